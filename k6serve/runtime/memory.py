"""Release and resume a worker's device memory between requests (sleep / wake, for an RL trainer on the same GPUs).

A release moves every tensor the worker keeps on its device between requests into host memory, by re-pointing each
tensor's `.data` (`offload/host_weights.py`), so the `nn.Parameter` objects, the hooks and the compiled graphs that
refer to them stay the same; then it frees the allocator's caches and reports what the process still holds
(`device_memory.py`). A resume copies everything back bit for bit and drops the host copies on a background thread
(`HostCopyReaper`: unregistering and unmapping tens of GiB took 4 of a 5.4 s resume). Each direction is
all or nothing on a worker: a failed release (host memory) or resume (device memory still taken by the trainer)
leaves every tensor where it was.

What is moved (`device_tensors`): each pipeline component's parameters and buffers (speed mode's fused projections
and folded buffers are registered there too), tensors kept as plain module attributes, and the dynamic LoRA
adapters' device copies. Tensors attached to the offload residency's host copies (`--performance-mode balanced /
memory`, between stages) are already in host memory and stay as they are; a residency copy that lives on the device
itself (block streaming's resident blocks) is moved as a whole (`device_homes`): its chunks, the views into them and
the tensors attached to them, so the streamer finds them where it left them after a resume. What is dropped
instead: `--compile-prompt-rewrite true`'s static KV cache (`StaticRewriteCache`, 117 MB for Qwen2.5-VL-7B at 2,048
positions), whose contents no request reads again; the next rewrite makes it anew. The CUDA graphs transformers
records of the compiled rewrite keep their private memory pool (one token's activations; not measured).

Tensor-parallel weights (`--tp-size`, and the text encoders under `--encoder-parallel fold`) are DTensors: the
`nn.Parameter` is a wrapper holding no memory, and this rank's shard is the plain tensor `_local_tensor`. That local
tensor is what moves (`local_shard`): re-pointing its `.data` keeps the DTensor, its placements and the Parameter
the same objects, and nothing else keeps the shard's storage between requests (a DTensor's `.data` and `to_local()`
hand out the shard or an alias of it per call, which the callers drop).

FSDP (`--use-fsdp-inference`) is refused (`memory_release_refusal`): each parameter's `FSDPParam` keeps its own
sharded storage, which the DTensor's local tensor views, and its all-gather buffers, so re-pointing the local tensor
would leave FSDP reading and gathering from storage that no longer holds the weights.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn
from typing_extensions import TypedDict

from k6serve.config import ParallelConfig
from k6serve.offload.host_weights import HostWeights, PinnedBuffer, module_tensors
from k6serve.runtime.device_memory import DeviceMemoryState, device_memory_state, free_allocator_caches, indexed

logger = logging.getLogger(__name__)

LORA_ADAPTERS = "lora_adapters"  # the report's name for the dynamic LoRA adapters' device copies
RESIDENT_BLOCKS = "offload_resident_blocks"  # ... and for the residency's copies kept on the device (`device_homes`)


RankStatus = Literal["released", "resumed", "already_released", "not_released"]


class _RankPlace(TypedDict, total=False):  # (not NotRequired[...]: see device_memory.DeviceMemoryState)
    replica: int  # where the engine runs ranks in their own processes
    rank: int


class MemoryRankReport(_RankPlace):
    """One rank's report of a release or resume (`MemoryRelease`)."""
    status: RankStatus
    message: str
    memory_released: bool
    moved_bytes: int
    moved_bytes_by_owner: dict[str, int]  # component name, `LORA_ADAPTERS` or `RESIDENT_BLOCKS` -> bytes
    host_bytes: int  # the host copies held now
    host_copy_kept: bool
    host_bytes_being_freed: int  # the last resume's host copies, still being unmapped in the background
    pinned: bool
    seconds: float
    after: DeviceMemoryState


