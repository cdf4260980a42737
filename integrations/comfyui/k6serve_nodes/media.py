"""ComfyUI tensors <-> files: the conditioning PNG, the MP4 the server returns, and the clip sent for upscaling.

ComfyUI's IMAGE is a float tensor [N, H, W, 3] in 0..1; AUDIO is {"waveform": [1, channels, samples],
"sample_rate": int}. PyAV (`av`) is imported only when a video is decoded or encoded.
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path

import numpy as np
import torch

SILENCE_SAMPLE_RATE = 44100  # k6serve's audio rate, used for the silent track of a video without audio


@dataclass(frozen=True)
class DecodedVideo:
    frames: torch.Tensor  # [N, H, W, 3] float32 in 0..1
    audio: dict  # ComfyUI AUDIO
    fps: float
    has_audio: bool


def require_av():
    """PyAV, or an ImportError that says how to install it into ComfyUI's Python."""
    try:
        import av
    except ImportError:
        raise ImportError(
            "The k6serve ComfyUI nodes need PyAV (`av`) to read and write MP4 files, and it is not installed in "
            "ComfyUI's Python environment. Install it there: `python -m pip install av` (with the portable build: "
            "`python_embeded\\python.exe -m pip install av`), then restart ComfyUI.") from None
    return av


def image_to_uint8(image: torch.Tensor) -> np.ndarray:
    """The first frame of a ComfyUI IMAGE as a uint8 [H, W, 3] array."""
    if image.ndim == 3:
        image = image[None]
    if image.ndim != 4 or image.shape[-1] not in (1, 3, 4):
        raise ValueError(f"expected a ComfyUI IMAGE [N, H, W, 3], got shape {tuple(image.shape)}")
    frame = image[0, ..., :3]
    if frame.shape[-1] == 1:
        frame = frame.expand(*frame.shape[:2], 3)
    return frames_to_uint8(frame[None])[0]


def frames_to_uint8(frames: torch.Tensor) -> np.ndarray:
    """IMAGE [N, H, W, 3] in 0..1 -> uint8 [N, H, W, 3], rounded."""
    return (frames.detach().to("cpu", torch.float32).clamp(0, 1) * 255).round().to(torch.uint8).numpy()


def encode_png(pixels_HWC: np.ndarray) -> bytes:
    """An 8-bit RGB PNG (standard library zlib; no Pillow needed)."""
    height, width, _ = pixels_HWC.shape
    rows = np.concatenate([np.zeros((height, 1), np.uint8), pixels_HWC.reshape(height, width * 3)], axis=1)

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)  # 8-bit truecolour, no interlace
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(rows.tobytes(), 6))
            + chunk(b"IEND", b""))


def decode_video(path: Path, check: Callable[[], None] = lambda: None) -> DecodedVideo:
    """Every frame of the first video stream, the first audio stream (silence of the clip's length if none).
    `check` runs between decoded frames and may raise to stop (ComfyUI's Cancel, the node's timeout_s): a long 4x
    upscale takes a while to decode."""
    av = require_av()
    with av.open(str(path)) as container:
        stream = container.streams.video[0]
        rate = stream.average_rate or stream.guessed_rate or stream.base_rate
        fps = float(rate) if rate else 24.0
        frames = _decode_frames(container, stream, check)
    with av.open(str(path)) as container:
        waveform, sample_rate = _decode_audio(av, container, check)
    has_audio = waveform is not None
    if waveform is None:
        num_samples = round(frames.shape[0] / fps * SILENCE_SAMPLE_RATE)
        waveform, sample_rate = torch.zeros(1, 1, num_samples), SILENCE_SAMPLE_RATE
    return DecodedVideo(frames=frames, audio={"waveform": waveform, "sample_rate": sample_rate}, fps=fps,
                        has_audio=has_audio)


def _decode_frames(container, stream, check: Callable[[], None]) -> torch.Tensor:
    # Kept as uint8 until the float tensor is filled: a 4x upscale is gigabytes as float32, so the peak stays at
    # 1.25x the result instead of 2x.
    frames = []
    for frame in container.decode(stream):
        check()
        frames.append(frame.to_ndarray(format="rgb24"))
    if not frames:
        raise ValueError("the video has no frames")
    out = torch.empty((len(frames), *frames[0].shape), dtype=torch.float32)
    for index in range(len(frames)):
        out[index] = torch.from_numpy(frames[index])
        frames[index] = None  # release as we go
    return out.div_(255.0)


