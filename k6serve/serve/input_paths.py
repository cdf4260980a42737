"""Server-side input paths from JSON bodies (`video_path`, `image_path`): only inside allowed folders.

The path is resolved with every symlink followed before the check, so `..` segments and links that point
outside an allowed folder are refused alike.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import threading
from collections.abc import Collection, Iterator
from pathlib import Path
from typing import Any

import av
import PIL.Image

from k6serve.media.container import (
    ANIMATED_WEBP,
    is_animated_webp,
    is_pdf,
    open_media,
    still_image_demuxer,
    unreadable_reason,
    video_streams,
)
from k6serve.media.image import (
    IMAGE_FORMATS,
    check_cover_resize,
    check_pixel_levels,
    no_decompression_bomb_warning,
    unreadable_image_reason,
)
from k6serve.request import SamplingParams, unencodable_path
from k6serve.serve.errors import ApiError


_EXIF_ORIENTATION = 0x0112
_TRANSPOSING_ORIENTATIONS = (5, 6, 7, 8)  # the EXIF orientations that swap width and height


class InputPathPolicy:
    """`allowed_dirs`: where JSON paths may point. `upload_dir`: refused even inside one, since its files are other
    jobs' uploads, deleted with their job or when it ends (a job naming one was accepted, then failed "it does not
    exist")."""

    def __init__(self, allowed_dirs: list[Path], *, upload_dir: Path | None = None) -> None:
        self.allowed_dirs = tuple(Path(d).resolve() for d in allowed_dirs)
        self.upload_dir = None if upload_dir is None else Path(upload_dir).resolve()

    def checked_params(self, params: SamplingParams, *, uploaded: Collection[str] = ()) -> SamplingParams:
        """`params` with each server-side input path (`image_path`, `video_path`) checked (`check`) and resolved; the
        request's own `uploaded` files are the server's and are not checked. A job's creation and its start (the
        runner checks again) both go through here."""
        changes: dict[str, Any] = {}
        for name in ("image_path", "video_path"):
            value = getattr(params, name)
            if value is not None and value not in uploaded:
                changes[name] = self.check(name, value)
        return dataclasses.replace(params, **changes) if changes else params

    def check(self, param: str, value: str) -> str:
        """The resolved path of an allowed, existing regular file; else a 400 saying what is allowed."""
        allowed = ", ".join(str(d) for d in self.allowed_dirs)
        if "\x00" in value or not value.strip():
            raise ApiError(400, f"{param} must be a file path.", code="invalid_path", param=param)
        if (reason := unencodable_path(value)) is not None:
            raise ApiError(400, f"{param} {reason.replace('this process', 'the server')}.", code="invalid_path",
                           param=param)
        try:
            resolved = Path(value).resolve(strict=False)
        except (OSError, RuntimeError):  # symlink loops
            raise ApiError(400, f"{param} {value!r} cannot be resolved.", code="invalid_path", param=param) from None
        if self.upload_dir is not None and resolved.is_relative_to(self.upload_dir):
            raise ApiError(400, f"{param} {value!r} is in the server's upload folder, whose files belong to the jobs "
                                "that uploaded them and are deleted with those jobs; upload the file with this "
                                "request (multipart input_reference) or put it in an allowed input folder.",
                           code="path_not_allowed", param=param)
        if not any(resolved.is_relative_to(folder) for folder in self.allowed_dirs):
            raise ApiError(400, f"{param} {value!r} is outside the allowed input folders ({allowed}); put the file "
                                "there (server --allowed-input-dir) or upload it instead.",
                           code="path_not_allowed", param=param)
        if not resolved.is_file():
            raise ApiError(400, f"{param} {value!r} is not an existing file inside the allowed input folders "
                                f"({allowed}).", code="invalid_path", param=param)
        return str(resolved)


