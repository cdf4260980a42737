"""Token counts of a generation request, as the pipeline computes them (performance.md §1.1)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from k6serve.pipelines.prepare_latents import VAE_SPATIAL, VAE_TEMPORAL, audio_latent_length

AUDIO_SAMPLE_RATE = 44100
AUDIO_LATENT_HOP_LENGTH = 1024
# diffusers pads every prompt to 1024 Qwen tokens (k6-generation.md §3.2).
NUM_TEXT_TOKENS = 1024


@dataclass(frozen=True, kw_only=True, slots=True)
class GenerationGeometry:
    """Latent grid and token counts of one (height, width, num_frames) request."""

    height: int
    width: int
    num_frames: int
    num_latent_frames: int
    latent_height: int
    latent_width: int
    num_video_tokens: int
    num_audio_tokens: int
    num_text_tokens: int

    @property
    def label(self) -> str:
        return f"{self.height}x{self.width}x{self.num_frames}"


def generation_geometry(
    height: int,
    width: int,
    num_frames: int,
    *,
    fps: float = 24.0,
    patch_size: tuple[int, int, int] = (1, 2, 2),
    num_text_tokens: int = NUM_TEXT_TOKENS,
) -> GenerationGeometry:
    """The latent grid and token counts the DiT sees for a request of this size."""
    patch_t, patch_h, patch_w = patch_size
    multiple = VAE_SPATIAL * max(patch_h, patch_w)
    if height <= 0 or width <= 0 or height % multiple or width % multiple:
        raise ValueError(f"height and width must be positive multiples of {multiple}, got {height}x{width}")
    if num_frames < 1 or num_frames % VAE_TEMPORAL != 1:
        raise ValueError(f"num_frames must be 4k+1 (e.g. 121), got {num_frames}")
    num_latent_frames = (num_frames - 1) // VAE_TEMPORAL + 1
    latent_height, latent_width = height // VAE_SPATIAL, width // VAE_SPATIAL
    num_video_tokens = math.prod(
        (num_latent_frames // patch_t, latent_height // patch_h, latent_width // patch_w)
    )
    num_audio_tokens = audio_latent_length(
        num_latent_frames, fps, AUDIO_SAMPLE_RATE, AUDIO_LATENT_HOP_LENGTH
    )
    return GenerationGeometry(
        height=height,
        width=width,
        num_frames=num_frames,
        num_latent_frames=num_latent_frames,
        latent_height=latent_height,
        latent_width=latent_width,
        num_video_tokens=num_video_tokens,
        num_audio_tokens=num_audio_tokens,
        num_text_tokens=num_text_tokens,
    )
