"""The SR K-VAE's upsampler convolution on the low-resolution grid: four 2x2 "phase" convolutions instead of a 3x3
convolution of the nearest-upsampled image (experimental).

diffusers' `Kandinsky6SRUpsample` nearest-upsamples each frame 2x and adds a (1, 3, 3) convolution of the result:
`h = up(x) + conv3x3(up(x))`. Every output pixel (2i + a, 2j + b) of that convolution reads a 3 x 3 window of
`up(x)` that covers only 2 x 2 distinct pixels of `x`, so the convolution equals, for each of the four phases
(a, b), a 2 x 2 convolution of `x` whose taps are sums of the 3 x 3 taps (along rows, phase 0 takes rows i - 1
and i with weights W[-1] and W[0] + W[1]; phase 1 takes rows i and i + 1 with W[-1] + W[0] and W[1]; the same along
columns; the zero padding of `up(x)` by one pixel is the zero padding of `x` by one). The four results interleave
into the output grid. Why: these convolutions are 154.9 of the 837.6 TFLOP of one 512x768x121 K-VAE tile decode
(`bench.flops.sr_vae_tile_decode_flops`); as phases they are 68.8 TFLOP (4 taps per output pixel instead of 9),
and the upsampled image is no longer an input of a convolution. At the compiled decode's 539 TFLOP/s for cuDNN
convolutions that is about 0.16 s of the 1.88 s per tile, 1.4 s per VSR x2 request, if 2 x 2 kernels run as well.

Numerics: the same sum in exact arithmetic. The summed taps are computed in fp32 and rounded once to the weight
dtype, so in bf16 a tap rounds differently from the products it replaces: outputs differ from diffusers' by
rounding (fp32 on CPU: within 1e-5 relative, tests/unit/test_kvae_upsample.py). So it sits only beside the
compiled decoder, which is outside eager's bits anyway, and there it is on by default (speed/vae.py;
`K6SERVE_KVAE_SUBPIXEL_UPSAMPLE=0` leaves it out). Measured on one H200 (seventh session, `gpu_profile.py kvae
--subpixel-upsample`): 1.878 -> 1.853 s per compiled tile, 14 levels from eager (15 without it), so 0.025 s of the
0.16 s the FLOP count promised: the 2x2 phase convolutions run at a lower rate than the 3x3 one.

The temporal half of the upsampler (`compress_time`: frames repeated and a causal (3, 1, 1) convolution, 7 TFLOP)
is diffusers' code unchanged.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn


def phase_kernels(weight_OI133: Tensor) -> list[Tensor]:
    """The four (O, I, 1, 2, 2) kernels of phases (a, b) = (0, 0), (0, 1), (1, 0), (1, 1) of a (O, I, 1, 3, 3)
    kernel applied to a 2x nearest-upsampled image; summed in fp32 (fp64 for fp64 weights), returned in the weight's
    dtype."""
    w = weight_OI133.to(torch.promote_types(weight_OI133.dtype, torch.float32))

    def split(tensor: Tensor, dim: int, phase: int) -> Tensor:
        first, middle, last = tensor.narrow(dim, 0, 1), tensor.narrow(dim, 1, 1), tensor.narrow(dim, 2, 1)
        return torch.cat((first, middle + last) if phase == 0 else (first + middle, last), dim=dim)

    kernels = [split(split(w, -2, a), -1, b).to(weight_OI133.dtype) for a in (0, 1) for b in (0, 1)]
    if not weight_OI133.is_contiguous() and weight_OI133.is_contiguous(memory_format=torch.channels_last_3d):
        # Beside channels-last decoder weights (speed/vae.py) cuDNN runs NDHWC; an NCDHW kernel would bring its
        # input and output transposes back (0.33 s per tile before that change).
        kernels = [kernel.contiguous(memory_format=torch.channels_last_3d) for kernel in kernels]
    return kernels


def subpixel_upsample_conv(x_BCTHW: Tensor, conv: nn.Conv3d) -> Tensor:
    """`conv(nearest_upsample_2x(x))` for a (1, 3, 3) zero-padded `conv`, computed as four phase convolutions on
    `x` and interleaved: (B, C, T, H, W) -> (B, O, T, 2H, 2W)."""
    batch, _, frames, height, width = x_BCTHW.shape
    padded = F.pad(x_BCTHW, (1, 1, 1, 1))
    kernels = phase_kernels(conv.weight)
    phases = [
        F.conv3d(padded[:, :, :, a : a + height + 1, b : b + width + 1], kernels[2 * a + b], conv.bias)
        for a in (0, 1)
        for b in (0, 1)
    ]
    out_channels = phases[0].shape[1]
    # (B, O, T, H, W, a, b) -> (B, O, T, H, a, W, b) -> (B, O, T, 2H, 2W): pixel (2i + a, 2j + b).
    stacked = torch.stack(phases, dim=-1).unflatten(-1, (2, 2))
    return stacked.permute(0, 1, 2, 3, 5, 4, 6).reshape(batch, out_channels, frames, 2 * height, 2 * width)


def _subpixel_forward(self, hidden_states: Tensor, cache: dict) -> Tensor:
    if self.compress_time:  # diffusers' Kandinsky6SRUpsample.forward, unchanged
        repeated = hidden_states.repeat_interleave(2, dim=2)
        if cache["temporal_conv"]["padding"] is None:
            repeated = repeated[:, :, 1:]
        conv_out = self.temporal_conv(repeated, cache["temporal_conv"])
        hidden_states = conv_out + repeated
    upsampled = F.interpolate(hidden_states, scale_factor=(1, 2, 2), mode="nearest")
    return self.linear(upsampled + subpixel_upsample_conv(hidden_states, self.spatial_conv))


def _is_upsampler(module: nn.Module) -> bool:
    # By name: diffusers' class, without importing diffusers here (the SR K-VAE module comes from it).
    return type(module).__name__ == "Kandinsky6SRUpsample"


def _fits(conv: nn.Module) -> bool:
    return (
        isinstance(conv, nn.Conv3d)
        and conv.kernel_size == (1, 3, 3)
        and conv.stride == (1, 1, 1)
        and conv.padding == (0, 1, 1)
        and conv.dilation == (1, 1, 1)
        and conv.groups == 1
        and conv.padding_mode == "zeros"
    )


def apply_subpixel_upsample(decoder: nn.Module) -> int:
    """Route every `Kandinsky6SRUpsample` of `decoder` through `_subpixel_forward`, in place; returns how many.
    Idempotent; parameters and state-dict names are untouched (only the instance's `forward` changes). An
    upsampler whose spatial convolution is not the zero-padded (1, 3, 3) one is left as it is."""
    count = 0
    for module in decoder.modules():
        if not _is_upsampler(module) or "forward" in vars(module) or not _fits(module.spatial_conv):
            continue
        module.forward = _subpixel_forward.__get__(module)
        count += 1
    return count
