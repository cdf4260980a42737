"""The flags of `k6serve generate` and `k6serve serve`, and the parser of the `k6serve` command.

Engine flags come from the config dataclasses (`ENGINE_FLAGS`), request flags from `SamplingParams` (the one
definition shared with the API and HTTP); the server's own flags are in serve_flags.py.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import types
import typing
from typing import Any

from k6serve.cli.help_format import HelpFormatter
from k6serve.config import (
    ATTENTION_BACKENDS,
    DEVICES,
    DTYPES,
    ENCODER_PARALLEL,
    LOAD_FORMATS,
    LORA_MERGE_MODES,
    PARALLEL_DECODE_MODES,
    PERFORMANCE_MODES,
    QUANTIZATIONS,
    VAE_TILING,
    WARMUP_MODES,
    flag_name,
)
from k6serve.reference_names import aliases_of, value_fix
from k6serve.request import SamplingParams, parameter_fields

ENGINE_FLAGS: list[tuple[str, dict[str, Any]]] = [
    ("model_path", dict(help="Local Diffusers checkpoint folder, hub id, or 'demo' / 'demo-sr' (built-in tiny random "
                             "generation / super-resolution models).")),
    ("model_id", dict(help="Released model name to route a renamed folder (e.g. "
                           "Kandinsky-6.0-Pro-distill-5s-Diffusers).")),
    ("revision", dict(help="Hub revision (branch, tag or commit) to download; ignored, with a warning, for a local "
                        "folder, the demos or --load-format dummy.")),
    ("load_format", dict(choices=LOAD_FORMATS, help="auto (default): the checkpoint's weights; 'dummy' builds the "
                         "released sizes with random weights (benchmarks).")),
    ("dtype", dict(choices=DTYPES, help="Weight/activation dtype (auto, the default: bfloat16 on CUDA, float32 on "
                   "CPU).")),
    ("lora_path", dict(help="LoRA adapter for the generation DiT, applied at start: a diffusers/PEFT .safetensors "
                       "file, a folder holding one, or a hub id.")),
    ("lora_nickname", dict(help="Name of the --lora-path adapter (set_lora / list_loras refer to it; default "
                                "'default').")),
    ("lora_scale", dict(type=float, help="Strength of the --lora-path adapter, from -100 to 100 (default 1.0; "
                        "adapters are used at about -2 to 2).")),
    ("lora_alpha", dict(type=float, help="Alpha of the --lora-path adapter, overriding the file's (scale alpha/rank; "
                        "from -10000 to 10000; default: the file's, else rank).")),
    ("lora_merge_mode", dict(choices=LORA_MERGE_MODES, help="merge: add the update to the weights (exact unmerge "
                             "from a host snapshot); dynamic: add it per call, weights untouched; auto (default): "
                             "merge (dynamic with --use-fsdp-inference). Also the default of set_lora requests. "
                             "Requests choosing their own loras need dynamic.")),
    ("quantization", dict(choices=QUANTIZATIONS, help="fp8: the generation DiT's video-token linears in e4m3 with "
                          "row-wise scales, quantized at load (lossy, opt-in; GPUs of compute capability >= 8.9). "
                          "Measured on an H200: Pro-distill's forward 5.81 -> 4.94 s, peak 59.6 -> 44.0 GiB, velocity "
                          "cosine 0.998 to bf16. Needs the DiT resident (refused when an offload mode or flag "
                          "offloads it), and refused with LoRA, --tp-size and --use-fsdp-inference (default none).")),
    ("quantization_ignored_layers", dict(nargs="+", action="extend", metavar="PATTERN", help="DiT linears that "
                                     "--quantization leaves in bf16: whole dot-separated parts of a module name or a "
                                     "glob over it, e.g. self_attention, '*_attention' (then only the "
                                     "feed-forwards are e4m3) or visual_transformer_blocks.0 (block 0); naming one "
                                     "of Q, K, V keeps all three (one GEMM in speed mode).")),
    ("device", dict(choices=DEVICES, help="Device to run on (auto, the default: CUDA if available).")),
    # The type refuses SGLang's modes (auto, manual) with the fix, before the choices check.
    ("performance_mode", dict(choices=PERFORMANCE_MODES, type=lambda v: _not_a_reference_value("performance_mode", v),
                              help="speed: every optimisation within tolerance; balanced: eager, each component on "
                              "the GPU only for its stage (weights in host memory); memory: balanced, the DiT's and "
                              "text encoders' blocks streamed one at a time and (--vae-tiling auto) the VAE decoded in "
                              "tiles: Pro-distill peaks at 8.3 GiB on an H200 (default speed).")),
    ("offload_prefetch_blocks", dict(type=int, help="When blocks are streamed (--performance-mode memory, or the "
                                 "DiT or a text encoder streamed by the flags below): blocks copied ahead of the "
                                 "running one (default 1). Each costs a block of GPU memory; more hide copies that "
                                 "outlast their block.")),
    ("offload_resident_blocks", dict(type=int, help="When the DiT's blocks are streamed: DiT blocks kept on the GPU, "
                                 "spread evenly (default 0; more than it has: all). GPU memory for fewer copies "
                                 "per step.")),
    ("cpu_offload_components", dict(nargs="+", action="extend", metavar="COMPONENT", help="Keep these components in "
                                "host memory, each copied whole to the GPU for its stage: checkpoint keys "
                                "(text_encoder, text_encoder_2, transformer, vae, audio_vae, vocoder; SR: "
                                "transformer, vae, latent_upscaler), dit (= transformer) or the groups all, none, "
                                "text_encoders, audio, default (all but the DiT). Overrides --performance-mode's "
                                "default for them; under speed they keep its transforms (the DiT fused and compiled), "
                                "as the components left on the GPU do.")),
    ("layerwise_offload_components", dict(nargs="+", action="extend", metavar="COMPONENT", help="Stream these "
                                      "components' repeated blocks from host memory during their stage (the DiT and "
                                      "the text encoders; others named, e.g. by all, are offloaded whole). Streamed "
                                      "blocks run eager, also under speed. Same names as --cpu-offload-components; a "
                                      "component named by both is refused, unless one of them names it through all, "
                                      "where this flag wins.")),
    ("component_residency", dict(nargs="+", action="extend", metavar="NAME=MODE", help="Per component residency, "
                             "overriding both flags above: resident, component_offload or layerwise_offload, e.g. "
                             "vae=resident (keep the VAE on the GPU under --performance-mode memory) or "
                             "all=component_offload transformer=resident. Same names; all applies first, then "
                             "groups, then single components.")),
    ("attention_backend", dict(choices=ATTENTION_BACKENDS, help="auto (default: fa on Hopper where fa3-fwd imports and "
                          "on datacenter Blackwell, B200/B300, where flash-attn-4 imports, for a bf16 model; else "
                          "torch_sdpa), fa (FlashAttention, bf16 only, the DiTs' attention: FA3 on Hopper, FA4 for "
                          "64-wide heads when installed; FA4 on datacenter Blackwell), fa3 and fa4 (aliases of fa that "
                          "pick no kernel: K6SERVE_FA4 does), fa_fp8 (Hopper only: FA3 in FP8 for the video "
                          "self-attention, Pro DiT 5.9 -> 5.2 s on an H200 but lossy, velocity cosine 0.94 to bf16) or "
                          "torch_sdpa (alias sdpa).")),
    ("warmup_mode", dict(choices=WARMUP_MODES, help="off (default), request (warm up before the first request) or "
                         "server (at start, the model's default shape or each --warmup-resolutions size; SR: one "
                         "upscale of a synthetic 768x512x121 clip; generate without --warmup-resolutions: as "
                         "request, with its own shape).")),
    ("warmup_resolutions", dict(nargs="+", action="extend", metavar="SIZE", help="With --warmup-mode server: the "
                                "shapes warmed at start, in order, instead of the default one (a shape's first "
                                "request otherwise pays its compile and set-up): WxH, width first as the HTTP "
                                "API's size (the CLI's --width and --height are separate flags), or WxHxF with a "
                                "frame count (default: the model's), e.g. 1280x720 768x512x61; each checked as a "
                                "request of it. SR: source clip sizes (F default 121).")),
    ("compile_vae", dict(type=lambda v: parse_bool(v), metavar="{true,false}",
                         help="true: torch.compile the VAE decoder (2.3x faster decode on an H200; bf16 rounding "
                              "differs from eager, see docs/benchmarks.md). --performance-mode speed only (refused "
                              "under the others, which run eager; default false).")),
    ("compile_prompt_rewrite", dict(type=lambda v: parse_bool(v), metavar="{true,false}",
                                    help="true: the expand_prompts rewrite through a static KV cache, its decoding "
                                         "step compiled on CUDA: 8.6-9.0 ms a token on an H100 through k6serve's "
                                         "2,048-position cache, 6.3-6.6x its eager rewrite (on an H200 7.5 against "
                                         "30.1 ms through transformers' own), after one compile of 9-36 s on an H100 "
                                         "(at warm-up with --warmup-mode request or server), but the rewrite may "
                                         "differ from diffusers' after some tokens (the compiled step rounds "
                                         "differently). --performance-mode speed only (default false: eager, "
                                         "diffusers' ids).")),
    ("vae_tiling", dict(choices=VAE_TILING, help="Decode the generation models' video VAE in blended spatial tiles "
                        "(diffusers' enable_tiling: lower peak memory, slower, frames differ from the untiled "
                        "decode). auto (default): on with --performance-mode memory on a GPU.")),
    ("cache_dit_config", dict(help="Cache-DiT step caching on for every generation request (lossy, faster; for the "
                              "50-step Pro/Lite): a JSON object of cache_dit_params (cache-dit's names, e.g. "
                              "'{\"residual_diff_threshold\": 0.12}', '{}' for the defaults) or a .json/.yaml file. "
                              "Requests may turn it off (generate: --no-enable-cache-dit; over HTTP: "
                              "enable_cache_dit false) or change settings.")),
    ("vae_parallel_tiling", dict(type=lambda v: parse_bool(v), metavar="{true,false}",
                                 help="SR on several GPUs: decode whole tiles in parallel (true: the default there, "
                                      "bitwise equal to serial decode). false, every GPU decoding every tile in the "
                                      "reference, gives the same frames and is decoded as true, with a warning.")),
    ("vae_parallel_decode", dict(type=lambda v: parse_bool(v), metavar="{true,false}", help="SR on several GPUs: true "
                             "with --vae-config.parallel-decode-mode spatial_shard splits each tile's height across "
                             "the GPUs; false keeps whole tiles.")),
    ("vae_parallel_decode_mode", dict(choices=PARALLEL_DECODE_MODES, help="SR on several GPUs: whole_tile (the "
                                  "default) or spatial_shard: every GPU decodes its rows of every tile, halo rows "
                                  "exchanged; less memory and time per tile, but frames differ from serial decode by "
                                  "rounding (opt-in with --vae-config.use-parallel-decode true, as in the "
                                  "reference).")),
    ("num_gpus", dict(type=int, help="Number of GPUs (worker processes; default 1), the product of the degrees "
                      "below (2 for --enable-cfg-parallel): e.g. --num-gpus 2 --ulysses-degree 2.")),
    ("tp_size", dict(type=int, help="Tensor-parallel degree (whole heads per rank).")),
    ("ulysses_degree", dict(type=int, help="Ulysses sequence-parallel degree over video tokens.")),
    ("ring_degree", dict(type=int, help="Ring attention degree over video tokens.")),
    ("enable_cfg_parallel", dict(action=argparse.BooleanOptionalAction, default=None, help="Run CFG branches on "
                                 "different GPUs (Pro/Lite); --no-enable-cfg-parallel turns off a --config file's.")),
    ("use_fsdp_inference", dict(type=lambda v: parse_bool(v), metavar="{true,false}",
                                help="true: shard DiT weights with FSDP2 across the replica (default false).")),
    ("encoder_parallel", dict(choices=ENCODER_PARALLEL, help="Text encoders on a replica of several GPUs: fold "
                              "(tensor-parallel over the replica), replicate, or auto (default: fold only with "
                              "--use-fsdp-inference, encoders at least 4096 wide and head counts that divide the "
                              "replica size; Kandinsky 6's are narrower, so auto replicates them).")),
    ("dp_size", dict(type=int, help="Independent replicas (data parallel).")),
    ("nnodes", dict(type=int, help="Number of hosts.")),
    ("node_rank", dict(type=int, help="This host's rank.")),
    ("dist_init_addr", dict(help="host:port of the rank-0 host for multi-host runs.")),
]


def parse_bool(value: str | bool) -> bool:
    if isinstance(value, bool):
        return value
    if not isinstance(value, str):
        raise argparse.ArgumentTypeError(f"expected true or false, got {value!r}")
    lowered = value.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {value!r}")


def _not_a_reference_value(option: str, value: Any) -> Any:
    """A choice flag's value, refused with the fix where it is a value of SGLang's same option that k6serve does not
    take (`--mode auto`); the choices check sees every other value."""
    fix = value_fix(option, value)
    if fix is not None:
        raise argparse.ArgumentTypeError(fix)
    return value


# An example value of each JSON-object request flag, for its parse error (one example served both: --loras was shown
# a Cache-DiT setting).
_JSON_EXAMPLES = {"cache_dit_params": '{"scm_preset": "medium"}', "loras": '{"style": 0.8}'}


def _json_object_type(name: str):
    """The argparse type of the JSON-object flag for request field `name` (a --config file may already hold the
    mapping)."""
    example = _JSON_EXAMPLES.get(name, "{...}")

    def parse(value: str | dict) -> dict:
        if isinstance(value, dict):
            return value
        try:
            parsed = json.loads(value)
        except json.JSONDecodeError as exc:
            raise argparse.ArgumentTypeError(f"expected a JSON object, e.g. '{example}' ({exc})") from None
        if not isinstance(parsed, dict):
            raise argparse.ArgumentTypeError(f"expected a JSON object, e.g. '{example}', got {value!r}")
        return parsed

    parse.__name__ = "JSON object"  # argparse names the type in "invalid <type> value" messages
    return parse


def _field_type(field: dataclasses.Field) -> type:
    hint = typing.get_type_hints(SamplingParams)[field.name]
    args = [a for a in typing.get_args(hint) if a is not type(None)] if isinstance(hint, types.UnionType) else [hint]
    return args[0] if args else str


class _InputGivenOnce(argparse.Action):
    """A request's input (--prompt, --negative-prompt, --image-path, --video-path) given twice with other values is
    refused: argparse keeps the last, so `--prompt "a cat" --prompt "a dog"` (two prompts meant as two videos, or a
    script adding a prompt to a command that had one) made one video of the dog, the cat dropped without a word."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        previous = getattr(namespace, self.dest, None)
        if previous is not None and previous != values:
            several = ("for several prompts, write them one a line in a file and pass --prompt-file-path FILE"
                       if self.dest == "prompt" else "pass it once")
            raise argparse.ArgumentError(self, f"given twice ({previous!r}, then {values!r}); a run takes one: "
                                               f"{several}.")
        setattr(namespace, self.dest, values)


