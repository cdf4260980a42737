"""The worker's checks once it knows the checkpoint's family and its device, before any weight loads.

`ModelWorker.__init__` runs them between recognising the checkpoint and building its pipeline: a flag the family
cannot take, a residency the layout refuses or a --quantization the GPU cannot run is refused before a load of
minutes. (The checks that need no model run earlier still, in the engine's process: `engine.check_before_loading`.)
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from k6serve.config import EngineConfig
from k6serve.models.variants import GENERATION, Variant
from k6serve.offload.residency import ResidencyPlan
from k6serve.rank_logging import ONCE
from k6serve.runtime.warmup_sizes import SR_WARMUP_CLIP, check_warmup_sizes

# The worker's name: these lines were logged under it when the checks were its methods (log filters, saved logs).
logger = logging.getLogger("k6serve.runtime.worker")


def refuse_family_flags(config: EngineConfig, variant: Variant, device: torch.device, folder: Path | None) -> None:
    """Refuse, before any weight loads, the flags this checkpoint's family cannot take."""
    runtime = config.runtime
    if runtime.cache_dit_config is not None and variant.family != GENERATION:
        raise ValueError(f"--cache-dit-config applies to the generation models; {variant.name} is a "
                         "super-resolution model (2 DiT steps per tile, nothing to skip). Drop the flag.")
    if runtime.compile_prompt_rewrite and variant.family != GENERATION:
        # Else accepted and silently doing nothing: the upscaler takes no prompt.
        raise ValueError(f"--compile-prompt-rewrite applies to the generation models' expand_prompts rewrite; "
                         f"{variant.name} is a super-resolution model, which rewrites no prompt. Drop the "
                         "flag.")
    check_quantization(config, variant, device, folder)
    if runtime.warmup_mode == "server":
        # A listed size the model cannot take is refused before the load (minutes), not after it.
        check_warmup_sizes(runtime.warmup_resolutions, variant,
                           sr_default_num_frames=SR_WARMUP_CLIP[2])


def check_residency(config: EngineConfig, variant: Variant, residency_plan: ResidencyPlan,
                    device: torch.device) -> None:
    """The residency plan's refusals for this family and layout, and what the flags do not do on the CPU
    (logged); before any weight loads."""
    runtime = config.runtime
    # The config checked the block-streaming flags against the generation plan (the family was unknown then);
    # this family's own plan may stream less (an SR checkpoint has no text encoders).
    refusal = runtime.block_streaming_refusal(super_resolution=variant.family != GENERATION)
    if refusal:
        raise ValueError(refusal)
    if residency_plan.offloads:
        from k6serve.config import refuse_offload_with_sharding

        refuse_offload_with_sharding(runtime, config.parallel)
    if residency_plan.offloads and device.type != "cuda":
        logger.info("%s: on the CPU every weight is in host memory already, so nothing is offloaded",
                    runtime.offload_flags, extra=ONCE)
    if runtime.compile_vae and device.type != "cuda":
        logger.warning("--compile-vae true: speed mode's transforms are for CUDA GPUs; on the CPU the VAE decoder "
                       "runs eager, as the reference does", extra=ONCE)
    if runtime.compile_prompt_rewrite and device.type != "cuda":
        logger.warning("--compile-prompt-rewrite true: transformers compiles generate's decoding step on CUDA "
                       "only; on the CPU the rewrite runs eager, through the static cache", extra=ONCE)


def check_quantization(config: EngineConfig, variant: Variant, device: torch.device, folder: Path | None) -> None:
    """--quantization before the weights load: the generation DiT only, and e4m3 GEMMs on a CUDA GPU."""
    quantization = config.model.quantization
    if quantization == "none":
        return
    if variant.family != GENERATION:
        raise ValueError(f"--quantization {quantization} applies to the generation DiT; {variant.name} is a "
                         "super-resolution model. Drop the flag.")
    if device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
        major, minor = torch.cuda.get_device_capability(device)
        raise ValueError(f"--quantization {quantization} needs e4m3 GEMMs, which GPUs of compute capability 8.9 "
                         f"or newer have (Ada, Hopper, Blackwell); {torch.cuda.get_device_name(device)} is "
                         f"{major}.{minor}. Drop the flag.")
    ignored = config.model.quantization_ignored_layers
    if ignored:
        # Against the names the DiT's linears can have, from its config: a typo is refused before a load of
        # minutes, not after it (apply_quantization checks the loaded model's own names again).
        from k6serve.models.kandinsky6.config_before_loading import transformer_config_before_loading
        from k6serve.speed.fp8_linears import check_ignored_layers, possible_linear_names

        num_blocks = transformer_config_before_loading(variant, folder).num_visual_blocks
        check_ignored_layers(ignored, possible_linear_names(num_blocks))
