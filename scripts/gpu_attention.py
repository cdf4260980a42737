"""Attention kernels at Kandinsky 6's video self-attention shapes: is anything faster than FA3 on the H200?

The Pro-distill DiT's 5.6 s target sits below what FA3 (`fa3-fwd` 0.0.3, 688 TFLOP/s at 32 x 128 heads) plus
cuBLAS allow (5.60 s with zero other work; docs/benchmarks.md), so the target needs a faster attention kernel.
This times, on one GPU, the video self-attention of one block (B=1, 47,616 tokens; Pro 32 heads x 128, Lite 28 x
64) with every kernel that imports:

  sdpa   torch SDPA, cuDNN first (k6serve's `torch_sdpa` backend)
  fa3    FlashAttention-3 forward from `fa3-fwd` (k6serve's `fa` backend)
  fa4    FlashAttention-4's CuTe-DSL kernels (`flash-attn-4`, JIT-compiled on first call; the op `K6SERVE_FA4`
         runs, at FA4's own tile; its wheels: docs/benchmarks.md, "Next GPU runs")
  fa3 fp8         FA3's e4m3 kernel as the opt-in `fa_fp8` backend calls it: per-head quantization of Q, K, V
                  included (ops/fp8_attention.py)
  fa3 fp8 kernel  the same kernel on inputs quantized beforehand: what the quantization costs on top
  sdpa fp8 inputs SDPA in fp32 on the dequantized e4m3 inputs: the part of the FP8 rows' difference that the
                  input rounding alone causes (the kernel adds its e4m3 rounding of P)
  fa3 splits N    FA3 with its key/value sequence split N ways (`num_splits=N`; k6serve calls FA3 with the default
                  1), for the short-query shapes below

The shapes: the video self-attention (`pro`, `lite`) and the audio-from-video cross-attention (`pro-av`, `lite-av`:
218 audio queries on the 47,616 video keys, the audio stream's heads). At 218 queries FA3 runs B x H x
ceil(218 / tile_m) CTAs, 32 for Pro's 16 heads on the H200's 132 SMs, so most of the GPU idles unless the keys are
split (FA3's own heuristic does that, but only outside torch.compile, which refuses `num_splits <= 0`: a split
count for the compiled blocks has to be chosen ahead, from these rows). About 20 ms per Pro forward is at stake.

and reports ms, TFLOP/s and the largest difference from the first kernel's output (bf16, the same inputs):

    python scripts/gpu_attention.py                               # CUDA, every kernel that imports
    python scripts/gpu_attention.py --fa4-tiles                   # and FA4 at each tile of FA4_TILES
    python scripts/gpu_attention.py --device cpu --tiny           # CPU check of the logic (CI): sdpa only
    python scripts/gpu_attention.py --device cpu --tiny --fa4-tiles   # the tile rows too, "needs CUDA"
    python scripts/gpu_attention.py --shapes pro-av,lite-av --kernels "fa3,fa3 splits 2,fa3 splits 4,fa3 splits 8"

`--fa4-tiles` adds, after the rows above, one row per FA4 forward config listed in `FA4_TILES` for the shape's head
dim (`fa4 128x176 rs ol`: tile_m x tile_n, "rs" P@V with P from registers, "ol" intra-warpgroup overlap; a missing
flag is off), called through `flash_attn.cute.interface._flash_attn_fwd` with that config instead of the one
`_tile_size_fwd_sm90` picks (128 x 128 rs ol for 128-wide heads, 192 x 128 rs ol for 64-wide). Each config compiles
on its first call (untimed; its seconds are the row's `first_call_s`); one that fails to compile or run gets its
error and the next one still runs; the 15 configs add a few minutes (a JIT compile of seconds each, then the
timing, `--repeats` like the other rows; `--repeats 5` halves the timing). It decides two things. At 32 x 128: a
config faster than FA3 (53.79 ms, 691 TFLOP/s in the sixth session; FA4's default 56.00 ms, 663) means the Pro DiT
could run FA4 with that tile (`K6SERVE_FA4_TILES=128:MxN[:FLAGS]`, ops/flash_attention4.py) and come closer to
its 5.6 s target. At 28 x 64: whether FA4 gains anything over its own default (29.82 ms, 545 TFLOP/s; FA3 30.70
ms), which Lite and the SR DiT already run. (A first, shorter sweep at the end of the sixth session found 192 x 128
rs tying FA3 at 32 x 128 and FA4's default best at 28 x 64: docs/benchmarks/2026-11-30-session6/fa4_tiles.md.)

Results: $OUT/attention.json and .md.
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from k6serve.bench.measure import kernel_median_ms, kernel_script_parser, write_kernel_report
from k6serve.ops import fp8_attention

# name -> (query tokens, key tokens, heads, head dim)
SHAPES = {"pro": (47_616, 47_616, 32, 128), "lite": (47_616, 47_616, 28, 64),
          "pro-av": (218, 47_616, 16, 128), "lite-av": (218, 47_616, 14, 64)}
TINY = {"tiny": (96, 96, 4, 16), "tiny-av": (5, 96, 4, 16)}
SPLITS = (2, 4, 8)  # the "fa3 splits N" rows

# `--fa4-tiles`: head dim -> FA4 SM90 forward configs (tile_m, tile_n, mma_pv_is_rs, intra_wg_overlap) to time, the
# default first (the baseline, timed in the same sweep; it reuses the `fa4` row's compiled kernel), then the rest
# most promising first (a config that faults the GPU spoils the CUDA context for the ones after it). What the
# kernel takes (flash_attn/cute/flash_fwd_sm90.py): tile_m / 64 MMA warpgroups, 1 to 3, so tile_m is 64, 128 or
# 192 (256 x 128 cannot run), plus one producer warpgroup: the thread count follows from tile_m (384 or 512),
# whatever `num_threads` says; tile_n a multiple of 8 up to 256 (wgmma N); shared memory Q + 2 stages of K and V
# (+ P when not "rs") within ~227 KB; per-thread accumulators within the register split (216 per MMA thread with 2
# MMA warpgroups, 128 with 3), where "ol" also keeps the bf16 P of the previous block. Sizes and registers below
# are from flash_attn/cute/sm90_config_search.py's model of exactly that; a config over it may still compile (and
# spill), so FA3's own 64-wide choice is listed although the model rejects it. Other head dims take the list of
# the next larger listed one (FA4 also picks by ranges: <= 64, <= 128), the CPU check's 16 that of 64.
FA4_TILES: dict[int, list[tuple[int, int, bool, bool]]] = {
    128: [  # Pro 32 x 128: FA3 691 TFLOP/s, FA4's default 663
        (128, 128, True, True),    # FA4's default (baseline): 160 KB, 160/216 registers
        (128, 176, True, True),    # FA3's C++ choice for non-causal 128-wide heads (hopper/tile_size.h): 208 KB, 196
        (128, 192, True, True),    # the largest N that fits: 224 KB, 208/216 (tight); fewest K/V blocks per Q tile
        (128, 160, True, True),    # between default and FA3's: 192 KB, 184
        (128, 144, True, True),    # the smallest step up from 128: 176 KB, 172
        (128, 176, True, False),   # FA3's tile without the overlap (152 registers): what "ol" is worth at N=176
        (192, 128, True, False),   # 3 MMA warpgroups, fewer K/V reloads: overlapped it needs 160/128 registers
    ],
    64: [  # Lite / SR 28 x 64: FA4's default 545 TFLOP/s, FA3 529
        (192, 128, True, True),    # FA4's default (baseline): 88 KB, 128/128 registers
        (192, 192, False, True),   # FA3's C++ choice for non-causal 64-wide heads (P via smem, overlap); over the
                                   # model's 3-warpgroup registers (176/128): spills or fails, but FA3 runs it
        (128, 192, True, True),    # 2 MMA warpgroups, larger N instead: 112 KB, 176/216
        (192, 192, True, False),   # FA3's tile with P in registers, no overlap: 128/128 registers
        (192, 160, True, False),   # N between: 104 KB, 112/128
        (128, 256, True, False),   # the largest wgmma N: 144 KB, 160/216 (overlapped it would need 224)
        (192, 128, True, False),   # the default tile without the overlap: what "ol" is worth there
        (128, 128, True, True),    # FA4's fallback tile (2 warpgroups, default N): 80 KB, 128/216
    ],
}
FA4_THREADS = 384  # `_flash_attn_fwd`'s default: SM90 ignores it (see above); the same value keeps the compile cache
ERROR_CHARACTERS = 300  # an error's message is cut here (CuTe-DSL compile errors can run to pages)


def _sdpa(query, key, value):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    order = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
    with sdpa_kernel(order, set_priority=True) if query.is_cuda else contextlib.nullcontext():
        return F.scaled_dot_product_attention(*(x.transpose(1, 2) for x in (query, key, value))).transpose(1, 2)


def _fp8_kernel_only(fa3: Callable) -> Callable:
    """FA3's e4m3 kernel on inputs quantized once per input tensor (outside the timed calls after the first)."""
    quantized: dict[tuple[int, ...], list] = {}

    def attention(query, key, value):
        pointers = tuple(x.data_ptr() for x in (query, key, value))
        if pointers not in quantized:
            quantized.clear()
            quantized[pointers] = [fp8_attention.quantize_per_head(x) for x in (query, key, value)]
        (query8, query_descale), (key8, key_descale), (value8, value_descale) = quantized[pointers]
        return fa3(query8, key8, value8, q_descale=query_descale, k_descale=key_descale, v_descale=value_descale)

    return attention