_INPUTS_GIVEN_ONCE = ("prompt", "negative_prompt", "image_path", "video_path")


def add_request_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("request")
    for field in parameter_fields(surface="cli"):
        kind = _field_type(field)
        if field.name in _INPUTS_GIVEN_ONCE:
            group.add_argument(flag_name(field.name), type=kind, default=None, action=_InputGivenOnce,
                               help=field.metadata["help"])
        elif kind is bool:
            group.add_argument(flag_name(field.name), action=argparse.BooleanOptionalAction, default=None,
                               help=field.metadata["help"])
        elif kind is dict:
            group.add_argument(flag_name(field.name), type=_json_object_type(field.name), default=None,
                               help=field.metadata["help"])
        else:
            group.add_argument(flag_name(field.name), type=kind, default=None, help=field.metadata["help"])


def add_engine_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("engine")
    for name, spec in ENGINE_FLAGS:
        spec = {"default": None, **spec}
        # SGLang's names of the same option (`--mode`) are accepted too (k6serve/reference_names.py).
        group.add_argument(flag_name(name), *aliases_of(name), dest=name, **spec)


LOG_LEVELS = ("debug", "info", "warning", "error", "critical")


def add_log_level_flag(parser: argparse.ArgumentParser, default: Any) -> None:
    parser.add_argument("--log-level", type=str.lower, choices=LOG_LEVELS, default=default,
                        help="Logging level (default info); debug also prints the traceback above an error.")


