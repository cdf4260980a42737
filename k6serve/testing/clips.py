"""Synthetic media files for tests: a smooth moving pattern, optionally with a tone soundtrack."""

from __future__ import annotations

import os
from fractions import Fraction
from pathlib import Path
from typing import Literal

import av
import numpy as np

from k6serve.media.mux import fps_fraction, x264_cpu_flags

AudioKind = Literal["none", "mono_tone", "stereo_tone"]
_FORMATS = {".mp4": "mp4", ".mkv": "matroska", ".mov": "mov"}


def moving_pattern(width: int, height: int, num_frames: int, *, first_frame: int = 0) -> np.ndarray:
    """uint8 (T, H, W, 3) frames of smooth gradients that drift every frame (cheap to encode well), from frame
    `first_frame` of the pattern on."""
    t = np.arange(first_frame, first_frame + num_frames, dtype=np.float64)[:, None, None]
    y = np.arange(height, dtype=np.float64)[None, :, None] / height
    x = np.arange(width, dtype=np.float64)[None, None, :] / width
    red = 128 + 90 * np.sin(2 * np.pi * (x + t / 40))
    green = 128 + 90 * np.cos(2 * np.pi * (y - t / 50))
    blue = 60 + 140 * (x + y) / 2 + 0 * t
    frames_THWC = np.stack(np.broadcast_arrays(red, green, blue), axis=-1)
    return np.round(frames_THWC).astype(np.uint8)


def tone(num_samples: int, sample_rate: int, tone_hz: float, num_channels: int) -> np.ndarray:
    """float32 (num_channels, num_samples) sine at amplitude 0.5; channel c plays (c + 1) * tone_hz."""
    time_s = np.arange(num_samples, dtype=np.float64) / sample_rate
    channels = [0.5 * np.sin(2 * np.pi * (c + 1) * tone_hz * time_s) for c in range(num_channels)]
    return np.stack(channels).astype(np.float32)


def make_clip(
    path: str | os.PathLike[str],
    *,
    width: int,
    height: int,
    num_frames: int,
    fps: float | Fraction,
    audio: AudioKind = "none",
    audio_rate: int = 48000,
    tone_hz: float = 440.0,
    rotation: int = 0,
    faststart: bool = False,
    audio_delay: float = 0.0,
    sample_aspect_ratio: Fraction | None = None,
    hdr_transfer: int | None = None,
    color_primaries: int | None = None,
) -> Path:
    """Write `moving_pattern` as H.264 in an .mp4/.mkv/.mov, with an AAC tone as long as the video; `rotation`
    (degrees counter-clockwise) is stored as the display matrix a phone writes for a portrait video; `faststart`
    puts an MP4/MOV's index before the media data, as web downloads have it (a cut copy then still opens);
    `audio_delay` (seconds) starts the soundtrack that much after the first frame, or (< 0) the video that many
    whole frames after the soundtrack, as camera files and stream-copy cuts have it. `sample_aspect_ratio` tags
    non-square pixels (an anamorphic DVD or camera file: a 4:3 ratio shows 64x48 as 16:9); `hdr_transfer` (FFmpeg's
    AVCOL_TRC_*: 16 PQ, 18 HLG) tags the stream HDR, BT.2020, as an HDR10 or HLG camera file is; `color_primaries`
    (AVCOL_PRI_*: 9 BT.2020, 12 Display P3) tags the stream's primaries (and, for 9, its matrix). Only the tags: the
    pixels are the pattern's codes either way."""
    path = Path(path)
    if path.suffix not in _FORMATS:
        raise ValueError(f"clip suffix must be one of {sorted(_FORMATS)}, got {path.name!r}")
    if audio not in ("none", "mono_tone", "stereo_tone"):
        raise ValueError(f"audio must be 'none', 'mono_tone' or 'stereo_tone', got {audio!r}")
    rate = fps_fraction(fps)
    num_channels = {"none": 0, "mono_tone": 1, "stereo_tone": 2}[audio]
    options = {"movflags": "faststart"} if faststart else {}
    with av.open(str(path), mode="w", format=_FORMATS[path.suffix], options=options) as container:
        # Every stream must exist before the first packet is muxed.
        stream = container.add_stream("libx264", rate=rate)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        stream.time_base = stream.codec_context.time_base = 1 / rate
        # x264's AVX-512 code makes the bytes differ from run to run (media/mux.py): off, so two clips made from
        # the same frames are the same file and tests may compare them.
        asm = x264_cpu_flags()
        stream.codec_context.options = {"crf": "10", "threads": "1"} | ({"x264-params": f"asm={asm}"} if asm else {})
        if rotation:
            stream.set_display_rotation(rotation)
        if sample_aspect_ratio is not None:
            stream.codec_context.sample_aspect_ratio = sample_aspect_ratio
        if hdr_transfer is not None:
            stream.codec_context.color_trc = hdr_transfer
            stream.codec_context.color_primaries = stream.codec_context.colorspace = 9  # BT.2020 (non-constant)
        if color_primaries is not None:
            stream.codec_context.color_primaries = color_primaries
            if color_primaries == 9:
                stream.codec_context.colorspace = 9
        audio_stream = (
            _add_aac_stream(container, audio_rate, num_channels) if num_channels else None
        )
        # One frame at a time: the whole clip's float64 intermediates peaked at about 60 bytes a pixel (15 GB for a
        # 1920x1080x121 server warm-up source, runtime/warmup_sizes.py).
        for index in range(num_frames):
            frame_HWC = moving_pattern(width, height, 1, first_frame=index)[0]
            frame = av.VideoFrame.from_ndarray(frame_HWC, format="rgb24")
            frame.pts = index + (round(-audio_delay * rate) if audio_delay < 0 else 0)
            container.mux(stream.encode(frame))
        container.mux(stream.encode(None))
        if audio_stream is not None:
            num_samples = round(num_frames / rate * audio_rate)
            waveform_CN = tone(num_samples, audio_rate, tone_hz, num_channels)
            _encode_audio(container, audio_stream, waveform_CN, audio_rate,
                          first_pts=round(max(audio_delay, 0) * audio_rate))
    return path


