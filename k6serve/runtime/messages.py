"""Typed messages between the engine process and the leader rank of each replica (pickled over a socket).

engine -> leader: `RunRequest`, `LoraRequest`, `MemoryRequest`, `Shutdown`, and a `StepReply` to every `Progress`.
leader -> engine: `Joined` once its replica's process group is formed, `Ready` / `StartupFailed` once, then per
request any number of `Progress` and one `RunSucceeded` or `RunFailed`; per `LoraRequest` one `LoraDone` or
`RunFailed` (no progress); per `MemoryRequest` one `MemoryDone` or `RunFailed`.
Inside a replica the leader broadcasts `RunRequest`, `LoraRequest`, `MemoryRequest`, `Heartbeat` and `Shutdown` to
the other ranks; every rank runs a `LoraRequest`'s or `MemoryRequest`'s operation on its own model and the leader
gathers their failures as for a run (and, for memory, every rank's report).
The engine sends a `LoraRequest` or `MemoryRequest` to every replica at once, only while none of them runs a request.
"""

from __future__ import annotations

from dataclasses import dataclass

from k6serve.lora.spec import LoraOperation, LoraReply
from k6serve.models.variants import Variant
from k6serve.request import OutputOptions, SamplingParams, VideoResult
from k6serve.runtime.memory import MemoryOperation, MemoryRankReport
from k6serve.speed.warmup import WarmupReport


@dataclass(frozen=True, kw_only=True, slots=True)
class RunRequest:
    request_id: int
    params: SamplingParams
    output: OutputOptions


@dataclass(frozen=True, kw_only=True, slots=True)
class LoraRequest:
    """Apply a LoRA operation (`k6serve.lora.spec`) on every rank of the replica, between requests."""

    request_id: int
    operation: LoraOperation


@dataclass(frozen=True, kw_only=True, slots=True)
class MemoryRequest:
    """Release or resume the device memory (`k6serve.runtime.memory`) on every rank of the replica, between requests."""

    request_id: int
    operation: MemoryOperation


@dataclass(frozen=True, kw_only=True, slots=True)
class StepReply:
    """The engine's answer to every `Progress`: continue, or cancel at this step boundary."""

    cancel: bool


@dataclass(frozen=True, kw_only=True, slots=True)
class Shutdown:
    pass


@dataclass(frozen=True, kw_only=True, slots=True)
class Heartbeat:
    """Sent by an idle leader so the other ranks' blocking broadcast never reaches the collective timeout."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Joined:
    """Sent by a replica's leader as soon as its ranks have joined, before the checkpoint is fetched and loaded:
    from then on the engine waits for `Ready` as long as the ranks live (a first download of tens of GiB, a
    load and a server warm-up are not bounded by `dist_timeout_s`, which bounds joining and each collective; the
    ranks' gather after loading is one, so a replica's ranks must finish within it of each other, as one host's
    do, sharing the download)."""

    replica: int


@dataclass(frozen=True, kw_only=True, slots=True)
class Ready:
    replica: int
    variant: Variant
    pids: tuple[int, ...]  # one per rank of the replica, in rank order
    warmups: tuple[WarmupReport, ...] = ()  # the leader's `--warmup-mode server` shapes and what each cost
    # What a request is checked against when it is resolved (`resolve_generate`), known once the model is loaded.
    has_audio: bool = True
    streams_text_encoder: bool = False
    # The dtype the ranks resolved for the weights (`--dtype auto`: bfloat16 on a GPU, float32 on the CPU), which
    # GET /v1/models reports; None from a stand-in worker that loads none.
    precision: str | None = None


@dataclass(frozen=True, kw_only=True, slots=True)
class StartupFailed:
    """`kind` "value": a user error (ValueError: invalid layout, checkpoint mismatch), raised as ValueError with
    `message`; "module": a third-party package missing from the workers' interpreter, `error` the
    ModuleNotFoundError to raise again; "runtime": anything else, `message` holds every failing rank's error with its
    traceback."""

    replica: int
    message: str
    kind: str = "runtime"
    error: Exception | None = None


@dataclass(frozen=True, kw_only=True, slots=True)
class Progress:
    request_id: int
    step: int
    total: int


@dataclass(frozen=True, kw_only=True, slots=True)
class RunSucceeded:
    request_id: int
    result: VideoResult


@dataclass(frozen=True, kw_only=True, slots=True)
class LoraDone:
    """Every rank of the replica applied the operation; `result` is the leader's `apply_lora_operation` reply."""

    request_id: int
    result: LoraReply


@dataclass(frozen=True, kw_only=True, slots=True)
class MemoryDone:
    """Every rank of the replica applied the memory operation; `result` holds each rank's report, in rank order."""

    request_id: int
    result: list[MemoryRankReport]


@dataclass(frozen=True, kw_only=True, slots=True)
class RunFailed:
    """A request (or a `LoraRequest`) failed on some rank. `kind` picks the exception the engine raises: "value"
    (user error, ValueError; `error` where it is a `FlagWorded`, whose `flag_wording` the CLI prints), "cancelled"
    (RequestCancelled), "os" (`error`, an OSError such as a full disk at the MP4 write) or "module" (`error`, the
    ModuleNotFoundError of a third-party package missing from the workers' interpreter), both with `message` as their
    remote traceback, or "runtime" (RuntimeError). `replica_broken` says the replica's ranks disagree and it has shut
    down."""

    request_id: int
    kind: str
    message: str
    replica_broken: bool = False
    error: Exception | None = None
