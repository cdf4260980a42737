"""Loading the conditioning image of an image-to-video request, and diffusers' cover-resize + crop.

Loading mirrors `diffusers.utils.load_image` for files (EXIF orientation applied, converted to
RGB); PIL images passed in are not rotated, as diffusers' pipeline does not rotate them.
Unlike diffusers, 16-bit, 32-bit integer and float grayscale images keep their levels (`_grayscale_to_8_bit`), and
an image whose embedded ICC profile is not sRGB (an iPhone's Display P3, Adobe RGB, a CMYK or gray profile) is
converted to sRGB, the video's colours (`media/icc.py`); an image with no profile, or an sRGB one, is diffusers' pixels.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import threading
import warnings
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import PIL.Image
import PIL.ImageOps

from k6serve.media.icc import to_srgb

logger = logging.getLogger(__name__)

# The formats named in errors, the ones users send; PIL reads more (BMP, ICO, ...), and those work too.
IMAGE_FORMATS = "a PNG, JPEG, WebP, TIFF or GIF image (a GIF gives its first frame)"

# First bytes of those formats, to say what a file PIL cannot open was meant to be: PIL reports a PNG with a damaged
# header, or a TIFF of a pixel type it lacks, as "cannot identify image file", the same as a text file.
_SIGNATURES = ((0, b"\x89PNG\r\n\x1a\n", "PNG"), (0, b"\xff\xd8\xff", "JPEG"), (0, b"GIF8", "GIF"),
               (8, b"WEBP", "WebP"), (0, b"II*\x00", "TIFF"), (0, b"MM\x00*", "TIFF"))
# A URL or a data URI given as a path: scheme "://" (not a Windows drive, "C:\\"), or "data:".
_URL = re.compile(r"(?:[A-Za-z][A-Za-z0-9+.-]+://|data:)", re.IGNORECASE)

# Major brands of HEIF files ("ftyp" box at byte 4): iPhone photos, which PIL cannot read without a plugin.
_HEIF_BRANDS = (b"heic", b"heix", b"heim", b"heis", b"hevc", b"hevx", b"mif1", b"msf1")

# The cover resize scales the image until it covers the video, so one far narrower (or flatter) than the video grows
# along its long side without bound before the crop: a 101-byte 1x4000 PNG became a 768x3,072,000 image (about 10 GB)
# for a 768x512 video. Past PIL's own decompression-bomb threshold it is refused instead.
MAX_COVER_RESIZED_PIXELS = 89_478_485


def looks_like_url(path: str) -> bool:
    """Whether an input path is a URL or a data URI, which k6serve does not fetch: it was reported as a missing file,
    quoted with its '//' collapsed by Path()."""
    return _URL.match(path) is not None


def shown_path(path: str) -> str:
    """`path` quoted for a message, its start only past 120 characters (a data URI of an image is megabytes)."""
    return repr(path) if len(path) <= 120 else f"{path[:100]!r}... ({len(path):,} characters)"


def cover_resized_size(image_width: int, image_height: int, height: int, width: int) -> tuple[int, int]:
    """(width, height) of the image after the cover resize, before the center crop (diffusers' integer rule)."""
    if width / height > image_width / image_height:
        return width, image_height * width // image_width
    return image_width * height // image_height, height


def check_cover_resize(image_width: int, image_height: int, height: int, width: int, *, source: str) -> None:
    """Raise ValueError, its message starting with `source`, when covering a `height` x `width` video would resize
    the image beyond MAX_COVER_RESIZED_PIXELS (an aspect ratio hundreds of times off the video's)."""
    resized_width, resized_height = cover_resized_size(image_width, image_height, height, width)
    if resized_width * resized_height > MAX_COVER_RESIZED_PIXELS:
        raise ValueError(
            f"{source} is {image_width}x{image_height}, too far from the video's {width}x{height} "
            f"aspect ratio: covering the video would first resize it to {resized_width}x{resized_height} "
            f"({resized_width * resized_height:,} pixels, limit {MAX_COVER_RESIZED_PIXELS:,}) before the center "
            f"crop; crop the image closer to {width}:{height} (width:height)"
        )


def load_conditioning_image(
    image: str | os.PathLike[str] | PIL.Image.Image, height: int, width: int, *, notes: list[str] | None = None,
    log: bool = True,
) -> PIL.Image.Image:
    """Open and check a conditioning image for a `height` x `width` video; returns it RGB, unresized.

    The pipeline resizes it (`cover_resize_center_crop`); height and width are checked here so a
    bad request fails before any model work. A conversion of its colours to sRGB, or an ICC profile that could not
    be used, is logged (unless `log` is False: a check ahead of the load that logs it) and, with `notes`, told
    there in a sentence for the user (`icc.to_srgb`).
    """
    for name, value in (("height", height), ("width", width)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if isinstance(image, PIL.Image.Image):
        loaded, sample_type = image, _tiff_sample_type(image)
        source = "the given PIL image"
    else:
        text = os.fspath(image)
        source = repr(text)  # as given: Path() collapses the '//' of a URL the message would quote
        if looks_like_url(text) and not os.path.exists(text):  # ('a://b' can be a folder 'a:' and a file)
            raise ValueError(f"cannot read conditioning image {shown_path(text)}: k6serve fetches no URLs; download "
                             "the image and pass the file's path.")
        loaded, sample_type = _open_image_file(Path(text), source)
    if loaded.width < 1 or loaded.height < 1:
        raise ValueError(f"conditioning image {source} is empty ({loaded.width}x{loaded.height})")
    check_cover_resize(loaded.width, loaded.height, height, width, source=f"conditioning image {source}")
    max_pixels = PIL.Image.MAX_IMAGE_PIXELS
    if max_pixels is not None and loaded.width * loaded.height > max_pixels:
        # One log line in place of PIL's DecompressionBombWarning ("could be decompression bomb DOS attack"), which
        # _open_image_file silences: the image passed the project's own limits; only its size costs.
        logger.info("conditioning image %s is %dx%d (%s pixels, more than PIL's decompression-bomb threshold of "
                    "%s): decoded in full before the resize to %dx%d", source, loaded.width, loaded.height,
                    f"{loaded.width * loaded.height:,}", f"{max_pixels:,}", width, height)
    icc_profile = loaded.info.get("icc_profile")  # read first: the 8-bit copy of a 16-bit image has no info
    loaded = _grayscale_to_8_bit(loaded, sample_type, f"conditioning image {source}")
    loaded = to_srgb(loaded, icc_profile, f"conditioning image {source}", notes, log=log)
    return loaded if loaded.mode == "RGB" else loaded.convert("RGB")


def unreadable_image_reason(path: str | os.PathLike[str], error: BaseException, pil_format: str | None) -> str:
    """Why PIL could not open or decode the image file at `path`, and the fix, in words for the user.

    `pil_format` is PIL's name for the format when it opened the file and failed later. The text never names the
    path (the server shows it for uploads, whose path is the server's own) nor the exception class.
    """
    if isinstance(error, PermissionError):
        return "the file cannot be opened (permission denied); make it readable"
    try:
        with open(path, "rb") as file:
            head = file.read(16)
    except OSError:  # gone or unreadable since PIL tried: say what PIL saw, if anything
        head = None
    if head == b"":
        return f"the file is empty (0 bytes); use {IMAGE_FORMATS}"
    found = pil_format
    if head is not None:
        if head[4:8] == b"ftyp" and head[8:12] in _HEIF_BRANDS:
            return "it is a HEIC/HEIF photo, which k6serve cannot read; convert it to JPEG or PNG"
        if head.startswith(b"%PDF-"):
            return "it is a PDF document, not an image; export the page as a PNG or JPEG"
        for offset, magic, name in _SIGNATURES:
            if head[offset:offset + len(magic)] == magic:
                found = name
    if found is not None:
        # PIL does not tell a cut-short file from a damaged one or from a variant it has no decoder for, except in
        # its message text, which names the path.
        return (f"it starts as a {found} file but its data is damaged, cut short or of a kind k6serve cannot "
                f"decode; export or copy it again, as an 8-bit PNG or JPEG if it still fails")
    return f"its contents are in no image format k6serve reads; use {IMAGE_FORMATS}"


def cover_resize_center_crop(image: PIL.Image.Image, height: int, width: int) -> PIL.Image.Image:
    """Resize keeping aspect ratio so the image covers height x width (Lanczos), then center-crop.

    Same pixels as diffusers 0.42.1 `VaeImageProcessor.resize(..., resize_mode="crop")`
    (`_resize_and_crop`), which `VideoProcessor.preprocess` applies to PIL conditioning images;
    copied rather than imported because diffusers is not a serving-time dependency. diffusers
    first floors height and width to multiples of the VAE scale factor; callers pass sizes that
    are already multiples.
    """
    resized_width, resized_height = cover_resized_size(image.width, image.height, height, width)
    resized = image.resize((resized_width, resized_height), resample=PIL.Image.Resampling.LANCZOS)
    cropped = PIL.Image.new("RGB", (width, height))
    cropped.paste(resized, box=(width // 2 - resized_width // 2, height // 2 - resized_height // 2))
    return cropped


# Held while the warning filter is swapped (`no_decompression_bomb_warning`): catch_warnings saves and restores the
# process-wide filter list, so two threads inside it at once (the server checks uploads in threads) could restore
# each other's lists and leave the filter on, or off, for good. Re-entrant so that a nested use cannot deadlock.
_WARNING_FILTER_LOCK = threading.RLock()


@contextlib.contextmanager
def no_decompression_bomb_warning() -> Iterator[None]:
    """PIL's DecompressionBombWarning (stderr, for images over MAX_IMAGE_PIXELS; it raises only past twice that)
    kept off while opening: such an image is refused by check_cover_resize or logged in one line by
    load_conditioning_image. Callers hold it around `PIL.Image.open` (where PIL warns) and header checks only, not
    around decoding: it serialises its users (`_WARNING_FILTER_LOCK`). Other threads' warnings of this one
    category are also hidden while it is held; nothing else in the filter list changes."""
    with _WARNING_FILTER_LOCK, warnings.catch_warnings():
        warnings.simplefilter("ignore", PIL.Image.DecompressionBombWarning)
        yield


def _open_image_file(path: Path, source: str) -> tuple[PIL.Image.Image, tuple[int, int] | None]:
    """The decoded image, EXIF orientation applied, and its TIFF sample type (`_tiff_sample_type`); `source` is the
    path as the user gave it, quoted, for the messages."""
    if not path.is_file():
        what = "is a directory" if path.is_dir() else "does not exist"
        raise ValueError(f"cannot read conditioning image {source}: it {what}")
    pil_format = None
    try:
        with no_decompression_bomb_warning():  # PIL warns in open(); the decode below runs outside the lock
            opened = PIL.Image.open(path)
        with opened:
            pil_format = opened.format
            # load() decodes now, so a truncated or corrupt file fails here, not in the pipeline.
            opened.load()
            # Read before exif_transpose, whose copy has no TIFF tags.
            sample_type = _tiff_sample_type(opened)
            return PIL.ImageOps.exif_transpose(opened), sample_type
    except PIL.Image.DecompressionBombError as exc:
        # Not an OSError: PIL refuses to decode more than twice its MAX_IMAGE_PIXELS (a guard against files that
        # expand to gigabytes). The image is readable, only too large for a conditioning frame. PIL's message is
        # the only place its pixel count is told ("Image size (N pixels) exceeds limit of M pixels, ...").
        counts = re.findall(r"(\d+) pixels", str(exc))
        size = (f"{int(counts[0]):,} pixels, limit {int(counts[1]):,}" if len(counts) == 2
                else f"over {2 * (PIL.Image.MAX_IMAGE_PIXELS or 0):,} pixels")
        raise ValueError(
            f"conditioning image {source} is too large ({size}); downscale it (the model uses it at the "
            "video's size, e.g. 768x512)"
        ) from exc
    except (PIL.UnidentifiedImageError, OSError, SyntaxError) as exc:
        raise ValueError(
            f"conditioning image {source} is not a readable image: "
            f"{unreadable_image_reason(path, exc, pil_format)}"
        ) from exc


def _tiff_sample_type(image: PIL.Image.Image) -> tuple[int, int] | None:
    """(bits per sample, TIFF SampleFormat: 1 unsigned, 2 signed, 3 float) of an image opened from a TIFF, else None."""
    tags = getattr(image, "tag_v2", None)
    if tags is None:
        return None
    bits, sample_format = tags.get(258, (1,)), tags.get(339, (1,))  # TIFF's defaults: 1 bit, unsigned
    return (bits[0] if isinstance(bits, tuple) else bits,
            sample_format[0] if isinstance(sample_format, tuple) else sample_format)


def check_pixel_levels(image: PIL.Image.Image, source: str) -> None:
    """Raise the ValueError `load_conditioning_image` raises for a decoded 32-bit integer or float grayscale image
    whose values it cannot read as levels (NaN, infinity, outside its range); `image` as opened, before any
    transpose (its TIFF tags give the sample type). The server checks uploads with it at creation."""
    _grayscale_to_8_bit(image, _tiff_sample_type(image), source)


def _grayscale_to_8_bit(image: PIL.Image.Image, sample_type: tuple[int, int] | None,
                        source: str) -> PIL.Image.Image:
    """A 16-bit, 32-bit integer or float grayscale image as 8-bit "L" with its levels kept; others unchanged.

    PIL's convert("RGB") clips these at 255 (a mid-gray 16- or 32-bit image came out white) and truncates floats (a
    0..1 image came out black). Integers keep their top 8 bits of 0 (black) .. the largest value their type holds
    (white), as PIL reads 16-bit RGB PNGs; floats map 0.0 (black) .. 1.0 (white), the usual float convention
    (scikit-image's, for one). Values outside that range are refused, not clipped: a float image in 0..255 or -1..1
    would otherwise come out white or half black.
    """
    if image.mode.startswith("I;16"):  # 16-bit grayscale PNG or TIFF
        return PIL.Image.fromarray((np.asarray(image) >> 8).astype(np.uint8), mode="L")
    if image.mode == "I":
        return PIL.Image.fromarray(_integer_levels(np.asarray(image), sample_type, source), mode="L")
    if image.mode == "F":
        return PIL.Image.fromarray(_float_levels(np.asarray(image), source), mode="L")
    return image


def _integer_levels(pixels: np.ndarray, sample_type: tuple[int, int] | None, source: str) -> np.ndarray:
    """Mode "I" pixels as uint8: the range comes from the TIFF's sample type; other files are 16-bit."""
    if sample_type is not None and sample_type[1] in (1, 2):
        bits, signed = sample_type[0], sample_type[1] == 2
        kind = f"{bits}-bit {'signed' if signed else 'unsigned'} integer TIFF"
        if bits == 32 and not signed:
            pixels = pixels.view(np.uint32)  # PIL keeps unsigned 32-bit samples in its signed mode "I", bit for bit
    else:
        # Older Pillows open 16-bit grayscale PNGs, and this one 16-bit PGMs (scaled to 0..65535 from their maxval) as
        # mode "I": those are the mode "I" files with no sample type to read.
        bits, signed = 16, False
        kind = "32-bit integer image (PIL mode I) not from a TIFF, so read as 16-bit,"
    white = 2 ** (bits - signed) - 1
    low, high = int(pixels.min()), int(pixels.max())
    if low < 0 or high > white:
        raise ValueError(
            f"{source} is a {kind} with values from {low:,} to {high:,}, outside its range of 0 (black) to "
            f"{white:,} (white); rescale it into that range, or save it as an 8- or 16-bit PNG"
        )
    shift = bits - signed - 8  # the top 8 bits of the range, as >> 8 for 16-bit; no wider copy of a large image
    return (pixels >> shift if shift >= 0 else pixels * 255 // white).astype(np.uint8)


def _float_levels(pixels: np.ndarray, source: str) -> np.ndarray:
    """Mode "F" pixels as uint8: 0.0 black, 1.0 white; NaN, infinity and values outside 0..1 refused."""
    num_not_finite = int(np.count_nonzero(~np.isfinite(pixels)))
    if num_not_finite:
        raise ValueError(
            f"{source} is a float image with {num_not_finite:,} NaN or infinite pixel values; replace them with "
            "values from 0.0 (black) to 1.0 (white), or save the image as an 8-bit PNG"
        )
    levels = np.floor(pixels * np.float32(255) + np.float32(0.5))
    low, high = float(pixels.min()), float(pixels.max())
    if levels.min() < 0 or levels.max() > 255:  # beyond half an 8-bit level: more than rounding error
        raise ValueError(
            f"{source} is a float image with values from {low:g} to {high:g}; float images are read as 0.0 "
            "(black) to 1.0 (white): rescale it to 0..1 (divide 0..255 values by 255), or save it as an 8-bit PNG"
        )
    return levels.astype(np.uint8)