def build_parser() -> argparse.ArgumentParser:
    # No prefix abbreviations: `--compile true` set --compile-vae.
    parser = argparse.ArgumentParser(prog="k6serve", description="Serve and run Kandinsky 6 video+audio generation "
                                     "and video super-resolution.", allow_abbrev=False, formatter_class=HelpFormatter)
    add_log_level_flag(parser, "info")
    from k6serve import __version__  # the package's own module: imports nothing heavy (k6serve/__init__.py)

    parser.add_argument("--version", action="version", version=f"k6serve {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    generate = sub.add_parser("generate", help="Run one request offline and write the MP4 (or one per line of "
                              "--prompt-file-path).", allow_abbrev=False,
                              formatter_class=HelpFormatter)
    generate.add_argument("--config", help="YAML or JSON file of flag values (the command line wins).")
    # Also after the command, where a user appends it to the command that just failed ("rerun with --log-level
    # debug"); SUPPRESS leaves the value given before the command in place when it is not repeated here.
    add_log_level_flag(generate, argparse.SUPPRESS)
    add_engine_flags(generate)
    add_request_flags(generate)
    generate.add_argument(
        "--prompt-file-path", default=None, metavar="FILE",
        help="Text file with one prompt per line (blank lines skipped): the model loads once and runs one request "
             "per prompt, each with the other flags as given (the same --seed); instead of --prompt. A given "
             "--output-file-name is numbered (clip_1.mp4, clip_2.mp4...); with --dp-size N, N prompts run at once. "
             "Generation models only.")
    generate.add_argument(
        "--prompt-file-lines", default=None, metavar="LINES",
        help="Run only these lines of --prompt-file-path, by their number in the file: 5, 3-200, 3-5,9,12- (12 to "
             "the end). A stopped run's report prints the value that runs what did not finish; a numbered "
             "--output-file-name keeps the numbers of the whole file.")
    generate.add_argument(
        "--json", action=argparse.BooleanOptionalAction, default=None,
        help="Print each request's result as one JSON line on stdout (output_file_path, width, height, num_frames, "
             "fps, has_audio, seed, timings, peak_memory_mb, notes, expanded_prompt; with --prompt-file-path also "
             "line and prompt) instead of the timing table and the saved line; for scripts (jq). Messages stay on "
             "stderr.")
    serve = sub.add_parser("serve", help="Start the HTTP server (OpenAI-style /v1/videos jobs).", allow_abbrev=False,
                           formatter_class=HelpFormatter)
    serve.add_argument("--config", help="YAML or JSON file of flag values (the command line wins).")
    add_log_level_flag(serve, argparse.SUPPRESS)
    add_engine_flags(serve)
    from k6serve.cli.serve_flags import add_server_flags

    add_server_flags(serve)
    bench = sub.add_parser("bench", help="Benchmark our DiT, VAE and pipeline against diffusers.",
                           formatter_class=HelpFormatter)
    bench.add_argument("bench_args", nargs=argparse.REMAINDER, help="Arguments for python -m k6serve.bench.")
    return parser


def split_options(options: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    engine_names = {name for name, _ in ENGINE_FLAGS}
    engine = {k: v for k, v in options.items() if k in engine_names}
    request = {k: v for k, v in options.items() if k not in engine_names}
    return engine, request
