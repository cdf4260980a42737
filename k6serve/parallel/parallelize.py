"""Apply a replica's parallel layout to loaded models, in one fixed order: validate -> TP -> SP -> FSDP.

TP first (it swaps linear weights for DTensor shards), then sequence parallelism (hooks and attention swaps, no
parameters), then FSDP (it wraps whatever parameters the model has by then). CFG-parallel only records the cfg
group on the DiT for the denoising loop. Generic: everything model-specific comes from the model's `ModelPlan`.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from torch import nn

from k6serve.models.plan import ModelPlan
from k6serve.parallel.cfg import attach_cfg_group
from k6serve.parallel.encoder_folding import fold_encoder, should_fold
from k6serve.parallel.fsdp import apply_fsdp
from k6serve.parallel.mesh import ParallelGroups, validate_layout
from k6serve.parallel.sequence_attention import ShardState
from k6serve.parallel.sequence_parallel import apply_sequence_parallel
from k6serve.parallel.tensor_parallel import apply_tp
from k6serve.rank_logging import ONCE

if TYPE_CHECKING:  # the model packages are imported where their models are parallelised
    from k6serve.models.kandinsky6_sr.transformer import SRTransformer

logger = logging.getLogger(__name__)


def parallelize_model(
    model: nn.Module, plan: ModelPlan, groups: ParallelGroups, *, device_type: str, model_name: str,
    has_guidance: bool,
) -> ShardState:
    """Validate the layout against `plan`, then apply TP, SP and FSDP to `model` in place."""
    layout = groups.layout
    validate_layout(layout, plan, model_name=model_name, has_guidance=has_guidance)
    apply_tp(model, plan.tp, groups.axis_mesh("tp", device_type))
    state = apply_sequence_parallel(model, plan.sp, groups)
    if layout.fsdp:
        apply_fsdp(model, plan.blocks, groups.axis_mesh("replica", device_type))
    if layout.cfg > 1:
        attach_cfg_group(model, groups.axis["cfg"])
    return state


def fold_text_encoders(encoders: list[nn.Module], mode: str, groups: ParallelGroups, *, device_type: str) -> bool:
    """Fold the text encoders over the replica when the `--encoder-parallel` rule says so; True if folded."""
    if not should_fold(mode, groups.layout, encoders):
        return False
    mesh = groups.axis_mesh("replica", device_type)
    for encoder in encoders:
        fold_encoder(encoder, mesh)
    logger.info("text encoders folded over %d ranks", groups.layout.replica_size, extra=ONCE)
    return True


def parallelize_generation_models(models, groups: ParallelGroups, *, encoder_parallel: str, device_type: str) -> None:
    """The generation pipeline's models (`GenerationModels`): the DiT and the Qwen/CLIP encoders."""
    from k6serve.models.kandinsky6.plan import kandinsky6_plan

    transformer = models.transformer
    parallelize_model(
        transformer, kandinsky6_plan(transformer.config), groups, device_type=device_type,
        model_name=models.variant.name, has_guidance=not models.variant.distilled,
    )
    fold_text_encoders([models.text_encoder, models.text_encoder_2], encoder_parallel, groups,
                       device_type=device_type)


def parallelize_sr_transformer(transformer: SRTransformer, groups: ParallelGroups, *, model_name: str,
                               device_type: str) -> None:
    """The SR DiT (no guidance branch, no text encoder)."""
    from k6serve.models.kandinsky6_sr.plan import sr_plan

    parallelize_model(transformer, sr_plan(transformer.config), groups, device_type=device_type,
                      model_name=model_name, has_guidance=False)


def parallelize_sr_models(models, groups: ParallelGroups, *, model_name: str, device_type: str,
                          decode: str = "whole_tile") -> None:
    """The SR DiT layout, plus the KVAE decode over the replica: `decode` "whole_tile" (tiles round-robin, bitwise
    equal to serial; the default) or "spatial_shard" (each tile's height split, halo rows exchanged;
    `tile_decode.sr_decode_mode` chooses)."""
    from k6serve.parallel.spatial_shard_decode import attach_spatial_shard
    from k6serve.parallel.tile_decode import SERIAL, SPATIAL_SHARD, WHOLE_TILE, attach_decode_group

    parallelize_sr_transformer(models.transformer, groups, model_name=model_name, device_type=device_type)
    if decode == SPATIAL_SHARD:
        attach_spatial_shard(models.vae, groups.replica_group)
        logger.info("SR decode: spatial_shard, each tile's height split across the replica's %d ranks (frames differ "
                    "from serial decode by rounding)", groups.layout.replica_size, extra=ONCE)
    elif decode == WHOLE_TILE:
        attach_decode_group(models.vae, groups.replica_group)
        logger.info("SR decode: whole tiles round-robin across the replica's %d ranks (bitwise equal to serial)",
                    groups.layout.replica_size, extra=ONCE)
    elif decode != SERIAL:  # serial: a replica of one rank, nothing to spread
        raise ValueError(f"decode must be {WHOLE_TILE!r}, {SPATIAL_SHARD!r} or {SERIAL!r}, got {decode!r}")
