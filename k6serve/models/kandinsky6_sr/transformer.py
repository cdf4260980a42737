"""Kandinsky 6 video super-resolution DiT, plain single-device PyTorch.

Same math and state-dict keys as diffusers 0.42.1 `Kandinsky6SRTransformer3DModel` (k6-super-resolution.md §1.6,
§2.9), with the two k6serve choices of §0:
* dense attention (one `InnerAttention` call per block) instead of the checkpoint's NABLA sparse attention, so no
  "fractal" token permutation is needed: tokens stay in (t, y, x) row-major order;
* an fp32 residual stream: norms, modulation and gates run in fp32 and the residual is NOT cast back to the linear
  dtype after the gated add (seeds / SG / R choice; diffusers rounds it to bf16 after every add, T:76-80).
In fp32 both differences vanish up to attention summation order, which is what the parity test checks.

Shape legend: B batch (tiles), T latent frames, H/W latent tile height/width (after patching), L = T*H*W tokens,
D model_dim, E time_dim, N heads, K head_dim, C latent channels (in: 2*C+1, out: out_visual_dim).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from k6serve.models.kandinsky6_sr.config import SRTransformerConfig


class InnerAttention(nn.Module):
    """The attention op alone, so sequence parallelism can swap exactly this module (style.md §4.1)."""

    def __init__(self, role: str, backend: str = "sdpa") -> None:
        super().__init__()
        self.role = role
        self.backend = backend

    def forward(self, query_BLNK: Tensor, key_BLNK: Tensor, value_BLNK: Tensor) -> Tensor:
        # TODO(k6serve): switch to k6serve.ops.attention.attention once it lands (single dispatch point).
        if self.backend != "sdpa":
            raise ValueError(f"attention backend {self.backend!r} is not available here; use 'sdpa'")
        out_BNLK = F.scaled_dot_product_attention(
            query_BLNK.transpose(1, 2), key_BLNK.transpose(1, 2), value_BLNK.transpose(1, 2)
        )
        return out_BNLK.transpose(1, 2)


def modulate(normed: Tensor, shift_BD: Tensor, scale_BD: Tensor) -> Tensor:
    """AdaLN scale/shift in fp32 on (B, L, D) tokens."""
    return normed * (scale_BD.float()[:, None] + 1.0) + shift_BD.float()[:, None]


def gated_residual(residual_BLD: Tensor, out_BLD: Tensor, gate_BD: Tensor) -> Tensor:
    """Residual update in fp32, kept fp32: the stream is never rounded to the linear dtype (seeds' choice)."""
    return residual_BLD.float() + gate_BD.float()[:, None] * out_BLD.float()


def rope_cos_sin(
    grid_size: tuple[int, int, int],
    axes_dims: tuple[int, int, int],
    rope_scale: tuple[float, float, float],
    device: torch.device,
) -> tuple[Tensor, Tensor]:
    """Tile-local 3-D RoPE tables (L, K/2) in fp32; positions start at 0 in every tile (T:329-370)."""
    per_axis = []
    for size, axis_dim, scale in zip(grid_size, axes_dims, rope_scale):
        half = axis_dim // 2
        freq = torch.exp(-math.log(10000.0) * torch.arange(half, dtype=torch.float32, device=device) / half)
        per_axis.append(torch.outer(torch.arange(size, dtype=torch.float32, device=device), freq) / scale)
    num_frames, height, width = grid_size
    angles_THWk = torch.cat(
        [
            per_axis[0][:, None, None].expand(num_frames, height, width, -1),
            per_axis[1][None, :, None].expand(num_frames, height, width, -1),
            per_axis[2][None, None, :].expand(num_frames, height, width, -1),
        ],
        dim=-1,
    )
    angles_Lk = angles_THWk.flatten(0, 2)
    return torch.cos(angles_Lk), torch.sin(angles_Lk)


def apply_rope(x_BLNK: Tensor, cos_Lk: Tensor, sin_Lk: Tensor) -> Tensor:
    """Rotate consecutive pairs (x0, x1) in fp32, cast back to the input dtype."""
    pairs = x_BLNK.float().unflatten(-1, (-1, 2))
    x0, x1 = pairs[..., 0], pairs[..., 1]
    cos, sin = cos_Lk[None, :, None], sin_Lk[None, :, None]
    rotated = torch.stack([cos * x0 - sin * x1, sin * x0 + cos * x1], dim=-1)
    return rotated.flatten(-2).to(x_BLNK.dtype)


class TimestepMLP(nn.Module):
    def __init__(self, model_dim: int, time_dim: int) -> None:
        super().__init__()
        self.linear_1 = nn.Linear(model_dim, time_dim)
        self.act = nn.SiLU()
        self.linear_2 = nn.Linear(time_dim, time_dim)

    def forward(self, x: Tensor) -> Tensor:
        return self.linear_2(self.act(self.linear_1(x)))


class TimeEmbeddings(nn.Module):
    """Sinusoid of t ([cos | sin], D dims) -> Linear -> SiLU -> Linear, kept fp32 by the plan."""

    def __init__(self, model_dim: int, time_dim: int) -> None:
        super().__init__()
        self.model_dim = model_dim
        self.timestep_embedder = TimestepMLP(model_dim, time_dim)

    def forward(self, timestep_B: Tensor) -> Tensor:
        half = self.model_dim // 2
        exponent = -math.log(10000.0) * torch.arange(half, dtype=torch.float32, device=timestep_B.device) / half
        angles_Bh = timestep_B[:, None].float() * torch.exp(exponent)[None, :]
        sinusoid_BD = torch.cat([torch.cos(angles_Bh), torch.sin(angles_Bh)], dim=-1)
        return self.timestep_embedder(sinusoid_BD.to(self.timestep_embedder.linear_1.weight.dtype))


class VisualEmbeddings(nn.Module):
    def __init__(self, in_channels: int, model_dim: int, patch_size: tuple[int, int, int]) -> None:
        super().__init__()
        self.patch_size = patch_size
        self.in_layer = nn.Linear(math.prod(patch_size) * in_channels, model_dim)

    def forward(self, latent_BTHWC: Tensor) -> Tensor:
        batch, num_frames, height, width, channels = latent_BTHWC.shape
        p_t, p_h, p_w = self.patch_size
        patches = (
            latent_BTHWC.view(batch, num_frames // p_t, p_t, height // p_h, p_h, width // p_w, p_w, channels)
            .permute(0, 1, 3, 5, 2, 4, 6, 7)
            .flatten(4, 7)
        )
        return self.in_layer(patches)


class Modulation(nn.Module):
    """SiLU -> Linear(E, num_params * D) on the time embedding, kept fp32 by the plan."""

    def __init__(self, time_dim: int, model_dim: int, num_params: int) -> None:
        super().__init__()
        self.activation = nn.SiLU()
        self.out_layer = nn.Linear(time_dim, num_params * model_dim)

    def forward(self, time_embed_BE: Tensor) -> Tensor:
        return self.out_layer(self.activation(time_embed_BE.to(self.out_layer.weight.dtype)))


class SelfAttention(nn.Module):
    def __init__(self, model_dim: int, head_dim: int) -> None:
        super().__init__()
        self.num_heads = model_dim // head_dim
        self.to_query = nn.Linear(model_dim, model_dim)
        self.to_key = nn.Linear(model_dim, model_dim)
        self.to_value = nn.Linear(model_dim, model_dim)
        self.query_norm = nn.RMSNorm(head_dim)
        self.key_norm = nn.RMSNorm(head_dim)
        self.inner_attention = InnerAttention(role="video_self")
        self.out_layer = nn.Linear(model_dim, model_dim)

    def forward(self, x_BLD: Tensor, cos_Lk: Tensor, sin_Lk: Tensor) -> Tensor:
        query_BLNK = self.to_query(x_BLD).unflatten(-1, (self.num_heads, -1))
        key_BLNK = self.to_key(x_BLD).unflatten(-1, (self.num_heads, -1))
        value_BLNK = self.to_value(x_BLD).unflatten(-1, (self.num_heads, -1))
        query_BLNK = self.query_norm(query_BLNK.float()).type_as(query_BLNK)
        key_BLNK = self.key_norm(key_BLNK.float()).type_as(key_BLNK)
        query_BLNK = apply_rope(query_BLNK, cos_Lk, sin_Lk)
        key_BLNK = apply_rope(key_BLNK, cos_Lk, sin_Lk)
        out_BLNK = self.inner_attention(query_BLNK, key_BLNK, value_BLNK)
        return self.out_layer(out_BLNK.flatten(2))


class GeluProjection(nn.Module):
    def __init__(self, model_dim: int, ff_dim: int) -> None:
        super().__init__()
        self.proj = nn.Linear(model_dim, ff_dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return F.gelu(self.proj(x))


class FeedForward(nn.Module):
    def __init__(self, model_dim: int, ff_dim: int) -> None:
        super().__init__()
        # Index layout of diffusers' FeedForward (net.1 is its inference no-op dropout), so keys load unchanged.
        self.net = nn.ModuleList([GeluProjection(model_dim, ff_dim), nn.Identity(), nn.Linear(ff_dim, model_dim, bias=False)])

    def forward(self, x: Tensor) -> Tensor:
        for layer in self.net:
            x = layer(x)
        return x


class TransformerBlock(nn.Module):
    def __init__(self, model_dim: int, time_dim: int, ff_dim: int, head_dim: int) -> None:
        super().__init__()
        self.visual_modulation = Modulation(time_dim, model_dim, 6)
        self.self_attention_norm = nn.LayerNorm(model_dim, elementwise_affine=False)
        self.self_attention = SelfAttention(model_dim, head_dim)
        self.feed_forward_norm = nn.LayerNorm(model_dim, elementwise_affine=False)
        self.feed_forward = FeedForward(model_dim, ff_dim)

    def forward(self, x_BLD: Tensor, time_embed_BE: Tensor, cos_Lk: Tensor, sin_Lk: Tensor) -> Tensor:
        compute_dtype = self.self_attention.to_query.weight.dtype
        shift, scale, gate, ff_shift, ff_scale, ff_gate = self.visual_modulation(time_embed_BE).chunk(6, dim=-1)
        attn_in_BLD = modulate(self.self_attention_norm(x_BLD.float()), shift, scale).to(compute_dtype)
        x_BLD = gated_residual(x_BLD, self.self_attention(attn_in_BLD, cos_Lk, sin_Lk), gate)
        ff_in_BLD = modulate(self.feed_forward_norm(x_BLD.float()), ff_shift, ff_scale).to(compute_dtype)
        return gated_residual(x_BLD, self.feed_forward(ff_in_BLD), ff_gate)


class OutLayer(nn.Module):
    def __init__(self, model_dim: int, time_dim: int, out_dim: int, patch_size: tuple[int, int, int]) -> None:
        super().__init__()
        self.patch_size = patch_size
        self.modulation = Modulation(time_dim, model_dim, 2)
        self.norm = nn.LayerNorm(model_dim, elementwise_affine=False)
        self.out_layer = nn.Linear(model_dim, math.prod(patch_size) * out_dim)

    def forward(self, x_BTHWD: Tensor, time_embed_BE: Tensor) -> Tensor:
        shift_BD, scale_BD = self.modulation(time_embed_BE).chunk(2, dim=-1)
        batch, num_frames, height, width, model_dim = x_BTHWD.shape
        normed = self.norm(x_BTHWD.float()).flatten(1, 3)
        out_in = modulate(normed, shift_BD, scale_BD).to(self.out_layer.weight.dtype)
        out = self.out_layer(out_in).view(batch, num_frames, height, width, -1)
        p_t, p_h, p_w = self.patch_size
        # Unpatchify; with the released (1, 1, 1) patch this is a no-op. Channels stay grid-major (g * C + c).
        return (
            out.view(batch, num_frames, height, width, -1, p_t, p_h, p_w)
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
        self.visual_embeddings = VisualEmbeddings(config.in_channels, config.model_dim, config.patch_size)
        self.visual_transformer_blocks = nn.ModuleList(
            [
                TransformerBlock(config.model_dim, config.time_dim, config.ff_dim, config.head_dim)
                for _ in range(config.num_visual_blocks)
            ]
        )
        self.out_layer = OutLayer(config.model_dim, config.time_dim, config.out_visual_dim, config.patch_size)

    def forward(self, latent_BTHWC: Tensor, timestep_B: Tensor) -> Tensor:
        time_embed_BE = self.time_embeddings(timestep_B) + self.pooled_bias
        x_BTHWD = self.visual_embeddings(latent_BTHWC)
        grid_size = tuple(x_BTHWD.shape[1:4])
        cos_Lk, sin_Lk = rope_cos_sin(grid_size, self.config.axes_dims, self.config.rope_scale, x_BTHWD.device)
        x_BLD = x_BTHWD.flatten(1, 3)
        for block in self.visual_transformer_blocks:
            x_BLD = block(x_BLD, time_embed_BE, cos_Lk, sin_Lk)
        return self.out_layer(x_BLD.unflatten(1, grid_size), time_embed_BE)
