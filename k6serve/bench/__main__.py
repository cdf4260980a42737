"""`python -m k6serve.bench` / `k6serve bench`: stage-by-stage benchmark against diffusers.

    python -m k6serve.bench --stage dit --variant pro-distill --json dit_pro.json
    python -m k6serve.bench --stage vae --stage audio --stage text
    python -m k6serve.bench --stage generate --variant lite-distill
    python -m k6serve.bench --tiny --stage all          # CPU smoke mode (CI): toy sizes, checks fields

Prints a markdown table (median of `--repeats` warm runs: seconds, TFLOP/s, % of the 790 TFLOP/s floor rate,
speed-up over diffusers, peak memory, cosine similarity to diffusers) and writes the rows as JSON. Each stage
runs in its own try/except, so one failure is recorded as an error row and the others still run.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from k6serve.bench.audio import AudioOptions, run_audio
from k6serve.bench.dit import DitOptions, parse_fp8_entry, run_dit
from k6serve.bench.end_to_end import EndToEndOptions, check_before_loading, run_generate, run_super_resolution
from k6serve.bench.geometry import NUM_TEXT_TOKENS, generation_geometry
from k6serve.bench.report import BenchRow, format_table, write_json
from k6serve.bench.text import TextOptions, run_text
from k6serve.bench.tiny import (
    TINY_HEIGHT,
    TINY_NUM_FRAMES,
    TINY_NUM_TEXT_TOKENS,
    TINY_TRANSFORMER_CONFIG,
    TINY_WIDTH,
)
from k6serve.bench.vae import VaeOptions, run_vae
from k6serve.config import ATTENTION_BACKENDS, PERFORMANCE_MODES, QUANTIZATIONS, VAE_TILING
from k6serve.models.variants import GENERATION, VARIANTS
from k6serve.request import error_type_name
from k6serve.speed.fp8_linears import check_ignored_layers, possible_linear_names

STAGES = ("dit", "vae", "audio", "text", "generate", "sr")
COMPILE_MODES = ("default", "max-autotune-no-cudagraphs", "max-autotune")
GENERATION_VARIANTS = tuple(name for name, v in VARIANTS.items() if v.family == GENERATION)
_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}
_DIT_FLAGS = ("transformer_path", "backends", "skip_reference", "reference_compiled", "skip_eager", "skip_speed",
              "norm_rope_kernel", "fp8_attention", "fp8_linears", "fp8_fast_accumulation", "blas_libraries",
              "compile_backend", "compile_mode")
_GENERATE_FLAGS = ("vae_tiling", "quantization", "quantization_ignored_layers", "num_inference_steps",
                   "cache_dit_params", "silent_request", "expand_prompts_request", "compile_prompt_rewrite")
_ENGINE_FLAGS = ("performance_mode", "offload_prefetch_blocks", "offload_resident_blocks", "cpu_offload_components",
                 "layerwise_offload_components", "component_residency", "attention_backend", "output_dir")
# The stages that read each stage-specific flag (the stages its help names): given with none of them, it is ignored,
# and the bench says so (`ignored_flags`) instead of checking it.
FLAG_STAGES: dict[str, tuple[str, ...]] = {
    **dict.fromkeys(_DIT_FLAGS, ("dit",)),
    **dict.fromkeys(_GENERATE_FLAGS, ("generate",)),
    **dict.fromkeys(_ENGINE_FLAGS, ("generate", "sr")),
    "variant": ("dit", "generate"),
    "warmup": ("dit", "vae", "audio", "text"),
    "dtype": ("dit", "vae", "audio", "text"),
    "compile_vae_decoder": ("vae", "generate", "sr"),
    "sr_scale": ("sr",),
    # audio decodes num_frames' soundtrack; its row's config names the whole size, checked as a generation's
    **dict.fromkeys(("height", "width", "num_frames"), ("dit", "vae", "audio", "generate", "sr")),
}
# The stages whose sizes are a generation's: multiples of 16, 4k+1 frames (the sr stage's source clip is any size).
GEOMETRY_STAGES = ("dit", "vae", "audio", "generate")


def build_parser() -> argparse.ArgumentParser:
    # allow_abbrev=False as generate and serve: "--rep 1" must not silently be --repeats.
    parser = argparse.ArgumentParser(prog="k6serve bench", description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument(
        "--stage",
        action="append",
        choices=(*STAGES, "all"),
        help="Stage(s) to run; repeat the flag for several (default: dit).",
    )
    parser.add_argument(
        "--variant",
        default="pro-distill",
        choices=GENERATION_VARIANTS,
        help="dit: the released config timed; generate: the model run (default pro-distill; --tiny: the toy config and "
        "the demo checkpoint instead; dit with --transformer-path: its config).",
    )
    parser.add_argument(
        "--transformer-path",
        help="dit: a local Diffusers checkpoint folder (its transformer/) or a transformer folder, whose weights "
        "replace the random ones (the inputs stay random); its config, not --variant's, sets the shapes.",
    )
    parser.add_argument(
        "--height",
        type=int,
        help="dit/vae/audio/generate/sr: pixels, a multiple of 16 (default 512; --tiny 64; sr: the source clip's, any "
        "even size).",
    )
    parser.add_argument(
        "--width",
        type=int,
        help="dit/vae/audio/generate/sr: pixels, a multiple of 16 (default 768; --tiny 96; sr: the source clip's, any "
        "even size).",
    )
    parser.add_argument(
        "--num-frames",
        type=int,
        help="dit/vae/audio/generate/sr: 4k+1 frames (default 121; --tiny 17; sr: any number).",
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=3,
        help="Timed warm runs, the median reported (default 3; in generate and sr, the warm requests after the first).",
    )
    # generate/sr never read it: their first request is the warm-up, reported as a row of its own.
    parser.add_argument(
        "--warmup",
        type=int,
        default=1,
        help="dit/vae/audio/text: untimed runs before the timed ones, default 1 (generate/sr: the first request, its "
        "own row).",
    )
    parser.add_argument(
        "--json",
        help="Write the rows, the arguments and the environment to this new JSON file (an existing file, or a folder "
        "that cannot be written, is refused before any stage runs); written after each stage, \"complete\": false "
        "until the last.",
    )
    parser.add_argument(
        "--device",
        default="auto",
        choices=("auto", "cuda", "cpu"),
        help="auto (the default): CUDA when visible (without a GPU, the released sizes need --device cpu: hours a "
        "stage), except with --tiny, which runs on the CPU unless --device cuda.",
    )
    parser.add_argument(
        "--dtype",
        default="bfloat16",
        choices=tuple(_DTYPES),
        help="dit/vae/audio/text: weights and inputs, default bfloat16 (generate/sr: the engine's own, bf16 on CUDA, "
        "fp32 on the CPU).",
    )
    parser.add_argument(
        "--tiny", action="store_true", help="CPU smoke mode: toy sizes for every stage."
    )
    parser.add_argument(
        "--backends",
        help="dit: attention backends for our DiT, comma-separated "
        "(default: fa,torch_sdpa on CUDA, torch_sdpa elsewhere).",
    )
    parser.add_argument("--skip-reference", action="store_true", help="dit: do not run diffusers' DiT.")
    parser.add_argument(
        "--reference-compiled",
        action="store_true",
        help="dit: also time diffusers' DiT with compile_repeated_blocks(fullgraph=True).",
    )
    parser.add_argument(
        "--skip-eager", action="store_true", help="dit: do not time our DiT without transforms."
    )
    parser.add_argument(
        "--skip-speed", action="store_true", help="dit: do not time our fused + compiled DiT."
    )
    parser.add_argument(
        "--norm-rope-kernel",
        action="store_true",
        help="dit: also time the fused + compiled DiT with the Triton RMSNorm + RoPE kernel "
        "(K6SERVE_FUSED_NORM_ROPE's transform).",
    )
    parser.add_argument(
        "--fp8-attention",
        action="store_true",
        help="dit: then time the last fast configuration once more with --attention-backend fa_fp8 "
        "(FA3's e4m3 kernel for the long attentions; lossy, opt-in; ops/fp8_attention.py).",
    )
    parser.add_argument(
        "--fp8-linears",
        nargs="+",
        type=_fp8_entry,
        default=[],
        metavar="SCOPE[:PATTERN,...]",
        help="dit: then time the last fast configuration once more per entry with video-token GEMMs in e4m3, each "
        "from the bf16 model (SCOPE ffn: the video feed-forward; video: every video-token linear; PATTERNs keep "
        "linears in bf16 as --quantization-ignored-layers does, e.g. ffn:visual_transformer_blocks.[0-9]; lossy, "
        "opt-in; speed/fp8_linears.py).",
    )
    parser.add_argument(
        "--fp8-fast-accumulation",
        action="store_true",
        help="dit: after the --fp8-linears rows, one more with cuBLASLt's FP8 fast accumulation.",
    )
    parser.add_argument(
        "--blas-libraries",
        nargs="+",
        choices=("cublas", "cublaslt"),
        default=[],
        metavar="{cublas,cublaslt}",
        help="dit: then time the last bf16 fast configuration once more per entry, in order, with torch's preferred "
        "BLAS library set to it (e.g. cublaslt cublas: the second row a control of the GPU's drift); nothing "
        "recompiles.",
    )
    parser.add_argument(
        "--compile-backend", help="dit: torch.compile backend (default inductor; --tiny eager)."
    )
    parser.add_argument(
        "--compile-mode",
        choices=COMPILE_MODES,
        help="dit: torch.compile mode of our blocks (inductor only), e.g. max-autotune-no-cudagraphs to let "
        "inductor try Triton GEMMs with the GELU fused in.",
    )
    parser.add_argument(
        "--compile-vae-decoder",
        action="store_true",
        help="vae: also time a compiled VAE decoder; generate/sr: run the engine with --compile-vae true.",
    )
    parser.add_argument(
        "--performance-mode",
        default="speed",
        choices=PERFORMANCE_MODES,
        help="generate/sr: the engine's performance mode (default speed).",
    )
    parser.add_argument(
        "--vae-tiling",
        default="auto",
        choices=VAE_TILING,
        help="generate: the engine's --vae-tiling (default auto: on with --performance-mode memory on a GPU).",
    )
    parser.add_argument(
        "--offload-prefetch-blocks",
        type=int,
        default=1,
        help="generate/sr: the engine's --offload-prefetch-blocks (default 1; where blocks are streamed: "
        "--performance-mode memory or --layerwise-offload-components).",
    )
    parser.add_argument(
        "--offload-resident-blocks",
        type=int,
        default=0,
        help="generate/sr: the engine's --offload-resident-blocks (default 0; where blocks are streamed: "
        "--performance-mode memory or --layerwise-offload-components).",
    )
    parser.add_argument(
        "--quantization",
        choices=QUANTIZATIONS,
        default="none",
        help="generate: the engine's --quantization (default none; fp8: the DiT's video-token linears in e4m3; lossy).",
    )
    parser.add_argument(
        "--quantization-ignored-layers",
        nargs="+",
        default=(),
        metavar="PATTERN",
        help="generate: the engine's --quantization-ignored-layers.",
    )
    parser.add_argument(
        "--cpu-offload-components",
        nargs="+",
        default=(),
        metavar="COMPONENT",
        help="generate/sr: the engine's --cpu-offload-components (components offloaded whole between stages).",
    )
    parser.add_argument(
        "--layerwise-offload-components",
        nargs="+",
        default=(),
        metavar="COMPONENT",
        help="generate/sr: the engine's --layerwise-offload-components (components whose blocks are streamed).",
    )
    parser.add_argument(
        "--component-residency",
        nargs="+",
        default=(),
        metavar="NAME=MODE",
        help="generate/sr: the engine's --component-residency.",
    )
    parser.add_argument(
        "--attention-backend",
        default="auto",
        choices=ATTENTION_BACKENDS,
        help="generate/sr: the engine's attention backend (default auto).",
    )
    parser.add_argument(
        "--num-inference-steps", type=int, help="generate: steps (default: the variant's)."
    )
    parser.add_argument(
        "--cache-dit-params",
        help="generate: after the uncached requests, run the same requests with Cache-DiT on with these "
        "cache_dit_params (a JSON object, '{}' for the defaults) and add their rows: the same run, the same GPU.",
    )
    parser.add_argument(
        "--silent-request",
        action="store_true",
        help="generate: then the same request with sample_audio=False (a silent video), a first and the warm ones, "
        "their step compared with the request with audio: the same run, the same GPU.",
    )
    parser.add_argument(
        "--expand-prompts-request",
        action="store_true",
        help="generate: then the same request with expand_prompts=True (the prompt rewritten first, up to 1,024 "
        "tokens), a first and the warm ones, with the rewrite's seconds and the cost against the plain request.",
    )
    parser.add_argument(
        "--compile-prompt-rewrite",
        action="store_true",
        help="generate: the engine with --compile-prompt-rewrite true (the rewrite through a static KV cache, its "
        "decoding step compiled; no warm-up here, so the first rewriting request compiles it).",
    )
    parser.add_argument("--sr-scale", type=float, default=2.0, help="sr: upscale factor, 2, 4 or 2.25 (default 2).")
    parser.add_argument(
        "--output-dir", help="generate/sr: keep the MP4s here (default: a temporary folder)."
    )
    return parser


def _fp8_entry(text: str) -> str:
    """argparse type of an --fp8-linears entry: checked here, so a typo fails before the model is built."""
    try:
        parse_fp8_entry(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    return text


def _transformer_dir(path: str) -> Path:
    """The folder with the DiT's config.json: `path` itself, or a Diffusers checkpoint's transformer/."""
    folder = Path(path).expanduser()
    for candidate in (folder, folder / "transformer"):
        if (candidate / "config.json").is_file() and any(candidate.glob("*.safetensors")):
            return candidate
    raise SystemExit(f"--transformer-path {path}: neither it nor its transformer/ holds a config.json with "
                     "safetensors weights; give a local Diffusers checkpoint folder (download it first, e.g. "
                     "`huggingface-cli download kandinskylab/Kandinsky-6.0-Pro-distill-5s-Diffusers --include "
                     "'transformer/*' --local-dir DIR`).")


def _check_fp8_patterns(entries: list[str], transformer_config: dict) -> None:
    """A pattern that keeps nothing in bf16 is refused before the model is built, not after the bf16 rows."""
    from k6serve.models.kandinsky6.config import Kandinsky6TransformerConfig

    num_blocks = Kandinsky6TransformerConfig.from_json_dict(transformer_config).num_visual_blocks
    names = possible_linear_names(num_blocks)
    for entry in entries:
        try:
            check_ignored_layers(parse_fp8_entry(entry)[1], names)
        except ValueError as error:
            raise SystemExit(f"--fp8-linears {entry}: {error}") from None


def _check_dit_flags(args: argparse.Namespace, device: torch.device, compile_backend: str,
                     transformer_config: dict) -> None:
    """The dit flags' combinations that cannot run or would add nothing, refused before any stage runs."""
    if args.fp8_attention and args.skip_speed:
        # The FP8 row re-times the fused + compiled DiT; without it the flag would add nothing, silently.
        raise SystemExit("--fp8-attention times the fused + compiled DiT once more with fa_fp8: drop --skip-speed")
    if args.fp8_linears and args.skip_speed:
        raise SystemExit("--fp8-linears times the fused + compiled DiT once more in e4m3: drop --skip-speed")
    if args.blas_libraries and args.skip_speed:
        raise SystemExit("--blas-libraries times the fused + compiled DiT once more per library: drop --skip-speed")
    if args.blas_libraries and device.type != "cuda":
        raise SystemExit("--blas-libraries picks among cuBLAS's kernels: it needs a CUDA device")
    # Each of these adds rows to a part that the skip flag removes: the row went missing without a word.
    if args.reference_compiled and args.skip_reference:
        raise SystemExit("--reference-compiled times diffusers' DiT compiled after its eager row: "
                         "drop --skip-reference")
    if args.norm_rope_kernel and args.skip_speed:
        raise SystemExit("--norm-rope-kernel times the fused + compiled DiT once more with the kernel: "
                         "drop --skip-speed")
    if args.compile_mode and args.skip_speed:
        raise SystemExit("--compile-mode sets how the fused + compiled DiT compiles: drop --skip-speed")
    if args.skip_reference and args.skip_eager and args.skip_speed:
        raise SystemExit("--skip-reference, --skip-eager and --skip-speed together leave the dit stage no row to time")
    if args.fp8_fast_accumulation and not args.fp8_linears:
        raise SystemExit("--fp8-fast-accumulation times the --fp8-linears rows' model once more: add --fp8-linears")
    _check_fp8_patterns(args.fp8_linears, transformer_config)
    from torch._dynamo import list_backends

    if compile_backend not in list_backends(exclude_tags=()):
        # A typo (inductr) failed each compiled row after the model was built (minutes at full size).
        raise SystemExit(f"--compile-backend {compile_backend!r} is no torch.compile backend; e.g. inductor, eager "
                         "or aot_eager (torch._dynamo.list_backends(exclude_tags=()) lists them all)")
    if args.compile_mode and compile_backend != "inductor":
        # torch.compile refuses a mode with any other backend; say so before minutes of setup.
        raise SystemExit(f"--compile-mode needs the inductor backend (got --compile-backend {compile_backend})")


