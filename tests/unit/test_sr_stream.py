"""The SR decode streamed into the MP4 writer: segment-major tile decode, blended segment by segment.

`decode_and_assemble_chunks` must give, concatenated, exactly the frames of the whole-clip decode + blend, and
the worker's streamed MP4 the bytes `write_mp4` makes from them. A 33-frame clip has 9 latent frames, decoded in
causal segments of 5 + 4 latents = 17 + 16 frames, so the stream has two chunks; the 96x32 source is two x2 tiles,
and an exact target size adds the antialiased downscale.
"""

from __future__ import annotations

from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest
import torch

from k6serve.media import mux
from k6serve.testing.clips import make_clip

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def worker(tiny_sr_dir):
    from k6serve.engine_arguments import build_engine_config
    from k6serve.runtime.worker import ModelWorker

    return ModelWorker(build_engine_config(str(tiny_sr_dir), device="cpu", warmup_mode="off"))


@pytest.fixture(scope="module")
def clip(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("sr_stream")
    return make_clip(folder / "clip33.mp4", width=96, height=32, num_frames=33, fps=24, audio="stereo_tone")


def _params(clip: Path, tmp_path: Path, **overrides):
    from k6serve.request_arguments import split_kwargs

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


def test_whole_tile_fallback_streams_the_same_chunks(worker, clip, tmp_path, monkeypatch):
    # When the tiles' caches would not fit side by side (decided on CUDA from the first segment's memory), the
    # tiles are decoded whole and only the blend is streamed: the same chunks, bit for bit.
    from k6serve.pipelines import sr_decode

    params, _ = _params(clip, tmp_path)
    request, _ = worker.resolve(params)
    reference = worker.pipeline(request).video.frames_THWC
    monkeypatch.setattr(sr_decode, "_segment_major_fits", lambda device, per_tile_bytes, num_tiles: False)
    chunks: list[np.ndarray] = []
    worker.pipeline(request, video_sink=lambda frame_chunks, audio, fps: chunks.extend(frame_chunks))
    assert [chunk.shape[0] for chunk in chunks] == [17, 16]
    assert np.array_equal(np.concatenate(chunks), reference)


def test_a_failing_sink_closes_the_decode_at_once():
    from k6serve.pipelines.decode_stream import feed_video_sink

    closed = []

    def decode():
        try:
            for index in range(3):
                yield np.full((2, 4, 4, 3), index, dtype=np.uint8)
        finally:
            closed.append(True)

    def sink(frame_chunks, audio, fps):
        next(frame_chunks)
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        feed_video_sink(sink, decode(), None, 24.0, {}, "decode")
    assert closed == [True]  # not left for the garbage collector


def test_segment_major_needs_half_of_what_is_left_for_the_other_tiles(monkeypatch):
    from k6serve.pipelines.sr_decode import _segment_major_fits

    gib = 2**30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (30 * gib, 141 * gib))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device: 12 * gib)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device: 10 * gib)
    cuda = torch.device("cuda", 0)
    # 32 GiB left (30 free + 2 reserved unused): 16 GiB for the other tiles' caches.
    assert _segment_major_fits(cuda, 2 * gib, 9)  # 8 x 2 = 16 GiB
    assert not _segment_major_fits(cuda, 2 * gib, 10)  # 18 GiB
    assert _segment_major_fits(torch.device("cpu"), 100 * gib, 100)  # off CUDA: always


def test_server_warmup_upscales_a_synthetic_clip_before_the_first_request(tiny_sr_dir, monkeypatch, tmp_path):
    """--warmup-mode server on the VSR model: at start the worker upscales a synthetic clip (SR_WARMUP_CLIP's shape)
    into a temporary MP4 through the request path, reports its cost, and leaves no file behind; a request then
    runs without a warm-up entry. --warmup-mode request has nothing shorter to run first for SR: 0 s."""
    import tempfile

    from k6serve.engine_arguments import build_engine_config
    from k6serve.request import OutputOptions, SamplingParams
    from k6serve.runtime import worker as worker_module

    monkeypatch.setattr(worker_module, "SR_WARMUP_CLIP", (96, 32, 17, 24))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # where the warm-up's temporary folder goes
    calls = []
    original = worker_module.generate_into_mp4

    def recording(pipeline, request, target, on_step):
        calls.append((Path(request.video_path).name, target.name))
        return original(pipeline, request, target, on_step)

    monkeypatch.setattr(worker_module, "generate_into_mp4", recording)
    worker = worker_module.ModelWorker(build_engine_config(str(tiny_sr_dir), device="cpu", warmup_mode="server"))
    assert worker.warmed_up and worker.server_warmup_s > 0
    assert calls == [("source.mp4", "upscaled.mp4")]
    assert list(tmp_path.iterdir()) == []  # the temporary clip and MP4 are gone
    source = make_clip(tmp_path / "clip.mp4", width=96, height=32, num_frames=17, fps=24)
    warmups = []
    monkeypatch.setattr(worker, "_warmup", lambda params: warmups.append(params) or 0.0)
    result = worker.run(SamplingParams(video_path=str(source), sr_resolution_scale=2),
                        OutputOptions(save_output=False, return_frames=False))
    assert warmups == [] and "warmup" not in result.timings  # warmed at start, not again before the request
    request_mode = worker_module.ModelWorker(build_engine_config(str(tiny_sr_dir), device="cpu",
                                                                 warmup_mode="request"))
    assert request_mode.server_warmup_s is None
    result = request_mode.run(SamplingParams(video_path=str(source), sr_resolution_scale=2),
                              OutputOptions(save_output=False, return_frames=False))
    assert "warmup" not in result.timings and request_mode.warmed_up  # its first request is its own warm-up


