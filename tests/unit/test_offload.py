"""Offloading (`--performance-mode balanced / memory`) on CPU: the offload and compute devices are both the CPU, and
every move is a real copy into fresh storage, so "on the device" means "not the host copy" (`attached_to_host`).

Checked: outputs bitwise equal with and without offload (generation and SR), every component back on the host after
its stage and only the stage's components on the device during it (checked at every call into any submodule), the
blocks streamed in order one ahead, the CLI flag reaching the worker, and the refused layouts. (A meta "device"
cannot stand in: a CPU parameter's `.data` cannot be re-pointed at a meta tensor.)
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch

from k6serve.engine_arguments import build_engine_config
from k6serve.models.registry import transformer_plan
from k6serve.offload import ComponentOffload, apply_offload
from k6serve.offload.block_stream import plan_blocks, repeated_blocks
from k6serve.request import OutputOptions, SamplingParams
from k6serve.runtime.worker import ModelWorker
from k6serve.testing.clips import make_clip

NO_FILE = OutputOptions(save_output=False, return_frames=True)
GENERATION_STAGES = ({"text_encoder", "text_encoder_2"}, {"transformer"}, {"vae"}, {"audio_vae", "vocoder"})


def _generate(worker: ModelWorker):
    params = SamplingParams(prompt="a fox in the snow", seed=7, height=32, width=48, num_frames=5)
    return worker.run(params, NO_FILE)


def _on_device(residency: ComponentOffload) -> set[str]:
    """The components with weights on the device now (a part's copy, "latent_upscaler[x2]", as its component)."""
    return {name.partition("[")[0] for name, weights in residency.weights.items() if not weights.attached_to_host()}


def _spy_stages(pipeline, residency: ComponentOffload, stages) -> list[tuple[str, set[str]]]:
    """Record, at every call into a component, which components are on the device; check it is one stage."""
    seen: list[tuple[str, set[str]]] = []

    def spy(name):
        def hook(module, args):
            on_device = _on_device(residency)
            stage = next(group for group in stages if name in group)
            assert name in on_device and on_device <= stage, (name, on_device)
            seen.append((name, on_device))

        return hook

    for name, component in pipeline.components().items():
        for module in component.modules():
            module.register_forward_pre_hook(spy(name))
    return seen


@pytest.mark.parametrize("mode", ["balanced", "memory"])
def test_generation_with_offload_is_bitwise_equal_and_moves_one_stage_at_a_time(tiny_distill_dir, mode):
    torch.set_num_threads(1)
    worker = ModelWorker(build_engine_config(str(tiny_distill_dir), device="cpu", performance_mode=mode,
                                             attention_backend="sdpa"))
    assert worker.offload_report is None  # nothing to offload to on a CPU device
    resident = _generate(worker)
    report = apply_offload(worker.pipeline, mode, compute_device="cpu",
                           plan=transformer_plan(worker.pipeline.models.transformer))
    residency = worker.pipeline.residency
    assert not report.pinned and set(residency.weights) == set(worker.pipeline.components())
    assert not _on_device(residency)
    seen = _spy_stages(worker.pipeline, residency, GENERATION_STAGES)
    offloaded = _generate(worker)
    assert np.array_equal(offloaded.frames, resident.frames) and np.array_equal(offloaded.audio, resident.audio)
    assert {name for name, _ in seen} == set(residency.weights)
    assert not _on_device(residency)
    for streamer in residency.streamers.values():
        assert all(weights.attached_to_host() for weights in streamer.weights)
    assert (report.num_streamed_blocks > 0) == (mode == "memory")
    # Streamed: the DiT's plan blocks and the text encoders' layers (the tiny Qwen's one vision block is no list).
    expected = {"transformer": len(plan_blocks(worker.pipeline.models.transformer,
                                               transformer_plan(worker.pipeline.models.transformer))),
                "text_encoder": 2, "text_encoder_2": 2} if mode == "memory" else {}
    assert report.streamed_blocks == expected
    assert residency.describe_peaks() == ""  # peaks are recorded on CUDA only


def test_repeated_blocks_are_the_outermost_lists_of_one_class_with_weights():
    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = torch.nn.ModuleList([torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)])  # part of its block

    model = torch.nn.Module()
    model.layers = torch.nn.ModuleList([Block(), Block(), Block()])
    model.mixed = torch.nn.ModuleList([torch.nn.Linear(2, 2), torch.nn.Conv1d(2, 2, 1)])  # two classes
    model.weightless = torch.nn.ModuleList([torch.nn.SiLU(), torch.nn.SiLU()])
    model.single = torch.nn.ModuleList([torch.nn.Linear(2, 2)])  # nothing repeats
    model.tower = torch.nn.Module()
    model.tower.blocks = torch.nn.ModuleList([torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)])
    assert repeated_blocks(model) == [*model.layers, *model.tower.blocks]


def test_memory_mode_streams_the_text_encoder_layers_one_at_a_time(tiny_distill_dir):
    """Each text encoder's layers are on the device only while they run, and none after the text stage; the
    encoders' other weights (embeddings, final norm) are there for the whole stage."""
    torch.set_num_threads(1)
    worker = ModelWorker(build_engine_config(str(tiny_distill_dir), device="cpu", performance_mode="memory",
                                             attention_backend="sdpa"))
    apply_offload(worker.pipeline, "memory", compute_device="cpu",
                  plan=transformer_plan(worker.pipeline.models.transformer))
    residency = worker.pipeline.residency
    attached_at_call: list[tuple[str, int, list[int]]] = []
    for name in ("text_encoder", "text_encoder_2"):
        streamer = residency.streamers[name]
        assert streamer.blocks == repeated_blocks(worker.pipeline.components()[name])
        for index, block in enumerate(streamer.blocks):
            block.register_forward_pre_hook(
                lambda module, args, name=name, index=index, streamer=streamer: attached_at_call.append(
                    (name, index, [i for i, w in enumerate(streamer.weights) if not w.attached_to_host()])))
    _generate(worker)
    assert {(name, index) for name, index, _ in attached_at_call} == {(n, i) for n in ("text_encoder", "text_encoder_2")
                                                                   for i in range(2)}
    for name, index, attached in attached_at_call:
        assert attached == [index], (name, index, attached)
    for name in ("text_encoder", "text_encoder_2"):
        assert all(weights.attached_to_host() for weights in residency.streamers[name].weights)


