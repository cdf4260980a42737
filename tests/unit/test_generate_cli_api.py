"""`k6serve generate` and `DiffGenerator` end to end on the tiny distilled checkpoint (CPU).

Sizes: the CLI and API take --height/--width (height first in the request, e.g. 64 x 96 here).
"""

import json
import math
import pickle
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from k6serve import DiffGenerator
from k6serve.cli.flags import build_parser
from k6serve.cli.main import main
from k6serve.media.probe import probe
from k6serve.media.video import read_video
from k6serve.request import FlagWordedNote, note_for_cli

HEIGHT, WIDTH, FRAMES, FPS = 64, 96, 17, 24


def _expected_samples(num_frames: int, fps: float) -> int:
    latent_frames = (num_frames - 1) // 4 + 1
    return math.ceil(((latent_frames - 1) * 4 + 1) / fps * 44100 / 1024) * 1024


@pytest.fixture(scope="module")
def generator(tiny_distill_dir):
    # The seed's Python example with only the model path and the attention backend changed.
    with DiffGenerator.from_pretrained(model_path=str(tiny_distill_dir), num_gpus=1, performance_mode="speed",
                                       attention_backend="sdpa", warmup_mode="off") as gen:
        yield gen


def test_seed_python_example_returns_file_frames_and_audio(generator, tmp_path):
    result = generator.generate(sampling_params_kwargs={
        "prompt": "A woman chops vegetables in a sunlit kitchen, with soft jazz playing.",
        "seed": 42,
        "height": HEIGHT, "width": WIDTH, "num_frames": FRAMES,
        "save_output": True,
        "output_path": str(tmp_path / "kandinsky6_samples"),
        "return_file_paths_only": False,
        "return_frames": True,
    })
    assert result.output_file_path and result.output_file_path.endswith(".mp4")
    assert result.frames.shape == (FRAMES, HEIGHT, WIDTH, 3) and result.frames.dtype == np.uint8
    # The waveform before muxing has exactly the reference length: L_a * 1024 samples.
    assert result.audio.dtype == np.float32 and result.audio.shape == (_expected_samples(FRAMES, FPS),)
    assert result.audio_sample_rate == 44100 and result.fps == FPS
    info = probe(result.output_file_path)
    assert (info.width, info.height, info.num_frames, info.fps) == (WIDTH, HEIGHT, FRAMES, FPS)
    assert info.video_codec == "h264"
    assert (info.audio_codec, info.audio_channels, info.audio_sample_rate) == ("aac", 1, 44100)
    assert abs(info.audio_num_samples - result.audio.shape[0]) < 1024
    decoded = read_video(result.output_file_path)
    # Lossy H.264 (yuv420 halves chroma, and random weights make noise-like frames): the decoded file still
    # follows the returned frames closely.
    correlation = np.corrcoef(decoded.frames.ravel().astype(float), result.frames.ravel().astype(float))[0, 1]
    assert decoded.frames.shape == result.frames.shape and correlation > 0.9
    assert set(result.timings) >= {"encode", "denoise", "denoise_per_step", "decode_video", "decode_audio", "mux",
                                   "total"}
    assert result.peak_memory_mb > 0


def test_same_seed_is_bit_identical_and_other_seed_differs(generator, tmp_path):
    kwargs = {"prompt": "a lighthouse at night", "height": HEIGHT, "width": WIDTH, "num_frames": 9,
              "return_frames": True, "output_path": str(tmp_path)}
    first = generator.generate({**kwargs, "seed": 5, "output_file_name": "a.mp4"})
    second = generator.generate({**kwargs, "seed": 5, "output_file_name": "b.mp4"})
    other = generator.generate({**kwargs, "seed": 6, "save_output": False})
    assert np.array_equal(first.frames, second.frames) and np.array_equal(first.audio, second.audio)
    assert (tmp_path / "a.mp4").read_bytes() == (tmp_path / "b.mp4").read_bytes()
    assert not np.array_equal(first.frames, other.frames) and other.output_file_path is None


