"""A cancel between the chunks of the video decode: the pipelines report the final step again after each temporal
tile (generation) or each segment / tile / round of tiles (super-resolution), so `RequestCancelled` raised from
`on_step` stops the decode there, with no MP4 left and no encoder thread running; without a cancel the frames are
those of the one-shot decode, bit for bit. A multi-process replica of two ranks (gloo) cancels in its decode without
hanging: the leader streams the MP4, the other rank decodes through the same chunks, and both make the same
collective checks.

CPU, tiny random-weight checkpoints.
"""

from __future__ import annotations

import dataclasses
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from k6serve.media import mux
from k6serve.request import OutputOptions, SamplingParams
from k6serve.runtime.engine import RequestCancelled

ENCODER_THREAD = "k6serve-mp4-encoder"
GENERATE = {"prompt": "a fox", "seed": 5, "height": 32, "width": 32, "num_frames": 33, "num_inference_steps": 2}
NUM_GENERATION_TILES = 3  # 33 frames = 9 latent frames: temporal tiles of 4 + 1 latents, stride 3

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _encoder_threads() -> list[threading.Thread]:
    return [thread for thread in threading.enumerate() if thread.name == ENCODER_THREAD]


class CancelInDecode:
    """An `on_step` that records every call and raises RequestCancelled at the n-th repeat of the final step."""

    def __init__(self, at_decode_check: int | None) -> None:
        self.at_decode_check = at_decode_check
        self.calls: list[tuple[int, int]] = []

    @property
    def num_decode_checks(self) -> int:
        return max(0, sum(1 for step, total in self.calls if step == total) - 1)

    def __call__(self, step: int, total: int) -> None:
        self.calls.append((step, total))
        if self.num_decode_checks == self.at_decode_check:
            raise RequestCancelled(f"cancelled at decode check {self.at_decode_check}")


def _count_forwards(module: torch.nn.Module) -> tuple[list[int], torch.utils.hooks.RemovableHandle]:
    calls = [0]

    def count(*_) -> None:
        calls[0] += 1

    return calls, module.register_forward_pre_hook(count)


def _split(params: dict):
    from k6serve.request_arguments import split_kwargs

    return split_kwargs(params)


@pytest.fixture(scope="module")
def generation_worker(tiny_distill_dir):
    from k6serve.engine_arguments import build_engine_config
    from k6serve.runtime.worker import ModelWorker

    return ModelWorker(build_engine_config(str(tiny_distill_dir), device="cpu", warmup_mode="off"))


@pytest.fixture(scope="module")
def sr_worker(tiny_sr_dir):
    from k6serve.engine_arguments import build_engine_config
    from k6serve.runtime.worker import ModelWorker

    return ModelWorker(build_engine_config(str(tiny_sr_dir), device="cpu", warmup_mode="off"))


@pytest.fixture(scope="module")
def clip(tmp_path_factory) -> Path:
    from k6serve.testing.clips import make_clip

    folder = tmp_path_factory.mktemp("decode_cancel")
    return make_clip(folder / "clip33.mp4", width=96, height=32, num_frames=33, fps=24, audio="stereo_tone")


@pytest.fixture(scope="module")
def sr_reference(sr_worker, clip, tmp_path_factory):
    """The whole SR pipeline's result for `_sr_params(clip, ..., return_frames=True)`, no on_step (no checks at all):
    the reference of two tests, computed once (an SR run of the clip takes 5 s on 2 cores). On one torch thread, as
    the tests run (`one_torch_thread`, set up after a module's fixtures): two threads sum in another order."""
    params, _ = _sr_params(clip, tmp_path_factory.mktemp("sr_reference"), return_frames=True)
    num_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return sr_worker.pipeline(sr_worker.resolve(params)[0])
    finally:
        torch.set_num_threads(num_threads)


# ---- the MP4 writer ----


