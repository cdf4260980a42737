"""`--performance-mode`: which speed transforms run, composed once in a fixed order.

* "speed" (CUDA): fused projections with the fused RMSNorm + RoPE kernel of Q and K ($K6SERVE_FUSED_NORM_ROPE=0
  keeps inductor's fused ops instead) -> regional compile of the DiT blocks -> VAE decode speed-ups (the
  compiled decoder with `compile_vae_decoder` = `--compile-vae true`; cuDNN's autotuner only with
  $K6SERVE_CUDNN_BENCHMARK=1, see `speed/vae.py`). Each
  keeps outputs within the issue's tolerance (bf16 velocity cosine >= 0.999 vs diffusers; uint8 frames
  within 1/255), which `k6serve bench` / `scripts/gpu_single.py` measure.
* "balanced" / "memory": no speed transforms (eager kernels, untrimmed text padding), so their outputs are the
  same bits offloaded or not, and the mode stays the bit-exact reference for Ulysses runs. What they add is offloading,
  applied by the worker after this function (`k6serve/offload/`, CUDA only: on the CPU there is nowhere to offload to):
  "balanced" keeps every component in pinned host memory and moves it to the GPU only for its stage (peak: the largest
  component, the 56 GiB Pro DiT, plus activations; 62.5 GiB for a Pro-distill 512x768x121 request on an H200); "memory"
  also streams the repeated blocks of the DiT and of the text encoders one at a time with the next one prefetched on a
  side stream (deeper with `--offload-prefetch-blocks`, some kept on the GPU with `--offload-resident-blocks`:
  `offload/block_stream.py`), and (`--vae-tiling auto`) decodes the video VAE in spatial tiles. Measured on an H200
  (Pro-distill, 512x768x121): peak 8.3 GiB, set by the DiT's stage (non-block weights, three ~0.9 GiB blocks,
  activations); the DiT step costs 1-2.5% more than in "balanced" (7.87-7.99 against 7.79 s), so the copies hide behind
  the blocks. Fused projections stay off because fusing allocates each module's projection weights twice for a moment
  and the fused copy would have to move too; regional compile stays off because it buys speed these modes give up anyway
  and its graphs hold device memory. The weights are loaded (and `--load-format dummy` builds them) on the host, so the
  model never needs to fit on the GPU at once. Refused with sharded weights (`--tp-size`, `--use-fsdp-inference`,
  `--encoder-parallel fold`); with Ulysses / Ring / CFG parallel each rank offloads its own replica (one host copy per
  GPU).
* "speed" with some components offloaded by the per component flags (`--cpu-offload-components`,
  `--layerwise-offload-components`, `--component-residency`; `offload/residency.py`): a component offloaded *whole*
  keeps its transforms, a component whose blocks are *streamed* runs eager (`speed_transform_targets`). Offloaded
  whole, a component's weights are on the host when the transforms run, and each stage attaches them to a device copy
  of all of them (`offload/host_weights.py` re-points each parameter's `.data`, keeping the objects): the fused
  projections are new Linears built here, on the host, which the offload then packs in place of the unfused ones
  (nothing else holds those); the compiled blocks take their parameters as graph inputs, so they read each stage's
  copy, which passes the same guards (shape, stride, dtype, device; the pipelines enter stages outside inference mode,
  so the copies are ordinary tensors, as resident weights are) and nothing recompiles (inductor assumes a parameter
  aligned when compiled stays aligned, unchecked: the host chunks align every tensor to 512 bytes, and so do their
  device copies); the RMSNorm + RoPE kernel is chosen per call, on the GPU tensors, and the attention backend at load,
  for the compute device (`worker.py`); the VAE's folded upsampler kernels are buffers, moved with it. Streamed blocks
  are swapped in and out block by block by forward hooks (`offload/block_stream.py`), built and measured with eager
  blocks, so they stay eager. Why it matters: Pro-distill in speed mode peaks above an 80 GB GPU all resident (94.5
  GiB); with every component offloaded whole (`--cpu-offload-components all`) it keeps the compiled step for one
  copy of the DiT per request: measured on an H200, step 5.865 s against 5.853 resident, peak 59.6 GiB, the same
  bits (docs/benchmarks.md, twenty-fifth session).
* On a non-CUDA device every mode is a no-op, so CPU outputs stay bitwise equal to diffusers'.

Tensor-parallel weights are not fused (see `fused_projections.py`); a `ModelPlan` supplies the blocks to
compile, so any model family with a plan gets regional compile.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch
from torch import nn

from k6serve.config import PERFORMANCE_MODES
from k6serve.models.registry import transformer_plan
from k6serve.speed.fp8_linears import apply_quantization
from k6serve.speed.fused_projections import apply_fused_norm_rope, apply_fused_projections
from k6serve.speed.regional_compile import apply_regional_compile
from k6serve.speed.vae import apply_vae_speedups

# The Triton RMSNorm + RoPE kernel of Q and K (k6serve/ops/rms_norm_rope.py) is on in speed mode: measured on one
# H200 (docs/benchmarks.md, fifth session) it takes 0.615 / 0.267 ms per tensor where inductor's fused ops take
# 0.703 / 0.374 (Pro / Lite shapes), Lite's compiled DiT 1.369 s against 1.377, cosine to diffusers unchanged.
# "0" turns it off (e.g. to compare, or to rule it out); read when the mode is applied (engine start-up).
FUSED_NORM_ROPE_ENVIRONMENT_VARIABLE = "K6SERVE_FUSED_NORM_ROPE"


@dataclass(frozen=True, kw_only=True, slots=True)
class PerformanceReport:
    """What `apply_performance_mode` did (logged by the worker, stored by the benchmark)."""

    mode: str
    device: str
    num_fused_attentions: int = 0
    num_compiled_blocks: int = 0
    num_quantized_linears: int = 0  # --quantization fp8: the DiT's video-token linears in e4m3
    vae: tuple[str, ...] = ()
    notes: tuple[str, ...] = field(default=())

    @property
    def applied(self) -> bool:
        return bool(self.num_fused_attentions or self.num_compiled_blocks or self.vae)


# The components speed mode transforms: the DiT (fused projections, the RMSNorm + RoPE kernel, compiled blocks) and
# the video VAE (decode speed-ups).
SPEED_COMPONENTS = ("transformer", "vae")


def speed_transform_targets(mode: str, device: torch.device | str, *,
                            streamed: frozenset[str] = frozenset()) -> frozenset[str]:
    """Which of `SPEED_COMPONENTS` get `mode`'s transforms on `device`: both in speed mode on CUDA, but a component
    whose blocks are `streamed`; none in the other modes or off CUDA. Resident and offloaded-whole components are
    treated alike (the module docstring says why)."""
    if mode != "speed" or torch.device(device).type != "cuda":
        return frozenset()
    return frozenset(name for name in SPEED_COMPONENTS if name not in streamed)


def apply_performance_mode(
    models, mode: str, device: torch.device | str, *, compile_vae_decoder: bool = False,
    offloaded_whole: frozenset[str] = frozenset(), streamed: frozenset[str] = frozenset(),
    quantization: str = "none", quantization_ignored_layers: tuple[str, ...] = (),
) -> PerformanceReport:
    """Apply `mode`'s transforms to `models` (anything with `.transformer` and optionally `.vae`).

    `offloaded_whole` names the components that live in host memory and are copied whole to the GPU for their stage
    (`--cpu-offload-components`; "component" in the residency plan), `streamed` those whose repeated blocks are
    streamed (`--layerwise-offload-components`; "layerwise"). In speed mode the ones offloaded whole keep their
    transforms, built on their host weights before the worker offloads them; the streamed ones stay eager, as in
    the memory mode (`speed_transform_targets`; the module docstring says why). The report's notes say which.
    Idempotent, so calling it on an already transformed model changes nothing.

    `quantization` (`--quantization fp8`, lossy, any mode, the DiT resident: config.py) converts the DiT's
    video-token linears to e4m3 (`speed/fp8_linears.py`): after the fused projections, so the fused Q/K/V is one e4m3
    GEMM, and before the compile, which then fuses each activation's quantization into the kernel producing it.
    """
    if mode not in PERFORMANCE_MODES:
        raise ValueError(f"--performance-mode must be one of {PERFORMANCE_MODES}, got {mode!r}")
    device = torch.device(device)

    def quantize() -> int:
        return apply_quantization(models.transformer, quantization, quantization_ignored_layers)

    if mode != "speed" or device.type != "cuda":
        why = (
            "CPU: kept identical to the reference" if device.type != "cuda" else "no transforms yet"
        )
        num_quantized = quantize()
        if num_quantized:
            why = f"{num_quantized} DiT linears in e4m3 (--quantization {quantization}), no other transforms"
        return PerformanceReport(mode=mode, device=str(device), num_quantized_linears=num_quantized,
                                 notes=(f"{mode}: {why}",))
    targets = speed_transform_targets(mode, device, streamed=streamed)
    notes = _residency_notes(offloaded_whole, streamed)
    num_fused = num_compiled = num_quantized = 0
    if "transformer" in targets:
        num_fused, num_compiled, num_quantized = _speed_up_transformer(models.transformer, notes, quantize)
    vae = getattr(models, "vae", None)
    # The SR pipeline wraps its K-VAE (`SRVAE.model`); the generation pipeline holds diffusers' module.
    vae_module = vae if isinstance(vae, nn.Module) else getattr(vae, "model", None)
    vae_applied = []
    if "vae" in targets and isinstance(vae_module, nn.Module):
        vae_applied = apply_vae_speedups(vae_module, device, compile_decoder=compile_vae_decoder)
    return PerformanceReport(
        mode=mode,
        device=str(device),
        num_fused_attentions=num_fused,
        num_compiled_blocks=num_compiled,
        num_quantized_linears=num_quantized,
        vae=tuple(vae_applied),
        notes=tuple(notes),
    )


def _residency_notes(offloaded_whole: frozenset[str], streamed: frozenset[str]) -> list[str]:
    """What speed mode does with the offloaded DiT and video VAE (the report's first notes)."""
    notes = []
    if "transformer" in streamed:
        notes.append("the DiT's blocks are streamed: they run eager (no fused projections, no compiled blocks)")
    elif "transformer" in offloaded_whole:
        notes.append("the DiT is offloaded whole: its fused, compiled blocks run on the copy moved to the GPU for "
                     "its stage")
    # The video VAE is never streamed (offload/residency.py offloads it whole instead: no repeated blocks).
    if "vae" in offloaded_whole:
        notes.append("the video VAE is offloaded whole: its decode speed-ups run on the copy moved to the GPU for "
                     "its stage")
    return notes


def _speed_up_transformer(transformer, notes: list[str], quantize) -> tuple[int, int, int]:
    """Fused projections, the fused RMSNorm + RoPE kernel, `quantize` and compiled blocks: (fused attentions, compiled
    blocks, quantized linears)."""
    num_fused = apply_fused_projections(transformer)
    num_quantized = quantize()
    if num_quantized:
        notes.append(f"{num_quantized} DiT linears in e4m3 (--quantization)")
    if os.environ.get(FUSED_NORM_ROPE_ENVIRONMENT_VARIABLE, "").strip() == "0":
        notes.append(f"fused RMSNorm + RoPE kernel off (${FUSED_NORM_ROPE_ENVIRONMENT_VARIABLE}=0)")
    else:
        notes.append(f"fused RMSNorm + RoPE kernel on {apply_fused_norm_rope(transformer)} attentions")
    plan = transformer_plan(transformer)
    num_compiled = 0
    if plan is None:
        notes.append(f"no plan for {type(transformer).__name__}: blocks not compiled")
    else:
        num_compiled = apply_regional_compile(transformer, plan)
    return num_fused, num_compiled, num_quantized
