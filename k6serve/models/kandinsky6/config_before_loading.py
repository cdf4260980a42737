"""The generation DiT's config read without loading anything: what the checks before a load of minutes (parallel
layout, Cache-DiT blocks, LoRA modules) need. Apart from checkpoint.py, which imports the model code (and through it
torch._dynamo), so that the engine's process can run these checks without it."""

from __future__ import annotations

from pathlib import Path

from k6serve.models.checkpoint_files import CheckpointError, read_component_config
from k6serve.models.kandinsky6.config import Kandinsky6TransformerConfig
from k6serve.models.variants import Variant


def transformer_config_before_loading(variant: Variant, folder: Path | None) -> Kandinsky6TransformerConfig:
    """The generation DiT's config as the load will build it, read without loading: `folder`'s
    transformer/config.json, or the released one when there is no folder to read (--load-format dummy, or a released
    hub id not downloaded yet). For the checks that refuse a request or a layout before a load of minutes."""
    config = read_component_config(folder, "transformer") if folder is not None else released_transformer_config(variant)
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
