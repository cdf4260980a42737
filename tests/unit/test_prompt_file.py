"""`k6serve generate --prompt-file-path`: one prompt per line, the model loaded once, every prompt's request checked
before the first runs, and a run stopped part way keeps what it saved and says which lines did not run (CPU, the
tiny distilled checkpoint in process)."""

from __future__ import annotations

import threading

import pytest

from k6serve import DiffGenerator
from k6serve.engine_arguments import build_engine_config
from k6serve.cli.prompt_file import read_prompt_file
from k6serve.media.output_names import numbered_file_names
from k6serve.cli.main import main
from k6serve.media.probe import probe
from k6serve.runtime.engine import Engine
from k6serve.runtime.worker import ModelWorker


def test_prompt_file_lines_are_stripped_and_blank_ones_skipped(tmp_path):
    path = tmp_path / "prompts.txt"
    path.write_bytes("\ufeffA cat plays piano\n\n   \n  A dog runs\t\r\n# a hash begins this prompt\n".encode())
    assert read_prompt_file(str(path)) == [(1, "A cat plays piano"), (4, "A dog runs"),
                                           (5, "# a hash begins this prompt")]


def test_prompt_file_lines_that_show_as_blank_are_skipped_and_every_bom_dropped(tmp_path):
    # Files joined with `cat` keep each one's byte-order mark at the start of a line: a line of a BOM alone ran as a
    # prompt, and the others kept it in their text; a line of zero-width spaces shows as blank too.
    path = tmp_path / "prompts.txt"
    path.write_bytes("\ufefffirst\r\n\ufeffsecond\r\n\ufeff\r\n\u200b \u200b\n\u200bthird\n".encode())
    assert read_prompt_file(str(path)) == [(1, "first"), (2, "second"), (5, "\u200bthird")]
    path.write_bytes("\ufeff\n\u200b\n".encode())
    with pytest.raises(ValueError, match="holds no prompt"):
        read_prompt_file(str(path))


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (None, "does not exist; pass a text file with one prompt per line"),
        ("folder", "is a folder; pass a text file"),
        (b"\n \n", "holds no prompt; write one prompt per line"),
        (b"fine\n\xff\xfe bad\n", "line 2 is not UTF-8 text (invalid start byte at byte 1); save the file as UTF-8"),
    ],
)
def test_unreadable_prompt_files_say_how_to_fix_them(tmp_path, content, message):
    path = tmp_path / "prompts.txt"
    if content == "folder":
        path.mkdir()
    elif content is not None:
        path.write_bytes(content)
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        read_prompt_file(str(path))


def test_a_given_output_name_is_numbered_per_prompt():
    assert numbered_file_names("clip.mp4", 1) == ["clip.mp4"]
    assert numbered_file_names("clip", 3) == ["clip_1.mp4", "clip_2.mp4", "clip_3.mp4"]
    assert numbered_file_names("clip.MP4", 10)[0] == "clip_01.mp4"  # sorted by name = the file's order
    assert numbered_file_names("clip", 10)[-1] == "clip_10.mp4"


@pytest.fixture
def loads(tiny_distill_dir, monkeypatch):
    """`k6serve generate` on in-process workers; the list records each model load."""
    import k6serve.cli.generate as generate_module

    loaded = []

    def from_cli_options(model_path, **options):
        loaded.append(model_path)
        config = build_engine_config(model_path, **options)
        return DiffGenerator(Engine(config, worker=ModelWorker(config)), wording=str)

    monkeypatch.setattr(generate_module.DiffGenerator, "from_cli_options", staticmethod(from_cli_options))
    return loaded


def _args(tiny_distill_dir, tmp_path, *flags):
    return ["generate", "--model-path", str(tiny_distill_dir), "--device", "cpu", "--height", "32", "--width", "32",
            "--num-frames", "5", "--output-path", str(tmp_path / "out"), *flags]


