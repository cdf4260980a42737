"""The HTTP server's own settings (the engine's live in `k6serve.config`)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True, kw_only=True, slots=True)
class ServerSettings:
    host: str = "127.0.0.1"
    port: int = 30000
    output_path: Path = Path("outputs")
    job_store: Path | None = None  # None: <output_path>/jobs.sqlite3
    output_ttl_s: float = 86400.0  # finished jobs and their files are deleted this long after finishing; 0 keeps
    max_queued_jobs: int = 64
    max_upload_mb: float = 512.0
    allowed_input_dirs: tuple[Path, ...] = ()  # empty: ./inputs and the upload folder
    api_key: str | None = None
    cleanup_interval_s: float = 60.0
    cancel_wait_s: float = 10.0  # how long DELETE waits for a running job to stop at a step boundary

    def __post_init__(self) -> None:
        if not (0 < self.port < 65536):
            raise ValueError(f"--port must be in 1..65535, got {self.port}")
        if self.output_ttl_s < 0:
            raise ValueError(f"--output-ttl must be >= 0 seconds (0 keeps outputs forever), got {self.output_ttl_s}")
        if self.max_queued_jobs < 1:
            raise ValueError(f"--max-queued-jobs must be >= 1, got {self.max_queued_jobs}")
        if self.max_upload_mb <= 0:
            raise ValueError(f"--max-upload-mb must be > 0, got {self.max_upload_mb}")
        if self.api_key is not None and not self.api_key.strip():
            raise ValueError("--api-key must not be empty; leave it unset to disable authentication.")

    @property
    def job_store_path(self) -> Path:
        return self.job_store if self.job_store is not None else self.output_path / "jobs.sqlite3"

    @property
    def max_upload_bytes(self) -> int:
        return int(self.max_upload_mb * 2**20)