def test_a_decode_started_before_the_sink_is_timed_from_its_start_and_closed_by_it():
    """The spatial-shard decode is started before the sink gets it (`_StartedChunks`): its "decode" time counts from
    that start, and a sink that stops early closes the decode itself (where a replica's collectives are finished)."""
    import time

    from k6serve.pipelines.decode_stream import feed_video_sink
    from k6serve.pipelines.sr_decode import _StartedChunks

    closed = []

    def decode():
        try:
            time.sleep(0.2)
            yield np.zeros((1, 2, 2, 3), np.uint8)
            yield np.ones((1, 2, 2, 3), np.uint8)
        finally:
            closed.append(True)

    timings: dict[str, float] = {}
    started_at = time.perf_counter()
    frames = feed_video_sink(lambda chunks, audio, fps: list(chunks), _StartedChunks(decode()), None, 24.0, timings,
                             "decode", started_at=started_at)
    assert frames.shape == (2, 2, 2, 3) and timings["decode"] >= 0.2 and closed == [True]

    def failing_sink(chunks, audio, fps):
        raise OSError(28, "No space left on device")  # before reading anything

    closed.clear()
    with pytest.raises(OSError):
        feed_video_sink(failing_sink, _StartedChunks(decode()), None, 24.0, {}, "decode")
    assert closed == [True]


@pytest.mark.parametrize("rotation, shown", [(0, "4:3"), (90, "3:4")])
def test_an_anamorphic_source_is_upscaled_into_a_file_tagged_with_its_pixel_shape(worker, tmp_path, rotation, shown):
    """A 64x48 source of 4:3 pixels plays as 16:9; its upscale was written with square pixels, so it played as 4:3,
    squeezed by a quarter. The frames are upscaled as stored (as the reference does) and the MP4 keeps the ratio;
    a source turned a quarter by its display matrix has its frames turned upright, and the ratio inverted."""
    import av

    source = make_clip(tmp_path / "anamorphic.mp4", width=64, height=32, num_frames=9, fps=24,
                       sample_aspect_ratio=Fraction(4, 3), rotation=rotation)
    params, output = _params(source, tmp_path)
    result = worker.run(params, output)
    expected = Fraction(4, 3) if rotation == 0 else Fraction(3, 4)
    assert result.sample_aspect_ratio == expected  # also for a caller of the frames
    # Worded for every surface: an HTTP job's warnings named "the result's sample_aspect_ratio", which jobs lack.
    assert (f"the output keeps the source's sample aspect ratio {shown}: the MP4 is tagged with it, so players show "
            "the source's shape") in result.notes
    with av.open(result.output_file_path) as container:
        stream = container.streams.video[0]
        assert (stream.width, stream.height) == ((128, 64) if rotation == 0 else (64, 128))
        assert stream.sample_aspect_ratio == expected
    params, output = _params(source, tmp_path, save_output=False)
    assert worker.run(params, output).sample_aspect_ratio == expected  # no file: the ratio is in the result


def test_an_exact_target_that_reshapes_an_anamorphic_source_is_written_with_square_pixels(worker, tmp_path):
    """Tagged with the source's 4:3 after 'exact' had set the shape, a 128x72 output showed at 2.37:1."""
    import av

    source = make_clip(tmp_path / "anamorphic.mp4", width=64, height=48, num_frames=9, fps=24,
                       sample_aspect_ratio=Fraction(4, 3))
    params, output = _params(source, tmp_path, sr_target_resolution="128x72", sr_target_resize_mode="exact")
    result = worker.run(params, output)
    assert (result.width, result.height) == (128, 72) and result.sample_aspect_ratio is None
    assert "the 'exact' sr_target_resolution sets the output's shape: its 128x72 frames have square pixels, not " \
           "the source's 4:3" in result.notes
    with av.open(result.output_file_path) as container:
        assert container.streams.video[0].sample_aspect_ratio in (None, Fraction(1, 1))


def test_a_square_pixel_source_writes_the_same_bytes_as_before(worker, clip, tmp_path):
    """No ratio tag where the source has square pixels: the file is write_mp4's of the frames, byte for byte."""
    params, output = _params(clip, tmp_path)
    result = worker.run(params, output)
    assert not any("aspect ratio" in note for note in result.notes)
    reference = mux.write_mp4(tmp_path / "reference.mp4", result.frames, result.fps, result.audio,
                              result.audio_sample_rate)
    assert Path(result.output_file_path).read_bytes() == reference.read_bytes()
