"""The `size` and `seconds` of an upscale job, known when it is created, from its source's headers and first frame.

A generation job's size and duration are request fields; an upscale job's follow from its source, which the
worker reads only when the job runs. Here the source is opened with the worker's reader and the size planned with
the worker's own `upscale_sizes`, so the values are the ones the finished job reports. The job's values are
replaced by the worker's when it completes: for a file whose headers state another length than it decodes to
(`SRSourceReader.preview`), the finished job's `seconds` wins.
"""

from __future__ import annotations

from dataclasses import dataclass

from k6serve.media.video import SRSourceReader
from k6serve.models.kandinsky6_sr.config_before_loading import SRTiling
from k6serve.pipelines.sr_plan import UpscaleTooLarge, check_canvas, plan_upscale, upscale_sizes
from k6serve.request import UpscaleRequest
from k6serve.serve.jobs import seconds_text, size_text


@dataclass(frozen=True, kw_only=True, slots=True)
class UpscaleOutput:
    """An upscale job's `size` and `seconds` as the job object shows them."""

    size: str  # "WxH", width first
    seconds: str | None  # None when the source states no length, or a duration too short to keep a frame
    notes: tuple[str, ...] = ()  # the plan's notes on the size (a target that cannot apply, a stretch)


class SourceUnusable(ValueError):
    """The worker's reader refuses the source itself (a frame rate that rounds to 0 fps, a music file whose only
    picture is its cover art, a still image, a first frame that does not decode): its message, raised before the
    model loads (CLI) or when the job is created (HTTP), not after a load or a wait in the queue."""


def expected_upscale_output(request: UpscaleRequest, tiling: SRTiling | None = None) -> UpscaleOutput:
    """What `request` will deliver. A source the worker's reader refuses raises `SourceUnusable` with the reader's
    message (the worker would fail the job with it, after the load or the queue). A size that cannot be made (an
    `exact` target larger than the result, a frame over H.264's limits) raises the worker's ValueError, and with the
    checkpoint's `tiling` a source smaller than one tile of its scale raises its `SourceTooSmall`, as the worker's own
    plan does: the server refuses the job at once."""
    try:
        with SRSourceReader(request.video_path) as reader:
            if (stated := reader.stated_frame_size()) is not None:
                check_canvas(stated, request)  # a canvas over H.264's limits refused before a frame is decoded
            source = reader.preview()
    except UpscaleTooLarge:
        raise  # the plan's refusal, as the worker words it (not the reader's)
    except ValueError as exc:
        raise SourceUnusable(str(exc)) from None
    sizes = upscale_sizes(source.frame_size, request)
    if tiling is not None:
        plan_upscale(source.frame_size, request, tile_sizes=tiling.tile_sizes, snap=tiling.snap)
    height, width = sizes.delivery_size
    seconds = None if source.num_frames is None else seconds_text(source.num_frames, source.fps)
    return UpscaleOutput(size=size_text(height, width), seconds=seconds, notes=sizes.notes)
