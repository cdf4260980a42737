"""Tiny random-weight Kandinsky 6 generation checkpoints in the real Diffusers layout; the demo.

Every component is the real diffusers / transformers class with only its sizes shrunk
(k6-generation.md §7), so the saved folder has exactly the layout of the released checkpoints (§1.1)
and diffusers itself can reload it as the numerical reference. Builds are deterministic in `seed`
and need no network.
"""

import copy
import json
import math
import os
import shutil
import tempfile
import time
import zlib
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch
from diffusers import FlowMatchEulerDiscreteScheduler, PiflowScheduler
from torch import nn
from transformers import (
    CLIPTextConfig,
    CLIPTextModel,
    CLIPTokenizer,
    Qwen2_5_VLConfig,
    Qwen2_5_VLForConditionalGeneration,
    Qwen2Tokenizer,
)

if TYPE_CHECKING:
    # The classes' own modules: mypy reads diffusers' top-level names as the dummies it defines for no torch.
    from diffusers.models.autoencoders.autoencoder_kl_hunyuan_video import AutoencoderKLHunyuanVideo
    from diffusers.models.autoencoders.autoencoder_mmaudio import MMAudioVAE
    from diffusers.models.autoencoders.mmaudio_vocoder import MMAudioVocoder
    from diffusers.models.transformers.transformer_kandinsky6 import Kandinsky6Transformer3DModel
    from diffusers.pipelines.kandinsky6.pipeline_kandinsky6_ti2va import Kandinsky6TI2VAPipeline
else:
    from diffusers import (
        AutoencoderKLHunyuanVideo,
        Kandinsky6TI2VAPipeline,
        Kandinsky6Transformer3DModel,
        MMAudioVAE,
        MMAudioVocoder,
    )

from k6serve.testing.demo_location import (
    DEMO_DEFAULTS,
    DEMO_MARKER_NAME,
    built_demo_checkpoint,
    demo_checkpoint_dir,
)
from k6serve.testing.tiny_configs import AUDIO_LATENT_CHANNELS, PIFLOW_N_GRID, tiny_transformer_config
from k6serve.testing.tokenizers import (
    build_qwen_processor,
    load_qwen_processor,
    qwen_vision_token_ids,
    train_clip_tokenizer,
    train_qwen_tokenizer,
)

VARIANTS = ("pro", "distill", "lite")
# PiFlow distilled heads predict n_grid candidate velocities per channel.
# Released audio-VAE scaling factors (k6-generation.md §1.3): Pro-sft 0.5302, Pro-distill 0.417.
_AUDIO_SCALING_FACTOR = {"pro": 0.5302, "lite": 0.5302, "distill": 0.417}


def _build_transformer(variant: str) -> Kandinsky6Transformer3DModel:
    return Kandinsky6Transformer3DModel(**tiny_transformer_config(distilled=variant == "distill"))


def _build_vae() -> AutoencoderKLHunyuanVideo:
    # Four levels like the real VAE (8x spatial, 4x temporal) but 8 channels wide: 17 frames at
    # 64x96 decode in ~0.3 s on one CPU core.
    return AutoencoderKLHunyuanVideo(
        block_out_channels=(8, 8, 8, 8), layers_per_block=1, norm_num_groups=4
    )


def _build_qwen_text_encoder(tokenizer: Qwen2Tokenizer) -> Qwen2_5_VLForConditionalGeneration:
    special_ids: dict[str, Any] = qwen_vision_token_ids(tokenizer)
    text_config = {
        "vocab_size": len(tokenizer),
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-6,
        # head_dim 16 -> 8 rotary pairs split over (t, h, w).
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 1_000_000.0,
            "mrope_section": [2, 2, 4],
        },
        "bos_token_id": tokenizer.convert_tokens_to_ids("<|endoftext|>"),
        "eos_token_id": tokenizer.convert_tokens_to_ids("<|im_end|>"),
        "pad_token_id": tokenizer.pad_token_id,
    }
    vision_config = {
        "depth": 1,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_heads": 2,
        "out_hidden_size": 32,
        "fullatt_block_indexes": [0],
    }
    config = Qwen2_5_VLConfig(text_config=text_config, vision_config=vision_config, **special_ids)
    return Qwen2_5_VLForConditionalGeneration(config).eval()


def _build_clip_text_encoder(tokenizer: CLIPTokenizer) -> CLIPTextModel:
    config = CLIPTextConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        projection_dim=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        max_position_embeddings=77,
        bos_token_id=tokenizer.bos_token_id,
        # The legacy OpenAI value: the pooled token is then argmax(input_ids), the first EOS.
        eos_token_id=2,
        pad_token_id=tokenizer.pad_token_id,
    )
    return CLIPTextModel(config).eval()


def _build_audio_vae(variant: str) -> MMAudioVAE:
    # Real 44.1 kHz / n_fft 2048 / hop 512, so audio lengths (1024 samples per latent) are real.
    return MMAudioVAE(
        mel_bins=16,
        latent_channels=AUDIO_LATENT_CHANNELS,
        hidden_channels=8,
        channel_multipliers=(1, 2),
        scaling_factor=_AUDIO_SCALING_FACTOR[variant],
    )


