"""Telling a run that ran out of device memory from a bug, wherever the failure surfaces.

In process torch raises `torch.OutOfMemoryError`; from a worker process the engine raises a RuntimeError whose
message carries the failing rank's error (its type name, then torch's text), so the check reads both. The CLI and
the HTTP server each add the fix in their own terms (flags there, request fields here).
"""

from __future__ import annotations

import errno
import re
import signal

import torch


class WorkerKilled(RuntimeError):
    """A worker rank ended by a signal, not by a Python error of its own: SIGKILL (on Linux usually the kernel's
    out-of-memory killer, the host's memory exhausted) or SIGTERM from outside, where the machine failed the run; or
    a crash (SIGSEGV, SIGBUS...) in native code, which `worker_killed_hint` tells apart."""


def describe_exit_code(exit_code: int) -> str:
    """A worker process's exit code in words: "exited with code 1", with the signal that ended it if one did."""
    if exit_code >= 0:
        return f"exited with code {exit_code}"
    try:
        name = signal.Signals(-exit_code).name
    except ValueError:
        name = f"signal {-exit_code}"
    return f"exited with code {exit_code} (killed by {name})"


def worker_killed_hint(exit_codes: list[int]) -> str:
    """What to do about ranks ended by a signal (empty when none was): SIGKILL is most often the out-of-memory
    killer, whose kill the process never sees."""
    if not any(code < 0 for code in exit_codes):
        return ""
    if hasattr(signal, "SIGKILL") and -signal.SIGKILL in exit_codes:
        # Each rank holds its own copy of the host-side weights: fewer ranks per host is the fix, GPUs or not (on a
        # CPU host "fewer GPUs" named hardware that was not there).
        fewer = "fewer GPUs per host" if torch.cuda.is_available() else "fewer processes (--num-gpus)"
        return (" SIGKILL is usually the kernel's out-of-memory killer (see `dmesg`): the host ran out of memory; "
                f"free host memory, or use {fewer} or a smaller model.")
    crashes = sorted({signal.Signals(-code).name for code in exit_codes if -code in _CRASH_SIGNALS})
    if crashes:
        # Raised by the process's own fault, not sent from outside (a SIGBUS was read as a stop from outside).
        kind = "is a crash" if len(crashes) == 1 else "are crashes"
        cause = ("a memory-mapped file changed or cut short under it (a checkpoint overwritten in place while it was "
                 "served) or a fault in a native library" if "SIGBUS" in crashes else "a fault in a native library")
        return (f" {' and '.join(crashes)} {kind} inside the process, not a stop from outside: {cause}; see the "
                "rank's log above.")
    return " It was stopped from outside k6serve."


# Signals a process raises on itself by faulting; the others (SIGTERM, SIGINT, SIGHUP...) come from outside.
# By name, where the platform has them: Windows has no SIGBUS (nor SIGKILL), and the module failed to import there.
_CRASH_SIGNALS = frozenset(getattr(signal, name) for name in ("SIGSEGV", "SIGBUS", "SIGABRT", "SIGILL", "SIGFPE")
                           if hasattr(signal, name))


def is_out_of_memory(error: BaseException) -> bool:
    """The GPU's memory ran out, or the host's (`is_host_out_of_memory`)."""
    text = str(error)
    return (isinstance(error, torch.OutOfMemoryError) or "OutOfMemoryError" in text or "CUDA out of memory" in text
            or is_host_out_of_memory(error))


def is_host_out_of_memory(error: BaseException) -> bool:
    """The host's memory ran out under an allocation (torch's CPU allocator, Python's MemoryError, ENOMEM), in this
    process or told by a worker's: it was "an internal error ... a bug in k6serve", or a job's 4,800-character
    traceback. (The kernel's out-of-memory killer is `WorkerKilled`.)"""
    if isinstance(error, torch.OutOfMemoryError):
        return False
    if isinstance(error, MemoryError) or getattr(error, "errno", None) == errno.ENOMEM:
        return True
    text = str(error)
    return "CUDA out of memory" not in text and _HOST_OUT_OF_MEMORY.search(text) is not None


# What torch's CPU allocator, Python and the C library say when an allocation fails (a worker's error carries them as
# text: the exception crossed a process boundary); MemoryError as a word, not the end of torch's OutOfMemoryError.
_HOST_OUT_OF_MEMORY = re.compile(r"DefaultCPUAllocator: can't allocate memory|Cannot allocate memory|\bMemoryError\b")


def out_of_memory_detail(error: BaseException) -> str:
    """torch's own line ("CUDA out of memory. Tried to allocate ...", "DefaultCPUAllocator: can't allocate memory:
    you tried to allocate ..."), at most 200 characters, or the type name."""
    markers = ("out of memory", "can't allocate memory", "cannot allocate memory", "memoryerror")
    line = next((line.strip() for line in str(error).splitlines()
                 if any(marker in line.lower() for marker in markers)), "")
    for start_marker in ("cuda out of memory", "defaultcpuallocator"):
        start = line.lower().find(start_marker)
        if start >= 0:
            line = line[start:]
            break
    return line[:200] or type(error).__name__


def server_side_fixes(performance_mode: str, *, offloaded: bool) -> str:
    """What the operator can change for requests that run out of GPU memory, as flags (the CLI's error, the server's
    log), from where the run is: speed mode with everything resident can keep its compiled DiT and move the weights
    to host memory between stages, the fast choice on an 80 GB GPU (docs/benchmarks.md, twenty-fifth session), before
    balanced's eager DiT; balanced goes on to memory; memory mode has no mode left, only its own settings. FSDP is
    offered only where nothing is offloaded: the config refuses it beside offloading."""
    fsdp = " or --use-fsdp-inference true" if not offloaded else ""
    more_gpus = f"or spread the model over more GPUs (--num-gpus with --ulysses-degree{fsdp})"
    if performance_mode == "memory":
        return ("keep --vae-tiling on (auto is on in memory mode), lower --offload-resident-blocks and "
                f"--offload-prefetch-blocks if they were raised, {more_gpus}")
    if performance_mode == "balanced":
        return f"run with --performance-mode memory (the DiT's blocks streamed from host memory), {more_gpus}"
    keep_speed = ("keep speed mode and move the weights to host memory between stages with --cpu-offload-components "
                  "all (Pro-distill at 512x768x121 peaks at 59.6 GiB so, 94.5 GiB all resident), "
                  if performance_mode == "speed" and not offloaded else "")
    return f"{keep_speed}run with --performance-mode balanced or memory (weights in host memory), {more_gpus}"
