"""`apply_fsdp`: FSDP2 inference sharding of a DiT's repeated blocks over the ranks of a replica.

Each block's parameters are sharded across the replica and all-gathered just before the block runs (then freed
again), so a rank holds 1/N of the blocks plus one block in full; the rest of the model (embeddings, heads) is the
root unit. Gathered parameters are the loaded ones, so the output is equal to the resident run. Sequence
parallelism composes: the Ulysses/Ring ranks are ranks of the replica and gather the same blocks in the same order.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard


def apply_fsdp(model: nn.Module, blocks: tuple[str, ...], mesh: DeviceMesh) -> None:
    """`fully_shard` every block of every `nn.ModuleList` named in `blocks`, then the root."""
    for path in blocks:
        block_list = model.get_submodule(path)
        assert isinstance(block_list, nn.ModuleList), f"plan.blocks names {path!r}, which is not a ModuleList"
        for block in block_list:
            fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
