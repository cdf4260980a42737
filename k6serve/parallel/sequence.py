"""How a sequence is cut across sequence-parallel ranks: pad to a multiple of the degree, split, gather back.

The sequence is padded at its end, so every shard has the same length and only the last shard(s) hold
padding. Attention never lets a padded key contribute: Ulysses strips the padding from the gathered
sequence before attention, Ring drops the padded keys of each rotated block (see `real_length`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class SequenceShard:
    """The cut of a `total_length` sequence into `degree` equal shards; `index` is this rank's shard."""

    total_length: int
    degree: int
    index: int

    def __post_init__(self) -> None:
        assert self.total_length >= 1 and 0 <= self.index < self.degree, self

    @property
    def local_length(self) -> int:
        return -(-self.total_length // self.degree)

    @property
    def padded_length(self) -> int:
        return self.local_length * self.degree

    def real_length(self, index: int, *, block: int = 1) -> int:
        """Unpadded tokens in shard `index`, or in block `index` of `block` consecutive shards."""
        length = self.local_length * block
        return max(0, min(length, self.total_length - index * length))


def pad_sequence(x: Tensor, dim: int, padded_length: int, *, mode: str = "zeros") -> Tensor:
    """Pad `x` along `dim` at the end; "edge" repeats the last row (RoPE tables), "zeros" fills 0."""
    num_pad = padded_length - x.shape[dim]
    assert num_pad >= 0, (x.shape, dim, padded_length)
    if num_pad == 0:
        return x
    if mode == "edge":
        last = x.narrow(dim, x.shape[dim] - 1, 1)
        return torch.cat([x, last.expand(*[num_pad if d == dim % x.dim() else -1 for d in range(x.dim())])], dim)
    assert mode == "zeros", mode
    pad = [0, 0] * (x.dim() - 1 - dim % x.dim()) + [0, num_pad]
    return F.pad(x, pad)


def shard_sequence(x: Tensor, dim: int, shard: SequenceShard, *, mode: str = "zeros") -> Tensor:
    """This rank's shard of the full sequence `x` (padded first)."""
    padded = pad_sequence(x, dim, shard.padded_length, mode=mode)
    return padded.narrow(dim, shard.index * shard.local_length, shard.local_length)


# torch 2.13 renamed `all_gather_into_tensor` to `all_gather_single` (the old name warns); torch 2.11 has only the old.
_all_gather_into_tensor = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


@torch.compiler.disable  # a collective: a compiled region breaks its graph here instead of tracing it
def gather_sequence(x_local: Tensor, dim: int, shard: SequenceShard, group: dist.ProcessGroup) -> Tensor:
    """The full, unpadded sequence from every rank's shard (ranks of `group` ordered by shard index).

    One collective into one buffer, the rank-major stack of the shards. When every dim before `dim` has size 1
    (B == 1 for the usual (B, L, ...) along dim 1) that stack already is the sequence, so the result is a view
    of it; otherwise one copy puts the shards in place (the cost of the concatenation it replaces).
    """
    return start_gather_sequence(x_local, dim, shard, group)()


@torch.compiler.disable
def start_gather_sequence(
    x_local: Tensor, dim: int, shard: SequenceShard, group: dist.ProcessGroup
) -> Callable[[], Tensor]:
    """`gather_sequence` started asynchronously: the collective runs on the communication stream while the caller
    queues other work; the returned function waits for it and gives the gathered sequence. Call it exactly once.
    """
    dim = dim % x_local.dim()
    x_local = x_local.contiguous()
    # The concatenated output form (N * x.shape[0], ...) is the one gloo supports too (NCCL takes both).
    gathered = x_local.new_empty((shard.degree * x_local.shape[0], *x_local.shape[1:]))
    work = _all_gather_into_tensor(gathered, x_local, group=group, async_op=True)

    def finish() -> Tensor:
        work.wait()  # also keeps x_local and gathered alive until the collective is done with them
        stacked = gathered.view(shard.degree, *x_local.shape).movedim(0, dim)
        return stacked.flatten(dim, dim + 1).narrow(dim, 0, shard.total_length)

    return finish
