"""Engine configuration: frozen, typed, validated once at start-up.

Every knob has a real default value ("auto" is a named rule, resolved in one visible place), and invalid
combinations raise ValueError with the fix, before any weight is loaded.
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from k6serve.caching.params import CacheDitParams, parse_cache_dit_config

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

LOAD_FORMATS = ("auto", "dummy")
DTYPES = ("auto", "bfloat16", "float32")
DEVICES = ("auto", "cuda", "cpu")
PERFORMANCE_MODES = ("speed", "balanced", "memory")
OFFLOAD_MODES = ("balanced", "memory")  # the modes that keep weights in host memory (k6serve/offload/)
WARMUP_MODES = ("off", "request", "server")
# "fa3" and "fa4" are the reference's spellings of "fa" (plain aliases: the GPU and $K6SERVE_FA4 pick the kernel).
ATTENTION_BACKENDS = ("auto", "fa", "fa3", "fa4", "fa_fp8", "torch_sdpa", "sdpa")
# Online quantization of the generation DiT's video-token linears (speed/fp8_linears.py): lossy, opt-in.
QUANTIZATIONS = ("none", "fp8")
ENCODER_PARALLEL = ("auto", "fold", "replicate")
VAE_TILING = ("auto", "on", "off")
PARALLEL_DECODE_MODES = ("whole_tile", "spatial_shard")  # the seed's --vae-config.parallel-decode-mode values
# Same tuple as k6serve.lora.spec.LORA_MERGE_MODES (config imports only torch-free k6serve modules; a unit test keeps
# them equal).
LORA_MERGE_MODES = ("auto", "merge", "dynamic")
# The options with a fixed set of values, by field name: the CLI's `choices` (a unit test keeps them equal), and what
# tells such an option's value from the words after it when the Python API rewords a flag (api_errors.py).
OPTION_CHOICES = {"load_format": LOAD_FORMATS, "dtype": DTYPES, "lora_merge_mode": LORA_MERGE_MODES,
                  "device": DEVICES, "performance_mode": PERFORMANCE_MODES, "attention_backend": ATTENTION_BACKENDS,
                  "warmup_mode": WARMUP_MODES, "vae_tiling": VAE_TILING, "encoder_parallel": ENCODER_PARALLEL,
                  "vae_parallel_decode_mode": PARALLEL_DECODE_MODES, "quantization": QUANTIZATIONS}

# What each annotated field type accepts, and how the error says it. The CLI's argparse types already convert, but
# the Python API passes values as given: the string "false" is a true use_fsdp_inference and the string "1" a
# num_gpus that fails only in a comparison deep in start-up, so every field is checked here, naming its flag.
_FIELD_KINDS = {
    "str": (lambda v: isinstance(v, str), "a string"),
    "int": (lambda v: isinstance(v, int) and not isinstance(v, bool), "an integer"),
    "float": (lambda v: isinstance(v, (int, float)) and not isinstance(v, bool), "a number"),
    "bool": (lambda v: isinstance(v, bool), "true or false"),
}
_API_ONLY_FIELDS = ("dist_timeout_s",)  # no command-line flag: named as the keyword argument
# Options whose flag is the seed's spelling rather than `--<field-name>` (the CLI adds them so).
SEED_FLAG_SPELLINGS = {"vae_parallel_tiling": "--vae-config.use-parallel-tiling",
                       "vae_parallel_decode": "--vae-config.use-parallel-decode",
                       "vae_parallel_decode_mode": "--vae-config.parallel-decode-mode"}


def flag_name(option: str) -> str:
    """An option's command-line flag, for messages and the parsers: `--<option-name>`, or its seed spelling."""
    return SEED_FLAG_SPELLINGS.get(option, "--" + option.replace("_", "-"))