def test_each_prompt_of_the_file_is_one_video_from_one_model_load(tiny_distill_dir, tmp_path, loads, capsys):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("A cat plays piano\n\nA dog runs on a beach\n")
    assert main(_args(tiny_distill_dir, tmp_path, "--prompt-file-path", str(prompts), "--output-file-name",
                      "my clip")) == 0
    captured = capsys.readouterr()
    assert len(loads) == 1
    assert sorted(path.name for path in (tmp_path / "out").iterdir()) == ["my_clip_1.mp4", "my_clip_2.mp4"]
    # Said once, before the names are numbered, in the flag's name.
    assert captured.err.count("warning: --output-file-name 'my clip' is written as 'my_clip.mp4'") == 1
    for name in ("my_clip_1.mp4", "my_clip_2.mp4"):
        info = probe(tmp_path / "out" / name)
        assert (info.width, info.height, info.num_frames) == (32, 32, 5)
    assert "[1/2] line 1: A cat plays piano" in captured.err and "[2/2] line 3: A dog runs on a beach" in captured.err
    assert captured.out.count("saved ") == 2
    assert captured.out.rstrip().endswith("prompt file: 2 of 2 requests finished, 2 saved")


def test_derived_names_follow_each_prompt(tiny_distill_dir, tmp_path, loads, capsys):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("red fox\nblue whale\n")
    assert main(_args(tiny_distill_dir, tmp_path, "--prompt-file-path", str(prompts), "--seed", "3")) == 0
    names = sorted(path.name for path in (tmp_path / "out").iterdir())
    assert [name.split("_seed3_")[0] for name in names] == ["blue_whale", "red_fox"]


def test_a_prompt_file_from_the_config_file(tiny_distill_dir, tmp_path, loads, capsys):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("one\n")
    config = tmp_path / "run.yaml"
    config.write_text(f"prompt_file_path: {prompts}\noutput_file_name: only\n")
    assert main(_args(tiny_distill_dir, tmp_path, "--config", str(config))) == 0
    assert [path.name for path in (tmp_path / "out").iterdir()] == ["only.mp4"]  # one prompt: the name as given


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--prompt", "x"], "--prompt and --prompt-file-path both give the prompt; pass one of them."),
        # Every prompt's request is checked before the load: the one that fails is named by its line.
        (["--height", "60"], "line 1 of --prompt-file-path: --height must be a positive multiple of 16"),
        # An engine flag is the run's, not a line's: its error names no line of the file.
        (["--dp-size", "2"], "world size must equal dp x cfg x tp x ulysses x ring = 2 x 1 x 1 x 1 x 1 = 2, but "
                             "--num-gpus is 1."),
        (["--output-file-name", "taken"], "line 2 of --prompt-file-path: '{out}/taken_2.mp4' already exists and was "
                                          "left as it is"),
        # The name as given is checked before it is numbered (numbered, "..mp4" passed as "._1.mp4").
        (["--output-file-name", "sub/clip"], "--output-file-name 'sub/clip' must be a file name without folders"),
        (["--output-file-name", "..mp4"], "--output-file-name '..mp4' has no letter or digit"),
        (["--prompt-file-lines", "0"], "--prompt-file-lines '0': '0' is not a line number or range; write lines as "
                                       "the stopped run's report names them, e.g. 5, 3-200 or 3-5,9,12- (12 to the "
                                       "end)."),
        (["--prompt-file-lines", "2-1"], "--prompt-file-lines '2-1': '2-1' runs backwards; write the lower line "
                                         "first: 1-2."),
        (["--prompt-file-lines", "3-"], "--prompt-file-lines '3-': the last prompt of '{prompts}' is on line 2, so "
                                        "none is on line 3 or after it."),
    ],
)
def test_a_bad_batch_is_refused_before_the_model_loads(tiny_distill_dir, tmp_path, no_model_load, capsys, flags,
                                                       message):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("first\nsecond\n")
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "taken_2.mp4").write_bytes(b"keep")
    args = _args(tiny_distill_dir, tmp_path, "--prompt-file-path", str(prompts), *flags)
    assert main(args) == 2
    err = capsys.readouterr().err
    assert f"error: {message.format(out=tmp_path / 'out', prompts=prompts)}" in err and "Traceback" not in err
    assert sorted(path.name for path in (tmp_path / "out").iterdir()) == ["taken_2.mp4"]


