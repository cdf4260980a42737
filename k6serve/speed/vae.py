"""Video VAE decode speed-ups (HunyuanVideo VAE; the SR K-VAE too), applied to the module in place.

The decode keeps its tiling (HunyuanVideo: diffusers' default framewise temporal tiling, plus spatial tiles with
`--vae-tiling`, speed/vae_tiling.py; SR: per-tile, segment-by-segment with causal caches): only the kernels change,
never the tiling.

* Not cuDNN's autotuner (`torch.backends.cudnn.benchmark`; `K6SERVE_CUDNN_BENCHMARK=1` turns it on): it times the
  candidate algorithms of each convolution shape and keeps the fastest, again in every thread (torch keeps its
  choices per thread; each engine runs its requests on its own) and every process, and candidates that time alike
  round differently. On an H100 (docs/benchmarks.md, fifty-eighth session) it made the vocoder give three different
  outputs in three threads, the VAE decode two and the SR K-VAE's tile decode three, where cuDNN's heuristics gave
  one, and a folder's checkpoint and the dummy build it was saved from gave different MP4s in one process only with
  it on; it saved nothing (the 121-frame 512x768 decode 6.632 s with it, 6.633 s without; compiled 2.817 and
  2.803 s; the vocoder 0.061 s both; the SR K-VAE's compiled tile decode 1.670 s both).
* `torch.compile` of the decoder (`--compile-vae true`; not part of `--performance-mode speed`, whose
  promise is uint8 frames within 1/255 of the reference, see below). Measured on one H200
  (docs/benchmarks.md): eager HunyuanVideo decode spends 2.2 of its 6.7 s in the bf16 GroupNorm statistics
  kernel and 1.2 s in replication-pad copies; compiled, GroupNorm + SiLU + padding fuse into Triton
  kernels and the decode takes 3.6 s. The SR K-VAE's fp32 RMSNorm, zq modulation, SiLU and pads fuse the
  same way (3.7 -> 2.1 s per tile). Fusion rounds once where eager rounds after every op, so frames
  differ from the eager bf16 decode by bf16 rounding: up to 12/255 (K-VAE 15/255) on random weights,
  which amplify rounding differences; whether trained weights stay within 1/255 is not yet measured. The
  difference is not an error of the compiled decode: on a small random VAE on CPU (`scripts/vae_rounding.py`)
  the compiled decode is 6 levels from an fp32 decode and eager bf16 is 8.
  Compilation happens once per tile shape (about 70 s HunyuanVideo, 150 s K-VAE on the first request;
  `--warmup-mode server` pays it at start). As the DiT's blocks (speed/regional_compile.py), the decoders compile
  in inductor's deterministic mode unless `TORCHINDUCTOR_DETERMINISTIC` is set: inductor's timed choice of kernel
  configurations gave other frames (H100, sixty-first session: HunyuanVideo's compiled decode 12 levels from eager
  in the mode, 13 without, VSR x2 MP4s of other bytes), while in the mode two VSR processes, each compiling afresh,
  wrote the same MP4. Its cost there: HunyuanVideo's 121-frame decode 2.856 s against 2.853 s, the K-VAE's decode in
  a VSR x2 request 14.67 s against 14.48 s (its compiles faster: 123-140 s against 179 s).
* The SR K-VAE's latent-conditioned norms with their 1x1x1 convolutions before the upsampling, beside the
  compiled decoder blocks ($K6SERVE_KVAE_COMMUTED_NORMS=0 leaves it out): the same convolution values, without
  writing two full-resolution tensors per norm (speed/kvae_spatial_norm.py). Measured on one H200 (sixth
  session): tile decode 1.952 -> 1.878 s with channels-last, the same 15-level distance from eager.
* The SR K-VAE upsamplers (nearest 2x, 3x3 convolution, 1x1x1 `linear`) folded into one 2x2 convolution with 4C
  outputs on the low-resolution grid, beside the compiled decoder blocks ($K6SERVE_KVAE_SUBPIXEL_UPSAMPLE=0 leaves it
  out): 837.6 -> 735.5 TFLOP per tile, the same values up to rounding (speed/kvae_upsample.py). Its first form (four
  separate phase convolutions, kernels computed inside the compiled graph) measured 1.878 -> 1.853 s per tile on one
  H200 (seventh session), far less than its FLOPs promised, because inductor laid those kernels out NCDHW and cuDNN
  transposed around them; the folded kernel is now a channels-last buffer computed once: 1.853 -> 1.568 s per tile
  (eighth session, 16 levels from eager).
* The SR K-VAE decoder's causal convolutions as one convolution per segment over `cat(carried padding, segment)`
  instead of diffusers' two (the first `time_pad` frames from the padding, the rest alone), beside the compiled
  decoder blocks ($K6SERVE_KVAE_SINGLE_CAUSAL_CONV=0 leaves it out): the same sums, one cuDNN launch instead of a
  big and a thin one (speed/kvae_causal_conv.py). Measured on one H200 (eighth session): 1.568 -> 1.523 s per tile
  after the folded upsampler, 14 levels from eager; the VSR x2 decode 16.7 -> 13.75 s with both.
* HunyuanVideo's upsamplers (nearest upsampling, replicate padding, causal 3x3x3 convolution) folded into one
  phase convolution on the low-resolution grid, beside the compiled decoder ($K6SERVE_HUNYUAN_FOLDED_UPSAMPLE=0
  leaves it out): 39.7 -> 12.3 TFLOP per 17-frame temporal tile of the 111 the decoder computes, the same values up
  to rounding (speed/hunyuan_upsample.py). Measured on one H200 (ninth session): compiled decode 3.157 -> 2.730 s,
  peak 17.6 -> 14.0 GiB.
* Channels-last 3-D convolution weights, only beside the compiled decoder. cuDNN's bf16 kernels run NDHWC
  and transpose every NCDHW input and output (the compiled K-VAE tile decode spent 0.33 of its 2.1 s in
  those transposes); with NDHWC weights cuDNN's output is NDHWC and inductor's fused norm/SiLU/pad kernels
  write the next convolution's input in that layout. Measured on one H200 (docs/benchmarks.md, fifth
  session): K-VAE tile 2.119 -> 1.952 s, same 15-level distance from eager, VSR x2 46.7 -> 45.7 s. So the
  SR K-VAE gets it with `--compile-vae true` ($K6SERVE_VAE_CHANNELS_LAST=0 leaves it out); HunyuanVideo's
  compiled decoder only with $K6SERVE_VAE_CHANNELS_LAST=1 (measured slower there: 3.38 vs 3.1 s). Eager is
  not converted: its GroupNorm and padding kernels are much slower on channels-last tensors (measured on
  H200: 1.55x slower decode). Only 5-D `Conv3d` weights are converted (`Module.to(memory_format=...)` fails on the
  rank-4 ones); the math of every op is unchanged, only summation order inside fused reductions can move.

Nothing is applied on a non-CUDA device, so CPU results are unchanged.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, TypeGuard, cast

import torch
from torch import nn

from k6serve.speed.hunyuan_upsample import apply_folded_upsample
from k6serve.speed.kvae_causal_conv import apply_single_causal_conv
from k6serve.speed.kvae_spatial_norm import apply_commuted_spatial_norms
from k6serve.speed.kvae_upsample import apply_subpixel_upsample
from k6serve.speed.regional_compile import inductor_options, is_compiled, raise_recompile_limit

if TYPE_CHECKING:  # diffusers' classes are told apart by name here (`_is_sr_vae`), without importing diffusers
    from diffusers.models.autoencoders.autoencoder_kandinsky6_sr import Kandinsky6SRVAE

# "1": cuDNN times each convolution's candidate algorithms (`torch.backends.cudnn.benchmark`) instead of choosing by its
# heuristics, as torch does by default. Off by default: the timed choice is made again by every thread (torch keeps
# the benchmark cache per thread) and every process, and candidates that time alike round differently, so two
# engines gave frames and samples apart from the same request, for no measured gain (see the module docstring).
CUDNN_BENCHMARK_ENVIRONMENT_VARIABLE = "K6SERVE_CUDNN_BENCHMARK"
# "0": never, "1": also HunyuanVideo's decoder (see the module docstring); read when the speed-ups are applied.
CHANNELS_LAST_ENVIRONMENT_VARIABLE = "K6SERVE_VAE_CHANNELS_LAST"
# "0": the SR K-VAE's latent-conditioned norms upsample before convolving, as diffusers does; by default beside the
# compiled decoder blocks they convolve first (speed/kvae_spatial_norm.py).
COMMUTED_NORMS_ENVIRONMENT_VARIABLE = "K6SERVE_KVAE_COMMUTED_NORMS"
# "0": the SR K-VAE's upsamplers convolve the upsampled image, as diffusers does; by default beside the compiled
# decoder blocks they run folded into one 2x2 convolution on the low-resolution grid (speed/kvae_upsample.py).
SUBPIXEL_UPSAMPLE_ENVIRONMENT_VARIABLE = "K6SERVE_KVAE_SUBPIXEL_UPSAMPLE"
# "0": the SR K-VAE decoder's causal convolutions run as diffusers' two convolutions per segment; by default beside the
# compiled decoder blocks as one (speed/kvae_causal_conv.py).
SINGLE_CAUSAL_CONV_ENVIRONMENT_VARIABLE = "K6SERVE_KVAE_SINGLE_CAUSAL_CONV"
# "0": HunyuanVideo's upsamplers convolve the upsampled grid, as diffusers does; by default beside the compiled decoder
# they run as one phase convolution on the low-resolution grid (speed/hunyuan_upsample.py).
HUNYUAN_FOLDED_UPSAMPLE_ENVIRONMENT_VARIABLE = "K6SERVE_HUNYUAN_FOLDED_UPSAMPLE"


def apply_vae_speedups(
    vae: nn.Module,
    device: torch.device,
    *,
    compile_decoder: bool = False,
) -> list[str]:
    """Apply the enabled decode speed-ups on CUDA; returns the names of what was applied."""
    if torch.device(device).type != "cuda":
        return []
    applied = []
    if os.environ.get(CUDNN_BENCHMARK_ENVIRONMENT_VARIABLE, "").strip() == "1":
        # Process-wide: every convolution in the process autotunes (the DiT has none).
        torch.backends.cudnn.benchmark = True
        applied.append("cudnn_benchmark")
    decoder = getattr(vae, "decoder", None)
    if compile_decoder and decoder is not None and _wants_channels_last(vae):
        apply_channels_last_3d(decoder)
        applied.append("channels_last_3d")
    if compile_decoder and decoder is not None:
        if _is_sr_vae(vae):
            # Each rewrite is on unless its variable is "0" (measured faster; see the module docstring).
            for variable, name, rewrite in (
                (COMMUTED_NORMS_ENVIRONMENT_VARIABLE, "commuted_spatial_norms", apply_commuted_spatial_norms),
                (SUBPIXEL_UPSAMPLE_ENVIRONMENT_VARIABLE, "subpixel_upsample", apply_subpixel_upsample),
                (SINGLE_CAUSAL_CONV_ENVIRONMENT_VARIABLE, "single_causal_conv", apply_single_causal_conv),
            ):
                if os.environ.get(variable, "").strip() != "0":
                    rewrite(decoder)
                    applied.append(name)
            compile_sr_decoder_blocks(vae)
            applied.append("compile_decoder_blocks")
        else:
            if os.environ.get(HUNYUAN_FOLDED_UPSAMPLE_ENVIRONMENT_VARIABLE, "").strip() != "0":
                apply_folded_upsample(decoder)
                applied.append("folded_upsample")
            if not is_compiled(decoder):
                # One graph per tile shape: a 121-frame decode has 2-3 temporal tile lengths, and with --vae-tiling
                # on each of its spatial tiles' shapes too (edge tiles are smaller: at 512x768 four heights and widths
                # combine into up to 12 shapes), past dynamo's default of 8, after which it would silently run eager.
                raise_recompile_limit(64)
                decoder.compile(dynamic=False, options=inductor_options("inductor", None))
            applied.append("compile_decoder")
    return applied


def apply_channels_last_3d(module: nn.Module) -> int:
    """Store every `Conv3d` weight of `module` in channels-last 3-D (NDHWC) order, in place; returns the count.

    Values are untouched; a convolution with an NDHWC weight returns an NDHWC output on cuDNN, so the layout
    propagates from the first convolution on without converting any activation here.
    """
    count = 0
    for conv in module.modules():
        if isinstance(conv, nn.Conv3d) and conv.weight.dim() == 5:
            conv.weight.data = conv.weight.data.contiguous(memory_format=torch.channels_last_3d)
            count += 1
    return count


def _wants_channels_last(vae: nn.Module) -> bool:
    setting = os.environ.get(CHANNELS_LAST_ENVIRONMENT_VARIABLE, "").strip()
    return setting == "1" or (setting != "0" and _is_sr_vae(vae))


def _is_sr_vae(vae: nn.Module) -> TypeGuard[Kandinsky6SRVAE]:
    # SRVAE drives the K-VAE decoder's blocks itself (segments with causal caches), never decoder.forward.
    return type(vae).__name__ == "Kandinsky6SRVAE"


def compile_sr_decoder_blocks(model: Kandinsky6SRVAE, *, backend: str = "inductor", limit: int = 64) -> int:
    """Compile every resnet block, upsampler and the output norm of the SR K-VAE decoder in place.

    `SRVAE` calls these submodules one by one with their cache dicts (segment-by-segment decoding), so the
    decoder's own forward never runs and compiling it would do nothing; compiling the blocks fuses the fp32
    RMSNorm, the zq modulation, SiLU and the padding copies around each convolution. Returns the count.
    """
    decoder = model.decoder
    raise_recompile_limit(limit)
    # `mid` and each level of `up` are plain nn.Module holders, whose children torch's stubs type as
    # Tensor | Module.
    mid = decoder.mid
    modules = [cast(nn.Module, mid.block_1), cast(nn.Module, mid.block_2), decoder.norm_out]
    for up in decoder.up:
        modules += list(cast(nn.ModuleList, up.block))
        if hasattr(up, "upsample"):
            modules.append(cast(nn.Module, up.upsample))
    for module in modules:
        if not is_compiled(module):
            module.compile(backend=backend, dynamic=False, options=inductor_options(backend, None))
    return len(modules)
