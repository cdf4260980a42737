"""How a job's end is recorded, by `JobOutcomes`, which the `JobRunner` owns and calls once it knows how a job
ended: stored with its webhook event in one transaction, counted in the metrics, logged once, its uploads removed;
a failure worded for the client (and, where only the operator can act, for the log too). Also the words of a
cancelled job and of an unwritable output folder, and the server's upload paths taken out of what a client reads.
"""

from __future__ import annotations

import errno
import logging
import os
import time
from concurrent.futures import CancelledError
from pathlib import Path
from typing import cast

from k6serve.dependencies import describe_missing_package, missing_package
from k6serve.request import VideoResult
from k6serve.runtime.engine import Engine, RequestCancelled
from k6serve.runtime.out_of_memory import (WorkerKilled, is_host_out_of_memory, is_out_of_memory,
                                           out_of_memory_detail, server_side_fixes)
from k6serve.serve.artifacts import ArtifactStore
from k6serve.serve.errors import client_words, disk_full, write_refused
from k6serve.serve.jobs import STORE_WRITE_ERRORS, Job, JobStatus, JobStore, kept_upload, seconds_text, size_text
from k6serve.serve.metrics import ServerMetrics, stage_seconds
from k6serve.serve.webhook_sender import VIDEO_COMPLETED, VIDEO_FAILED, WebhookSender

# The runner's name: a job's start and its end are logged under one name, as they always were (log filters, the
# saved server logs in docs/benchmarks/).
logger = logging.getLogger("k6serve.serve.runner")

CANCEL_IN_DECODE = (
    "A cancel was requested after the last denoising step, during the video decode: the engine stops at the next "
    "decoded chunk. If the decode had already ended, the job stays in_progress while its MP4 is finished, which "
    "cannot stop midway, then it is cancelled and its video discarded."
)
CANCELLED_IN_DECODE = (
    "Cancelled by the client during the video decode; the engine stopped between two decoded chunks and kept no video."
)
CANCELLED_AFTER_DECODE = (
    "Cancelled by the client after the video decode, while the MP4 was being finished, which cannot stop midway; the "
    "engine finished it and the video was discarded."
)
CANCELLED_AT_STEP = "Cancelled by the client while running; the engine stopped at a step boundary."

OUTPUT_NOT_WRITABLE = ("The server could not write this job's video: its output folder (--output-path) was "
                       "removed, made read-only, or its permissions changed, after the server started, so the video "
                       "was not kept; submit the job again (a removed folder is created again for it; one made "
                       "unwritable must first be made writable again by the server's operator).")