def _check_field_types(config: DataclassInstance, *, checked_elsewhere: tuple[str, ...] = ()) -> None:
    for item in dataclasses.fields(config):
        kind, _, optional = str(item.type).partition(" | ")
        if kind not in _FIELD_KINDS or item.name in checked_elsewhere:
            continue  # parsed and checked by its own code (cache_dit_config), with a more specific message
        value = getattr(config, item.name)
        if value is None and optional == "None":
            continue
        accepts, wanted = _FIELD_KINDS[kind]
        if not accepts(value):
            name = item.name if item.name in _API_ONLY_FIELDS else flag_name(item.name)
            raise ValueError(f"{name} must be {wanted}, got {value!r} ({type(value).__name__})")


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelConfig:
    model_path: str
    model_id: str | None = None  # routing override for renamed folders
    revision: str | None = None
    load_format: str = "auto"  # "dummy": released configs, random weights, no download
    dtype: str = "auto"  # auto = bfloat16 on CUDA, float32 on CPU
    # A LoRA adapter for the generation DiT, loaded at start (k6serve/lora/): a .safetensors file, a folder holding
    # one, or a hub id. Later adapters come and go through `/v1/set_lora` without a restart.
    lora_path: str | None = None
    lora_nickname: str = "default"
    lora_scale: float = 1.0  # the adapter's strength
    lora_alpha: float | None = None  # overrides the file's alpha (default: the file's, else the rank: scale 1)
    lora_merge_mode: str = "auto"  # also the default of set_lora requests that say "auto"; auto = merge
    # "fp8": the generation DiT's video-token linears in e4m3 with row-wise scales, quantized at load (the
    # reference's online fp8 `--quantization`); measured on an H200 (docs/benchmarks.md, twenty-second session):
    # Pro-distill's forward 5.81 -> 4.94 s and 59.6 -> 44.0 GiB peak, at a velocity cosine of 0.9981 to bf16
    # diffusers (the speed tolerance is 0.999), so it is never on by default. The ignored layers (globs over the
    # DiT's module names, or parts of them) stay in bf16.
    quantization: str = "none"
    quantization_ignored_layers: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not self.model_path:
            raise ValueError("--model-path is required (a local Diffusers folder, a hub id, or 'demo' / 'demo-sr').")
        object.__setattr__(self, "quantization_ignored_layers", _layer_patterns(self.quantization_ignored_layers))
        _check_field_types(self)
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"--quantization must be one of {', '.join(QUANTIZATIONS)}, got {self.quantization!r}")
        if self.quantization_ignored_layers and self.quantization == "none":
            raise ValueError("--quantization-ignored-layers names the layers --quantization leaves in bf16, but "
                             "--quantization is none; add --quantization fp8, or drop it.")
        if self.quantization != "none" and self.lora_path:
            raise ValueError(f"--lora-path cannot be used with --quantization {self.quantization}: an adapter "
                             "updates bf16 weights, and the quantized linears hold e4m3 ones; drop one of them.")
        if self.lora_merge_mode not in LORA_MERGE_MODES:
            raise ValueError(f"--lora-merge-mode must be one of {LORA_MERGE_MODES}, got {self.lora_merge_mode!r}")
        if not self.lora_nickname:
            raise ValueError("--lora-nickname must not be empty")
        if self.lora_path is None:
            # They describe the --lora-path adapter; without one they were silently ignored. (--lora-merge-mode
            # stands alone: it is also the default of later set_lora requests.)
            given = [flag for flag, value, default in (("--lora-nickname", self.lora_nickname, "default"),
                                                       ("--lora-scale", self.lora_scale, 1.0),
                                                       ("--lora-alpha", self.lora_alpha, None)) if value != default]
            if given:
                one = len(given) == 1
                flags = given[0] if one else f"{', '.join(given[:-1])} and {given[-1]}"
                raise ValueError(f"{flags} {'describes' if one else 'describe'} the --lora-path "
                                 f"adapter, but no --lora-path was given; add --lora-path, or drop "
                                 f"{'it' if one else 'them'} (adapters can also come later, through set_lora).")
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(f"--load-format must be one of {LOAD_FORMATS}, got {self.load_format!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"--dtype must be one of {DTYPES}, got {self.dtype!r}")


def _layer_patterns(value: object) -> tuple[str, ...]:
    """--quantization-ignored-layers as given by the CLI (a list), a --config file or the API (a list, or one string
    of names separated by commas or spaces): a tuple of non-empty patterns."""
    if value is None:
        return ()
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, (list, tuple)) or not all(isinstance(item, str) and item.strip() for item in items):
        raise ValueError("--quantization-ignored-layers must be module names or globs (e.g. 'feed_forward' "
                         f"'visual_transformer_blocks.0.*'), got {value!r}")
    # A --config file's `feed_forward, self_attention` reaches here as one item.
    return tuple(part for item in items for part in item.replace(",", " ").split())


# The largest Ulysses degree every released DiT's heads divide by: gcd of Pro's 32, Lite's 28 and SR's 28. The
# config is checked before the model is known, so a suggestion made here must hold for any of them.
_ULYSSES_FOR_ANY_MODEL = 4


