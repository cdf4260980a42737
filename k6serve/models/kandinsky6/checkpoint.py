"""Load a Kandinsky 6 generation checkpoint (Diffusers layout) into k6serve's components.

Our own DiT takes the diffusers state-dict keys unchanged; the text encoders come from transformers and the
VAEs, vocoder and schedulers from diffusers (k6-generation.md §6). Every mismatch between a config and its
weights fails here, at load time, naming the parameters. `load_format="dummy"` builds the released sizes with
random weights directly on the target device in the target dtype (never an fp32 host copy). `weights_device`
(default: `device`) is where the weights are placed: the host when the engine offloads them
(`--performance-mode balanced / memory`), so the components never need to fit on the GPU at once.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from k6serve.models.checkpoint_files import (
    MAX_POLICY_SUBSTEPS,
    CheckpointError,
    check_block_counts,
    check_state_dict,
    config_count,
    folder_listing,
    header_state_dict,
    index_class,
    load_state_dict,
    read_component_config,
    read_json_file,
    read_model_index,
    require_components,
)
from k6serve.models.kandinsky6 import encoder_configs
from k6serve.models.kandinsky6.config import SCHEDULER_CLASSES, Kandinsky6TransformerConfig
from k6serve.models.kandinsky6.config_before_loading import released_transformer_config, unlisted_audio_components
from k6serve.models.kandinsky6.transformer import Kandinsky6Transformer, cast_for_inference
from k6serve.models.variants import Variant

logger = logging.getLogger(__name__)

REQUIRED = ["transformer", "vae", "text_encoder", "tokenizer", "text_encoder_2", "tokenizer_2", "scheduler"]
# Each component's config file, read before any weight: transformers builds a text encoder whose config.json is missing
# from its class's default config (Qwen2.5-VL's is 8192 wide), which filled the host's memory until the kernel killed
# the rank, and a tokenizer without tokenizer_config.json loads with no padding token, failing every request.
CONFIG_FILES = {"transformer": "config.json", "vae": "config.json", "text_encoder": "config.json",
                "tokenizer": "tokenizer_config.json", "text_encoder_2": "config.json",
                "tokenizer_2": "tokenizer_config.json", "scheduler": "scheduler_config.json",
                "audio_vae": "config.json", "vocoder": "config.json"}


@dataclass(kw_only=True)
class GenerationModels:
    """Everything a generation request needs, loaded and placed on one device."""

    transformer: Kandinsky6Transformer
    vae: Any  # diffusers AutoencoderKLHunyuanVideo
    text_encoder: Any  # transformers Qwen2_5_VLForConditionalGeneration
    tokenizer: Any
    text_encoder_2: Any  # transformers CLIPTextModel
    tokenizer_2: Any
    scheduler_class: str
    scheduler_config: dict
    audio_vae: Any | None
    vocoder: Any | None
    device: torch.device
    dtype: torch.dtype
    variant: Variant
    source: str  # folder path or "dummy"

    @property
    def transformer_config(self) -> Kandinsky6TransformerConfig:
        return self.transformer.config

    @property
    def has_audio(self) -> bool:
        return self.audio_vae is not None and self.vocoder is not None


def load_generation_models(
    folder: Path | None, variant: Variant, *, device: torch.device, dtype: torch.dtype, load_format: str,
    weights_device: torch.device | None = None, component_devices: Mapping[str, torch.device] | None = None,
) -> GenerationModels:
    """`device` runs the requests; the weights go to `weights_device` (default: `device`), except the components
    named in `component_devices`, which go where it says (with some components offloaded, the resident ones load
    straight onto the GPU: loading every weight on the host and moving the resident ones after made Pro-distill's
    load 29 s longer on an H200)."""
    weights_device = device if weights_device is None else weights_device
    overrides = dict(component_devices or {})

    def where(component: str) -> torch.device:
        return overrides.get(component, weights_device)

    if load_format == "dummy":
        return _build_dummy(variant, device=device, dtype=dtype, where=where)
    assert folder is not None
    index = read_model_index(folder)
    unlisted = unlisted_audio_components(index)
    with_audio = not unlisted
    # The audio components are optional, as in diffusers (no audio track then), but listed ones must be there: a
    # listed folder that is missing was an internal error with a "check your internet connection" text.
    components = REQUIRED + (["audio_vae", "vocoder"] if with_audio else [])
    require_components(folder, index, components)
    for component in components:
        read_component_config(folder, component, CONFIG_FILES[component])
    if not with_audio:
        logger.warning("%s: model_index.json lists no %s, so the videos will have no audio track (the released "
                       "checkpoints have audio_vae and vocoder; copy them from the checkpoint's source for audio).",
                       folder, " or ".join(unlisted))
    scheduler_class = index_class(index, "scheduler", folder / "model_index.json")
    if scheduler_class not in SCHEDULER_CLASSES:
        # Loaded, then every request failed "Unsupported scheduler", naming no file.
        raise CheckpointError(f"{folder / 'model_index.json'} names the scheduler {scheduler_class!r}; Kandinsky 6 "
                              f"generation runs {' or '.join(SCHEDULER_CLASSES)} (the released checkpoints' "
                              "schedulers): restore the file from the checkpoint's source.")
    scheduler_config = read_component_config(folder, "scheduler", "scheduler_config.json")
    transformer = load_transformer(folder / "transformer", device=where("transformer"), dtype=dtype)
    _check_scheduler_fits_head(transformer.config, scheduler_class, scheduler_config, folder)
    return GenerationModels(
        transformer=transformer,
        vae=_load_diffusers(folder, "vae", "AutoencoderKLHunyuanVideo", where("vae"), dtype),
        text_encoder=_load_transformers(folder, "text_encoder", "Qwen2_5_VLForConditionalGeneration",
                                        where("text_encoder"), dtype),
        tokenizer=_load_tokenizer(folder / "tokenizer"),
        text_encoder_2=_load_transformers(folder, "text_encoder_2", "CLIPTextModel", where("text_encoder_2"), dtype),
        tokenizer_2=_load_tokenizer(folder / "tokenizer_2"),
        scheduler_class=scheduler_class,
        scheduler_config=scheduler_config,
        audio_vae=_load_diffusers(folder, "audio_vae", "MMAudioVAE", where("audio_vae"), dtype) if with_audio else None,
        vocoder=_load_diffusers(folder, "vocoder", "MMAudioVocoder", where("vocoder"), dtype) if with_audio else None,
        device=device,
        dtype=dtype,
        variant=variant,
        source=str(folder),
    )


def load_transformer(component_dir: Path, *, device: torch.device, dtype: torch.dtype) -> Kandinsky6Transformer:
    config_dict = read_json_file(component_dir / "config.json")
    try:
        config = Kandinsky6TransformerConfig.from_json_dict(config_dict)
    except ValueError as exc:  # the key and the value; the file too
        raise CheckpointError(f"{component_dir / 'config.json'}: {exc}; copy or download the checkpoint "
                              "again.") from None
    check_block_counts(component_dir, {
        "visual_transformer_blocks": ("num_visual_blocks", config.num_visual_blocks),
        "video_text_transformer_blocks": ("num_text_blocks", config.num_text_blocks),
        "audio_text_transformer_blocks": ("num_text_blocks", config.num_text_blocks)})
    with torch.device("meta"):
        model = cast_for_inference(Kandinsky6Transformer(config), dtype)  # the dtypes the weights are read into
    expected = {name: tensor.shape for name, tensor in model.state_dict().items()}
    floating = [name for name, tensor in model.state_dict().items() if tensor.is_floating_point()]
    check_state_dict(expected, header_state_dict(component_dir), f"{component_dir.name} ({component_dir})", floating)
    # Each tensor read straight onto `device`, cast as diffusers' from_pretrained casts (`cast_for_inference`).
    state = load_state_dict(component_dir, device, dtypes={name: p.dtype for name, p in model.named_parameters()})
    check_state_dict(expected, state, f"{component_dir.name} ({component_dir})", floating)
    model.load_state_dict(state, strict=True, assign=True)  # every tensor is already on `device`
    del state
    return model.eval().requires_grad_(False)


def _check_scheduler_fits_head(config: Kandinsky6TransformerConfig, scheduler_class: str, scheduler_config: dict,
                               folder: Path) -> None:
    """A PiFlow scheduler needs n_grid-wide heads, a flow-matching one plain heads; anything else cannot run."""
    if scheduler_class == "PiflowScheduler":
        n_grid = scheduler_config.get("n_grid", 10)
        if isinstance(n_grid, bool) or not isinstance(n_grid, int) or n_grid < 1:  # null was "a bug in k6serve"
            raise CheckpointError(f"{folder / 'scheduler' / 'scheduler_config.json'}: n_grid must be a whole number "
                                  f"> 0, got {json.dumps(n_grid)}; copy or download the checkpoint again.")
        substeps = scheduler_config.get("num_policy_substeps", 128)
        try:
            config_count(substeps, "num_policy_substeps", str(folder / "scheduler" / "scheduler_config.json"),
                         high=MAX_POLICY_SUBSTEPS)
        except ValueError as exc:
            raise CheckpointError(str(exc)) from None
        visual, audio = n_grid * config.in_visual_dim, n_grid * config.in_audio_dim
        ok = config.out_visual_dim == visual and config.out_audio_dim == audio
        want = f"{n_grid} x latent channels ({visual} video / {audio} audio)"
    else:
        ok = config.out_visual_dim == config.in_visual_dim and config.out_audio_dim == config.in_audio_dim
        want = f"the latent channels ({config.in_visual_dim} video / {config.in_audio_dim} audio)"
    if not ok:
        raise CheckpointError(
            f"{folder}: scheduler {scheduler_class} needs output heads of width {want}, but the transformer has "
            f"out_visual_dim {config.out_visual_dim} / out_audio_dim {config.out_audio_dim}. The scheduler and the "
            "transformer come from different repositories or revisions; re-download the checkpoint."
        )


# A byte-level BPE tokenizer (Qwen's and CLIP's) is its tokenizer.json, or its vocab.json with merges.txt.
_VOCABULARY_FILES = (("tokenizer.json",), ("vocab.json", "merges.txt"))
_PROBE_TEXT = "A cat plays the piano"


def _load_tokenizer(path: Path):
    """The component's tokenizer, refused when it has no vocabulary: without its tokenizer.json transformers
    builds one from tokenizer_config.json alone (the special tokens: 8 for Qwen, 2 for CLIP) with no error, which
    encodes every prompt as nothing (Qwen) or unknown tokens (CLIP), so each video was generated from no prompt."""
    from transformers import AutoTokenizer

    fix = "copy or download the checkpoint again"
    if not any(all((path / name).is_file() for name in names) for names in _VOCABULARY_FILES):
        present = folder_listing(path)
        raise CheckpointError(f"The tokenizer in {path} has no vocabulary: it needs tokenizer.json (or vocab.json "
                              f"and merges.txt) and holds {present}, e.g. after an interrupted download; {fix}.")
    try:
        # Said, not left to the default: a tokenizer_config.json whose `auto_map` names the folder's own Python code
        # made transformers ask on the terminal whether to run it, and run it on "y". False uses transformers' own
        # class where the config names one, and refuses otherwise.
        tokenizer = AutoTokenizer.from_pretrained(str(path), trust_remote_code=False)
    except Exception as exc:  # transformers raises many types here; the path is what the user needs
        if "trust_remote_code" in str(exc):
            raise CheckpointError(f"The tokenizer in {path} needs its own Python code ('auto_map' in "
                                  "tokenizer_config.json, with no tokenizer class of transformers'); k6serve runs no "
                                  f"code from a checkpoint. The released checkpoints' tokenizers need none: {fix}."
                                  ) from None
        raise CheckpointError(f"Cannot load the tokenizer in {path}: {exc}") from exc
    ids = tokenizer(_PROBE_TEXT, add_special_tokens=False)["input_ids"]
    if not ids or all(i == tokenizer.unk_token_id for i in ids):
        raise CheckpointError(f"The tokenizer in {path} ({len(tokenizer)} tokens) encodes {_PROBE_TEXT!r} as "
                              f"{ids}: its vocabulary files are damaged or from another tokenizer; {fix}.")
    return tokenizer


def _report_loading_info(component: str, folder: Path, info: dict) -> None:
    problems = {k: v for k, v in info.items() if k in ("missing_keys", "unexpected_keys", "mismatched_keys") and v}
    if problems:
        detail = "; ".join(f"{k}: {sorted(map(str, v))[:8]}" for k, v in problems.items())
        raise CheckpointError(
            f"{component} weights in {folder / component} do not match its config ({detail}). The config and "
            "weights come from different repositories or revisions; re-download the component."
        )


def _load_transformers(folder: Path, component: str, class_name: str, device: torch.device, dtype: torch.dtype):
    import transformers

    cls = getattr(transformers, class_name)
    with _component_load_errors(folder, component):
        # Straight onto `device` (one device: no dispatch hooks), not loaded on the host and moved: Qwen2.5-VL-7B's
        # 16.6 GB in 10.9 s cold and 2.9 s warm against 12.4 s and 3.6 s on an H100 host, the same bits
        # (scripts/gpu_load.py --stage text-encoder, fifty-third session).
        model, info = cls.from_pretrained(str(folder / component), dtype=dtype, output_loading_info=True,
                                          use_safetensors=True, device_map={"": device})
    _report_loading_info(component, folder, info)
    return model.to(device).eval().requires_grad_(False)


def _load_diffusers(folder: Path, component: str, class_name: str, device: torch.device, dtype: torch.dtype):
    import diffusers

    cls = getattr(diffusers, class_name)
    with _component_load_errors(folder, component):
        model, info = cls.from_pretrained(str(folder / component), torch_dtype=dtype, output_loading_info=True,
                                          use_safetensors=True)
    _report_loading_info(component, folder, info)
    return model.to(device).eval().requires_grad_(False)


@contextlib.contextmanager
def _component_load_errors(folder: Path, component: str):
    """A component's files missing or unreadable (a weight file or shard gone, only a variant's weights): diffusers
    and transformers raise OSError, whose text may talk of the Hub ("check your internet connection") for a local
    folder, and which k6serve reported as an internal error. Said as a checkpoint problem naming the folder, with
    what it holds."""
    try:
        yield
    except (ValueError, RuntimeError) as exc:
        # The weights and config.json disagree (diffusers' "Cannot load  because ... expected shape", transformers'
        # "ignore_mismatched_sizes": an internal error, advising flags k6serve has not), or the config asks for a
        # tensor larger than the host (an edited size: "the host ran out of memory, ask for fewer pixels").
        config = folder / component / "config.json"
        text = str(exc)
        wanted = re.search(r"tried to allocate (\d+) bytes", text)
        if wanted is not None and int(wanted[1]) > _host_memory_bytes():
            raise CheckpointError(f"{config} asks for a tensor of {int(wanted[1]) / 2**30:,.0f} GiB, more than this "
                                  "host's memory: the config is damaged or edited; copy or download the checkpoint "
                                  "again.") from exc
        if isinstance(exc, torch.OutOfMemoryError) or wanted is not None or not (
                "expected shape" in text or "ignore_mismatched_sizes" in text or "size mismatch" in text):
            raise
        detail = (text.split(". If you want")[0].replace("Cannot load  because ", "").strip()
                  if "expected shape" in text else  # diffusers names the weight
                  "a weight's shape differs from the config's; transformers' warning in the log names it")
        raise CheckpointError(f"{component}'s weights in {folder / component} do not fit its config.json ({detail}). "
                              "The config and weights come from different repositories or revisions, or the config "
                              "was edited; copy or download the checkpoint again.") from exc
    except OSError as exc:
        directory = folder / component
        present = folder_listing(directory)
        raise CheckpointError(f"Cannot load {component} from {directory} (it holds {present}): "
                              f"{(str(exc).splitlines() or [type(exc).__name__])[0].rstrip('.')}. The folder lacks "
                              "files of the component, or holds only a variant's weights (e.g. .fp16.safetensors) "
                              "or pickled .bin weights (k6serve reads safetensors only, the released format, which "
                              "cannot run code when loaded); copy or download the checkpoint again.") from exc


def _host_memory_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):  # no sysconf (Windows): any size may be the host's
        return 2**62


def dummy_qwen_config(tokenizer):
    """The released Qwen2.5-VL-7B config for a `--load-format dummy` text encoder, its vision token ids the trained
    `tokenizer`'s: with the released ids (151655 for `<|image_pad|>`) the encoder found no image placeholder in the
    trained tokenizer's ids, and every rewrite with an image (expand_prompts; the compiled rewrite's warm-up) failed
    with "Image features and image tokens do not match, tokens: 0" (forty-sixth session, on an H100)."""
    import transformers

    from k6serve.testing.tokenizers import qwen_vision_token_ids

    return transformers.Qwen2_5_VLConfig(**{**encoder_configs.QWEN25_VL_7B, **qwen_vision_token_ids(tokenizer)})


def cast_without_warning(module: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """`module.to(dtype)` by torch's own `Module.to`: diffusers' override (0.42.1) warns "There are modules in
    AutoencoderKLHunyuanVideo that should be kept in float32: []" on every cast, even with none to keep, which put
    three such lines in every dummy build's output. Its cast is the same: it warns and then casts every module."""
    return torch.nn.Module.to(module, dtype)


