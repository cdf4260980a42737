"""The rank side of the SPMD runtime: the code that runs inside each rank process. The engine's side, which starts
the ranks and talks to each replica's leader, is `MultiProcessWorker` (`process_group_worker.py`).

`rank_main`: join the process group, build the groups of the layout, build the per-rank worker, then loop: the
leader receives a message and broadcasts it on the replica's CPU group, every rank runs the same request, the leader
replies. A rank that dies is seen by the engine (its process sentinel, or the leader's socket closing) and fails the
request at once; ranks blocked in a collective with it hit the collective timeout and exit.

A rank's process starts at `engine_rank_main` (the engine started it) or `_host_rank_main` (`serve_worker_ranks`, on a
host without the engine). The engine's process imports this module too: the model libraries are imported only where
the worker is built (`build_model_worker`, `parallelize_worker_models`).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import threading
import time
import traceback
from collections.abc import Callable
from multiprocessing.connection import Client, Connection
from typing import Protocol, TypeVar, cast

import torch
import torch.distributed as dist

from k6serve.config import EngineConfig
from k6serve.dependencies import missing_package
from k6serve.lora.spec import LoraOperation, LoraReply
from k6serve.models.variants import GENERATION, Variant
from k6serve.parallel.mesh import ParallelGroups, ParallelLayout, build_groups
from k6serve.process_exit import exit_without_teardown
from k6serve.rank_logging import configure_rank_logging
from k6serve.request import FlagWorded, OutputOptions, ProgressCallback, SamplingParams, VideoResult
from k6serve.runtime import messages
from k6serve.runtime.engine import RequestCancelled
from k6serve.runtime.launch import (
    ENGINE_HANDLED_SIGNALS,
    RankSpec,
    device_type_for,
    init_distributed,
    local_rank_specs,
    start_process,
    torchrun_rank,
)
from k6serve.runtime.memory import MemoryOperation, MemoryRankReport, inverse
from k6serve.runtime.out_of_memory import describe_exit_code

logger = logging.getLogger(__name__)

_NO_OUTPUT = OutputOptions(save_output=False, return_frames=False)

_T = TypeVar("_T")
# A rank's failure, as `_classify` tells it: (kind, message, the error to raise again in the engine).
_Failure = tuple[str, str, Exception | None]


class RankWorker(Protocol):
    """What each rank builds: the model worker of its device (see `runtime.worker.ModelWorker`)."""

    variant: Variant

    def run(self, params: SamplingParams, output: OutputOptions,
            on_step: ProgressCallback | None = None) -> VideoResult: ...

    def apply_lora_operation(self, operation: LoraOperation) -> LoraReply: ...

    def apply_memory_operation(self, operation: MemoryOperation) -> list[MemoryRankReport]: ...


@dataclasses.dataclass(frozen=True, kw_only=True)
class RankContext:
    """Who this rank is: its spec, device and process groups."""

    spec: RankSpec
    device: torch.device
    groups: ParallelGroups

    @property
    def is_leader(self) -> bool:
        return self.spec.rank == self.groups.replica_ranks[0]


RankWorkerFactory = Callable[[EngineConfig, RankContext], RankWorker]


def build_model_worker(config: EngineConfig, context: RankContext) -> RankWorker:
    """The default per-rank worker: the single-device `ModelWorker` on this rank's device, parallelised.

    The checkpoint is loaded whole on every rank, then the layout is applied (`parallel.parallelize`); only the
    leader saves the MP4 (the other ranks run with `save_output=False`).
    """
    from k6serve.runtime.worker import ModelWorker

    # The layout is applied inside the worker's construction, before its speed transforms and warm-up, which
    # must see the final (sharded) module tree.
    return ModelWorker(config, transform=lambda worker: parallelize_worker_models(worker, config, context))


def parallelize_worker_models(worker, config: EngineConfig, context: RankContext) -> None:
    """Validate and apply the replica layout to the models a `ModelWorker` loaded (no-op work for one rank)."""
    from k6serve.parallel.parallelize import (
        parallelize_generation_models,
        parallelize_sr_models,
    )

    device_type, layout = context.device.type, context.groups.layout
    if worker.variant.family == GENERATION:
        parallelize_generation_models(worker.pipeline.models, context.groups,
                                      encoder_parallel=config.parallel.encoder_parallel, device_type=device_type)
        if len(context.groups.replica_ranks) > 1:
            # expand_prompts: every rank rewrites the prompt; the leader's text is the one all of them encode. A
            # replicated text encoder's rounding could differ between ranks (each would then condition its shard of
            # the video on another prompt). A folded one runs every token's forward as collectives whose all-reduced
            # logits are the same on every rank, drawn with the same seed: the ranks stop at the same token, so none
            # is left waiting in a collective (HF's synced_gpus would all-reduce over every replica's ranks).
            worker.pipeline.agree_on_text = lambda text: _broadcast(text, context)
    elif layout.replica_size > 1 or layout.fsdp:
        parallelize_sr_models(worker.pipeline.models, context.groups, model_name=worker.variant.name,
                              device_type=device_type, decode=worker.sr_decode)


def _broadcast(message: object, context: RankContext) -> object:
    """The leader's `message` on every rank of the replica (CPU group, collective timeout applies)."""
    box = [message]
    dist.broadcast_object_list(box, src=context.groups.replica_ranks[0], group=context.groups.control)
    return box[0]


