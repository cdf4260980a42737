"""Where the time of one call goes: a kernel table from `torch.profiler`, grouped into categories.

Used by `scripts/gpu_profile.py` and `scripts/gpu_multi.py --profile` to decide what to optimise next: the
table lists the most expensive kernels (device time, count) and sums them into categories (GEMM,
attention, communication, generated Triton kernels, copies, convolutions, normalisation, other), plus the
wall time of the profiled region and the device idle time (wall minus the sum of kernel time on one stream,
a lower bound on launch and host overhead). On a CPU-only run the same code summarises CPU operators.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from typing import Any

import torch

# First match wins: the order puts the specific kernel families before the generic ones.
CATEGORIES: tuple[tuple[str, str], ...] = (
    ("communication", r"nccl|all_to_all|allgather|all_gather|reduce_scatter|allreduce"),
    ("attention", r"flash|fmha|attention|attn|sdpa|cudnn.*(mha|sdp)"),
    ("convolution", r"conv|implicit_gemm|implicit_convolve|winograd|fft|dgrad|wgrad|xmma_fprop"),
    ("gemm", r"gemm|nvjet|cutlass|xmma|sm90_|sm80_|matmul|addmm|\bmm\b|bmm"),
    ("triton", r"^triton_"),
    ("normalisation", r"norm"),
    ("copy", r"copy|cat|elementwise|vectorized|unrolled|reduce|transpose|memcpy|memset|fill|index"),
)


def kernel_category(name: str) -> str:
    lowered = name.lower()
    for category, pattern in CATEGORIES:
        if re.search(pattern, lowered):
            return category
    return "other"


def _is_device_event(event: Any) -> bool:
    device_type = getattr(event, "device_type", None)
    return device_type is not None and getattr(device_type, "name", str(device_type)).upper() != "CPU"


def _is_device_range(event: Any) -> bool:
    """A range on the device timeline that is not a kernel: the profiler mirrors operator and record_function
    ranges there ("aten::addmm", "fa3_fwd::fwd", "nccl:all_to_all") with the time of the kernels inside them,
    and CUDA reports "Command Buffer Full" waits. Counting those would count their kernels twice."""
    name = str(event.key)
    return (bool(getattr(event, "is_user_annotation", False)) or _OPERATOR_NAME.fullmatch(name) is not None
            or name.startswith("nccl:") or name == "Command Buffer Full")


# "aten::addmm", "fa3_fwd::fwd": an operator's qualified name. Kernel names that contain "::" are C++ signatures
# ("void at::native::elementwise_kernel<...>(...)", "cutlass::device_kernel<...>") and never match.
_OPERATOR_NAME = re.compile(r"[A-Za-z_]\w*(::[A-Za-z_]\w*)+(\.\w+)?")


def _device_time_us(event: Any) -> float:
    for attribute in ("self_device_time_total", "self_cuda_time_total"):
        value = getattr(event, attribute, None)
        if value:
            return float(value)
    return 0.0


def summarize(events: Any, *, wall_s: float, top: int = 40, device: bool = True) -> dict:
    """Summarise `profile.key_averages()`: top kernels, category sums (ms) and idle time.

    With `device=False` (CPU runs) the operators' self CPU time is used instead of device time.
    """
    rows = []
    for event in events:
        # Operators (aten::mm, fa3_fwd::fwd, a Triton launch) also carry the device time of the kernels they
        # launch; only the kernels themselves are counted, or every microsecond would appear twice.
        if device and (not _is_device_event(event) or _is_device_range(event)):
            continue
        micros = _device_time_us(event) if device else float(getattr(event, "self_cpu_time_total", 0.0))
        if micros <= 0:
            continue
        rows.append({"name": event.key, "ms": micros / 1e3, "count": int(event.count),
                     "category": kernel_category(event.key)})
    rows.sort(key=lambda row: row["ms"], reverse=True)
    categories: dict[str, float] = {}
    for row in rows:
        categories[row["category"]] = categories.get(row["category"], 0.0) + row["ms"]
    busy_ms = sum(categories.values())
    return {
        "wall_ms": wall_s * 1e3,
        "busy_ms": busy_ms,
        "idle_ms": max(0.0, wall_s * 1e3 - busy_ms),
        "categories_ms": dict(sorted(categories.items(), key=lambda item: -item[1])),
        "top": rows[:top],
    }


def profile_call(call: Callable[[], Any], *, device: torch.device, top: int = 40) -> dict:
    """Run `call` once under the profiler (after the caller's warm-up) and summarise it."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    on_cuda = device.type == "cuda"
    if on_cuda:
        activities.append(torch.profiler.ProfilerActivity.CUDA)
        torch.cuda.synchronize(device)
    with torch.profiler.profile(activities=activities) as profile:
        start = time.perf_counter()
        call()
        if on_cuda:
            torch.cuda.synchronize(device)
        wall_s = time.perf_counter() - start
    return summarize(profile.key_averages(), wall_s=wall_s, top=top, device=on_cuda)


def format_summary(title: str, summary: dict, *, top: int = 25) -> str:
    """Markdown: the category sums, then the top kernels."""
    lines = [f"### {title}", "",
             f"wall {summary['wall_ms']:.1f} ms, kernels {summary['busy_ms']:.1f} ms, "
             f"idle >= {summary['idle_ms']:.1f} ms", "",
             "| category | ms | share |", "|---|---|---|"]
    busy = summary["busy_ms"] or 1.0
    for category, ms in summary["categories_ms"].items():
        lines.append(f"| {category} | {ms:.1f} | {100 * ms / busy:.1f}% |")
    lines += ["", "| kernel | category | ms | calls |", "|---|---|---|---|"]
    for row in summary["top"][:top]:
        name = row["name"] if len(row["name"]) <= 110 else row["name"][:107] + "..."
        lines.append(f"| `{name}` | {row['category']} | {row['ms']:.2f} | {row['count']} |")
    return "\n".join(lines) + "\n"