# The seeds of the dummy build's components other than the DiT (whose weights come from `build_dummy_transformer`'s
# own generator, seed 0).
DUMMY_COMPONENT_SEEDS = {"text_encoder": 1, "text_encoder_2": 2, "vae": 3, "audio_vae": 4, "vocoder": 5}


def _build_dummy(variant: Variant, *, device: torch.device, dtype: torch.dtype,
                 where: Callable[[str], torch.device]) -> GenerationModels:
    """Released sizes, random weights, each component created on `where(name)` in `dtype` (benchmarks; outputs
    are noise).

    On the host beside a GPU (offloading) the random numbers are still drawn on the GPU, which is what makes the
    build take seconds: one CPU generator draws about 100 M values per 0.5 s, so Pro's 38 B parameters would take
    over three minutes. The DiT, which need not fit on the GPU, is drawn one
    parameter at a time and copied to its host storage, from the same generator sequence as a GPU build, so its
    weights equal the resident build's; every other component is built on the GPU and then moved to the host (each
    must fit on the GPU anyway, for its stage)."""
    import transformers
    # From their defining modules: mypy types diffusers' top-level names as its torch-less placeholders
    # (dummy_pt_objects).
    from diffusers.models.autoencoders.autoencoder_kl_hunyuan_video import AutoencoderKLHunyuanVideo
    from diffusers.models.autoencoders.autoencoder_mmaudio import MMAudioVAE
    from diffusers.models.autoencoders.mmaudio_vocoder import MMAudioVocoder

    from k6serve.testing.tokenizers import train_clip_tokenizer, train_qwen_tokenizer

    def build_device(target: torch.device) -> torch.device:
        return device if device.type == "cuda" and target.type == "cpu" else target

    transformer = build_dummy_transformer(released_transformer_config(variant), device=where("transformer"),
                                          dtype=dtype, random_device=build_device(where("transformer")))

    def built(component: str, make):
        target = where(component)
        build = build_device(target)
        module = build_dummy_component(component, make, build)
        return _move_to_host(module) if build != target else module

    tokenizer = train_qwen_tokenizer()
    qwen_config = dummy_qwen_config(tokenizer)
    text_encoder = built("text_encoder", lambda: transformers.Qwen2_5_VLForConditionalGeneration._from_config(
        qwen_config, dtype=dtype))
    clip_config = transformers.CLIPTextConfig(**encoder_configs.CLIP_VIT_L14_TEXT)
    text_encoder_2 = built("text_encoder_2", lambda: transformers.CLIPTextModel._from_config(clip_config, dtype=dtype))
    vae = built("vae", lambda: cast_without_warning(AutoencoderKLHunyuanVideo(), dtype))
    audio_vae = built("audio_vae", lambda: cast_without_warning(MMAudioVAE(), dtype))
    vocoder = built("vocoder", lambda: cast_without_warning(MMAudioVocoder(), dtype))
    if variant.distilled:
        scheduler_class = "PiflowScheduler"
        scheduler_config = {"shift": 5.0, "n_grid": 10, "eps": 1e-6, "final_step_size_scale": 0.5,
                            "num_policy_substeps": 128, "num_train_timesteps": 1000}
    else:
        scheduler_class = "FlowMatchEulerDiscreteScheduler"
        scheduler_config = {"shift": 5.0, "num_train_timesteps": 1000}
    return GenerationModels(
        transformer=transformer,
        vae=vae.eval().requires_grad_(False),
        text_encoder=text_encoder.eval().requires_grad_(False),
        # Random weights need no real vocabulary: the project's offline BPE tokenizers keep the 129-token
        # template crop exact and produce ids inside the real vocab.
        tokenizer=tokenizer,
        text_encoder_2=text_encoder_2.eval().requires_grad_(False),
        tokenizer_2=train_clip_tokenizer(),
        scheduler_class=scheduler_class,
        scheduler_config=scheduler_config,
        audio_vae=audio_vae.eval().requires_grad_(False),
        vocoder=vocoder.eval().requires_grad_(False),
        device=device,
        dtype=dtype,
        variant=variant,
        source="dummy",
    )


