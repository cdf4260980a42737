"""An upscale's geometry, decided before any compute: its output sizes (`upscale_sizes`, which needs no checkpoint)
and its tile grid (`plan_upscale`). Its own module, without the stages' decode code, so the HTTP server tells a
job's output size when the job is created from the same code the worker runs, without importing the models."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import cast

from k6serve.media.mux import MAX_FRAME_MACROBLOCKS, MAX_FRAME_SIDE, frame_macroblocks
from k6serve.pipelines.sr_tiling import (
    ScalePlan,
    TileGrid,
    plan_tiles,
    pre_upscale_size,
    resolve_scale,
    resolve_target_size,
    stretches_aspect,
    target_bucket,
)
from k6serve.request import FIELD_NAMES, FieldNames, FlagWorded, FlagWordedNote, UpscaleRequest


class UpscaleTooLarge(FlagWorded):
    """The upscaled frame is over H.264's largest level: the scale or the source is what to change (a target does
    not help), so the HTTP error names `sr_resolution_scale` even beside a target."""


@dataclass(frozen=True, kw_only=True, slots=True)
class UpscalePlan:
    """Everything about one request's geometry, decided before any compute."""

    scale: ScalePlan
    source_size: tuple[int, int]  # (H, W) of the source frames
    input_size: tuple[int, int]  # (H, W) after the x1.125 pre-upscale (= source_size at x2 and x4)
    snap: int  # pixels per latent cell: padding and tile positions align to it
    grid: TileGrid  # over the input frame padded to `snap`
    crop_size: tuple[int, int]  # input_size x tiling scale: the blended canvas without the padding
    delivery_size: tuple[int, int]  # crop_size, or the downscaled target resolution
    notes: tuple[str, ...] = ()  # what the user should know about the geometry (a target that could not apply)

    @property
    def num_tiles(self) -> int:
        return len(self.grid.tiles)

    def describe(self, name: FieldNames = FIELD_NAMES) -> str:
        """The plan in words, naming the target as `name` does (the request's field; `FLAG_NAMES`: the CLI's flag)."""
        (source_h, source_w), (crop_h, crop_w) = self.source_size, self.crop_size
        base_h, base_w = self.grid.base_size
        # The upscaled size, then the target's (which only downscales): "upscaled 96x64 to 90x60" read as an upscale.
        out_height, out_width = self.delivery_size
        resized = ("" if self.delivery_size == self.crop_size
                   else f", then resized to {out_width}x{out_height} ({name('sr_target_resolution')})")
        return (
            f"upscaled {source_w}x{source_h} to {crop_w}x{crop_h} with {self.num_tiles} tile(s) "
            f"({len(self.grid.tops)}x{len(self.grid.lefts)} grid of {base_w}x{base_h} output tiles){resized}"
        )


@dataclass(frozen=True, kw_only=True, slots=True)
class UpscaleSizes:
    """The sizes of an `UpscalePlan`, without its tile grid."""

    scale: ScalePlan
    input_size: tuple[int, int]
    crop_size: tuple[int, int]
    delivery_size: tuple[int, int]
    notes: tuple[str, ...] = ()


def check_canvas(source_size: tuple[int, int], request: UpscaleRequest) -> None:
    """Raises `UpscaleTooLarge` when the upscaled canvas of a `source_size` (H, W) source is over H.264's largest
    level. It depends on the area alone, so a source's stated size (before a display rotation swaps its sides)
    answers it before its first frame is decoded (`SRSourceReader.stated_frame_size`)."""
    scale = resolve_scale(request.scale)
    height, width = source_size
    crop_size = _input_and_crop_sizes(source_size, scale)[1]
    if frame_macroblocks(*crop_size) > MAX_FRAME_MACROBLOCKS:
        # The upscaled canvas is computed whole before any sr_target_resolution downscales it, so a target does not
        # help; a bound here also bounds the request's host memory (the canvas of 121 frames: 12.9 GB at the
        # bound; an 8000x8000 source at x2 was accepted and needed 93 GB) and its time (tiles grow with the area).
        raise UpscaleTooLarge.naming(lambda name: (
            f"the x{request.scale:g} upscale of this {width}x{height} source would be {crop_size[1]}x{crop_size[0]} "
            f"({frame_macroblocks(*crop_size):,} macroblocks of 16x16 pixels), more than H.264's largest level "
            f"allows in a frame ({MAX_FRAME_MACROBLOCKS:,}, e.g. 8192x4320 or 7680x4320), and the output is "
            f"computed at that size before any {name('sr_target_resolution')}; "
            f"{_smaller_scales(source_size, request.scale, name)}"))


