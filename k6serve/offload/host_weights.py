"""The weights of some modules kept in host chunks, attached either to that host copy or to a device copy.

Moving is done by re-pointing each parameter's and buffer's `.data`, never by `module.to()`: the `nn.Parameter`
objects (and whatever hooks or swapped submodules refer to them) stay the same, the host copy is made once and never
rewritten (the weights are frozen), so bringing a component back costs one host-to-device copy and sending it away
costs nothing. Values are copied bit for bit, so a model computes the same wherever its weights came from.

Tensors are packed per dtype into chunks of at most `CHUNK_BYTES`: one copy per chunk instead of one per tensor,
and a bounded transient while packing (the originals are released chunk by chunk). Every tensor starts at a
`ALIGN_BYTES` boundary, as a fresh allocation would, because kernels choose code paths (and CPU GEMMs round) by
alignment: an unaligned view could change the output bits.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import logging
import mmap
import os
from collections import deque
from collections.abc import Collection, Generator, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch
from torch import nn

logger = logging.getLogger(__name__)

CHUNK_BYTES = 256 * 2**20
ALIGN_BYTES = 512  # the CUDA caching allocator's block alignment

# Pinned chunks are page-locked by `cudaHostRegister` on exact-size host allocations, not allocated with
# `pin_memory=True`: torch's pinned allocator rounds every allocation up to a power of two so that freed blocks can be
# reused by size, and these chunks hold frozen weights for the life of the worker, so the rounding would only waste
# host memory. The Pro DiT's blocks pack into 56.0 GiB of 128-256 MiB chunks that round up to 62.5 GiB; a
# Pro-distill process in "memory" mode peaked at 98 GB resident on a 128 GB H200 host. (torch 2.13's
# `pinned_max_round_threshold_mb` allocator setting would also stop the rounding; torch 2.11 refuses the key.)
PAGE_BYTES = 4096
HUGE_PAGE_BYTES = 2 * 2**20
# Pinned chunks are mapped with a request for transparent huge pages (`madvise(MADV_HUGEPAGE)`; honoured where the
# host's THP mode is "always" or "madvise"): faulting in, locking and unmapping a 2 MiB page costs about what a
# 4 KiB one does, so page-locking tens of GiB (memory mode's load, a memory release) and freeing them go faster.
# `K6SERVE_PINNED_HUGE_PAGES=0` asks for ordinary pages.
PINNED_HUGE_PAGES = os.environ.get("K6SERVE_PINNED_HUGE_PAGES", "1") != "0"
# A `HostWeights` with several pinned chunks page-locks the next ones on background threads while the caller copies
# into the current one: locking a chunk (faulting its pages in, registering them) takes longer than copying it.
PIN_AHEAD_CHUNKS = 4
PIN_THREADS = 2


def _host_allocation(num_bytes: int, huge_pages: bool) -> torch.Tensor:
    """`num_bytes` of fresh anonymous host memory as a uint8 tensor starting on a page (a huge-page) boundary.

    Mapped directly rather than taken from torch's CPU allocator, so huge pages can be asked for on this memory only;
    the tensor keeps the mapping alive (`torch.frombuffer`), and the mapping is unmapped when its last view dies."""
    align = HUGE_PAGE_BYTES if huge_pages else PAGE_BYTES
    # Private: a shared anonymous mapping is shmem, whose faults are slower and which THP's madvise does not cover.
    region = mmap.mmap(-1, num_bytes + align, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if huge_pages and hasattr(mmap, "MADV_HUGEPAGE"):
        with contextlib.suppress(OSError):  # a kernel without THP: ordinary pages
            region.madvise(mmap.MADV_HUGEPAGE)
    allocation = torch.frombuffer(region, dtype=torch.uint8)
    # The head below the boundary is never touched, so it is never backed by memory.
    offset = -allocation.data_ptr() % align
    return allocation[offset : offset + num_bytes]


class PinnedBuffer:
    """`num_bytes` of page-locked host memory, exactly: a fresh anonymous mapping registered with CUDA.

    The buffer holds the allocation, so it is unregistered (when the buffer is collected) before the memory can be
    freed, whatever order the views into it die in; a view that outlives the buffer stays valid, only no longer
    page-locked."""

    def __init__(self, num_bytes: int, *, huge_pages: bool | None = None) -> None:
        self.num_bytes = num_bytes
        self.registered = False
        # The CUDA device is per thread, and a thread that never set one uses device 0: unregistering from another
        # thread (the release's reaper, a collector) would create a context on GPU 0 from a rank on GPU 1.
        self.device_index = _current_device()
        if not num_bytes:
            self.data = torch.empty(0, dtype=torch.uint8)
            self.pointer = self.data.data_ptr()
            return
        self.data = _host_allocation(num_bytes, PINNED_HUGE_PAGES if huge_pages is None else huge_pages)
        # Fault the pages in on torch's intra-op threads first: cudaHostRegister faults in the pages it finds
        # missing on one thread. On the H200 host (16 cores) a 4 GiB buffer of 4 KiB pages was locked in 0.35-0.43 s
        # this way against 1.32 s, and in 0.23 s with huge pages (scripts/gpu_pinned.py): memory mode's load and a
        # memory release page-lock tens of GiB.
        self.data.fill_(0)
        self.pointer = self.data.data_ptr()
        # Unregistered through the runtime that registered it: a buffer that outlives a stand-in cudart (a CPU test's)
        # must not reach the real one with a pointer it never registered.
        self.runtime = torch.cuda.cudart()
        error = _cuda_call(self.runtime, "cudaHostRegister", self.pointer, num_bytes, 0)
        if error:
            raise RuntimeError(f"cudaHostRegister of {num_bytes / 2**20:.0f} MiB of host memory failed (CUDA error "
                               f"{int(error)}); the host may be out of lockable memory (ulimit -l), or use "
                               "--performance-mode speed, which keeps the weights on the GPU.")
        self.registered = True

    def view(self, dtype: torch.dtype) -> torch.Tensor:
        return self.data.view(dtype)

    def __del__(self) -> None:
        if getattr(self, "registered", False):
            self.registered = False
            try:
                with _on_device(self.device_index):
                    error = _cuda_call(self.runtime, "cudaHostUnregister", self.pointer)
                if error:
                    logger.warning("cudaHostUnregister of %.0f MiB at %#x failed (CUDA error %d); the error was "
                                   "cleared and the memory is freed regardless", self.num_bytes / 2**20, self.pointer,
                                   error)
            except Exception:  # noqa: BLE001 - at interpreter exit torch or the CUDA context may be gone; the
                pass  # process's pages go with it, registered or not


def _cuda_call(runtime, name: str, *args) -> int:
    """`runtime.name(*args)` (`torch.cuda.cudart()`), returning its error code; a failure is also cleared from the
    thread's last CUDA error.

    The runtime keeps a failed call's error as the calling thread's last error until something reads it, and torch
    reads it after its next kernel launch: a refused registration (whose caller falls back to pageable memory) or a
    failed unregister would otherwise fail that unrelated kernel. Seen on an H200 in a run of the test suite: a
    buffer a CPU test had registered with its stand-in was unregistered later with the real runtime (error 713), and
    the next test's text encoder raised "pointer does not correspond to a registered memory region" from an
    embedding lookup. (Buffers now also unregister through the runtime that registered them.)"""
    error = int(getattr(runtime, name)(*args))
    if error:
        library = _cuda_runtime_library()
        if library is not None:
            library.cudaGetLastError()
    return error


@functools.cache
def _cuda_runtime_library() -> ctypes.CDLL | None:
    """The CUDA runtime torch loaded (cudaGetLastError is not among torch's cudart bindings), or None.

    Only a library already mapped into the process: another copy loaded by name would keep its own per-thread error,
    so reading it would clear nothing (a torch built with the static runtime has none to find)."""
    with contextlib.suppress(OSError):
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.split()[-1]
                if "/libcudart.so" in path:
                    return ctypes.CDLL(path)  # already loaded: the same library and the same per-thread error state
    logger.debug("no shared CUDA runtime is loaded: a failed page-locking call's error cannot be cleared")
    return None


def _current_device() -> int | None:
    """This thread's CUDA device, or None where CUDA is not in use (CPU runs; tests with a stand-in cudart)."""
    return torch.cuda.current_device() if torch.cuda.is_initialized() else None


def _on_device(index: int | None):
    return torch.cuda.device(index) if index is not None else contextlib.nullcontext()


def _locked_buffer(num_bytes: int, inference: bool, device_index: int | None) -> PinnedBuffer:
    # Inference mode and the CUDA device are per thread: the caller's, so the chunks are inference tensors exactly
    # when the caller's allocations would be, and registering them creates no context on another GPU.
    with torch.inference_mode(inference), _on_device(device_index):
        return PinnedBuffer(num_bytes)


def pinned_buffers(sizes: list[int]) -> Generator[PinnedBuffer, None, None]:
    """A `PinnedBuffer` of each of `sizes`, in order; after the first, each is page-locked on a background thread
    while the caller works on the ones before it (at most `PIN_AHEAD_CHUNKS` ahead). A failure is raised where its
    buffer would have been yielded; closing the generator early drops the buffers made ahead."""
    inference, device_index = torch.is_inference_mode_enabled(), _current_device()
    if len(sizes) <= 1:
        yield from (PinnedBuffer(size) for size in sizes)
        return
    pending: deque[Future[PinnedBuffer]] = deque()
    with ThreadPoolExecutor(PIN_THREADS, thread_name_prefix="k6serve-pin") as pool:
        try:
            for size in sizes:
                pending.append(pool.submit(_locked_buffer, size, inference, device_index))
                if len(pending) > PIN_AHEAD_CHUNKS:
                    yield pending.popleft().result()
            while pending:
                yield pending.popleft().result()
        finally:
            for future in pending:
                future.cancel()
            # Done futures hold their buffers: drop them now, not when a traceback that keeps this frame dies.
            pending.clear()


@dataclass(eq=False, slots=True)
class _PlannedChunk:
    tensors: list[tuple[torch.Tensor, int]]  # each with its offset in elements
    num_elements: int

    @property
    def num_bytes(self) -> int:
        return self.num_elements * self.tensors[0][0].element_size()


@dataclass(eq=False, slots=True)
class _Slot:
    tensor: torch.Tensor  # the Parameter or buffer object whose `.data` is re-pointed
    chunk: int  # index into the chunk list
    offset: int  # in elements; -1 for a tensor stored on its own (not contiguous)
    host: torch.Tensor  # its view of the host chunk


def module_tensors(modules: Iterable[nn.Module], skip: Collection[int] = frozenset()) -> list[torch.Tensor]:
    """Every parameter and buffer of `modules` (and their submodules) once, in module order, except ids in `skip`.

    Tied parameters are one object, so they are moved once and stay tied."""
    seen: set[int] = set(skip)
    tensors = []
    for root in modules:
        for module in root.modules():
            for tensor in (*module._parameters.values(), *module._buffers.values()):
                if tensor is None or id(tensor) in seen:
                    continue
                seen.add(id(tensor))
                tensors.append(tensor)
    return tensors


class HostWeights:
    """`tensors` moved into host chunks on `offload_device` (pinned when `pin`); they start attached to the host."""

    def __init__(self, tensors: list[torch.Tensor], *, offload_device: torch.device, pin: bool) -> None:
        self.offload_device = torch.device(offload_device)
        self.pinned = pin
        self.chunks: list[torch.Tensor] = []
        self.slots: list[_Slot] = []
        self.device_chunks: list[torch.Tensor] | None = None
        self.num_bytes = 0
        self.pinned_buffers: list[PinnedBuffer] = []
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for tensor in tensors:
            by_dtype.setdefault(tensor.dtype, []).append(tensor)
        plan = [item for dtype_tensors in by_dtype.values() for item in self._plan(dtype_tensors)]
        sizes = [item.num_bytes for item in plan if isinstance(item, _PlannedChunk)]
        # Closed when done, so a failure part-way drops the buffers locked ahead.
        with contextlib.closing(pinned_buffers(sizes if pin else [])) as buffers:
            for item in plan:
                if isinstance(item, _PlannedChunk):
                    self._fill_chunk(item.tensors, item.num_elements, next(buffers, None))
                else:
                    self._store_alone(item)

    @staticmethod
    def _plan(tensors: list[torch.Tensor]) -> list[_PlannedChunk | torch.Tensor]:
        """The chunks of `tensors` (of one dtype), in order; a tensor that is stored on its own stands for itself."""
        plan: list[_PlannedChunk | torch.Tensor] = []
        pending: list[tuple[torch.Tensor, int]] = []
        used = 0
        for tensor in tensors:
            if not tensor.is_contiguous():
                plan.append(tensor)
                continue
            align = max(1, ALIGN_BYTES // tensor.element_size())
            start = -(-used // align) * align
            if pending and (start + tensor.numel()) * tensor.element_size() > CHUNK_BYTES:
                plan.append(_PlannedChunk(pending, used))
                pending, start = [], 0
            pending.append((tensor, start))
            used = start + tensor.numel()
        if pending:
            plan.append(_PlannedChunk(pending, used))
        return plan

    def _fill_chunk(self, pending: list[tuple[torch.Tensor, int]], num_elements: int,
                    buffer: PinnedBuffer | None) -> None:
        """Copy `pending` into a new chunk (into `buffer` when pinned), then re-point the originals to it."""
        dtype = pending[0][0].dtype
        if buffer is not None:
            self.pinned_buffers.append(buffer)
            chunk = buffer.view(dtype)
        else:
            chunk = torch.empty(num_elements, dtype=dtype, device=self.offload_device)
        index = len(self.chunks)
        self.chunks.append(chunk)
        self.num_bytes += chunk.numel() * chunk.element_size()
        for tensor, offset in pending:
            host = chunk[offset : offset + tensor.numel()].view(tensor.shape)
            host.copy_(tensor.data)
            tensor.data = host
            self.slots.append(_Slot(tensor=tensor, chunk=index, offset=offset, host=host))

    def _store_alone(self, tensor: torch.Tensor) -> None:
        # `.to(copy=True)` keeps the strides; such tensors are rare (none in the released models), so unpinned.
        host = tensor.data.to(self.offload_device, copy=True)
        self.chunks.append(host)
        self.num_bytes += host.untyped_storage().nbytes()
        tensor.data = host
        self.slots.append(_Slot(tensor=tensor, chunk=len(self.chunks) - 1, offset=-1, host=host))

    @property
    def on_device(self) -> bool:
        return self.device_chunks is not None

    def copy_to(self, device: torch.device) -> list[torch.Tensor]:
        """A device copy of every chunk, queued on the current stream (asynchronous from pinned memory)."""
        return [chunk.to(device, non_blocking=self.pinned, copy=True) for chunk in self.chunks]

    def attach(self, device_chunks: list[torch.Tensor]) -> None:
        """Point every tensor at its part of `device_chunks` (from `copy_to`)."""
        for slot in self.slots:
            chunk = device_chunks[slot.chunk]
            if slot.offset < 0:
                slot.tensor.data = chunk
            else:
                slot.tensor.data = chunk[slot.offset : slot.offset + slot.host.numel()].view(slot.host.shape)
        self.device_chunks = device_chunks

    def to_device(self, device: torch.device) -> None:
        if not self.on_device:
            self.attach(self.copy_to(device))

    def to_host(self) -> None:
        """Point every tensor back at the host copy; the device copy is freed once nothing else holds it."""
        for slot in self.slots:
            slot.tensor.data = slot.host
        self.device_chunks = None

    def attached_to_host(self) -> bool:
        """True when every tensor uses the host copy (what tests check after a stage)."""
        return all(slot.tensor.data_ptr() == slot.host.data_ptr() for slot in self.slots)