def _json_path(text: str) -> Path:
    """--json's file, checked before any stage runs: a folder, a file in the way or an unwritable folder ended the
    run in a traceback after every stage had run, and an existing file (an earlier run's rows) was replaced."""
    if not text.strip():
        raise SystemExit("--json is empty; give the file to write the rows to (e.g. --json bench.json)")
    if text == "-":
        # Read elsewhere as stdout, which carries the table here: it wrote a file named "-".
        raise SystemExit("--json - would write a file named '-' (stdout carries the table); give a file path, e.g. "
                         "--json bench.json")
    path = Path(text).expanduser()  # `--json=~/x.json` reaches us unexpanded, as --transformer-path may
    if path.is_dir():
        raise SystemExit(f"--json {text} is a folder; give the file to write in it (e.g. --json {path / 'bench.json'})")
    if path.exists() or path.is_symlink():
        raise SystemExit(f"--json {text} already exists, and the bench never replaces a file (it may hold an earlier "
                         "run's rows); delete it or give another path")
    _writable_folder(path.parent, f"--json {text}")
    return path


def _writable_folder(folder: Path, flag: str) -> None:
    """Create `folder` and prove it writable now, before any stage runs, or refuse `flag` (e.g. "--json PATH")."""
    if folder.exists() and not folder.is_dir():
        raise SystemExit(f"{flag}: {folder} is a file, not a folder; give a path in a folder")
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as error:
        raise SystemExit(f"cannot write {flag} ({error.strerror or error}); give a writable folder") from None


