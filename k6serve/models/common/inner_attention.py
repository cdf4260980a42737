"""`InnerAttention`: the weightless attention core that parallelism swaps from outside.

Shape legend: B batch, L query length, S key length, H heads, D head dim.
"""

from __future__ import annotations

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

    def extra_repr(self) -> str:
        return f"role={self.role}, backend={self.backend}"
