"""Finished jobs past their `expires_at` (`jobs.expires_at`, `--output-ttl`), deleted with their files: by the
periodic sweep (`app._sweep_expired`), before a listing, and by any route that meets one before the sweep does."""

from __future__ import annotations

import time

from k6serve.serve.artifacts import ArtifactStore, output_file_name
from k6serve.serve.jobs import Job, JobStore, expires_at, is_expired
from k6serve.serve.server_context import ServerContext


def forget_job(store: JobStore, artifacts: ArtifactStore, job: Job, *, gone_at: float | None = None) -> bool:
    """Delete a finished job's record, its video and its uploads; False if it was already gone. `gone_at`: when
    it ended, its `expires_at` for an expired job (a later request_id conflict counts its age from there, not from
    the sweep that found it; default now)."""
    # Without an output_file, the job's own name may still hold a video an interrupted attempt wrote before the job
    # was re-queued and then cancelled (no client can name that file: `output_file_name`).
    video = artifacts.output_path(job.output_file or output_file_name(job.id))
    # The files go first: on a full disk the job store cannot write until some space is free, and deleting finished
    # jobs is how a client frees it. A record left by a failed delete answers content_missing until deleted again.
    artifacts.remove([video, *job.upload_files])
    return store.delete(job.id, now=gone_at)


def sweep_expired_once(store: JobStore, artifacts: ArtifactStore, ttl_s: float, now: float | None = None) -> int:
    """Delete every job past its `expires_at` (see `jobs.expires_at`), with its files; how many were deleted."""
    now = time.time() if now is None else now
    # expires_at <= now implies completed_at < now + 1 - ttl: a superset, which is_expired narrows.
    candidates = store.finished_before(now + 1 - ttl_s)
    return sum(forget_job(store, artifacts, job, gone_at=expires_at(job, ttl_s)) for job in candidates
               if is_expired(job, ttl_s, now))


def sweep_expired(ctx: ServerContext) -> int | None:
    """`sweep_expired_once` unless a sweep is already running (then None: that one does the work)."""
    if not ctx.sweep_lock.acquire(blocking=False):
        return None
    try:
        return sweep_expired_once(ctx.store, ctx.artifacts, ctx.settings.output_ttl_s)
    finally:
        ctx.sweep_lock.release()


def live_job(ctx: ServerContext, job: Job | None) -> Job | None:
    """`job`, or None once it is past its `expires_at`: the sweep runs only every `cleanup_interval_s`, so an
    expired job met in between is deleted here, and every route answers as after the sweep."""
    if job is not None and is_expired(job, ctx.settings.output_ttl_s, time.time()):
        forget_job(ctx.store, ctx.artifacts, job, gone_at=expires_at(job, ctx.settings.output_ttl_s))
        return None
    return job