def _json_object(text: str | None, flag: str) -> dict | None:
    if text is None:
        return None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise SystemExit(f"{flag} must be a JSON object ({exc})") from None
    if not isinstance(value, dict):
        raise SystemExit(f"{flag} must be a JSON object, got {text!r}")
    return value


def _device(name: str, *, tiny: bool = False) -> torch.device:
    if name == "auto":
        # --tiny is the CPU smoke mode (CI): on a GPU host it still checks the CPU path, whose rows the tests know;
        # `--tiny --device cuda` runs the toy sizes on the GPU.
        if not tiny and not torch.cuda.is_available():
            # A plain `k6serve bench` on a host without a GPU built the released Pro DiT (56 GiB in bf16) on the CPU
            # and ran it for hours; asked for by name it still runs.
            raise ValueError("no CUDA GPU is visible, and the released sizes on the CPU take hours and tens of GiB of "
                             "memory a stage; add --tiny for the CPU smoke mode, or --device cpu to run them anyway.")
        return torch.device("cuda" if torch.cuda.is_available() and not tiny else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError(
            "--device cuda was requested but no CUDA GPU is visible; use --device cpu."
        )
    return torch.device(name)


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
            flag = "--" + dest.replace("_", "-")
            notes.append(f"{flag} is read by the {'/'.join(readers)} stage{'s' if len(readers) > 1 else ''} only, "
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

    device = _device(args.device, tiny=args.tiny)
    dtype = _DTYPES[args.dtype]
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
    weights_dir = _transformer_dir(args.transformer_path) if args.transformer_path and runs_dit else None
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
        cache_dit_params=_json_object(args.cache_dit_params, "--cache-dit-params") if "generate" in stages else None,
        silent_request=args.silent_request,
        expand_prompts_request=args.expand_prompts_request,
        compile_prompt_rewrite=args.compile_prompt_rewrite,
    )
    if args.output_dir is not None and {"generate", "sr"} & set(stages):
        _writable_folder(Path(args.output_dir).expanduser(), f"--output-dir {args.output_dir}")
    try:
        check_before_loading(end_to_end, stages)
    except ValueError as error:
        # The engine's --compile-vae true is this command's --compile-vae-decoder: "drop --compile-vae" named a
        # flag the bench does not have; its --compile-prompt-rewrite takes no value.
        message = re.sub(r"--compile-vae( true)?\b(?!-)", "--compile-vae-decoder", str(error))
        raise SystemExit(message.replace("--compile-prompt-rewrite true", "--compile-prompt-rewrite")) from None
    compile_backend = args.compile_backend or ("eager" if args.tiny else "inductor")
    if runs_dit:
        _check_dit_flags(args, device, compile_backend, transformer_config)
    dit = DitOptions(
        label=str(weights_dir) if weights_dir else "tiny" if args.tiny else args.variant,
        transformer_config=transformer_config,
        weights_dir=weights_dir,
        geometry=geometry,
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
                geometry=geometry,
                device=device,
                dtype=dtype,
                tiny=args.tiny,
                compile_decoder=args.compile_vae_decoder,
                **timing,
            )
        ),
        "audio": lambda: run_audio(
            AudioOptions(geometry=geometry, device=device, dtype=dtype, tiny=args.tiny, **timing)
        ),
        "text": lambda: run_text(TextOptions(device=device, dtype=dtype, tiny=args.tiny, **timing)),
        "generate": lambda: run_generate(end_to_end),
        "sr": lambda: run_super_resolution(end_to_end),
    }


