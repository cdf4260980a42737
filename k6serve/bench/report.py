"""Benchmark rows, the printed table and the JSON file."""

from __future__ import annotations

import dataclasses
import datetime
import importlib.metadata
import json
import math
import os
import platform
import subprocess
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

import k6serve
from k6serve.bench.flops import FLOOR_TFLOPS
from k6serve.serve.settings import API_KEY_ENV
from k6serve.serve.webhook_transport import WEBHOOK_SECRET_ENV


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
    )  # the worker's timings of a pipeline run: per-stage seconds, per-step seconds ("denoise_per_step", ...) and
    # counts ("graphs_compiled", "cache_dit_cached_calls"); several runs: the median of each entry, so the stages
    # need not add up to the row's median total
    # Every timed run's breakdown, so one slow run among them shows where its time went.
    breakdowns_s: tuple[dict[str, float], ...] = ()
    # sha256 of the row's outputs, so runs in separate processes can be compared byte for byte: vae, the uint8
    # frames of its last timed run; generate and sr, each request's MP4 in order.
    output_sha256: tuple[str, ...] = ()
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
    # A --transformer-path with a "|" in it (the dit rows' config) split its row into one cell too many.
    escaped = [text.replace("|", "\\|").replace("\n", " ") for text in (row.stage, row.name, row.config)]
    return [
        *escaped,
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
    # "max|diff|" unescaped made the header 14 cells over a 12-cell delimiter row: no markdown table at all.
    header = [column.replace("|", "\\|") for column in COLUMNS]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(_cells(row)) + " |" for row in rows]
    return "\n".join(lines)


COMMIT_ENVIRONMENT_VARIABLE = "K6SERVE_COMMIT"
# `k6serve serve`'s bearer key and webhook signing key, by the server's own names (settings.py imports no web
# framework, only the standard library).
SECRET_ENVIRONMENT_VARIABLES = frozenset({API_KEY_ENV, WEBHOOK_SECRET_ENV})


def _git_commit() -> str | None:
    """$K6SERVE_COMMIT if set, else `git rev-parse --short HEAD` of the source tree.

    The variable exists for copied trees: the GPU machine receives the working tree with a `.git` that can be
    older than the code (measured: JSON of 2026-11-30 named the session's first commit), so the launcher passes
    the commit it sent. Whether the tree has changes beyond it is `environment()["tree_modified"]`.
    """
    pinned = os.environ.get(COMMIT_ENVIRONMENT_VARIABLE, "").strip()
    if pinned:
        return pinned
    if _source_tree() is None:
        return None
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


def _source_tree() -> Path | None:
    """The k6serve checkout this code runs from, or None for an installed package: git run beside an installed
    copy (a virtual environment inside the user's own repository) answered with that repository's commit."""
    root = Path(__file__).resolve().parents[2]
    try:
        named = 'name = "k6serve"' in (root / "pyproject.toml").read_text(encoding="utf-8")
    except OSError:
        return None
    return root if named else None


def _tree_modified() -> bool | None:
    """Whether the source tree differs from its git HEAD (uncommitted changes ran); None without git or a `.git`
    (the GPU machine's copy may have a stale one: then it says modified, which is the truth about that HEAD), and
    for an installed package."""
    if _source_tree() is None:
        return None
    try:
        result = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                                check=False, text=True, timeout=10, cwd=Path(__file__).resolve().parent)
    except (OSError, subprocess.SubprocessError):
        return None
    return bool(result.stdout.strip()) if result.returncode == 0 else None


