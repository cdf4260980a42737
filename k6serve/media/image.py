"""Loading the conditioning image of an image-to-video request, and diffusers' cover-resize + crop.

Loading mirrors `diffusers.utils.load_image` for files (EXIF orientation applied, converted to
RGB); PIL images passed in are only converted to RGB, as diffusers' pipeline does not rotate them.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import numpy as np
import PIL.Image
import PIL.ImageOps


# The cover resize scales the image until it covers the video, so one far narrower (or flatter) than the video grows
# along its long side without bound before the crop: a 101-byte 1x4000 PNG became a 768x3,072,000 image (about 10 GB)
# for a 768x512 video. Past PIL's own decompression-bomb threshold it is refused instead.
MAX_COVER_RESIZED_PIXELS = 89_478_485


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
    image: str | os.PathLike[str] | PIL.Image.Image, height: int, width: int
) -> PIL.Image.Image:
    """Open and check a conditioning image for a `height` x `width` video; returns it RGB, unresized.

    The pipeline resizes it (`cover_resize_center_crop`); height and width are checked here so a
    bad request fails before any model work.
    """
    for name, value in (("height", height), ("width", width)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if isinstance(image, PIL.Image.Image):
        loaded = image
        source = "the given PIL image"
    else:
        source = repr(str(image))
        loaded = _open_image_file(Path(image))
    if loaded.width < 1 or loaded.height < 1:
        raise ValueError(f"conditioning image {source} is empty ({loaded.width}x{loaded.height})")
    check_cover_resize(loaded.width, loaded.height, height, width, source=f"conditioning image {source}")
    if loaded.mode.startswith("I;16"):
        # A 16-bit grayscale PNG or TIFF: PIL's convert clips its values at 255, so the image came out white. Keep
        # the high byte instead, as PIL reads 16-bit RGB PNGs.
        loaded = PIL.Image.fromarray((np.asarray(loaded) >> 8).astype(np.uint8), mode="L")
    return loaded if loaded.mode == "RGB" else loaded.convert("RGB")


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


def _open_image_file(path: Path) -> PIL.Image.Image:
    if not path.is_file():
        what = "is a directory" if path.is_dir() else "does not exist"
        raise ValueError(f"cannot read conditioning image {str(path)!r}: it {what}")
    try:
        with PIL.Image.open(path) as opened:
            # load() decodes now, so a truncated or corrupt file fails here, not in the pipeline.
            opened.load()
            return PIL.ImageOps.exif_transpose(opened)
    except PIL.Image.DecompressionBombError as exc:
        # Not an OSError: PIL refuses to decode more than twice its MAX_IMAGE_PIXELS (a guard against files that
        # expand to gigabytes). The image is readable, only too large for a conditioning frame. PIL's message is
        # the only place its pixel count is told ("Image size (N pixels) exceeds limit of M pixels, ...").
        counts = re.findall(r"(\d+) pixels", str(exc))
        size = (f"{int(counts[0]):,} pixels, limit {int(counts[1]):,}" if len(counts) == 2
                else f"over {2 * (PIL.Image.MAX_IMAGE_PIXELS or 0):,} pixels")
        raise ValueError(
            f"conditioning image {str(path)!r} is too large ({size}); downscale it (the model uses it at the "
            "video's size, e.g. 768x512)"
        ) from exc
    except (PIL.UnidentifiedImageError, OSError, SyntaxError) as exc:
        raise ValueError(
            f"cannot read conditioning image {str(path)!r}: not a readable image ({exc}); "
            "pass a PNG, JPEG or WebP file"
        ) from exc
