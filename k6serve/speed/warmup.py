"""`--warmup-mode`: run a short request before real ones, so compilation and autotuning are paid up front.

* "off": nothing runs; the first request pays for compilation (and cuDNN autotuning with
  `K6SERVE_CUDNN_BENCHMARK=1`).
* "request": the worker warms up lazily, right before the first request, with that request's shape.
* "server": the worker warms up once at start-up, before it reports ready: with each `--warmup-resolutions` size
  in turn (`runtime/warmup_sizes.py`), or with the variant's default request when none is listed.

Both warm modes run the same thing: the request with its shape (what compiled graphs and cuDNN plans are
keyed on) but only `WARMUP_STEPS` denoising steps, and report the wall time it took. With
`--compile-prompt-rewrite true` the first warm-up of a worker also compiles the prompt rewrite (`warm_rewrite`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from k6serve.config import WARMUP_MODES
from k6serve.request import GenerateRequest

# Two steps exercise the scheduler's step and a second DiT call on the compiled, warm path.
WARMUP_STEPS = 2
# The compiled rewrite's warm-up writes this many tokens: the first from the eager prefill, then the compiled
# decoding step three times, which compiles it and lets CUDA graphs (transformers' "reduce-overhead") record it.
WARMUP_REWRITE_TOKENS = 4
# The frame rate of a silent warm-up's steps with sound (and a quarter more): 509 frames, the most, need 10.71.
SOUND_WARMUP_FPS = 24.0


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class WarmupReport:
    """What a warm-up cost: wall seconds and the shape it warmed (empty for mode "off")."""

    mode: str
    seconds: float
    # (num_frames, height, width) of a generation request, or of a super-resolution source clip (the frames it keeps)
    shape: tuple[int, int, int] | None = None
    num_inference_steps: int | None = None
    # The compiled prompt rewrite's part of `seconds` (`warm_rewrite`); None when the warm-up did not rewrite.
    rewrite_seconds: float | None = None

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
        cache_dit = request.cache_dit
        if cache_dit is not None and cache_dit.uses_step_mask:
            # A preset step mask needs 4, 6 or >= 8 steps and refused the warm-up's 2 (a valid request, or the
            # start-up, failed on it); bins cover their own step count. The mask only picks the steps that may reuse
            # the cache: the same blocks run.
            cache_dit = dataclasses.replace(cache_dit, scm_preset="none", scm_compute_bins=None, scm_cache_bins=None)
        # No prompt rewrite here: up to 1024 tokens generated one by one warm nothing the request's own run needs
        # (eager generate), and the rewrite's length is the prompt's, which `other_lengths` already covers. A
        # compiled rewrite is warmed apart, in a few tokens (`warm_rewrite`).
        return dataclasses.replace(request, num_inference_steps=steps, cache_dit=cache_dit, expand_prompts=False)
    return request


class _FirstStepDone(Exception):
    """Raised from `on_step` to end the other lengths' pass after its one DiT step (no decode)."""


def other_text_length_prompt(prompt: str) -> str:
    """A prompt whose token count differs from `prompt`'s: the prompt twice, or "a" for one so long that twice it
    would be cut at the text encoder's limit (1,024 tokens, at least a few thousand characters)."""
    return f"{prompt} {prompt}" if len(prompt) < 1000 else "a"


def other_audio_length_fps(fps: float) -> float:
    """A frame rate that gives the same frames another soundtrack length (the audio tokens are num_frames / fps
    seconds): a quarter faster, so the soundtrack is shorter and within the DiT's positions; 240 fps (the limit) a
    quarter slower, a soundtrack of at most 2.7 s."""
    return fps * 1.25 if fps * 1.25 <= 240 else fps / 1.25


