"""Telling a run that ran out of device memory from a bug, wherever the failure surfaces.

In process torch raises `torch.OutOfMemoryError`; from a worker process the engine raises a RuntimeError whose
message carries the failing rank's error (its type name, then torch's text), so the check reads both. The CLI and
the HTTP server each add the fix in their own terms (flags there, request fields here).
"""

from __future__ import annotations

import torch


def is_out_of_memory(error: BaseException) -> bool:
    text = str(error)
    return isinstance(error, torch.OutOfMemoryError) or "OutOfMemoryError" in text or "CUDA out of memory" in text


def out_of_memory_detail(error: BaseException) -> str:
    """torch's own line ("CUDA out of memory. Tried to allocate ..."), at most 200 characters, or the type name."""
    line = next((line.strip() for line in str(error).splitlines() if "out of memory" in line.lower()), "")
    start = line.lower().find("cuda out of memory")
    line = line[start:] if start >= 0 else line
    return line[:200] or type(error).__name__
