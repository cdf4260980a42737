"""The LoRA requests that cross process boundaries (engine -> replica leader -> ranks): plain, frozen, picklable.

The operations mirror the reference server's LoRA routes (`/v1/set_lora`, `/v1/merge_lora_weights`,
`/v1/unmerge_lora_weights`, `/v1/unload_lora`, `/v1/list_loras`; docs/http-api.md). Each runs between requests, on
every rank of every replica, through `ModelWorker.apply_lora_operation` and its `LoraManager`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

# typing_extensions' TypedDict, not typing's: pydantic reads these into the HTTP routes' OpenAPI answers
# (serve/response_models.py) and refuses typing.TypedDict before Python 3.12.
from typing_extensions import TypedDict

if TYPE_CHECKING:
    from k6serve.config import ModelConfig

LORA_MERGE_MODES = ("auto", "merge", "dynamic")
AppliedMode = Literal["merge", "dynamic"]  # how active adapters are applied: what "auto" resolves to
LORA_TARGETS = ("all", "transformer")  # Kandinsky 6 has one DiT; "all" means it too

# The largest |strength| accepted anywhere (a request's `loras`, set_lora, merge_lora_weights, --lora-scale). Real use
# stays far below it: adapters are trained for 1.0 and used within about -2..2, "slider" adapters up to about +-10,
# and ComfyUI's LoraLoader node stops at +-100. Past that the update outweighs the weights it changes by orders of
# magnitude, and a strength like 1e30 overflows the latents to NaN (fp32 and bf16 end at 3.4e38), which failed the
# request only after the whole denoising loop.
MAX_LORA_STRENGTH = 100.0
USUAL_LORA_STRENGTH = 2.0  # adapters are trained at 1.0 and used within about -2..2


def is_finite_number(value: float) -> bool:
    """math.isfinite for any real, an int too large for a float (10**400, which JSON and Python pass as is) included:
    math.isfinite raises OverflowError on it, which reached the user as an internal error."""
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


def _bound_refusal(value: float, name: str, bound: float, why: str) -> str | None:
    if not is_finite_number(value) or abs(value) > bound:
        return f"{name} must be a finite number from {-bound:g} to {bound:g}, got {value!r}; {why}"
    return None


def _check_bound(value: float, name: str, bound: float, why: str) -> None:
    if refusal := _bound_refusal(value, name, bound, why):
        raise ValueError(refusal)


def lora_strength_refusal(strength: float, name: str) -> str | None:
    """Why `strength` (a number, called `name`) is refused, not finite or past `MAX_LORA_STRENGTH`, or None. A
    request's `loras` words it twice, in its fields' and its flags' names (`request_resolution._resolve_loras`)."""
    return _bound_refusal(strength, name, MAX_LORA_STRENGTH,
                          f"adapters are used at about -{USUAL_LORA_STRENGTH:g} to {USUAL_LORA_STRENGTH:g} (1.0 is the "
                          "strength they were trained at), and far past that the update swamps the model's weights and "
                          "the latents overflow to NaN.")


def check_lora_strength(strength: float, name: str) -> None:
    """Raise ValueError when `strength` (a number, called `name` in the message) is not finite or past
    `MAX_LORA_STRENGTH`."""
    if refusal := lora_strength_refusal(strength, name):
        raise ValueError(refusal)


# The largest |alpha| accepted anywhere (set_lora's lora_alpha, --lora-alpha, an adapter file's alpha). The update is
# strength x alpha / rank x B A, and alpha is at most a small multiple of the rank: kohya writes 1 up to the rank,
# PEFT and diffusers trainers the rank or twice it. A rank cannot usefully pass the narrower side of the Linear it
# adapts (full rank is a plain weight delta), 4096 at most in Kandinsky 6 (Pro's model_dim; Lite's is 1792), so even
# a full-rank adapter at twice its rank stays under 8192. It is bounded on its own, not against the rank, because
# set_lora is refused before the adapter file is read. Past 1e4 alpha is a typo or a broken file and, times a
# strength up to 100, overflows the latents like a huge strength.
MAX_LORA_ALPHA = 1e4


def check_lora_alpha(alpha: float, name: str) -> None:
    """Raise ValueError when `alpha` (a number, called `name` in the message) is not finite or past
    `MAX_LORA_ALPHA`."""
    _check_bound(alpha, name, MAX_LORA_ALPHA,
                 "an adapter's alpha is its rank or a small multiple of it (the update is strength x alpha / rank x "
                 "B A), and far past that the update swamps the model's weights and the latents overflow to NaN.")


def resolve_merge_mode(merge_mode: str, *, fsdp: bool = False) -> AppliedMode:
    """"merge" or "dynamic" for a mode of `LORA_MERGE_MODES`: "auto" merges, except under FSDP (the reference
    server's rule), where "merge" is refused."""
    if merge_mode not in LORA_MERGE_MODES:
        raise ValueError(f"LoRA merge_mode must be one of {', '.join(LORA_MERGE_MODES)}, got {merge_mode!r}")
    if fsdp and merge_mode == "merge":
        raise ValueError(FSDP_MERGE_REFUSAL)
    return "dynamic" if merge_mode == "dynamic" or fsdp else "merge"


