"""The Python API and the engine as a demanding user drives them: interrupts, shutdown races, progress callbacks,
signals reaching the worker processes. Fake workers keep these in seconds; the multi-process ones use gloo on CPU."""

from __future__ import annotations

import os
import signal
import threading
import time

import numpy as np
import pytest

from k6serve.config import EngineConfig, ModelConfig, ParallelConfig, RuntimeConfig
from k6serve.models.variants import VARIANTS
from k6serve.request import OutputOptions, SamplingParams, VideoResult
from k6serve.runtime.engine import Engine, RequestCancelled


def fake_config() -> EngineConfig:
    return EngineConfig(
        model=ModelConfig(model_path="fake-k6", load_format="dummy"),
        parallel=ParallelConfig(),
        runtime=RuntimeConfig(device="cpu"),
    )


class StepWorker:
    """In-process stand-in for the worker: `num_inference_steps` steps of `step_s` seconds each."""

    variant = VARIANTS["pro"]

    def __init__(self, step_s: float = 0.02) -> None:
        self.step_s = step_s
        self.cancelled: list[int] = []

    def resolve(self, params: SamplingParams):
        return None, []  # what DiffGenerator.generate checks first; these tests are about running

    def run(self, params: SamplingParams, output: OutputOptions, on_step=None) -> VideoResult:
        total = params.num_inference_steps or 1
        try:
            for step in range(1, total + 1):
                time.sleep(self.step_s)
                if on_step is not None:
                    on_step(step, total)
        except RequestCancelled:
            self.cancelled.append(step)
            raise
        return VideoResult(output_file_path=None, frames=None, audio=None, audio_sample_rate=44100, fps=24.0,
                           seed=params.seed or 42, timings={"total": 0.0}, peak_memory_mb=0.0, num_frames=1,
                           height=16, width=16, notes=[f"steps={total}"])


@pytest.mark.parametrize("delivered_to", ["process", "worker thread"])
def test_ctrl_c_while_waiting_cancels_the_request_and_the_engine_stays_usable(delivered_to):
    """Ctrl-C is a process-wide SIGINT; the kernel usually hands it to the main thread but may hand it to any
    (it went to the worker thread under load on the GPU host). Handed elsewhere, it only sets Python's flag: the
    waiting main thread must still notice it at once, not when the 10 s request ends."""
    worker = StepWorker(step_s=0.05)  # 500 steps: 25 s, far longer than the bounds below
    engine = Engine(fake_config(), worker=worker)
    main_pid = os.getpid()

    def interrupt_at_step_two(step: int, total: int) -> None:
        if step == 2 and delivered_to == "process":
            os.kill(main_pid, signal.SIGINT)  # what Ctrl-C (a terminal, a notebook's interrupt) delivers
        elif step == 2:
            signal.pthread_kill(threading.get_ident(), signal.SIGINT)  # this callback runs on the worker thread

    try:
        with pytest.raises(KeyboardInterrupt):
            engine.generate(SamplingParams(prompt="long", num_inference_steps=500), on_progress=interrupt_at_step_two)
        start = time.monotonic()
        # The next request only runs within 10 s if the interrupted one (25 s) stopped.
        result = engine.generate(SamplingParams(prompt="next", num_inference_steps=1))
        assert time.monotonic() - start < 10
        assert result.notes == ["steps=1"]
        assert len(worker.cancelled) == 1 and worker.cancelled[0] < 200
    finally:
        engine.shutdown()


class _ShutdownBeforePut:
    """A queue whose put of a request lets a concurrent shutdown() run first: the window between submit's
    closed check and its put."""

    def __init__(self, engine: Engine, inner) -> None:
        self.engine, self.inner = engine, inner
        self.shutdown_thread: threading.Thread | None = None

    def put(self, item) -> None:
        if hasattr(item, "future"):
            self.shutdown_thread = threading.Thread(target=self.engine.shutdown)
            self.shutdown_thread.start()
            self.shutdown_thread.join(0.5)
        self.inner.put(item)

    def get(self, *args, **kwargs):
        return self.inner.get(*args, **kwargs)

    def qsize(self) -> int:
        return self.inner.qsize()


def test_a_request_racing_shutdown_runs_or_fails_but_never_hangs():
    engine = Engine(fake_config(), worker=StepWorker())
    racing = _ShutdownBeforePut(engine, engine._queue)
    engine._queue = racing
    try:
        job = engine.submit(SamplingParams(prompt="racing", num_inference_steps=1))
        assert job.future.result(timeout=5).notes == ["steps=1"]
    finally:
        engine.shutdown()
        if racing.shutdown_thread is not None:
            racing.shutdown_thread.join(5)
    with pytest.raises(RuntimeError, match="shut down"):
        engine.generate(SamplingParams(prompt="after", num_inference_steps=1))


