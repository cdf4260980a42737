"""Stage: video VAE decode (the reference's framewise temporal tiling) and audio VAE + vocoder.

The HunyuanVideo VAE decodes with its default framewise temporal tiling (4 latent frames, stride 3, 4-frame
blend): bit identity with the reference needs exactly that (k6-generation.md §3.7). Frames are quantised as
diffusers' PIL path does, round(x * 255).
"""

from __future__ import annotations

import torch

from k6serve.pipelines.state import DecodedAudio, DecodedVideo


@torch.inference_mode()
def decode_video(vae, video_BTHWC: torch.Tensor, *, keep_float: bool = True) -> DecodedVideo:
    """Latents -> uint8 frames (T, H, W, 3) on the host; with `keep_float`, also the float frames.

    The float frames exist for parity checks; a server does not need them. At 512x768x121 they are 570 MB of
    fp32 next to 142 MB of uint8; the H200 profile showed 0.41 s of device-to-host copies for the two together.
    """
    latents = video_BTHWC.permute(0, 4, 1, 2, 3).to(vae.dtype) / vae.config.scaling_factor
    pixels = vae.decode(latents, return_dict=False)[0]  # (1, 3, T, H, W) in [-1, 1]
    frames = float_frames(pixels)
    as_uint8 = quantise(frames).cpu().numpy()
    return DecodedVideo(frames_float_THWC=frames.cpu() if keep_float else None, frames_THWC=as_uint8)


def float_frames(pixels_BCTHW: torch.Tensor) -> torch.Tensor:
    """Decoder output in [-1, 1] (batch 1) -> float32 frames (T, H, W, 3) in [0, 1], on its device.

    `(x * 0.5 + 0.5).clamp(0, 1)` runs in the decoder's dtype and only then becomes fp32, as diffusers'
    `VaeImageProcessor.denormalize` + `pt_to_numpy` do: with a bf16 VAE the value is rounded to bf16 before the
    `round(x * 255)`, so the uint8 frames equal diffusers' PIL frames bit for bit (in fp32 nothing changes).
    """
    return (pixels_BCTHW[0] * 0.5 + 0.5).clamp(0, 1).float().permute(1, 2, 3, 0).contiguous()


def quantise(frames_THWC: torch.Tensor) -> torch.Tensor:
    """Float frames in [0, 1] -> uint8, rounded to nearest."""
    return (frames_THWC * 255).round().to(torch.uint8)


@torch.inference_mode()
def decode_audio(audio_vae, vocoder, audio_BLC: torch.Tensor) -> DecodedAudio:
    latents = audio_BLC.permute(0, 2, 1).to(audio_vae.dtype) / audio_vae.config.scaling_factor
    mel = audio_vae.decode(latents, return_dict=False)[0]
    waveform = vocoder(mel.to(vocoder.dtype), return_dict=False)[0][:, 0].float()
    return DecodedAudio(waveform=waveform[0].cpu().numpy(), sample_rate=int(audio_vae.config.sample_rate))
