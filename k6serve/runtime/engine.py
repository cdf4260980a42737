"""The engine: a request queue in front of a model worker, returning futures.

GPU work runs on the engine's own threads (never on the caller's event loop): one loop thread per worker replica
(`worker.num_replicas`, dp), so with dp replicas up to dp requests run at once, taken in arrival order. By default
the worker is the multi-process runtime (`MultiProcessWorker`: one process per GPU, also for one GPU); tests pass
`worker=` to skip starting processes. Cancellation is cooperative: it takes effect at the next denoising step (or SR
tile) boundary, or after the last one at the next chunk of the video decode (the pipelines report the final step again
there), after which the worker is free for the next request. Only the MP4's tail, after the last chunk, runs to its end.

LoRA operations (`Engine.lora`, `submit_lora`) queue like requests and run between them, in submission order: one
starts once every request taken before it has finished, on every replica at once (`worker.apply_lora_operation`),
and no request taken after it starts until it has finished, so all replicas always hold the same adapters.

Memory operations (`release_memory`, `resume_memory`, `submit_memory`; `runtime/memory.py`) run the same way. After
a release, requests and adapter changes taken from the queue are held back, in order, until a resume; the loop keeps
taking, so the resume (and a `ListLoras`, which changes nothing) gets through whatever waits before it. A held
request can still be cancelled (it then never runs); `shutdown` fails the ones still held. Releasing twice or
resuming while not released changes nothing and says so in the reply's "status".
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import wait as futures_wait
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

from k6serve.config import EngineConfig
from k6serve.lora.spec import ListLoras, LoraOperation, LoraReply
from k6serve.request import OutputOptions, ProgressCallback, SamplingParams, VideoResult, drawn_seed
from k6serve.runtime.memory import MemoryOperation, MemoryReply, ReleaseMemory, ResumeMemory, memory_reply
from k6serve.speed.warmup import WarmupReport

if TYPE_CHECKING:  # the engine's process imports no model code (the ranks build the models)
    from k6serve.runtime.process_group_worker import MultiProcessWorker
    from k6serve.runtime.worker import ModelWorker

logger = logging.getLogger(__name__)


class RequestCancelled(Exception):
    """Raised inside the worker at a step boundary (or a decode chunk boundary) when the request was cancelled."""


@dataclass(eq=False)
class EngineJob:
    id: str
    params: SamplingParams
    output: OutputOptions
    on_progress: ProgressCallback | None
    # A failure is logged with its traceback unless the caller waits for the result (`Engine.generate`), which
    # raises it: the CLI would otherwise print it twice, the traceback above its one-line error.
    log_failure: bool = True
    future: Future = field(default_factory=Future)
    cancelled: threading.Event = field(default_factory=threading.Event)
    started: threading.Event = field(default_factory=threading.Event)
    cancel_reason: str | None = None  # said after "cancelled at step i/n" when the caller did not ask for it
    # The caller stopped waiting (Ctrl-C, a cancelled asyncio task): its on_progress is not called again. It ran
    # once more at the cancelling step, printing into a notebook's next cell.
    caller_gone: bool = False

    def abandon(self) -> None:
        """The caller has stopped waiting: cancel at the next boundary, and call its on_progress no more."""
        self.caller_gone = True
        self.cancel()

    @property
    def cancel_words(self) -> str:
        """": <reason>" to end a cancellation's message with, when it has one."""
        return f": {self.cancel_reason}" if self.cancel_reason else ""

    def cancel(self, reason: str | None = None) -> None:
        """Cancel now if still queued, else at the next step boundary."""
        if reason is not None:
            self.cancel_reason = reason
        self.cancelled.set()
        if not self.started.is_set():
            self.future.cancel()


@dataclass(eq=False)
class LoraJob:
    """A LoRA operation waiting in the engine's queue; its future holds the worker's reply."""

    operation: LoraOperation
    future: Future[LoraReply] = field(default_factory=Future)


@dataclass(eq=False)
class MemoryJob:
    """A memory release or resume waiting in the engine's queue; its future holds the reply (`memory_reply`)."""

    operation: MemoryOperation
    future: Future[MemoryReply] = field(default_factory=Future)


