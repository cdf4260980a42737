"""The generation DiT's config read without loading anything: what the checks before a load of minutes (parallel
layout, Cache-DiT blocks, LoRA modules) need. Apart from checkpoint.py, which imports the model code (and through it
torch._dynamo), so that the engine's process can run these checks without it."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from k6serve.models.checkpoint_files import (
    CheckpointError,
    read_component_config,
    read_model_index,
    variant_before_loading,
)
from k6serve.models.kandinsky6.config import Kandinsky6TransformerConfig
from k6serve.models.variants import GENERATION, Variant

if TYPE_CHECKING:
    from k6serve.config import ModelConfig


def transformer_config_before_loading(variant: Variant, folder: Path | None) -> Kandinsky6TransformerConfig:
    """The generation DiT's config as the load will build it, read without loading: `folder`'s
    transformer/config.json, or the released one when there is no folder to read (--load-format dummy, or a released
    hub id not downloaded yet). For the checks that refuse a request or a layout before a load of minutes."""
    config = (read_component_config(folder, "transformer") if folder is not None
              else released_transformer_config(variant))
    try:
        return Kandinsky6TransformerConfig.from_json_dict(config)
    except ValueError as exc:
        if folder is None:
            raise
        # As the load says it (checkpoint.load_transformer): the file too.
        raise CheckpointError(f"{folder / 'transformer' / 'config.json'}: {exc}; copy or download the checkpoint "
                              "again.") from None


def released_transformer_config(variant: Variant) -> dict:
    """The built-in copy of the released transformer/config.json for a generation variant."""
    from k6serve.models.kandinsky6.released_configs import RELEASED_TRANSFORMER_CONFIGS

    if variant.size not in ("pro", "lite"):
        raise ValueError(f"--load-format dummy has no built-in transformer config for {variant.name}.")
    return RELEASED_TRANSFORMER_CONFIGS[f"{variant.size}_distill" if variant.distilled else variant.size]


def unlisted_audio_components(index: dict) -> list[str]:
    """Which of audio_vae and vocoder a checkpoint's model_index.json (`index`) leaves out or lists as null: with
    either gone it makes silent videos only, as in diffusers. Read by the load and by the CLI's check before it."""
    return [name for name in ("audio_vae", "vocoder") if name not in index or index[name][0] is None]


def has_audio_before_loading(model: ModelConfig) -> bool:
    """Whether the load will give the checkpoint its audio_vae and vocoder: --load-format dummy builds both, as does
    the load of a hub id (every release has them); a local folder says so in its model_index.json. True where it
    cannot be told now (the load reports a damaged index, in its words)."""
    try:
        _, folder = variant_before_loading(model.model_path, model.model_id, model.load_format)
        if folder is None:  # no local folder to read (variant_before_loading gives none for dummy)
            return True
        return not unlisted_audio_components(read_model_index(folder))
    except (OSError, KeyError, TypeError, ValueError):
        return True


def dit_blocks_before_loading(model: ModelConfig) -> int | None:
    """The generation DiT's number of fused blocks where it needs no download; None for a super-resolution model
    or when it cannot be told now (a hub id not among the released ones, a folder without the config)."""
    try:
        variant, folder = variant_before_loading(model.model_path, model.model_id, model.load_format)
        if variant is None or variant.family != GENERATION:
            return None
        # --load-format dummy builds the released config whatever the folder holds (models/kandinsky6/checkpoint.py).
        folder = None if model.load_format == "dummy" else folder
        return transformer_config_before_loading(variant, folder).num_visual_blocks
    except (OSError, KeyError, TypeError, ValueError):
        return None  # the load reports a damaged or missing config, in its words
