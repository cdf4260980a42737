"""scripts/gpu_cudnn_autotune.py's measurements on CPU: each fresh thread's output and two calls in one thread are
told apart, and a call that fails in its thread is an error, not a missing digest."""

import sys
import threading
from pathlib import Path

import pytest
import torch

sys.path.append(str(Path(__file__).parents[2] / "scripts"))  # appended: no script shadows a module
import gpu_cudnn_autotune as autotune  # noqa: E402 (the scripts folder first)


def test_outputs_are_counted_per_fresh_thread_and_within_one_thread():
    # A stand-in for torch's per-thread choice: each thread's first call fixes what its calls return.
    chosen = threading.local()
    threads_seen: list[int] = []

    def choice():
        if not hasattr(chosen, "value"):
            threads_seen.append(1)
            chosen.value = float(len(threads_seen))
        return torch.full((3,), chosen.value)

    result = autotune.distinct_outputs(choice)
    assert result["distinct_fresh"] == 3 and result["one_thread_same"]
    assert len(set(result["fresh_threads"] + result["one_thread"])) == 4
    assert autotune.distinct_outputs(lambda: torch.ones(3))["distinct_fresh"] == 1


def test_a_failing_call_is_an_error_and_timing_keeps_the_first_call_apart():
    def fails():
        raise ValueError("no")

    with pytest.raises(RuntimeError, match="failed in its thread"):
        autotune._in_new_thread(fails)
    calls = []
    timing = autotune.timed(lambda: calls.append(1), torch.device("cpu"), 3)
    assert len(calls) == 4 and len(timing["times_s"]) == 4 and timing["median_s"] >= 0