def run_stages(args: argparse.Namespace, *, log: Callable[[str], None] = print,
               runners: dict[str, Callable[[], list[BenchRow]]] | None = None,
               after_stage: Callable[[list[BenchRow]], None] | None = None) -> list[BenchRow]:
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


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns 0 when every row ran, 1 when any row recorded an error (or the JSON could not be
    written), 130 after Ctrl-C; a refused flag exits 2 before any stage runs, as argparse's own refusals and
    `k6serve generate`'s."""
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    # `k6serve bench -- ARGS` forwards the separator too.
    args = parser.parse_args(argv[1:] if argv[:1] == ["--"] else argv)
    try:
        device = _device(args.device, tiny=args.tiny)
    except ValueError as error:
        parser.error(str(error))
    try:
        json_path = _json_path(args.json) if args.json is not None else None
        runners = stage_runners(args)
    except SystemExit as refusal:
        # The checks raise SystemExit(message), which exited 1, the code of a row that failed: a script could not
        # tell "nothing ran" from "a row failed". Exit 2 as argparse's refusals, without their page of usage.
        if isinstance(refusal.code, str):
            parser.exit(2, f"{parser.prog}: error: {refusal.code}\n")
        raise
    written = []  # whether this run has written the file already (then it replaces its own)

    def save(rows: list[BenchRow], *, complete: bool) -> bool:
        try:
            write_json(json_path, rows, vars(args), device=device, notes=ignored_flags(args), complete=complete,
                       replace=bool(written))
        except OSError as error:
            # Checked writable before the stages, it can still fail (disk full): a message, not a traceback.
            print(f"[bench] could not write --json {args.json}: {error}", file=sys.stderr, flush=True)
            return False
        written.append(True)
        return True

    # After each stage, so a run killed later (out of host memory, a timeout, Ctrl-C) keeps the stages that finished,
    # marked "complete": false; it lost every row.
    after_stage = (lambda rows: save(rows, complete=False)) if json_path is not None else None
    try:
        rows = run_stages(args, log=lambda text: print(text, flush=True), runners=runners, after_stage=after_stage)
    except KeyboardInterrupt:
        kept = f"; --json {args.json} holds the stages that finished" if written else ""
        print(f"\n[bench] interrupted{kept}", file=sys.stderr, flush=True)
        return 130
    print("\n" + format_table(rows), flush=True)
    if json_path is not None:
        if not save(rows, complete=True):
            return 1  # the rows are the table above
        print(f"[bench] wrote {json_path}", flush=True)
    return 1 if any(row.error for row in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
