"""Releasing and resuming the worker's device memory (sleep / wake): the worker on a tiny checkpoint, the engine's
queue, the Python API, the multi-process runtime (tensor-parallel weights and folded encoders included), and a CUDA
check.

On the CPU the "device" and the host are the same memory, so the worker tests check what a release does to storage:
every tensor is re-pointed to a fresh host copy (the same Parameter objects, new `data_ptr`s), again to fresh
storage on resume, and the outputs after a release and resume equal those before, bit for bit.
"""

from __future__ import annotations

import gc
import hashlib
import os
import signal
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from safetensors import safe_open
from test_launch import TIMEOUT_S, FakeRankWorker, make_config
from typed_dicts import mismatches

from k6serve.api import DiffGenerator
from k6serve.config import EngineConfig, ModelConfig, ParallelConfig, RuntimeConfig
from k6serve.engine_arguments import build_engine_config
from k6serve.lora.spec import ListLoras, LoraSpec, SetLora
from k6serve.models.variants import VARIANTS
from k6serve.offload import apply_offload
from k6serve.offload.host_weights import HostWeights, module_tensors
from k6serve.request import OutputOptions, SamplingParams
from k6serve.runtime import memory
from k6serve.runtime.engine import Engine
from k6serve.runtime.memory import (
    LORA_ADAPTERS,
    MemoryRankReport,
    MemoryReply,
    ReleaseMemory,
    ResumeMemory,
    device_tensors,
    memory_release_refusal,
)
from k6serve.runtime.process_group_worker import MultiProcessWorker
from k6serve.runtime.worker import ModelWorker
from k6serve.speed.performance_mode import transformer_plan

NO_FILE = OutputOptions(save_output=False, return_frames=True)
PARAMS = SamplingParams(prompt="a fox in the snow", seed=7, height=32, width=48, num_frames=5)


def _worker(checkpoint: Path, **kwargs) -> ModelWorker:
    torch.set_num_threads(1)
    return ModelWorker(build_engine_config(str(checkpoint), device="cpu", attention_backend="sdpa", **kwargs))


def _same_output(first, second) -> bool:
    return np.array_equal(first.frames, second.frames) and np.array_equal(first.audio, second.audio)


def _pointers(groups: dict[str, list[torch.Tensor]]) -> dict[int, int]:
    return {id(tensor): tensor.data_ptr() for tensors in groups.values() for tensor in tensors}


# ---- the worker on the tiny checkpoint ----


def test_release_repoints_every_tensor_and_resume_gives_the_same_output(tiny_distill_dir, tmp_path):
    from test_lora import VIDEO_FFN, write_adapter

    worker = _worker(tiny_distill_dir)
    transformer = worker.pipeline.models.transformer
    adapter = write_adapter(tmp_path, {VIDEO_FFN: tuple(transformer.get_submodule(VIDEO_FFN).weight.shape)})
    worker.apply_lora_operation(SetLora(specs=(LoraSpec(nickname="a", path=str(adapter)),), merge_mode="dynamic"))
    before = worker.run(PARAMS, NO_FILE)  # also puts the adapter's copies on the "device"
    groups = device_tensors(worker.pipeline, worker.lora_manager, worker.device)
    assert set(groups) == {*worker.pipeline.components(), LORA_ADAPTERS} and groups[LORA_ADAPTERS]
    values = {id(t): t.detach().clone() for tensors in groups.values() for t in tensors}
    loaded = _pointers(groups)

    [report] = worker.apply_memory_operation(ReleaseMemory())
    assert report["status"] == "released" and report["memory_released"]
    assert report["moved_bytes_by_owner"] == {name: sum(t.numel() * t.element_size() for t in tensors)
                                              for name, tensors in groups.items()}
    assert report["host_bytes"] >= report["moved_bytes"] > 0 and not report["pinned"]
    released = _pointers(groups)
    assert all(released[key] != loaded[key] for key in loaded)  # every tensor, the same object, in new storage
    with pytest.raises(RuntimeError, match="resume it before"):
        worker.run(PARAMS, NO_FILE)
    again = worker.apply_memory_operation(ReleaseMemory())[0]
    assert again["status"] == "already_released" and again["moved_bytes"] == 0 and _pointers(groups) == released

    [report] = worker.apply_memory_operation(ResumeMemory())
    assert report["status"] == "resumed" and not report["memory_released"] and report["host_bytes"] == 0
    resumed = _pointers(groups)
    # Back in device storage. Not compared with `loaded`: the allocator may hand the freed block out again (malloc
    # did on the H200's host, where this test failed with that comparison).
    assert all(resumed[key] != released[key] for key in loaded)
    assert all(t.device.type == torch.device(worker.device).type for tensors in groups.values() for t in tensors)
    assert all(torch.equal(t, values[id(t)]) for tensors in groups.values() for t in tensors)
    assert worker.apply_memory_operation(ResumeMemory())[0]["status"] == "not_released"
    assert _same_output(worker.run(PARAMS, NO_FILE), before)


