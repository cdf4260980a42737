"""Whole-tile parallel decode for super-resolution: tiles are decoded round-robin over the replica's ranks.

Rank r decodes tiles r, r + W, r + 2W, ... (W ranks); after each round the decoded tiles are all-gathered and
kept in tile order, so every rank holds every tile and the blending that follows runs unchanged. Each tile is
an independent decode with its own temporal cache chain, so the tiles (and the blended frames) equal a serial
decode bit for bit on the same hardware. Fewer tiles than ranks: serial, replicated (nothing to distribute).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import Tensor


def check_decode_flags(runtime, *, replica_size: int, super_resolution: bool) -> None:
    """Refuse the seed's `--vae-config.*` decode choices that this decode does not make, where they would matter (an
    SR model on a replica of several GPUs); elsewhere they choose nothing, as in the reference (one GPU keeps the
    replicated decode, and the generation VAE decodes replicated)."""
    if not super_resolution or replica_size == 1:
        return
    # spatial_shard is refused even without use-parallel-decode true (which the reference needs to select it): a
    # user who names it wants it, and would otherwise get whole tiles without a word.
    if runtime.vae_parallel_decode_mode == "spatial_shard" and runtime.vae_parallel_decode is not False:
        raise ValueError(
            "--vae-config.parallel-decode-mode spatial_shard (each tile's height split across GPUs, which changes "
            "the rounding) is not available in k6serve. A multi-GPU replica decodes whole tiles in parallel, equal "
            "to the serial decode bit for bit: drop --vae-config.parallel-decode-mode (or give it whole_tile).")
    if runtime.vae_parallel_tiling is False:
        raise ValueError(
            "--vae-config.use-parallel-tiling false asks every GPU to decode every tile; k6serve decodes whole tiles "
            "in parallel on a multi-GPU replica, and that equals the serial decode bit for bit, so it only saves "
            "time. Drop the flag (or set it true).")


# Where `attach_decode_group` records the group on a VAE wrapper (as the cfg group is kept on the DiT).
_DECODE_GROUP_ATTRIBUTE = "_k6serve_decode_group"


def attach_decode_group(vae: object, group: dist.ProcessGroup) -> None:
    """Make the SR pipeline decode `vae`'s tiles across the ranks of `group`."""
    setattr(vae, _DECODE_GROUP_ATTRIBUTE, group)


def decode_group_of(vae: object) -> dist.ProcessGroup | None:
    group = getattr(vae, _DECODE_GROUP_ATTRIBUTE, None)
    return group if group is not None and dist.get_world_size(group) > 1 else None


def decode_round_robin(decode_one: Callable[[int], Tensor], num_tiles: int,
                       group: dist.ProcessGroup | None) -> list[Tensor]:
    """`[decode_one(i) for i in range(num_tiles)]`, computed round-robin over `group` when that pays."""
    world = dist.get_world_size(group) if group is not None else 1
    if world == 1 or num_tiles < world:
        return [decode_one(index) for index in range(num_tiles)]
    rank = dist.get_rank(group)
    tiles: list[Tensor] = []
    template: Tensor | None = None  # every tile of a grid decodes to the same shape
    for start in range(0, num_tiles, world):
        index = start + rank
        if index < num_tiles:
            local = decode_one(index).contiguous()
            template = local
        else:  # the last round has fewer tiles than ranks: this rank contributes a placeholder
            assert template is not None  # the first round decoded one tile on every rank
            local = torch.empty_like(template)
        gathered = [torch.empty_like(local) for _ in range(world)]
        dist.all_gather(gathered, local, group=group)
        tiles.extend(gathered[: min(world, num_tiles - start)])
    return tiles
