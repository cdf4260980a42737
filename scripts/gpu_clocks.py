"""The H200's SM clock and power under the Pro DiT's two bounding kernels, held for seconds as a forward holds them.

Issue 5's bf16 Pro-distill DiT is 5.78-5.95 s against 5.6 s asked, and FA3 plus cuBLAS alone take 5.53-5.60 s of it
(docs/benchmarks.md): FA3 runs the video self-attention at 688 TFLOP/s, where FlashAttention-3's paper reports 740+
at 128-wide heads on an H100 of the same SM count, and the GEMMs at 765-780 TFLOP/s. Both were timed in bursts of
a few calls. This asks whether the gap is the kernels' or the GPU's: each kernel runs back to back for `--seconds`
(a forward is 3.4 s of attention and 2.2 s of GEMMs), while `nvidia-smi` samples the SM clock, the power draw and
the clock-event reasons (power cap, thermal) every 100 ms. Per kernel it reports the TFLOP/s of the first and the
last second and the median, the median SM clock and power while it ran, the reasons seen, and the dense bf16
tensor-core peak at that clock (SMs x 4,096 FLOP per clock: 989 TFLOP/s at 1,830 MHz on 132 SMs), so the kernel's
share of what the GPU could do at the clock it ran at.

    python3 scripts/gpu_clocks.py --out $OUT [--seconds 15]
    python3 scripts/gpu_clocks.py --device cpu --tiny --seconds 0.2     # the logic on the CPU (CI): no samples

Writes <out>/clocks.json (the rows and every sample) and <out>/clocks.md.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import threading
import time
from pathlib import Path

import torch

from k6serve.ops.attention import attention, resolve_attention_backend

# Pro's video self-attention (B=1, 47,616 tokens, 32 heads x 128) and FFN-up GEMM (47,616 x 4,096 @ 4,096 x 16,384).
SHAPES = {"attention": (47_616, 32, 128), "gemm": (47_616, 4_096, 16_384)}
TINY = {"attention": (64, 2, 16), "gemm": (64, 32, 64)}
FLOP_PER_SM_CLOCK = 4_096  # dense bf16 on Hopper: 4 tensor cores x 1,024 FLOP per SM and clock
# nvidia-smi's clocks_event_reasons.active bits (nvml's nvmlClocksEventReasons).
REASONS = {0x1: "gpu_idle", 0x2: "applications_clocks", 0x4: "sw_power_cap", 0x8: "hw_slowdown",
           0x20: "sw_thermal", 0x40: "hw_thermal", 0x80: "hw_power_brake", 0x100: "display_clocks"}
QUERY = "timestamp,clocks.sm,power.draw,temperature.gpu,clocks_event_reasons.active"


def reasons(mask: int) -> list[str]:
    return [name for bit, name in REASONS.items() if mask & bit]


def parse_sample(line: str) -> dict | None:
    """One CSV line of `nvidia-smi --query-gpu=QUERY --format=csv,noheader,nounits` (None for anything else: the
    tool prints a blank line or a warning now and then)."""
    fields = [field.strip() for field in line.split(",")]
    if len(fields) != 5:
        return None
    try:
        when = datetime.datetime.strptime(fields[0], "%Y/%m/%d %H:%M:%S.%f").timestamp()
        return {"t": when, "sm_mhz": float(fields[1]), "power_w": float(fields[2]), "temp_c": float(fields[3]),
                "reasons": int(fields[4], 16)}
    except ValueError:
        return None


class Sampler:
    """nvidia-smi every 100 ms in a child process, its lines parsed by a thread; nothing on a CPU run."""

    def __init__(self, device: torch.device) -> None:
        self.samples: list[dict] = []
        self.process: subprocess.Popen[str] | None = None
        if device.type != "cuda":
            return
        index = device.index if device.index is not None else torch.cuda.current_device()
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        if visible:  # nvidia-smi numbers the GPUs physically, torch within CUDA_VISIBLE_DEVICES
            index = int(visible.split(",")[index])
        self.process = subprocess.Popen(
            ["nvidia-smi", f"--query-gpu={QUERY}", "--format=csv,noheader,nounits", "-i", str(index), "-lms", "100"],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        # The thread starts only after Popen(stdout=PIPE).
        assert self.process is not None and self.process.stdout is not None
        for line in self.process.stdout:
            if (sample := parse_sample(line)) is not None:
                self.samples.append(sample)

    def between(self, start: float, end: float) -> list[dict]:
        return [sample for sample in self.samples if start <= sample["t"] <= end]

    def stop(self) -> None:
        if self.process is not None:
            self.process.terminate()
            self.process.wait()
            self.thread.join(timeout=5)


def kernel(name: str, shape: tuple[int, int, int], device: torch.device, backend: str):
    """The call and its FLOPs."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    generator = torch.Generator(device).manual_seed(0)
    if name == "attention":
        tokens, heads, head_dim = shape
        q, k, v = (torch.randn(1, tokens, heads, head_dim, device=device, dtype=dtype, generator=generator)
                   for _ in range(3))
        return (lambda: attention(q, k, v, backend=backend)), 4 * tokens * tokens * heads * head_dim
    rows, inner, columns = shape
    a = torch.randn(rows, inner, device=device, dtype=dtype, generator=generator)
    b = torch.randn(inner, columns, device=device, dtype=dtype, generator=generator)
    return (lambda: a @ b), 2 * rows * inner * columns


