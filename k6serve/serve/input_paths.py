"""Server-side input paths from JSON bodies (`video_path`, `image_path`): only inside allowed folders.

The path is resolved with every symlink followed before the check, so `..` segments and links that point
outside an allowed folder are refused alike.
"""

from __future__ import annotations

from pathlib import Path

import av
import PIL.Image

from k6serve.media.container import still_image_demuxer
from k6serve.media.image import (
    IMAGE_FORMATS,
    check_cover_resize,
    no_decompression_bomb_warning,
    unreadable_image_reason,
)
from k6serve.serve.errors import ApiError


_EXIF_ORIENTATION = 0x0112
_TRANSPOSING_ORIENTATIONS = (5, 6, 7, 8)  # the EXIF orientations that swap width and height


class InputPathPolicy:
    def __init__(self, allowed_dirs: list[Path]) -> None:
        self.allowed_dirs = tuple(Path(d).resolve() for d in allowed_dirs)

    def check(self, param: str, value: str) -> str:
        """The resolved path of an allowed, existing regular file; else a 400 saying what is allowed."""
        allowed = ", ".join(str(d) for d in self.allowed_dirs)
        if "\x00" in value or not value.strip():
            raise ApiError(400, f"{param} must be a file path.", code="invalid_path", param=param)
        try:
            resolved = Path(value).resolve(strict=False)
        except (OSError, RuntimeError):  # symlink loops
            raise ApiError(400, f"{param} {value!r} cannot be resolved.", code="invalid_path", param=param) from None
        if not any(resolved.is_relative_to(folder) for folder in self.allowed_dirs):
            raise ApiError(400, f"{param} {value!r} is outside the allowed input folders ({allowed}); put the file "
                                "there (server --allowed-input-dir) or upload it instead.",
                           code="path_not_allowed", param=param)
        if not resolved.is_file():
            raise ApiError(400, f"{param} {value!r} is not an existing file inside the allowed input folders "
                                f"({allowed}).", code="invalid_path", param=param)
        return str(resolved)


def check_readable(kind: str, path: str, *, param: str, uploaded: bool,
                   video_size: tuple[int, int] | None = None) -> None:
    """A 400 now, naming the field, when `path` is not an image / a video with a video stream, or is an image
    too far from the `video_size` (height, width) aspect ratio to cover-resize (`check_cover_resize`).

    Caught at creation, not minutes later as a failed job whose message showed the server's upload path.
    Only headers are read (PIL's verify, FFmpeg's probe): the pipeline still decodes and reports the rest.
    """
    code = "invalid_upload" if uploaded else "invalid_path"
    what = f"The uploaded {param}" if uploaded else f"{param} {path!r}"
    if kind == "image":
        pil_format = None
        try:
            with no_decompression_bomb_warning():
                with PIL.Image.open(path) as image:
                    pil_format = image.format
                    image.verify()
                with PIL.Image.open(path) as image:  # verify() leaves the image unusable, so read the header again
                    size = image.size
                    if image.getexif().get(_EXIF_ORIENTATION) in _TRANSPOSING_ORIENTATIONS:
                        size = size[::-1]  # the pipeline applies the rotation before resizing
        except PIL.Image.DecompressionBombError:
            # A readable image with more than twice PIL's MAX_IMAGE_PIXELS: too large, not broken.
            raise ApiError(400, f"{what} is too large (over {2 * (PIL.Image.MAX_IMAGE_PIXELS or 0):,} pixels); "
                                "downscale it: the model uses it at the video's size.", code=code,
                           param=param) from None
        except Exception as exc:  # noqa: BLE001 - PIL raises many types for bad files
            has_video, image_demuxer = _probe_video(path)
            if has_video and image_demuxer is None:
                # Said plainly: a generation model's input_reference is its conditioning image, whatever the upload
                # was named or typed, and no generation model takes a video.
                raise ApiError(400, f"{what} is a video, not an image: a generation model is conditioned on an "
                                    "image (TI2AV); videos are the super-resolution model's input. Send "
                                    f"{IMAGE_FORMATS}.", code=code, param=param) from None
            # The reason, not PIL's message: that names the file, here the server's upload path.
            raise ApiError(400, f"{what} is not a readable image: {unreadable_image_reason(path, exc, pil_format)}.",
                           code=code, param=param) from None
        if video_size is not None:
            try:
                check_cover_resize(*size, *video_size, source=what)
            except ValueError as exc:
                raise ApiError(400, str(exc), code=code, param=param) from None
        return
    has_video, image_demuxer = _probe_video(path)
    if has_video and image_demuxer is not None:
        # FFmpeg shows a still image as a one-frame 25 fps video; the SR source reader refuses it, so refuse it now.
        raise ApiError(400, f"{what} is a still image (FFmpeg's {image_demuxer} demuxer), not a video; send a video "
                            "file such as an MP4, MKV, MOV or WebM.", code=code, param=param)
    if not has_video:
        problem = "has no video stream" if has_video is False else "is not a readable video"
        raise ApiError(400, f"{what} {problem}; send a video file such as an MP4, MKV, MOV or WebM.", code=code,
                       param=param)


def _probe_video(path: str) -> tuple[bool | None, str | None]:
    """(whether FFmpeg finds a video stream, None when it cannot open the file; the still-image demuxer's name)."""
    try:
        with av.open(path, mode="r") as container:
            return bool(container.streams.video), still_image_demuxer(container)
    except (av.error.FFmpegError, UnicodeDecodeError):
        return None, None
