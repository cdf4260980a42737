"""Tile geometry, pixel pre/post-processing, Hann blending and per-chunk noise of Kandinsky 6 SR.

Follows the SG column of k6-super-resolution.md §7 (the behaviour the seeds describe): replicate padding to 16 and
a crop at the end, uint8 round trip after the x1.125 pre-upscale, per-tile uint8 truncation before an exact-divide
Hann blend, chunk seeding with seed + first tile index. Python's `round` (half-to-even) is used wherever R uses it.

Frames are uint8 (T, 3, H, W) tensors unless stated otherwise; latents are (B, T, h, w, C) channels-last.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from k6serve.request import FlagWorded


SNAP = 16  # pixels per latent cell of the released K-VAE; tile positions and padding align to it
DEFAULT_MIN_OVERLAP = 0.2
PRE_UPSCALE_FACTOR = 1.125
BLEND_FRAME_CHUNK = 8
TARGET_RESOLUTIONS: dict[str, tuple[tuple[int, int], ...]] = {
    "hd": ((720, 1280), (720, 720), (1280, 720)),
    "fullhd": ((1080, 1920), (1080, 1080), (1920, 1080)),
    "2k": ((1440, 2560), (1440, 1440), (2560, 1440)),
}


@dataclass(frozen=True, kw_only=True, slots=True)
class ScalePlan:
    """How a requested scale runs: pixel pre-upscale, then tiles at an integer scale."""

    tiling_scale: int
    pre_upscale: float


def resolve_scale(scale: float) -> ScalePlan:
    """2 -> x2 tiles; 4 -> x4 tiles; 2.25 -> x1.125 pixel pre-upscale then x2 tiles (§2.2)."""
    if scale == 2.25:
        return ScalePlan(tiling_scale=2, pre_upscale=PRE_UPSCALE_FACTOR)
    if scale in (2, 4):
        return ScalePlan(tiling_scale=int(scale), pre_upscale=1.0)
    raise ValueError(f"SR scale {scale} is not supported; use 2, 4 or 2.25.")


def pre_upscale_size(
    height: int, width: int, factor: float = PRE_UPSCALE_FACTOR
) -> tuple[int, int]:
    """max(16, round(side * factor / 16) * 16) per side, half-to-even (64 -> 4.5 -> 4 -> 64)."""
    snapped_height, snapped_width = (max(SNAP, round(side * factor / SNAP) * SNAP) for side in (height, width))
    return snapped_height, snapped_width


def pre_upscale_x1125(frames_TCHW: Tensor) -> Tensor:
    """Bilinear x1.125 on float(uint8), then round, clamp and back to uint8, as R and SG do."""
    size = pre_upscale_size(frames_TCHW.shape[-2], frames_TCHW.shape[-1])
    resized = F.interpolate(frames_TCHW.float(), size=size, mode="bilinear", align_corners=False)
    return resized.round().clamp(0, 255).to(torch.uint8)


def pad_to_multiple(frames_TCHW: Tensor, multiple: int = SNAP) -> Tensor:
    """Replicate the last row/column so H and W become multiples of `multiple`; crop the output afterwards."""
    height, width = frames_TCHW.shape[-2:]
    padded_height, padded_width = (
        -(-height // multiple) * multiple,
        -(-width // multiple) * multiple,
    )
    rows = torch.arange(padded_height, device=frames_TCHW.device).clamp(max=height - 1)
    columns = torch.arange(padded_width, device=frames_TCHW.device).clamp(max=width - 1)
    return frames_TCHW[..., rows, :][..., columns]


def select_base_tile(
    height: int, width: int, tile_sizes: Sequence[tuple[int, int]]
) -> tuple[int, int]:
    """The trained (H, W) tile whose W/H is closest to the frame's; ties go to the first listed."""
    return min(tile_sizes, key=lambda size: abs(size[1] / size[0] - width / height))


