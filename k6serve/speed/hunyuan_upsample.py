"""The HunyuanVideo VAE decoder's upsamplers as one convolution on the low-resolution grid: the nearest upsampling and
the replicate-padded causal 3x3x3 convolution after it folded into "phase" kernels.

diffusers' `HunyuanVideoUpsampleCausal3D` upsamples by nearest neighbour, 2x in space and, in two of the three
decoder levels, 2x in time (the first frame only in space: frames f0, f1, f1, f2, f2, ...), pads the result by
replication (one pixel on every spatial side, two frames in front) and convolves it with a 3x3x3 kernel W. Every
output pixel reads a window of the upsampled grid that covers only two distinct source rows, two source columns
and, with the temporal upsampling, two source frames, so the convolution is, per output phase, a convolution of the
source with 2-tap sums of W:

* rows (and the same for columns): output row 2i reads source rows (i - 1, i) with taps (W[0], W[1] + W[2]), output
  row 2i + 1 reads (i, i + 1) with (W[0] + W[1], W[2]). The replicate padding of the upsampled grid by one pixel is
  the replicate padding of the source by one (both repeat the edge pixel), so one convolution with a 2-wide kernel
  over the source padded by one gives H + 1 rows per phase, and phase a is the rows starting at a.
* frames, with temporal upsampling: output frame 2k - 1 (k >= 1) reads source frames (k - 1, k) with taps
  (W[0] + W[1], W[2]) ("phase A") and output frame 2k reads the same pair with (W[0], W[1] + W[2]) ("phase B"); with
  the source padded in front by one replicated frame both phases exist at every k, and at k = 0 they are equal
  (both (W[0] + W[1] + W[2]) f0, which is diffusers' output frame 0), so the 2T - 1 output frames are
  A0, B0, A1, B1, ... without its first element. Without temporal upsampling the three temporal taps stay as they
  are, over the source padded in front by two frames, as in diffusers.

So each upsampler is one convolution with P * C output channels (P = 8 phases with the temporal upsampling, 4
without) and a (2, 2, 2) or (3, 2, 2) kernel over the replicate-padded source, then one interleave.

Why: in the 512x768 decode the three upsamplers' convolutions are about 36% of the decoder's FLOPs (39.7 of 111
TFLOP per 17-frame temporal tile) and run on the upsampled grid; folded they cost 8 taps per output voxel instead of
27 with the temporal upsampling (12 instead of 27 without), and the upsampled and padded tensors are never written.
A folded upsampler's FLOPs per 17-frame tile: 12.3 TFLOP instead of 39.7. Measured on one H200 (ninth session,
`k6serve bench --stage vae --compile-vae-decoder`): the compiled 121-frame 512x768 decode 3.157 -> 2.730 s (2.17x ->
2.46x diffusers' default decode), peak memory 17.6 -> 14.0 GiB.

Numerics: the same sum in exact arithmetic. The folded kernel is computed in fp32 (fp64 for fp64 weights) and rounded
once to the weight dtype, so in bf16 the phase taps (sums of two or three bf16 taps) are rounded where diffusers
rounds products: outputs differ from diffusers' by rounding (exact in fp64, within 1e-5 relative in fp32 on CPU,
tests/unit/test_hunyuan_upsample.py). So it sits only beside the compiled decoder, which is outside eager's bits
anyway (speed/vae.py; `K6SERVE_HUNYUAN_FOLDED_UPSAMPLE=0` leaves it out).

The folded kernel is a non-persistent buffer computed from the weights when `apply_folded_upsample` runs: apply it
after the weights are final (the engine applies every decode speed-up after loading), or apply it again.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, TypeGuard

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from k6serve.speed.phase_fold import (
    BIAS_BUFFER,
    MAX_CONV_OUTPUT_ELEMENTS,
    WEIGHT_BUFFER,
    accumulation_dtype,
    phase_taps,
    route_folded,
    two_tap_phases,
)

if TYPE_CHECKING:
    from diffusers.models.autoencoders.autoencoder_kl_hunyuan_video import HunyuanVideoUpsampleCausal3D


def folded_upsampler_kernel(conv: nn.Conv3d, temporal_upsample: bool) -> tuple[Tensor, Tensor]:
    """The (P * O, I, kt, 2, 2) kernel and (P * O,) bias of `conv(pad(up(x)))` as one convolution of the source
    replicate-padded by one pixel on each spatial side and kt - 1 frames in front (kt = 2 with the temporal
    upsampling, 3 without). Output channels [p * O, (p + 1) * O) are phase p = (t * 2 + a) * 2 + b, with t indexing
    (A, B) in time when there is a temporal phase. Summed in fp32 (fp64 for fp64 weights), rounded once."""
    dtype = accumulation_dtype(conv.weight)
    weight = conv.weight.to(dtype)
    # Phase A (output frames 2k - 1) reads source frames (k - 1, k) with (W0 + W1, W2): two_tap_phases' phase 1;
    # phase B (frames 2k) the same pair with (W0, W1 + W2): its phase 0.
    temporal = list(reversed(two_tap_phases(weight, 2))) if temporal_upsample else [weight]
    kernels = [spatial for taps in temporal for spatial in phase_taps(taps)]
    folded = torch.cat(kernels).to(conv.weight.dtype)
    if conv.weight.is_contiguous(memory_format=torch.channels_last_3d) and not conv.weight.is_contiguous():
        # Keep the layout of the decoder's other weights: cuDNN runs the layout its kernel has.
        folded = folded.contiguous(memory_format=torch.channels_last_3d)
    if conv.bias is None:
        bias = torch.zeros(conv.out_channels, dtype=conv.weight.dtype, device=conv.weight.device)
    else:
        bias = conv.bias
    return folded, bias.repeat(len(kernels))


def _phase_convolution(padded: Tensor, weight: Tensor, bias: Tensor) -> Tensor:
    """`conv3d(padded, weight, bias)`, split along time (with the kernel's overlap) where one call's output would pass
    cuDNN's 32-bit indexing."""
    batch, _, padded_frames, height, width = padded.shape
    kernel_frames = weight.shape[2]
    frames = padded_frames - kernel_frames + 1
    per_frame = weight.shape[0] * (height - 1) * (width - 1) * batch
    step = max(1, MAX_CONV_OUTPUT_ELEMENTS // per_frame)
    if step >= frames:
        return F.conv3d(padded, weight, bias)
    chunks = [F.conv3d(padded[:, :, start : start + step + kernel_frames - 1], weight, bias)
              for start in range(0, frames, step)]
    return torch.cat(chunks, dim=2)


def folded_upsample(x_BCTHW: Tensor, weight: Tensor, bias: Tensor, temporal_upsample: bool) -> Tensor:
    """The folded upsampler on the source: (B, C, T, H, W) -> (B, O, 2T - 1 or T, 2H, 2W)."""
    batch, _, frames, height, width = x_BCTHW.shape
    kernel_frames = weight.shape[2]
    padded = F.pad(x_BCTHW, (1, 1, 1, 1, kernel_frames - 1, 0), mode="replicate")
    phases = _phase_convolution(padded, weight, bias)  # (B, P * O, T, H + 1, W + 1)
    time_phases = 2 if temporal_upsample else 1
    out_channels = weight.shape[0] // (4 * time_phases)
    phases = phases.unflatten(1, (time_phases, 2, 2, out_channels))  # (B, t, a, b, O, T, H + 1, W + 1)
    rows = [
        torch.stack([phases[:, :, a, b, :, :, a : a + height, b : b + width] for b in (0, 1)], dim=-1)
        for a in (0, 1)
    ]  # each (B, t, O, T, H, W, b)
    interleaved = torch.stack(rows, dim=-3)  # (B, t, O, T, H, a, W, b): pixel (2i + a, 2j + b)
    interleaved = interleaved.reshape(batch, time_phases, out_channels, frames, 2 * height, 2 * width)
    if not temporal_upsample:
        return interleaved[:, 0]
    # Frames A0, B0, A1, B1, ...: B0 = A0 (both read f0 twice), diffusers has it once.
    ordered = interleaved.permute(0, 2, 3, 1, 4, 5).reshape(batch, out_channels, 2 * frames, 2 * height, 2 * width)
    return ordered[:, :, 1:]


def _folded_forward(self, hidden_states: Tensor) -> Tensor:
    return folded_upsample(hidden_states, getattr(self, WEIGHT_BUFFER), getattr(self, BIAS_BUFFER),
                           temporal_upsample=self.upsample_factor[0] == 2)


def _is_upsampler(module: nn.Module) -> TypeGuard[HunyuanVideoUpsampleCausal3D]:
    # By name: diffusers' class, without importing diffusers here.
    return type(module).__name__ == "HunyuanVideoUpsampleCausal3D"


def _fits(module: HunyuanVideoUpsampleCausal3D) -> bool:
    factor = tuple(module.upsample_factor)
    causal, conv = module.conv, getattr(module.conv, "conv", None)
    return (
        factor in ((1, 2, 2), (2, 2, 2))
        and isinstance(conv, nn.Conv3d)
        and getattr(causal, "pad_mode", None) == "replicate"
        and tuple(causal.time_causal_padding) == (1, 1, 1, 1, 2, 0)
        and conv.kernel_size == (3, 3, 3)
        and conv.stride == (1, 1, 1)
        and conv.padding == (0, 0, 0)
        and conv.dilation == (1, 1, 1)
        and conv.groups == 1
    )


def apply_folded_upsample(decoder: nn.Module) -> int:
    """Route every `HunyuanVideoUpsampleCausal3D` of `decoder` through the folded upsampler, in place; returns how
    many were newly routed.

    Idempotent. Parameters and state-dict names are untouched: the folded kernel and bias are non-persistent buffers,
    computed now from the current weights, and computed again on an upsampler already routed here (so applying it
    again after the weights changed refreshes them). An upsampler that is not the replicate-padded causal 3x3x3
    convolution after a (1, 2, 2) or (2, 2, 2) nearest upsampling is left as it is.
    """
    return route_folded(
        decoder,
        is_upsampler=_is_upsampler,
        fits=_fits,
        folded_kernel=lambda module: folded_upsampler_kernel(module.conv.conv, module.upsample_factor[0] == 2),
        forward=_folded_forward,
    )
