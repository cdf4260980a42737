"""The LoRA requests that cross process boundaries (engine -> replica leader -> ranks): plain, frozen, picklable.

The operations mirror the reference server's LoRA routes (`/v1/set_lora`, `/v1/merge_lora_weights`,
`/v1/unmerge_lora_weights`, `/v1/list_loras`; docs/http-api.md). Each runs between requests, on every rank of every
replica, through `ModelWorker.set_lora` / `merge_lora` / `unmerge_lora` / `list_loras`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

LORA_MERGE_MODES = ("auto", "merge", "dynamic")
LORA_TARGETS = ("all", "transformer")  # Kandinsky 6 has one DiT; "all" means it too

# The largest |strength| accepted anywhere (a request's `loras`, set_lora, merge_lora_weights, --lora-scale). Real use
# stays far below it: adapters are trained for 1.0 and used within about -2..2, "slider" adapters up to about +-10,
# and ComfyUI's LoraLoader node stops at +-100. Past that the update outweighs the weights it changes by orders of
# magnitude, and a strength like 1e30 overflows the latents to NaN (fp32 and bf16 end at 3.4e38), which failed the
# request only after the whole denoising loop.
MAX_LORA_STRENGTH = 100.0


def check_lora_strength(strength: float, name: str) -> None:
    """Raise ValueError when `strength` (a number, called `name` in the message) is not finite or past
    `MAX_LORA_STRENGTH`."""
    if not math.isfinite(strength) or abs(strength) > MAX_LORA_STRENGTH:
        raise ValueError(f"{name} must be a finite number from {-MAX_LORA_STRENGTH:g} to {MAX_LORA_STRENGTH:g}, got "
                         f"{strength!r}; adapters are used at about -2 to 2 (1.0 is the strength they were trained "
                         "at), and far past that the update swamps the model's weights and the latents overflow to "
                         "NaN.")


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


class ReplicasDisagree(RuntimeError):
    """A LoRA operation that succeeded on some dp replicas and failed on others: they now hold different
    adapters, so whether a nickname it loads is there depends on the replica a job lands on."""
