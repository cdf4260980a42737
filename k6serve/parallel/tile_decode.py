"""Whole-tile parallel decode for super-resolution: tiles are decoded round-robin over the replica's ranks; and the
choice between it and the spatial-shard decode (parallel/spatial_shard_decode.py) from the seed's flags.

Rank r decodes tiles r, r + W, r + 2W, ... (W ranks); after each round the decoded tiles are all-gathered and
kept in tile order, so every rank holds every tile and the blending that follows runs unchanged. Each tile is
an independent decode with its own temporal cache chain, so the tiles (and the blended frames) equal a serial
decode bit for bit on the same hardware. Fewer tiles than ranks: serial, replicated (nothing to distribute).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import Tensor

from k6serve.rank_logging import ONCE

logger = logging.getLogger(__name__)

WHOLE_TILE, SPATIAL_SHARD, SERIAL = "whole_tile", "spatial_shard", "serial"


def sr_decode_mode(runtime, *, replica_size: int, super_resolution: bool) -> str:
    """The SR decode the seed's `--vae-config.*` flags choose on a replica of `replica_size` ranks: "serial" (one
    GPU, or a generation model: nothing to choose, as in the reference), "spatial_shard" (each tile's height split
    across the ranks, parallel/spatial_shard_decode.py; it takes precedence, as in the reference) or "whole_tile"
    (the default of a multi-GPU SR replica, bitwise equal to serial; `use-parallel-tiling false`, every GPU decoding
    every tile in the reference, gives the same frames and is taken as whole_tile with a warning)."""
    if not super_resolution or replica_size == 1:
        given = _given_decode_flags(runtime)
        if given:
            # As in the reference, nothing to choose here; but a flag typed for this run is said to do nothing.
            where = "a generation model" if not super_resolution else "one GPU per replica"
            one = len(given) == 1
            logger.warning("%s only %s how super-resolution tiles are decoded across a replica's GPUs; with %s %s "
                           "nothing (ignored).", " and ".join(given), "chooses" if one else "choose", where,
                           "it does" if one else "they do", extra=ONCE)
        return SERIAL
    if runtime.vae_parallel_decode_mode == SPATIAL_SHARD:
        if runtime.vae_parallel_decode:
            return SPATIAL_SHARD
        if runtime.vae_parallel_decode is None:
            # The reference selects it only together with use-parallel-decode true, and otherwise decodes bit for bit
            # like serial; named alone it is not taken silently either way, since it changes the rounding.
            raise ValueError(
                "--vae-config.parallel-decode-mode spatial_shard is selected together with "
                "--vae-config.use-parallel-decode true (each tile's height split across the GPUs: less memory and "
                "time per tile, frames differ from serial decode by rounding). Add that flag, or drop the mode to "
                "decode whole tiles in parallel, bitwise equal to serial.")
    if runtime.vae_parallel_tiling is False:
        # The reference's choice, every rank decoding every tile, has the frames of the whole-tile decode bit for bit,
        # so it is accepted and decoded that way, in less time: it was refused, and the reference's command lines
        # failed here. (Serial on several ranks is not offered: the leader streams its decode into the MP4 and the
        # others do not, so their cancellation checks, each a collective, would not pair up.)
        logger.warning("--vae-config.use-parallel-tiling false (every GPU decoding every tile) is taken as the "
                       "parallel whole-tile decode: the same frames bit for bit, in about 1/%d of the decode time "
                       "across this replica's GPUs.", replica_size, extra=ONCE)
    return WHOLE_TILE


def _given_decode_flags(runtime) -> list[str]:
    """The seed's `--vae-config.*` flags given, as written."""
    values = (("--vae-config.use-parallel-tiling", runtime.vae_parallel_tiling),
              ("--vae-config.use-parallel-decode", runtime.vae_parallel_decode),
              ("--vae-config.parallel-decode-mode", runtime.vae_parallel_decode_mode))
    return [f"{flag} {str(value).lower()}" for flag, value in values if value is not None]


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
