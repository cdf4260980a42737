"""What a media file contains, measured by decoding it (for tests and the CLI summary)."""

from __future__ import annotations

import os
from dataclasses import dataclass

import av

from k6serve.media.container import describe_streams, open_input


@dataclass(frozen=True)
class MediaInfo:
    """Facts about a file's first video stream and first audio stream."""

    width: int
    height: int
    num_frames: int  # decoded frames, not the container's (often missing) count
    fps: float  # average rate, or base rate when the container has no average
    video_codec: str
    has_audio: bool
    audio_codec: str | None
    audio_sample_rate: int | None
    audio_channels: int | None
    # Decoded samples per channel at the stream's own rate. For AAC the decoder drops the
    # encoder's priming samples but keeps the padding of the last frame, so this can exceed the
    # encoded waveform by up to one AAC frame (1,024 samples).
    audio_num_samples: int | None


def probe(path: str | os.PathLike[str]) -> MediaInfo:
    """Decode `path` once and report sizes, rates, codecs and counts."""
    with open_input(path) as container:
        if not container.streams.video:
            raise ValueError(
                f"media file {str(path)!r} has no video stream (found: {describe_streams(container)})"
            )
        video_stream = container.streams.video[0]
        audio_stream = container.streams.audio[0] if container.streams.audio else None
        rate = video_stream.average_rate or video_stream.base_rate
        num_frames = 0
        num_samples = 0
        streams = [video_stream] if audio_stream is None else [video_stream, audio_stream]
        try:
            for frame in container.decode(*streams):
                if isinstance(frame, av.VideoFrame):
                    num_frames += 1
                else:
                    num_samples += frame.samples
        except av.error.FFmpegError as exc:
            raise ValueError(f"cannot decode media file {str(path)!r}: {exc}") from exc
        audio = None if audio_stream is None else audio_stream.codec_context
        return MediaInfo(
            width=video_stream.codec_context.width,
            height=video_stream.codec_context.height,
            num_frames=num_frames,
            fps=float(rate) if rate else 0.0,
            video_codec=video_stream.codec_context.name,
            has_audio=audio is not None,
            audio_codec=None if audio is None else audio.name,
            audio_sample_rate=None if audio is None else audio.sample_rate,
            audio_channels=None if audio is None else audio.layout.nb_channels,
            audio_num_samples=None if audio is None else num_samples,
        )