def test_block_streaming_copies_each_block_once_one_ahead(tiny_distill_dir):
    torch.set_num_threads(1)
    worker = ModelWorker(build_engine_config(str(tiny_distill_dir), device="cpu", performance_mode="memory",
                                             attention_backend="sdpa"))
    transformer = worker.pipeline.models.transformer
    apply_offload(worker.pipeline, "memory", compute_device="cpu", plan=transformer_plan(transformer))
    streamer = worker.pipeline.residency.streamers["transformer"]
    blocks = plan_blocks(transformer, transformer_plan(transformer))
    assert streamer.blocks == blocks and len(blocks) > 2
    copies: list[int] = []
    for index, weights in enumerate(streamer.weights):
        def copy_to(device, index=index, original=weights.copy_to):
            copies.append(index)
            return original(device)

        weights.copy_to = copy_to
    resident_at_call: list[tuple[int, set[int], set[int]]] = []  # (block, attached, prefetched)
    for index, block in enumerate(blocks):  # registered after the streamer's hooks, so they see its work done
        block.register_forward_pre_hook(
            lambda module, args, index=index: resident_at_call.append(
                (index, {i for i, w in enumerate(streamer.weights) if w.on_device}, set(streamer.prefetched))))
    _generate(worker)
    count = len(blocks)
    calls = len(resident_at_call) // count
    assert calls >= 2 and len(resident_at_call) == calls * count
    # The plan order is the run order: text blocks (video, audio), then the fused blocks.
    assert [index for index, _, _ in resident_at_call] == list(range(count)) * calls
    # Each block copied once per DiT call; the last block prefetches the first for the next call, and the one made
    # after the last call is dropped at the end of the stage.
    assert copies == list(range(count)) * calls + [0]
    assert all(attached == {index} and prefetched == {(index + 1) % count}
               for index, attached, prefetched in resident_at_call)
    assert not any(weights.on_device for weights in streamer.weights)


@pytest.mark.parametrize("mode", ["balanced", "memory"])
def test_super_resolution_with_offload_is_bitwise_equal(tiny_sr_dir, tmp_path, mode):
    torch.set_num_threads(1)
    clip = make_clip(tmp_path / "clip.mp4", width=64, height=32, num_frames=9, fps=24)
    worker = ModelWorker(build_engine_config(str(tiny_sr_dir), device="cpu", performance_mode=mode))
    params = SamplingParams(video_path=str(clip), sr_resolution_scale=2, num_inference_steps=2, seed=3)
    resident = worker.run(params, NO_FILE)
    apply_offload(worker.pipeline, mode, compute_device="cpu",
                  plan=transformer_plan(worker.pipeline.models.transformer))
    residency = worker.pipeline.residency
    seen = _spy_stages(worker.pipeline, residency, ({"vae"}, {"latent_upscaler"}, {"transformer"}))
    offloaded = worker.run(params, NO_FILE)
    assert np.array_equal(offloaded.frames, resident.frames)
    assert {name for name, _ in seen} == {"vae", "latent_upscaler", "transformer"}
    assert not _on_device(residency)


def test_cli_performance_mode_reaches_the_worker(tiny_distill_dir, tmp_path, monkeypatch, in_process_worker):
    """`--performance-mode memory` through `main`: the in-process worker loads on the host and offloads (forced on,
    since a CPU device has nowhere to offload to)."""
    from k6serve.cli.main import main

    monkeypatch.setattr(ModelWorker, "offloads", property(lambda self: True))
    assert main(["generate", "--model-path", str(tiny_distill_dir), "--device", "cpu", "--attention-backend",
                 "sdpa", "--performance-mode", "memory", "--prompt", "x", "--height", "32", "--width", "32",
                 "--num-frames", "5", "--output-path", str(tmp_path)]) == 0
    (worker,) = in_process_worker
    assert worker.config.runtime.performance_mode == "memory" and worker.weights_device == torch.device("cpu")
    assert worker.offload_report.mode == "memory" and worker.offload_report.num_streamed_blocks > 0
    assert not _on_device(worker.pipeline.residency)
    assert len(list(tmp_path.glob("*.mp4"))) == 1


@pytest.mark.parametrize(
    ("layout", "named"),
    [
        ({"num_gpus": 2, "tp_size": 2}, "--tp-size 2"),
        ({"num_gpus": 2, "ulysses_degree": 2, "use_fsdp_inference": True}, "--use-fsdp-inference"),
        ({"num_gpus": 2, "ulysses_degree": 2, "encoder_parallel": "fold"}, "--encoder-parallel fold"),
    ],
)
@pytest.mark.parametrize("mode", ["balanced", "memory"])
def test_offload_refuses_sharded_weights(layout, named, mode):
    with pytest.raises(ValueError, match=rf"--performance-mode {mode} offloads the weights.*\({named}\): use "
                                         rf"--performance-mode speed to keep {named}, or drop {named} to offload\.$"):
        build_engine_config("demo", performance_mode=mode, **layout)
    build_engine_config("demo", performance_mode="speed", **layout)  # the same layout without offloading is fine


