"""Typed values passed between pipeline stages (no shared mutable request object)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True, slots=True)
class TextEmbeddings:
    """One prompt encoded by Qwen2.5-VL (tokens) and CLIP (pooled), in the transformer dtype."""

    tokens_BLD: torch.Tensor  # (B, 1024, in_text_dim)
    pooled_BD: torch.Tensor  # (B, in_text_dim2)
    mask_BL: torch.Tensor | None  # bool key mask; None when no token is padding (as the reference)


@dataclass(frozen=True, slots=True)
class Conditioning:
    """Text for the positive branch and, with CFG, the negative branch."""

    positive: TextEmbeddings
    negative: TextEmbeddings | None


@dataclass(slots=True)
class Latents:
    """Denoising state: video (B, T, h, w, C) channels-last, audio (B, L, C)."""

    video_BTHWC: torch.Tensor
    audio_BLC: torch.Tensor | None
    # TI2AV: the clean reference-image latent appended as an extra tail frame, re-pinned every step.
    tail_BHWC: torch.Tensor | None = None
    rope_positions: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    token_type_ids_BT: torch.Tensor | None = None


@dataclass(frozen=True, slots=True)
class DecodedVideo:
    frames_float_THWC: torch.Tensor | None  # float32 in [0, 1] before quantisation (parity checks), or None
    frames_THWC: np.ndarray  # uint8


@dataclass(frozen=True, slots=True)
class DecodedAudio:
    waveform: np.ndarray  # float32 mono
    sample_rate: int
