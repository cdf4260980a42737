"""`apply_tp`: tensor parallelism from a plan of module globs -> "colwise" | "rowwise" (torch `parallelize_module`).

Column-parallel linears keep whole heads per rank (Q/K/V, the FFN input) and hand back local tensors; the
row-parallel linear after them (attention output, FFN output) all-reduces its partial sums into a replicated
local tensor. The models read heads as (-1, head_dim), so local head counts need no model attribute change
(the parity tests prove it). The all-reduce reorders sums, so TP differs from one
device by rounding (docs/parallelism.md has the measured size).
"""

from __future__ import annotations

from collections.abc import Mapping

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    parallelize_module,
)

from k6serve.models.plan import TensorParallelStyle
from k6serve.parallel.module_paths import match_modules

_STYLES: dict[str, type[ParallelStyle]] = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}


def expand_plan(model: nn.Module, plan: Mapping[str, TensorParallelStyle]) -> dict[str, ParallelStyle]:
    """The plan with every glob replaced by the full names of the modules it matches."""
    return {
        name: _STYLES[style]()
        for glob, style in plan.items()
        for name, _ in match_modules(model, glob)
    }


def apply_tp(model: nn.Module, plan: Mapping[str, TensorParallelStyle], mesh: DeviceMesh) -> None:
    """Shard the plan's linears over the 1-D `mesh` (the replica's tp axis); a no-op on one rank."""
    if mesh.size() == 1:
        return
    parallelize_module(model, mesh, expand_plan(model, plan))