def kernels(device: torch.device) -> dict[str, Callable | str]:
    """name -> attention(q, k, v) on (B, S, H, D) tensors, or the reason it is unavailable."""
    found: dict[str, Callable | str] = {"sdpa": _sdpa}
    emulated = {"sdpa fp8 inputs": lambda q, k, v: fp8_attention.reference_fp8_attention(q, k, v).to(q.dtype)}
    if device.type != "cuda":
        return found | {"fa3": "needs CUDA", "fa4": "needs CUDA", "fa3 fp8": "needs CUDA",
                        "fa3 fp8 kernel": "needs CUDA"} | emulated | split_kernels("needs CUDA")
    from k6serve.ops.attention import _load_fa3

    fa3, reason = _load_fa3()
    found["fa3"] = fa3 if fa3 is not None else reason
    from k6serve.ops import flash_attention4

    fa4, reason = flash_attention4.load()
    found["fa4"] = flash_attention4.fa4_attention if fa4 is not None else reason  # the op $K6SERVE_FA4=1 uses
    if fa3 is None:
        return found | {"fa3 fp8": reason, "fa3 fp8 kernel": reason} | emulated | split_kernels(reason)
    return found | {
        "fa3 fp8": lambda q, k, v: fp8_attention.fp8_attention(fa3, q, k, v),  # what backend "fa_fp8" runs
        "fa3 fp8 kernel": _fp8_kernel_only(fa3),
    } | emulated | split_kernels(fa3)


