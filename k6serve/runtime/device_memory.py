"""What this process still holds on its GPU, for the memory release report (`runtime/memory.py`).

Three figures, from the most to the least precise: torch's caching allocator (`allocated`: live tensors and
allocator-owned workspaces; `reserved`: that plus cached free blocks), the device's used memory (`mem_get_info`:
every process on the GPU), and this process's share of it from NVML (needs `nvidia-ml-py`). The difference between
this process's share and `reserved` is memory torch's allocator never saw: the CUDA context and NCCL's buffers.
"""

from __future__ import annotations

import gc
import os

import torch
# typing_extensions' TypedDict: pydantic reads these into the memory routes' OpenAPI answer (serve/response_models.py)
# and refuses typing.TypedDict before Python 3.12.
from typing_extensions import TypedDict

# Named in the report, so a caller sees what cannot be freed without ending the process. Measured on an H200 (torch
# 2.11, CUDA 13; scripts/gpu_context.py, docs/benchmarks.md thirteenth session): the context 518 MiB, cuBLAS's
# handle 158 MiB and cuDNN's 8 MiB, with or without compiled kernels, so a released one-GPU worker keeps about
# 0.6 GB; each NCCL communicator added about 650 MiB (one rank). Communicators exist only for groups that ran a
# collective (ranks join unbound, `launch.py`; axes naming the same ranks share a group, `parallel/mesh.py`).
OUTSIDE_ALLOCATOR = ("the CUDA context (driver state and the loaded kernel images of torch, cuBLAS, cuDNN and the "
                     "compiled kernels; about 0.6-0.7 GB per process on an H200 with torch 2.11 and CUDA 13)")
NCCL_BUFFERS = ("NCCL's communicators, one for each process group that has run a collective (their buffers and "
                "channels; about 650 MiB for a one-rank communicator on an H200)")
NUM_LISTED_TENSORS = 5


def indexed(device: torch.device) -> torch.device:
    """`device` with its index ("cuda" -> "cuda:<current>"), so tensors' devices compare equal to it."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def free_allocator_caches(device: torch.device) -> None:
    """Collect garbage, drop cuBLAS's per-handle workspaces and return the allocator's free blocks to the driver."""
    gc.collect()
    if device.type != "cuda":
        return
    torch.cuda.synchronize(device)
    # cuBLAS workspaces are allocator blocks kept per (handle, stream) for the life of the handle; torch's only way
    # to drop them is this private binding (what inductor's CUDA-graph trees call). Recreated on the next GEMM.
    clear_workspaces = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear_workspaces is not None:
        clear_workspaces()
    torch.cuda.empty_cache()


class LiveStorage(TypedDict):
    """A live storage left on the device, with the shape and dtype of one tensor viewing it."""
    bytes: int
    shape: list[int]
    dtype: str


class _AnyDeviceState(TypedDict):
    device: str
    explanation: str


# The optional keys by `total=False`, not NotRequired[...]: under `from __future__ import annotations` the
# annotations are strings, and TypedDict took every NotRequired key as required.
class DeviceMemoryState(_AnyDeviceState, total=False):
    """What this process holds on its device. A CPU device has only `device` and `explanation`."""
    allocated_bytes: int  # torch's allocator: live tensors and allocator-owned workspaces
    reserved_bytes: int  # that plus the allocator's cached free blocks
    device_used_bytes: int  # every process on this GPU
    device_total_bytes: int
    process_used_bytes: int | None  # this process's share per NVML; None without nvidia-ml-py
    live_tensor_bytes: int
    largest_live_tensors: list[LiveStorage]


def live_tensor_storages(device: torch.device) -> list[LiveStorage]:
    """The storages of live tensors on `device` that the garbage collector can reach, largest first: what is left
    allocated after a release, with a shape and dtype of one tensor viewing each (to recognise it)."""
    from torch._subclasses.fake_tensor import FakeTensor

    device = indexed(device)
    storages: dict[int, LiveStorage] = {}
    for obj in gc.get_objects():
        try:
            # torch.compile's fake tensors (alive in its caches after a compiled step) claim the device but hold no
            # memory; asking one for its data pointer warned in every release's report (H100, fifty-seventh session)
            # and is to become an error in torch.
            if not isinstance(obj, torch.Tensor) or isinstance(obj, FakeTensor) or obj.device != device:
                continue
            storage = obj.untyped_storage()
            pointer = storage.data_ptr()
        except Exception:  # noqa: BLE001, S112 - fake, functional or storage-less tensors hold no memory
            continue
        if pointer and pointer not in storages:
            storages[pointer] = {"bytes": storage.nbytes(), "shape": list(obj.shape), "dtype": str(obj.dtype)}
    return sorted(storages.values(), key=lambda entry: -entry["bytes"])


def _process_used_bytes(device: torch.device) -> int | None:
    """This process's memory on `device` as NVML counts it (context included), or None without nvidia-ml-py."""
    try:
        import pynvml

        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(torch.cuda._get_nvml_device_index(device))
        processes = pynvml.nvmlDeviceGetComputeRunningProcesses(handle)
    except Exception:  # noqa: BLE001 - not installed, no driver access in a container, or an older torch
        return None
    return next((p.usedGpuMemory for p in processes if p.pid == os.getpid() and p.usedGpuMemory is not None), None)


def _uses_nccl() -> bool:
    """NCCL communicators are alive: a multi-GPU process group (a one-GPU worker creates none, `launch.py`)."""
    import torch.distributed as dist

    return (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
            and "nccl" in str(dist.get_backend()).lower())


def device_memory_state(device: torch.device) -> DeviceMemoryState:
    """What this process holds on `device` now, with the explanation of what is not torch's (JSON-able)."""
    if device.type != "cuda":
        return {"device": str(device), "explanation": "a CPU device: the weights already live in host memory, so a "
                                                      "release only moves them to fresh host storage"}
    device = indexed(device)
    allocated = torch.cuda.memory_allocated(device)
    reserved = torch.cuda.memory_reserved(device)
    free, total = torch.cuda.mem_get_info(device)
    process = _process_used_bytes(device)
    live = live_tensor_storages(device)
    outside = [OUTSIDE_ALLOCATOR] + ([NCCL_BUFFERS] if _uses_nccl() else [])
    if process is None:
        share = ("this process's share of the device's used memory is unknown (install nvidia-ml-py for it); what "
                 f"is not torch's is {' and '.join(outside)}")
    else:
        share = (f"this process uses {process / 2**20:.0f} MiB of the device per NVML, "
                 f"{max(0, process - reserved) / 2**20:.0f} MiB of it outside torch's allocator: "
                 f"{' and '.join(outside)}")
    return {
        "device": str(device),
        "allocated_bytes": allocated,
        "reserved_bytes": reserved,
        "device_used_bytes": total - free,  # every process on this GPU
        "device_total_bytes": total,
        "process_used_bytes": process,
        "live_tensor_bytes": sum(entry["bytes"] for entry in live),
        "largest_live_tensors": live[:NUM_LISTED_TENSORS],
        "explanation": (f"torch has {allocated / 2**20:.1f} MiB allocated ({len(live)} live tensor storages, "
                        f"{sum(e['bytes'] for e in live) / 2**20:.1f} MiB; the rest is allocator-owned workspaces) "
                        f"and {reserved / 2**20:.1f} MiB reserved; {share}. Neither the context nor NCCL's buffers "
                        "can be freed without ending the process."),
    }