def test_a_producer_error_drops_the_queued_chunks_unencoded(tmp_path, monkeypatch):
    # A cancel raised in the decode used to wait for the encoder to encode every chunk already queued.
    from k6serve.testing.clips import moving_pattern

    release = threading.Event()
    encoded = [0]
    real_video_frame = mux._video_frame

    def slow_video_frame(frame_HWC: np.ndarray, index: int):
        if index == 0:
            release.wait(10)  # the encoder holds the first chunk while the other three fill the queue
        encoded[0] += 1
        return real_video_frame(frame_HWC, index)

    monkeypatch.setattr(mux, "_video_frame", slow_video_frame)

    def chunks():
        for _ in range(1 + mux.QUEUED_CHUNKS):
            yield moving_pattern(32, 32, 4)
        threading.Timer(0.2, release.set).start()
        raise RequestCancelled("cancelled between chunks")

    with pytest.raises(RequestCancelled):
        mux.write_mp4_stream(tmp_path / "out.mp4", chunks(), 24)
    assert encoded[0] == 4  # the chunk it was on, none of the queued ones
    assert list(tmp_path.iterdir()) == [] and not _encoder_threads()


# ---- generation ----


@pytest.mark.parametrize("save_output", [True, False], ids=["streamed-mp4", "no-sink"])
def test_a_cancel_in_the_generation_decode_stops_it_before_the_next_tile(generation_worker, tmp_path, save_output):
    params, output = _split({**GENERATE, "output_path": str(tmp_path), "output_file_name": "clip.mp4",
                             "save_output": save_output})
    decoder_calls, hook = _count_forwards(generation_worker.pipeline.models.vae.decoder)
    on_step = CancelInDecode(at_decode_check=1)
    try:
        with pytest.raises(RequestCancelled, match="decode check 1"):
            generation_worker.run(params, output, on_step=on_step)
    finally:
        hook.remove()
    assert on_step.calls == [(1, 2), (2, 2), (2, 2)]
    assert decoder_calls[0] == 1  # the first of the 3 temporal tiles, then the check stopped it
    assert list(tmp_path.iterdir()) == [] and not _encoder_threads()


@pytest.mark.parametrize("save_output", [True, False], ids=["streamed-mp4", "no-sink"])
def test_a_short_clip_checks_for_a_cancel_after_its_one_decode(generation_worker, tmp_path, save_output):
    # 5 frames decode in one piece (no temporal tiles), after which nothing looked at a cancel that came after the
    # last step: the audio decode and the MP4 went on, and a cancelled request kept its file.
    params, output = _split({**GENERATE, "num_frames": 5, "output_path": str(tmp_path),
                             "output_file_name": "clip.mp4", "save_output": save_output})
    on_step = CancelInDecode(at_decode_check=1)
    with pytest.raises(RequestCancelled, match="decode check 1"):
        generation_worker.run(params, output, on_step=on_step)
    assert on_step.calls == [(1, 2), (2, 2), (2, 2)]
    assert list(tmp_path.iterdir()) == [] and not _encoder_threads()


def test_without_a_cancel_the_generation_frames_are_the_one_shot_decode(generation_worker, tmp_path):
    params, output = _split({**GENERATE, "output_path": str(tmp_path), "output_file_name": "clip.mp4",
                             "return_frames": True})
    request, _ = generation_worker.resolve(params)
    pipeline = generation_worker.pipeline
    pipeline.keep_float_frames = True  # the one-shot `decode_video`, as every path decoded before
    try:
        reference = pipeline(request).video.frames_THWC
    finally:
        pipeline.keep_float_frames = False
    on_step = CancelInDecode(at_decode_check=None)
    unsaved = pipeline(request, on_step=on_step).video.frames_THWC
    assert on_step.num_decode_checks == NUM_GENERATION_TILES
    on_step = CancelInDecode(at_decode_check=None)
    saved = generation_worker.run(params, output, on_step=on_step)
    assert on_step.num_decode_checks == NUM_GENERATION_TILES  # the streamed decode checks at the same points
    assert np.array_equal(unsaved, reference) and np.array_equal(saved.frames, reference)
    written = mux.write_mp4(tmp_path / "reference.mp4", reference, saved.fps, saved.audio, saved.audio_sample_rate)
    assert Path(saved.output_file_path).read_bytes() == written.read_bytes()


