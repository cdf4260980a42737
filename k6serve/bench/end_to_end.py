"""Stages `generate` and `sr`: whole requests through `DiffGenerator`, as a user runs them.

Full size uses `--load-format dummy` (released configs, random weights, no download); `--tiny` uses the
built-in demo checkpoint (generation) or a tiny SR checkpoint written to a temporary folder. The first
request is reported on its own ("cold": compilation and autotuning happen there); then `repeats` warm
requests give the median and the per-stage breakdown the pipeline reports (a warm request that fails is an error
row after the cold one's, as a failed row of the other stages is). The engine runs its worker in
this process (`ModelWorker`, one device), so the bench can reach the pipeline's models.

The worker applies `--performance-mode` (and `--compile-vae`) while loading; the rows' note repeats its report.
"""

from __future__ import annotations

import hashlib
import statistics
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import cast

import torch

from k6serve.bench.report import BenchRow
from k6serve.models.variants import VARIANTS
from k6serve.request import TIMING_COUNTS, error_type_name

PROMPT = "A red fox runs through fresh snow at sunrise, the camera tracking it from the side."
SR_VARIANT = "vsr-distilled2steps"


@dataclass(frozen=True, kw_only=True, slots=True)
class EndToEndOptions:
    variant: str  # a generation variant for `generate`; SR always uses vsr-distilled2steps
    height: int
    width: int
    num_frames: int
    device: str  # "cuda" | "cpu" | "auto"
    performance_mode: str = "speed"
    attention_backend: str = "auto"
    num_inference_steps: int | None = None  # None: the variant's default (10 for distilled)
    sr_scale: float = 2.0
    tiny: bool = False
    repeats: int = 1
    output_dir: str | None = None
    compile_vae: bool = False  # the engine's --compile-vae
    vae_tiling: str = "auto"  # the engine's --vae-tiling
    offload_prefetch_blocks: int = 1  # the engine's --offload-prefetch-blocks
    offload_resident_blocks: int = 0  # the engine's --offload-resident-blocks
    cpu_offload_components: tuple[str, ...] = ()  # the engine's --cpu-offload-components
    layerwise_offload_components: tuple[str, ...] = ()  # the engine's --layerwise-offload-components
    component_residency: tuple[str, ...] = ()  # the engine's --component-residency (NAME=MODE items)
    quantization: str = "none"  # generate: the engine's --quantization
    quantization_ignored_layers: tuple[str, ...] = ()  # and its --quantization-ignored-layers
    # generate: also run the requests with Cache-DiT on, with these cache_dit_params (None: uncached only)
    cache_dit_params: dict | None = None
    # generate: also run the request with sample_audio=False (a silent video: the DiT on the video tokens alone)
    silent_request: bool = False
    # generate: also run the request with expand_prompts=True (Qwen2.5-VL rewrites the prompt first)
    expand_prompts_request: bool = False
    compile_prompt_rewrite: bool = False  # the engine's --compile-prompt-rewrite


def _speed_note(generator) -> str:
    """What the engine's worker applied at load time (`--performance-mode`, `--compile-vae`, and with offloading
    the offload report: what streams, how far ahead, what stays on the GPU)."""
    worker = generator.engine.worker
    report = worker.performance_report
    offload = getattr(worker, "offload_report", None)
    return (
        f"{report.mode}: {report.num_fused_attentions} fused attentions, {report.num_compiled_blocks} compiled "
        f"blocks, vae {list(report.vae)}" + (", vae tiling on" if getattr(worker, "vae_tiling", False) else "")
        + (f", {report.num_quantized_linears} DiT linears in e4m3" if report.num_quantized_linears else "")
        + (f"; {offload.describe()}" if offload is not None else "")
    )


def _stage_peaks(generator) -> str:
    """With offloading on CUDA: the peak allocation after each stage of the last request (`ComponentOffload`), so
    the row shows which stage sets the peak; '' otherwise."""
    describe = getattr(generator.engine.worker.pipeline.residency, "describe_peaks", None)
    peaks = describe() if describe is not None else ""
    return f"; peak after each stage: {peaks}" if peaks else ""  # appended to a row's note