def test_offload_refusal_through_the_cli(capsys):
    from k6serve.cli.main import main

    assert main(["generate", "--model-path", "demo", "--prompt", "x", "--num-gpus", "2", "--tp-size", "2",
                 "--performance-mode", "balanced"]) == 2
    assert "cannot work with weights sharded across GPUs (--tp-size 2)" in capsys.readouterr().err


def _registered_ranges(residency: ComponentOffload) -> list[tuple[int, int]]:
    """The address ranges of every registered (page-locked) host buffer of the offloaded components."""
    weights = [*residency.weights.values(), *(w for streamer in residency.streamers.values() for w in streamer.weights)]
    return [(buffer.pointer, buffer.pointer + buffer.num_bytes) for host in weights for buffer in host.pinned_buffers
            if buffer.registered]


def _in_ranges(tensor: torch.Tensor, ranges: list[tuple[int, int]]) -> bool:
    start, end = tensor.data_ptr(), tensor.data_ptr() + tensor.numel() * tensor.element_size()
    return any(low <= start and end <= high for low, high in ranges)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="pinned memory, the side stream and events need CUDA")
@pytest.mark.parametrize("mode", ["balanced", "memory"])
def test_cuda_offload_matches_resident(tiny_distill_dir, mode, monkeypatch):
    """On a GPU: the worker loads on the host and offloads from pinned memory; the outputs equal a resident run of
    the same mode bit for bit, and no weight is left on the GPU after the request."""
    config = build_engine_config(str(tiny_distill_dir), device="cuda", performance_mode=mode,
                                 attention_backend="sdpa")
    offloaded_worker = ModelWorker(config)
    assert offloaded_worker.offload_report.pinned and offloaded_worker.weights_device.type == "cpu"
    offloaded = _generate(offloaded_worker)
    # torch 2.11's `is_pinned()` only knows its own pinned allocator (measured: False on registered pages, which
    # copied at 53 GB/s against 6 GB/s pageable on the H200), so the check is against the registered buffers.
    ranges = _registered_ranges(offloaded_worker.pipeline.residency)
    for module in offloaded_worker.pipeline.components().values():
        assert all(p.device.type == "cpu" and _in_ranges(p, ranges) for p in module.parameters())
    # The peak after each stage, in stage order, only grows; the last is the request's peak.
    peaks = offloaded_worker.pipeline.residency.peak_after
    assert [stage for stage, _ in peaks] == ["text_encoder+text_encoder_2", "transformer", "audio_vae+vocoder", "vae"]
    assert [peak for _, peak in peaks] == sorted(peak for _, peak in peaks)
    assert offloaded_worker.pipeline.residency.describe_peaks().endswith(" GiB")
    monkeypatch.setattr(ModelWorker, "offloads", property(lambda self: False))
    resident = _generate(ModelWorker(config))
    assert np.array_equal(offloaded.frames, resident.frames) and np.array_equal(offloaded.audio, resident.audio)


def test_pinned_chunks_are_registered_at_their_exact_size_and_unregistered_with_their_buffers(monkeypatch):
    """Pinned chunks are exact-size host allocations locked with cudaHostRegister (torch's pinned allocator would
    round each up to a power of two: +11% for the Pro DiT), page-aligned, and unregistered when their weights go,
    before the memory can be freed; the weights compute the same from them. A fake cudart stands in for CUDA."""
    import gc

    from k6serve.offload.host_weights import PAGE_BYTES, HostWeights

    registered: dict[int, int] = {}
    unregistered: list[int] = []

    class FakeCudart:
        @staticmethod
        def cudaHostRegister(pointer, num_bytes, flags):
            assert flags == 0 and pointer not in registered
            registered[pointer] = num_bytes
            return 0

        @staticmethod
        def cudaHostUnregister(pointer):
            unregistered.append(pointer)
            return 0

    monkeypatch.setattr(torch.cuda, "cudart", lambda: FakeCudart)
    # The whole demo pipeline, pinned: every parameter lies in a registered buffer (what the CUDA test checks).
    worker = ModelWorker(build_engine_config("demo", device="cpu", attention_backend="sdpa"))
    residency_report = apply_offload(worker.pipeline, "memory", compute_device="cpu", pin=True,
                                     plan=transformer_plan(worker.pipeline.models.transformer))
    ranges = _registered_ranges(worker.pipeline.residency)
    assert residency_report.pinned and ranges
    assert all(_in_ranges(p, ranges) for module in worker.pipeline.components().values() for p in module.parameters())
    del worker, residency_report, ranges
    gc.collect()
    registered.clear()
    unregistered.clear()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(48, 40), torch.nn.Linear(40, 8).double())
    inputs = torch.randn(3, 48)
    expected = model[1](model[0](inputs).double())
    weights = HostWeights(list(model.parameters()), offload_device=torch.device("cpu"), pin=True)
    assert sorted(registered.values()) == sorted(chunk.numel() * chunk.element_size() for chunk in weights.chunks)
    assert all(pointer % PAGE_BYTES == 0 for pointer in registered)
    assert {chunk.data_ptr() for chunk in weights.chunks} == set(registered)
    assert torch.equal(model[1](model[0](inputs).double()), expected)
    weights.to_device(torch.device("cpu"))
    assert torch.equal(model[1](model[0](inputs).double()), expected)
    weights.to_host()
    del weights
    gc.collect()
    assert sorted(unregistered) == sorted(registered)
    assert torch.equal(model[1](model[0](inputs).double()), expected)  # the views outlive the buffers, still valid