# ---- super-resolution ----


def _count_segments(monkeypatch, vae) -> list[int]:
    calls = [0]
    original = vae._decode_segment

    def counted(*args, **kwargs):
        calls[0] += 1
        return original(*args, **kwargs)

    monkeypatch.setattr(vae, "_decode_segment", counted)
    return calls


def _sr_params(clip: Path, tmp_path: Path, **overrides):
    return _split({"video_path": str(clip), "sr_resolution_scale": 2, "seed": 7, "output_path": str(tmp_path),
                   "output_file_name": "up.mp4"} | overrides)


@pytest.mark.parametrize("save_output", [True, False], ids=["streamed-mp4", "no-sink"])
def test_a_cancel_in_the_sr_decode_stops_it_before_the_decode_ends(sr_worker, clip, tmp_path, monkeypatch,
                                                                   save_output):
    params, output = _sr_params(clip, tmp_path, save_output=save_output)
    request, _ = sr_worker.resolve(params)
    segments = _count_segments(monkeypatch, sr_worker.pipeline.models.vae)
    reference = sr_worker.pipeline(request, on_step=CancelInDecode(at_decode_check=None))
    num_tiles = int(reference.notes[-1].split(" with ")[1].split(" tile")[0])
    assert num_tiles >= 2
    total_segments, segments[0] = segments[0], 0
    assert total_segments == 2 * num_tiles  # 33 frames: segments of 17 and 16 frames per tile
    on_step = CancelInDecode(at_decode_check=1)
    with pytest.raises(RequestCancelled, match="decode check 1"):
        sr_worker.run(params, output, on_step=on_step)
    # Streamed: segment-major, stopped after the first segment of every tile; no sink: whole tiles, after the first.
    assert segments[0] == (num_tiles if save_output else 2)
    assert segments[0] < total_segments
    assert list(tmp_path.iterdir()) == [] and not _encoder_threads()


def test_the_sr_whole_tile_fallback_checks_for_a_cancel_after_every_segment(sr_worker, clip, sr_reference, tmp_path,
                                                                             monkeypatch):
    """When the tiles' causal caches would not fit on the GPU together, the streamed decode takes the tiles whole,
    one cache at a time; a cancel still stops it after the segment in flight, not after the whole tile."""
    from k6serve.pipelines import sr_decode

    monkeypatch.setattr(sr_decode, "_segment_major_fits", lambda *args: False)
    params, output = _sr_params(clip, tmp_path)
    segments = _count_segments(monkeypatch, sr_worker.pipeline.models.vae)
    with pytest.raises(RequestCancelled, match="decode check 1"):
        sr_worker.run(params, output, on_step=CancelInDecode(at_decode_check=1))
    assert segments[0] == 1  # tile 0's first segment only, of 2 per tile
    assert list(tmp_path.iterdir()) == [] and not _encoder_threads()
    params, output = _sr_params(clip, tmp_path, return_frames=True)
    on_step = CancelInDecode(at_decode_check=None)
    frames = sr_worker.run(params, output, on_step=on_step).frames
    reference = sr_reference
    num_tiles = int(reference.notes[-1].split(" with ")[1].split(" tile")[0])
    # Same bytes as the segment-major decode; one check per segment of every tile (33 frames: 2 segments).
    assert np.array_equal(frames, reference.video.frames_THWC) and on_step.num_decode_checks == 2 * num_tiles


def test_without_a_cancel_the_sr_frames_are_unchanged(sr_worker, clip, sr_reference, tmp_path):
    params, output = _sr_params(clip, tmp_path, return_frames=True)
    request, _ = sr_worker.resolve(params)
    reference = sr_reference  # no on_step: no checks at all
    on_step = CancelInDecode(at_decode_check=None)
    checked = sr_worker.pipeline(request, on_step=on_step)
    on_step_streamed = CancelInDecode(at_decode_check=None)
    streamed = sr_worker.run(params, output, on_step=on_step_streamed)
    assert np.array_equal(checked.video.frames_THWC, reference.video.frames_THWC)
    assert np.array_equal(streamed.frames, reference.video.frames_THWC)
    num_tiles = int(reference.notes[-1].split(" with ")[1].split(" tile")[0])
    assert on_step.num_decode_checks == num_tiles  # one per tile
    assert on_step_streamed.num_decode_checks == 2  # one per segment
    assert on_step.calls[-num_tiles - 1] == on_step.calls[-1]  # the final step, reported again


