"""The tiny generation-DiT config shared by the parity tests, the tiny checkpoints and the bench smoke mode.

k6-generation.md §7.1: d=64, d_a=32, time dims 32, ff 128/64, 2 text + 2 fused blocks, head dim 16 (4 video and
2 audio heads), every released flag on. Importing this module pulls in nothing heavy (no diffusers).
"""

from __future__ import annotations

from typing import Any

VIDEO_LATENT_CHANNELS = 16
AUDIO_LATENT_CHANNELS = 8
PIFLOW_N_GRID = 10

TINY_TRANSFORMER_CONFIG: dict[str, Any] = {
    "in_visual_dim": VIDEO_LATENT_CHANNELS,
    "out_visual_dim": VIDEO_LATENT_CHANNELS,
    "in_text_dim": 32,
    "in_text_dim2": 32,
    "time_dim": 32,
    "patch_size": (1, 2, 2),
    "model_dim": 64,
    "ff_dim": 128,
    "num_text_blocks": 2,
    "num_visual_blocks": 2,
    "axes_dims": (4, 6, 6),
    "visual_cond": True,
    "in_audio_dim": AUDIO_LATENT_CHANNELS,
    "out_audio_dim": AUDIO_LATENT_CHANNELS,
    "model_dim_a": 32,
    "time_dim_a": 32,
    "ff_dim_a": 64,
    "axes_dims_a": (4, 6, 6),
    "audio_freqs_scaling": 0.144,
    "scale_factor": (1.0, 2.0, 2.0),
    "text_token_padding": True,
    "ca_rope": True,
    "cross_gates": True,
    "fix_modulation": True,
    "visual_token_type_num_embeddings": 2,
}


def tiny_transformer_config(*, distilled: bool = False) -> dict[str, Any]:
    """A copy of the tiny config; `distilled` widens the heads to the PiFlow grid (g * C + c)."""
    config = dict(TINY_TRANSFORMER_CONFIG)
    if distilled:
        config["out_visual_dim"] = VIDEO_LATENT_CHANNELS * PIFLOW_N_GRID
        config["out_audio_dim"] = AUDIO_LATENT_CHANNELS * PIFLOW_N_GRID
    return config
