"""The Python API inside someone else's program: callbacks that call back, an interrupted shutdown, a caller that
changes folder, and what starting the workers leaves in the host process."""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import threading
import time

import pytest

from k6serve import DiffGenerator
from k6serve.engine_arguments import build_engine_config
from k6serve.runtime import launch
from k6serve.runtime.engine import Engine
from k6serve.runtime.worker import ModelWorker

SMALL = {"prompt": "x", "height": 32, "width": 32, "num_frames": 5, "save_output": False}


def _generator(tiny_distill_dir) -> DiffGenerator:
    config = build_engine_config(str(tiny_distill_dir), device="cpu")
    return DiffGenerator(Engine(config, worker=ModelWorker(config)))


def test_a_callback_that_waits_on_the_generator_is_refused_not_deadlocked(tiny_distill_dir):
    """on_progress runs on the engine's thread: a generate() (or a LoRA call) from it waited for itself forever,
    and a shutdown() from it spent the generator while its worker kept running."""
    errors: list[str] = []
    with _generator(tiny_distill_dir) as generator:
        def callback(step: int, total: int) -> None:
            if step == 1:
                for call in (lambda: generator.generate(SMALL), generator.list_loras, generator.shutdown):
                    try:
                        call()
                    except RuntimeError as exc:
                        errors.append(str(exc))

        generator.generate(SMALL, on_progress=callback)
        assert [error.split(" from ")[0] for error in errors] == ["a request was made", "a LoRA or memory call was made",
                                                                  "shutdown() was called"]
        assert "it would wait for itself forever" in errors[0]
        generator.generate(SMALL)  # still serving

        async def async_callback(step: int, total: int) -> None:
            pass

        with pytest.raises(ValueError, match="on_progress is an async function; it is called on the engine's "
                                             "thread, outside any event loop"):
            generator.generate(SMALL, on_progress=async_callback)


def test_a_shutdown_interrupted_while_it_waits_is_finished_by_the_next_call(tiny_distill_dir):
    """A Ctrl-C while shutdown() waited for a running request spent it: the next call returned at once and the
    worker's ranks kept running (a notebook's GPU memory held until the kernel restarts)."""
    generator = _generator(tiny_distill_dir)
    started = threading.Event()

    def slow(step: int, total: int) -> None:
        started.set()
        time.sleep(0.3)

    runner = threading.Thread(target=lambda: generator.generate(SMALL, on_progress=slow), daemon=True)
    runner.start()
    assert started.wait(60)
    closed = []
    generator.engine.worker.close = lambda *args, **kwargs: closed.append(True)
    threading.Timer(0.2, signal.pthread_kill, (threading.main_thread().ident, signal.SIGINT)).start()
    with pytest.raises(KeyboardInterrupt):
        generator.shutdown()
    assert closed == []  # interrupted before the worker closed
    generator.shutdown()
    runner.join(60)
    assert closed == [True] and not generator._shutdown.alive
    generator.shutdown()  # done: nothing more
    assert closed == [True]
    with pytest.raises(RuntimeError, match="has been shut down"):
        generator.generate(SMALL)


def test_relative_paths_are_the_callers_after_it_changes_folder(tiny_distill_dir, tmp_path, monkeypatch):
    """The workers keep the folder they started in: after a %cd the caller's check made an empty folder here, the
    MP4 went there, and the returned relative path did not exist from here."""
    first, second = tmp_path / "first", tmp_path / "second"
    first.mkdir()
    second.mkdir()
    monkeypatch.chdir(first)
    with _generator(tiny_distill_dir) as generator:
        monkeypatch.chdir(second)
        result = generator.generate({**SMALL, "save_output": True, "output_path": "out"})
        assert result.output_file_path.startswith(str(second / "out") + os.sep)
        assert os.path.isfile(result.output_file_path) and list(first.iterdir()) == []
        default = generator.generate({**SMALL, "save_output": True})
        assert default.output_file_path.startswith(str(second / "outputs") + os.sep)
        # A URL stays a URL, refused as one: made absolute it was "<folder>/https:/example.com/a.png", which
        # "does not exist".
        with pytest.raises(ValueError, match="fetches no URLs"):
            generator.generate({**SMALL, "image_path": "https://example.com/a.png"})
        monkeypatch.chdir(first)  # back where it started: paths are left as given
        same = generator.generate({**SMALL, "save_output": True, "output_path": "out"})
        assert same.output_file_path.startswith("out" + os.sep)


def test_starting_workers_leaves_the_hosts_start_method_unset():
    """CPython's spawn preparation fixes the default start method: a host's set_start_method("spawn") after a
    generator loaded raised "context has already been set"."""
    before = multiprocessing.get_start_method(allow_none=True)
    try:
        multiprocessing.set_start_method(None, force=True)
        with launch._start_method_kept():
            multiprocessing.get_start_method()  # what spawn's preparation does
        assert multiprocessing.get_start_method(allow_none=True) is None
        multiprocessing.set_start_method("fork", force=True)
        with launch._start_method_kept():
            pass
        assert multiprocessing.get_start_method(allow_none=True) == "fork"  # the host's own choice is kept
    finally:
        multiprocessing.set_start_method(before, force=True)