def build_dummy_component(component: str, make: Callable[[], nn.Module], build: torch.device) -> nn.Module:
    """`make()` (one of the dummy build's components other than the DiT) on `build`, its random weights drawn from
    the component's seed (`DUMMY_COMPONENT_SEEDS`); `k6serve bench` builds its components with it too.

    transformers' and diffusers' initialisers draw from torch's global generators: seeded here per component (the
    DiT has its own generator), so that every build has the same weights whatever the process drew before (a second
    engine in one process; a folder written from one build, compared with another; two bench processes). Before, a
    build's weights depended on the process's history. The caller's random state is restored."""
    seed = DUMMY_COMPONENT_SEEDS[component]
    cuda_devices = ([build.index if build.index is not None else torch.cuda.current_device()]
                    if build.type == "cuda" else [])
    with torch.random.fork_rng(devices=cuda_devices), torch.device(build):
        torch.random.default_generator.manual_seed(seed)
        for index in cuda_devices:  # only the GPU drawn on: torch.manual_seed would reseed every GPU's
            with torch.cuda.device(index):
                torch.cuda.manual_seed(seed)
        module = make()
        if build.type != "cpu":
            _buffers_computed_on_host(module, make)
    return module


def _buffers_computed_on_host(module: nn.Module, make: Callable[[], nn.Module]) -> None:
    """Recompute `module`'s floating non-persistent buffers (Qwen2.5-VL's rotary frequencies) on the host.

    A checkpoint stores no such buffer: transformers' from_pretrained computes it on the host as it loads, then
    copies it to the weights' device. The dummy build, made on the GPU, computed it there, where `pow` rounds
    differently in the last place: a full-size folder written from a dummy build and loaded gave another MP4 than
    the dummy build (every stored tensor equal; the rotary frequencies up to 3e-8 apart; H200, fifty-fifth session,
    `scripts/gpu_folder_diagnose.py`). A shell of the module, its parameters on the meta device (no weights drawn,
    a 7B shell in 0.3 s), gives the host's values."""
    from accelerate import init_empty_weights

    stored = module.state_dict().keys()
    targets = {name: buffer for name, buffer in module.named_buffers()
               if name not in stored and buffer.is_floating_point()}
    if not targets:
        return
    with torch.random.fork_rng(devices=[]), init_empty_weights(include_buffers=False), torch.device("cpu"):
        shell = make()
    host = dict(shell.named_buffers())
    with torch.no_grad():
        for name, buffer in targets.items():
            buffer.copy_(host[name])


