"""Feed-forward layer with diffusers' `FeedForward(activation_fn="gelu", bias=False)` parameter names."""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn


class GeluProjection(nn.Module):
    """Linear followed by exact (erf) GELU; holds the `proj` weight of diffusers' `GELU`."""

    def __init__(self, dim_in: int, dim_out: int):
        super().__init__()
        self.proj = nn.Linear(dim_in, dim_out, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return F.gelu(self.proj(x), approximate="none")


class FeedForward(nn.Module):
    """Linear(dim -> inner, no bias), GELU, Linear(inner -> dim, no bias).

    `net` mirrors diffusers' ModuleList so the keys are `net.0.proj.weight` and `net.2.weight`; index 1
    is diffusers' inference-time Dropout(0.0), kept as an Identity only to keep the indices.
    """

    def __init__(self, dim: int, inner_dim: int):
        super().__init__()
        self.net = nn.ModuleList(
            [GeluProjection(dim, inner_dim), nn.Identity(), nn.Linear(inner_dim, dim, bias=False)]
        )

    def forward(self, x: Tensor) -> Tensor:
        for layer in self.net:
            x = layer(x)
        return x