def _rows_from_results(
    stage: str, config: str, cold, warm: list, load_s: float, note: str, peaks: str = "", warm_error: str | None = None
) -> list[BenchRow]:
    """The cold row and, with warm runs, their median row; `peaks` (of the last request) goes on the last measured
    row. `warm_error`: a warm request failed, so the warm row is an error row (the cold row stays)."""
    if warm_error is not None:
        # The peaks are the failed request's (an out-of-memory one's tell where it ran out): on its row, not the cold.
        return [*_rows_from_results(stage, config, cold, [], load_s, note),
                BenchRow(stage=stage, name="ours warm", config=config, error=warm_error, note=peaks.removeprefix("; "))]
    cold_row = BenchRow(
        stage=stage,
        name="ours cold (first request)",
        config=config,
        seconds=cold.timings.get("total"),
        times_s=(cold.timings.get("total", 0.0),),
        peak_memory_gib=cold.peak_memory_mb / 1024,
        breakdown_s=dict(cold.timings),
        output_sha256=_file_digests([cold]),
        note=f"load {load_s:.1f} s; {note}" + ("" if warm else peaks),
    )
    rows = [cold_row]
    if warm:
        totals = tuple(result.timings.get("total", 0.0) for result in warm)
        breakdown = _median_breakdown([result.timings for result in warm])
        rows.append(
            BenchRow(
                stage=stage,
                name="ours warm",
                config=config,
                seconds=statistics.median(totals),
                times_s=totals,
                peak_memory_gib=max(r.peak_memory_mb for r in warm) / 1024,
                breakdown_s=breakdown,
                breakdowns_s=tuple(dict(result.timings) for result in warm),
                output_sha256=_file_digests(warm),
                note=("each stage's median (over the runs, so they need not add up to the median total) "
                      if len(warm) > 1 else "") + _breakdown_text(breakdown) + peaks,
            )
        )
    return rows


def _file_digests(results: list) -> tuple[str, ...]:
    """Each result's MP4's sha256 (a request after the first with the same name writes a numbered one, so every
    file is still there); none for a result without a file."""
    digests = []
    for result in results:
        if result.output_file_path is not None:
            digests.append(hashlib.sha256(Path(result.output_file_path).read_bytes()).hexdigest())
    return tuple(digests)


def _breakdown_text(breakdown: dict[str, float]) -> str:
    """`stage=seconds ...`, counts as whole numbers (they read as seconds: "graphs_compiled=0.00")."""
    return " ".join(f"{key}={value:.0f}" if key in TIMING_COUNTS else f"{key}={value:.2f}"
                    for key, value in breakdown.items())


def _median_breakdown(timings: list[dict[str, float]]) -> dict[str, float]:
    """Each stage's median over the runs (a stage missing from a run is left out of that run's values)."""
    keys = list(dict.fromkeys(key for run in timings for key in run))
    return {key: statistics.median(run[key] for run in timings if key in run) for key in keys}


# The engine options of the generation models only (their help says generate:): the SR engine refuses each one set
# (--quantization fp8 "applies to the generation DiT"), so with --stage generate --stage sr they failed the sr stage.
_GENERATE_ENGINE_OPTIONS = ("compile_prompt_rewrite", "vae_tiling", "quantization", "quantization_ignored_layers")


def _engine_kwargs(options: EndToEndOptions, *, super_resolution: bool = False) -> dict:
    """The engine's options for the generate stage, or without the generation-only ones for the sr stage."""
    kwargs = {
        "device": options.device,
        "performance_mode": options.performance_mode,
        "attention_backend": options.attention_backend,
        "load_format": "auto" if options.tiny else "dummy",
        "compile_vae": options.compile_vae,
        "compile_prompt_rewrite": options.compile_prompt_rewrite,
        "vae_tiling": options.vae_tiling,
        "offload_prefetch_blocks": options.offload_prefetch_blocks,
        "offload_resident_blocks": options.offload_resident_blocks,
        "cpu_offload_components": options.cpu_offload_components,
        "layerwise_offload_components": options.layerwise_offload_components,
        "component_residency": options.component_residency,
        "quantization": options.quantization,
        "quantization_ignored_layers": options.quantization_ignored_layers,
    }
    if super_resolution:
        kwargs = {key: value for key, value in kwargs.items() if key not in _GENERATE_ENGINE_OPTIONS}
    return kwargs


def _open_generator(model_path: str, options: EndToEndOptions, *, super_resolution: bool = False):
    """`DiffGenerator` over an in-process `ModelWorker` (the default engine spawns worker processes)."""
    from k6serve.api import DiffGenerator
    from k6serve.engine_arguments import build_engine_config
    from k6serve.runtime.engine import Engine
    from k6serve.runtime.worker import ModelWorker

    config = build_engine_config(model_path, **_engine_kwargs(options, super_resolution=super_resolution))
    return DiffGenerator(Engine(config, worker=ModelWorker(config)))


def _run_requests(generator, params: dict, repeats: int):
    """The first request (raising if it fails), then `repeats` warm ones: (first, warm results, warm error). A warm
    request that raises ends the warm ones, its error the text for the caller's error row, and no warm results (a
    median of the runs before it would read as the warm figure): raising, it lost the first request's row."""
    cold = generator.generate(params)
    warm = []
    for index in range(repeats):
        try:
            warm.append(generator.generate(params))
        except Exception as error:  # noqa: BLE001 (a failure is a table row)
            return cold, [], f"warm request {index + 1} of {repeats}: {error_type_name(error)}: {error}"
    return cold, warm, None


def check_before_loading(options: EndToEndOptions, stages: Sequence[str]) -> None:
    """The engine flags and the request of the generate / sr stages run, checked as `k6serve generate` checks its
    own before the load: a --num-inference-steps 0 or --sr-scale 3 was refused by the request after the model had
    loaded, and after every stage before it had run. Raises ValueError naming the flag."""
    from k6serve.cli.preflight import check_request_before_loading
    from k6serve.engine_arguments import build_engine_config
    from k6serve.request import SR_SCALES, SamplingParams

    if options.attention_backend != "auto" and {"generate", "sr"} & set(stages):
        from k6serve.ops.attention import resolve_attention_backend

        # --attention-backend fa on a host without FA3 failed at the engine's load; "auto" always resolves.
        resolve_attention_backend(options.attention_backend, options.device)
    if "generate" in stages:
        # The uncached request, then the requests of the extra rows: a --cache-dit-params key of no setting, or
        # --expand-prompts-request under a streamed text encoder, was refused only when its row ran, after the load
        # and the uncached requests (minutes at full size).
        params = SamplingParams(prompt=PROMPT, height=options.height, width=options.width,
                                num_frames=options.num_frames, seed=42,
                                num_inference_steps=options.num_inference_steps)
        engine_options = {"model_path": _generate_model_path(options), **_engine_kwargs(options)}
        check_request_before_loading(engine_options, params)
        if options.cache_dit_params is not None:  # refused in its flag's words, as the bench's flag is the same
            check_request_before_loading(engine_options, replace(params, cache_dit_params=options.cache_dit_params))
        if options.expand_prompts_request:
            try:
                check_request_before_loading(engine_options, replace(params, expand_prompts=True))
            except ValueError as exc:  # the bench's flag is the request's --expand-prompts
                raise ValueError(str(exc).replace("--expand-prompts", "--expand-prompts-request")) from exc
        _check_family_plan(build_engine_config(_generate_model_path(options), **_engine_kwargs(options)).runtime,
                           super_resolution=False)
    if "sr" in stages:
        # The source clip is H.264 4:2:0, which halves both sides (the SR pipeline takes any such size and length).
        if min(options.height, options.width) < 2 or options.height % 2 or options.width % 2 or options.num_frames < 1:
            raise ValueError(f"--height / --width / --num-frames: the sr stage's source clip needs even sides and one "
                             f"frame or more, got {options.height}x{options.width}x{options.num_frames}")
        if options.sr_scale not in SR_SCALES:
            raise ValueError(f"--sr-scale must be 2, 4 or 2.25, got {options.sr_scale:g}")
        try:
            _check_family_plan(build_engine_config(_hub_id(SR_VARIANT),
                                                   **_engine_kwargs(options, super_resolution=True)).runtime,
                               super_resolution=True)
        except ValueError as error:
            if "generate" not in stages:
                raise
            # The offload flags go to both stages' engines: say how to give each its own.
            raise ValueError(f"{error} (the sr stage's engine: the offload flags reach both stages; run sr in a "
                             "k6serve bench of its own)") from None


def _check_family_plan(runtime, *, super_resolution: bool) -> None:
    """The worker's own checks of its family's component plan (runtime/worker.py's `resolve_residency`, then
    worker_preflight.py's `check_residency`), made at its load: a component the model lacks
    (--layerwise-offload-components text_encoder for sr, latent_upscaler for generate) failed the stage after the
    earlier ones had run."""
    from k6serve.offload.residency import resolve_residency

    resolve_residency(runtime.performance_mode, super_resolution=super_resolution,
                      cpu_offload=runtime.cpu_offload_components, layerwise=runtime.layerwise_offload_components,
                      settings=runtime.component_residency)
    refusal = runtime.block_streaming_refusal(super_resolution=super_resolution)
    if refusal:
        raise ValueError(refusal)


def _hub_id(variant: str) -> str:
    # Every variant in VARIANTS is a released checkpoint with its hub id (only the demo ones, not in it, have none).
    return cast(str, VARIANTS[variant].hub_id)


def _generate_model_path(options: EndToEndOptions) -> str:
    return "demo" if options.tiny else _hub_id(options.variant)


def run_generate(options: EndToEndOptions) -> list[BenchRow]:
    """A whole T2AV request (text encode, denoise, video + audio decode, MP4) through `DiffGenerator`."""
    model_path = _generate_model_path(options)
    config = f"{'demo' if options.tiny else options.variant} {options.height}x{options.width}x{options.num_frames}"
    with tempfile.TemporaryDirectory() as scratch:
        output_dir = options.output_dir or scratch
        start = time.perf_counter()
        with _open_generator(model_path, options) as generator:
            note = _speed_note(generator)
            load_s = time.perf_counter() - start
            params = {
                "prompt": PROMPT,
                "height": options.height,
                "width": options.width,
                "num_frames": options.num_frames,
                "seed": 42,
                "output_path": output_dir,
            }
            if options.num_inference_steps is not None:
                params["num_inference_steps"] = options.num_inference_steps
            if options.cache_dit_params is not None:
                params["return_frames"] = True  # to compare the cached frames with these
            cold, warm, warm_error = _run_requests(generator, params, options.repeats)
            peaks = _stage_peaks(generator)
            rows = _rows_from_results("generate", config, cold, warm, load_s, note, peaks, warm_error)
            extras = (
                (options.cache_dit_params is not None, "ours, Cache-DiT", _cached_rows),
                (options.silent_request, "ours silent", _silent_rows),
                (options.expand_prompts_request, "ours expand_prompts", _expanded_rows),
            )
            for wanted, name, extra_rows in extras:
                if not wanted:
                    continue
                # Its own error row: raising, it turned the whole stage into one, losing the rows measured above.
                try:
                    rows += extra_rows(generator, params, options, config, warm or [cold])
                except Exception as error:  # noqa: BLE001 (a failure is a table row)
                    rows.append(BenchRow(stage="generate", name=name, config=config,
                                         error=f"{error_type_name(error)}: {error}"))
    _free()
    return rows


def _cached_rows(generator, params: dict, options: EndToEndOptions, config: str, uncached: list) -> list[BenchRow]:
    """The same requests with Cache-DiT on (`options.cache_dit_params`), after the uncached ones: a first one (a
    cached step may compile new shapes) and `repeats` warm ones, the warm median compared with the uncached."""
    cached_params = {**params, "cache_dit_params": options.cache_dit_params}
    first, warm, warm_error = _run_requests(generator, cached_params, options.repeats)
    runs = warm or [first]
    seconds = statistics.median(r.timings["total"] for r in runs)
    baseline = statistics.median(r.timings["total"] for r in uncached)
    denoise = statistics.median(r.timings["denoise"] for r in runs)
    baseline_denoise = statistics.median(r.timings["denoise"] for r in uncached)
    # Frames of the cached request against the uncached one of the same seed: how far caching moved the output.
    difference = float(abs(runs[-1].frames.astype("int16") - uncached[-1].frames).mean()) \
        if runs[-1].frames is not None and uncached[-1].frames is not None else None
    note = (f"cache_dit_params {options.cache_dit_params}; {runs[-1].notes[-1].rstrip('.') if runs[-1].notes else ''}; "
            f"total x{baseline / seconds:.2f}, denoise x{baseline_denoise / denoise:.2f} against uncached"
            + (f"; frames differ from uncached by {difference:.2f}/255 on average" if difference is not None else ""))
    rows = [BenchRow(stage="generate", name="ours warm, Cache-DiT" if warm else "ours, Cache-DiT", config=config,
                     seconds=seconds, times_s=tuple(r.timings["total"] for r in runs),
                     peak_memory_gib=max(r.peak_memory_mb for r in runs) / 1024,
                     breakdown_s=_median_breakdown([r.timings for r in runs]), note=note)]
    return rows + _warm_error_rows("ours warm, Cache-DiT", config, warm_error)


def _warm_error_rows(name: str, config: str, warm_error: str | None) -> list[BenchRow]:
    """The error row of an extra request's failed warm runs after its first run's row ([] when they ran)."""
    return [] if warm_error is None else [BenchRow(stage="generate", name=name, config=config, error=warm_error)]