def test_a_prompt_files_line_that_is_not_text_is_named_by_its_line_not_as_prompt(tiny_distill_dir, tmp_path,
                                                                                  no_model_load, capsys):
    # The request's check names the prompt --prompt, a flag not given: the line is named instead.
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("first\nsec\x1bond\n" + "x" * 32_769 + "\n")
    args = _args(tiny_distill_dir, tmp_path, "--prompt-file-path", str(prompts))
    assert main(args) == 2
    assert ("error: line 2 of --prompt-file-path holds the control character U+001B at character 4: text read in "
            "the wrong encoding") in capsys.readouterr().err
    assert main([*args, "--prompt-file-lines", "3"]) == 2
    assert ("error: line 3 of --prompt-file-path has 32,769 characters; at most 32,768 are taken"
            in capsys.readouterr().err)
    assert main([*args, "--prompt-file-lines", "1", "--negative-prompt", "a\x00b"]) == 2
    assert ("error: line 1 of --prompt-file-path: --negative-prompt holds the control character U+0000 at character 2"
            in capsys.readouterr().err)


def test_the_super_resolution_model_refuses_a_prompt_file(tiny_sr_dir, tmp_path, no_model_load, capsys):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("first\n")
    assert main(["generate", "--model-path", str(tiny_sr_dir), "--video-path", "clip.mp4", "--prompt-file-path",
                 str(prompts)]) == 2
    assert ("error: --prompt-file-path gives prompts to the generation models; the super-resolution model upscales "
            "--video-path and takes no text") in capsys.readouterr().err


def test_a_run_stopped_part_way_keeps_what_it_saved_and_names_the_lines_left(tiny_distill_dir, tmp_path, loads,
                                                                              monkeypatch, capsys):
    import errno

    from k6serve.media import mux

    real_fsync = mux._fsync

    def disk_full_on_the_second(path):
        if "clip_2" in str(path):  # the second video's partial file
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        return real_fsync(path)

    monkeypatch.setattr(mux, "_fsync", disk_full_on_the_second)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("first\nsecond\n\nthird\n")
    assert main(_args(tiny_distill_dir, tmp_path, "--prompt-file-path", str(prompts), "--output-file-name",
                      "clip")) == 1
    err = capsys.readouterr().err
    assert ("prompt file: 1 of 3 requests finished, 1 saved\n"
            "prompt file: line 2 stopped the run (the videos saved before it are kept)\n"
            "prompt file: not run: line 4\n"
            "prompt file: to run them again, add --prompt-file-lines 2,4\n") in err
    # the error line last, after the report (docs/cli.md)
    assert err.splitlines()[-2] == "prompt file: to run them again, add --prompt-file-lines 2,4"
    assert err.splitlines()[-1].startswith("error: writing the MP4 failed: No space left on device")
    assert [path.name for path in (tmp_path / "out").iterdir()] == ["clip_1.mp4"]
    assert probe(tmp_path / "out" / "clip_1.mp4").num_frames == 5
    # The disk has room again: the flag the report printed runs the rest, numbered as the whole file numbers them.
    monkeypatch.setattr(mux, "_fsync", real_fsync)
    assert main(_args(tiny_distill_dir, tmp_path, "--prompt-file-path", str(prompts), "--output-file-name",
                      "clip", "--prompt-file-lines", "2,4")) == 0
    captured = capsys.readouterr()
    assert "[1/2] line 2: second" in captured.err and "[2/2] line 4: third" in captured.err
    assert sorted(path.name for path in (tmp_path / "out").iterdir()) == ["clip_1.mp4", "clip_2.mp4", "clip_3.mp4"]


