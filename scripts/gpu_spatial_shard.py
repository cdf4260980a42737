"""One rank's share of the spatial-shard SR decode, on one GPU: the compute of a height slab with its halo rows.

    python3 scripts/gpu_spatial_shard.py --out $OUT [--compiled] [--tiny]

A real spatial-shard decode needs a replica of several GPUs (`--vae-config.parallel-decode-mode spatial_shard`,
parallel/spatial_shard_decode.py). With one GPU this measures what each rank computes: the released K-VAE's decode
of one 512x768x121 output tile (latent 32 x 48), whole, then as the slab of rank 0 of 2 (16 latent rows, halo rows
below) and of rank 1 of 4 (8 rows, halo rows on both sides). The hooks of the real decode run, but the halo rows are
zeros appended locally (the same shapes, so the same work) instead of an all-gather: no communication is timed
(about 70 all-gathers of 2 rows per segment on NVLink), and the frames are not meant to match. `--compiled` adds
the compiled decoder of `--compile-vae true` (its rewrites and blocks, the halo rows traced into their graphs).
Median of `--repeats` warm runs. Writes <out>/spatial_shard.json and .md. `--tiny`: the tiny K-VAE on the CPU.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from contextlib import nullcontext
from pathlib import Path

import torch

from k6serve.bench.measure import measure
from k6serve.bench.report import environment
from k6serve.parallel.spatial_shard_decode import HaloExchange, hook_decoder, row_bounds


class LocalHalo(HaloExchange):
    """The exchange of rank `rank` of `world` without a process group: halo rows are zeros of the right shape."""

    def __init__(self) -> None:  # no group: set per slab by `as_rank`
        self.group, self.rank, self.world, self.active, self.max_halo = None, 0, 1, False, 1

    def as_rank(self, rank: int, world: int) -> LocalHalo:
        self.rank, self.world = rank, world
        return self

    def extend(self, x_BCTHW: torch.Tensor, rows: int) -> torch.Tensor:
        zeros = x_BCTHW.new_zeros((*x_BCTHW.shape[:3], rows, x_BCTHW.size(4)))
        parts = ([zeros] if self.has_above else []) + [x_BCTHW] + ([zeros] if self.has_below else [])
        extended = torch.cat(parts, dim=3)
        if x_BCTHW.is_contiguous(memory_format=torch.channels_last_3d) and not x_BCTHW.is_contiguous():
            extended = extended.contiguous(memory_format=torch.channels_last_3d)
        return extended


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--compiled", action="store_true")
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--slabs", default="whole,r0of2,r1of4",
                        help="comma-separated: whole (the tile), r0of2, r1of4; one process per compiled slab keeps "
                             "dynamo's variants per block under its limit, as on a real rank")
    parser.add_argument("--skip-eager", action="store_true")
    args = parser.parse_args(argv)
    from k6serve.models.kandinsky6_sr.checkpoint import build_dummy_sr_models, read_sr_configs, released_sr_configs
    from k6serve.models.variants import VARIANTS

    device = torch.device("cpu" if args.tiny else "cuda")
    dtype = torch.float32 if args.tiny else torch.bfloat16
    variant = VARIANTS["vsr-distilled2steps"]
    if args.tiny:
        from k6serve.testing.tiny_sr_checkpoint import build_sr_checkpoint

        with tempfile.TemporaryDirectory() as folder:
            configs = read_sr_configs(build_sr_checkpoint(folder))
        latent_size, frames, repeats = (8, 6), 9, 1
    else:
        configs = released_sr_configs(variant)
        latent_size, frames, repeats = (32, 48), 121, args.repeats
    models = build_dummy_sr_models(configs, variant, device=device, dtype=dtype)
    del models.transformer
    vae = models.vae
    latent = torch.randn(1, configs.vae.latent_channels, (frames - 1) // 4 + 1, *latent_size,
                         generator=torch.Generator().manual_seed(0)).to(device=device, dtype=dtype)
    halo = LocalHalo()
    hooked = hook_decoder(vae.model.decoder, halo)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report: dict = {"environment": environment(), "argv": sys.argv[1:] if argv is None else argv,
                    "latent": list(latent.shape), "hooked_modules": hooked, "rows": []}
    lines = ["# spatial-shard decode, one rank's compute (zeros for halo rows, no communication)", "",
             "| decoder | slab | latent rows | first call s | warm s (median) | x whole tile |", "|---|---|---|---|---|---|"]

    def write() -> None:
        (out / "spatial_shard.json").write_text(json.dumps(report, indent=2, default=str))
        (out / "spatial_shard.md").write_text("\n".join(lines) + "\n")

    slabs = {"whole": ("whole tile", 0, 1), "r0of2": ("rank 0 of 2", 0, 2), "r1of4": ("rank 1 of 4", 1, 4)}
    chosen = [slabs[name] for name in args.slabs.split(",")]

    def measure_slabs(decoder_name: str) -> None:
        whole = None
        for name, rank, world in chosen:
            start, stop = row_bounds(latent.size(3), world)[rank]
            slab = latent[:, :, :, start:stop]
            halo.as_rank(rank, world)

            def call() -> torch.Tensor:
                with halo.sharding() if world > 1 else nullcontext():
                    return vae.decode_tile(slab)

            with torch.inference_mode():
                first = measure(call, device=device, repeats=1, warmup=0).times_s[0]  # compiles, when compiled
                timed = measure(call, device=device, repeats=repeats, warmup=0)
            warm, times = statistics.median(timed.times_s), list(timed.times_s)
            whole = warm if world == 1 else whole
            ratio = warm / whole if whole else None
            row = {"decoder": decoder_name, "slab": name, "latent_rows": stop - start, "first_s": first,
                   "warm_s": warm, "times": times, "x_whole": ratio}
            report["rows"].append(row)
            lines.append(f"| {decoder_name} | {name} | {stop - start} | {first:.2f} | {warm:.3f} | "
                         f"{'-' if ratio is None else f'{ratio:.3f}'} |")
            print(lines[-1], flush=True)
            write()

    torch.backends.cudnn.benchmark = device.type == "cuda"
    if not args.skip_eager:
        measure_slabs("eager")
    if args.compiled:
        from k6serve.speed.vae import apply_vae_speedups, compile_sr_decoder_blocks

        if device.type == "cuda":
            report["speedups"] = apply_vae_speedups(vae.model, device, compile_decoder=True)
        else:  # the same rewrites and compiled blocks, traced by dynamo's eager backend
            from k6serve.speed.kvae_causal_conv import apply_single_causal_conv
            from k6serve.speed.kvae_spatial_norm import apply_commuted_spatial_norms
            from k6serve.speed.kvae_upsample import apply_subpixel_upsample

            for rewrite in (apply_commuted_spatial_norms, apply_subpixel_upsample, apply_single_causal_conv):
                rewrite(vae.model.decoder)
            compile_sr_decoder_blocks(vae.model, backend="eager")
        measure_slabs("compiled")
    write()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