def _layout_fix(num_gpus: int, product: int, *, others: int, tp: int, ulysses_given: int, ring_given: int) -> str:
    """What to change when the degrees do not multiply to --num-gpus: the GPU count they need, and where the other
    degrees (`others`: dp x cfg x tp) divide --num-gpus, the sequence-parallel degrees that fill it (never a no-op
    suggestion of the same layout). Ulysses splits heads, so its share is a divisor of every released model's heads;
    Ring, which has no head constraint, takes the rest (3 GPUs were told --ulysses-degree 3, which the model's heads
    then refused)."""
    fix = f"Pass --num-gpus {product} for this layout"
    degree = num_gpus // others if num_gpus % others == 0 else 0
    if num_gpus == 1:
        return fix + ", or drop the parallel flags to run on one GPU."
    if degree:
        # Ulysses splits the TP-local heads: under --tp-size 2 every model keeps a multiple of 2 per rank.
        cap = _ULYSSES_FOR_ANY_MODEL // math.gcd(_ULYSSES_FOR_ANY_MODEL, tp)
        ulysses = max(d for d in range(1, cap + 1) if cap % d == 0 and degree % d == 0)
        # A degree already given is restated even at 1, so the command line does not keep the old one.
        flags = [f"--ulysses-degree {ulysses}"] if ulysses > 1 or ulysses_given > 1 else []
        flags += [f"--ring-degree {degree // ulysses}"] if degree // ulysses > 1 or ring_given > 1 else []
        if flags:
            fix += f", or keep {num_gpus} GPU(s) with {' '.join(flags)}"
    return fix + "."


@dataclass(frozen=True, kw_only=True, slots=True)
class ParallelConfig:
    num_gpus: int = 1
    tp_size: int = 1
    ulysses_degree: int = 1
    ring_degree: int = 1
    enable_cfg_parallel: bool = False
    use_fsdp_inference: bool = False
    encoder_parallel: str = "auto"
    dp_size: int = 1
    nnodes: int = 1
    node_rank: int = 0
    dist_init_addr: str | None = None
    dist_timeout_s: float = 600.0

    def __post_init__(self) -> None:
        _check_field_types(self)
        if self.dist_timeout_s <= 0:
            raise ValueError(f"dist_timeout_s must be > 0 seconds, got {self.dist_timeout_s}")
        for name in ("num_gpus", "tp_size", "ulysses_degree", "ring_degree", "dp_size", "nnodes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{flag_name(name)} must be >= 1, got {getattr(self, name)}")
        if not 0 <= self.node_rank < self.nnodes:
            # A negative rank was told it "hosts worker ranks only" and to call serve_worker_ranks.
            raise ValueError(f"--node-rank must be in [0, {self.nnodes - 1}] (this host's index among --nnodes "
                             f"{self.nnodes}), got {self.node_rank}")
        if self.encoder_parallel not in ENCODER_PARALLEL:
            raise ValueError(f"--encoder-parallel must be one of {ENCODER_PARALLEL}")
        cfg = 2 if self.enable_cfg_parallel else 1
        product = self.dp_size * cfg * self.tp_size * self.ulysses_degree * self.ring_degree
        if product != self.num_gpus:
            raise ValueError(
                f"world size must equal dp x cfg x tp x ulysses x ring = {self.dp_size} x {cfg} x {self.tp_size} "
                f"x {self.ulysses_degree} x {self.ring_degree} = {product}, but --num-gpus is {self.num_gpus}. "
                + _layout_fix(self.num_gpus, product, others=self.dp_size * cfg * self.tp_size, tp=self.tp_size,
                              ulysses_given=self.ulysses_degree, ring_given=self.ring_degree)
            )

    @property
    def world_size(self) -> int:
        return self.num_gpus

    @property
    def cache_dit_unavailable(self) -> str | None:
        """Why this layout cannot run Cache-DiT, or None. FSDP gathers each block's weights on every rank of the
        replica together, and with CFG-parallel the two branches decide separately which blocks to skip."""
        if self.use_fsdp_inference and self.enable_cfg_parallel:
            return ("--use-fsdp-inference with --enable-cfg-parallel: each guidance branch decides on its own "
                    "which DiT blocks to skip, but FSDP gathers every block's weights on both ranks together. "
                    "Drop one of the two flags to use Cache-DiT.")
        return None

    @property
    def dit_sharding_flags(self) -> list[str]:
        """The flags that shard the DiT's weights across GPUs (DTensor or FSDP storage), as the user wrote them."""
        flags = [f"--tp-size {self.tp_size}"] if self.tp_size > 1 else []
        return flags + (["--use-fsdp-inference"] if self.use_fsdp_inference else [])


