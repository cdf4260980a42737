"""Opening media files for reading, with errors that say which file and what was wrong."""

from __future__ import annotations

import os
from pathlib import Path

import av
import av.container

from k6serve.media.image import looks_like_url, shown_path


def open_input(path: str | os.PathLike[str]) -> av.container.InputContainer:
    """Open `path` for demuxing; a missing or unreadable file raises ValueError naming it."""
    if looks_like_url(os.fspath(path)) and not os.path.exists(path):
        raise ValueError(f"cannot read media file {shown_path(os.fspath(path))}: k6serve fetches no URLs; download "
                         "the video and pass the file's path")
    path = Path(path)
    if not path.is_file():
        what = "is a directory" if path.is_dir() else "does not exist"
        raise ValueError(f"cannot read media file {str(path)!r}: it {what}; pass a video file path")
    if is_pdf(path):
        # FFmpeg's mjpeg demuxer reads the JPEG of each page as a video frame: a PDF was upscaled as a clip.
        raise ValueError(f"cannot read media file {str(path)!r}: it is a PDF document, not a video; pass a video "
                         "file such as an MP4, MKV, MOV or WebM")
    try:
        return av.open(str(path), mode="r")
    except (av.error.FFmpegError, UnicodeDecodeError) as exc:
        raise ValueError(
            f"cannot read media file {str(path)!r}: FFmpeg could not open it ({exc}); "
            "pass a valid video file such as an MP4, MKV, MOV or WebM"
        ) from exc


def describe_streams(container: av.container.InputContainer) -> str:
    """One-line list of the streams in `container`, for error messages."""
    if not container.streams:
        return "no streams"
    parts = []
    for stream in container.streams:
        codec_name = stream.codec_context.name if stream.codec_context is not None else "unknown"
        parts.append(f"{stream.type} ({codec_name})")
    return ", ".join(parts)


def still_image_demuxer(container: av.container.InputContainer) -> str | None:
    """The demuxer's name when FFmpeg read `container` as a still image (its image2 or *_pipe image demuxers,
    e.g. png_pipe, jpeg_pipe), else None. Such a file still shows one video stream, at a made-up 25 fps."""
    name = container.format.name
    return name if name in ("image2", "image2pipe") or name.endswith("_pipe") else None


def is_pdf(path: str | os.PathLike[str]) -> bool:
    """Whether the file starts as a PDF document (which FFmpeg's mjpeg demuxer reads as video: its pages' JPEGs)."""
    try:
        with open(path, "rb") as file:
            return file.read(5) == b"%PDF-"
    except OSError:
        return False
