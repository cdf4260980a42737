"""Timestep and video patch embeddings with diffusers' Kandinsky 6 parameter names.

Shape legend: B batch, T frames, H height, W width, C channels, D model dim.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn


def sinusoidal_timestep_embedding(
    timestep_B: Tensor, dim: int, max_period: float = 10000.0
) -> Tensor:
    """[cos | sin] of t * exp(-ln(max_period) * i / (dim/2)), fp32 (diffusers `Timesteps(dim, True, 0)`)."""
    half_dim = dim // 2
    exponent = -math.log(max_period) * torch.arange(
        start=0, end=half_dim, dtype=torch.float32, device=timestep_B.device
    )
    frequencies = torch.exp(exponent / half_dim)
    angles_BF = timestep_B[:, None].float() * frequencies[None, :]
    return torch.cat([torch.cos(angles_BF), torch.sin(angles_BF)], dim=-1)


class TimestepMLP(nn.Module):
    """Linear -> SiLU -> Linear; the `linear_1`/`linear_2` names of diffusers' `TimestepEmbedding`."""

    def __init__(self, in_dim: int, time_dim: int):
        super().__init__()
        self.linear_1 = nn.Linear(in_dim, time_dim)
        self.act = nn.SiLU()
        self.linear_2 = nn.Linear(time_dim, time_dim)

    def forward(self, x: Tensor) -> Tensor:
        return self.linear_2(self.act(self.linear_1(x)))


class TimeEmbeddings(nn.Module):
    """Sinusoid of the raw timestep (dimension `model_dim`) -> MLP to `time_dim`."""

    def __init__(self, model_dim: int, time_dim: int):
        super().__init__()
        if model_dim % 2:
            raise ValueError(f"model_dim must be even for the timestep sinusoid, got {model_dim}")
        self.model_dim = model_dim
        self.timestep_embedder = TimestepMLP(model_dim, time_dim)

    def forward(self, timestep_B: Tensor) -> Tensor:
        embed_BD = sinusoidal_timestep_embedding(timestep_B, self.model_dim)
        return self.timestep_embedder(embed_BD.to(self.timestep_embedder.linear_1.weight.dtype))


class PatchEmbeddings(nn.Module):
    """Patchify (B, T, H, W, C) latents into (B, T', H', W', pt*ph*pw*C) features, C fastest, then Linear."""

    def __init__(self, visual_dim: int, model_dim: int, patch_size: tuple[int, int, int]):
        super().__init__()
        self.patch_size = tuple(patch_size)
        self.in_layer = nn.Linear(math.prod(patch_size) * visual_dim, model_dim)

    def forward(self, latents_BTHWC: Tensor) -> Tensor:
        batch, num_frames, height, width, channels = latents_BTHWC.shape
        patch_t, patch_h, patch_w = self.patch_size
        patches_BTHWP = (
            latents_BTHWC.view(
                batch,
                num_frames // patch_t,
                patch_t,
                height // patch_h,
                patch_h,
                width // patch_w,
                patch_w,
                channels,
            )
            .permute(0, 1, 3, 5, 2, 4, 6, 7)
            .flatten(4, 7)
        )
        return self.in_layer(patches_BTHWP)
