"""Experimental: part of FlashAttention-4's SM90 softmax exponentials computed on the FMA units.

Why: with 64-wide heads (Lite, the SR DiT) the attention kernel is bound by the exponentials, not the tensor
cores. At 47,616 tokens x 28 heads one attention evaluates 63.5 G exponentials; the H200's MUFU units do 16 per
clock per SM (132 SMs, 1.98 GHz: 15.2 ms), about what the tensor cores need for the two GEMMs (16.2 TFLOP at
989 TFLOP/s: 16.4 ms), and FA4 takes 29.4 ms because the two do not fully overlap. The FMA pipe does 128 fp32
operations per clock per SM, and a degree-3 polynomial exp2 (FA4's own `utils.ex2_emulation`, Cody-Waite range
reduction, which FA4's SM100 kernels already use for a share of their exponentials) costs about six of them, so
moving a share of the exponentials there can raise the softmax throughput. FA4's SM90 kernel has no such option;
this replaces `Softmax.online_softmax` (flash_attn/cute/softmax.py, 4.0.0b36), which the SM90 forward kernel calls
once per KV block, with a copy that, in every group of FREQ consecutive elements of the thread's share of a row
(each of 4 threads holds tile_n / 4 = 32 scores of a row with FA4's SM90 tiles; hence FREQ <= 32), computes the
last RES with the polynomial. Everything else is the original method line for line.

Numerics: the polynomial's relative error is about 1e-4 (FA4's choice for SM100), below the bf16 rounding of P
(4e-3) that follows. Inputs at or below -127 (after the row max is subtracted), -inf included, come out as exactly
0 (the clamp to -127 leaves a zero exponent field under the polynomial's 1.0): FA4 sets the columns past the key
length in a partial last KV block to -inf, and those still weigh nothing. `flash_attention4.probe` checks each head
dim against SDPA before FA4 serves a request.

Opt-in and unmeasured: `K6SERVE_FA4_EX2_EMULATION=FREQ:RES` (e.g. "8:3"), applied when FA4 is imported, before its
first kernel is compiled (FA4 caches compiled kernels in-process by a key that does not see this patch, and its
on-disk cache, off by default, keys on FA4's own sources only: do not enable `FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED`
with it). The balance point is estimated at about 40% emulated (MUFU at 16 per clock against the FMA pipe's 128
shared with the softmax's own scale, sum and conversion), so "8:3" and "16:7" are the first to time
(docs/benchmarks.md, "Next GPU runs").
"""

from __future__ import annotations

import os

ENVIRONMENT_VARIABLE = "K6SERVE_FA4_EX2_EMULATION"


def parse(text: str) -> tuple[int, int] | None:
    """"FREQ:RES" -> (FREQ, RES) with 0 < RES < FREQ; "" -> None; a ValueError saying the format otherwise."""
    text = text.strip()
    if not text:
        return None
    freq, _, res = text.partition(":")
    if not (freq.isdigit() and res.isdigit() and 0 < int(res) < int(freq) <= 32):
        raise ValueError(
            f"${ENVIRONMENT_VARIABLE} takes FREQ:RES with 0 < RES < FREQ <= 32 (in every FREQ consecutive scores of "
            f"a thread's share of a row, the last RES get the polynomial exp2), e.g. '8:3'; got {text!r}"
        )
    return int(freq), int(res)


SETTING = parse(os.environ.get(ENVIRONMENT_VARIABLE, ""))


def apply(freq: int, res: int) -> None:  # pragma: no cover - needs flash-attn-4 (CUDA 13 cutlass-dsl, Python 3.12)
    """Replace FA4's `Softmax.online_softmax` with the partly emulated copy; before FA4 compiles any kernel. The
    kernel code lives in `fa4_exp2_softmax` (imported here: it needs cutlass at import), at module level, because
    the CuTe DSL rewrites a `@cute.jit` function from its source and resolves names in the module's globals."""
    from flash_attn.cute.softmax import Softmax

    from k6serve.ops import fa4_exp2_softmax

    fa4_exp2_softmax.FREQ, fa4_exp2_softmax.RES = freq, res
    Softmax.online_softmax = fa4_exp2_softmax.online_softmax
