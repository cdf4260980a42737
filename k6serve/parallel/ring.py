"""Ring attention: K/V shards rotate around the ring group; partial results merge by log-sum-exp.

Each rank keeps its query shard and, over N steps, attends to every rank's K/V shard as it passes by
(send to the next rank, receive from the previous one, overlapped with the attention of the current block).
The merge is exact in real arithmetic but reorders the softmax sums, so the output differs from the
single-device run by rounding (tested within 1e-5 relative in fp32). Ring rotates whole K/V shards, so it
imposes no head-count constraint.

Shape legend: B batch, L local query length, S key length of one block, H heads, D head dim.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from k6serve.ops.attention import attention_with_lse


def _rotate(tensors: list[Tensor], group: dist.ProcessGroup) -> tuple[list[Tensor], list[dist.Work]]:
    """Start sending `tensors` to the next rank of the ring and receiving the previous rank's."""
    rank, num_ranks = dist.get_rank(group), dist.get_world_size(group)
    next_rank = dist.get_global_rank(group, (rank + 1) % num_ranks)
    previous_rank = dist.get_global_rank(group, (rank - 1) % num_ranks)
    received = [torch.empty_like(t) for t in tensors]
    operations = [dist.P2POp(dist.isend, t, next_rank, group) for t in tensors]
    operations += [dist.P2POp(dist.irecv, t, previous_rank, group) for t in received]
    return received, dist.batch_isend_irecv(operations)


def merge_partial(
    out_BLHD: Tensor | None, lse_BHL: Tensor | None, block_out_BLHD: Tensor, block_lse_BHL: Tensor
) -> tuple[Tensor, Tensor]:
    """Combine two softmax-normalised partial attentions over disjoint key sets (fp32)."""
    block_out_BLHD = block_out_BLHD.float()
    if out_BLHD is None:
        return block_out_BLHD, block_lse_BHL
    if lse_BHL is None:
        raise ValueError("merge_partial: a partial attention needs its log-sum-exp")
    merged_lse_BHL = torch.logaddexp(lse_BHL, block_lse_BHL)
    weight_BLH1 = torch.exp(lse_BHL - merged_lse_BHL).transpose(1, 2)[..., None]
    block_weight_BLH1 = torch.exp(block_lse_BHL - merged_lse_BHL).transpose(1, 2)[..., None]
    return out_BLHD * weight_BLH1 + block_out_BLHD * block_weight_BLH1, merged_lse_BHL


def ring_attention(
    query_BLHD: Tensor,
    key_BSHD: Tensor,
    value_BSHD: Tensor,
    *,
    group: dist.ProcessGroup,
    key_lengths: Sequence[int],
    backend: str,
) -> Tensor:
    """Attention of the local queries over the K/V blocks of every ring rank.

    `key_lengths[j]` is the number of real (unpadded) keys in ring rank j's block; padded keys are cut off
    and an all-padding block is skipped. Returns (B, L, H, D) in the query dtype.
    """
    rank, num_ranks = dist.get_rank(group), dist.get_world_size(group)
    assert len(key_lengths) == num_ranks and sum(key_lengths) > 0, key_lengths
    out_BLHD = lse_BHL = None
    kv = [key_BSHD.contiguous(), value_BSHD.contiguous()]
    for step in range(num_ranks):
        pending = _rotate(kv, group) if step + 1 < num_ranks else None
        owner = (rank - step) % num_ranks
        num_keys = key_lengths[owner]
        if num_keys > 0:
            block_out_BLHD, block_lse_BHL = attention_with_lse(
                query_BLHD, kv[0][:, :num_keys], kv[1][:, :num_keys], backend=backend
            )
            out_BLHD, lse_BHL = merge_partial(out_BLHD, lse_BHL, block_out_BLHD, block_lse_BHL)
        if pending is not None:
            kv, works = pending
            for work in works:
                work.wait()
    assert out_BLHD is not None
    return out_BLHD.to(query_BLHD.dtype)