def test_bad_inputs_fail_with_their_message_and_the_generator_keeps_serving(generator, tmp_path):
    with pytest.raises(ValueError, match="requires guidance_scale exactly 1.0") as refused:
        generator.generate({"prompt": "x", "guidance_scale": 5.0})
    # A Python caller passes the keyword: the CLI's --guidance-scale is not named.
    assert str(refused.value).endswith("(got 5.0); leave guidance_scale out, or use a Pro/Lite checkpoint for CFG.")
    with pytest.raises(ValueError, match="multiple of 16"):
        generator.generate({"prompt": "x", "height": 50})
    with pytest.raises(ValueError, match="Unknown sampling parameter"):
        generator.generate({"prompt": "x", "sead": 1})
    with pytest.raises(ValueError, match="not found|No such file|cannot"):
        generator.generate({"prompt": "x", "height": HEIGHT, "width": WIDTH, "num_frames": 9,
                            "image_path": str(tmp_path / "missing.png")})
    ok = generator.generate({"prompt": "still alive", "height": HEIGHT, "width": WIDTH, "num_frames": 9,
                             "save_output": False})
    # Without a file the frames are the result: returned without return_frames (they were dropped).
    assert ok.frames.shape[0] == 9 and ok.audio is not None and ok.output_file_path is None


# 10 tokens of the tiny Qwen tokenizer per sentence: 1100 tokens, 76 over the encoder's 1024.
LONG_PROMPT = "A cat plays piano. " * 110
TRUNCATED = ("prompt was truncated: the text encoder (Qwen2.5-VL) kept its first 1024 of 1100 tokens; the rest does "
             "not reach the model. Shorten it to use all of it.")


def test_a_truncated_prompt_is_a_note_of_the_result(generator):
    # A 108k-character prompt completed with no word that most of it never reached the model.
    kwargs = {"height": HEIGHT, "width": WIDTH, "num_frames": 5, "save_output": False}
    assert TRUNCATED in generator.generate({**kwargs, "prompt": LONG_PROMPT}).notes
    exact = generator.generate({**kwargs, "prompt": "A cat plays piano. " * 102 + "A cat plays"})  # 1023 tokens
    assert not any("truncated" in note for note in exact.notes)


def test_a_truncated_negative_prompt_is_noted_only_when_cfg_encodes_it():
    from types import SimpleNamespace

    from k6serve.pipelines.text_to_video import TextToVideoPipeline
    from k6serve.request import GenerateRequest
    from k6serve.testing.tokenizers import train_qwen_tokenizer

    pipeline = TextToVideoPipeline(SimpleNamespace(tokenizer=train_qwen_tokenizer()))
    request = dict(prompt="short", image_path=None, seed=1, height=64, width=64, num_frames=5, fps=24.0,
                   num_inference_steps=2)
    with_cfg = GenerateRequest(**request, negative_prompt=LONG_PROMPT, guidance_scale=5.0)
    assert pipeline.truncation_notes(with_cfg) == [TRUNCATED.replace("prompt was", "negative_prompt was")]
    both = GenerateRequest(**{**request, "prompt": LONG_PROMPT}, negative_prompt=LONG_PROMPT, guidance_scale=5.0)
    assert [note.split(" ")[0] for note in pipeline.truncation_notes(both)] == ["prompt", "negative_prompt"]
    without_cfg = GenerateRequest(**request, negative_prompt=None, guidance_scale=1.0)
    assert pipeline.truncation_notes(without_cfg) == []


def test_a_prompt_cut_at_a_lowered_max_sequence_length_is_told_to_raise_it():
    # "Shorten it to use all of it." was the only fix offered, also when max_sequence_length, not the prompt, cut it.
    from types import SimpleNamespace

    from k6serve.pipelines.text_to_video import TextToVideoPipeline
    from k6serve.request import GenerateRequest
    from k6serve.testing.tokenizers import train_qwen_tokenizer

    pipeline = TextToVideoPipeline(SimpleNamespace(tokenizer=train_qwen_tokenizer()))
    request = dict(negative_prompt=None, image_path=None, seed=1, height=64, width=64, num_frames=5, fps=24.0,
                   num_inference_steps=2, guidance_scale=1.0)
    (note,) = pipeline.truncation_notes(GenerateRequest(prompt="A cat plays piano. " * 3, max_sequence_length=16,
                                                        **request))
    assert note == ("prompt was truncated: the text encoder (Qwen2.5-VL) kept its first 16 of 30 tokens; the rest "
                    "does not reach the model. Raise max_sequence_length to 30, or shorten it, to use all of it.")
    assert note_for_cli(note).endswith("Raise --max-sequence-length to 30, or shorten it, to use all of it.")
    (note,) = pipeline.truncation_notes(GenerateRequest(prompt=LONG_PROMPT, max_sequence_length=64, **request))
    assert note.endswith("kept its first 64 of 1100 tokens; the rest does not reach the model. Shorten it, and "
                         "raise max_sequence_length to 1024 (its most), to use all of it.")


