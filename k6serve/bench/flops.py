"""FLOPs of one Kandinsky 6 DiT forward (k6-generation.md §2.11, full count) and the H200 floor rate.

A multiply-add is 2 FLOP. Per fused block, with video tokens N_v, audio tokens N_a, text tokens N_t, widths
d, f (video) and d_a, f_a (audio):
  video projections 16·N_v·d² + 4·N_v·d·f + 4·N_t·d² + 4·N_a·d_a·d
  audio projections 16·N_a·d_a² + 4·N_a·d_a·f_a + 4·N_t·d_a² + 4·N_v·d·d_a
  attention cores   4·d·(N_v² + N_v·N_t + N_v·N_a) + 4·d_a·(N_a² + N_a·N_t + N_a·N_v)
plus the text branches, the embeddings and the heads. Without audio the audio terms of the fused blocks
vanish (the audio text branch still runs), and so do the video side's audio cross-attention projections (its
query and output, 4·N_v·d² of the 16): the block skips that attention.
"""

from __future__ import annotations

import math

import torch

from k6serve.models.kandinsky6.config import Kandinsky6TransformerConfig
from k6serve.models.kandinsky6_sr.config import SRTransformerConfig

# The measured dense bf16 GEMM rate of one H200 (performance.md §0): the "floor" every row is compared to.
FLOOR_TFLOPS = 790.0


def _text_branch_flops(num_text: int, dim: int, ff_dim: int) -> float:
    return 8 * num_text * dim**2 + 4 * num_text**2 * dim + 4 * num_text * dim * ff_dim


def kandinsky6_forward_flops(
    config: Kandinsky6TransformerConfig,
    *,
    num_video_tokens: int,
    num_audio_tokens: int,
    num_text_tokens: int,
) -> float:
    """FLOPs of one forward of the generation DiT on one sample (`num_audio_tokens` 0: video only)."""
    d, f = config.model_dim, config.ff_dim
    d_a, f_a = config.audio_model_dim, config.audio_ff_dim
    n_v, n_a, n_t = num_video_tokens, num_audio_tokens, num_text_tokens
    # Self-attention Q/K/V/O 8·N_v·d², the text cross-attention's Q/O 4·N_v·d², the audio one's Q/O 4·N_v·d²
    # (only with audio: the block skips it without; counted, a video-only Pro forward read 5.3% more work than it
    # does).
    video = (16 if n_a else 12) * n_v * d**2 + 4 * n_v * d * f + 4 * n_t * d**2 + 4 * n_a * d_a * d
    video_attention = 4 * d * (n_v**2 + n_v * n_t + n_v * n_a)
    audio = audio_attention = 0
    if n_a:
        audio = 16 * n_a * d_a**2 + 4 * n_a * d_a * f_a + 4 * n_t * d_a**2 + 4 * n_v * d * d_a
        audio_attention = 4 * d_a * (n_a**2 + n_a * n_t + n_a * n_v)
    blocks = config.num_visual_blocks * (video + video_attention + audio + audio_attention)
    text = config.num_text_blocks * (
        _text_branch_flops(n_t, d, f) + _text_branch_flops(n_t, d_a, f_a)
    )
    patch_volume = math.prod(config.patch_size)
    embeddings = (
        2 * n_t * config.in_text_dim * (d + d_a)
        + 2 * n_v * patch_volume * config.visual_in_channels * d
        + 2 * n_a * config.in_audio_dim * d_a
        + 2 * n_v * d * patch_volume * config.out_visual_dim
        + 2 * n_a * d_a * config.out_audio_dim
    )
    return float(blocks + text + embeddings)


def sr_dit_forward_flops(config: SRTransformerConfig, *, num_tokens: int) -> float:
    """FLOPs of one SR DiT call on one tile of `num_tokens` latent tokens with dense attention
    (k6-super-resolution.md §5: per block 8d² + 4d·ff per token for the projections and FFN, 4·S²·d for the
    attention; the embeddings and the head are left out, < 0.1%)."""
    d, f, s = config.model_dim, config.ff_dim, num_tokens
    return float(config.num_visual_blocks * (s * (8 * d**2 + 4 * d * f) + 4 * s**2 * d))


def sr_vae_tile_decode_flops(
    configs, latent_frames: int, latent_height: int, latent_width: int, *, subpixel_upsample: bool = False
) -> float:
    """FLOPs of the SR K-VAE's decode of one latent tile (frames x height x width latents; a 512x768 output tile of
    121 frames is 31 x 32 x 48): the sum over its convolutions, counted by torch's `FlopCounterMode` while the
    decoder runs on a meta-device build of `configs` (an `SRConfigs`), so no weights are allocated and the count
    follows the decoder's real segment and cache logic. Released K-VAE: 837.6 TFLOP per tile, all convolutions
    (sixth session). Why not a formula: the causal segments, the first-frame handling and the upsamplers make one
    error-prone, and the count is what the profile's convolution time is compared with. `subpixel_upsample`: the
    decode with the upsamplers folded into one 2x2 phase convolution (speed/kvae_upsample.py), 735.5 TFLOP per tile."""
    from torch.utils.flop_counter import FlopCounterMode

    from k6serve.models.kandinsky6_sr.checkpoint import build_dummy_sr_models
    from k6serve.models.variants import VARIANTS

    meta = torch.device("meta")
    models = build_dummy_sr_models(configs, VARIANTS["vsr-distilled2steps"], device=meta, dtype=torch.bfloat16)
    if subpixel_upsample:
        from k6serve.speed.kvae_upsample import apply_subpixel_upsample

        apply_subpixel_upsample(models.vae.model.decoder)
    latent = torch.empty(1, configs.vae.latent_channels, latent_frames, latent_height, latent_width,
                         device=meta, dtype=torch.bfloat16)
    with torch.inference_mode(), FlopCounterMode(display=False) as counter:
        models.vae.decode_tile(latent)
    return float(counter.get_total_flops())
