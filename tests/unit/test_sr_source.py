"""The SR source read on a background thread with the K-VAE encode running beside it (pipelines/sr_source.py): the
same latent as encoding the whole clip read first, bit for bit, whatever the 24 fps rule and the 1 + 8k floor drop;
the first segment is encoded while the source is still decoding; every error reaches the caller with the reader's
message and stops the thread; the soundtrack and the notes are the reader's."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from k6serve.media.audio import OUTPUT_SAMPLE_RATE, processed_num_samples, read_source_audio
from k6serve.media.video import SRSourceReader, read_sr_source
from k6serve.pipelines import sr_source
from k6serve.pipelines.sr_source import read_and_encode
from k6serve.pipelines.sr_plan import plan_upscale
from k6serve.pipelines.sr_stages import prepare_pixels
from k6serve.request import UpscaleRequest
from k6serve.testing.clips import make_clip

CPU = torch.device("cpu")
pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _request(path: Path, scale: float = 2.0) -> UpscaleRequest:
    return UpscaleRequest(video_path=str(path), scale=scale, tiles_batch_size=1, tile_min_overlap=0.25,
                          target_resolution=None, target_resize_mode="fit", seed=0, requested_steps=None)


def _planner(request: UpscaleRequest, vae, tile_sizes):
    return lambda size: plan_upscale(size, request, tile_sizes=tile_sizes, snap=vae.spatial_compression_ratio)


@pytest.fixture(scope="module")
def vae(tiny_sr_configs):
    from k6serve.models.kandinsky6_sr.checkpoint import build_dummy_sr_models
    from k6serve.models.variants import VARIANTS

    models = build_dummy_sr_models(tiny_sr_configs, VARIANTS["vsr-distilled2steps"], device=CPU,
                                   dtype=torch.float32)
    return models.vae


@pytest.mark.parametrize(
    ("num_frames", "fps", "scale", "audio", "kept"),
    [
        (49, 24, 2.0, "mono_tone", 49),  # segments 17, 16, 16
        (46, 24, 2.25, "none", 41),  # floored: 17, 16, 8; the x1.125 pre-upscale per segment
        (45, 30, 2.0, "stereo_tone", 33),  # subsampled: 36 selected while decoding, int(45 / 1.25) = 36 -> 33
        (11, 30, 2.0, "none", 1),  # 9 selected while decoding, the end bound keeps 8 -> 1 frame
        (17, 24, 2.0, "late_mono_tone", 17),  # the soundtrack starts 0.25 s in: aligned to the first frame
    ],
)
def test_streamed_encode_equals_encoding_the_whole_clip(vae, tiny_sr_configs, tmp_path, num_frames, fps, scale,
                                                        audio, kept):
    delay = 0.25 if audio.startswith("late_") else 0.0
    path = make_clip(tmp_path / "source.mp4", width=48, height=32, num_frames=num_frames, fps=fps,
                     audio=audio.removeprefix("late_"), audio_delay=delay)
    request = _request(path, scale)
    make_plan = _planner(request, vae, tiny_sr_configs.transformer.tile_sizes)
    timings: dict[str, float] = {}
    streamed = read_and_encode(vae, str(path), CPU, make_plan, timings)

    clip = read_sr_source(path)
    frames_TCHW = torch.from_numpy(clip.frames).permute(0, 3, 1, 2)
    plan = make_plan(tuple(frames_TCHW.shape[-2:]))
    expected = vae.encode_clip(prepare_pixels(frames_TCHW, plan).permute(1, 0, 2, 3).unsqueeze(0))
    assert streamed.num_frames == clip.num_frames == kept
    assert streamed.latent_BCThw.shape == expected.shape and streamed.latent_BCThw.shape[2] == 1 + (kept - 1) // 4
    assert torch.equal(streamed.latent_BCThw, expected)
    assert streamed.plan == plan and streamed.fps == clip.fps and streamed.notes == clip.notes
    expected_audio = read_source_audio(path, sample_rate=OUTPUT_SAMPLE_RATE,
                                       num_samples=processed_num_samples(kept, clip.fps, OUTPUT_SAMPLE_RATE),
                                       video_start=0.0)
    if delay:
        assert not np.any(expected_audio[:round(0.2 * OUTPUT_SAMPLE_RATE)])  # the silence before the late start
    if expected_audio is None:
        assert streamed.audio is None
    else:
        assert streamed.audio.sample_rate == OUTPUT_SAMPLE_RATE
        np.testing.assert_array_equal(streamed.audio.waveform, expected_audio)
    assert set(timings) == {"read", "encode"} and min(timings.values()) >= 0


def test_the_first_segment_is_encoded_while_the_source_still_decodes(vae, tiny_sr_configs, tmp_path, monkeypatch):
    """The reader stalls after frame 33 until the encoder has pushed a segment: with the encode waiting for the
    whole read, this would time out."""
    path = make_clip(tmp_path / "source.mp4", width=48, height=32, num_frames=49, fps=24)
    pushed = threading.Event()
    original_frames, original_push = SRSourceReader.frames, sr_source.CausalClipEncoder.push

    def stalling_frames(self):
        for index, frame in enumerate(original_frames(self)):
            if index == 33:
                assert pushed.wait(timeout=30), "the encode did not start before the read ended"
            yield frame

    def recording_push(self, segment):
        original_push(self, segment)
        pushed.set()

    monkeypatch.setattr(SRSourceReader, "frames", stalling_frames)
    monkeypatch.setattr(sr_source.CausalClipEncoder, "push", recording_push)
    make_plan = _planner(_request(path), vae, tiny_sr_configs.transformer.tile_sizes)
    source = read_and_encode(vae, str(path), CPU, make_plan, {})
    assert source.num_frames == 49 and pushed.is_set()


def _source_threads() -> list[threading.Thread]:
    return [thread for thread in threading.enumerate() if thread.name == "k6serve-sr-source"]


def test_errors_reach_the_caller_and_stop_the_reader(vae, tiny_sr_configs, tmp_path):
    tile_sizes = tiny_sr_configs.transformer.tile_sizes
    missing = tmp_path / "missing.mp4"
    with pytest.raises(ValueError, match=r"missing\.mp4'.*does not exist"):
        read_and_encode(vae, str(missing), CPU, _planner(_request(missing), vae, tile_sizes), {})
    # A request error (the plan, from the first frame's size) is raised before any encode, and the reader stops.
    small = make_clip(tmp_path / "small.mp4", width=24, height=24, num_frames=49, fps=24)
    with pytest.raises(ValueError, match="need at least 32x32; use a larger input"):
        read_and_encode(vae, str(small), CPU, _planner(_request(small), vae, tile_sizes), {})
    assert not _source_threads()
    # A source the rule keeps no frame of: the reader's message.
    short = make_clip(tmp_path / "short.mp4", width=48, height=32, num_frames=1, fps=60)
    with pytest.raises(ValueError, match=r"short\.mp4' gives no frames to upscale: 1 decoded frame\(s\) at 60 fps, "
                                         r"which .* keeping none of fewer than 3 frames; pass a clip of at least 3"):
        read_and_encode(vae, str(short), CPU, _planner(_request(short), vae, tile_sizes), {})
    assert not _source_threads()


def test_definitely_kept_never_passes_the_final_count(tmp_path):
    """While frames are still decoding, the count the stage may encode up to is a 1 + 8k prefix of the final
    selection, for kept-every-frame, subsampled and capped sources."""
    for name, num_frames, fps, max_frames in (("a", 40, 24, 121), ("b", 45, 30, 121), ("c", 11, 30, 121),
                                               ("d", 160, 30, 50)):
        path = make_clip(tmp_path / f"{name}.mp4", width=32, height=32, num_frames=num_frames, fps=fps)
        seen = []
        with SRSourceReader(path, max_frames=max_frames) as reader:
            frames = [frame for frame in reader.frames() if not seen.append(reader.definitely_kept())]
            summary = reader.summary()
        assert seen == sorted(seen) and seen[-1] <= summary.num_frames
        assert all((count - 1) % 8 == 0 for count in seen if count)
        assert max(seen) >= summary.num_frames - 8 * (fps != 24)  # the kept-every-frame case ends on the final count
        clip = read_sr_source(path, max_frames=max_frames)
        np.testing.assert_array_equal(np.stack(frames[: summary.num_frames]), clip.frames)


def test_summary_needs_the_frames_read_first(tmp_path):
    path = make_clip(tmp_path / "clip.mp4", width=32, height=32, num_frames=9, fps=24)
    with SRSourceReader(path) as reader, pytest.raises(RuntimeError, match="frames\\(\\) to be exhausted"):
        reader.summary()


def test_pixel_aspect_ratio_is_turned_with_the_frames():
    from fractions import Fraction

    from k6serve.media.orientation import pixel_aspect_ratio

    assert pixel_aspect_ratio(Fraction(4, 3), 0.0) == Fraction(4, 3)
    assert pixel_aspect_ratio(Fraction(4, 3), 90.0) == pixel_aspect_ratio(Fraction(4, 3), -90.0) == Fraction(3, 4)
    assert pixel_aspect_ratio(Fraction(4, 3), 180.0) == Fraction(4, 3)
    assert pixel_aspect_ratio(None, 0.0) is pixel_aspect_ratio(Fraction(1, 1), 90.0) is None
    assert pixel_aspect_ratio(Fraction(0, 1), 0.0) is None  # FFmpeg's "unknown"


def test_read_sr_source_gives_the_pixel_shape_with_the_frames(tmp_path):
    from fractions import Fraction

    path = make_clip(tmp_path / "anamorphic.mp4", width=32, height=32, num_frames=9, fps=24,
                     sample_aspect_ratio=Fraction(4, 3))
    clip = read_sr_source(path)
    assert clip.sample_aspect_ratio == Fraction(4, 3)
    assert any("pixels are not square (sample aspect ratio 4:3)" in note for note in clip.notes)
    assert read_sr_source(make_clip(tmp_path / "square.mp4", width=32, height=32, num_frames=9,
                                    fps=24)).sample_aspect_ratio is None
