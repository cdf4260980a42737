"""`Engine(config)` on the multi-process runtime with the real per-rank worker (tiny checkpoint, CPU, gloo).

The default engine starts `MultiProcessWorker` for every N: one rank and Ulysses2 give the same frames and waveform
bit for bit (through the whole stack: request broadcast, parallelised DiT, leader-only result), a SIGKILLed rank
fails the running request instead of hanging, dp=2 replicas serve two requests at once through the engine's loop
threads, and shutdown() stops the processes.
"""

from __future__ import annotations

import dataclasses
import os
import re
import signal
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from test_launch import TIMEOUT_S, FakeRankWorker, PackageLessRankWorker, make_config, note

from k6serve.config import EngineConfig, ModelConfig, ParallelConfig, RuntimeConfig
from k6serve.request import OutputOptions, SamplingParams
from k6serve.runtime.engine import Engine
from k6serve.runtime.process_group_worker import MultiProcessWorker

pytestmark = pytest.mark.multiprocess
PARAMS = SamplingParams(prompt="a red fox runs", seed=5, height=48, width=80, num_frames=5, num_inference_steps=2,
                        guidance_scale=4.0)
FRAMES_ONLY = OutputOptions(save_output=False, return_frames=True)


def real_config(folder: Path, **parallel) -> EngineConfig:
    return EngineConfig(
        model=ModelConfig(model_path=str(folder)),
        parallel=ParallelConfig(dist_timeout_s=60.0, **parallel),
        runtime=RuntimeConfig(device="cpu"),
    )


# Bitwise equality needs the same CPU kernels on both sides: ranks split the host's cores (2 ranks on 2 cores: one
# thread each) while one rank takes them all, and on an AVX2 CPU (AMD EPYC) a matmul's sums depend on its thread
# count. One thread in every rank, as on a GPU each rank's kernels are the one-GPU kernels.
@pytest.fixture(scope="module")
def one_rank_result(tiny_pro_dir):
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("OMP_NUM_THREADS", "1")  # read by the spawned rank at its start
        engine = Engine(real_config(tiny_pro_dir))
    try:
        assert isinstance(engine.worker, MultiProcessWorker) and len(engine.worker.pids) == 1
        return engine.generate(PARAMS, FRAMES_ONLY)
    finally:
        engine.shutdown()


