"""The LoRA requests that cross process boundaries (engine -> replica leader -> ranks): plain, frozen, picklable.

The operations mirror the reference server's LoRA routes (`/v1/set_lora`, `/v1/merge_lora_weights`,
`/v1/unmerge_lora_weights`, `/v1/list_loras`; docs/http-api.md). Each runs between requests, on every rank of every
replica, through `ModelWorker.set_lora` / `merge_lora` / `unmerge_lora` / `list_loras`.
"""

from __future__ import annotations

from dataclasses import dataclass

LORA_MERGE_MODES = ("auto", "merge", "dynamic")
LORA_TARGETS = ("all", "transformer")  # Kandinsky 6 has one DiT; "all" means it too


def odd_nickname(nickname: str) -> str | None:
    """What is wrong with a nickname that starts or ends with spaces or holds a control character, else None. A
    request's `loras` must name it exactly, and a newline split the log line and every message naming it."""
    if nickname == nickname.strip() and nickname.isprintable():
        return None
    return (f"{nickname!r} starts or ends with spaces or holds control characters (a newline, a tab); use plain "
            f"text, e.g. {' '.join(nickname.split())!r}.")


@dataclass(frozen=True, kw_only=True, slots=True)
class LoraSpec:
    """One adapter to activate: `path` (a .safetensors file, a folder holding one, or a hub id) loaded under
    `nickname`; `path=None` reuses the adapter already loaded under that nickname. `strength` multiplies the
    adapter's alpha / rank scale; `alpha` overrides the alpha stored in the file (default: rank, i.e. scale 1)."""

    nickname: str
    path: str | None = None
    strength: float = 1.0
    alpha: float | None = None


@dataclass(frozen=True, kw_only=True, slots=True)
class SetLora:
    """Replace the active adapters by `specs` (an empty tuple deactivates all), applied as `merge_mode`."""

    specs: tuple[LoraSpec, ...]
    merge_mode: str = "auto"
    target: str = "all"


@dataclass(frozen=True, kw_only=True, slots=True)
class MergeLora:
    """Merge the active adapters into the weights (from dynamic, or again at a new `strength` when given)."""

    target: str = "all"
    strength: float | None = None


@dataclass(frozen=True, kw_only=True, slots=True)
class UnmergeLora:
    """Deactivate every adapter and restore the base weights bit for bit."""

    target: str = "all"


@dataclass(frozen=True, kw_only=True, slots=True)
class ListLoras:
    pass


LoraOperation = SetLora | MergeLora | UnmergeLora | ListLoras