def split_kernels(fa3: Callable | str) -> dict[str, Callable | str]:
    """"fa3 splits N" -> FA3 with `num_splits=N` for each N of SPLITS, or why FA3 is unavailable."""
    if isinstance(fa3, str):
        return {f"fa3 splits {splits}": fa3 for splits in SPLITS}
    return {f"fa3 splits {splits}": lambda q, k, v, splits=splits: fa3(q, k, v, num_splits=splits)
            for splits in SPLITS}


def fa4_tile_configs(head_dim: int) -> list[tuple[int, int, bool, bool]]:
    """`FA4_TILES`' list for `head_dim`: its own, else that of the next larger listed head dim, else the largest's."""
    larger = [listed for listed in sorted(FA4_TILES) if listed >= head_dim]
    return FA4_TILES[larger[0] if larger else max(FA4_TILES)]


def fa4_tile_name(tile_m: int, tile_n: int, mma_pv_is_rs: bool, intra_wg_overlap: bool) -> str:
    return " ".join(["fa4", f"{tile_m}x{tile_n}"] + ["rs"] * mma_pv_is_rs + ["ol"] * intra_wg_overlap)


def fa4_tile_kernels(device: torch.device, head_dim: int) -> dict[str, Callable | str]:
    """name -> FA4 at one config of `fa4_tile_configs(head_dim)` on (B, S, H, D) tensors, or why it cannot run."""
    configs = fa4_tile_configs(head_dim)
    reason = "needs CUDA" if device.type != "cuda" else ""
    if not reason:
        from k6serve.ops import flash_attention4

        _, reason = flash_attention4.load()
    if not reason:
        try:
            from flash_attn.cute.interface import _flash_attn_fwd
        except Exception as error:  # noqa: BLE001 - reported like any other unavailable kernel
            reason = f"flash-attn-4's _flash_attn_fwd could not be imported ({error_text(error)})"
    if reason:
        return {fa4_tile_name(*config): reason for config in configs}

    def kernel(config):
        tile_m, tile_n, mma_pv_is_rs, intra_wg_overlap = config

        def attention(query, key, value):
            return _flash_attn_fwd(query, key, value, tile_mn=(tile_m, tile_n), mma_pv_is_rs=mma_pv_is_rs,
                                   intra_wg_overlap=intra_wg_overlap, num_threads=FA4_THREADS)[0]  # (out, lse, ...)
        return attention

    return {fa4_tile_name(*config): kernel(config) for config in configs}