def test_cli_prints_the_notes_naming_its_flags(tiny_distill_dir, tmp_path, capsys, in_process_worker):
    # The notes named the API's fields (`num_frames 6 is not of the form 4k+1`, `seed -1 drew ...`) to a CLI user,
    # who typed --num-frames; the refusals had been worded in flags already (FlagWorded).
    assert main(["generate", "--model-path", str(tiny_distill_dir), "--prompt", LONG_PROMPT, "--height", "32",
                 "--width", "32", "--num-frames", "6", "--seed", "-1", "--output-path", str(tmp_path),
                 "--json"]) == 0
    captured = capsys.readouterr()
    record = json.loads(captured.out.strip().splitlines()[-1])
    seed = record["seed"]
    notes = [f"--seed -1 drew seed {seed}: pass --seed {seed} to make this video again.",
             "--num-frames 6 is not of the form 4k+1; using 5 (n // 4 * 4 + 1, as the reference).",
             TRUNCATED]  # "prompt", which a --prompt-file-path's line is too
    assert all(note in record["notes"] for note in notes), record["notes"]
    assert all(f"note: {note}" in captured.err for note in notes), captured.err
    assert "num_frames 6" not in captured.err.replace("--num-frames 6", "")


def test_the_api_and_the_server_read_the_same_notes_in_field_names(generator):
    result = generator.generate({"prompt": LONG_PROMPT, "height": HEIGHT, "width": WIDTH, "num_frames": 6,
                                 "save_output": False})
    assert TRUNCATED in result.notes
    assert "num_frames 6 is not of the form 4k+1; using 5 (n // 4 * 4 + 1, as the reference)." in result.notes
    assert all("--" not in note for note in result.notes)


def test_a_flag_worded_note_keeps_both_wordings_through_pickle_and_json():
    # Results cross the ranks' process boundary pickled; the server stores them as JSON.
    note = FlagWordedNote.naming(lambda name: f"{name('sample_audio', False)} and {name('num_frames')}")
    again = pickle.loads(pickle.dumps(note))
    assert (again, note_for_cli(again)) == ("sample_audio and num_frames", "--no-sample-audio and --num-frames")
    assert json.loads(json.dumps({"notes": [again]})) == {"notes": ["sample_audio and num_frames"]}
    assert note_for_cli("a plain note") == "a plain note"


def test_cli_writes_mp4_with_config_file_and_cli_override(tiny_distill_dir, tmp_path, capsys, in_process_worker):
    config = tmp_path / "run.yaml"
    config.write_text(f"model-path: {tiny_distill_dir}\nprompt: from the file\nseed: 3\nheight: 32\n"
                      f"width: {WIDTH}\nnum-frames: 9\n")
    code = main(["generate", "--config", str(config), "--height", str(HEIGHT), "--save-output",
                 "--output-path", str(tmp_path / "out"), "--output-file-name", "clip"])
    assert code == 0
    out = capsys.readouterr().out
    assert "denoise per step" in out and "peak memory" in out
    # A count, not printed as seconds (0 on the CPU; on a GPU host this run compiles its blocks).
    assert re.search(r"^graphs compiled +\d+$", out, re.MULTILINE)
    info = probe(tmp_path / "out" / "clip.mp4")
    assert (info.height, info.width, info.num_frames) == (HEIGHT, WIDTH, 9)  # the CLI's --height won
    assert info.has_audio


def test_cli_default_name_from_prompt_seed_and_time(tiny_distill_dir, tmp_path, in_process_worker):
    assert main(["generate", "--model-path", str(tiny_distill_dir), "--prompt", "Red fox, snow!", "--seed", "9",
                 "--height", "32", "--width", "32", "--num-frames", "5", "--output-path", str(tmp_path)]) == 0
    names = [p.name for p in tmp_path.iterdir()]
    assert len(names) == 1 and re.fullmatch(r"Red_fox_snow_seed9_\d{8}-\d{6}\.mp4", names[0])


