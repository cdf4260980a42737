"""Video output head: AdaLN (shift, scale) -> Linear -> unpatchify (k6-generation.md §2.6).

Shape legend: B batch, T/H/W token grid, D model dim, E time-embedding dim, C output channels, pt/ph/pw patch
sizes, P = C*pt*ph*pw the linear's outputs.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from k6serve.models.common.modulation import Modulation, apply_scale_shift


class VideoOutLayer(nn.Module):
    """Projects (B, T, H, W, D) tokens to (B, T*pt, H*ph, W*pw, C) latents.

    The linear output is read channel-major, (C, pt, ph, pw): the opposite of the patchify input order.
    """

    def __init__(
        self, model_dim: int, time_dim: int, visual_dim: int, patch_size: tuple[int, int, int]
    ):
        super().__init__()
        self.patch_size = tuple(patch_size)
        self.modulation = Modulation(time_dim, model_dim, 2)
        self.norm = nn.LayerNorm(model_dim, elementwise_affine=False)
        self.out_layer = nn.Linear(model_dim, math.prod(patch_size) * visual_dim)

    def forward(self, tokens_BTHWD: Tensor, time_embed_BE: Tensor) -> Tensor:
        shift, scale = torch.chunk(self.modulation(time_embed_BE), 2, dim=-1)
        x_BTHWD = apply_scale_shift(self.norm(tokens_BTHWD.float()), tokens_BTHWD, scale, shift)
        x_BTHWP = self.out_layer(x_BTHWD)
        batch, num_frames, height, width = x_BTHWP.shape[:4]
        patch_t, patch_h, patch_w = self.patch_size
        return (
            x_BTHWP.view(batch, num_frames, height, width, -1, patch_t, patch_h, patch_w)
            .permute(0, 1, 5, 2, 6, 3, 7, 4)
            .flatten(1, 2)
            .flatten(2, 3)
            .flatten(3, 4)
        )
