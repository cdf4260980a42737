"""FlashAttention-4 (`flash-attn-4`, CuTe-DSL kernels, JIT-compiled on first use) in place of FA3 (experimental).

Why: the Pro-distill DiT's 5.6 s target is below FA3 + cuBLAS alone (5.60 s; FA3 runs the video self-attention
at 688 TFLOP/s on the H200, docs/benchmarks.md), so only a faster attention kernel can reach it. FA4 ships an SM90
forward kernel that had not been measured at K6's shapes; `scripts/gpu_attention.py` times it beside FA3. With
`K6SERVE_FA4=1` (read at import), every call that would run FA3 (backend "fa", no key mask, CUDA bf16) runs FA4
instead, so the DiT benchmarks can measure it without code changes. The same math (softmax attention, scale
1/sqrt(D)); only the kernel, and so the rounding, differs.

The call goes through the custom op `k6serve::fa4_attention`, so a compiled block keeps one graph around it
(dynamo does not trace into FA4's Python launcher or its JIT).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable

import torch
from torch import Tensor

ENVIRONMENT_VARIABLE = "K6SERVE_FA4"
ENABLED = os.environ.get(ENVIRONMENT_VARIABLE, "").strip() == "1"


@functools.cache
def load() -> tuple[Callable[..., object] | None, str]:
    """FA4's `flash_attn_func` once; (function, "") or (None, why it could not be imported)."""
    try:
        from flash_attn.cute.interface import flash_attn_func
    except Exception as error:  # noqa: BLE001 - any import failure (missing wheel, CUDA libs) is reported alike
        return None, f"flash-attn-4 could not be imported ({type(error).__name__}: {error})"
    return flash_attn_func, ""


@torch.library.custom_op("k6serve::fa4_attention", mutates_args=())
def fa4_attention(query_BLHD: Tensor, key_BSHD: Tensor, value_BSHD: Tensor) -> Tensor:
    """Softmax attention with scale 1/sqrt(D) by FA4; (B, L, H, D) in, (B, L, H, D) out."""
    function, reason = load()
    if function is None:
        raise ValueError(
            f"{ENVIRONMENT_VARIABLE}=1 asks for FlashAttention-4 but {reason}; install flash-attn-4 (with "
            f"nvidia-cutlass-dsl[cu13]) or unset {ENVIRONMENT_VARIABLE} to run FA3"
        )
    out = function(query_BLHD, key_BSHD, value_BSHD)
    return (out[0] if isinstance(out, tuple) else out).contiguous()  # FA4 returns (out, lse)


@fa4_attention.register_fake
def _(query_BLHD: Tensor, key_BSHD: Tensor, value_BSHD: Tensor) -> Tensor:
    return query_BLHD.new_empty((*query_BLHD.shape[:-1], value_BSHD.shape[-1]))