class LoraPathPolicy:
    """Where set_lora's `lora_path` may point: anywhere the server can read, and hub ids, without `allowed_dirs`
    (documented: give the server a key); with them (--allowed-lora-dir), an existing file or folder inside one, its
    symlinks resolved, and no hub id (a download is a path outside them)."""

    def __init__(self, allowed_dirs: tuple[Path, ...]) -> None:
        self.allowed_dirs = tuple(Path(folder).expanduser().resolve() for folder in allowed_dirs)

    def check(self, value: str | list[str | None] | None) -> str | list[str | None] | None:
        """`value` (one path, a list of them, None entries reusing a loaded adapter) with each path absolute; a 400
        naming lora_path for one outside the allowed folders."""
        if not self.allowed_dirs or value is None:
            return value
        if isinstance(value, list):
            return [None if item is None else self._one(item) for item in value]
        return self._one(value)

    def _one(self, value: str) -> str:
        allowed = ", ".join(str(folder) for folder in self.allowed_dirs)
        where = f"this server loads LoRA adapters only from its --allowed-lora-dir folders ({allowed})"
        if not isinstance(value, str) or "\x00" in value or not value.strip():
            raise ApiError(400, f"lora_path must be a file or folder path; {where}.", code="invalid_path",
                           param="lora_path")
        if (reason := unencodable_path(value)) is not None:
            raise ApiError(400, f"lora_path {reason.replace('this process', 'the server')}.", code="invalid_path",
                           param="lora_path")
        try:
            resolved = Path(value).expanduser().resolve(strict=False)
        except (OSError, RuntimeError):  # symlink loops
            raise ApiError(400, f"lora_path {value!r} cannot be resolved.", code="invalid_path",
                           param="lora_path") from None
        if not any(resolved.is_relative_to(folder) for folder in self.allowed_dirs):
            raise ApiError(400, f"lora_path {value!r} is outside them: {where}; put the adapter there (a hub id is "
                                "not downloaded: download it into one of them first).", code="path_not_allowed",
                           param="lora_path")
        if not (resolved.is_file() or resolved.is_dir()):
            raise ApiError(400, f"lora_path {value!r} is not an existing file or folder; {where}.",
                           code="invalid_path", param="lora_path")
        # The path as named, made absolute, not its link's target: the reader needs the link's name (a hub cache's
        # snapshots/<rev>/adapter_model.safetensors points at a blob with no suffix) and folder (the
        # adapter_config.json beside it, which sets the scale). Where it leads is checked above. Not normalised:
        # `a/link/../b` is where the kernel goes through the link, which is what was checked, not `a/b`.
        return os.path.join(os.getcwd(), os.path.expanduser(value))


def check_readable(kind: str, path: str, *, param: str, uploaded: bool,
                   video_size: tuple[int, int] | None = None) -> None:
    """A 400 now, naming the field, when `path` is not an image / a video with a video stream, or is an image
    too far from the `video_size` (height, width) aspect ratio to cover-resize (`check_cover_resize`), or one whose
    pixel data does not decode (cut short or damaged past its header).

    Caught at creation, not minutes later as a failed job whose message showed the server's upload path. An image
    is decoded as the worker decodes it (`_decode`), so what the worker would refuse is refused here with the
    same reason, and what it would accept passes; a video only has its headers read (FFmpeg's probe): the
    pipeline decodes it and reports the rest. Runs in a thread, off the event loop: a decode takes up to seconds.
    """
    code = "invalid_upload" if uploaded else "invalid_path"
    what = f"The uploaded {param}" if uploaded else f"{param} {path!r}"
    if kind == "image":
        _check_image(path, what=what, code=code, param=param, video_size=video_size)
        return
    if is_pdf(path):
        raise ApiError(400, f"{what} is a PDF document, not a video; send a video file such as an MP4, MKV, MOV or "
                            "WebM.", code=code, param=param)
    has_video, image_demuxer = _probe_video(path)
    if has_video and image_demuxer is not None and is_animated_webp(path):
        raise ApiError(400, f"{what} is {ANIMATED_WEBP}.", code=code, param=param)
    if has_video and image_demuxer is not None:
        # FFmpeg shows a still image as a one-frame 25 fps video; the SR source reader refuses it, so refuse it now.
        raise ApiError(400, f"{what} is a still image (FFmpeg's {image_demuxer} demuxer), not a video; send a video "
                            "file such as an MP4, MKV, MOV or WebM.", code=code, param=param)
    if not has_video:
        problem = "has no video stream" if has_video is False else _unreadable_video(path)
        raise ApiError(400, f"{what} {problem}; send a video file such as an MP4, MKV, MOV or WebM.", code=code,
                       param=param)


