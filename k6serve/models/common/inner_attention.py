"""`InnerAttention`: the weightless attention core that parallelism swaps from outside.

Shape legend: B batch, L query length, S key length, H heads, D head dim.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn

from k6serve.ops.attention import TORCH_SDPA, attention, canonical_backend_name


class InnerAttention(nn.Module):
    """Calls `k6serve.ops.attention` on projected, normed and rotated Q/K/V.

    `role` names which attention this is (e.g. "video_self", "audio_from_video") so a sequence-parallel
    applier can swap exactly the modules whose inputs are sharded; `backend` is the resolved kernel name.
    """

    def __init__(self, role: str, backend: str = TORCH_SDPA):
        super().__init__()
        self.role = role
        self.backend = canonical_backend_name(backend)

    def forward(
        self,
        query_BLHD: Tensor,
        key_BSHD: Tensor,
        value_BSHD: Tensor,
        key_mask_BS: Tensor | None = None,
    ) -> Tensor:
        return attention(
            query_BLHD, key_BSHD, value_BSHD, key_mask_BL=key_mask_BS, backend=self.backend
        )

    def prepare_key_value(self, key_BSHD: Tensor, value_BSHD: Tensor) -> PreparedKeyValue:
        """K/V computed before their query exists. Kept as they are here; a parallel replacement may start moving
        them (e.g. an asynchronous all-gather) so the transfer runs beside the work done before `attend_prepared`."""
        return key_BSHD, value_BSHD

    def attend_prepared(
        self, query_BLHD: Tensor, prepared: PreparedKeyValue, key_mask_BS: Tensor | None = None
    ) -> Tensor:
        """Attention of `query_BLHD` over K/V from `prepare_key_value`."""
        key_BSHD, value_BSHD = prepared
        return self(query_BLHD, key_BSHD, value_BSHD, key_mask_BS)

    def prepare_query_key_value(
        self, query_BLHD: Tensor, key_BSHD: Tensor, value_BSHD: Tensor, key_mask_BS: Tensor | None = None
    ) -> PreparedQueryKeyValue:
        """Q/K/V of a self-attention handed over before the model queues other work (kept as they are here; a
        sequence-parallel core starts its exchange, so that work runs beside it)."""
        return query_BLHD, key_BSHD, value_BSHD, key_mask_BS

    def attend_prepared_query_key_value(self, prepared: PreparedQueryKeyValue) -> Tensor:
        return self(*prepared)

    def extra_repr(self) -> str:
        return f"role={self.role}, backend={self.backend}"


# What `prepare_key_value` returns: a (key, value) pair, or a parallel replacement's handle to one in transit.
PreparedKeyValue = Any
# What `prepare_query_key_value` returns: (query, key, value, key mask), or a parallel replacement's exchange.
PreparedQueryKeyValue = Any