def make_audio_only_file(
    path: str | os.PathLike[str], *, seconds: float, sample_rate: int = 44100, cover_art: bool = False
) -> Path:
    """Write an .mp4 holding only a mono AAC tone (no video stream), for error-path tests; with `cover_art`, also a
    32x32 MJPEG picture flagged as attached (a music file's cover, which FFmpeg lists as a video stream)."""
    path = Path(path)
    with av.open(str(path), mode="w", format="mp4") as container:
        stream = _add_aac_stream(container, sample_rate, 1)
        write_cover = add_cover_art(container) if cover_art else None
        if write_cover is not None:
            write_cover()
        waveform_CN = tone(round(seconds * sample_rate), sample_rate, 440.0, 1)
        _encode_audio(container, stream, waveform_CN, sample_rate)
    return path


def add_cover_art(container):
    """Add a one-picture MJPEG stream flagged `attached_pic` to `container` (open for writing); returns the call that
    writes its picture, to make once every stream exists (the first packet writes the header)."""
    picture = container.add_stream("mjpeg", rate=1)
    picture.width = picture.height = 32
    picture.pix_fmt = "yuvj420p"
    picture.disposition = av.stream.Disposition.attached_pic

    def write() -> None:
        frame = av.VideoFrame.from_ndarray(np.full((32, 32, 3), 128, np.uint8), format="rgb24").reformat(
            format="yuvj420p")
        frame.pts = 0
        container.mux(picture.encode(frame))
        container.mux(picture.encode(None))

    return write


def _add_aac_stream(container, sample_rate: int, num_channels: int):
    stream = container.add_stream("aac", rate=sample_rate)
    stream.layout = "stereo" if num_channels == 2 else "mono"
    stream.time_base = stream.codec_context.time_base = Fraction(1, sample_rate)
    return stream


def _encode_audio(container, stream, waveform_CN: np.ndarray, sample_rate: int, first_pts: int = 0) -> None:
    layout = "stereo" if waveform_CN.shape[0] == 2 else "mono"
    for start in range(0, waveform_CN.shape[1], 1024):
        chunk_CN = np.ascontiguousarray(waveform_CN[:, start : start + 1024])
        frame = av.AudioFrame.from_ndarray(chunk_CN, format="fltp", layout=layout)
        frame.sample_rate = sample_rate
        frame.pts = first_pts + start
        container.mux(stream.encode(frame))
    container.mux(stream.encode(None))
