"""The SPMD runtime: one process per rank, grouped into dp replicas, driven by `MultiProcessWorker`.

Engine side: `MultiProcessWorker(config)` starts the ranks (or joins the ones torchrun started), waits until
every replica's leader (its first rank) reports `Ready`, then hands each request to an idle replica over a
socket and relays progress and cancellation step by step. It has the members the `Engine` uses (`variant`,
`resolve`, `run`, `apply_lora_operation` and `apply_memory_operation`, which wait until every replica is idle and run
the operation on all of them), so `Engine(config, worker=MultiProcessWorker(config))` serves with any number of ranks,
including 1.

Rank side: `rank_process.py` (`rank_main`, the per-rank worker and its request loop, `serve_worker_ranks`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
import os
import queue
import socket
import threading
import time
from collections.abc import Callable
from multiprocessing import AuthenticationError
from multiprocessing.connection import Connection, Listener, wait
from multiprocessing.process import BaseProcess
from typing import TypeVar, cast

import torch.distributed as dist

from k6serve.config import EngineConfig
from k6serve.lora.spec import LoraOperation, LoraReply
from k6serve.models.kandinsky6.config_before_loading import dit_blocks_before_loading
from k6serve.models.variants import GENERATION, Variant
from k6serve.parallel.mesh import ParallelLayout
from k6serve.request import (
    GenerateRequest,
    OutputOptions,
    ProgressCallback,
    SamplingParams,
    UpscaleRequest,
    VideoResult,
)
from k6serve.request_resolution import resolve_generate, resolve_upscale
from k6serve.runtime import messages
from k6serve.runtime.engine import RequestCancelled
from k6serve.runtime.engine_ranks import ENGINE_RANKS
from k6serve.runtime.launch import (
    LOCAL_HOST,
    device_type_for,
    local_rank_specs,
    rendezvous_store,
    start_process,
    stop_processes,
    torchrun_rank,
    warn_of_cpu_ranks,
)
from k6serve.runtime.memory import MemoryOperation, MemoryRankReport, inverse
from k6serve.runtime.out_of_memory import WorkerKilled, describe_exit_code, worker_killed_hint
from k6serve.runtime.rank_process import (
    RankWorkerFactory,
    build_model_worker,
    engine_rank_main,
    rank_main,
    serve_worker_ranks,
)
from k6serve.runtime.replica_failures import (
    RemoteTraceback,
    failure_error,
    lora_result,
    remove_dead_writers_files,
)
from k6serve.speed.warmup import WarmupReport

# serve_worker_ranks, which the errors below tell a host of worker ranks only to call, stays importable from here.
__all__ = ["MultiProcessWorker", "serve_worker_ranks"]

logger = logging.getLogger(__name__)
_Outcome = TypeVar("_Outcome")  # what a control message's replicas answered (`_control_on`)


@dataclasses.dataclass(eq=False)
class _Replica:
    index: int
    connection: Connection
    pids: tuple[int, ...]
    processes: list[BaseProcess]  # the ranks of this replica started by this process
    alive: bool = True


class MultiProcessWorker:
    """The engine's view of all ranks: `variant`, `resolve(params)` and `run(params, output, on_step)`.

    `run` may be called from several threads at once: each call takes an idle replica (dp) and waits for it.
    """

    def __init__(self, config: EngineConfig, *, build_rank_worker: RankWorkerFactory = build_model_worker):
        parallel = config.parallel
        if parallel.node_rank != 0:
            raise ValueError(
                f"--node-rank {parallel.node_rank} hosts worker ranks only; the engine runs on node 0. Call "
                f"serve_worker_ranks(config) on this host."
            )
        self.config = config
        self.layout = ParallelLayout.from_config(parallel)
        device_type = device_type_for(config.runtime.device)
        warn_of_cpu_ranks(config.runtime.device, device_type, parallel.num_gpus)
        torchrun = torchrun_rank(os.environ, world_size=parallel.num_gpus, device_type=device_type,
                                 timeout_s=parallel.dist_timeout_s)
        if torchrun is not None and torchrun.rank != 0:
            raise ValueError(
                f"torchrun rank {torchrun.rank} hosts a worker rank only; the engine runs on rank 0. "
                f"Call serve_worker_ranks(config) on the other ranks."
            )
        many_hosts = parallel.nnodes > 1 or (torchrun is not None and torchrun.world_size > 1)
        advertised_host = torchrun.master_addr if torchrun else (
            parallel.dist_init_addr.rpartition(":")[0] if parallel.dist_init_addr else LOCAL_HOST)
        authkey = os.urandom(32)
        self._listener = Listener(("0.0.0.0" if many_hosts else LOCAL_HOST, 0), authkey=authkey)
        self._listener_address = self._listener.address  # for `_wake_accept`, which may run after the close
        address = (advertised_host if many_hosts else LOCAL_HOST, self._listener.address[1])
        self._processes: dict[int, BaseProcess] = {}
        self._rank0_thread: threading.Thread | None = None
        self._store: dist.TCPStore | None = None  # the ranks' rendezvous server when this process holds it
        self._death_notes: dict[int, str] = {}  # replica index -> how it died, for dead_replicas()
        self._ids = itertools.count()
        self._idle: list[_Replica] = []
        self._replicas: list[_Replica] = []
        self._changed = threading.Condition()
        self._closed = False  # set by close(): requests then fail as shut down, not as crashed
        if parallel.nnodes > 1:
            # Node 0 waited for the other hosts with nothing printed.
            others = ("the other host (--node-rank 1)" if parallel.nnodes == 2 else
                      f"the other {parallel.nnodes - 1} hosts (--node-rank 1 to {parallel.nnodes - 1})")
            logger.info("waiting for the worker ranks of %s to join at %s, within %g s", others,
                        parallel.dist_init_addr, parallel.dist_timeout_s)
        try:
            self._start_ranks(torchrun, config, build_rank_worker, address, authkey, many_hosts, device_type)
            self._replicas = self._wait_until_ready(parallel.dist_timeout_s)
        except BaseException:
            # The ranks ignore SIGINT and have no connection to be told to stop on: a Ctrl-C while they start or
            # load must not wait out the usual grace before they are terminated (nor leave the ones already
            # started, the listener and the rendezvous store behind in a notebook that goes on).
            self.close(timeout_s=2.0)
            raise
        self._idle = list(self._replicas)
        # So a request whose Cache-DiT settings leave no block to cache is refused when resolved (a 400 when the
        # server creates the job), not when it runs; None where the count needs a download (the pipeline checks).
        self.num_dit_blocks = dit_blocks_before_loading(config.model)

    @property
    def num_replicas(self) -> int:
        """How many requests can run at once (dp); the engine may call `run` from this many threads."""
        return self.layout.dp

    @property
    def pids(self) -> dict[int, int]:
        """Global rank -> process id of every rank (for tests and diagnostics)."""
        return {
            rank: pid
            for replica in self._replicas
            for rank, pid in zip(self.layout.replica_ranks(replica.index), replica.pids)
        }

    def _dead_ranks(self, ranks: list[int] | None = None) -> list[str]:
        found = []
        for rank, process in sorted(self._processes.items()):
            if (ranks is None or rank in ranks) and process.exitcode is not None:
                found.append(f"rank {rank} (pid {process.pid}) {describe_exit_code(process.exitcode)}")
        return found

    def _dead_ranks_error(self, message: str, ranks: list[int] | None = None,
                          codes: list[int] | None = None) -> RuntimeError:
        """`message` as the error to raise: a `WorkerKilled` (the machine's failure, with its likely cause) when a
        rank was ended by a signal, such as the out-of-memory killer's SIGKILL. `codes`: the exit codes to judge
        by, when not those the processes have now (a rank the engine itself killed is no sign of the machine's)."""
        if codes is None:
            codes = [p.exitcode for rank, p in self._processes.items()
                     if (ranks is None or rank in ranks) and p.exitcode is not None]
        hint = worker_killed_hint(codes)
        return WorkerKilled(message + hint) if hint else RuntimeError(message)

    def _accept_leaders(self, connections: queue.Queue) -> None:
        """Put each replica leader's authenticated connection in `connections`, until all have come or `close()`."""
        accepted = 0
        while accepted < self.layout.dp and not self._closed:
            try:
                connection = self._listener.accept()
            except OSError:
                return  # the listener was closed: start-up failed
            except (EOFError, AuthenticationError):
                continue  # a connection that did not authenticate: `close()`'s wake-up, or a stranger's
            if self._closed:
                connection.close()
                return
            connections.put(connection)
            accepted += 1

    def _wake_accept(self) -> None:
        """End an accept() still waiting for a leader (a Ctrl-C while the ranks start): closing the listener does
        not wake it on Linux, and each interrupted load left its thread and two descriptors for good. A connection
        that sends nothing fails its authentication, and the thread, seeing `_closed`, returns."""
        host, port = self._listener_address[:2]
        with contextlib.suppress(OSError):
            socket.create_connection((LOCAL_HOST if host == "0.0.0.0" else host, port), timeout=1.0).close()

    def _wait_until_ready(self, timeout_s: float) -> list[_Replica]:
        """Each replica's `Ready`. `timeout_s` bounds only the joining (every leader's `Joined`); then the wait lasts
        as long as the ranks live: fetching the checkpoint (a first download of tens of GiB), loading it and a
        server warm-up took longer than 600 s on a slow link, and start-up failed with the model half loaded. (The
        ranks' gather after loading is a collective: a replica's ranks finish within `timeout_s` of each other.)"""
        connections: queue.Queue = queue.Queue()

        threading.Thread(target=self._accept_leaders, args=(connections,), name="k6serve-accept",
                         daemon=True).start()
        replicas: dict[int, _Replica] = {}
        pending: list[Connection] = []  # leaders connected, not yet ready
        replica_of: dict[Connection, int] = {}  # each leader's replica, from its Joined
        closed: list[Connection] = []  # leaders whose connection ended before their Ready

        def read(timeout: float) -> None:
            """Handle what the leaders sent within `timeout` s: raises their start-up failure."""
            if not pending:
                try:  # the first connection: waited for here, so that it is read at once
                    pending.append(connections.get(timeout=timeout))
                except queue.Empty:
                    return
            while not connections.empty():
                pending.append(connections.get())
            for connection in wait(pending, timeout=timeout):
                # Every message there is: a leader that failed fast sends Joined, then StartupFailed, and exits; read
                # one at a time, the Joined was the last handled when its exit was seen, and the failure was lost.
                while connection in pending and connection.poll():
                    handle(connection)

        def handle(connection: Connection) -> None:
            try:
                message = connection.recv()
            except (EOFError, OSError):
                pending.remove(connection)
                closed.append(connection)
                return
            if isinstance(message, messages.Joined):
                replica_of[connection] = message.replica
                return
            pending.remove(connection)
            if isinstance(message, messages.StartupFailed):
                if message.kind == "value":
                    raise ValueError(message.message)
                if message.kind == "module" and message.error is not None:
                    message.error.__cause__ = RemoteTraceback(message.message)
                    raise message.error
                raise RuntimeError(f"replica {message.replica} failed to start:\n{message.message}")
            assert isinstance(message, messages.Ready), message
            ranks = self.layout.replica_ranks(message.replica)
            processes = [self._processes[r] for r in ranks if r in self._processes]
            replicas[message.replica] = _Replica(message.replica, connection, message.pids, processes)
            self.variant: Variant = message.variant
            if message.replica == 0:
                self.server_warmups: tuple[WarmupReport, ...] = message.warmups  # `Engine.startup_warmups`
                self.has_audio, self.streams_text_encoder = message.has_audio, message.streams_text_encoder
                self.precision = message.precision  # `Engine.precision`

        deadline = time.monotonic() + timeout_s
        while len(replicas) < self.layout.dp:
            read(0.2)
            if closed:
                # A leader is gone. One of this host's is named by its exit code, there once the process has ended
                # (its interpreter's teardown can take seconds after the socket closed); one on another host only
                # by this (no deadline would end the wait).
                ended = wait([process.sentinel for process in self._processes.values()], timeout=5.0)
                for process in self._processes.values():
                    if process.sentinel in ended:
                        process.join(2.0)  # its sentinel fires slightly before its exit code can be read
            dead = self._dead_ranks()
            if self._rank0_thread is not None and not self._rank0_thread.is_alive():
                dead.append("rank 0 (this process) stopped")
            if dead:
                read(0.0)  # the start-up failure a leader sent just before it exited is the better report
                raise self._dead_ranks_error(f"worker start-up failed: {'; '.join(dead)} (see its log above).")
            if closed:
                raise RuntimeError(f"the leader of replica {replica_of.get(closed[0], '?')} closed its connection "
                                   "during start-up; see the log of the host that runs it.")
            if len(replica_of) < self.layout.dp and time.monotonic() > deadline:
                raise RuntimeError(
                    f"worker ranks did not join within {timeout_s:g} s ({len(replica_of)} of {self.layout.dp} "
                    f"replica(s) joined); check that every host and GPU of the layout is up and can reach the "
                    f"rendezvous address, or give them longer (the Python API's dist_timeout_s)."
                )
        return [replicas[index] for index in range(self.layout.dp)]

    def resolve(self, params: SamplingParams) -> tuple[GenerateRequest | UpscaleRequest, list[str]]:
        if self.variant.family == GENERATION:
            return resolve_generate(params, self.variant, engine_cache_dit=self.config.runtime.cache_dit_config,
                                    cache_dit_unavailable=self.config.parallel.cache_dit_unavailable,
                                    num_dit_blocks=self.num_dit_blocks,
                                    has_audio=getattr(self, "has_audio", True),
                                    streams_text_encoder=getattr(self, "streams_text_encoder", False))
        return resolve_upscale(params, self.variant)

    def run(self, params: SamplingParams, output: OutputOptions,
            on_step: ProgressCallback | None = None) -> VideoResult:
        replica = self._take_idle_replica()
        try:
            return self._run_on(replica, params, output, on_step)
        finally:
            with self._changed:
                if replica.alive:
                    self._idle.append(replica)
                self._changed.notify_all()

    def apply_lora_operation(self, operation: LoraOperation) -> LoraReply:
        """Run `operation` on every rank of every replica, once all are idle; returns the first replica's reply.

        A ValueError on every replica is raised as ValueError (the adapters are unchanged); if some replicas
        succeeded and others failed `ReplicasDisagree` (a RuntimeError) says so, as they now hold different adapters.
        """
        replicas = self._take_all_replicas("LoRA operation")
        try:
            # A LoRA request's replicas answer `LoraDone`, whose result is the leader's reply.
            outcomes = cast("list[tuple[int, LoraReply | Exception]]", self._control_on(
                replicas, lambda request_id: messages.LoraRequest(request_id=request_id, operation=operation)))
        finally:
            self._give_back(replicas)
        # A replica that died during it was told as `ReplicasDisagree`, so the server recorded the adapters as
        # varying and did not keep the change for its restart, though every replica left held it.
        return lora_result(operation, [outcome for _, outcome in self._of_serving(replicas, outcomes)])

    def apply_memory_operation(self, operation: MemoryOperation) -> list[MemoryRankReport]:
        """Release or resume the memory of every rank of every replica, once all are idle; every rank's report.

        All or nothing: if some replicas fail, the others are put back (`memory.inverse`) and the first failure is
        raised (a ValueError as it is: a refused layout is refused everywhere)."""
        replicas = self._take_all_replicas("memory operation")
        undo_failed: list[int] = []
        try:
            # A replica that died during it does not count: the others were put back, and the operation failed.
            serving = self._of_serving(replicas, self._memory_on(replicas, operation))
            outcomes = [outcome for _, outcome in serving]
            failed = [(index, error) for index, error in outcomes if isinstance(error, Exception)]
            succeeded = [r for r, (_, result) in serving if not isinstance(result, Exception)]
            if failed and succeeded:
                undone = self._memory_on(succeeded, inverse(operation))
                undo_failed = [index for index, result in undone if isinstance(result, Exception)]
        finally:
            self._give_back(replicas)
        if failed:
            index, error = failed[0]
            if isinstance(error, ValueError) or not succeeded:
                raise error
            outcome = (f"undoing it failed on replica(s) {undo_failed}, which now differ from the others; restart the "
                       "server" if undo_failed else "the replicas where it succeeded were put back, so nothing changed")
            raise RuntimeError(f"{type(operation).__name__} failed on replica(s) {[i for i, _ in failed]}; "
                               f"{outcome}. Replica {index}: {type(error).__name__}: {error}") from error
        # Every outcome is a list of reports here (`failed` is empty); the isinstance only tells mypy so.
        return [report for _, reports in outcomes if not isinstance(reports, Exception) for report in reports]

    def _of_serving(self, replicas: list[_Replica],
                    outcomes: list[tuple[int, _Outcome]]) -> list[tuple[_Replica, tuple[int, _Outcome]]]:
        """(replica, its outcome) of the replicas still serving after an operation: one that died during it serves no
        more, so only the others must agree (its death is logged here). All of them when none is left."""
        serving = [(replica, outcome) for replica, outcome in zip(replicas, outcomes) if replica.alive]
        if not serving:
            return list(zip(replicas, outcomes))
        for replica, (_, error) in zip(replicas, outcomes):
            if not replica.alive:
                logger.error("%s", error)
        return serving

    def _memory_on(self, replicas: list[_Replica],
                   operation: MemoryOperation) -> list[tuple[int, list[MemoryRankReport] | Exception]]:
        # A memory request's replicas answer `MemoryDone`, whose result is each rank's report.
        return cast("list[tuple[int, list[MemoryRankReport] | Exception]]", self._control_on(
            replicas, lambda request_id: messages.MemoryRequest(request_id=request_id, operation=operation)))

    def _give_back(self, replicas: list[_Replica]) -> None:
        with self._changed:
            self._idle.extend(r for r in replicas if r.alive)
            self._idle.sort(key=lambda r: r.index)
            self._changed.notify_all()

    def _take_all_replicas(self, what: str) -> list[_Replica]:
        with self._changed:
            while True:
                if self._closed:
                    raise RuntimeError(f"The engine has been shut down; this {what} did not run.")
                self._retire_ended_idle_replicas()
                alive = [r for r in self._replicas if r.alive]
                if not alive:
                    raise RuntimeError(self._all_dead_message())
                if all(r in self._idle for r in alive):
                    self._idle = [r for r in self._idle if r not in alive]
                    return alive
                self._changed.wait()

    def _control_on(self, replicas: list[_Replica], build: Callable[[int], object]) -> list[tuple[int, object]]:
        """(replica index, its result or the exception to raise) for each replica; all run the message `build`
        makes for a request id at once."""
        request_id = next(self._ids)
        unreachable = set()
        for replica in replicas:
            try:
                replica.connection.send(build(request_id))
            except OSError:
                unreachable.add(replica.index)
        outcomes: list[tuple[int, object]] = []  # a LoraReply, a list of MemoryRankReport, or an Exception
        for replica in replicas:
            try:
                if replica.index in unreachable:
                    raise EOFError
                ready = wait([replica.connection, *[p.sentinel for p in replica.processes]])
                if replica.connection not in ready:
                    raise EOFError
                message = replica.connection.recv()
            except (EOFError, OSError):
                outcomes.append((replica.index, self._replica_died(replica, request_id)))
                continue
            if isinstance(message, (messages.LoraDone, messages.MemoryDone)):
                outcomes.append((replica.index, message.result))
                continue
            assert isinstance(message, messages.RunFailed), message
            if message.replica_broken:
                outcomes.append((replica.index, self._replica_died(replica, request_id, message.message)))
            else:
                outcomes.append((replica.index, failure_error(message, request_id, replica.index)))
        return outcomes

    def dead_replicas(self) -> list[str]:
        """Why each replica that can no longer serve is gone, checked now: an idle replica whose rank has ended
        (killed, out of host memory) is retired here, not left for the next request to find and be blamed for.
        A busy one is left to its request, which sees the rank end."""
        with self._changed:
            self._retire_ended_idle_replicas()
            return [self._death_notes.get(r.index, f"replica {r.index} stopped") for r in self._replicas
                    if not r.alive]

    def _retire_ended_idle_replicas(self) -> None:
        """Under self._changed."""
        if self._closed:
            return
        for replica in [r for r in self._idle if r.alive]:
            ranks = self.layout.replica_ranks(replica.index)
            dead = self._dead_ranks(ranks)
            if 0 in ranks and self._rank0_thread is not None and not self._rank0_thread.is_alive():
                dead.append("rank 0 (this process's rank thread) stopped")
            if not dead:
                continue
            replica.alive = False
            self._idle.remove(replica)
            self._death_notes[replica.index] = (f"replica {replica.index} (ranks {ranks}) died while idle: "
                                                f"{'; '.join(dead)}")
            replica.connection.close()
            stop_processes(replica.processes, grace_s=1.0, terminate=False)
            logger.error("%s; %d replica(s) still serving", self._death_notes[replica.index],
                         sum(r.alive for r in self._replicas))

    def _all_dead_message(self) -> str:
        notes = "; ".join(note for _, note in sorted(self._death_notes.items()))
        return (f"every worker replica has died ({notes or 'see the errors above'}); nothing can run on them now: "
                "load the model again (a new DiffGenerator, or restart k6serve).")

    def _take_idle_replica(self) -> _Replica:
        with self._changed:
            while True:
                if self._closed:
                    # A deliberate shutdown, not a crash: "replicas died, restart" would send the user hunting.
                    raise RuntimeError("The engine has been shut down; this request did not run.")
                self._retire_ended_idle_replicas()
                if not any(r.alive for r in self._replicas):
                    raise RuntimeError(self._all_dead_message())
                if self._idle:
                    return self._idle.pop(0)
                self._changed.wait()

    def _run_on(self, replica: _Replica, params: SamplingParams, output: OutputOptions,
                on_step: ProgressCallback | None) -> VideoResult:
        request_id = next(self._ids)
        cancelled: BaseException | None = None
        try:
            replica.connection.send(messages.RunRequest(request_id=request_id, params=params, output=output))
            while True:
                sentinels = [p.sentinel for p in replica.processes]
                ready = wait([replica.connection, *sentinels])
                if replica.connection not in ready:
                    raise EOFError
                message = replica.connection.recv()
                if isinstance(message, messages.Progress):
                    if cancelled is None and on_step is not None:
                        try:
                            on_step(message.step, message.total)
                        except BaseException as error:  # noqa: BLE001 (the engine cancels by raising from on_step)
                            cancelled = error
                    replica.connection.send(messages.StepReply(cancel=cancelled is not None))
                    continue
                break
        except (EOFError, OSError):
            died = self._replica_died(replica, request_id)
            if output.save_output:
                remove_dead_writers_files(output.output_path, replica.pids)
            raise died from None
        if isinstance(message, messages.RunSucceeded):
            return message.result
        assert isinstance(message, messages.RunFailed), message
        if message.replica_broken:
            raise self._replica_died(replica, request_id, message.message)
        if message.kind == "cancelled":
            # close() stopped it at a step (`rank_process._ReplicaLoop._on_step`)
            if cancelled is None and self._closed:
                raise RuntimeError(f"request {request_id} was stopped by the engine's shutdown while it ran.")
            raise cancelled if cancelled is not None else RequestCancelled(message.message)
        raise failure_error(message, request_id, replica.index)

    def _replica_died(self, replica: _Replica, request_id: int, detail: str = "") -> RuntimeError:
        if self._closed:
            # close() stopped the replica under this request (shutdown outwaited it): not a crash to debug.
            return RuntimeError(f"request {request_id} was stopped by the engine's shutdown while it ran.")
        replica.alive = False
        ranks = self.layout.replica_ranks(replica.index)
        self._death_notes[replica.index] = f"replica {replica.index} (ranks {ranks}) died running request {request_id}"
        # A rank's sentinel fires as it exits, slightly before its exit code can be read; the leader may also
        # report the broken group before the dead rank's sentinel fires.
        # Every rank that is ending gets the 2 s: taken at the first exit, healthy peers a few milliseconds behind
        # it were named as hung ("stopped responding") beside the one that was.
        grace_end = time.monotonic() + 2.0
        ending = [p for p in replica.processes if p.exitcode is None]
        while ending and (left := grace_end - time.monotonic()) > 0:
            for sentinel in wait([p.sentinel for p in ending], timeout=left):
                process = next(p for p in ending if p.sentinel == sentinel)
                process.join(2.0)
                ending.remove(process)
        dead = self._dead_ranks(ranks)
        codes = [p.exitcode for p in replica.processes if p.exitcode is not None]
        running = {rank: p for rank, p in sorted(self._processes.items()) if rank in ranks and p.exitcode is None}
        replica.connection.close()
        stop_processes(replica.processes, grace_s=1.0, terminate=False)
        # A rank still running when a peer had ended is named as such: the engine's own SIGKILL of it read as
        # "killed by SIGKILL ... the out-of-memory killer", and a rank that hung (its peers timed out waiting for it,
        # then exited cleanly) was never named.
        if dead:
            hung = all(code == 0 for code in codes)
            dead += [f"rank {rank} (pid {p.pid}) "
                     + ("stopped responding (its peers timed out waiting for it)" if hung else "was still running")
                     + " and was stopped by the engine" for rank, p in running.items()]
        else:
            dead = ["the replica's leader closed its connection"]
        # How it died, as for an idle replica: GET /health's dead_replicas shows this note.
        self._death_notes[replica.index] += f": {'; '.join(dead)}"
        remaining = sum(r.alive for r in self._replicas)
        return self._dead_ranks_error(
            f"request {request_id} failed: worker replica {replica.index} (ranks {ranks}) died while running "
            f"it: {'; '.join(dead)}{'. ' + detail if detail else ''}. The replica was shut down; "
            f"{remaining} replica(s) still serving.", ranks, codes)

    def _start_ranks(self, torchrun, config: EngineConfig, build_rank_worker: RankWorkerFactory, address,
                     authkey: bytes, many_hosts: bool, device_type: str) -> None:
        parallel = config.parallel
        if torchrun is not None:
            # This process is global rank 0 as well as the engine: run its rank loop on a thread.
            self._rank0_thread = threading.Thread(
                target=rank_main, args=(torchrun, config, build_rank_worker, address, authkey),
                name="k6serve-rank0", daemon=True,
            )
            self._rank0_thread.start()
            return
        # One host and no --dist-init-addr: this process binds the rendezvous port itself (no race with other
        # programs for a port chosen free); the store must outlive the ranks' process groups.
        if not many_hosts and parallel.dist_init_addr is None:
            self._store = rendezvous_store(parallel.dist_timeout_s)
        store_port = None if self._store is None else self._store.port
        for spec in local_rank_specs(parallel, device_type, store_port=store_port):
            args = (spec, config, build_rank_worker, address if spec.rank == 0 else None,
                    authkey if spec.rank == 0 else None)
            self._processes[spec.rank] = start_process(engine_rank_main, args, block_sigint=True,
                                                       name=f"k6serve-rank{spec.rank}")
            ENGINE_RANKS.add(self._processes[spec.rank])

    def close(self, timeout_s: float = 10.0) -> None:
        """Ask every replica to shut down, then stop whatever is still running."""
        self._closed = True
        told = [replica for replica in self._replicas if replica.alive]  # a dead one's connection is closed already
        for replica in told:
            try:
                replica.connection.send(messages.Shutdown())
            except OSError:
                pass
            replica.alive = False
        stop_processes(list(self._processes.values()), grace_s=timeout_s, terminate=False)
        if self._rank0_thread is not None:
            self._rank0_thread.join(timeout_s)
        # Once the ranks here have read their Shutdown. Left open, each engine shut down kept a socket per replica for
        # as long as it was referenced (a notebook's output history keeps every generator it showed).
        for replica in told:
            replica.connection.close()
        self._store = None  # the ranks are gone: the rendezvous server and its port go too
        self._wake_accept()
        self._listener.close()
        with self._changed:
            self._changed.notify_all()