def test_shutdown_cancels_a_request_still_running_after_its_wait_and_says_why():
    """shutdown() closed the worker under a request still running after its 30 s wait: the ranks stopped
    mid-request and the caller got "AssertionError: Shutdown()" (a notebook's shutdown() beside a long request; the
    interpreter exiting with one in a daemon thread). It is cancelled at its next step now, and told why; the
    request queued behind it is not started."""
    from k6serve.lora.spec import ListLoras

    class LoraWorker(StepWorker):
        lora_operations: list = []

        def apply_lora_operation(self, operation):
            self.lora_operations.append(operation)
            return {}

    worker = LoraWorker(step_s=0.05)
    engine = Engine(fake_config(), worker=worker)
    running = engine.submit(SamplingParams(prompt="long", num_inference_steps=400))
    queued = engine.submit(SamplingParams(prompt="next", num_inference_steps=1))
    lora = engine.submit_lora(ListLoras())
    running.started.wait(5)
    start = time.monotonic()
    engine.shutdown(timeout=0.3)
    assert time.monotonic() - start < 5
    with pytest.raises(RequestCancelled, match=r"^request req-\d+ was cancelled at step \d+/400: the engine was shut "
                                               r"down \(it waited 0.3 s for the requests before it to finish\)$"):
        running.future.result(timeout=0)
    with pytest.raises(RequestCancelled, match=r"cancelled before it started: the engine was shut down"):
        queued.future.result(timeout=0)
    assert len(worker.cancelled) == 1 and worker.cancelled[0] < 400
    # An adapter change queued behind them does not run either: it could outlast the last wait, under close().
    with pytest.raises(RuntimeError, match=r"^Not run: the engine was shut down \(it waited 0.3 s"):
        lora.result(timeout=0)
    assert worker.lora_operations == []


def test_shutdown_does_not_run_an_operation_another_replica_took_while_a_request_ran():
    """With two replicas, one loop thread runs a request while the other takes the LoRA operation behind it and
    waits for the request to end. A shutdown() that stopped waiting cancelled the request, and the operation then ran
    anyway (an adapter load could outlast the last wait, and the worker was closed under it)."""
    from k6serve.lora.spec import ListLoras

    class TwoReplicaLoraWorker(StepWorker):
        num_replicas = 2

        def __init__(self) -> None:
            super().__init__(step_s=0.02)
            self.lora_operations: list = []

        def apply_lora_operation(self, operation):
            self.lora_operations.append(operation)
            return {}

    worker = TwoReplicaLoraWorker()
    engine = Engine(fake_config(), worker=worker)
    running = engine.submit(SamplingParams(prompt="long", num_inference_steps=1000))
    running.started.wait(5)
    lora = engine.submit_lora(ListLoras())
    deadline = time.monotonic() + 5
    while engine._queue.qsize():  # taken by the other loop thread, which waits for the request
        assert time.monotonic() < deadline
        time.sleep(0.01)
    engine.shutdown(timeout=0.2)
    with pytest.raises(RuntimeError, match=r"^Not run: the engine was shut down \(it waited 0.2 s"):
        lora.result(timeout=0)
    assert worker.lora_operations == []
    with pytest.raises(RequestCancelled):
        running.future.result(timeout=0)


def test_a_worker_without_lora_operations_fails_the_call_not_the_engine():
    """The loop thread read `worker.apply_lora_operation` before running it: a worker without it (a custom worker, a
    test double) raised AttributeError in the loop thread, which stopped it, and every later request waited forever.
    The caller of the LoRA call gets the error; the engine keeps serving."""
    from k6serve.lora.spec import ListLoras

    engine = Engine(fake_config(), worker=StepWorker(step_s=0.0))
    try:
        with pytest.raises(AttributeError, match="apply_lora_operation"):
            engine.submit_lora(ListLoras()).result(timeout=5)
        job = engine.submit(SamplingParams(prompt="after", num_inference_steps=2))
        assert job.future.result(timeout=5).notes == ["steps=2"]
    finally:
        engine.shutdown(timeout=5)


def test_shutdown_lets_a_request_that_ends_within_the_wait_finish():
    engine = Engine(fake_config(), worker=StepWorker(step_s=0.02))
    job = engine.submit(SamplingParams(prompt="short", num_inference_steps=5))
    job.started.wait(5)
    engine.shutdown(timeout=10)
    assert job.future.result(timeout=0).notes == ["steps=5"]


