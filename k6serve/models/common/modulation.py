"""AdaLN pieces: the modulation projection and the fp32 scale/shift and gated-residual helpers.

Both helpers compute in fp32 and cast back to the residual stream's dtype, exactly as diffusers does
(k6-generation.md §2.1). With an fp32 residual stream the cast back is a no-op.

Shape legend: B batch, D model dim, E time-embedding dim.
"""

from __future__ import annotations

from torch import Tensor, nn


def _broadcast_condition(condition_BD: Tensor, x: Tensor) -> Tensor:
    """View a per-sample (B, D) condition as (B, 1, ..., 1, D) to broadcast over x's token dims."""
    if x.ndim > 2 and condition_BD.ndim == 2:
        return condition_BD.reshape(
            (condition_BD.shape[0],) + (1,) * (x.ndim - 2) + (condition_BD.shape[-1],)
        )
    return condition_BD


def apply_scale_shift(normed: Tensor, x: Tensor, scale: Tensor, shift: Tensor) -> Tensor:
    """`normed * (1 + scale) + shift` in fp32, cast to x's dtype; `normed` is the caller's LN(x.float())."""
    scale, shift = _broadcast_condition(scale, x), _broadcast_condition(shift, x)
    return (normed * (scale.float() + 1.0) + shift.float()).to(dtype=x.dtype)


def apply_gate_sum(x: Tensor, out: Tensor, gate: Tensor) -> Tensor:
    """Gated residual `x + gate * out` in fp32, cast to x's dtype."""
    gate = _broadcast_condition(gate, x)
    return (x.float() + gate.float() * out.float()).to(dtype=x.dtype)


class Modulation(nn.Module):
    """AdaLN projection `Linear(SiLU(t))` with `num_params * model_dim` outputs.

    The input is cast to the weight dtype *before* the SiLU: that matters for the projections kept in
    fp32 after a bf16 load, whose SiLU then runs in fp32.
    """

    def __init__(self, time_dim: int, model_dim: int, num_params: int):
        super().__init__()
        self.activation = nn.SiLU()
        self.out_layer = nn.Linear(time_dim, num_params * model_dim)

    def forward(self, time_embed_BE: Tensor) -> Tensor:
        return self.out_layer(self.activation(time_embed_BE.to(self.out_layer.weight.dtype)))
