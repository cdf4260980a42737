"""Video jobs: the typed `Job`, its `JobStatus`, and the embedded SQLite store that survives restarts.

One connection, guarded by a lock, serves the event loop, the dispatcher thread and the engine's progress
callback; WAL keeps readers from blocking the writer. Every status change is a compare-and-set
(`transition`), so a cancel and the dispatcher can never both win.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import json
import math
import os
import sqlite3
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, TextIO

try:
    import fcntl
except ImportError:  # not on Windows: the store is then unguarded, as before
    fcntl = None  # type: ignore[assignment]  # the checker reads the POSIX branch; callers test for None


class JobStatus(str, enum.Enum):
    """The OpenAI video-job status values."""

    QUEUED = "queued"
    IN_PROGRESS = "in_progress"
    COMPLETED = "completed"
    FAILED = "failed"
    CANCELLED = "cancelled"

    @property
    def is_terminal(self) -> bool:
        return self in (JobStatus.COMPLETED, JobStatus.FAILED, JobStatus.CANCELLED)


TERMINAL = (JobStatus.COMPLETED, JobStatus.FAILED, JobStatus.CANCELLED)

# A job that was running when the server died is re-queued once; dying on it again fails it.
MAX_ATTEMPTS = 2
# A running job whose cancel was accepted, ended by a stop of the server rather than by the engine.
CANCELLED_AT_SHUTDOWN = "Cancelled by the client while running; the server stopped before the engine did."

# How long a deleted (or expired) job's place in the creation order is remembered, so a client paging with
# `after=<its id>` continues where it was instead of getting a 400 because the job expired between two pages.
DELETED_CURSOR_RETENTION_S = 7 * 86400

# What the store raises when a write cannot be made now, e.g. on a full disk ("database or disk is full"): a
# condition of the machine that passes, not of the job, so the runner retries such a write.
STORE_WRITE_ERRORS = (sqlite3.OperationalError, OSError)


def size_text(height: int, width: int) -> str:
    """A job's `size`: OpenAI's "WxH", width first."""
    return f"{width}x{height}"


def seconds_text(num_frames: int, fps: float) -> str:
    """A job's `seconds`, as a string as OpenAI's; one rule for the value at creation and the finished job's."""
    return f"{num_frames / fps:g}"


@dataclass(frozen=True, kw_only=True, slots=True)
class Job:
    id: str
    model: str
    status: JobStatus = JobStatus.QUEUED
    progress: int = 0  # 0-100
    created_at: float
    started_at: float | None = None
    completed_at: float | None = None  # set for every terminal status
    params: dict[str, Any] = field(default_factory=dict)  # SamplingParams fields (server-side paths)
    size: str | None = None  # "WxH", width first
    seconds: str | None = None
    error_code: str | None = None
    error_message: str | None = None
    inference_time_s: float | None = None
    peak_memory_mb: float | None = None
    output_file: str | None = None  # file name inside the artifact folder
    # Uploaded inputs owned by this job: deleted when it ends, but for a completed job's reference image
    # (`kept_upload`), deleted with the job.
    upload_files: tuple[str, ...] = ()
    idempotency_key: str | None = None
    request_hash: str | None = None
    attempts: int = 0  # how many times a worker started it
    warnings: tuple[str, ...] = ()
    # Set when a DELETE asked to cancel it while running: a job that finishes anyway (the cancel came after the
    # engine's last step boundary) ends cancelled, and neither a shutdown nor a restart re-queues it.
    cancel_requested_at: float | None = None
    expanded_prompt: str | None = None  # expand_prompts: the prompt as the text encoder rewrote it
    # Once completed: the seconds of each stage the engine ran (metrics.STAGES among its timings), in run order.
    stage_seconds: dict[str, float] = field(default_factory=dict)
    # Once completed, super-resolution of a source with non-square pixels: their width over height, "N:M" as FFmpeg
    # writes it (the MP4 is tagged with it); None for square pixels. `size` is the stored frames' WxH.
    sample_aspect_ratio: str | None = None
    # A remix (POST /v1/videos/{id}/remix): the job whose settings and seed it took, with a new prompt.
    remixed_from_video_id: str | None = None


