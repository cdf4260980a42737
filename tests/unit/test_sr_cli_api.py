"""Kandinsky 6 VSR through the Python API and the CLI on the tiny checkpoint (k6-super-resolution.md §0, §2).

Sources are synthetic PyAV clips: 30 fps with a stereo tone (subsampled to 24 fps, audio kept as mono 44.1 kHz) and
silent 24 fps clips. The tiny K-VAE's latent cell is 8 px and its x2 input tiles are 32x32 / 32x64 / 64x32, x4 ones
16x16 / 16x32 / 32x16, so a 64x32 source is one x2 tile and a 32x16 source one x4 tile.
"""

from __future__ import annotations

import json
import re
import threading

import numpy as np
import pytest
import torch

from k6serve.api import DiffGenerator
from k6serve.cli.main import main
from k6serve.media.mux import AAC_FRAME_SIZE
from k6serve.media.probe import probe
from k6serve.models.kandinsky6_sr.config_before_loading import sr_tiling_before_loading
from k6serve.runtime.engine import RequestCancelled
from k6serve.testing.clips import make_clip

STAMP = r"\d{8}-\d{6}"


@pytest.fixture(scope="module")
def clips(tmp_path_factory):
    folder = tmp_path_factory.mktemp("sr_clips")
    return {
        # 12 frames at 30 fps -> stride 1.25 -> 9 frames at 24 fps; two x2 tiles side by side.
        "stereo30": make_clip(folder / "stereo30.mp4", width=96, height=32, num_frames=12, fps=30,
                              audio="stereo_tone"),
        "silent24": make_clip(folder / "silent24.mp4", width=64, height=32, num_frames=9, fps=24),
        "wide": make_clip(folder / "wide.mp4", width=80, height=32, num_frames=9, fps=24),
        "x4": make_clip(folder / "x4.mp4", width=32, height=16, num_frames=9, fps=24),
        "small": make_clip(folder / "small.mp4", width=24, height=24, num_frames=9, fps=24),
        # x4 would make it 16448 px wide, more than H.264 takes: refused from the first frame, not at the MP4 write.
        "too_wide_x4": make_clip(folder / "too_wide_x4.mp4", width=4112, height=16, num_frames=1, fps=24),
        # A phone's portrait clip: 64x32 frames stored with a 90 degree display rotation, shown as 32x64.
        "portrait": make_clip(folder / "portrait.mp4", width=64, height=32, num_frames=9, fps=24, rotation=90),
    }  # fmt: skip


@pytest.fixture(scope="module")
def generator(tiny_sr_dir):
    torch.set_num_threads(1)
    generator = DiffGenerator.from_pretrained(model_path=str(tiny_sr_dir), device="cpu")
    yield generator
    generator.shutdown()


def _run(generator, clip, tmp_path, **kwargs):
    request = {"video_path": str(clip), "sr_resolution_scale": 2, "num_inference_steps": 2,
               "seed": 42, "output_path": str(tmp_path), "save_output": True, "return_frames": True}  # fmt: skip
    return generator.generate(sampling_params_kwargs=request | kwargs)


@pytest.fixture(scope="module")
def stereo_x2(generator, clips, tmp_path_factory):
    return _run(generator, clips["stereo30"], tmp_path_factory.mktemp("sr_out"))


def test_seed_example_x2_with_source_audio(stereo_x2):
    result = stereo_x2
    assert result.frames.shape == (9, 64, 192, 3) and result.fps == 24.0
    # 9 / 24 * 44100 = 16537.5 -> 16538 (half-to-even), the processed duration, before muxing.
    assert result.audio is not None and result.audio.shape == (16538,)
    assert result.audio_sample_rate == 44100
    assert re.fullmatch(rf"stereo30_sr2x_{STAMP}\.mp4", result.output_file_path.split("/")[-1])
    info = probe(result.output_file_path)
    assert (info.width, info.height, info.num_frames, info.fps) == (192, 64, 9, 24.0)
    assert (info.audio_codec, info.audio_channels, info.audio_sample_rate) == ("aac", 1, 44100)
    assert abs(info.audio_num_samples - 16538) <= AAC_FRAME_SIZE
    assert "2 tile(s)" in " ".join(result.notes)
    # The saved request streams the decode into the MP4 writer: "decode" includes the blend, "mux" what was left.
    for stage in ("read", "encode", "upscale", "dit", "decode", "mux"):
        assert result.timings[stage] >= 0
    assert "blend" not in result.timings


def test_same_seed_is_bit_identical_and_tile_batching_changes_the_output(
    generator, clips, tmp_path
):
    first = _run(generator, clips["stereo30"], tmp_path, save_output=False)
    second = _run(generator, clips["stereo30"], tmp_path, save_output=False)
    assert np.array_equal(first.frames, second.frames)
    assert np.array_equal(first.audio, second.audio)
    # Chunks are seeded with seed + first tile index, so tile 1 now shares tile 0's stream (the seeds are
    # checked in tests/parity/test_sr_pipeline.py).
    batched = _run(generator, clips["stereo30"], tmp_path, save_output=False, sr_tiles_batch_size=2)
    assert batched.frames.shape == first.frames.shape
    assert not np.array_equal(batched.frames, first.frames)


