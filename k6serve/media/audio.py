"""Reading the source soundtrack of an SR request (k6-super-resolution.md §2.13).

The soundtrack is kept, converted to mono 44.1 kHz float32 and trimmed to the processed video
duration, round(num_frames / fps * 44100) samples. As in the reference it is only trimmed, never
padded: a soundtrack shorter than the processed video stays shorter, and the output file then
has audio that ends before the video does.
"""

from __future__ import annotations

import logging
import os

import av
import numpy as np

from k6serve.media.container import open_input

logger = logging.getLogger(__name__)

OUTPUT_SAMPLE_RATE = 44100


def processed_num_samples(
    num_frames: int, fps: float, sample_rate: int = OUTPUT_SAMPLE_RATE
) -> int:
    """Audio samples covering `num_frames` video frames at `fps` (Python round, half-to-even)."""
    if num_frames < 1 or not fps > 0:
        raise ValueError(f"need num_frames >= 1 and fps > 0, got {num_frames} frames at {fps} fps")
    return round(num_frames / fps * sample_rate)


def read_source_audio(
    path: str | os.PathLike[str],
    *,
    sample_rate: int = OUTPUT_SAMPLE_RATE,
    num_samples: int | None,
) -> np.ndarray | None:
    """First audio stream as mono float32 in [-1, 1] at `sample_rate`, cut to `num_samples`.

    Returns None when the file has no audio stream, or one that decodes to no samples (the output
    is then video-only). `num_samples=None` keeps the whole soundtrack. Decoding stops once
    `num_samples` samples exist: resampled samples already emitted never change, so this equals
    decoding everything and trimming.
    """
    if num_samples is not None and num_samples < 1:
        raise ValueError(f"num_samples must be >= 1 or None, got {num_samples}")
    with open_input(path) as container:
        if not container.streams.audio:
            return None
        stream = container.streams.audio[0]
        resampler = av.AudioResampler(format="fltp", layout="mono", rate=sample_rate)
        chunks: list[np.ndarray] = []
        num_collected = 0
        try:
            for frame in container.decode(stream):
                for resampled in resampler.resample(frame):
                    chunks.append(resampled.to_ndarray()[0])
                    num_collected += resampled.samples
                if num_samples is not None and num_collected >= num_samples:
                    break
            else:
                chunks.extend(resampled.to_ndarray()[0] for resampled in resampler.resample(None))
        except av.error.FFmpegError as exc:
            raise ValueError(f"cannot decode the audio of {str(path)!r}: {exc}") from exc
    if sum(chunk.shape[0] for chunk in chunks) == 0:
        logger.warning("%s: the audio stream has no samples; writing video only", path)
        return None
    # fltp output is already float; the clip guards against resampler overshoot on loud input.
    waveform = np.clip(np.concatenate(chunks).astype(np.float32, copy=False), -1.0, 1.0)
    if num_samples is not None:
        if waveform.shape[0] < num_samples:
            logger.info(
                "%s: soundtrack has %d samples, shorter than the %d of the processed video; "
                "kept as is (audio is trimmed, never padded)",
                path,
                waveform.shape[0],
                num_samples,
            )
        waveform = waveform[:num_samples]
    return waveform
