"""Opening media files for reading, with errors that say which file and what was wrong."""

from __future__ import annotations

import os
from pathlib import Path

import av
import av.container

from k6serve.media.image import looks_like_url, shown_path


# The demuxers a video input may be read with. Not FFmpeg's whole list: its playlist and stream-description readers
# (hls for an .m3u8, concat, dash, sdp / rtp / rtsp) open the files or network addresses the input names, so an
# uploaded playlist read any video on the server, outside --allowed-input-dir (its frames upscaled for download).
# The image demuxers stay, so that a still image is told apart from a video.
VIDEO_DEMUXERS = ("mov", "matroska", "avi", "mpegts", "flv", "live_flv", "mpeg", "ogg", "asf", "mxf", "gif", "apng",
                  "nut", "dv", "ivf", "rm", "wtv", "swf", "h264", "hevc", "vvc", "h263", "m4v", "vc1", "av1", "obu",
                  "dirac", "cavsvideo", "mjpeg", "mjpeg_2000", "mpegvideo", "yuv4mpegpipe", "image2",
                  *sorted(name for name in av.formats_available if name.endswith("_pipe")))
_WHITELIST = {"format_whitelist": ",".join(VIDEO_DEMUXERS)}
REFUSED_DEMUXER = ("FFmpeg reads it as a format k6serve does not open (a playlist such as HLS .m3u8, a concat list "
                   "or a stream description such as SDP, which read other files or the network, or a container "
                   "outside the video formats k6serve reads)")


def open_media(path: str | os.PathLike[str]) -> av.container.InputContainer:
    """`av.open(path)` for reading, with FFmpeg held to `VIDEO_DEMUXERS`; a demuxer outside them raises
    av.error.ArgumentError (EINVAL), which `refused_demuxer` tells apart."""
    return av.open(str(path), mode="r", container_options=dict(_WHITELIST))


def refused_demuxer(error: BaseException) -> bool:
    """Whether `open_media` failed on the demuxer list (FFmpeg answers EINVAL; a damaged file gets another error)."""
    return isinstance(error, av.error.ArgumentError)


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
        return open_media(path)
    except (av.error.FFmpegError, UnicodeDecodeError) as exc:
        raise ValueError(f"cannot read media file {str(path)!r}: it {unreadable_reason(path, exc)}; pass a video "
                         "file such as an MP4, MKV, MOV or WebM") from exc


def unreadable_reason(path: str | os.PathLike[str], error: BaseException) -> str:
    """Why `open_media(path)` raised `error`, as the end of "<the file> ...": the CLI, the API and the HTTP server
    say the same. PyAV gives FFmpeg's error code's text ("Invalid data found when processing input"), not its log's
    "moov atom not found", so an MP4 cut before its index is told what that text usually means."""
    try:
        if Path(path).stat().st_size == 0:
            return "is empty (0 bytes)"
    except OSError:
        pass
    if refused_demuxer(error):
        return f"is not a video file k6serve reads: {REFUSED_DEMUXER}"
    if isinstance(error, PermissionError):
        # It was "not a readable video (FFmpeg: Permission denied): it may be damaged or cut short".
        return ("cannot be opened: permission denied (the user k6serve runs as may not read it; give it read access, "
                "e.g. chmod a+r on the file)")
    reason = getattr(error, "strerror", None) or str(error)
    return (f"is not a readable video (FFmpeg: {reason}): it may be damaged or cut short (an incomplete download or "
            "copy?)")


def video_streams(container: av.container.InputContainer) -> list:
    """The container's video streams that are video: not an attached picture (a music file's cover art, a
    thumbnail), which FFmpeg lists as a one-frame video stream at a made-up rate (90,000 fps in an MP4), nor, beside
    a track, a HEIF image item (an animated AVIF lists its still picture first: that one frame was upscaled). A file
    of image items alone (an AVIF or HEIC photo) keeps them, for `still_image_demuxer` to tell."""
    streams = [stream for stream in container.streams.video
               if not stream.disposition & av.stream.Disposition.attached_pic]
    return [stream for stream in streams if not _heif_item(container, stream)] or streams


def _heif_item(container: av.container.InputContainer, stream) -> bool:
    """Whether `stream` is an image item of a HEIF file (AVIF, HEIC: brand mif1), which FFmpeg's mov demuxer lists as
    a one-frame video stream without a duration."""
    brands = container.metadata.get("major_brand", "") + container.metadata.get("compatible_brands", "")
    return "mif1" in brands and stream.duration is None and stream.frames <= 1


def describe_streams(container: av.container.InputContainer) -> str:
    """One-line list of the streams in `container`, for error messages."""
    if not container.streams:
        return "no streams"
    parts = []
    for stream in container.streams:
        codec_name = stream.codec_context.name if stream.codec_context is not None else "unknown"
        picture = stream.type == "video" and stream.disposition & av.stream.Disposition.attached_pic
        parts.append(f"{'attached picture' if picture else stream.type} ({codec_name})")
    return ", ".join(parts)


def still_image_demuxer(container: av.container.InputContainer) -> str | None:
    """The demuxer's name when FFmpeg read `container` as a still image (its image2 or *_pipe image demuxers,
    e.g. png_pipe, jpeg_pipe, or a GIF of one frame), else None. Such a file still shows one video stream, at a
    made-up 25 fps (a still GIF's at 100 fps)."""
    name = container.format.name
    if name == "gif":
        # The gif demuxer counts a file's frames when it opens it. A still GIF went on as a video of one frame at
        # 100 fps, which the 24 fps rule subsamples to none: its job failed in the queue with "pass a longer clip"
        # (one with a frame delay of a second came out as a one-frame MP4).
        streams = video_streams(container)
        return name if streams and streams[0].frames == 1 else None
    if name.startswith("mov,"):
        # An AVIF or HEIC photo opens as a one-frame video at 1 fps: it was upscaled as such a clip.
        streams = video_streams(container)
        return "mov (an AVIF or HEIC image)" if streams and _heif_item(container, streams[0]) else None
    return name if name in ("image2", "image2pipe") or name.endswith("_pipe") else None


# What to do with an animated WebP, which FFmpeg reads as one still picture it then cannot decode.
ANIMATED_WEBP = ("an animated WebP, which FFmpeg cannot decode (it reads WebP files as still images); convert it to a "
                 "video first with a tool that reads animated WebP (e.g. ImageMagick: magick IN.webp OUT.mp4)")


def is_animated_webp(path: str | os.PathLike[str]) -> bool:
    """Whether the file is a WebP with its animation flag set (the VP8X chunk's 0x02 bit): FFmpeg's webp_pipe
    demuxer takes it for a still image, so it was refused as "a still image, not a video"."""
    try:
        with open(path, "rb") as file:
            header = file.read(21)
    except OSError:
        return False
    return len(header) == 21 and header[:4] == b"RIFF" and header[8:16] == b"WEBPVP8X" and bool(header[20] & 0x02)


def is_pdf(path: str | os.PathLike[str]) -> bool:
    """Whether the file starts as a PDF document (which FFmpeg's mjpeg demuxer reads as video: its pages' JPEGs)."""
    try:
        with open(path, "rb") as file:
            return file.read(5) == b"%PDF-"
    except OSError:
        return False