@pytest.mark.parametrize(("num_tiles", "num_ranks", "batches"), [
    (4, 1, [(0, 1), (1, 2), (2, 3), (3, 4)]),
    (4, 2, [(0, 2), (2, 4)]),
    (5, 2, [(0, 2), (2, 5)]),  # the last round of one tile joins the one before, still spread over both ranks
    (1, 2, [(0, 1)]),  # fewer tiles than ranks: decode_round_robin decodes it on every rank
    (7, 3, [(0, 3), (3, 7)]),
])
def test_sr_decode_batches_are_rounds_of_tiles(num_tiles, num_ranks, batches):
    from k6serve.pipelines.sr_decode import _decode_batches

    assert [(batch.start, batch.stop) for batch in _decode_batches(num_tiles, num_ranks)] == batches


# ---- a replica of two ranks (gloo) ----


def _engine(folder: Path, runtime: dict | None = None, **parallel):
    from k6serve.config import EngineConfig, ModelConfig, ParallelConfig, RuntimeConfig
    from k6serve.runtime.engine import Engine

    return Engine(EngineConfig(model=ModelConfig(model_path=str(folder)),
                               parallel=ParallelConfig(dist_timeout_s=60.0, num_gpus=2, **parallel),
                               runtime=RuntimeConfig(device="cpu", **(runtime or {}))))


def _wide_sr_replica(folder: Path, tmp_path: Path, num_frames: int = 17, **runtime):
    """A two-rank (Ulysses2) SR engine, an x2 request of a 192x32 clip (six tiles) and its save options."""
    from k6serve.testing.clips import make_clip

    wide = make_clip(tmp_path / "wide.mp4", width=192, height=32, num_frames=num_frames, fps=24)
    out = tmp_path / "out"
    out.mkdir()
    params = SamplingParams(video_path=str(wide), sr_resolution_scale=2, seed=7)
    save = OutputOptions(output_path=str(out), output_file_name="up.mp4", save_output=True)
    return _engine(folder, runtime=runtime, ulysses_degree=2), params, save, out


def _cancel_after_the_first_decode_check(engine, params: SamplingParams, save: OutputOptions, folder: Path) -> None:
    job, calls = _cancel_at_decode_check(engine, params, save, at_decode_check=1)
    with pytest.raises(RequestCancelled, match="during the video decode"):
        job.future.result(timeout=120)
    assert sum(1 for step, total in calls if step == total) == 2  # the last DiT call, then the first decode check
    assert list(folder.iterdir()) == []


def _cancel_at_decode_check(engine, params: SamplingParams, output: OutputOptions, at_decode_check: int):
    """Submit `params` and cancel the job from its progress callback at its n-th decode check; returns the job and
    the progress calls."""
    submitted = threading.Event()
    calls: list[tuple[int, int]] = []
    box = []

    def on_progress(step: int, total: int) -> None:
        calls.append((step, total))
        if sum(1 for s, t in calls if s == t) - 1 == at_decode_check:
            submitted.wait(10)
            box[0].cancel()

    box.append(engine.submit(params, output, on_progress=on_progress))
    submitted.set()
    return box[0], calls


@pytest.mark.multiprocess
def test_a_two_rank_generation_replica_cancels_in_its_decode_without_hanging(tiny_pro_dir, tmp_path):
    engine = _engine(tiny_pro_dir, ulysses_degree=2)
    try:
        params = SamplingParams(**{**GENERATE, "guidance_scale": 4.0})
        save = OutputOptions(output_path=str(tmp_path), output_file_name="clip.mp4", save_output=True)
        job, calls = _cancel_at_decode_check(engine, params, save, at_decode_check=1)
        with pytest.raises(RequestCancelled, match="during the video decode"):
            job.future.result(timeout=120)
        assert calls == [(1, 2), (2, 2), (2, 2)]  # stopped at the first tile of 3
        assert list(tmp_path.iterdir()) == []
        # The replica is still in step: the next request runs through its whole decode, on both ranks.
        result = engine.generate(dataclasses.replace(params, seed=6),
                                 OutputOptions(save_output=False, return_frames=True))
        assert result.frames.shape == (33, 32, 32, 3)
    finally:
        engine.shutdown()