def _gpu_facts() -> dict[str, Any]:
    """The driver, clocks and power cap of GPU 0 (nvidia-smi; the forward is power-bound at the H200's 700 W, and
    hosts differed by 0.15 s a step), empty where there is none."""
    query = "driver_version,clocks.max.sm,power.limit"
    try:
        result = subprocess.run(["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader,nounits", "-i", "0"],
                                capture_output=True, check=False, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return {}
    values = [value.strip() for value in result.stdout.strip().split(",")]
    return dict(zip(("driver", "max_sm_clock_mhz", "power_limit_w"), values)) if len(values) == 3 else {}


def environment(device: torch.device | str | None = None) -> dict[str, Any]:
    """Versions and hardware, recorded with every result (docs/benchmarks.md asks for them). `date` is when the
    environment is written, at the end of the run; `gpu` the GPU the rows ran on (None for a CPU run)."""
    on_gpu = torch.cuda.is_available() and (device is None or torch.device(device).type == "cuda")
    info: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "commit": _git_commit(),
        "tree_modified": _tree_modified(),
        "k6serve": k6serve.__version__,  # not the installed metadata's: the GPU host runs the tree uninstalled
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        "gpu": torch.cuda.get_device_name(0) if on_gpu else None,
        **(_gpu_facts() if on_gpu else {}),
    }
    # diffusers is the reference; the fa / compiled rows depend on FA3 (fa3-fwd), FA4 (CUTLASS DSL) and Triton.
    for package in ("diffusers", "transformers", "triton", "fa3-fwd", "nvidia-cutlass-dsl"):
        info[package] = _version(package)
    # The K6SERVE_* switches (FA4, kernels, VAE layouts, cuDNN's autotuner, x264 threads) change what a row
    # measures; the server's secrets (its API key, the webhook signing key) are never written, as the JSON files are
    # shared (docs/benchmarks/ holds them).
    info["k6serve_environment"] = {
        name: value for name, value in sorted(os.environ.items())
        if name.startswith("K6SERVE_") and name not in SECRET_ENVIRONMENT_VARIABLES
    }
    # torch's own switches that change what inductor compiles (TORCHINDUCTOR_DETERMINISTIC: no on-device timing of
    # configurations that change numerics; the cache folder, whether a compile was cold).
    info["torch_environment"] = {
        name: value for name, value in sorted(os.environ.items()) if name.startswith(("TORCHINDUCTOR_", "TORCH_"))
    }
    return info


def _version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def write_json(path: str | Path, rows: list[BenchRow], arguments: dict[str, Any],
               device: torch.device | str | None = None, notes: Sequence[str] = (), *, complete: bool = True,
               replace: bool = False) -> None:
    """`device`: where the rows ran (`--device auto --tiny` is the CPU), so a CPU run names no GPU. `notes`: what
    the run printed about its arguments (a flag no stage of it read), beside them so `arguments` is not misread.
    `complete`: False while stages are still to run (the file is written after each). `replace`: the file is this
    run's own, written before; otherwise an existing file is never replaced."""
    payload = {
        "complete": complete,
        "environment": environment(device),
        "arguments": arguments,
        "notes": list(notes),
        "rows": [row.to_json() for row in rows],
    }
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    text = json_text(payload)
    if not replace:
        # "x": a file that appeared since `k6serve bench` checked the path (another run's) is not replaced.
        with path.open("x", encoding="utf-8") as file:
            file.write(text)
        return
    # Written beside it, then renamed over it: a kill mid-write leaves the previous stage's whole file.
    with tempfile.NamedTemporaryFile("w", encoding="utf-8", dir=path.parent, prefix=f".{path.name}.",
                                     delete=False) as temporary:
        temporary.write(text)
    os.chmod(temporary.name, path.stat().st_mode & 0o7777)  # the temporary file's 0600, not the run's first file's mode
    os.replace(temporary.name, path)


def json_text(payload: Any) -> str:
    """`payload` as indented JSON, each non-finite number as null: json.dumps wrote a NaN cosine (a diverging fp8
    row) as `NaN`, which strict parsers (jq, JavaScript's JSON.parse) refuse."""
    return json.dumps(_finite(payload), indent=2, default=str, allow_nan=False)


def _finite(value: Any) -> Any:
    """`value` with each non-finite float (NaN, infinity) as None, through dicts, lists and tuples."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: _finite(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(item) for item in value]
    return value
