"""Benchmark rows, the printed table and the JSON file."""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import platform
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from k6serve.bench.flops import FLOOR_TFLOPS


@dataclass(kw_only=True, slots=True)
class BenchRow:
    """One measured thing: a stage run by one implementation on one configuration."""

    stage: str  # dit | vae | audio | text | generate | sr
    name: str  # e.g. "ours fa+speed", "diffusers eager"
    config: str  # variant and geometry
    seconds: float | None = None  # median of the timed runs
    times_s: tuple[float, ...] = ()
    tflop: float | None = None  # work of one call, 1e12 FLOP
    reference_seconds: float | None = None  # the diffusers row this one is compared with
    peak_memory_gib: float | None = None
    cosine_video: float | None = None
    cosine_audio: float | None = None
    max_abs_diff: float | None = None  # vs the reference output (uint8 levels for frames)
    breakdown_s: dict[str, float] = field(
        default_factory=dict
    )  # per-stage seconds of a pipeline run (several runs: the median of each stage)
    # Every timed run's breakdown, so one slow run among them shows where its time went.
    breakdowns_s: tuple[dict[str, float], ...] = ()
    note: str = ""
    error: str | None = None

    def record(self, result) -> Any:
        """Take the median, the run times and the peak memory of a `measure()` result; return its output."""
        self.seconds, self.times_s, self.peak_memory_gib = (
            result.median_s,
            result.times_s,
            result.peak_memory_gib,
        )
        return result.output

    @property
    def tflops(self) -> float | None:
        return self.tflop / self.seconds if self.tflop and self.seconds else None

    @property
    def percent_of_floor(self) -> float | None:
        return 100.0 * self.tflops / FLOOR_TFLOPS if self.tflops else None

    @property
    def speedup(self) -> float | None:
        """Reference seconds / our seconds (> 1: faster than diffusers)."""
        if self.reference_seconds and self.seconds:
            return self.reference_seconds / self.seconds
        return None

    def to_json(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data.update(
            tflops=self.tflops, percent_of_floor=self.percent_of_floor, speedup=self.speedup
        )
        return data


COLUMNS = (
    "stage",
    "name",
    "config",
    "seconds",
    "TFLOP/s",
    "% of 790",
    "x diffusers",
    "peak GiB",
    "cos video",
    "cos audio",
    "max|diff|",
    "note",
)


def _number(value: float | None, digits: int) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _cells(row: BenchRow) -> list[str]:
    note = f"ERROR: {row.error}" if row.error else row.note
    return [
        row.stage,
        row.name,
        row.config,
        _number(row.seconds, 3),
        _number(row.tflops, 0),
        _number(row.percent_of_floor, 1),
        _number(row.speedup, 2),
        _number(row.peak_memory_gib, 1),
        _number(row.cosine_video, 5),
        _number(row.cosine_audio, 5),
        _number(row.max_abs_diff, 3),
        note.replace("|", "/").replace("\n", " ")[:160],
    ]


def format_table(rows: list[BenchRow]) -> str:
    """A markdown table of `rows` (also readable as plain text)."""
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(_cells(row)) + " |" for row in rows]
    return "\n".join(lines)


COMMIT_ENVIRONMENT_VARIABLE = "K6SERVE_COMMIT"


def _git_commit() -> str | None:
    """$K6SERVE_COMMIT if set, else `git rev-parse --short HEAD` of the source tree.

    The variable exists for copied trees: the GPU machine receives the working tree with a `.git` that can be
    older than the code (measured: JSON of 2026-11-30 named the session's first commit), so the launcher passes
    the commit it sent. A dirty tree is not detected either way.
    """
    pinned = os.environ.get(COMMIT_ENVIRONMENT_VARIABLE, "").strip()
    if pinned:
        return pinned
    try:
        result = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            check=False,
            text=True,
            timeout=5,
            cwd=Path(__file__).resolve().parent,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return result.stdout.strip() or None


def environment() -> dict[str, Any]:
    """Versions and hardware, recorded with every result (docs/benchmarks.md asks for them)."""
    info: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "commit": _git_commit(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }
    for package in ("diffusers", "transformers"):
        try:
            info[package] = __import__(package).__version__
        except ImportError:
            info[package] = None
    # The K6SERVE_* switches (FA4, kernels, VAE layouts, x264 threads) change what a row measures.
    info["k6serve_environment"] = {
        name: value for name, value in sorted(os.environ.items())
        if name.startswith("K6SERVE_") and name != "K6SERVE_API_KEY"
    }
    return info


def write_json(path: str | Path, rows: list[BenchRow], arguments: dict[str, Any]) -> None:
    payload = {
        "environment": environment(),
        "arguments": arguments,
        "rows": [row.to_json() for row in rows],
    }
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2, default=str))