def test_a_quantized_dit_releases_its_e4m3_weights_and_resumes_to_the_same_output(tiny_distill_dir):
    """--quantization fp8: the e4m3 weights and their scales are buffers of float8 and fp32; they move to host memory
    and back like every other tensor, bit for bit."""
    worker = _worker(tiny_distill_dir, quantization="fp8")
    assert worker.performance_report.num_quantized_linears > 0
    before = worker.run(PARAMS, NO_FILE)
    groups = device_tensors(worker.pipeline, None, worker.device)
    e4m3 = [t for t in groups["transformer"] if t.dtype == torch.float8_e4m3fn]
    assert len(e4m3) == worker.performance_report.num_quantized_linears
    values = {id(t): t.detach().clone() for t in e4m3}
    assert worker.apply_memory_operation(ReleaseMemory())[0]["status"] == "released"
    assert worker.apply_memory_operation(ResumeMemory())[0]["status"] == "resumed"
    assert all(t.dtype == torch.float8_e4m3fn and torch.equal(t.view(torch.uint8), values[id(t)].view(torch.uint8))
               for t in e4m3)
    assert _same_output(worker.run(PARAMS, NO_FILE), before)


def test_a_kept_host_copy_makes_the_next_release_a_repoint(tiny_distill_dir):
    """`ResumeMemory(keep_host_copy=True)` keeps the host copy: the next release re-points every tensor to the very
    storage of the first release (no copy), and the outputs stay those before any release."""
    worker = _worker(tiny_distill_dir)
    before = worker.run(PARAMS, NO_FILE)
    groups = device_tensors(worker.pipeline, worker.lora_manager, worker.device)
    worker.apply_memory_operation(ReleaseMemory())
    first_host = _pointers(groups)
    # Held so that the allocator cannot hand the same addresses to the copy of the last release below, once the
    # plain resume has dropped the worker's copy (CI saw exactly that reuse, and the pointer check failed).
    first_storages = [t.untyped_storage() for tensors in groups.values() for t in tensors]
    [report] = worker.apply_memory_operation(ResumeMemory(keep_host_copy=True))
    assert report["status"] == "resumed" and report["host_copy_kept"] and report["host_bytes"] > 0
    assert "host copy kept" in report["message"]
    assert all(pointer != first_host[key] for key, pointer in _pointers(groups).items())  # on the "device" again
    assert _same_output(worker.run(PARAMS, NO_FILE), before)

    [report] = worker.apply_memory_operation(ReleaseMemory())
    assert report["status"] == "released" and "no copy" in report["message"]
    assert _pointers(groups) == first_host  # the kept storage itself
    [report] = worker.apply_memory_operation(ResumeMemory())  # a plain resume drops the copy
    assert not report["host_copy_kept"] and report["host_bytes"] == 0
    assert _same_output(worker.run(PARAMS, NO_FILE), before)
    [report] = worker.apply_memory_operation(ReleaseMemory())
    assert "no copy" not in report["message"]
    assert all(pointer != first_host[key] for key, pointer in _pointers(groups).items())  # a fresh copy
    worker.apply_memory_operation(ResumeMemory())
    del first_storages


