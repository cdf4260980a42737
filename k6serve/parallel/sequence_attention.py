"""Attention modules that replace a model's `InnerAttention` when its inputs are sequence-sharded.

* `ShardedAttention` (queries and K/V sharded, e.g. "video_self"): Ulysses, Ring, or Ulysses x Ring.
* `GatherKVAttention` (replicated queries, sharded K/V, e.g. "audio_from_video"): all-gather K/V first (one
  collective each, or both packed in one when they come from a fused projection), started when the model
  prepares the K/V (`prepare_key_value`) and awaited at the attention.

Both read the current cut of the sequence from a `ShardState` that the split hook of
`apply_sequence_parallel` sets once per forward, so every block reuses the same cut.

Both forwards run eagerly under `torch.compile` (`torch.compiler.disable`): a regionally compiled block breaks
its graph around the sharded attention instead of tracing process groups, async work handles and the shard state.

Shape legend: B batch, L local query length, S key length, H heads, D head dim, 2 the (key, value) slot.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import Tensor, nn

from k6serve.parallel.bit_copy import copy_bits_
from k6serve.parallel.ring import ring_attention
from k6serve.parallel.sequence import SequenceShard, start_gather_sequence
from k6serve.parallel.ulysses import (
    UlyssesExchange,
    attend_unpadded,
    default_overlap_chunks,
    finish_ulysses,
    overlap_chunks_from_environment,
    start_ulysses,
)

if TYPE_CHECKING:
    from k6serve.models.common.inner_attention import InnerAttention


@dataclasses.dataclass(eq=False)
class ShardState:
    """The cut of the sharded sequence for the forward in flight (set by the split hook)."""

    current: SequenceShard | None = None

    def require(self) -> SequenceShard:
        assert self.current is not None, "the sequence split hook must run before sharded attention"
        return self.current


class ShardedAttention(nn.Module):
    """Sequence-parallel replacement for an `InnerAttention` whose queries and K/V are both sharded.

    `overlap_chunks` is the number of head chunks the Ulysses exchange is pipelined in (see
    `k6serve.parallel.ulysses`); None takes $K6SERVE_ULYSSES_CHUNKS, else `default_overlap_chunks` of the local
    head count (1 when Ring is on: Ring overlaps its own communication, and chunks would run the ring once per
    chunk).
    """

    def __init__(
        self,
        inner: InnerAttention,
        *,
        ulysses_group: dist.ProcessGroup,
        ring_group: dist.ProcessGroup,
        state: ShardState,
        overlap_chunks: int | None = None,
    ):
        super().__init__()
        if overlap_chunks is not None and overlap_chunks < 1:
            raise ValueError(f"overlap_chunks must be a positive number of head chunks, got {overlap_chunks}")
        self.inner = inner
        self.role = inner.role
        self.ulysses_group = ulysses_group
        self.ring_group = ring_group
        self.state = state
        self.overlap_chunks = overlap_chunks if overlap_chunks is not None else overlap_chunks_from_environment()

    def num_chunks(self, num_heads: int) -> int:
        """The head chunks the Ulysses exchange of a `num_heads`-head attention is pipelined in."""
        if self.overlap_chunks is not None:
            return self.overlap_chunks
        if dist.get_world_size(self.ring_group) > 1:
            return 1
        return default_overlap_chunks(num_heads // dist.get_world_size(self.ulysses_group))

    @torch.compiler.disable
    def forward(
        self, query_BLHD: Tensor, key_BLHD: Tensor, value_BLHD: Tensor, key_mask_BS: Tensor | None = None
    ) -> Tensor:
        return self.attend_prepared_query_key_value(
            self.prepare_query_key_value(query_BLHD, key_BLHD, value_BLHD, key_mask_BS)
        )

    @torch.compiler.disable
    def prepare_query_key_value(
        self, query_BLHD: Tensor, key_BLHD: Tensor, value_BLHD: Tensor, key_mask_BS: Tensor | None = None
    ) -> _PreparedShardedAttention:
        """Post the Ulysses exchange of Q/K/V (when Ulysses is on); the model's work before
        `attend_prepared_query_key_value` runs beside it."""
        assert key_mask_BS is None, f"sharded attention '{self.role}' takes no key mask (padding is cut off)"
        shard = self.state.require()
        if dist.get_world_size(self.ulysses_group) == 1:
            return _PreparedShardedAttention(shard=shard, query_key_value=(query_BLHD, key_BLHD, value_BLHD))
        exchange = start_ulysses(query_BLHD, key_BLHD, value_BLHD, group=self.ulysses_group,
                                 num_chunks=self.num_chunks(query_BLHD.shape[2]))
        return _PreparedShardedAttention(shard=shard, exchange=exchange)

    @torch.compiler.disable
    def attend_prepared_query_key_value(self, prepared: _PreparedShardedAttention) -> Tensor:
        assert isinstance(prepared, _PreparedShardedAttention), f"'{self.role}' got Q/K/V it did not prepare"
        shard = prepared.shard
        num_ring = dist.get_world_size(self.ring_group)
        if num_ring == 1:
            attend = attend_unpadded(self.inner, shard.total_length)
        else:
            block = dist.get_world_size(self.ulysses_group)
            key_lengths = [shard.real_length(j, block=block) for j in range(num_ring)]

            def attend(query_BSHD: Tensor, key_BSHD: Tensor, value_BSHD: Tensor) -> Tensor:
                return ring_attention(
                    query_BSHD, key_BSHD, value_BSHD,
                    group=self.ring_group, key_lengths=key_lengths, backend=self.inner.backend,
                )

        if prepared.exchange is None:  # no Ulysses: the ring (or the plain core) sees this rank's shard
            assert prepared.query_key_value is not None  # a prepared attention holds one or the other
            return attend(*prepared.query_key_value)
        return finish_ulysses(prepared.exchange, attend)

    def extra_repr(self) -> str:
        return (f"role={self.role}, ulysses={dist.get_world_size(self.ulysses_group)}, "
                f"ring={dist.get_world_size(self.ring_group)}, overlap_chunks={self.overlap_chunks}")


class GatherKVAttention(nn.Module):
    """Replicated queries over sharded K/V: gather the full, unpadded K/V, then run the original attention.

    `prepare_key_value` starts the gather asynchronously (the model computes these K/V before the work that
    precedes their attention, see `Kandinsky6Attention.key_value`), and `attend_prepared` waits for it: the
    transfer runs beside that work instead of in front of the attention.
    """

    def __init__(self, inner: InnerAttention, *, sequence_group: dist.ProcessGroup, state: ShardState):
        super().__init__()
        self.inner = inner
        self.role = inner.role
        self.sequence_group = sequence_group
        self.state = state

    @torch.compiler.disable
    def forward(
        self, query_BLHD: Tensor, key_BSHD: Tensor, value_BSHD: Tensor, key_mask_BS: Tensor | None = None
    ) -> Tensor:
        return self.attend_prepared(query_BLHD, self.prepare_key_value(key_BSHD, value_BSHD), key_mask_BS)

    @torch.compiler.disable
    def prepare_key_value(self, key_BSHD: Tensor, value_BSHD: Tensor) -> _GatheringKeyValue:
        shard = self.state.require()
        assert key_BSHD.shape == value_BSHD.shape and key_BSHD.dtype == value_BSHD.dtype, (
            "K and V are gathered alike")
        if key_BSHD.is_contiguous() and value_BSHD.is_contiguous():
            # Separate projections: two collectives straight from the tensors, no packing copy on the compute
            # stream (both run on the communication stream beside the model's work).
            return _GatheringKeyValue(
                key=start_gather_sequence(key_BSHD, 1, shard, self.sequence_group),
                value=start_gather_sequence(value_BSHD, 1, shard, self.sequence_group),
            )
        # Fused K/V projection (V a strided view): one collective for both; for B == 1 both come back as strided
        # views of the gathered buffer. The two packing copies move 8-byte words (`copy_bits_`): torch.stack fell
        # back to its non-vectorised kernel on the strided V (26.7 ms per Pro step in the H200 profile of
        # 2026-11-30).
        key_value_BS2HD = key_BSHD.new_empty((*key_BSHD.shape[:2], 2, *key_BSHD.shape[2:]))
        copy_bits_(key_value_BS2HD[:, :, 0], key_BSHD)
        copy_bits_(key_value_BS2HD[:, :, 1], value_BSHD)
        return _GatheringKeyValue(packed=start_gather_sequence(key_value_BS2HD, 1, shard, self.sequence_group))

    @torch.compiler.disable
    def attend_prepared(
        self, query_BLHD: Tensor, prepared: _GatheringKeyValue, key_mask_BS: Tensor | None = None
    ) -> Tensor:
        assert key_mask_BS is None, f"'{self.role}' attends to sharded keys and takes no key mask"
        assert isinstance(prepared, _GatheringKeyValue), f"'{self.role}' got K/V it did not prepare"
        return self.inner(query_BLHD, *prepared.finish())

    def extra_repr(self) -> str:
        return f"role={self.role}"


@dataclasses.dataclass(eq=False, kw_only=True)
class _GatheringKeyValue:
    """K/V whose all-gather is in flight: `packed` (K and V stacked on dim 2, one collective) or `key` and
    `value` (one collective each). `finish()` waits for them, once, and gives (K, V)."""

    packed: Callable[[], Tensor] | None = None
    key: Callable[[], Tensor] | None = None
    value: Callable[[], Tensor] | None = None
    done: bool = False

    def finish(self) -> tuple[Tensor, Tensor]:
        assert not self.done, "prepared K/V are attended to once"
        self.done = True
        if self.packed is not None:
            key_value_BS2HD = self.packed()
            return key_value_BS2HD[:, :, 0], key_value_BS2HD[:, :, 1]
        assert self.key is not None and self.value is not None
        return self.key(), self.value()


@dataclasses.dataclass(eq=False, kw_only=True)
class _PreparedShardedAttention:
    """Q/K/V handed to a `ShardedAttention`: the Ulysses exchange in flight, or (no Ulysses) the local Q/K/V."""

    shard: SequenceShard
    exchange: UlyssesExchange | None = None
    query_key_value: tuple[Tensor, Tensor, Tensor] | None = None
