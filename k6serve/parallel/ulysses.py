"""Ulysses sequence parallelism: all-to-all from sequence shards to head shards and back.

Each rank holds L/N tokens of all H heads; after the input exchange it holds all N*L tokens of H/N heads,
runs ordinary attention on them, and the output exchange returns its tokens. Attention per head sees exactly
the keys of the single-device run, so the output is bitwise equal to it.

The exchange is split in two calls, `start_ulysses` (post the Q/K/V exchange) and `finish_ulysses` (attend and
exchange back), so the model can queue independent work in between: the K6 DiT runs its audio self-attention
there (`ShardedAttention.prepare_query_key_value` / `attend_prepared_query_key_value`).

Communication is cut and hidden two ways:
* Q, K and V travel in one all-to-all. The permute copy that every exchange needs writes the three tensors
  interleaved per token into one send buffer (N, B, L, 3, h, D), so on the receiving side Q, K and V are
  strided views of the received buffer with no copy when B == 1 (flash-attn's "qkv-packed" layout; attention
  kernels take it as is). The permute copies move 8-byte words (`copy_bits_`), not bf16 elements.
* Head-chunk pipelining (opt-in, off by default: see `default_overlap_chunks`). The h local heads are split
  into `num_chunks` groups; the input exchanges of all chunks are posted asynchronously up front, chunk c's
  attention runs while the later chunks' exchanges are in flight, and chunk c's output exchange is posted as
  soon as its attention ends. Attention of one head never reads another, so every chunk count gives the same
  bits.

The chunk count: `ShardedAttention(..., overlap_chunks=n)`, else the environment variable
`K6SERVE_ULYSSES_CHUNKS=n` (read when each `ShardedAttention` is built, so set it before launching; it exists
to compare chunk counts in benchmarks without code edits), else `default_overlap_chunks(local_heads)`.

Shape legend: B batch, L local (sharded) length, S full length (N x L), H heads, h = H / N local heads,
C chunks, c = h / C heads per chunk, D head dim, N group size, 3 the (query, key, value) slot.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from k6serve.parallel.bit_copy import copy_bits_

Attend = Callable[[Tensor, Tensor, Tensor], Tensor]
CHUNKS_ENVIRONMENT_VARIABLE = "K6SERVE_ULYSSES_CHUNKS"


def default_overlap_chunks(local_heads: int) -> int:
    """1: no head-chunk pipelining unless asked for ($K6SERVE_ULYSSES_CHUNKS or `overlap_chunks=`).

    Measured on two NVLink H200s (docs/benchmarks.md, 2026-11-30, Pro-distill Ulysses2 step speed-up): eager
    1.81x with 1 chunk against 1.69x with 2; compiled 1.79x against 1.60x. The NCCL all-to-all kernels need SMs
    and do not overlap FlashAttention-3 (a persistent kernel that holds every SM); NCCL's copy-engine path frees
    the SMs but moves only 61 GB/s. So the default is the unchunked exchange. `local_heads` stays in the
    signature so a measured rule (e.g. chunking only with a non-persistent attention kernel) can use it.
    """
    del local_heads
    return 1


def overlap_chunks_from_environment() -> int | None:
    """The chunk count set by $K6SERVE_ULYSSES_CHUNKS, or None when it is unset or empty."""
    text = os.environ.get(CHUNKS_ENVIRONMENT_VARIABLE, "").strip()
    if not text:
        return None
    if not text.isdigit() or int(text) < 1:
        raise ValueError(
            f"{CHUNKS_ENVIRONMENT_VARIABLE}={text!r} is not a positive integer; set it to the number of head "
            f"chunks to pipeline (e.g. 1 or 2) or unset it for the default"
        )
    return int(text)


def _check_chunks(num_chunks: int, local_heads: int) -> None:
    if num_chunks < 1 or local_heads % num_chunks:
        divisors = [d for d in range(1, local_heads + 1) if local_heads % d == 0]
        raise ValueError(
            f"Ulysses overlap chunks {num_chunks} must divide the {local_heads} heads each rank attends to; "
            f"use one of {divisors} (overlap_chunks= or ${CHUNKS_ENVIRONMENT_VARIABLE})"
        )


def _post_input_exchange(
    sources_BLNCcD: list[Tensor], chunk: int, send_CNBL3cD: Tensor, received_CNBL3cD: Tensor,
    group: dist.ProcessGroup,
) -> dist.Work:
    """Copy chunk `chunk` of Q, K and V into its send slab (head group n goes to rank n) and post one all-to-all."""
    for slot, source_BLNCcD in enumerate(sources_BLNCcD):
        copy_bits_(send_CNBL3cD[chunk, :, :, :, slot], source_BLNCcD[:, :, :, chunk].permute(2, 0, 1, 3, 4))
    return dist.all_to_all_single(received_CNBL3cD[chunk], send_CNBL3cD[chunk], group=group, async_op=True)


def _received_heads(received_NBL3cD: Tensor, slot: int) -> Tensor:
    """(B, N*L, c, D) sequence of Q, K or V from one chunk's received slab; a view when B == 1."""
    num_ranks, batch, length, _, chunk_heads, head_dim = received_NBL3cD.shape
    return received_NBL3cD[:, :, :, slot].transpose(0, 1).reshape(batch, num_ranks * length, chunk_heads, head_dim)


