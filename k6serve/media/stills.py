"""Still images of a finished video: the thumbnail and the spritesheet OpenAI's video API serves beside the MP4
(`GET /v1/videos/{id}/content?variant=thumbnail|spritesheet`, the SDK's `download_content(variant=...)`).

OpenAI's service answers a WebP thumbnail and a JPEG spritesheet; these are the same formats. The thumbnail is the
video's middle frame at full size (the first frame of an image-to-video job shows its input image, so the middle one
says more of what was made); the spritesheet is `SPRITESHEET_FRAMES` frames spread evenly over the video, in rows of
`SPRITESHEET_COLUMNS`, each scaled to fit `SPRITE_SIZE` pixels. Both are drawn in the shape players show: an
upscaled anamorphic source's frames (non-square pixels, `sample_aspect_ratio`) are widened or narrowed to it.
They are made from the MP4 when asked for (0.16 s for the thumbnail of a 121-frame 512x768 clip on this project's
2-core CI machine, 0.27 s for its spritesheet; the decode stops at the last frame used), not stored, so deleting or
expiring a job has nothing more to remove.
"""

from __future__ import annotations

import io
import math
import os
from fractions import Fraction

import numpy as np
import PIL.features
import PIL.Image

from k6serve.media.video import sample_frames

THUMBNAIL_MEDIA_TYPE = "image/webp"
SPRITESHEET_MEDIA_TYPE = "image/jpeg"
SPRITESHEET_FRAMES = 16
SPRITESHEET_COLUMNS = 4
SPRITE_SIZE = 256  # each frame of the spritesheet fits a square of this side, its display shape kept
# Pillow's defaults are 80 and 75; a still of a video is looked at closely.
_QUALITY = 90


def thumbnail_webp(path: str | os.PathLike[str]) -> bytes:
    """The video's middle frame as a WebP image (RGB, full size, display shape)."""
    if not PIL.features.check("webp"):
        # Pillow's wheels include libwebp; a Pillow built without it cannot write the format OpenAI's API serves.
        raise RuntimeError("this Pillow was built without WebP support, so no thumbnail can be written; install "
                           "Pillow's wheel (pip install --force-reinstall pillow)")
    sampled = sample_frames(path, 1)
    image = _display_image(sampled.frames[0], sampled.sample_aspect_ratio)
    buffer = io.BytesIO()
    image.save(buffer, format="WEBP", quality=_QUALITY)
    return buffer.getvalue()


def spritesheet_jpeg(path: str | os.PathLike[str]) -> bytes:
    """Up to `SPRITESHEET_FRAMES` frames spread over the video, left to right then top to bottom, as one JPEG."""
    sampled = sample_frames(path, SPRITESHEET_FRAMES)
    tiles = [_display_image(frame, sampled.sample_aspect_ratio) for frame in sampled.frames]
    width, height = tiles[0].size
    scale = min(1.0, SPRITE_SIZE / max(width, height))  # never enlarged: a small video keeps its pixels
    size = (max(1, round(width * scale)), max(1, round(height * scale)))
    columns = min(SPRITESHEET_COLUMNS, len(tiles))
    sheet = PIL.Image.new("RGB", (columns * size[0], math.ceil(len(tiles) / columns) * size[1]))
    for position, tile in enumerate(tiles):
        row, column = divmod(position, columns)
        resized = tile if tile.size == size else tile.resize(size, PIL.Image.Resampling.LANCZOS)
        sheet.paste(resized, (column * size[0], row * size[1]))
    buffer = io.BytesIO()
    sheet.save(buffer, format="JPEG", quality=_QUALITY)
    return buffer.getvalue()


def _display_image(frame_HWC: np.ndarray, sample_aspect_ratio: Fraction | None) -> PIL.Image.Image:
    """The frame in the shape players show it: non-square pixels widen (or narrow) it, its height kept."""
    image = PIL.Image.fromarray(frame_HWC)  # uint8 (H, W, 3): RGB
    if sample_aspect_ratio is None:
        return image
    width = max(1, round(image.width * sample_aspect_ratio))
    return image.resize((width, image.height), PIL.Image.Resampling.LANCZOS)
