"""The thumbnail and spritesheet of a finished video (media/stills.py, served as /content?variant=...): which frames,
in which order, in the shape players show them, and the formats OpenAI's API answers (WebP, JPEG)."""

from __future__ import annotations

import io
from fractions import Fraction
from pathlib import Path

import numpy as np
import PIL.Image
import pytest

from k6serve.media.stills import SPRITE_SIZE, spritesheet_jpeg, thumbnail_webp
from k6serve.media.video import read_video, sample_frames
from k6serve.testing.clips import make_clip


@pytest.fixture(scope="module")
def clip(tmp_path_factory) -> Path:
    # A moving pattern: every frame differs from the others.
    return make_clip(tmp_path_factory.mktemp("stills") / "clip.mp4", width=48, height=32, num_frames=21, fps=24)


@pytest.mark.parametrize(("count", "indices"), [
    (1, (10,)),  # the middle frame
    (4, (2, 7, 13, 18)),  # the middle of each quarter
    (16, (0, 1, 3, 4, 5, 7, 8, 9, 11, 12, 13, 15, 16, 17, 19, 20)),  # 21 / 16 apart, rounded down
    (40, tuple(range(21))),  # a shorter video: every frame
])
def test_sampled_frames_are_the_middles_of_equal_parts_decoded_as_read_video_does(clip, count, indices):
    sampled = sample_frames(clip, count)
    assert sampled.indices == indices and sampled.num_frames == 21 and sampled.sample_aspect_ratio is None
    every = read_video(clip).frames
    assert len(sampled.frames) == len(indices)
    assert all(np.array_equal(frame, every[index]) for frame, index in zip(sampled.frames, indices, strict=True))


def test_the_decode_stops_at_the_last_frame_picked(clip, monkeypatch):
    from k6serve.media import video

    asked = []
    decode = video._decode_rgb

    def watched(container, stream, path, keep, **kwargs):
        return decode(container, stream, path, lambda index: asked.append(index) or keep(index), **kwargs)

    monkeypatch.setattr(video, "_decode_rgb", watched)
    assert sample_frames(clip, 1).indices == (10,)
    assert asked == list(range(12))  # frames 0-10, then 11 ends it: a long 4K video is not decoded to its end


def test_a_count_below_one_is_refused(clip):
    with pytest.raises(ValueError, match="count must be >= 1, got 0"):
        sample_frames(clip, 0)


def test_the_thumbnail_is_the_middle_frame_as_webp(clip):
    image = PIL.Image.open(io.BytesIO(thumbnail_webp(clip)))
    assert (image.format, image.size, image.mode) == ("WEBP", (48, 32), "RGB")
    frames = read_video(clip).frames.astype(np.int16)
    pixels = np.asarray(image, dtype=np.int16)
    # Lossy, so the nearest frame, and near it.
    assert int(np.argmin([np.abs(pixels - frame).mean() for frame in frames])) == 10
    assert np.abs(pixels - frames[10]).mean() < 4


def test_the_spritesheet_holds_sixteen_frames_in_rows_of_four_in_order(clip):
    image = PIL.Image.open(io.BytesIO(spritesheet_jpeg(clip)))
    assert (image.format, image.size) == ("JPEG", (4 * 48, 4 * 32))  # small frames are not enlarged
    frames = read_video(clip).frames.astype(np.int16)
    tiles = np.asarray(image.convert("RGB"), dtype=np.int16)
    picked = sample_frames(clip, 16).indices
    for position, index in enumerate(picked):
        row, column = divmod(position, 4)
        tile = tiles[row * 32:(row + 1) * 32, column * 48:(column + 1) * 48]
        assert int(np.argmin([np.abs(tile - frame).mean() for frame in frames])) == index


def test_large_frames_shrink_to_the_sprite_size_and_non_square_pixels_show_in_display_shape(tmp_path):
    # 300x200 stored with 4:3 pixels plays as 400x200: the thumbnail so, each sprite within 256 pixels of that.
    wide = make_clip(tmp_path / "anamorphic.mp4", width=300, height=200, num_frames=3, fps=24,
                     sample_aspect_ratio=Fraction(4, 3))
    assert sample_frames(wide, 1).sample_aspect_ratio == Fraction(4, 3)
    assert PIL.Image.open(io.BytesIO(thumbnail_webp(wide))).size == (400, 200)
    sheet = PIL.Image.open(io.BytesIO(spritesheet_jpeg(wide)))
    assert SPRITE_SIZE == 256 and sheet.size == (3 * 256, 128)  # 3 frames: one row of 3


def test_a_container_that_states_no_length_has_its_packets_counted(tmp_path, monkeypatch):
    from k6serve.media import video

    mkv = make_clip(tmp_path / "clip.mkv", width=48, height=32, num_frames=21, fps=24)
    monkeypatch.setattr(video, "declared_frame_count", lambda stream, fps: None)  # Matroska states none per stream
    sampled = sample_frames(mkv, 1)
    assert sampled.num_frames == 21 and sampled.indices == (10,)
    assert np.array_equal(sampled.frames[0], read_video(mkv).frames[10])