def test_cli_errors_exit_2_with_the_fix(tiny_distill_dir, capsys, tmp_path):
    assert main(["generate", "--model-path", str(tiny_distill_dir), "--prompt", "x",
                 "--guidance-scale", "5", "--output-path", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "requires guidance_scale exactly 1.0 (got 5.0); leave --guidance-scale out, or use a Pro/Lite" in err
    assert main(["generate", "--prompt", "x"]) == 2
    assert "--model-path is required" in capsys.readouterr().err
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"promt": "typo"}))
    assert main(["generate", "--config", str(bad), "--model-path", str(tiny_distill_dir)]) == 2
    assert "unknown key(s) ['promt']" in capsys.readouterr().err


def test_help_lists_every_flag_with_a_description():
    parser = build_parser()
    generate = parser._subparsers._group_actions[0].choices["generate"]
    flags = {opt for action in generate._actions for opt in action.option_strings}
    for flag in ["--model-path", "--prompt", "--negative-prompt", "--image-path", "--seed", "--height", "--width",
                 "--num-frames", "--fps", "--num-inference-steps", "--guidance-scale", "--save-output",
                 "--output-path", "--output-file-name", "--performance-mode", "--attention-backend", "--warmup-mode",
                 "--model-id", "--load-format", "--config", "--video-path", "--sr-resolution-scale",
                 "--sr-tiles-batch-size", "--sr-tile-min-overlap", "--sr-target-resolution",
                 "--sr-target-resize-mode", "--num-gpus", "--ulysses-degree", "--ring-degree", "--tp-size",
                 "--enable-cfg-parallel", "--use-fsdp-inference", "--encoder-parallel", "--dp-size"]:
        assert flag in flags, flag
    for action in generate._actions:
        if action.option_strings and action.dest != "help":
            assert action.help, action.option_strings
    text = subprocess.run([sys.executable, "-m", "k6serve.cli.main", "--help"], capture_output=True, text=True)
    assert text.returncode == 0 and "generate" in text.stdout and "serve" in text.stdout


def test_demo_checkpoint_main_job(demo_dir, tmp_path, capfd):
    """The README's main job: offline, built-in demo weights, writes an MP4 with audio."""
    assert main(["generate", "--model-path", "demo", "--prompt", "A woman chops vegetables", "--seed", "42",
                 "--save-output", "--output-path", str(tmp_path)]) == 0
    # The worker logs from its own process, so read the file descriptor. Said once (the worker's warning, shared by
    # the CLI, the API and the server), and it says what to do.
    err = capfd.readouterr().err
    assert err.count("weights are random") == 1 and "real Kandinsky 6 checkpoint" in err
    (path,) = tmp_path.iterdir()
    info = probe(path)
    assert (info.width, info.height, info.num_frames, info.has_audio) == (96, 64, 17, True)


def test_cli_reference_lists_every_flag():
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "docs" / "cli.md").read_text()
    from k6serve.bench.flags import build_parser as build_bench_parser

    parser = build_parser()
    for command in ("generate", "serve", "bench"):
        sub = build_bench_parser() if command == "bench" else parser._subparsers._group_actions[0].choices[command]
        for action in sub._actions:
            for flag in action.option_strings:
                if flag.startswith("--") and flag != "--help":
                    assert flag in text, f"docs/cli.md does not document {command} {flag}"


def test_warmup_mode_request_is_reported_once(tiny_distill_dir):
    from k6serve.engine_arguments import build_engine_config
    from k6serve.request_arguments import split_kwargs
    from k6serve.runtime.worker import ModelWorker

    worker = ModelWorker(build_engine_config(str(tiny_distill_dir), device="cpu", warmup_mode="request"))
    params, output = split_kwargs({"prompt": "x", "height": 32, "width": 32, "num_frames": 5, "save_output": False})
    first = worker.run(params, output)
    second = worker.run(params, output)
    assert first.timings["warmup"] > 0 and "warmup" not in second.timings
    assert worker.performance_report.mode == "speed"  # on CPU the speed transforms are a no-op


