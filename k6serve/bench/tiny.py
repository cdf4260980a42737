"""The `--tiny` CPU smoke configuration: every stage at toy size, so CI checks the harness, not speed."""

from __future__ import annotations

# The DiT of the parity tests (k6-generation.md §7.1) with every released flag on and distilled heads.
TINY_TRANSFORMER_CONFIG = {
    "in_visual_dim": 16,
    "out_visual_dim": 160,
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
    "in_audio_dim": 8,
    "out_audio_dim": 80,
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
TINY_HEIGHT, TINY_WIDTH, TINY_NUM_FRAMES = 64, 96, 17
TINY_NUM_TEXT_TOKENS = 16
