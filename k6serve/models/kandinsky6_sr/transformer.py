"""Kandinsky 6 video super-resolution DiT, plain single-device PyTorch.

Same math and state-dict keys as diffusers 0.42.1 `Kandinsky6SRTransformer3DModel` (k6-super-resolution.md §1.6,
§2.9), with the two k6serve choices of §0:
* dense attention (one `InnerAttention` call per block) instead of the checkpoint's NABLA sparse attention, so no
  "fractal" token permutation is needed: tokens stay in (t, y, x) row-major order;
* an fp32 residual stream: norms, modulation and gates run in fp32 and the residual is NOT cast back to the linear
  dtype after the gated add (seeds / SG / R choice; diffusers rounds it to bf16 after every add, T:76-80).
In fp32 both differences vanish up to attention summation order, which is what the parity test checks.

Shape legend: B batch (tiles), T latent frames, H/W latent tile height/width (after patching), L = T*H*W tokens,
D model_dim, E time_dim, N heads, K head_dim, C latent channels (in: 2*C+1, out: out_visual_dim), P = C*pt*ph*pw
the head's outputs (pt/ph/pw the patch sizes).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from k6serve.models.common.embeddings import PatchEmbeddings, TimeEmbeddings
from k6serve.models.common.feed_forward import FeedForward
from k6serve.models.common.inner_attention import InnerAttention
from k6serve.models.common.modulation import Modulation
from k6serve.models.common.rope import RotaryEmbedding3D, apply_rotary
from k6serve.models.kandinsky6_sr.config import SRTransformerConfig
from k6serve.ops.attention import canonical_backend_name


def modulate(normed_BLD: Tensor, shift_BD: Tensor, scale_BD: Tensor) -> Tensor:
    """AdaLN scale/shift in fp32 on (B, L, D) tokens."""
    return normed_BLD * (scale_BD.float()[:, None] + 1.0) + shift_BD.float()[:, None]


def gated_residual(residual_BLD: Tensor, out_BLD: Tensor, gate_BD: Tensor) -> Tensor:
    """Residual update in fp32, kept fp32: the stream is never rounded to the linear dtype (seeds' choice)."""
    return residual_BLD.float() + gate_BD.float()[:, None] * out_BLD.float()


class SelfAttention(nn.Module):
    """Video self-attention: q/k/v with bias, per-head RMSNorm in fp32, RoPE, dense attention, out projection."""

    def __init__(self, model_dim: int, head_dim: int) -> None:
        super().__init__()
        self.num_heads = model_dim // head_dim
        self.head_dim = head_dim
        self.to_query = nn.Linear(model_dim, model_dim)
        self.to_key = nn.Linear(model_dim, model_dim)
        self.to_value = nn.Linear(model_dim, model_dim)
        self.query_norm = nn.RMSNorm(head_dim)
        self.key_norm = nn.RMSNorm(head_dim)
        self.inner_attention = InnerAttention(role="video_self")
        self.out_layer = nn.Linear(model_dim, model_dim)

    def project(self, x_BLD: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Q, K, V before the head split (the speed transforms replace only this step)."""
        return self.to_query(x_BLD), self.to_key(x_BLD), self.to_value(x_BLD)

    def forward(self, x_BLD: Tensor, rope: Tensor) -> Tensor:
        query_BLD, key_BLD, value_BLD = self.project(x_BLD)
        query_BLNK = self.normed_rotated_heads(query_BLD, self.query_norm, rope)
        key_BLNK = self.normed_rotated_heads(key_BLD, self.key_norm, rope)
        value_BLNK = value_BLD.unflatten(-1, (-1, self.head_dim))
        out_BLNK = self.inner_attention(query_BLNK, key_BLNK, value_BLNK)
        return self.out_layer(out_BLNK.flatten(2))

    def normed_rotated_heads(self, x_BLD: Tensor, norm: nn.RMSNorm, rope: Tensor) -> Tensor:
        """Q or K heads: per-head RMSNorm in fp32, back to the stream dtype, then RoPE (a speed transform may run
        this step as one kernel)."""
        # Heads are read as (-1, head_dim) so tensor-parallel column shards need no attribute change.
        heads_BLNK = x_BLD.unflatten(-1, (-1, self.head_dim))
        return apply_rotary(norm(heads_BLNK.float()).type_as(heads_BLNK), rope)


class TransformerBlock(nn.Module):
    """AdaLN-modulated self-attention + GELU feed-forward on an fp32 residual stream."""

    def __init__(self, model_dim: int, time_dim: int, ff_dim: int, head_dim: int) -> None:
        super().__init__()
        self.visual_modulation = Modulation(time_dim, model_dim, 6)
        self.self_attention_norm = nn.LayerNorm(model_dim, elementwise_affine=False)
        self.self_attention = SelfAttention(model_dim, head_dim)
        self.feed_forward_norm = nn.LayerNorm(model_dim, elementwise_affine=False)
        self.feed_forward = FeedForward(model_dim, ff_dim)

    def forward(self, *, video_BLD: Tensor, time_embed_BE: Tensor, video_rope: Tensor) -> Tensor:
        """`video_rope` is the (L, 1, K/2, 2, 2) rotation table; keyword arguments are the SP split points."""
        # out_layer, not to_query: a fused attention (speed/fused_projections.py) has no to_query.
        compute_dtype = self.self_attention.out_layer.weight.dtype
        shift, scale, gate, ff_shift, ff_scale, ff_gate = self.visual_modulation(
            time_embed_BE
        ).chunk(6, dim=-1)
        attn_in_BLD = modulate(self.self_attention_norm(video_BLD.float()), shift, scale).to(
            compute_dtype
        )
        video_BLD = gated_residual(video_BLD, self.self_attention(attn_in_BLD, video_rope), gate)
        ff_in_BLD = modulate(self.feed_forward_norm(video_BLD.float()), ff_shift, ff_scale).to(
            compute_dtype
        )
        return gated_residual(video_BLD, self.feed_forward(ff_in_BLD), ff_gate)


class OutLayer(nn.Module):
    """AdaLN (shift, scale) -> Linear head -> unpatchify.

    Not common's VideoOutLayer: that one casts the modulated tokens to the residual dtype, which is fp32 here, so
    the bf16 head would receive fp32 input; this one casts to the head's dtype, as the blocks do.
    """

    def __init__(
        self, model_dim: int, time_dim: int, out_dim: int, patch_size: tuple[int, int, int]
    ) -> None:
        super().__init__()
        self.patch_size = patch_size
        self.modulation = Modulation(time_dim, model_dim, 2)
        self.norm = nn.LayerNorm(model_dim, elementwise_affine=False)
        self.out_layer = nn.Linear(model_dim, math.prod(patch_size) * out_dim)

    def forward(self, x_BTHWD: Tensor, time_embed_BE: Tensor) -> Tensor:
        shift_BD, scale_BD = self.modulation(time_embed_BE).chunk(2, dim=-1)
        batch, num_frames, height, width = x_BTHWD.shape[:4]
        normed_BLD = self.norm(x_BTHWD.float()).flatten(1, 3)
        modulated_BLD = modulate(normed_BLD, shift_BD, scale_BD).to(self.out_layer.weight.dtype)
        out_BTHWP = self.out_layer(modulated_BLD).view(batch, num_frames, height, width, -1)
        p_t, p_h, p_w = self.patch_size
        # Unpatchify; with the released (1, 1, 1) patch this is a no-op. Channels stay grid-major (g * C + c).
        return (
            out_BTHWP.view(batch, num_frames, height, width, -1, p_t, p_h, p_w)
            .permute(0, 1, 5, 2, 6, 3, 7, 4)
            .flatten(1, 2)
            .flatten(2, 3)
            .flatten(3, 4)
        )


class SRTransformer(nn.Module):
    """The SR DiT: (B, T, H, W, 2C+1) latent tiles and timesteps (B,) -> (B, T, H, W, out_visual_dim)."""

    def __init__(self, config: SRTransformerConfig) -> None:
        super().__init__()
        self.config = config
        self.time_embeddings = TimeEmbeddings(config.model_dim, config.time_dim)
        # The empty caption's pooled-text projection, folded into a constant by the checkpoint conversion.
        self.pooled_bias = nn.Parameter(torch.zeros(config.time_dim))
        self.visual_embeddings = PatchEmbeddings(
            config.in_channels, config.model_dim, config.patch_size
        )
        self.visual_rope_embeddings = RotaryEmbedding3D(config.axes_dims)
        self.visual_transformer_blocks = nn.ModuleList(
            [
                TransformerBlock(config.model_dim, config.time_dim, config.ff_dim, config.head_dim)
                for _ in range(config.num_visual_blocks)
            ]
        )
        self.out_layer = OutLayer(
            config.model_dim, config.time_dim, config.out_visual_dim, config.patch_size
        )

    def set_attention_backend(self, backend: str) -> None:
        """Point every `InnerAttention` at `backend` (a name from `resolve_attention_backend`)."""
        backend = canonical_backend_name(backend)
        for module in self.modules():
            if isinstance(module, InnerAttention):
                module.backend = backend

    def forward(self, latent_BTHWC: Tensor, timestep_B: Tensor) -> Tensor:
        time_embed_BE = self.time_embeddings(timestep_B) + self.pooled_bias
        x_BTHWD = self.visual_embeddings(latent_BTHWC)
        grid_size = tuple(x_BTHWD.shape[1:4])
        # Tile-local positions: (t, y, x) start at 0 in every tile (§2.9).
        positions = tuple(torch.arange(size, device=x_BTHWD.device) for size in grid_size)
        video_rope = self.visual_rope_embeddings(positions, self.config.rope_scale).flatten(0, 2)
        video_BLD = x_BTHWD.flatten(1, 3)
        for block in self.visual_transformer_blocks:
            video_BLD = block(
                video_BLD=video_BLD, time_embed_BE=time_embed_BE, video_rope=video_rope
            )
        return self.out_layer(video_BLD.unflatten(1, grid_size), time_embed_BE)
