"""Ulysses sequence parallelism: all-to-all from sequence shards to head shards and back.

Each rank holds L/N tokens of all H heads; after `sequence_to_heads` it holds all L tokens of H/N heads,
runs ordinary attention on them, and `heads_to_sequence` returns its tokens. Attention per head sees exactly
the keys of the single-device run, so the output is bitwise equal to it.

Shape legend: B batch, L local (sharded) length, S full length (N x L), H heads, h = H / N local heads,
D head dim, N group size.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

Attend = Callable[[Tensor, Tensor, Tensor], Tensor]


def sequence_to_heads(x_BLHD: Tensor, group: dist.ProcessGroup) -> Tensor:
    """(B, L, H, D) sequence shard -> (B, N*L, H/N, D) head shard, sequence in rank order."""
    num_ranks = dist.get_world_size(group)
    batch, length, num_heads, head_dim = x_BLHD.shape
    assert num_heads % num_ranks == 0, (num_heads, num_ranks)
    local_heads = num_heads // num_ranks
    send_NBLhD = x_BLHD.reshape(batch, length, num_ranks, local_heads, head_dim).permute(2, 0, 1, 3, 4)
    send_NBLhD = send_NBLhD.contiguous()
    received_NBLhD = torch.empty_like(send_NBLhD)
    dist.all_to_all_single(received_NBLhD, send_NBLhD, group=group)
    return received_NBLhD.permute(1, 0, 2, 3, 4).reshape(batch, num_ranks * length, local_heads, head_dim)


def heads_to_sequence(x_BShD: Tensor, group: dist.ProcessGroup) -> Tensor:
    """(B, N*L, h, D) head shard -> (B, L, N*h, D) sequence shard: the inverse of `sequence_to_heads`."""
    num_ranks = dist.get_world_size(group)
    batch, full_length, local_heads, head_dim = x_BShD.shape
    assert full_length % num_ranks == 0, (full_length, num_ranks)
    length = full_length // num_ranks
    send_NBLhD = x_BShD.reshape(batch, num_ranks, length, local_heads, head_dim).permute(1, 0, 2, 3, 4)
    send_NBLhD = send_NBLhD.contiguous()
    received_NBLhD = torch.empty_like(send_NBLhD)
    dist.all_to_all_single(received_NBLhD, send_NBLhD, group=group)
    return received_NBLhD.permute(1, 2, 0, 3, 4).reshape(batch, length, num_ranks * local_heads, head_dim)


def ulysses_attention(
    query_BLHD: Tensor, key_BLHD: Tensor, value_BLHD: Tensor, *, group: dist.ProcessGroup, attend: Attend
) -> Tensor:
    """Exchange to head shards, `attend` over the whole (padded) sequence, exchange back."""
    if dist.get_world_size(group) == 1:
        return attend(query_BLHD, key_BLHD, value_BLHD)
    query_BShD, key_BShD, value_BShD = (sequence_to_heads(x, group) for x in (query_BLHD, key_BLHD, value_BLHD))
    return heads_to_sequence(attend(query_BShD, key_BShD, value_BShD), group)


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
