"""Generic plan dataclasses: what a model declares so transforms can be applied from outside.

A model family's `plan.py` returns a `ModelPlan` (data only). Generic appliers in `k6serve.parallel`,
`offload`, `cache` and `compile` read it; they never name a model class. Nothing here applies a plan.

Module paths are dotted names relative to the model; `*` matches one path component (one block index).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Literal

TensorParallelStyle = Literal["colwise", "rowwise"]


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Capabilities:
    """Which parallel techniques the model supports (validated against the engine config up front)."""

    tp: bool
    ulysses: bool
    ring: bool
    cfg_parallel: bool
    fsdp: bool


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class AttentionSite:
    """One attention layer: its module path glob, `InnerAttention` role and head geometry.

    Tensor and Ulysses parallelism split whole heads, so their degrees must divide `num_heads`.
    """

    module: str
    role: str
    num_heads: int
    head_dim: int


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class SequenceSplitPoint:
    """A tensor whose sequence dim is split across sequence-parallel ranks, or gathered back.

    `argument` names a keyword argument of `module.forward` (input points); `output_index` selects an
    element of the module's output tuple (output points). Exactly one of them is set.
    """

    module: str
    dim: int
    argument: str | None = None
    output_index: int | None = None

    def __post_init__(self) -> None:
        assert (self.argument is None) != (self.output_index is None), (
            "set argument or output_index"
        )


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class SequenceParallelPlan:
    """Where the sharded stream is split and gathered, and how each attention role behaves.

    * `sharded_roles`: queries and keys/values both sharded: swap `InnerAttention` for Ulysses/Ring.
    * `gather_kv_roles`: replicated queries attend to sharded keys/values: gather K/V before attention.
    * `local_roles`: sharded queries attend to replicated keys/values: no communication.
    * `replicated_roles`: nothing sharded: every rank computes the same result.
    """

    split_inputs: tuple[SequenceSplitPoint, ...]
    gather_outputs: tuple[SequenceSplitPoint, ...]
    sharded_roles: tuple[str, ...]
    gather_kv_roles: tuple[str, ...]
    local_roles: tuple[str, ...]
    replicated_roles: tuple[str, ...]


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class ModelPlan:
    """Everything transforms need to know about a model, as data.

    * `blocks`: paths of the `nn.ModuleList`s of repeated blocks (unit of FSDP, compile, offload, caching).
    * `tp`: module glob -> "colwise" | "rowwise" for every linear that tensor parallelism shards.
    * `keep_fp32`: module names kept in fp32 after a low-precision load (see `keeps_fp32`).
    """

    blocks: tuple[str, ...]
    tp: Mapping[str, TensorParallelStyle]
    sp: SequenceParallelPlan
    keep_fp32: tuple[str, ...]
    attention: tuple[AttentionSite, ...]
    capabilities: Capabilities


def keeps_fp32(parameter_name: str, keep_fp32: tuple[str, ...]) -> bool:
    """diffusers' load rule: keep a tensor fp32 only if a name equals a whole dotted path component.

    E.g. "modulation" keeps `out_layer.modulation.out_layer.weight` but not `...text_modulation...`.
    """
    components = parameter_name.split(".")
    return any(name in components for name in keep_fp32)