def other_lengths_request(request: GenerateRequest, image_path: str) -> GenerateRequest:
    """`request` with every other thing a request may change without changing the video's shape changed: a prompt
    (and negative prompt) of another length, another soundtrack length, and the conditioning image toggled
    (`image_path` for a text-only request), one DiT step."""
    negative = request.negative_prompt
    return dataclasses.replace(
        request, prompt=other_text_length_prompt(request.prompt),
        negative_prompt=None if negative is None else other_text_length_prompt(negative),
        fps=other_audio_length_fps(request.fps), image_path=None if request.image_path else image_path,
        num_inference_steps=1)


@contextlib.contextmanager
def _gray_image(request: GenerateRequest) -> Iterator[str]:
    """The path of a gray PNG of `request`'s size, for the warm-up passes that need a conditioning image; removed
    after."""
    import tempfile

    from PIL import Image

    with tempfile.TemporaryDirectory(prefix="k6serve-warmup-") as folder:
        image_path = str(Path(folder) / "image.png")
        Image.new("RGB", (request.width, request.height), (128, 128, 128)).save(image_path)
        yield image_path


def warm_other_lengths(pipeline: Callable, request: GenerateRequest,
                       on_step: Callable[[int, int], object] | None = None) -> None:
    """One DiT step of `request` as `other_lengths_request` changes it, then, where the checkpoint has its audio
    parts, one without the soundtrack (a request with one) or two with it (a silent request), each stopped before
    the decode.

    Why: speed mode trims the text padding (pipelines/encode_text.py, `trim_text_padding`), so the text length the
    compiled blocks see is the prompt's token count. Dynamo compiles them static on the first length it sees and,
    on the second, once more with that dimension dynamic, which then serves every length. A warm-up with one prompt
    left that second compile to the first real request whose prompt had another length: on the H200 a warmed
    Lite-distill request at 768x512x121 compiled 3 graphs and spent 10.7 s of its denoise compiling
    (scripts/gpu_warmup_sizes.py, twenty-sixth session). The soundtrack's length (num_frames / fps) is such a
    dimension too (a request at another --fps recompiled the same way), the negative prompt's length is the only one
    the CFG-parallel rank of the negative branch sees, and a conditioning image (TI2AV) takes another graph than a
    text-only request; this pass changes them all, so dynamo compiles once more for all of them. A silent request
    is one more graph, warmed by one more silent step (and after a silent warm-up, the graph with sound by two
    steps at two soundtrack lengths). On the H200 graphs
    dynamic in every length ran the Pro-distill step in 5.860 s against 5.835 s static (0.4%;
    scripts/gpu_dynamic_dims.py, twenty-sixth session), where each recompile they spare a request costs 7-8 s."""
    def stop(step: int, total: int) -> None:
        if on_step is not None:
            on_step(step, total)  # the caller's cancellation point first
        if step >= 1:
            raise _FirstStepDone

    def one_step(pass_request: GenerateRequest) -> None:
        try:
            pipeline(pass_request, on_step=stop)
        except _FirstStepDone:
            pass

    with _gray_image(request) as image_path:
        one_step(other_lengths_request(request, image_path))
        # (A checkpoint without audio parts makes every request silent: the pass above was one.)
        if getattr(getattr(pipeline, "models", None), "has_audio", True):
            if request.with_audio:
                # A silent request (sample_audio false) has no audio tokens, so its blocks are a graph of their
                # own: one more DiT step, silent, compiles it here (already dynamic in the lengths the pass above
                # changed). The first silent Pro-distill request after a warm-up spent 4.1 s compiling it on the
                # H200 (forty-fifth session); this pass costs a step more at start-up (5.3 s there).
                one_step(dataclasses.replace(request, with_audio=False, num_inference_steps=1))
            else:
                # A silent warm-up (--warmup-mode request, a first request with sample_audio false) never compiled
                # the graph with sound: two steps with a soundtrack, of two lengths, so the audio dimension is
                # dynamic too (one alone compiled it static, and the first two requests with sound compiled a graph
                # each). At SOUND_WARMUP_FPS, whose soundtrack fits the DiT for any frame count (a silent request's
                # fps has no floor).
                sound = dataclasses.replace(request, with_audio=True, fps=SOUND_WARMUP_FPS, num_inference_steps=1)
                one_step(sound)
                one_step(dataclasses.replace(sound, fps=other_audio_length_fps(SOUND_WARMUP_FPS)))