def test_a_resume_frees_the_host_copy_on_a_background_thread_and_a_release_waits_for_it(tiny_distill_dir):
    """A resume answers once the weights are back: the host copy is freed on the reaper's thread (4 of the 5.4 s a
    full-size resume took), which the reply reports, and the next release waits for that before copying again, so
    the worker never holds two host copies."""
    import weakref

    worker = _worker(tiny_distill_dir)
    before = worker.run(PARAMS, NO_FILE)
    worker.apply_memory_operation(ReleaseMemory())
    copies = worker.memory_release.copies
    freed_on, gate = [], threading.Event()

    def freed(_name=None):
        freed_on.append(threading.current_thread().name)
        gate.wait(10)  # holds the reaper until the test lets it go

    for copy in copies:
        weakref.finalize(copy.weights, freed)
    host_bytes = sum(copy.weights.num_bytes for copy in copies)
    del copies, copy
    [report] = worker.apply_memory_operation(ResumeMemory())
    assert report["status"] == "resumed" and report["host_bytes"] == 0
    assert report["host_bytes_being_freed"] == host_bytes > 0
    assert f"its {host_bytes / 2**20:.1f} MiB host copy is freed in the background" in report["message"]
    assert _same_output(worker.run(PARAMS, NO_FILE), before)  # the worker serves meanwhile

    released = threading.Event()
    releasing = threading.Thread(target=lambda: (worker.apply_memory_operation(ReleaseMemory()), released.set()))
    releasing.start()
    assert not released.wait(0.3)  # held: the last copy is still being freed
    gate.set()
    releasing.join(TIMEOUT_S)
    assert released.is_set() and worker.memory_release.released
    assert set(freed_on) == {"k6serve-free-host-copy"} and len(freed_on) == len(worker.memory_release.copies)
    [report] = worker.apply_memory_operation(ResumeMemory())
    worker.memory_release.reaper.wait()
    assert report["status"] == "resumed" and worker.memory_release.reaper.freeing_bytes == 0
    assert _same_output(worker.run(PARAMS, NO_FILE), before)


def test_a_lora_change_drops_the_kept_host_copy(tiny_distill_dir, tmp_path):
    """A merge rewrites the device weights, so the kept copy would be stale: after a LoRA operation the next release
    copies again, and a resume gives the merged model's output."""
    from test_lora import VIDEO_FFN, write_adapter

    worker = _worker(tiny_distill_dir)
    transformer = worker.pipeline.models.transformer
    adapter = write_adapter(tmp_path, {VIDEO_FFN: tuple(transformer.get_submodule(VIDEO_FFN).weight.shape)})
    worker.apply_memory_operation(ReleaseMemory())
    worker.apply_memory_operation(ResumeMemory(keep_host_copy=True))
    # A refused operation changes no weight: the copy stays kept (it was dropped before the operation ran)
    with pytest.raises(ValueError, match="no LoRA adapter is loaded under the nickname 'ghost'"):
        worker.apply_lora_operation(SetLora(specs=(LoraSpec(nickname="ghost"),)))
    assert worker.memory_release.kept is not None
    worker.apply_lora_operation(SetLora(specs=(LoraSpec(nickname="a", path=str(adapter)),), merge_mode="merge"))
    assert worker.memory_release.kept is None
    merged = worker.run(PARAMS, NO_FILE)
    [report] = worker.apply_memory_operation(ReleaseMemory())
    assert report["status"] == "released" and "no copy" not in report["message"]
    worker.apply_memory_operation(ResumeMemory())
    assert _same_output(worker.run(PARAMS, NO_FILE), merged)


def test_offloaded_weights_stay_in_their_host_copies(tiny_distill_dir):
    worker = _worker(tiny_distill_dir, performance_mode="balanced")
    apply_offload(worker.pipeline, "balanced", compute_device="cpu",
                  plan=transformer_plan(worker.pipeline.models.transformer))
    residency = worker.pipeline.residency
    before = worker.run(PARAMS, NO_FILE)
    [report] = worker.apply_memory_operation(ReleaseMemory())
    # Between requests every weight uses the residency's host copy: nothing is on the device to move.
    assert report["status"] == "released" and report["moved_bytes"] == 0
    assert all(weights.attached_to_host() for weights in residency.weights.values())
    worker.apply_memory_operation(ResumeMemory())
    assert _same_output(worker.run(PARAMS, NO_FILE), before)


def test_a_residency_copy_on_the_device_moves_whole_and_keeps_working():
    """Block streaming's resident blocks are packed in a copy that lives on the device (`device_homes`): a release
    moves its chunks, the slots' views and the attached tensors together (here on the CPU: to fresh storage)."""
    torch.manual_seed(0)
    linear = torch.nn.Linear(8, 4)
    home = HostWeights(module_tensors([linear]), offload_device=torch.device("cpu"), pin=False)
    values = [tensor.detach().clone() for tensor in (linear.weight, linear.bias)]
    loaded = [linear.weight.data_ptr(), home.chunks[0].data_ptr()]
    release = memory.MemoryRelease(torch.device("cpu"))
    report = release.release({}, [home])
    assert report["moved_bytes_by_owner"] == {memory.RESIDENT_BLOCKS: home.num_bytes}
    released = [linear.weight.data_ptr(), home.chunks[0].data_ptr()]
    assert released[0] != loaded[0] and released[1] != loaded[1] and home.attached_to_host()
    released_chunk = home.chunks[0]  # held, so its address cannot be handed out again (the loaded one can be)
    release.resume()
    # Back in a fresh chunk, and the weight is a view of it.
    assert home.chunks[0].data_ptr() != released_chunk.data_ptr()
    assert linear.weight.untyped_storage().data_ptr() == home.chunks[0].untyped_storage().data_ptr()
    assert home.attached_to_host()
    del released_chunk
    assert torch.equal(linear.weight, values[0]) and torch.equal(linear.bias, values[1])
    home.to_device(torch.device("cpu"))  # the streamer's own moves still work on the moved copy
    assert not home.attached_to_host() and torch.equal(linear.weight, values[0])
    home.to_host()
    assert home.attached_to_host()


