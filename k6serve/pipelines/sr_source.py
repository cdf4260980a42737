"""The first SR stage: read the source and encode it, the encode running while later frames still decode.

The source (the 24 fps rule, <= 121 frames, the 1 + 8k floor: `media.video.SRSourceReader`) decodes on a
background thread, and the K-VAE encodes each causal segment (17 frames, then 16 each: `encode_segment_lengths`) as
soon as its frames are certain to be kept, so the GPU encode overlaps the CPU decode instead of following it. The
segments are the ones `SRVAE.encode_clip` uses for the whole clip, pushed in the same order through one cache chain,
so the latent is the same tensor (tests/unit/test_sr_source.py). The plan (scale, tile grid: every request error)
is made from the first frame's size, before any GPU work. The soundtrack is read on the same thread after the last
frame, beside the rest of the encode.

Timings: "read" is the time until the source (frames and soundtrack) was read, "encode" the rest of the stage
until the latent is ready; they add up to the stage's time, and the encode's work before the read ended is hidden
in "read".
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from fractions import Fraction

import numpy as np
import torch
from torch import Tensor

from k6serve.media.audio import OUTPUT_SAMPLE_RATE, processed_num_samples, read_source_audio
from k6serve.media.video import SourceSummary, SRSourceReader
from k6serve.models.kandinsky6_sr.vae import (
    ENCODE_SEGMENT_FRAMES,
    SRVAE,
    CausalClipEncoder,
    encode_segment_lengths,
)
from k6serve.pipelines.sr_plan import UpscalePlan
from k6serve.pipelines.sr_stages import prepare_pixels
from k6serve.pipelines.state import DecodedAudio

# Decoded frames waiting for the encode: bounds host memory for large sources (a 4K RGB frame is 25 MB).
_QUEUE_FRAMES = 48


@dataclass(frozen=True, eq=False)
class EncodedSource:
    """The source as the later stages need it: its latent, plan, soundtrack and what the reader changed."""

    latent_BCThw: Tensor  # (1, C, T', h, w) scaled posterior mean of the padded, pre-upscaled clip
    plan: UpscalePlan
    num_frames: int  # 1 + 8k kept source frames
    fps: int  # fps of the processed clip (and of the output file)
    # Mono 44.1 kHz, at most round(T / fps * 44100) samples; None for a silent source.
    audio: DecodedAudio | None
    notes: tuple[str, ...]
    sample_aspect_ratio: Fraction | None = None  # the source's non-square pixels, kept by the output file


def read_and_encode(
    vae: SRVAE,
    video_path: str,
    device: torch.device,
    make_plan: Callable[[tuple[int, int]], UpscalePlan],
    timings: dict[str, float],
) -> EncodedSource:
    """Read `video_path` and encode it segment by segment as its frames arrive; `make_plan((H, W))` plans the
    request from the source size (its errors are raised before any GPU work). Fills timings "read" and "encode"."""
    start = time.perf_counter()
    source = _BackgroundSource(video_path)
    try:
        encoder = vae.clip_encoder()
        pending: list[np.ndarray] = []  # decoded frames not yet encoded
        plan: UpscalePlan | None = None
        encoded = 0
        while True:
            item = source.next()
            if isinstance(item, _End):
                break
            frame, definitely_kept = item
            if plan is None:
                plan = make_plan(frame.shape[:2])
            pending.append(frame)
            # Segment lengths do not depend on the final count until its last segment: 17, then 16 each.
            length = _next_full_segment(encoded)
            while encoded + length <= definitely_kept:
                _push(encoder, pending[:length], plan, device)
                del pending[:length]
                encoded += length
                length = _next_full_segment(encoded)
        summary, audio, read_s, audio_notes = item.summary, item.audio, item.read_s, item.audio_notes
    finally:
        source.close()
    assert plan is not None, "the reader raises for a source without frames"
    lengths = encode_segment_lengths(summary.num_frames)
    done = len(encoder.segment_lengths)
    assert lengths[:done] == encoder.segment_lengths, (lengths, encoder.segment_lengths)
    for length in lengths[done:]:
        _push(encoder, pending[:length], plan, device)
        del pending[:length]
    latent = encoder.latent()
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # GPU work is asynchronous: charge it to this stage
    timings["read"] = read_s
    timings["encode"] = time.perf_counter() - start - read_s
    waveform = None if audio is None else DecodedAudio(waveform=audio, sample_rate=OUTPUT_SAMPLE_RATE)
    return EncodedSource(latent_BCThw=latent, plan=plan, num_frames=summary.num_frames, fps=summary.fps,
                         audio=waveform, notes=summary.notes + audio_notes,
                         sample_aspect_ratio=summary.sample_aspect_ratio)


def _next_full_segment(encoded: int) -> int:
    return ENCODE_SEGMENT_FRAMES + 1 if encoded == 0 else ENCODE_SEGMENT_FRAMES


def _push(encoder: CausalClipEncoder, frames: list[np.ndarray], plan: UpscalePlan, device: torch.device) -> None:
    frames_TCHW = torch.from_numpy(np.stack(frames)).to(device).permute(0, 3, 1, 2)
    encoder.push(prepare_pixels(frames_TCHW, plan).permute(1, 0, 2, 3).unsqueeze(0))


@dataclass(frozen=True, eq=False)
class _End:
    summary: SourceSummary
    audio: np.ndarray | None
    read_s: float  # from the reader's start to the end of the soundtrack read
    audio_notes: tuple[str, ...] = ()  # the soundtrack's (`read_source_audio`)


class _BackgroundSource:
    """`SRSourceReader` on a daemon thread: `next()` returns (frame, definitely kept so far) or the `_End`, and
    re-raises what the thread raised. Opening happens on the caller's thread, so a missing or unreadable file fails
    at once with the reader's message. `close()` stops the thread (at its next frame) and waits for it."""

    def __init__(self, video_path: str) -> None:
        self._start = time.perf_counter()
        self._reader = SRSourceReader(video_path)
        self._path = video_path
        self._queue: queue.Queue = queue.Queue(maxsize=_QUEUE_FRAMES)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="k6serve-sr-source", daemon=True)
        self._thread.start()

    def next(self) -> tuple[np.ndarray, int] | _End:
        kind, payload = self._queue.get()
        if kind == "error":
            raise payload
        return payload

    def close(self) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        try:
            with self._reader as reader:
                for frame in reader.frames():
                    if not self._put(("frame", (frame, reader.definitely_kept()))):
                        return
                summary = reader.summary()
            audio_notes: list[str] = []
            audio = read_source_audio(
                self._path,
                sample_rate=OUTPUT_SAMPLE_RATE,
                num_samples=processed_num_samples(summary.num_frames, summary.fps, OUTPUT_SAMPLE_RATE),
                video_start=summary.start_time,
                notes=audio_notes,
            )
            self._put(("end", _End(summary=summary, audio=audio, read_s=time.perf_counter() - self._start,
                                   audio_notes=tuple(audio_notes))))
        except BaseException as error:  # noqa: BLE001 - handed to the consumer, which raises it
            self._put(("error", error))

    def _put(self, item) -> bool:
        """Queue `item` unless the consumer has stopped; False once it has."""
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.05)
                return True
            except queue.Full:
                continue
        return False