def test_prompt_file_lines_picks_lines_and_keeps_the_whole_files_numbered_names(tiny_distill_dir, tmp_path, loads,
                                                                                  capsys):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("first\nsecond\n\nthird\nfourth\n")
    config = tmp_path / "run.yaml"
    config.write_text("prompt_file_lines: 4\n")  # YAML reads it as a number
    assert main(_args(tiny_distill_dir, tmp_path, "--prompt-file-path", str(prompts), "--output-file-name", "clip",
                      "--config", str(config))) == 0
    assert "[1/1] line 4: third" in capsys.readouterr().err
    assert main(_args(tiny_distill_dir, tmp_path, "--prompt-file-path", str(prompts), "--output-file-name", "clip",
                      "--prompt-file-lines", "1, 5-")) == 0
    assert "[1/2] line 1: first" in capsys.readouterr().err
    assert sorted(path.name for path in (tmp_path / "out").iterdir()) == ["clip_1.mp4", "clip_3.mp4", "clip_4.mp4"]


@pytest.mark.parametrize(("lines", "message"), [
    ("3", "--prompt-file-lines '3': line 3 of '{prompts}' holds no prompt (blank lines are skipped)."),
    ("3-3", "--prompt-file-lines '3-3': line 3 of '{prompts}' holds no prompt (blank lines are skipped)."),
    ("2-", None),  # a range over a blank line runs the prompts in it
])
def test_prompt_file_lines_that_name_no_prompt_are_refused(tmp_path, lines, message):
    from k6serve.cli.prompt_file import prompt_file_batch

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("first\nsecond\n\nthird\n")
    options = {"prompt_file_path": str(prompts), "prompt_file_lines": lines}
    if message is None:
        assert [label for label, _ in prompt_file_batch(options)] == ["line 2", "line 4"]
    else:
        with pytest.raises(ValueError) as error:
            prompt_file_batch(options)
        assert str(error.value) == message.format(prompts=prompts)


def test_prompt_file_lines_without_a_prompt_file_is_refused(tiny_distill_dir, tmp_path, no_model_load, capsys):
    assert main(_args(tiny_distill_dir, tmp_path, "--prompt", "x", "--prompt-file-lines", "2")) == 2
    assert ("error: --prompt-file-lines picks lines of --prompt-file-path; pass the prompt file too, or drop "
            "--prompt-file-lines.") in capsys.readouterr().err


def test_a_prompt_file_path_from_a_config_file_expands_the_home_folder(tmp_path, monkeypatch):
    # A shell expands ~ on the command line; a --config file's value arrives as written (as for --image-path).
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "prompts.txt").write_text("one\n")
    assert read_prompt_file("~/prompts.txt") == [(1, "one")]


def test_a_run_stopped_after_a_finished_prompt_names_the_next_one_as_not_run(tiny_distill_dir, tmp_path, loads,
                                                                              monkeypatch, capsys):
    # Stopped while the first prompt's summary was printed (Ctrl-C, or stdout closed by `| head`): line 1 finished
    # and was saved, so it did not stop the run, and line 2 did not run.
    import k6serve.cli.result_output as result_output

    def interrupted(result, unsaved_by):
        raise KeyboardInterrupt

    monkeypatch.setattr(result_output, "format_summary", interrupted)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("first\nsecond\n")
    assert main(_args(tiny_distill_dir, tmp_path, "--prompt-file-path", str(prompts), "--output-file-name",
                      "clip")) == 130
    err = capsys.readouterr().err
    assert ("prompt file: 1 of 2 requests finished, 1 saved\nprompt file: not run: line 2\n"
            "prompt file: to run it again, add --prompt-file-lines 2\n") in err
    assert "stopped the run" not in err
    assert err.endswith("error: interrupted (Ctrl-C) between two prompts; none was running.\n")


