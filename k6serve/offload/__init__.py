"""Weight offloading: per component resident, offloaded whole, or streamed block by block (`residency.py` makes the
plan from `--performance-mode`, `--cpu-offload-components` and `--layerwise-offload-components`).

The torch-using parts load on first use, so that `k6serve.config` can validate the flags' names through the
torch-free `residency.py` without importing them (they import the config)."""

from __future__ import annotations

from typing import Any

_COMPONENTS = ("RESIDENT", "ComponentOffload", "OffloadReport", "Resident", "apply_offload")

__all__ = ["OFFLOAD_MODES", *_COMPONENTS]


def __getattr__(name: str) -> Any:
    if name in _COMPONENTS:
        from k6serve.offload import components

        return getattr(components, name)
    if name == "OFFLOAD_MODES":
        from k6serve.config import OFFLOAD_MODES

        return OFFLOAD_MODES
    raise AttributeError(f"module 'k6serve.offload' has no attribute {name!r}")
