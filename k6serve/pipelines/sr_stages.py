"""The stages of Kandinsky 6 video super-resolution around the DiT, in the order `SuperResolutionPipeline` calls them.

read source -> plan (scale, tile grid, output sizes: every user error is raised here, before any compute) ->
prepare pixels (x1.125 uint8 round trip, replicate pad; here) -> causal encode (these three in `sr_source.py`, the
encode overlapping the read) -> per-tile latent upscaling -> per-chunk π-Flow denoising (here) -> per-tile decode ->
Hann blend, crop, optional downscale (`sr_decode.py`) (k6-super-resolution.md §2, the SG column of §7). Geometry,
blending and noise helpers live in `sr_tiling.py`.

Frames are uint8 (T, 3, H, W) tensors; latents are (B, C, T, h, w) for the K-VAE and the bank, and (B, T, h, w, C)
channels-last for the DiT. T' below is the number of latent frames.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from k6serve.pipelines.sr_plan import UpscalePlan
from k6serve.pipelines.sr_tiling import (
    chunk_noise,
    chunk_tiles,
    mix_lq_noise,
    pad_to_multiple,
    pre_upscale_x1125,
)
from k6serve.request import ProgressCallback

if TYPE_CHECKING:  # annotations only: the server plans an upscale's tiles (`plan_upscale`) without the models
    from k6serve.models.kandinsky6_sr.piflow import SRPiflowSampler
    from k6serve.models.kandinsky6_sr.transformer import SRTransformer
    from k6serve.models.kandinsky6_sr.upscaler import SRLatentUpscaler


def prepare_pixels(frames_TCHW: Tensor, plan: UpscalePlan) -> Tensor:
    """x2.25: bilinear x1.125 rounded back to uint8; then replicate-pad to the latent cell (cropped at the end)."""
    if plan.scale.pre_upscale != 1.0:
        frames_TCHW = pre_upscale_x1125(frames_TCHW)
    assert tuple(frames_TCHW.shape[-2:]) == plan.input_size
    return pad_to_multiple(frames_TCHW, plan.snap)


def upscale_tiles(
    upscaler: SRLatentUpscaler, latent_BCThw: Tensor, plan: UpscalePlan
) -> list[Tensor]:
    """Cut each tile's window from the whole-clip latent and upscale it -> (1, T', h*s, w*s, C) fp32 per tile."""
    tiles = []
    for index in range(plan.num_tiles):
        rows, columns = plan.grid.latent_window(index, plan.snap)
        upscaled_BCThw = upscaler.upscale(latent_BCThw[..., rows, columns], plan.scale.tiling_scale)
        tiles.append(upscaled_BCThw.permute(0, 2, 3, 4, 1))
    return tiles


def denoise_tiles(
    transformer: SRTransformer,
    sampler: SRPiflowSampler,
    lq_tiles: Sequence[Tensor],
    *,
    seed: int,
    tiles_batch_size: int,
    lq_noise_scale: float,
    dtype: torch.dtype,
    on_step: ProgressCallback | None = None,
) -> list[Tensor]:
    """π-Flow from the noised LQ tiles, `tiles_batch_size` tiles per DiT call -> (T', h, w, C) fp32 per tile.

    The chunk starting at tile s draws its noise from a fresh generator seeded with seed + s (§2.7), so changing
    `tiles_batch_size` changes the noise of every tile that no longer starts a chunk. `on_step(done, total)` is
    called after every DiT call with done/total counted in tile-steps (total = nfe x tiles), so progress and
    cancellation move at DiT-call boundaries whatever the batch size.
    """
    total = sampler.num_steps * len(lq_tiles)
    done = 0
    denoised: list[Tensor] = []
    for chunk in chunk_tiles(len(lq_tiles), tiles_batch_size, seed):
        lq_BThwC = torch.cat(list(lq_tiles[chunk.start : chunk.stop])).to(dtype)
        # Drawn on the DiT's device with a generator seeded per chunk, as R and SG do: on CUDA this is the Philox
        # stream, on CPU the CPU generator (the one diffusers' pipeline uses in the parity test).
        noise_BThwC = chunk_noise(lq_BThwC.shape, chunk.seed, lq_BThwC.device, dtype)
        # The mix rounds in the DiT dtype (SG); the π-Flow state is fp32 from here on (§2.8).
        sample_BThwC = mix_lq_noise(lq_BThwC, noise_BThwC, lq_noise_scale).float()
        for timestep in sampler.timesteps(lq_BThwC.device):
            output = transformer(_model_input(sample_BThwC, dtype), timestep.expand(len(lq_BThwC)))
            sample_BThwC = sampler.step(output, timestep, sample_BThwC)
            done += chunk.stop - chunk.start
            if on_step is not None:
                on_step(done, total)
        denoised.extend(sample_BThwC)
    return denoised


def _model_input(sample_BThwC: Tensor, dtype: torch.dtype) -> Tensor:
    """[latent | anchor | anchor mask]: the released model is anchor-free, so anchor and mask are zeros (§2.7)."""
    sample_BThwC = sample_BThwC.to(dtype)
    mask_BThw1 = sample_BThwC.new_zeros((*sample_BThwC.shape[:-1], 1))
    return torch.cat([sample_BThwC, torch.zeros_like(sample_BThwC), mask_BThw1], dim=-1)
