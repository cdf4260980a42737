"""Per-head RMSNorm followed by RoPE on interleaved pairs, as one op: a Triton kernel on CUDA, the reference math
elsewhere.

Why a kernel: compiled by inductor, the DiT's `rope(norm(q))` runs at 27-41% of a plain copy's bandwidth on the
H200 (0.62 ms per Pro query tensor against 0.24 ms for a copy of its bytes, 0.42 against 0.12 ms for Lite;
`scripts/gpu_qk_norm_rope.py`, docs/benchmarks.md, fourth session): the rotation reads each value's pair partner
with a second, computed-index load after the reduction. This kernel loads a block of whole head rows once, keeps
them in registers for the sum of squares, the scaling and the rotation (pairs separated in registers with
`tl.split`), and writes each row once. Measured on the H200 (fifth session): 0.615 ms per Pro query tensor and
0.267 ms per Lite one, against 0.703 / 0.374 ms for inductor's fused ops in the same run; Lite's compiled DiT
1.377 -> 1.369 s with the same cosine to diffusers. A second, token-major kernel (`_rms_norm_rope_tokens_kernel`)
is faster with 64-wide heads and slower with 128-wide ones (sixth session), so the head dim picks (`kernel_for`).
Part of `--performance-mode speed`
(`k6serve.speed.fused_projections.apply_fused_norm_rope`; `K6SERVE_FUSED_NORM_ROPE=0` turns it off).

Semantics (`rms_norm_rope_reference`, the model's own code path): y = bf16(x * rsqrt(mean(x^2) + eps) * w) in
fp32, rounded to the output dtype (as `nn.RMSNorm` does), then rotated in fp32 by the (L, 1, D/2, 2, 2) table and
rounded again (as `apply_rotary` does). The kernel keeps both rounding points; its sum of squares and
multiply-adds run in another order (a tree sum, fused multiply-adds), so its output differs from eager kernels by
fp32 rounding that the bf16 rounding mostly absorbs (as inductor's fused kernel does too): on the H200 72% of the
outputs equal the eager reference bit for bit and the rest are 1 bf16 ulp off (ptxas contracts more multiply-adds
than Triton's interpreter, where >99% are equal).

Shape legend: B batch, L tokens, H heads, D head dim, F = D/2 frequency pairs.
"""

from __future__ import annotations

import os

import torch
from torch import Tensor

from k6serve.models.common.rope import apply_rotary

try:  # the CPU wheel ships without triton; CUDA builds of torch depend on it
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the installation
    triton = None


def rms_norm_rope_reference(
    x_BLHD: Tensor, weight_D: Tensor | None, eps: float, rope_L1F22: Tensor, norm_dtype: torch.dtype
) -> Tensor:
    """The unfused computation: `nn.RMSNorm` on `x` cast to `norm_dtype`, back to x's dtype, then `apply_rotary`."""
    normed = torch.rms_norm(x_BLHD.to(norm_dtype), (x_BLHD.shape[-1],), weight_D, eps).to(x_BLHD.dtype)
    return apply_rotary(normed, rope_L1F22)


def default_eps(eps: float | None, dtype: torch.dtype) -> float:
    """The eps `torch.rms_norm` uses when given None: its compute type's machine epsilon (fp32 for bf16/fp16 inputs,
    not the input dtype's)."""
    if eps is not None:
        return eps
    return torch.finfo(torch.float64 if dtype == torch.float64 else torch.float32).eps