def test_a_refused_registration_says_what_to_do(monkeypatch):
    from k6serve.offload.host_weights import PinnedBuffer

    class Refusing:
        @staticmethod
        def cudaHostRegister(pointer, num_bytes, flags):
            return 2  # cudaErrorMemoryAllocation

    monkeypatch.setattr(torch.cuda, "cudart", lambda: Refusing)
    with pytest.raises(RuntimeError, match=r"cudaHostRegister of 3 MiB .*ulimit -l.*--performance-mode speed"):
        PinnedBuffer(3 * 2**20)


def test_a_failed_registration_call_leaves_no_cuda_error_behind(monkeypatch, caplog):
    """CUDA keeps a failed runtime call's error as the thread's last error, and torch raises it at its next kernel
    launch: a refused registration (the caller then falls back to pageable memory) or a failed unregister would fail
    an unrelated kernel (on an H200, a text encoder's embedding lookup). Both are read back, and the failed unregister
    is logged. A buffer unregisters through the runtime that registered it, even after that runtime was replaced."""
    import gc

    from k6serve.offload import host_weights

    class Failing:
        register_error = 0

        def cudaHostRegister(self, pointer, num_bytes, flags):
            return self.register_error

        @staticmethod
        def cudaHostUnregister(pointer):
            return 713  # cudaErrorHostMemoryNotRegistered

    class Runtime:
        reads = 0

        def cudaGetLastError(self):
            self.reads += 1
            return 0

    cudart, runtime = Failing(), Runtime()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: cudart)
    monkeypatch.setattr(host_weights, "_cuda_runtime_library", lambda: runtime)
    buffer = host_weights.PinnedBuffer(4096)
    assert buffer.registered and runtime.reads == 0
    monkeypatch.setattr(torch.cuda, "cudart", lambda: pytest.fail("unregistered through another runtime"))
    with caplog.at_level("WARNING", logger=host_weights.__name__):
        del buffer
        gc.collect()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: cudart)
    assert runtime.reads == 1
    assert "cudaHostUnregister of 0 MiB" in caplog.text and "CUDA error 713" in caplog.text
    cudart.register_error = 2
    with pytest.raises(RuntimeError, match="cudaHostRegister of 0 MiB"):
        host_weights.PinnedBuffer(4096)
    assert runtime.reads == 2


class _RecordingCudart:
    """Stands in for CUDA's registration calls: records each registration (address, size, thread) and
    unregistration, and refuses registrations of `refuse_bytes`."""

    def __init__(self, refuse_bytes: int = -1) -> None:
        self.registered: list[tuple[int, int, str]] = []
        self.unregistered: list[int] = []
        self.refuse_bytes = refuse_bytes
        self.lock = threading.Lock()

    def cudaHostRegister(self, pointer, num_bytes, flags):
        if num_bytes == self.refuse_bytes:
            return 2
        with self.lock:
            self.registered.append((pointer, num_bytes, threading.current_thread().name))
        return 0

    def cudaHostUnregister(self, pointer):
        with self.lock:
            self.unregistered.append(pointer)
        return 0


def _wait_for(condition, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.01)


def test_pinned_chunks_are_locked_ahead_on_background_threads(monkeypatch):
    """A copy of many chunks page-locks the next ones on background threads while it fills the current one, at most
    PIN_AHEAD_CHUNKS ahead; the chunks come in order, start on a huge-page boundary, and hold the values bit for bit."""
    import gc

    from k6serve.offload import host_weights

    cudart = _RecordingCudart()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: cudart)
    monkeypatch.setattr(host_weights, "CHUNK_BYTES", 4096)
    sizes = [4096 * (1 + index % 3) for index in range(12)]
    buffers = host_weights.pinned_buffers(sizes)
    first = next(buffers)
    # Taking the first chunk leaves the next PIN_AHEAD_CHUNKS being locked (by two threads, in either order), no more.
    _wait_for(lambda: len(cudart.registered) >= 1 + host_weights.PIN_AHEAD_CHUNKS)
    time.sleep(0.05)
    assert len(cudart.registered) == 1 + host_weights.PIN_AHEAD_CHUNKS
    assert sorted(size for _, size, _ in cudart.registered) == sorted(sizes[: 1 + host_weights.PIN_AHEAD_CHUNKS])
    assert all(thread.startswith("k6serve-pin") for _, _, thread in cudart.registered)
    rest = list(buffers)
    assert [buffer.num_bytes for buffer in [first, *rest]] == sizes
    assert all(buffer.pointer % host_weights.HUGE_PAGE_BYTES == 0 for buffer in [first, *rest])
    del first, rest, buffers
    gc.collect()
    assert sorted(cudart.unregistered) == sorted(pointer for pointer, _, _ in cudart.registered)

    torch.manual_seed(0)
    tensors = [torch.randn(700 + index) for index in range(9)]
    values = [tensor.clone() for tensor in tensors]
    weights = host_weights.HostWeights(tensors, offload_device=torch.device("cpu"), pin=True)
    assert len(weights.chunks) == 9 and all(torch.equal(a, b) for a, b in zip(tensors, values, strict=True))
    assert [chunk.data_ptr() for chunk in weights.chunks] == [buffer.pointer for buffer in weights.pinned_buffers]


