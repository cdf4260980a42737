"""Stage: initial noise, audio length and the TI2AV reference frame (k6-generation.md §3.3-3.4, §4).

Random numbers follow the reference order on one generator: (TI2AV) the VAE posterior sample of the image,
then the video noise, then the audio noise, each drawn on the generator's device directly in the transformer
dtype. We use a CPU generator, so a seed gives the same noise on every device. That generator (torch's Mersenne
Twister, which diffusers draws with too) keeps only a seed's low 32 bits: seeds 2**32 apart draw the same noise, so
outputs follow diffusers' for every seed, and `cpu_seed_note` tells a user whose seed is 2**32 or more.
"""

from __future__ import annotations

import math

import torch

from k6serve.pipelines.state import Latents
from k6serve.request import GenerateRequest

VAE_SPATIAL = 8
VAE_TEMPORAL = 4


def make_generator(seed: int) -> torch.Generator:
    return torch.Generator(device="cpu").manual_seed(seed)


def cpu_seed_note(seed: int) -> str | None:
    """A note for a seed that torch's CPU generator cuts to its low 32 bits (the module docstring), else None."""
    if seed < 2**32:
        return None
    return (f"seed {seed} draws the same noise as seed {seed % 2**32}: torch's CPU random generator, which draws "
            "the noise (as in diffusers), keeps only a seed's low 32 bits; for distinct outputs use seeds below "
            "2**32 (4294967296)")


def randn(shape: tuple[int, ...], generator: torch.Generator, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    # Drawn on the generator's device in the target dtype, then moved (diffusers' randn_tensor).
    return torch.randn(shape, generator=generator, device=generator.device, dtype=dtype).to(device)


def audio_latent_length(num_latent_frames: int, fps: float, sample_rate: int, latent_hop_length: int) -> int:
    num_pixel_frames = (num_latent_frames - 1) * VAE_TEMPORAL + 1
    return math.ceil(num_pixel_frames / fps * sample_rate / latent_hop_length)


@torch.inference_mode()
def encode_reference_image(image, vae, *, height: int, width: int, device: torch.device, dtype: torch.dtype,
                           generator: torch.Generator) -> torch.Tensor:
    """PIL image -> clean first-frame latent (1, h, w, 16), scaled; samples the posterior as the reference."""
    from diffusers.video_processor import VideoProcessor

    pixels = VideoProcessor(vae_scale_factor=VAE_SPATIAL).preprocess(image, height=height, width=width,
                                                                        resize_mode="crop")
    pixels = pixels.to(device=device, dtype=vae.dtype).unsqueeze(2)
    # A posterior *sample* (not the mode), consuming the generator first, as the reference does.
    latent = vae.encode(pixels).latent_dist.sample(generator) * vae.config.scaling_factor
    return latent[:, :, 0].permute(0, 2, 3, 1).to(dtype)


def prepare_latents(
    request: GenerateRequest,
    *,
    in_visual_dim: int,
    in_audio_dim: int,
    with_audio: bool,
    audio_sample_rate: int,
    audio_latent_hop_length: int,
    device: torch.device,
    dtype: torch.dtype,
    generator: torch.Generator,
    tail_latent_BHWC: torch.Tensor | None,
    patch_size: tuple[int, int, int] = (1, 2, 2),
) -> Latents:
    num_latent_frames = request.num_latent_frames
    shape = (1, num_latent_frames, request.height // VAE_SPATIAL, request.width // VAE_SPATIAL, in_visual_dim)
    video = randn(shape, generator, device, dtype)
    audio = None
    if with_audio:
        length = audio_latent_length(num_latent_frames, request.fps, audio_sample_rate, audio_latent_hop_length)
        audio = randn((1, length, in_audio_dim), generator, device, dtype)
    if tail_latent_BHWC is None:
        return Latents(video_BTHWC=video, audio_BLC=audio)
    # TI2AV: the clean image latent is an extra last frame with token type 1 that shares t-position 0.
    video = torch.cat([video, tail_latent_BHWC[:, None]], dim=1)
    token_types = torch.zeros((1, num_latent_frames + 1), dtype=torch.long, device=device)
    token_types[:, -1] = 1
    patch_t, patch_h, patch_w = patch_size
    positions = (
        torch.cat([torch.arange(num_latent_frames // patch_t, device=device),
                   torch.zeros(1, dtype=torch.long, device=device)]),
        torch.arange(video.shape[2] // patch_h, device=device),
        torch.arange(video.shape[3] // patch_w, device=device),
    )
    return Latents(video_BTHWC=video, audio_BLC=audio, tail_BHWC=tail_latent_BHWC, rope_positions=positions,
                   token_type_ids_BT=token_types)