def test_silent_source_gives_video_only_and_steps_are_fixed(generator, clips, tmp_path):
    result = _run(generator, clips["silent24"], tmp_path, num_inference_steps=4)
    assert result.frames.shape == (9, 64, 128, 3) and result.audio is None
    assert not probe(result.output_file_path).has_audio
    assert any("num_inference_steps 4 is ignored" in note for note in result.notes)
    assert result.prompt is None  # no prompt to name


@pytest.mark.parametrize(
    ("clip", "scale", "shape", "name"),
    [
        # x2.25: 80x32 -> x1.125 with 16-px rounding = 96x32 -> two x2 tiles -> 192x64.
        ("wide", 2.25, (9, 64, 192, 3), "wide_sr2.25x_"),
        ("x4", 4, (9, 64, 128, 3), "x4_sr4x_"),
    ],
)
def test_x225_and_x4(generator, clips, tmp_path, clip, scale, shape, name):
    result = _run(generator, clips[clip], tmp_path, sr_resolution_scale=scale)
    assert result.frames.shape == shape
    assert re.fullmatch(rf"{re.escape(name)}{STAMP}\.mp4", result.output_file_path.split("/")[-1])


def test_rotated_source_is_upscaled_upright(generator, clips, tmp_path):
    result = _run(generator, clips["portrait"], tmp_path)
    assert result.frames.shape == (9, 128, 64, 3)
    info = probe(result.output_file_path)
    assert (info.width, info.height, info.num_frames) == (64, 128, 9)
    assert "upscaled 32x64 to 64x128" in " ".join(result.notes)


@pytest.mark.parametrize(
    ("target", "mode", "size"),
    [
        ("100x40", "fit", (40, 80)),  # one isotropic scale 0.625 into the 100x40 bucket
        ("100x40", "exact", (40, 100)),
    ],
)
def test_target_resolution_modes(generator, clips, tmp_path, target, mode, size):
    result = _run(generator, clips["silent24"], tmp_path, save_output=False,
                  sr_target_resolution=target, sr_target_resize_mode=mode)  # fmt: skip
    assert result.frames.shape == (9, *size, 3)


def test_progress_per_dit_call_and_cancellation(generator, clips, tmp_path):
    from k6serve.request_arguments import split_kwargs

    params, output = split_kwargs({"video_path": str(clips["stereo30"]), "sr_resolution_scale": 2,
                                   "save_output": False})  # fmt: skip
    progress, jobs, submitted = [], [], threading.Event()

    def on_progress(done, total):
        progress.append((done, total))
        submitted.wait(30)
        jobs[0].cancel()

    jobs.append(generator.engine.submit(params, output, on_progress=on_progress))
    submitted.set()
    with pytest.raises(RequestCancelled):
        jobs[0].future.result()
    assert progress == [(1, 4)]  # 2 tiles x 2 DiT calls; cancelled at the first call boundary


@pytest.mark.parametrize(
    ("clip", "kwargs", "message"),
    [
        ("small", {}, "x2 tiles need at least 32x32"),
        ("silent24", {"sr_resolution_scale": 3}, "must be 2, 4 or 2.25"),
        (
            "silent24",
            {"sr_target_resolution": "hd", "sr_target_resize_mode": "exact"},
            "only downscale",
        ),
        ("silent24", {"sr_tile_min_overlap": 1.0}, r"must be in \[0, 1\)"),
        ("too_wide_x4", {"sr_resolution_scale": 4}, "would be 16448x64, but H.264 frames are at most 16384"),
    ],
)
def test_bad_requests_raise_with_the_fix(generator, clips, tmp_path, clip, kwargs, message):
    with pytest.raises(ValueError, match=message):
        _run(generator, clips[clip], tmp_path, **kwargs)
    assert list(tmp_path.glob("*.mp4")) == []


def test_head_mismatch_fails_at_load_time(tiny_sr_flow640_dir):
    # Raised while the worker loads, before any request exists (and, per tests/parity/test_sr_pipeline.py, before
    # any weight is read).
    with pytest.raises(
        ValueError, match="flow-Euler scheduler next to a 640-wide head.*distilled2steps"
    ):
        DiffGenerator.from_pretrained(model_path=str(tiny_sr_flow640_dir), device="cpu")


def _cli(model_dir, clip, out_dir, *extra):
    return main(["generate", "--model-path", str(model_dir), "--video-path", str(clip),
                 "--sr-resolution-scale", "2", "--num-inference-steps", "2", "--seed", "42",
                 "--save-output", "--output-path", str(out_dir), *extra])  # fmt: skip


