"""The SR DiT's plan, as data: repeated blocks, TP and SP plans, fp32 names, capabilities.

TP shards whole heads (28 heads, head_dim 64; Q/K/V colwise, output rowwise) and the FFN (7168 wide); modulations,
embeddings and the head stay replicated. SP shards the video tokens of a tile: the only attention is video
self-attention, so Ulysses and Ring apply directly; the tokens are gathered before the head, which unpatchifies the
whole (T, H, W) grid. There is no guidance branch, so no CFG parallelism. The KVAE and the latent upscaler are
replicated (SG does the same); decode parallelism is a separate, tile-level choice.
"""

from __future__ import annotations

from k6serve.models.kandinsky6_sr.config import SRTransformerConfig
from k6serve.models.plan import (
    AttentionSite,
    Capabilities,
    ModelPlan,
    SequenceParallelPlan,
    SequenceSplitPoint,
    TensorParallelStyle,
)

# Matched per whole dotted name component. diffusers' list (T:457) is the first three, under which the blocks'
# `visual_modulation` would load in bf16; k6serve keeps it fp32 too, because the seeds / SG / R run all modulation in
# fp32 (179,524,608 fp32 parameters, §1.1).
KEEP_FP32_MODULES = ("time_embeddings", "pooled_bias", "modulation", "visual_modulation")

_BLOCKS = "visual_transformer_blocks"


def _tensor_parallel_plan() -> dict[str, TensorParallelStyle]:
    attention, feed_forward = f"{_BLOCKS}.*.self_attention", f"{_BLOCKS}.*.feed_forward"
    return {
        f"{attention}.to_query": "colwise",
        f"{attention}.to_key": "colwise",
        f"{attention}.to_value": "colwise",
        f"{attention}.out_layer": "rowwise",
        f"{feed_forward}.net.0.proj": "colwise",
        f"{feed_forward}.net.2": "rowwise",
    }


def sr_plan(config: SRTransformerConfig) -> ModelPlan:
    """The plan of an `SRTransformer` built from `config`."""
    first_block, last_block = f"{_BLOCKS}.0", f"{_BLOCKS}.{config.num_visual_blocks - 1}"
    return ModelPlan(
        blocks=(_BLOCKS,),
        tp=_tensor_parallel_plan(),
        sp=SequenceParallelPlan(
            split_inputs=(
                SequenceSplitPoint(module=first_block, argument="video_BLD", dim=1),
                SequenceSplitPoint(module=first_block, argument="video_rope", dim=0),
            ),
            gather_outputs=(SequenceSplitPoint(module=last_block, output_index=0, dim=1),),
            sharded_roles=("video_self",),
            gather_kv_roles=(),
            local_roles=(),
            replicated_roles=(),
        ),
        keep_fp32=KEEP_FP32_MODULES,
        attention=(
            AttentionSite(
                module=f"{_BLOCKS}.*.self_attention",
                role="video_self",
                num_heads=config.num_heads,
                head_dim=config.head_dim,
            ),
        ),
        capabilities=Capabilities(tp=True, ulysses=True, ring=True, cfg_parallel=False, fsdp=True),
    )
