"""The SR K-VAE's spatial upsampler as one 2x2 convolution on the low-resolution grid: the nearest upsampling, its
3x3 convolution and the 1x1x1 `linear` after it folded into four "phase" kernels.

diffusers' `Kandinsky6SRUpsample` computes, per frame, `linear(up(x) + conv3x3(up(x)))` with `up` the 2x nearest
upsampling. Every output pixel (2i + a, 2j + b) of the 3x3 convolution reads a 3 x 3 window of `up(x)` that covers
only 2 x 2 distinct pixels of `x`, so the convolution equals, for each of the four phases (a, b), a 2 x 2
convolution of `x` whose taps are sums of the 3 x 3 taps (along rows, phase 0 takes rows i - 1 and i with weights
W[-1] and W[0] + W[1]; phase 1 takes rows i and i + 1 with W[-1] + W[0] and W[1]; the same along columns; the zero
padding of `up(x)` by one pixel is the zero padding of `x` by one). `up(x)` itself is, at phase (a, b), the tap of
that window that reads x[i, j]. And `linear` is the same matrix L at every pixel, so it moves inside each phase:
phase (a, b) of the whole upsampler is a 2 x 2 convolution of `x` with kernel L @ (K_ab + I at the x[i, j] tap) and
bias L @ b_conv + b_linear. The four phases run as one convolution with 4C output channels over `x` zero-padded by
one ((H + 1) x (W + 1) outputs; phase (a, b) is the window starting at (a, b)), and one interleave writes the
(2H, 2W) result.

Why: in the released 512x768 tile decode the upsamplers' 3x3 convolutions are 154.9 of 837.6 TFLOP
(`bench.flops.sr_vae_tile_decode_flops`) and their `linear` runs on the upsampled grid too; folded they are 4
taps per output pixel instead of 9 + 1, and the upsampled image, the sum and the 1x1x1 convolution's input are never
written. The first form of this rewrite (seventh session) ran the four phases as separate convolutions of sliced
inputs with kernels computed inside the compiled graph: inductor laid those out NCDHW, so cuDNN transposed input,
kernel and output around each (89 ms of the 1.85 s tile in `nchwToNhwc`/`nhwcToNchw`), plus the slice copies and
the full-resolution `linear`; the tile decode gained 0.025 s where the FLOPs promised 0.16 s. Here the folded kernel
is computed once, when the rewrite is applied, and kept in the conv weight's layout (channels-last beside the
compiled decoder), and the convolution reads `x` as it is. Measured on one H200 (eighth session, `gpu_profile.py
kvae`): the compiled 512x768x121 tile decode 1.853 -> 1.568 s, no cuDNN transposes left.

Numerics: the same sum in exact arithmetic. The folded kernel and bias are computed in fp32 (fp64 for fp64 weights)
and rounded once to the weight dtype, and the convolution accumulates in fp32 where diffusers rounds `up(x) + conv`
to bf16 before `linear`: outputs differ from diffusers' by rounding (fp32 on CPU: within 1e-5 relative, exact in
fp64, tests/unit/test_kvae_upsample.py). So it sits only beside the compiled decoder, which is outside eager's bits
anyway, and there it is on by default (speed/vae.py; `K6SERVE_KVAE_SUBPIXEL_UPSAMPLE=0` leaves it out).

The folded kernel is a buffer computed from the weights when `apply_subpixel_upsample` runs: apply it after the
weights are final (the engine applies every decode speed-up after loading), or apply it again.

The temporal half of the upsampler (`compress_time`: frames repeated and a causal (3, 1, 1) convolution, 7 TFLOP)
is diffusers' code unchanged.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, TypeGuard

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from k6serve.speed.kvae_spatial_norm import is_pointwise_conv
from k6serve.speed.phase_fold import (
    BIAS_BUFFER,
    MAX_CONV_OUTPUT_ELEMENTS,
    WEIGHT_BUFFER,
    accumulation_dtype,
    phase_taps,
    route_folded,
)

if TYPE_CHECKING:
    from diffusers.models.autoencoders.autoencoder_kandinsky6_sr import Kandinsky6SRUpsample

__all__ = ["apply_subpixel_upsample", "folded_upsample", "folded_upsampler_kernel", "phase_taps"]


def folded_upsampler_kernel(spatial_conv: nn.Conv3d, linear: nn.Conv3d) -> tuple[Tensor, Tensor]:
    """The (4C, C, 1, 2, 2) kernel and (4C,) bias of `linear(up(x) + spatial_conv(up(x)))` as one convolution of `x`
    zero-padded by one: output channels [p * C, (p + 1) * C) are phase p = 2a + b. Folded in fp32 (fp64 for fp64
    weights), rounded once; channels-last when the spatial kernel is."""
    channels = spatial_conv.out_channels
    dtype = accumulation_dtype(spatial_conv.weight)
    mix = linear.weight.to(dtype).reshape(linear.out_channels, linear.in_channels)  # L
    identity = torch.eye(channels, dtype=dtype, device=mix.device)
    kernels = []
    for phase, taps in enumerate(phase_taps(spatial_conv.weight)):
        a, b = divmod(phase, 2)
        taps = taps.clone()
        taps[:, :, 0, 1 - a, 1 - b] += identity  # up(x) at (2i + a, 2j + b) is x[i, j]: tap (1 - a, 1 - b)
        kernels.append(torch.einsum("om,mikl->oikl", mix, taps[:, :, 0]).unsqueeze(2))
    bias = mix @ _bias(spatial_conv, dtype) + _bias(linear, dtype)
    weight = torch.cat(kernels).to(spatial_conv.weight.dtype)
    source = spatial_conv.weight
    if source.is_contiguous(memory_format=torch.channels_last_3d) and not source.is_contiguous():
        # Beside channels-last decoder weights cuDNN runs NDHWC; an NCDHW kernel would bring its input and output
        # transposes back (0.33 s per tile before that change).
        weight = weight.contiguous(memory_format=torch.channels_last_3d)
    return weight, bias.repeat(4).to(spatial_conv.weight.dtype)


def _bias(conv: nn.Conv3d, dtype: torch.dtype) -> Tensor:
    if conv.bias is None:
        return torch.zeros(conv.out_channels, dtype=dtype, device=conv.weight.device)
    return conv.bias.to(dtype)


def folded_upsample(x_BCTHW: Tensor, weight: Tensor, bias: Tensor) -> Tensor:
    """The folded upsampler on `x`: (B, C, T, H, W) -> (B, C, T, 2H, 2W), laid out channels-last (the layout of
    the next convolution's input beside channels-last weights; the values do not depend on it)."""
    batch, channels, frames, height, width = x_BCTHW.shape
    per_frame = 4 * channels * (height + 1) * (width + 1) * batch
    step = max(1, MAX_CONV_OUTPUT_ELEMENTS // per_frame)
    # A (1, 2, 2) kernel mixes no frames: split along time where the output would pass cuDNN's 32-bit indexing.
    phases = torch.cat([F.conv3d(chunk, weight, bias, padding=(0, 1, 1)) for chunk in x_BCTHW.split(step, dim=2)],
                       dim=2)
    # (B, 4C, T, H + 1, W + 1) viewed channels-last as (B, T, H + 1, W + 1, a, b, C); phase (a, b) starts at (a, b).
    phases = phases.permute(0, 2, 3, 4, 1).unflatten(-1, (2, 2, channels))
    rows = [torch.stack([phases[:, :, a : a + height, b : b + width, a, b] for b in (0, 1)], dim=-2) for a in (0, 1)]
    interleaved = torch.stack(rows, dim=3)  # (B, T, H, a, W, b, C): pixel (2i + a, 2j + b)
    return interleaved.reshape(batch, frames, 2 * height, 2 * width, channels).permute(0, 4, 1, 2, 3)


def _folded_forward(self, hidden_states: Tensor, cache: dict) -> Tensor:
    if self.compress_time:  # diffusers' Kandinsky6SRUpsample.forward, unchanged
        repeated = hidden_states.repeat_interleave(2, dim=2)
        if cache["temporal_conv"]["padding"] is None:
            repeated = repeated[:, :, 1:]
        conv_out = self.temporal_conv(repeated, cache["temporal_conv"])
        hidden_states = conv_out + repeated
    return folded_upsample(hidden_states, getattr(self, WEIGHT_BUFFER), getattr(self, BIAS_BUFFER))


def _is_upsampler(module: nn.Module) -> TypeGuard[Kandinsky6SRUpsample]:
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
        and conv.in_channels == conv.out_channels  # the residual up(x) + conv(up(x))
    )


def _folds(linear: nn.Module, channels: int) -> bool:
    # A 1x1x1 convolution, C -> C: the interleave keeps C channels.
    return is_pointwise_conv(linear) and linear.in_channels == linear.out_channels == channels


def apply_subpixel_upsample(decoder: nn.Module) -> int:
    """Route every `Kandinsky6SRUpsample` of `decoder` through the folded upsampler, in place; returns how many.

    Idempotent. Parameters and state-dict names are untouched: the folded kernel and bias are non-persistent
    buffers, computed now from the current weights; on an upsampler already routed here they are computed again
    (so applying it again after the weights changed refreshes them; only newly routed upsamplers are counted). An
    upsampler whose spatial convolution is not the zero-padded (1, 3, 3) one or whose `linear` is not a 1x1x1
    convolution is left as it is.
    """
    return route_folded(
        decoder,
        is_upsampler=_is_upsampler,
        fits=lambda module: _fits(module.spatial_conv) and _folds(module.linear, module.spatial_conv.out_channels),
        folded_kernel=lambda module: folded_upsampler_kernel(module.spatial_conv, module.linear),
        forward=_folded_forward,
    )
