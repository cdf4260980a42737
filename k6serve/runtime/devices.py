"""The device and dtype a worker runs on, from the config's names, and the peak memory a request reports."""

from __future__ import annotations

import sys

import torch


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda was requested but no CUDA GPU is visible; use --device cpu.")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"bfloat16": torch.bfloat16, "float32": torch.float32}[name]


def peak_memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    # CPU: the process's peak resident set (ru_maxrss is KiB on Linux, bytes on macOS). `resource` is Unix's: imported
    # at the top, it failed the worker's import on Windows (told as "pip install resource").
    try:
        import resource
    except ImportError:
        return 0.0
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / (2**20 if sys.platform == "darwin" else 2**10)