def _build_vocoder() -> MMAudioVocoder:
    # Real upsample rates / kernels / resblocks (product 512 = hop), only the channel width shrunk.
    return MMAudioVocoder(num_mels=16, upsample_initial_channel=64)


def _build_scheduler(variant: str) -> FlowMatchEulerDiscreteScheduler | PiflowScheduler:
    if variant == "distill":
        return PiflowScheduler(
            shift=5.0,
            n_grid=PIFLOW_N_GRID,
            eps=1e-6,
            final_step_size_scale=0.5,
            num_policy_substeps=128,
        )
    return FlowMatchEulerDiscreteScheduler(shift=5.0)


@torch.no_grad()
def rerandomize_(module: nn.Module, seed: int) -> None:
    """Overwrite every parameter with seeded random values, so every gate and path is non-zero.

    Matrices N(0, 0.02), vectors N(0, 0.01), norm weights N(1, 0.05). Convolution kernels use
    N(0, 1/sqrt(fan_in)) instead: the conv-only VAEs and vocoder have few norms, and 0.02 would
    shrink their signal to nothing.
    """
    generator = torch.Generator().manual_seed(seed)
    for submodule in module.modules():
        is_norm = "Norm" in type(submodule).__name__
        for name, param in submodule.named_parameters(recurse=False):
            noise = torch.randn(param.shape, generator=generator, dtype=torch.float32)
            if is_norm and name == "weight":
                value = 1.0 + 0.05 * noise
            elif param.ndim >= 3:
                value = noise / math.sqrt(param[0].numel())
            elif param.ndim == 2:
                value = 0.02 * noise
            else:
                value = 0.01 * noise
            param.copy_(value.to(param.dtype))


def _component_seed(seed: int, name: str) -> int:
    # Per-component seeds keep each component's weights independent of which others are built.
    return seed * 1_000_003 + zlib.crc32(name.encode())


def build_generation_pipeline(
    variant: str = "pro", seed: int = 0, *, with_audio: bool = True
) -> Kandinsky6TI2VAPipeline:
    """Build the tiny random-weight `Kandinsky6TI2VAPipeline` in memory (fp32, CPU, eval mode)."""
    if variant not in VARIANTS:
        raise ValueError(
            f"unknown tiny checkpoint variant {variant!r}; use one of {', '.join(VARIANTS)}"
        )
    qwen_tokenizer = train_qwen_tokenizer()
    clip_tokenizer = train_clip_tokenizer()
    # Constructors draw from the global RNG; fork it so a build leaves the caller's RNG untouched.
    with torch.random.fork_rng(devices=[]):
        components: dict[str, Any] = {  # the pipeline's modules, by its keyword names
            "transformer": _build_transformer(variant),
            "vae": _build_vae(),
            "text_encoder": _build_qwen_text_encoder(qwen_tokenizer),
            "text_encoder_2": _build_clip_text_encoder(clip_tokenizer),
        }
        if with_audio:
            components["audio_vae"] = _build_audio_vae(variant)
            components["vocoder"] = _build_vocoder()
    for name, component in components.items():
        rerandomize_(component, _component_seed(seed, name))
        component.eval()
    if with_audio:
        _randomize_mel_statistics_(components["audio_vae"], _component_seed(seed, "audio_vae.data"))
        # With random weights the vocoder's residual stacks grow the signal ~14x; shrink the last
        # conv so the waveform mostly stays inside the vocoder's [-1, 1] clamp, not saturated.
        with torch.no_grad():
            components["vocoder"].conv_post.weight.mul_(1 / 32)
    return Kandinsky6TI2VAPipeline(
        tokenizer=build_qwen_processor(qwen_tokenizer),
        tokenizer_2=clip_tokenizer,
        scheduler=_build_scheduler(variant),
        **components,
    )


@torch.no_grad()
def _randomize_mel_statistics_(audio_vae: MMAudioVAE, seed: int) -> None:
    # The per-bin mel mean/std are persistent buffers, not parameters; make them non-trivial too.
    generator = torch.Generator().manual_seed(seed)
    # buffers, which nn.Module's attribute lookup types as Tensor | Module
    data_mean, data_std = cast(torch.Tensor, audio_vae.vae.data_mean), cast(torch.Tensor, audio_vae.vae.data_std)
    data_mean.copy_(0.1 * torch.randn(data_mean.shape, generator=generator))
    data_std.copy_(1.0 + 0.05 * torch.randn(data_std.shape, generator=generator).abs())


def build_generation_checkpoint(
    out_dir: Path, variant: str = "pro", seed: int = 0, *, with_audio: bool = True
) -> Path:
    """Write a tiny Diffusers-layout K6 generation checkpoint to `out_dir` and return it."""
    pipeline = build_generation_pipeline(variant, seed, with_audio=with_audio)
    out_dir = Path(out_dir)
    pipeline.save_pretrained(out_dir, safe_serialization=True)
    return out_dir


