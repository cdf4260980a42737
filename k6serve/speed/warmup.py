"""`--warmup-mode`: run a short request before real ones, so compilation and autotuning are paid up front.

* "off": nothing runs; the first request pays for compilation and cuDNN autotuning.
* "request": the worker warms up lazily, right before the first request, with that request's shape.
* "server": the worker warms up once at start-up, before it reports ready: with each `--warmup-resolutions` size
  in turn (`runtime/warmup_sizes.py`), or with the variant's default request when none is listed.

Both warm modes run the same thing: the request with its shape (what compiled graphs and cuDNN plans are
keyed on) but only `WARMUP_STEPS` denoising steps, and report the wall time it took.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

import torch

from k6serve.config import WARMUP_MODES
from k6serve.request import GenerateRequest

# Two steps exercise the scheduler's step and a second DiT call on the compiled, warm path.
WARMUP_STEPS = 2


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class WarmupReport:
    """What a warm-up cost: wall seconds and the shape it warmed (empty for mode "off")."""

    mode: str
    seconds: float
    # (num_frames, height, width) of a generation request, or of a super-resolution source clip (the frames it keeps)
    shape: tuple[int, int, int] | None = None
    num_inference_steps: int | None = None

    @property
    def size(self) -> str:
        """The shape as `--warmup-resolutions` writes it, width first: WxHxF ("" without a shape)."""
        if self.shape is None:
            return ""
        num_frames, height, width = self.shape
        return f"{width}x{height}x{num_frames}"


def warmup_request(request):
    """The short request a warm-up runs: same shape, `WARMUP_STEPS` steps (SR requests unchanged)."""
    if isinstance(request, GenerateRequest):
        steps = min(WARMUP_STEPS, request.num_inference_steps)
        return dataclasses.replace(request, num_inference_steps=steps)
    return request


def warmup(pipeline: Callable, request_like, mode: str) -> WarmupReport:
    """Run `pipeline` once on a short version of `request_like` unless `mode` is "off"; report the cost."""
    if mode not in WARMUP_MODES:
        raise ValueError(f"--warmup-mode must be one of {WARMUP_MODES}, got {mode!r}")
    if mode == "off":
        return WarmupReport(mode=mode, seconds=0.0)
    request = warmup_request(request_like)
    start = time.perf_counter()
    pipeline(request)
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    shape = None
    steps = None
    if isinstance(request, GenerateRequest):
        shape = (request.num_frames, request.height, request.width)
        steps = request.num_inference_steps
    return WarmupReport(mode=mode, seconds=seconds, shape=shape, num_inference_steps=steps)