@dataclass(frozen=True, slots=True)
class WarmupSize:
    """One `--warmup-resolutions` item: width and height in pixels, width first (as the HTTP API's `size` and the
    reference's flag), and the frame count when given (None: the model's default; super-resolution: that of
    `runtime.warmup_sizes.SR_WARMUP_CLIP`)."""

    width: int
    height: int
    num_frames: int | None = None

    def __str__(self) -> str:
        return f"{self.width}x{self.height}" + ("" if self.num_frames is None else f"x{self.num_frames}")


_WARMUP_SIZE = re.compile(r"([0-9]+)x([0-9]+)(?:x([0-9]+))?")  # ASCII digits, as the HTTP API's `size` takes


def parse_warmup_sizes(value: object) -> tuple[WarmupSize, ...]:
    """--warmup-resolutions as given by the CLI (a list), a --config file or the API (a list, or one string of sizes
    separated by commas or spaces): the sizes, in order. The model's own rules (multiples of 16, frame counts)
    are checked where the model is known (`runtime/warmup_sizes.py`)."""
    if value is None:
        return ()
    items = [value] if isinstance(value, (str, WarmupSize)) else value
    if not isinstance(items, (list, tuple)):
        raise ValueError(f"--warmup-resolutions takes sizes WxH or WxHxF (e.g. 1280x720 768x512x61), got {value!r}")
    sizes: list[WarmupSize] = []
    for item in items:
        if isinstance(item, WarmupSize):
            sizes.append(item)
            continue
        words = item.replace(",", " ").split() if isinstance(item, str) else [item]
        for word in words:
            match = _WARMUP_SIZE.fullmatch(word.lower()) if isinstance(word, str) else None
            if match is None or any(group is not None and int(group) == 0 for group in match.groups()):
                raise ValueError(f"--warmup-resolutions {word!r} is not a size: write WxH, or WxHxF with a frame "
                                 "count, in positive whole pixels and frames, width first as in the HTTP API's size "
                                 "(e.g. 1280x720 or 768x512x61).")
            width, height, frames = match.groups()
            sizes.append(WarmupSize(int(width), int(height), None if frames is None else int(frames)))
    repeated = sorted({str(size) for size in sizes if sizes.count(size) > 1})
    if repeated:
        raise ValueError(f"--warmup-resolutions lists {', '.join(repeated)} more than once; each size is warmed once: "
                         "drop the repeat.")
    return tuple(sizes)