def test_a_refusal_before_the_load_keeps_its_origin_for_log_level_debug(tiny_distill_dir, tmp_path, no_model_load,
                                                                        capsys):
    # --log-level debug prints where the refusal came from (the request rules), not only the CLI's re-raise.
    assert main(_args(tiny_distill_dir, tmp_path, "--prompt", "x", "--height", "60", "--log-level", "debug")) == 2
    err = capsys.readouterr().err
    assert "error: --height must be a positive multiple of 16" in err and "request_resolution.py" in err


def _saved(prompt: str, seconds: float):
    """What a stand-in replica's `generate` returns for a finished prompt."""
    from types import SimpleNamespace

    return SimpleNamespace(notes=[], timings={"total": seconds}, peak_memory_mb=1.0, num_frames=5, width=32,
                           height=32, fps=24.0, has_audio=True, output_file_path=f"out/{prompt}.mp4", seed=42,
                           expanded_prompt=None)


class _Replicas:
    """A stand-in generator with two replicas: `generate` records how many requests run at once; the prompt "fail"
    raises 0.05 s after it starts, the others finish after 0.3 s."""

    def __init__(self):
        import threading

        from k6serve.models.variants import VARIANTS

        self.variant = VARIANTS["pro-distill"]
        self.engine = type("Engine", (), {"num_replicas": 2})()
        self.lock = threading.Lock()
        self.running = 0
        self.most = 0
        self.started = []
        self.shut = False

    def generate(self, options, on_progress=None, progress_bar=False):
        import time

        with self.lock:
            self.running += 1
            self.most = max(self.most, self.running)
            self.started.append(options["prompt"])
        try:
            if options["prompt"] == "fail":  # fails while the first prompt still runs
                time.sleep(0.05)
                raise RuntimeError("the replica's GPU fell off the bus")
            time.sleep(0.3)
            return _saved(options["prompt"], 0.2)
        finally:
            with self.lock:
                self.running -= 1

    def shutdown(self):
        self.shut = True


def _with_replicas(monkeypatch):
    import k6serve.cli.generate as generate_module

    replicas = _Replicas()
    monkeypatch.setattr(generate_module.DiffGenerator, "from_cli_options", staticmethod(lambda *a, **k: replicas))
    return replicas


def test_with_two_replicas_the_prompts_run_two_at_a_time(tiny_distill_dir, tmp_path, monkeypatch, capsys):
    replicas = _with_replicas(monkeypatch)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a\nb\nc\nd\n")
    assert main(_args(tiny_distill_dir, tmp_path, "--prompt-file-path", str(prompts))) == 0
    captured = capsys.readouterr()
    assert replicas.most == 2 and sorted(replicas.started) == ["a", "b", "c", "d"] and replicas.shut
    assert "prompt file: 4 prompts, 2 at a time (--dp-size 2)" in captured.err
    assert captured.err.count(" finished] line ") == 4 and captured.out.count("saved out/") == 4
    assert captured.out.rstrip().endswith("prompt file: 4 of 4 requests finished, 4 saved")


def test_with_two_replicas_a_failure_stops_the_prompts_not_started(tiny_distill_dir, tmp_path, monkeypatch, capsys):
    replicas = _with_replicas(monkeypatch)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("ok\nfail\nnever\nnor this\n")
    assert main(_args(tiny_distill_dir, tmp_path, "--prompt-file-path", str(prompts))) == 70
    err = capsys.readouterr().err
    assert sorted(replicas.started) == ["fail", "ok"]  # the two started together; the rest never did
    assert ("prompt file: 1 of 4 requests finished, 1 saved\nprompt file: line 2 stopped the run (the videos saved "
            "before it are kept)\nprompt file: not run: lines 3-4\n") in err
    assert "the replica's GPU fell off the bus" in err


