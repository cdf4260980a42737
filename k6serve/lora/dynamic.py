"""Dynamic LoRA: the base weights stay untouched and each targeted Linear adds its low-rank update at run time.

A `LoraLinear` (`LoraEmbedding` for an nn.Embedding) takes the targeted layer's place in its parent for as long as
adapters are active (the original is put back on restore). A module swap rather than a forward hook, because the
DiT blocks are `torch.compile`d in `--performance-mode speed` and dynamo does not guard on module hooks: a hook
registered after the first compiled call is silently skipped (checked with torch 2.13). Dynamo does guard on the
module's type and attributes, so a swap (and a change of the `deltas` list) is seen; the delta tensors are graph
inputs, so a new strength, which only changes their values, costs no recompilation.

The wrapped Linear's parameters are the same objects, so offloading (which re-points `.data`) and block streaming
keep working; the adapter tensors are plain attributes, not parameters or buffers, so they are not offloaded:
they are copied to the input's device and dtype on first use and cached there.

Sharded weights (`sharding.py`): under FSDP the weight is whole inside the forward, so nothing changes. Under
tensor parallelism it is still a shard: a column-parallel Linear returns this rank's output rows, so the update
uses those rows of B (and of DoRA's row factors); a row-parallel one gets this rank's input columns and all-reduces
its partial sums, so the update's first GEMM (x @ A^T, summed over the ranks' columns of A) is all-reduced too
before B: (tokens x rank) values, one small collective per such Linear and call. Its output is whole on every rank,
so DoRA scales all its rows there. DoRA's factors are computed between requests (`dora.py`), for all rows.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from k6serve.lora.sharding import ShardedWeight


@dataclass(eq=False, slots=True)
class LoraDelta:
    """scale * up @ down (+ scale * bias), added to output rows `rows` of a layer; DoRA also multiplies those rows of
    the output by `factor` first. CPU tensors, cast and cached per device and dtype on first use."""

    down: Tensor  # (rank, in_features), CPU
    up: Tensor  # (rows, rank), CPU
    scale: float
    rows: slice
    full_width: bool  # rows are all of the output: add to the whole output, no slicing
    bias: Tensor | None = None  # lora_B.bias (rows,): PEFT adds scale * bias with the update
    # DoRA (PEFT's use_dora): factor = magnitude / ||W + scale B A|| per row, computed when the adapter is set (the
    # base weight is fixed while it is active; `dora.DoraCache`); shift = (1 - factor) * the bias the rows held
    # before it. Both cover all `rows`, also on a sharded layer: `weights` takes this rank's.
    factor: Tensor | None = None  # (rows,), fp32
    shift: Tensor | None = None  # (rows,), fp32; None where that bias is zero (no bias)
    # Only tensors go in here (runtime/memory.py moves each of them for sleep / wake): (down, up[, bias][, factor][,
    # shift]), the optional ones where set.
    cache: dict[tuple[torch.device, torch.dtype], tuple[Tensor, ...]] = field(default_factory=dict)
    # `up` and `bias` with the scale (and DoRA's factor) folded in, fp32 CPU, made with the delta (`__post_init__`).
    scaled_up: Tensor = field(init=False)
    scaled_bias: Tensor | None = field(init=False)

    def __post_init__(self) -> None:
        # The scale is folded into `up` in fp32, before the cast: one multiply fewer per call, and the rank-r GEMM
        # that follows rounds once, as the merged weight's single GEMM does. Folded here, not on the first call: a
        # compiled block whose first call filled the cache read `scale` as a constant and compiled again for the next
        # strength (a request's own `loras` makes new deltas every time).
        up = self.up.float() * self.scale
        self.scaled_up = up if self.factor is None else self.factor[:, None] * up
        self.scaled_bias = None if self.bias is None else self.bias.float() * self.scale

    def weights(self, like: Tensor, shard: ShardedWeight) -> tuple[Tensor, Tensor, Tensor | None, Tensor | None,
                                                                   Tensor | None]:
        """(down, up, bias, factor, shift) on `like`'s device and dtype, restricted to `shard` (fixed for a wrapper);
        `up` and `bias` carry the scale (and DoRA's factor), the missing ones are None."""
        key = (like.device, like.dtype)
        if key not in self.cache:
            up, down = shard.slice_update(self.scaled_up, self.down)
            bias, factor, shift = (None if tensor is None else shard.slice_rows(tensor)
                                   for tensor in (self.scaled_bias, self.factor, self.shift))
            present = (down, up, bias, factor, shift)
            self.cache[key] = tuple(tensor.to(like.device, like.dtype) for tensor in present if tensor is not None)
        cached = self.cache[key]
        down, up, bias, factor, shift, index = cached[0], cached[1], None, None, None, 2
        if self.bias is not None:
            bias, index = cached[index], index + 1
        if self.factor is not None:
            factor, index = cached[index], index + 1
        if self.shift is not None:
            shift = cached[index]
        return down, up, bias, factor, shift


def _add(output: Tensor, delta: LoraDelta, update: Tensor, factor: Tensor | None, shift: Tensor | None) -> Tensor:
    """`output` with `update` added on `delta`'s rows; DoRA's rows are first scaled by `factor` and shifted."""
    if factor is not None:
        # DoRA as an output scaling: factor * (W x + b) + (1 - factor) * b + factor * scale * B A x is
        # factor * (W + scale B A) x + b, PEFT's DoRA forward, exactly in real arithmetic. It costs one multiply-add
        # over the output on top of plain LoRA's two thin GEMMs (factor is folded into up), where the merged
        # weight's delta as a dense (out x in) matrix would double the memory of every targeted weight and add a
        # full GEMM per call.
        update = update if shift is None else update + shift
        if delta.full_width:
            return torch.addcmul(update, output, factor)
        output[..., delta.rows] = torch.addcmul(update, output[..., delta.rows], factor)
        return output
    if delta.full_width:
        return output + update
    # A fused projection's block of rows ([q; k; v]): `output` is this call's fresh GEMM result, so it can be
    # updated in place.
    output[..., delta.rows] += update
    return output


class LoraLinear(nn.Module):
    """`base(x)` plus, for each delta, `F.linear(F.linear(x, down), scale * up)` on its output rows."""

    def __init__(self, base: nn.Linear) -> None:
        super().__init__()
        self.base = base
        self.deltas: list[LoraDelta] = []
        self.shard: ShardedWeight | None = None  # the weight's layout inside the forward: `prepare`, or the first call

    # The model reads some Linears' weight (the dtype to cast a time embedding or modulation input to): the wrapper
    # answers for the layer it stands in for.
    @property
    def weight(self) -> Tensor:
        return self.base.weight

    @property
    def bias(self) -> Tensor | None:
        return self.base.bias

    @property
    def in_features(self) -> int:
        return self.base.in_features

    @property
    def out_features(self) -> int:
        return self.base.out_features

    def prepare(self, device: torch.device) -> None:
        """Read the weight's layout and cast the deltas for an input on `device` in the weight's dtype now, before
        the forward (not under FSDP, whose weight is whole only inside it). Left to a compiled block's first call,
        this made that call's graph unlike every later call's: two graphs per new set of wrapped layers instead of
        one. An input of another dtype still fills its cache on first use."""
        if self.shard is None:
            self.shard = ShardedWeight.of(self.base)
        like = torch.empty(0, device=device, dtype=self.base.weight.dtype)
        for delta in self.deltas:
            delta.weights(like, self.shard)

    def forward(self, x: Tensor) -> Tensor:
        output = self.base(x)
        if self.shard is None:
            self.shard = ShardedWeight.of(self.base)
        for delta in self.deltas:
            down, up, bias, factor, shift = delta.weights(x, self.shard)
            if self.shard.dim == 1:  # row-parallel: never a fused projection's rows, so `full_width`
                update = _row_parallel_update(x, down, up, bias, self.shard.group)
            else:
                update = F.linear(F.linear(x, down), up, bias)
            output = _add(output, delta, update, factor, shift)
        return output

    def extra_repr(self) -> str:
        return f"lora_deltas={len(self.deltas)}"


class LoraEmbedding(nn.Module):
    """`base(ids)` plus, for each delta, the ids' rows of down^T times (scale * up)^T: PEFT's embedding LoRA, whose
    lora_embedding_A / _B are the down / up of the table's transpose (`state_dict.LoraModule`). No layout runs the
    embedding sharded inside the forward (tensor parallelism leaves it whole, FSDP gathers it)."""

    _WHOLE = ShardedWeight(dim=None)

    def __init__(self, base: nn.Embedding) -> None:
        super().__init__()
        self.base = base
        self.deltas: list[LoraDelta] = []

    @property
    def weight(self) -> Tensor:
        return self.base.weight

    @property
    def num_embeddings(self) -> int:
        return self.base.num_embeddings

    @property
    def embedding_dim(self) -> int:
        return self.base.embedding_dim

    def prepare(self, device: torch.device) -> None:
        """Cast the deltas for `device` and the table's dtype now (`LoraLinear.prepare`)."""
        like = torch.empty(0, device=device, dtype=self.base.weight.dtype)
        for delta in self.deltas:
            delta.weights(like, self._WHOLE)

    def forward(self, ids: Tensor) -> Tensor:
        output = self.base(ids)
        for delta in self.deltas:
            down, up, _, factor, _ = delta.weights(output, self._WHOLE)
            output = _add(output, delta, F.linear(F.embedding(ids, down.T), up), factor, None)
        return output

    def extra_repr(self) -> str:
        return f"lora_deltas={len(self.deltas)}"


@torch.compiler.disable  # a collective: a compiled block breaks its graph here instead of tracing it
def _row_parallel_update(x_local: Tensor, down_local: Tensor, up: Tensor, bias: Tensor | None, group) -> Tensor:
    """B @ (sum over ranks of A_r @ x_r) (+ bias): this rank's input columns, all-reduced before the second GEMM,
    which every rank then computes whole, so the bias is added once."""
    import torch.distributed as dist

    partial = F.linear(x_local, down_local)
    dist.all_reduce(partial, group=group)
    return F.linear(partial, up, bias)
