"""Stage: the SR decode and blend. Each tile's latent decoded by the causal K-VAE, then the tiles Hann-blended,
cropped and resized to the delivery size (k6-super-resolution.md §2.10-2.12); whole, or streamed segment by segment
so the MP4 encoder runs beside the decode; on a multi-GPU replica whole tiles round-robin or each tile's rows split
across the ranks (`k6serve.parallel.tile_decode`, `k6serve.parallel.spatial_shard_decode`).

Frames are uint8 (T, 3, H, W) tensors; latents are (T', h, w, C) channels-last per tile, as the DiT leaves them.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Generator, Iterator, Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor

from k6serve.parallel.spatial_shard_decode import iter_decode_tile_sharded, spatial_shard_of
from k6serve.parallel.tile_decode import decode_group_of, decode_round_robin
from k6serve.pipelines.decode_stream import ChunkCheck, start_host_copy
from k6serve.pipelines.sr_plan import UpscalePlan
from k6serve.pipelines.sr_tiling import blend_tiles, resize_frames

if TYPE_CHECKING:  # annotations only: the server plans an upscale's tiles (`plan_upscale`) without the models
    from k6serve.models.kandinsky6_sr.vae import SRVAE

logger = logging.getLogger(__name__)


def decode_tiles(vae: SRVAE, latents_ThwC: Sequence[Tensor], between_tiles: ChunkCheck | None = None) -> list[Tensor]:
    """Each tile decoded on its own, with a fresh temporal cache chain -> uint8 (T, 3, H, W), truncated.

    On a multi-GPU replica the tiles are decoded round-robin across its ranks (whole-tile parallel decode,
    bitwise equal to serial; `k6serve.parallel.tile_decode`). `between_tiles()` (the cancellation point) runs
    after each batch of `_decode_batches`: one tile on one rank, one round of tiles on several, so every rank of
    the replica makes the same calls whether it streams the result or not. (A spatial-shard replica decodes
    through `decode_and_assemble_chunks`, on every rank.)
    """

    def decode_one(index: int) -> Tensor:
        return vae.decode_tile(latents_ThwC[index].permute(3, 0, 1, 2).unsqueeze(0))[0]

    if spatial_shard_of(vae) is not None:
        # One decode order for every rank of such a replica, with or without a sink: a rank decoding here while
        # another streams would make other collectives.
        raise RuntimeError("a spatial-shard replica decodes through decode_and_assemble_chunks")

    group = decode_group_of(vae)
    num_ranks = dist.get_world_size(group) if group is not None else 1
    tiles: list[Tensor] = []
    for batch in _decode_batches(len(latents_ThwC), num_ranks):
        def decode_in_batch(index: int, start: int = batch.start) -> Tensor:
            return decode_one(start + index)

        tiles.extend(decode_round_robin(decode_in_batch, len(batch), group))
        if between_tiles is not None:
            between_tiles()
    return tiles


def _decode_batches(num_tiles: int, num_ranks: int) -> list[range]:
    """The tile ranges `decode_tiles` decodes between two cancellation points: rounds of `num_ranks` tiles.

    A last round of fewer tiles than ranks joins the round before it: alone, `decode_round_robin` would decode
    it on every rank (fewer tiles than ranks is its serial case) instead of spreading it.
    """
    starts = list(range(0, num_tiles, num_ranks))
    if num_tiles % num_ranks and len(starts) > 1:
        starts.pop()
    return [range(start, stop) for start, stop in zip(starts, [*starts[1:], num_tiles], strict=True)]


def assemble_frames(tiles_TCHW: Sequence[Tensor], plan: UpscalePlan) -> np.ndarray:
    """Hann-blend the tiles, crop the padding, downscale to the delivery size -> uint8 (T, H, W, 3) on the CPU."""
    return _assemble_on_device(tiles_TCHW, plan).cpu().numpy()


def _assemble_on_device(tiles_TCHW: Sequence[Tensor], plan: UpscalePlan) -> Tensor:
    frames_TCHW = blend_tiles(tiles_TCHW, plan.grid)
    crop_height, crop_width = plan.crop_size
    frames_TCHW = frames_TCHW[..., :crop_height, :crop_width]
    frames_TCHW = resize_frames(frames_TCHW, plan.delivery_size)
    return frames_TCHW.permute(0, 2, 3, 1).contiguous()


def decode_and_assemble_chunks(vae: SRVAE, latents_ThwC: Sequence[Tensor], plan: UpscalePlan,
                               between_chunks: ChunkCheck | None = None) -> Iterator[np.ndarray]:
    """`assemble_frames(decode_tiles(vae, latents_ThwC), plan)` as uint8 (T_i, H, W, 3) chunks, one per causal
    decode segment (17, 16, ... frames); the chunks concatenate to exactly that array.

    Segment-major order, when the memory allows it: every tile keeps its own causal cache chain and decodes its segments
    in order, as `SRVAE.decode_tile` does, but the tiles take turns per segment, so the frames of a segment are final
    once every tile has decoded it and the MP4 encoder runs beside the rest of the decode. Blend, crop and resize
    compute each frame from that frame alone (the frame chunks of `blend_tiles` / `resize_frames` bound memory, they do
    not mix frames), so blending a segment's frames gives the same bytes as blending the whole clip. The price is every
    tile's cache chain (the last input frames of each causal convolution; a helper's estimate from the released K-VAE
    config is ~1.9 GiB per 512x768 tile, not measured on a GPU) alive at once, so on CUDA the first segment's memory is
    measured and, when `num_tiles` of them would not fit (`_segment_major_fits`), the tiles are decoded whole, one cache
    at a time, and only the blend is streamed. Chunk i is handed out after chunk i + 1 is queued, so on a GPU its host
    copy and the caller's work on it overlap the next one's computation.

    A multi-GPU replica decodes whole tiles round-robin across its ranks (`decode_tiles`): that happens here,
    before anything is returned, so every rank joins the collectives even if the caller never reads a chunk, and
    `between_chunks()` runs at `decode_tiles`' points, which the ranks that call `decode_tiles` directly share.
    Otherwise it runs after each segment, in either order. The spatial-shard decode streams like one rank: each
    rank decodes its rows of every tile segment by segment, the segments are gathered whole on every rank, and the
    ranks agree on the order, so they make the same collectives and `between_chunks()` calls.
    """
    if decode_group_of(vae) is not None:
        return iter([assemble_frames(decode_tiles(vae, latents_ThwC, between_chunks), plan)])
    chunks = _decode_and_assemble_locally(vae, latents_ThwC, plan, between_chunks)
    if spatial_shard_of(vae) is not None:
        # Started here, so that however early the caller stops, closing it makes this rank's share of the
        # replica's collectives (a generator closed before its first step would run none).
        return _StartedChunks(chunks)
    return chunks


class _StartedChunks:
    """`chunks` (a generator) advanced to its first chunk now; iterates as `chunks` would and closes it."""

    def __init__(self, chunks: Generator[np.ndarray, None, None]) -> None:
        self._chunks = chunks
        self._first: list[np.ndarray] = [next(chunks)]

    def __iter__(self) -> _StartedChunks:
        return self

    def __next__(self) -> np.ndarray:
        return self._first.pop() if self._first else next(self._chunks)

    def close(self) -> None:
        self._first.clear()
        self._chunks.close()


def _decode_and_assemble_locally(
    vae: SRVAE, latents_ThwC: Sequence[Tensor], plan: UpscalePlan, between_chunks: ChunkCheck | None
) -> Generator[np.ndarray, None, None]:
    # One rank, or every rank of a spatial-shard replica: there the fit is agreed on, so the number of
    # `between_chunks` calls, which differs between the two orders, is the same on every rank.
    exchange = spatial_shard_of(vae)

    def iter_tile(latent_ThwC: Tensor) -> Iterator[Tensor]:
        latent_BCThw = latent_ThwC.permute(3, 0, 1, 2).unsqueeze(0)
        if exchange is None:
            return vae.iter_decode_tile(latent_BCThw)
        return iter_decode_tile_sharded(vae, latent_BCThw, exchange)

    iterators = [iter_tile(latent_ThwC) for latent_ThwC in latents_ThwC]
    device = latents_ThwC[0].device
    before = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    first_segment = next(iterators[0])  # tile 0's first segment; its cache chain is now alive
    per_tile_bytes = torch.cuda.memory_allocated(device) - before if device.type == "cuda" else 0
    segments_by_tile = [itertools.chain([first_segment], iterators[0]), *iterators[1:]]
    between_segments = between_chunks
    fits = _segment_major_fits(device, per_tile_bytes, len(iterators))
    if exchange is not None:
        fits = exchange.agree(fits)
    if fits:
        tile_segments = zip(*segments_by_tile, strict=True)  # segment s of every tile, tile by tile
    else:
        logger.info("SR decode: %d tiles x %.1f GiB of causal caches do not fit; decoding whole tiles, streaming "
                    "only the blend", len(iterators), per_tile_bytes / 2**30)
        decoded = []
        for tile_segments_iterator in segments_by_tile:
            tile = []
            for segment in tile_segments_iterator:  # a cancel is seen after every segment, not only after a whole tile
                tile.append(segment)
                if between_chunks is not None:
                    between_chunks()
            decoded.append(tile)
        tile_segments = zip(*decoded, strict=True)
        between_segments = None  # the decode is over: only the blend is left
    pending: Callable[[], np.ndarray] | None = None
    try:
        for segments in tile_segments:
            started = start_host_copy(_assemble_on_device([segment[0] for segment in segments], plan))
            if between_segments is not None:
                between_segments()
            if pending is not None:
                yield pending()
            pending = started
        assert pending is not None, "a tile has at least one segment"
        yield pending()
    except GeneratorExit:
        if exchange is not None:
            # The caller stopped reading (the leader's MP4 sink failed: a full disk, an encoder error) while the
            # other ranks, which have no sink, are still decoding their rows: make the rest of their collectives
            # (halo rows, gathers, the cancellation checks) here, then let the caller's error through.
            for _ in tile_segments:
                if between_segments is not None:
                    between_segments()
        raise


def _segment_major_fits(device: torch.device, per_tile_bytes: int, num_tiles: int) -> bool:
    """Whether `num_tiles` cache chains of `per_tile_bytes` each fit beside the decode's own working memory.

    Half of what the device has left (free memory plus the caching allocator's unused reserve) may go to the
    other tiles' caches; the rest stays for the segment decode's activations. Off CUDA: always (tests, CPU runs).
    """
    if device.type != "cuda":
        return True
    free_bytes, _ = torch.cuda.mem_get_info(device)
    unused_reserve = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    return per_tile_bytes * (num_tiles - 1) <= 0.5 * (free_bytes + unused_reserve)