def test_cli_default_and_custom_names(tiny_sr_dir, clips, tmp_path, capsys, in_process_worker):
    assert _cli(tiny_sr_dir, clips["silent24"], tmp_path / "default") == 0
    (written,) = (tmp_path / "default").iterdir()
    assert re.fullmatch(rf"silent24_sr2x_{STAMP}\.mp4", written.name)
    info = probe(written)
    assert (info.width, info.height, info.num_frames, info.has_audio) == (128, 64, 9, False)
    assert (
        _cli(tiny_sr_dir, clips["stereo30"], tmp_path / "named", "--output-file-name", "mine.mp4")
        == 0
    )
    assert [p.name for p in (tmp_path / "named").iterdir()] == ["mine.mp4"]
    assert probe(tmp_path / "named" / "mine.mp4").has_audio
    assert "saved" in capsys.readouterr().out
    # The notes name the flags typed (they named the API's fields: `num_inference_steps=4 is ignored`).
    assert _cli(tiny_sr_dir, clips["silent24"], tmp_path / "noted", "--num-inference-steps", "4",
                "--sr-target-resolution", "100x40", "--sr-target-resize-mode", "exact") == 0
    err = capsys.readouterr().err
    assert ("note: --num-inference-steps 4 is ignored: this checkpoint's PiFlow scheduler always runs 2 DiT calls "
            "per tile.") in err
    assert ("note: --sr-target-resolution '100x40' with the 'exact' resize mode stretches the 128x64 upscaled result "
            "to 100x40, changing its aspect ratio; use --sr-target-resize-mode 'fit' to keep it.") in err
    assert ", then resized to 100x40 (--sr-target-resolution), 2 DiT calls per tile" in err
    assert "sr_target_resolution" not in err


def test_cli_runs_the_built_in_sr_demo(clips, tmp_path, caplog, in_process_worker, monkeypatch):
    """`--model-path demo-sr`: the tiny random-weight distilled VSR, built once under K6SERVE_CACHE (the same
    checkpoint as tiny_sr_dir), so the SR surfaces can be tried offline as `demo` lets generation be tried."""
    from k6serve.testing.tiny_sr_checkpoint import TINY_TILE_SIZES

    monkeypatch.setenv("K6SERVE_CACHE", str(tmp_path / "cache"))
    assert _cli("demo-sr", clips["silent24"], tmp_path / "out", "--revision", "main") == 0
    (written,) = (tmp_path / "out").iterdir()
    info = probe(written)
    assert (info.width, info.height, info.num_frames) == (128, 64, 9)
    assert "revision 'main' is ignored: it only picks the revision a hub id downloads, and 'demo-sr' is a " \
           "built-in tiny checkpoint." in caplog.text
    assert "the upscaled video is noise (the source's audio is kept)" in caplog.text
    (built,) = (tmp_path / "cache" / "demo").iterdir()
    assert built.name == "kandinsky6-demo-sr-v1"
    assert json.loads((built / "k6serve_demo.json").read_text()) == {"demo": True, "variant": "sr"}
    assert json.loads((built / "model_index.json").read_text())["_class_name"] == "Kandinsky6SRPipeline"
    (worker,) = in_process_worker
    assert (worker.variant.name, worker.variant.family, worker.variant.is_demo) == ("demo-sr", "super_resolution", True)
    assert (worker.variant.num_inference_steps, worker.variant.hub_id) == (2, None)
    tiling = sr_tiling_before_loading("demo-sr", None, "auto")
    assert (tiling.tile_sizes, tiling.snap) == (TINY_TILE_SIZES, 8)


def test_cli_refuses_a_source_smaller_than_a_tile_before_the_load(tiny_sr_dir, clips, tmp_path, capsys, no_ranks):
    assert _cli(tiny_sr_dir, clips["small"], tmp_path) == 2
    # The setting named as the flag: it said "a higher scale".
    assert "need at least 32x32; use a larger input or a higher --sr-resolution-scale." in capsys.readouterr().err
    assert list(tmp_path.glob("*.mp4")) == []


def test_cli_errors(tiny_sr_flow640_dir, clips, tmp_path, capsys):
    assert _cli(tiny_sr_flow640_dir, clips["silent24"], tmp_path) == 2
    assert "Kandinsky-6.0-VSR-distilled2steps-5s-Diffusers" in capsys.readouterr().err
    assert list(tmp_path.glob("*.mp4")) == []


def test_a_list_of_prompts_is_refused_by_the_super_resolution_model(generator, clips):
    with pytest.raises(ValueError, match=r"^prompt is a list, which runs one generation per prompt, and the "
                                         r"super-resolution model takes no prompt: upscale one video a call"):
        generator.generate(prompt=["a", "b"], video_path=str(clips["silent24"]), save_output=False)