class JobOutcomes:
    """Records a job's end for the runner: `record` (failed or cancelled), `record_success`, `record_failure` (by the
    engine's error) and `end` (the store's transition with the webhook event). The runner decides when a job ends
    (dispatch, cancel, stop, the engine's answer); this keeps what a client and the metrics then read."""

    def __init__(self, engine: Engine, store: JobStore, artifacts: ArtifactStore, metrics: ServerMetrics, *,
                 created_monotonic: dict[str, float], in_decode: set[str]) -> None:
        self.engine = engine
        self.store = store
        self.artifacts = artifacts
        self.metrics = metrics
        self.webhooks: WebhookSender | None = None  # --webhook-url: told of each completed or failed job
        # Job id -> time.monotonic() at its creation, for the latency metric: the runner's own dict, shared (it adds
        # a job at its admission and drops one cancelled before it started); an end recorded here drops the job.
        self._created_monotonic = created_monotonic
        self._in_decode = in_decode  # the runner's: running jobs whose engine reported a decode chunk
        self.recent_durations: list[float] = []  # the last ten completed jobs' run times, for the runner's hints

    def _memory_fixes(self) -> str:
        runtime = getattr(getattr(self.engine, "config", None), "runtime", None)
        return server_side_fixes(getattr(runtime, "performance_mode", "speed"),
                                 offloaded=bool(getattr(runtime, "offloads", False)))

    def record_failure(self, job: Job, error: BaseException) -> None:
        """End `job` by the engine's `error`: cancelled, failed on its input, or failed for a reason the client is
        told in words (memory, disk, a dead worker, a missing package), else with the exception's text."""
        try:
            raise error
        except (RequestCancelled, CancelledError):
            message = CANCELLED_IN_DECODE if job.id in self._in_decode else CANCELLED_AT_STEP
            self.record(job, JobStatus.CANCELLED, error_code="cancelled", error_message=message)
        except ValueError as exc:
            self.record(job, JobStatus.FAILED, error_code="invalid_request", error_message=str(exc))
        except Exception as exc:  # noqa: BLE001 - any engine failure belongs to this job only
            if is_out_of_memory(exc):
                # The request was too big for this server's GPU (or host), not broken: say so and what a retry can
                # change; the operator's log gets what the server's flags can change.
                host = is_host_out_of_memory(exc)
                where = "server's host" if host else "GPU"
                logger.warning("job %s ran out of %s memory; for such requests, %s", job.id,
                               "host" if host else "GPU",
                               "free host memory or run on a machine with more" if host else self._memory_fixes())
                self.record(job, JobStatus.FAILED, error_code="out_of_memory",
                            error_message=f"The {where} ran out of memory for this request "
                                          f"({out_of_memory_detail(exc)}); retry with a smaller size or fewer "
                                          "seconds.", logged=True)
            elif disk_full(exc):
                # The machine's state, not the request's: say so, without the server's own file paths.
                self.record(job, JobStatus.FAILED, error_code="insufficient_storage",
                            error_message="The server's disk was full when this job's video was written, so it was "
                                          "not kept; submit the job again once space is free (deleting finished "
                                          "jobs frees their videos).")
            elif self._output_write_refused(exc):
                logger.warning("job %s failed: its video could not be written (%s)", job.id, exc)
                self.record(job, JobStatus.FAILED, error_code="output_not_writable",
                            error_message=OUTPUT_NOT_WRITABLE, logged=True)
            elif isinstance(exc, WorkerKilled):
                # The machine failed the run (the out-of-memory killer, a crash in native code): the client is
                # told that and that a retry may run; the operator's log gets the ranks, exit codes and host fixes.
                logger.error("job %s failed: %s", job.id, exc)
                self.record(job, JobStatus.FAILED, error_code="worker_died",
                            error_message="The server's worker process running this job was killed (the host ran "
                                          "out of memory, or a crash; the server's log says which) and the job did "
                                          "not finish. Submit it again: it runs on a replica still serving, or is "
                                          "refused with engine_unavailable if none is left.", logged=True)
            elif missing_package(exc):
                # The server's environment, not the request: the client is told which package, the operator's log
                # also gets the pip command for the server's interpreter (a path the client need not see).
                module = cast(str, exc.name)  # set, or missing_package is false
                logger.error("job %s failed: %s", job.id, describe_missing_package(module))
                top = module.partition(".")[0]
                self.record(job, JobStatus.FAILED, error_code="generation_failed",
                            error_message=f"The server cannot run this job: the Python package that provides "
                                          f"{top!r} is not installed in its environment. The server's operator "
                                          "must install it (the server's log has the pip command); then submit "
                                          "the job again.", logged=True)
            else:
                # Unexpected: the one failure logged with its traceback.
                logger.error("job %s failed", job.id, exc_info=exc)
                self.record(job, JobStatus.FAILED, error_code="generation_failed",
                            error_message=client_words(exc), logged=True)

    def _output_write_refused(self, exc: BaseException) -> bool:
        """The engine's error is a write into the output folder refused by permissions or a read-only mount, or
        failed because the folder was removed (the MP4; an input the worker could not read is not this)."""
        filename = getattr(exc, "filename", None)
        # ENOENT: the folder itself was removed (the MP4 writer's FileNotFoundError; this was a ValueError answered
        # as the client's invalid_request, with the server's path).
        removed = isinstance(exc, OSError) and exc.errno == errno.ENOENT
        if not (write_refused(exc) or removed) or filename is None:
            return False
        return Path(os.fsdecode(filename)).parent == self.artifacts.root

    def record(self, job: Job, status: JobStatus, *, logged: bool = False, **fields) -> None:
        """End `job` as `status` (failed or cancelled) with `fields`; one log line says so, unless the caller
        `logged` its own (with what only the operator should read: pip commands, host fixes, a traceback). A job
        that failed on the client's input was in no log before (the engine leaves ValueErrors to the caller)."""
        self._created_monotonic.pop(job.id, None)
        if fields.get("error_message") and job.upload_files:
            fields["error_message"] = without_upload_paths(fields["error_message"], job.upload_files)
        finished = self.end(job.id, (JobStatus.IN_PROGRESS, JobStatus.QUEUED),
                            VIDEO_FAILED if status == JobStatus.FAILED else None, status=status,
                            completed_at=time.time(), **fields)
        if finished is not None:
            if not logged:
                level = logging.INFO if status == JobStatus.CANCELLED else logging.WARNING
                logger.log(level, "job %s %s (%s): %s", job.id, status.value, fields.get("error_code"),
                           fields.get("error_message"))
            self.metrics.finished(status)
            self.artifacts.remove(list(finished.upload_files))

    def record_success(self, job: Job, result: VideoResult) -> None:
        created = self._created_monotonic.pop(job.id, None)
        if result.output_file_path is None:
            self.record(job, JobStatus.FAILED, error_code="no_output", error_message="The engine wrote no file.")
            return
        completed_at = time.time()
        inference_s = result.timings.get("total", completed_at - (job.started_at or completed_at))
        notes = [n for n in result.notes if n not in job.warnings]
        if result.timings.get("warmup") is not None:
            # The job that paid for a --warmup-mode request warm-up says so: its inference_time_s leaves it out, and
            # nothing else reported its cost over HTTP.
            notes.append(f"this job ran the server's warm-up first (--warmup-mode request): "
                         f"{result.timings['warmup']:.2f} s before its own run, not in inference_time_s")
        finished = self.end(
            job.id, (JobStatus.IN_PROGRESS, JobStatus.QUEUED), VIDEO_COMPLETED, status=JobStatus.COMPLETED,
            progress=100, completed_at=completed_at,
            output_file=self.artifacts.output_path(result.output_file_path).name,
            inference_time_s=round(inference_s, 4), peak_memory_mb=round(result.peak_memory_mb, 1),
            size=size_text(result.height, result.width), seconds=seconds_text(result.num_frames, result.fps),
            warnings=job.warnings + tuple(notes), expanded_prompt=result.expanded_prompt,
            stage_seconds=stage_seconds(result.timings),
            sample_aspect_ratio=None if result.sample_aspect_ratio is None else
            f"{result.sample_aspect_ratio.numerator}:{result.sample_aspect_ratio.denominator}",
        )
        if finished is None:
            # Deleted while running: nobody owns the file any more.
            self.artifacts.remove([result.output_file_path])
            return
        stages = ", ".join(f"{stage} {seconds:.2f}" for stage, seconds in finished.stage_seconds.items())
        logger.info("job %s completed in %.1f s (%.1f s from its creation)%s", job.id, inference_s,
                    completed_at - job.created_at, f"; stages (s): {stages}" if stages else "")
        self.metrics.finished(JobStatus.COMPLETED, result.peak_memory_mb)
        # The monotonic clock for a job created in this process: the wall clock stepped back an hour (NTP) made the
        # histogram's sum -3,600, which Prometheus reads as a counter reset. A job from before a restart has only
        # the wall clock: clamped at 0.
        self.metrics.job_latency.observe(time.monotonic() - created if created is not None
                                         else max(0.0, completed_at - job.created_at))
        self.metrics.inference_latency.observe(inference_s)
        self.metrics.stages(finished.stage_seconds)
        self.recent_durations = (self.recent_durations + [inference_s])[-10:]
        self.artifacts.remove([path for path in finished.upload_files if path != kept_upload(finished)])

    def end(self, job_id: str, allowed: tuple[JobStatus, ...], event_type: str | None, **fields) -> Job | None:
        """Store a job's end (`transition` with `fields`, which set `completed_at`) and, with `event_type` and
        --webhook-url, its webhook event's rows in the same transaction, then schedule the event: a crash keeps both
        or neither. Rows the store cannot take (a full disk) do not keep the job's end from being stored: it is
        stored without them and the event sent from memory, with a warning."""
        if self.webhooks is None or event_type is None:
            return self.store.transition(job_id, allowed, **fields)
        event = self.webhooks.new_event(event_type, job_id, fields["completed_at"])
        rows = self.webhooks.outbox_event(event)
        store_error = None
        try:
            finished = self.store.transition(job_id, allowed, webhook_event=rows, **fields)
        except STORE_WRITE_ERRORS as exc:
            if rows is None:
                raise
            store_error = exc
            # A write error again propagates: the finisher retries the job's end with a new event (this one was not
            # scheduled); at start-up (a job that died twice) the start fails, as the store's recovery did before.
            finished = self.store.transition(job_id, allowed, **fields)
        if finished is not None:
            self.webhooks.schedule(event, store_error)
        return finished


UPLOADED_FILE = "(the uploaded file)"


def without_upload_paths(message: str, upload_files: tuple[str, ...]) -> str:
    """`message` with the server's own paths of the job's uploads replaced by `UPLOADED_FILE`.

    The worker's errors name the files they could not read (an image that decodes at creation but whose values the
    worker refuses, e.g. a float TIFF holding NaN), and an upload's path is the server's, not the client's: it told
    the client nothing and showed where the server keeps its files.
    """
    for path in upload_files:
        message = message.replace(repr(str(path)), UPLOADED_FILE).replace(str(path), UPLOADED_FILE)
    return message