def test_upscale_takes_a_progress_callback(tmp_path):
    from k6serve.api import DiffGenerator

    class Recorder(StepWorker):
        def run(self, params, output, on_step=None):
            self.params = params
            return super().run(params, output, on_step)

    worker = Recorder()
    steps: list[tuple[int, int]] = []
    with DiffGenerator(Engine(fake_config(), worker=worker)) as generator:
        generator.upscale(str(tmp_path / "source.mp4"), num_inference_steps=2, save_output=False,
                          on_progress=lambda step, total: steps.append((step, total)))
    assert steps == [(1, 2), (2, 2)]
    assert worker.params.video_path == str(tmp_path / "source.mp4")


def test_upscale_takes_the_progress_bar_and_names_diffusers_video_keyword(tmp_path, capsys):
    # upscale() forwarded on_progress alone: progress_bar=True went into the request, refused as an unknown
    # sampling parameter; and diffusers' pipe(video=...) spelling got Python's "missing 1 required positional
    # argument: 'video_path'" instead of the note generate() gives for it.
    from k6serve.api import DiffGenerator

    with DiffGenerator(Engine(fake_config(), worker=StepWorker())) as generator:
        result = generator.upscale(str(tmp_path / "source.mp4"), num_inference_steps=2, save_output=False,
                                   progress_bar=True)
        assert result.notes == ["steps=2"]
        assert "2/2" in capsys.readouterr().err
        with pytest.raises(ValueError, match=r"Unknown sampling parameter\(s\) \['video'\] \(diffusers' argument; "
                                             r"super-resolution takes the source's file: pass video_path="):
            generator.upscale(video=str(tmp_path / "source.mp4"))


@pytest.mark.multiprocess
def test_ctrl_c_reaching_the_worker_processes_leaves_them_serving():
    from test_launch import FakeRankWorker, make_config

    from k6serve.runtime.process_group_worker import MultiProcessWorker

    worker = MultiProcessWorker(make_config(num_gpus=1), build_rank_worker=FakeRankWorker)
    engine = Engine(worker.config, worker=worker)
    try:
        # A terminal sends Ctrl-C to every process of the group; the engine process decides what stops.
        os.kill(worker.pids[0], signal.SIGINT)
        time.sleep(0.5)
        assert engine.generate(SamplingParams(prompt="cat", num_inference_steps=1)).num_frames > 0
        assert all(process.is_alive() for process in worker._processes.values())
    finally:
        engine.shutdown()
    assert all(not process.is_alive() for process in worker._processes.values())


def test_generate_takes_a_sampling_params_object(tmp_path):
    """`k6serve` exports SamplingParams, and `generate(SamplingParams(...))` used to fail with "'SamplingParams'
    object is not a mapping". Its fields set away from their defaults are the request; keyword arguments win, and
    return_frames=True no longer meets the object's default return_file_paths_only=True as a contradiction."""
    from k6serve.api import DiffGenerator

    class Recorder(StepWorker):
        def run(self, params, output, on_step=None):
            self.seen = (params, output)
            return super().run(params, output, on_step)

    worker = Recorder()
    with DiffGenerator(Engine(fake_config(), worker=worker)) as generator:
        generator.generate(SamplingParams(prompt="a cat", seed=7, num_inference_steps=2), save_output=False,
                           seed=8, return_frames=True)
    params, output = worker.seen
    assert (params.prompt, params.seed, params.num_inference_steps) == ("a cat", 8, 2)
    assert output.return_frames is True and output.save_output is False


@pytest.mark.multiprocess
def test_requests_after_a_deliberate_shutdown_say_so_not_that_replicas_died():
    """After close() a request failed with "every worker replica has died; restart the engine (see the errors
    above)", which sent a user looking for a crash that never happened."""
    from test_launch import FakeRankWorker, make_config

    from k6serve.runtime.process_group_worker import MultiProcessWorker

    worker = MultiProcessWorker(make_config(num_gpus=1), build_rank_worker=FakeRankWorker)
    assert worker.run(SamplingParams(prompt="cat", num_inference_steps=1), OutputOptions(save_output=False))
    worker.close()
    with pytest.raises(RuntimeError, match=r"^The engine has been shut down; this request did not run\.$"):
        worker.run(SamplingParams(prompt="cat", num_inference_steps=1), OutputOptions(save_output=False))


