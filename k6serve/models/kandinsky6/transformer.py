"""Kandinsky 6 generation DiT (text/image -> video + audio), plain single-device PyTorch.

A port of diffusers 0.42.1 `Kandinsky6Transformer3DModel` (models/transformers/transformer_kandinsky6.py;
k6-generation.md §2): the same module tree and parameter names, so a diffusers state dict loads with
`load_state_dict(..., strict=True)`; the same forward signature and the same fp32 points (AdaLN and gated
residuals in fp32 cast back, modulation input cast before SiLU, QK RMSNorm with eps=None in the stream
dtype, fp32 RoPE on interleaved pairs, a second LayerNorm in the audio head). On CPU in fp32 and after
`cast_for_inference(model, torch.bfloat16)` the outputs are bitwise equal to diffusers'.

Every attention core is an `InnerAttention` with a `role` (text_self, video_self, video_text,
audio_self, audio_text, video_from_audio, audio_from_video): parallelism swaps or wraps those modules
from outside (plan.py), the model itself knows nothing about devices or ranks.

Shape legend: B batch; T, H, W latent frames / height / width (the token grid after patchify);
C channels; L video tokens (T*H*W); A audio tokens; S text tokens; D the stream's model dim;
E time-embedding dim; N heads; K head dim.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

from k6serve.models.common.embeddings import PatchEmbeddings, TimeEmbeddings
from k6serve.models.common.feed_forward import FeedForward
from k6serve.models.common.inner_attention import InnerAttention, PreparedQueryKeyValue
from k6serve.models.common.modulation import Modulation, apply_gate_sum, apply_scale_shift
from k6serve.models.common.out_layer import VideoOutLayer
from k6serve.models.common.rope import (
    MAX_SEQUENCE_POSITIONS,
    MAX_VIDEO_POSITIONS_PER_AXIS,
    RotaryEmbedding1D,
    RotaryEmbedding3D,
)
from k6serve.models.kandinsky6.attention import Kandinsky6Attention
from k6serve.models.kandinsky6.config import Kandinsky6TransformerConfig
from k6serve.models.kandinsky6.plan import KEEP_FP32_MODULES
from k6serve.models.plan import keeps_fp32
from k6serve.ops.attention import canonical_backend_name


class Kandinsky6TextEmbeddings(nn.Module):
    """Linear then affine LayerNorm: text tokens, the pooled CLIP vector and audio latents use it."""

    def __init__(self, text_dim: int, model_dim: int):
        super().__init__()
        self.in_layer = nn.Linear(text_dim, model_dim)
        self.norm = nn.LayerNorm(model_dim, elementwise_affine=True)

    def forward(self, x: Tensor) -> Tensor:
        return self.norm(self.in_layer(x))


class Kandinsky6AudioOutLayer(nn.Module):
    """Audio head: AdaLN (shift, scale), a second non-affine LayerNorm in the stream dtype, Linear."""

    def __init__(self, model_dim: int, time_dim: int, audio_dim: int):
        super().__init__()
        self.modulation = Modulation(time_dim, model_dim, 2)
        self.norm = nn.LayerNorm(model_dim, elementwise_affine=False)
        self.out_layer = nn.Linear(model_dim, audio_dim)

    def forward(self, audio_BAD: Tensor, time_embed_BE: Tensor) -> Tensor:
        shift, scale = torch.chunk(self.modulation(time_embed_BE), 2, dim=-1)
        x_BAD = apply_scale_shift(self.norm(audio_BAD.float()), audio_BAD, scale, shift)
        # The released weights were trained with this second norm; kept for parity.
        return self.out_layer(self.norm(x_BAD))


class Kandinsky6TextBlock(nn.Module):
    """Text encoder block: AdaLN self-attention (1-D RoPE, key mask) and feed-forward, both gated."""

    def __init__(self, model_dim: int, time_dim: int, ff_dim: int, head_dim: int):
        super().__init__()
        self.text_modulation = Modulation(time_dim, model_dim, 6)
        self.attn_norm = nn.LayerNorm(model_dim, elementwise_affine=False)
        self.attn = Kandinsky6Attention(model_dim, head_dim, role="text_self")
        self.feed_forward_norm = nn.LayerNorm(model_dim, elementwise_affine=False)
        self.feed_forward = FeedForward(model_dim, ff_dim)

    def forward(
        self, x_BSD: Tensor, time_embed_BE: Tensor, rope: Tensor, key_mask_BS: Tensor | None = None
    ) -> Tensor:
        attention_params, feed_forward_params = torch.chunk(
            self.text_modulation(time_embed_BE), 2, dim=-1
        )
        shift, scale, gate = torch.chunk(attention_params, 3, dim=-1)
        attention_input_BSD = apply_scale_shift(self.attn_norm(x_BSD.float()), x_BSD, scale, shift)
        attention_out_BSD = self.attn(
            attention_input_BSD, query_rope=rope, key_rope=rope, key_mask_BS=key_mask_BS
        )
        x_BSD = apply_gate_sum(x_BSD, attention_out_BSD, gate)
        shift, scale, gate = torch.chunk(feed_forward_params, 3, dim=-1)
        feed_forward_input_BSD = apply_scale_shift(
            self.feed_forward_norm(x_BSD.float()), x_BSD, scale, shift
        )
        return apply_gate_sum(x_BSD, self.feed_forward(feed_forward_input_BSD), gate)


class Kandinsky6StreamLayers(nn.Module):
    """One stream's layers inside a fused block (diffusers' `Kandinsky6TransformerDecoderBlock`).

    A container only: `Kandinsky6FusedBlock.forward` calls these submodules directly.
    """

    def __init__(self, model_dim: int, time_dim: int, ff_dim: int, head_dim: int, stream: str):
        super().__init__()
        self.visual_modulation = Modulation(time_dim, model_dim, 9)
        self.self_attention_norm = nn.LayerNorm(model_dim, elementwise_affine=False)
        self.self_attention = Kandinsky6Attention(model_dim, head_dim, role=f"{stream}_self")
        self.cross_attention_norm = nn.LayerNorm(model_dim, elementwise_affine=False)
        self.cross_attention = Kandinsky6Attention(
            model_dim, head_dim, role=f"{stream}_text", kv_dim=model_dim
        )
        self.feed_forward_norm = nn.LayerNorm(model_dim, elementwise_affine=False)
        self.feed_forward = FeedForward(model_dim, ff_dim)

    def self_attention_residual(
        self, x: Tensor, rope: Tensor | None, shift: Tensor, scale: Tensor, gate: Tensor
    ) -> Tensor:
        return self.finish_self_attention(x, self.start_self_attention(x, rope, shift, scale), gate)

    def start_self_attention(
        self, x: Tensor, rope: Tensor | None, shift: Tensor, scale: Tensor
    ) -> PreparedQueryKeyValue:
        """`self_attention_residual` up to the attention core (see `Kandinsky6Attention.start_self`)."""
        attention_input = apply_scale_shift(self.self_attention_norm(x.float()), x, scale, shift)
        return self.self_attention.start_self(attention_input, query_rope=rope, key_rope=rope)

    def finish_self_attention(self, x: Tensor, prepared: PreparedQueryKeyValue, gate: Tensor) -> Tensor:
        return apply_gate_sum(x, self.self_attention.finish_self(prepared), gate)

    def feed_forward_residual(
        self, x: Tensor, shift: Tensor, scale: Tensor, gate: Tensor
    ) -> Tensor:
        feed_forward_input = apply_scale_shift(self.feed_forward_norm(x.float()), x, scale, shift)
        return apply_gate_sum(x, self.feed_forward(feed_forward_input), gate)


class Kandinsky6FusedBlock(nn.Module):
    """Fused video/audio block (k6-generation.md §2.5): per-stream self- and text cross-attention,
    audio<->video cross-attention with crossed gates, per-stream feed-forward."""

    def __init__(self, config: Kandinsky6TransformerConfig):
        super().__init__()
        video_dim, audio_dim = config.model_dim, config.audio_model_dim
        self.video_dec_block = Kandinsky6StreamLayers(
            video_dim, config.time_dim, config.ff_dim, config.video_head_dim, stream="video"
        )
        self.audio_dec_block = Kandinsky6StreamLayers(
            audio_dim,
            config.audio_time_dim,
            config.audio_ff_dim,
            config.audio_head_dim,
            stream="audio",
        )
        self.va_cross_attention = Kandinsky6Attention(
            video_dim, config.video_head_dim, role="video_from_audio", kv_dim=audio_dim
        )
        self.av_cross_attention = Kandinsky6Attention(
            audio_dim, config.audio_head_dim, role="audio_from_video", kv_dim=video_dim
        )
        if config.cross_gates:
            self.va_modulation = Modulation(config.time_dim, 2 * video_dim + audio_dim, 1)
            self.av_modulation = Modulation(config.audio_time_dim, 2 * audio_dim + video_dim, 1)
        else:
            self.va_modulation = Modulation(config.time_dim, video_dim, 3)
            self.av_modulation = Modulation(config.audio_time_dim, audio_dim, 3)
        self.va_normalization = nn.LayerNorm(video_dim, elementwise_affine=False)
        self.av_normalization = nn.LayerNorm(audio_dim, elementwise_affine=False)
        self.video_dim, self.audio_dim = video_dim, audio_dim
        self.ca_rope = config.ca_rope
        self.cross_gates = config.cross_gates
        self.fix_modulation = config.fix_modulation

    def forward(
        self,
        *,
        video_BLD: Tensor,
        audio_BAD: Tensor | None,
        video_text_BSD: Tensor,
        audio_text_BSD: Tensor,
        video_time_embed_BE: Tensor,
        audio_time_embed_BE: Tensor,
        video_rope: Tensor,
        audio_rope: Tensor | None,
        text_key_mask_BS: Tensor | None,
    ) -> tuple[Tensor, Tensor | None]:
        video, audio = self.video_dec_block, self.audio_dec_block
        video_sa, video_ca, video_ff = torch.chunk(
            video.visual_modulation(video_time_embed_BE), 3, dim=-1
        )
        video_sa_shift, video_sa_scale, video_sa_gate = torch.chunk(video_sa, 3, dim=-1)
        video_self = video.start_self_attention(video_BLD, video_rope, video_sa_shift, video_sa_scale)
        if audio_BAD is not None:
            # The audio self-attention reads no video: run between the start and the end of the video one, the
            # same ops on the same inputs, it goes beside a sequence-parallel core's Q/K/V exchange.
            audio_sa, audio_ca, audio_ff = torch.chunk(
                audio.visual_modulation(audio_time_embed_BE), 3, dim=-1
            )
            audio_BAD = audio.self_attention_residual(
                audio_BAD, audio_rope, *torch.chunk(audio_sa, 3, dim=-1)
            )
        video_BLD = video.finish_self_attention(video_BLD, video_self, video_sa_gate)
        del video_self  # its Q/K/V (or Ulysses buffers) would otherwise live through the rest of the block
        shift, scale, video_text_gate = torch.chunk(video_ca, 3, dim=-1)
        # Kept as the K/V source of audio_from_video: normalised after self-attention, before any cross residual.
        video_pre_cross_BLD = apply_scale_shift(
            video.cross_attention_norm(video_BLD.float()), video_BLD, scale, shift
        )
        video_cross_rope, audio_cross_rope = (
            (video_rope, audio_rope) if self.ca_rope else (None, None)
        )
        if audio_BAD is not None:
            # audio_from_video's K/V, computed here although only needed after the text cross-attention and the
            # audio stream: the same ops on the same inputs, and a sequence-parallel attention core can move them
            # between ranks (`prepare_key_value`) while that work runs.
            audio_from_video_key_value = self.av_cross_attention.key_value(
                video_pre_cross_BLD, key_rope=video_cross_rope
            )
        video_from_text_BLD = video.cross_attention(
            video_pre_cross_BLD, video_text_BSD, key_mask_BS=text_key_mask_BS
        )

        if audio_BAD is None:
            video_BLD = apply_gate_sum(video_BLD, video_from_text_BLD, video_text_gate)
            return video.feed_forward_residual(video_BLD, *torch.chunk(video_ff, 3, dim=-1)), None

        shift, scale, gate = torch.chunk(audio_ca, 3, dim=-1)
        audio_pre_cross_BAD = apply_scale_shift(
            audio.cross_attention_norm(audio_BAD.float()), audio_BAD, scale, shift
        )
        audio_from_text_BAD = audio.cross_attention(
            audio_pre_cross_BAD, audio_text_BSD, key_mask_BS=text_key_mask_BS
        )
        audio_BAD = apply_gate_sum(audio_BAD, audio_from_text_BAD, gate)

        va_shift, va_scale, video_gate, av_shift, av_scale, audio_gate = (
            self._cross_modal_modulation(video_time_embed_BE, audio_time_embed_BE)
        )
        video_BLD = apply_gate_sum(video_BLD, video_from_text_BLD, video_text_gate)
        video_query_BLD = apply_scale_shift(
            self.va_normalization(video_BLD.float()), video_BLD, va_scale, va_shift
        )
        audio_query_BAD = apply_scale_shift(
            self.av_normalization(audio_BAD.float()), audio_BAD, av_scale, av_shift
        )
        video_from_audio_BLD = self.va_cross_attention(
            video_query_BLD,
            audio_pre_cross_BAD,
            query_rope=video_cross_rope,
            key_rope=audio_cross_rope,
        )
        audio_from_video_BAD = self.av_cross_attention.attend(
            audio_query_BAD, audio_from_video_key_value, query_rope=audio_cross_rope
        )
        del audio_from_video_key_value  # the (gathered) video K/V: free before the feed-forwards
        video_BLD = apply_gate_sum(video_BLD, video_from_audio_BLD, video_gate)
        audio_BAD = apply_gate_sum(audio_BAD, audio_from_video_BAD, audio_gate)

        video_BLD = video.feed_forward_residual(video_BLD, *torch.chunk(video_ff, 3, dim=-1))
        audio_BAD = audio.feed_forward_residual(audio_BAD, *torch.chunk(audio_ff, 3, dim=-1))
        return video_BLD, audio_BAD

    def _cross_modal_modulation(
        self, video_time_embed_BE: Tensor, audio_time_embed_BE: Tensor
    ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
        """(va_shift, va_scale, video gate, av_shift, av_scale, audio gate) for the cross-modal attention."""
        # fix_modulation (released) feeds each projection its own stream's embedding; False swaps them.
        if self.fix_modulation:
            va_time_embed, av_time_embed = video_time_embed_BE, audio_time_embed_BE
        else:
            va_time_embed, av_time_embed = audio_time_embed_BE, video_time_embed_BE
        va_params = self.va_modulation(va_time_embed)
        av_params = self.av_modulation(av_time_embed)
        if not self.cross_gates:
            va_shift, va_scale, va_gate = torch.chunk(va_params, 3, dim=-1)
            av_shift, av_scale, av_gate = torch.chunk(av_params, 3, dim=-1)
            return va_shift, va_scale, va_gate, av_shift, av_scale, av_gate
        va_shift, va_scale, va_gate = torch.split(
            va_params, [self.video_dim, self.video_dim, self.audio_dim], dim=-1
        )
        av_shift, av_scale, av_gate = torch.split(
            av_params, [self.audio_dim, self.audio_dim, self.video_dim], dim=-1
        )
        # Crossed gates: each stream's residual gate comes from the other modality's projection.
        return va_shift, va_scale, av_gate, av_shift, av_scale, va_gate


class Kandinsky6FusedBlockStack(nn.Module):
    """Runs the fused blocks in order: the one module around the whole stack, with no parameters of its own.

    The blocks stay registered under `visual_transformer_blocks` (diffusers' names) and come in as an argument.
    Sequence parallelism splits this module's inputs and gathers its output (plan.py), so whatever runs inside
    sees shards; a step cache (k6serve/caching/) may set `runner` to run the blocks its own way, e.g. skip the
    middle ones on some steps. With `runner` None every block runs, as in diffusers.
    """

    def __init__(self) -> None:
        super().__init__()
        # (blocks, video_BLD, audio_BAD, block_kwargs) -> (video_BLD, audio_BAD); not a Module, so not a child.
        self.runner: Callable[[nn.ModuleList, Tensor, Tensor | None, dict], tuple[Tensor, Tensor | None]] | None = None

    def forward(self, blocks: nn.ModuleList, *, video_BLD: Tensor, audio_BAD: Tensor | None,
                **block_kwargs) -> tuple[Tensor, Tensor | None]:
        if self.runner is not None:
            return self.runner(blocks, video_BLD, audio_BAD, block_kwargs)
        for block in blocks:
            video_BLD, audio_BAD = block(video_BLD=video_BLD, audio_BAD=audio_BAD, **block_kwargs)
        return video_BLD, audio_BAD


class Kandinsky6Transformer(nn.Module):
    """The K6 generation DiT with diffusers' `Kandinsky6Transformer3DModel` parameter names and forward."""

    def __init__(self, config: Kandinsky6TransformerConfig):
        super().__init__()
        self.config = config
        # Registration order follows diffusers, so state_dict() key order and `dtype` match too.
        self.visual_embeddings = PatchEmbeddings(
            config.visual_in_channels, config.model_dim, config.patch_size
        )
        if config.visual_token_type_num_embeddings > 0:
            self.visual_token_type_embeddings = nn.Embedding(
                config.visual_token_type_num_embeddings, config.model_dim
            )
        self.visual_rope_embeddings = RotaryEmbedding3D(config.axes_dims)
        self.out_layer = VideoOutLayer(
            config.model_dim, config.time_dim, config.out_visual_dim, config.patch_size
        )

        self.audio_embeddings = Kandinsky6TextEmbeddings(
            config.in_audio_dim, config.audio_model_dim
        )
        self.audio_rope_embeddings = RotaryEmbedding1D(
            config.audio_head_dim, freqs_scaling=config.audio_freqs_scaling
        )
        self.audio_out_layer = Kandinsky6AudioOutLayer(
            config.audio_model_dim, config.audio_time_dim, config.out_audio_dim
        )
        for stream, model_dim, time_dim, ff_dim, head_dim in (
            ("video", config.model_dim, config.time_dim, config.ff_dim, config.video_head_dim),
            (
                "audio",
                config.audio_model_dim,
                config.audio_time_dim,
                config.audio_ff_dim,
                config.audio_head_dim,
            ),
        ):
            setattr(self, f"{stream}_time_embeddings", TimeEmbeddings(model_dim, time_dim))
            setattr(
                self,
                f"{stream}_text_embeddings",
                Kandinsky6TextEmbeddings(config.in_text_dim, model_dim),
            )
            setattr(
                self,
                f"{stream}_pooled_text_embeddings",
                Kandinsky6TextEmbeddings(config.in_text_dim2, time_dim),
            )
            setattr(self, f"{stream}_text_rope_embeddings", RotaryEmbedding1D(head_dim))
            blocks = [
                Kandinsky6TextBlock(model_dim, time_dim, ff_dim, head_dim)
                for _ in range(config.num_text_blocks)
            ]
            setattr(self, f"{stream}_text_transformer_blocks", nn.ModuleList(blocks))
        self.visual_transformer_blocks = nn.ModuleList(
            [Kandinsky6FusedBlock(config) for _ in range(config.num_visual_blocks)]
        )
        self.fused_blocks = Kandinsky6FusedBlockStack()

    @property
    def dtype(self) -> torch.dtype:
        """The stream dtype, as diffusers' `ModelMixin.dtype`: the first floating parameter whose name does
        not contain a keep-fp32 name (a substring match there, unlike the load rule)."""
        for name, parameter in self.named_parameters():
            if parameter.is_floating_point() and not any(
                keep in name for keep in KEEP_FP32_MODULES
            ):
                return parameter.dtype
        raise AssertionError("the model has no floating-point parameters")

    def set_attention_backend(self, backend: str) -> None:
        """Point every `InnerAttention` at `backend` (a name from `resolve_attention_backend`)."""
        backend = canonical_backend_name(backend)
        for module in self.modules():
            if isinstance(module, InnerAttention):
                module.backend = backend

    def forward(
        self,
        hidden_states: Tensor,
        encoder_hidden_states: Tensor,
        pooled_projections: Tensor,
        timestep: Tensor,
        audio_hidden_states: Tensor | None = None,
        visual_rope_pos: tuple[Tensor, Tensor, Tensor] | None = None,
        encoder_attention_mask: Tensor | None = None,
        visual_token_type_ids: Tensor | None = None,
    ) -> tuple[Tensor, Tensor | None]:
        """Velocity prediction.

        hidden_states (B, T, H, W, C_in) video latents (noisy latent, conditioning latent, mask);
        encoder_hidden_states (B, S, in_text_dim) text tokens; pooled_projections (B, in_text_dim2);
        timestep (B,) on the [0, 1000] scale; audio_hidden_states (B, A, in_audio_dim) or None;
        visual_rope_pos per-axis token positions (default arange; I2V passes t = [0..T-1, 0]);
        encoder_attention_mask (B, S) bool key mask or None; visual_token_type_ids (B, T) or None.
        Returns (video (B, T, H, W, out_visual_dim), audio (B, A, out_audio_dim) or None).
        """
        if visual_token_type_ids is not None and self.config.visual_token_type_num_embeddings == 0:
            raise ValueError(
                "`visual_token_type_ids` requires `visual_token_type_num_embeddings > 0`"
            )
        device = hidden_states.device
        text_key_mask_BS = encoder_attention_mask

        text_positions_S = torch.arange(encoder_hidden_states.shape[1], device=device)
        _check_positions("text tokens", encoder_hidden_states.shape[1], MAX_SEQUENCE_POSITIONS)
        video_text_BSD, video_time_embed_BE = self._encode_text(
            "video",
            encoder_hidden_states,
            pooled_projections,
            timestep,
            text_positions_S,
            text_key_mask_BS,
        )
        audio_text_BSD, audio_time_embed_BE = self._encode_text(
            "audio",
            encoder_hidden_states,
            pooled_projections,
            timestep,
            text_positions_S,
            text_key_mask_BS,
        )

        video_BTHWD = self.visual_embeddings(hidden_states)
        if visual_token_type_ids is not None:
            # One id per latent frame, added to every token of that frame.
            video_BTHWD = (
                video_BTHWD
                + self.visual_token_type_embeddings(visual_token_type_ids)[:, :, None, None, :]
            )
        grid_shape = video_BTHWD.shape[1:4]
        for axis, size in zip("THW", grid_shape):
            _check_positions(f"video token grid axis {axis}", size, MAX_VIDEO_POSITIONS_PER_AXIS)
        if visual_rope_pos is None:
            num_frames, height, width = grid_shape
            visual_rope_pos = (torch.arange(num_frames, device=device), torch.arange(height, device=device),
                               torch.arange(width, device=device))
        video_rope = self.visual_rope_embeddings(visual_rope_pos, self.config.scale_factor).flatten(
            0, 2
        )
        video_BLD = video_BTHWD.flatten(1, 3)

        audio_BAD = audio_rope = None
        if audio_hidden_states is not None:
            _check_positions("audio tokens", audio_hidden_states.shape[1], MAX_SEQUENCE_POSITIONS)
            audio_BAD = self.audio_embeddings(audio_hidden_states)
            audio_rope = self.audio_rope_embeddings(
                torch.arange(audio_hidden_states.shape[1], device=device)
            )

        # Keyword arguments: sequence parallelism splits `video_BLD` / `video_rope` by name (plan.py).
        video_BLD, audio_BAD = self.fused_blocks(
            self.visual_transformer_blocks,
            video_BLD=video_BLD,
            audio_BAD=audio_BAD,
            video_text_BSD=video_text_BSD,
            audio_text_BSD=audio_text_BSD,
            video_time_embed_BE=video_time_embed_BE,
            audio_time_embed_BE=audio_time_embed_BE,
            video_rope=video_rope,
            audio_rope=audio_rope,
            text_key_mask_BS=text_key_mask_BS,
        )

        video_out = self.out_layer(
            video_BLD.reshape(-1, *grid_shape, video_BLD.shape[-1]), video_time_embed_BE
        )
        audio_out = (
            self.audio_out_layer(audio_BAD, audio_time_embed_BE) if audio_BAD is not None else None
        )
        return video_out, audio_out

    def _encode_text(
        self,
        stream: str,
        text_BSX: Tensor,
        pooled_BX: Tensor,
        timestep_B: Tensor,
        positions_S: Tensor,
        key_mask_BS: Tensor | None,
    ) -> tuple[Tensor, Tensor]:
        """One stream's text branch: (text tokens (B, S, D), time embedding (B, E)).

        The text blocks are modulated by the time embedding, so this runs every step and per CFG branch.
        """
        rope = getattr(self, f"{stream}_text_rope_embeddings")(positions_S)
        text_BSD = getattr(self, f"{stream}_text_embeddings")(text_BSX)
        time_embed_BE = getattr(self, f"{stream}_time_embeddings")(timestep_B) + getattr(
            self, f"{stream}_pooled_text_embeddings"
        )(pooled_BX)
        for block in getattr(self, f"{stream}_text_transformer_blocks"):
            text_BSD = block(text_BSD, time_embed_BE, rope, key_mask_BS)
        return text_BSD, time_embed_BE


def _check_positions(what: str, size: int, limit: int) -> None:
    if size > limit:
        raise ValueError(
            f"{what}: {size} positions exceed the model's RoPE table of {limit}; reduce the input size"
        )


def cast_for_inference(model: Kandinsky6Transformer, dtype: torch.dtype) -> Kandinsky6Transformer:
    """Cast in place like diffusers' `from_pretrained(torch_dtype=dtype)` (k6-generation.md §2.8).

    Each floating parameter goes from its current dtype straight to `dtype`, except those with a
    keep-fp32 name as a whole path component (only `out_layer.modulation.*` and
    `audio_out_layer.modulation.*`), which go to fp32. Works on meta-device models too.
    """
    for name, parameter in model.named_parameters():
        if parameter.is_floating_point():
            target = torch.float32 if keeps_fp32(name, KEEP_FP32_MODULES) else dtype
            parameter.data = parameter.data.to(target)
    return model