def _check_image(path: str, *, what: str, code: str, param: str, video_size: tuple[int, int] | None) -> None:
    """`check_readable` for an image: its headers first, then the aspect ratio, then the decode (the costly part)."""
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
        # A PDF is not probed: FFmpeg's mjpeg demuxer reads the JPEG of each page as a video frame, and a PDF
        # upload was called "a video".
        has_video, image_demuxer = (None, None) if is_pdf(path) else _probe_video(path)
        if has_video and image_demuxer is None:
            # Said plainly: a generation model's input_reference is its conditioning image, whatever the upload
            # was named or typed, and no generation model takes a video.
            raise ApiError(400, f"{what} is a video, not an image: a generation model is conditioned on an "
                                "image (TI2AV); videos are the super-resolution model's input. Send "
                                f"{IMAGE_FORMATS}.", code=code, param=param) from None
        raise _unreadable(what, path, exc, pil_format, code=code, param=param) from None
    if video_size is not None:
        try:
            check_cover_resize(*size, *video_size, source=what)
        except ValueError as exc:
            raise ApiError(400, str(exc), code=code, param=param) from None
    with _DECODES.reserve(size[0] * size[1]):
        try:
            decoded = _decode(path)
        except Exception as exc:  # noqa: BLE001 - PIL's decoders raise many types for bad data
            raise _unreadable(what, path, exc, pil_format, code=code, param=param) from None
        with decoded:
            try:
                # The worker's reading of 32-bit integer and float levels: NaN or out-of-range values are refused
                # now, in its words, not when the job starts.
                check_pixel_levels(decoded, what)
            except ValueError as exc:
                raise ApiError(400, str(exc), code=code, param=param) from None


def _unreadable(what: str, path: str, error: Exception, pil_format: str | None, *, code: str,
                param: str) -> ApiError:
    # The reason, not PIL's message: that names the file, here the server's upload path.
    return ApiError(400, f"{what} is not a readable image: {unreadable_image_reason(path, error, pil_format)}.",
                    code=code, param=param)


def _decode(path: str) -> PIL.Image.Image:
    """Decode the image's pixel data as the worker's `load()` does (`_open_image_file`), raising what it raises.

    A JPEG is decoded at 1/8 scale (PIL's `draft`): libjpeg still reads every entropy-coded block, so a file cut
    short or broken fails as in the full decode, in half the time and a thirtieth of the memory (8000x6000,
    baseline: 0.16 s and 5 MiB against 0.3 s and 186 MiB; a progressive one still holds its coefficients, 142 MiB).
    Other formats have no reduced decode in PIL and are decoded in full.

    libjpeg's warnings ("Corrupt JPEG data: ...": bad Huffman codes, extraneous bytes before a marker) are not
    errors for PIL: the image loads with gray or garbled blocks where the data was bad. The worker then uses it,
    so it passes here too; only libjpeg's errors and a file that ends early fail, in both decodes alike.
    """
    with no_decompression_bomb_warning():  # PIL warns in open(); the decode below runs outside its lock
        image = PIL.Image.open(path)
    try:
        image.draft(image.mode, (1, 1))  # JPEG only (a no-op for other formats): its smallest scale, 1/8
        image.load()
    except BaseException:
        image.close()
        raise
    return image  # decoded; the caller closes it


class _PixelBudget:
    """At most `pixels` pixels decoding at once; a larger image waits to decode alone.

    The server checks uploads in threads, several at once, and a decode holds its whole image (4 bytes a pixel as
    RGB or RGBA, about 16 for a WebP while libwebp decodes): a 7 KB lossless WebP of 16000x11000 takes 2.7 GiB and
    4 s. The budget keeps the checks together to about one such image, however many arrive at the same time.
    """

    def __init__(self, pixels: int) -> None:
        self._pixels = pixels
        self._in_use = 0
        self._turn = threading.Lock()  # one waits at a time: a large image is not passed over by later small ones
        self._freed = threading.Condition()

    @contextlib.contextmanager
    def reserve(self, pixels: int) -> Iterator[None]:
        pixels = min(pixels, self._pixels)
        with self._turn, self._freed:
            self._freed.wait_for(lambda: self._in_use + pixels <= self._pixels)
            self._in_use += pixels
        try:
            yield
        finally:
            with self._freed:
                self._in_use -= pixels
                self._freed.notify_all()


# Twice PIL's default MAX_IMAGE_PIXELS: the largest image PIL opens (`DecompressionBombError` beyond), so the checks
# together hold no more than the largest single image that can reach them.
_DECODES = _PixelBudget(2 * 89_478_485)


def _unreadable_video(path: str) -> str:
    """Why FFmpeg cannot open `path`, for the refusal (`container.unreadable_reason`, as the CLI says it)."""
    try:
        with open_media(path):
            return "is not a readable video"
    except (av.error.FFmpegError, UnicodeDecodeError) as exc:
        return unreadable_reason(path, exc)


def _probe_video(path: str) -> tuple[bool | None, str | None]:
    """(whether FFmpeg finds a video stream, None when it cannot open the file; the still-image demuxer's name)."""
    try:
        with open_media(path) as container:
            return bool(video_streams(container)), still_image_demuxer(container)
    except (av.error.FFmpegError, UnicodeDecodeError):
        return None, None