def axis_positions(
    length: int, tile: int, min_overlap: float = DEFAULT_MIN_OVERLAP, snap: int = SNAP
) -> list[int]:
    """Evenly spread tile starts over [0, length - tile] with overlap >= min_overlap (R `axis_positions_even`)."""
    if tile >= length:
        return [0]
    unit = snap if length % snap == 0 and tile % snap == 0 else 1
    span = (length - tile) // unit
    max_stride = max(1, math.floor(tile * (1.0 - min_overlap) / unit))
    count = math.ceil(span / max_stride) + 1
    return [round(index * span / (count - 1)) * unit for index in range(count)]


@dataclass(frozen=True, kw_only=True, slots=True)
class TileGrid:
    """Row-major tiles over a (padded) source frame; input-side tiles map to HR base tiles at `scale`."""

    scale: int
    base_size: tuple[int, int]  # HR tile (H, W), a trained DiT size
    tile_size: tuple[int, int]  # input-side tile = base_size / scale
    source_size: tuple[int, int]  # the frame the grid covers (after pre-upscale and padding)
    tops: tuple[int, ...]
    lefts: tuple[int, ...]

    @property
    def tiles(self) -> list[tuple[int, int]]:
        """(top, left) in source pixels, tops outer, lefts inner."""
        return [(top, left) for top in self.tops for left in self.lefts]

    @property
    def output_size(self) -> tuple[int, int]:
        return self.source_size[0] * self.scale, self.source_size[1] * self.scale

    def latent_window(self, index: int, spatial_factor: int = SNAP) -> tuple[slice, slice]:
        """(rows, columns) of tile `index` in the whole-clip latent."""
        top, left = self.tiles[index]
        tile_height, tile_width = self.tile_size
        return (
            slice(top // spatial_factor, (top + tile_height) // spatial_factor),
            slice(left // spatial_factor, (left + tile_width) // spatial_factor),
        )


class SourceTooSmall(FlagWorded):
    """The source frame is smaller than one tile of the chosen scale: the source is at fault (the HTTP error names
    its field), though a higher scale, whose tiles need fewer source pixels, also fits it."""


def plan_tiles(
    height: int,
    width: int,
    *,
    tiling_scale: int,
    tile_sizes: Sequence[tuple[int, int]],
    min_overlap: float = DEFAULT_MIN_OVERLAP,
    snap: int = SNAP,
) -> TileGrid:
    """Tile grid for a frame of (height, width) pixels, already pre-upscaled and padded (§2.4)."""
    if not 0.0 <= min_overlap < 1.0:
        raise ValueError(f"tile min overlap {min_overlap} must be in [0, 1); the default is 0.2.")
    base_height, base_width = select_base_tile(height, width, tile_sizes)
    if base_height % (snap * tiling_scale) or base_width % (snap * tiling_scale):
        raise ValueError(
            f"tile size {(base_height, base_width)} is not divisible by {snap} x scale {tiling_scale}; "
            "the checkpoint's tile sizes do not support this scale."
        )
    tile_height, tile_width = base_height // tiling_scale, base_width // tiling_scale
    if height < tile_height or width < tile_width:
        # "a higher scale" named no setting: each surface's name of it.
        raise SourceTooSmall.naming(lambda name: (
            f"the source frame is {width}x{height} (WxH, after pre-upscale and padding to {snap}) but x"
            f"{tiling_scale} tiles need at least {tile_width}x{tile_height}; use a larger input or a higher "
            f"{name('sr_resolution_scale')}."))
    return TileGrid(
        scale=tiling_scale,
        base_size=(base_height, base_width),
        tile_size=(tile_height, tile_width),
        source_size=(height, width),
        tops=tuple(axis_positions(height, tile_height, min_overlap, snap)),
        lefts=tuple(axis_positions(width, tile_width, min_overlap, snap)),
    )


def hann_window_2d(height: int, width: int, device: torch.device | str = "cpu") -> Tensor:
    """(H, W) fp32 window wy ⊗ wx with w = hann_window(n + 2)[1:-1] (periodic, slightly asymmetric, never 0)."""
    window_y = torch.hann_window(height + 2, device=device)[1:-1]
    window_x = torch.hann_window(width + 2, device=device)[1:-1]
    return window_y[:, None] * window_x[None, :]


def blend_tiles(
    tiles_TCHW: Sequence[Tensor], grid: TileGrid, frame_chunk: int = BLEND_FRAME_CHUNK
) -> Tensor:
    """Hann-blend uint8 HR tiles (row-major, grid order) into uint8 frames (T, 3, H*s, W*s).

    acc += tile * w, wsum += w in tile order, acc / wsum exactly (no 1e-6 clamp, unlike R), then truncation to
    uint8. Uncovered pixels stay 0. Frames are blended `frame_chunk` at a time to bound the fp32 accumulator.
    """
    assert len(tiles_TCHW) == len(grid.tiles)
    num_frames, channels = tiles_TCHW[0].shape[:2]
    out_height, out_width = grid.output_size
    base_height, base_width = grid.base_size
    device = tiles_TCHW[0].device
    window_HW = hann_window_2d(base_height, base_width, device)
    weight_sum_HW = torch.zeros(out_height, out_width, device=device)
    positions = [(top * grid.scale, left * grid.scale) for top, left in grid.tiles]
    for top, left in positions:
        weight_sum_HW[top : top + base_height, left : left + base_width] += window_HW
    frames = torch.empty(
        num_frames, channels, out_height, out_width, dtype=torch.uint8, device=device
    )
    for start in range(0, num_frames, frame_chunk):
        stop = min(start + frame_chunk, num_frames)
        acc = torch.zeros(stop - start, channels, out_height, out_width, device=device)
        for tile, (top, left) in zip(tiles_TCHW, positions):
            acc[..., top : top + base_height, left : left + base_width] += (
                tile[start:stop].float() * window_HW
            )
        blended = torch.where(weight_sum_HW > 0, acc / weight_sum_HW, torch.zeros_like(acc))
        frames[start:stop] = blended.clamp(0, 255).to(torch.uint8)
    return frames


@dataclass(frozen=True, kw_only=True, slots=True)
class TileChunk:
    """Tiles [start, stop) denoised in one DiT call, with their noise seed."""

    start: int
    stop: int
    seed: int


def chunk_tiles(num_tiles: int, tiles_batch_size: int, seed: int) -> list[TileChunk]:
    """Chunks of `tiles_batch_size`; the chunk starting at tile s is seeded with seed + s (§2.7)."""
    if tiles_batch_size < 1:
        raise ValueError(f"tiles batch size {tiles_batch_size} must be >= 1 (default 1).")
    return [
        TileChunk(start=start, stop=min(start + tiles_batch_size, num_tiles), seed=seed + start)
        for start in range(0, num_tiles, tiles_batch_size)
    ]


def chunk_noise(
    shape: Sequence[int], seed: int, device: torch.device | str, dtype: torch.dtype
) -> Tensor:
    """eps from a fresh generator on `device` seeded with the chunk seed, drawn in the DiT dtype.

    R draws [n*T', h, w, C] for n tiles; (n, T', h, w, C) is the same stream in the same memory order.
    """
    generator = torch.Generator(device=device).manual_seed(seed)
    return torch.randn(tuple(shape), generator=generator, device=device, dtype=dtype)


def mix_lq_noise(lq_latent: Tensor, noise: Tensor, lq_noise_scale: float) -> Tensor:
    """The "ddpm" start point x = sqrt(1 - s^2) * lq + s * eps (0.714142842854285 * lq + 0.7 * eps at s = 0.7)."""
    return math.sqrt(1 - lq_noise_scale**2) * lq_latent + lq_noise_scale * noise


def _parse_target(target: str) -> tuple[tuple[int, int], ...]:
    if target in TARGET_RESOLUTIONS:
        return TARGET_RESOLUTIONS[target]
    width_text, sep, height_text = target.lower().partition("x")
    if (
        sep
        and width_text.isdigit()
        and height_text.isdigit()
        and int(width_text) > 0
        and int(height_text) > 0
    ):
        # An odd side is refused with the request (`request_resolution.parse_target_resolution`), before the
        # model runs.
        return ((int(height_text), int(width_text)),)
    raise ValueError(
        f"target resolution {target!r} is not one of hd, fullhd, 2k or WxH (e.g. 1280x720)."
    )


def target_bucket(height: int, width: int, target: str) -> tuple[int, int]:
    """The (H, W) bucket of `target` closest in aspect to an SR result of (height, width)."""
    return select_base_tile(height, width, _parse_target(target))


def stretches_aspect(size: tuple[int, int], result_size: tuple[int, int]) -> bool:
    """Whether delivering `size` (H, W) from a result of `result_size` changes the aspect ratio by over 2%."""
    (height, width), (result_height, result_width) = size, result_size
    return abs(width / height - result_width / result_height) > 0.02 * (result_width / result_height)


def resolve_target_size(height: int, width: int, target: str, mode: str = "fit") -> tuple[int, int]:
    """Delivery (H, W) for an SR result of (height, width) (§2.12); never upscales.

    fit: one isotropic scale into the bucket closest in aspect; a bucket at least as large leaves the size as is.
    exact: the bucket itself; a bucket larger than the result in either side raises.
    """
    bucket_height, bucket_width = target_bucket(height, width, target)
    if mode == "fit":
        scale = min(bucket_height / height, bucket_width / width)
        if scale >= 1:
            return height, width
        fitted = (
            min(bucket_height, round(height * scale / 2) * 2),
            min(bucket_width, round(width * scale / 2) * 2),
        )
        if min(fitted) < 2:
            # A strip of a source (1024x32 at x2 into 16x16) rounded its short side to 0, then divided by it.
            raise FlagWorded.naming(lambda name: (
                f"fitting the {width}x{height} upscaled result into target {target!r} "
                f"({bucket_width}x{bucket_height}) would leave its "
                f"{'height' if fitted[0] < 2 else 'width'} under 2 pixels; use a larger "
                f"{name('sr_target_resolution')} or drop it."))
        return fitted
    if mode == "exact":
        if bucket_height > height or bucket_width > width:
            # It read "Use a larger scale or a smaller target", naming neither setting (nor 'fit', which allows it).
            bucket = "" if target == f"{bucket_width}x{bucket_height}" else f" ({bucket_width}x{bucket_height})"
            raise FlagWorded.naming(lambda name: (
                f"{name('sr_target_resolution')} {target!r}{bucket} is larger than the {width}x{height} upscaled "
                f"result, and target resolutions only downscale; use a larger {name('sr_resolution_scale')}, a "
                f"smaller {name('sr_target_resolution')}, or {name('sr_target_resize_mode')} 'fit', which keeps "
                "the upscaled size."))
        # A stretch beyond 2% is told to the user as a note of the plan (`sr_plan.upscale_sizes`).
        return bucket_height, bucket_width
    raise ValueError(f"target resize mode {mode!r} is not 'fit' or 'exact'.")


def resize_frames(
    frames_TCHW: Tensor, size: tuple[int, int], frame_chunk: int = BLEND_FRAME_CHUNK
) -> Tensor:
    """Bilinear antialiased downscale of uint8 frames, `frame_chunk` at a time, rounded back to uint8."""
    if tuple(frames_TCHW.shape[-2:]) == tuple(size):
        return frames_TCHW
    chunks = [
        F.interpolate(
            chunk.float(), size=size, mode="bilinear", antialias=True, align_corners=False
        )
        .clamp(0, 255)
        .round()
        .to(torch.uint8)
        for chunk in frames_TCHW.split(frame_chunk)
    ]
    return torch.cat(chunks)