class MemoryReply(TypedDict):
    """The engine's answer to a release or resume: a summary over every rank's report, and the reports."""
    status: Literal["ok", "already_released", "not_released"]
    message: str
    memory_released: bool
    moved_bytes: int
    num_waiting_requests: int  # requests held for a resume
    ranks: list[MemoryRankReport]  # one per rank of every replica


@dataclass(frozen=True, kw_only=True, slots=True)
class ReleaseMemory:
    """Move the worker's device tensors to host memory and free the allocator caches; generation waits meanwhile."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ResumeMemory:
    """Copy the released tensors back to the device, bit for bit, and free their host copies; or, with
    `keep_host_copy`, keep them, so that the next release only re-points the tensors to them (no copy, no host
    allocation: an RL loop's every release after the first is then immediate). The weights are frozen, so the kept
    copy stays equal to the device one; a LoRA change (which can merge into the weights) drops it."""

    keep_host_copy: bool = False


MemoryOperation = ReleaseMemory | ResumeMemory


def memory_release_refusal(parallel: ParallelConfig) -> str | None:
    """Why this layout's memory cannot be released, naming the flag to drop; None when it can."""
    if not parallel.use_fsdp_inference:
        return None
    return ("A memory release cannot move weights sharded by --use-fsdp-inference: FSDP keeps its own "
            "sharded storage and all-gather buffers for every parameter, which re-pointing the weights to host memory "
            "would break. Drop --use-fsdp-inference to release memory (--tp-size, --encoder-parallel fold, Ulysses, "
            "Ring, CFG-parallel and --dp-size work).")


def local_shard(tensor: torch.Tensor) -> torch.Tensor:
    """The plain tensor holding `tensor`'s memory on this rank: a DTensor's local shard, else `tensor` itself.

    `_local_tensor` rather than `to_local()`: with torch 2.13 `to_local()` of a Parameter returns a fresh view even
    without autograd (so re-pointing it would not move the shard); with torch 2.11 it returns `_local_tensor`."""
    from torch.distributed.tensor import DTensor

    return tensor._local_tensor if isinstance(tensor, DTensor) else tensor


def _residency_copies(pipeline) -> list[HostWeights]:
    """The offload residency's packed copies: per component, and per streamed block (none without offloading)."""
    residency = pipeline.residency
    weights = list(getattr(residency, "weights", {}).values())
    for streamer in getattr(residency, "streamers", {}).values():
        weights.extend(streamer.weights)
    return weights


def device_homes(pipeline, device: torch.device) -> list[HostWeights]:
    """The residency's copies that live on `device` itself (resident blocks), which a release moves whole; on a CPU
    device every copy is in host memory already."""
    device = indexed(device)
    return [weights for weights in _residency_copies(pipeline)
            if device.type != "cpu" and weights.chunks and weights.chunks[0].device == device]


def _attached_to_residency(pipeline) -> set[int]:
    """Ids of the tensors using one of the residency's copies now: left to it (host) or moved with it (device)."""
    return {id(slot.tensor) for weights in _residency_copies(pipeline) for slot in weights.slots
            if slot.tensor.data_ptr() == slot.host.data_ptr()}


def _attribute_tensors(module: nn.Module, seen: set[int]) -> list[torch.Tensor]:
    """Tensors held as plain attributes of `module` or its submodules (not parameters or buffers), e.g. a copy of
    a rotary table that a library keeps beside its buffer."""
    found = []
    for submodule in module.modules():
        for value in vars(submodule).values():
            if isinstance(value, torch.Tensor) and id(value) not in seen:
                seen.add(id(value))
                found.append(value)
    return found


def device_tensors(pipeline, lora_manager, device: torch.device) -> dict[str, list[torch.Tensor]]:
    """Every tensor the worker keeps on `device` between requests, by owner (component name, or LORA_ADAPTERS); a
    DTensor is given as its local shard, the tensor that holds its memory and moves."""
    device = indexed(device)
    seen = _attached_to_residency(pipeline)
    groups: dict[str, list[torch.Tensor]] = {}
    for name, module in pipeline.components().items():
        tensors = module_tensors([module], seen)
        seen.update(id(tensor) for tensor in tensors)
        tensors += _attribute_tensors(module, seen)
        groups[name] = tensors
    if lora_manager is not None:
        caches = [delta.cache.values() for _, wrapper in lora_manager.wrappers for delta in wrapper.deltas]
        groups[LORA_ADAPTERS] = [tensor for cache in caches for pair in cache for tensor in pair]
    return {name: [local for local in map(local_shard, tensors) if local.device == device]
            for name, tensors in groups.items()}


def _check_movable(groups: dict[str, list[torch.Tensor]]) -> None:
    from torch.distributed.tensor import DTensor

    assert not any(isinstance(t, DTensor) for tensors in groups.values() for t in tensors), \
        "DTensors move as their local shards (`device_tensors`)"
    # HostWeights copies each tensor on its own: tensors viewing one another's memory would come back unshared.
    ranges = sorted((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size(), name)
                    for name, tensors in groups.items() for t in tensors if t.numel())
    for (_, end, name), (start, _, other) in itertools.pairwise(ranges):
        assert start >= end, f"a tensor of {name} overlaps one of {other}: they cannot be released separately"


def _nbytes(tensors: list[torch.Tensor]) -> int:
    return sum(tensor.numel() * tensor.element_size() for tensor in tensors)


@dataclass(eq=False, slots=True)
class _HostCopy:
    """One group's tensors of one kind in host chunks (inference tensors are moved inside inference mode, so they
    stay inference tensors; the others outside it, so they do not become ones)."""

    name: str
    weights: HostWeights
    inference: bool

    def mode(self):
        return torch.inference_mode(self.inference)


@dataclass(eq=False, slots=True)
class _MovedHome:
    """A residency copy moved off the device: its device chunks were replaced by `chunks` (held by `buffers` when
    pinned)."""

    weights: HostWeights
    buffers: list[PinnedBuffer]


def _copy_chunks(weights: HostWeights, device: torch.device, *, pin: bool) -> tuple[list[torch.Tensor], list]:
    """A copy of each of `weights`' chunks on `device` (packed 1-D chunks pinned when `pin`), and the pinned buffers."""
    chunks, buffers = [], []
    for chunk in weights.chunks:
        if pin and chunk.dim() == 1:
            buffer = PinnedBuffer(chunk.numel() * chunk.element_size())
            buffers.append(buffer)
            chunks.append(buffer.view(chunk.dtype).copy_(chunk))
        else:
            chunks.append(chunk.to(device, copy=True))
    return chunks, buffers


def _rehome(weights: HostWeights, chunks: list[torch.Tensor]) -> None:
    """Make `chunks` `weights`' copy: each slot's view into it, and each tensor that was attached to the old one."""
    for slot in weights.slots:
        attached = slot.tensor.data_ptr() == slot.host.data_ptr()
        chunk = chunks[slot.chunk]
        slot.host = chunk if slot.offset < 0 else chunk[slot.offset : slot.offset + slot.host.numel()].view(
            slot.host.shape)
        if attached:
            slot.tensor.data = slot.host
    weights.chunks = chunks


class HostCopyReaper:
    """Frees dropped host copies on a background thread, so a resume answers once the weights are back on the device.

    Freeing a page-locked copy unregisters and unmaps it: 4 of the 5.4 s a resume of Pro-distill's 73 GiB took on an
    H200 host (docs/benchmarks.md, twelfth session). One copy is freed at a time, and `wait` (called before a release
    allocates a new one) bounds the host memory the worker holds to one copy."""

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self.freeing_bytes = 0

    def free(self, garbage: list, num_bytes: int) -> None:
        """Free what `garbage` holds on the thread: its items are moved out of the list here, so the caller must hold
        no other reference to them."""
        self.wait()
        box = garbage[:]
        garbage.clear()
        self.freeing_bytes = num_bytes

        def run() -> None:
            box.clear()  # the last reference: the copies' buffers unregister and unmap here
            self.freeing_bytes = 0

        self._thread = threading.Thread(target=run, name="k6serve-free-host-copy", daemon=True)
        self._thread.start()

    def wait(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None


class MemoryRelease:
    """A worker's released device tensors: their host copies while released, nothing otherwise."""

    def __init__(self, device: torch.device) -> None:
        self.device = indexed(device)
        self.copies: list[_HostCopy] | None = None  # None: not released
        self.homes: list[_MovedHome] = []
        # The host copies a `keep_host_copy` resume kept (the tensors are attached to device copies meanwhile).
        self.kept: list[_HostCopy] | None = None
        self.reaper = HostCopyReaper()

    @property
    def released(self) -> bool:
        return self.copies is not None

    def drop_kept(self) -> None:
        """Forget the kept host copies (the device weights may change: a LoRA operation); the next release copies."""
        if self.kept is not None:
            kept, self.kept = self.kept, None
            self.reaper.free(kept, sum(copy.weights.num_bytes for copy in kept))  # empties `kept`

    def _reattach_kept(self, groups: dict[str, list[torch.Tensor]]) -> list[_HostCopy] | None:
        """The kept copies with every tensor re-pointed to them, if they hold exactly `groups`' tensors; else None
        (a tensor came or went since, e.g. a dynamic adapter's device copy) and they are dropped."""
        kept, self.kept = self.kept, None
        if kept is None:
            return None
        held = {id(slot.tensor) for copy in kept for slot in copy.weights.slots}
        if held != {id(tensor) for tensors in groups.values() for tensor in tensors}:
            return None
        for copy in kept:
            with copy.mode():
                copy.weights.to_host()  # re-points only: the device copies are freed with their last reference
        return kept

    def release(self, groups: dict[str, list[torch.Tensor]], homes: Sequence[HostWeights] = ()) -> MemoryRankReport:
        """Move `groups` (from `device_tensors`) and `homes` (`device_homes`) to host memory; a report of what moved
        and what is left."""
        if self.released:
            return self._report("already_released", "memory was already released; nothing changed", {}, 0.0)
        _check_movable(groups)
        start = time.perf_counter()
        self.reaper.wait()  # the last resume's host copy is gone before a new one is allocated
        pin = self.device.type == "cuda"
        self.copies = self._reattach_kept(groups)
        reused = self.copies is not None
        if self.copies is not None:
            pin = all(copy.weights.pinned for copy in self.copies)
        else:
            refused = None
            try:
                self.copies = self._copy_to_host(groups, pin=pin)
            except (RuntimeError, OSError) as error:  # cudaHostRegister refused; mmap out of memory
                if not pin:
                    raise
                refused = str(error)
            if refused is not None:
                # Page-locking can be refused (a container's locked-memory limit); pageable memory only resumes
                # slower. Copied outside the `except`: its traceback kept the failed attempt's frames, and with them
                # its page-locked chunks, alive beside the new copy.
                logger.warning("pinning the released weights failed (%s); releasing to pageable host memory", refused)
                pin = False
                self.copies = self._copy_to_host(groups, pin=False)
        try:
            moved = [_copy_chunks(weights, torch.device("cpu"), pin=pin) for weights in homes]
        except BaseException:
            self._put_back()
            raise
        for weights, (chunks, buffers) in zip(homes, moved, strict=True):
            _rehome(weights, chunks)
            self.homes.append(_MovedHome(weights, buffers))
        freed = {name: _nbytes(tensors) for name, tensors in groups.items() if tensors}
        if homes:
            freed[RESIDENT_BLOCKS] = sum(_nbytes(weights.chunks) for weights in homes)
        free_allocator_caches(self.device)
        size, pinned = f"{sum(freed.values()) / 2**20:.1f} MiB", "pinned " if pin else ""
        message = (f"re-pointed {size} to the {pinned}host copy kept at the last resume (no copy)" if reused
                   else f"moved {size} to {pinned}host memory")
        report = self._report("released", message, freed, time.perf_counter() - start)
        logger.info("memory released: %s; %s", report["message"], report["after"]["explanation"])
        return report

    def _held_copies(self) -> list[_HostCopy]:
        """The host copies, for a step that runs only while released."""
        if self.copies is None:
            raise RuntimeError("memory is not released")
        return self.copies

    def _put_back(self) -> None:
        for copy in self._held_copies():
            with copy.mode():
                copy.weights.to_device(self.device)
        self.copies = None

    def _copy_to_host(self, groups: dict[str, list[torch.Tensor]], *, pin: bool) -> list[_HostCopy]:
        """Host copies of every group, tensors re-pointed to them; on a failure every tensor is put back."""
        copies: list[_HostCopy] = []
        try:
            for name, tensors in groups.items():
                for inference in (False, True):
                    kind = [tensor for tensor in tensors if tensor.is_inference() == inference]
                    if kind:
                        with torch.inference_mode(inference):
                            copies.append(_HostCopy(name, HostWeights(kind, offload_device=torch.device("cpu"),
                                                                      pin=pin), inference))
        except BaseException:
            for copy in copies:
                with copy.mode():
                    copy.weights.to_device(self.device)
            copies.clear()  # their host chunks go now, not with the traceback that keeps this frame
            # The group that failed part-way has re-pointed some tensors already.
            for tensors in groups.values():
                for tensor in tensors:
                    if tensor.device != self.device:
                        with torch.inference_mode(tensor.is_inference()):
                            tensor.data = tensor.data.to(self.device)
            raise
        return copies

    def resume(self, *, keep_host_copy: bool = False) -> MemoryRankReport:
        """Copy every released tensor back to the device (all copies made before any tensor is re-pointed, so an
        out-of-memory leaves everything released) and drop the host copies, or keep them (`ResumeMemory`)."""
        if self.copies is None:  # `not self.released`, spelled so that mypy narrows `self.copies` below
            return self._report("not_released", "memory was not released; nothing changed", {}, 0.0)
        start = time.perf_counter()
        restored = self._copy_back()
        # Without `keep_host_copy` the host chunks go with them, on the reaper's thread. The resident blocks' host
        # chunks always go: they are small, and their streamer re-homes them (`_rehome`) on the next release anyway.
        self.kept = self.copies if keep_host_copy else None
        garbage = [home.buffers for home in self.homes] + ([] if keep_host_copy else [self.copies])
        garbage_bytes = sum(home.weights.num_bytes for home in self.homes) + (
            0 if keep_host_copy else sum(copy.weights.num_bytes for copy in self.copies))
        self.copies, self.homes = None, []
        if garbage_bytes:
            self.reaper.free(garbage, garbage_bytes)
        kept = (" (host copy kept for the next release)" if keep_host_copy
                else f"; its {garbage_bytes / 2**20:.1f} MiB host copy is freed in the background")
        report = self._report("resumed", f"copied {sum(restored.values()) / 2**20:.1f} MiB back to {self.device}{kept}",
                              restored, time.perf_counter() - start)
        logger.info("memory resumed: %s", report["message"])
        return report

    def _copy_back(self) -> dict[str, int]:
        """Attach every released tensor to a new device copy; the bytes restored per owner. (A method of its own so
        that no local variable outlives it holding a host copy, which must be freed on the reaper's thread.)"""
        copies = self._held_copies()
        device_chunks = []
        for copy in copies:
            with copy.mode():
                device_chunks.append(copy.weights.copy_to(self.device))
        home_chunks = [_copy_chunks(home.weights, self.device, pin=False)[0] for home in self.homes]
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # the copies from pinned memory are asynchronous
        restored: dict[str, int] = {}
        for copy, chunks in zip(copies, device_chunks, strict=True):
            with copy.mode():
                copy.weights.attach(chunks)
            restored[copy.name] = restored.get(copy.name, 0) + _nbytes([slot.tensor for slot in copy.weights.slots])
        for home, chunks in zip(self.homes, home_chunks, strict=True):
            _rehome(home.weights, chunks)
        if self.homes:
            restored[RESIDENT_BLOCKS] = sum(_nbytes(home.weights.chunks) for home in self.homes)
        return restored

    def _report(self, status: RankStatus, message: str, moved: dict[str, int], seconds: float) -> MemoryRankReport:
        return {
            "status": status,
            "message": message,
            "memory_released": self.released,
            "moved_bytes": sum(moved.values()),
            "moved_bytes_by_owner": moved,
            "host_bytes": sum(copy.weights.num_bytes for copy in (self.copies or self.kept or ()))
                          + sum(_nbytes(home.weights.chunks) for home in self.homes),
            "host_copy_kept": self.kept is not None,
            "host_bytes_being_freed": self.reaper.freeing_bytes,
            # The resident DiT blocks' copies (`homes`, all a memory-mode release moves) count too: they were said to
            # be in pinned memory while the report said False.
            "pinned": bool(self.copies or self.homes) and all(copy.weights.pinned for copy in self.copies or ())
                      and all(len(home.buffers) == len(home.weights.chunks) for home in self.homes),
            "seconds": round(seconds, 4),
            "after": device_memory_state(self.device),
        }


def inverse(operation: MemoryOperation) -> MemoryOperation:
    """The operation that undoes `operation` (to put back the ranks where it succeeded when another failed)."""
    return ResumeMemory() if isinstance(operation, ReleaseMemory) else ReleaseMemory()


def apply_memory_operation(worker, operation: MemoryOperation) -> MemoryRankReport:
    """Release or resume a `ModelWorker`'s device memory; its report (`MemoryRelease`). FSDP raises ValueError,
    whatever the operation."""
    refusal = memory_release_refusal(worker.config.parallel)
    if refusal is not None:
        raise ValueError(refusal)
    if isinstance(operation, ResumeMemory):
        return worker.memory_release.resume(keep_host_copy=operation.keep_host_copy)
    if worker.memory_release.released:
        return worker.memory_release.release({})
    rewrite_cache = getattr(worker.pipeline, "rewrite_cache", None)
    if rewrite_cache is not None:
        rewrite_cache.release()  # --compile-prompt-rewrite's static KV cache: remade by the next rewrite
    return worker.memory_release.release(device_tensors(worker.pipeline, worker.lora_manager, worker.device),
                                         device_homes(worker.pipeline, worker.device))


def memory_reply(operation: MemoryOperation, reports: list[MemoryRankReport], *, num_waiting: int) -> MemoryReply:
    """The engine's answer: a summary over every rank's report, and the reports (one per rank of every replica)."""
    changed = [report for report in reports if report["status"] in ("released", "resumed")]
    status: Literal["ok", "already_released", "not_released"]
    if changed:
        status = "ok"
        verb = "released" if isinstance(operation, ReleaseMemory) else "resumed"
        message = (f"memory {verb} on {len(changed)} rank(s): {sum(r['moved_bytes'] for r in changed) / 2**20:.1f} "
                   f"MiB moved {'to host memory' if verb == 'released' else 'back to the devices'}")
    else:
        # None released or resumed: each rank said "already_released" or "not_released".
        status = reports[0]["status"] if reports else "ok"  # type: ignore[assignment]
        message = reports[0]["message"] if reports else "no rank to apply it to"
    if num_waiting:
        message += (f"; {num_waiting} request(s) wait for a resume" if isinstance(operation, ReleaseMemory)
                    else f"; the {num_waiting} waiting request(s) now run, in order")
    return {
        "status": status,
        "message": message,
        "memory_released": isinstance(operation, ReleaseMemory),
        "moved_bytes": sum(report["moved_bytes"] for report in reports),
        "num_waiting_requests": num_waiting,
        "ranks": reports,
    }
