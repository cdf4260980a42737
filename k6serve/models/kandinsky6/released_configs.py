"""The `transformer/config.json` dicts of the released Kandinsky 6 generation checkpoints.

Source: k6-generation.md §1.2, which took them from public third-party copies (the SGLang test that
embeds the Pro-distill file, the official ComfyUI contract, FastVideo and vLLM-Omni) [ext]; they have not
been compared with the Hub files byte for byte, and the Lite-distill output dims are inferred from
Pro-distill. `-sft` and `-pretrain` checkpoints share the Pro / Lite transformer configs.
Keys are exactly diffusers' init arguments; `_class_name` and Pro-distill's extra `is_multimodal` are
kept to show that unknown keys are ignored by `Kandinsky6TransformerConfig.from_json_dict`.
"""

from __future__ import annotations

from typing import Any

_PRO: dict[str, Any] = {
    "_class_name": "Kandinsky6Transformer3DModel",
    "in_visual_dim": 16,
    "out_visual_dim": 16,
    "in_text_dim": 3584,
    "in_text_dim2": 768,
    "time_dim": 1024,
    "patch_size": [1, 2, 2],
    "model_dim": 4096,
    "ff_dim": 16384,
    "num_text_blocks": 4,
    "num_visual_blocks": 60,
    "axes_dims": [32, 48, 48],
    "visual_cond": True,
    "in_audio_dim": 40,
    "out_audio_dim": 40,
    "model_dim_a": 2048,
    "time_dim_a": 1024,
    "ff_dim_a": 7168,
    "axes_dims_a": [32, 48, 48],
    "audio_freqs_scaling": 0.144,
    "scale_factor": [1.0, 2.0, 2.0],
    "text_token_padding": True,
    "ca_rope": True,
    "cross_gates": True,
    "fix_modulation": True,
    "visual_token_type_num_embeddings": 2,
}

_LITE: dict[str, Any] = {
    **_PRO,
    "time_dim": 512,
    "model_dim": 1792,
    "ff_dim": 7168,
    "num_text_blocks": 2,
    "num_visual_blocks": 32,
    "axes_dims": [16, 24, 24],
    "model_dim_a": 896,
    "time_dim_a": 512,
    "ff_dim_a": 3584,
    "axes_dims_a": [16, 24, 24],
}

# Distilled (PiFlow) heads predict n_grid = 10 outputs per channel, grid-major (g * C + c).
_DISTILLED_HEADS: dict[str, Any] = {"out_visual_dim": 160, "out_audio_dim": 400}

RELEASED_TRANSFORMER_CONFIGS: dict[str, dict[str, Any]] = {
    "pro": _PRO,
    "pro_distill": {**_PRO, **_DISTILLED_HEADS, "is_multimodal": True},
    "lite": _LITE,
    "lite_distill": {**_LITE, **_DISTILLED_HEADS},
}
