"""Attention kernels at Kandinsky 6's video self-attention shapes: is anything faster than FA3 on the H200?

The Pro-distill DiT's 5.6 s target sits below what FA3 (`fa3-fwd` 0.0.3, 688 TFLOP/s at 32 x 128 heads) plus
cuBLAS allow (5.60 s with zero other work; docs/benchmarks.md), so the target needs a faster attention kernel.
This times, on one GPU, the video self-attention of one block (B=1, 47,616 tokens; Pro 32 heads x 128, Lite 28 x
64) with every kernel that imports:

  sdpa   torch SDPA, cuDNN first (k6serve's `torch_sdpa` backend)
  fa3    FlashAttention-3 forward from `fa3-fwd` (k6serve's `fa` backend)
  fa4    FlashAttention-4's CuTe-DSL kernels (`flash-attn-4`, JIT-compiled on first call; SM90 path unmeasured so
         far; its wheels: docs/benchmarks.md, "Next GPU runs")

and reports ms, TFLOP/s and the largest difference from the first kernel's output (bf16, the same inputs):

    python scripts/gpu_attention.py                               # CUDA, every kernel that imports
    python scripts/gpu_attention.py --device cpu --tiny           # CPU check of the logic (CI): sdpa only

Results: $OUT/attention.json and .md.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from k6serve.bench.measure import kernel_median_ms, kernel_script_parser, write_kernel_report

SHAPES = {"pro": (47_616, 32, 128), "lite": (47_616, 28, 64)}
TINY = {"tiny": (96, 4, 16)}


def _sdpa(query, key, value):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    order = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
    with sdpa_kernel(order, set_priority=True) if query.is_cuda else contextlib.nullcontext():
        return F.scaled_dot_product_attention(*(x.transpose(1, 2) for x in (query, key, value))).transpose(1, 2)


def kernels(device: torch.device) -> dict[str, Callable | str]:
    """name -> attention(q, k, v) on (B, S, H, D) tensors, or the reason it is unavailable."""
    found: dict[str, Callable | str] = {"sdpa": _sdpa}
    if device.type != "cuda":
        return found | {"fa3": "needs CUDA", "fa4": "needs CUDA"}
    from k6serve.ops.attention import _load_fa3

    fa3, reason = _load_fa3()
    found["fa3"] = fa3 if fa3 is not None else reason
    from k6serve.ops import flash_attention4

    fa4, reason = flash_attention4.load()
    found["fa4"] = flash_attention4.fa4_attention if fa4 is not None else reason  # the op $K6SERVE_FA4=1 uses
    return found


def run(device: torch.device, shapes: dict, repeats: int) -> list[dict]:
    rows = []
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    available = kernels(device)
    for shape_name, (tokens, heads, head_dim) in shapes.items():
        generator = torch.Generator(device=device).manual_seed(0)
        query, key, value = (torch.randn(1, tokens, heads, head_dim, device=device, dtype=dtype, generator=generator)
                             for _ in range(3))
        flop = 4 * tokens * tokens * heads * head_dim
        reference = None
        for name, kernel in available.items():
            row = {"shape": shape_name, "kernel": name, "tokens": tokens, "heads": heads, "head_dim": head_dim,
                   "ms": None, "tflops": None, "max_abs_difference": None, "error": None}
            rows.append(row)
            if isinstance(kernel, str):
                row["error"] = kernel
                continue
            try:
                with torch.inference_mode():
                    out = kernel(query, key, value)  # first call: compilation (FA4 JIT) happens here
                    out = kernel(query, key, value)
                    row["ms"] = kernel_median_ms(lambda kernel=kernel, qkv=(query, key, value): kernel(*qkv),
                                                 device=device, repeats=repeats)
                row["tflops"] = flop / row["ms"] / 1e9
                if reference is None:
                    reference = out.float()
                row["max_abs_difference"] = (out.float() - reference).abs().max().item()
            except Exception as error:  # noqa: BLE001 - recorded; the next kernel still runs
                row["error"] = f"{type(error).__name__}: {error}"
            print(f"{shape_name:5s} {name:5s} ms={row['ms']} tflops={row['tflops']} "
                  f"max_abs_difference={row['max_abs_difference']} error={row['error']}", flush=True)
    return rows


def main(argv: list[str] | None = None) -> None:
    args = kernel_script_parser(__doc__.split("\n\n")[0], repeats=10).parse_args(argv)
    device = torch.device(args.device)
    rows = run(device, TINY if args.tiny else SHAPES, args.repeats)
    out = Path(args.out)
    report = write_kernel_report(out, "attention", rows, device)

    def cell(value, spec):
        return "-" if value is None else format(value, spec)

    lines = [f"### attention ({report['device']}, torch {report['torch']})", "",
             "| shape | kernel | ms | TFLOP/s | max abs difference | error |", "|---|---|---|---|---|---|"]
    lines += [f"| {r['shape']} ({r['heads']}x{r['head_dim']}) | {r['kernel']} | {cell(r['ms'], '.3f')} | "
              f"{cell(r['tflops'], '.0f')} | {cell(r['max_abs_difference'], '.3g')} | {r['error'] or ''} |"
              for r in rows]
    (out / "attention.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
