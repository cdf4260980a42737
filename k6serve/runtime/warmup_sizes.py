"""The shapes `--warmup-mode server` warms: `--warmup-resolutions` checked against the model's own rules.

A generation size is checked as a request of that size is (`resolve_generate`: multiples of 16, at most 2048 a side,
a frame count rounded to 4k + 1 with a note, at most 509 frames, the soundtrack's length). A super-resolution size
is a source clip's, checked as a source of that size is at the warm-up's x2 (`plan_upscale`: the output's H.264
limit and, with the checkpoint's tiles, at least one tile), plus the even sides its synthetic H.264 clip needs.
`check_warmup_sizes_before_loading` runs before any rank starts, where the model is known without a download (the
`Engine`, and `serve` before it binds its port); the worker checks again once it knows the model, before its weights
load, and plans each SR source against the loaded tiles before writing the clip.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from k6serve.config import EngineConfig, WarmupSize
from k6serve.models.variants import GENERATION, Variant
from k6serve.request import GenerateRequest, SamplingParams
from k6serve.request_resolution import resolve_generate, resolve_upscale

if TYPE_CHECKING:
    from k6serve.models.kandinsky6_sr.config_before_loading import SRTiling

# The SR server warm-up's synthetic source when no size is listed (width, height, frames, fps): the 5 s
# checkpoints' 121 frames at the 3:2 landscape shape of docs/benchmarks.md's VSR runs. Listed sizes take its frames
# and fps unless they give frames.
SR_WARMUP_CLIP = (768, 512, 121, 24)
# The server warm-up upscales x2 (the plain tiling route; 2.25 adds only a resize before it).
SR_WARMUP_SCALE = 2.0

Resolve = Callable[[SamplingParams], tuple[GenerateRequest, list[str]]]


def generation_warmups(sizes: tuple[WarmupSize, ...], variant: Variant,
                       resolve: Resolve | None = None) -> list[GenerateRequest]:
    """Each size's request, in order (`resolve`: the worker's, with the engine's Cache-DiT; default the bare request
    rules); a size a request could not have is refused naming the flag and the item. A frame count not of the
    form 4k + 1 is rounded, as a request's is."""
    resolve = resolve or (lambda params: resolve_generate(params, variant))
    requests = []
    for size in sizes:
        params = SamplingParams(prompt="warm-up", width=size.width, height=size.height, num_frames=size.num_frames)
        try:
            requests.append(resolve(params)[0])
        except ValueError as error:
            raise ValueError(f"--warmup-resolutions {size}: {error}") from None
    _refuse_same_shapes(sizes, [(r.width, r.height, r.num_frames) for r in requests], variant)
    return requests


def sr_warmup_source(size: WarmupSize, default_num_frames: int) -> tuple[tuple[int, int, int], list[str]]:
    """(width, height, frames kept) of the synthetic source a super-resolution `size` warms, and a note when the
    source keeps fewer frames than listed (as a request's source would)."""
    from k6serve.media.video import MAX_NUM_FRAMES, floor_frame_count

    num_frames = default_num_frames if size.num_frames is None else size.num_frames
    kept = floor_frame_count(min(num_frames, MAX_NUM_FRAMES))  # the source reader's rule (24 fps keeps every frame)
    notes = []
    if kept != num_frames:
        notes.append(f"a source keeps at most {MAX_NUM_FRAMES} frames, floored to 1 + 8k: {num_frames} frames warm "
                     f"the shape of {kept}.")
    return (size.width, size.height, kept), notes


def check_sr_warmup_size(size: WarmupSize, variant: Variant, tiling: SRTiling | None = None) -> None:
    """Refuse a super-resolution `size` whose source could not be upscaled x2 (`tiling`: the checkpoint's tiles,
    for the smallest source; None checks the rest)."""
    if size.width % 2 or size.height % 2:
        frames = "" if size.num_frames is None else f"x{size.num_frames}"
        raise ValueError(f"--warmup-resolutions {size}: the warm-up writes its source clip in H.264 (4:2:0), which "
                         f"needs even sides; use {size.width + size.width % 2}x{size.height + size.height % 2}"
                         f"{frames}.")
    from k6serve.pipelines.sr_plan import plan_upscale, upscale_sizes

    request, _ = resolve_upscale(SamplingParams(video_path="warm-up.mp4", sr_resolution_scale=SR_WARMUP_SCALE),
                                 variant)
    source_size = (size.height, size.width)
    try:
        if tiling is None:
            upscale_sizes(source_size, request)
        else:
            plan_upscale(source_size, request, tile_sizes=tiling.tile_sizes, snap=tiling.snap)
    except ValueError as error:
        raise ValueError(f"--warmup-resolutions {size}: a source of this size cannot be upscaled at the warm-up's "
                         f"x{SR_WARMUP_SCALE:g}: {error}") from None


def check_warmup_sizes(sizes: tuple[WarmupSize, ...], variant: Variant, *, sr_tiling: SRTiling | None = None,
                       sr_default_num_frames: int) -> None:
    """Refuse a size `variant` could not warm (see the module docstring), naming the flag and the item
    (`sr_default_num_frames`: a super-resolution source's frames where the item gives none)."""
    if variant.family == GENERATION:
        generation_warmups(sizes, variant)
        return
    for size in sizes:
        check_sr_warmup_size(size, variant, sr_tiling)
    _refuse_same_shapes(sizes, [sr_warmup_source(size, sr_default_num_frames)[0] for size in sizes], variant)


def _refuse_same_shapes(sizes: tuple[WarmupSize, ...], shapes: list[tuple[int, int, int]], variant: Variant) -> None:
    """Two items that warm one shape (768x512 and 768x512x121 with a 121-frame default; 120 and 121 frames)."""
    first: dict[tuple[int, int, int], WarmupSize] = {}
    for size, shape in zip(sizes, shapes):
        if shape in first:
            width, height, num_frames = shape
            raise ValueError(f"--warmup-resolutions {first[shape]} and {size} warm the same shape on {variant.name} "
                             f"({width}x{height}x{num_frames}); drop one of them.")
        first[shape] = size


def check_warmup_sizes_before_loading(config: EngineConfig) -> None:
    """`check_warmup_sizes` before any rank starts, where the model is known without a download."""
    runtime, model = config.runtime, config.model
    if runtime.warmup_mode != "server" or not runtime.warmup_resolutions:
        return
    from k6serve.models.checkpoint_files import variant_before_loading
    from k6serve.models.kandinsky6_sr.config_before_loading import sr_tiling_before_loading

    try:
        variant, _ = variant_before_loading(model.model_path, model.model_id, model.load_format)
    except (OSError, ValueError):
        return  # a damaged checkpoint: the load reports it, in its words
    if variant is None:
        return  # the worker knows the model once downloaded, and checks then
    tiling = None
    if variant.family != GENERATION:
        tiling = sr_tiling_before_loading(model.model_path, model.model_id, model.load_format)
    check_warmup_sizes(runtime.warmup_resolutions, variant, sr_tiling=tiling, sr_default_num_frames=SR_WARMUP_CLIP[2])
