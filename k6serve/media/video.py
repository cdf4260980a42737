"""Reading video files: whole clips for inspection, and the SR source under the 24 fps rule.

The SR rule (k6-super-resolution.md §2.1, the SR seed "Limits"): sources within 1.5 fps of 24 keep
every frame, faster sources are stride-subsampled to 24 fps, slower sources keep their native rate
(no frame interpolation); then the first 121 frames are kept and the count is floored to 1 + 8k.
"""

from __future__ import annotations

import logging
import math
import os
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from fractions import Fraction
from typing import Self

import av
import av.container
import av.video.stream
import numpy as np

from k6serve.media.color import SdrFrames
from k6serve.media.container import (
    ANIMATED_WEBP,
    describe_streams,
    is_animated_webp,
    open_input,
    still_image_demuxer,
    video_streams,
)
from k6serve.media.deinterlace import Deinterlacer
from k6serve.media.orientation import display_matrix, pixel_aspect_ratio, quarter_turns, upright

logger = logging.getLogger(__name__)

TARGET_FPS = 24
FPS_TOLERANCE = 1.5
MAX_NUM_FRAMES = 121  # 5 s x 24 fps + 1
# The SR model takes 1 + 8k frames (4x temporal VAE compression, latent frames paired by the DiT).
FRAME_COUNT_MULTIPLE = 8
# A whole decode that gives fewer than this share of the frames the file declares gets a note: a damaged or cut
# file (a partial download with its index at the front) decodes short without an FFmpeg error. Not a refusal: a
# clip trimmed in an editor can declare frames its edit list drops.
SHORT_DECODE_FRACTION = 0.9
# A source whose frames lie this far (seconds) from where its average frame rate puts them gets a note: a variable
# frame rate, which the index-based selection turns into picture and sound out of sync. 0.1 s is past the lip-sync
# offsets viewers notice (about 45 ms early, 125 ms late: ITU-R BT.1359); a phone's jitter of a few ms is not.
VFR_NOTE_SECONDS = 0.1


@dataclass(frozen=True, eq=False)
class DecodedVideo:
    """Every frame of a file's first video stream."""

    frames: np.ndarray  # uint8 (T, H, W, 3), RGB
    fps: float  # stream average rate, or its base rate when the container has no average

    @property
    def num_frames(self) -> int:
        return self.frames.shape[0]


@dataclass(frozen=True, eq=False)
class SourceClip:
    """The frames of an SR source selected by the 24 fps rule, ready for upscaling."""

    frames: np.ndarray  # uint8 (T, H, W, 3), RGB, T = 1 + 8k <= max_frames
    fps: int  # the fps of the processed clip, used for the output file and the audio trim
    source_fps: float
    source_indices: tuple[int, ...]  # index in the source (decode order) of each kept frame
    # Frames decoded: less than the source length when decoding stopped early.
    num_decoded_frames: int
    notes: tuple[str, ...]  # what was changed relative to the source, one sentence each
    # Pixel width over height of the frames (the display rotation applied); None for square pixels.
    sample_aspect_ratio: Fraction | None = None

    @property
    def num_frames(self) -> int:
        return self.frames.shape[0]


@dataclass(frozen=True)
class FrameRatePlan:
    """How the 24 fps rule treats one source frame rate."""

    output_fps: int
    step: float | None  # source frames per output frame when subsampling; None keeps every frame
    note: str | None


def plan_frame_rate(
    source_fps: float, *, target_fps: int = TARGET_FPS, tolerance: float = FPS_TOLERANCE
) -> FrameRatePlan:
    """Apply the 24 fps rule to a source frame rate (Python round, i.e. half-to-even, as the seeds)."""
    if not source_fps > 0:
        raise ValueError(f"source fps must be > 0, got {source_fps}")
    if abs(source_fps - target_fps) < tolerance:
        return FrameRatePlan(output_fps=round(source_fps), step=None, note=_drift_note(source_fps))
    if source_fps > target_fps:
        step = source_fps / target_fps
        note = f"subsampled {source_fps:g} fps to {target_fps} fps (stride {step:g})"
        return FrameRatePlan(output_fps=target_fps, step=step, note=note)
    note = (
        f"source is {source_fps:g} fps, below {target_fps} fps: kept every frame at "
        f"{round(source_fps)} fps; no frame interpolation is done"
    )
    drift = _drift_note(source_fps)
    return FrameRatePlan(output_fps=round(source_fps), step=None, note=f"{note}; {drift}" if drift else note)