@dataclass(frozen=True, kw_only=True, slots=True)
class RuntimeConfig:
    device: str = "auto"
    performance_mode: str = "speed"
    attention_backend: str = "auto"
    warmup_mode: str = "off"
    # The shapes `--warmup-mode server` warms at start-up, in order, instead of the model's default request: a
    # shape's first request pays what is keyed on its size (its set-up; a compile where the DiT's graphs are
    # not yet dynamic, speed/warmup.py). Each is checked as a request of its size is, before the load where the
    # model is known.
    warmup_resolutions: tuple[WarmupSize, ...] = ()
    # torch.compile of the video VAE decoder (HunyuanVideo; the SR K-VAE per block). Opt-in, not part of
    # "speed": on H200 it makes the decode 2.3x faster than our eager one (ninth session, with the folded
    # upsamplers; 1.9x in the second) and the K-VAE's tile 2.0x (seventh session), but fused kernels round once
    # where eager rounds after every op, and on random weights the frames then differed from the eager bf16 decode
    # by 12-18/255, beyond the 1/255 that "speed" promises (docs/benchmarks.md).
    compile_vae: bool = False
    # expand_prompts' rewrite through one static KV cache (pipelines/expand_prompt.py, `StaticRewriteCache`), whose
    # decoding step transformers compiles on CUDA. Opt-in, not part of "speed": through this cache 8.6-9.0 ms a token
    # on an H100 against 56.4 eager there (6.3-6.6x; on an H200 transformers' own static cache took 7.5 against 30.1),
    # after one compile of 9-36 s on an H100 (at warm-up with a warm mode), but the compiled step rounds differently,
    # and on random weights its ids left the eager ones (diffusers') at token 4.
    compile_prompt_rewrite: bool = False
    # Spatial tiles for the generation models' HunyuanVideo VAE decode: "on" is diffusers' `vae.enable_tiling()`
    # with its default tiles (256 px, stride 192), "off" never, "auto" on exactly for --performance-mode memory on
    # a GPU (speed/vae_tiling.py). Tied to memory mode because that mode promises the lowest peak, and its peak is
    # the untiled decode (Pro-distill 512x768x121 on an H200: 21.7 GiB). Not on elsewhere: each tile is decoded
    # without the rest of the frame and the overlaps are blended, so the frames differ from the untiled decode (as
    # with diffusers' own enable_tiling) and the decode is slower; the CPU and the speed / balanced modes keep
    # their bits.
    vae_tiling: str = "auto"
    # Cache-DiT on by default for every generation request, with these settings (k6serve/caching/); a request can
    # turn it off or change settings. Given as a mapping, a JSON object string or a .json/.yaml file path, and
    # kept as the parsed `CacheDitParams`.
    cache_dit_config: CacheDitParams | None = None
    # Block streaming ("memory" mode, offload/block_stream.py): how many blocks are copied ahead of the running one
    # (each costs one block of device memory; a deeper queue absorbs blocks whose copy outlasts their compute, as
    # long as the total copy time stays under the total compute time), and how many of the DiT's blocks stay on the
    # device for the life of the worker (spread evenly over its block list, block_stream.py says why; a count above
    # the number of blocks keeps all of them; the text encoders' stay streamed, components.py says why).
    # Only "memory" streams blocks: with another mode they must stay at these defaults.
    offload_prefetch_blocks: int = 1
    offload_resident_blocks: int = 0
    # Per component offloading, the seed's flags (offload/residency.py): the components offloaded whole between
    # their stages, and those streamed block by block; each overrides --performance-mode's default for the
    # components it names (e.g. speed with `text_encoder vae` offloaded keeps a compiled, resident DiT). Checkpoint
    # component keys or the groups all, none, dit, text_encoders, audio.
    cpu_offload_components: tuple[str, ...] = ()
    layerwise_offload_components: tuple[str, ...] = ()
    # `--component-residency NAME=MODE ...` (resident | component_offload | layerwise_offload), over both flags: the
    # reference's per component setting, also the way to keep one component resident under balanced or memory.
    component_residency: tuple[tuple[str, str], ...] = ()
    # The seed's SR decode flags (`--vae-config.use-parallel-tiling`, `--vae-config.use-parallel-decode`,
    # `--vae-config.parallel-decode-mode`). A multi-GPU SR replica decodes whole tiles in parallel by default
    # (parallel/tile_decode.py; bitwise equal to serial); spatial_shard splits each tile's height across the GPUs
    # instead (parallel/spatial_shard_decode.py; changes the rounding); use-parallel-tiling false, every GPU
    # decoding every tile in the reference, has the same frames and is decoded as whole tiles (`sr_decode_mode`).
    # One GPU or a generation model: nothing to choose, as in the reference.
    vae_parallel_tiling: bool | None = None
    vae_parallel_decode: bool | None = None
    vae_parallel_decode_mode: str | None = None

    def __post_init__(self) -> None:
        if self.cache_dit_config is not None and not isinstance(self.cache_dit_config, CacheDitParams):
            # Normalised once here, where every way of building the config passes (CLI, --config file, API).
            object.__setattr__(self, "cache_dit_config", parse_cache_dit_config(self.cache_dit_config))
        # torch-free (k6serve/offload/__init__.py)
        from k6serve.offload.residency import normalise_component_names, normalise_residency_settings

        for name in ("cpu_offload_components", "layerwise_offload_components"):
            object.__setattr__(self, name, normalise_component_names(getattr(self, name), flag_name(name)))
        object.__setattr__(self, "component_residency", normalise_residency_settings(self.component_residency))
        _check_field_types(self, checked_elsewhere=("offload_prefetch_blocks", "offload_resident_blocks"))
        if self.vae_tiling not in VAE_TILING:
            raise ValueError(f"--vae-tiling must be one of {VAE_TILING}, got {self.vae_tiling!r}")
        if isinstance(self.device, str) and self.device.startswith("cuda:") and self.device[5:].isdigit():
            # torch's "cuda:1" (or a torch.device's index): the ranks take the visible GPUs from the first on.
            raise ValueError(f"--device takes 'cuda', not {self.device!r}: choose the GPU with the environment, "
                             f"CUDA_VISIBLE_DEVICES={self.device[5:]} (k6serve's ranks use the visible GPUs from the "
                             "first, one per rank).")
        if self.device not in DEVICES:
            raise ValueError(f"--device must be one of {DEVICES}, got {self.device!r}")
        if self.performance_mode not in PERFORMANCE_MODES:
            from k6serve.reference_names import value_fix  # it imports the request module, which imports this one

            fix = value_fix("performance_mode", self.performance_mode)  # SGLang's auto / manual: which to pick
            raise ValueError(f"--performance-mode must be one of {PERFORMANCE_MODES}, got {self.performance_mode!r}"
                             + (f": {fix}" if fix else ""))
        if self.warmup_mode not in WARMUP_MODES:
            raise ValueError(f"--warmup-mode must be one of {WARMUP_MODES}, got {self.warmup_mode!r}")
        self._check_warmup_resolutions()
        self._check_block_streaming()
        if self.compile_vae and self.performance_mode != "speed":
            # apply_performance_mode compiles only under speed: balanced and memory run eager kernels, so the flag
            # did nothing there.
            raise ValueError(f"--compile-vae true compiles the VAE decoder only under --performance-mode speed; "
                             f"--performance-mode {self.performance_mode} runs eager kernels and would ignore it. Use "
                             "--performance-mode speed (with --cpu-offload-components vae to keep the VAE in host "
                             "memory), or drop --compile-vae.")
        if self.compile_prompt_rewrite:
            self._check_compile_prompt_rewrite()
        if self.vae_parallel_decode_mode not in (None, *PARALLEL_DECODE_MODES):
            raise ValueError(f"--vae-config.parallel-decode-mode must be one of {', '.join(PARALLEL_DECODE_MODES)}, "
                             f"got {self.vae_parallel_decode_mode!r}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(
                f"--attention-backend must be one of auto, fa, fa_fp8, torch_sdpa (alias sdpa), fa3 or fa4 (aliases "
                f"of fa), got {self.attention_backend!r}"
            )

    def _check_compile_prompt_rewrite(self) -> None:
        if self.performance_mode != "speed":
            # As --compile-vae: balanced and memory promise eager kernels.
            raise ValueError(f"--compile-prompt-rewrite true compiles the expand_prompts rewrite only under "
                             f"--performance-mode speed; --performance-mode {self.performance_mode} runs eager "
                             "kernels and would ignore it. Use --performance-mode speed, or drop "
                             "--compile-prompt-rewrite.")
        from k6serve.offload.residency import COMPONENT, LAYERWISE

        residency = self.residency_plan(super_resolution=False).residency.get("text_encoder")
        if residency == COMPONENT:
            # transformers compiles the decoding step with CUDA graphs, which hold the weights' GPU addresses: an
            # encoder offloaded whole comes back at new ones for every request, and each is a new recording whose
            # memory the graphs keep (torch does not count these against its re-record limit): unmeasured, so
            # refused rather than left to grow in a server.
            raise ValueError(f"--compile-prompt-rewrite true needs the text encoder resident on the GPU, which `"
                             f"{self.residency_flags}` offloads: its compiled decoding step's CUDA graphs hold the "
                             "weights' GPU addresses, and each request would record them again. Keep the text "
                             "encoder resident (--component-residency text_encoder=resident), or drop "
                             "--compile-prompt-rewrite.")
        if residency == LAYERWISE:
            # expand_prompts itself is refused there (request_resolution.py), so the flag would do nothing.
            raise ValueError(f"--compile-prompt-rewrite true compiles the expand_prompts rewrite, which `"
                             f"{self.residency_flags}` refuses: it streams the text encoder's layers from host memory, "
                             "and generate would copy them for every token. Keep the text encoder on the GPU "
                             "(--component-residency text_encoder=resident), or drop --compile-prompt-rewrite.")

    def _check_warmup_resolutions(self) -> None:
        object.__setattr__(self, "warmup_resolutions", parse_warmup_sizes(self.warmup_resolutions))
        if not self.warmup_resolutions or self.warmup_mode == "server":
            return
        # The reference derives an unset mode from the list ("request"); ours has a real default, "off", so a list
        # beside another mode is a contradiction to name, not a mode to pick silently: "off" warms nothing, and
        # "request" warms the first request's own shape, on that request's time, whatever the list says.
        does = ("warms nothing" if self.warmup_mode == "off" else
                "warms only the first request's own shape, right before it runs")
        default = " (the default)" if self.warmup_mode == "off" else ""
        raise ValueError(f"--warmup-resolutions lists sizes to warm at start-up, which --warmup-mode server does; "
                         f"--warmup-mode {self.warmup_mode}{default} {does}. Add --warmup-mode server, or drop "
                         "--warmup-resolutions.")

    def _check_block_streaming(self) -> None:
        limits = {"offload_prefetch_blocks": (1, "blocks copied ahead of the running one"),
                  "offload_resident_blocks": (0, "DiT blocks kept on the GPU")}
        for name, (low, meaning) in limits.items():
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{flag_name(name)} must be an integer >= {low} ({meaning}), got {value!r}")
        # The model's family is known only once the worker recognises the checkpoint: here the generation plan,
        # which streams whatever the super-resolution plan streams (their DiTs alike) and the text encoders besides;
        # the worker checks the super-resolution plan before it loads (`block_streaming_refusal`).
        refusal = self.block_streaming_refusal(super_resolution=False)
        if refusal:
            raise ValueError(refusal)

    def block_streaming_refusal(self, *, super_resolution: bool) -> str | None:
        """Why --offload-prefetch-blocks / --offload-resident-blocks cannot apply to one family's plan (None when
        they can): the first needs some component's blocks streamed, the second the DiT's."""
        from k6serve.offload.residency import LAYERWISE

        residency = self.residency_plan(super_resolution=super_resolution).residency
        streams_blocks = LAYERWISE in residency.values()
        refused = []
        if self.offload_prefetch_blocks != 1 and not streams_blocks:
            refused.append(f"--offload-prefetch-blocks {self.offload_prefetch_blocks}")
        if self.offload_resident_blocks != 0 and residency.get("transformer") != LAYERWISE:
            refused.append(f"--offload-resident-blocks {self.offload_resident_blocks}")
        if not refused:
            return None
        named, several = " and ".join(refused), len(refused) > 1
        which = "blocks are" if refused[0].startswith("--offload-prefetch") and not several else "the DiT's blocks are"
        streams = "none" if not streams_blocks else "only text encoders"
        if super_resolution:
            streams += " for the super-resolution model"
        return (f"{named} {'apply' if several else 'applies'} only when {which} streamed between host and GPU, and "
                f"`{self.residency_flags}` streams {streams}. Stream the DiT (--performance-mode memory, "
                "--layerwise-offload-components transformer or --component-residency transformer=layerwise_offload, "
                f"with no other flag keeping it whole or resident), or drop {'them' if several else 'it'}.")

    def _component_flags(self, *, offloading_only: bool) -> list[str]:
        """The per component flags as given (for messages); `offloading_only` leaves out what offloads nothing."""
        flags = []
        for name in ("cpu_offload_components", "layerwise_offload_components"):
            names = getattr(self, name)
            if names and not (offloading_only and names == ("none",)):
                flags.append(f"{flag_name(name)} {' '.join(names)}")
        settings = [f"{n}={m}" for n, m in self.component_residency if not (offloading_only and m == "resident")]
        if settings:
            flags.append("--component-residency " + " ".join(settings))
        return flags

    @property
    def residency_flags(self) -> str:
        """The mode and the per component flags, as the user wrote them (for messages)."""
        return " ".join([f"--performance-mode {self.performance_mode}", *self._component_flags(offloading_only=False)])

    def residency_plan(self, *, super_resolution: bool):
        """The plan for every component of one family (`offload/residency.py`), the names of the other left out."""
        from k6serve.offload.residency import ALIASES, GROUPS, SPECIAL, family_components, resolve_residency

        keys = family_components(super_resolution)

        def here(name: str) -> bool:
            name = ALIASES.get(name, name)  # the config keeps the names as given (`dit`)
            return name in SPECIAL or name in keys or any(member in keys for member in GROUPS.get(name, ()))

        return resolve_residency(
            self.performance_mode, super_resolution=super_resolution,
            cpu_offload=tuple(filter(here, self.cpu_offload_components)),
            layerwise=tuple(filter(here, self.layerwise_offload_components)),
            settings=tuple(item for item in self.component_residency if here(item[0])))

    @property
    def streams_dit(self) -> bool:
        """Whether the DiT's blocks are streamed (its residency is "layerwise"): the same for both families."""
        from k6serve.offload.residency import LAYERWISE

        return self.residency_plan(super_resolution=False).residency["transformer"] == LAYERWISE

    @property
    def streams_blocks(self) -> bool:
        """Whether any component's blocks are streamed (the DiT's or the text encoders')."""
        from k6serve.offload.residency import LAYERWISE

        return LAYERWISE in self.residency_plan(super_resolution=False).residency.values()

    @property
    def offloads(self) -> bool:
        """Whether any component's weights live in host memory, for either family's components."""
        return any(self.residency_plan(super_resolution=sr).offloads for sr in (False, True))

    @property
    def offload_flag_list(self) -> list[str]:
        """The flags that offload, as the user wrote them (for messages)."""
        mode = [f"--performance-mode {self.performance_mode}"] if self.performance_mode in OFFLOAD_MODES else []
        return mode + self._component_flags(offloading_only=True)

    @property
    def offload_flags(self) -> str:
        return " ".join(self.offload_flag_list)