@pytest.mark.parametrize(
    ("options", "message"),
    [
        # A truthy string would turn FSDP / CFG-parallel on, the opposite of what it says.
        ({"use_fsdp_inference": "false"}, r"^use_fsdp_inference must be true or false, got 'false' \(str\)$"),
        ({"enable_cfg_parallel": "no"}, r"^enable_cfg_parallel must be true or false, got 'no'"),
        ({"num_gpus": "1"}, r"^num_gpus must be an integer, got '1' \(str\)$"),
        ({"num_gpus": 1.0}, r"^num_gpus must be an integer, got 1.0 \(float\)$"),
        ({"compile_vae": 1}, r"^compile_vae must be true or false, got 1"),
        ({"lora_scale": "0.5"}, r"^lora_scale must be a number, got '0.5'"),
        ({"model_id": 6}, r"^model_id must be a string, got 6 \(int\)$"),
        ({"dist_timeout_s": 0}, r"^dist_timeout_s must be > 0 seconds"),
    ],
)
def test_engine_options_of_the_wrong_type_are_refused_naming_the_keyword(options, message):
    from k6serve.api import DiffGenerator

    with pytest.raises(ValueError, match=message):
        DiffGenerator.from_pretrained("demo", **options)  # refused while the config is built, before any start


def test_engine_options_take_pathlib_paths(tmp_path):
    from k6serve.engine_arguments import build_engine_config

    config = build_engine_config(tmp_path, lora_path=tmp_path / "a.safetensors", lora_scale=1, dist_timeout_s=5)
    assert config.model.model_path == str(tmp_path) and config.model.lora_path == str(tmp_path / "a.safetensors")
    assert config.model.lora_scale == 1 and config.parallel.dist_timeout_s == 5


def test_numpy_integers_are_the_ints_they_stand_for():
    import numpy as np

    from k6serve.request_resolution import resolve_generate

    params = SamplingParams.from_kwargs({"prompt": "x", "seed": np.int64(3), "num_frames": np.int32(5)})
    assert type(params.seed) is int and params.seed == 3 and type(params.num_frames) is int
    request, _ = resolve_generate(params, VARIANTS["pro-distill"])
    assert request.seed == 3


def test_guidance_that_is_not_finite_says_so():
    from k6serve.request_resolution import resolve_generate

    with pytest.raises(ValueError, match="guidance_scale must be a finite number >= 1.0.*got inf"):
        resolve_generate(SamplingParams(prompt="x", guidance_scale=float("inf")), VARIANTS["pro"])
    # nan is reported as nan (it read "got inf", the value the comparisons use), on a CFG and a distilled model.
    with pytest.raises(ValueError, match=r"guidance_scale must be a finite number >= 1.0.*got nan$"):
        resolve_generate(SamplingParams(prompt="x", guidance_scale=float("nan")), VARIANTS["pro"])
    with pytest.raises(ValueError, match=r"requires guidance_scale exactly 1\.0 \(got nan\)"):
        resolve_generate(SamplingParams(prompt="x", guidance_scale=float("nan")), VARIANTS["pro-distill"])


@pytest.mark.parametrize("option, flag", [({"lora_scale": 0.5}, "--lora-scale"), ({"lora_alpha": 8.0}, "--lora-alpha"),
                                          ({"lora_nickname": "style"}, "--lora-nickname")])
def test_lora_options_without_a_lora_path_are_refused(option, flag):
    with pytest.raises(ValueError, match=f"^{flag} describes the --lora-path adapter, but no --lora-path was given; "
                                         "add --lora-path, or drop it "):
        ModelConfig(model_path="demo", **option)
    with pytest.raises(ValueError, match="^--lora-scale and --lora-alpha describe the --lora-path .* drop them "):
        ModelConfig(model_path="demo", lora_scale=0.5, lora_alpha=8.0)
    ModelConfig(model_path="demo", lora_path="a.safetensors", **option)
    ModelConfig(model_path="demo", lora_merge_mode="dynamic")  # stands alone: set_lora's default


def test_a_pil_image_as_image_path_says_to_pass_a_path():
    import PIL.Image

    from k6serve.request_arguments import split_kwargs

    with pytest.raises(ValueError, match=r"image_path takes the path of an image file \(a str or pathlib.Path\), "
                                         r"not a PIL image: save it first, e\.g\. image\.save"):
        split_kwargs({"prompt": "x", "image_path": PIL.Image.new("RGB", (4, 4))})


@pytest.mark.parametrize("key", ["image_path", "video_path"])
def test_an_array_of_pixels_as_a_path_says_to_save_it_in_one_line(key):
    # A numpy array (frames from OpenCV, a result's `frames`) was refused as "must be a string, got array([[[0, 0,
    # 0], ..." with some 50 lines of pixels and no fix.
    import torch

    from k6serve.request_arguments import split_kwargs

    for pixels, kind in ((np.zeros((64, 96, 3), np.uint8), "numpy.ndarray"), (torch.zeros(3, 8, 8), "torch.Tensor")):
        with pytest.raises(ValueError) as error:
            split_kwargs({"prompt": "x", key: pixels})
        message = str(error.value)
        assert message.startswith(f"{key} takes the path of ") and "\n" not in message
        assert f"not a {kind} of shape {tuple(pixels.shape)}: save it first" in message


