"""Fused attention projections: one GEMM for Q/K/V (self-attention) or K/V (cross-attention).

Covers both Kandinsky 6 DiTs. `apply_fused_projections(model)` replaces, in a loaded model,
* every `Kandinsky6Attention` of the generation DiT by a `FusedProjectionAttention` (Q/K/V fused for
  self-attention, K/V for cross-attention), and
* every `SelfAttention` of the SR DiT (`kandinsky6_sr/transformer.py`) by a `FusedSRSelfAttention` (Q/K/V),
each owning one concatenated `nn.Linear` instead of two or three. The norms, the output projection and the
`InnerAttention` core are the *same module objects*, so attention backends, roles and sequence-parallel swaps
keep working. The forward is the reference forward op for op except that the projections run as one GEMM
whose output is split: in fp32 on CPU that differs from the separate GEMMs by rounding only
(tests/unit/test_speed_transforms.py, <= 1e-5 relative); in bf16 each output element is still one
fp32-accumulated dot product rounded once, so differences come only from the GEMM kernel's reduction order.

Fuse *after* loading weights: the fused module's state dict holds `to_query_key_value.*` /
`to_key_value.*` instead of `to_query/to_key/to_value.*`. Tensor-parallel (DTensor) weights are left
alone: their column shards cannot be concatenated locally.

Shape legend: B batch; L query tokens; S key tokens; D model dim; N heads; K head dim.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from k6serve.models.kandinsky6.attention import Kandinsky6Attention
from k6serve.models.kandinsky6_sr.transformer import SelfAttention as SRSelfAttention
from k6serve.ops import rms_norm_rope as norm_rope_op


def _concatenate_linears(*linears: nn.Linear) -> nn.Linear:
    """One Linear whose output is the concatenation of `linears`' outputs (same input, dtype, device)."""
    first = linears[0]
    weight = torch.cat([linear.weight.detach() for linear in linears], dim=0)
    has_bias = first.bias is not None
    assert all((linear.bias is not None) == has_bias for linear in linears)
    with torch.device("meta"):
        fused = nn.Linear(first.in_features, weight.shape[0], bias=has_bias)
    fused.weight = nn.Parameter(weight, requires_grad=False)
    if has_bias:
        fused.bias = nn.Parameter(
            torch.cat([linear.bias.detach() for linear in linears]), requires_grad=False
        )
    return fused


def _norm_rope(heads_BLNK: Tensor, norm: nn.RMSNorm, rope: Tensor, *, norm_dtype: torch.dtype | None = None) -> Tensor:
    """`apply_rotary(norm(heads.to(norm_dtype)).type_as(heads), rope)` through the fused op (eps as torch resolves
    None for that input dtype)."""
    norm_dtype = norm_dtype or heads_BLNK.dtype
    eps = norm_rope_op.default_eps(norm.eps, norm_dtype)
    return norm_rope_op.rms_norm_rope(heads_BLNK, norm.weight, eps, rope, norm_dtype)


