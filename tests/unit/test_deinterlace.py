"""Interlaced SR sources (DVDs, broadcast and camcorder 1080i) are deinterlaced before upscaling
(k6serve/media/deinterlace.py, `Deinterlacer`): the combing of two fields from different instants is gone, the frame
count and rate are the source's, and a progressive source is untouched."""

from __future__ import annotations

import av
import numpy as np
import pytest

from k6serve.media.video import SRSourceReader, read_sr_source

WIDTH, HEIGHT = 64, 48


def _write(path, *, interlaced: bool, num_frames: int = 17, fps: int = 25) -> None:
    """A white bar moving 4 px a frame; interlaced, each frame's odd lines are half a frame later than its even
    lines (top field first), as a camera's fields are, and the stream is coded as interlaced."""
    with av.open(str(path), "w") as container:
        stream = container.add_stream("libx264", rate=fps)
        stream.width, stream.height, stream.pix_fmt = WIDTH, HEIGHT, "yuv420p"
        stream.codec_context.options = {"crf": "10", "threads": "1"} | ({"x264-params": "tff=1"} if interlaced else {})
        for index in range(num_frames):
            image = np.zeros((HEIGHT, WIDTH, 3), np.uint8)
            for y in range(HEIGHT):
                start = int(4 * (index + (0.5 if interlaced and y % 2 else 0))) % WIDTH
                image[y, start:start + 16] = 255
            frame = av.VideoFrame.from_ndarray(image, format="rgb24")
            frame.pts = index
            container.mux(stream.encode(frame))
        container.mux(stream.encode(None))


def _combing(frames: np.ndarray) -> float:
    """How far each line is from the mean of its neighbours, on average (fields of different instants: large)."""
    luma = frames.astype(float).mean(axis=-1)
    return float(np.abs(luma[:, 1:-1] - (luma[:, :-2] + luma[:, 2:]) / 2).mean())


def _plain(path) -> np.ndarray:
    with av.open(str(path)) as container:
        return np.stack([frame.to_ndarray(format="rgb24") for frame in container.decode(video=0)])


def test_an_interlaced_source_is_deinterlaced_frame_for_frame(tmp_path, caplog):
    path = tmp_path / "576i.mp4"
    _write(path, interlaced=True)
    with caplog.at_level("INFO", logger="k6serve.media.video"):
        clip = read_sr_source(path)
    plain = _plain(path)
    assert clip.frames.shape == plain.shape and clip.fps == 25  # one frame each: the count and rate kept
    assert _combing(plain) > 10 and _combing(clip.frames) < 1.5
    note = ("the source is interlaced (top field first): its frames were deinterlaced (FFmpeg's bwdif, one frame "
            "each, so the frame rate is the source's) before upscaling")
    assert note in clip.notes and note in caplog.text
    # The bar is where the frame's first field shows it, not smeared over both fields' places.
    assert abs(int(np.argmax(clip.frames[5, HEIGHT // 2, :, 0] > 128)) - 20) <= 2


def test_a_progressive_source_is_untouched(tmp_path):
    path = tmp_path / "progressive.mp4"
    _write(path, interlaced=False)
    clip = read_sr_source(path)
    np.testing.assert_array_equal(clip.frames, _plain(path))
    assert not [note for note in clip.notes if "interlaced" in note]


@pytest.mark.parametrize("max_frames", [1, 9])
def test_reading_stops_early_without_waiting_for_the_rest(tmp_path, max_frames):
    """The filter holds a frame until the next arrives: a reader that stops early still gets its frames, and the
    same ones as a full read."""
    path = tmp_path / "576i.mp4"
    _write(path, interlaced=True, num_frames=33)
    with SRSourceReader(path, max_frames=max_frames) as reader:
        frames = list(reader.frames())
        summary = reader.summary()
    assert summary.num_frames == max_frames
    full = read_sr_source(path)
    np.testing.assert_array_equal(np.stack(frames[:max_frames]), full.frames[:max_frames])