FSDP_MERGE_REFUSAL = ("LoRA merge_mode 'merge' cannot be used with --use-fsdp-inference: the weights are FSDP shards "
                      "between requests; use merge_mode 'dynamic' (or 'auto', which is dynamic under FSDP).")


def set_lora_merge_mode(merge_mode: str, *, server_merge_mode: str, fsdp: bool) -> AppliedMode:
    """How the worker applies a `SetLora` whose `merge_mode` is `merge_mode`: "merge" or "dynamic". "auto" takes the
    server's `server_merge_mode` (--lora-merge-mode), itself resolved by `resolve_merge_mode`; a ValueError where the
    layout refuses the mode. The HTTP server predicts with it what a queued SetLora will do."""
    return resolve_merge_mode(server_merge_mode if merge_mode == "auto" else merge_mode, fsdp=fsdp)


def quantized_lora_refusal(quantization: str, *, subject: str = "The DiT",
                           fix: str = "Load the model without --quantization to use adapters.") -> str:
    """Why a LoRA operation or a request's adapters are refused on a DiT quantized with --quantization (the worker's,
    the server's and the CLI's words), and `fix`."""
    return (f"{subject} is quantized with --quantization {quantization} and takes no LoRA adapters: its linears hold "
            f"e4m3 weights, and adapters update bf16 ones. {fix}")


def odd_nickname(nickname: str) -> str | None:
    """What is wrong with a nickname that starts or ends with spaces or holds a control character, else None. A
    request's `loras` must name it exactly, and a newline split the log line and every message naming it."""
    if nickname == nickname.strip() and nickname.isprintable():
        return None
    # Every character `isprintable` refuses (a NUL, an escape, a zero-width space) separates words, as whitespace
    # does: the example is a name this check accepts, never the refused one again.
    plain = " ".join("".join(c if c.isprintable() else " " for c in nickname).split())
    example = f", e.g. {plain!r}" if plain else ""
    return (f"{nickname!r} starts or ends with spaces or holds control characters (a newline, a tab); use plain "
            f"text{example}.")


@dataclass(frozen=True, kw_only=True, slots=True)
class LoraSpec:
    """One adapter to activate: `path` (a .safetensors file, a folder holding one, or a hub id) loaded under
    `nickname`; `path=None` reuses the adapter already loaded under that nickname. `strength` multiplies the
    adapter's alpha / rank scale; `alpha` overrides the alpha stored in the file (default: the file's alpha, else
    the rank, i.e. scale 1)."""

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
class UnloadLora:
    """Forget loaded adapters that are not active: their weights leave the worker's memory, and a restart no longer
    loads them. A server that sets many adapters over its life otherwise holds every one it ever read."""

    nicknames: tuple[str, ...]
    target: str = "all"


@dataclass(frozen=True, kw_only=True, slots=True)
class ListLoras:
    pass


LoraOperation = SetLora | MergeLora | UnmergeLora | UnloadLora | ListLoras


def start_set_lora(model: ModelConfig) -> SetLora | None:
    """The SetLora the worker applies at start for `--lora-path` (None without one)."""
    if not model.lora_path:
        return None
    return SetLora(specs=(LoraSpec(nickname=model.lora_nickname, path=model.lora_path, strength=model.lora_scale,
                                   alpha=model.lora_alpha),), merge_mode=model.lora_merge_mode)


class LoraAdapterState(TypedDict):
    """One loaded adapter, as `list_loras()` and every LoRA call's reply list it (`LoraManager.state`)."""
    nickname: str
    path: str  # the file, folder or hub id it was loaded from
    rank: int
    alpha: float  # the one a request would use: set_lora's lora_alpha, else the file's, else the rank
    strength: float | None  # None while inactive
    num_modules: int
    dora: bool  # PEFT's variants the file carries: DoRA magnitudes, lora_B biases, an Embedding's pair
    lora_bias: bool
    embedding: bool
    active: bool
    merged: bool
    merge_mode: AppliedMode | None  # how the active adapters are applied; None while inactive


class LoraChange(TypedDict):
    """The reply of set_lora, merge_lora_weights, unmerge_lora_weights and unload_lora."""
    status: Literal["ok"]
    message: str
    loras: list[LoraAdapterState]  # the active adapters first, in activation order


class LoraListing(TypedDict):
    """The reply of list_loras."""
    loras: list[LoraAdapterState]


LoraReply = LoraChange | LoraListing  # what a worker answers a `LoraOperation`


class ReplicasDisagree(RuntimeError):
    """A LoRA operation that succeeded on some dp replicas and failed on others: they now hold different
    adapters, so whether a nickname it loads is there depends on the replica a job lands on."""