def test_a_refused_lock_ahead_is_raised_in_order_and_drops_the_buffers_made_ahead(monkeypatch):
    import gc

    from k6serve.offload import host_weights

    cudart = _RecordingCudart(refuse_bytes=8192)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: cudart)
    buffers = host_weights.pinned_buffers([4096, 4096, 8192, *[4096] * 5])
    taken = [next(buffers), next(buffers)]
    with pytest.raises(RuntimeError, match="cudaHostRegister of 0 MiB"):
        next(buffers)
    buffers.close()
    gc.collect()
    # Every buffer locked ahead is unregistered again; the two taken stay registered.
    held = {buffer.pointer for buffer in taken}
    assert len(cudart.registered) >= 2
    assert sorted(cudart.unregistered) == sorted(pointer for pointer, _, _ in cudart.registered if pointer not in held)

    # Inference mode is per thread: the buffers locked ahead follow the caller's.
    with torch.inference_mode():
        made = list(host_weights.pinned_buffers([4096] * 3))
    assert all(buffer.data.is_inference() for buffer in made)
    assert not any(buffer.data.is_inference() for buffer in host_weights.pinned_buffers([4096] * 3))


def test_background_threads_register_and_unregister_on_the_callers_gpu(monkeypatch):
    """The CUDA device is per thread, and a thread that never set one is on device 0: the lock-ahead threads and a
    free on another thread (the release's reaper) would create a context on GPU 0 from a rank on GPU 1. Both run
    their CUDA calls on the device of the thread that asked (here "device 1", with stand-ins for CUDA)."""
    import contextlib
    import gc

    from k6serve.offload import host_weights

    cudart = _RecordingCudart()
    on_device: list[tuple[str, int | None]] = []
    monkeypatch.setattr(torch.cuda, "cudart", lambda: cudart)
    monkeypatch.setattr(host_weights, "_current_device", lambda: 1)

    def entering(index):
        on_device.append((threading.current_thread().name, index))
        return contextlib.nullcontext()

    monkeypatch.setattr(host_weights, "_on_device", entering)
    buffers = list(host_weights.pinned_buffers([4096] * 6))
    registering = {thread for _, _, thread in cudart.registered}
    assert registering and all(thread.startswith("k6serve-pin") for thread in registering)
    assert registering <= {thread for thread, index in on_device if index == 1}
    assert all(buffer.device_index == 1 for buffer in buffers)
    on_device.clear()
    freeing = threading.Thread(target=buffers.clear, name="freeing")
    freeing.start()
    freeing.join()
    gc.collect()
    assert len(cudart.unregistered) == 6 and on_device == [("freeing", 1)] * 6


def test_pinned_buffers_ask_for_huge_pages_only_when_told(monkeypatch):
    """Huge pages are asked for (`madvise(MADV_HUGEPAGE)`) on a private mapping (a shared one is shmem, which THP's
    madvise does not cover: measured 3x slower to lock), and the buffer starts on a huge-page boundary; with
    `huge_pages=False` neither."""
    import mmap

    from k6serve.offload import host_weights

    mappings: list[tuple[int, list[int]]] = []

    class Recording(mmap.mmap):
        def __new__(cls, fileno, length, flags=mmap.MAP_SHARED, **kwargs):
            region = super().__new__(cls, fileno, length, flags=flags, **kwargs)
            mappings.append((flags, []))
            region.advised = mappings[-1][1]
            return region

        def madvise(self, option, *args):
            self.advised.append(option)
            return super().madvise(option, *args)

    monkeypatch.setattr(torch.cuda, "cudart", lambda: _RecordingCudart())
    monkeypatch.setattr(mmap, "mmap", Recording)
    huge = host_weights.PinnedBuffer(5000, huge_pages=True)
    small = host_weights.PinnedBuffer(5000, huge_pages=False)
    private = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
    assert mappings == [(private, [mmap.MADV_HUGEPAGE]), (private, [])]
    assert huge.pointer % host_weights.HUGE_PAGE_BYTES == 0 and huge.data.numel() == 5000
    assert small.pointer % host_weights.PAGE_BYTES == 0 and small.data.numel() == 5000
    assert host_weights.PinnedBuffer(0).data.numel() == 0 and len(mappings) == 2  # nothing mapped for nothing


class _FakeEvent:
    """Stands in for the CUDA event recorded after a streamed block: until the host waits on it, the block's dropped
    device copy may still be in use by the GPU, so it counts as on the device."""

    def __init__(self, index: int, unfinished: list[int]) -> None:
        self.index, self.unfinished = index, unfinished
        unfinished.append(index)

    def synchronize(self) -> None:
        self.unfinished.remove(self.index)


class _Watch:
    """Observes a `BlockStreamer` on CPU (no streams there: copies are synchronous and nothing is in flight): fake
    finished events make the host's waits visible, and at every device copy and block call the streamed copies the
    device could hold (attached, prefetched, dropped but not waited for) are counted against `prefetch_blocks + 2`."""

    def __init__(self, streamer) -> None:
        self.streamer = streamer
        self.unfinished: list[int] = []
        self.copies: list[int] = []
        self.most_on_device = 0
        self.prefetched_at_call: list[tuple[int, list[int]]] = []  # (block, prefetched after its `before`)
        after = streamer.after

        def after_with_event(index):  # what `after` does on CUDA, with a fake event
            after(index)
            if index not in streamer.resident:
                streamer.finished.append(_FakeEvent(index, self.unfinished))

        streamer.after = after_with_event
        release = streamer.release

        def release_at_stage_end():  # the events are dropped unwaited; the next use is a later stage or request
            release()
            self.unfinished.clear()

        streamer.release = release_at_stage_end
        for index, weights in enumerate(streamer.weights):
            def copy_to(device, index=index, original=weights.copy_to):
                self.copies.append(index)
                self._count(copying=1)
                return original(device)

            weights.copy_to = copy_to
        for index, block in enumerate(streamer.blocks):  # registered after the streamer's hooks: they see its work
            block.register_forward_pre_hook(lambda module, args, index=index: self._called(index))

    def _count(self, copying: int = 0) -> None:
        streamer = self.streamer
        attached = sum(weights.on_device for weights in streamer.weights)
        on_device = attached + len(streamer.prefetched) + len(self.unfinished) + copying
        assert on_device <= streamer.prefetch_blocks + 2, (on_device, attached, streamer.prefetched, self.unfinished)
        self.most_on_device = max(self.most_on_device, on_device)

    def _called(self, index: int) -> None:
        self._count()
        self.prefetched_at_call.append((index, list(self.streamer.prefetched)))