@pytest.mark.multiprocess
def test_a_two_rank_sr_replica_cancels_in_its_parallel_tile_decode_without_hanging(tiny_sr_dir, tmp_path):
    # Wide enough for several rounds of two tiles: the leader (streaming) and the other rank check after each.
    engine, params, save, folder = _wide_sr_replica(tiny_sr_dir, tmp_path)
    try:
        _cancel_after_the_first_decode_check(engine, params, save, folder)  # after the first round of tiles
        # The replica is still in step: the next request runs its whole decode, through more rounds.
        finished: list[tuple[int, int]] = []
        result = engine.generate(params, OutputOptions(save_output=False, return_frames=True),
                                 on_progress=lambda step, total: finished.append((step, total)))
        assert result.frames.shape == (17, 64, 384, 3)
        assert sum(1 for step, total in finished if step == total) - 1 >= 2
    finally:
        engine.shutdown()


@pytest.mark.multiprocess
def test_a_two_rank_spatial_shard_replica_cancels_in_its_decode_and_then_saves(tiny_sr_dir, tmp_path):
    """`--vae-config.use-parallel-decode true --vae-config.parallel-decode-mode spatial_shard` through the engine:
    the leader streams its segments into the MP4, the other rank decodes its rows without a sink, and both check
    for a cancel after every causal segment (33 frames: two), so a cancel after the first leaves them in step."""
    from k6serve.media.probe import probe

    engine, params, save, folder = _wide_sr_replica(
        tiny_sr_dir, tmp_path, num_frames=33, vae_parallel_decode=True, vae_parallel_decode_mode="spatial_shard")
    try:
        _cancel_after_the_first_decode_check(engine, params, save, folder)  # after the first segment
        finished: list[tuple[int, int]] = []
        result = engine.generate(params, OutputOptions(output_path=str(folder), output_file_name="up.mp4",
                                                       save_output=True, return_frames=True),
                                 on_progress=lambda step, total: finished.append((step, total)))
        assert result.frames.shape == (33, 64, 384, 3)
        # One check after the DiT, then one after each of the two segments.
        assert sum(1 for step, total in finished if step == total) == 3
        info = probe(folder / "up.mp4")
        assert (info.width, info.height, info.num_frames) == (384, 64, 33)
    finally:
        engine.shutdown()


@pytest.mark.multiprocess
def test_a_two_rank_replica_cancelled_in_its_request_warm_up_stays_in_step(tiny_pro_dir, tmp_path):
    """--warmup-mode request: the warm-up calls the request's cancellation point on every rank at the same steps, so
    a cancel during it stops both ranks together; the next request warms up and runs on both."""
    engine = _engine(tiny_pro_dir, runtime={"warmup_mode": "request"}, ulysses_degree=2)
    try:
        params = SamplingParams(**{**GENERATE, "guidance_scale": 4.0})
        submitted = threading.Event()
        calls, box = [], []

        def on_progress(step: int, total: int) -> None:
            calls.append((step, total))
            submitted.wait(10)
            box[0].cancel()

        box.append(engine.submit(params, OutputOptions(save_output=False), on_progress=on_progress))
        submitted.set()
        with pytest.raises(RequestCancelled, match="at step 0/2"):
            box[0].future.result(timeout=120)
        assert calls == [(0, 2)]  # the warm-up's first step, reported as step 0 of the request
        result = engine.generate(dataclasses.replace(params, seed=6),
                                 OutputOptions(save_output=False, return_frames=True))
        assert result.frames.shape == (33, 32, 32, 3) and result.timings["warmup"] > 0
    finally:
        engine.shutdown()