_STOP = object()
_Reply = TypeVar("_Reply", LoraReply, MemoryReply)
# Every engine not yet garbage-collected: shut down, as their owners would have, before the process's exit kills what
# is left of their ranks (engine_ranks._kill_ranks_at_exit).
LIVE_ENGINES: "weakref.WeakSet[Engine]" = weakref.WeakSet()
# How long shutdown() waits, after cancelling the requests still running, for them to reach a step boundary before
# it closes the worker anyway (a hung rank): a step of Pro at 512x768x121 on an H200 took 15.7 s eager with serial
# CFG (docs/benchmarks.md, the first session's table), two forwards of about 5.8 s each in speed mode.
SHUTDOWN_CANCEL_WAIT_S = 60.0


def _interruptible_result(future: Future) -> Any:
    """`future.result()`, waking every 0.1 s while it waits. Ctrl-C is a process-wide SIGINT that the kernel may
    hand to any thread: handed to the worker thread, it only sets Python's flag, and a main thread blocked in an
    untimed wait ran the handler when the request ended, 10 s later in a test. A timed wait runs it within 0.1 s."""
    while not futures_wait([future], timeout=0.1).done:
        pass
    return future.result()


def _cancellation_point(job: EngineJob) -> ProgressCallback:
    """The worker's `on_step`: reports progress, then raises RequestCancelled if `job` was cancelled."""
    final_step_reported = False

    def on_step(step: int, total: int) -> None:
        nonlocal final_step_reported
        if job.on_progress is not None and not job.caller_gone:
            job.on_progress(step, total)
        # The pipelines report the final step again between the video decode's chunks.
        in_decode = final_step_reported and step >= total
        final_step_reported = final_step_reported or step >= total
        if job.cancelled.is_set():
            where = f"during the video decode (after step {step}/{total})" if in_decode else f"at step {step}/{total}"
            raise RequestCancelled(f"request {job.id} was cancelled {where}{job.cancel_words}")

    return on_step


def check_before_loading(config: EngineConfig) -> None:
    """Refuse, before any rank loads, a config the ranks would refuse after their load (a layout, a
    --warmup-resolutions size, a --quantization-ignored-layers typo) or that every request would fail on (Cache-DiT
    settings leaving no block to cache).
    `Engine` runs it; `serve` runs it before it binds its port, so that a flag's mistake is not hidden behind a port
    in use."""
    from k6serve.caching.preflight import check_cache_dit_config_before_loading
    from k6serve.runtime.device_fit import check_device_fits
    from k6serve.parallel.preflight import check_layout_before_loading
    from k6serve.runtime.warmup_sizes import check_warmup_sizes_before_loading
    from k6serve.speed.fp8_linears import check_quantization_before_loading

    check_temporary_folder()
    check_layout_before_loading(config)
    check_cache_dit_config_before_loading(config)
    check_warmup_sizes_before_loading(config)
    check_quantization_before_loading(config)
    check_device_fits(config)  # last: a layout or flag mistake is told first, whatever the machine


def check_temporary_folder() -> None:
    """Refuse to start without a writable temporary folder: torch finds its compiler's cache folder there as the
    ranks import it, so a container with a read-only root and no /tmp mounted failed each rank's start-up, told as
    "a bug in k6serve"."""
    import tempfile

    try:
        tempfile.gettempdir()
    except FileNotFoundError as exc:
        raise ValueError(f"there is no writable temporary folder ({exc.strerror or exc}); torch needs one for its "
                         "compiler's cache. Set TMPDIR to a writable folder (in a container, mount one at /tmp), or "
                         "TORCHINDUCTOR_CACHE_DIR to one for that cache.") from None


