"""DoRA's row norms (PEFT's `use_dora`): m / ||W + s B A|| per output row, on whole or sharded weights, and the
cache that spares the dynamic path a pass over the weights on every switch of adapters.

The norm is over the input dimension for each output row of the Linear view (an Embedding's table transposed), as
PEFT's `get_weight_norm` takes it, over the base weight W. Where a rank holds only part of W (`sharding.py`):
* a block of output rows (tensor-parallel column-parallel Linears; FSDP's `Shard(0)` of a Linear between requests):
  each row is whole on its rank, so its norm is local and bit for bit the unsharded one;
* a block of input columns (tensor-parallel row-parallel Linears; FSDP's `Shard(0)` of an Embedding's table, which
  splits its ids): each rank sums the squares of its columns, and the sums are all-reduced over the shard's group
  before the square root (fp32: the unsharded norm within rounding, the sum being split in another order).
Every rank runs the same LoRA operations in the same order (`ModelWorker.apply_lora_operation`), so these
collectives pair up across ranks; the cache below decides hits and misses on sharded weights (whose misses run
them) from values every rank shares.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from k6serve.lora.sharding import ShardedWeight, local_tensor
from k6serve.lora.state_dict import LoraModule
from k6serve.lora.targets import LoraTarget, features, linear_view

# CPU memory for the cached rows: DoRA on every Linear of the Pro DiT takes about 77 MiB per adapter and strength
# (42 MiB of factors, 35 of biases; Lite about 18 MiB), so this keeps about six such combinations.
MAX_CACHE_BYTES = 512 << 20


def row_norms(rows: Tensor, shard: ShardedWeight) -> Tensor:
    """||row|| of each row of `rows` (fp32: this rank's block of W + s B A); completed across the shard's group where
    the weight is split by input columns."""
    if shard.dim != 1:
        return torch.linalg.norm(rows, dim=1)
    import torch.distributed as dist

    squares = rows.square().sum(dim=1)
    dist.all_reduce(squares, group=shard.group)
    return squares.sqrt()


def dora_factor(layer: nn.Linear | nn.Embedding, rows: slice, module: LoraModule, scale: float) -> Tensor:
    """m / ||W + scale B A|| for output rows `rows` of `layer`'s Linear view, from its base weight (fp32, CPU; computed
    where the weight is). All of those rows on every rank, whatever part of W it holds: the dynamic path scales the
    outputs by it, and a column-parallel rank takes its own rows of it in the forward (`dynamic.LoraDelta`)."""
    shard = ShardedWeight.of(layer)
    with torch.no_grad():
        view = linear_view(layer, shard.local(layer).detach())
        if shard.dim is None:
            weight = view[rows].float()
        else:
            assert (rows.start, rows.stop) == (0, features(layer)[0]), "fused projections are never sharded"
            weight = view.float()
        up, down = shard.slice_update(module.up, module.down)
        delta = scale * (up.to(weight.device, torch.float32) @ down.to(weight.device, torch.float32))
        norm = row_norms(weight + delta, shard)
        if shard.dim == 0:
            # This rank's rows; the other ranks' norms arrive through a sum with zeros elsewhere (exact).
            import torch.distributed as dist

            whole = norm.new_zeros(rows.stop - rows.start)
            whole[shard.start:shard.start + shard.length] = norm
            dist.all_reduce(whole, group=shard.group)
            norm = whole
        if module.magnitude is None:  # asked only of a DoRA module
            raise TypeError("dora_factor needs a DoRA module, one with lora_magnitude_vector")
        return (module.magnitude.to(weight.device, torch.float32) / norm).cpu()


def base_bias(layer: nn.Linear | nn.Embedding, rows: slice) -> Tensor | None:
    """The layer's own bias on output rows `rows` (fp32, CPU), gathered whole where it is sharded; None without one."""
    from torch.distributed.tensor import DTensor

    bias = getattr(layer, "bias", None)
    if bias is None:
        return None
    bias = bias.detach()
    bias = bias.full_tensor() if isinstance(bias, DTensor) else bias
    return bias[rows].float().cpu()


@dataclass(frozen=True, slots=True)
class DoraRows:
    """What a dynamic DoRA delta takes from the base layer, for one adapter module at one scale."""

    factor: Tensor  # (rows,) fp32 CPU: m / ||W + scale B A||
    bias: Tensor | None  # (rows,) fp32 CPU: the layer's own bias on those rows (where DoRA's shift starts from)

    @property
    def num_bytes(self) -> int:
        return sum(tensor.numel() * tensor.element_size() for tensor in (self.factor, self.bias) if tensor is not None)


class DoraCache:
    """`DoraRows` by (adapter module, target rows, scale, base weight storage), least recently used dropped first past
    `max_bytes`. Without it, each request naming a DoRA adapter passed over every targeted weight twice (its adapters
    in, the engine's back), a dense (out x in) update each.

    The factor depends on the module (a re-read file is new `LoraModule` objects), the scale (strength x alpha / rank)
    and the base weight only, not on the other adapters (DoRA's norm is over the base weight), so a switch between
    combinations reuses it. The base weight: the manager is its only writer, and its unmerge restores it bit for bit
    before anything is installed dynamically; a whole weight whose storage was replaced (a memory release and
    resume) is another key, so it is computed again. A sharded one is keyed without its storage, which differs
    between ranks (its values come back bit for bit from a resume)."""

    def __init__(self, max_bytes: int = MAX_CACHE_BYTES) -> None:
        self.max_bytes = max_bytes
        self.num_bytes = 0
        # key -> (the module, kept so that its id stays its own while the entry lives; the rows)
        self.entries: OrderedDict[tuple, tuple[LoraModule, DoraRows]] = OrderedDict()

    def rows(self, target: LoraTarget, module: LoraModule, scale: float) -> DoraRows:
        """The cached `DoraRows` of `module` on `target` at `scale`, computed on a miss."""
        # A miss on a sharded weight runs collectives, so there every rank must decide alike: the storage's address
        # is each rank's own (a memory resume may give one rank its old address and another a new one), so it keys
        # only whole weights, whose misses run none.
        storage = _storage(target.layer) if ShardedWeight.of(target.layer).dim is None else ()
        key = (id(module), target.layer, target.rows.start, target.rows.stop, scale, *storage)
        cached = self.entries.get(key)
        if cached is not None:
            self.entries.move_to_end(key)
            return cached[1]
        rows = DoraRows(dora_factor(target.layer, target.rows, module, scale), base_bias(target.layer, target.rows))
        self.entries[key] = (module, rows)
        self.num_bytes += rows.num_bytes
        while self.num_bytes > self.max_bytes and len(self.entries) > 1:
            # Sizes and order are the same on every rank, so every rank drops the same entries.
            self.num_bytes -= self.entries.popitem(last=False)[1][1].num_bytes
        return rows

    def retain(self, modules: set[int]) -> None:
        """Drop the entries of modules whose id is not in `modules` (adapters no longer loaded: an entry keeps its
        module alive)."""
        for key in [key for key, (module, _) in self.entries.items() if id(module) not in modules]:
            self.num_bytes -= self.entries.pop(key)[1].num_bytes


def _storage(layer: nn.Linear | nn.Embedding) -> tuple:
    """Where the layer's weight and bias are stored now (pointer, device): another storage is another key."""
    tensors = [local_tensor(tensor) for tensor in (layer.weight, getattr(layer, "bias", None)) if tensor is not None]
    return tuple((tensor.data_ptr(), tensor.device) for tensor in tensors)
