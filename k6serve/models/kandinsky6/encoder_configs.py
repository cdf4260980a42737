"""Built-in copies of the released non-DiT component configs, for `--load-format dummy` (no download).

Sources: the public Qwen2.5-VL-7B-Instruct and CLIP ViT-L/14 configs (k6-generation.md §1.1); the HunyuanVideo
VAE and MMAudio VAE/vocoder released sizes are the diffusers class defaults, so they need no copy here.
"""

from __future__ import annotations

from typing import Any

QWEN25_VL_7B: dict[str, Any] = {  # keyword arguments of transformers' config class (any JSON value)
    "model_type": "qwen2_5_vl",
    "text_config": {
        "model_type": "qwen2_5_vl_text",
        "hidden_size": 3584,
        "intermediate_size": 18944,
        "num_hidden_layers": 28,
        "num_attention_heads": 28,
        "num_key_value_heads": 4,
        "vocab_size": 152064,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 128000,
        "hidden_act": "silu",
        "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [16, 24, 24]},
        "tie_word_embeddings": False,
    },
    "vision_config": {
        "depth": 32,
        "hidden_size": 1280,
        "out_hidden_size": 3584,
        "intermediate_size": 3420,
        "num_heads": 16,
        "patch_size": 14,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "window_size": 112,
        "fullatt_block_indexes": [7, 15, 23, 31],
    },
    "image_token_id": 151655,
    "video_token_id": 151656,
    "vision_start_token_id": 151652,
    "tie_word_embeddings": False,
}

CLIP_VIT_L14_TEXT: dict[str, Any] = {
    "hidden_size": 768,
    "intermediate_size": 3072,
    "num_hidden_layers": 12,
    "num_attention_heads": 12,
    "vocab_size": 49408,
    "max_position_embeddings": 77,
    "hidden_act": "quick_gelu",
    "projection_dim": 768,
    # Legacy OpenAI CLIP value: transformers then pools at argmax(input_ids), the EOT token.
    "eos_token_id": 2,
    "bos_token_id": 0,
    "pad_token_id": 1,
}
