"""Spatial-shard SR decode: each tile's height split across the replica's ranks, halo rows exchanged per convolution.

The seed's `--vae-config.use-parallel-decode true --vae-config.parallel-decode-mode spatial_shard`
(k6-super-resolution.md §4): rank r of W decodes latent rows `tensor_split(h, W)[r]` of every tile, with that slab's
own temporal cache chain, and the decoded pixel slabs are all-gathered after each causal segment, so every rank
holds every tile's frames and the blend that follows runs unchanged. Against the whole-tile decode
(parallel/tile_decode.py) it divides every tile's work and its activations and caches by W, so it also pays when a
clip has fewer tiles than ranks or a count that does not divide, at the price of two small collectives per
convolution.

Why it is exact in arithmetic: the K-VAE decoder is local along the height. Its only operations that read
neighbouring rows are the causal 3x3x3 convolutions (one row each way) and the upsamplers' spatial convolution (one
row each way of the upsampled grid, so one row of their input); RMS norms, SiLU, 1x1x1 and (k, 1, 1) temporal
convolutions, and the latent-conditioned norms' nearest upsampling of `zq` (integer factors, the slab starts on a
latent row) stay inside the rows they are given. So each of those modules gets its input extended by its
neighbours' edge rows (a forward pre-hook; zero rows at the image's top and bottom are the modules' own zero
padding, so nothing is added there) and its output cut back to the slab's rows (a forward hook): the rows kept see
exactly the inputs the unsplit decode gives them. The temporal caches hold the extended frames, whose halo rows were
exchanged when those frames were current, which is what the next segment's window needs (the seed's "original
temporal cache"). Hooks, not a rewritten forward, so every forward the speed rewrites install (one causal
convolution per segment, the folded sub-pixel upsampler, channels-last, the compiled blocks) runs unchanged beside
them; the exchange is a functional all-gather, which dynamo traces into the compiled blocks' graphs.

What it costs: each hooked module also computes its halo rows (2 extra rows per convolution) and the replica exchanges 2
rows per rank per convolution, about 70 small all-gathers per segment. Measured on one H200 with zeros for the halo rows
(scripts/gpu_spatial_shard.py): a rank's compiled decode of its half of a 512x768x121 tile takes 0.54x of the whole
tile's, of a quarter 0.28x (ideal 0.5x / 0.25x). What changes: the bits. A convolution over other shapes may take
another algorithm or summation order, so frames differ from serial decode by rounding (the seed measured max 4/255, PSNR
57.5 dB on GB300; the CPU test here, fp32: the decoder outputs within 1e-5 relative of serial, the uint8 frames within
one level). That is why it is opt-in, as in the reference. A tile with fewer latent rows than ranks is decoded
replicated, and one GPU keeps the serial decode.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, cast

import torch
import torch.distributed as dist
from torch import Tensor, nn

from k6serve.parallel.sequence import pad_sequence

if TYPE_CHECKING:  # the K-VAE's modules are told apart by class name, without importing diffusers here
    from diffusers.models.autoencoders.autoencoder_kandinsky6_sr import Kandinsky6SRCausalConv3d

# Where `attach_spatial_shard` records the exchange on the SRVAE wrapper (as `attach_decode_group` records its group),
# and `hook_decoder` on each hooked module.
_EXCHANGE_ATTRIBUTE = "_k6serve_spatial_shard"
_HOOKED_ATTRIBUTE = "_k6serve_halo_exchange"


class HaloExchange:
    """Neighbour rows between the ranks of `group`, each holding one horizontal slab of the same (B, C, T, H, W)
    tensor, rank order = top to bottom. Inactive (the hooks do nothing) outside `sharding()`."""

    def __init__(self, group: dist.ProcessGroup | None) -> None:
        self.group = group
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self.active = False
        self.max_halo = 1  # the most halo rows a hooked module reads (`hook_decoder`); every slab needs as many

    @contextmanager
    def sharding(self) -> Iterator[None]:
        previous, self.active = self.active, True
        try:
            yield
        finally:
            self.active = previous

    @property
    def has_above(self) -> bool:
        return self.rank > 0

    @property
    def has_below(self) -> bool:
        return self.rank < self.world - 1

    def extend(self, x_BCTHW: Tensor, rows: int) -> Tensor:
        """`x` with the `rows` last rows of the slab above prepended and the `rows` first rows of the slab below
        appended (nothing at the image's top and bottom). Every slab needs at least `rows` rows.

        A functional all-gather, which dynamo traces: inside a compiled block the exchange is part of the graph, so
        inductor still fuses the norm and SiLU before a convolution into the write of its (extended) input. (A
        `torch.compiler.disable`d exchange broke every block at each convolution: on one H200 a half-height slab
        then took 2.09 s against 1.48 s for the whole tile.)"""
        if x_BCTHW.size(3) < rows:
            raise ValueError(f"a slab of {x_BCTHW.size(3)} rows cannot lend {rows} halo rows")
        batch = x_BCTHW.size(0)
        edges = torch.cat([x_BCTHW[:, :, :, :rows], x_BCTHW[:, :, :, -rows:]], dim=3).contiguous()
        gathered = _all_gather_dim0(edges, self.group)  # (world * B, C, T, 2 rows, W), rank-major
        parts = [x_BCTHW]
        if self.has_above:
            parts.insert(0, gathered[(self.rank - 1) * batch: self.rank * batch, :, :, rows:])
        if self.has_below:
            parts.append(gathered[(self.rank + 1) * batch: (self.rank + 2) * batch, :, :, :rows])
        extended = torch.cat(parts, dim=3)
        if x_BCTHW.is_contiguous(memory_format=torch.channels_last_3d) and not x_BCTHW.is_contiguous():
            # Keep the layout the channels-last decoder runs in (cuDNN would transpose an NCDHW input back).
            extended = extended.contiguous(memory_format=torch.channels_last_3d)
        return extended

    def crop(self, y_BCTHW: Tensor, rows: int) -> Tensor:
        """The slab's own output rows from a module that ran on `extend(x, ...)`: `rows` output rows came from each
        halo (the upsamplers make two of each input row)."""
        start = rows if self.has_above else 0
        stop = y_BCTHW.size(3) - (rows if self.has_below else 0)
        return y_BCTHW[:, :, :, start:stop]

    @torch.compiler.disable
    def agree(self, value: bool) -> bool:
        """`value` on every rank, and-ed: decisions that shape the collectives must be the same everywhere."""
        device = _collective_device(self.group)
        flag = torch.tensor([int(value)], dtype=torch.int32, device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self.group)
        return bool(flag.item())

    def gather_rows(self, slab_BTCHW: Tensor, heights: list[int]) -> Tensor:
        """The slabs of every rank (`heights[r]` rows each, dim -2), stacked top to bottom on every rank."""
        # all_gather needs equal shapes: pad each slab to the tallest, then trim it.
        padded = pad_sequence(slab_BTCHW, -2, max(heights)).contiguous()
        gathered = [torch.empty_like(padded) for _ in range(self.world)]
        dist.all_gather(gathered, padded, group=self.group)
        return torch.cat([slab[..., :height, :] for slab, height in zip(gathered, heights, strict=True)], dim=-2)


def _all_gather_dim0(tensor: Tensor, group: dist.ProcessGroup | None) -> Tensor:
    """Every rank's `tensor` stacked along dim 0, as a functional collective (traceable by dynamo)."""
    from torch.distributed import _functional_collectives as funcol

    gather = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor  # renamed after torch 2.11
    # The default group, typed optional for before `init_process_group`: a decode collective runs after it.
    return gather(tensor, 0, group if group is not None else cast(dist.ProcessGroup, dist.group.WORLD))


def _collective_device(group: dist.ProcessGroup | None) -> torch.device:
    # NCCL reduces CUDA tensors only; gloo (tests, CPU runs) CPU tensors.
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _is_row_mixing_conv(module: nn.Module) -> bool:
    # By name: diffusers' classes, without importing diffusers here (the SR K-VAE comes from it).
    return type(module).__name__ == "Kandinsky6SRCausalConv3d" and _height_pad(module) > 0


def _height_pad(module: nn.Module) -> int:
    return cast("Kandinsky6SRCausalConv3d", module).height_pad  # told by its class name (`_is_row_mixing_conv`)


def _is_upsampler(module: nn.Module) -> bool:
    return type(module).__name__ == "Kandinsky6SRUpsample"


def hook_decoder(decoder: nn.Module, exchange: HaloExchange) -> int:
    """Give every row-mixing module of the K-VAE `decoder` its halo rows while `exchange` is sharding; returns how
    many modules. Their causal convolutions read `height_pad` rows each way; the upsamplers one input row (one row
    each way of the 2x grid, i.e. two output rows to cut)."""
    pending = []
    for module in decoder.modules():
        if _is_row_mixing_conv(module):
            rows, scale = _height_pad(module), 1
        elif _is_upsampler(module):
            rows, scale = 1, 2
        else:
            continue
        hooked = getattr(module, _HOOKED_ATTRIBUTE, None)
        if hooked is not None and hooked is not exchange:
            raise RuntimeError("this K-VAE decoder is hooked for another spatial-shard exchange already")
        if hooked is None:
            pending.append((module, rows, scale))
    # dynamo does not guard on the hooks of a module it has traced (skip_nnmodule_hook_guards): hooks added after
    # compilation would be skipped without a word wherever a graph exists already. (`module.compile()` sets
    # _compiled_call_impl: speed/regional_compile.is_compiled; parallel/ does not import speed/.)
    if pending and any(getattr(module, "_compiled_call_impl", None) is not None for module in decoder.modules()):
        raise RuntimeError("hook the K-VAE decoder for the spatial-shard decode before compiling its blocks (the "
                           "engine applies the parallel layout before the speed transforms)")
    for module, rows, scale in pending:
        module.register_forward_pre_hook(_pre_hook(exchange, rows))
        module.register_forward_hook(_post_hook(exchange, rows * scale))
        setattr(module, _HOOKED_ATTRIBUTE, exchange)
        exchange.max_halo = max(exchange.max_halo, rows)
    return len(pending)


def _pre_hook(exchange: HaloExchange, rows: int):
    def extend_input(module: nn.Module, args: tuple) -> tuple | None:
        if not exchange.active:
            return None
        return (exchange.extend(args[0], rows), *args[1:])

    return extend_input


def _post_hook(exchange: HaloExchange, rows: int):
    def crop_output(module: nn.Module, args: tuple, output: Tensor) -> Tensor | None:
        if not exchange.active:
            return None
        return exchange.crop(output, rows)

    return crop_output


def attach_spatial_shard(vae, group: dist.ProcessGroup) -> HaloExchange:
    """Make the SR pipeline decode every tile of `vae` (an `SRVAE`) height-sharded across the ranks of `group`."""
    exchange = HaloExchange(group)
    hook_decoder(vae.model.decoder, exchange)
    setattr(vae, _EXCHANGE_ATTRIBUTE, exchange)
    return exchange


def spatial_shard_of(vae) -> HaloExchange | None:
    exchange = getattr(vae, _EXCHANGE_ATTRIBUTE, None)
    return exchange if exchange is not None and exchange.world > 1 else None


def row_bounds(height: int, world: int) -> list[tuple[int, int]]:
    """`torch.tensor_split`'s slabs of `height` rows over `world` ranks: the first `height % world` get one more."""
    base, extra = divmod(height, world)
    bounds, start = [], 0
    for rank in range(world):
        stop = start + base + (rank < extra)
        bounds.append((start, stop))
        start = stop
    return bounds


def iter_decode_tile_sharded(vae, latent_BCThw: Tensor, exchange: HaloExchange) -> Iterator[Tensor]:
    """`vae.iter_decode_tile(latent)` with the tile's height split over the exchange's ranks: uint8 (B, T_i, 3,
    H, W) per causal segment, the whole tile's rows on every rank. A tile too short for every rank to lend its halo
    rows (fewer latent rows than ranks, with the released 3x3 kernels) is decoded whole on every rank (the
    reference's replicated decode)."""
    height = latent_BCThw.size(3)
    # Decided from the tile's shape alone, so every rank takes the same branch (and makes the same collectives).
    if height // exchange.world < exchange.max_halo:
        yield from vae.iter_decode_tile(latent_BCThw)
        return
    bounds = row_bounds(height, exchange.world)
    start, stop = bounds[exchange.rank]
    factor = vae.spatial_compression_ratio
    heights = [(high - low) * factor for low, high in bounds]
    segments = vae.iter_decode_tile(latent_BCThw[:, :, :, start:stop])
    while True:
        with exchange.sharding():  # only around this slab's own decode: an interleaved replicated tile stays plain
            slab = next(segments, None)
        if slab is None:
            return
        yield exchange.gather_rows(slab, heights)