@dataclasses.dataclass(eq=False)
class UlyssesExchange:
    """The input exchange of one Ulysses attention, posted by `start_ulysses` and completed by `finish_ulysses`.

    Holds the send and receive buffers until their exchanges are waited on (NCCL reads/writes them on its stream).
    """

    input_works: list
    send_CNBL3cD: Tensor
    received_CNBL3cD: Tensor
    group: dist.ProcessGroup
    shape_BLHD: tuple[int, int, int, int]
    num_chunks: int
    done: bool = False


@torch.compiler.disable  # async collectives: a compiled block breaks its graph here instead of tracing them
def start_ulysses(
    query_BLHD: Tensor, key_BLHD: Tensor, value_BLHD: Tensor, *, group: dist.ProcessGroup, num_chunks: int = 1
) -> UlyssesExchange:
    """Post the exchange of Q, K and V from sequence shards to head shards (one all-to-all per head chunk); work
    the caller queues before `finish_ulysses` runs beside it."""
    num_ranks = dist.get_world_size(group)
    batch, length, num_heads, head_dim = query_BLHD.shape
    assert num_heads % num_ranks == 0, (num_heads, num_ranks)
    local_heads = num_heads // num_ranks
    _check_chunks(num_chunks, local_heads)
    chunk_heads = local_heads // num_chunks
    # Global head n*h + k*c + j is head j of chunk k on rank n.
    sources_BLNCcD = [x.unflatten(2, (num_ranks, num_chunks, chunk_heads)) for x in (query_BLHD, key_BLHD, value_BLHD)]
    send_CNBL3cD = query_BLHD.new_empty(num_chunks, num_ranks, batch, length, 3, chunk_heads, head_dim)
    received_CNBL3cD = torch.empty_like(send_CNBL3cD)
    input_works = [
        _post_input_exchange(sources_BLNCcD, chunk, send_CNBL3cD, received_CNBL3cD, group)
        for chunk in range(num_chunks)
    ]
    return UlyssesExchange(input_works=input_works, send_CNBL3cD=send_CNBL3cD, received_CNBL3cD=received_CNBL3cD,
                           group=group, shape_BLHD=(batch, length, num_heads, head_dim), num_chunks=num_chunks)


@torch.compiler.disable
def finish_ulysses(exchange: UlyssesExchange, attend: Attend) -> Tensor:
    """Wait for each chunk's input exchange, `attend` over the whole (padded) sequence, exchange back; (B, L, H, D)."""
    assert not exchange.done, "a Ulysses exchange is finished once"
    exchange.done = True
    group, num_chunks = exchange.group, exchange.num_chunks
    batch, length, num_heads, head_dim = exchange.shape_BLHD
    num_ranks = dist.get_world_size(group)
    chunk_heads = num_heads // num_ranks // num_chunks
    output_exchanges: list[tuple[dist.Work, Tensor, Tensor]] = []
    for chunk in range(num_chunks):
        exchange.input_works[chunk].wait()
        out_BScD = attend(*(_received_heads(exchange.received_CNBL3cD[chunk], slot) for slot in range(3)))
        send_NBLcD = out_BScD.reshape(batch, num_ranks, length, chunk_heads, head_dim).transpose(0, 1).contiguous()
        received_NBLcD = torch.empty_like(send_NBLcD)
        work = dist.all_to_all_single(received_NBLcD, send_NBLcD, group=group, async_op=True)
        output_exchanges.append((work, send_NBLcD, received_NBLcD))
    out_BLNCcD = exchange.send_CNBL3cD.new_empty(batch, length, num_ranks, num_chunks, chunk_heads, head_dim)
    for chunk, (work, _, received_NBLcD) in enumerate(output_exchanges):
        work.wait()
        copy_bits_(out_BLNCcD[:, :, :, chunk], received_NBLcD.permute(1, 2, 0, 3, 4))
    return out_BLNCcD.view(batch, length, num_heads, head_dim)


def attend_unpadded(attend: Attend, num_real: int) -> Attend:
    """Wrap `attend` so it runs on the first `num_real` tokens only; padded query rows come back as zeros.

    Removing the padded keys (instead of masking them) keeps the kernel call identical to the single-device
    one, which is what makes Ulysses bitwise exact.
    """

    def run(query_BSHD: Tensor, key_BSHD: Tensor, value_BSHD: Tensor) -> Tensor:
        num_pad = query_BSHD.shape[1] - num_real
        if num_pad == 0:
            return attend(query_BSHD, key_BSHD, value_BSHD)
        out_BSHD = attend(query_BSHD[:, :num_real], key_BSHD[:, :num_real], value_BSHD[:, :num_real])
        return F.pad(out_BSHD, (0, 0, 0, 0, 0, num_pad))

    return run