def _streamed_after(index: int, count: int, resident: frozenset[int], depth: int) -> list[int]:
    """The next `depth` streamed blocks after `index` in plan order, wrapping."""
    following = [(index + step) % count for step in range(1, count)]
    return [other for other in following if other not in resident][:depth]


@pytest.fixture(scope="module")
def resident_outputs(tiny_distill_dir):
    torch.set_num_threads(1)
    worker = ModelWorker(build_engine_config(str(tiny_distill_dir), device="cpu", performance_mode="memory",
                                             attention_backend="sdpa"))
    return _generate(worker)


@pytest.mark.parametrize(("prefetch_blocks", "resident_blocks"), [(1, 0), (2, 0), (3, 0), (1, 1), (2, 1), (2, 99)])
def test_streaming_depth_and_resident_blocks_are_bitwise_equal_and_bounded(tiny_distill_dir, resident_outputs,
                                                                           prefetch_blocks, resident_blocks):
    """Every depth and resident count gives the resident model's bits; at every copy and block call at most depth
    + 2 streamed blocks are on the "device", and depth + 2 is reached (the depth is real); after each block the
    next `depth` streamed blocks are prefetched; resident blocks (strided; 99 > any block count: all of them) are
    never copied and keep their storage across calls and after the stage."""
    torch.set_num_threads(1)
    worker = ModelWorker(build_engine_config(str(tiny_distill_dir), device="cpu", performance_mode="memory",
                                             attention_backend="sdpa"))
    report = apply_offload(worker.pipeline, "memory", compute_device="cpu", prefetch_blocks=prefetch_blocks,
                           resident_blocks=resident_blocks, plan=transformer_plan(worker.pipeline.models.transformer))
    streamers = worker.pipeline.residency.streamers
    watches = {name: _Watch(streamer) for name, streamer in streamers.items()}
    storage = {name: {index: [p.data_ptr() for p in streamer.blocks[index].parameters()]
                      for index in streamer.resident} for name, streamer in streamers.items()}
    for _ in range(2):
        offloaded = _generate(worker)
        assert np.array_equal(offloaded.frames, resident_outputs.frames)
        assert np.array_equal(offloaded.audio, resident_outputs.audio)
    for name, streamer in streamers.items():
        count, watch = len(streamer.blocks), watches[name]
        # The DiT's blocks alone are kept resident; the text encoders' stay streamed (components.py says why).
        assert len(streamer.resident) == (min(resident_blocks, count) if name == "transformer" else 0)
        num_streamed = count - len(streamer.resident)
        assert report.streamed_blocks[name] == num_streamed
        assert not set(watch.copies) & streamer.resident
        assert storage[name] == {index: [p.data_ptr() for p in streamer.blocks[index].parameters()]
                                 for index in streamer.resident}
        assert not any(weights.on_device for weights in streamer.weights) and not streamer.prefetched
        if num_streamed > prefetch_blocks:
            assert watch.most_on_device == prefetch_blocks + 2, (name, watch.most_on_device)
        for index, prefetched in watch.prefetched_at_call:
            assert prefetched == _streamed_after(index, count, streamer.resident, prefetch_blocks), (name, index)
    if resident_blocks:
        assert report.resident_blocks == {"transformer": len(streamers["transformer"].resident)}
        assert report.resident_bytes["transformer"] == streamers["transformer"].resident_bytes > 0
        assert "on the GPU for the worker's life: " in report.describe()
    else:
        assert report.resident_blocks == {} and "on the GPU" not in report.describe()
    assert f"streamed {prefetch_blocks} ahead" in report.describe()


def test_streaming_bound_holds_when_cached_steps_skip_blocks(tiny_distill_dir):
    """Cache-DiT skips blocks on cached steps, so the predicted order goes wrong there: prefetches of blocks that
    did not run are dropped, not kept, and the device never holds more than depth + 2 streamed blocks."""
    torch.set_num_threads(1)
    worker = ModelWorker(build_engine_config(str(tiny_distill_dir), device="cpu", performance_mode="memory",
                                             attention_backend="sdpa"))
    apply_offload(worker.pipeline, "memory", compute_device="cpu", prefetch_blocks=2,
                  plan=transformer_plan(worker.pipeline.models.transformer))
    watch = _Watch(worker.pipeline.residency.streamers["transformer"])
    params = SamplingParams(prompt="a fox in the snow", seed=7, height=32, width=48, num_frames=5,
                            num_inference_steps=4, cache_dit_params={"max_warmup_steps": 1,
                                                                     "residual_diff_threshold": 1.0})
    result = worker.run(params, NO_FILE)
    assert result.timings["cache_dit_cached_calls"] == 3
    called = [index for index, _ in watch.prefetched_at_call]
    assert len(called) < 4 * len(watch.streamer.blocks)  # blocks were skipped
    assert watch.most_on_device == 4


