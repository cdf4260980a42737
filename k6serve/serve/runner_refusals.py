"""What the job runner refuses, each answered by the routes as what it is: a LoRA or memory operation while the
server stops (`ServerShuttingDown`, 503), a job past the queue's room (`QueueFull`, 429), and a job whose own `loras`
the worker would refuse when it starts (`LorasNotLoaded`, `LorasMerged`, `LorasQuantized`, 400), with the messages
that say what to do instead.
"""

from __future__ import annotations

import json
import shlex
from typing import Any

from k6serve.serve.lora_state import Adapters


class ServerShuttingDown(RuntimeError):
    """A LoRA or memory operation refused (or dropped while it waited) because the server is stopping: answered 503,
    not as a failed operation, since nothing was tried and another server (or this one restarted) can take it."""

    def __init__(self, what: str) -> None:
        super().__init__(f"The server is shutting down; the {what} did not run. Retry once it is back.")


class LorasNotLoaded(ValueError):
    """A new job's `loras` names adapters the worker will not hold when it runs (see `JobRunner._check_loras`)."""

    code = "lora_not_loaded"


class LorasMerged(ValueError):
    """A new job has its own `loras` ({} included) but the server's adapters will be merged when it runs, which the
    worker refuses (`LoraManager.check_request`; see `JobRunner._check_loras`)."""

    code = "lora_merged"


class LorasQuantized(ValueError):
    """A new job has its own `loras` ({} included) but the server's DiT is quantized (`--quantization fp8`), which
    takes no adapters (`ModelWorker._lora_manager`)."""

    code = "lora_quantized"


class QueueFull(Exception):
    def __init__(self, queued: int) -> None:
        super().__init__(queued)
        self.queued = queued


def not_loaded_message(unknown: list[str], held: frozenset[str], loading: frozenset[str]) -> str:
    have = f"loaded: {', '.join(map(repr, sorted(held)))}" if held else "no adapter is loaded"
    if loading:
        have += f"; set_lora requests queued before this job load {', '.join(map(repr, sorted(loading)))}"
    example = json.dumps({"lora_nickname": unknown[0], "lora_path": "/path/to/adapter.safetensors",
                          "merge_mode": "dynamic"}, ensure_ascii=False)
    return (f"loras names LoRA adapter(s) {unknown} that this server will not have loaded when the job runs ({have}). "
            f"Load one first with POST /v1/set_lora {example}, or start the server with --lora-path FILE "
            f"--lora-nickname {shlex.quote(unknown[0])} --lora-merge-mode dynamic (dynamic: a job's own adapters need "
            "the server's unmerged); the job was not created.")


def merged_message(requested: dict, then: Adapters, *, merged_now: bool) -> str:
    own = f"the adapter(s) {list(requested)}" if requested else "none: {} runs the base model"
    names = [spec.nickname for spec in then.active]
    listed = ", ".join(f"{spec.nickname!r} at strength {spec.strength:g}" for spec in then.active)
    merged = f"adapter(s) {listed}" if listed else "adapters"
    when = ("are merged into the weights" if merged_now else
            "will be merged into the weights when the job runs (by a LoRA request queued before it)")
    again: dict[str, Any] = {"lora_nickname": (names[0] if len(names) == 1 else names) if names else "NICKNAME",
                             "lora_path": None}
    strengths = [spec.strength for spec in then.active]
    if strengths and len(set(strengths)) == 1:
        again["strength"] = strengths[0]
    elif strengths:
        again["strength"] = strengths
    if then.active and then.active[0].alpha is not None:
        again["lora_alpha"] = then.active[0].alpha
    again["merge_mode"] = "dynamic"
    return (f"loras chooses this job's own LoRA adapters ({own}), but the server's {merged} {when}; a job's own "
            "adapters are added dynamically, and taking merged adapters out of the weights and back in around every "
            "job would copy each adapted weight twice per job. Make the server's adapters dynamic first: POST "
            f"/v1/unmerge_lora_weights, then POST /v1/set_lora {json.dumps(again)} to make them active again "
            "(merge_mode \"dynamic\": \"auto\" means the server's --lora-merge-mode, which merges unless it is "
            "dynamic), or start the server with --lora-merge-mode dynamic; the job was not created.")