def test_a_tilde_in_any_request_path_is_the_home_folder(tmp_path, monkeypatch):
    from pathlib import Path

    from k6serve.request_arguments import split_kwargs

    monkeypatch.setenv("HOME", str(tmp_path))
    params, output = split_kwargs({"prompt": "x", "image_path": "~/a.png", "output_path": Path("~/out")})
    assert params.image_path == str(tmp_path / "a.png") and output.output_path == str(tmp_path / "out")
    params, _ = split_kwargs({"video_path": Path("~/in.mp4")})
    assert params.video_path == str(tmp_path / "in.mp4")


def test_a_negative_prompt_ignored_by_super_resolution_is_said():
    from k6serve.request_resolution import resolve_upscale

    _, notes = resolve_upscale(SamplingParams(video_path="a.mp4", negative_prompt="blurry"),
                               VARIANTS["vsr-distilled2steps"])
    assert "takes no negative_prompt; it was ignored" in " ".join(notes)


class ClosingStepWorker(StepWorker):
    """StepWorker that records what it ran and whether the engine closed it (as it stops worker processes)."""

    def __init__(self) -> None:
        super().__init__()
        self.closed = False
        self.ran: list[SamplingParams] = []

    def run(self, params, output, on_step=None):
        self.ran.append(params)
        return super().run(params, output, on_step)

    def close(self) -> None:
        self.closed = True


def test_a_request_that_is_not_a_mapping_says_how_to_pass_it():
    """generate("a cat") failed with "'str' object is not a mapping", which names neither the argument nor the fix."""
    from k6serve.api import DiffGenerator

    with DiffGenerator(Engine(fake_config(), worker=StepWorker())) as generator:
        with pytest.raises(ValueError, match=r"^generate\(\) takes the request as a dict .* got 'a cat' \(str\); "
                                             r"e\.g\. generate\(prompt='a cat'\)"):
            generator.generate("a cat")
        with pytest.raises(ValueError, match=r"got \['a cat'\] \(list\)"):
            generator.generate(["a cat"])


def test_a_request_key_that_is_not_a_name_says_so():
    """{5: 1} failed inside difflib's "did you mean" as a TypeError "'int' object is not iterable"."""
    from k6serve.api import DiffGenerator

    with DiffGenerator(Engine(fake_config(), worker=StepWorker())) as generator:
        with pytest.raises(ValueError, match=r"request keys are parameter names \(strings, e\.g\. 'prompt'\), got 5 "
                                             r"\(int\)"):
            generator.generate({"prompt": "x", 5: 1}, save_output=False)


def test_an_option_given_to_the_wrong_call_says_which_call_takes_it():
    """An engine option given to generate(), or a request parameter to from_pretrained(), was only "unknown": the
    user learnt it is misplaced only by reading the other call's list."""
    from k6serve.api import DiffGenerator
    from k6serve.engine_arguments import build_engine_config

    worker = ClosingStepWorker()
    with DiffGenerator(Engine(fake_config(), worker=worker)) as generator:
        with pytest.raises(ValueError, match=r"^num_gpus is an engine option, fixed when the model loads: pass it to "
                                             r"DiffGenerator\.from_pretrained\(\), not to generate\(\)\.$"):
            generator.generate(prompt="x", num_gpus=2, save_output=False)
    assert worker.ran == []
    with pytest.raises(ValueError, match=r"^seed is a request parameter: pass it to generate\(\), not to "
                                         r"from_pretrained\(\)\.$"):
        build_engine_config("demo", seed=3)


def test_a_misspelt_option_names_the_one_it_resembles():
    from k6serve.engine_arguments import build_engine_config
    from k6serve.request_arguments import split_kwargs

    with pytest.raises(ValueError, match=r"^Unknown sampling parameter\(s\) \['num_inference_step'\] \(did you mean "
                                         r"'num_inference_steps'\?\)\. Valid parameters: "):
        split_kwargs({"prompt": "x", "num_inference_step": 2})
    with pytest.raises(ValueError, match=r"^Unknown engine option 'num_gpu' \(did you mean 'num_gpus'\?\)\. Valid "):
        build_engine_config("demo", num_gpu=1)
    with pytest.raises(ValueError, match=r"^Unknown sampling parameter\(s\) \['zzz'\]\. Valid parameters: "):
        split_kwargs({"prompt": "x", "zzz": 2})  # nothing close: no guess


