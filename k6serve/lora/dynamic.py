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
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn


@dataclass(eq=False, slots=True)
class LoraDelta:
    """scale * up @ down, added to output rows `rows` of a Linear; `up` is stored pre-multiplied by `scale`."""

    down: Tensor  # (rank, in_features), CPU
    up: Tensor  # (rows, rank), CPU
    scale: float
    rows: slice
    full_width: bool  # rows are all of the output: add to the whole output, no slicing
    cache: dict[tuple[torch.device, torch.dtype], tuple[Tensor, Tensor]] = field(default_factory=dict)

    def weights(self, like: Tensor) -> tuple[Tensor, Tensor]:
        key = (like.device, like.dtype)
        if key not in self.cache:
            # The scale is folded into `up` in fp32, before the cast: one multiply fewer per call, and the rank-r
            # GEMM that follows rounds once, as the merged weight's single GEMM does.
            up = (self.up.float() * self.scale).to(like.device, like.dtype)
            self.cache[key] = (self.down.to(like.device, like.dtype), up)
        return self.cache[key]


class LoraLinear(nn.Module):
    """`base(x)` plus, for each delta, `F.linear(F.linear(x, down), scale * up)` on its output rows."""

    def __init__(self, base: nn.Linear) -> None:
        super().__init__()
        self.base = base
        self.deltas: list[LoraDelta] = []

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
        for delta in self.deltas:
            down, up = delta.weights(x)
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
