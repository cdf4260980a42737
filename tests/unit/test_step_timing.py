"""Per-step denoise timings and the post-compilation GC freeze (runtime diagnostics that CI can check on CPU)."""

from __future__ import annotations

import gc

import pytest
import torch

from k6serve.runtime import gc_freeze
from k6serve.runtime.gc_freeze import CompileGcFreezer


def test_step_timings_bound_the_denoise_time(tiny_distill_dir):
    from k6serve.engine_arguments import build_engine_config
    from k6serve.request_arguments import split_kwargs
    from k6serve.runtime.worker import ModelWorker

    worker = ModelWorker(build_engine_config(str(tiny_distill_dir), device="cpu"))
    params, output = split_kwargs({"prompt": "x", "height": 32, "width": 32, "num_frames": 5, "save_output": False,
                                   "num_inference_steps": 3})
    try:
        timings = worker.run(params, output).timings
        assert 0 < timings["denoise_step_median"] <= timings["denoise_step_max"] <= timings["denoise"]
        assert "gc_freeze" in timings  # the first request always freezes what loading left behind
        assert timings["graphs_compiled"] == 0  # eager model: no dynamo graph in the request
        assert "gc_freeze" not in worker.run(params, output).timings  # nothing was compiled since
        from k6serve.runtime import worker as worker_module

        counts = iter([5, 7])  # before the pipeline and after it: two graphs compiled meanwhile
        original = worker_module.compiled_graph_count
        worker_module.compiled_graph_count = lambda: next(counts)
        try:
            assert worker.run(params, output).timings["graphs_compiled"] == 2
        finally:
            worker_module.compiled_graph_count = original
    finally:
        gc.unfreeze()  # the rest of the test session keeps the usual collector


def test_freezer_freezes_once_per_new_compilation(monkeypatch):
    graphs = [0]
    monkeypatch.setattr(gc_freeze, "compiled_graph_count", lambda: graphs[0])
    freezer = CompileGcFreezer()
    try:
        assert freezer.freeze_if_compiled() is not None  # first call: model loading created the objects
        frozen = gc.get_freeze_count()
        assert frozen > 0
        assert freezer.freeze_if_compiled() is None
        graphs[0] = 3  # the last request compiled three graphs
        assert freezer.freeze_if_compiled() is not None
        assert freezer.freeze_if_compiled() is None
    finally:
        gc.unfreeze()


def test_compiled_graph_count_follows_dynamo():
    before = gc_freeze.compiled_graph_count()
    torch.compile(lambda x: x * 2 + 1, backend="eager")(torch.ones(3))
    assert gc_freeze.compiled_graph_count() == before + 1
    torch._dynamo.reset()


@pytest.mark.parametrize("steps", [1, 4])
def test_denoise_reports_one_duration_per_step(steps):
    from k6serve.pipelines.denoise import _StepClock

    clock = _StepClock(torch.device("cpu"))
    for _ in range(steps):
        clock.mark()
    durations = clock.durations()
    assert len(durations) == steps and all(d >= 0 for d in durations)


def test_ulysses_with_compiled_blocks_warns_that_output_is_not_bit_exact(tiny_distill_dir, monkeypatch, caplog):
    from k6serve.engine_arguments import build_engine_config
    from k6serve.runtime import worker as worker_module
    from k6serve.speed.performance_mode import PerformanceReport

    monkeypatch.setattr(worker_module, "apply_performance_mode",
                        lambda *args, **kwargs: PerformanceReport(mode="speed", device="cuda", num_compiled_blocks=6))
    config = build_engine_config(str(tiny_distill_dir), device="cpu", num_gpus=2, ulysses_degree=2)
    with caplog.at_level("WARNING"):
        worker_module.ModelWorker(config)
    assert "--performance-mode balanced for bit-exact output" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING"):
        worker_module.ModelWorker(build_engine_config(str(tiny_distill_dir), device="cpu"))
    assert "bit-exact" not in caplog.text


def test_frozen_objects_are_released_at_exit_so_extensions_report_no_leaks():
    """Frozen objects are never collected at shutdown; Triton's nanobind bindings (>= 3.9) then print pages of
    "leaked instance" reports after every run. The freezer hands them back to the collector at exit."""
    import subprocess
    import sys

    pytest.importorskip("triton")
    code = ("import triton.language\n"
            "from k6serve.runtime.gc_freeze import CompileGcFreezer\n"
            "assert CompileGcFreezer().freeze_if_compiled() is not None\n")
    completed = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True,
                               timeout=120)
    assert completed.returncode == 0, completed.stderr[-2000:]
    assert "leaked" not in completed.stderr, completed.stderr[:500]