def kept_upload(job: Job) -> str | None:
    """The upload a completed job keeps until the job itself is deleted or expires: its uploaded reference image
    (`input_reference` on a generation server), which a remix of it runs with again (OpenAI's remix takes any
    completed video, an image-to-video one included). Everything else uploaded (a super-resolution source, up to
    --max-upload-mb of video that no remix reads) is deleted when the job ends, as is every upload of a job that
    failed or was cancelled."""
    image = job.params.get("image_path")
    return image if image in job.upload_files else None


def expires_at(job: Job, ttl_s: float) -> int | None:
    """The Unix second from which a finished job reads as gone, as the job object shows it: its `completed_at` in
    whole seconds (as shown) + --output-ttl, rounded up to a whole second, so `expires_at - completed_at` is the TTL
    when it is whole (and the TTL rounded up otherwise); the job may thus go up to a second before
    `completed_at + ttl` exactly. None while it is unfinished or when finished jobs are kept (`ttl_s`
    0). The routes treat a job past it as deleted even before the periodic sweep removes it."""
    if job.completed_at is None or ttl_s <= 0:
        return None
    return math.ceil(int(job.completed_at) + ttl_s)


def is_expired(job: Job, ttl_s: float, now: float) -> bool:
    expiry = expires_at(job, ttl_s)
    return expiry is not None and now >= expiry


# The TTL sweep's query, on the completed_at index: left to choose, SQLite took the status index (reading and sorting
# every finished job) or a scan of the whole table in seq order; the index gives only the jobs old enough.
FINISHED_BEFORE_SQL = (f"SELECT * FROM jobs INDEXED BY jobs_completed WHERE status IN "
                       f"({', '.join('?' for _ in TERMINAL)}) AND completed_at < ? ORDER BY seq")
_JSON_FIELDS = {"params", "upload_files", "warnings", "stage_seconds"}
_JSON_OBJECTS = {"params", "stage_seconds"}  # JSON fields that are objects (dicts); the others are tuples
_COLUMNS = [f.name for f in dataclasses.fields(Job)]


@dataclass(frozen=True, slots=True)
class PendingWebhook:
    """A webhook event not yet delivered to one URL (a `webhook_outbox` row): what a restart sends again."""

    event_id: str
    url: str
    event_type: str
    video_id: str
    created_at: int  # the event's, as its body shows it
    queued_at: float  # when the server first queued it


@dataclass(frozen=True, slots=True)
class OutboxEvent:
    """A webhook event for `transition` to keep with the job's end that caused it: a `webhook_outbox` row per URL."""

    event_id: str
    event_type: str
    video_id: str
    created_at: int  # the event's, as its body shows it
    urls: tuple[str, ...]


class IdempotencyConflict(Exception):
    """The Idempotency-Key was used before with a different request body."""

    def __init__(self, existing: Job) -> None:
        super().__init__(existing.id)
        self.existing = existing


class RequestIdConflict(Exception):
    """A client-chosen job id (`request_id`) names a stored job created with a different request body (`existing`),
    or a job deleted less than DELETED_CURSOR_RETENTION_S ago (`deleted_at`): its id still marks a place in the
    listing order, so it is not given to another job until then."""

    def __init__(self, job_id: str, *, existing: Job | None = None, deleted_at: float | None = None) -> None:
        super().__init__(job_id)
        self.job_id = job_id
        self.existing = existing
        self.deleted_at = deleted_at


