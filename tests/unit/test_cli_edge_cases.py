"""Edge cases of `k6serve generate` and `DiffGenerator` on the tiny checkpoints (CPU): bad input fails before any
work with the fix in its message, and no earlier file is ever replaced."""

from __future__ import annotations

import re
import signal
import sys
from datetime import datetime
from fractions import Fraction
from pathlib import Path

import numpy as np
import PIL.Image
import pytest
import torch

import k6serve.media.output_names as output_names
from k6serve import DiffGenerator
from k6serve.cli.main import main
from k6serve.engine_arguments import build_engine_config
from k6serve.media.probe import probe
from k6serve.output_checks import final_file_name
from k6serve.request import FlagWorded, SamplingParams
from k6serve.runtime.engine import Engine
from k6serve.runtime import worker as worker_module
from k6serve.runtime.worker import ModelWorker

SMALL = {"prompt": "x", "height": 32, "width": 32, "num_frames": 5}


@pytest.fixture(scope="module")
def generator(tiny_distill_dir):
    # In-process worker: no worker process to start, and the clock below can be frozen for it.
    config = build_engine_config(str(tiny_distill_dir), device="cpu")
    with DiffGenerator(Engine(config, worker=ModelWorker(config))) as gen:
        yield gen


def test_a_seed_past_32_bits_is_said_to_draw_its_low_32_bits_noise(generator):
    """torch's CPU generator (diffusers' too) keeps a seed's low 32 bits: seeds 2**32 apart made the same video,
    and nothing said so while the docs took seeds up to 2**63."""
    low = generator.generate({**SMALL, "seed": 7, "save_output": False, "return_frames": True})
    high = generator.generate({**SMALL, "seed": 2**32 + 7, "save_output": False, "return_frames": True})
    np.testing.assert_array_equal(high.frames, low.frames)
    assert not [note for note in low.notes if "32 bits" in note]
    assert f"seed {2**32 + 7} draws the same noise as seed 7: torch's CPU random generator, which draws the noise " \
           "(as in diffusers), keeps only a seed's low 32 bits; for distinct outputs use seeds below 2**32 " \
           "(4294967296)" in high.notes


def test_existing_output_file_name_is_refused_and_kept(generator, tmp_path):
    first = generator.generate({**SMALL, "output_path": str(tmp_path), "output_file_name": "clip"})
    before = (tmp_path / "clip.mp4").read_bytes()
    with pytest.raises(ValueError, match=r"clip\.mp4' already exists.*pass another output_file_name\."):
        generator.generate({**SMALL, "seed": 7, "output_path": str(tmp_path), "output_file_name": "clip.mp4"})
    assert first.output_file_path == str(tmp_path / "clip.mp4")
    assert (tmp_path / "clip.mp4").read_bytes() == before


def test_a_dangling_link_as_the_output_name_is_refused_before_the_run(generator, tmp_path):
    (tmp_path / "clip.mp4").symlink_to(tmp_path / "nowhere" / "target.mp4")
    with pytest.raises(ValueError, match=r"clip\.mp4' already exists"):
        generator.generate({**SMALL, "output_path": str(tmp_path), "output_file_name": "clip"})
    assert (tmp_path / "clip.mp4").is_symlink() and not (tmp_path / "nowhere").exists()


