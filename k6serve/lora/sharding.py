"""Which part of a Linear's full weight this rank holds, so a LoRA update can be applied to the local part only.

Tensor parallelism leaves each targeted weight a DTensor on the tp mesh: column-parallel `Shard(0)` (a block of
output rows: the update's rows of B @ A) or row-parallel `Shard(1)` (a block of input columns: B @ A's columns).
FSDP leaves block weights `Shard(0)` DTensors between requests and plain full tensors inside the forward.
A column-parallel Linear's bias is sharded as its rows (`Shard(0)`); a row-parallel one's is replicated, and torch
adds it once, after the partial sums are reduced. An Embedding is read as the Linear whose weight is its table
transposed (`targets.linear_view`), so FSDP's `Shard(0)` of its table is a block of that Linear's input columns.

`ShardedWeight.of(linear)` reads the layout between requests (merge and the checks); `dynamic.LoraLinear` reads
it again inside the forward, where only tensor parallelism is still sharded.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

from torch import Tensor, nn

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor


@dataclass(frozen=True, slots=True)
class ShardedWeight:
    """The local block of a 2-D weight in its Linear view (out x in): `dim` 0 (output rows) or 1 (input columns),
    from `start`, `length` long; `dim` None when the weight is whole on this rank."""

    dim: int | None
    start: int = 0
    length: int = 0
    group: object = None  # the ProcessGroup of the shard's mesh (the row-parallel update sums over it)

    @classmethod
    def of(cls, linear: nn.Linear | nn.Embedding) -> ShardedWeight:
        from torch.distributed.tensor import DTensor, Shard
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        weight = linear.weight.data
        if not isinstance(weight, DTensor):
            return cls(dim=None)
        placements = weight.placements
        if weight.device_mesh.ndim != 1 or len(placements) != 1 or not isinstance(placements[0], Shard):
            raise ValueError(f"LoRA supports weights sharded along one dimension of a 1-D mesh (tensor parallel or "
                             f"FSDP alone), not {placements} on a {weight.device_mesh.ndim}-D mesh")
        stored = placements[0].dim % 2  # of the stored weight; an Embedding's table is the Linear view transposed
        local_shape, offset = compute_local_shape_and_global_offset(weight.shape, weight.device_mesh, placements)
        dim = 1 - stored if isinstance(linear, nn.Embedding) else stored
        return cls(dim=dim, start=offset[stored], length=local_shape[stored], group=weight.device_mesh.get_group())

    def local(self, linear: nn.Linear | nn.Embedding) -> Tensor:
        """The weight's local storage (a view: writing to it changes the weight)."""
        weight = linear.weight.data
        return weight if self.dim is None else cast("DTensor", weight).to_local()  # a shard's weight is a DTensor

    def slice_update(self, up: Tensor, down: Tensor) -> tuple[Tensor, Tensor]:
        """(up, down) restricted to this rank's block of up @ down."""
        if self.dim == 0:
            return up[self.start:self.start + self.length], down
        if self.dim == 1:
            return up, down[:, self.start:self.start + self.length]
        return up, down

    def slice_rows(self, vector: Tensor) -> Tensor:
        """A vector over all output rows (a bias, DoRA's magnitudes or row factors) restricted to the rows this rank
        computes (its block, column-parallel; all of them where the weight is whole or row-parallel, whose output,
        bias included, is whole on every rank)."""
        return vector[self.start:self.start + self.length] if self.dim == 0 else vector


def local_tensor(tensor: Tensor) -> Tensor:
    """A parameter's local storage: a DTensor's local shard (a view), else the tensor itself."""
    from torch.distributed.tensor import DTensor

    tensor = tensor.data
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor
