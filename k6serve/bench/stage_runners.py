"""The stages a `k6serve bench` run asks for: one runner per stage with its options resolved and checked from the
flags, run in order (a failing stage becomes one error row), and the flags no stage of the run reads."""

from __future__ import annotations

import argparse
import re
from collections.abc import Callable
from pathlib import Path
from typing import cast

from k6serve.bench.audio import AudioOptions, run_audio
from k6serve.bench.dit import DitOptions, run_dit
from k6serve.bench.end_to_end import EndToEndOptions, check_before_loading, run_generate, run_super_resolution
from k6serve.bench.flag_checks import bench_device, check_dit_flags, json_object, transformer_dir, writable_folder
from k6serve.bench.flags import DTYPES, FLAG_STAGES, GEOMETRY_STAGES, STAGES, build_parser
from k6serve.bench.geometry import NUM_TEXT_TOKENS, GenerationGeometry, generation_geometry
from k6serve.bench.report import BenchRow, format_table
from k6serve.bench.text import TextOptions, run_text
from k6serve.bench.tiny import (
    TINY_HEIGHT,
    TINY_NUM_FRAMES,
    TINY_NUM_TEXT_TOKENS,
    TINY_TRANSFORMER_CONFIG,
    TINY_WIDTH,
)
from k6serve.bench.vae import VaeOptions, run_vae
from k6serve.config import flag_name
from k6serve.models.variants import VARIANTS
from k6serve.request import error_type_name


def _stages(args: argparse.Namespace) -> list[str]:
    requested = args.stage or ["dit"]
    return list(STAGES) if "all" in requested else list(dict.fromkeys(requested))


def ignored_flags(args: argparse.Namespace) -> list[str]:
    """One line per stage-specific flag given (not at its default) that no stage of this run reads."""
    parser = build_parser()
    stages = _stages(args)
    notes = []
    for dest, readers in FLAG_STAGES.items():
        # A list flag's default is [] or () and its value a list: compared as lists.
        value, default = (list(item) if isinstance(item, (list, tuple)) else item
                          for item in (getattr(args, dest), parser.get_default(dest)))
        if value == default:
            continue
        if not set(readers) & set(stages):
            plural = "s" if len(readers) > 1 else ""
            notes.append(f"{flag_name(dest)} is read by the {'/'.join(readers)} stage{plural} only, "
                         f"not run here ({', '.join(stages)}): ignored, and not checked")
    # --variant's own exceptions (its help): a --tiny run times the toy config and the demo checkpoint, and the dit
    # stage takes a --transformer-path's config; `--tiny --variant lite-distill` ran the toy model without a word.
    if args.variant != parser.get_default("variant") and {"dit", "generate"} & set(stages):
        if args.tiny:
            notes.append(f"--variant {args.variant} is not read with --tiny (dit times the toy config, generate runs "
                         "the demo checkpoint): ignored")
        elif args.transformer_path and "generate" not in stages:
            notes.append(f"--variant {args.variant} is not read by the dit stage with --transformer-path (its "
                         "config.json sets the shapes): ignored")
    return notes


def stage_runners(args: argparse.Namespace) -> dict[str, Callable[[], list[BenchRow]]]:
    """One zero-argument runner per stage, with every option resolved from `args`."""
    from k6serve.models.kandinsky6.config_before_loading import released_transformer_config

    device = bench_device(args.device, tiny=args.tiny)
    dtype = DTYPES[args.dtype]
    # `is None`, not `or`: --num-frames 0 ran the default size as if the flag were not given.
    height = args.height if args.height is not None else TINY_HEIGHT if args.tiny else 512
    width = args.width if args.width is not None else TINY_WIDTH if args.tiny else 768
    num_frames = args.num_frames if args.num_frames is not None else TINY_NUM_FRAMES if args.tiny else 121
    num_text_tokens = TINY_NUM_TEXT_TOKENS if args.tiny else NUM_TEXT_TOKENS
    try:
        geometry = generation_geometry(height, width, num_frames, num_text_tokens=num_text_tokens)
    except ValueError as error:
        # A size no stage can run (--height 30) ended in a traceback; refused like the other flags set up here. Only
        # for the stages that need a generation's size: `--stage sr --height 540 --width 960` (a 540p source) was
        # refused, though the SR pipeline upscales any even size.
        if set(GEOMETRY_STAGES) & set(_stages(args)):
            raise SystemExit(f"--height / --width / --num-frames: {error}") from None
        geometry = None
    if geometry is not None and "dit" in _stages(args):
        from k6serve.models.common.rope import MAX_VIDEO_POSITIONS_PER_AXIS

        # The DiT refused a larger grid in every row, after the model was built (generate's request says the same).
        grid = (geometry.num_latent_frames, geometry.latent_height // 2, geometry.latent_width // 2)
        limit = MAX_VIDEO_POSITIONS_PER_AXIS
        if max(grid) > limit:
            shape = "x".join(map(str, grid))
            raise SystemExit(f"--height / --width / --num-frames: the DiT's video token grid {shape} exceeds its RoPE "
                             f"table of {limit} positions an axis (at most {limit * 16} pixels a side, "
                             f"{(limit - 1) * 4 + 1} frames)")
    # Checked here, once: measure() refusing them inside each stage turned every stage into the same error row.
    if args.repeats < 1:
        raise SystemExit(f"--repeats must be >= 1 (the median of the timed runs is reported), got {args.repeats}")
    if args.warmup < 0:
        raise SystemExit(f"--warmup must be >= 0, got {args.warmup}")
    # A flag of a stage not run is not checked (ignored_flags says it is ignored): --transformer-path was refused with
    # --stage vae, which never reads it, while the three skip flags were already only checked with the dit stage.
    stages = _stages(args)
    runs_dit = "dit" in stages
    default_backends = "fa,torch_sdpa" if device.type == "cuda" else "torch_sdpa"
    backends = tuple(b.strip() for b in (args.backends or default_backends).split(",") if b.strip())
    if not backends and runs_dit:
        # `--backends ,` left none: the dit stage ran diffusers' rows alone, with no row of ours and no word why.
        raise SystemExit(f"--backends {args.backends!r} names no attention backend; give one or more, comma-separated "
                         f"(e.g. {default_backends}), or leave the flag out")
    timing = {"repeats": args.repeats, "warmup": args.warmup}
    weights_dir = transformer_dir(args.transformer_path) if args.transformer_path and runs_dit else None
    if weights_dir is not None:
        from k6serve.models.checkpoint_files import read_json_file

        transformer_config = read_json_file(weights_dir / "config.json")
    else:
        transformer_config = (
            TINY_TRANSFORMER_CONFIG
            if args.tiny
            else released_transformer_config(VARIANTS[args.variant])
        )
    end_to_end = EndToEndOptions(
        variant=args.variant,
        height=height,
        width=width,
        num_frames=num_frames,
        device=str(device),
        performance_mode=args.performance_mode,
        attention_backend=args.attention_backend,
        num_inference_steps=args.num_inference_steps,
        sr_scale=args.sr_scale,
        tiny=args.tiny,
        repeats=args.repeats,
        output_dir=args.output_dir,
        compile_vae=args.compile_vae_decoder,
        vae_tiling=args.vae_tiling,
        offload_prefetch_blocks=args.offload_prefetch_blocks,
        offload_resident_blocks=args.offload_resident_blocks,
        cpu_offload_components=tuple(args.cpu_offload_components),
        layerwise_offload_components=tuple(args.layerwise_offload_components),
        component_residency=tuple(args.component_residency),
        quantization=args.quantization,
        quantization_ignored_layers=tuple(args.quantization_ignored_layers),
        cache_dit_params=json_object(args.cache_dit_params, "--cache-dit-params") if "generate" in stages else None,
        silent_request=args.silent_request,
        expand_prompts_request=args.expand_prompts_request,
        compile_prompt_rewrite=args.compile_prompt_rewrite,
    )
    if args.output_dir is not None and {"generate", "sr"} & set(stages):
        writable_folder(Path(args.output_dir).expanduser(), f"--output-dir {args.output_dir}")
    try:
        check_before_loading(end_to_end, stages)
    except ValueError as error:
        # The engine's --compile-vae true is this command's --compile-vae-decoder: "drop --compile-vae" named a
        # flag the bench does not have; its --compile-prompt-rewrite takes no value.
        message = re.sub(r"--compile-vae( true)?\b(?!-)", "--compile-vae-decoder", str(error))
        raise SystemExit(message.replace("--compile-prompt-rewrite true", "--compile-prompt-rewrite")) from None
    compile_backend = args.compile_backend or ("eager" if args.tiny else "inductor")
    if runs_dit:
        check_dit_flags(args, device, compile_backend, transformer_config)
    # None only when no stage that reads it runs (GEOMETRY_STAGES); DitOptions is built for every run all the same
    stage_geometry = cast(GenerationGeometry, geometry)
    dit = DitOptions(
        label=str(weights_dir) if weights_dir else "tiny" if args.tiny else args.variant,
        transformer_config=transformer_config,
        weights_dir=weights_dir,
        geometry=stage_geometry,
        device=device,
        dtype=dtype,
        backends=backends,
        eager=not args.skip_eager,
        speed=not args.skip_speed,
        reference=not args.skip_reference,
        reference_compiled=args.reference_compiled,
        norm_rope_kernel=args.norm_rope_kernel,
        fp8_attention=args.fp8_attention,
        fp8_linears=tuple(args.fp8_linears),
        fp8_fast_accumulation=args.fp8_fast_accumulation,
        blas_libraries=tuple(args.blas_libraries),
        compile_backend=compile_backend,
        compile_mode=args.compile_mode,
        **timing,
    )
    return {
        "dit": lambda: run_dit(dit),
        "vae": lambda: run_vae(
            VaeOptions(
                geometry=stage_geometry,
                device=device,
                dtype=dtype,
                tiny=args.tiny,
                compile_decoder=args.compile_vae_decoder,
                **timing,
            )
        ),
        "audio": lambda: run_audio(
            AudioOptions(geometry=stage_geometry, device=device, dtype=dtype, tiny=args.tiny, **timing)
        ),
        "text": lambda: run_text(TextOptions(device=device, dtype=dtype, tiny=args.tiny, **timing)),
        "generate": lambda: run_generate(end_to_end),
        "sr": lambda: run_super_resolution(end_to_end),
    }


def run_stages(args: argparse.Namespace, *, log: Callable[[str], None] = print,
               runners: dict[str, Callable[[], list[BenchRow]]] | None = None,
               after_stage: Callable[[list[BenchRow]], object] | None = None) -> list[BenchRow]:
    """Run the requested stages in order; a failing stage becomes one error row. `runners`: `stage_runners(args)`,
    when the caller built them already; `after_stage`: called with the rows so far after each stage but the last."""
    runners = stage_runners(args) if runners is None else runners
    for note in ignored_flags(args):
        log(f"[bench] note: {note}")
    rows: list[BenchRow] = []
    for stage in _stages(args):
        log(f"[bench] stage {stage} ...")
        try:
            stage_rows = runners[stage]()
        except Exception as error:  # noqa: BLE001 (one stage's failure must not lose the others)
            stage_rows = [
                BenchRow(
                    stage=stage, name="-", config="-", error=f"{error_type_name(error)}: {error}"
                )
            ]
        rows += stage_rows
        log(format_table(stage_rows))
        if after_stage is not None and stage != _stages(args)[-1]:
            after_stage(rows)
    return rows