def test_numpy_scalars_are_the_python_values_they_stand_for_in_every_option():
    """numpy ints were taken for the sampling parameters only: np.bool_ (from a comparison or arr.any()) was refused
    as "must be true or false, got np.True_ (bool)", and every numpy value given to from_pretrained as not an
    integer, not a number, or not true or false."""
    import numpy as np

    from k6serve.engine_arguments import build_engine_config
    from k6serve.request_arguments import split_kwargs

    params, output = split_kwargs({"prompt": "x", "save_output": np.bool_(False), "return_frames": np.bool_(True),
                                   "guidance_scale": np.float32(1.0), "seed": np.int64(3)})
    assert output.save_output is False and output.return_frames is True
    assert type(params.guidance_scale) is float and type(params.seed) is int
    config = build_engine_config("demo", num_gpus=np.int64(1), compile_vae=np.bool_(True), lora_path="a.safetensors",
                                 lora_scale=np.float32(0.5))
    assert type(config.parallel.num_gpus) is int and config.runtime.compile_vae is True
    assert config.model.lora_scale == 0.5


def test_none_is_the_default_for_the_output_keys_too():
    """None stands for "the default" in every request key, but save_output=None silently wrote no file (the video
    was lost) and output_path=None failed with "expected str, bytes or os.PathLike object, not NoneType"."""
    from k6serve.request_arguments import split_kwargs

    _, output = split_kwargs({"prompt": "x", "save_output": None, "output_path": None, "output_file_name": None,
                              "return_frames": None, "return_file_paths_only": None})
    assert (output.save_output, output.output_path, output.return_frames) == (True, "outputs", False)


def test_generate_after_shutdown_says_so_and_creates_nothing(tmp_path):
    """After shutdown() (or the `with` block) generate created the output folder, then failed with "The engine has
    been shut down.", which says neither which object nor what to do."""
    from k6serve.api import DiffGenerator

    with DiffGenerator(Engine(fake_config(), worker=StepWorker())) as generator:
        pass
    with pytest.raises(RuntimeError, match=r"^This DiffGenerator has been shut down \(shutdown\(\) or the end of its "
                                           r"`with` block\); load a new one with DiffGenerator\.from_pretrained"):
        generator.generate(prompt="x", output_path=str(tmp_path / "new"))
    assert not (tmp_path / "new").exists()
    # The LoRA and memory methods said only "The engine has been shut down."
    for call in (lambda: generator.set_lora("x"), generator.merge_lora_weights, generator.unmerge_lora_weights,
                 lambda: generator.unload_lora("x"), generator.list_loras, generator.release_memory,
                 generator.resume_memory):
        with pytest.raises(RuntimeError, match=r"^This DiffGenerator has been shut down"):
            call()
    generator.shutdown()  # again: nothing to do


def test_a_progress_callback_that_cannot_be_called_is_refused_before_the_run():
    from k6serve.api import DiffGenerator

    worker = ClosingStepWorker()
    with DiffGenerator(Engine(fake_config(), worker=worker)) as generator:
        with pytest.raises(ValueError, match=r"^on_progress must be a function called as on_progress\(step, total\), "
                                             r"got 5 \(int\)\.$"):
            generator.generate(prompt="x", save_output=False, on_progress=5)
    assert worker.ran == []


def test_a_dropped_generator_stops_its_worker():
    """A generator dropped without shutdown() (a notebook cell run again rebinds its name) kept its worker processes,
    and their GPU memory, until the interpreter exited."""
    import gc

    from k6serve.api import DiffGenerator

    worker = ClosingStepWorker()
    generator = DiffGenerator(Engine(fake_config(), worker=worker))
    generator.generate(prompt="x", save_output=False)
    del generator
    gc.collect()
    assert worker.closed


@pytest.mark.multiprocess
def test_a_dropped_generator_stops_its_worker_processes():
    import gc

    from test_launch import FakeRankWorker, make_config

    from k6serve.api import DiffGenerator
    from k6serve.runtime.process_group_worker import MultiProcessWorker

    worker = MultiProcessWorker(make_config(num_gpus=1), build_rank_worker=FakeRankWorker)
    processes = list(worker._processes.values())
    generator = DiffGenerator(Engine(worker.config, worker=worker))
    assert generator.generate(prompt="cat", num_inference_steps=1, save_output=False).num_frames > 0
    del generator, worker
    gc.collect()
    assert all(not process.is_alive() for process in processes)


