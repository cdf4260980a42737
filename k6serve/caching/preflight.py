"""Cache-DiT settings checked against the DiT's block count before the model loads (minutes for a real checkpoint).

Fn_compute_blocks + Bn_compute_blocks must leave a block to cache. The pipeline checks that against the loaded DiT,
so `--cache-dit-config` or a request's `cache_dit_params` over the count was refused only after the whole load
(`k6serve generate`), or made every accepted job fail (`k6serve serve`). Here the count is read where that needs no
download (a local folder's transformer/config.json, the demo, a released checkpoint's built-in config), as the
parallel preflight reads it. The pipeline checks again; this only moves the refusal earlier.
"""

from __future__ import annotations

import logging

from k6serve.config import EngineConfig

logger = logging.getLogger(__name__)


def check_cache_dit_config_before_loading(config: EngineConfig) -> None:
    """Refuse, before loading, a --cache-dit-config that leaves no block of the DiT to cache (every request would
    fail)."""
    from k6serve.models.kandinsky6.config_before_loading import dit_blocks_before_loading

    cache_dit = config.runtime.cache_dit_config
    if cache_dit is None:
        return
    num_blocks = dit_blocks_before_loading(config.model)
    if num_blocks is not None:
        cache_dit.check_blocks(num_blocks, source="--cache-dit-config")


def warn_if_the_default_steps_do_not_fit(config: EngineConfig) -> None:
    """`k6serve serve`: a --cache-dit-config step mask that cannot run the model's default step count fails every
    job that leaves num_inference_steps out (each told why). Said once at start, not refused: a client may always
    send steps the mask covers. (`k6serve generate` checks its one request before the load.)"""
    from k6serve.caching.params import StepMaskMismatch
    from k6serve.models.checkpoint_files import variant_before_loading
    from k6serve.models.variants import GENERATION

    cache_dit = config.runtime.cache_dit_config
    if cache_dit is None or not cache_dit.uses_step_mask:
        return
    try:
        variant, _ = variant_before_loading(config.model.model_path, config.model.model_id, config.model.load_format)
    except (OSError, KeyError, TypeError, ValueError):
        return
    if variant is None or variant.family != GENERATION:
        return
    try:
        cache_dit.steps_mask(variant.num_inference_steps)
    except StepMaskMismatch as exc:
        logger.warning("--cache-dit-config: %s, and %s runs %d steps by default: every request that leaves "
                       "num_inference_steps out will be refused; send steps the mask covers, or change the mask",
                       exc.what, variant.name, variant.num_inference_steps)
