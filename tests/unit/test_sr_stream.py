"""The SR decode streamed into the MP4 writer: segment-major tile decode, blended segment by segment.

`decode_and_assemble_chunks` must give, concatenated, exactly the frames of the whole-clip decode + blend, and
the worker's streamed MP4 the bytes `write_mp4` makes from them. A 33-frame clip has 9 latent frames, decoded in
causal segments of 5 + 4 latents = 17 + 16 frames, so the stream has two chunks; the 96x32 source is two x2 tiles,
and an exact target size adds the antialiased downscale.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from k6serve.media import mux
from k6serve.testing.clips import make_clip

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def worker(tiny_sr_dir):
    from k6serve.api import build_engine_config
    from k6serve.runtime.worker import ModelWorker

    return ModelWorker(build_engine_config(str(tiny_sr_dir), device="cpu", warmup_mode="off"))


@pytest.fixture(scope="module")
def clip(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("sr_stream")
    return make_clip(folder / "clip33.mp4", width=96, height=32, num_frames=33, fps=24, audio="stereo_tone")


def _params(clip: Path, tmp_path: Path, **overrides):
    from k6serve.api import split_kwargs

    return split_kwargs({"video_path": str(clip), "sr_resolution_scale": 2, "seed": 7, "output_path": str(tmp_path),
                         "output_file_name": "up.mp4", "return_frames": True} | overrides)


@pytest.mark.parametrize("target", [None, "150x50"], ids=["x2", "x2-then-downscale"])
def test_streamed_chunks_equal_the_whole_clip_decode(worker, clip, tmp_path, target):
    extra = {} if target is None else {"sr_target_resolution": target, "sr_target_resize_mode": "exact"}
    params, _ = _params(clip, tmp_path, **extra)
    request, _ = worker.resolve(params)
    reference = worker.pipeline(request)
    chunks: list[np.ndarray] = []

    def sink(frame_chunks, audio, fps):
        assert audio is not None and fps == reference.fps
        chunks.extend(frame_chunks)

    streamed = worker.pipeline(request, video_sink=sink)
    assert [chunk.shape[0] for chunk in chunks] == [17, 16]
    assert np.array_equal(np.concatenate(chunks), reference.video.frames_THWC)
    assert np.array_equal(streamed.video.frames_THWC, reference.video.frames_THWC)
    expected_size = (64, 192) if target is None else (50, 150)
    assert reference.video.frames_THWC.shape == (33, *expected_size, 3)
    assert {"decode", "video_sink"} <= streamed.timings.keys() and "blend" not in streamed.timings
    assert {"decode", "blend"} <= reference.timings.keys()


def test_segments_of_one_tile_equal_its_whole_decode(worker):
    vae = worker.pipeline.models.vae
    generator = torch.Generator().manual_seed(0)
    latent_BCThw = torch.randn(1, vae.model.config.latent_channels, 9, 4, 4, generator=generator)
    segments = list(vae.iter_decode_tile(latent_BCThw))
    assert [segment.shape[1] for segment in segments] == [17, 16]
    assert torch.equal(torch.cat(segments, dim=1), vae.decode_tile(latent_BCThw))


def test_worker_streams_the_sr_decode_into_the_same_mp4(worker, clip, tmp_path, monkeypatch):
    calls = []
    original = mux.write_mp4_stream
    monkeypatch.setattr(mux, "write_mp4_stream", lambda *args, **kwargs: calls.append(1) or original(*args, **kwargs))
    params, output = _params(clip, tmp_path)
    result = worker.run(params, output)
    assert calls == [1]
    assert {"decode", "mux"} <= result.timings.keys() and not {"blend", "video_sink"} & result.timings.keys()
    assert result.frames.shape == (33, 64, 192, 3) and result.audio is not None
    reference = mux.write_mp4(tmp_path / "reference.mp4", result.frames, result.fps, result.audio,
                              result.audio_sample_rate)
    assert Path(result.output_file_path).read_bytes() == reference.read_bytes()