def _drift_note(source_fps: float) -> str | None:
    """What keeping every frame at the whole-number rate (the reference's round) does to the timing, when it drifts
    by more than a frame over the longest clip (121 frames): the soundtrack keeps its speed, so the two part."""
    output_fps = round(source_fps)
    if output_fps < 1 or abs(output_fps / source_fps - 1) * MAX_NUM_FRAMES <= 1:
        return None
    change = output_fps / source_fps - 1
    return (f"at {output_fps} fps the picture plays {abs(change):.1%} {'faster' if change > 0 else 'slower'} than "
            f"the source's {source_fps:g} fps, and its soundtrack keeps its speed, so the picture runs "
            f"{'ahead of' if change > 0 else 'behind'} the sound by {abs(change):.2f} s each second; to keep them "
            f"together, convert the source to a whole frame rate first (FFmpeg: -r {output_fps})")


def sr_source_indices(
    num_source_frames: int, plan: FrameRatePlan, *, max_frames: int = MAX_NUM_FRAMES
) -> list[int]:
    """Source frame indices the rule keeps for a source of known length (before the 1+8k floor)."""
    if plan.step is None:
        return list(range(min(num_source_frames, max_frames)))
    num_steps = int(num_source_frames / plan.step)
    indices = [round(i * plan.step) for i in range(num_steps)]
    return [index for index in indices if index < num_source_frames][:max_frames]