def test_the_result_repr_summarises_its_arrays():
    """print(result) printed the frames' and the waveform's values: some 60 lines of pixels before the timings."""
    import numpy as np

    result = VideoResult(output_file_path="out.mp4", frames=np.zeros((17, 64, 96, 3), np.uint8),
                         audio=np.zeros(31744, np.float32), audio_sample_rate=44100, fps=24.0, seed=42,
                         timings={"total": 1.5}, peak_memory_mb=10.0, num_frames=17, height=64, width=96)
    text = repr(result)
    assert "\n" not in text and len(text) < 400
    assert "frames=<uint8 array (17, 64, 96, 3)>" in text and "audio=<float32 array (31744,)>" in text
    assert "output_file_path='out.mp4'" in text and "timings={'total': 1.5}" in text
    assert "frames=None" in repr(VideoResult(**{**vars(result), "frames": None, "audio": None}))


def test_sglangs_result_fields_say_what_the_result_holds_instead():
    """SGLang's GenerationResult has size, samples, metrics, prompt_index: `result.size` was a bare AttributeError."""
    import copy
    import pickle

    result = VideoResult(output_file_path=None, frames=None, audio=None, audio_sample_rate=44100, fps=24.0, seed=42,
                         timings={}, peak_memory_mb=1.0, num_frames=5, height=32, width=32)
    with pytest.raises(AttributeError) as raised:
        result.size
    assert str(raised.value) == ("'VideoResult' object has no attribute 'size' (SGLang's result field; k6serve's are "
                                 "height, width and num_frames)")
    with pytest.raises(AttributeError, match=r"'prompt_index' \(SGLang's result field; a list of prompts returns"):
        result.prompt_index
    with pytest.raises(AttributeError, match=r"^'VideoResult' object has no attribute 'sizee'$"):
        result.sizee
    # Still a plain object otherwise: hasattr, pickle and copy see no attribute that is not there.
    assert not hasattr(result, "samples") and pickle.loads(pickle.dumps(result)).seed == copy.deepcopy(result).seed


def test_close_is_shutdown():
    """contextlib.closing (and users of other Python resources) call close(); the seed names it shutdown()."""
    import contextlib

    from k6serve.api import DiffGenerator

    worker = ClosingStepWorker()
    with contextlib.closing(DiffGenerator(Engine(fake_config(), worker=worker))) as generator:
        generator.generate(prompt="x", save_output=False)
    with pytest.raises(RuntimeError, match=r"^This DiffGenerator has been shut down"):
        generator.generate(prompt="x", save_output=False)
    assert worker.closed
    generator.close()  # again: nothing to do


def test_a_second_generator_loading_beside_a_running_one_is_warned_about(monkeypatch, caplog):
    """A notebook cell run again loads the new model while its name still holds the old generator: both models are
    in memory until the load ends, so the load says so first, naming the running ones. Shut down, they are not
    named again."""
    import gc
    import logging

    from k6serve import api
    from k6serve.api import DiffGenerator

    class FakeEngine:
        num_replicas = 1

        def __init__(self, config, worker=None):
            self.config = config
            self.dead = []

        def dead_replicas(self):
            return self.dead

        def shutdown(self):
            pass

    monkeypatch.setattr(api, "Engine", FakeEngine)
    monkeypatch.setattr(api, "_RUNNING", type(api._RUNNING)())
    caplog.set_level(logging.WARNING, logger="k6serve.api")
    first = DiffGenerator.from_pretrained("demo", device="cpu")
    assert not [r for r in caplog.records if "still hold" in r.getMessage()]
    second = DiffGenerator.from_pretrained("demo", device="cpu")
    warned = [r.getMessage() for r in caplog.records if "still hold" in r.getMessage()]
    assert warned == ["1 generator(s) loaded earlier ('demo') still hold their model and its memory until shut down; "
                      "this one loads beside them. Call shutdown() on one you are replacing first (or open generators "
                      "with `with DiffGenerator.from_pretrained(...) as generator:`)."]
    caplog.clear()
    first.shutdown()
    del second
    gc.collect()  # a dropped generator is shut down by its finalizer, and is no longer running either
    with DiffGenerator.from_pretrained("demo", device="cpu") as third:
        assert not [r for r in caplog.records if "still hold" in r.getMessage()]
        # One whose every replica died (killed by the OOM killer) holds nothing: it was counted as holding its model.
        third.engine.dead = ["replica 0 (ranks [0]) died while idle: rank 0 exited with code -9"]
        with DiffGenerator.from_pretrained("demo", device="cpu"):
            assert not [r for r in caplog.records if "still hold" in r.getMessage()]