@pytest.mark.parametrize(("in_file", "typed", "expected"), [
    ("prompt: from the file\n", ["--prompt-file-path", "PROMPTS"], ["first", "second"]),
    ("prompt_file_path: PROMPTS\n", ["--prompt", "typed"], ["typed"]),
    # The file's lines go with the file --prompt replaced (it was refused: "--prompt-file-lines picks lines of...").
    ("prompt_file_path: PROMPTS\nprompt_file_lines: 2\n", ["--prompt", "typed"], ["typed"]),
    ("prompt_file_path: PROMPTS\nprompt_file_lines: 2\n", [], ["second"]),
    ("prompt_file_path: other.txt\nprompt_file_lines: 2\n", ["--prompt-file-path", "PROMPTS"], ["first", "second"]),
])
def test_the_command_line_wins_over_a_config_files_other_way_to_give_the_prompt(tiny_distill_dir, tmp_path,
                                                                               monkeypatch, capsys, in_file, typed,
                                                                               expected):
    replicas = _with_replicas(monkeypatch)
    replicas.engine.num_replicas = 1
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("first\nsecond\n")
    config = tmp_path / "run.yaml"
    config.write_text(in_file.replace("PROMPTS", str(prompts)))
    args = [str(prompts) if arg == "PROMPTS" else arg for arg in typed]
    assert main(_args(tiny_distill_dir, tmp_path, "--config", str(config), *args)) == 0
    assert replicas.started == expected


def test_with_two_replicas_ctrl_c_stops_the_running_prompts_and_the_report_says_so(tiny_distill_dir, tmp_path,
                                                                                   monkeypatch, capsys):
    # Ctrl-C reaches the main thread, not the pool's threads waiting in generate(): the requests running then went
    # on to their end in shutdown() and were saved, while the report named their lines "not run". They must stop at
    # their next step (a request ended by raising from on_progress leaves no file), and the report must match.
    import _thread
    import time

    replicas = _with_replicas(monkeypatch)
    ended = {}

    def generate(options, on_progress=None):
        prompt = options["prompt"]
        with replicas.lock:
            replicas.started.append(prompt)
        try:
            for step in range(1, 201):  # 2 s unless stopped
                if prompt == "a" and step == 5:
                    _thread.interrupt_main()  # Ctrl-C while both prompts run
                time.sleep(0.01)
                if on_progress is not None:
                    on_progress(step, 200)
        except BaseException:
            ended[prompt] = "stopped"
            raise
        ended[prompt] = "saved"
        return _saved(prompt, 2.0)

    replicas.generate = generate
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a\nb\nc\n")
    assert main(_args(tiny_distill_dir, tmp_path, "--prompt-file-path", str(prompts))) == 130
    deadline = time.monotonic() + 5
    while len(ended) < 2 and time.monotonic() < deadline:  # before the fix they ran on after main() returned
        time.sleep(0.05)
    assert sorted(replicas.started) == ["a", "b"] and ended == {"a": "stopped", "b": "stopped"}
    err = capsys.readouterr().err
    assert "prompt file: 0 of 3 requests finished, 0 saved\nprompt file: not run: lines 1-3\n" in err
    assert err.endswith("error: interrupted (Ctrl-C); the 2 requests running then were stopped.\n")


def _interrupted_run(checkpoint, tmp_path, capsys, lines: str) -> str:
    """A prompt file of `lines` run to its Ctrl-C (exit 130): what it printed on stderr."""
    prompts = tmp_path / "prompts.txt"
    prompts.write_text(lines)
    assert main(_args(checkpoint, tmp_path, "--prompt-file-path", str(prompts))) == 130
    return capsys.readouterr().err


def test_ctrl_c_after_every_prompt_finished_says_every_video_is_kept(tiny_distill_dir, tmp_path, monkeypatch,
                                                                     capsys):
    # While the workers shut down after the last prompt: "between two prompts" named a prompt that did not exist.
    replicas = _with_replicas(monkeypatch)

    def interrupted_shutdown():
        replicas.shut = True
        raise KeyboardInterrupt

    replicas.shutdown = interrupted_shutdown
    err = _interrupted_run(tiny_distill_dir, tmp_path, capsys, "a\nb\n")
    assert "prompt file: 2 of 2 requests finished, 2 saved\n" in err
    assert err.endswith("error: interrupted (Ctrl-C) after the last prompt finished; every video is kept.\n")