def _gather(item: _T, context: RankContext) -> list[_T]:
    items: list[object] = [None] * len(context.groups.replica_ranks)
    dist.all_gather_object(items, item, group=context.groups.control)
    return cast("list[_T]", items)  # each rank's `item`: every rank gathers the same kind of thing


def _classify(error: BaseException, rank: int) -> _Failure:
    """(kind, message, the error to raise again in the engine) for a rank's failure; a runtime message starts
    with one line naming the error, the traceback follows."""
    if isinstance(error, RequestCancelled):
        return "cancelled", str(error), None
    if isinstance(error, FlagWorded):
        return "value", str(error), error  # `k6serve generate` prints its `flag_wording`
    if isinstance(error, ValueError):
        return "value", str(error), None
    text = f"rank {rank}: {type(error).__name__}: {error}\n{''.join(traceback.format_exception(error))}"
    if isinstance(error, OSError):
        # Rebuilt from its fields: a library's OSError subclass may not unpickle in the engine process, and the
        # builtin constructor still picks the errno's subclass (PermissionError, ...).
        rebuilt = OSError(error.errno, error.strerror, error.filename) if error.errno else OSError(str(error))
        return "os", text, rebuilt
    # missing_package tests the class too; the isinstance is spelled here so that mypy knows `error.name`.
    if isinstance(error, ModuleNotFoundError) and missing_package(error):
        # The workers' interpreter lacks a package (a PYTHONPATH that hides it, an optional one imported late): the
        # machine's state, which the CLI and the server name with its pip command, not a bug. Kept a
        # ModuleNotFoundError with its name so that they can; one of k6serve's own modules missing stays a bug.
        return "module", text, ModuleNotFoundError(str(error), name=error.name)
    return "runtime", text, None


