"""The SR K-VAE decoder's causal convolutions as one convolution per segment instead of two.

diffusers' `Kandinsky6SRCausalConv3d` pads the segment spatially, then convolves its first `time_pad` output frames
from `cat(carried padding, first frames)` and the rest from the segment alone, and writes both into a fresh output
tensor. With a time stride of 1 those are the windows of one convolution over `cat(carried padding, segment)`: the
same products and sums for every output frame, so this runs that single convolution, and carries the same padding
(the last `time_pad` frames of the concatenation, which is what diffusers keeps in both of its cases). Why: the
second, 2-frame convolution per causal convolution is a separate cuDNN launch on a thin input (an eighth of the
frames of a 16-frame segment at a lower rate than the big one), and the output is no longer assembled from two
pieces. Under `torch.compile` the norm/SiLU/pad kernel before each convolution writes straight into the
concatenation. Measured on one H200 (eighth session, `gpu_profile.py kvae`): the compiled 512x768x121 tile decode
1.568 -> 1.523 s with the folded upsamplers (speed/kvae_upsample.py).

Numerics: the same sums; a different convolution shape may make cuDNN pick another algorithm, so bf16 outputs can
differ by rounding (fp32 on CPU: within 1e-5 relative of diffusers, tests/unit/test_kvae_causal_conv.py). So it sits
only beside the compiled decoder, like the other decode rewrites (speed/vae.py; `K6SERVE_KVAE_SINGLE_CAUSAL_CONV=0`
leaves it out). The cache format is diffusers' (spatially padded frames), so the rewritten and the original forward
can even share a cache chain. Only time-stride-1 convolutions are rewritten (the decoder has no other; the
encoder's strided downsamplers are not touched).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

if TYPE_CHECKING:
    from diffusers.models.autoencoders.autoencoder_kandinsky6_sr import Kandinsky6SRCausalConv3d


def _single_conv_forward(self, hidden_states: Tensor, cache: dict) -> Tensor:
    hidden_states = F.pad(hidden_states, (self.width_pad, self.width_pad, self.height_pad, self.height_pad))
    padding = cache["padding"]
    if padding is None:  # the first segment repeats its first frame, as diffusers does
        padding = hidden_states[:, :, :1].expand(-1, -1, self.time_pad, -1, -1)
    window = torch.cat([padding, hidden_states], dim=2) if self.time_pad else hidden_states
    cache["padding"] = window[:, :, window.size(2) - self.time_pad :].clone()
    return self.conv(window)


def _is_causal_conv(module: nn.Module) -> bool:
    # By name: diffusers' class, without importing diffusers here (the SR K-VAE module comes from it).
    return type(module).__name__ == "Kandinsky6SRCausalConv3d"


def _fits(module: nn.Module) -> bool:
    causal = cast("Kandinsky6SRCausalConv3d", module)  # told by its class name (`_is_causal_conv`)
    conv = causal.conv
    return (
        causal.time_stride == 1
        and causal.time_pad == causal.time_kernel_size - 1
        and isinstance(conv, nn.Conv3d)
        and conv.stride == (1, 1, 1)
        and conv.padding in ((0, 0, 0), "valid")
        and conv.dilation == (1, 1, 1)
    )


def apply_single_causal_conv(decoder: nn.Module) -> int:
    """Route every time-stride-1 `Kandinsky6SRCausalConv3d` of `decoder` through one convolution per segment, in
    place; returns how many. Idempotent; parameters and state-dict names are untouched."""
    count = 0
    for module in decoder.modules():
        if not _is_causal_conv(module) or "forward" in vars(module) or not _fits(module):
            continue
        module.forward = _single_conv_forward.__get__(module)
        count += 1
    return count