class JobStore(Protocol):
    def insert(self, job: Job) -> tuple[Job, bool]: ...
    def get(self, job_id: str) -> Job | None: ...
    def id_taken(self, job_id: str) -> bool: ...
    def get_by_idempotency_key(self, key: str) -> Job | None: ...
    def list_page(self, *, after: str | None, limit: int, ascending: bool) -> tuple[list[Job], bool]: ...
    def update(self, job_id: str, **fields: Any) -> Job | None: ...
    def transition(self, job_id: str, allowed: tuple[JobStatus, ...], *,
                   webhook_event: OutboxEvent | None = None, **fields: Any) -> Job | None: ...
    def delete(self, job_id: str, now: float | None = None) -> bool: ...
    def next_queued(self) -> Job | None: ...
    def queued_ids(self) -> list[str]: ...
    def count_by_status(self) -> dict[JobStatus, int]: ...
    def count_queued(self) -> int: ...
    def finished_before(self, timestamp: float) -> list[Job]: ...
    def recover_interrupted(self) -> tuple[list[Job], list[Job], list[Job]]: ...
    def upload_files(self) -> set[str]: ...
    def lora_state(self) -> list[dict[str, Any]]: ...
    def set_lora_state(self, operations: list[dict[str, Any]]) -> None: ...
    def add_webhook_event(self, event_id: str, event_type: str, video_id: str, created_at: int,
                          urls: Iterable[str], queued_at: float | None = None) -> None: ...
    def remove_webhook_event(self, event_id: str, url: str) -> None: ...
    def remove_webhook_events(self, rows: Iterable[tuple[str, str]]) -> None: ...
    def pending_webhook_events(self) -> list[PendingWebhook]: ...
    def close(self) -> None: ...