class _ReplicaLoop:
    """The request loop of one rank; `connection` is the engine socket on the leader, None elsewhere."""

    def __init__(self, worker: RankWorker, context: RankContext, connection: Connection | None):
        self.worker = worker
        self.context = context
        self.connection = connection
        self.heartbeat_s = min(30.0, context.spec.timeout_s / 4)
        self.shutdown_received = False  # a Shutdown came in place of a StepReply: the request stops, then the replica

    def serve(self) -> None:
        while True:
            sent = self._next_message() if self.connection else None
            try:
                message = _broadcast(sent, self.context)
            except RuntimeError as error:  # torch.distributed's errors (DistBackendError among them)
                # A peer of the replica is gone (killed while idle): the engine finds the dead rank and says how it
                # died. This rank's traceback ("Connection closed by peer") printed before that, on every rank left.
                if not isinstance(sent, messages.Shutdown):
                    logger.warning("a peer of replica %d is gone (%s); this rank shuts down",
                                   self.context.groups.replica, str(error).splitlines()[0] if str(error) else error)
                return
            if isinstance(message, messages.Shutdown):
                return
            if isinstance(message, messages.RunRequest) and not self._run(message):
                return
            if isinstance(message, messages.LoraRequest) and not self._apply_lora(message):
                return
            if isinstance(message, messages.MemoryRequest) and not self._apply_memory(message):
                return

    def _next_message(self) -> object:
        assert self.connection is not None
        if self.shutdown_received:
            return messages.Shutdown()
        try:
            if not self.connection.poll(self.heartbeat_s):
                return messages.Heartbeat()
            return self.connection.recv()
        except (EOFError, OSError):
            logger.warning("the engine closed its connection; replica %d shuts down", self.context.groups.replica)
            return messages.Shutdown()

    def _on_step(self, request_id: int) -> ProgressCallback:
        # A collective: the pipelines call it at the same points on every rank, the steps and the decode's chunks
        # (the final step reported again; the ranks that save nothing decode through the leader's chunks too).
        def on_step(step: int, total: int) -> None:
            cancel = False
            if self.connection is not None:
                try:
                    self.connection.send(messages.Progress(request_id=request_id, step=step, total=total))
                    reply = self.connection.recv()
                except (EOFError, OSError):
                    # The engine is gone mid-request (killed, or OOM-killed). Cancelled through the broadcast below,
                    # the replica's ranks stay in step and shut down at the next message (`_next_message`); raised
                    # here, the leader left its peers in this broadcast, and they held their memory until the
                    # collective timeout (10 minutes by default).
                    logger.warning("the engine closed its connection during request %d; it is cancelled",
                                   request_id)
                    reply = messages.StepReply(cancel=True)
                if isinstance(reply, messages.Shutdown):
                    # close() under a running request (a forced stop of the server, a step longer than shutdown's
                    # wait). Taken as a StepReply, it failed the leader alone ("AssertionError: Shutdown()"), out of
                    # step with its peers, and the replica, told nothing more, waited for close()'s SIGKILL.
                    self.shutdown_received = True
                    reply = messages.StepReply(cancel=True)
                assert isinstance(reply, messages.StepReply), reply
                cancel = reply.cancel
            if _broadcast(cancel, self.context):
                raise RequestCancelled(f"request {request_id} was cancelled at step {step}/{total}")

        return on_step

    def _run(self, request: messages.RunRequest) -> bool:
        """Run one request on this rank; returns False when the replica can no longer serve."""
        output = request.output if self.context.is_leader else _NO_OUTPUT
        succeeded, failure = None, None
        try:
            result = self.worker.run(request.params, output, on_step=self._on_step(request.request_id))
            succeeded = messages.RunSucceeded(request_id=request.request_id, result=result)
        except Exception as error:  # noqa: BLE001 (reported to the engine below; the loop keeps serving)
            failure = _classify(error, self.context.spec.rank)
        return self._reply(request.request_id, failure, succeeded)

    def _apply_lora(self, request: messages.LoraRequest) -> bool:
        """Apply one LoRA operation on this rank; returns False when the replica can no longer serve."""
        succeeded, failure = None, None
        try:
            result = self.worker.apply_lora_operation(request.operation)
            succeeded = messages.LoraDone(request_id=request.request_id, result=result)
        except Exception as error:  # noqa: BLE001 (reported to the engine below; the loop keeps serving)
            failure = _classify(error, self.context.spec.rank)
        return self._reply(request.request_id, failure, succeeded)

    def _apply_memory(self, request: messages.MemoryRequest) -> bool:
        """Release or resume on this rank. If it failed on another rank of the replica, it is undone here, so the
        ranks stay alike (all released or none); returns False when that fails too or a peer is gone."""
        reports: list[MemoryRankReport] = []
        failure = None
        rank, replica = self.context.spec.rank, self.context.groups.replica
        try:
            reports = [{"replica": replica, "rank": rank, **report}
                       for report in self.worker.apply_memory_operation(request.operation)]
        except Exception as error:  # noqa: BLE001 (reported to the engine below; the loop keeps serving)
            failure = _classify(error, rank)
        try:
            outcomes = _gather((failure, reports), self.context)
        except Exception as error:  # noqa: BLE001 (a peer is gone: the replica cannot run collectives)
            outcomes = [(failure or ("runtime", f"a rank of the replica stopped responding: {error}", None), [])]
        failures = [outcome for outcome, _ in outcomes if outcome is not None]
        broken = len(outcomes) != len(self.context.groups.replica_ranks)  # a peer is gone
        if failures and not broken:
            undo_failed = False
            if failure is None:
                try:
                    self.worker.apply_memory_operation(inverse(request.operation))
                except Exception:  # the ranks now differ: the replica cannot serve
                    logger.exception("undoing %s on rank %d failed", type(request.operation).__name__, rank)
                    undo_failed = True
            try:
                broken = any(_gather(undo_failed, self.context))
            except Exception:  # noqa: BLE001 (a peer is gone)
                broken = True
        if self.connection is not None:
            if not failures:
                self._send(messages.MemoryDone(request_id=request.request_id,
                                               result=[r for _, ranks in outcomes for r in ranks]))
            else:
                kind, text, engine_error = failures[0]
                self._send(messages.RunFailed(request_id=request.request_id, kind=kind, message=text,
                                              replica_broken=broken, error=engine_error))
        return not broken

    def _reply(self, request_id: int, failure: _Failure | None, succeeded: object) -> bool:
        """Gather every rank's failure; the leader sends `succeeded` (None where this rank failed) or the first
        failure. Returns False when the ranks disagree (some failed, some did not) or a peer is gone: the replica can
        no longer serve."""
        try:
            failures = _gather(failure, self.context)
        except Exception as error:  # noqa: BLE001 (a peer is gone: the replica cannot run collectives)
            failures = [failure or ("runtime", f"a rank of the replica stopped responding: {error}", None)]
            broken = True
        else:
            broken = any(f is None for f in failures) and any(f is not None for f in failures)
        if self.connection is not None:
            reported = [f for f in failures if f is not None]
            if not reported:
                self._send(succeeded)
            else:
                kind, text, engine_error = reported[0]
                self._send(messages.RunFailed(
                    request_id=request_id, kind=kind, message=text, replica_broken=broken, error=engine_error,
                ))
        return not broken

    def _send(self, reply: object) -> None:
        """The leader's reply to the engine. An engine gone meanwhile is not this rank's error: raised, it ended the
        leader alone, out of step with its peers; the next `_next_message` reads the closed connection and shuts
        the whole replica down."""
        if self.connection is None:
            raise RuntimeError("only the replica's leader replies to the engine")
        try:
            self.connection.send(reply)
        except (EOFError, OSError):
            logger.warning("the engine closed its connection; the reply to it is dropped")


