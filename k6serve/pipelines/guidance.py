"""Classifier-free guidance combine, in the stream dtype exactly as the reference (P:914-917)."""

from __future__ import annotations

import torch


def cfg_combine(cond: torch.Tensor, uncond: torch.Tensor, scale: float) -> torch.Tensor:
    return uncond + scale * (cond - uncond)