def test_a_request_without_a_file_returns_its_frames_unless_told_not_to():
    """save_output=False with neither return flag returned neither a file nor frames: the run's video was lost."""
    from k6serve.request_arguments import split_kwargs

    _, output = split_kwargs({"prompt": "cat", "save_output": False})
    assert output.return_frames is True
    _, output = split_kwargs({"prompt": "cat", "save_output": False, "return_frames": False})
    assert output.return_frames is False  # a timing run says so
    _, output = split_kwargs({"prompt": "cat", "save_output": False, "return_file_paths_only": True})
    assert output.return_frames is False  # the seed's flag, said explicitly
    _, output = split_kwargs({"prompt": "cat"})
    assert output.return_frames is False  # with a file, the path is the result
    _, output = split_kwargs({"prompt": "cat", "save_output": None})
    assert output.return_frames is False  # None is the default: a file


@pytest.mark.parametrize(
    "call, message",
    [
        (dict(model_path="demo", local_mode=False),
         r"^local_mode=False \(SGLang's client of a running server's scheduler\) is not k6serve's: .*docs/http-api.md"),
        (dict(model_path="demo", local_mode="yes"), r"^local_mode must be True or False, got 'yes' \(str\)\.$"),
        (dict(), r"^from_pretrained\(\) needs the model: model_path='demo'"),
        (dict(server_args={"num_gpus": 1}), r"^from_pretrained\(\) needs the model"),
        (dict(model_path="demo", server_args={"model_path": "other"}),
         r"^from_pretrained\(\) got two models: model_path='demo' and server_args's model_path='other'; pass one\.$"),
        (dict(server_args=["demo"]), r"^server_args takes the engine options as a dict of keyword names, .* got list;"),
        (dict(server_args={"model_path": "demo", 1: 2}), r"^server_args's keys are engine option names"),
        # server_args's options get the keyword arguments' checks and wording.
        (dict(server_args={"model_path": "demo", "num_gpus": "1"}), r"^num_gpus must be an integer, got '1'"),
        (dict(server_args={"model_path": "demo", "enable_torch_compile": True}),
         r"^Unknown engine option 'enable_torch_compile' \(SGLang's option; k6serve compiles"),
    ],
)
def test_sglangs_server_args_and_local_mode_are_checked_before_anything_starts(call, message, no_ranks):
    from k6serve.api import DiffGenerator

    with pytest.raises(ValueError, match=message):
        DiffGenerator.from_pretrained(**call)


def test_server_args_are_the_engine_options_under_the_keyword_arguments(monkeypatch):
    from k6serve import api
    from k6serve.api import DiffGenerator

    loaded = {}
    monkeypatch.setattr(api.DiffGenerator, "_load", classmethod(
        lambda cls, model_path, options, wording: loaded.update(model_path=model_path, options=options)))
    DiffGenerator.from_pretrained(server_args={"model_path": "demo", "num_gpus": 2, "dp_size": 2}, dp_size=1,
                                  local_mode=True)
    assert loaded == {"model_path": "demo", "options": {"num_gpus": 2, "dp_size": 1}}
    DiffGenerator.from_server_args({"model_path": "demo", "warmup_mode": "off"})
    assert loaded == {"model_path": "demo", "options": {"warmup_mode": "off"}}
    DiffGenerator.from_pretrained("demo", server_args={"model_path": "demo"}, local_mode=np.True_)  # the same model
    assert loaded == {"model_path": "demo", "options": {}}


def test_a_sampling_params_of_a_prompt_list_points_to_generates_list():
    # generate(prompt=[...]) runs one request per prompt; SamplingParams(prompt=[...]) said only "must be a string".
    with pytest.raises(ValueError, match=r"^prompt must be a string, got a list of 2: a SamplingParams is one request; "
                                         r"pass the list to generate\(prompt=\[\.\.\.\]\), which runs one request "
                                         r"per prompt\.$"):
        SamplingParams(prompt=["A cat", "A dog"])


@pytest.mark.parametrize("sequence", [list, tuple])
def test_set_lora_takes_relative_adapter_paths_from_the_callers_folder_in_a_tuple_too(tmp_path, monkeypatch,
                                                                                       sequence):
    # After a %cd a list's relative paths were made the caller's; a tuple's went to the workers as given, relative
    # to the folder the workers started in.
    from k6serve.api import DiffGenerator

    first, second = tmp_path / "first", tmp_path / "second"
    first.mkdir()
    second.mkdir()
    for name in ("a.safetensors", "b.safetensors"):
        (second / name).write_bytes(b"")
    monkeypatch.chdir(first)
    with DiffGenerator(Engine(fake_config(), worker=StepWorker())) as generator:
        monkeypatch.chdir(second)
        operations = []
        monkeypatch.setattr(generator.engine, "lora", lambda operation: operations.append(operation) or {})
        generator.set_lora(sequence(["a", "b"]), sequence(["a.safetensors", "b.safetensors"]))
    [operation] = operations
    assert [spec.path for spec in operation.specs] == [str(second / "a.safetensors"), str(second / "b.safetensors")]