def test_non_leader_hosts_only_serve_worker_ranks(monkeypatch):
    import k6serve.runtime.rank_process as rank_process

    served = []
    monkeypatch.setattr(rank_process, "serve_worker_ranks", lambda config: served.append(config))
    assert main(["generate", "--model-path", "demo", "--prompt", "x", "--num-gpus", "2", "--ulysses-degree", "2",
                 "--nnodes", "2", "--node-rank", "1", "--dist-init-addr", "10.0.0.1:29500"]) == 0
    (config,) = served
    assert (config.parallel.node_rank, config.parallel.nnodes, config.parallel.dist_init_addr) == (1, 2, "10.0.0.1:29500")
    monkeypatch.setenv("RANK", "1")
    assert main(["serve", "--model-path", "demo", "--num-gpus", "2", "--ulysses-degree", "2"]) == 0
    assert len(served) == 2


SEED_SCRIPT = """
from k6serve import DiffGenerator

generator = DiffGenerator.from_pretrained(
    model_path={model_path!r},
    num_gpus=1,
    performance_mode="speed",
    attention_backend="sdpa",
    warmup_mode="off",
)
try:
    result = generator.generate(sampling_params_kwargs={{
        "prompt": "A woman chops vegetables in a sunlit kitchen, with soft jazz playing.",
        "seed": 42,
        "height": 32, "width": 32, "num_frames": 5,
        "save_output": True,
        "output_path": "kandinsky6_samples",
        "return_file_paths_only": False,
        "return_frames": True,
    }})
    print(result.output_file_path)
finally:
    generator.shutdown()
"""


def test_seed_example_runs_as_a_script_without_a_main_guard(tiny_distill_dir, tmp_path):
    """The seed's example has no `if __name__ == "__main__"`: spawned workers must not re-run it."""
    script = tmp_path / "seed_example.py"
    script.write_text(SEED_SCRIPT.format(model_path=str(tiny_distill_dir)))
    done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    path = tmp_path / done.stdout.strip().splitlines()[-1]
    assert path.is_file() and probe(path).num_frames == 5


def test_latents_that_overflow_are_refused_before_the_decode(tiny_pro_dir, tmp_path):
    # guidance_scale 1e30 made the latents NaN: the frames were decoded black and the MP4 writer refused the NaN
    # soundtrack with "fix the waveform before muxing", after the whole decode.
    from k6serve.engine_arguments import build_engine_config
    from k6serve.request_arguments import split_kwargs
    from k6serve.runtime.worker import ModelWorker

    worker = ModelWorker(build_engine_config(str(tiny_pro_dir), device="cpu", attention_backend="sdpa"))
    request = {"prompt": "x", "height": 32, "width": 32, "num_frames": 5, "num_inference_steps": 2,
               "output_path": str(tmp_path)}
    with pytest.raises(ValueError, match=r"^the denoised latents hold NaN or infinite values, so no video or audio "
                                         r"can be decoded from them; guidance_scale 1e\+30 overflowed the latents: "
                                         r"use a usual scale \(Pro/Lite: 5\)\.$"):
        worker.run(*split_kwargs({**request, "guidance_scale": 1e30}))
    assert list(tmp_path.iterdir()) == []
    result = worker.run(*split_kwargs({**request, "guidance_scale": 1e15, "save_output": False, "return_frames": True}))
    assert np.isfinite(result.audio).all() and result.frames.shape == (5, 32, 32, 3)


def test_cli_no_save_output_does_not_ship_the_frames_back(capsys):
    """The API returns the frames of a request without a file; the CLI only prints timings, so it asks for none
    (for an upscale they are gigabytes pickled from the worker)."""
    from k6serve.cli.preflight import checked_output_options
    from k6serve.request_arguments import split_kwargs

    options = checked_output_options({"prompt": "x", "save_output": False})
    assert options["return_frames"] is False and split_kwargs(options)[1].return_frames is False
    assert "return_frames" not in checked_output_options({"prompt": "x", "output_file_name": None})