def test_ulysses2_engine_equals_one_rank_and_a_killed_rank_fails_the_request(tiny_pro_dir, one_rank_result,
                                                                             monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    engine = Engine(real_config(tiny_pro_dir, num_gpus=2, ulysses_degree=2))
    worker = engine.worker
    try:
        result = engine.generate(PARAMS, FRAMES_ONLY)
        assert result.frames.shape == one_rank_result.frames.shape == (5, 48, 80, 3)
        assert np.array_equal(result.frames, one_rank_result.frames)
        assert np.array_equal(result.audio, one_rank_result.audio)

        victim = worker.pids[1]

        def kill_at_first_step(step: int, total: int) -> None:
            if step == 1:
                os.kill(victim, signal.SIGKILL)

        job = engine.submit(dataclasses.replace(PARAMS, num_inference_steps=20), FRAMES_ONLY,
                            on_progress=kill_at_first_step)
        with pytest.raises(RuntimeError, match=r"replica 0 .* died .*rank 1 .*exited with code -9"):
            job.future.result(timeout=60)
    finally:
        engine.shutdown()
    assert all(not process.is_alive() for process in worker._processes.values())


def test_engine_runs_dp_replicas_at_once(tmp_path: Path):
    worker = MultiProcessWorker(make_config(num_gpus=2, dp_size=2), build_rank_worker=FakeRankWorker)
    engine = Engine(worker.config, worker=worker)
    try:
        marker = tmp_path / "second-started"
        # The first request waits until the second has started: it only finishes if the engine runs both at once.
        first = engine.submit(SamplingParams(prompt=f"wait-for:{marker}", num_inference_steps=2))
        time.sleep(0.2)
        second = engine.submit(SamplingParams(prompt=f"touch:{marker}", num_inference_steps=2))
        results = [job.future.result(timeout=TIMEOUT_S + 10) for job in (first, second)]
        assert {note(result, "replica") for result in results} == {"0", "1"}
    finally:
        engine.shutdown()
    assert all(not process.is_alive() for process in worker._processes.values())
    # Each replica's socket too: an engine kept after its shutdown (a notebook's output history) held them open.
    assert all(replica.connection.closed for replica in worker._replicas)


class PrecisionRankWorker(FakeRankWorker):
    precision = "bfloat16"  # as ModelWorker.precision: the dtype the rank resolved for the weights


def test_the_ranks_precision_reaches_the_engine():
    # GET /v1/models reports the DiT's and the VAE's precision (SGLang's card has them): the dtype the ranks
    # resolved, which only they know (`--dtype auto` is bfloat16 on a GPU, float32 on the CPU).
    worker = MultiProcessWorker(make_config(), build_rank_worker=PrecisionRankWorker)
    engine = Engine(worker.config, worker=worker)
    try:
        assert engine.precision == "bfloat16"
    finally:
        engine.shutdown()


def test_a_replica_killed_while_running_says_how_it_died(tmp_path: Path):
    # GET /health's dead_replicas (docs/http-api.md: "one line per dead replica saying how it died") said only
    # "replica 0 (ranks [0]) died running request 0" for a replica killed mid-request; the idle case said how.
    worker = MultiProcessWorker(make_config(), build_rank_worker=FakeRankWorker)
    engine = Engine(worker.config, worker=worker)
    try:
        [pid] = worker.pids.values()
        job = engine.submit(SamplingParams(prompt=f"wait-for:{tmp_path / 'never'}", num_inference_steps=1))
        time.sleep(1.0)  # the rank is inside the request, waiting for the file
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(RuntimeError, match="died while running it"):
            job.future.result(timeout=TIMEOUT_S)
        [note_0] = engine.dead_replicas()
        assert re.search(rf"replica 0 .*died running request \d+: rank 0 \(pid {pid}\) exited with code -9", note_0)
    finally:
        engine.shutdown()


def test_a_rank_that_hangs_is_named_and_not_called_out_of_memory(tmp_path: Path):
    # A stopped rank (SIGSTOP; a hang outside any collective reads the same): its peer timed out in the step's
    # collective and exited cleanly, then the engine SIGKILLed the stopped one, and the request's error named only
    # the peer ("exited with code 0") and read the engine's own SIGKILL as the out-of-memory killer's.
    # Four ranks: the healthy peers end a few milliseconds apart, and taken at the first exit they were all named
    # as hung too.
    # dist_timeout_s is how long the peers wait in the collective, and also bounds the four ranks' joining: 8 s was
    # too short for four spawned ranks to import torch on two busy cores (CI failed with "did not join within 8 s").
    config = make_config(num_gpus=4, ulysses_degree=4)
    config = dataclasses.replace(config, parallel=dataclasses.replace(config.parallel, dist_timeout_s=20.0))
    worker = MultiProcessWorker(config, build_rank_worker=FakeRankWorker)
    engine = Engine(worker.config, worker=worker)
    try:
        victim = worker.pids[2]

        def stop_at_first_step(step: int, total: int) -> None:
            if step == 1:
                os.kill(victim, signal.SIGSTOP)

        job = engine.submit(SamplingParams(prompt="slow", num_inference_steps=50), on_progress=stop_at_first_step)
        with pytest.raises(RuntimeError) as raised:
            job.future.result(timeout=60)
        message = str(raised.value)
        assert re.search(rf"rank 2 \(pid {victim}\) stopped responding \(its peers timed out waiting for it\) and "
                         r"was stopped by the engine", message), message
        assert message.count("stopped responding") == 1, message
        assert "out-of-memory" not in message and type(raised.value).__name__ == "RuntimeError"
    finally:
        engine.shutdown()
    assert all(not process.is_alive() for process in worker._processes.values())


def test_a_replica_killed_while_idle_is_found_and_no_request_is_blamed(tmp_path: Path):
    worker = MultiProcessWorker(make_config(num_gpus=2, dp_size=2), build_rank_worker=FakeRankWorker)
    engine = Engine(worker.config, worker=worker)
    try:
        assert engine.dead_replicas() == []
        os.kill(worker.pids[1], signal.SIGKILL)
        deadline = time.monotonic() + 10
        while not engine.dead_replicas() and time.monotonic() < deadline:
            time.sleep(0.05)
        [note_1] = engine.dead_replicas()
        assert re.search(r"replica 1 .*died while idle: rank 1 .*exited with code -9", note_1)
        # The survivor serves every request; none is told that it was running when replica 1 died.
        results = [engine.generate(SamplingParams(prompt="x", num_inference_steps=1)) for _ in range(3)]
        assert {note(result, "replica") for result in results} == {"0"}
        os.kill(worker.pids[0], signal.SIGKILL)
        while len(engine.dead_replicas()) < 2 and time.monotonic() < deadline + 10:
            time.sleep(0.05)
        with pytest.raises(RuntimeError, match=r"every worker replica has died \(.*replica 0 .*died while idle.*"
                                               r"replica 1 .*died while idle.*load the model again \(a new "
                                               r"DiffGenerator, or restart k6serve\)\.$"):
            engine.generate(SamplingParams(prompt="x", num_inference_steps=1))
    finally:
        engine.shutdown()


def _kill_and_wait_for_its_death(engine: Engine, pid: int) -> None:
    """SIGKILL an idle rank and wait (10 s at most) until the engine reports its replica dead."""
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while not engine.dead_replicas() and time.monotonic() < deadline:
        time.sleep(0.05)


@pytest.mark.parametrize("dies_first", [True, False], ids=["dead-before-the-request", "dies-while-it-runs"])
def test_with_a_replica_dead_the_next_request_waits_in_the_queue_and_a_cancel_lands_at_once(tmp_path: Path,
                                                                                           dies_first: bool):
    # A loop thread took the next request and waited inside the worker for the survivor: the request counted as
    # started, and its cancel (an HTTP DELETE, Ctrl-C) landed only after the survivor's request had ended. Also when
    # the replica dies while the other runs a request: the free loop thread had passed the replica check before the
    # death and waited in the queue.
    worker = MultiProcessWorker(make_config(num_gpus=2, dp_size=2), build_rank_worker=FakeRankWorker)
    engine = Engine(worker.config, worker=worker)
    try:
        if dies_first:
            _kill_and_wait_for_its_death(engine, worker.pids[1])
        marker = tmp_path / "go"
        running = engine.submit(SamplingParams(prompt=f"wait-for:{marker}", num_inference_steps=1))
        assert running.started.wait(TIMEOUT_S)
        if not dies_first:
            time.sleep(0.3)  # the other loop thread waits in the queue by now
            _kill_and_wait_for_its_death(engine, worker.pids[1])
        assert len(engine.dead_replicas()) == 1
        waiting = engine.submit(SamplingParams(prompt="x", num_inference_steps=1))
        time.sleep(0.5)
        assert not waiting.started.is_set() and engine.queue_depth() == 1
        waiting.cancel()
        assert waiting.future.cancelled()  # at once, not when the survivor is free
        marker.touch()
        assert note(running.future.result(timeout=TIMEOUT_S), "replica") == "0"
        # The survivor still takes every request, one after another.
        assert note(engine.generate(SamplingParams(prompt="x", num_inference_steps=1)), "replica") == "0"
    finally:
        engine.shutdown()


def test_a_peer_killed_while_idle_leaves_the_leader_without_a_traceback(capfd):
    # The leader's next broadcast to the dead peer raised out of its loop: "Process k6serve-rank0: Traceback ...
    # Connection closed by peer" printed above the engine's own account of the death.
    worker = MultiProcessWorker(make_config(num_gpus=2, ulysses_degree=2), build_rank_worker=FakeRankWorker)
    engine = Engine(worker.config, worker=worker)
    try:
        _kill_and_wait_for_its_death(engine, worker.pids[1])
        assert re.search(r"replica 0 .*died while idle: rank 1 .*exited with code -9", engine.dead_replicas()[0])
        worker._processes[0].join(10)
    finally:
        engine.shutdown()
    err = capfd.readouterr().err
    assert "Traceback" not in err and "Connection closed by peer" not in err, err


def test_shutdown_closes_a_worker_without_processes():
    closed = threading.Event()

    class Fake:
        variant = None

        def close(self) -> None:
            closed.set()

    Engine(real_config(Path("unused")), worker=Fake()).shutdown()
    assert closed.is_set()


def test_invalid_layout_fails_at_start_with_the_rule(tiny_distill_dir):
    # The engine refuses it before the ranks start (test_layout_preflight.py); the ranks check again after loading,
    # and their user error comes back as ValueError, once, without a traceback.
    with pytest.raises(ValueError, match=r"^pro-distill has no classifier-free guidance branch.*--ulysses-degree 2"):
        MultiProcessWorker(real_config(tiny_distill_dir, num_gpus=2, enable_cfg_parallel=True))


def test_a_package_missing_in_a_worker_process_is_named_not_reported_as_a_bug():
    # It came back as "RuntimeError: request 1 failed on replica 0: rank 0: ModuleNotFoundError ...", which the CLI
    # and the server call a bug in k6serve; now it is the ModuleNotFoundError, with its name, and the remote traceback.
    from k6serve.runtime.replica_failures import RemoteTraceback

    worker = MultiProcessWorker(make_config(num_gpus=1), build_rank_worker=FakeRankWorker)
    engine = Engine(worker.config, worker=worker)
    try:
        with pytest.raises(ModuleNotFoundError) as raised:
            engine.generate(SamplingParams(prompt="lack-a-package", num_inference_steps=1))
        assert raised.value.name == "av_not_installed"
        assert isinstance(raised.value.__cause__, RemoteTraceback)
        assert "rank 0: ModuleNotFoundError" in str(raised.value.__cause__) and "test_launch.py" in str(raised.value.__cause__)
        # The replica serves on.
        assert note(engine.generate(SamplingParams(prompt="x", num_inference_steps=1)), "replica") == "0"
    finally:
        engine.shutdown()


def test_a_package_missing_while_the_workers_load_is_named_not_reported_as_a_bug():
    with pytest.raises(ModuleNotFoundError) as raised:
        MultiProcessWorker(make_config(num_gpus=1), build_rank_worker=PackageLessRankWorker)
    assert raised.value.name == "av_not_installed" and "rank 0" in str(raised.value.__cause__)


def test_a_start_up_failure_sent_just_before_the_leader_exits_is_the_one_reported():
    # A leader that fails fast sends Joined and StartupFailed, then exits: read one message at a time, the engine saw
    # the exit after handling Joined and reported "rank 0 exited with code 0", the failure lost (a race in CI).
    import secrets
    from multiprocessing.connection import Client, Listener

    from k6serve.runtime import messages
    from k6serve.parallel.mesh import ParallelLayout

    class EndedProcess:
        pid, exitcode = 4242, None

    authkey = secrets.token_bytes(16)
    worker = MultiProcessWorker.__new__(MultiProcessWorker)
    worker.layout = ParallelLayout.from_config(ParallelConfig(num_gpus=1))
    worker._listener = Listener(("127.0.0.1", 0), authkey=authkey)
    worker._processes, worker._rank0_thread, worker._closed = {0: EndedProcess()}, None, False

    def leader() -> None:  # a thread: connecting waits for the engine's accept, in _wait_until_ready
        with Client(worker._listener.address, authkey=authkey) as connection:
            connection.send(messages.Joined(replica=0))
            connection.send(messages.StartupFailed(replica=0, message="checkpoint folder /x has no model_index.json",
                                                   kind="value"))
        worker._processes[0].exitcode = 0

    threading.Thread(target=leader, daemon=True).start()
    try:
        with pytest.raises(ValueError, match="^checkpoint folder /x has no model_index.json$"):
            worker._wait_until_ready(60)
    finally:
        worker._listener.close()


class SlowLoadingRankWorker(FakeRankWorker):
    """A rank whose model takes longer to fetch and load than dist_timeout_s (a first download of a hub id)."""

    def __init__(self, config: EngineConfig, context):
        time.sleep(config.parallel.dist_timeout_s + 4)
        super().__init__(config, context)


def test_a_load_longer_than_dist_timeout_s_is_waited_for():
    # dist_timeout_s (600 s by default) bounded the whole start-up, the ranks' download, load and warm-up included:
    # a first run of a hub checkpoint on a slow link failed once it passed, naming a flag that does not exist. It
    # now bounds the joining; a rank that joined is waited for as long as it lives.
    config = make_config(num_gpus=1)
    config = dataclasses.replace(config, parallel=dataclasses.replace(config.parallel, dist_timeout_s=8.0))
    started = time.monotonic()
    worker = MultiProcessWorker(config, build_rank_worker=SlowLoadingRankWorker)
    engine = Engine(worker.config, worker=worker)
    try:
        assert time.monotonic() - started > 12
        assert note(engine.generate(SamplingParams(prompt="x", num_inference_steps=2)), "replica") == "0"
    finally:
        engine.shutdown()


class OutOfHostMemoryRankWorker(FakeRankWorker):
    """A rank the kernel's out-of-memory killer ends while it loads (SIGKILL: the process sees nothing)."""

    def __init__(self, config: EngineConfig, context):
        os.kill(os.getpid(), signal.SIGKILL)


def test_a_rank_killed_while_loading_is_the_machines_failure_not_a_bug():
    # A dummy Pro model on a host too small for it: the rank was SIGKILLed while it loaded, and the engine raised a
    # RuntimeError that the CLI reported as "internal error ... a bug in k6serve" (exit 70).
    from k6serve.runtime.out_of_memory import WorkerKilled

    with pytest.raises(WorkerKilled, match=r"rank 0 \(pid \d+\) exited with code -9 \(killed by SIGKILL\).* "
                                           r"out-of-memory killer"):
        MultiProcessWorker(make_config(num_gpus=1), build_rank_worker=OutOfHostMemoryRankWorker)


def test_a_list_of_prompts_runs_on_both_dp_replicas_at_once(tmp_path: Path):
    # DiffGenerator.generate(prompt=[...]) ran a list one prompt after another while the other replica idled: the
    # first prompt here waits until the second has started, so it finishes only if the list runs side by side.
    from k6serve.api import DiffGenerator

    worker = MultiProcessWorker(make_config(num_gpus=2, dp_size=2), build_rank_worker=FakeRankWorker)
    marker = tmp_path / "second-started"
    with DiffGenerator(Engine(worker.config, worker=worker)) as generator:
        results = generator.generate(prompt=[f"wait-for:{marker}", f"touch:{marker}"], num_inference_steps=2,
                                     save_output=False)
    assert len(results) == 2 and {note(result, "replica") for result in results} == {"0", "1"}
    assert all(not process.is_alive() for process in worker._processes.values())
