"""Config files of the released Kandinsky 6 VSR checkpoints, for `--load-format dummy` and loader tests.

Transcribed from k6-super-resolution.md §1.1-1.5 (which checked them against diffusers on the meta device and
against the Hub safetensors headers; SG keeps byte copies in `test/unit/kandinsky6_sr_release_configs.py`, which is
not reachable from here). Keys the spec elides (the "..." of §1.4 decoder_config) are absent; they do not change the
architecture that diffusers' classes build. Distilled repo revision measured by SG:
3e3e10bcd23659eeeb23cac740258ee4fc14aa7d.
"""

from __future__ import annotations

import copy
from typing import Any

DISTILLED_REPO = "kandinskylab/Kandinsky-6.0-VSR-distilled2steps-5s-Diffusers"
FLOW_REPO = "kandinskylab/Kandinsky-6.0-VSR-5s-Diffusers"
# The flow repo revision that pairs a flow-Euler scheduler with a 640-wide head (seed documents).
KNOWN_BAD_FLOW_REVISION = "d6ddfabc62b3920b6da6487e4f444d37c591d5f4"

MODEL_INDEX: dict[str, Any] = {
    "_class_name": "Kandinsky6SRPipeline",
    "_diffusers_version": "0.41.0.dev0",
    "transformer": ["diffusers", "Kandinsky6SRTransformer3DModel"],
    "vae": ["diffusers", "Kandinsky6SRVAE"],
    "latent_upscaler": ["diffusers", "Kandinsky6SRLatentUpscalerBank"],
    "scheduler": ["diffusers", "PiflowScheduler"],
    "_kandinsky6_sr": {
        "format_version": 1,
        "uses_patched_diffusers": True,
        "vae_name": "video-kvae",
    },
}

SR_CONFIG: dict[str, Any] = {"default_resolution_scale": 2.25}

TRANSFORMER_CONFIG: dict[str, Any] = {
    "in_visual_dim": 64,
    "out_visual_dim": 640,
    "time_dim": 512,
    "patch_size": [1, 1, 1],
    "model_dim": 1792,
    "ff_dim": 7168,
    "num_visual_blocks": 32,
    "axes_dims": [16, 24, 24],
    "in_text_dim": 3584,
    "in_text_dim2": 768,
    "num_text_blocks": 2,
    "use_text": False,
    "visual_cond": True,
    "instruct_type": "hybrid_anchor",
    "attribute_overrides": {},
    "attention_params": {
        "512": {
            "type": "nabla",
            "P": 0.8,
            "wT": 11,
            "wH": 7,
            "wW": 7,
            "add_sta": True,
            "method": "topcdf",
            "P_warmup_start": 0.95,
            "P_warmup_steps": 0,
        },
        "1024": {"type": "flash"},
    },
    "sr_params": {
        "visual_size": [512],
        "scale_factor": {"512": [1.0, 2.0, 2.0]},
        "scheduler_scale": 3.5,
        "lq_noise_scale": 0.7,
        "lq_noise_type": "ddpm",
        "lq_channel_noise_scale": 0.0,
        "cap_noise_timestep": False,
        "fps": 24,
    },
}

SCHEDULER_CONFIG: dict[str, Any] = {
    "_class_name": "PiflowScheduler",
    "nfe": 2,
    "n_grid": 10,
    "shift": 3.5,
    "final_step_size_scale": 0.5,
    "num_policy_substeps": 128,
    "eps": 1e-6,
    "num_train_timesteps": 1000,
}

VAE_CONFIG: dict[str, Any] = {
    "encoder_config": {
        "ch": 128,
        "ch_mult": [0.125, 1, 2, 4, 8],
        "num_res_blocks": 2,
        "z_channels": 64,
        "double_z": True,
        "temporal_compress_times": 4,
        "temporal_compress_start_level": 1,
        "norm_type": "rms_norm",
        "downsample_version": 2,
        "fix_pxs": True,
        "padding_mode": "zeros",
    },
    "decoder_config": {
        "ch": 256,
        "ch_mult": [0.0625, 1, 2, 4, 8],
        "num_res_blocks": 2,
        "out_ch": 3,
        "z_channels": 64,
    },
    "scaling_factor": 0.910344004631042,
    "spatial_factor": 16,
    "temporal_factor": 4,
    "vae_type": "video-kvae",
}

_UPSCALER_SHARED: dict[str, Any] = {
    "architecture": "multi_scale",
    "in_channels": 64,
    "stage_channels": [2048, 1024, 512],
    "hidden": 2048,
    "num_pre_blocks": 5,
    "num_mid_blocks": 3,
    "num_post_blocks": 3,
    "expand_ratio": 1,
    "bare_stem": True,
    "input_skip": False,
    "modulated_norm": True,
    "modulated_output_proj": True,
    "upsample_mode": "pxs_v2",
    "upsample_padding_mode": "zeros",
    "temporal_padding": "replicate",
    "temporal_mix": False,
}

# List order is 4x then 2x; the weights store 2x under `_models.0.` (§1.5).
LATENT_UPSCALER_CONFIG: dict[str, Any] = {
    "models": [
        {"target_scale": "4x", "model": dict(_UPSCALER_SHARED)},
        {
            "target_scale": "2x",
            "model": _UPSCALER_SHARED
            | {
                "enable_x2_entry": True,
                "x2_adapter_blocks": 2,
                "x2_adapter_sources": [0, 4],
                "x2_finisher": "pxs_residual",
                "x2_tail_mode": "private_full",
            },
        },
    ],
    "scaling_factor": 0.910344,
}

# The flow-matching teacher differs only here (§1.2, §1.3).
FLOW_TRANSFORMER_CONFIG: dict[str, Any] = copy.deepcopy(TRANSFORMER_CONFIG)
FLOW_TRANSFORMER_CONFIG["out_visual_dim"] = 64
FLOW_TRANSFORMER_CONFIG["sr_params"]["scheduler_scale"] = 5.0
FLOW_TRANSFORMER_CONFIG["attention_params"]["512"]["P_warmup_steps"] = 200
FLOW_SCHEDULER_CONFIG: dict[str, Any] = {
    "_class_name": "FlowMatchEulerDiscreteScheduler",
    "num_train_timesteps": 1000,
    "shift": 5.0,
    "use_dynamic_shifting": False,
}

# Expected sizes (D classes built from these configs; §1.1 table).
NUM_PARAMETERS = {
    "transformer": 1_414_263_936,
    "vae": 1_738_878_243,
    "latent_upscaler": 3_654_021_952,
}
NUM_TENSORS = {"transformer": 459, "vae": 378, "latent_upscaler": 489}