def _decode_audio(av, container, check: Callable[[], None]) -> tuple[torch.Tensor | None, int]:
    if not container.streams.audio:
        return None, 0
    stream = container.streams.audio[0]
    # Packed samples, one plane, split into channels here: PyAV 18's planar frames of 8 channels crash to_ndarray.
    channels = stream.channels
    resampler = av.AudioResampler(format="flt", layout=stream.layout.name, rate=stream.rate)
    chunks = []
    for frame in container.decode(stream):
        check()
        chunks += [resampled.to_ndarray().reshape(-1, channels).T for resampled in resampler.resample(frame)]
    chunks += [resampled.to_ndarray().reshape(-1, channels).T for resampled in resampler.resample(None)]
    if not chunks:
        return None, 0
    waveform = torch.from_numpy(np.concatenate(chunks, axis=1).astype(np.float32))  # [channels, samples]
    return waveform[None], stream.rate


def encode_video(path: Path, frames: torch.Tensor, fps: float, audio: dict | None,
                 check: Callable[[], None] = lambda: None) -> Path:
    """A near-lossless MP4 of IMAGE frames (H.264 4:4:4, CRF 10) with optional AAC audio, to upload for SR.
    `check` runs between frames and may raise to stop, as in `decode_video`."""
    av = require_av()
    pixels = frames_to_uint8(frames)
    rate = Fraction(fps).limit_denominator(1001)
    with av.open(str(path), mode="w") as container:
        video = container.add_stream("libx264", rate=rate)
        video.width, video.height = pixels.shape[2], pixels.shape[1]
        video.pix_fmt = "yuv444p"
        video.codec_context.options = {"crf": "10"}
        audio_stream = None
        if audio is not None:
            waveform, layout = _channels_for_aac(audio["waveform"][0].detach().to("cpu", torch.float32).numpy())
            audio_stream = container.add_stream("aac", rate=int(audio["sample_rate"]), layout=layout)
        for index, frame_HWC in enumerate(pixels):
            check()
            frame = av.VideoFrame.from_ndarray(frame_HWC, format="rgb24")
            frame.pts = index
            container.mux(video.encode(frame))
        container.mux(video.encode(None))
        if audio_stream is not None:
            _encode_audio(av, container, audio_stream, waveform, layout, int(audio["sample_rate"]))
    return path


# FFmpeg's layouts by channel count, in its channel order (what `_decode_audio` gives back for such a file).
_LAYOUTS = {1: "mono", 2: "stereo", 3: "2.1", 4: "quad", 5: "5.0", 6: "5.1", 7: "6.1", 8: "7.1"}


def _channels_for_aac(waveform: np.ndarray) -> tuple[np.ndarray, str]:
    """[channels, samples] and its layout, every channel kept: the server downmixes to mono with FFmpeg's weights
    (centre and surrounds included). Only the first two were kept, so a 5.1 track lost its centre, the dialogue.
    More than 8 channels have no layout and are averaged to mono."""
    if waveform.shape[0] in _LAYOUTS:
        return waveform, _LAYOUTS[waveform.shape[0]]
    return waveform.mean(axis=0, keepdims=True), "mono"


def _encode_audio(av, container, stream, waveform: np.ndarray, layout: str, sample_rate: int) -> None:
    frame_size = stream.codec_context.frame_size or 1024
    for start in range(0, waveform.shape[1], frame_size):
        # Packed (interleaved) samples, one plane: PyAV 18 builds a planar frame of 8 channels wrongly (7.1 raised
        # IndexError); the encoder converts to its own planar format.
        chunk = waveform[:, start:start + frame_size]
        frame = av.AudioFrame.from_ndarray(np.ascontiguousarray(chunk.T.reshape(1, -1)), format="flt", layout=layout)
        frame.sample_rate = sample_rate
        frame.pts = start
        container.mux(stream.encode(frame))
    container.mux(stream.encode(None))