def hold_exclusively(lock_path: Path, refusal: str) -> TextIO:
    """An exclusive lock on `lock_path` for as long as the returned file stays open (the kernel frees it when the
    process ends, however it ends); held by another process, ValueError(`refusal` with its `{holder}` process id)."""
    owner = open(lock_path, "a+")  # noqa: SIM115 - held open while the lock is
    if fcntl is None:
        return owner
    try:
        fcntl.flock(owner, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        owner.seek(0)
        holder = owner.read().strip() or "unknown"
        owner.close()
        raise ValueError(refusal.format(holder=holder)) from None
    except OSError:  # a file system without flock (some network ones): unguarded, as before
        return owner
    owner.truncate(0)
    owner.write(str(os.getpid()))
    owner.flush()
    return owner


def _own(path: Path) -> TextIO:
    """One server per job store: a second `k6serve serve` started in the same folder (say, super-resolution beside
    generation, both on the default outputs/jobs.sqlite3) re-queued the first one's running job as if its server had
    died, and ran its queued jobs on the other model, failing them."""
    return hold_exclusively(path.with_name(path.name + ".lock"),
                            f"the job store {str(path)!r} is in use by another k6serve server (process {{holder}}); "
                            "stop that one, or give this one its own --output-path (or --job-store).")


class SqliteJobStore:
    """Jobs in one SQLite file, held by one server at a time (`_own`). Safe to share across threads; survives process
    restarts."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._owner = _own(self.path)
        self._lock = threading.Lock()
        if not self.path.exists():
            # Owner-only, as a new file: the store holds every prompt, the webhook URLs with the tokens in their paths
            # and the LoRA paths, and sqlite made it (and its -wal and -shm, which take its mode) readable to every
            # local user (0644). An existing store keeps the mode it was given.
            with contextlib.suppress(FileExistsError):
                os.close(os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
        self._db = sqlite3.connect(str(self.path), check_same_thread=False, isolation_level=None, timeout=30)
        self._db.row_factory = sqlite3.Row
        with self._lock:
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=NORMAL")  # with WAL: durable across process crashes
            self._db.execute(
                """CREATE TABLE IF NOT EXISTS jobs (
                    seq INTEGER PRIMARY KEY AUTOINCREMENT,
                    id TEXT NOT NULL UNIQUE,
                    model TEXT NOT NULL,
                    status TEXT NOT NULL,
                    progress INTEGER NOT NULL,
                    created_at REAL NOT NULL,
                    started_at REAL,
                    completed_at REAL,
                    params TEXT NOT NULL,
                    size TEXT,
                    seconds TEXT,
                    error_code TEXT,
                    error_message TEXT,
                    inference_time_s REAL,
                    peak_memory_mb REAL,
                    output_file TEXT,
                    upload_files TEXT NOT NULL,
                    idempotency_key TEXT UNIQUE,
                    request_hash TEXT,
                    attempts INTEGER NOT NULL,
                    warnings TEXT NOT NULL,
                    cancel_requested_at REAL,
                    expanded_prompt TEXT,
                    stage_seconds TEXT,
                    sample_aspect_ratio TEXT,
                    remixed_from_video_id TEXT
                )"""
            )
            columns = {row["name"] for row in self._db.execute("PRAGMA table_info(jobs)")}
            if "cancel_requested_at" not in columns:  # a store written before cancel requests were kept
                self._db.execute("ALTER TABLE jobs ADD COLUMN cancel_requested_at REAL")
            if "expanded_prompt" not in columns:  # a store written before expand_prompts
                self._db.execute("ALTER TABLE jobs ADD COLUMN expanded_prompt TEXT")
            if "stage_seconds" not in columns:  # a store written before jobs kept their stages (null: none)
                self._db.execute("ALTER TABLE jobs ADD COLUMN stage_seconds TEXT")
            if "sample_aspect_ratio" not in columns:  # a store written before jobs kept it (null: square pixels)
                self._db.execute("ALTER TABLE jobs ADD COLUMN sample_aspect_ratio TEXT")
            if "remixed_from_video_id" not in columns:  # a store written before remixes (null: not one)
                self._db.execute("ALTER TABLE jobs ADD COLUMN remixed_from_video_id TEXT")
            self._db.execute("CREATE INDEX IF NOT EXISTS jobs_status ON jobs (status, seq)")
            # The TTL sweep's candidates (`finished_before`) by index: without it each sweep, run before every
            # listing too, read and sorted every finished job (39 ms a listing at 100k stored jobs).
            self._db.execute("CREATE INDEX IF NOT EXISTS jobs_completed ON jobs (completed_at)")
            # seq is AUTOINCREMENT, so it is never reused: a deleted job's seq still marks a unique place
            # between the live jobs created before and after it.
            self._db.execute(
                "CREATE TABLE IF NOT EXISTS deleted_jobs (id TEXT PRIMARY KEY, seq INTEGER NOT NULL, "
                "deleted_at REAL NOT NULL)"
            )
            self._db.execute("CREATE INDEX IF NOT EXISTS deleted_jobs_at ON deleted_jobs (deleted_at)")
            # One row: the LoRA operations that rebuild the adapters (serve/lora_state.py), as JSON.
            self._db.execute("CREATE TABLE IF NOT EXISTS lora_state (id INTEGER PRIMARY KEY CHECK (id = 1), "
                             "operations TEXT NOT NULL)")
            # Webhook events not yet delivered, one row per event and URL (serve/webhook_outbox.py): a restart, or a
            # start after a crash, sends them again with their own ids.
            self._db.execute("CREATE TABLE IF NOT EXISTS webhook_outbox (event_id TEXT NOT NULL, url TEXT NOT NULL, "
                             "event_type TEXT NOT NULL, video_id TEXT NOT NULL, created_at INTEGER NOT NULL, "
                             "queued_at REAL NOT NULL, PRIMARY KEY (event_id, url))")

    def lora_state(self) -> list[dict[str, Any]]:
        with self._lock:
            row = self._db.execute("SELECT operations FROM lora_state WHERE id = 1").fetchone()
        return json.loads(row["operations"]) if row is not None else []

    def set_lora_state(self, operations: list[dict[str, Any]]) -> None:
        with self._lock:
            self._db.execute("INSERT INTO lora_state (id, operations) VALUES (1, ?) "
                             "ON CONFLICT (id) DO UPDATE SET operations = excluded.operations",
                             (json.dumps(operations, sort_keys=True),))

    def add_webhook_event(self, event_id: str, event_type: str, video_id: str, created_at: int,
                          urls: Iterable[str], queued_at: float | None = None) -> None:
        """Keep an event to deliver to each of `urls` until `remove_webhook_event` says that URL is done with it."""
        event = OutboxEvent(event_id, event_type, video_id, created_at, tuple(urls))
        # One transaction: a crash keeps the event for every URL or for none.
        with self._lock, self._transaction():
            self._add_webhook_rows_locked(event, time.time() if queued_at is None else queued_at)

    def _add_webhook_rows_locked(self, event: OutboxEvent, queued_at: float) -> None:
        rows = [(event.event_id, url, event.event_type, event.video_id, event.created_at, queued_at)
                for url in event.urls]
        self._db.executemany("INSERT OR IGNORE INTO webhook_outbox (event_id, url, event_type, video_id, created_at, "
                             "queued_at) VALUES (?, ?, ?, ?, ?, ?)", rows)

    def remove_webhook_event(self, event_id: str, url: str) -> None:
        with self._lock:
            self._db.execute("DELETE FROM webhook_outbox WHERE event_id = ? AND url = ?", (event_id, url))

    def remove_webhook_events(self, rows: Iterable[tuple[str, str]]) -> None:
        """Remove the (event id, URL) rows in one transaction: a start dropping thousands of them committed (synced
        to disk) once per row."""
        rows = list(rows)
        if not rows:
            return
        with self._lock, self._transaction():
            self._db.executemany("DELETE FROM webhook_outbox WHERE event_id = ? AND url = ?", rows)

    def pending_webhook_events(self) -> list[PendingWebhook]:
        """The kept events in the order they were queued: by rowid, not `queued_at`, which follows the wall clock (a
        clock stepped back would send a later event first)."""
        with self._lock:
            rows = self._db.execute("SELECT * FROM webhook_outbox ORDER BY rowid").fetchall()
        return [PendingWebhook(event_id=row["event_id"], url=row["url"], event_type=row["event_type"],
                               video_id=row["video_id"], created_at=row["created_at"], queued_at=row["queued_at"])
                for row in rows]

    @contextlib.contextmanager
    def _transaction(self) -> Iterator[None]:
        """One write transaction; the caller holds `_lock`. Rolled back on any error, a failed COMMIT's too: SQLite
        may keep the transaction open after one that met a full disk, and every later BEGIN would then fail."""
        self._db.execute("BEGIN IMMEDIATE")
        try:
            yield
            self._db.execute("COMMIT")
        except BaseException:
            if self._db.in_transaction:
                self._db.execute("ROLLBACK")
            raise

    def close(self) -> None:
        with self._lock:
            self._db.close()
        self._owner.close()  # frees the store for the next server

    @staticmethod
    def _encode(name: str, value: Any) -> Any:
        if name in _JSON_FIELDS:
            # Not sorted: the order of a job's `loras` is the order its adapters are stacked in, which changes the
            # output (a DoRA adapter rescales the ones before it).
            return json.dumps(list(value) if isinstance(value, tuple) else value)
        if isinstance(value, JobStatus):
            return value.value
        return value

    @staticmethod
    def _decode(row: sqlite3.Row) -> Job:
        values: dict[str, Any] = {}
        for name in _COLUMNS:
            value = row[name]
            if name in _JSON_FIELDS:
                value = json.loads(value) if value is not None else {}  # null: a row from before its column
                value = value if name in _JSON_OBJECTS else tuple(value)
            elif name == "status":
                value = JobStatus(value)
            values[name] = value
        return Job(**values)

    def _get_locked(self, job_id: str) -> Job | None:
        row = self._db.execute("SELECT * FROM jobs WHERE id = ?", (job_id,)).fetchone()
        return self._decode(row) if row is not None else None

    def insert(self, job: Job) -> tuple[Job, bool]:
        """Insert `job`, or return the job already stored under its idempotency key or its id: (job, created).

        Raises IdempotencyConflict when the key exists with a different request hash, RequestIdConflict when the id
        does (or names a job deleted within DELETED_CURSOR_RETENTION_S). Server-made ids are random, so only a
        client's `request_id` ever meets an existing one.
        """
        with self._lock:
            if job.idempotency_key is not None:
                row = self._db.execute("SELECT * FROM jobs WHERE idempotency_key = ?",
                                       (job.idempotency_key,)).fetchone()
                if row is not None:
                    keyed = self._decode(row)
                    if keyed.request_hash != job.request_hash:
                        raise IdempotencyConflict(keyed)
                    return keyed, False
            existing = self._get_locked(job.id)
            if existing is not None:
                if existing.request_hash != job.request_hash:
                    raise RequestIdConflict(job.id, existing=existing)
                return existing, False
            row = self._deleted_locked(job.id)
            if row is not None:
                raise RequestIdConflict(job.id, deleted_at=row["deleted_at"])
            names = ", ".join(_COLUMNS)
            marks = ", ".join("?" for _ in _COLUMNS)
            self._db.execute(
                f"INSERT INTO jobs ({names}) VALUES ({marks})",
                [self._encode(name, getattr(job, name)) for name in _COLUMNS],
            )
            return job, True

    def get(self, job_id: str) -> Job | None:
        with self._lock:
            return self._get_locked(job_id)

    def id_taken(self, job_id: str) -> bool:
        """A stored job has this id, or one deleted within DELETED_CURSOR_RETENTION_S (`insert` refuses it)."""
        with self._lock:
            return self._get_locked(job_id) is not None or self._deleted_locked(job_id) is not None

    def _deleted_locked(self, job_id: str):
        return self._db.execute("SELECT deleted_at FROM deleted_jobs WHERE id = ? AND deleted_at >= ?",
                                (job_id, time.time() - DELETED_CURSOR_RETENTION_S)).fetchone()

    def get_by_idempotency_key(self, key: str) -> Job | None:
        with self._lock:
            row = self._db.execute("SELECT * FROM jobs WHERE idempotency_key = ?", (key,)).fetchone()
            return self._decode(row) if row is not None else None

    def list_page(self, *, after: str | None, limit: int, ascending: bool) -> tuple[list[Job], bool]:
        """Jobs in creation order after the job `after` (exclusive); returns (page, has_more).

        `after` may name a job deleted in the last DELETED_CURSOR_RETENTION_S: the page continues from its place.
        Raises KeyError if `after` names neither a stored job nor such a deleted one.
        """
        with self._lock:
            where, args = "", []
            if after is not None:
                row = self._db.execute("SELECT seq FROM jobs WHERE id = ?", (after,)).fetchone()
                if row is None:
                    row = self._db.execute("SELECT seq FROM deleted_jobs WHERE id = ? AND deleted_at >= ?",
                                           (after, time.time() - DELETED_CURSOR_RETENTION_S)).fetchone()
                if row is None:
                    raise KeyError(after)
                where, args = ("WHERE seq > ?" if ascending else "WHERE seq < ?"), [row["seq"]]
            order = "ASC" if ascending else "DESC"
            rows = self._db.execute(
                f"SELECT * FROM jobs {where} ORDER BY seq {order} LIMIT ?", [*args, limit + 1]
            ).fetchall()
        jobs = [self._decode(row) for row in rows]
        return jobs[:limit], len(jobs) > limit

    def update(self, job_id: str, **fields: Any) -> Job | None:
        return self.transition(job_id, tuple(JobStatus), **fields)

    def transition(self, job_id: str, allowed: tuple[JobStatus, ...], *,
                   webhook_event: OutboxEvent | None = None, **fields: Any) -> Job | None:
        """Set `fields` only if the job's status is one of `allowed`; returns the new job or None.

        `webhook_event` (the job's end's) goes to `webhook_outbox` in the same transaction, only if the job changed:
        a crash keeps both the job's end and its event, or neither."""
        unknown = set(fields) - set(_COLUMNS) | ({"id"} & set(fields))
        assert not unknown, f"not updatable job fields: {unknown}"
        assignments = ", ".join(f"{name} = ?" for name in fields) or "id = id"
        marks = ", ".join("?" for _ in allowed)
        with self._lock, self._transaction():
            cursor = self._db.execute(
                f"UPDATE jobs SET {assignments} WHERE id = ? AND status IN ({marks})",
                [self._encode(n, v) for n, v in fields.items()] + [job_id] + [s.value for s in allowed],
            )
            if not cursor.rowcount:
                return None
            if webhook_event is not None:
                self._add_webhook_rows_locked(webhook_event, time.time())
            return self._get_locked(job_id)

    def delete(self, job_id: str, now: float | None = None) -> bool:
        """Delete the job, remembering its place in the creation order for `list_page` cursors."""
        now = time.time() if now is None else now
        with self._lock, self._transaction():
            self._db.execute("DELETE FROM deleted_jobs WHERE deleted_at < ?", (now - DELETED_CURSOR_RETENTION_S,))
            self._db.execute("INSERT OR REPLACE INTO deleted_jobs (id, seq, deleted_at) "
                             "SELECT id, seq, ? FROM jobs WHERE id = ?", (now, job_id))
            return self._db.execute("DELETE FROM jobs WHERE id = ?", (job_id,)).rowcount > 0

    def next_queued(self) -> Job | None:
        with self._lock:
            row = self._db.execute(
                "SELECT * FROM jobs WHERE status = ? ORDER BY seq ASC LIMIT 1", (JobStatus.QUEUED.value,)
            ).fetchone()
            return self._decode(row) if row is not None else None

    def queued_ids(self) -> list[str]:
        """The ids of the queued jobs, oldest first."""
        with self._lock:
            rows = self._db.execute(
                "SELECT id FROM jobs WHERE status = ? ORDER BY seq ASC", (JobStatus.QUEUED.value,)
            ).fetchall()
        return [row["id"] for row in rows]

    def count_queued(self) -> int:
        """The queued jobs (an index search: `count_by_status` groups every job, 10 ms at 100k stored jobs, and
        admission runs it on the event loop for every job created)."""
        with self._lock:
            return self._db.execute("SELECT COUNT(*) FROM jobs WHERE status = ?",
                                    (JobStatus.QUEUED.value,)).fetchone()[0]

    def count_by_status(self) -> dict[JobStatus, int]:
        with self._lock:
            rows = self._db.execute("SELECT status, COUNT(*) AS n FROM jobs GROUP BY status").fetchall()
        counts = {status: 0 for status in JobStatus}
        counts.update({JobStatus(row["status"]): row["n"] for row in rows})
        return counts

    def finished_before(self, timestamp: float) -> list[Job]:
        """Terminal jobs that finished before `timestamp` (the TTL sweep)."""
        with self._lock:
            rows = self._db.execute(FINISHED_BEFORE_SQL, [s.value for s in TERMINAL] + [timestamp]).fetchall()
        return [self._decode(row) for row in rows]

    def upload_files(self) -> set[str]:
        """Every uploaded file a stored job owns (start-up: the others in the upload folder are orphans)."""
        with self._lock:
            rows = self._db.execute("SELECT upload_files FROM jobs WHERE upload_files != '[]'").fetchall()
        return {path for row in rows for path in json.loads(row["upload_files"])}

    def recover_interrupted(self) -> tuple[list[Job], list[Job], list[Job]]:
        """At start-up: re-queue jobs that were running when the server died, once, and cancel those whose cancel
        had been accepted (a cancelled job must not run again).

        Returns (requeued, cancelled, died_twice): died_twice are the jobs still in_progress that ran MAX_ATTEMPTS
        times, for the caller to fail, as it fails any job: with its webhook event in the same transaction.
        """
        requeued, cancelled, died_twice = [], [], []
        with self._lock:
            rows = self._db.execute(
                "SELECT * FROM jobs WHERE status = ? ORDER BY seq", (JobStatus.IN_PROGRESS.value,)
            ).fetchall()
        for job in (self._decode(row) for row in rows):
            if job.cancel_requested_at is not None:
                updated = self.transition(
                    job.id, (JobStatus.IN_PROGRESS,), status=JobStatus.CANCELLED, error_code="cancelled",
                    error_message=CANCELLED_AT_SHUTDOWN,
                    completed_at=time.time(),
                )
                if updated is not None:
                    cancelled.append(updated)
            elif job.attempts < MAX_ATTEMPTS:
                updated = self.transition(
                    job.id, (JobStatus.IN_PROGRESS,), status=JobStatus.QUEUED, progress=0, started_at=None,
                    warnings=job.warnings + ("The server stopped while this job was running; it was re-queued.",),
                )
                if updated is not None:
                    requeued.append(updated)
            else:
                died_twice.append(job)
        return requeued, cancelled, died_twice