class Engine:
    def __init__(self, config: EngineConfig, *, worker: ModelWorker | MultiProcessWorker | None = None) -> None:
        self.config = config
        if worker is None:
            from k6serve.runtime.process_group_worker import MultiProcessWorker

            check_before_loading(config)
            worker = MultiProcessWorker(config)
        self.worker = worker
        LIVE_ENGINES.add(self)
        self._queue: queue.Queue = queue.Queue()
        self._ids = itertools.count()
        self._threads = [
            threading.Thread(target=self._loop, name=f"k6serve-engine-{index}", daemon=True)
            for index in range(getattr(worker, "num_replicas", 1))
        ]
        self._closed = False  # shutdown() began: no request is taken
        self._shut_down = False  # shutdown() ended: the worker is closed
        self._shutting_down = threading.Lock()  # held by the shutdown() running
        self._closing = threading.Lock()
        # One loop thread takes from the queue at a time, so a LoRA operation holds back every item behind it.
        self._taking = threading.Lock()
        self._idle = threading.Condition()  # notified whenever a request ends
        self._running: set[EngineJob] = set()  # the requests running now, under `_idle`
        self._shutdown_reason: str | None = None  # set by a shutdown() that stopped waiting; under `_idle`
        self._memory_released = False
        self._held: deque[EngineJob | LoraJob] = deque()  # taken while released, run after the resume; `_taking`
        # A request taken from the queue that waits for a serving replica to be free, not started (`_loop`); `_taking`
        self._taken: EngineJob | None = None
        for thread in self._threads:
            thread.start()

    @property
    def variant(self):
        return self.worker.variant

    @property
    def num_replicas(self) -> int:
        """How many requests run at once: one per replica (`--dp-size`), each in its own thread."""
        return len(self._threads)

    @property
    def startup_warmups(self) -> tuple[WarmupReport, ...]:
        """What `--warmup-mode server` warmed at start-up, a `WarmupReport` per shape with its cost (with several
        replicas, replica 0's: each warms the same shapes at the same time); empty without a server warm-up."""
        # A stand-in worker (the HTTP tests' fakes) runs no warm-up.
        return tuple(getattr(self.worker, "server_warmups", ()))

    @property
    def precision(self) -> str | None:
        """The dtype the workers resolved for the weights (`ModelWorker.precision`); None from a stand-in worker."""
        return getattr(self.worker, "precision", None)

    def dead_replicas(self) -> list[str]:
        """How each replica that can no longer serve died (empty while all serve); an in-process worker has no
        ranks to lose."""
        probe = getattr(self.worker, "dead_replicas", None)
        return probe() if probe is not None else []

    def resolve(self, params: SamplingParams):
        """Validate a request without running it (raises ValueError with the fix)."""
        return self.worker.resolve(params)

    def submit(self, params: SamplingParams, output: OutputOptions | None = None, *,
               on_progress: ProgressCallback | None = None, job_id: str | None = None,
               log_failure: bool = True) -> EngineJob:
        # A seed of -1 not drawn where the request entered (DiffGenerator and the server draw it, with a note) is
        # drawn here, once, before any rank resolves it: each rank would otherwise draw its own.
        params, _ = drawn_seed(params)
        job = EngineJob(id=job_id or f"req-{next(self._ids)}", params=params, output=output or OutputOptions(),
                        on_progress=on_progress, log_failure=log_failure)
        # Checked and queued under the lock that shutdown() takes to queue the stops: a job queued behind them
        # would never run and its caller would wait forever.
        with self._closing:
            if self._closed:
                raise RuntimeError("The engine has been shut down.")
            self._queue.put(job)
        return job

    def generate(self, params: SamplingParams, output: OutputOptions | None = None, *,
                 on_progress: ProgressCallback | None = None) -> VideoResult:
        """Run one request and return its result; its failure is raised here, not logged. A caller interrupted
        while it waits (Ctrl-C: KeyboardInterrupt) cancels the request at its next step boundary."""
        self.check_not_own_thread("a request")
        job = self.submit(params, output, on_progress=on_progress, log_failure=False)
        try:
            return _interruptible_result(job.future)
        except BaseException:
            if job.future.done():
                raise
            # Nobody is left to take the result: without this a Ctrl-C in a notebook left the request running
            # to its end, holding the worker for the next one, and shutdown() waited for it.
            job.abandon()
            raise

    async def agenerate(self, params: SamplingParams, output: OutputOptions | None = None, *,
                        on_progress: ProgressCallback | None = None) -> VideoResult:
        """`generate` for asyncio: awaits the request without blocking the event loop. Cancelling the awaiting task
        (asyncio.wait_for's timeout, task.cancel()) cancels the request at its next step boundary; `await
        asyncio.to_thread(generate, ...)` left it running to its end, its file written, the next
        request waiting behind it."""
        import asyncio

        self.check_not_own_thread("a request")
        job = self.submit(params, output, on_progress=on_progress, log_failure=False)
        try:
            return await asyncio.wrap_future(job.future)
        except BaseException:
            if not job.future.done() or job.future.cancelled():
                job.abandon()
            raise

    def queue_depth(self) -> int:
        return self._queue.qsize() + len(self._held) + (self._taken is not None)

    @property
    def memory_released(self) -> bool:
        """True from a release until the next resume: requests wait in the queue meanwhile."""
        return self._memory_released

    def _put(self, job: LoraJob | MemoryJob) -> None:
        with self._closing:
            if self._closed:
                raise RuntimeError("The engine has been shut down.")
            self._queue.put(job)

    def submit_lora(self, operation: LoraOperation) -> Future[LoraReply]:
        """Queue a LoRA operation behind the requests already submitted; its future holds the worker's reply."""
        job = LoraJob(operation)
        self._put(job)
        return job.future

    def submit_memory(self, operation: MemoryOperation) -> Future[MemoryReply]:
        """Queue a memory release or resume behind the requests already submitted; its future holds the reply."""
        job = MemoryJob(operation)
        self._put(job)
        return job.future

    def check_not_own_thread(self, what: str) -> None:
        """Refuse to wait, on an engine thread (in an on_progress callback), for work that thread must run: the
        wait never ended."""
        if threading.current_thread() in self._threads:
            raise RuntimeError(f"{what} was made from an on_progress callback, which runs on the engine's thread that "
                               "runs the request: it would wait for itself forever; make it once generate() has "
                               "returned, or from another thread.")

    def _wait_for(self, future: Future[_Reply]) -> _Reply:
        try:
            return _interruptible_result(future)
        except BaseException:
            future.cancel()  # an interrupted caller: drop it if still queued
            raise

    def release_memory(self) -> MemoryReply:
        """Once the requests before it have finished, move every device tensor of every rank to host memory and
        free the allocator caches; requests wait until `resume_memory`. Returns what each rank freed and still
        holds (`runtime/memory.py`). --use-fsdp-inference raises ValueError."""
        self.check_not_own_thread("a LoRA or memory call")
        return self._wait_for(self.submit_memory(ReleaseMemory()))

    def resume_memory(self, *, keep_host_copy: bool = False) -> MemoryReply:
        """Copy the released tensors back to the devices, bit for bit; the waiting requests then run in order. With
        `keep_host_copy` the host copies stay, so the next release only re-points the weights to them."""
        self.check_not_own_thread("a LoRA or memory call")
        return self._wait_for(self.submit_memory(ResumeMemory(keep_host_copy=keep_host_copy)))

    def lora(self, operation: LoraOperation) -> LoraReply:
        """Run a LoRA operation on every rank of every replica, between requests; returns the worker's reply.
        A ValueError (bad input: the adapter state is unchanged) is raised as it is."""
        self.check_not_own_thread("a LoRA or memory call")
        return self._wait_for(self.submit_lora(operation))

    def _loop(self) -> None:
        while True:
            with self._taking:
                job = self._held.popleft() if self._held and not self._memory_released else self._queue.get()
                if job is _STOP:
                    return
                if isinstance(job, (MemoryJob, LoraJob)) and self._shutdown_reason is not None:
                    # Queued behind a request that shutdown() stopped waiting for: an adapter load or a memory
                    # release could outlast the last wait, and the worker would be closed under it.
                    if job.future.set_running_or_notify_cancel():
                        job.future.set_exception(RuntimeError(f"Not run: {self._shutdown_reason}."))
                    continue
                if isinstance(job, MemoryJob):
                    self._run_control(job.future, self._apply_memory, job.operation)
                    continue
                if self._memory_released and not (isinstance(job, LoraJob) and isinstance(job.operation, ListLoras)):
                    self._held.append(job)
                    continue
                if isinstance(job, LoraJob):
                    self._run_control(job.future, self._apply_lora, job.operation)
                    continue
                # Checked once the request is taken, not before the thread waits in the queue: a replica may die
                # while it waits there (the usual idle state with dp > 1 and one request running).
                self._taken = job
                try:
                    self._wait_for_a_serving_replica()
                finally:
                    self._taken = None
                if not job.future.set_running_or_notify_cancel():
                    continue  # cancelled while queued
                job.started.set()
                with self._idle:
                    self._running.add(job)
                    if self._shutdown_reason is not None:
                        job.cancel(self._shutdown_reason)
            try:
                self._run(job)
            finally:
                with self._idle:
                    self._running.discard(job)
                    self._idle.notify_all()

    def _wait_for_a_serving_replica(self) -> None:
        """Called holding `_taking`: wait until fewer requests run than replicas still serve. With a dp replica dead,
        a loop thread took the next request and waited inside the worker for the survivor: the request counted as
        started, and a cancel (DELETE, Ctrl-C) landed only after the survivor's request ended and it had begun. Left
        in the queue (`_taken`, not started), it is cancelled at once. At least one: with none serving, the worker
        says they all died."""
        with self._idle:
            while len(self._running) >= max(1, len(self._threads) - len(self.dead_replicas())):
                self._idle.wait()

    def _run(self, job: EngineJob) -> None:
        try:
            if job.cancelled.is_set():
                raise RequestCancelled(f"request {job.id} was cancelled before it started{job.cancel_words}")
            result = self.worker.run(job.params, job.output, on_step=_cancellation_point(job))
        except BaseException as exc:  # every failure belongs to this request, not to the engine
            if job.log_failure and not isinstance(exc, (RequestCancelled, ValueError)):
                logger.exception("request %s failed", job.id)
            job.future.set_exception(exc)
        else:
            job.future.set_result(result)

    def _run_control(self, future: Future[_Reply], apply: Callable[[Any], _Reply], operation: object) -> None:
        """Run a LoRA or memory operation: called holding `_taking`, it waits for the running requests to end, and
        none starts until it returns; `apply(operation)`'s result or exception goes to `future`."""
        with self._idle:
            while self._running:
                self._idle.wait()
            stopped = self._shutdown_reason
        if not future.set_running_or_notify_cancel():
            return
        if stopped is not None:
            # Taken (with dp > 1) while another replica's request ran, then shutdown() stopped waiting for that
            # request: run now, it could outlast the last wait, and the worker would be closed under it.
            future.set_exception(RuntimeError(f"Not run: {stopped}."))
            return
        try:
            result = apply(operation)
        except BaseException as exc:  # noqa: BLE001 (raised to the caller, who waits for it)
            future.set_exception(exc)
        else:
            future.set_result(result)

    def _apply_lora(self, operation: LoraOperation) -> LoraReply:
        # The worker's method is looked up here, inside _run_control's try: a worker without it (a test double, a
        # custom worker) fails this call's future, where reading it in the loop stopped the loop thread.
        return self.worker.apply_lora_operation(operation)

    def _apply_memory(self, operation: MemoryOperation) -> MemoryReply:
        reports = self.worker.apply_memory_operation(operation)  # one report per rank
        self._memory_released = isinstance(operation, ReleaseMemory)
        return memory_reply(operation, reports, num_waiting=len(self._held))

    def shutdown(self, timeout: float | None = 30.0, *, cancel_wait_s: float = SHUTDOWN_CANCEL_WAIT_S) -> None:
        """Finish the requests submitted before it, stop the loop threads, then close the worker (its processes).

        A request still running after `timeout` seconds is cancelled at its next step (or decode chunk) boundary,
        its caller told why, and waited for up to `cancel_wait_s` seconds (a hung rank never gets there) before the
        worker closes: closing under it stopped its ranks mid-request, which failed
        it 30 s later as "AssertionError: Shutdown()" (a notebook's shutdown() beside a long request, or the
        interpreter exiting with one running in a daemon thread)."""
        if threading.current_thread() in self._threads:
            # A join of its own thread raised "cannot join current thread" after the engine was marked closed.
            raise RuntimeError("shutdown() was called from the engine's own thread (an on_progress callback): it "
                               "would wait for the request that called it; call it once generate() has returned.")
        # One shutdown at a time: a second caller waits for the first, then finds it done. One interrupted (Ctrl-C
        # while it waits for a request) lets go, and the next call finishes it: each step below may run again. It
        # once returned at once, the worker's ranks left running.
        with self._shutting_down:
            self._shutdown(timeout, cancel_wait_s)

    def _shutdown(self, timeout: float | None, cancel_wait_s: float) -> None:
        with self._closing:
            if self._shut_down:
                return
            if not self._closed:
                self._closed = True
                for _ in self._threads:
                    self._queue.put(_STOP)
        deadline = None if timeout is None else time.monotonic() + timeout
        for thread in self._threads:
            thread.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
        if any(thread.is_alive() for thread in self._threads):
            reason = f"the engine was shut down (it waited {timeout:g} s for the requests before it to finish)"
            with self._idle:
                self._shutdown_reason = reason  # the requests still queued behind the running ones: not started
                running = list(self._running)
            for job in running:
                if not job.cancelled.is_set():  # a caller's own cancel keeps its words
                    job.cancel(reason)
            deadline = time.monotonic() + cancel_wait_s  # one wait for all replicas, not one each
            for thread in self._threads:
                thread.join(max(0.0, deadline - time.monotonic()))
        while self._held:
            held = self._held.popleft()
            if held.future.set_running_or_notify_cancel():
                held.future.set_exception(RuntimeError("The engine was shut down while its memory was released; "
                                                       "this did not run."))
        close = getattr(self.worker, "close", None)
        if close is not None:
            close()
        self._shut_down = True