def rank_main(
    spec: RankSpec,
    config: EngineConfig,
    build_rank_worker: RankWorkerFactory,
    engine_address: tuple[str, int] | None,
    authkey: bytes | None,
) -> None:
    """The body of one rank's process: join, build, report readiness, serve until shut down."""
    configure_rank_logging(spec.rank, spec.log_level)
    device = init_distributed(spec)
    try:
        layout = ParallelLayout.from_config(config.parallel)
        groups = build_groups(layout, spec.rank, backend=spec.backend, timeout_s=spec.timeout_s)
        # Only rank 0 was told where the engine listens (other hosts' launchers do not know it). One rank has it
        # already. The broadcast goes over gloo: on the default NCCL group it would create a communicator
        # (`init_distributed`) that, with dp replicas, no model collective would ever use again.
        if spec.world_size > 1:
            box = [(engine_address, authkey)]
            dist.broadcast_object_list(box, src=0, group=groups.world_control)
            engine_address, authkey = box[0]
        context = RankContext(spec=spec, device=device, groups=groups)
        connection = None
        if context.is_leader:
            if engine_address is None:
                raise RuntimeError(f"rank {spec.rank} leads a replica but was not told where the engine listens")
            connection = Client(engine_address, authkey=authkey)
            connection.send(messages.Joined(replica=groups.replica))
        worker, failure = None, None
        try:
            worker = build_rank_worker(config, context)
        except Exception as error:  # noqa: BLE001 (every rank's start-up error goes to the engine)
            failure = _classify(error, spec.rank)
        failures = _gather(failure, context)
        pids = _gather(os.getpid(), context)
        if connection is not None:  # this rank leads the replica
            reported = [f for f in failures if f is not None]
            if reported:
                # A user error (bad layout, checkpoint mismatch) is the same on every rank: report it once.
                user_error = all(kind == "value" for kind, _, _ in reported)
                message = reported[0][1] if user_error else "\n".join(text for _, text, _ in reported)
                # A package missing from the workers' interpreter is named as such (the first rank's: they share it).
                missing = next((error for kind, _, error in reported if kind == "module"), None)
                kind = "value" if user_error else "module" if missing is not None else "runtime"
                connection.send(messages.StartupFailed(replica=groups.replica, message=message, kind=kind,
                                                       error=missing))
            else:
                assert worker is not None  # this rank's own failure would be among `reported`
                # A rank worker without a server warm-up (the tests' stand-ins) reports none.
                connection.send(messages.Ready(replica=groups.replica, variant=worker.variant, pids=tuple(pids),
                                               warmups=tuple(getattr(worker, "server_warmups", ())),
                                               has_audio=getattr(worker, "has_audio", True),
                                               streams_text_encoder=getattr(worker, "streams_text_encoder", False),
                                               precision=getattr(worker, "precision", None)))
        if worker is not None and not any(failures):
            _ReplicaLoop(worker, context, connection).serve()
            # A resume's host copy may still be being freed (unregistered, unmapped) on the reaper's thread, a
            # daemon that would otherwise be cut off in a CUDA call while the interpreter and CUDA shut down.
            reaper = getattr(getattr(worker, "memory_release", None), "reaper", None)
            if reaper is not None:
                reaper.wait()
    finally:
        dist.destroy_process_group()