def warm_rewrite(pipeline, request: GenerateRequest) -> float:
    """Rewrites of `WARMUP_REWRITE_TOKENS` tokens of `request`'s prompt through the pipeline's static rewrite cache,
    sized for the request's `max_sequence_length` new tokens as its own rewrite would be: on CUDA transformers
    compiles the decoding step there (about 45 s on an H200), which every rewrite of that cache length then runs.
    Returns their seconds.

    Two rewrites: with a conditioning image (the request's, or a gray one of its size) and without. transformers
    5.17 (the GPU host's) passes an image rewrite's `image_grid_thw` to every decoding step, one more keyword than a
    text rewrite's, so dynamo compiles a second graph for it (5.25 drops it: one graph); a text-only warm-up left
    that compile to the first request with an image. The image's comes first: its inputs are the longer, so it sizes
    the cache (which only grows) and the text rewrite then compiles on the cache later requests use."""
    import logging

    start = time.perf_counter()
    with contextlib.ExitStack() as stack:
        image_path = request.image_path or stack.enter_context(_gray_image(request))
        try:
            pipeline.warm_up_rewrite(dataclasses.replace(request, image_path=image_path), WARMUP_REWRITE_TOKENS)
        except ImportError as error:
            # The checkpoint's image processor needs torchvision under transformers 5.17: a rewrite with an image
            # fails there anyway, and a text-only deployment must still start.
            logging.getLogger(__name__).warning(
                "the compiled prompt rewrite was warmed without an image (%s); a rewrite with one fails", error)
    pipeline.warm_up_rewrite(dataclasses.replace(request, image_path=None), WARMUP_REWRITE_TOKENS)
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
    return time.perf_counter() - start


def warmup(pipeline: Callable, request_like, mode: str, *, other_lengths: bool = False, rewrite: bool = False,
           on_step: Callable[[int, int], object] | None = None) -> WarmupReport:
    """Run `pipeline` once on a short version of `request_like` unless `mode` is "off"; report the cost. With
    `other_lengths` (the caller's compiled DiT has not yet seen a second prompt length), a generation request also
    runs one DiT step with the prompt's, the soundtrack's and the image's other variants (`warm_other_lengths`), so
    the compiled blocks take any of them; with `rewrite` (--compile-prompt-rewrite true, not yet warmed), it also
    compiles the prompt rewrite (`warm_rewrite`); their time is in the report. The caller decides from its
    configuration, not from what this process compiled, so that every rank of a replica runs the same passes (and
    collectives). `on_step` is called at the warm-up's steps, as a pipeline's (a request's cancellation point)."""
    if mode not in WARMUP_MODES:
        raise ValueError(f"--warmup-mode must be one of {WARMUP_MODES}, got {mode!r}")
    if mode == "off":
        return WarmupReport(mode=mode, seconds=0.0)
    request = warmup_request(request_like)
    start = time.perf_counter()
    if on_step is None:
        pipeline(request)
    else:
        pipeline(request, on_step=on_step)
    if other_lengths and isinstance(request, GenerateRequest):
        warm_other_lengths(pipeline, request, on_step)
    rewrite_seconds = None
    if rewrite and isinstance(request, GenerateRequest):
        rewrite_seconds = warm_rewrite(pipeline, request)
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    shape = None
    steps = None
    if isinstance(request, GenerateRequest):
        shape = (request.num_frames, request.height, request.width)
        steps = request.num_inference_steps
    return WarmupReport(mode=mode, seconds=seconds, shape=shape, num_inference_steps=steps,
                        rewrite_seconds=rewrite_seconds)
