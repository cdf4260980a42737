"""`python -m k6serve.bench` / `k6serve bench`: stage-by-stage benchmark against diffusers.

The command's flags (`build_parser`, whose description is the line above, as it was __main__.py's) and the stages
that read each stage-specific flag (`FLAG_STAGES`); __main__.py runs the command.
"""

from __future__ import annotations

import argparse

import torch

from k6serve.bench.dit import parse_fp8_entry
from k6serve.cli.help_format import HelpFormatter
from k6serve.config import ATTENTION_BACKENDS, PERFORMANCE_MODES, QUANTIZATIONS, VAE_TILING
from k6serve.models.variants import GENERATION, VARIANTS

STAGES = ("dit", "vae", "audio", "text", "generate", "sr")
COMPILE_MODES = ("default", "max-autotune-no-cudagraphs", "max-autotune")
GENERATION_VARIANTS = tuple(name for name, v in VARIANTS.items() if v.family == GENERATION)
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}
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
    parser = argparse.ArgumentParser(prog="k6serve bench", description=__doc__.split("\n\n")[0], allow_abbrev=False,
                                     formatter_class=HelpFormatter)
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
        choices=tuple(DTYPES),
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
