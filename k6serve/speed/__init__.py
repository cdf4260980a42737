"""Speed transforms applied from outside a built model (style.md rule 3), and warm-up.

Each transform is an `apply_*` function on an already loaded model, composed once, in this fixed order, by
`apply_performance_mode`:

1. `apply_fused_projections(transformer)`: one GEMM for Q/K/V of every self-attention and for K/V of every
   cross-attention, in the generation DiT and the SR DiT (after the weights are loaded; the fused module's
   state-dict keys differ); then `apply_fused_norm_rope(transformer)`: the per-head RMSNorm + RoPE of Q/K as
   one Triton kernel (`K6SERVE_FUSED_NORM_ROPE=0` leaves it out).
2. `apply_regional_compile(transformer, plan)`: `torch.compile` on each repeated block of `plan.blocks`
   (fuses the fp32 AdaLN / gate / RMSNorm / RoPE elementwise chains around the GEMMs).
3. `apply_vae_speedups(vae, device)`: cuDNN autotuning for the video VAE; with `compile_decoder`
   (`--compile-vae true`) a compiled decoder (HunyuanVideo) or compiled decoder blocks (SR K-VAE, with
   channels-last convolution weights and its norms' convolutions moved before their upsampling;
   `K6SERVE_VAE_CHANNELS_LAST=0` / `K6SERVE_KVAE_COMMUTED_NORMS=0` leave those out).

`warmup(pipeline, request, mode)` runs a short request so compilation and autotuning happen before the
first real request, and reports what that cost.
"""

from k6serve.speed.fused_projections import FusedProjectionAttention, FusedSRSelfAttention, apply_fused_projections
from k6serve.speed.performance_mode import PerformanceReport, apply_performance_mode
from k6serve.speed.regional_compile import apply_regional_compile, is_compiled
from k6serve.speed.vae import apply_vae_speedups
from k6serve.speed.warmup import WarmupReport, warmup

__all__ = [
    "FusedProjectionAttention",
    "FusedSRSelfAttention",
    "PerformanceReport",
    "WarmupReport",
    "apply_fused_projections",
    "apply_performance_mode",
    "apply_regional_compile",
    "apply_vae_speedups",
    "is_compiled",
    "warmup",
]