def hold(call, flop: int, seconds: float, device: torch.device) -> list[tuple[float, float]]:
    """Call back to back for `seconds`; (wall time at the call's end, TFLOP/s) per call. On CUDA the calls are timed
    with events and synchronised in groups, so the GPU never waits for the host between calls."""
    call()  # first call (FA3's and cuBLAS's choices) untimed
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    times: list[tuple[float, float]] = []
    end_at = time.time() + seconds
    while time.time() < end_at or not times:
        if device.type != "cuda":
            start = time.perf_counter()
            call()
            times.append((time.time(), flop / (time.perf_counter() - start) / 1e12))
            continue
        events = [torch.cuda.Event(enable_timing=True) for _ in range(11)]
        events[0].record()
        for event in events[1:]:
            call()
            event.record()
        events[-1].synchronize()
        now = time.time()
        elapsed = [events[i].elapsed_time(events[i + 1]) / 1e3 for i in range(10)]
        # Each call's end is estimated back from the group's end: the samples are matched by wall time.
        ends = [now - sum(elapsed[i + 1:]) for i in range(10)]
        times += [(ends[i], flop / elapsed[i] / 1e12) for i in range(10)]
    return times


def row(name: str, shape, times: list[tuple[float, float]], samples: list[dict], sms: int) -> dict:
    start, end = times[0][0], times[-1][0]
    first = [rate for when, rate in times if when <= start + 1.0]
    last = [rate for when, rate in times if when >= end - 1.0]
    clock = statistics.median(s["sm_mhz"] for s in samples) if samples else None
    mask = 0
    for sample in samples:
        mask |= sample["reasons"]
    peak = sms * FLOP_PER_SM_CLOCK * clock * 1e6 / 1e12 if clock else None
    median = statistics.median(rate for _, rate in times)
    return {"kernel": name, "shape": list(shape), "calls": len(times), "seconds": round(end - start, 3),
            "tflops_median": median, "tflops_first_second": statistics.median(first),
            "tflops_last_second": statistics.median(last),
            "sm_mhz_median": clock, "sm_mhz_min": min((s["sm_mhz"] for s in samples), default=None),
            "power_w_median": statistics.median(s["power_w"] for s in samples) if samples else None,
            "temp_c_max": max((s["temp_c"] for s in samples), default=None),
            "reasons": reasons(mask), "samples": len(samples),
            "peak_tflops_at_clock": peak, "share_of_peak_at_clock": median / peak if peak else None}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true", help="toy shapes (CPU check)")
    parser.add_argument("--seconds", type=float, default=15.0)
    parser.add_argument("--attention-backend", default=None, help="default: fa where FA3 imports, else sdpa")
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    backend = resolve_attention_backend(args.attention_backend, device)
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 0
    sampler = Sampler(device)
    time.sleep(1.0 if device.type == "cuda" else 0)  # the idle clock before the first kernel, in the samples
    rows = []
    try:
        for name, shape in (TINY if args.tiny else SHAPES).items():
            call, flop = kernel(name, shape, device, backend)
            times = hold(call, flop, args.seconds, device)
            time.sleep(0.3 if device.type == "cuda" else 0)  # the last samples of the window arrive
            rows.append(row(name if name == "gemm" else f"attention ({backend})", shape, times,
                            sampler.between(times[0][0], times[-1][0]), sms))
            del call
    finally:
        sampler.stop()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    (out / "clocks.json").write_text(json.dumps({"device": name, "torch": torch.__version__, "sms": sms,
                                                 "rows": rows, "samples": sampler.samples}, indent=2))

    def cell(value, spec):
        return "-" if value is None else format(value, spec)

    lines = [f"### sustained kernels ({name}, torch {torch.__version__}, {args.seconds:g} s each)", "",
             "| kernel | TFLOP/s median | first s | last s | SM MHz median (min) | W median | peak at clock | "
             "share | reasons |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['kernel']} | {r['tflops_median']:.1f} | {r['tflops_first_second']:.1f} | "
                     f"{r['tflops_last_second']:.1f} | {cell(r['sm_mhz_median'], '.0f')} "
                     f"({cell(r['sm_mhz_min'], '.0f')}) | {cell(r['power_w_median'], '.0f')} | "
                     f"{cell(r['peak_tflops_at_clock'], '.0f')} | {cell(r['share_of_peak_at_clock'], '.3f')} | "
                     f"{', '.join(r['reasons']) or '-'} |")
    (out / "clocks.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
