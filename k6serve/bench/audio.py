"""Stage `audio`: MMAudio VAE decode + vocoder of one clip's audio latents (the code diffusers runs)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from k6serve.bench.components import build_audio_decoder
from k6serve.bench.geometry import GenerationGeometry
from k6serve.bench.measure import measure
from k6serve.bench.report import BenchRow
from k6serve.pipelines.decode import decode_audio
from k6serve.request import error_type_name


@dataclass(frozen=True, kw_only=True, slots=True)
class AudioOptions:
    geometry: GenerationGeometry
    device: torch.device
    dtype: torch.dtype
    tiny: bool = False
    repeats: int = 3
    warmup: int = 1
    seed: int = 0


def run_audio(options: AudioOptions) -> list[BenchRow]:
    row = BenchRow(stage="audio", name="ours decode_audio", config=options.geometry.label)
    try:
        audio_vae, vocoder = build_audio_decoder(
            tiny=options.tiny, device=options.device, dtype=options.dtype
        )
        channels = int(audio_vae.config.latent_channels)
        generator = torch.Generator(device="cpu").manual_seed(options.seed)
        latents = torch.randn((1, options.geometry.num_audio_tokens, channels), generator=generator)
        latents = latents.to(device=options.device, dtype=options.dtype)
        result = measure(
            lambda: decode_audio(audio_vae, vocoder, latents),
            device=options.device,
            repeats=options.repeats,
            warmup=options.warmup,
        )
        row.record(result)
        row.note = f"{result.output.waveform.shape[0]} samples at {result.output.sample_rate} Hz"
    except Exception as error:  # noqa: BLE001 (a stage failure is a table row)
        row.error = f"{error_type_name(error)}: {error}"
    return [row]