def test_the_timing_table_keeps_its_columns_and_prints_counts_whole():
    # "cache dit cached calls" (22 characters) pushed its value two columns right, printed as "8.000" seconds.
    from types import SimpleNamespace

    from k6serve.cli.result_output import format_timings

    result = SimpleNamespace(timings={"encode": 0.5, "denoise": 2.0, "total": 3.0, "graphs_compiled": 2.0,
                                      "cache_dit_cached_calls": 8.0}, peak_memory_mb=12.5)
    lines = format_timings(result).splitlines()
    assert "cache dit cached calls          8" in lines and "graphs compiled                 2" in lines
    ends = {len(line) for line in lines if not line.startswith("-")}
    assert ends == {len(lines[0])}, lines


@pytest.mark.parametrize("progress_bar", [False, True])
def test_on_progress_counts_from_step_one_while_the_rewrite_reports_step_0(generator, progress_bar):
    # The engine reports step 0 every 16 tokens of the prompt's rewrite (a cancellation point); the API's contract is
    # steps from 1 (an ETA callback divided by the step: ZeroDivisionError failed the request).
    calls = []
    start = time.monotonic()

    def eta(step: int, total: int) -> None:
        calls.append((step, total))
        (time.monotonic() - start) / step * (total - step)

    result = generator.generate({"prompt": "a fox", "expand_prompts": True, "num_inference_steps": 2,
                                 "max_sequence_length": 64, "height": HEIGHT, "width": WIDTH, "num_frames": FRAMES,
                                 "save_output": False}, on_progress=eta, progress_bar=progress_bar)
    assert result.expanded_prompt and calls[0] == (1, 2) and min(step for step, _ in calls) == 1


def test_a_list_of_prompts_is_one_request_each_in_order(generator, tmp_path):
    """The seed's `generate` takes a prompt list, one request per prompt; k6serve refused it ("prompt must be a
    string"), so code moved from it broke at its first call."""
    kwargs = {"height": 32, "width": 32, "num_frames": 5, "seed": 7, "output_path": str(tmp_path)}
    results = generator.generate({**kwargs, "prompt": ["A cat plays piano", "A dog runs"],
                                  "output_file_name": "my clip", "return_frames": True})
    assert [Path(result.output_file_path).name for result in results] == ["my_clip_1.mp4", "my_clip_2.mp4"]
    assert [(result.seed, result.prompt) for result in results] == [(7, "A cat plays piano"), (7, "A dog runs")]
    # The name's rewrite is said (once per result, each whole on its own), of the name given.
    assert all(any(note.startswith("output_file_name 'my clip' is written as 'my_clip.mp4'") for note in result.notes)
               for result in results)
    # The same video as the prompt alone: one request each, not a batch with its own noise.
    alone = generator.generate({**kwargs, "prompt": "A dog runs", "save_output": False})
    assert np.array_equal(results[1].frames, alone.frames) and not np.array_equal(results[0].frames, alone.frames)
    # A tuple, keywords, and the async twin alike; one prompt in a list is a list of one result.
    import asyncio

    awaited = asyncio.run(generator.agenerate(prompt=("A cat",), **{**kwargs, "save_output": False}))
    assert isinstance(awaited, list) and len(awaited) == 1 and awaited[0].frames.shape == (5, 32, 32, 3)


@pytest.mark.parametrize(("prompts", "message"), [
    ([], r"^prompt is an empty list: pass one prompt as a string, or a list of at least one\.$"),
    (["A cat", 3], r"^prompt 1 of the list \(3 \(int\)\): prompt must be a string"),
    (["A cat", " "], r"^prompt 1 of the list \(' '\): prompt is required"),
])
def test_a_bad_prompt_of_a_list_is_refused_before_any_runs(generator, tmp_path, prompts, message):
    with pytest.raises(ValueError, match=message):
        generator.generate(prompt=prompts, height=32, width=32, num_frames=5, output_path=str(tmp_path / "out"))
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


def _stops_at_the_second_prompt():
    """An on_progress that stops the request (Ctrl-C) at the first step of the second prompt of a list."""
    calls = []

    def second_fails(step, total):
        calls.append(step)
        if calls.count(1) == 2:
            raise KeyboardInterrupt

    return second_fails


def test_a_failing_prompt_stops_the_list_saying_what_finished(generator, tmp_path):
    with pytest.raises(KeyboardInterrupt) as raised:
        generator.generate(prompt=["A cat", "A dog", "A fox"], height=32, width=32, num_frames=5, seed=3,
                           output_path=str(tmp_path), on_progress=_stops_at_the_second_prompt())
    (saved,) = tmp_path.iterdir()
    assert raised.value.__notes__ == [
        f"prompt 1 of the list of 3 stopped it: prompt 0 had finished (saved: {saved}); to run the rest, pass the "
        "list from prompt 1 on (prompts[1:])."]