def build_foldable_generation_checkpoint(out_dir: Path) -> Path:
    """The tiny Pro checkpoint (seed 0) with 2 key/value heads in Qwen (the stock tiny one has 1), so that 2 ranks
    can fold the text encoders (`--encoder-parallel fold`); its other components are the stock ones."""
    pipeline = build_generation_pipeline("pro", seed=0)
    config = copy.deepcopy(pipeline.text_encoder.config)
    config.text_config.num_key_value_heads = 2
    with torch.random.fork_rng(devices=[]):
        text_encoder = Qwen2_5_VLForConditionalGeneration(config).eval()
    rerandomize_(text_encoder, seed=4242)
    pipeline.text_encoder = text_encoder
    out_dir = Path(out_dir)
    pipeline.save_pretrained(out_dir, safe_serialization=True)
    return out_dir


def load_reference_pipeline(
    ckpt_dir: Path, dtype: torch.dtype = torch.float32
) -> Kandinsky6TI2VAPipeline:
    """Reload a saved checkpoint with diffusers, as the numerical reference.

    The `tokenizer` is passed explicitly because diffusers would build `Qwen2_5_VLProcessor` through
    `from_pretrained`, which requires torchvision (k6-generation.md §7.3). Outputs are bitwise equal
    to those of the in-memory pipeline that was saved.
    """
    ckpt_dir = Path(ckpt_dir)
    processor = load_qwen_processor(ckpt_dir / "tokenizer")
    pipeline = Kandinsky6TI2VAPipeline.from_pretrained(ckpt_dir, tokenizer=processor, dtype=dtype)
    for component in pipeline.components.values():
        if isinstance(component, nn.Module):
            _copy_to_fresh_storage_(component)
    return pipeline


@torch.no_grad()
def _copy_to_fresh_storage_(module: nn.Module) -> None:
    # safetensors tensors are memory-mapped at unaligned offsets in the file; CPU GEMM kernels take
    # other code paths for them and round differently (~1e-7). Fresh allocations are 64-byte
    # aligned, like a freshly built model's.
    for tensor in [*module.parameters(), *module.buffers()]:
        tensor.data = tensor.data.clone()


# A build takes seconds; one older than this was abandoned (its process killed with SIGKILL, which skips the
# cleanup). By age, not by its process: the cache can be a home folder that several hosts share.
ABANDONED_BUILD_AGE_S = 6 * 3600


def _remove_abandoned_builds(final_dir: Path) -> None:
    """Remove the hidden build folders of `final_dir` that builds killed outright left (3 MB each, never reused)."""
    now = time.time()
    for stale in final_dir.parent.glob(f".{final_dir.name}.*"):
        try:
            if stale.is_dir() and now - stale.stat().st_mtime > ABANDONED_BUILD_AGE_S:
                shutil.rmtree(stale, ignore_errors=True)
        except OSError:
            continue


def ensure_demo_checkpoint(kind: str = "t2av") -> Path:
    """Return the cached random-weight demo checkpoint, building it once (atomically) if missing."""
    built = built_demo_checkpoint(kind)
    if built is not None:
        return built
    final_dir = demo_checkpoint_dir(kind)
    try:
        final_dir.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        source = "$K6SERVE_CACHE" if os.environ.get("K6SERVE_CACHE") else "the default cache (~/.cache/k6serve)"
        raise ValueError(f"cannot create the demo checkpoint's folder {final_dir.parent} under {source} "
                         f"({exc.strerror}); set K6SERVE_CACHE to a writable folder.") from None
    _remove_abandoned_builds(final_dir)
    # Build beside the final folder (same file system), then rename: no one sees a partial demo.
    build_dir = Path(tempfile.mkdtemp(prefix=f".{final_dir.name}.", dir=final_dir.parent))
    build_dir.chmod(0o755)
    try:
        if kind == "sr":
            from k6serve.testing.tiny_sr_checkpoint import build_sr_checkpoint

            build_sr_checkpoint(build_dir, head="distilled", seed=0)
            marker = {"demo": True, "variant": "sr"}
        else:
            build_generation_checkpoint(build_dir, "distill", seed=0)
            marker = {"demo": True, "variant": "distill", "defaults": DEMO_DEFAULTS}
        (build_dir / DEMO_MARKER_NAME).write_text(json.dumps(marker, indent=2) + "\n")
        try:
            os.rename(build_dir, final_dir)
        except OSError:
            # Another process won the race; its folder is complete because it was renamed in whole.
            if not (final_dir / DEMO_MARKER_NAME).is_file():
                raise ValueError(
                    f"{final_dir} exists but is not a complete demo checkpoint "
                    f"(no {DEMO_MARKER_NAME}); delete that folder and run again"
                ) from None
    finally:
        shutil.rmtree(build_dir, ignore_errors=True)
    return final_dir