def test_with_two_replicas_ctrl_c_after_a_failure_names_the_failure_too(tiny_distill_dir, tmp_path, monkeypatch,
                                                                        capsys):
    # Side by side a failure waits for the running prompt; a Ctrl-C then counted the failed prompt as stopped ("the
    # 2 requests running then were stopped") and its error was never printed.
    import _thread
    import time

    replicas = _with_replicas(monkeypatch)
    failed = threading.Event()

    def generate(options, on_progress=None):
        if options["prompt"] == "fail":
            failed.set()
            raise RuntimeError("the replica's GPU fell off the bus")
        for step in range(1, 301):  # 3 s unless stopped
            if step == 5:
                failed.wait(5)
                time.sleep(0.2)  # the main thread has taken the failure
                _thread.interrupt_main()
            time.sleep(0.01)
            on_progress(step, 300)
        return _saved("slow", 3.0)

    replicas.generate = generate
    err = _interrupted_run(tiny_distill_dir, tmp_path, capsys, "slow\nfail\nnever\n")
    assert "prompt file: 0 of 3 requests finished, 0 saved\nprompt file: line 2 stopped the run" in err
    assert err.endswith("error: interrupted (Ctrl-C); the request running then was stopped; line 2 had failed "
                        "before it: the replica's GPU fell off the bus.\n")


def test_a_progress_line_shows_the_start_of_a_long_prompt_on_one_line():
    """A 5,000-character prompt (a prompt file's line) was printed whole at every start and finish."""
    from k6serve.cli.generate import _progress_prompt

    assert _progress_prompt("A cat plays piano") == "A cat plays piano"
    long = "A cat\tplays " + "piano " * 1000
    shown = _progress_prompt(long)
    assert len(shown) == 160 and shown.startswith("A cat plays piano piano") and shown.endswith("...")


def test_a_progress_line_escapes_terminal_controls_and_cuts_between_characters():
    """An escape sequence or a right-to-left override in a prompt file's line recoloured or reversed the terminal's
    line; a cut at character 157 split an accented letter or an emoji's joined sequence."""
    from k6serve.cli.generate import _progress_prompt

    assert _progress_prompt("\x1b[31mЛиса\u202e бежит") == "\\x1b[31mЛиса\\u202e бежит"
    family = "\U0001f468\u200d\U0001f469\u200d\U0001f467"
    assert _progress_prompt("a" * 154 + family + "b" * 20) == "a" * 154 + "..."  # not half a family
    assert _progress_prompt("e" * 156 + "e\u0301\u0301x" + "b" * 20) == "e" * 156 + "..."  # not a bare accent
    assert _progress_prompt("a" * 100 + family + "b" * 100).startswith("a" * 100 + family)  # whole ones are kept
    persian = "\u0645\u06cc\u200c\u062e\u0648\u0627\u0647\u0645"  # a zero-width non-joiner inside the word
    assert _progress_prompt(persian) == persian


def test_the_prompts_not_run_are_told_as_line_ranges():
    # 126 labels "line 75, line 76, ..." on one line could not be read, nor turned back into a prompt file.
    from k6serve.cli.prompt_file import _line_ranges

    assert _line_ranges(["line 4"]) == "line 4"
    assert _line_ranges([f"line {n}" for n in range(75, 201)]) == "lines 75-200"
    assert _line_ranges(["line 1", "line 2", "line 3", "line 7", "line 9", "line 10"]) == "lines 1-3, 7, 9-10"