class FusedProjectionAttention(Kandinsky6Attention):
    """`Kandinsky6Attention` with Q/K/V (self) or K/V (cross) computed by one concatenated GEMM.

    Only `project` (self) and `project_key_value` (cross) differ; the head split, norms, RoPE, attention core and
    output are the parent's.
    """

    def __init__(self, attention: Kandinsky6Attention, *, is_self_attention: bool):
        nn.Module.__init__(self)  # the parent's __init__ would allocate fresh projections
        self.head_dim = attention.head_dim
        self.num_heads = attention.num_heads
        self.num_channels = attention.to_query.out_features
        self.is_self_attention = is_self_attention
        if is_self_attention:
            self.to_query_key_value = _concatenate_linears(
                attention.to_query, attention.to_key, attention.to_value
            )
        else:
            self.to_query = attention.to_query
            self.to_key_value = _concatenate_linears(attention.to_key, attention.to_value)
        self.query_norm = attention.query_norm
        self.key_norm = attention.key_norm
        self.out_layer = attention.out_layer
        self.inner_attention = attention.inner_attention
        # Set by `apply_fused_norm_rope`: the per-head RMSNorm and RoPE of Q and K as one Triton kernel on CUDA.
        self.fused_norm_rope = False

    def _query_heads(self, query_BLD: Tensor, query_rope: Tensor | None) -> Tensor:
        heads_BLNK = query_BLD.unflatten(-1, (-1, self.head_dim))
        # (`supports` is False without a rope; the explicit test tells mypy.)
        if self.fused_norm_rope and query_rope is not None and norm_rope_op.supports(
                heads_BLNK, self.query_norm.weight, query_rope):
            return _norm_rope(heads_BLNK, self.query_norm, query_rope)
        return super()._query_heads(query_BLD, query_rope)

    def _key_value_heads(
        self, key_BSD: Tensor, value_BSD: Tensor, key_rope: Tensor | None
    ) -> tuple[Tensor, Tensor]:
        heads_BSNK = key_BSD.unflatten(-1, (-1, self.head_dim))
        if self.fused_norm_rope and key_rope is not None and norm_rope_op.supports(
                heads_BSNK, self.key_norm.weight, key_rope):
            return _norm_rope(heads_BSNK, self.key_norm, key_rope), value_BSD.unflatten(-1, (-1, self.head_dim))
        return super()._key_value_heads(key_BSD, value_BSD, key_rope)

    def project(self, x_BLD: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        # Split views are strided; every later op accepts them.
        assert self.is_self_attention, "project() is the self-attention path"
        return self.to_query_key_value(x_BLD).split(self.num_channels, dim=-1)

    def project_key_value(self, context_BSD: Tensor) -> tuple[Tensor, Tensor]:
        assert not self.is_self_attention, "project_key_value() is the cross-attention path"
        key_BSD, value_BSD = self.to_key_value(context_BSD).split(self.num_channels, dim=-1)
        return key_BSD, value_BSD

    def extra_repr(self) -> str:
        kind = "qkv" if self.is_self_attention else "q + kv"
        return f"fused={kind}, heads={self.num_heads}x{self.head_dim}"


class FusedSRSelfAttention(SRSelfAttention):
    """The SR DiT's `SelfAttention` with Q/K/V computed by one concatenated GEMM.

    Only `project` differs; norms, RoPE, attention core and output are the parent's `forward`.
    """

    def __init__(self, attention: SRSelfAttention):
        nn.Module.__init__(self)  # the parent's __init__ would allocate fresh projections
        self.num_heads = attention.num_heads
        self.head_dim = attention.head_dim
        self.num_channels = attention.to_query.out_features
        self.to_query_key_value = _concatenate_linears(
            attention.to_query, attention.to_key, attention.to_value
        )
        self.query_norm = attention.query_norm
        self.key_norm = attention.key_norm
        self.inner_attention = attention.inner_attention
        self.out_layer = attention.out_layer
        self.fused_norm_rope = False  # see FusedProjectionAttention

    def project(self, x_BLD: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        # Split views are strided; every later op accepts them.
        return self.to_query_key_value(x_BLD).split(self.num_channels, dim=-1)

    def normed_rotated_heads(self, x_BLD: Tensor, norm: nn.RMSNorm, rope: Tensor) -> Tensor:
        heads_BLNK = x_BLD.unflatten(-1, (-1, self.head_dim))
        if self.fused_norm_rope and norm_rope_op.supports(heads_BLNK, norm.weight, rope):
            return _norm_rope(heads_BLNK, norm, rope, norm_dtype=torch.float32)  # the SR norm runs on fp32 input
        return super().normed_rotated_heads(x_BLD, norm, rope)

    def extra_repr(self) -> str:
        return f"fused=qkv, heads={self.num_heads}x{self.head_dim}"


_FUSED = (FusedProjectionAttention, FusedSRSelfAttention)


def _is_plain_tensor(parameter: Tensor) -> bool:
    # DTensor (tensor parallel) and meta parameters cannot be concatenated into a local weight.
    return type(parameter.data) is Tensor and not parameter.is_meta


def _is_fusable(module: nn.Module) -> bool:
    """An attention of either DiT, not fused yet, whose projection weights are plain local tensors."""
    return (
        isinstance(module, (Kandinsky6Attention, SRSelfAttention))
        and not isinstance(module, _FUSED)
        and all(
            _is_plain_tensor(linear.weight)
            for linear in (module.to_query, module.to_key, module.to_value)
        )
    )


def _fused(attention: Kandinsky6Attention | SRSelfAttention) -> nn.Module:
    if isinstance(attention, SRSelfAttention):
        return FusedSRSelfAttention(attention)
    # The generation DiT only ever calls `*_self` roles without a context.
    is_self = attention.inner_attention.role.endswith("_self")
    return FusedProjectionAttention(attention, is_self_attention=is_self)


def apply_fused_norm_rope(model: nn.Module) -> int:
    """Route the per-head RMSNorm + RoPE of Q and K of every fused attention (generation and SR DiT) through the fused
    kernel (`k6serve.ops.rms_norm_rope`); returns how many attentions. Run after `apply_fused_projections`.

    Each call still falls back to the model's own ops where the kernel does not apply (CPU, no RoPE, no triton).
    Part of `--performance-mode speed` (`K6SERVE_FUSED_NORM_ROPE=0` leaves it out; speed/performance_mode.py).
    """
    attentions = [module for module in model.modules() if isinstance(module, _FUSED)]
    for attention in attentions:
        attention.fused_norm_rope = True
    return len(attentions)


def apply_fused_projections(model: nn.Module) -> int:
    """Fuse the projections of every generation or SR DiT attention in `model`, in place; returns how many.

    Idempotent: already fused modules are skipped, and so are tensor-parallel (DTensor) or meta weights.
    """
    targets = [(name, module) for name, module in model.named_modules() if _is_fusable(module)]
    for name, attention in targets:
        parent_name, _, child_name = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        # One module at a time, so the extra memory is one module's projection weights.
        setattr(parent, child_name, _fused(attention))
    return len(targets)
