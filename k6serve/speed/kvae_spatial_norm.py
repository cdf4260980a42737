"""The SR K-VAE's latent-conditioned norms with their 1x1x1 convolutions moved before the upsampling.

diffusers' `Kandinsky6SRSpatialNorm3D` nearest-upsamples the latent `zq` (16 channels) to every feature grid of the
decoder and then runs two 1x1x1 convolutions on it (`conv_y`, `conv_b`: 16 -> C channels), so each norm writes and
reads back two C-channel tensors at the full feature resolution (at the top level of a 512x768 tile: 128 channels
x 16 frames x 512 x 768 per segment, ~1.6 GB each). A 1x1x1 convolution is the same dot product at every position,
and nearest upsampling only repeats positions, so the two commute exactly: convolving the latent-resolution `zq`
first and upsampling the two results gives the same values (each output value is the same 16-term dot product
plus bias, rounded once to the conv dtype). Under `torch.compile` the upsampling of the results then becomes an
index computation inside the fused norm * y + b kernel: the convolutions run on 16 x 16 x 4-times fewer positions
at the top level and the two full-resolution tensors are never written. The compiled bf16 graph is a different
graph, though, and inductor may fuse and round it differently (the tiny CPU K-VAE in bf16: 26 uint8 levels from
eager against 22 for the default compiled decode; bit for bit in fp32 and eager). Eager gains nothing (the upsampled
results are materialised either way), so this is applied only beside the compiled decoder blocks (speed/vae.py;
`K6SERVE_KVAE_COMMUTED_NORMS=0` leaves it out). Measured on one H200 (`gpu_profile.py kvae --channels-last
--commuted-norms`, sixth session): one 512x768 tile decodes in 1.878 s against 1.952 s, with the same 15-level
maximum distance from the eager bf16 decode on random weights.

The segment and first-frame logic (the first segment's first frame is upsampled on its own, because the temporal
upsampler turns T + 1 latent frames into 2T + 1 frames) is diffusers', applied to the convolved tensors; the
channel chunking of diffusers' interpolation (a peak-memory device for eager) is dropped, which changes no value.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, TypeGuard, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

if TYPE_CHECKING:
    from diffusers.models.autoencoders.autoencoder_kandinsky6_sr import Kandinsky6SRSpatialNorm3D


def _nearest_like(conditioning: Tensor, hidden_states: Tensor, first_segment: bool) -> Tensor:
    """diffusers' upsampling of `zq` to `hidden_states`' (T, H, W) grid (first frame apart in the first segment)."""
    if not first_segment:
        return F.interpolate(conditioning, size=hidden_states.shape[-3:], mode="nearest")
    first = F.interpolate(conditioning[:, :, :1], size=hidden_states[:, :, :1].shape[-3:], mode="nearest")
    if conditioning.size(2) == 1:
        return first
    rest = F.interpolate(conditioning[:, :, 1:], size=hidden_states[:, :, 1:].shape[-3:], mode="nearest")
    return torch.cat([first, rest], dim=2)


def _commuted_forward(self, hidden_states: Tensor, zq: Tensor, cache: dict) -> Tensor:
    first_segment = cache["is_first_segment"]
    scale = _nearest_like(self.conv_y(zq), hidden_states, first_segment)
    shift = _nearest_like(self.conv_b(zq), hidden_states, first_segment)
    output = self.norm_layer(hidden_states) * scale + shift
    cache["is_first_segment"] = False
    return output


def _is_spatial_norm(module: nn.Module) -> bool:
    # By name: diffusers' class, without importing diffusers here (the SR K-VAE module comes from it).
    return type(module).__name__ == "Kandinsky6SRSpatialNorm3D"


def is_pointwise_conv(conv: nn.Module) -> TypeGuard[nn.Conv3d]:
    """A plain 1x1x1 convolution: the same dot product at every position (also used by speed/kvae_upsample.py)."""
    return (
        isinstance(conv, nn.Conv3d)
        and conv.kernel_size == (1, 1, 1)
        and conv.stride == (1, 1, 1)
        and conv.padding in ((0, 0, 0), "valid")
        and conv.dilation == (1, 1, 1)
        and conv.groups == 1
    )


def apply_commuted_spatial_norms(decoder: nn.Module) -> int:
    """Route every `Kandinsky6SRSpatialNorm3D` of `decoder` through `_commuted_forward`, in place; returns how many.

    Idempotent. Parameters, buffers and state-dict names are untouched (only the instance's `forward` changes).
    A norm whose convolutions are not plain 1x1x1 (no commuting then) is left as it is.
    """
    count = 0
    for module in decoder.modules():
        if not _is_spatial_norm(module) or "forward" in vars(module):
            continue
        norm = cast("Kandinsky6SRSpatialNorm3D", module)  # told by its class name (`_is_spatial_norm`)
        if not (is_pointwise_conv(norm.conv_y) and is_pointwise_conv(norm.conv_b)):
            continue
        module.forward = _commuted_forward.__get__(module)
        count += 1
    return count