def test_the_ranks_log_at_the_hosts_level_for_k6serve(monkeypatch):
    root, package = logging.getLogger(), logging.getLogger("k6serve")
    monkeypatch.setattr(root, "handlers", [])
    monkeypatch.setattr(package, "level", logging.NOTSET)
    assert launch.parent_log_level() == logging.INFO  # nothing configured: the ranks' INFO lines still show
    monkeypatch.setattr(package, "level", logging.ERROR)
    assert launch.parent_log_level() == logging.ERROR  # a host quieting k6serve quiets its ranks too


def test_closing_during_start_up_ends_the_thread_waiting_for_the_leaders():
    """A Ctrl-C before the ranks connected closed the listener, which does not wake a blocked accept() on Linux:
    each interrupted load left the thread and two descriptors for good."""
    import queue
    from multiprocessing.connection import Client, Listener
    from types import SimpleNamespace

    from k6serve.runtime.launch import LOCAL_HOST
    from k6serve.runtime.process_group_worker import MultiProcessWorker

    worker = MultiProcessWorker.__new__(MultiProcessWorker)
    worker._listener = Listener((LOCAL_HOST, 0), authkey=b"k" * 32)
    worker._listener_address = worker._listener.address
    worker._closed = False
    worker.layout = SimpleNamespace(dp=2)
    connections: queue.Queue = queue.Queue()
    thread = threading.Thread(target=worker._accept_leaders, args=(connections,), daemon=True)
    thread.start()
    leader = Client(worker._listener.address, authkey=b"k" * 32)  # one of two leaders arrives
    assert connections.get(timeout=10) is not None
    worker._closed = True
    worker._wake_accept()
    thread.join(10)
    assert not thread.is_alive()
    worker._listener.close()
    worker._wake_accept()  # again, after the close (a second close()): nothing to wake, no error
    leader.close()



def test_agenerate_awaits_the_same_request_and_a_cancelled_task_cancels_it(tiny_distill_dir, tmp_path):
    """`await asyncio.to_thread(generate, ...)` under asyncio.wait_for's timeout (or a cancelled task) left the
    request running to its end: its file written, the next request waiting behind it. agenerate cancels it."""
    import asyncio

    import numpy as np

    with _generator(tiny_distill_dir) as generator:
        awaited = asyncio.run(generator.agenerate(SMALL, seed=7))
        assert np.array_equal(awaited.frames, generator.generate(SMALL, seed=7).frames)
        with pytest.raises(ValueError, match="prompt is required"):
            asyncio.run(generator.agenerate({**SMALL, "prompt": ""}))

        steps: list[int] = []

        async def too_long() -> None:
            await asyncio.wait_for(generator.agenerate({**SMALL, "save_output": True, "num_inference_steps": 1000},
                                                       output_path=str(tmp_path), seed=1,
                                                       on_progress=lambda step, total: steps.append(step)),
                                   timeout=1.0)

        with pytest.raises(TimeoutError):
            asyncio.run(too_long())
        reported = len(steps)
        started = time.monotonic()
        generator.generate(SMALL)  # not behind the cancelled request's remaining steps
        assert time.monotonic() - started < 30
        assert 0 < reported < 1000 and len(steps) <= reported + 1  # no callback after it was abandoned
        assert list(tmp_path.iterdir()) == []  # no MP4, no part file

        async def both() -> list:
            return await asyncio.gather(generator.agenerate(SMALL, seed=1), generator.agenerate(SMALL, seed=2))

        first, second = asyncio.run(both())
        assert (first.seed, second.seed) == (1, 2)
        # Errors name the keyword, as generate's do (its checks run before anything is queued).
        with pytest.raises(ValueError, match="num_inference_steps must be between 1 and 1000"):
            asyncio.run(generator.agenerate(SMALL, num_inference_steps=0))
        assert repr(generator) == f"<DiffGenerator {str(tiny_distill_dir)!r}, running>"
    assert repr(generator) == f"<DiffGenerator {str(tiny_distill_dir)!r}, shut down>"


def test_progress_bar_shows_the_steps_beside_on_progress(tiny_distill_dir, capsys):
    """A notebook user saw nothing for the minute of a request (diffusers' pipeline shows its bar); the CLI's bar
    is one keyword away, and on_progress still runs beside it."""
    seen = []
    with _generator(tiny_distill_dir) as generator:
        generator.generate({**SMALL, "num_inference_steps": 3}, progress_bar=True,
                           on_progress=lambda step, total: seen.append(step))
        err = capsys.readouterr().err
        assert "denoising: 3/3 steps" in err  # plain lines: pytest's stderr is no terminal (nor a notebook)
        assert seen[:3] == [1, 2, 3]
        generator.generate(SMALL)
        assert "denoising" not in capsys.readouterr().err  # off unless asked for
        with pytest.raises(ValueError, match="progress_bar must be True or False, got 'yes'"):
            generator.generate(SMALL, progress_bar="yes")
