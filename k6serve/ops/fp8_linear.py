"""FP8 (e4m3) linear layers with row-wise scales: lossy, opt-in, for measuring what FP8 GEMMs buy the DiT.

On an H200 a bf16 GEMM at the Pro DiT's shapes runs at 755-822 TFLOP/s and an e4m3 one at ~1,475
(`../shared/docs/performance.md` §2.3), and the DiT's GEMMs are 2.16 s of its 5.9 s forward (docs/benchmarks.md).
FP8 attention was measured too lossy (velocity cosine 0.94, seventh session); GEMMs quantized per row of the
activations and per output channel of the weights lose far less, since every scale follows one dot product's own
range. Whether that stays within the issue's tolerance (velocity cosine >= 0.999 against diffusers' bf16) is what
`k6serve bench --stage dit --fp8-linears` measures; nothing turns this on by default.

The math of one `Fp8Linear` call, for input rows x_m and weight rows w_n:
    s_m = max|x_m| / 448,  t_n = max|w_n| / 448       (448: e4m3's largest finite value)
    y_mn = s_m * t_n * sum_k e4m3(x_mk / s_m) * e4m3(w_nk / t_n)  (+ bias_n)
accumulated in fp32: on CUDA by `torch._scaled_mm` (cuBLASLt's e4m3 GEMM, compute capability >= 8.9); elsewhere
written out in fp32 (`dequantized_linear`), since torch's CPU `_scaled_mm` takes row-wise scales only from 2.13 on
and we support 2.11. The activation's row maximum and cast are plain tensor ops, so under `torch.compile` inductor
fuses them into the kernel that produces the activation (the LayerNorm + modulation, the GELU).

Besides the bench rows, the engine's `--quantization fp8` (config.py) converts the DiT with these layers.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448.0
# A row of zeros gets this scale instead of 0, so the division stays finite and the row stays exactly 0.
_MIN_SCALE = 1e-12


def quantize_rowwise(x: Tensor) -> tuple[Tensor, Tensor]:
    """(e4m3 values, fp32 scales of shape (rows, 1)) of a 2-D tensor, one scale per row: x ~= values * scales."""
    scale = (x.abs().amax(dim=-1, keepdim=True).float() / FP8_MAX).clamp(min=_MIN_SCALE)
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale


class Fp8Linear(nn.Module):
    """`nn.Linear` with e4m3 weights (one scale per output channel) and e4m3 activations (one scale per row),
    computing in `torch._scaled_mm` with bf16 (or the input's) output. Built from a Linear by `from_linear`; the
    bf16 weight is not kept (the module is for inference, and keeping both would cost the memory the FP8 copy
    saves)."""

    # Registered as buffers (`__init__`), which nn.Module's stubs cannot tell from submodules.
    weight: Tensor
    weight_scale: Tensor
    bias: Tensor | None

    def __init__(self, weight: Tensor, weight_scale: Tensor, bias: Tensor | None, *,
                 fast_accumulation: bool = False) -> None:
        super().__init__()
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        self.register_buffer("weight", weight)  # (out, in) e4m3; `.t()` is the column-major operand cuBLASLt wants
        self.register_buffer("weight_scale", weight_scale)  # (1, out) fp32
        self.register_buffer("bias", bias)
        # cuBLASLt's "fast accumulation" skips the periodic promotion of Hopper's FP8 accumulators to fp32: faster,
        # less exact over long sums (K = 16,384 in the FFN's second GEMM).
        self.fast_accumulation = fast_accumulation

    @classmethod
    def from_linear(cls, linear: nn.Linear, *, fast_accumulation: bool = False) -> "Fp8Linear":
        with torch.no_grad():
            weight, scale = quantize_rowwise(linear.weight.detach())
            bias = None if linear.bias is None else linear.bias.detach().clone()
        return cls(weight, scale.reshape(1, -1).contiguous(), bias, fast_accumulation=fast_accumulation)

    def forward(self, x: Tensor) -> Tensor:
        if x.shape[-1] != self.in_features:
            raise ValueError(f"Fp8Linear expects {self.in_features} input features, got shape {tuple(x.shape)}.")
        if x.device.type != "cuda":
            return dequantized_linear(x, self)
        rows = x.reshape(-1, self.in_features)
        values, scale = quantize_rowwise(rows)
        bias = None if self.bias is None else self.bias.to(x.dtype)
        # cuBLASLt adds a bias in its epilogue only for a 16-bit output; an fp32 model (--dtype float32) adds it after.
        fused_bias = bias if x.dtype != torch.float32 else None
        output = torch._scaled_mm(values, self.weight.t(), scale_a=scale, scale_b=self.weight_scale, bias=fused_bias,
                                  out_dtype=x.dtype, use_fast_accum=self.fast_accumulation)
        if bias is not None and fused_bias is None:
            output = output + bias
        return output.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"e4m3 row-wise{', fast accumulation' if self.fast_accumulation else ''}")


def dequantized_linear(x: Tensor, layer: Fp8Linear) -> Tensor:
    """What `layer(x)` computes, written out in fp32: quantize, scale back, matmul (the CPU's path, and the CUDA
    tests' reference)."""
    values, scale = quantize_rowwise(x.reshape(-1, layer.in_features))
    weight = layer.weight.float() * layer.weight_scale.reshape(-1, 1)
    output = (values.float() * scale) @ weight.t()
    if layer.bias is not None:
        output = output + layer.bias.float()
    return output.to(x.dtype).reshape(*x.shape[:-1], layer.out_features)