def floor_frame_count(num_frames: int) -> int:
    """Largest 1 + 8k not above `num_frames` (121, 113, ..., 9, 1)."""
    assert num_frames >= 1
    return 1 + FRAME_COUNT_MULTIPLE * ((num_frames - 1) // FRAME_COUNT_MULTIPLE)


def read_video(path: str | os.PathLike[str]) -> DecodedVideo:
    """Decode every frame of the first video stream to RGB uint8."""
    with open_input(path) as container:
        stream = _first_video_stream(container, path)
        fps = _stream_fps(stream, path)
        frames = [frame for _, frame in _decode_rgb(container, stream, path, keep=lambda _: True)]
    if not frames:
        raise ValueError(f"video file {str(path)!r} has a video stream but no decodable frames")
    return DecodedVideo(frames=np.stack(frames), fps=fps)


@dataclass(frozen=True, eq=False)
class SampledFrames:
    """Frames picked across a video (`sample_frames`)."""

    frames: tuple[np.ndarray, ...]  # uint8 (H, W, 3) RGB, upright as players show them
    indices: tuple[int, ...]  # each one's index in the stream (decode order)
    num_frames: int  # the stream's length the picks were spread over
    # Pixel width over height (the display rotation applied); None for square pixels.
    sample_aspect_ratio: Fraction | None


def sample_frames(path: str | os.PathLike[str], count: int) -> SampledFrames:
    """`count` frames spread evenly over the first video stream: the middle frame of each of `count` equal parts
    (one frame: the middle one), all of them when the video is shorter. The decode stops at the last one picked, and
    only the picked frames are converted to RGB, so a thumbnail of a long 4K video holds one frame in memory."""
    if count < 1:
        raise ValueError(f"count must be >= 1, got {count}")
    with open_input(path) as container:
        stream = _first_video_stream(container, path)
        num_frames = declared_frame_count(stream, _stream_fps(stream, path)) or _count_packets(path)
        if not num_frames:
            raise ValueError(f"video file {str(path)!r} has a video stream but no frames")
        picks = min(count, num_frames)
        indices = sorted({min(num_frames - 1, int((2 * part + 1) * num_frames // (2 * picks)))
                          for part in range(picks)})
        wanted = set(indices)
        rotations: list[float] = []
        frames = [frame for _, frame in _decode_rgb(
            container, stream, path, keep=lambda index: None if index > indices[-1] else index in wanted,
            seen=lambda frame: rotations.append(frame.rotation) if not rotations else None)]
        stated_aspect = stream.sample_aspect_ratio
    if not frames:
        raise ValueError(f"cannot decode video file {str(path)!r}: no frame at the picked indices {indices}")
    sample_aspect_ratio = pixel_aspect_ratio(stated_aspect, rotations[0] if rotations else 0.0)
    # A stream shorter than it states keeps what it decoded (a cut-off file): its picks are the frames it has.
    return SampledFrames(frames=tuple(frames), indices=tuple(indices[:len(frames)]), num_frames=num_frames,
                         sample_aspect_ratio=sample_aspect_ratio)


def _count_packets(path: str | os.PathLike[str]) -> int:
    """The first video stream's packets, for a container that states no length (no decode)."""
    with open_input(path) as container:
        stream = _first_video_stream(container, path)
        return sum(1 for packet in container.demux(stream) if packet.size)


def read_sr_source(
    path: str | os.PathLike[str],
    *,
    max_frames: int = MAX_NUM_FRAMES,
    target_fps: int = TARGET_FPS,
    tolerance: float = FPS_TOLERANCE,
) -> SourceClip:
    """Read an SR source with the 24 fps rule, the `max_frames` cap and the 1 + 8k floor.

    Decoding stops as soon as more frames cannot change the selection, so long sources cost only
    the frames that are kept (plus up to one stride when subsampling).
    """
    with SRSourceReader(path, max_frames=max_frames, target_fps=target_fps, tolerance=tolerance) as reader:
        frames = list(reader.frames())
        summary = reader.summary()
    return SourceClip(
        frames=np.stack(frames[: summary.num_frames]),
        fps=summary.fps,
        source_fps=summary.source_fps,
        source_indices=summary.source_indices,
        num_decoded_frames=summary.num_decoded_frames,
        notes=summary.notes,
        sample_aspect_ratio=summary.sample_aspect_ratio,
    )


@dataclass(frozen=True)
class SourcePreview:
    """What `SRSourceReader` will give, told from the file's headers and first frame before the decode."""

    frame_size: tuple[int, int]  # (H, W) of the frames `frames()` yields: the display rotation applied
    # The kept count `summary()` gives if the file is as long as it says (`SRSourceReader.preview`); None when it
    # states no length, or only a duration too short to keep a frame (a stated count that short is refused).
    num_frames: int | None
    fps: int  # `summary().fps`: it depends on the stated frame rate only


@dataclass(frozen=True)
class SourceSummary:
    """What `SRSourceReader` kept: `SourceClip` without the frames."""

    num_frames: int  # 1 + 8k: the first num_frames of the frames the reader yielded
    fps: int
    source_fps: float
    source_indices: tuple[int, ...]
    num_decoded_frames: int
    notes: tuple[str, ...]
    # The first kept frame's presentation time in seconds (None when the file gives none): the soundtrack is
    # aligned to it (`media.audio.read_source_audio`).
    start_time: float | None = None
    # The shape of the source's pixels as its frames are yielded (display rotation applied), width over height;
    # None for square pixels. The upscale keeps it: the output MP4 is tagged with it (`media.mux`).
    sample_aspect_ratio: Fraction | None = None


class SRSourceReader:
    """`read_sr_source` frame by frame, so a caller can work on the first frames while later ones decode.

    `frames()` yields the frames the 24 fps rule selects, in order, before the 1 + 8k floor and the end-of-source
    bound; once it is exhausted, `summary()` says how many of them are kept (a prefix). While it runs,
    `definitely_kept()` says how many of the frames yielded so far are kept whatever follows. Opening checks the
    file (errors name it, as `read_sr_source` does); `close()` (or the `with` block) releases it.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        max_frames: int = MAX_NUM_FRAMES,
        target_fps: int = TARGET_FPS,
        tolerance: float = FPS_TOLERANCE,
    ) -> None:
        if max_frames < 1:
            raise ValueError(f"max_frames must be >= 1, got {max_frames}")
        self.path = path
        self._container = open_input(path)
        try:
            image_demuxer = still_image_demuxer(self._container)
            if image_demuxer is not None and is_animated_webp(path):
                raise ValueError(f"{str(path)!r} is {ANIMATED_WEBP}.")
            if image_demuxer is not None:
                raise ValueError(
                    f"{str(path)!r} is a still image (FFmpeg reads it with its {image_demuxer} demuxer), not a "
                    "video; super-resolution upscales a video: pass an MP4, MKV, MOV or WebM clip."
                )
            self._stream = _first_video_stream(self._container, path)
            self.source_fps = _stream_fps(self._stream, path)
            self.declared_frames = declared_frame_count(self._stream, self.source_fps)
            # Matroska and WebM state no frame count, but their muxers tag each track with its duration: a decode
            # that ends far before the video track's is a cut file too (`summary`). Not the container's duration,
            # which a longer soundtrack sets, nor a count from it, which a variable frame rate breaks.
            self._declared_seconds = (_tagged_duration(self._stream) if self.declared_frames is None else None)
            self._decoded_until: float | None = None  # the end of the last decoded frame, in seconds
            self._start_time: float | None = None  # the first decoded frame's time (always kept), in seconds
            self._sample_aspect_ratio: Fraction | None = None  # the first decoded frame's (`pixel_aspect_ratio`)
            self._colors = SdrFrames()  # HDR and wide-gamut frames brought into BT.709 SDR (`media.color`)
            self._progressive = Deinterlacer()  # an interlaced source's frames made progressive
            self._num_seen = 0
            # Per decoded frame index: its time less its time at the average rate, in seconds.
            self._timing_offsets: dict[int, float] = {}
            self._plan = plan_frame_rate(self.source_fps, target_fps=target_fps, tolerance=tolerance)
            if self._plan.output_fps < 1:
                # Checked here: the 0 would otherwise fail the audio trim or the MP4 writer with no hint of a fix.
                raise ValueError(
                    f"video file {str(path)!r} is {self.source_fps:g} fps: a source slower than {target_fps} fps "
                    "keeps its frame rate rounded to a whole number, and this one rounds to 0 fps, which an MP4 "
                    "cannot play; re-encode it at 1 fps or more (FFmpeg: -r 1)."
                )
        except BaseException:
            self._container.close()
            raise
        self._selection = _FrameSelection(self._plan, max_frames)
        self._max_frames = max_frames
        self._finished = False

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *_) -> None:
        self.close()

    def close(self) -> None:
        self._container.close()

    def stated_frame_size(self) -> tuple[int, int] | None:
        """(H, W) as the stream's header states it, before any frame is decoded and before a display rotation swaps
        the sides; None where the header states none. For bounds that do not depend on the orientation (an
        area): a crafted 16000x8000 source cost its whole first frame's decode (200 MB) before its refusal."""
        context = self._stream.codec_context
        return (context.height, context.width) if context.width > 0 and context.height > 0 else None

    def preview(self) -> SourcePreview:
        """The frame size, kept count and fps of this source, from its headers and its first frame alone (PyAV
        shows the display rotation, which swaps a portrait phone video's width and height, only on decoded frames).
        Use a reader of its own: `frames()` would then start at the second frame.

        The count is what the 24 fps rule, the cap and the 1 + 8k floor keep of the length the file states
        (`declared_frame_count`, else the video track's tagged duration, else the container's, at the stream's
        rate: Matroska and WebM state no count). A file that decodes to another length (cut short, or trimmed by
        an edit list) gets another count from `summary()`."""
        try:
            frame = next(self._container.decode(self._stream), None)
        except av.error.FFmpegError as exc:
            raise ValueError(f"cannot decode video file {str(self.path)!r}: {exc}") from exc
        if frame is None:
            raise ValueError(f"video file {str(self.path)!r} has a video stream but no decodable frames")
        frame_size = (frame.height, frame.width)
        if quarter_turns(frame.rotation) % 2:
            frame_size = (frame.width, frame.height)
        num_source_frames = self.declared_frames
        if num_source_frames is None and self._declared_seconds is not None:
            # The video track's tagged duration: the container's is the longest track's, so a soundtrack longer
            # than the picture made a 9-frame MKV read as 4 s of video at a job's creation.
            num_source_frames = round(self._declared_seconds * self.source_fps)
        if num_source_frames is None and self._container.duration:
            num_source_frames = round(self._container.duration / av.time_base * self.source_fps)
        indices = sr_source_indices(num_source_frames or 0, self._plan, max_frames=self._max_frames)
        if num_source_frames and not indices and self.declared_frames:
            # A count from the sample table (not a duration's estimate): `summary` would refuse it after the load,
            # or after an HTTP job's wait in the queue.
            raise ValueError(self._no_frames(f"it states {num_source_frames} frame(s)"))
        return SourcePreview(frame_size=frame_size, num_frames=floor_frame_count(len(indices)) if indices else None,
                             fps=self._plan.output_fps)

    def _no_frames(self, count: str) -> str:
        """The refusal of a source the 24 fps rule keeps no frame of, which has `count` ("2 decoded frame(s)")."""
        message = f"video file {str(self.path)!r} gives no frames to upscale: {count} at {self.source_fps:g} fps"
        step = self._plan.step
        if step is None:
            return message + "; pass a longer clip"
        # A clip of 1 frame at 30 fps, or 2 at 60, was told only "pass a longer clip", where the same frames at 24
        # fps are upscaled: the subsampling keeps int(N / step) frames, none below one step.
        return (f"{message}, which the 24 fps rule subsamples to {self._plan.output_fps} fps (a frame every "
                f"{step:g}), keeping none of fewer than {math.ceil(step)} frames; pass a clip of at least "
                f"{math.ceil(step)} frames")

    def frames(self) -> Iterator[np.ndarray]:
        """The selected RGB uint8 (H, W, 3) frames, decoded one at a time."""
        for _, frame in _decode_rgb(self._container, self._stream, self.path, keep=self._selection.offer,
                                    seen=self._seen, colors=self._colors, progressive=self._progressive):
            yield frame
        self._finished = True

    def _seen(self, frame: av.VideoFrame) -> None:
        self._num_seen += 1
        if self._num_seen == 1:
            self._start_time = frame.time
            self._sample_aspect_ratio = pixel_aspect_ratio(self._stream.sample_aspect_ratio, frame.rotation)
        if frame.time is not None and self._start_time is not None:
            # Frames are selected by index at the stream's average rate, as the reference does; a variable frame
            # rate (or frames lost in a damaged stretch) puts them elsewhere in time than that rate says, and the
            # soundtrack, aligned by time, parts from the picture by as much (`summary` says so, for the frames
            # kept, beyond VFR_NOTE_SECONDS).
            self._timing_offsets[self._num_seen - 1] = (
                (frame.time - self._start_time) - (self._num_seen - 1) / self.source_fps)
        if self._declared_seconds is not None and frame.time is not None:
            duration = float(frame.duration * frame.time_base) if frame.duration and frame.time_base else 0.0
            self._decoded_until = frame.time + (duration or 1 / self.source_fps)

    def definitely_kept(self) -> int:
        """How many of the frames yielded so far the rule keeps whatever comes after them (the 1 + 8k floor, and
        when subsampling the `i < int(N / step)` bound, which only grows with the source length N)."""
        selection, step = self._selection, self._plan.step
        count = len(selection.indices)
        if step is not None:
            count = min(count, int(selection.num_decoded / step))
        return floor_frame_count(count) if count else 0

    def summary(self) -> SourceSummary:
        """After `frames()` is exhausted: the kept count and what changed relative to the source."""
        if not self._finished:
            raise RuntimeError("SRSourceReader.summary() needs frames() to be exhausted first")
        selection, plan, path = self._selection, self._plan, self.path
        num_decoded = selection.num_decoded
        indices = sr_source_indices(num_decoded, plan, max_frames=self._max_frames)
        # Decoding may have gone past the last selected frame; the selection is always a prefix.
        assert selection.indices[: len(indices)] == indices, (selection.indices, indices)
        if not indices:
            raise ValueError(self._no_frames(f"{num_decoded} decoded frame(s)"))
        num_kept = floor_frame_count(len(indices))
        notes = [plan.note] if plan.note else []
        if plan.note and plan.step is None:
            logger.warning("%s: %s", path, plan.note)
        if not selection.reached_end:
            notes.append(f"kept the first {len(indices)} selected frames (limit {self._max_frames})")
        declared, declared_seconds, decoded_until = self.declared_frames, self._declared_seconds, self._decoded_until
        short = None
        if selection.reached_end and declared and num_decoded < SHORT_DECODE_FRACTION * declared:
            short = f"decoded only {num_decoded} of the {declared} frames the file declares"
        elif (selection.reached_end and declared_seconds and decoded_until is not None
              and decoded_until < SHORT_DECODE_FRACTION * declared_seconds):
            short = (f"decoded only {decoded_until:.2f} s of the {declared_seconds:.2f} s of video the file "
                     "declares")
        if short is not None:
            short += (": it may be damaged or cut short (a partial download?), and the output is as long as what "
                      "decoded; if frames are missing, copy or download the file again")
            logger.warning("%s: %s", path, short)
            notes.append(short)
        offset = max((self._timing_offsets.get(index, 0.0) for index in indices[:num_kept]), key=abs)
        if abs(offset) > VFR_NOTE_SECONDS:
            vfr = (f"the source's frames are not evenly spaced in time (a variable frame rate, or frames missing "
                   f"from a damaged stretch): a kept frame plays {abs(offset):.2f} s "
                   f"{'earlier' if offset < 0 else 'later'} in it than its average {self.source_fps:g} "
                   f"fps puts it, and the output plays its frames at a constant {plan.output_fps} fps, so its "
                   "picture and sound part by up to that much; to keep them together, convert the source to a "
                   f"constant frame rate first (FFmpeg: ffmpeg -i IN -vf fps={plan.output_fps} -c:a copy OUT)")
            logger.warning("%s: %s", path, vfr)
            notes.append(vfr)
        if num_kept < len(indices):
            notes.append(
                f"dropped the last {len(indices) - num_kept} frame(s) so the count is "
                f"1 + {FRAME_COUNT_MULTIPLE}k ({num_kept})"
            )
        sar = self._sample_aspect_ratio
        if sar is not None:
            notes.append(f"the source's pixels are not square (sample aspect ratio {sar.numerator}:{sar.denominator}"
                         "): its frames are as stored, which shows them squeezed or stretched until scaled by that "
                         "ratio")
        if self._progressive.field_order is not None:
            deinterlaced = (f"the source is interlaced ({self._progressive.field_order}): its frames were "
                            "deinterlaced (FFmpeg's bwdif, one frame each, so the frame rate is the source's) before "
                            "upscaling")
            logger.info("%s: %s", path, deinterlaced)
            notes.append(deinterlaced)
        if self._colors.mapping is not None:
            colors = self._colors.mapping.note()
            logger.info("%s: %s", path, colors)
            notes.append(colors)
        return SourceSummary(
            num_frames=num_kept,
            fps=plan.output_fps,
            source_fps=self.source_fps,
            source_indices=tuple(indices[:num_kept]),
            num_decoded_frames=num_decoded,
            notes=tuple(notes),
            start_time=self._start_time,
            sample_aspect_ratio=sar,
        )


class _FrameSelection:
    """Streaming form of `sr_source_indices`: says, frame by frame, whether to keep it and when to stop."""

    def __init__(self, plan: FrameRatePlan, max_frames: int) -> None:
        self.plan = plan
        self.max_frames = max_frames
        self.indices: list[int] = []
        self.num_decoded = 0
        self.reached_end = True

    def offer(self, index: int) -> bool | None:
        """True keeps frame `index`, False skips it, None stops decoding (nothing later is needed)."""
        if self._enough():
            self.reached_end = False
            return None
        self.num_decoded = index + 1
        step = self.plan.step
        wanted = len(self.indices) if step is None else round(len(self.indices) * step)
        keep = index == wanted and len(self.indices) < self.max_frames
        if keep:
            self.indices.append(index)
        return keep

    def _enough(self) -> bool:
        if len(self.indices) < self.max_frames:
            return False
        if self.plan.step is None:
            return True
        # The full rule only keeps i < int(N / step): once that bound reaches max_frames for the
        # frames seen so far, it does for any longer source too.
        return int(self.num_decoded / self.plan.step) >= self.max_frames


def _first_video_stream(
    container: av.container.InputContainer, path: str | os.PathLike[str]
) -> av.video.stream.VideoStream:
    streams = video_streams(container)
    if not streams:
        raise ValueError(
            f"media file {str(path)!r} has no video stream (found: {describe_streams(container)}); "
            "pass a file that contains video"
        )
    return streams[0]


def declared_frame_count(stream: av.video.stream.VideoStream, fps: float) -> int | None:
    """The frame count the container states for `stream` (MP4/MOV's sample table), else one from the duration it
    states at `fps` (`_stream_fps`); None when it states neither (Matroska and WebM state no per-stream length)."""
    if stream.frames:
        return stream.frames
    if stream.duration and stream.time_base:
        return round(float(stream.duration * stream.time_base) * fps)
    return None


def _tagged_duration(stream: av.video.stream.VideoStream) -> float | None:
    """The stream's DURATION tag in seconds ("00:00:04.031000000", as FFmpeg's and mkvmerge's Matroska muxers
    write it per track), or None."""
    tag = stream.metadata.get("DURATION")
    match = re.fullmatch(r"(\d+):(\d{1,2}):(\d{1,2}(?:\.\d+)?)", tag.strip()) if tag else None
    if match is None:
        return None
    hours, minutes, seconds = match.groups()
    return int(hours) * 3600 + int(minutes) * 60 + float(seconds)


def _stream_fps(stream: av.video.stream.VideoStream, path: str | os.PathLike[str]) -> float:
    rate = stream.average_rate or stream.base_rate
    if not rate or rate <= 0:
        raise ValueError(
            f"video file {str(path)!r} does not report a frame rate (average rate "
            f"{stream.average_rate}, base rate {stream.base_rate}); re-mux it with a frame rate"
        )
    return float(rate)


def _decode_rgb(
    container: av.container.InputContainer,
    stream: av.video.stream.VideoStream,
    path: str | os.PathLike[str],
    keep: Callable[[int], bool | None],
    seen: Callable[[av.VideoFrame], None] | None = None,
    colors: SdrFrames | None = None,
    progressive: Deinterlacer | None = None,
) -> Iterator[tuple[int, np.ndarray]]:
    """Yield (index, RGB frame) for decoded frames where `keep(index)` is True; stop on None. `seen` gets every
    decoded frame, kept or not; `progressive` deinterlaces them and `colors` converts them (BT.709 SDR RGB); new
    ones when None."""
    colors = SdrFrames() if colors is None else colors
    progressive = Deinterlacer() if progressive is None else progressive
    stream.codec_context.thread_type = "AUTO"
    size = None
    try:
        for index, frame in enumerate(progressive.frames(container.decode(stream), stream)):
            decision = keep(index)
            if seen is not None and decision is not None:
                seen(frame)
            if decision is None:
                return
            if not decision:
                continue
            if size is None:
                size = (frame.width, frame.height)
            elif (frame.width, frame.height) != size:
                raise ValueError(
                    f"video file {str(path)!r} changes frame size at frame {index} "
                    f"({size[0]}x{size[1]} -> {frame.width}x{frame.height}); re-encode it at one size"
                )
            yield index, upright(colors.rgb(frame), frame.rotation, display_matrix(frame))
    except av.error.FFmpegError as exc:
        raise ValueError(f"cannot decode video file {str(path)!r}: {exc}") from exc
