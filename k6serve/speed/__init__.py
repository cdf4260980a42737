"""Speed transforms applied from outside a built model (style.md rule 3), and warm-up.

Each transform is an `apply_*` function on an already loaded model, composed once, in this fixed order, by
`apply_performance_mode`:

1. `apply_fused_projections(transformer)`: one GEMM for Q/K/V of every self-attention and for K/V of every
   cross-attention, in the generation DiT and the SR DiT (after the weights are loaded; the fused module's
   state-dict keys differ); then `apply_fused_norm_rope(transformer)`: the per-head RMSNorm + RoPE of Q/K as
   one Triton kernel (`K6SERVE_FUSED_NORM_ROPE=0` leaves it out).
2. `apply_regional_compile(transformer, plan)`: `torch.compile` on each repeated block of `plan.blocks`
   (fuses the fp32 AdaLN / gate / RMSNorm / RoPE elementwise chains around the GEMMs).
3. `apply_vae_speedups(vae, device)`: with `compile_decoder`
   (`--compile-vae true`) a compiled decoder (HunyuanVideo) or compiled decoder blocks (SR K-VAE, with
   channels-last convolution weights and its norms' convolutions moved before their upsampling;
   `K6SERVE_VAE_CHANNELS_LAST=0` / `K6SERVE_KVAE_COMMUTED_NORMS=0` leave those out).

`warmup(pipeline, request, mode)` runs a short request so compilation and autotuning happen before the
first real request, and reports what that cost.
"""

import importlib

# The warm-up's names are imported here (its module needs no model code; and a later first import of the
# submodule would otherwise bind `warmup` to the module); the others on first use (PEP 562): the engine's own
# process, which only starts the ranks (their leader writes the MP4), reads `WarmupReport`s and must not import the
# models (and through them torch._dynamo) to do so.
from k6serve.speed.warmup import WarmupReport, warmup

_WHERE = {
    "FusedProjectionAttention": "fused_projections",
    "FusedSRSelfAttention": "fused_projections",
    "apply_fused_projections": "fused_projections",
    "PerformanceReport": "performance_mode",
    "apply_performance_mode": "performance_mode",
    "apply_regional_compile": "regional_compile",
    "is_compiled": "regional_compile",
    "apply_vae_speedups": "vae",
}


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_WHERE[name]}"), name)


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