def upscale_sizes(source_size: tuple[int, int], request: UpscaleRequest) -> UpscaleSizes:
    """The output sizes of `request` on a source of `source_size` (H, W); raises ValueError for a target or size that
    cannot be made. Needs no checkpoint (the tile grid does, and does not change the sizes), so the HTTP server
    tells a job's size when it is created, from the same code the worker runs (`plan_upscale`)."""
    scale = resolve_scale(request.scale)
    height, width = source_size
    input_size, crop_size = _input_and_crop_sizes(source_size, scale)
    delivery_size = crop_size
    notes: tuple[str, ...] = ()
    if scale.pre_upscale != 1.0:
        # The reference's rounding of each side to a multiple of 16 (kept: the tiles need it) stretched a small source
        # with nothing said, while a target's stretch was told (96x64 came out 224x128: aspect 1.5 -> 1.75), or
        # gave x2 for the x2.25 asked (32x32 rounds back to 32x32).
        enlarged = (f"the x{request.scale:g} scale first enlarges the {width}x{height} source x{scale.pre_upscale:g} "
                    f"with each side rounded to a multiple of 16, to {input_size[1]}x{input_size[0]}")
        wide, high = crop_size[1] / width, crop_size[0] / height
        if stretches_aspect(input_size, source_size):
            notes = (FlagWordedNote.naming(lambda name: (
                f"{enlarged}, changing its aspect ratio ({width / height:.3g} -> "
                f"{input_size[1] / input_size[0]:.3g}); use {name('sr_resolution_scale')} 2 or 4 to keep it.")),)
        elif any(abs(factor - request.scale) > 0.02 * request.scale for factor in (wide, high)):
            factor = f"x{wide:.3g}" if f"{wide:.3g}" == f"{high:.3g}" else f"x{wide:.3g} wide and x{high:.3g} high"
            notes = (FlagWordedNote.naming(lambda name: (
                f"{enlarged}: the upscaled result, {crop_size[1]}x{crop_size[0]}, scales the source {factor}, not "
                f"x{request.scale:g}; use {name('sr_resolution_scale')} 2 or 4 for an exact scale.")),)
    check_canvas(source_size, request)
    if request.target_resolution is not None:
        delivery_size = resolve_target_size(
            *crop_size, request.target_resolution, request.target_resize_mode
        )
        bucket_height, bucket_width = target_bucket(*crop_size, request.target_resolution)
        if delivery_size == crop_size and (bucket_height, bucket_width) != crop_size:
            # "fit" only downscales, so a target at least as large as the result silently did nothing.
            crop_height, crop_width = crop_size
            notes += (FlagWordedNote.naming(lambda name: (
                f"{name('sr_target_resolution')} {request.target_resolution!r} ({bucket_width}x{bucket_height}) "
                f"is not smaller than the {crop_width}x{crop_height} upscaled result, and 'fit' only downscales: "
                f"the output keeps {crop_width}x{crop_height}. Use a larger {name('sr_resolution_scale')} to get "
                f"closer to the target, or drop {name('sr_target_resolution')}.")),)
        elif stretches_aspect(delivery_size, crop_size):
            # Only "exact" stretches ("fit" scales both sides alike). This was a log line no user saw.
            (crop_height, crop_width), (out_height, out_width) = crop_size, delivery_size
            notes += (FlagWordedNote.naming(lambda name: (
                f"{name('sr_target_resolution')} {request.target_resolution!r} with the 'exact' resize mode "
                f"stretches the {crop_width}x{crop_height} upscaled result to {out_width}x{out_height}, changing "
                f"its aspect ratio; use {name('sr_target_resize_mode')} 'fit' to keep it.")),)
    if max(delivery_size) > MAX_FRAME_SIDE:
        # Found here, from the first frame, rather than when the MP4 writer opens after every tile was computed.
        out_height, out_width = delivery_size
        raise FlagWorded.naming(lambda name: (
            f"the x{request.scale:g} upscale of this {width}x{height} source would be {out_width}x{out_height}, "
            f"but H.264 frames are at most {MAX_FRAME_SIDE} pixels a side; use a smaller "
            f"{name('sr_resolution_scale')}, a smaller source, or an {name('sr_target_resolution')} of at most "
            f"{MAX_FRAME_SIDE} a side (e.g. 2k)."))
    return UpscaleSizes(scale=scale, input_size=input_size, crop_size=crop_size, delivery_size=delivery_size,
                        notes=notes)


def _input_and_crop_sizes(source_size: tuple[int, int], scale: ScalePlan
                          ) -> tuple[tuple[int, int], tuple[int, int]]:
    """(H, W) after the x1.125 pre-upscale (the source's at x2 and x4), and that x the tiling scale: the canvas."""
    # tuple(): a list given as the size is taken as the pair it holds
    input_size = (pre_upscale_size(*source_size) if scale.pre_upscale != 1.0
                  else cast(tuple[int, int], tuple(source_size)))
    return input_size, (input_size[0] * scale.tiling_scale, input_size[1] * scale.tiling_scale)


def _smaller_scales(source_size: tuple[int, int], scale: float, name: FieldNames) -> str:
    """The fix for a source too large at `scale`: the smaller scales that fit, or the source's largest size."""
    fitting = [f"{smaller:g}" for smaller in (2.25, 2) if smaller < scale and frame_macroblocks(
        *_input_and_crop_sizes(source_size, resolve_scale(smaller))[1]) <= MAX_FRAME_MACROBLOCKS]
    if fitting:
        return f"use {name('sr_resolution_scale')} {' or '.join(fitting)}, or a smaller source."
    return ("downscale the source first (at x2, to at most 4096x2160 or another frame of at most "
            f"{MAX_FRAME_MACROBLOCKS // 4:,} macroblocks).")


def plan_upscale(
    source_size: tuple[int, int],
    request: UpscaleRequest,
    *,
    tile_sizes: Sequence[tuple[int, int]],
    snap: int,
) -> UpscalePlan:
    """Scale route, tile grid and output sizes; raises ValueError for every request that cannot run."""
    sizes = upscale_sizes(source_size, request)
    padded_height, padded_width = (-(-side // snap) * snap for side in sizes.input_size)
    grid = plan_tiles(
        padded_height,
        padded_width,
        tiling_scale=sizes.scale.tiling_scale,
        tile_sizes=tile_sizes,
        min_overlap=request.tile_min_overlap,
        snap=snap,
    )
    return UpscalePlan(
        scale=sizes.scale,
        source_size=cast(tuple[int, int], tuple(source_size)),  # a list given as the size: the pair it holds
        input_size=sizes.input_size,
        snap=snap,
        grid=grid,
        crop_size=sizes.crop_size,
        delivery_size=sizes.delivery_size,
        notes=sizes.notes,
    )