def test_resident_blocks_are_strided():
    from k6serve.offload.block_stream import strided_indices

    assert strided_indices(8, 0) == frozenset()
    assert strided_indices(8, 2) == {0, 4}
    assert strided_indices(8, 3) == {0, 2, 5}
    assert strided_indices(48, 20) == {index * 48 // 20 for index in range(20)}
    assert strided_indices(4, 4) == strided_indices(4, 9) == {0, 1, 2, 3}  # more than the blocks: all of them


class _Shuffled(torch.nn.Module):
    """Seven blocks called in another order than their list's, so the streamer must learn the order."""

    ORDER = (0, 4, 1, 5, 2, 6, 3)

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(7))

    def forward(self, x):
        for index in self.ORDER:
            x = torch.tanh(self.blocks[index](x))
        return x


@pytest.mark.parametrize(("prefetch_blocks", "resident_blocks"), [(2, 0), (3, 2)])
def test_deeper_prefetch_learns_the_order_the_blocks_run_in(prefetch_blocks, resident_blocks):
    """With depth > 1 the prefetch chain is still corrected from the run order: the first call learns the order
    within a call, the second the wrap from the last block to the next call's first; from then on each streamed
    block is copied once per call, by prefetch, and after each block the next `depth` in run order are prefetched."""
    from k6serve.offload.block_stream import BlockStreamer

    model = _Shuffled()
    inputs = torch.randn(3, 8)
    expected = model(inputs)
    cpu = torch.device("cpu")
    streamer = BlockStreamer(list(model.blocks), compute_device=cpu, offload_device=cpu, pin=False,
                             prefetch_blocks=prefetch_blocks, resident_blocks=resident_blocks)
    watch = _Watch(streamer)
    for _ in range(2):
        assert torch.equal(model(inputs), expected)
    for _ in range(2):
        watch.copies.clear()
        watch.prefetched_at_call.clear()
        assert torch.equal(model(inputs), expected)
        streamed_order = [index for index in _Shuffled.ORDER if index not in streamer.resident]
        # Each streamed block once, all by prefetch (the last ones also prefetch the next call's first blocks).
        assert sorted(watch.copies) == sorted(streamed_order)
        run = list(_Shuffled.ORDER)
        for position, (index, prefetched) in enumerate(watch.prefetched_at_call):
            assert index == run[position]
            following = [run[(position + step) % len(run)] for step in range(1, len(run))]
            assert prefetched == [other for other in following if other not in streamer.resident][:prefetch_blocks]
    assert watch.most_on_device == prefetch_blocks + 2
    streamer.release()
    assert not any(weights.on_device for weights in streamer.weights) and not streamer.prefetched
    assert torch.equal(model(inputs), expected)


def test_resident_blocks_have_no_host_copy_and_stay_after_release(monkeypatch):
    """Resident blocks are packed on the compute device at install (no pinned host copy: host memory is for the
    streamed blocks), stay attached across calls and `release()`, and are never sent back by `after()`."""
    from k6serve.offload.block_stream import BlockStreamer

    registered: list[int] = []

    class FakeCudart:
        @staticmethod
        def cudaHostRegister(pointer, num_bytes, flags):
            registered.append(pointer)
            return 0

        @staticmethod
        def cudaHostUnregister(pointer):
            return 0

    monkeypatch.setattr(torch.cuda, "cudart", lambda: FakeCudart)
    model = _Shuffled()
    inputs = torch.randn(3, 8)
    expected = model(inputs)
    cpu = torch.device("cpu")
    streamer = BlockStreamer(list(model.blocks), compute_device=cpu, offload_device=cpu, pin=True,
                             prefetch_blocks=2, resident_blocks=3)
    assert streamer.resident == {0, 2, 4}
    assert len(registered) == 4 and all(streamer.weights[index].pinned_buffers == [] for index in streamer.resident)
    block_bytes = streamer.weights[0].num_bytes  # every block packs alike (the bias aligned after the weight)
    assert block_bytes >= (8 * 8 + 8) * 4
    assert (streamer.resident_bytes, streamer.streamed_bytes) == (3 * block_bytes, 4 * block_bytes)
    storage = {index: [p.data_ptr() for p in model.blocks[index].parameters()] for index in streamer.resident}
    for _ in range(2):
        assert torch.equal(model(inputs), expected)
        streamer.release()
        assert storage == {index: [p.data_ptr() for p in model.blocks[index].parameters()]
                           for index in streamer.resident}
    assert all(streamer.weights[index].attached_to_host() for index in range(7) if index not in streamer.resident)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"performance_mode": "memory", "offload_prefetch_blocks": 0},
         r"--offload-prefetch-blocks must be an integer >= 1 \(blocks copied ahead of the running one\), got 0"),
        ({"performance_mode": "memory", "offload_prefetch_blocks": 1.5}, r"--offload-prefetch-blocks must be an "
                                                                         r"integer >= 1 .*got 1.5"),
        ({"performance_mode": "memory", "offload_resident_blocks": -1},
         r"--offload-resident-blocks must be an integer >= 0 \(DiT blocks kept on the GPU\)"),
        ({"performance_mode": "memory", "offload_resident_blocks": True}, r"--offload-resident-blocks must be an "
                                                                          r"integer >= 0 .*got True"),
        ({"offload_prefetch_blocks": 2}, r"^--offload-prefetch-blocks 2 applies only when blocks are streamed "
                                         r"between host and GPU, and `--performance-mode speed` streams none\. Stream "
                                         r"the DiT \(--performance-mode memory, --layerwise-offload-components "
                                         r"transformer or --component-residency transformer=layerwise_offload, with no "
                                         r"other flag keeping it whole or resident\), or drop it\.$"),
        ({"performance_mode": "balanced", "offload_prefetch_blocks": 3, "offload_resident_blocks": 4},
         r"^--offload-prefetch-blocks 3 and --offload-resident-blocks 4 apply only when the DiT's blocks are "
         r"streamed.*`--performance-mode balanced` streams none\. Stream the DiT .*, or drop them\.$"),
        # memory mode with the DiT offloaded whole streams only the text encoders: no resident DiT blocks
        ({"performance_mode": "memory", "cpu_offload_components": "transformer", "offload_resident_blocks": 2},
         r"^--offload-resident-blocks 2 applies only when the DiT's blocks are streamed.*`--performance-mode memory "
         r"--cpu-offload-components transformer` streams only text encoders\."),
    ],
)
def test_block_streaming_options_are_validated(options, message):
    with pytest.raises(ValueError, match=message):
        build_engine_config("demo", **options)


