"""The causal K-VAE of Kandinsky 6 SR: diffusers' `Kandinsky6SRVAE` modules, k6serve segment and cache control.

diffusers' `encode`/`decode` already segment the clip (17 then 16 pixel frames; 1+4 then 4 latent frames) and carry
the causal caches (A:585-640). k6serve runs that loop itself, calling the encoder/decoder submodules with caches it
owns, so a later multi-GPU whole-tile decode can hand complete tiles (each with a fresh cache chain) to ranks, and a
spatial-shard decode can hook individual convolutions.

norm_out activation of the decoder: x * sigmoid(x), not F.silu. SG uses it "to match the reference in bf16" and
k6serve follows SG (k6-super-resolution.md §0, §2.10); in bf16 it rounds twice (sigmoid, then product) where F.silu
rounds once, so it changes bf16 pixels. In fp32 the two agree to about one ulp, which the parity test bounds.

Shape legend: B batch (1 for a clip or a tile), C channels, T pixel frames, Tl latent frames, H/W pixel size,
h/w latent size.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import cast

import torch
# From its defining module: mypy types the top-level name as diffusers' torch-less placeholder (dummy_pt_objects).
from diffusers.models.autoencoders.autoencoder_kandinsky6_sr import Kandinsky6SRVAE
from torch import Tensor, nn

from k6serve.models.kandinsky6_sr.config import SRVAEConfig

ENCODE_SEGMENT_FRAMES = 16  # pixel frames per encode segment after the first, which has one more
DECODE_SEGMENT_LATENT_FRAMES = (
    4  # latent frames per decode segment after the first, which has one more
)


def build_vae(config: SRVAEConfig) -> Kandinsky6SRVAE:
    """Construct the diffusers module from a vendor config (on the current default device; meta works)."""
    return Kandinsky6SRVAE(**config.to_diffusers_kwargs())


def normalize_pixels(video_uint8: Tensor) -> Tensor:
    """uint8 pixels -> x / 128 - 1 in fp32: the K-VAE's training normalisation (not / 127.5, §2.5)."""
    return video_uint8.float() / 128 - 1


def encode_segment_lengths(num_frames: int) -> list[int]:
    """17, 16, 16, ..., remainder: 121 -> [17, 16, 16, 16, 16, 16, 16, 8]."""
    lengths = [min(ENCODE_SEGMENT_FRAMES + 1, num_frames)]
    while sum(lengths) < num_frames:
        lengths.append(min(ENCODE_SEGMENT_FRAMES, num_frames - sum(lengths)))
    return lengths


def decode_segment_lengths(num_latent_frames: int) -> list[int]:
    """1+4, 4, ..., remainder: 31 -> [5, 4, 4, 4, 4, 4, 4, 2]."""
    lengths = [min(DECODE_SEGMENT_LATENT_FRAMES + 1, num_latent_frames)]
    while sum(lengths) < num_latent_frames:
        lengths.append(min(DECODE_SEGMENT_LATENT_FRAMES, num_latent_frames - sum(lengths)))
    return lengths


def latent_to_uint8(decoded_BCTHW: Tensor) -> Tensor:
    """Decoder output -> uint8 as R/SG do before blending: ((x+1)*128/255).clamp(0,1)*255 in fp32, truncated."""
    return (((decoded_BCTHW.float() + 1) * 128 / 255).clamp(0, 1) * 255).to(torch.uint8)