def error_text(error: Exception) -> str:
    """`type: message` on one line, cut to `ERROR_CHARACTERS`."""
    text = f"{type(error).__name__}: {' '.join(str(error).split())}"
    return text if len(text) <= ERROR_CHARACTERS else text[:ERROR_CHARACTERS - 3] + "..."


def time_kernels(device: torch.device, shape_name: str, shape: tuple[int, int, int, int], available: dict,
                 repeats: int, reference: torch.Tensor | None = None) -> tuple[list[dict], torch.Tensor | None]:
    """One row per kernel of `available` at `shape`; returns the rows and the reference output (the given one, or
    the first kernel's that ran), which each row's max_abs_difference is measured from."""
    tokens, key_tokens, heads, head_dim = shape
    rows = []
    if not any(callable(kernel) for kernel in available.values()):
        query = key = value = None
    else:  # the same seed, so the same inputs for each call at this shape
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        generator = torch.Generator(device=device).manual_seed(0)
        query, key, value = (torch.randn(1, length, heads, head_dim, device=device, dtype=dtype, generator=generator)
                             for length in (tokens, key_tokens, key_tokens))
    flop = 4 * tokens * key_tokens * heads * head_dim
    for name, kernel in available.items():
        row = {"shape": shape_name, "kernel": name, "tokens": tokens, "key_tokens": key_tokens, "heads": heads,
               "head_dim": head_dim,
               "ms": None, "tflops": None, "max_abs_difference": None, "relative_rms_difference": None,
               "first_call_s": None, "error": None}
        rows.append(row)
        if isinstance(kernel, str):
            row["error"] = kernel
            continue
        try:
            with torch.inference_mode():
                begin = time.perf_counter()
                out = kernel(query, key, value)  # first call: compilation (FA4 JIT) happens here
                if device.type == "cuda":
                    torch.cuda.synchronize(device)  # a failed launch is this kernel's error, not the next one's
                row["first_call_s"] = time.perf_counter() - begin
                out = kernel(query, key, value)
                row["ms"] = kernel_median_ms(functools.partial(kernel, query, key, value), device=device,
                                             repeats=repeats)
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
            row["tflops"] = flop / row["ms"] / 1e9
            if reference is None:
                reference = out.float()
            row["max_abs_difference"] = (out.float() - reference).abs().max().item()
            # ||out - reference|| / ||reference||: the FP8 rows' error in a unit that does not depend on the scale
            row["relative_rms_difference"] = ((out.float() - reference).norm() / reference.norm()).item()
        except Exception as error:  # noqa: BLE001 - recorded; the next kernel still runs
            row["ms"] = row["tflops"] = None
            row["error"] = error_text(error)
        print(f"{shape_name:5s} {name:18s} ms={row['ms']} tflops={row['tflops']} "
              f"max_abs_difference={row['max_abs_difference']} first_call_s={row['first_call_s']} "
              f"error={row['error']}", flush=True)
    return rows, reference


