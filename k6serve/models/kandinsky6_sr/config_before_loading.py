"""An SR checkpoint's configs read without loading anything: its four component configs (a local folder's, or the
released ones for `--load-format dummy`) and what planning an upscale's tiles needs of them. Apart from
checkpoint.py, which imports the models (diffusers' K-VAE, the PiFlow scheduler), so that the engine's process and
the server can check a request before the load without them."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from k6serve.models.checkpoint_files import read_model_index, require_components
from k6serve.models.kandinsky6_sr import released_configs as released
from k6serve.models.kandinsky6_sr.checks import check_sr_checkpoint
from k6serve.models.kandinsky6_sr.config import (
    SRSchedulerConfig,
    SRTransformerConfig,
    SRUpscalerConfig,
    SRVAEConfig,
)
from k6serve.models.variants import Variant

REQUIRED = ["transformer", "vae", "latent_upscaler", "scheduler"]


@dataclass(frozen=True, kw_only=True, slots=True)
class SRConfigs:
    """The four component configs of one SR checkpoint."""

    transformer: SRTransformerConfig
    vae: SRVAEConfig
    upscaler: SRUpscalerConfig
    scheduler: SRSchedulerConfig


def read_sr_configs(folder: Path) -> SRConfigs:
    """Read the vendor configs and run the head/scheduler check from headers only (no weights are read)."""
    index = read_model_index(folder)
    require_components(folder, index, REQUIRED)
    transformer, scheduler = check_sr_checkpoint(folder)
    return SRConfigs(
        transformer=transformer,
        vae=SRVAEConfig.from_json_file(folder / "vae" / "config.json"),
        upscaler=SRUpscalerConfig.from_json_file(folder / "latent_upscaler" / "config.json"),
        scheduler=scheduler,
    )


@dataclass(frozen=True, kw_only=True, slots=True)
class SRTiling:
    """What planning an upscale's tiles needs of a checkpoint: its HR tile sizes and the K-VAE's spatial factor."""

    tile_sizes: tuple[tuple[int, int], ...]
    snap: int


def sr_tiling_before_loading(model_path: str, model_id: str | None, load_format: str | None) -> SRTiling | None:
    """The SR checkpoint's tiling, read without loading where that needs no download (a local folder's configs, a
    released checkpoint's built-in ones, `--load-format dummy`), so a server can refuse at a job's creation a source
    too small for one tile; None for a generation model or when it cannot be told (the worker refuses it then)."""
    from k6serve.models.checkpoint_files import variant_before_loading
    from k6serve.models.variants import GENERATION

    try:
        variant, folder = variant_before_loading(model_path, model_id, load_format)
        if variant is None or variant.family == GENERATION:
            return None
        configs = released_sr_configs(variant) if folder is None else read_sr_configs(folder)
    except (OSError, KeyError, TypeError, ValueError):
        return None
    return SRTiling(tile_sizes=tuple(configs.transformer.tile_sizes), snap=configs.vae.spatial_compression_ratio)


def released_sr_configs(variant: Variant) -> SRConfigs:
    """The released configs of `variant` (for `--load-format dummy`)."""
    distilled = variant.distilled
    return SRConfigs(
        transformer=SRTransformerConfig.from_dict(
            released.TRANSFORMER_CONFIG if distilled else released.FLOW_TRANSFORMER_CONFIG
        ),
        vae=SRVAEConfig.from_dict(released.VAE_CONFIG),
        upscaler=SRUpscalerConfig.from_dict(released.LATENT_UPSCALER_CONFIG),
        scheduler=SRSchedulerConfig.from_dict(
            released.SCHEDULER_CONFIG if distilled else released.FLOW_SCHEDULER_CONFIG
        ),
    )
