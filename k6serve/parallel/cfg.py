"""CFG-parallel: the conditional and unconditional branches run on different ranks of the cfg axis.

Branch i runs on cfg rank i (0 = conditional, 1 = unconditional). After the forward, every rank gathers
both branch outputs in branch order and applies the same serial combine (`uncond + g * (cond - uncond)`,
done by the caller), so the result is bit-identical to running the branches one after the other on one rank.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

import torch
import torch.distributed as dist
from torch import Tensor

Branch = TypeVar("Branch")

CONDITIONAL, UNCONDITIONAL = 0, 1
# Where `attach_cfg_group` records the cfg group on a parallelised DiT (as diffusers keeps `_parallel_config`),
# so the denoising loop finds it without the pipeline knowing about ranks.
_CFG_GROUP_ATTRIBUTE = "_k6serve_cfg_group"


def attach_cfg_group(model: torch.nn.Module, group: dist.ProcessGroup) -> None:
    """Make the denoising loop run the two guidance branches of `model` on the two ranks of `group`."""
    assert dist.get_world_size(group) == 2, dist.get_world_size(group)
    setattr(model, _CFG_GROUP_ATTRIBUTE, group)


def cfg_group_of(model: object) -> dist.ProcessGroup | None:
    """The cfg group attached to `model`, or None when CFG runs serially."""
    return getattr(model, _CFG_GROUP_ATTRIBUTE, None)


def select_cfg_branch(branches: Sequence[Branch], group: dist.ProcessGroup) -> Branch:
    """The branch this rank runs: branches are (conditional, unconditional) and the cfg group has 2 ranks."""
    assert len(branches) == dist.get_world_size(group) == 2, (len(branches), dist.get_world_size(group))
    return branches[dist.get_rank(group)]


def gather_cfg_branches(local: Tensor | None, group: dist.ProcessGroup) -> list[Tensor] | list[None]:
    """Every branch's output, in branch order, on every rank (None stays None: e.g. no audio stream)."""
    if local is None:
        return [None] * dist.get_world_size(group)
    local = local.contiguous()
    parts = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, local, group=group)
    return parts
