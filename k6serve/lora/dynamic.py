"""Dynamic LoRA: the base weights stay untouched and each targeted Linear adds its low-rank update at run time.

A `LoraLinear` takes the targeted Linear's place in its parent for as long as adapters are active (the original is
put back on restore). A module swap rather than a forward hook, because the DiT blocks are `torch.compile`d in
`--performance-mode speed` and dynamo does not guard on module hooks: a hook registered after the first compiled
call is silently skipped (checked with torch 2.13). Dynamo does guard on the module's type and attributes, so a swap
(and a change of the `deltas` list) is seen; the delta tensors are graph inputs, so a new strength, which only
changes their values, costs no recompilation.

The wrapped Linear's parameters are the same objects, so offloading (which re-points `.data`) and block streaming
keep working; the adapter tensors are plain attributes, not parameters or buffers, so they are not offloaded:
they are copied to the input's device and dtype on first use and cached there.

Sharded weights (`sharding.py`): under FSDP the weight is whole inside the forward, so nothing changes. Under
tensor parallelism it is still a shard: a column-parallel Linear returns this rank's output rows, so the update
uses those rows of B; a row-parallel one gets this rank's input columns and all-reduces its partial sums, so the
update's first GEMM (x @ A^T, summed over the ranks' columns of A) is all-reduced too before B: (tokens x rank)
values, one small collective per such Linear and call.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from k6serve.lora.sharding import ShardedWeight


@dataclass(eq=False, slots=True)
class LoraDelta:
    """scale * up @ down, added to output rows `rows` of a Linear; `up` is stored pre-multiplied by `scale`."""

    down: Tensor  # (rank, in_features), CPU
    up: Tensor  # (rows, rank), CPU
    scale: float
    rows: slice
    full_width: bool  # rows are all of the output: add to the whole output, no slicing
    cache: dict[tuple[torch.device, torch.dtype], tuple[Tensor, Tensor]] = field(default_factory=dict)

    def weights(self, like: Tensor, shard: ShardedWeight) -> tuple[Tensor, Tensor]:
        """(down, scale * up) on `like`'s device and dtype, restricted to `shard` (fixed for a wrapper)."""
        key = (like.device, like.dtype)
        if key not in self.cache:
            # The scale is folded into `up` in fp32, before the cast: one multiply fewer per call, and the rank-r
            # GEMM that follows rounds once, as the merged weight's single GEMM does.
            up, down = shard.slice_update(self.up.float() * self.scale, self.down)
            self.cache[key] = (down.to(like.device, like.dtype), up.to(like.device, like.dtype))
        return self.cache[key]


class LoraLinear(nn.Module):
    """`base(x)` plus, for each delta, `F.linear(F.linear(x, down), scale * up)` on its output rows."""

    def __init__(self, base: nn.Linear) -> None:
        super().__init__()
        self.base = base
        self.deltas: list[LoraDelta] = []
        self.shard: ShardedWeight | None = None  # the weight's layout inside the forward, read on the first call

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

    def forward(self, x: Tensor) -> Tensor:
        output = self.base(x)
        if self.shard is None:
            self.shard = ShardedWeight.of(self.base)
        for delta in self.deltas:
            down, up = delta.weights(x, self.shard)
            if self.shard.dim == 1:
                output = output + _row_parallel_update(x, down, up, self.shard.group)
                continue
            update = F.linear(F.linear(x, down), up)
            if delta.full_width:
                output = output + update
            else:
                # A fused projection's block of rows ([q; k; v]): `output` is this call's fresh GEMM result, so it
                # can be updated in place.
                output[..., delta.rows] += update
        return output

    def extra_repr(self) -> str:
        return f"lora_deltas={len(self.deltas)}"


@torch.compiler.disable  # a collective: a compiled block breaks its graph here instead of tracing it
def _row_parallel_update(x_local: Tensor, down_local: Tensor, up: Tensor, group) -> Tensor:
    """B @ (sum over ranks of A_r @ x_r): this rank's input columns, all-reduced before the second GEMM."""
    import torch.distributed as dist

    partial = F.linear(x_local, down_local)
    dist.all_reduce(partial, group=group)
    return F.linear(partial, up)
