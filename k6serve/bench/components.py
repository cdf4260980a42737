"""The non-DiT generation components a stage times: full size with random weights, or `--tiny`.

Full size mirrors `load_generation_models(..., load_format="dummy")` (the released configs, random
weights, built in the target dtype on the device, each from its seed by the same `build_dummy_component`,
so a stage times the weights an engine's dummy build has, in every process) but builds only what one stage
needs. `--tiny` takes
the components of the tiny test checkpoint (`k6serve.testing.tiny_checkpoints`), on the CPU.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch

from k6serve.bench.reference import import_diffusers
from k6serve.models.kandinsky6.checkpoint import build_dummy_component, cast_without_warning


@dataclass(kw_only=True)
class TextComponents:
    tokenizer: Any
    text_encoder: Any  # Qwen2_5_VLForConditionalGeneration
    tokenizer_2: Any
    text_encoder_2: Any  # CLIPTextModel


@functools.cache
def _tiny_pipeline():
    """Built once per process (training its tokenizers takes seconds); stages cast their parts in place."""
    from k6serve.testing.tiny_checkpoints import build_generation_pipeline

    return build_generation_pipeline("distill")


def _place(module, device: torch.device, dtype: torch.dtype):
    return cast_without_warning(module.to(device), dtype).eval().requires_grad_(False)


def build_video_vae(*, tiny: bool, device: torch.device, dtype: torch.dtype):
    """HunyuanVideo VAE (diffusers' class defaults = the released config) or the tiny one."""
    diffusers = import_diffusers()
    if tiny:
        return _place(_tiny_pipeline().vae, device, dtype)
    vae = build_dummy_component("vae", lambda: cast_without_warning(diffusers.AutoencoderKLHunyuanVideo(), dtype),
                                device)
    return vae.eval().requires_grad_(False)


def build_audio_decoder(*, tiny: bool, device: torch.device, dtype: torch.dtype):
    """(MMAudio VAE, vocoder) at the released sizes, or the tiny ones."""
    diffusers = import_diffusers()
    if tiny:
        pipe = _tiny_pipeline()
        return _place(pipe.audio_vae, device, dtype), _place(pipe.vocoder, device, dtype)
    audio_vae = build_dummy_component("audio_vae", lambda: cast_without_warning(diffusers.MMAudioVAE(), dtype), device)
    vocoder = build_dummy_component("vocoder", lambda: cast_without_warning(diffusers.MMAudioVocoder(), dtype), device)
    return audio_vae.eval().requires_grad_(False), vocoder.eval().requires_grad_(False)


def build_text_components(
    *, tiny: bool, device: torch.device, dtype: torch.dtype
) -> TextComponents:
    """Qwen2.5-VL-7B + CLIP-L text (random weights) with the offline tokenizers, or the tiny ones."""
    if tiny:
        pipe = _tiny_pipeline()
        return TextComponents(
            tokenizer=pipe.tokenizer.tokenizer,
            text_encoder=_place(pipe.text_encoder, device, dtype),
            tokenizer_2=pipe.tokenizer_2,
            text_encoder_2=_place(pipe.text_encoder_2, device, dtype),
        )
    import transformers

    from k6serve.models.kandinsky6 import encoder_configs
    from k6serve.models.kandinsky6.checkpoint import dummy_qwen_config
    from k6serve.testing.tokenizers import train_clip_tokenizer, train_qwen_tokenizer

    tokenizer = train_qwen_tokenizer()
    qwen_config = dummy_qwen_config(tokenizer)
    text_encoder = build_dummy_component("text_encoder", lambda: transformers.Qwen2_5_VLForConditionalGeneration
                                         ._from_config(qwen_config, dtype=dtype), device)
    clip_config = transformers.CLIPTextConfig(**encoder_configs.CLIP_VIT_L14_TEXT)
    text_encoder_2 = build_dummy_component(
        "text_encoder_2", lambda: transformers.CLIPTextModel._from_config(clip_config, dtype=dtype), device)
    return TextComponents(
        tokenizer=tokenizer,
        text_encoder=text_encoder.eval().requires_grad_(False),
        tokenizer_2=train_clip_tokenizer(),
        text_encoder_2=text_encoder_2.eval().requires_grad_(False),
    )