def test_json_prints_one_line_per_request_with_its_prompt_file_line(tiny_distill_dir, tmp_path, loads, capsys):
    # --json: stdout is JSON Lines, one object per finished request, nothing else; the run's summary goes to stderr.
    import json

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("Лиса в снегу\n\nA dog runs\n")
    assert main(_args(tiny_distill_dir, tmp_path, "--prompt-file-path", str(prompts), "--seed", "7", "--json",
                      "--output-file-name", "clip")) == 0
    captured = capsys.readouterr()
    lines = captured.out.splitlines()
    assert len(lines) == 2
    records = [json.loads(line) for line in lines]
    assert [(record["line"], record["prompt"]) for record in records] == [(1, "Лиса в снегу"), (3, "A dog runs")]
    for record, name in zip(records, ("clip_1.mp4", "clip_2.mp4")):
        assert record["output_file_path"] == str(tmp_path / "out" / name)
        info = probe(record["output_file_path"])
        assert (record["width"], record["height"], record["num_frames"]) == (info.width, info.height, 5) == (32, 32, 5)
        assert record["seed"] == 7 and record["fps"] == 24.0 and record["sample_aspect_ratio"] is None
        assert record["has_audio"] is True and record["audio_sample_rate"] == 44100
        assert record["timings"]["total"] > 0 and record["timings"]["graphs_compiled"] == 0
        assert isinstance(record["timings"]["graphs_compiled"], int) and record["peak_memory_mb"] > 0
    assert "Лиса" in lines[0]  # not \u escapes
    assert "stage" not in captured.out and "saved " not in captured.out
    assert "prompt file: 2 of 2 requests finished, 2 saved" in captured.err


def test_json_with_one_request_and_no_saved_file(tiny_distill_dir, tmp_path, loads, capsys):
    import json

    assert main(_args(tiny_distill_dir, tmp_path, "--prompt", "a fox", "--no-save-output", "--json")) == 0
    (line,) = capsys.readouterr().out.splitlines()
    record = json.loads(line)
    assert record["output_file_path"] is None and "line" not in record and "prompt" not in record
    assert record["notes"] == []


def test_json_record_keeps_the_line_json_where_a_value_is_not_finite():
    # Python's json.dumps writes NaN, which jq and JSON.parse refuse: a time not measured is null.
    import json
    from fractions import Fraction

    from k6serve.cli.result_output import result_record
    from k6serve.request import VideoResult

    result = VideoResult(output_file_path="o/a.mp4", frames=None, audio=None, audio_sample_rate=44100, fps=24.0,
                         seed=1, timings={"total": float("nan"), "dit": 2.5, "graphs_compiled": 3.0},
                         peak_memory_mb=float("inf"), num_frames=121, height=1024, width=1536, has_audio=False,
                         notes=["an SR note"], sample_aspect_ratio=Fraction(4, 3))
    record = result_record(result)
    assert json.loads(json.dumps(record, allow_nan=False)) == {
        "output_file_path": "o/a.mp4", "width": 1536, "height": 1024, "num_frames": 121, "fps": 24.0,
        "has_audio": False, "audio_sample_rate": None, "seed": 1, "sample_aspect_ratio": "4:3",
        "timings": {"total": None, "dit": 2.5, "graphs_compiled": 3}, "peak_memory_mb": None,
        "notes": ["an SR note"], "expanded_prompt": None}


def test_json_lines_stay_json_on_a_stdout_that_is_not_utf8(monkeypatch, capsys):
    # Windows pipes are cp1252: the console's backslashreplace wrote \U0001f98a for an emoji, which is no JSON escape.
    import io
    import json
    import sys

    from k6serve.cli.result_output import print_result
    from k6serve.request import VideoResult

    stream = io.TextIOWrapper(io.BytesIO(), encoding="cp1252", errors="backslashreplace")
    monkeypatch.setattr(sys, "stdout", stream)
    result = VideoResult(output_file_path="out/Лиса_🦊.mp4", frames=None, audio=None, audio_sample_rate=44100,
                         fps=24.0, seed=1, timings={"total": 1.0}, peak_memory_mb=1.0, num_frames=5, height=32,
                         width=32)
    print_result(result, as_json=True, label="line 1", prompt="Лиса 🦊 é")
    stream.flush()
    record = json.loads(stream.buffer.getvalue().decode("cp1252"))
    assert record["prompt"] == "Лиса 🦊 é" and record["output_file_path"] == "out/Лиса_🦊.mp4"