def build_dummy_transformer(config_dict: dict, *, device: torch.device, dtype: torch.dtype,
                            seed: int = 0, random_device: torch.device | None = None) -> Kandinsky6Transformer:
    """Allocate the DiT directly in `dtype` on `device` and fill it with small random weights, drawn on
    `random_device` (default `device`) one parameter at a time: the same values for any `device`."""
    config = Kandinsky6TransformerConfig.from_json_dict(config_dict)
    with torch.device("meta"):
        model = Kandinsky6Transformer(config)
    cast_for_inference(model, dtype)  # on meta: only records the dtypes to allocate
    if torch.device(device).type == "meta":
        return model.eval().requires_grad_(False)
    model.to_empty(device=device)
    random_device = torch.device(device if random_device is None else random_device)
    generator = torch.Generator(device=random_device).manual_seed(seed)

    def draw(param: torch.Tensor, std: float) -> None:
        if param.device == random_device:
            param.normal_(0.0, std, generator=generator)
        else:
            _fault_in(param)
            param.copy_(torch.empty(param.shape, dtype=param.dtype, device=random_device).normal_(
                0.0, std, generator=generator))

    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.ndim >= 2:
                draw(param, 0.02)
            elif name.endswith("norm.weight") or name.endswith("_norm.weight"):
                param.fill_(1.0)
            else:
                draw(param, 0.01)
    return model.eval().requires_grad_(False)


def _fault_in(host: torch.Tensor) -> None:
    # A fresh host allocation's pages are faulted in by whoever touches them first; a copy from the GPU does that on
    # one thread (on the H200 host the dummy Pro DiT's 56 GiB took 46 s to copy), torch's fill on all of them.
    if host.device.type == "cpu":
        host.zero_()


def _move_to_host(module: nn.Module) -> nn.Module:
    """`module.to("cpu")`, its host tensors' pages faulted in on torch's threads before each copy (`_fault_in`:
    a GPU-built Qwen2.5-VL's 15.5 GiB took 17 s to move with `.to`). A tied parameter (one Parameter object
    under two modules) is copied once: `_apply` visits it from each owner, and the second visit returns the
    first copy rather than copying the already-moved tensor again."""
    copies: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id -> (source kept alive, its host copy)

    def moved(tensor: torch.Tensor) -> torch.Tensor:
        if id(tensor) in copies:
            return copies[id(tensor)][1]
        host = torch.empty_like(tensor, device="cpu")
        _fault_in(host)
        host.copy_(tensor)
        copies[id(tensor)] = (tensor, host)
        return host

    return module._apply(moved)


def count_parameters(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())