def supports(x_BLHD: Tensor, weight_D: Tensor | None, rope_L1F22: Tensor | None) -> bool:
    """Whether the Triton kernel takes these inputs (else callers use the unfused path)."""
    if triton is None or rope_L1F22 is None or weight_D is None or not x_BLHD.is_cuda:
        return False
    batch, length, _, head_dim = x_BLHD.shape
    return (
        x_BLHD.dtype == torch.bfloat16  # the kernel rounds to bf16 (`_rounded_to_bf16`)
        and head_dim in (32, 64, 128, 256)
        and x_BLHD.stride(-1) == 1
        and x_BLHD.stride(-2) == head_dim
        and tuple(rope_L1F22.shape) == (length, 1, head_dim // 2, 2, 2)
        and rope_L1F22.dtype == torch.float32
        and weight_D.shape == (head_dim,)
        and weight_D.is_contiguous()
        and rope_L1F22.device == x_BLHD.device
        and batch >= 1
    )


@torch.library.custom_op("k6serve::rms_norm_rope", mutates_args=())
def rms_norm_rope(
    x_BLHD: Tensor, weight_D: Tensor, eps: float, rope_L1F22: Tensor, norm_dtype: torch.dtype, variant: str = ""
) -> Tensor:
    """Fused per-head RMSNorm + RoPE; returns a contiguous (B, L, H, D) tensor in x's dtype. `variant` picks the Triton
    kernel ("rows" / "tokens" / "auto"; "" = $K6SERVE_NORM_ROPE_KERNEL, default "auto": see `kernel_for`). Not named
    `kernel`: inductor lowers a custom op through `FallbackKernel.create(kernel, *args, **kwargs)`, and an op argument
    of that name fails every compiled graph that calls the op (found on the H200; tests/unit/test_rms_norm_rope.py)."""
    if supports(x_BLHD, weight_D, rope_L1F22):
        return launch(x_BLHD, weight_D, eps, rope_L1F22, variant or None)
    return rms_norm_rope_reference(x_BLHD, weight_D, eps, rope_L1F22, norm_dtype).contiguous()


@rms_norm_rope.register_fake
def _(x_BLHD: Tensor, weight_D: Tensor, eps: float, rope_L1F22: Tensor, norm_dtype: torch.dtype,
      variant: str = "") -> Tensor:
    return torch.empty(x_BLHD.shape, dtype=x_BLHD.dtype, device=x_BLHD.device)


def _rows_per_program(head_dim: int) -> int:
    # 2048 values of x per program (16 per thread of 4 warps) and twice that of the fp32 table: enough bytes in
    # flight per SM without spilling registers (an untuned first choice: the GPU run measures it).
    return max(1, 2048 // head_dim)


# Which kernel runs. Measured on the H200 (sixth session, `scripts/gpu_qk_norm_rope.py`, median of 10-call
# samples): with 64-wide heads the token-major kernel wins (Lite Q: 0.164 ms against 0.182 for "rows"; the Lite DiT
# forward 1.361 s without a Triton kernel -> 1.355 s with "tokens", not timed with "rows" in that session), with
# 128-wide heads the row-block kernel does (Pro Q: 0.406 against 0.479 ms).
# So "auto" (the default) picks by head dim; "rows" / "tokens" force one ($K6SERVE_NORM_ROPE_KERNEL, read at
# import) for benchmarks.
KERNEL_ENVIRONMENT_VARIABLE = "K6SERVE_NORM_ROPE_KERNEL"
KERNELS = ("rows", "tokens")
KERNEL = os.environ.get(KERNEL_ENVIRONMENT_VARIABLE, "").strip() or "auto"
if KERNEL not in ("auto", *KERNELS):
    raise ValueError(f"${KERNEL_ENVIRONMENT_VARIABLE} must be one of {('auto', *KERNELS)}, got {KERNEL!r}")
# Head dims up to this run the token-major kernel in "auto" mode.
TOKENS_KERNEL_MAX_HEAD_DIM = 64


def kernel_for(head_dim: int, kernel: str | None = None) -> str:
    """The kernel that runs for `head_dim`: `kernel` if given, else $K6SERVE_NORM_ROPE_KERNEL, where "auto" means
    "tokens" up to 64-wide heads and "rows" above."""
    choice = kernel or KERNEL
    if choice == "auto":
        return "tokens" if head_dim <= TOKENS_KERNEL_MAX_HEAD_DIM else "rows"
    if choice not in KERNELS:
        raise ValueError(f"kernel must be one of {('auto', *KERNELS)}, got {choice!r}")
    return choice


def _heads_per_program(head_dim: int, num_heads: int) -> int:
    # 2048 values per program, 8 per thread of 8 warps (one 16-byte load each): no shared memory and no barrier in
    # the sm_90 code (tests/unit/test_rms_norm_rope.py); fewer heads when the model has fewer.
    return min(max(1, 2048 // head_dim), triton.next_power_of_2(num_heads))


def launch(x_BLHD: Tensor, weight_D: Tensor, eps: float, rope_L1F22: Tensor, kernel: str | None = None) -> Tensor:
    """Run the Triton kernel `kernel_for(head_dim, kernel)` on CUDA tensors, or on CPU tensors under
    TRITON_INTERPRET=1, as the tests do."""
    assert triton is not None, "triton is not installed"
    batch, length, num_heads, head_dim = x_BLHD.shape
    kernel = kernel_for(head_dim, kernel)
    out_BLHD = torch.empty((batch, length, num_heads, head_dim), dtype=x_BLHD.dtype, device=x_BLHD.device)
    rope = rope_L1F22.contiguous()
    if kernel == "tokens":
        heads = _heads_per_program(head_dim, num_heads)
        _rms_norm_rope_tokens_kernel[(batch * length, triton.cdiv(num_heads, heads))](
            x_BLHD, weight_D, rope, out_BLHD,
            length, num_heads,
            x_BLHD.stride(0), x_BLHD.stride(1),
            eps,
            HEAD_DIM=head_dim, HEADS=heads,
            num_warps=8,
        )
        return out_BLHD
    rows = batch * length * num_heads
    rows_per_program = _rows_per_program(head_dim)
    grid = (triton.cdiv(rows, rows_per_program),)
    _rms_norm_rope_kernel[grid](
        x_BLHD, weight_D, rope, out_BLHD,
        rows, length, num_heads,
        x_BLHD.stride(0), x_BLHD.stride(1),
        eps,
        HEAD_DIM=head_dim, ROWS=rows_per_program,
        num_warps=4,
    )
    return out_BLHD


if triton is not None:

    @triton.jit
    def _rounded_to_bf16(x):
        """fp32 -> the nearest bf16 value (ties to even), kept in fp32. Written out in integer ops because Triton's
        interpreter, which runs this kernel in the CPU tests, truncates on a cast (the GPU rounds to nearest);
        the later cast to bf16 is then exact on both. NaN passes through unchanged."""
        bits = x.to(tl.int32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
        return tl.where(x != x, x, bits.to(tl.float32, bitcast=True))  # noqa: PLR0124 - the NaN test

    # The counts change with every prompt length (text attention) and resolution; specialising on them (Triton's
    # "divisible by 16" / "== 1" variants) would compile new variants inside requests. Strides stay specialised:
    # their alignment lets the loads vectorise.
    @triton.jit(do_not_specialize=["rows", "length", "num_heads"])
    def _rms_norm_rope_kernel(
        x_ptr, weight_ptr, rope_ptr, out_ptr,
        rows, length, num_heads,
        x_batch_stride, x_token_stride,
        eps,
        HEAD_DIM: tl.constexpr, ROWS: tl.constexpr,
    ):
        """One program: ROWS head rows (row = (b, l, h), h fastest) of HEAD_DIM values each."""
        PAIRS: tl.constexpr = HEAD_DIM // 2
        row = tl.program_id(0) * ROWS + tl.arange(0, ROWS)  # (ROWS,)
        row_ok = row < rows
        head = row % num_heads
        token = (row // num_heads) % length
        batch = row // (num_heads * length)
        column = tl.arange(0, HEAD_DIM)  # (HEAD_DIM,)
        source = batch.to(tl.int64) * x_batch_stride + token.to(tl.int64) * x_token_stride + head * HEAD_DIM
        mask = row_ok[:, None]
        x = tl.load(x_ptr + source[:, None] + column[None, :], mask=mask, other=0.0).to(tl.float32)

        # RMSNorm in fp32, rounded to the output dtype as nn.RMSNorm's result is.
        mean_square = tl.sum(x * x, axis=1) / HEAD_DIM
        inverse_rms = 1.0 / tl.sqrt(mean_square + eps)
        weight = tl.load(weight_ptr + column).to(tl.float32)
        normed = _rounded_to_bf16((x * inverse_rms[:, None]) * weight[None, :])

        # The table row of each token: (F, 2, 2) = [[r00, r01], [r10, r11]] per pair; out = r @ (x0, x1).
        entry = tl.arange(0, 4 * PAIRS)
        table = tl.load(rope_ptr + token.to(tl.int64)[:, None] * (4 * PAIRS) + entry[None, :], mask=mask, other=0.0)
        table = tl.reshape(table, (ROWS, PAIRS, 2, 2))
        first_column, second_column = tl.split(table)  # r[:, :, :, 0] and r[:, :, :, 1]: (ROWS, F, 2)
        r00, r10 = tl.split(first_column)
        r01, r11 = tl.split(second_column)
        x0, x1 = tl.split(tl.reshape(normed, (ROWS, PAIRS, 2)))
        rotated = tl.join(r00 * x0 + r01 * x1, r10 * x0 + r11 * x1)  # (ROWS, F, 2)
        out = _rounded_to_bf16(tl.reshape(rotated, (ROWS, HEAD_DIM))).to(tl.bfloat16)
        destination = row.to(tl.int64)[:, None] * HEAD_DIM + column[None, :]
        tl.store(out_ptr + destination, out, mask=mask)

    @triton.jit(do_not_specialize=["length", "num_heads"])
    def _rms_norm_rope_tokens_kernel(
        x_ptr, weight_ptr, rope_ptr, out_ptr,
        length, num_heads,
        x_batch_stride, x_token_stride,
        eps,
        HEAD_DIM: tl.constexpr, HEADS: tl.constexpr,
    ):
        """One program: HEADS heads of one token (grid: tokens x head blocks). The same math and rounding points as
        `_rms_norm_rope_kernel`; what differs is the work split. The token's RoPE rows are loaded once per program
        (the "rows" kernel loads them once per head row) as two HEAD_DIM vectors, diagonal (r00, r11 per pair) and
        off-diagonal (r01, r10), so the rotation is normed * diagonal + partner * off-diagonal with the pair
        partner swapped in registers; one integer division per program instead of three per row."""
        PAIRS: tl.constexpr = HEAD_DIM // 2
        token_index = tl.program_id(0)  # b * length + l
        head = tl.program_id(1) * HEADS + tl.arange(0, HEADS)
        mask = (head < num_heads)[:, None]
        batch = token_index // length
        token = token_index - batch * length
        column = tl.arange(0, HEAD_DIM)
        source = batch.to(tl.int64) * x_batch_stride + token.to(tl.int64) * x_token_stride
        x = tl.load(x_ptr + source + head[:, None] * HEAD_DIM + column[None, :], mask=mask, other=0.0).to(tl.float32)

        mean_square = tl.sum(x * x, axis=1) / HEAD_DIM
        inverse_rms = 1.0 / tl.sqrt(mean_square + eps)
        weight = tl.load(weight_ptr + column).to(tl.float32)
        normed = _rounded_to_bf16((x * inverse_rms[:, None]) * weight[None, :])

        # Table entries of pair i at 4i..4i+3: [r00, r01, r10, r11]; column 2i + odd takes r00 / r11 on the
        # diagonal and r01 / r10 off it: out[2i] = r00 x0 + r01 x1, out[2i+1] = r11 x1 + r10 x0.
        odd = column % 2
        table = rope_ptr + token.to(tl.int64) * (4 * PAIRS) + 4 * (column // 2)
        diagonal = tl.load(table + 3 * odd)
        off_diagonal = tl.load(table + 1 + odd)
        first, second = tl.split(tl.reshape(normed, (HEADS, PAIRS, 2)))
        partner = tl.reshape(tl.join(second, first), (HEADS, HEAD_DIM))
        out = _rounded_to_bf16(normed * diagonal[None, :] + partner * off_diagonal[None, :]).to(tl.bfloat16)
        destination = (token_index.to(tl.int64) * num_heads + head)[:, None] * HEAD_DIM + column[None, :]
        tl.store(out_ptr + destination, out, mask=mask)
