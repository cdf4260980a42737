"""Do GEMM epilogues pay for the DiT's elementwise work? A measuring script for one GPU (issue 5).

The compiled Pro DiT spends 0.35 s of a 5.95 s forward in memory-bound elementwise kernels between its GEMMs and
FlashAttention (docs/benchmarks.md, second session). Two of them could ride on cuBLAS instead:

* the FFN's GELU (`gelu(x @ W1.T)`, 75 ms per Pro forward): cuBLASLt's GELU epilogue, reached through
  `torch._addmm_activation(bias, x, W1.T, use_gelu=True)`. That epilogue is the tanh approximation, not the
  model's exact erf GELU, so the script also reports how far its output is from the exact one.
* the gated residual after the FFN (`x + gate * (h @ W2.T)`, in fp32, cast back): with the gate folded into the
  weight (`W2 * gate[:, None]`, once per forward) it is one in-place GEMM `x.addmm_(h, W2g.T)` that reads x as C.

For each it times (CUDA events, median of 20 after warm-up) the current compiled form, the epilogue form (eager and
inside torch.compile, to see whether inductor keeps the cuBLASLt call) and the bare GEMM, at the Pro and Lite
shapes of a 512x768x121 request (47,616 video tokens), and writes `epilogue.json` / `epilogue.md` under `--out`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from pathlib import Path

import torch
import torch.nn.functional as F

SHAPES = {"pro": (4096, 16384), "lite": (1792, 7168)}


def median_ms(fn, repeats: int = 20, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return F.cosine_similarity(a.float().flatten(), b.float().flatten(), dim=0).item()


def gelu_rows(tokens: int, dim: int, inner: int, device: torch.device) -> list[dict]:
    x = torch.randn(tokens, dim, device=device, dtype=torch.bfloat16)
    w1 = (torch.randn(inner, dim, device=device) / dim**0.5).to(torch.bfloat16)
    zero_bias = torch.zeros(inner, device=device, dtype=torch.bfloat16)

    def reference(x, w):
        return F.gelu(F.linear(x, w), approximate="none")

    def epilogue(x, w):
        return torch._addmm_activation(zero_bias, x, w.t(), use_gelu=True)

    compiled_reference = torch.compile(reference, dynamic=False)
    compiled_epilogue = torch.compile(epilogue, dynamic=False)
    exact = reference(x, w1)
    tanh = F.gelu(F.linear(x, w1), approximate="tanh")
    fused = epilogue(x, w1)
    rows = [
        {"op": "ffn up + gelu", "form": "bare GEMM (x @ W1.T)", "ms": median_ms(lambda: F.linear(x, w1))},
        {"op": "ffn up + gelu", "form": "eager linear + erf gelu", "ms": median_ms(lambda: reference(x, w1))},
        {"op": "ffn up + gelu", "form": "compiled linear + erf gelu", "ms": median_ms(lambda: compiled_reference(x, w1))},
        {
            "op": "ffn up + gelu", "form": "cuBLASLt GELU epilogue, eager", "ms": median_ms(lambda: epilogue(x, w1)),
            "max_abs_vs_exact": (fused.float() - exact.float()).abs().max().item(),
            "cos_vs_exact": cosine(fused, exact),
            "max_abs_vs_tanh": (fused.float() - tanh.float()).abs().max().item(),
        },
        {
            "op": "ffn up + gelu", "form": "cuBLASLt GELU epilogue, compiled",
            "ms": median_ms(lambda: compiled_epilogue(x, w1)),
            "max_abs_vs_exact": (compiled_epilogue(x, w1).float() - exact.float()).abs().max().item(),
        },
    ]
    del exact, tanh, fused
    return rows


def residual_rows(tokens: int, dim: int, inner: int, device: torch.device) -> list[dict]:
    h = torch.randn(tokens, inner, device=device, dtype=torch.bfloat16)
    w2 = (torch.randn(dim, inner, device=device) / inner**0.5).to(torch.bfloat16)
    x0 = torch.randn(tokens, dim, device=device, dtype=torch.bfloat16)
    gate = torch.randn(dim, device=device, dtype=torch.float32) * 0.1

    def reference(x, h, w, gate):
        return (x.float() + gate * F.linear(h, w).float()).to(torch.bfloat16)

    def folded(x, h, w, gate):
        return x.addmm_(h, (w * gate[:, None]).to(torch.bfloat16).t())

    compiled_reference = torch.compile(reference, dynamic=False)
    want = reference(x0, h, w2, gate)
    got = folded(x0.clone(), h, w2, gate)
    x = x0.clone()
    rows = [
        {"op": "ffn down + gated residual", "form": "bare GEMM (h @ W2.T)", "ms": median_ms(lambda: F.linear(h, w2))},
        {
            "op": "ffn down + gated residual", "form": "compiled GEMM + fp32 gated sum",
            "ms": median_ms(lambda: compiled_reference(x0, h, w2, gate)),
        },
        {
            # In place on a scratch copy: the values drift over the repeats, which does not change the time.
            "op": "ffn down + gated residual", "form": "gate folded into W2, in-place addmm_",
            "ms": median_ms(lambda: folded(x, h, w2, gate)),
            "max_abs_vs_reference": (got.float() - want.float()).abs().max().item(),
            "cos_vs_reference": cosine(got, want),
        },
    ]
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "out")))
    parser.add_argument("--tokens", type=int, default=47616)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    device = torch.device("cuda")
    rows = []
    for model, (dim, inner) in SHAPES.items():
        for row in gelu_rows(args.tokens, dim, inner, device) + residual_rows(args.tokens, dim, inner, device):
            rows.append({"model": model, **row})
            print(rows[-1], flush=True)
        torch.cuda.empty_cache()
    report = {
        "commit": os.environ.get("K6SERVE_COMMIT", ""),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "device": torch.cuda.get_device_name(),
        "tokens": args.tokens,
        "rows": rows,
    }
    (args.out / "epilogue.json").write_text(json.dumps(report, indent=2))
    lines = ["| model | op | form | ms | accuracy |", "|---|---|---|---|---|"]
    for row in rows:
        extra = ", ".join(f"{k} {v:.3g}" for k, v in row.items() if k not in ("model", "op", "form", "ms"))
        lines.append(f"| {row['model']} | {row['op']} | {row['form']} | {row['ms']:.3f} | {extra} |")
    (args.out / "epilogue.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
