"""The Kandinsky 6 DiT's plan, as data: repeated blocks, TP and SP plans, fp32 names, capabilities.

TP shards whole heads (Q/K/V colwise, output projection rowwise) and the FFN (in colwise, out rowwise);
modulations, embeddings and heads stay replicated. SP shards the video tokens; text and audio stay
replicated, so audio queries attending to video (audio_from_video) gather the video K/V.
"""

from __future__ import annotations

from k6serve.models.kandinsky6.config import Kandinsky6TransformerConfig
from k6serve.models.plan import (
    AttentionSite,
    Capabilities,
    ModelPlan,
    SequenceParallelPlan,
    SequenceSplitPoint,
    TensorParallelStyle,
)

# diffusers' `_keep_in_fp32_modules`; under the whole-component rule only `out_layer.modulation` and
# `audio_out_layer.modulation` match (k6-generation.md §2.8).
KEEP_FP32_MODULES = ("time_embeddings", "modulation")

ATTENTION_ROLES = (
    "text_self",
    "video_self",
    "video_text",
    "audio_self",
    "audio_text",
    "video_from_audio",
    "audio_from_video",
)

_TEXT_BLOCKS = ("video_text_transformer_blocks", "audio_text_transformer_blocks")
_FUSED_BLOCKS = "visual_transformer_blocks"
_BLOCK_STACK = "fused_blocks"  # Kandinsky6FusedBlockStack: runs every fused block


def _attention_tp(attention_glob: str) -> dict[str, TensorParallelStyle]:
    return {
        f"{attention_glob}.to_query": "colwise",
        f"{attention_glob}.to_key": "colwise",
        f"{attention_glob}.to_value": "colwise",
        f"{attention_glob}.out_layer": "rowwise",
    }


def _feed_forward_tp(feed_forward_glob: str) -> dict[str, TensorParallelStyle]:
    return {f"{feed_forward_glob}.net.0.proj": "colwise", f"{feed_forward_glob}.net.2": "rowwise"}


def _tensor_parallel_plan() -> dict[str, TensorParallelStyle]:
    plan: dict[str, TensorParallelStyle] = {}
    for blocks in _TEXT_BLOCKS:
        plan |= _attention_tp(f"{blocks}.*.attn") | _feed_forward_tp(f"{blocks}.*.feed_forward")
    for stream in ("video_dec_block", "audio_dec_block"):
        stream_glob = f"{_FUSED_BLOCKS}.*.{stream}"
        plan |= _attention_tp(f"{stream_glob}.self_attention")
        plan |= _attention_tp(f"{stream_glob}.cross_attention")
        plan |= _feed_forward_tp(f"{stream_glob}.feed_forward")
    plan |= _attention_tp(f"{_FUSED_BLOCKS}.*.va_cross_attention")
    plan |= _attention_tp(f"{_FUSED_BLOCKS}.*.av_cross_attention")
    return plan


def _attention_sites(config: Kandinsky6TransformerConfig) -> tuple[AttentionSite, ...]:
    video = {"num_heads": config.num_video_heads, "head_dim": config.video_head_dim}
    audio = {"num_heads": config.num_audio_heads, "head_dim": config.audio_head_dim}
    fused = f"{_FUSED_BLOCKS}.*"
    return (
        AttentionSite(module="video_text_transformer_blocks.*.attn", role="text_self", **video),
        AttentionSite(module="audio_text_transformer_blocks.*.attn", role="text_self", **audio),
        AttentionSite(module=f"{fused}.video_dec_block.self_attention", role="video_self", **video),
        AttentionSite(
            module=f"{fused}.video_dec_block.cross_attention", role="video_text", **video
        ),
        AttentionSite(module=f"{fused}.audio_dec_block.self_attention", role="audio_self", **audio),
        AttentionSite(
            module=f"{fused}.audio_dec_block.cross_attention", role="audio_text", **audio
        ),
        AttentionSite(module=f"{fused}.va_cross_attention", role="video_from_audio", **video),
        AttentionSite(module=f"{fused}.av_cross_attention", role="audio_from_video", **audio),
    )


def _sequence_parallel_plan() -> SequenceParallelPlan:
    # Split and gathered around the whole fused-block stack (not at its first and last block), so a step cache
    # that skips blocks (k6serve/caching/) still runs inside the sharded region and the gather still happens.
    return SequenceParallelPlan(
        # The stack takes keyword arguments; the video rope table is (L, 1, K/2, 2, 2).
        split_inputs=(
            SequenceSplitPoint(module=_BLOCK_STACK, argument="video_BLD", dim=1),
            SequenceSplitPoint(module=_BLOCK_STACK, argument="video_rope", dim=0),
        ),
        # Gathered before the head, which needs the whole (T, H, W) grid to unpatchify.
        gather_outputs=(SequenceSplitPoint(module=_BLOCK_STACK, output_index=0, dim=1),),
        sharded_roles=("video_self",),
        gather_kv_roles=("audio_from_video",),
        local_roles=("video_text", "video_from_audio"),
        replicated_roles=("text_self", "audio_self", "audio_text"),
    )


def kandinsky6_plan(config: Kandinsky6TransformerConfig) -> ModelPlan:
    """The plan of a `Kandinsky6Transformer` built from `config`."""
    return ModelPlan(
        blocks=(*_TEXT_BLOCKS, _FUSED_BLOCKS),
        tp=_tensor_parallel_plan(),
        sp=_sequence_parallel_plan(),
        keep_fp32=KEEP_FP32_MODULES,
        attention=_attention_sites(config),
        capabilities=Capabilities(tp=True, ulysses=True, ring=True, cfg_parallel=True, fsdp=True),
    )