def _silent_rows(generator, params: dict, options: EndToEndOptions, config: str, with_audio: list) -> list[BenchRow]:
    """The same request with sample_audio=False, after the ones with audio: its first run (the DiT's blocks meet a
    sequence without the audio tokens, a shape the warm-ups do not compile) and `repeats` warm ones, whose median
    step is compared with the audio requests' step of the same run."""
    first, warm, warm_error = _run_requests(generator, {**params, "sample_audio": False}, options.repeats)
    step = statistics.median(r.timings["denoise_step_median"] for r in with_audio) \
        if all("denoise_step_median" in r.timings for r in with_audio) else None
    rows = []
    for name, runs in (("ours silent, first", [first]), ("ours silent, warm", warm)):
        if not runs:
            continue
        breakdown = _median_breakdown([r.timings for r in runs])
        silent_step = breakdown.get("denoise_step_median")
        note = "sample_audio=False; " + _breakdown_text(breakdown)
        if step is not None and silent_step is not None:
            note += f"; step x{step / silent_step:.3f} against the request with audio ({step:.3f} s)"
        rows.append(BenchRow(stage="generate", name=name, config=config,
                             seconds=statistics.median(r.timings["total"] for r in runs),
                             times_s=tuple(r.timings["total"] for r in runs),
                             peak_memory_gib=max(r.peak_memory_mb for r in runs) / 1024,
                             breakdown_s=breakdown, note=note))
    return rows + _warm_error_rows("ours silent, warm", config, warm_error)


def _expanded_rows(generator, params: dict, options: EndToEndOptions, config: str, plain: list) -> list[BenchRow]:
    """The same request with expand_prompts=True, after the others: its first run (with --compile-prompt-rewrite
    true and no warm-up, the rewrite's compile) and `repeats` warm ones, the rewrite's seconds (`expand_prompt`)
    and the whole request's against the request without it. Random weights rarely write the end token: the rewrite
    runs to `max_sequence_length` (1,024) tokens, the longest a request can ask for."""
    first, warm, warm_error = _run_requests(generator, {**params, "expand_prompts": True}, options.repeats)
    baseline = statistics.median(r.timings["total"] for r in plain)
    mode = "compiled, static cache" if options.compile_prompt_rewrite else "eager"
    rows = []
    for name, runs in (("ours expand_prompts, first", [first]), ("ours expand_prompts, warm", warm)):
        if not runs:
            continue
        breakdown = _median_breakdown([r.timings for r in runs])
        seconds = statistics.median(r.timings["total"] for r in runs)
        rewrite = breakdown.get("expand_prompt")
        note = (f"expand_prompts=True, rewrite {mode}"
                + (f" {rewrite:.2f} s" if rewrite is not None else "")
                + f" ({len(runs[-1].expanded_prompt or '')} characters); +{seconds - baseline:.2f} s against the "
                f"request without it; " + _breakdown_text(breakdown))
        rows.append(BenchRow(stage="generate", name=name, config=config, seconds=seconds,
                             times_s=tuple(r.timings["total"] for r in runs),
                             peak_memory_gib=max(r.peak_memory_mb for r in runs) / 1024,
                             breakdown_s=breakdown, note=note))
    return rows + _warm_error_rows("ours expand_prompts, warm", config, warm_error)


def run_super_resolution(options: EndToEndOptions) -> list[BenchRow]:
    """VSR of a synthetic clip (height x width x num_frames) end to end through `DiffGenerator.upscale`."""
    from k6serve.testing.clips import make_clip

    # Height first, as every other row's config (`Geometry.label`) and --height / --width: written width first, the
    # sr row's 96x64x17 read as a 96-high source beside the dit rows' 64x96x17 of the same flags.
    config = f"x{options.sr_scale:g} of {options.height}x{options.width}x{options.num_frames}"
    with tempfile.TemporaryDirectory() as scratch:
        clip = make_clip(
            Path(scratch) / "source.mp4",
            width=options.width,
            height=options.height,
            num_frames=options.num_frames,
            fps=24,
        )
        if options.tiny:
            from k6serve.testing.tiny_sr_checkpoint import build_sr_checkpoint

            model_path = str(build_sr_checkpoint(Path(scratch) / "tiny_sr"))
        else:
            model_path = _hub_id(SR_VARIANT)
        start = time.perf_counter()
        with _open_generator(model_path, options, super_resolution=True) as generator:
            note = _speed_note(generator)
            load_s = time.perf_counter() - start
            params = {
                "video_path": str(clip),
                "sr_resolution_scale": options.sr_scale,
                "seed": 42,
                "output_path": options.output_dir or scratch,
            }
            cold, warm, warm_error = _run_requests(generator, params, options.repeats)
            peaks = _stage_peaks(generator)
        rows = _rows_from_results("sr", config, cold, warm, load_s, note, peaks, warm_error)  # the MP4s still there
    _free()
    return rows


def _free() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()