class SRVAE:
    """Whole-clip causal encode and per-tile decode on one device."""

    def __init__(self, model: Kandinsky6SRVAE) -> None:
        self.model = model
        self.scaling_factor = float(model.config["scaling_factor"])
        self.spatial_compression_ratio = int(model.spatial_compression_ratio)
        self.temporal_compression_ratio = int(model.temporal_compression_ratio)

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    @torch.no_grad()
    def encode_clip(self, video_BCTHW: Tensor) -> Tensor:
        """Pixels (uint8, or already x/128-1) -> posterior mean x scaling_factor, the space of the LU and DiT.

        The frame count must be 1 + 4k; the clip is encoded in causal segments sharing one cache chain, which
        equals a single pass (§2.5).
        """
        num_frames = video_BCTHW.shape[2]
        if (num_frames - 1) % self.temporal_compression_ratio:
            raise ValueError(
                f"the clip has {num_frames} frames; the K-VAE needs 1 + {self.temporal_compression_ratio}k "
                "(the SR reader keeps 1 + 8k frames)."
            )
        encoder = self.clip_encoder()
        for segment in torch.split(video_BCTHW, encode_segment_lengths(num_frames), dim=2):
            encoder.push(segment)
        return encoder.latent()

    def clip_encoder(self) -> CausalClipEncoder:
        """`encode_clip` one segment at a time, for frames that arrive while the clip is still being read."""
        return CausalClipEncoder(self)

    @torch.no_grad()
    def decode_tile_raw(self, latent_BCThw: Tensor) -> Tensor:
        """Scaled latent tile -> decoder output in normalised pixel space, with a fresh cache chain per tile."""
        return torch.cat(list(self.iter_decode_tile_raw(latent_BCThw)), dim=2)

    def iter_decode_tile_raw(self, latent_BCThw: Tensor) -> Iterator[Tensor]:
        """`decode_tile_raw` one causal segment at a time (1 + 4, 4, ... latent frames -> 17, 16, ... frames).

        The tile's cache chain lives in the generator, so several tiles can be decoded segment by segment,
        interleaved, each giving exactly the segments of its own `decode_tile_raw`.
        """
        with torch.no_grad():
            latent_BCThw = latent_BCThw.to(self.dtype) / self.scaling_factor
            cache = self.model.decoder.make_cache()
            segments = torch.split(latent_BCThw, decode_segment_lengths(latent_BCThw.shape[2]), dim=2)
        for segment in segments:
            with torch.no_grad():  # not around the yield: the caller's grad mode stays its own
                decoded = self._decode_segment(segment, cache)
            yield decoded

    def decode_tile(self, latent_BCThw: Tensor) -> Tensor:
        """Scaled latent tiles (B, C, Tl, h, w) -> uint8 frames (B, T, 3, H, W), truncated as in R/SG."""
        return latent_to_uint8(self.decode_tile_raw(latent_BCThw)).transpose(1, 2)

    def iter_decode_tile(self, latent_BCThw: Tensor) -> Iterator[Tensor]:
        """`decode_tile` one causal segment at a time: uint8 (B, T_i, 3, H, W) per segment."""
        for decoded in self.iter_decode_tile_raw(latent_BCThw):
            yield latent_to_uint8(decoded).transpose(1, 2)

    def _decode_segment(self, latent_BCThw: Tensor, cache: dict) -> Tensor:
        # Kandinsky6SRDecoder3D.forward (A:497-513) with x * sigmoid(x) at norm_out; see the module docstring.
        decoder = self.model.decoder
        hidden = decoder.conv_in(latent_BCThw, cache["conv_in"])
        # `mid` and each level of `up` are plain nn.Module holders, whose children torch's stubs type as
        # Tensor | Module.
        hidden = cast(nn.Module, decoder.mid.block_1)(hidden, cache["mid_1"], zq=latent_BCThw)
        hidden = cast(nn.Module, decoder.mid.block_2)(hidden, cache["mid_2"], zq=latent_BCThw)
        for level in reversed(range(len(decoder.up))):
            up, level_cache = decoder.up[level], cache["up"][level]
            for index, block in enumerate(cast(nn.ModuleList, up.block)):
                hidden = block(hidden, level_cache["block"][index], zq=latent_BCThw)
            if hasattr(up, "upsample"):
                hidden = cast(nn.Module, up.upsample)(hidden, level_cache["upsample"])
        hidden = decoder.norm_out(hidden, latent_BCThw, cache["norm_out"])
        hidden = hidden * torch.sigmoid(hidden)
        return decoder.conv_out(hidden, cache["conv_out"])


class CausalClipEncoder:
    """`SRVAE.encode_clip` fed one causal segment at a time (one cache chain): push the segments of
    `encode_segment_lengths(num_frames)` in order, then `latent()` is exactly what `encode_clip` returns for the
    whole clip (the same encoder calls on the same segments; the mean and the scaling are per element)."""

    def __init__(self, vae: SRVAE) -> None:
        self._vae = vae
        self._cache = vae.model.encoder.make_cache()
        self._latents: list[Tensor] = []
        self.segment_lengths: list[int] = []

    @torch.no_grad()
    def push(self, segment_BCTHW: Tensor) -> None:
        """Encode the next segment: uint8 pixels, or already x/128-1."""
        if segment_BCTHW.dtype == torch.uint8:
            segment_BCTHW = normalize_pixels(segment_BCTHW)
        moments_BCTHW = self._vae.model.encoder(segment_BCTHW.to(self._vae.dtype), self._cache)
        mean_BCTHW = moments_BCTHW[:, : self._vae.model.config["latent_channels"]]
        self._latents.append(mean_BCTHW * self._vae.scaling_factor)
        self.segment_lengths.append(segment_BCTHW.shape[2])

    def latent(self) -> Tensor:
        """(1, C, T', h, w): the segments' latents in order."""
        return torch.cat(self._latents, dim=2)
