"""What the folded-upsampler rewrites share (speed/kvae_upsample.py for the SR K-VAE, speed/hunyuan_upsample.py for
HunyuanVideo): a 3-tap kernel read after a 2x nearest upsampling is, per output phase, a 2-tap kernel of the source;
the folded taps are summed in fp32 and rounded once; cuDNN's 32-bit output bound; and routing each fitting
upsampler through its folded forward, with the folded kernel kept in non-persistent buffers.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeGuard, TypeVar

import torch
from torch import Tensor, nn

# What the released diffusers modules split their convolutions at (`CONV_CHUNK_ELEMENTS`): cuDNN indexes with 32 bits.
MAX_CONV_OUTPUT_ELEMENTS = 2 * 10**9
WEIGHT_BUFFER, BIAS_BUFFER = "_k6serve_phase_weight", "_k6serve_phase_bias"

_Upsampler = TypeVar("_Upsampler", bound=nn.Module)


def accumulation_dtype(tensor: Tensor) -> torch.dtype:
    return torch.promote_types(tensor.dtype, torch.float32)


def two_tap_phases(weight: Tensor, dim: int) -> tuple[Tensor, Tensor]:
    """Along `dim`, the taps (W0, W1, W2) read after a 2x nearest upsampling, per output phase: phase 0 (output
    2i) reads source (i - 1, i) with (W0, W1 + W2), phase 1 (output 2i + 1) reads (i, i + 1) with (W0 + W1, W2)."""
    first, middle, last = (weight.narrow(dim, index, 1) for index in range(3))
    return torch.cat((first, middle + last), dim=dim), torch.cat((first + middle, last), dim=dim)


def phase_taps(weight_OI_33: Tensor) -> list[Tensor]:
    """The four (..., 2, 2) kernels of spatial phases (a, b) = (0, 0), (0, 1), (1, 0), (1, 1) of a (..., 3, 3)
    kernel applied to a 2x nearest-upsampled image, summed in fp32 (fp64 for fp64 weights) and not rounded."""
    w = weight_OI_33.to(accumulation_dtype(weight_OI_33))
    return [columns for rows in two_tap_phases(w, -2) for columns in two_tap_phases(rows, -1)]


def route_folded(decoder: nn.Module, *, is_upsampler: Callable[[nn.Module], TypeGuard[_Upsampler]],
                 fits: Callable[[_Upsampler], bool], folded_kernel: Callable[[_Upsampler], tuple[Tensor, Tensor]],
                 forward: Callable) -> int:
    """Route every upsampler of `decoder` that `fits` through `forward`, in place, with `folded_kernel(module)`
    stored as non-persistent buffers (state-dict names untouched); returns how many were newly routed.

    Idempotent: on an upsampler already routed here the kernel is computed again, so applying it again after the
    weights changed refreshes the buffers. A module whose `forward` someone else replaced is left alone.
    """
    count = 0
    for module in decoder.modules():
        if not is_upsampler(module):
            continue
        routed = getattr(vars(module).get("forward"), "__func__", None) is forward
        if not routed and ("forward" in vars(module) or not fits(module)):
            continue
        with torch.no_grad():
            weight, bias = folded_kernel(module)
        module.register_buffer(WEIGHT_BUFFER, weight, persistent=False)
        module.register_buffer(BIAS_BUFFER, bias, persistent=False)
        if not routed:
            module.forward = forward.__get__(module)
            count += 1
    return count
