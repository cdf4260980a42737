"""Tiny random-weight Kandinsky 6 SR checkpoints in the Hub layout, for CPU tests.

Built with diffusers' real classes at the sizes of k6-super-resolution.md §6, saved with
`Kandinsky6SRPipeline.save_pretrained`, then every component config.json is rewritten into the vendor format the Hub
uses (transformer "native" keys with attention_params / sr_params, nested K-VAE encoder_config / decoder_config,
latent-upscaler `models` list), so k6serve's loaders are tested on the real layout. All weights are re-randomised
(norm gains near 1, biases and pooled_bias non-zero) so every path changes the output.

Heads:
* "distilled": PiflowScheduler (nfe 2, n_grid 10, shift 3.5) with an n_grid x C = 80 wide head (the released pair);
* "flow640": FlowMatchEulerDiscreteScheduler with an 80 (640-style) head: the known-bad pairing of §3;
* "plain64": PiflowScheduler with a plain C = 8 wide head: the other bad pairing.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    # The classes' own modules: mypy reads diffusers' top-level names as the dummies it defines for no torch.
    from diffusers.models.autoencoders.autoencoder_kandinsky6_sr import Kandinsky6SRVAE
    from diffusers.models.latent_upscaler.latent_upscaler_kandinsky6_sr import Kandinsky6SRLatentUpscalerBank
    from diffusers.models.transformers.transformer_kandinsky6_sr import Kandinsky6SRTransformer3DModel
    from diffusers.pipelines.kandinsky6.pipeline_kandinsky6_sr import Kandinsky6SRPipeline
    from diffusers.schedulers.scheduling_flow_match_euler_discrete import FlowMatchEulerDiscreteScheduler
    from diffusers.schedulers.scheduling_piflow import PiflowScheduler
else:
    from diffusers import (
        FlowMatchEulerDiscreteScheduler,
        Kandinsky6SRLatentUpscalerBank,
        Kandinsky6SRPipeline,
        Kandinsky6SRTransformer3DModel,
        Kandinsky6SRVAE,
        PiflowScheduler,
    )

from k6serve.models.kandinsky6_sr.config import TILE_SIZES_OVERRIDE_KEY, UPSCALER_FIXED, UPSCALER_X2_FIXED

TINY_CHANNELS = 8
TINY_N_GRID = 10
TINY_TILE_SIZES = ((64, 64), (64, 128), (128, 64))
TINY_TRANSFORMER = {
    "in_visual_dim": TINY_CHANNELS,
    "time_dim": 32,
    "patch_size": (1, 1, 1),
    "model_dim": 32,
    "ff_dim": 64,
    "num_visual_blocks": 2,
    "axes_dims": (4, 6, 6),
}
# Encoder widths 16 * (0.5, 1, 1, 2) = (8, 16, 16, 32), decoder 32 * (0.25, 0.5, 1, 1) = (8, 16, 32, 32):
# 4 levels = spatial x8, temporal x4 from level 1.
TINY_VAE_ENCODER: dict[str, Any] = {"ch": 16, "ch_mult": [0.5, 1, 1, 2]}
TINY_VAE_DECODER: dict[str, Any] = {"ch": 32, "ch_mult": [0.25, 0.5, 1, 1]}
TINY_UPSCALER = {
    "in_channels": TINY_CHANNELS,
    "stage_channels": (16, 16, 8),
    "num_pre_blocks": 1,
    "num_mid_blocks": 1,
    "num_post_blocks": 1,
    "num_x2_adapter_blocks": 1,
    "scales": (2, 4),
}
SCALING_FACTOR = 0.910344004631042
HEADS = ("distilled", "flow640", "plain64")


def build_sr_checkpoint(out_dir: str | Path, *, head: str = "distilled", seed: int = 0) -> Path:
    """Write a tiny SR checkpoint to `out_dir` and return that path."""
    if head not in HEADS:
        raise ValueError(f"head {head!r} is not one of {HEADS}")
    out_dir = Path(out_dir)
    generator = torch.Generator().manual_seed(seed)
    out_visual_dim = TINY_CHANNELS if head == "plain64" else TINY_N_GRID * TINY_CHANNELS
    transformer = Kandinsky6SRTransformer3DModel(
        **TINY_TRANSFORMER, out_visual_dim=out_visual_dim, tile_sizes=TINY_TILE_SIZES
    )
    vae = Kandinsky6SRVAE(
        latent_channels=TINY_CHANNELS,
        encoder_block_out_channels=_widths(TINY_VAE_ENCODER),
        decoder_block_out_channels=_widths(TINY_VAE_DECODER),
        layers_per_block=1,
        scaling_factor=SCALING_FACTOR,
    )
    upscaler = Kandinsky6SRLatentUpscalerBank(**TINY_UPSCALER, scaling_factor=SCALING_FACTOR)
    for module in (transformer, vae, upscaler):
        randomize_weights(module, generator)
    if head == "flow640":
        scheduler = FlowMatchEulerDiscreteScheduler(shift=5.0)
    else:
        scheduler = PiflowScheduler(shift=3.5, n_grid=TINY_N_GRID)
    pipeline = Kandinsky6SRPipeline(
        transformer=transformer, vae=vae, scheduler=scheduler, latent_upscaler=upscaler
    )
    pipeline.save_pretrained(out_dir)

    _rewrite(out_dir / "transformer" / "config.json", lambda raw: _vendor_transformer(raw, head))
    _rewrite(out_dir / "vae" / "config.json", _vendor_vae)
    _rewrite(out_dir / "latent_upscaler" / "config.json", _vendor_upscaler)
    if head != "flow640":
        _rewrite(out_dir / "scheduler" / "scheduler_config.json", lambda raw: raw | {"nfe": 2})
    (out_dir / "sr_config.json").write_text(
        json.dumps({"default_resolution_scale": 2.25}, indent=2)
    )
    return out_dir


@torch.no_grad()
def randomize_weights(module: torch.nn.Module, generator: torch.Generator) -> None:
    """Gains 1 + 0.1 N, biases 0.1 N, matrices / kernels N / sqrt(fan_in): O(1) activations, no dead paths."""
    for name, param in module.named_parameters():
        noise = torch.randn(param.shape, generator=generator)
        if name.endswith(("gamma", "norm.weight")):
            param.copy_(1 + 0.1 * noise)
        elif param.ndim == 1:
            param.copy_(0.1 * noise)
        else:
            param.copy_(noise / math.sqrt(param[0].numel()))


def _widths(section: dict[str, Any]) -> tuple[int, ...]:
    return tuple(int(section["ch"] * mult) for mult in section["ch_mult"])


def _rewrite(path: Path, convert) -> None:
    path.write_text(json.dumps(convert(json.loads(path.read_text())), indent=2))


def _metadata(raw: dict[str, Any]) -> dict[str, Any]:
    return {
        key: value for key, value in raw.items() if key in ("_class_name", "_diffusers_version")
    }


def _vendor_transformer(raw: dict[str, Any], head: str) -> dict[str, Any]:
    return _metadata(raw) | {
        "in_visual_dim": raw["in_visual_dim"],
        "out_visual_dim": raw["out_visual_dim"],
        "time_dim": raw["time_dim"],
        "patch_size": list(raw["patch_size"]),
        "model_dim": raw["model_dim"],
        "ff_dim": raw["ff_dim"],
        "num_visual_blocks": raw["num_visual_blocks"],
        "axes_dims": list(raw["axes_dims"]),
        "in_text_dim": 16,
        "in_text_dim2": 8,
        "num_text_blocks": 2,
        "use_text": False,
        "visual_cond": True,
        "instruct_type": "hybrid_anchor",
        "attribute_overrides": {},
        "attention_params": {
            "512": {
                "type": "nabla",
                "P": raw["nabla_threshold"],
                "wT": raw["nabla_window"][0],
                "wH": raw["nabla_window"][1],
                "wW": raw["nabla_window"][2],
                "add_sta": True,
                "method": "topcdf",
                "P_warmup_start": 0.95,
                "P_warmup_steps": 0,
            },
            "1024": {"type": "flash"},
        },
        "sr_params": {
            "visual_size": [512],
            "scale_factor": {"512": list(raw["scale_factor"])},
            "scheduler_scale": 5.0 if head == "flow640" else 3.5,
            "lq_noise_scale": 0.7,
            "lq_noise_type": "ddpm",
            "lq_channel_noise_scale": 0.0,
            "cap_noise_timestep": False,
            "fps": 24,
        },
        TILE_SIZES_OVERRIDE_KEY: [list(size) for size in raw["tile_sizes"]],
    }


def _vendor_vae(raw: dict[str, Any]) -> dict[str, Any]:
    encoder = TINY_VAE_ENCODER | {
        "num_res_blocks": raw["layers_per_block"],
        "z_channels": raw["latent_channels"],
        "double_z": True,
        "temporal_compress_times": raw["temporal_compression_ratio"],
        "temporal_compress_start_level": raw["temporal_compression_start_level"],
        "norm_type": "rms_norm",
        "downsample_version": 2,
        "fix_pxs": True,
        "padding_mode": "zeros",
    }
    decoder = TINY_VAE_DECODER | {
        "num_res_blocks": raw["layers_per_block"],
        "out_ch": raw["out_channels"],
        "z_channels": raw["latent_channels"],
    }
    assert _widths(encoder) == tuple(raw["encoder_block_out_channels"])
    assert _widths(decoder) == tuple(raw["decoder_block_out_channels"])
    return _metadata(raw) | {
        "encoder_config": encoder,
        "decoder_config": decoder,
        "scaling_factor": raw["scaling_factor"],
        "spatial_factor": 2 ** (len(encoder["ch_mult"]) - 1),
        "temporal_factor": raw["temporal_compression_ratio"],
        "vae_type": "video-kvae",
    }


def _vendor_upscaler(raw: dict[str, Any]) -> dict[str, Any]:
    shared = UPSCALER_FIXED | {
        "in_channels": raw["in_channels"],
        "stage_channels": list(raw["stage_channels"]),
        "hidden": raw["stage_channels"][0],
        "num_pre_blocks": raw["num_pre_blocks"],
        "num_mid_blocks": raw["num_mid_blocks"],
        "num_post_blocks": raw["num_post_blocks"],
    }
    x2_entry = shared | UPSCALER_X2_FIXED | {
        "x2_adapter_blocks": raw["num_x2_adapter_blocks"],
        "x2_adapter_sources": [0, 4],
    }
    # Hub list order: 4x first, although the weights hold x2 under `_models.0.`.
    return _metadata(raw) | {
        "models": [
            {"target_scale": "4x", "model": shared},
            {"target_scale": "2x", "model": x2_entry},
        ],
        "scaling_factor": raw["scaling_factor"],
    }
