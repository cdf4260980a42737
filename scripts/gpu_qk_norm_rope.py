"""Where the compiled per-head RMSNorm + RoPE of Q and K loses its time (one H200, one command, ~2 minutes).

The kernel profile of a compiled Pro-distill forward (docs/benchmarks.md, second session) shows the fused
RMSNorm + RoPE kernels of Q and K at 1.12 and 0.68 ms per call, i.e. 0.7 TB/s for a pass that reads and writes
the Q tensor once (~0.8 GB at Pro's 47,616 tokens x 32 heads x 128): four times under the H200's bandwidth.
This times, each compiled alone with inductor at the DiT's shapes, the exact code the DiT runs and the pieces it
is made of, against a plain copy of the same bytes, so the next change goes where the time is:

    python scripts/gpu_qk_norm_rope.py                 # Pro and Lite shapes, CUDA
    python scripts/gpu_qk_norm_rope.py --device cpu --tiny --backend eager   # CPU check of the logic (CI)

Variants (input: Q as the query slice of a fused QKV projection output, as in `--performance-mode speed`):
  copy            Q slice -> contiguous (the bandwidth yardstick)
  norm            nn.RMSNorm per head
  rope            apply_rotary (fp32 rotation of interleaved pairs)
  norm_rope       both: the DiT's `_query_heads`
  norm_rope_contiguous  both, Q already contiguous (no fused-QKV stride)
  norm_rope_swap  both, RoPE written as x * own + swap_pairs(x) * partner over full-width fp32 tables
  triton_kernel   k6serve's fused Triton kernel, row blocks (`k6serve.ops.rms_norm_rope`, "rows": the default
                  above 64-wide heads; the reference math off CUDA)
  triton_kernel_tokens  its token-major variant ("tokens": the default up to 64-wide heads)
Results: $OUT/qk_norm_rope.json and .md (median ms of 20 calls, effective GB/s of the bytes read and written).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from k6serve.bench.measure import kernel_median_ms, kernel_script_parser, write_kernel_report
from k6serve.models.common.rope import RotaryEmbedding3D, apply_rotary
from k6serve.ops.rms_norm_rope import default_eps, rms_norm_rope

# (name, tokens as a (T, H, W) latent grid, heads, head_dim, RoPE axes dims): 512x768x121 after patching.
SHAPES = {
    "pro": ((31, 32, 48), 32, 128, (32, 48, 48)),
    "lite": ((31, 32, 48), 28, 64, (16, 24, 24)),
}
TINY = {"tiny": ((2, 4, 6), 4, 16, (4, 6, 6))}


def _variants(norm: nn.RMSNorm, rope: torch.Tensor, head_dim: int) -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
    cos_sin = _cos_sin(rope)

    def heads(q):
        return q.unflatten(-1, (-1, head_dim))

    return {
        "copy": lambda q: heads(q).contiguous(),
        "norm": lambda q: norm(heads(q)),
        "rope": lambda q: apply_rotary(heads(q), rope),
        "norm_rope": lambda q: apply_rotary(norm(heads(q)), rope),
        "norm_rope_contiguous": lambda q: apply_rotary(norm(heads(q)), rope),
        "norm_rope_swap": lambda q: _rotate_swapped(norm(heads(q)), cos_sin),
        # k6serve's Triton kernel (k6serve/ops/rms_norm_rope.py); the reference math off CUDA.
        "triton_kernel": lambda q: rms_norm_rope(heads(q), norm.weight, default_eps(norm.eps, q.dtype), rope,
                                                 q.dtype, "rows"),
        # The token-major kernel (the default with 64-wide heads; k6serve/ops/rms_norm_rope.py `kernel_for`).
        "triton_kernel_tokens": lambda q: rms_norm_rope(heads(q), norm.weight, default_eps(norm.eps, q.dtype), rope,
                                                        q.dtype, "tokens"),
    }


def _cos_sin(rope: torch.Tensor) -> torch.Tensor:
    """(L, 1, D/2, 2, 2) rotation table -> (2, L, 1, D): per output element its own coefficient of x[j] and of
    its pair partner x[j ^ 1] (cos, then -sin for even j and sin for odd j)."""
    own = torch.stack([rope[..., 0, 0], rope[..., 1, 1]], dim=-1).flatten(-2)
    partner = torch.stack([rope[..., 0, 1], rope[..., 1, 0]], dim=-1).flatten(-2)
    return torch.stack([own, partner])


def _rotate_swapped(x: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor:
    """`apply_rotary` as two full-width products: x * own + swap_pairs(x) * partner, in fp32 (the same
    products and sums as the reference's, in the same order up to commutation)."""
    x32 = x.float()
    swapped = x32.unflatten(-1, (-1, 2)).flip(-1).flatten(-2)
    return (cos_sin[0] * x32 + cos_sin[1] * swapped).to(x.dtype)


def run(device: torch.device, shapes: dict, backend: str, repeats: int) -> list[dict]:
    rows = []
    dtype = torch.bfloat16
    for name, (grid, num_heads, head_dim, axes) in shapes.items():
        torch.manual_seed(0)
        tokens = grid[0] * grid[1] * grid[2]
        width = num_heads * head_dim
        qkv = torch.randn(1, tokens, 3 * width, device=device, dtype=dtype)
        query_slice = qkv[..., :width]
        query_contiguous = query_slice.contiguous()
        norm = nn.RMSNorm(head_dim).to(device=device, dtype=dtype)
        with torch.no_grad():
            norm.weight.uniform_(0.5, 1.5)
        positions = tuple(torch.arange(n, device=device) for n in grid)
        rope = RotaryEmbedding3D(axes)(positions, (1.0, 2.0, 2.0)).reshape(tokens, 1, head_dim // 2, 2, 2)
        reference = None
        for variant, fn in _variants(norm, rope, head_dim).items():
            compiled = torch.compile(fn, backend=backend, dynamic=False)
            source = query_contiguous if variant == "norm_rope_contiguous" else query_slice
            with torch.inference_mode():
                out = compiled(source)
                if variant == "norm_rope":
                    reference = out
                equal = None if reference is None or variant == "norm_rope" else bool(torch.equal(out, reference))
                # How far from the DiT's bits: a rounding-order difference (the Triton kernel's tree sum and fused
                # multiply-adds) flips a few last bf16 bits; a wrong index or mask breaks most values.
                difference = None if equal is None or reference is None else (out.float() - reference.float()).abs()
                ms = kernel_median_ms(lambda: compiled(source), device=device, repeats=repeats,  # noqa: B023
                                      warmup=3)  # (timed before the loop moves on)
            moved = 2 * source.numel() * source.element_size()  # read Q once, write it once
            if variant.startswith(("rope", "norm_rope", "triton")):
                moved += rope.numel() * rope.element_size()
            rows.append({"shape": name, "variant": variant, "tokens": tokens, "heads": num_heads,
                         "head_dim": head_dim, "ms": ms, "gb_per_s": moved / ms / 1e6,
                         "bits_equal_to_norm_rope": equal,
                         "equal_share": None if difference is None else (difference == 0).float().mean().item(),
                         "max_abs_difference": None if difference is None else difference.max().item()})
            print(f"{name:5s} {variant:22s} {ms:8.3f} ms {moved / ms / 1e6:8.1f} GB/s equal={equal} "
                  f"equal_share={rows[-1]['equal_share']} max_abs_difference={rows[-1]['max_abs_difference']}",
                  flush=True)
    return rows


def main(argv: list[str] | None = None) -> None:
    args = kernel_script_parser(__doc__.split("\n\n")[0], repeats=20, backend=True).parse_args(argv)
    device = torch.device(args.device)
    rows = run(device, TINY if args.tiny else SHAPES, args.backend, args.repeats)
    out = Path(args.out)
    report = write_kernel_report(out, "qk_norm_rope", rows, device, backend=args.backend)
    lines = [f"### qk_norm_rope ({report['device']}, torch {report['torch']}, {args.backend})", "",
             "| shape | variant | ms | GB/s | bits equal to norm_rope | equal share | max abs difference |",
             "|---|---|---|---|---|---|---|"]
    lines += [f"| {r['shape']} | {r['variant']} | {r['ms']:.3f} | {r['gb_per_s']:.0f} | "
              f"{'-' if r['bits_equal_to_norm_rope'] is None else r['bits_equal_to_norm_rope']} | "
              f"{'-' if r['equal_share'] is None else format(r['equal_share'], '.6f')} | "
              f"{'-' if r['max_abs_difference'] is None else format(r['max_abs_difference'], '.3g')} |" for r in rows]
    (out / "qk_norm_rope.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
