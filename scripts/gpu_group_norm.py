"""Is the HunyuanVideo VAE's GroupNorm statistics kernel the waste the profile says, and can it go faithfully?

The eager bf16 VAE decode (diffusers' default, the reference of issue 5's "within 1/255" target) spends 2.17 of its
6.71 s in PyTorch's GroupNorm statistics kernel (docs/benchmarks.md, second session), which reduces each (sample,
group) row in one thread block: 32 blocks for 132 SMs. This times, at decoder-sized bf16 inputs and 32 groups:

  native    nn.GroupNorm (eager; what the reference runs)
  split     the same per-element formula as the native kernel (y = x * a + b in fp32, a = rstd * gamma,
            b = -a * mean + beta, one rounding) with fp32 statistics from PyTorch's general reduction (it splits a
            long row across blocks)
  compiled  nn.GroupNorm alone under torch.compile (inductor's split reduction + one fused pass); the rest of the
            decoder would stay eager, so rounding between ops stays eager's

and reports each against native: ms and the largest difference in bf16 units in the last place. Near-equal is
not equal enough on random weights: on CPU the split variant leaves 99.97% of a tiny random VAE's GroupNorm
outputs bit-identical and its decode still moves by 5 uint8 levels (docs/benchmarks.md, "Next GPU runs", item 3),
so this answers which GroupNorm is fastest, for trained weights or an fp32-referenced tolerance:

    python scripts/gpu_group_norm.py                                    # decoder shapes, CUDA
    python scripts/gpu_group_norm.py --device cpu --tiny --backend eager    # CPU check of the logic (CI)

Results: $OUT/group_norm.json and .md.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor, nn

from k6serve.bench.measure import kernel_median_ms, kernel_script_parser, write_kernel_report

# (N, C, T, H, W) GroupNorm inputs of the HunyuanVideo decoder at 512x768, a few frames per framewise chunk.
SHAPES = [(1, 128, 4, 512, 768), (1, 256, 4, 256, 384), (1, 512, 4, 128, 192), (1, 512, 2, 64, 96)]
TINY = [(1, 64, 2, 8, 12), (2, 32, 1, 4, 6)]
GROUPS = 32


def split_statistics_group_norm(x: Tensor, norm: nn.GroupNorm) -> Tensor:
    """GroupNorm with the native CUDA kernel's per-element formula and the statistics from PyTorch's general
    reduction, which splits a long row across thread blocks (the native statistics kernel gives a row one block)."""
    batch, channels = x.shape[:2]
    groups = norm.num_groups
    # fp32 statistics (native_group_norm would return them rounded to bf16); the cast costs one fp32 copy.
    var, mean = torch.var_mean(x.reshape(batch, groups, -1).float(), dim=-1, correction=0)
    rstd = (var + norm.eps).rsqrt()
    gamma = norm.weight.float().view(groups, channels // groups)
    beta = norm.bias.float().view(groups, channels // groups)
    scale = rstd[..., None] * gamma  # (N, G, C/G), as the native kernel's ComputeFusedParams
    shift = -scale * mean[..., None] + beta
    view = (batch, channels) + (1,) * (x.dim() - 2)
    return torch.addcmul(shift.reshape(view), x, scale.reshape(view)).to(x.dtype)


def _ulps(out: Tensor, reference: Tensor) -> int:
    """Largest difference in bf16 units in the last place (same-sign values; 0 for equal tensors)."""
    a, b = out.float(), reference.float()
    spacing = torch.where(b == 0, torch.full_like(b, 2.0**-133), 2.0 ** (torch.floor(torch.log2(b.abs())) - 7))
    return int(((a - b).abs() / spacing).round().max().item())


def run(device: torch.device, shapes: list, backend: str, repeats: int) -> list[dict]:
    rows = []
    for shape in shapes:
        torch.manual_seed(0)
        x = (torch.randn(shape, device=device) * 3 + 1).to(torch.bfloat16)
        norm = nn.GroupNorm(GROUPS, shape[1], eps=1e-6).to(device=device, dtype=torch.bfloat16)
        with torch.no_grad():
            norm.weight.uniform_(0.5, 1.5)
            norm.bias.uniform_(-0.5, 0.5)
        compiled = torch.compile(norm, backend=backend, dynamic=False)
        variants = {
            "native": lambda x=x, norm=norm: norm(x),
            "split": lambda x=x, norm=norm: split_statistics_group_norm(x, norm),
            "compiled": lambda x=x, compiled=compiled: compiled(x),
        }
        with torch.inference_mode():
            reference = variants["native"]()
            for name, fn in variants.items():
                out = fn()
                ms = kernel_median_ms(fn, device=device, repeats=repeats, warmup=2)
                rows.append({"shape": list(shape), "variant": name, "ms": ms,
                             "max_ulps_vs_native": _ulps(out, reference),
                             "equal_share": (out == reference).float().mean().item()})
                print(f"{shape!s:28s} {name:9s} {ms:9.3f} ms  max {rows[-1]['max_ulps_vs_native']} ulp  "
                      f"equal {rows[-1]['equal_share']:.4f}", flush=True)
        torch._dynamo.reset()
    return rows


def main(argv: list[str] | None = None) -> None:
    args = kernel_script_parser(__doc__.split("\n\n")[0], repeats=10, backend=True).parse_args(argv)
    device = torch.device(args.device)
    rows = run(device, TINY if args.tiny else SHAPES, args.backend, args.repeats)
    out = Path(args.out)
    report = write_kernel_report(out, "group_norm", rows, device, backend=args.backend)
    lines = [f"### group_norm ({report['device']}, torch {report['torch']}, {args.backend}, bf16, {GROUPS} groups)",
             "", "| shape | variant | ms | max ulps vs native | equal share |", "|---|---|---|---|---|"]
    lines += [f"| {'x'.join(map(str, r['shape']))} | {r['variant']} | {r['ms']:.3f} | {r['max_ulps_vs_native']} | "
              f"{r['equal_share']:.4f} |" for r in rows]
    (out / "group_norm.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