def run(device: torch.device, shapes: dict, repeats: int, fa4_tiles: bool = False,
        only: list[str] | None = None) -> list[dict]:
    """The kernels of `kernels()` (those named in `only`, in its order, when given) at every shape, then
    (`fa4_tiles`) FA4 at every config of `FA4_TILES` at every shape: the sweep comes last, so a config that faults
    the GPU cannot cost the main rows."""
    rows, references = [], {}
    available = kernels(device)
    if only is not None:
        unknown = [name for name in only if name not in available]
        if unknown:
            raise SystemExit(f"--kernels: unknown {unknown}; the kernels are {list(available)}")
        available = {name: available[name] for name in only}
    for shape_name, shape in shapes.items():
        shape_rows, references[shape_name] = time_kernels(device, shape_name, shape, available, repeats)
        rows += shape_rows
    if fa4_tiles:
        for shape_name, shape in shapes.items():
            shape_rows, _ = time_kernels(device, shape_name, shape, fa4_tile_kernels(device, shape[3]), repeats,
                                         reference=references.pop(shape_name))
            rows += shape_rows
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = kernel_script_parser(__doc__.split("\n\n")[0], repeats=10)
    parser.add_argument("--fa4-tiles", action="store_true",
                        help="also time FA4 at each forward tile config of FA4_TILES (see the module docstring)")
    parser.add_argument("--kernels", help="comma-separated kernel names to time, in this order (default: all); the "
                        "first one's output is the reference of the differences, e.g. 'sdpa,fa4'")
    parser.add_argument("--shapes", help=f"comma-separated shapes (default: all of {list(SHAPES)}; with --tiny "
                        f"{list(TINY)})")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    shapes = TINY if args.tiny else SHAPES  # --shapes picks among the shapes of the mode
    if args.shapes:
        names = [name.strip() for name in args.shapes.split(",") if name.strip()]
        if unknown := [name for name in names if name not in shapes]:
            raise SystemExit(f"--shapes: unknown {unknown}; the shapes{' with --tiny' * args.tiny} are {list(shapes)}")
        shapes = {name: shapes[name] for name in names}
    only = [name.strip() for name in args.kernels.split(",") if name.strip()] if args.kernels else None
    rows = run(device, shapes, args.repeats, fa4_tiles=args.fa4_tiles, only=only)
    out = Path(args.out)
    report = write_kernel_report(out, "attention", rows, device)

    def cell(value, spec):
        return "-" if value is None else format(value, spec)

    lines = [f"### attention ({report['device']}, torch {report['torch']})", "",
             "| shape | kernel | ms | TFLOP/s | max abs difference | relative RMS difference | error |",
             "|---|---|---|---|---|---|---|"]
    lines += [f"| {r['shape']} ({r['heads']}x{r['head_dim']}) | {r['kernel']} | {cell(r['ms'], '.3f')} | "
              f"{cell(r['tflops'], '.0f')} | {cell(r['max_abs_difference'], '.3g')} | "
              f"{cell(r['relative_rms_difference'], '.3g')} | "
              f"{(r['error'] or '').replace('|', '/')} |"
              for r in rows]
    (out / "attention.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