@dataclass(frozen=True, kw_only=True, slots=True)
class EngineConfig:
    model: ModelConfig
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)

    def __post_init__(self) -> None:
        parallel = self.parallel
        if self.model.lora_path and len(parallel.dit_sharding_flags) == 2:
            raise ValueError("--lora-path cannot be used with --tp-size > 1 and --use-fsdp-inference together: the "
                             "weights are then sharded along two mesh axes; drop one of them (each alone works).")
        if self.model.lora_path and parallel.use_fsdp_inference and self.model.lora_merge_mode == "merge":
            raise ValueError("--lora-merge-mode merge cannot be used with --use-fsdp-inference: the weights are FSDP "
                             "shards between requests; use --lora-merge-mode dynamic or auto (dynamic under FSDP).")
        if self.model.quantization != "none":
            self._check_quantization()
        if self.runtime.compile_prompt_rewrite and parallel.encoder_parallel == "fold":
            # A folded encoder's forward is collectives over sharded weights; compiled into generate's decoding step
            # (and its CUDA graphs) it has never run. auto never folds Kandinsky 6's encoders (3,584 wide).
            raise ValueError("--compile-prompt-rewrite true cannot be used with --encoder-parallel fold: the "
                             "compiled decoding step of a folded text encoder is untested. Use --encoder-parallel "
                             "replicate or auto, or drop --compile-prompt-rewrite.")
        if self.runtime.cache_dit_config is not None and parallel.cache_dit_unavailable:
            raise ValueError(f"--cache-dit-config cannot be used with {parallel.cache_dit_unavailable}")
        # Refused here when every model family's reading of the flags offloads; a component name of one family
        # only is checked by the worker, which knows the family and first refuses a name of the other one.
        if all(self.runtime.residency_plan(super_resolution=sr).offloads for sr in (False, True)):
            refuse_offload_with_sharding(self.runtime, parallel)

    def _check_quantization(self) -> None:
        flag = f"--quantization {self.model.quantization}"
        from k6serve.models.variants import GENERATION, variant_from_id

        # A super-resolution checkpoint recognisable by its name is refused first, as the worker would (a renamed
        # folder is refused there): the fixes below would not help it.
        variant = variant_from_id(self.model.model_id or self.model.model_path)
        if variant is not None and variant.family != GENERATION:
            raise ValueError(f"{flag} applies to the generation DiT; {variant.name} is a super-resolution model. "
                             "Drop the flag.")
        sharding = self.parallel.dit_sharding_flags
        if sharding:
            raise ValueError(f"{flag} cannot be used with {' and '.join(sharding)}: the linears are quantized whole "
                             f"on each GPU, not as shards; drop {flag}, or drop {' and '.join(sharding)} (Ulysses, "
                             "Ring and CFG parallel work with it).")
        from k6serve.offload.residency import RESIDENT

        if self.runtime.residency_plan(super_resolution=False).residency.get("transformer") != RESIDENT:
            raise ValueError(f"{flag} needs the DiT resident on the GPU (offloading its e4m3 weights is not "
                             f"supported), but `{self.runtime.residency_flags}` offloads it. Offload the other "
                             "components instead (e.g. --performance-mode speed --cpu-offload-components "
                             "text_encoders vae; the quantized Pro-distill DiT needs about 44 GiB), add "
                             f"--component-residency transformer=resident, or drop {flag}.")


def refuse_offload_with_sharding(runtime: RuntimeConfig, parallel: ParallelConfig) -> None:
    """Offloading re-points each parameter's plain tensor between host and device; a DTensor shard (TP, folded
    encoders) or FSDP's managed storage cannot be moved that way, so offloading flags are refused beside them.
    Ulysses / Ring / CFG replicate the weights, so each rank offloads its own copy (one copy per GPU in host
    memory)."""
    flags = parallel.dit_sharding_flags + (["--encoder-parallel fold"] if parallel.encoder_parallel == "fold" else [])
    if not flags:
        return
    named = " and ".join(flags)
    fixes = ["use --performance-mode speed"] if runtime.performance_mode in OFFLOAD_MODES else []
    fixes += [f"drop {flag}" for flag in runtime.offload_flag_list if not flag.startswith("--perf")]
    raise ValueError(
        f"{runtime.offload_flags} offloads the weights to host memory, which cannot work with weights "
        f"sharded across GPUs ({named}): {' and '.join(fixes)} to keep {named}, or drop {named} to offload."
    )