def test_a_pathlib_output_file_name_is_numbered_per_prompt_of_a_list(generator, tmp_path):
    # A Path is taken as the name for one prompt; for a list it was not numbered, so the second video was moved on
    # to clip_1.mp4 beside the first's clip.mp4, with a note, where a str gives clip_1.mp4 and clip_2.mp4.
    results = generator.generate(prompt=["A cat", "A dog"], output_file_name=Path("clip.mp4"), height=32, width=32,
                                 num_frames=5, output_path=tmp_path)
    assert [Path(result.output_file_path).name for result in results] == ["clip_1.mp4", "clip_2.mp4"]
    assert not any("created in the output folder" in note for result in results for note in result.notes)


def test_a_renamed_output_file_name_of_a_list_is_logged_once(generator, tmp_path, caplog):
    # One prompt's renamed name is logged as a warning; a list's was only put in the results' notes.
    with caplog.at_level("WARNING", logger="k6serve.api"):
        generator.generate(prompt=["A cat", "A dog"], output_file_name="my clip?", height=32, width=32, num_frames=5,
                           output_path=tmp_path)
    logged = [record.getMessage() for record in caplog.records if "is written as" in record.getMessage()]
    assert logged == ["output_file_name 'my clip?' is written as 'my_clip_.mp4': file names keep only letters and "
                      "digits (of any script), '.', '_' and '-' (others become '_'), and no leading dot."]


def test_a_bad_progress_bar_with_a_list_is_not_told_as_a_stopped_prompt(generator, tmp_path):
    # It was raised inside the first prompt's run, with a note that prompt 0 "stopped" the list.
    with pytest.raises(ValueError, match=r"^progress_bar must be True or False, got 'yes'\.$") as raised:
        generator.generate(prompt=["A cat", "A dog"], progress_bar="yes", height=32, width=32, num_frames=5,
                           output_path=str(tmp_path))
    assert not getattr(raised.value, "__notes__", None) and not any(tmp_path.iterdir())


def test_a_stopped_list_with_a_numbered_name_says_the_rerun_needs_another_name(generator, tmp_path):
    # The note advised prompts[1:] alone: its names start again at clip_1.mp4, which the first prompt's video holds,
    # so the rerun was refused as "already exists".
    with pytest.raises(KeyboardInterrupt) as raised:
        generator.generate(prompt=["A cat", "A dog"], output_file_name="clip", height=32, width=32, num_frames=5,
                           output_path=str(tmp_path), on_progress=_stops_at_the_second_prompt())
    assert raised.value.__notes__ == [
        f"prompt 1 of the list of 2 stopped it: prompt 0 had finished (saved: {tmp_path / 'clip_1.mp4'}); to run the "
        "rest, pass the list from prompt 1 on (prompts[1:]) with another output_file_name, as a list's names are "
        "numbered from 1 and clip_1.mp4 is taken."]


def test_a_warning_every_prompt_of_a_list_gets_is_logged_once(generator, tmp_path, caplog):
    # output_path with save_output=False was logged as ignored once per prompt: 100 lines for 100 prompts.
    with caplog.at_level("WARNING", logger="k6serve.api"):
        results = generator.generate(prompt=["A cat", "A dog", "A fox"], save_output=False, output_path=tmp_path,
                                     height=32, width=32, num_frames=5)
    logged = [record.getMessage() for record in caplog.records if "is ignored" in record.getMessage()]
    assert logged == [f"output_path={str(tmp_path)!r} is ignored: save_output=False writes no file."]
    assert all(result.notes == logged for result in results)  # each result still says it


def test_an_ignored_pathlib_output_path_is_named_as_the_path(generator, tmp_path):
    # save_output=False with output_path=Path(...) noted "output_path=PosixPath('...') is ignored".
    result = generator.generate(prompt="A cat", save_output=False, output_path=tmp_path, height=32, width=32,
                                num_frames=5)
    assert result.notes == [f"output_path={str(tmp_path)!r} is ignored: save_output=False writes no file."]
