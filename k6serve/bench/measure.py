"""Timing (median of warm runs, device-synchronised), peak memory and output similarity."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

GIB = 2**30


@dataclass(frozen=True, kw_only=True, slots=True)
class Measurement:
    """Wall seconds of each timed run, their median, the peak memory and the last run's output."""

    times_s: tuple[float, ...]
    peak_memory_gib: float | None
    output: Any

    @property
    def median_s(self) -> float:
        return statistics.median(self.times_s)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(
    fn: Callable[[], Any], *, device: torch.device, repeats: int, warmup: int
) -> Measurement:
    """Run `fn` `warmup` times untimed, then `repeats` times timed (each between device syncs).

    Peak memory is `max_memory_allocated` over all runs on CUDA (None elsewhere). Only the last output is
    kept, so a caller comparing outputs holds one copy.
    """
    if repeats < 1:
        raise ValueError(f"--repeats must be >= 1, got {repeats}")
    if device.type == "cuda":
        synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    output = None
    for _ in range(warmup):
        output = fn()
        del output
    times = []
    for _ in range(repeats):
        output = None  # free the previous output before the next run allocates its own
        synchronize(device)
        start = time.perf_counter()
        output = fn()
        synchronize(device)
        times.append(time.perf_counter() - start)
    peak = torch.cuda.max_memory_allocated(device) / GIB if device.type == "cuda" else None
    return Measurement(times_s=tuple(times), peak_memory_gib=peak, output=output)


def kernel_median_ms(
    fn: Callable[[], Any], *, device: torch.device, repeats: int, warmup: int = 0, calls_per_sample: int = 10
) -> float:
    """Median milliseconds per call of `fn` over `repeats` samples, after `warmup` untimed calls, for
    sub-millisecond kernels. On CUDA each sample is `calls_per_sample` calls back to back between two CUDA events
    (no host sync inside): with one call per sample the GPU would idle while the host launches it, which adds the
    launch latency (tens of microseconds) to a 0.1 ms kernel. Elsewhere, wall time of one call per sample."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(calls_per_sample):
                fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / calls_per_sample)
        else:
            begin = time.perf_counter()
            fn()
            times.append((time.perf_counter() - begin) * 1e3)
    return statistics.median(times)


def kernel_script_parser(description: str, *, repeats: int, backend: bool = False) -> argparse.ArgumentParser:
    """The arguments every kernel micro-benchmark script takes (scripts/gpu_{attention,group_norm,qk_norm_rope}.py):
    --device, --tiny (toy shapes, the CPU check CI runs), --repeats, --out (default $OUT), and with `backend`
    the torch.compile backend of the compiled variants."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true", help="toy shapes (CPU check)")
    if backend:
        parser.add_argument("--backend", default="inductor")
    parser.add_argument("--repeats", type=int, default=repeats)
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    return parser


def write_kernel_report(out: str | Path, name: str, rows: list[dict], device: torch.device, **extra: Any) -> dict:
    """Write `<out>/<name>.json` (the device, bench.report.environment(): versions, date, commit, and the rows);
    returns the report, whose "device" and "torch" the scripts' markdown headers use."""
    from k6serve.bench.report import environment

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    report = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              **environment(), **extra, "rows": rows}
    (out / f"{name}.json").write_text(json.dumps(report, indent=2))
    return report


def cosine_similarity(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """Cosine similarity of two same-shape tensors, flattened, accumulated in fp64."""
    if actual.shape != expected.shape:
        raise ValueError(f"shapes differ: {tuple(actual.shape)} vs {tuple(expected.shape)}")
    a, b = actual.reshape(-1).double(), expected.reshape(-1).double()
    return float((a @ b) / (a.norm() * b.norm()).clamp_min(1e-300))


def max_abs_difference(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max |actual - expected| (uint8 frames: in units of 1/255, computed in int16 to stay small)."""
    if actual.dtype == torch.uint8 and expected.dtype == torch.uint8:
        return float((actual.to(torch.int16) - expected.to(torch.int16)).abs().max())
    return float((actual.double() - expected.double()).abs().max())
