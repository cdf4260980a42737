"""Opt-in FP8 attention: FlashAttention-3's e4m3 forward for the long video attentions (backend "fa_fp8").

Why: with Pro's 128-wide heads the bf16 attention is the DiT's bound. FA3 runs at about 690 TFLOP/s there and no
bf16 kernel that installs offline is faster (FA4's best tile ties it; sixth session, docs/benchmarks.md), so the
Pro forward cannot drop under FA3 + cuBLAS = 5.60 s in bf16. FA3's e4m3 kernel does the same two GEMMs on the
FP8 tensor cores (the FA3 paper reports about 1.2 PFLOP/s at head dim 128 on H100; performance.md §5), and the
fa3-fwd wheel is built with FP8 kept (`FLASHATTENTION_DISABLE_FP8: False`).

What changes numerically: Q, K and V are rounded to e4m3 (3 mantissa bits) with one scale per (batch, head) that maps
the head's largest magnitude to e4m3's 448 (`quantize_per_head`); FA3 multiplies the scores by the Q and K descales and
the output by V's, and it rounds the softmax probabilities to e4m3 for the P @ V GEMM as well. That is lossy: with
unit-normal inputs the e4m3 rounding of Q, K and V alone moves one attention's output by 4.8% (relative RMS, against
0.38% for a whole bf16 attention; tests/unit/test_fp8_attention.py checks the range on the CPU), and scaling finer than
per head would not help (e4m3's relative precision is the same across its range). performance.md §3.1 records Sage-class
attention costing visible quality on real K6 weights.

Measured on one H200 (seventh session, docs/benchmarks.md): at 47,616 tokens the e4m3 kernel takes 40.7 ms at 32 x
128 heads (913 TFLOP/s) against FA3's 54.4 ms in bf16, 47.3 ms with the quantization of Q, K and V; at 28 x 64 24.3
/ 27.1 ms against FA4's 29.9. The Pro-distill DiT forward drops from 5.92 to 5.20 s (1.60x diffusers eager), but its
velocity's cosine to diffusers drops from 0.9997 to 0.941 (video) and 0.872 (audio) on random weights, far from the
0.999 the speed targets hold. So this is never a default and no performance mode turns it on; the user picks
`--attention-backend fa_fp8` knowing that, and the bench's `--fp8-attention` row reports its cosine beside its
speed.

Where it applies: calls that FA3 would run (no key mask, CUDA bf16) with at least `MIN_KEYS` keys: the video
self-attention (47,616 tokens at 512x768x121) and, in the SR DiT, its tile's self-attention. Shorter calls gain
nothing worth their rounding and keep the "fa" path (FA3, or FA4 for 64-wide heads). Head dims FA3's FP8 kernels
are built for: 64, 96, 128, 192, 256.
"""

from __future__ import annotations

import torch
from torch import Tensor

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
MIN_KEYS = 4096
HEAD_DIMS = (64, 96, 128, 192, 256)
# A head that is all zeros would give scale = inf; its values quantize to 0 whatever the (finite) scale.
_MIN_AMAX = 1e-12


def applies(query_BLHD: Tensor, key_BSHD: Tensor) -> bool:
    """Whether an FA3-eligible call takes the FP8 kernel (long enough, a head dim FA3 has FP8 kernels for, and as
    many query as key heads: FA3 takes every descale as (B, key heads), and Q is scaled per query head)."""
    return (
        key_BSHD.shape[1] >= MIN_KEYS
        and query_BLHD.shape[-1] in HEAD_DIMS
        and query_BLHD.shape[2] == key_BSHD.shape[2]
    )


def quantize_per_head(x_BLHD: Tensor) -> tuple[Tensor, Tensor]:
    """(B, L, H, D) -> (e4m3 tensor of the same shape, fp32 descale (B, H)) with x ~= x8 * descale per head.

    The scale maps each (batch, head)'s largest magnitude to 448, so no value saturates and the e4m3 grid's
    relative spacing (2^-3) is used from the top of the range down. Computed in fp32 (bf16 * scale could round to
    just above 448, which e4m3fn has no infinity for)."""
    amax_BH = x_BLHD.abs().amax(dim=(1, 3)).float().clamp_min(_MIN_AMAX)
    scale_BH = FP8_MAX / amax_BH
    x8_BLHD = (x_BLHD.float() * scale_BH[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return x8_BLHD, (amax_BH / FP8_MAX).contiguous()


def fp8_attention(
    fa3_function, query_BLHD: Tensor, key_BSHD: Tensor, value_BSHD: Tensor, *, return_lse: bool = False
):
    """Softmax attention (scale 1/sqrt(D)) through FA3's e4m3 kernel; returns bf16 (B, L, H, D) [and the lse].

    FA3 takes the descales as (B, heads of K/V) fp32 tensors and returns bf16 for e4m3 inputs."""
    query8, query_descale = quantize_per_head(query_BLHD)
    key8, key_descale = quantize_per_head(key_BSHD)
    value8, value_descale = quantize_per_head(value_BSHD)
    return fa3_function(
        query8,
        key8,
        value8,
        q_descale=query_descale,
        k_descale=key_descale,
        v_descale=value_descale,
        return_attn_probs=return_lse,
    )


def reference_fp8_attention(query_BLHD: Tensor, key_BSHD: Tensor, value_BSHD: Tensor) -> Tensor:
    """The math `fp8_attention` asks of the kernel, in fp32 on any device: attention of the dequantized e4m3 inputs
    (without the kernel's own rounding of P). For CPU tests and for judging a kernel's extra error on the GPU."""
    dequantized = []
    for x in (query_BLHD, key_BSHD, value_BSHD):
        x8, descale_BH = quantize_per_head(x)
        dequantized.append(x8.float() * descale_BH[:, None, :, None])
    query, key, value = (x.permute(0, 2, 1, 3) for x in dequantized)
    out_BHLD = torch.nn.functional.scaled_dot_product_attention(query, key, value)
    return out_BHLD.permute(0, 2, 1, 3)