def test_block_streaming_defaults_are_accepted_in_every_mode():
    for mode in ("speed", "balanced", "memory"):
        runtime = build_engine_config("demo", performance_mode=mode, offload_prefetch_blocks=1,
                                      offload_resident_blocks=0).runtime
        assert (runtime.offload_prefetch_blocks, runtime.offload_resident_blocks) == (1, 0)


@pytest.mark.parametrize("command", ["generate", "serve"])
def test_block_streaming_flags_reach_the_runtime_config(command, tmp_path, engine_config_from_cli):
    """The CLI flags of both commands, a --config file and the Python API's keyword arguments."""
    from k6serve.api import DiffGenerator

    extra = ["--prompt", "x"] if command == "generate" else []
    runtime = engine_config_from_cli(command, "--model-path", "demo", "--performance-mode", "memory",
                                     "--offload-prefetch-blocks", "2", "--offload-resident-blocks", "20",
                                     *extra).runtime
    assert (runtime.offload_prefetch_blocks, runtime.offload_resident_blocks) == (2, 20)
    config_file = tmp_path / "engine.yaml"
    config_file.write_text("performance-mode: memory\noffload-prefetch-blocks: 3\noffload-resident-blocks: '4'\n")
    runtime = engine_config_from_cli(command, "--model-path", "demo", "--config", str(config_file), *extra).runtime
    assert (runtime.offload_prefetch_blocks, runtime.offload_resident_blocks) == (3, 4)
    captured = {}

    class FakeEngine:
        def __init__(self, config):
            captured["config"] = config

        def shutdown(self):  # the generator stops its engine when dropped
            pass

    import k6serve.api

    original = k6serve.api.Engine
    k6serve.api.Engine = FakeEngine
    try:
        DiffGenerator.from_pretrained("demo", performance_mode="memory", offload_prefetch_blocks=2,
                                      offload_resident_blocks=5)
    finally:
        k6serve.api.Engine = original
    assert (captured["config"].runtime.offload_prefetch_blocks,
            captured["config"].runtime.offload_resident_blocks) == (2, 5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the side stream, events and pinned copies need CUDA")
def test_cuda_deeper_prefetch_and_resident_blocks_match_resident_and_bound_the_memory(tiny_distill_dir, monkeypatch):
    """On a GPU with depth 2 and 2 resident blocks: the outputs equal a resident run bit for bit; at every DiT block
    call the streamed copies the device may hold (attached, prefetched, and those dropped after a block whose
    finished event the host has not waited on) are at most depth + 2 = 4; the DiT's peak allocation exceeds that of
    depth 1 without resident blocks by at most two streamed blocks (one more copy ahead, and a finishing block the
    allocator may or may not have freed yet) plus the resident bytes, so no copy is kept across calls; the resident
    blocks stay on the GPU after the request, the streamed ones back on the host."""
    def dit_peak_and_counts(prefetch_blocks, resident_blocks):
        config = build_engine_config(str(tiny_distill_dir), device="cuda", performance_mode="memory",
                                     attention_backend="sdpa", offload_prefetch_blocks=prefetch_blocks,
                                     offload_resident_blocks=resident_blocks)
        worker = ModelWorker(config)
        streamer = worker.pipeline.residency.streamers["transformer"]
        counts: list[int] = []
        peaks: list[int] = []
        for block in streamer.blocks:  # after the streamer's hooks
            block.register_forward_pre_hook(lambda module, args: counts.append(
                sum(w.on_device for w in streamer.weights) + len(streamer.prefetched) + len(streamer.finished)))
        transformer = worker.pipeline.models.transformer
        transformer.register_forward_pre_hook(lambda module, args: torch.cuda.reset_peak_memory_stats())
        transformer.register_forward_hook(lambda module, args, output: peaks.append(torch.cuda.max_memory_allocated()))
        return worker, streamer, _generate(worker), max(peaks), counts

    # The baseline first: its worker leaves nothing on the GPU, while the other's resident blocks stay there.
    _, _, baseline, baseline_peak, _ = dit_peak_and_counts(1, 0)
    worker, streamer, offloaded, peak, counts = dit_peak_and_counts(2, 2)
    assert len(streamer.resident) == 2 and max(counts) <= 4
    for index, block in enumerate(streamer.blocks):
        assert all(p.device.type == ("cuda" if index in streamer.resident else "cpu") for p in block.parameters())
    largest_block = max(w.num_bytes for i, w in enumerate(streamer.weights) if i not in streamer.resident)
    assert np.array_equal(offloaded.frames, baseline.frames)
    assert peak - baseline_peak <= 2 * largest_block + streamer.resident_bytes
    monkeypatch.setattr(ModelWorker, "offloads", property(lambda self: False))
    resident = _generate(ModelWorker(build_engine_config(str(tiny_distill_dir), device="cuda",
                                                         performance_mode="memory", attention_backend="sdpa")))
    assert np.array_equal(offloaded.frames, resident.frames) and np.array_equal(offloaded.audio, resident.audio)
