"""Feeds stored jobs to the engine, one at a time per replica (`--dp-size`), and records what happens to them.

The queue of record is the SQLite store, not the engine's in-memory queue: the dispatcher thread takes the
oldest `queued` job, marks it `in_progress`, submits it to the engine and waits for its future (in this
thread, never in the event loop), then writes the outcome. So queued work survives a restart, a queued job is
cancelled by a status change alone, and a running one through `EngineJob.cancel()` at the next step boundary.

After the last denoising step (or SR tile) the engine reports the final step again between the chunks of the video
decode, and stops there on a cancel. Only the MP4's tail (the encoder's backlog and flush after the last chunk) has no
boundary: a cancel accepted after the last step is recorded on the job (`cancel_requested_at`, and a warning saying
why it may still be `in_progress`), and if the engine returns a video anyway the job ends `cancelled` with the video
discarded.

A LoRA operation that changes the adapters (`submit_lora`) takes its place in this queue too: the dispatcher runs it
once every job queued or running when it arrived has left the queue, and before any job created after it, so each
job runs with the adapters set when it was created. That order is also what `admit` checks a job's own `loras`
against: the adapters held now plus those the LoRA operations queued before it will load (`LorasNotLoaded`), and
whether those operations leave the server's adapters merged (`LorasMerged`).

A memory release or resume (`submit_memory`) does not queue behind the stored jobs: it goes to the engine at once, and
a release waits only for the running jobs. From then until a resume the dispatcher starts nothing (jobs stay
`queued`, LoRA changes wait), so the GPU stays free for whoever asked for it.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from concurrent.futures import CancelledError, Future
from dataclasses import dataclass, field
from typing import Any, Literal

from k6serve.lora.spec import (
    ListLoras,
    LoraOperation,
    ReplicasDisagree,
    SetLora,
    UnloadLora,
    quantized_lora_refusal,
    start_set_lora,
)
from k6serve.request import SamplingParams, VideoResult
from k6serve.runtime.engine import Engine, EngineJob, RequestCancelled
from k6serve.runtime.memory import MemoryOperation, ReleaseMemory
from k6serve.serve.artifacts import ArtifactStore, output_file_name
from k6serve.serve.errors import ApiError
from k6serve.serve.input_paths import InputPathPolicy
from k6serve.serve.job_outcomes import CANCEL_IN_DECODE, CANCELLED_AFTER_DECODE, OUTPUT_NOT_WRITABLE, JobOutcomes
from k6serve.serve.jobs import CANCELLED_AT_SHUTDOWN, STORE_WRITE_ERRORS, Job, JobStatus, JobStore
from k6serve.serve.lora_state import LoraState
from k6serve.serve.metrics import ServerMetrics
from k6serve.serve.runner_refusals import (LorasMerged, LorasNotLoaded, LorasQuantized, QueueFull, ServerShuttingDown,
                                           merged_message, not_loaded_message)
from k6serve.serve.webhook_sender import VIDEO_FAILED, WebhookSender

logger = logging.getLogger(__name__)

# How often a job store write that failed (a full disk) is tried again by the dispatcher and the finishers.
STORE_RETRY_S = 1.0

DIED_TWICE = (
    "The server stopped twice while this job was running, so it is not retried again (it may be what stops the "
    "server). Submit it again to retry."
)


def _quantization(engine: Any) -> str:
    """The engine's --quantization ("none" for an engine without a config, e.g. a test's)."""
    return getattr(getattr(getattr(engine, "config", None), "model", None), "quantization", "none")


@dataclass(eq=False)
class PendingLora:
    """A LoRA operation waiting for the jobs in `after` (queued or running when it arrived) to be dispatched."""

    operation: LoraOperation
    after: frozenset[str]
    future: Future = field(default_factory=Future)


class JobRunner:
    def __init__(self, engine: Engine, store: JobStore, artifacts: ArtifactStore, metrics: ServerMetrics, *,
                 max_queued_jobs: int) -> None:
        self.engine = engine
        self.store = store
        self.artifacts = artifacts
        self.metrics = metrics
        self.max_queued_jobs = max_queued_jobs
        self._lock = threading.Lock()  # admission, pick-next and cancel are mutually exclusive
        self._wake = threading.Condition(self._lock)
        # As many jobs run at once as the engine has replicas (`--dp-size`): one at a time per replica.
        self._capacity = max(1, int(getattr(engine, "num_replicas", 1)))
        self._running: dict[str, EngineJob] = {}
        self._finishers: list[threading.Thread] = []  # one per running job: waits for it and records the outcome
        self._no_more_waiting = threading.Event()  # `stop_waiting`
        # Running job id -> time.monotonic() of its dispatch or last progress report (`seconds_since_progress`).
        self._last_heard: dict[str, float] = {}
        self._past_last_step: set[str] = set()  # running jobs whose engine reported their last step or tile
        self._in_decode: set[str] = set()  # running jobs whose engine reported their last step again: a decode chunk
        self._stopping = False
        self._thread: threading.Thread | None = None
        # Job id -> time.monotonic() at its creation here, for the latency metric; dropped when the job ends.
        self._created_monotonic: dict[str, float] = {}
        self._pending_loras: list[PendingLora] = []
        self._applying_lora: PendingLora | None = None  # taken from `_pending_loras`, not finished yet
        self._lora_state: LoraState | None = None
        # Nicknames a SetLora loaded on some dp replicas only (`ReplicasDisagree`): whether a job finds them depends
        # on its replica, so they are not refused at creation.
        self._loaded_somewhere: set[str] = set()
        self._num_releasing = 0  # releases sent to the engine and not finished: the queue is held already
        # Where a job's server-side image_path / video_path may point (`build_app` sets the server's policy): checked
        # again as each job starts (`_inputs_checked_again`), not only at its creation.
        self.inputs: InputPathPolicy | None = None
        # Records each job's end (the store with its webhook event, the metrics, the log), with this runner's
        # creation times and decoding jobs.
        self.outcomes = JobOutcomes(engine, store, artifacts, metrics, created_monotonic=self._created_monotonic,
                                    in_decode=self._in_decode)

    @property
    def webhooks(self) -> WebhookSender | None:
        """--webhook-url's sender, told of each completed or failed job (by the outcomes, which queue its events)."""
        return self.outcomes.webhooks

    @webhooks.setter
    def webhooks(self, sender: WebhookSender | None) -> None:
        self.outcomes.webhooks = sender

    def _restore_loras(self) -> None:
        """Rebuild the adapters recorded before a restart, before any job runs: the jobs still queued were created
        under them. A state that cannot be rebuilt stops the start-up, rather than running those jobs without."""
        config = getattr(self.engine, "config", None)
        model = getattr(config, "model", None)
        self._lora_state = LoraState.from_json(
            self.store.lora_state(),
            start=start_set_lora(model) if model is not None and getattr(model, "lora_path", None) else None,
            server_merge_mode=getattr(model, "lora_merge_mode", "auto"),
            fsdp=bool(getattr(getattr(config, "parallel", None), "use_fsdp_inference", False)))
        reload = self._lora_state.inactive_reload()
        for operation in self._lora_state.operations:
            if operation == reload:
                self._reload_inactive(operation, self._lora_state)
                continue
            try:
                self.engine.lora(operation)
            except Exception as exc:
                raise RuntimeError(
                    f"The job store records LoRA adapters set before the server stopped ({operation}), and they could "
                    f"not be restored ({type(exc).__name__}: {exc}). Jobs queued then were created with them. Make "
                    "the adapter files available again and restart, or start with another --job-store to begin "
                    "without them."
                ) from exc
        if self._lora_state.operations:
            # A summary, not the replay list: with a hundred adapters loaded that was one 23 KB line.
            now = self._lora_state.now
            active = ", ".join(f"{spec.nickname} {spec.strength:g}" for spec in now.active) or "none"
            logger.info("restored the LoRA adapters set before the restart: %d loaded; active: %s%s",
                           len(now.loaded), active, f" ({now.mode})" if now.mode else "")

    def _reload_inactive(self, operation: SetLora, state: LoraState) -> None:
        """Load the adapters that were loaded but not active, one at a time: one whose file is gone since (an
        adapter set long ago) is dropped with a warning, rather than stopping the start-up of every job's server;
        only the queued jobs that name it fail, when they start, saying it is not loaded."""
        missing = {}
        for spec in operation.specs:
            try:
                self.engine.lora(SetLora(specs=(spec,), merge_mode="dynamic", target=operation.target))
            except Exception as exc:  # noqa: BLE001 - any failure to load it drops this adapter only
                missing[spec.nickname] = f"{type(exc).__name__}: {exc}"
        if missing:
            logger.warning("LoRA adapters loaded before the restart but not active could not be loaded again, and are "
                           "dropped (queued jobs naming them will fail): %s", missing)
            state.forget(set(missing))
            self.store.set_lora_state(state.to_json())

    def start(self) -> None:
        self._restore_loras()
        requeued, cancelled, died_twice = self.store.recover_interrupted()
        for job in requeued:
            logger.warning("job %s was running when the server stopped; re-queued (attempt %d)", job.id,
                           job.attempts + 1)
        for job in cancelled:
            logger.warning("job %s was being cancelled when the server stopped; marked cancelled", job.id)
            self.artifacts.remove(list(job.upload_files))
        for job in died_twice:
            # Failed here, not by the store's recovery, so that its video.failed (its client waits on it as for any
            # failure) is kept in the same transaction, with the same fallback on a full disk.
            failed = self.outcomes.end(job.id, (JobStatus.IN_PROGRESS,), VIDEO_FAILED, status=JobStatus.FAILED,
                                       error_code="server_restarted", error_message=DIED_TWICE,
                                       completed_at=time.time())
            if failed is not None:
                logger.error("job %s failed: the server stopped twice while running it", job.id)
                self.artifacts.remove(list(failed.upload_files))
        self.artifacts.remove_partial_files()
        self.artifacts.remove_orphan_uploads(self.store.upload_files())
        self._thread = threading.Thread(target=self._loop, name="k6serve-dispatcher", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        """Stop dispatching; a running job goes back to `queued` (not counted as an attempt) and is cancelled.

        A job whose cancel was already accepted stays `in_progress` instead: it ends `cancelled` when the engine
        returns, or at the next start-up if the process exits first, and never runs again.
        """
        with self._lock:
            self._stopping = True
            for current in self._running.values():
                job = self.store.get(current.id)
                if job is not None and job.cancel_requested_at is None:
                    requeued = self.store.transition(job.id, (JobStatus.IN_PROGRESS,), status=JobStatus.QUEUED,
                                                     progress=0, started_at=None, attempts=max(0, job.attempts - 1))
                    if requeued is not None:  # not again when stop() runs twice (the lifespan's end, uvicorn's exit)
                        logger.info("job %s was running at the shutdown: back in the queue, it runs again at the "
                                    "next start", job.id)
                if current.id in self._past_last_step:
                    logger.warning("job %s is past its last step: it stops at the next chunk of its video decode, "
                                   "or, if the decode has ended, shutdown waits up to %g s for its MP4", current.id,
                                   timeout)
                current.cancel()
            pending, self._pending_loras = self._pending_loras, []
            self._wake.notify_all()
        for lora in pending:
            if lora.future.set_running_or_notify_cancel():
                lora.future.set_exception(ServerShuttingDown("LoRA operation"))
        deadline = time.monotonic() + timeout
        if self._thread is not None:
            self._join(self._thread, deadline)
        self.wait_for_outcomes(max(0.0, deadline - time.monotonic()))

    def wait_for_outcomes(self, timeout: float, *, forced_too: bool = False) -> None:
        """Wait up to `timeout` s for the running jobs' outcomes to be recorded: the server calls it again after the
        engine's shutdown, whose end of the ranks ends a job that outlived stop()'s wait, before closing the job
        store (a late outcome met a closed store: sqlite3.ProgrammingError in the log); `forced_too`: even after
        `stop_waiting`."""
        deadline = time.monotonic() + timeout
        for finisher in list(self._finishers):
            self._join(finisher, deadline, forced_too=forced_too)

    def stop_waiting(self) -> None:
        """End stop()'s and wait_for_outcomes()' waits now (a second stop signal: a hung job would hold them)."""
        self._no_more_waiting.set()

    def _join(self, thread: threading.Thread, deadline: float, *, forced_too: bool = False) -> None:
        while thread.is_alive() and (forced_too or not self._no_more_waiting.is_set()):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return
            thread.join(min(remaining, 0.1))

    def admit(self, job: Job) -> tuple[Job, bool]:
        """Store a new job unless the queue is full (QueueFull); idempotent replays (by Idempotency-Key or by a
        client-chosen id) return the stored job."""
        with self._lock:
            keyed = job.idempotency_key is not None and self.store.get_by_idempotency_key(job.idempotency_key)
            if keyed or self.store.id_taken(job.id):
                # Same hash: returns the stored job; else IdempotencyConflict / RequestIdConflict (a deleted job's
                # id included): answered as what it is even when the queue is full, not as "retry later".
                return self.store.insert(job)
            self._check_loras(job)  # before the queue's room: a retry after a 429 would only meet this 400
            queued = self.store.count_queued()
            if queued >= self.max_queued_jobs:
                raise QueueFull(queued)
            stored, created = self.store.insert(job)
            if created:
                self._created_monotonic[stored.id] = time.monotonic()
            self._wake.notify_all()
            return stored, created

    def _check_loras(self, job: Job) -> None:
        """Refuse a job with its own `loras` that the worker would refuse when the job starts (the same checks, in
        its order): one naming an adapter the worker will not hold then (`LorasNotLoaded`), and one ({}, the base
        model, included) while the server's adapters will be merged then (`LorasMerged`). Judged on the adapters
        held now and what the LoRA operations taken before the job (they run first, see the module docstring) will
        do, with the worker's rules (`Adapters.after`: "auto" is the server's --lora-merge-mode, merge unless under
        FSDP). Called under `_lock`, which `submit_lora` and the dispatcher's pick hold too.

        Not decided here, so such a job still fails when it starts: a queued operation counts as succeeding unless
        the worker refuses it for sure, but one may fail yet (a missing or damaged file, memory): a set_lora that
        fails loads no adapters, and one meant to switch merged adapters to dynamic (or an unmerge) leaves them
        merged; one dropped after this check (a shutdown, or its HTTP client gone) does nothing either; and with dp
        replicas that disagree (`ReplicasDisagree`) a nickname counts as held and the adapters as unmerged. The
        other way round, a job refused because a queued operation merges the adapters would have run had that
        operation failed: the client asked for that merge, and is told why.
        """
        requested = job.params.get("loras")
        if requested and (quantization := _quantization(self.engine)) != "none":
            # ({} asks for the base model, which is all a quantized DiT runs: the worker runs it as without loras.)
            raise LorasQuantized("loras names LoRA adapters, but " + quantized_lora_refusal(
                quantization, subject="this server's DiT", fix="Drop loras; the job was not created."))
        if requested is None or self._lora_state is None:
            return
        queued = [pending.operation for pending in [self._applying_lora, *self._pending_loras]
                  if pending is not None and not pending.future.cancelled()]
        now, then = self._lora_state.now, self._lora_state.after(queued)
        found = then.loaded | self._loaded_somewhere
        unknown = [nickname for nickname in requested if nickname not in found]
        if unknown:
            raise LorasNotLoaded(not_loaded_message(unknown, now.loaded, then.loaded - now.loaded))
        if then.mode == "merge":
            raise LorasMerged(merged_message(requested, then, merged_now=then == now))

    def submit_lora(self, operation: LoraOperation) -> Future:
        """Queue a LoRA operation behind the jobs queued or running now; the future holds the worker's dict."""
        if not isinstance(operation, ListLoras) and (quantization := _quantization(self.engine)) != "none":
            # The worker's refusal, before the operation waits behind the queued jobs for it.
            raise ValueError(quantized_lora_refusal(quantization, subject="This server's DiT",
                                                    fix="Restart the server without --quantization to use adapters."))
        with self._lock:
            if self._stopping:
                raise ServerShuttingDown("LoRA operation")
            after = set(self.store.queued_ids()) | set(self._running)
            pending = PendingLora(operation, frozenset(after))
            self._pending_loras.append(pending)
            self._wake.notify_all()
            return pending.future

    def submit_memory(self, operation: MemoryOperation) -> Future:
        """Send a memory release or resume to the engine now (see the module docstring); the future holds its reply."""
        with self._lock:
            if self._stopping:
                raise ServerShuttingDown("memory operation")
            # Under the lock that dispatching holds: every job already handed to the engine is ahead of the release.
            releasing = isinstance(operation, ReleaseMemory)
            self._num_releasing += releasing
            future = self.engine.submit_memory(operation)

        def finished(_: Future) -> None:
            with self._lock:
                self._num_releasing -= releasing
                self._wake.notify_all()

        future.add_done_callback(finished)
        return future

    def holds_queue(self) -> bool:
        """True while the engine's memory is released (or a release is on its way): queued jobs wait for a resume."""
        return self._num_releasing > 0 or self.engine.memory_released

    def queue_is_full(self) -> bool:
        return self.store.count_queued() >= self.max_queued_jobs

    def retry_after_s(self) -> int:
        """A hint for 429 answers: about one job's time over the replicas that run jobs at once, at least 1 s."""
        recent = self.outcomes.recent_durations[-10:]
        return max(1, round(sum(recent) / len(recent) / self._capacity)) if recent else 5

    def poll_after_ms(self) -> int:
        """The `openai-poll-after-ms` hint on an unfinished job: a twentieth of a recent job's time, 0.5-10 s (1 s,
        the OpenAI SDK's own default, before any finished). The SDK's `poll` / `create_and_poll` read it at the first
        poll and keep it, so a job is seen finished within about 5% of its time, without a poll a second through
        a ten-minute job."""
        recent = self.outcomes.recent_durations[-10:]
        if not recent:
            return 1000
        return min(10_000, max(500, round(sum(recent) / len(recent) * 1000 / 20)))

    def cancel(self, job_id: str) -> Job | None:
        """Cancel a queued job now, or ask the engine to stop a running one at its next step (or decode chunk)
        boundary."""
        with self._lock:
            job = self.store.get(job_id)
            if job is None:
                return None
            if job.status == JobStatus.QUEUED:
                cancelled = self.store.transition(
                    job_id, (JobStatus.QUEUED,), status=JobStatus.CANCELLED, completed_at=time.time(),
                    error_code="cancelled", error_message="Cancelled by the client before it started.")
                if cancelled is not None:
                    self._created_monotonic.pop(job_id, None)
                    logger.info("job %s cancelled (cancelled): %s", job_id, cancelled.error_message)
                    self.metrics.finished(JobStatus.CANCELLED)
                    self.artifacts.remove(list(cancelled.upload_files))
                    return cancelled
            elif job.status == JobStatus.IN_PROGRESS and job_id in self._running:
                if job.cancel_requested_at is None:
                    past_last_step = job_id in self._past_last_step
                    self.store.transition(
                        job_id, (JobStatus.IN_PROGRESS,), cancel_requested_at=time.time(),
                        warnings=job.warnings + ((CANCEL_IN_DECODE,) if past_last_step else ()))
                self._running[job_id].cancel()
            return self.store.get(job_id)

    def running_count(self) -> int:
        return len(self._running)

    def seconds_since_progress(self) -> float:
        """Seconds since the running job heard from last (its dispatch, a step, a decode chunk) did so; 0 when none
        runs. Far above a step's time it is a hung worker, which /health cannot see (its processes are alive)."""
        heard = list(self._last_heard.values())
        return max(0.0, time.monotonic() - min(heard)) if heard else 0.0

    def _next(self) -> tuple[Job, EngineJob] | PendingLora | Literal["look again"] | None:
        """The next job (submitted to the engine) or LoRA operation; "look again" after waiting for a change, so
        `_loop` checks the replicas again; None once stopping."""
        with self._lock:
            while not self._stopping:
                if self.holds_queue():
                    self._wake.wait(timeout=1.0)
                    return "look again"
                job = self.store.next_queued()
                if self._pending_loras and (job is None or job.id not in self._pending_loras[0].after):
                    self._applying_lora = self._pending_loras.pop(0)
                    return self._applying_lora
                if job is None or len(self._running) >= self._capacity:
                    self._wake.wait(timeout=1.0)
                    return "look again"
                started = self.store.transition(job.id, (JobStatus.QUEUED,), status=JobStatus.IN_PROGRESS,
                                                started_at=time.time(), attempts=job.attempts + 1, progress=0)
                if started is None:
                    continue
                folder = self.artifacts.unwritable_folder(uploads=False)
                if folder is not None:
                    # Made read-only after the job was created: it could only fail at its MP4, after its whole run
                    # on the GPU (minutes), so it fails now and the next one is looked at.
                    logger.warning("job %s failed before it ran: the output folder %s is not writable", job.id,
                                   folder)
                    self.outcomes.record(started, JobStatus.FAILED, error_code="output_not_writable",
                                         error_message=OUTPUT_NOT_WRITABLE, logged=True)
                    continue
                params = SamplingParams(**started.params)
                try:
                    params = self._inputs_checked_again(started, params)
                except ApiError as refusal:
                    logger.warning("job %s failed before it ran: %s", job.id, refusal.message)
                    self.outcomes.record(started, JobStatus.FAILED, error_code=refusal.code,
                                         error_message=refusal.message, logged=True)
                    continue
                logger.info("job %s started%s", job.id,
                            f" (attempt {started.attempts})" if started.attempts > 1 else "")
                # The job's file already there can only be its own video from an earlier attempt that wrote it and
                # was then cut off (a crash, or a shutdown that outwaited the decode, after which the job was
                # re-queued): no client chooses that name (`output_file_name`). The worker never replaces a file, so
                # clear it before the re-run.
                self.artifacts.remove([self.artifacts.output_path(output_file_name(job.id))])
                # The runner logs each job's end once (`JobOutcomes.record`); the engine's own log of a failure would
                # repeat it with a traceback.
                engine_job = self.engine.submit(params, self.artifacts.output_options(job.id),
                                                on_progress=self._progress_callback(job.id), job_id=job.id,
                                                log_failure=False)
                self._running[job.id] = engine_job
                self._last_heard[job.id] = time.monotonic()
                return started, engine_job
            return None

    def _inputs_checked_again(self, job: Job, params: SamplingParams) -> SamplingParams:
        """`params` with its server-side input paths checked against --allowed-input-dir again, as the job starts:
        a job waits in the queue for minutes (and across a restart with other folders), in which a checked file or
        folder could be swapped for a link out of the allowed folders; checked now, the worker opens it a moment
        later (whoever can write into an allowed folder can still race that moment: docs/http-api.md). An ApiError
        (`path_not_allowed`, `invalid_path`) says what changed."""
        if self.inputs is None:
            return params
        try:
            return self.inputs.checked_params(params, uploaded=job.upload_files)
        except ApiError as error:
            raise ApiError(error.status, f"{error.param} passed the input check when the job was created but not "
                                         f"when it started: {error.message}", code=error.code,
                           param=error.param) from None

    def _loop(self) -> None:
        failing = False
        while True:
            try:
                if not self._dispatch_once():
                    return
                failing = False
            except Exception:  # noqa: BLE001 - e.g. the job store refusing a write on a full disk
                # The dispatcher alone starts jobs: had it ended here, every later job would stay queued until a
                # restart while /health said ok. It tries again until the write goes through.
                if not failing:
                    logger.exception("dispatching the next job failed; retrying every %g s", STORE_RETRY_S)
                failing = True
                if self._pause(STORE_RETRY_S):
                    return

    def _dispatch_once(self) -> bool:
        """Start the next job or LoRA operation, or wait for a change; False once stopping."""
        if len(self.engine.dead_replicas()) >= self._capacity:
            # Every replica has died: a job started now could only fail. Queued jobs stay queued, so the restart
            # the server now asks for (GET /health) runs them. Checked outside the lock: finding a death stops
            # the rest of that replica's ranks, which can take a second or two.
            return not self._pause(1.0)
        picked = self._next()
        if picked is None:
            return False
        if picked == "look again":
            return True
        if isinstance(picked, PendingLora):
            self._run_lora(picked)
            return True
        job, engine_job = picked
        # The dispatcher goes back to the queue at once; a finisher thread waits for this job. With one
        # replica the next job still waits for this one's finisher (`_capacity`), as before.
        finisher = threading.Thread(target=self._finish_and_release, args=(job, engine_job),
                                    name=f"k6serve-job-{job.id}", daemon=True)
        with self._lock:
            self._finishers = [thread for thread in self._finishers if thread.is_alive()] + [finisher]
        finisher.start()
        return True

    def _pause(self, seconds: float) -> bool:
        """Wait up to `seconds` (less on any change, e.g. stop()); True once stopping."""
        with self._lock:
            if not self._stopping:
                self._wake.wait(timeout=seconds)
            return self._stopping

    def _finish_and_release(self, job: Job, engine_job: EngineJob) -> None:
        try:
            for attempt in itertools.count():
                try:
                    self._finish(job, engine_job)
                    break
                except STORE_WRITE_ERRORS:
                    # E.g. a full disk. The job keeps its replica until its outcome is written, rather than staying
                    # in_progress for good, and no later job starts whose outcome could not be written either.
                    if attempt == 0:
                        logger.exception("recording the outcome of job %s failed; retrying every %g s", job.id,
                                         STORE_RETRY_S)
                    if self._pause(STORE_RETRY_S):
                        break  # stopping: the job store re-queues it at the next start
        except Exception:  # a bookkeeping bug must not stop the server serving later jobs
            logger.exception("recording the outcome of job %s failed", job.id)
        finally:
            with self._lock:
                self._running.pop(job.id, None)
                self._last_heard.pop(job.id, None)
                self._past_last_step.discard(job.id)
                self._in_decode.discard(job.id)
                self._wake.notify_all()

    def _run_lora(self, pending: PendingLora) -> None:
        try:
            if not pending.future.set_running_or_notify_cancel():
                return
            try:
                result = self.engine.lora(pending.operation)
                # Saved before the client hears of it: a job created after this answer runs with these adapters,
                # after a restart too. Under the lock: `_check_loras` reads the state.
                with self._lock:
                    if isinstance(pending.operation, UnloadLora):  # held by no replica any more
                        self._loaded_somewhere -= set(pending.operation.nicknames)
                    if self._lora_state is not None and self._lora_state.record(pending.operation):
                        self.store.set_lora_state(self._lora_state.to_json())
            except BaseException as exc:  # noqa: BLE001 (answered to the HTTP client waiting for it)
                if isinstance(exc, ReplicasDisagree):
                    with self._lock:
                        if isinstance(pending.operation, SetLora):
                            self._loaded_somewhere.update(spec.nickname for spec in pending.operation.specs)
                        if self._lora_state is not None:
                            self._lora_state.replicas_disagree()
                pending.future.set_exception(exc)
            else:
                pending.future.set_result(result)
        finally:
            with self._lock:
                self._applying_lora = None

    def _progress_callback(self, job_id: str):
        state = {"last": time.perf_counter(), "progress": 0, "final_step_seen": False, "previous_step": 0}

        def on_progress(step: int, total: int) -> None:
            now = time.perf_counter()
            if job_id in self._last_heard:  # a plain store: read without the lock by `seconds_since_progress`
                self._last_heard[job_id] = time.monotonic()
            decode_chunk = 0 < total <= step and state["final_step_seen"]  # the final step reported again
            # A step's time is from the step before it: the first step's, since dispatch or since a report of step 0
            # (the cancellation points of a warm-up or of the prompt's rewrite), holds the text encoding, the
            # conditioning and a first compile (0.25 s against 0.01 s a step on the demo).
            if step > 0 and not decode_chunk and state["previous_step"] > 0:
                self.metrics.step_latency.observe(now - state["last"])
            state["last"], state["previous_step"] = now, step
            if 0 < total <= step:
                state["final_step_seen"] = True
                self._past_last_step.add(job_id)
            if decode_chunk:
                self._in_decode.add(job_id)
            progress = min(99, int(100 * step / total)) if total > 0 else 0
            if progress != state["progress"]:
                try:
                    self.store.transition(job_id, (JobStatus.IN_PROGRESS,), progress=progress)
                except STORE_WRITE_ERRORS as exc:
                    # Progress is advisory: a write refused now (a full disk) must not fail the job; the next step
                    # tries again.
                    logger.warning("could not record the progress of job %s: %s", job_id, exc)
                    return
                state["progress"] = progress

        return on_progress

    def _finish(self, job: Job, engine_job: EngineJob) -> None:
        try:
            result: VideoResult = engine_job.future.result()
        except BaseException as exc:
            if self._stopping and not isinstance(exc, ValueError):
                if not self._cancel_requested(job.id):
                    # stop() already put it back in the queue. A failure now is the shutdown's doing (its cancel, or
                    # a worker killed or hung as the server stops: `worker_died`), not the job's: it was recorded
                    # failed after the log had said "back in the queue".
                    logger.info("job %s ended as the server stopped (%s): left in the queue, it runs again at the "
                                "next start", job.id, type(exc).__name__)
                    return
                if not isinstance(exc, (RequestCancelled, CancelledError)):
                    # The client's cancel was accepted, then the shutdown ended the ranks inside a step: it ends as
                    # the next start would end it, not failed (generation_failed, a traceback, video.failed).
                    self.outcomes.record(job, JobStatus.CANCELLED, error_code="cancelled",
                                         error_message=CANCELLED_AT_SHUTDOWN)
                    return
            self.outcomes.record_failure(job, exc)
        else:
            with self._lock:  # so a cancel cannot land between this check and the job becoming completed
                if self._cancel_requested(job.id):
                    # The cancel came after the decode's last chunk: only the MP4's tail was left; it ran to the end.
                    self.artifacts.remove([result.output_file_path] if result.output_file_path else [])
                    self.outcomes.record(job, JobStatus.CANCELLED, error_code="cancelled",
                                         error_message=CANCELLED_AFTER_DECODE)
                else:
                    self.outcomes.record_success(job, result)

    def _cancel_requested(self, job_id: str) -> bool:
        job = self.store.get(job_id)
        return job is not None and job.cancel_requested_at is not None
