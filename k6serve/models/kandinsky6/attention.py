"""The Kandinsky 6 generation DiT's attention module (`Kandinsky6Attention`), diffusers' `Kandinsky6Attention` under
the same parameter names: Q/K/V projections, per-head RMSNorm, RoPE, an `InnerAttention` core (whose `role` names the
site for the parallel plans) and the output projection. Shape legend: transformer.py's."""

from __future__ import annotations

from torch import Tensor, nn

from k6serve.models.common.inner_attention import (
    InnerAttention,
    PreparedKeyValue,
    PreparedQueryKeyValue,
)
from k6serve.models.common.rope import apply_rotary


class Kandinsky6Attention(nn.Module):
    """Q/K/V projections (with bias), per-head RMSNorm, optional RoPE, `InnerAttention`, output projection."""

    def __init__(self, num_channels: int, head_dim: int, role: str, kv_dim: int | None = None):
        super().__init__()
        if num_channels % head_dim:
            raise ValueError(
                f"num_channels {num_channels} must be divisible by head_dim {head_dim}"
            )
        kv_dim = kv_dim or num_channels
        self.head_dim = head_dim
        self.num_heads = num_channels // head_dim
        self.to_query = nn.Linear(num_channels, num_channels)
        self.to_key = nn.Linear(kv_dim, num_channels)
        self.to_value = nn.Linear(kv_dim, num_channels)
        # eps=None, as the reference: torch then uses its fp32 compute type's epsilon (1.2e-7), also for bf16 input.
        self.query_norm = nn.RMSNorm(head_dim)
        self.key_norm = nn.RMSNorm(head_dim)
        self.out_layer = nn.Linear(num_channels, num_channels)
        self.inner_attention = InnerAttention(role)

    def project(self, x_BLD: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Q, K, V of a self-attention before the head split (the speed transforms replace the projections)."""
        return self.to_query(x_BLD), self.to_key(x_BLD), self.to_value(x_BLD)

    def project_key_value(self, context_BSD: Tensor) -> tuple[Tensor, Tensor]:
        """K, V of a cross-attention context before the head split."""
        return self.to_key(context_BSD), self.to_value(context_BSD)

    def forward(
        self,
        x_BLD: Tensor,
        context_BSD: Tensor | None = None,
        *,
        query_rope: Tensor | None = None,
        key_rope: Tensor | None = None,
        key_mask_BS: Tensor | None = None,
    ) -> Tensor:
        """Self-attention when `context_BSD` is None, else cross-attention with K/V from the context."""
        if context_BSD is not None:
            key_value = self.key_value(context_BSD, key_rope=key_rope)
            return self.attend(x_BLD, key_value, query_rope=query_rope, key_mask_BS=key_mask_BS)
        return self.finish_self(
            self.start_self(x_BLD, query_rope=query_rope, key_rope=key_rope, key_mask_BS=key_mask_BS)
        )

    def start_self(
        self,
        x_BLD: Tensor,
        *,
        query_rope: Tensor | None = None,
        key_rope: Tensor | None = None,
        key_mask_BS: Tensor | None = None,
    ) -> PreparedQueryKeyValue:
        """Self-attention up to its core: Q/K/V heads handed to the core's `prepare_query_key_value` (where a
        sequence-parallel core starts its exchange); `finish_self` completes it. Work queued between the two runs
        beside that exchange."""
        query_BLD, key_BSD, value_BSD = self.project(x_BLD)
        query_BLNK = self._query_heads(query_BLD, query_rope)
        key_BSNK, value_BSNK = self._key_value_heads(key_BSD, value_BSD, key_rope)
        return self.inner_attention.prepare_query_key_value(query_BLNK, key_BSNK, value_BSNK, key_mask_BS)

    def finish_self(self, prepared: PreparedQueryKeyValue) -> Tensor:
        return self.out_layer(self.inner_attention.attend_prepared_query_key_value(prepared).flatten(-2, -1))

    def key_value(self, context_BSD: Tensor, *, key_rope: Tensor | None = None) -> PreparedKeyValue:
        """The K/V heads of a cross-attention context (projected, key-normed, rotated), computed ahead of the query
        and handed to the attention core's `prepare_key_value`; pass the result to `attend`."""
        key_BSNK, value_BSNK = self._key_value_heads(*self.project_key_value(context_BSD), key_rope)
        return self.inner_attention.prepare_key_value(key_BSNK, value_BSNK)

    def attend(
        self,
        x_BLD: Tensor,
        key_value: PreparedKeyValue,
        *,
        query_rope: Tensor | None = None,
        key_mask_BS: Tensor | None = None,
    ) -> Tensor:
        """Cross-attention of `x_BLD` over the K/V that `key_value` prepared."""
        query_BLNK = self._query_heads(self.to_query(x_BLD), query_rope)
        out_BLNK = self.inner_attention.attend_prepared(query_BLNK, key_value, key_mask_BS)
        return self.out_layer(out_BLNK.flatten(-2, -1))

    # Heads are read as (-1, head_dim) so tensor-parallel column shards need no attribute change.
    def _query_heads(self, query_BLD: Tensor, query_rope: Tensor | None) -> Tensor:
        query_BLNK = self.query_norm(query_BLD.unflatten(-1, (-1, self.head_dim)))
        return query_BLNK if query_rope is None else apply_rotary(query_BLNK, query_rope)

    def _key_value_heads(
        self, key_BSD: Tensor, value_BSD: Tensor, key_rope: Tensor | None
    ) -> tuple[Tensor, Tensor]:
        key_BSNK = self.key_norm(key_BSD.unflatten(-1, (-1, self.head_dim)))
        value_BSNK = value_BSD.unflatten(-1, (-1, self.head_dim))
        return (key_BSNK if key_rope is None else apply_rotary(key_BSNK, key_rope)), value_BSNK
