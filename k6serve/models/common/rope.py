"""Rotary position embeddings on interleaved pairs, computed in fp32 (k6-generation.md §2.1, §2.3).

A rope table has shape (L, 1, D/2, 2, 2): per token and frequency pair the rotation matrix
[[cos, -sin], [sin, cos]], with a unit dim that broadcasts over heads. `apply_rotary` rotates
(x[2i], x[2i+1]) of a (B, L, H, D) tensor with it.

Tables are computed on the fly from positions instead of being stored as buffers, so a model built on
the meta device needs no re-initialisation. Only the tiny frequency vector (<= 64 values) is cached per
device; it is computed on the CPU with diffusers' exact formula and then moved, so the angles are
bitwise equal to diffusers' CPU-built buffers (`outer(arange, freq)[pos]` is one fp32 multiply per
element, the same as `pos * freq`).

Shape legend: L tokens, T/H/W latent grid sizes, D head dim.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

# Position limits of the reference tables: beyond them diffusers' buffers have no entries.
MAX_VIDEO_POSITIONS_PER_AXIS = 128
MAX_SEQUENCE_POSITIONS = 2048


def rope_frequencies(num_frequencies: int, max_period: float = 10000.0) -> Tensor:
    """Inverse frequencies exp(-ln(max_period) * i / n), i < n, in fp32 on the CPU."""
    # device="cpu" explicitly: a model may be built under `with torch.device("meta")`.
    positions = torch.arange(start=0, end=num_frequencies, dtype=torch.float32, device="cpu")
    return torch.exp(-math.log(max_period) * positions / num_frequencies)


def apply_rotary(x: Tensor, rope: Tensor) -> Tensor:
    """Rotate interleaved pairs of x (..., D) by `rope` (..., D/2, 2, 2) in fp32, cast back to x's dtype."""
    x_pairs = x.reshape(*x.shape[:-1], -1, 1, 2).float()
    rope = rope.float()
    # The reference's `(rope * x_pairs).sum(-1)` written out as its two products and one addition: the same
    # fp32 arithmetic (bitwise on CPU), but pointwise, so a compiled block fuses it with the RMSNorm into one
    # elementwise kernel instead of a reduction over a length-2 axis (measured on H200: ~1.1 ms per Pro
    # query tensor as a reduction kernel).
    rotated = rope[..., 0] * x_pairs[..., 0] + rope[..., 1] * x_pairs[..., 1]
    return rotated.reshape(*x.shape).to(dtype=x.dtype)


def _rotation_table(angles: Tensor) -> Tensor:
    """(..., D/2) angles -> (..., 1, D/2, 2, 2) rotation matrices."""
    cos, sin = torch.cos(angles), torch.sin(angles)
    rope = torch.stack([cos, -sin, sin, cos], dim=-1)
    return rope.view(*rope.shape[:-1], 2, 2).unsqueeze(-4)


class _FrequencyCache:
    """Per-device copies of one CPU-computed frequency vector (not a buffer: see the module docstring)."""

    def __init__(self, frequencies: Tensor):
        self._cpu = frequencies
        self._by_device: dict[torch.device, Tensor] = {}

    def on(self, device: torch.device) -> Tensor:
        if device not in self._by_device:
            self._by_device[device] = self._cpu.to(device)
        return self._by_device[device]


class RotaryEmbedding1D(nn.Module):
    """1-D RoPE table for text and audio tokens; `freqs_scaling` compresses audio positions (0.144)."""

    def __init__(self, dim: int, max_period: float = 10000.0, freqs_scaling: float = 1.0):
        super().__init__()
        self.dim = dim
        self.freqs_scaling = freqs_scaling
        self._frequencies = _FrequencyCache(rope_frequencies(dim // 2, max_period) * freqs_scaling)

    def forward(self, positions_L: Tensor) -> Tensor:
        """Integer positions (L,) -> rope table (L, 1, D/2, 2, 2), fp32."""
        frequencies = self._frequencies.on(positions_L.device)
        angles_LF = positions_L.to(torch.float32)[:, None] * frequencies[None, :]
        return _rotation_table(angles_LF)


class RotaryEmbedding3D(nn.Module):
    """3-D RoPE for video tokens: per-axis tables concatenated as [t | h | w] for each (t, h, w) token."""

    def __init__(self, axes_dims: tuple[int, int, int], max_period: float = 10000.0):
        super().__init__()
        self.axes_dims = tuple(axes_dims)
        self._frequencies = [
            _FrequencyCache(rope_frequencies(dim // 2, max_period)) for dim in axes_dims
        ]

    def forward(
        self,
        positions: tuple[Tensor, Tensor, Tensor],
        scale_factor: tuple[float, float, float] = (1.0, 1.0, 1.0),
    ) -> Tensor:
        """Per-axis integer positions ((T,), (H,), (W,)) -> rope table (T, H, W, 1, D/2, 2, 2), fp32.

        Angles are divided by `scale_factor` per axis ((1, 2, 2) in Kandinsky 6: h and w positions halved).
        """
        num_frames, height, width = (int(axis_positions.shape[0]) for axis_positions in positions)
        angles_per_axis = [
            axis_positions.to(torch.float32)[:, None]
            * cache.on(axis_positions.device)[None, :]
            / axis_scale
            for axis_positions, cache, axis_scale in zip(positions, self._frequencies, scale_factor)
        ]
        angles_t, angles_h, angles_w = angles_per_axis
        angles_THWF = torch.cat(
            [
                angles_t.view(num_frames, 1, 1, -1).expand(num_frames, height, width, -1),
                angles_h.view(1, height, 1, -1).expand(num_frames, height, width, -1),
                angles_w.view(1, 1, width, -1).expand(num_frames, height, width, -1),
            ],
            dim=-1,
        )
        return _rotation_table(angles_THWF)
