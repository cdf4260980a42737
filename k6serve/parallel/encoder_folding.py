"""Encoder folding: shard the Qwen2.5-VL and CLIP text encoders across the ranks of a replica (TP).

The encoders run once per request, before denoising, and every rank of a replica encodes the same prompts, so
they can be tensor-parallel over the whole replica: attention Q/K/V and the MLP input colwise, the attention and
MLP outputs rowwise. That divides their weight memory (15 GiB of Qwen2.5-VL-7B in bf16) by the replica size, at
the cost of two all-reduces per layer.

`--encoder-parallel` rule: "replicate" keeps a whole copy on every rank; "fold" shards and fails at start when a
head count or MLP width does not divide; "auto" folds only when `--use-fsdp-inference` is on (the user asked to
trade speed for memory), every encoder is at least AUTO_FOLD_MIN_HIDDEN wide (the reference's gate,
serving-reference.md §4.7: narrower ones ran slower folded) and every count divides; otherwise it replicates: for a
once-per-request encoder of a few milliseconds' compute, replication costs no communication and memory is the
only thing folding buys. Kandinsky 6's encoders (the Qwen2.5-VL trunk, 3,584 wide; CLIP-L, 768) are below the
gate, so "auto" replicates them, and the seed's baseline recipes, FSDP x Ulysses included, keep one GPU's encoder
reductions: the seed promises FSDP + Ulysses equal to resident Ulysses in every frame and the waveform, and folding
changes the encoders' reductions ("keep auto for the baseline recipes").
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import parallelize_module

from k6serve.models.plan import TensorParallelStyle
from k6serve.parallel.mesh import ParallelLayout
from k6serve.parallel.tensor_parallel import expand_plan


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class EncoderPlan:
    """TP plan of one transformers encoder class: its layer list and what each layer shards."""

    layers: str  # dotted suffix of the layers' ModuleList (wrapper prefixes differ between versions)
    layer_tp: Mapping[str, TensorParallelStyle]
    # Any: the config is the transformers config class of the plan's encoder (each plan reads its own attributes).
    divisible_counts: Callable[[Any], dict[str, int]]  # config -> the counts the fold size must divide
    hidden_size: Callable[[Any], int]  # config -> the width "auto" compares with AUTO_FOLD_MIN_HIDDEN


# "auto" folds no encoder narrower than this (the reference's gate).
AUTO_FOLD_MIN_HIDDEN = 4096


ENCODER_PLANS = {
    "Qwen2_5_VLForConditionalGeneration": EncoderPlan(
        layers="language_model.layers",
        layer_tp={
            "self_attn.q_proj": "colwise", "self_attn.k_proj": "colwise", "self_attn.v_proj": "colwise",
            "self_attn.o_proj": "rowwise", "mlp.gate_proj": "colwise", "mlp.up_proj": "colwise",
            "mlp.down_proj": "rowwise",
        },
        divisible_counts=lambda config: {
            "attention heads": config.text_config.num_attention_heads,
            "key/value heads": config.text_config.num_key_value_heads,
            "MLP width": config.text_config.intermediate_size,
        },
        hidden_size=lambda config: config.text_config.hidden_size,
    ),
    "CLIPTextModel": EncoderPlan(
        layers="encoder.layers",
        layer_tp={
            "self_attn.q_proj": "colwise", "self_attn.k_proj": "colwise", "self_attn.v_proj": "colwise",
            "self_attn.out_proj": "rowwise", "mlp.fc1": "colwise", "mlp.fc2": "rowwise",
        },
        divisible_counts=lambda config: {
            "attention heads": config.num_attention_heads, "MLP width": config.intermediate_size,
        },
        hidden_size=lambda config: config.hidden_size,
    ),
}


def _plan_of(encoder: nn.Module) -> EncoderPlan:
    return _plan_named(type(encoder).__name__)


def _plan_named(name: str) -> EncoderPlan:
    if name not in ENCODER_PLANS:
        raise ValueError(
            f"--encoder-parallel fold has no plan for {name} (known: {sorted(ENCODER_PLANS)}); use "
            f"--encoder-parallel replicate."
        )
    return ENCODER_PLANS[name]


def fold_blockers(encoders: list[tuple[str, object]], size: int) -> list[str]:
    """Why the encoders, given as (class name, transformers config) pairs, cannot be folded over `size` ranks
    (empty when they can)."""
    blockers = []
    for class_name, config in encoders:
        for what, count in _plan_named(class_name).divisible_counts(config).items():
            if count % size:
                blockers.append(f"{class_name} has {count} {what}, not divisible by {size}")
    return blockers


def should_fold(mode: str, layout: ParallelLayout, encoders: Sequence[nn.Module | tuple[str, object]]) -> bool:
    """Apply the `--encoder-parallel` rule of the module docstring; ValueError when "fold" cannot run. The encoders
    are the loaded modules, or (class name, config) pairs read before loading (`parallel/preflight.py`)."""
    if mode == "replicate":
        return False
    described = [item if isinstance(item, tuple) else (type(item).__name__, item.config) for item in encoders]
    blockers = fold_blockers(described, layout.replica_size) if layout.replica_size > 1 else ["one rank"]
    if mode == "auto":
        # Checked last: only where a fold could run (FSDP, no blocker) are the encoders' plans looked up.
        return layout.fsdp and not blockers and all(
            _plan_named(name).hidden_size(config) >= AUTO_FOLD_MIN_HIDDEN for name, config in described)
    assert mode == "fold", mode
    if layout.replica_size == 1:
        raise ValueError(
            "--encoder-parallel fold shards the text encoders over the ranks of a replica, and this replica has "
            "one GPU. Fix: use --encoder-parallel replicate (or auto), or give the replica more GPUs."
        )
    if blockers:
        raise ValueError(
            f"--encoder-parallel fold over {layout.replica_size} ranks is impossible: {'; '.join(blockers)}. "
            f"Fix: use --encoder-parallel replicate, or a replica size that divides these counts."
        )
    return True


def fold_encoder(encoder: nn.Module, mesh: DeviceMesh) -> None:
    """Tensor-parallelise one encoder's layers over `mesh` (every rank of the replica)."""
    plan = _plan_of(encoder)
    layer_lists = [
        module for name, module in encoder.named_modules()
        if name == plan.layers or name.endswith("." + plan.layers)
    ]
    assert len(layer_lists) == 1, f"{type(encoder).__name__}: expected one '{plan.layers}' list"
    for layer in layer_lists[0]:
        parallelize_module(layer, mesh, expand_plan(layer, plan.layer_tp))