def _leave_to_the_engine(signum: int, frame: object) -> None:
    """A rank's handler of the signals the engine handles (`engine_rank_main`): nothing to do here."""


def engine_rank_main(*args) -> None:
    """`rank_main` in a process the engine started: Ctrl-C, SIGTERM and SIGHUP are the engine's to handle.

    A terminal's Ctrl-C reaches the whole process group: the ranks died mid-step with a traceback each while the
    engine, which cancels the request and shuts them down, was still running. So do `timeout`'s SIGTERM and a
    closed terminal's SIGHUP: the ranks died at once (the video's temporary file left behind) while `k6serve
    generate` stopped the request as at Ctrl-C. (They also start with these signals blocked,
    `start_process(block_sigint=True)`, for the seconds before this line runs.) A rank whose engine is gone exits by
    itself (`_exit_when_orphaned`); the engine stops a rank with SIGKILL when it must (`stop_processes`).
    """
    # A Python handler that does nothing, not SIG_IGN, then the mask unblocked: an ignored or blocked signal stays so
    # in every process the rank starts (inductor's compile workers, whose pool is stopped with SIGTERM), where a
    # handler is reset by exec.
    for signum in ENGINE_HANDLED_SIGNALS:
        signal.signal(signum, _leave_to_the_engine)
    if hasattr(signal, "pthread_sigmask"):
        signal.pthread_sigmask(signal.SIG_UNBLOCK, set(ENGINE_HANDLED_SIGNALS))
    _exit_when_orphaned()
    rank_main(*args)
    exit_without_teardown(0)  # shut down cleanly: the engine need not wait for the interpreter's teardown


def _exit_when_orphaned(poll_s: float = 0.5) -> None:
    """A daemon thread that ends this rank once the engine process that started it is gone (it is re-parented).

    Mid-request a rank notices through its connection; before that, in the rendezvous, it waited up to
    --dist-timeout-s (600 s) for peers that would never come, a process with no parent (on a GPU, holding a CUDA
    context): the engine killed by SIGTERM or SIGKILL while the model loaded."""
    import multiprocessing

    parent = multiprocessing.parent_process()
    if parent is None or parent.pid is None:
        return
    expected = parent.pid

    def watch() -> None:
        while os.getppid() == expected:
            time.sleep(poll_s)
        os.write(2, f"k6serve rank process {os.getpid()}: the engine process {expected} that started it is gone; "
                    "exiting.\n".encode())
        os._exit(1)

    threading.Thread(target=watch, name="k6serve-orphan-watch", daemon=True).start()


def _host_rank_main(*args) -> None:
    """`rank_main` in a process `serve_worker_ranks` started (a host without the engine)."""
    rank_main(*args)
    exit_without_teardown(0)


def serve_worker_ranks(config: EngineConfig, build_rank_worker: RankWorkerFactory = build_model_worker) -> None:
    """Run the ranks of a host that does not host the engine (--node-rank > 0, or torchrun rank > 0)."""
    device_type = device_type_for(config.runtime.device)
    spec = torchrun_rank(os.environ, world_size=config.parallel.num_gpus, device_type=device_type,
                         timeout_s=config.parallel.dist_timeout_s)
    if spec is not None:
        rank_main(spec, config, build_rank_worker, None, None)
        return
    parallel = config.parallel
    specs = local_rank_specs(parallel, device_type)
    ranks = f"ranks {specs[0].rank}-{specs[-1].rank}" if len(specs) > 1 else f"rank {specs[0].rank}"
    # A host waiting for node 0 printed nothing, nor anything when its ranks ended.
    logger.info("host %d of %d: starting worker %s, joining node 0 at %s within %g s", parallel.node_rank,
                parallel.nnodes, ranks, parallel.dist_init_addr, parallel.dist_timeout_s)
    processes = [
        start_process(_host_rank_main, (spec, config, build_rank_worker, None, None), name=f"k6serve-rank{spec.rank}")
        for spec in specs
    ]
    for process in processes:
        process.join()
    codes = [process.exitcode for process in processes]
    logger.info("host %d of %d: worker %s ended (%s)", parallel.node_rank, parallel.nnodes, ranks,
                "exited with code 0" if not any(codes) else
                "; ".join(f"rank {spec.rank} {describe_exit_code(code)}" for spec, code in zip(specs, codes) if code))