def test_a_failed_release_leaves_the_worker_serving(tiny_distill_dir, monkeypatch):
    worker = _worker(tiny_distill_dir)
    before = worker.run(PARAMS, NO_FILE)
    real, calls = memory.HostWeights, []

    def failing(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("host out of memory")
        return real(*args, **kwargs)

    monkeypatch.setattr(memory, "HostWeights", failing)
    with pytest.raises(RuntimeError, match="host out of memory"):
        worker.apply_memory_operation(ReleaseMemory())
    assert not worker.memory_release.released
    assert _same_output(worker.run(PARAMS, NO_FILE), before)


def test_fsdp_is_refused_with_the_flag_to_drop_and_tensor_parallel_layouts_are_not():
    parallel = ParallelConfig(num_gpus=2, ulysses_degree=2, use_fsdp_inference=True)
    message = memory_release_refusal(parallel)
    assert "sharded by --use-fsdp-inference" in message and "Drop --use-fsdp-inference" in message
    worker = SimpleNamespace(config=SimpleNamespace(parallel=parallel))
    for operation in (ReleaseMemory(), ResumeMemory()):
        with pytest.raises(ValueError, match="cannot move weights sharded by --use-fsdp-inference"):
            memory.apply_memory_operation(worker, operation)
    for layout in ({"num_gpus": 2, "tp_size": 2}, {"num_gpus": 2, "ulysses_degree": 2, "encoder_parallel": "fold"},
                   {"num_gpus": 4, "tp_size": 2, "ulysses_degree": 2}, {"num_gpus": 4, "ulysses_degree": 2, "dp_size": 2}):
        assert memory_release_refusal(ParallelConfig(**layout)) is None


# ---- the engine's queue, with a fake worker ----


class FakeMemoryWorker:
    """Runs requests instantly unless the prompt says "hold" (until `go` is set); logs starts, operations and state."""

    def __init__(self, num_replicas: int = 1) -> None:
        self.variant = VARIANTS["pro"]
        self.num_replicas = num_replicas
        self.go = threading.Event()
        self.log: list[str] = []
        self.released = False

    def run(self, params, output, on_step=None) -> str:
        assert not self.released, "a request ran while the memory was released"
        self.log.append(f"start {params.prompt}")
        if "hold" in params.prompt:
            assert self.go.wait(TIMEOUT_S)
        self.log.append(f"end {params.prompt}")
        return params.prompt

    def apply_lora_operation(self, operation) -> dict:
        self.log.append(type(operation).__name__)
        return {"loras": []}

    def apply_memory_operation(self, operation) -> list[dict]:
        release = isinstance(operation, ReleaseMemory)
        status = ("released" if release else "resumed") if release != self.released else (
            "already_released" if release else "not_released")
        self.released = release
        self.log.append(type(operation).__name__)
        return [{"status": status, "message": status, "moved_bytes": 8 if status in ("released", "resumed") else 0}]


def _engine(worker) -> Engine:
    return Engine(EngineConfig(model=ModelConfig(model_path="fake")), worker=worker)


def test_requests_wait_while_released_and_control_operations_get_through():
    worker = FakeMemoryWorker()
    engine = _engine(worker)
    try:
        reply = engine.release_memory()
        assert reply["status"] == "ok" and reply["memory_released"] and engine.memory_released
        first = engine.submit(SamplingParams(prompt="first"))
        lora = engine.submit_lora(SetLora(specs=()))  # an adapter change waits with the requests, in order
        cancelled = engine.submit(SamplingParams(prompt="cancelled"))
        assert engine.lora(ListLoras()) == {"loras": []}  # changes nothing: answered now
        assert engine.release_memory()["status"] == "already_released"  # behind the held ones, not blocked
        cancelled.cancel()
        assert engine.queue_depth() == 3
        time.sleep(0.1)
        assert not first.future.done() and not lora.done() and worker.log == [
            "ReleaseMemory", "ListLoras", "ReleaseMemory"]
        reply = engine.resume_memory()
        assert reply["status"] == "ok" and not reply["memory_released"] and reply["num_waiting_requests"] == 3
        assert first.future.result(TIMEOUT_S) == "first" and lora.result(TIMEOUT_S) == {"loras": []}
        assert cancelled.future.cancelled()
        assert worker.log[3:] == ["ResumeMemory", "start first", "end first", "SetLora"]
        assert engine.resume_memory()["status"] == "not_released"
    finally:
        engine.shutdown(timeout=5)


@pytest.mark.parametrize("num_replicas", [1, 2])
def test_a_release_waits_for_the_running_requests(num_replicas):
    worker = FakeMemoryWorker(num_replicas)
    engine = _engine(worker)
    try:
        running = engine.submit(SamplingParams(prompt="hold"))
        while "start hold" not in worker.log:
            time.sleep(0.01)
        release = engine.submit_memory(ReleaseMemory())
        time.sleep(0.1)
        assert not release.done()
        worker.go.set()
        assert release.result(TIMEOUT_S)["memory_released"]
        assert running.future.result(TIMEOUT_S) == "hold"
        assert worker.log == ["start hold", "end hold", "ReleaseMemory"]
    finally:
        engine.shutdown(timeout=5)


def test_shutdown_fails_the_requests_still_waiting_for_a_resume():
    engine = _engine(FakeMemoryWorker())
    engine.release_memory()
    waiting = engine.submit(SamplingParams(prompt="never"))
    engine.shutdown(timeout=5)
    with pytest.raises(RuntimeError, match="shut down while its memory was released"):
        waiting.future.result(1)


# ---- the Python API on the real tiny model ----


def test_the_api_releases_holds_a_request_and_resumes(tiny_distill_dir):
    config = build_engine_config(str(tiny_distill_dir), device="cpu", attention_backend="sdpa")
    torch.set_num_threads(1)
    with DiffGenerator(Engine(config, worker=ModelWorker(config))) as generator:
        params = {"prompt": "a fox in the snow", "seed": 7, "height": 32, "width": 48, "num_frames": 5,
                  "save_output": False, "return_frames": True}
        before = generator.generate(params)
        reply = generator.release_memory()
        assert reply["status"] == "ok" and reply["moved_bytes"] > 0 and len(reply["ranks"]) == 1
        assert reply["ranks"][0]["after"]["device"] == "cpu"
        # Its type (and the OpenAPI document's answer, made from it) names every key it has, and no other.
        assert mismatches(reply, MemoryReply) == []
        results = []
        thread = threading.Thread(target=lambda: results.append(generator.generate(params)))
        thread.start()
        deadline = time.monotonic() + TIMEOUT_S  # polled: the thread may take a while to submit on a busy machine
        while generator.engine.queue_depth() != 1:
            assert time.monotonic() < deadline, "the request never reached the queue"
            time.sleep(0.01)
        time.sleep(0.2)
        assert not results and generator.engine.queue_depth() == 1  # waits: not failed, not run
        assert generator.resume_memory()["num_waiting_requests"] == 1
        thread.join(TIMEOUT_S)
        assert _same_output(results[0], before)


# ---- the multi-process runtime (gloo): every rank, per-rank reports, all or nothing ----

FAIL_FILE_ENV = "K6SERVE_TEST_MEMORY_FAIL_FILE"


class MemoryRankWorker(FakeRankWorker):
    """A rank that reports its process id with its memory state, and fails on global rank 1 while the file named by
    $K6SERVE_TEST_MEMORY_FAIL_FILE exists. (No collective: an undo runs on the ranks that succeeded only, as the
    real worker's does.)"""

    def __init__(self, config, context) -> None:
        super().__init__(config, context)
        self.released = False

    def apply_memory_operation(self, operation) -> list[dict]:
        release = isinstance(operation, ReleaseMemory)
        if self.context.spec.rank == 1 and Path(os.environ[FAIL_FILE_ENV]).exists():
            raise RuntimeError("cudaHostRegister failed")
        status = ("released" if release else "resumed") if release != self.released else (
            "already_released" if release else "not_released")
        self.released = release
        return [{"status": status, "message": status, "moved_bytes": 8, "pid": os.getpid(),
                 "memory_released": self.released}]


class DyingMemoryRankWorker(MemoryRankWorker):
    """Global rank 1 is killed as it releases (the host's out-of-memory killer, as the host copy grows)."""

    def apply_memory_operation(self, operation) -> list[dict]:
        if self.context.spec.rank == 1 and isinstance(operation, ReleaseMemory):
            os.kill(os.getpid(), signal.SIGKILL)
        return super().apply_memory_operation(operation)


@pytest.mark.multiprocess
def test_a_replica_dying_during_a_release_leaves_the_serving_ones_released(tmp_path, monkeypatch):
    """The replica still serving released: the release succeeds. It was undone there and failed, as if the dead
    replica could still disagree."""
    monkeypatch.setenv(FAIL_FILE_ENV, str(tmp_path / "never"))
    worker = MultiProcessWorker(make_config(num_gpus=2, dp_size=2), build_rank_worker=DyingMemoryRankWorker)
    engine = Engine(worker.config, worker=worker)
    try:
        reply = engine.release_memory()
        assert [(r["replica"], r["status"]) for r in reply["ranks"]] == [(0, "released")]
        assert engine.memory_released and len(engine.dead_replicas()) == 1
        assert [r["status"] for r in engine.resume_memory()["ranks"]] == ["resumed"]
    finally:
        engine.shutdown()


@pytest.mark.multiprocess
@pytest.mark.parametrize("layout", [{"ulysses_degree": 2}, {"dp_size": 2}], ids=["one-replica", "two-replicas"])
def test_every_rank_releases_and_a_failure_on_one_is_undone_on_the_others(layout, tmp_path, monkeypatch):
    fail = tmp_path / "fail"
    monkeypatch.setenv(FAIL_FILE_ENV, str(fail))
    worker = MultiProcessWorker(make_config(num_gpus=2, **layout), build_rank_worker=MemoryRankWorker)
    engine = Engine(worker.config, worker=worker)
    try:
        reply = engine.release_memory()
        replicas = [0, 0] if "ulysses_degree" in layout else [0, 1]
        assert [(r["rank"], r["replica"], r["pid"]) for r in reply["ranks"]] == [
            (rank, replica, worker.pids[rank]) for rank, replica in zip([0, 1], replicas)]
        assert reply["moved_bytes"] == 16 and all(r["memory_released"] for r in reply["ranks"])
        fail.touch()
        with pytest.raises(RuntimeError, match="cudaHostRegister failed"):
            engine.resume_memory()
        assert engine.memory_released  # still released everywhere: rank 0 was put back
        fail.unlink()
        reply = engine.resume_memory()
        assert [r["status"] for r in reply["ranks"]] == ["resumed", "resumed"]  # rank 0 too: it was re-released
        result = engine.generate(SamplingParams(prompt="after", num_inference_steps=1), OutputOptions(save_output=False))
        assert result.seed is not None
    finally:
        engine.shutdown()
        worker.close()


class ShardProbeRankWorker:
    """The real per-rank worker (`build_model_worker`), whose memory reports add what the operation did to this rank's
    DTensor parameters: the ids of each Parameter and of its local shard, the placements, the shard's data_ptr and a
    digest of its bytes (`shards`); and how many of the shards' storages from before the operation are still alive
    (`storages_alive`, of `num_storages`): a second reference to a shard's old storage would keep it on the GPU."""

    def __init__(self, config, context) -> None:
        from k6serve.runtime.rank_process import build_model_worker

        self.worker = build_model_worker(config, context)
        self.variant = self.worker.variant

    def run(self, params, output, on_step=None):
        return self.worker.run(params, output, on_step)

    def apply_lora_operation(self, operation) -> dict:
        return self.worker.apply_lora_operation(operation)

    def apply_memory_operation(self, operation) -> list[dict]:
        from torch.multiprocessing.reductions import StorageWeakRef

        storages = [StorageWeakRef(parameter._local_tensor.untyped_storage())
                    for _, parameter in _dtensor_parameters(self.worker.pipeline)]
        reports = self.worker.apply_memory_operation(operation)
        self.worker.memory_release.reaper.wait()  # a plain resume frees the old host copy in the background
        gc.collect()
        alive = sum(not storage.expired() for storage in storages)
        return [{**report, "shards": _shards(self.worker.pipeline), "storages_alive": alive,
                 "num_storages": len(storages)} for report in reports]


def _dtensor_parameters(pipeline) -> list[tuple[str, torch.Tensor]]:
    from torch.distributed.tensor import DTensor

    return [(f"{component}.{name}", parameter) for component, module in pipeline.components().items()
            for name, parameter in module.named_parameters() if isinstance(parameter, DTensor)]


def _shards(pipeline) -> dict[str, tuple]:
    shards = {}
    for name, parameter in _dtensor_parameters(pipeline):
        local = parameter._local_tensor
        digest = hashlib.sha256(local.detach().reshape(-1).view(torch.uint8).numpy()).hexdigest()
        shards[name] = (id(parameter), id(local), str(parameter.placements), local.data_ptr(), digest)
    return shards


def _shard_fields(reply: dict, index: int) -> list[dict[str, object]]:
    """Per rank: parameter name -> field `index` of `_shards` (0 Parameter id ... 3 data_ptr, 4 digest)."""
    return [{name: shard[index] for name, shard in rank["shards"].items()} for rank in reply["ranks"]]


@pytest.mark.multiprocess
@pytest.mark.parametrize(("layout", "sharded"), [
    ({"tp_size": 2}, {"transformer"}),
    ({"ulysses_degree": 2, "encoder_parallel": "fold"}, {"text_encoder", "text_encoder_2"}),
], ids=["tp2", "fold"])
def test_tensor_parallel_shards_move_and_come_back_on_every_rank(tiny_pro_foldable_dir, tmp_path, layout, sharded):
    """TP (and folded encoders) on 2 gloo ranks with the real worker: a release re-points every local shard (the
    same Parameter, DTensor and local tensor objects, new storage, the old one freed), a resume brings the same
    bytes back, and the output equals the one before; a kept host copy is re-pointed to on the next release. Under
    TP a dynamic LoRA's device copies (column- and row-parallel targets) move too."""
    from test_lora import AUDIO_FFN, VIDEO_FFN, write_adapter

    config = EngineConfig(model=ModelConfig(model_path=str(tiny_pro_foldable_dir)),
                          parallel=ParallelConfig(num_gpus=2, dist_timeout_s=60.0, **layout),
                          runtime=RuntimeConfig(device="cpu"))
    worker = MultiProcessWorker(config, build_rank_worker=ShardProbeRankWorker)
    engine = Engine(config, worker=worker)
    params = SamplingParams(prompt="a red fox runs", seed=5, height=48, width=80, num_frames=5,
                            num_inference_steps=2, guidance_scale=4.0)
    try:
        if "tp_size" in layout:
            with safe_open(str(next((tiny_pro_foldable_dir / "transformer").glob("*.safetensors"))), "pt") as file:
                shapes = {path: tuple(file.get_slice(f"{path}.weight").get_shape()) for path in (VIDEO_FFN, AUDIO_FFN)}
            adapter = write_adapter(tmp_path, shapes)
            engine.lora(SetLora(specs=(LoraSpec(nickname="a", path=str(adapter)),), merge_mode="dynamic"))
        before = engine.generate(params, NO_FILE)
        loaded = engine.resume_memory()  # not released: changes nothing, reports the shards as loaded
        assert [rank["status"] for rank in loaded["ranks"]] == ["not_released"] * 2
        assert all({name.split(".")[0] for name in shards} == sharded for shards in _shard_fields(loaded, 0))
        objects = [_shard_fields(loaded, index) for index in range(3)]  # Parameter, local tensor, placements
        digests = _shard_fields(loaded, 4)

        def check(reply: dict, status: str, *, kept: bool = False) -> list[dict[str, int]]:
            """Every rank did `status` on the same objects, with the same bytes, and the storages it moved from were
            freed (or are the host copy it `kept`); the shards' data_ptrs per rank."""
            assert [rank["status"] for rank in reply["ranks"]] == [status] * 2
            assert [_shard_fields(reply, index) for index in range(3)] == objects and _shard_fields(reply, 4) == digests
            for rank in reply["ranks"]:
                assert rank["storages_alive"] == (rank["num_storages"] if kept else 0), rank
            return _shard_fields(reply, 3)

        def all_moved(before: list[dict[str, int]], after: list[dict[str, int]]) -> bool:
            return all(after[rank][name] != pointer for rank, pointers in enumerate(before)
                       for name, pointer in pointers.items())

        released = engine.release_memory()
        first_host = check(released, "released")
        assert all_moved(_shard_fields(loaded, 3), first_host)
        assert all(sharded <= set(rank["moved_bytes_by_owner"]) for rank in released["ranks"])
        if "tp_size" in layout:
            assert all(rank["moved_bytes_by_owner"][LORA_ADAPTERS] > 0 for rank in released["ranks"])

        assert all_moved(first_host, check(engine.resume_memory(keep_host_copy=True), "resumed", kept=True))
        assert _same_output(engine.generate(params, NO_FILE), before)

        again = engine.release_memory()
        assert check(again, "released") == first_host  # the kept storage itself
        assert all("no copy" in rank["message"] for rank in again["ranks"])
        check(engine.resume_memory(), "resumed")  # the host copy is dropped
        assert _same_output(engine.generate(params, NO_FILE), before)
    finally:
        engine.shutdown()
        worker.close()


# ---- on a GPU ----


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("mode", ["speed", "balanced"])
def test_cuda_release_frees_the_gpu_and_resume_is_bit_identical(tiny_distill_dir, mode):
    """After a release torch holds (almost) nothing on the GPU: the weights are in pinned host memory and the
    allocator's caches and cuBLAS's workspaces are freed. What may remain is a few small tensors a library keeps
    outside any module (listed in the report) and allocator rounding; the CUDA context is not torch's and is not
    counted by `memory_allocated`."""
    import gc

    # Measured from what the process already holds: in a full run, earlier tests can leave tensors on the GPU (and
    # the segments they sit in), which no release of this worker could free.
    gc.collect()
    torch.cuda.empty_cache()
    held_allocated, held_reserved = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
    config = build_engine_config(str(tiny_distill_dir), device="cuda", attention_backend="sdpa",
                                 performance_mode=mode)
    worker = ModelWorker(config)
    before = worker.run(PARAMS, NO_FILE)
    [report] = worker.apply_memory_operation(ReleaseMemory())
    assert mismatches(report, MemoryRankReport) == []  # the GPU figures of `after` as its type names them
    after = report["after"]
    assert torch.cuda.memory_allocated() <= held_allocated + 4 * 2**20, after
    assert after["allocated_bytes"] == torch.cuda.memory_allocated(), after
    assert after["reserved_bytes"] <= held_reserved + 4 * 2**20, after
    assert report["pinned"] == (report["moved_bytes"] > 0)
    assert (report["moved_bytes"] > 0) == (mode == "speed")  # balanced keeps its weights on the host already
    worker.apply_memory_operation(ResumeMemory())
    assert _same_output(worker.run(PARAMS, NO_FILE), before)


def test_resident_blocks_moved_to_pinned_memory_are_reported_pinned(monkeypatch):
    """Memory mode between requests keeps every weight in the residency's host copies but the DiT blocks held
    resident (--offload-resident-blocks), which a release moves to pinned buffers: the report said "moved ... to
    pinned host memory" beside "pinned": false. The CUDA path on the CPU: pinned buffers and the device's state
    are stood in for."""
    from k6serve.runtime import memory

    class Pinned:
        def __init__(self, num_bytes):
            self.data = torch.empty(num_bytes, dtype=torch.uint8)

        def view(self, dtype):
            return self.data.view(dtype)

    monkeypatch.setattr(memory, "PinnedBuffer", Pinned)
    monkeypatch.setattr(memory, "free_allocator_caches", lambda device: None)
    monkeypatch.setattr(memory, "device_memory_state", lambda device: {"explanation": "-"})
    release = memory.MemoryRelease(torch.device("cuda", 0))
    block = HostWeights(module_tensors([torch.nn.Linear(8, 4)]), offload_device=torch.device("cpu"), pin=False)
    report = release.release({"transformer": []}, [block])
    assert report["message"].startswith("moved ") and report["message"].endswith(" to pinned host memory")
    assert report["pinned"] and report["moved_bytes_by_owner"] == {
        "offload_resident_blocks": sum(chunk.numel() * chunk.element_size() for chunk in block.chunks)}


def test_live_storages_skip_compile_fake_tensors_without_warning():
    # torch.compile leaves fake tensors alive in its caches; asking one for its data pointer warned in every CUDA
    # release's report (H100, fifty-seventh session) and is to become an error. They hold no memory: not listed.
    import warnings

    from torch._subclasses.fake_tensor import FakeTensorMode

    from k6serve.runtime.device_memory import live_tensor_storages

    real = torch.zeros(3, 1000, dtype=torch.float64)
    with FakeTensorMode():
        fake = torch.empty(5, 1000)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        storages = live_tensor_storages(torch.device("cpu"))
    assert [str(w.message) for w in caught if "FakeTensor" in str(w.message)] == []
    assert {"bytes": real.nbytes, "shape": [3, 1000], "dtype": "torch.float64"} in storages
    assert [5, 1000] not in [entry["shape"] for entry in storages]
    del fake
