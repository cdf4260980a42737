"""`apply_sequence_parallel`: run a model's sharded stream (the video tokens) split across the SP group.

Driven by the model's `SequenceParallelPlan`, with hooks only (the model stays single-device code):
* a forward pre-hook on each split module cuts its named keyword arguments to this rank's shard (padded at the
  end to a multiple of the degree) and records the cut in a `ShardState`. When the split module is block i of a
  `ModuleList`, the later blocks receive the shard of a tensor they are handed unchanged (the RoPE table is
  passed to every block; the hidden state already arrives sharded from the previous block);
* every `InnerAttention` of a sharded role becomes `ShardedAttention` (Ulysses / Ring / both), every one of a
  gather-kv role `GatherKVAttention`; local and replicated roles are left alone;
* a forward hook on each gather module all-gathers the named output back to the full, unpadded sequence.

The TI2AV reference frame needs nothing special: it is the last video tokens, wherever the cut falls.
"""

from __future__ import annotations

import dataclasses

import torch.distributed as dist
from torch import Tensor, nn

from k6serve.models.common.inner_attention import InnerAttention
from k6serve.models.plan import SequenceParallelPlan, SequenceSplitPoint
from k6serve.parallel.mesh import ParallelGroups
from k6serve.parallel.module_paths import match_modules, parent_list
from k6serve.parallel.sequence import SequenceShard, gather_sequence, shard_sequence
from k6serve.parallel.sequence_attention import GatherKVAttention, ShardedAttention, ShardState


@dataclasses.dataclass(eq=False)
class _SplitCache:
    """The full tensors cut by the split hook of this forward and their shards, by argument name."""

    shards: dict[str, tuple[Tensor, Tensor]] = dataclasses.field(default_factory=dict)


def _swap_inner_attention(model: nn.Module, plan: SequenceParallelPlan, groups: ParallelGroups,
                          state: ShardState) -> None:
    for name, module in list(model.named_modules()):
        if not isinstance(module, InnerAttention):
            continue
        if module.role in plan.sharded_roles:
            replacement: nn.Module = ShardedAttention(
                module, ulysses_group=groups.axis["ulysses"], ring_group=groups.axis["ring"], state=state
            )
        elif module.role in plan.gather_kv_roles:
            replacement = GatherKVAttention(module, sequence_group=groups.sequence, state=state)
        else:
            continue
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child, replacement)


def _split_hook(points: list[SequenceSplitPoint], groups: ParallelGroups, state: ShardState, cache: _SplitCache):
    layout = groups.layout
    # Every split point names a keyword argument: `apply_sequence_parallel` asserted it.
    cuts = [(point.argument, point.dim) for point in points if point.argument is not None]

    def hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        lengths = {kwargs[argument].shape[dim] for argument, dim in cuts}
        assert len(lengths) == 1, f"split arguments disagree on the sequence length: {lengths}"
        shard = SequenceShard(total_length=lengths.pop(), degree=layout.sequence_degree,
                              index=layout.sequence_index(groups.rank))
        state.current = shard
        cache.shards.clear()
        for argument, dim in cuts:
            full = kwargs[argument]
            kwargs[argument] = shard_sequence(full, dim, shard)
            cache.shards[argument] = (full, kwargs[argument])
        return args, kwargs

    return hook


def _follow_hook(arguments: list[str], cache: _SplitCache):
    def hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        for argument in arguments:
            full, shard = cache.shards.get(argument, (None, None))
            if full is not None and kwargs.get(argument) is full:
                kwargs[argument] = shard
        return args, kwargs

    return hook


def _gather_hook(point: SequenceSplitPoint, groups: ParallelGroups, state: ShardState, cache: _SplitCache):
    def hook(module: nn.Module, args: tuple, output):
        shard = state.require()
        if isinstance(output, tuple):
            output = list(output)
            output[point.output_index] = gather_sequence(output[point.output_index], point.dim, shard,
                                                         groups.sequence)
            output = tuple(output)
        else:
            assert point.output_index == 0, "a module with one output has only output 0"
            output = gather_sequence(output, point.dim, shard, groups.sequence)
        state.current = None
        cache.shards.clear()
        return output

    return hook


# Where `apply_sequence_parallel` records how to sum a per-token value over the whole sharded sequence (as
# `attach_cfg_group` records the cfg group), for code that runs inside the sharded region and must decide the
# same on every rank: the step cache's residual distance (k6serve/caching/).
_TOKEN_SUM_ATTRIBUTE = "_k6serve_sequence_token_sum"


class SequenceTokenSum:
    """`(S, L_local) -> (S,)`: S per-token values summed over the real (unpadded) tokens of every rank's shard.

    One all-reduce; every rank of the sequence group gets the same sums. Valid only inside the sharded region
    (between the split and the gather hooks), where the shard of the forward in flight is known.
    """

    def __init__(self, state: ShardState, group) -> None:
        self.state, self.group = state, group

    def __call__(self, values_SL: Tensor) -> Tensor:
        shard = self.state.require()
        sums_S = values_SL.narrow(1, 0, shard.real_length(shard.index)).sum(dim=1)
        dist.all_reduce(sums_S, group=self.group)
        return sums_S


def _local_token_sum(values_SL: Tensor) -> Tensor:
    return values_SL.sum(dim=1)


def sequence_token_sum_of(model: nn.Module):
    """How to sum per-token values of `model`'s sharded stream over the whole sequence (`SequenceTokenSum`
    under sequence parallelism, else a plain sum over the tokens)."""
    return getattr(model, _TOKEN_SUM_ATTRIBUTE, _local_token_sum)


def apply_sequence_parallel(model: nn.Module, plan: SequenceParallelPlan, groups: ParallelGroups) -> ShardState:
    """Shard the plan's stream over `groups.sequence` (ring x ulysses); a no-op at degree 1."""
    state = ShardState()
    if groups.layout.sequence_degree == 1:
        return state
    setattr(model, _TOKEN_SUM_ATTRIBUTE, SequenceTokenSum(state, groups.sequence))
    cache = _SplitCache()
    _swap_inner_attention(model, plan, groups, state)
    by_module: dict[str, list[SequenceSplitPoint]] = {}
    for point in plan.split_inputs:
        assert point.argument is not None, f"split point {point} must name a keyword argument"
        by_module.setdefault(point.module, []).append(point)
    for glob, points in by_module.items():
        for name, module in match_modules(model, glob):
            module.register_forward_pre_hook(_split_hook(points, groups, state, cache), with_kwargs=True)
            siblings = parent_list(model, name)
            if siblings is not None:
                blocks, index = siblings
                arguments = [p.argument for p in points if p.argument is not None]  # all (asserted above)
                for later in list(blocks)[index + 1:]:
                    later.register_forward_pre_hook(_follow_hook(arguments, cache), with_kwargs=True)
    for point in plan.gather_outputs:
        assert point.output_index is not None, f"gather point {point} must name an output index"
        for _, module in match_modules(model, point.module):
            module.register_forward_hook(_gather_hook(point, groups, state, cache))
    return state