def test_a_tilde_output_path_is_the_home_folder(generator, tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    result = generator.generate({**SMALL, "output_path": "~/clips", "output_file_name": "a"})
    assert result.output_file_path == str(tmp_path / "home" / "clips" / "a.mp4")
    assert not (tmp_path / "~").exists()


class _FrozenClock(datetime):
    @classmethod
    def now(cls, tz=None):
        return datetime(2026, 1, 2, 3, 4, 5)


def test_derived_names_never_collide(generator, tmp_path, monkeypatch):
    # Same prompt and seed within one second at two sizes: the same derived name, so the second once replaced
    # the first.
    monkeypatch.setattr(output_names, "datetime", _FrozenClock)
    first = generator.generate({**SMALL, "output_path": str(tmp_path)})
    second = generator.generate({**SMALL, "width": 48, "output_path": str(tmp_path)})
    assert first.output_file_path == str(tmp_path / "x_seed42_20260102-030405.mp4")
    assert second.output_file_path == str(tmp_path / "x_seed42_20260102-030405_1.mp4")
    assert probe(first.output_file_path).width == 32 and probe(second.output_file_path).width == 48


def test_output_file_name_with_folders_is_refused(generator, tmp_path):
    with pytest.raises(ValueError, match=r"without folders; put the folder in output_path\."):
        generator.generate({**SMALL, "output_path": str(tmp_path), "output_file_name": "sub/clip.mp4"})
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("kind", ["file", "under_file", "empty"])
def test_unusable_output_path_is_a_value_error(generator, tmp_path, kind):
    (tmp_path / "afile").write_text("keep me")
    path = {"file": tmp_path / "afile", "under_file": tmp_path / "afile" / "sub", "empty": ""}[kind]
    with pytest.raises(ValueError, match="output_path"):
        generator.generate({**SMALL, "output_path": str(path)})
    assert (tmp_path / "afile").read_text() == "keep me"
    generator.generate({**SMALL, "output_path": str(path), "save_output": False})  # nothing to write: fine


def test_output_path_that_is_a_file_says_so(tmp_path):
    from k6serve.output_checks import check_output_folder
    from k6serve.request import OutputOptions

    (tmp_path / "clip.mp4").write_text("keep me")
    with pytest.raises(ValueError, match=r"'.*clip.mp4' is a file, not a folder;.*--output-file-name"):
        check_output_folder(OutputOptions(output_path=str(tmp_path / "clip.mp4")))
    assert (tmp_path / "clip.mp4").read_text() == "keep me"


def test_cli_bad_output_path_fails_before_loading_the_model(tmp_path, capsys):
    (tmp_path / "afile").write_text("keep me")
    # A checkpoint path that does not exist: reaching the model load would fail with another message.
    assert main(["generate", "--model-path", str(tmp_path / "no_model"), "--prompt", "x",
                 "--output-path", str(tmp_path / "afile")]) == 2
    err = capsys.readouterr().err
    assert "is a file, not a folder" in err and "--output-path" in err and "Traceback" not in err


# The one adapter `k6serve generate` can name in --loras: its --lora-path one, added dynamically.
LORA_X = ["--lora-path", "x.safetensors", "--lora-nickname", "x", "--lora-merge-mode", "dynamic"]


@pytest.mark.parametrize(
    ("checkpoint", "flags", "message"),
    [
        ("generation", ["--prompt", "x", "--seed", "-2"], "--seed must be an integer in [0, 2**63), or -1 for a "
                                                          "seed drawn for the request, got -2"),
        ("generation", ["--prompt", "x", "--height", "60"], "--height must be a positive multiple of 16"),
        ("generation", ["--prompt", "x", "--video-path", "clip.mp4"], "--video-path is for the super-resolution model"),
        ("generation", ["--prompt", "x", "--image-path", "missing.png"],
         "cannot read conditioning image 'missing.png': it does not exist"),
        ("sr", ["--video-path", "missing.mp4"], "cannot read media file 'missing.mp4': it does not exist"),
        # A URL was called a missing file, quoted with its '//' collapsed ('https:/example.com/a.png').
        ("generation", ["--prompt", "x", "--image-path", "https://example.com/a.png"],
         "cannot read conditioning image 'https://example.com/a.png': k6serve fetches no URLs; download the image and "
         "pass the file's path."),
        ("generation", ["--prompt", "x", "--image-path", "data:image/png;base64,iVBORw0KGgo="],
         "cannot read conditioning image 'data:image/png;base64,iVBORw0KGgo=': k6serve fetches no URLs"),
        # A data URI of a real image is megabytes: the message quotes its start.
        ("generation", ["--prompt", "x", "--image-path", "DATA:image/png;base64," + "A" * 5000],
         "cannot read conditioning image 'DATA:image/png;base64," + "A" * 78 + "'... (5,022 characters): k6serve "
         "fetches no URLs"),
        ("sr", ["--video-path", "http://example.com/clip.mp4"],
         "cannot read media file 'http://example.com/clip.mp4': k6serve fetches no URLs; download the video and pass "
         "the file's path"),
        ("generation", ["--prompt", "x", "--image-path", ""],
         "--image-path is empty: pass an image file's path, or leave it out to generate from the prompt alone."),
        ("generation", ["--prompt", "\ufeff"],
         "prompt is required for Kandinsky 6 generation (e.g. --prompt 'A cat plays piano'). The prompt given, "
         "'\\ufeff', has no visible character"),
        ("sr", ["--video-path", "clip.mp4", "--sr-resolution-scale", "3"],
         "--sr-resolution-scale must be 2, 4 or 2.25, got 3.0"),
        # Only a note after the load before, while the generation models' other flags were refused up front.
        ("sr", ["--video-path", "clip.mp4", "--prompt", "x"],
         "--prompt applies to the generation models; the super-resolution model upscales --video-path and takes no "
         "text: drop --prompt"),
        ("sr", ["--video-path", "clip.mp4", "--negative-prompt", "y", "--prompt", "x"],
         "--prompt and --negative-prompt apply to the generation models"),
        # Refused by the SR pipeline before any DiT call, but only once the model had loaded.
        ("sr", ["--video-path", "clip.mp4", "--sr-target-resolution", "101x100"],
         "--sr-target-resolution '101x100' has an odd side; H.264 needs even width and height: use 102x100 or "
         "100x100"),
        # Once written as video.mp4 and _.mp4, names the user never chose.
        ("generation", ["--prompt", "x", "--output-file-name", ".."],
         "--output-file-name '..' has no letter or digit"),
        ("generation", ["--prompt", "x", "--output-file-name", "?.mp4"],
         "--output-file-name '?.mp4' has no letter or digit"),
        ("generation", ["--prompt", "x", "--output-file-name", ""], "--output-file-name is empty"),
        ("generation", ["--prompt", "x", "--output-file-name", "sub/clip.mp4"],
         "--output-file-name 'sub/clip.mp4' must be a file name without folders; put the folder in --output-path."),
        ("generation", ["--prompt", "x", "--output-file-name", "a" * 300],
         "--output-file-name is 304 bytes long with .mp4 in UTF-8, more than the 231 an output file may have"),
        # --loras takes its object as JSON: the refusal names the nickname in it, not the API's loras['x'] (the
        # adapter file is read only by the load).
        ("generation", ["--prompt", "x", *LORA_X, "--loras", '{"x": 101}'],
         "'x' in --loras must be a finite number from -100 to 100, got 101; adapters are used at about -2 to 2"),
        ("generation", ["--prompt", "x", *LORA_X, "--loras", '{"x": "strong"}'],
         "'x' in --loras must be a finite number (the adapter's strength), got 'strong'"),
        ("generation", ["--prompt", "a\x1bb"], "--prompt holds the control character U+001B at character 2"),
        ("generation", ["--prompt", "x" * 32_769], "--prompt has 32,769 characters; at most 32,768 are taken"),
        ("generation", ["--prompt", "x", "--negative-prompt", "a\x00b"],
         "--negative-prompt holds the control character U+0000 at character 2"),
        # Cache-DiT's refusals named the request fields (enable_cache_dit, cache_dit_params) instead of the flags.
        ("sr", ["--video-path", "clip.mp4", "--cache-dit-params", "{}"],
         "Cache-DiT applies to the generation models: the super-resolution model runs 2 DiT steps per tile, with "
         "nothing to skip. Drop --cache-dit-params."),
        ("sr", ["--video-path", "clip.mp4", "--enable-cache-dit"],
         "Cache-DiT applies to the generation models: the super-resolution model runs 2 DiT steps per tile, with "
         "nothing to skip. Drop --enable-cache-dit."),
        ("generation", ["--prompt", "x", "--cache-dit-params", "{}", "--no-enable-cache-dit"],
         "--cache-dit-params was given with --no-enable-cache-dit; drop one of them (--cache-dit-params alone turns "
         "caching on)."),
        ("generation", ["--prompt", "x", "--cache-dit-config", '{"scm_preset": "fast"}', "--num-inference-steps", "3"],
         "--num-inference-steps 3 does not fit the engine's Cache-DiT step mask (--cache-dit-config: its scm_preset "
         "'fast' needs 4, 6 or at least 8 steps); use steps it covers, or turn caching off with "
         "--no-enable-cache-dit."),
        # The request's rules worded with the flags typed, not the API's fields (sr_resolution_scale, fps).
        ("generation", ["--prompt", "x", "--fps", "0.5"], "--fps must be between 1 and 240 (it sets the audio length, "
                                                          "--num-frames / --fps seconds), got 0.5"),
        ("generation", ["--prompt", "x", "--num-frames", "49", "--fps", "1"],
         "--num-frames 49 at --fps 1 is 49.0 s of audio, longer than the model's audio positions allow (47.6 s: 2048 "
         "latents, this clip needs 2111); raise --fps to at least 1.04, lower --num-frames to at most 45, or make a "
         "silent video (--no-sample-audio)."),
        ("generation", ["--prompt", "x", "--max-sequence-length", "2000"],
         "--max-sequence-length must be between 1 and 1024 (prompt tokens the model reads), got 2000"),
        ("generation", ["--prompt", "x", "--sr-tiles-batch-size", "2"],
         "--sr-tiles-batch-size applies to the super-resolution model only"),
        ("sr", ["--video-path", "clip.mp4", "--sr-target-resize-mode", "exact"],
         "--sr-target-resize-mode only says how to reach --sr-target-resolution, and none was given; pass "
         "--sr-target-resolution (hd, fullhd, 2k or WxH) as well, or drop --sr-target-resize-mode."),
        ("sr", ["--video-path", "clip.mp4", "--sr-target-resolution", "hd", "--sr-target-resize-mode", "stretch"],
         "--sr-target-resize-mode must be 'fit' or 'exact', got 'stretch'"),
        ("sr", ["--video-path", "clip.mp4", "--sr-target-resolution", "8x8"],
         "--sr-target-resolution must be one of hd, fullhd, 2k or 'WxH' (width first, each side at least 16, e.g. "
         "1280x720), got '8x8'"),
        ("sr", ["--video-path", "clip.mp4", "--image-path", "a.png"],
         "--image-path is not used by the super-resolution model; pass --video-path only."),
        ("sr", ["--video-path", "clip.mp4", "--num-frames", "9"],
         "--num-frames is taken from the source video in super-resolution; the upscale takes up to 121 frames "
         "from the source's start (5 s at 24 fps), at the rate the 24 fps rule sets, floored to 1 + 8k. For "
         "another part or a shorter clip, cut the source first (FFmpeg: ffmpeg -ss START -i IN -t SECONDS OUT), "
         "and drop --num-frames."),
        ("sr", ["--video-path", "clip.mp4", "--no-sample-audio"],
         "--no-sample-audio applies to the generation models; super-resolution keeps the source video's own "
         "soundtrack (a source without one gives a silent video). Drop --no-sample-audio."),
        ("sr", ["--video-path", "clip.mp4", "--expand-prompts"],
         "--expand-prompts rewrites a generation prompt; the super-resolution model takes no text. Drop "
         "--expand-prompts."),
        # A released hub id: refused before a download of the whole checkpoint.
        ("kandinskylab/Kandinsky-6.0-Pro-distill-5s-Diffusers", ["--prompt", "x", "--guidance-scale", "3"],
         "pro-distill is a distilled (PiFlow) checkpoint and requires guidance_scale exactly 1.0 (got 3.0); leave "
         "--guidance-scale out, or use a Pro/Lite checkpoint for CFG."),
    ],
)
def test_cli_refuses_a_bad_request_before_loading_the_model(request, no_model_load, tmp_path, capsys, checkpoint,
                                                            flags, message):
    model_path = {"generation": "tiny_distill_dir", "sr": "tiny_sr_dir"}.get(checkpoint)
    model_path = str(request.getfixturevalue(model_path)) if model_path else checkpoint
    assert main(["generate", "--model-path", model_path, *flags, "--output-path", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert f"error: {message}" in err and "Traceback" not in err
    assert not (tmp_path / "out").exists()  # nothing written, not even the folder


STRENGTH_WHY = ("adapters are used at about -2 to 2 (1.0 is the strength they were trained at), and far past that "
                "the update swamps the model's weights and the latents overflow to NaN.")
WRONG_ENCODING = ("the wrong encoding (a UTF-16 file read as UTF-8 has a control character beside every letter) or a "
                  "pasted terminal escape; send the prompt as UTF-8 text without control characters.")
STREAMED = ("runs the text encoder once per generated token (up to 1024), and this engine streams its layers from "
            "host memory (--performance-mode memory, or --layerwise-offload-components text_encoder), which would "
            "copy all of them for every token. Offload it whole instead (--component-residency "
            "text_encoder=component_offload: it visits the GPU for the rewrite and the encoding, about 16 GB there)")


@pytest.mark.parametrize(
    ("refuse", "message", "flag_wording"),
    [
        (lambda: final_file_name(".."), "output_file_name '..' has no letter or digit to name the file by; pass a "
         "name such as clip.mp4 (letters and digits of any script, '.', '_' and '-').", "--output-file-name '..' "
         "has no letter or digit to name the file by; pass a name such as clip.mp4 (letters and digits of any "
         "script, '.', '_' and '-')."),
        (lambda: final_file_name(" "), "output_file_name is empty; pass a name such as clip.mp4, or leave it out for "
         "a name derived from the request.", "--output-file-name is empty; pass a name such as clip.mp4, or leave it "
         "out for a name derived from the request."),
        (lambda: final_file_name("a/b"), "output_file_name 'a/b' must be a file name without folders; put the "
         "folder in --output-path.", "--output-file-name 'a/b' must be a file name without folders; put the folder "
         "in --output-path."),
        (lambda: _resolve(loras={"x": 1e30}), "loras['x'] must be a finite number from -100 to 100, got 1e+30; "
         f"{STRENGTH_WHY}", f"'x' in --loras must be a finite number from -100 to 100, got 1e+30; {STRENGTH_WHY}"),
        (lambda: _resolve(loras={"x": True}), "loras['x'] must be a finite number (the adapter's strength), got "
         "True", "'x' in --loras must be a finite number (the adapter's strength), got True"),
        (lambda: _resolve(loras={1: 1.0}), "loras keys must be adapter nicknames, got 1",
         "--loras keys must be adapter nicknames, got 1"),
        (lambda: _resolve(prompt="a\x1b"), "prompt holds the control character U+001B at character 2: text read "
         f"in {WRONG_ENCODING}", f"--prompt holds the control character U+001B at character 2: text read in "
         f"{WRONG_ENCODING}"),
        (lambda: _resolve(sample_audio=True, has_audio=False), "sample_audio is true, but this checkpoint has no "
         "audio_vae and vocoder (its model_index.json lists none), so it makes silent videos only; drop "
         "sample_audio.", "--sample-audio was given, but this checkpoint has no audio_vae and vocoder (its "
         "model_index.json lists none), so it makes silent videos only; drop --sample-audio."),
        (lambda: _resolve(expand_prompts=True, streams_text_encoder=True), f"expand_prompts {STREAMED}, or drop "
         "expand_prompts.", f"--expand-prompts {STREAMED}, or drop --expand-prompts."),
    ],
)
def test_a_refusal_keeps_the_apis_words_and_carries_the_flags(refuse, message, flag_wording):
    # The Python API and the HTTP server answer with the message, word for word as before; `k6serve generate`
    # prints flag_wording.
    with pytest.raises(FlagWorded) as raised:
        refuse()
    assert (str(raised.value), raised.value.flag_wording) == (message, flag_wording)


def _resolve(*, has_audio: bool = True, streams_text_encoder: bool = False, **fields):
    from k6serve.models.variants import VARIANTS
    from k6serve.request_resolution import resolve_generate

    return resolve_generate(SamplingParams(**{"prompt": "x", **fields}), VARIANTS["pro-distill"],
                            has_audio=has_audio, streams_text_encoder=streams_text_encoder)


def test_cli_refuses_an_unusable_sr_source_before_loading_the_model(no_model_load, tiny_sr_dir, tmp_path, capsys):
    """The pre-load check read the source's first frame but let the reader's own refusals through to the worker:
    a 0.5 fps clip, a song with cover art or a still image named .mp4 were refused only after the model loaded."""
    from k6serve.testing.clips import make_audio_only_file, make_clip

    cases = [
        (make_clip(tmp_path / "slow.mp4", width=32, height=32, num_frames=3, fps=Fraction(1, 2)),
         "slow.mp4' is 0.5 fps: a source slower than 24 fps keeps its frame rate rounded to a whole number, and this "
         "one rounds to 0 fps"),
        (make_audio_only_file(tmp_path / "song.mp4", seconds=0.5, cover_art=True),
         "song.mp4' has no video stream (found: audio (aac), attached picture (mjpeg))"),
    ]
    still = tmp_path / "still.mp4"
    PIL.Image.new("RGB", (32, 32), "red").save(still, format="PNG")
    cases.append((still, "still.mp4' is a still image (FFmpeg reads it with its png_pipe demuxer)"))
    # A GIF of one frame: FFmpeg's gif demuxer is no image demuxer, and the 100 fps it gives a frame without a delay
    # was subsampled to no frame after the load ("pass a longer clip"); with a delay of 1 s it was upscaled as a clip.
    for duration in (0, 1000):
        gif = tmp_path / f"still_{duration}.gif"
        PIL.Image.new("RGB", (32, 32), "red").save(gif, duration=duration)
        cases.append((gif, f"still_{duration}.gif' is a still image (FFmpeg reads it with its gif demuxer)"))
    # An animated WebP, which FFmpeg reads as a still picture it cannot decode: it was called "a still image".
    webp = tmp_path / "moving.webp"
    frames = [PIL.Image.new("RGB", (32, 32), colour) for colour in ("red", "green", "blue")]
    frames[0].save(webp, save_all=True, append_images=frames[1:], duration=40)
    cases.append((webp, "moving.webp' is an animated WebP, which FFmpeg cannot decode (it reads WebP files as still "
                        "images); convert it to a video first"))
    # A frame at 30 fps, which the 24 fps rule subsamples to none (the same frame at 24 fps is upscaled): refused
    # after the load, saying only "pass a longer clip".
    cases.append((make_clip(tmp_path / "one30.mp4", width=32, height=32, num_frames=1, fps=30),
                  "one30.mp4' gives no frames to upscale: it states 1 frame(s) at 30 fps, which the 24 fps rule "
                  "subsamples to 24 fps (a frame every 1.25), keeping none of fewer than 2 frames; pass a clip of at "
                  "least 2 frames"))
    for path, message in cases:
        assert main(["generate", "--model-path", str(tiny_sr_dir), "--video-path", str(path),
                     "--output-path", str(tmp_path / "out")]) == 2
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err, err
    assert not (tmp_path / "out").exists()


def test_cli_refuses_sample_audio_for_a_silent_checkpoint_before_loading_it(no_model_load, tmp_path, capsys):
    # A checkpoint whose model_index.json lists no audio_vae and vocoder: --sample-audio was refused by the worker,
    # once the model had loaded (minutes for a real one).
    from k6serve.testing.tiny_checkpoints import build_generation_checkpoint

    folder = build_generation_checkpoint(tmp_path / "silent", "lite", seed=1, with_audio=False)
    assert main(["generate", "--model-path", str(folder), "--prompt", "x", "--sample-audio",
                 "--output-path", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert ("error: --sample-audio was given, but this checkpoint has no audio_vae and vocoder (its model_index.json "
            "lists none), so it makes silent videos only; drop --sample-audio.") in err and "Traceback" not in err
    assert not (tmp_path / "out").exists()
    # Unset: its silent videos, as before (the stand-in load fails the run).
    main(["generate", "--model-path", str(folder), "--prompt", "x", "--output-path", str(tmp_path / "out")])
    assert "AssertionError: the model was loaded" in capsys.readouterr().err


def test_cli_names_its_flags_in_an_sr_size_refusal(no_model_load, tiny_sr_dir, tmp_path, capsys):
    """The plan's refusals (an output over H.264's limits, a 'fit' target leaving a side under 2 pixels) named the
    request fields on the command line: `use sr_resolution_scale 2.25 or 2`, beside flags everywhere else."""
    from k6serve.testing.clips import make_clip

    # x4 is 8256x4352, over H.264's largest level; x2.25 (4640x2432) and x2 fit.
    large = make_clip(tmp_path / "large.mp4", width=2064, height=1088, num_frames=1, fps=24)
    wide = make_clip(tmp_path / "wide.mp4", width=4112, height=16, num_frames=1, fps=24)
    strip = make_clip(tmp_path / "strip.mp4", width=1024, height=32, num_frames=1, fps=24)
    for path, flags, message in [
        (large, ["--sr-resolution-scale", "4"],
         "and the output is computed at that size before any --sr-target-resolution; use --sr-resolution-scale "
         "2.25 or 2, or a smaller source."),
        (wide, ["--sr-resolution-scale", "4"],
         "use a smaller --sr-resolution-scale, a smaller source, or an --sr-target-resolution of at most 16384 a "
         "side (e.g. 2k)."),
        (strip, ["--sr-resolution-scale", "2", "--sr-target-resolution", "16x16"],
         "would leave its height under 2 pixels; use a larger --sr-target-resolution or drop it."),
    ]:
        assert main(["generate", "--model-path", str(tiny_sr_dir), "--video-path", str(path), *flags,
                     "--output-path", str(tmp_path / "out")]) == 2
        err = capsys.readouterr().err
        assert message in err and " sr_" not in err, err


def test_cli_rejected_request_prints_no_progress_bar(tiny_distill_dir, tmp_path, capsys):
    assert main(["generate", "--model-path", str(tiny_distill_dir), "--prompt", "x", "--height", "30",
                 "--output-path", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "multiple of 16" in err and "denoising" not in err


def test_cli_repeated_run_keeps_the_first_file(tiny_distill_dir, tmp_path, capsys, in_process_worker):
    args = ["generate", "--model-path", str(tiny_distill_dir), "--prompt", "x", "--height", "32", "--width", "32",
            "--num-frames", "5", "--output-path", str(tmp_path), "--output-file-name", "same"]
    assert main(args) == 0
    before = (tmp_path / "same.mp4").read_bytes()
    assert main(args) == 2
    assert re.search(r"same\.mp4' already exists", capsys.readouterr().err)
    assert (tmp_path / "same.mp4").read_bytes() == before and len(list(tmp_path.iterdir())) == 1


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"height": "32"}, r"height must be an integer, got '32' \(str\)"),
        ({"num_frames": 5.0}, r"num_frames must be an integer, got 5.0"),
        ({"prompt": 5}, r"prompt must be a string, got 5 \(int\)"),
        ({"fps": True}, r"fps must be a number, got True"),
        ({"save_output": "no"}, r"save_output must be true or false, got 'no'"),
        ({"return_frames": 1}, r"return_frames must be true or false"),
        ({"return_file_paths_only": True, "return_frames": True}, "contradict each other"),
    ],
)
def test_wrong_types_are_value_errors_naming_the_field(generator, tmp_path, kwargs, message):
    with pytest.raises(ValueError, match=message):
        generator.generate({**SMALL, "output_path": str(tmp_path), **kwargs})
    assert list(tmp_path.iterdir()) == []


def test_numpy_numbers_and_pathlib_paths_are_accepted(generator, tmp_path):
    import numpy as np

    result = generator.generate({**SMALL, "height": np.int64(32), "fps": np.float32(24), "output_path": tmp_path,
                                 "output_file_name": "np"})
    assert result.output_file_path == str(tmp_path / "np.mp4") and probe(result.output_file_path).height == 32


def _config(tmp_path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


@pytest.mark.parametrize(
    ("name", "text", "message"),
    [
        ("missing.yaml", None, "cannot read --config .*missing.yaml: No such file"),
        ("bad.yaml", "prompt: [unclosed\n", "is not valid YAML"),
        ("bad.json", "{'prompt': 1}", "is not valid JSON"),
        ("h.json", '{"height": "tall"}', "--height: expected an integer, got 'tall'"),
        ("f.yaml", "height: 64.5\n", r"f\.yaml: --height: expected an integer, got 64\.5"),
        ("i.yaml", "seed: 1.0\n", r"i\.yaml: --seed: expected an integer, got 1\.0"),
        ("l.yaml", "fps: [24]\n", r"l\.yaml: --fps: expected a number, got \[24\]"),
        ("d.yaml", "dtype: float16\n", "--dtype: expected one of auto, bfloat16, float32, got 'float16'"),
        ("s.yaml", "save-output: maybe\n", "--save-output: expected true or false, got 'maybe'"),
        # [] ran as if the key were absent: a list emptied to mean "none" kept the mode's default.
        ("e.yaml", "cpu-offload-components: []\n", r"--cpu-offload-components: is an empty list; the flag takes at "
                                                    r"least one value: drop the key for the default \(`\[none\]` "
                                                    r"to offload none\)"),
        ("q.yaml", "quantization-ignored-layers: []\n", "--quantization-ignored-layers: is an empty list"),
    ],
)
def test_cli_config_file_problems_exit_2_with_the_fix(tmp_path, capsys, name, text, message):
    path = str(tmp_path / name) if text is None else _config(tmp_path, name, text)
    assert main(["generate", "--config", path, "--model-path", "demo", "--prompt", "x"]) == 2
    err = capsys.readouterr().err
    assert re.search(message, err), err
    assert "Traceback" not in err


@pytest.mark.parametrize(
    ("text", "message"),
    [
        # A list or mapping for a one-string flag was passed on as is: exit 70, "internal error (TypeError: ...)".
        ("host: [a, b]\n", r"--host: takes one string, got \['a', 'b'\]"),
        ("output-path: {a: 1}\n", r"--output-path: takes one string, got \{'a': 1\}"),
        # str() of a mapping allowed a folder literally named "{'a': 1}".
        ("allowed-input-dir: {a: 1}\n", r"--allowed-input-dir: takes a string or a list of strings, got \{'a': 1\}"),
        ("allowed-input-dir: [a, [b]]\n", r"--allowed-input-dir: takes a string or a list of strings"),
        ("allowed-input-dir: []\n", r"--allowed-input-dir: is an empty list; the flag takes at least one value"),
    ],
)
def test_cli_serve_config_values_of_the_wrong_shape_exit_2(tmp_path, capsys, monkeypatch, text, message):
    from k6serve.serve import server_process

    monkeypatch.setattr(server_process, "Engine", lambda config: pytest.fail("the model loaded"))
    monkeypatch.setattr(server_process, "listening_socket", lambda host, port: pytest.fail("the port was bound"))
    monkeypatch.chdir(tmp_path)
    path = _config(tmp_path, "s.yaml", text)
    assert main(["serve", "--config", path, "--model-path", "demo", "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert re.search(rf"^error: --config .*s\.yaml: {message}", err), err


def test_cli_config_prompt_list_says_how_to_run_several_prompts(tmp_path, capsys):
    # The Python API's generate takes a list of prompts; a --config file's list got only "takes one string".
    path = _config(tmp_path, "p.yaml", "prompt: [a cat, a dog]\n")
    assert main(["generate", "--config", path, "--model-path", "demo"]) == 2
    assert capsys.readouterr().err.endswith(
        "--prompt: takes one string, got ['a cat', 'a dog'] (several prompts: write them one per line in a file and "
        "give it as prompt-file-path)\n")


def test_cli_config_yaml_booleans_and_dates_of_string_flags_are_read_as_written(tmp_path, capsys):
    # YAML reads an unquoted off as false and 2026-01-01 as a date: `warmup-mode: off` (a choice of the flag) was
    # refused as "expected one of off, request, server, got False", and `output-path: 2026-01-01` failed as
    # "output_path must be a string, got datetime.date(2026, 1, 1)".
    from k6serve.cli.config_file import merged_options
    from k6serve.cli.flags import build_parser

    parser = build_parser()
    path = _config(tmp_path, "run.yaml", "model-path: demo\nwarmup-mode: off\nvae-tiling: on\n"
                                         "output-path: 2026-01-01\nprompt: a cat\n")
    options = merged_options(parser.parse_args(["generate", "--config", path]), parser)
    assert (options["warmup_mode"], options["vae_tiling"], options["output_path"]) == ("off", "on", "2026-01-01")
    # A YAML file named in capitals (run.YAML) was read as JSON and refused as "not valid JSON".
    upper = tmp_path / "RUN.YML"
    upper.write_text("model-path: demo\nprompt: a cat\n")
    assert merged_options(parser.parse_args(["generate", "--config", str(upper)]), parser)["prompt"] == "a cat"
    # A boolean where no choice reads it (yes, true and on are one value): refused, naming the file and the flag.
    path = _config(tmp_path, "bad.yaml", "negative-prompt: no\n")
    assert main(["generate", "--config", path, "--model-path", "demo", "--prompt", "x"]) == 2
    assert re.search(r"error: --config .*bad\.yaml: --negative-prompt: takes one string, got false \(YAML reads an "
                     r"unquoted yes, no, on, off, true or false as a boolean\); quote the value",
                     capsys.readouterr().err)


def test_cli_config_values_are_read_like_flags(tiny_distill_dir, tmp_path, capsys, in_process_worker):
    # JSON strings for numbers once crashed inside the worker; YAML "no" for save-output once saved the file.
    path = _config(tmp_path, "run.json", f'{{"model-path": "{tiny_distill_dir}", "prompt": "x", "height": "32", '
                                         f'"width": 32, "num-frames": "5", "save-output": "no", "output-path": '
                                         f'"{tmp_path / "out"}", "compile-vae": "false"}}')
    assert main(["generate", "--config", path]) == 0
    assert not (tmp_path / "out").exists() or list((tmp_path / "out").iterdir()) == []
    captured = capsys.readouterr()
    out = captured.out
    assert not any(line.startswith("saved ") for line in out.splitlines())
    # The note and the summary line named --no-save-output, a flag the user never typed: they name the file's key.
    summary = f"not saved (save-output: false (--config {path})): 32x32, 5 frames, 24 fps, with audio, seed 42"
    assert out.splitlines()[-1] == summary
    assert (f"note: save-output: false (--config {path}): the video is generated and then discarded; only the "
            "timings are printed. Drop it from the file (or pass --save-output) to write the MP4.") in captured.err
    assert "--no-save-output" not in captured.err + out


@pytest.fixture(scope="module")
def sr_generator(tiny_sr_dir):
    config = build_engine_config(str(tiny_sr_dir), device="cpu")
    with DiffGenerator(Engine(config, worker=ModelWorker(config))) as gen:
        yield gen


@pytest.fixture(scope="module")
def sr_clip(tmp_path_factory):
    from k6serve.testing.clips import make_clip

    return make_clip(tmp_path_factory.mktemp("edge_clips") / "clip.mp4", width=64, height=32, num_frames=9, fps=24)


@pytest.mark.parametrize("mode", ["exact", "fit"])
def test_odd_sr_target_fails_before_any_dit_call(sr_generator, sr_clip, tmp_path, mode):
    # 43 high: "fit" rounds 64 * 43/64 half-to-even up to 44, then clamps to the odd bucket side 43.
    steps = []
    with pytest.raises(ValueError, match=r"'86x43' has an odd side.*use 86x44 or 86x42"):
        sr_generator.generate({"video_path": str(sr_clip), "sr_resolution_scale": 2, "output_path": str(tmp_path),
                               "sr_target_resolution": "86x43", "sr_target_resize_mode": mode},
                              on_progress=lambda step, total: steps.append(step))
    assert steps == [] and list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(("character", "count"), [("a", 240), ("\u0432", 120)])  # 1 and 2 bytes in UTF-8
def test_a_long_source_name_gives_a_derived_name_the_filesystem_takes(sr_generator, sr_clip, tmp_path, character,
                                                                      count):
    # A 240-byte stem: with the "_sr2x_<stamp>.mp4" suffix past the 255 bytes a file name may have. The write failed
    # with "File name too long" after the whole upscale; the stem is now cut to fit, at a character.
    source = tmp_path / f"{character * count}.mp4"
    source.write_bytes(sr_clip.read_bytes())
    result = sr_generator.generate({"video_path": str(source), "sr_resolution_scale": 2,
                                    "output_path": str(tmp_path / "out")})
    name = result.output_file_path.split("/")[-1]
    assert re.fullmatch(rf"{character}+_sr2x_\d{{8}}-\d{{6}}\.mp4", name)
    assert len(name.encode()) <= 255 - 24  # room for the writer's temporary name and a _<n> when taken
    assert probe(result.output_file_path).num_frames == 9


@pytest.mark.parametrize(("source_name", "stem"), [(".hidden.mp4", "hidden"), (".mp4", "mp4"), ("..mp4", "video")])
def test_a_hidden_source_gives_a_visible_derived_name(source_name, stem):
    # The SR output name is derived from the source's stem: a hidden source (".hidden.mp4") gave a hidden output
    # (".hidden_sr2x_<stamp>.mp4") that ls and file browsers do not list.
    from k6serve.request import UpscaleRequest

    request = UpscaleRequest(video_path=f"/clips/{source_name}", scale=2.0, tiles_batch_size=1, tile_min_overlap=0.2,
                             target_resolution=None, target_resize_mode="fit", seed=42, requested_steps=None)
    name = output_names.default_file_name(request, datetime(2026, 1, 2, 3, 4, 5))
    assert name == f"{stem}_sr2x_20260102-030405.mp4"


@pytest.mark.parametrize(("source_name", "stem"), [("a\nb.mp4", "a_b"), ("x\u202egpj.mp4", "x_gpj"),
                                                    ("my clip (1).mp4", "my clip (1)")])
def test_a_derived_name_keeps_no_control_or_format_character_of_the_source(source_name, stem):
    # A newline in the source's name split the CLI's "saved PATH (...)" line on stdout; a right-to-left override
    # showed the output's name reversed. The rest of the name (spaces, brackets) is the user's and stays.
    from k6serve.request import UpscaleRequest

    request = UpscaleRequest(video_path=f"/clips/{source_name}", scale=2.0, tiles_batch_size=1, tile_min_overlap=0.2,
                             target_resolution=None, target_resize_mode="fit", seed=42, requested_steps=None)
    assert output_names.default_file_name(request, datetime(2026, 1, 2, 3, 4, 5)) == f"{stem}_sr2x_20260102-030405.mp4"


def test_a_given_output_file_name_too_long_for_the_filesystem_is_refused_before_the_run(generator, tmp_path):
    with pytest.raises(ValueError, match=r"output_file_name is 254 bytes long with \.mp4 in UTF-8, more than the "
                                         "231 .*pass a shorter name"):
        generator.generate({**SMALL, "output_path": str(tmp_path / "out"), "output_file_name": "c" * 250})
    # Bytes, not characters: 120 Cyrillic letters are 240 bytes.
    with pytest.raises(ValueError, match=r"output_file_name is 244 bytes long"):
        generator.generate({**SMALL, "output_path": str(tmp_path / "out"), "output_file_name": "л" * 120})
    assert not (tmp_path / "out").exists()


def test_sr_on_the_cpu_says_a_seed_past_32_bits_draws_its_low_32_bits_noise(sr_generator, sr_clip):
    """SR draws tile noise on its device: on the CPU a seed 2**32 larger draws the same; on CUDA (Philox, all 64
    bits) it would not, so only a CPU run gets the note."""
    request = {"video_path": str(sr_clip), "sr_resolution_scale": 2, "save_output": False, "return_frames": True}
    low = sr_generator.generate({**request, "seed": 3})
    high = sr_generator.generate({**request, "seed": 2**32 + 3})
    np.testing.assert_array_equal(high.frames, low.frames)
    assert [note for note in high.notes if "low 32 bits" in note] == [
        f"seed {2**32 + 3} draws the same noise as seed 3: torch's CPU random generator, which draws the noise (as "
        "in diffusers), keeps only a seed's low 32 bits; for distinct outputs use seeds below 2**32 (4294967296)"]
    assert not [note for note in low.notes if "low 32 bits" in note]


def test_sr_output_never_replaces_the_source(sr_generator, sr_clip):
    before = sr_clip.read_bytes()
    with pytest.raises(ValueError, match="already exists"):
        sr_generator.generate({"video_path": str(sr_clip), "sr_resolution_scale": 2,
                               "output_path": str(sr_clip.parent), "output_file_name": sr_clip.name})
    assert sr_clip.read_bytes() == before


@pytest.mark.parametrize("command", ["generate", "serve", "bench"])
def test_cli_reference_shows_the_exact_help(command, monkeypatch):
    """docs/cli.md's usage blocks are `k6serve <command> --help` at 120 columns, word for word (bench's flags were
    documented nowhere)."""
    from pathlib import Path

    from k6serve.bench.flags import build_parser as build_bench_parser
    from k6serve.cli.flags import build_parser

    monkeypatch.setenv("COLUMNS", "120")
    sub = build_bench_parser() if command == "bench" else build_parser()._subparsers._group_actions[0].choices[command]
    text = (Path(__file__).resolve().parents[2] / "docs" / "cli.md").read_text()
    block = re.search(rf"```\n(usage: k6serve {command} .*?)```", text, re.DOTALL)
    assert block is not None and block.group(1) == sub.format_help()


def test_the_python_api_names_the_fields_where_the_cli_names_flags(generator, sr_generator, sr_clip, tmp_path):
    # The CLI's refusals name its flags (test_cli_refuses_a_bad_request_before_loading_the_model); the API's keep
    # its keywords, the words the HTTP server answers with too.
    with pytest.raises(ValueError, match=r"^fps must be between 1 and 240 .*, got 0\.5$"):
        generator.generate({**SMALL, "output_path": str(tmp_path), "fps": 0.5})
    with pytest.raises(ValueError, match=r"^sr_resolution_scale must be 2, 4 or 2\.25, got 3$"):
        sr_generator.generate({"video_path": str(sr_clip), "sr_resolution_scale": 3, "output_path": str(tmp_path)})
    with pytest.raises(ValueError, match=r"^sample_audio applies to the generation models; .* Drop sample_audio\.$"):
        sr_generator.generate({"video_path": str(sr_clip), "sample_audio": False, "output_path": str(tmp_path)})
    assert list(tmp_path.iterdir()) == []


def test_sr_target_resize_mode_is_refused_on_a_generation_model(generator, tmp_path):
    with pytest.raises(ValueError, match="sr_target_resize_mode applies to the super-resolution model only.*drop it"):
        generator.generate({**SMALL, "output_path": str(tmp_path), "sr_target_resize_mode": "exact"})
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("mode", ["exact", "fit"])
def test_sr_target_resize_mode_without_a_target_is_refused(sr_generator, sr_clip, tmp_path, mode):
    with pytest.raises(ValueError, match="sr_target_resize_mode only says how to reach sr_target_resolution.*"
                                         "pass sr_target_resolution"):
        sr_generator.generate({"video_path": str(sr_clip), "sr_resolution_scale": 2, "output_path": str(tmp_path),
                               "sr_target_resize_mode": mode})
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(("target", "noted"), [("hd", True), ("256x64", True), ("128x64", False), ("100x40", False)])
def test_sr_fit_target_not_smaller_than_the_result_is_noted(sr_generator, sr_clip, tmp_path, target, noted):
    # 64x32 x2 = 128x64: "fit" only downscales, so hd and 256x64 leave the size as is, which once said nothing.
    result = sr_generator.generate({"video_path": str(sr_clip), "sr_resolution_scale": 2, "save_output": False,
                                    "return_frames": True, "sr_target_resolution": target})
    kept = [note for note in result.notes if "'fit' only downscales" in note]
    assert len(kept) == int(noted)
    if noted:
        assert "the output keeps 128x64" in kept[0] and result.frames.shape[1:3] == (64, 128)


@pytest.mark.parametrize("suffix", [".png", ".jpg"])
def test_sr_still_image_source_is_refused(sr_generator, tmp_path, suffix):
    # FFmpeg opens a PNG or JPEG as a one-frame "video" at 25 fps, which once upscaled as a 1-frame clip.
    import numpy as np
    from PIL import Image

    image = tmp_path / f"photo{suffix}"
    Image.fromarray(np.full((32, 64, 3), 128, np.uint8)).save(image)
    steps = []
    with pytest.raises(ValueError, match=rf"photo\{suffix}' is a still image .*(png|jpeg)_pipe.*pass an MP4"):
        sr_generator.generate({"video_path": str(image), "sr_resolution_scale": 2, "output_path": str(tmp_path)},
                              on_progress=lambda step, total: steps.append(step))
    assert steps == [] and [p.name for p in tmp_path.iterdir()] == [image.name]


def test_a_derived_name_taken_while_the_request_runs_moves_on(generator, tmp_path, monkeypatch):
    # Another replica or thread writing the same derived name in the same second: the first request's file
    # was once replaced by the second's.
    monkeypatch.setattr(output_names, "datetime", _FrozenClock)
    taken = tmp_path / "x_seed42_20260102-030405.mp4"
    taken_1 = tmp_path / "x_seed42_20260102-030405_1.mp4"

    def another_request_finishes_first(step, total):
        if step == 1:
            taken.write_bytes(b"the other request's video")
            taken_1.write_bytes(b"and a third one")

    result = generator.generate({**SMALL, "output_path": str(tmp_path)}, on_progress=another_request_finishes_first)
    assert result.output_file_path == str(tmp_path / "x_seed42_20260102-030405_2.mp4")
    assert probe(result.output_file_path).width == 32
    assert taken.read_bytes() == b"the other request's video" and taken_1.read_bytes() == b"and a third one"
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([taken.name, taken_1.name,
                                                                 "x_seed42_20260102-030405_2.mp4"])


def test_a_given_name_taken_while_the_request_runs_is_kept_and_the_video_saved_beside_it(generator, tmp_path):
    """The finished video was thrown away ("this result was not saved"): minutes of GPU time lost for a name."""
    target = tmp_path / "clip.mp4"

    def another_request_finishes_first(step, total):
        if step == 1:
            target.write_bytes(b"the other request's video")

    result = generator.generate({**SMALL, "output_path": str(tmp_path), "output_file_name": "clip"},
                                on_progress=another_request_finishes_first)
    assert target.read_bytes() == b"the other request's video"
    assert result.output_file_path == str(tmp_path / "clip_1.mp4") and probe(result.output_file_path).width == 32
    assert "'clip.mp4' was created in the output folder while this request ran and was left as it is; this video " \
           "was saved as 'clip_1.mp4' instead." in result.notes
    assert sorted(p.name for p in tmp_path.iterdir()) == ["clip.mp4", "clip_1.mp4"]


@pytest.fixture
def in_process_cli(tiny_distill_dir, in_process_worker):
    """`k6serve generate` on an in-process worker, so a test can make the MP4 write fail in this process."""
    return ["generate", "--model-path", str(tiny_distill_dir), "--device", "cpu", "--prompt", "x", "--height", "32",
            "--width", "32", "--num-frames", "5"]


def _disk_full(path):
    import errno

    raise OSError(errno.ENOSPC, "No space left on device", str(path))


def test_cli_disk_full_at_the_write_is_one_line_with_the_fix(in_process_cli, tmp_path, monkeypatch, capsys):
    from k6serve.media import mux

    monkeypatch.setattr(mux, "_fsync", _disk_full)
    assert main([*in_process_cli, "--output-path", str(tmp_path), "--output-file-name", "clip"]) == 1
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert lines == [(f"error: writing the MP4 failed: No space left on device: '{tmp_path / 'clip.mp4'}'; free "
                      "space on that disk, or pass --output-path on another disk")], err
    assert "Traceback" not in err and list(tmp_path.iterdir()) == []


def test_cli_debug_log_level_shows_the_traceback(in_process_cli, tmp_path, monkeypatch, capsys):
    from k6serve.media import mux

    monkeypatch.setattr(mux, "_fsync", _disk_full)
    assert main(["--log-level", "debug", *in_process_cli, "--output-path", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert "Traceback" in err and "_disk_full" in err and "error: writing the MP4 failed" in err


def test_cli_debug_log_level_after_the_command_shows_the_traceback(in_process_cli, tmp_path, monkeypatch, capsys):
    """Every error line says "rerun with --log-level debug": appended to the failed command, it must work."""
    from k6serve.media import mux

    monkeypatch.setattr(mux, "_fsync", _disk_full)
    assert main([*in_process_cli, "--output-path", str(tmp_path), "--log-level", "DEBUG"]) == 1
    err = capsys.readouterr().err
    assert "Traceback" in err and "_disk_full" in err and "error: writing the MP4 failed" in err


def test_cli_log_level_is_checked_and_not_a_config_key(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", "--model-path", "demo", "--log-level", "verbose"])
    assert exit_info.value.code == 2
    assert "argument --log-level: invalid choice: 'verbose'" in capsys.readouterr().err
    config = tmp_path / "run.json"
    config.write_text('{"model-path": "demo", "log-level": "debug"}')
    assert main(["generate", "--config", str(config)]) == 2
    assert "unknown key(s) ['log_level']" in capsys.readouterr().err


def test_cli_ctrl_c_is_one_line_and_exit_130(tiny_distill_dir, tmp_path, monkeypatch, capsys):
    import k6serve.cli.generate as generate_module

    def interrupted(self, *args, **kwargs):
        raise KeyboardInterrupt  # where the CLI waits on the request when Ctrl-C arrives

    monkeypatch.setattr(generate_module.DiffGenerator, "generate", interrupted)
    assert main(["generate", "--model-path", str(tiny_distill_dir), "--device", "cpu", "--prompt", "x",
                 "--output-path", str(tmp_path)]) == 130
    err = capsys.readouterr().err
    assert "error: interrupted (Ctrl-C); the request was stopped." in err and "Traceback" not in err
    assert list(tmp_path.iterdir()) == []


def test_cli_ctrl_c_after_the_video_was_saved_says_so(tiny_distill_dir, tmp_path, monkeypatch, capsys):
    """A Ctrl-C while the workers shut down, the MP4 already on disk, said "the request was stopped"; one during
    the load said the same of a request that never started."""
    import k6serve.cli.generate as generate_module

    def interrupted(self, *args, **kwargs):
        raise KeyboardInterrupt

    args = ["generate", "--model-path", str(tiny_distill_dir), "--device", "cpu", "--prompt", "x", "--num-frames",
            "5", "--height", "32", "--width", "32", "--output-path", str(tmp_path), "--output-file-name", "clip"]
    shutdown = generate_module.DiffGenerator.shutdown

    def shut_down_then_interrupted(self, *a, **kw):
        shutdown(self, *a, **kw)
        raise KeyboardInterrupt

    monkeypatch.setattr(generate_module.DiffGenerator, "shutdown", shut_down_then_interrupted)
    assert main(args) == 130
    err = capsys.readouterr().err
    saved = tmp_path / "clip.mp4"
    assert saved.is_file()
    assert err.endswith(f"error: interrupted (Ctrl-C) after the request finished; saved {saved} (32x32, 5 frames, "
                        "24 fps, with audio, seed 42).\n"), err

    monkeypatch.setattr(generate_module.DiffGenerator, "from_cli_options", classmethod(interrupted))
    assert main([*args, "--output-file-name", "other"]) == 130
    assert capsys.readouterr().err.endswith(
        "error: interrupted (Ctrl-C) while the model loaded; nothing was generated.\n")


def test_cli_internal_error_is_told_apart_from_user_errors(in_process_cli, tmp_path, monkeypatch, capsys):
    def broken(*args, **kwargs):
        raise RuntimeError("shapes do not match\nmore detail")

    monkeypatch.setattr(worker_module, "generate_into_mp4", broken)
    assert main([*in_process_cli, "--output-path", str(tmp_path)]) == 70
    err = capsys.readouterr().err
    assert "error: internal error (RuntimeError: shapes do not match); this is a bug in k6serve: rerun with " \
           "--log-level debug" in err
    assert "Traceback" not in err and "more detail" not in err


@pytest.mark.parametrize("module, code", [("multipart.multipart", 1), ("fastapi", 1), ("k6serve.serve.app", 70)])
def test_cli_missing_dependency_is_an_environment_error_with_the_pip_command(in_process_cli, tmp_path, monkeypatch,
                                                                              capsys, module, code):
    """A dependency missing from the running interpreter (a PYTHONPATH that replaced the one holding it did this
    on the GPU host) is not a k6serve bug: exit 1 and the pip command for this interpreter. One of k6serve's own
    modules missing still is."""
    def missing(*args, **kwargs):
        raise ModuleNotFoundError(f"No module named {module!r}", name=module)

    monkeypatch.setattr(worker_module, "generate_into_mp4", missing)
    assert main([*in_process_cli, "--output-path", str(tmp_path)]) == code
    err = capsys.readouterr().err
    if code == 1:
        distribution = "python-multipart" if module.startswith("multipart") else module
        # The version k6serve declares, not the newest release (PyAV 19 is outside av<19).
        assert (f"error: the Python package {distribution!r} (module {module.partition('.')[0]!r}), which k6serve "
                f"needs, is not installed for {sys.executable}: run `{sys.executable} -m pip install "
                f"\"{distribution}>=") in err
        assert "bug" not in err
    else:
        assert "this is a bug in k6serve" in err


def test_a_source_tree_never_installed_still_names_the_declared_versions(monkeypatch):
    # On the GPU host k6serve runs from a copy of the tree on PYTHONPATH: no installed metadata, and the pip
    # command fell back to a bare `pip install fastapi` (the test above failed there).
    import importlib.metadata

    from k6serve import dependencies

    def not_installed(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "requires", not_installed)
    assert dependencies.declared_requirement("fastapi").startswith("fastapi>=")
    assert dependencies.declared_requirement("av").startswith("av") and "<19" in dependencies.declared_requirement("av")
    assert dependencies.declared_requirement("not-a-dependency") == "not-a-dependency"


def test_a_worker_process_os_error_reaches_the_engine_as_an_os_error():
    import errno
    import pickle

    from k6serve.runtime import messages
    from k6serve.runtime.replica_failures import RemoteTraceback, failure_error
    from k6serve.runtime.rank_process import _classify

    try:
        _disk_full("/out/clip.mp4")
    except OSError as error:
        kind, text, rebuilt = _classify(error, 3)
    message = pickle.loads(pickle.dumps(messages.RunFailed(request_id=1, kind=kind, message=text, error=rebuilt)))
    raised = failure_error(message, 1, 0)
    assert isinstance(raised, OSError) and (raised.errno, raised.filename) == (errno.ENOSPC, "/out/clip.mp4")
    assert isinstance(raised.__cause__, RemoteTraceback) and "_disk_full" in str(raised.__cause__)
    # One of k6serve's own modules missing is a bug, and stays one.
    assert _classify(ModuleNotFoundError("No module named 'k6serve.x'", name="k6serve.x"), 0)[0] == "runtime"
    kind, text, _ = _classify(RuntimeError("boom"), 3)
    raised = failure_error(messages.RunFailed(request_id=1, kind=kind, message=text), 1, 0)
    assert isinstance(raised, RuntimeError)
    assert str(raised).splitlines()[0] == "request 1 failed on replica 0: rank 3: RuntimeError: boom"


def test_cli_has_no_return_frames_flag(capsys):
    # It only filled arrays the command line then dropped; the Python API keeps return_frames (and the refusal,
    # since SGLang has the flag, says so: tests/unit/test_reference_names.py).
    assert main(["generate", "--model-path", "demo", "--prompt", "x", "--return-frames"]) == 2
    err = capsys.readouterr().err
    assert "error: unrecognized arguments: --return-frames" in err and "return_frames=True" in err


def test_cli_no_save_output_says_the_video_is_discarded(in_process_cli, tmp_path, capsys):
    assert main([*in_process_cli, "--output-path", str(tmp_path), "--no-save-output"]) == 0
    captured = capsys.readouterr()
    assert "note: --no-save-output: the video is generated and then discarded" in captured.err
    assert "not saved (--no-save-output): 32x32, 5 frames, 24 fps, with audio, seed 42" in captured.out
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("remote", [False, True])
def test_cli_out_of_memory_is_a_machine_limit_with_a_fix_not_a_bug(in_process_cli, tmp_path, monkeypatch, capsys,
                                                                     remote):
    """In process torch raises OutOfMemoryError; from a worker process it arrives as a RuntimeError carrying the
    rank's error text. Either way: one line saying what ran out and which flags help, exit 1, not 'a bug'."""
    oom = "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.1 GiB"

    def exhausted(*args, **kwargs):
        if remote:
            raise RuntimeError(f"request 1 failed on replica 0: rank 0: OutOfMemoryError: {oom}\nTraceback ...")
        raise torch.OutOfMemoryError(oom)

    monkeypatch.setattr(worker_module, "generate_into_mp4", exhausted)
    assert main([*in_process_cli, "--output-path", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert f"error: the GPU ran out of memory ({oom}); ask for fewer pixels or frames" in err
    assert "--num-frames" in err and "bug" not in err and "Traceback" not in err
    # Speed mode (the default) with everything resident: the offload that keeps it compiled comes first.
    assert "keep speed mode and move the weights to host memory between stages with --cpu-offload-components all" in err


SPEED_NEXT = "--performance-mode balanced or memory (weights in host memory)"


@pytest.mark.parametrize(("options", "keeps_speed", "next_step"), [
    ({}, True, SPEED_NEXT), ({"performance_mode": "speed"}, True, SPEED_NEXT),
    # balanced goes on to memory; memory has no mode left (both were offered to it, it being one of them)
    ({"performance_mode": "balanced"}, False, "--performance-mode memory (the DiT's blocks streamed from host memory)"),
    ({"performance_mode": "memory"}, False, "keep --vae-tiling on (auto is on in memory mode), lower "
                                            "--offload-resident-blocks and --offload-prefetch-blocks if they were raised"),
    ({"cpu_offload_components": ["all"]}, False, SPEED_NEXT),
    ({"layerwise_offload_components": ["transformer"]}, False, SPEED_NEXT),
    # `none` offloads nothing (everything resident: the fix applies); every component offloaded whole through
    # --component-residency is what the fix would do (it was offered again, and withheld for `none`).
    ({"cpu_offload_components": ["none"]}, True, SPEED_NEXT),
    ({"component_residency": ["all=component_offload"]}, False, SPEED_NEXT),
])
def test_cli_out_of_memory_offers_the_fixes_that_apply_where_the_run_is(options, keeps_speed, next_step):
    from types import SimpleNamespace

    from k6serve.cli.main import describe_out_of_memory
    from k6serve.engine_arguments import build_engine_config
    from k6serve.serve.job_outcomes import JobOutcomes

    text = describe_out_of_memory(RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB"), options)
    assert ("--cpu-offload-components all" in text) is keeps_speed
    assert next_step in text and "--ulysses-degree" in text
    # FSDP only where nothing is offloaded: the config refuses it beside offloading
    offloads = build_engine_config("demo", **options).runtime.offloads
    assert ("--use-fsdp-inference true" in text) is not offloads
    outcomes = object.__new__(JobOutcomes)  # the server's log line for a job out of memory, from the same flags
    outcomes.engine = SimpleNamespace(config=build_engine_config("demo", **options))
    assert outcomes._memory_fixes() in text


def test_cli_internal_error_from_a_worker_names_the_error_under_its_header(in_process_cli, tmp_path, monkeypatch,
                                                                           capsys):
    """A replica that failed to start sends a header line and its traceback; the one-line error shows the header
    and the traceback's last line (the error itself), not the header alone."""
    def broken(*args, **kwargs):
        raise RuntimeError("replica 0 failed to start:\nTraceback (most recent call last):\n  File \"x.py\", line 1\n"
                           "ImportError: cannot import name 'VideoProcessorMixin'\n")

    monkeypatch.setattr(worker_module, "generate_into_mp4", broken)
    assert main([*in_process_cli, "--output-path", str(tmp_path)]) == 70
    err = capsys.readouterr().err
    assert ("error: internal error (RuntimeError: replica 0 failed to start: ImportError: cannot import name "
            "'VideoProcessorMixin'); this is a bug in k6serve") in err


@pytest.mark.parametrize("name", ["..", ".", "???", " ", ".mp4", "-.MP4", "🦊.mp4", "\u202e.mp4"])
def test_output_file_name_without_a_letter_or_digit_is_refused(generator, tmp_path, name):
    # " " is empty once stripped, and said so; the others are refused as names with nothing to name the file by.
    with pytest.raises(ValueError, match=r"(has no letter or digit to name the file by|is empty); pass a name "
                                         r"such as clip\.mp4"):
        generator.generate({**SMALL, "output_path": str(tmp_path / "out"), "output_file_name": name})
    assert not (tmp_path / "out").exists()


def test_names_in_other_scripts_name_the_file(generator, tmp_path):
    """Russian, Chinese or accented names were cut to ASCII: every Russian prompt's video was video_seed42_<time>.mp4
    (two at one second collided) and a given "Лиса.mp4" was refused."""
    given = generator.generate({**SMALL, "output_path": str(tmp_path), "output_file_name": "Лиса в снегу.mp4"})
    assert given.output_file_path == str(tmp_path / "Лиса_в_снегу.mp4")
    assert any("is written as 'Лиса_в_снегу.mp4'" in note for note in given.notes)
    kept = generator.generate({**SMALL, "output_path": str(tmp_path), "output_file_name": "一只狐狸.mp4"})
    assert kept.output_file_path == str(tmp_path / "一只狐狸.mp4")
    assert not any("is written as" in note for note in kept.notes)
    derived = generator.generate({**SMALL, "prompt": "Лиса бежит по снегу, 🦊!", "output_path": str(tmp_path)})
    assert Path(derived.output_file_path).name.startswith("Лиса_бежит_по_снегу_seed42_")
    # NFD "é" (e + U+0301, as macOS may type it) is written NFC: the same bytes as a precomposed "é".
    accented = generator.generate({**SMALL, "output_path": str(tmp_path), "output_file_name": "cafe\u0301"})
    assert accented.output_file_path == str(tmp_path / "caf\u00e9.mp4")
    # It read "'café' is written as 'café.mp4'", no change to see: the escapes show it, and the reason is given.
    assert any(note.startswith("output_file_name 'cafe\\u0301' is written as 'caf\\xe9.mp4': its Unicode was "
                               "normalised (NFC)") for note in accented.notes), accented.notes


def test_a_name_changed_by_nfc_and_by_its_characters_says_both():
    from k6serve.output_checks import final_file_name

    final, warning = final_file_name("e\u0301 clip?.mp4")
    assert final == "\u00e9_clip_.mp4"
    assert warning.startswith("output_file_name 'e\u0301 clip?.mp4' is written as '\u00e9_clip_.mp4': file names "
                              "keep only letters and digits")
    assert warning.endswith("no leading dot; and its Unicode was normalised (NFC), so that it has the same bytes "
                            "however its accents were typed (an 'e' and a combining accent become one '\u00e9').")


def test_a_changed_output_file_name_is_warned_with_the_final_name(generator, tmp_path, caplog):
    with caplog.at_level("WARNING", logger="k6serve.api"):
        result = generator.generate({**SMALL, "output_path": str(tmp_path), "output_file_name": "my clip?.mp4"})
    warning = "output_file_name 'my clip?.mp4' is written as 'my_clip_.mp4'"
    assert result.output_file_path == str(tmp_path / "my_clip_.mp4")
    assert any(note.startswith(warning) for note in result.notes)
    assert warning in caplog.text
    # Only the added .mp4: nothing to warn about.
    result = generator.generate({**SMALL, "output_path": str(tmp_path), "output_file_name": "plain"})
    assert result.output_file_path == str(tmp_path / "plain.mp4")
    assert not any("is written as" in note for note in result.notes)


def test_cli_warns_about_a_changed_output_file_name_before_loading(in_process_cli, tmp_path, capsys):
    assert main([*in_process_cli, "--output-path", str(tmp_path), "--output-file-name", ".my clip"]) == 0
    err = capsys.readouterr().err
    assert ("warning: --output-file-name '.my clip' is written as 'my_clip.mp4': file names keep only letters and "
            "digits (of any script), '.', '_' and '-' (others become '_'), and no leading dot.") in err
    assert err.count("is written as") == 1  # said once, before the load, not again by the API
    assert [path.name for path in tmp_path.iterdir()] == ["my_clip.mp4"]


@pytest.mark.parametrize(("flags", "warning"), [
    (["--output-file-name", "clip"], "warning: --output-file-name is ignored: --no-save-output writes no file."),
    (["--output-file-name", "clip", "--output-path", "{out}"],
     "warning: --output-file-name and --output-path are ignored: --no-save-output writes no file."),
    ([], None),
])
def test_cli_no_save_output_warns_about_ignored_output_flags(in_process_cli, tmp_path, monkeypatch, capsys, flags,
                                                            warning):
    monkeypatch.chdir(tmp_path)
    flags = [flag.format(out=tmp_path / "out") for flag in flags]
    assert main([*in_process_cli, "--no-save-output", *flags]) == 0
    err = capsys.readouterr().err
    if warning is None:
        assert "ignored" not in err
    else:
        assert err.count(warning) == 1 and err.count("ignored") == 1, err
    assert list(tmp_path.iterdir()) == []


def test_api_no_save_output_notes_an_ignored_file_name(generator, tmp_path):
    result = generator.generate({**SMALL, "save_output": False, "output_file_name": "clip"})
    assert "output_file_name='clip' is ignored: save_output=False writes no file." in result.notes
    assert result.output_file_path is None
    result = generator.generate({**SMALL, "save_output": False})
    assert not any("ignored" in note for note in result.notes)


@pytest.mark.parametrize(("model_path", "load_format", "ignored_because"), [
    ("{folder}", "auto", "is a local folder, used as it is"),
    ("demo", "auto", "'demo' is a built-in tiny checkpoint"),
    # The API's words: the keyword it was given (the CLI's warning names --load-format dummy).
    ("kandinskylab/Kandinsky-6.0-Pro-distill-5s-Diffusers", "dummy", "load_format='dummy' builds random weights"),
    ("kandinskylab/Kandinsky-6.0-Pro-distill-5s-Diffusers", "auto", None),
])
def test_revision_that_applies_to_no_hub_id_is_warned(tmp_path, monkeypatch, caplog, model_path, load_format,
                                                      ignored_because):
    import k6serve.api as api

    from types import SimpleNamespace

    # What is said before the load, not the load: a stand-in engine (the generator stops it when dropped).
    monkeypatch.setattr(api, "Engine", lambda config: SimpleNamespace(config=config, shutdown=lambda: None))
    # Generators other tests keep open would add the "loaded beside them" warning.
    monkeypatch.setattr(api, "_RUNNING", type(api._RUNNING)())
    with caplog.at_level("WARNING", logger="k6serve.api"):
        DiffGenerator.from_pretrained(model_path.format(folder=tmp_path), revision="v1", load_format=load_format)
        DiffGenerator.from_pretrained(model_path.format(folder=tmp_path), load_format=load_format)
    warnings = [record.getMessage() for record in caplog.records]
    if ignored_because is None:
        assert warnings == []
    else:
        assert len(warnings) == 1 and warnings[0].startswith(
            "revision 'v1' is ignored: it only picks the revision a hub id downloads, and ")
        assert ignored_because in warnings[0]


@pytest.mark.parametrize(("num_frames", "text"), [(1, "1 frame,"), (17, "17 frames,")])
def test_cli_summary_counts_frames_in_words(num_frames, text):
    from types import SimpleNamespace

    from k6serve.cli.result_output import format_summary

    result = SimpleNamespace(width=96, height=64, num_frames=num_frames, fps=24.0, has_audio=False,
                             output_file_path=None, seed=2**40)
    assert format_summary(result) == f"not saved (--no-save-output): 96x64, {text} 24 fps, no audio, seed {2**40}"


def test_sr_without_a_source_names_the_api_keyword(sr_generator, tmp_path):
    from k6serve.request_refusals import MissingSourceVideo

    with pytest.raises(MissingSourceVideo) as refused:
        sr_generator.generate({"sr_resolution_scale": 2, "output_path": str(tmp_path)})
    message = str(refused.value)
    assert "pass video_path='/path/to/input.mp4' (or call generator.upscale(" in message
    assert "--video-path" not in message and "HTTP" not in message
    assert list(tmp_path.iterdir()) == []


def test_cli_sr_without_a_source_names_the_flag_when_the_model_is_known_only_once_loaded(tiny_sr_dir, tmp_path,
                                                                                           monkeypatch, capsys):
    import k6serve.cli.generate as generate_module
    import k6serve.cli.preflight as preflight

    monkeypatch.setattr(preflight, "engine_variant_before_loading", lambda options: None)  # e.g. a renamed hub repo
    monkeypatch.setattr(generate_module.DiffGenerator, "from_cli_options", staticmethod(
        lambda model_path, **options: DiffGenerator(Engine(build_engine_config(model_path, **options),
                                                           worker=FakeSRWorker()), wording=str)))
    assert main(["generate", "--model-path", str(tiny_sr_dir), "--output-path", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "error: Super-resolution needs exactly one source video: pass --video-path /path/to/input.mp4" in err
    assert "video_path=" not in err


class FakeSRWorker:
    """Stands in for a loaded SR worker: the API refuses the request before it would run."""

    name = "vsr-distilled2steps"

    def __init__(self) -> None:
        from k6serve.models.variants import VARIANTS

        self.variant = VARIANTS[self.name]

    def resolve(self, params):
        from k6serve.request_resolution import resolve_generate, resolve_upscale

        if self.variant.family == "super_resolution":
            return resolve_upscale(params, self.variant)
        return resolve_generate(params, self.variant)

    def run(self, params, output, on_step=None):
        raise AssertionError("the request ran")


class FakeGenerationWorker(FakeSRWorker):
    name = "lite-distill"


def test_a_missing_prompt_names_the_api_keyword_in_the_api_and_the_flag_on_the_cli(tmp_path, monkeypatch, capsys):
    from k6serve.models.variants import SUPER_RESOLUTION
    from k6serve.request_refusals import MissingPrompt

    assert FakeSRWorker().variant.family == SUPER_RESOLUTION
    generator = DiffGenerator(Engine(build_engine_config("demo", device="cpu"), worker=FakeGenerationWorker()))
    with pytest.raises(MissingPrompt, match=r"pass prompt='A cat plays piano'\.$") as refused:
        generator.generate({"prompt": " ", "output_path": str(tmp_path)})
    assert "--prompt" not in str(refused.value)
    with pytest.raises(MissingPrompt) as refused:  # a byte-order mark alone ran as a prompt
        generator.generate({"prompt": "\ufeff", "output_path": str(tmp_path)})
    assert str(refused.value) == ("prompt is required for Kandinsky 6 generation: pass prompt='A cat plays piano'. The "
                                  "prompt given, '\\ufeff', has no visible character: only spaces and zero-width, "
                                  "format, control or blank characters (a byte-order mark U+FEFF, U+200B, U+3164).")

    import k6serve.cli.generate as generate_module
    import k6serve.cli.preflight as preflight

    monkeypatch.setattr(preflight, "engine_variant_before_loading", lambda options: None)  # known only once loaded
    monkeypatch.setattr(generate_module.DiffGenerator, "from_cli_options", staticmethod(
        lambda model_path, **options: DiffGenerator(Engine(build_engine_config(model_path, **options),
                                                           worker=FakeGenerationWorker()), wording=str)))
    assert main(["generate", "--model-path", "demo", "--prompt", " ", "--output-path", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "error: prompt is required for Kandinsky 6 generation (e.g. --prompt 'A cat plays piano')." in err
    assert "prompt=" not in err


def test_cli_serve_warns_about_an_ignored_revision_before_loading(monkeypatch, caplog):
    from k6serve.serve import server_process

    monkeypatch.setattr(server_process, "serve", lambda engine_options, server_options: 0)  # no model load, no server
    with caplog.at_level("WARNING", logger="k6serve.cli.serve_flags"):
        assert main(["serve", "--model-path", "demo", "--revision", "v1"]) == 0
    assert "revision 'v1' is ignored: it only picks the revision a hub id downloads, and 'demo'" in caplog.text


def test_debug_prints_the_traceback_above_a_user_error_too(capsys, tmp_path):
    assert main(["generate", "--model-path", "demo", "--prompt", "x", "--fps", "0.5", "--no-save-output"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and "--fps must be between 1 and 240" in err
    assert main(["generate", "--model-path", "demo", "--prompt", "x", "--fps", "0.5", "--no-save-output",
                 "--log-level", "debug"]) == 2
    err = capsys.readouterr().err
    assert "Traceback (most recent call last)" in err
    assert err.strip().splitlines()[-1].startswith("error: --fps must be between 1 and 240")


def test_the_progress_bar_draws_each_step_once_at_an_honest_rate(in_process_cli, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr("k6serve.step_bar.is_terminal", lambda stream: True)  # the bar, as on a terminal
    assert main([*in_process_cli, "--num-inference-steps", "4", "--output-path", str(tmp_path)]) == 0
    err = capsys.readouterr().err
    draws = re.findall(r"denoising: +\d+%\|[^|]*\| (\d+)/(\d+) \[[^,\]]*(?:, *([0-9.]+)step/s)?", err)
    steps = [int(done) for done, _, _ in draws]
    # The final step is reported again at the decode's chunk boundaries: drawn once (plus tqdm's closing redraw).
    assert steps[-1] == 4 and steps.count(4) <= 2 and steps == sorted(steps), draws
    # The bar opens at the first step: that step is not counted in the rate (it read 190,000 step/s).
    assert all(float(rate) < 1000 for _, _, rate in draws if rate), draws


def test_cli_a_damaged_local_checkpoint_is_refused_before_the_workers_start(no_model_load, capsys, tmp_path):
    import shutil

    from k6serve.testing.tiny_checkpoints import ensure_demo_checkpoint

    folder = tmp_path / "ck"
    shutil.copytree(ensure_demo_checkpoint(), folder)
    (folder / "k6serve_demo.json").unlink()  # routed by its model_index.json, as a real checkpoint
    weights = folder / "vae" / "diffusion_pytorch_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])  # an interrupted copy
    assert main(["generate", "--model-path", str(folder), "--prompt", "x", "--no-save-output"]) == 2
    err = capsys.readouterr().err
    assert f"error: {weights} is damaged" in err and "copy or download it again" in err


def test_progress_is_plain_lines_where_stderr_is_no_terminal(in_process_cli, tmp_path, capsys):
    """In a CI log or `2>log` the bar's redraws were one line of carriage-return-joined frames."""
    assert main([*in_process_cli, "--num-inference-steps", "20", "--output-path", str(tmp_path)]) == 0
    err = capsys.readouterr().err
    assert "\rdenoising" not in err and "%|" not in err.split("denoising", 1)[1]
    counts = re.findall(r"^denoising: (\d+)/20 steps, [0-9.]+ s$", err, re.MULTILINE)
    # The first step (it started), then each tenth once, the last once despite the decode's repeats of it.
    assert counts == ["1", *(str(step) for step in range(2, 21, 2))]


def test_a_config_path_naming_an_environment_variable_is_refused(tmp_path, capsys, no_model_load):
    """`output-path: ${OUT}/videos` wrote into a folder named "${OUT}" under the working folder, exit 0."""
    config = tmp_path / "run.yaml"
    config.write_text("output-path: ${OUT}/videos\nprompt: a $5 bill\n")  # a prompt may hold a dollar sign
    assert main(["generate", "--model-path", "demo", "--config", str(config)]) == 2
    assert ("output-path '${OUT}/videos' names an environment variable, which k6serve does not expand in a config "
            "file; write the value out, or pass it as a flag") in capsys.readouterr().err


def test_the_progress_bar_closes_at_the_last_step_not_after_the_decode(monkeypatch):
    """The bar closed only after the decode, so its last line counted the decode in the rate (3 s/step where the
    steps took 0.7 s). The decode's repeats of the last step draw nothing; a count that starts over opens a bar."""
    import io

    from k6serve.step_bar import StepBar

    monkeypatch.setattr("k6serve.step_bar.is_terminal", lambda stream: True)
    out = io.StringIO()
    bar = StepBar("denoising", file=out)
    bar.update(0, 4)  # the warm-up's and the prompt rewrite's cancellation points: no bar yet
    bar.update(0, 4)
    assert bar.bar is None and out.getvalue() == ""
    for step in (1, 2, 3, 4):
        bar.update(step, 4)
    first = bar.bar
    assert first.n == 4 and first.disable  # tqdm's state once closed
    drawn = out.getvalue()
    bar.update(4, 4)  # the decode's chunk boundaries
    bar.update(4, 4)
    assert bar.bar is first and out.getvalue() == drawn
    bar.update(1, 2)  # a second count (a new request on the same bar object)
    assert bar.bar is not first and bar.bar.n == 1 and not bar.bar.disable
    bar.close()
    bar.close()  # again: nothing to do


def test_cli_switches_off_a_config_files_cfg_parallel(tmp_path):
    """--enable-cfg-parallel was on-only, so a --config file's `enable-cfg-parallel: true` could not be turned off for
    one run; --no-enable-cfg-parallel does, and a flag left out keeps the file's value."""
    from k6serve.cli.config_file import merged_options
    from k6serve.cli.flags import build_parser

    path = _config(tmp_path, "cfg.yaml", "enable-cfg-parallel: true\nnum-gpus: 2\n")
    parser = build_parser()
    for flags, expected in (([], True), (["--no-enable-cfg-parallel"], False), (["--enable-cfg-parallel"], True)):
        args = parser.parse_args(["generate", "--config", path, "--model-path", "demo", "--prompt", "x", *flags])
        assert merged_options(args, parser)["enable_cfg_parallel"] is expected
    usage = parser._subparsers._group_actions[0].choices["generate"].format_usage()
    assert "--use-fsdp-inference {true,false}" in usage and "--compile-vae {true,false}" in usage


@pytest.mark.parametrize("argv", [["--help"], ["generate", "--help"], ["serve", "--help"],
                                  ["generate", "--height", "tall"]])
def test_cli_help_and_flag_errors_do_not_import_torch(argv):
    """`import k6serve` used to import the runtime and torch (about 2 s) before argparse could answer --help or a
    typo; DiffGenerator is now imported on first use (k6serve/__init__.py)."""
    import subprocess
    import sys

    code = ("import sys\nfrom k6serve.cli.main import main\ntry:\n    main(sys.argv[1:])\nexcept SystemExit:\n    pass\n"
            "print('torch imported' if 'torch' in sys.modules else 'no torch')")
    result = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=120)
    assert result.stdout.strip().endswith("no torch"), (result.stdout[-500:], result.stderr[-500:])
    if argv[-1] == "tall":
        assert "--height: invalid int value: 'tall'" in result.stderr


def test_the_package_still_gives_diffgenerator():
    import k6serve
    from k6serve.api import DiffGenerator

    assert k6serve.DiffGenerator is DiffGenerator and "DiffGenerator" in k6serve.__all__
    with pytest.raises(AttributeError, match="module 'k6serve' has no attribute 'Generator'"):
        k6serve.Generator  # noqa: B018


def test_cli_version(capsys):
    from k6serve import __version__
    from k6serve.cli.main import main

    with pytest.raises(SystemExit) as exited:
        main(["--version"])
    assert exited.value.code == 0 and capsys.readouterr().out == f"k6serve {__version__}\n"


def test_python_dash_m_k6serve_runs_the_k6serve_command():
    # `python -m k6serve` failed with "No module named k6serve.__main__"; it is the console script's entry point.
    import subprocess

    result = subprocess.run([sys.executable, "-m", "k6serve", "--help"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-500:]
    assert result.stdout.startswith("usage: k6serve ")
    assert all(command in result.stdout for command in ("generate", "serve", "bench"))
    refused = subprocess.run([sys.executable, "-m", "k6serve", "generate", "--height", "tall"],
                             capture_output=True, text=True, timeout=120)
    assert refused.returncode == 2 and "--height: invalid int value: 'tall'" in refused.stderr


# Exit codes by signal name: SIGBUS is 7 on Linux, 10 on macOS (where 7 is SIGEMT).
KILL, BUS, SEGV, TERM = (-int(getattr(signal, name)) for name in ("SIGKILL", "SIGBUS", "SIGSEGV", "SIGTERM"))


@pytest.mark.parametrize(("codes", "start"), [
    ([KILL], " SIGKILL is usually the kernel's out-of-memory killer"),
    # A SIGBUS from a mapped file cut short under the worker (a LoRA file copied over in place did it) was called
    # "stopped from outside k6serve".
    ([BUS], " SIGBUS is a crash inside the process, not a stop from outside: a memory-mapped file changed or cut "
           "short under it"),
    ([0, SEGV, BUS], " SIGBUS and SIGSEGV are crashes inside the process, not a stop from outside: a memory-mapped "),
    ([SEGV], " SIGSEGV is a crash inside the process, not a stop from outside: a fault in a native library; see "),
    ([TERM], " It was stopped from outside k6serve."),
    ([1, 0], ""),
])
def test_a_signal_that_ended_a_rank_is_told_by_where_it_came_from(codes, start):
    from k6serve.runtime.out_of_memory import worker_killed_hint

    assert worker_killed_hint(codes).startswith(start) and bool(worker_killed_hint(codes)) == bool(start)


@pytest.mark.parametrize(("cuda", "fix"), [(True, "fewer GPUs per host"), (False, "fewer processes (--num-gpus)")])
def test_the_out_of_memory_killers_fix_names_what_the_host_has(monkeypatch, cuda, fix):
    from k6serve.runtime.out_of_memory import worker_killed_hint

    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    assert worker_killed_hint([KILL]).endswith(f"free host memory, or use {fix} or a smaller model.")


def test_cli_a_worker_killed_by_the_machine_is_exit_1_not_a_bug(monkeypatch, capsys, tmp_path):
    """A rank SIGKILLed by the out-of-memory killer (a dummy Pro model on a small host) was "internal error ...
    this is a bug in k6serve" with exit 70; it is the machine failing the run: exit 1 and the likely cause."""
    import k6serve.cli.generate as generate_module
    from k6serve.runtime.out_of_memory import WorkerKilled, worker_killed_hint

    def killed(model_path, **options):
        raise WorkerKilled("worker start-up failed: rank 0 (pid 7) exited with code -9 (killed by SIGKILL) (see its "
                           "log above)." + worker_killed_hint([-9]))

    monkeypatch.setattr(generate_module.DiffGenerator, "from_cli_options", staticmethod(killed))
    assert main(["generate", "--model-path", "demo", "--prompt", "x", "--output-path", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert "internal error" not in err and "Traceback" not in err
    assert re.search(r"^error: worker start-up failed: .*killed by SIGKILL.*out-of-memory killer", err, re.M), err


def test_generate_refuses_a_lora_merge_mode_without_an_adapter(capsys, tmp_path):
    # It was accepted and did nothing: a one-shot generate loads no adapter but --lora-path's.
    assert main(["generate", "--model-path", "demo", "--prompt", "x", "--lora-merge-mode", "dynamic",
                 "--output-path", str(tmp_path)]) == 2
    assert capsys.readouterr().err.strip() == (
        "error: --lora-merge-mode says how the --lora-path adapter is applied, but no --lora-path was given and "
        "`k6serve generate` loads no other adapter; add --lora-path, or drop --lora-merge-mode.")
    assert list(tmp_path.iterdir()) == []


def test_generate_warms_up_with_its_own_request_under_warmup_mode_server(in_process_cli, tmp_path, caplog):
    # It warmed up with the variant's default shape (512x768x121) at start, then ran the request's own shape:
    # minutes of wasted compile for a one-shot run (an audit's CPU run of it had not ended after 120 s).
    with caplog.at_level("INFO"):
        assert main([*in_process_cli, "--warmup-mode", "server", "--output-path", str(tmp_path)]) == 0
    assert "--warmup-mode server warms up with this request's own shape" in caplog.text
    assert "warm-up (request) took" in caplog.text and "warm-up (server)" not in caplog.text


def test_every_choice_flag_says_its_default():
    """docs/cli.md's flag reference is the help: --performance-mode, --attention-backend (whose `auto` was not
    explained), --warmup-mode, --compile-vae, --load-format, --dtype, --device, --lora-merge-mode and
    --use-fsdp-inference did not say which value a run takes when the flag is left out."""
    import dataclasses

    from k6serve.cli.flags import ENGINE_FLAGS
    from k6serve.config import ModelConfig, ParallelConfig, RuntimeConfig

    defaults = {field.name: field.default for config in (ModelConfig, ParallelConfig, RuntimeConfig)
                for field in dataclasses.fields(config)}
    unsaid = []
    for name, spec in ENGINE_FLAGS:
        default = defaults.get(name)
        if default is None or not ("choices" in spec or spec.get("metavar") == "{true,false}"):
            continue
        value = re.escape(str(default).lower())
        said = rf"\b{value} \(default|\b{value}, the default|\bdefault:? {value}\b|\b{value} \(the default\)"
        if not re.search(said, " ".join(spec["help"].split())):
            unsaid.append(f"--{name.replace('_', '-')} (default {default})")
    assert unsaid == []


def test_config_key_of_a_no_flag_says_how_to_write_it(tmp_path, capsys):
    # docs/cli.md: --config keys are flag names; `no-save-output: true` was refused as an unknown key, no fix given.
    config = tmp_path / "run.json"
    config.write_text('{"model-path": "demo", "prompt": "x", "no-save-output": true}')
    assert main(["generate", "--config", str(config)]) == 2
    assert ("unknown key(s) ['no_save_output']; --no-save-output is written as save-output: false"
            in capsys.readouterr().err)


@pytest.mark.parametrize(("flag", "value", "message"), [
    # --loras was shown --cache-dit-params' example.
    ("--loras", "style:0.8", "argument --loras: expected a JSON object, e.g. '{\"style\": 0.8}' (Expecting value: "),
    ("--cache-dit-params", "[1]",
     "argument --cache-dit-params: expected a JSON object, e.g. '{\"scm_preset\": \"medium\"}', got '[1]'"),
])
def test_a_json_object_flag_shows_its_own_example(flag, value, message, capsys):
    with pytest.raises(SystemExit) as exited:
        main(["generate", "--model-path", "demo", "--prompt", "x", flag, value])
    assert exited.value.code == 2 and message in capsys.readouterr().err


def test_above_info_the_libraries_progress_bars_are_off(monkeypatch, capsys):
    """transformers' "Loading weights" bars (two per rank at every start) printed even at --log-level warning; the
    hub's switch is set for this process and the ranks it starts, unless the user set it."""
    import os

    environ = {key: value for key, value in os.environ.items() if key != "HF_HUB_DISABLE_PROGRESS_BARS"}
    monkeypatch.setattr(os, "environ", environ)
    assert main(["generate", "--log-level", "warning", "--model-path", "demo", "--prompt", "x", "--height", "30"]) == 2
    assert environ["HF_HUB_DISABLE_PROGRESS_BARS"] == "1"
    environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "0"  # the user's own choice stays
    assert main(["generate", "--log-level", "error", "--model-path", "demo", "--prompt", "x", "--height", "30"]) == 2
    assert environ["HF_HUB_DISABLE_PROGRESS_BARS"] == "0"


@pytest.mark.parametrize("terminal", [True, False])
def test_at_info_the_libraries_progress_bars_are_off_when_stderr_is_no_terminal(monkeypatch, capsys, caplog,
                                                                                terminal):
    # A service's journal or a container's log collector got each bar redraw of "Loading weights" as a line.
    import os

    import k6serve.cli.main as cli_main

    environ = {key: value for key, value in os.environ.items() if key != "HF_HUB_DISABLE_PROGRESS_BARS"}
    monkeypatch.setattr(os, "environ", environ)
    monkeypatch.setattr(cli_main, "is_terminal", lambda stream: terminal)
    caplog.set_level("INFO")  # the root level --log-level info sets (pytest's handlers make basicConfig a no-op)
    assert main(["generate", "--log-level", "info", "--model-path", "demo", "--prompt", "x", "--height", "30"]) == 2
    assert environ.get("HF_HUB_DISABLE_PROGRESS_BARS") == (None if terminal else "1")


def test_a_stream_without_a_terminal_is_told_as_none():
    import io

    from k6serve.step_bar import is_terminal as _is_terminal

    closed = io.StringIO()
    closed.close()
    assert not _is_terminal(io.StringIO()) and not _is_terminal(closed) and not _is_terminal(object())


def test_no_writable_temporary_folder_is_told_with_the_fix(tmp_path, capsys, monkeypatch):
    # A container with a read-only root and no /tmp: every rank failed as it imported torch (its compiler's cache
    # folder), told as "internal error ... this is a bug in k6serve", exit 70.
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", None)
    monkeypatch.setattr(tempfile, "_candidate_tempdir_list", lambda: [str(tmp_path / "missing")])
    assert main(["generate", "--model-path", "demo", "--prompt", "x", "--output-path", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "there is no writable temporary folder (No usable temporary directory found in" in err
    assert "Set TMPDIR to a writable folder (in a container, mount one at /tmp)" in err
    assert "TORCHINDUCTOR_CACHE_DIR" in err and "bug" not in err


@pytest.mark.parametrize(("error", "host"), [
    (RuntimeError("[enforce fail at alloc_cpu.cpp:117] data. DefaultCPUAllocator: can't allocate memory: you tried "
                  "to allocate 3221225472 bytes. Error code 12 (Cannot allocate memory)"), True),
    (MemoryError(), True),
    (OSError(12, "Cannot allocate memory"), True),
    (RuntimeError("request 1 failed on replica 0: rank 0: MemoryError: \nTraceback ..."), True),
    (torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 9.00 GiB."), False),
    (RuntimeError("rank 0: OutOfMemoryError: CUDA out of memory. Tried to allocate 9.00 GiB."), False),
])
def test_the_hosts_memory_running_out_is_told_as_such_not_as_a_bug(error, host):
    # It was "internal error (...); this is a bug in k6serve" (exit 70), and the GPU's flags were offered for it.
    from k6serve.cli.main import describe_out_of_memory
    from k6serve.runtime.out_of_memory import is_host_out_of_memory, is_out_of_memory

    assert is_out_of_memory(error) and is_host_out_of_memory(error) is host
    message = describe_out_of_memory(error, {})
    if host:
        assert message.startswith("the host ran out of memory (")
        assert message.endswith("; ask for fewer pixels or frames (--height, --width, --num-frames), free host "
                                "memory (other processes, a lower --dp-size), or run on a machine with more.")
        assert "--performance-mode" not in message
    else:
        assert message.startswith("the GPU ran out of memory (CUDA out of memory. Tried to allocate 9.00 GiB.)")


def test_cli_empty_model_path_is_refused_as_missing_not_read_as_the_working_folder(tmp_path, monkeypatch, capsys):
    # `--model-path "$MODEL"` with MODEL unset: Path("") is ".", whose broken JSON was called a damaged checkpoint.
    (tmp_path / "notes.json").write_text("{not json")
    monkeypatch.chdir(tmp_path)
    assert main(["generate", "--model-path", "", "--prompt", "x", "--output-path", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "error: --model-path is required" in err and "damaged" not in err


@pytest.mark.parametrize("text", ["", "# model-path: demo\n# seed: 7\n"])
def test_cli_empty_or_all_commented_yaml_config_sets_nothing(tmp_path, capsys, text):
    # It was refused as "must hold a mapping of flag names to values"; the flags typed apply as without it.
    config = tmp_path / "run.yaml"
    config.write_text(text)
    assert main(["generate", "--config", str(config), "--model-path", "demo", "--prompt", "x", "--height", "30"]) == 2
    err = capsys.readouterr().err
    assert "error: --height must be a positive multiple of 16" in err and "mapping" not in err


@pytest.mark.parametrize(("flags", "message"), [
    (["--prompt", "a cat", "--prompt", "a dog"],
     "argument --prompt: given twice ('a cat', then 'a dog'); a run takes one: for several prompts, write them one a "
     "line in a file and pass --prompt-file-path FILE."),
    (["--image-path", "a.png", "--image-path", "b.png"],
     "argument --image-path: given twice ('a.png', then 'b.png'); a run takes one: pass it once."),
])
def test_an_input_given_twice_is_refused_not_dropped(capsys, flags, message):
    # argparse keeps the last: the first prompt was dropped without a word (one video, of the dog).
    with pytest.raises(SystemExit) as raised:
        main(["generate", "--model-path", "demo", *flags])
    assert raised.value.code == 2 and capsys.readouterr().err.rstrip().endswith(f"error: {message}")


def test_the_same_input_twice_and_a_config_files_prompt_under_the_flag_are_fine(tmp_path):
    from k6serve.cli.config_file import merged_options
    from k6serve.cli.flags import build_parser

    parser = build_parser()
    args = parser.parse_args(["generate", "--model-path", "demo", "--prompt", "a cat", "--prompt", "a cat"])
    assert args.prompt == "a cat"
    config = tmp_path / "run.yaml"
    config.write_text("prompt: from the file\n")
    args = parser.parse_args(["generate", "--config", str(config), "--model-path", "demo", "--prompt", "a dog"])
    assert merged_options(args, parser)["prompt"] == "a dog"  # the command line wins, as for every flag


def test_expand_prompts_under_a_streamed_text_encoder_is_refused_before_the_load(monkeypatch):
    # The worker refuses it (each generated token would copy the whole streamed encoder from host memory), but
    # `k6serve generate --expand-prompts --performance-mode memory` on a GPU said so only after the model had loaded.
    import torch

    from k6serve.cli.preflight import check_request_before_loading
    from k6serve.request import SamplingParams

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # streaming is CUDA's alone
    params = SamplingParams(prompt="a cat", expand_prompts=True)
    for engine in ({"performance_mode": "memory"}, {"layerwise_offload_components": ("text_encoder",)}):
        with pytest.raises(ValueError, match=r"^--expand-prompts runs the text encoder once per generated token .*"
                                             r"--component-residency text_encoder=component_offload"):
            check_request_before_loading({"model_path": "demo", **engine}, params)
    check_request_before_loading({"model_path": "demo", "performance_mode": "balanced"}, params)  # offloaded whole
    check_request_before_loading({"model_path": "demo", "performance_mode": "memory", "device": "cpu"}, params)
