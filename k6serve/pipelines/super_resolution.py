"""Kandinsky 6 video super-resolution: read + plan + encode -> upscale -> denoise -> decode -> blend.

No prompt, no guidance: each tile is denoised by the checkpoint's two-step π-Flow (2 DiT calls per tile whatever
`num_inference_steps` says; `resolve_upscale` warns) and the source soundtrack is kept. The stages are in
`sr_source.py` (read and encode, overlapped), `sr_stages.py` (upscale, denoise) and `sr_decode.py` (decode and
blend); this class only calls them in order and times them.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path
from typing import cast

import numpy as np
import torch

from k6serve.models.kandinsky6_sr.checkpoint import SRModels, load_sr_models
from k6serve.models.variants import Variant
from k6serve.offload.components import RESIDENT
from k6serve.parallel.spatial_shard_decode import spatial_shard_of
from k6serve.pipelines.decode_stream import VideoSink, feed_video_sink, final_step_check
from k6serve.pipelines.prepare_latents import cpu_seed_note
from k6serve.pipelines.sr_decode import assemble_frames, decode_and_assemble_chunks, decode_tiles
from k6serve.pipelines.sr_plan import UpscalePlan, plan_upscale
from k6serve.pipelines.sr_source import read_and_encode
from k6serve.pipelines.sr_stages import denoise_tiles, upscale_tiles
from k6serve.pipelines.sr_tiling import stretches_aspect
from k6serve.pipelines.state import DecodedAudio
from k6serve.request import FlagWordedNote, ProgressCallback, UpscaleRequest


@dataclass(frozen=True, eq=False)
class UpscaledVideo:
    frames_THWC: np.ndarray  # uint8, on the CPU


@dataclass
class SuperResolutionOutput:
    video: UpscaledVideo
    audio: DecodedAudio | None
    fps: float
    timings: dict[str, float] = field(
        default_factory=dict
    )  # read, encode, upscale, dit, decode, blend (s); streamed: decode (with the blend), video_sink
    notes: list[str] = field(default_factory=list)
    # Pixel width over height of the frames: the source's non-square pixels, kept (None: square).
    sample_aspect_ratio: Fraction | None = None


class SuperResolutionPipeline:
    def __init__(self, models: SRModels) -> None:
        self.models = models
        # Which components are on the device for each stage: all of them, always, unless `apply_offload` set it.
        self.residency = RESIDENT

    def components(self) -> dict[str, torch.nn.Module]:
        """The modules the stages name in `residency.stage(...)`."""
        # diffusers' models are Modules; mypy reads their names from diffusers' dummy objects
        return {"vae": cast(torch.nn.Module, self.models.vae.model),
                "latent_upscaler": cast(torch.nn.Module, self.models.upscaler.bank),
                "transformer": self.models.transformer}

    def component_parts(self) -> dict[str, dict[str, torch.nn.Module]]:
        """The bank's upscalers, one per scale ("x2", "x4"): an offloaded bank moves only the one a request runs
        (`ComponentOffload`), so balanced / memory mode stages 2.2B or 1.45B parameters, not both."""
        upscaler = self.models.upscaler
        return {"latent_upscaler": {f"x{scale}": upscaler.model(scale) for scale in upscaler.scales}}

    def __call__(
        self, request: UpscaleRequest, *, on_step: ProgressCallback | None = None, video_sink: VideoSink | None = None
    ) -> SuperResolutionOutput:
        """Upscale one clip. With `video_sink`, the tiles are decoded segment by segment and each blended segment
        goes to the sink as soon as it is final (`decode_and_assemble_chunks`); then timings["decode"] includes
        the blend, there is no "blend" entry, and "video_sink" is the sink's time after the last chunk.

        `on_step(done, total)` runs after every DiT call, then again as `on_step(total, total)` between the
        decode's segments or tiles (`decode_tiles`, `decode_and_assemble_chunks`), so a cancel raised from it also
        stops the decode."""
        m = self.models
        timings: dict[str, float] = {}
        with self.residency.stage("vae"):
            source = read_and_encode(
                m.vae,
                request.video_path,
                m.device,
                lambda size: plan_upscale(
                    size, request, tile_sizes=m.transformer.config.tile_sizes, snap=m.vae.spatial_compression_ratio
                ),
                timings,
            )
        plan, latent = source.plan, source.latent_BCThw
        sample_aspect_ratio, aspect_note = _output_pixel_shape(source.sample_aspect_ratio, plan)
        m.upscaler.model(plan.scale.tiling_scale)  # a scale the bank lacks is refused before weights move
        with _timed(timings, "upscale", m.device), self.residency.stage(
                f"latent_upscaler[x{plan.scale.tiling_scale}]"):
            lq_tiles = upscale_tiles(m.upscaler, latent, plan)
        sampler = m.sampler()
        with _timed(timings, "dit", m.device), self.residency.stage("transformer"):
            latents = denoise_tiles(
                m.transformer,
                sampler,
                lq_tiles,
                seed=request.seed,
                tiles_batch_size=request.tiles_batch_size,
                lq_noise_scale=m.transformer.config.lq_noise_scale,
                dtype=m.dtype,
                on_step=on_step,
            )
        between_chunks = final_step_check(on_step, sampler.num_steps * len(lq_tiles))  # denoise_tiles' total
        if video_sink is not None:
            with self.residency.stage("vae"):
                # The spatial-shard decode starts inside decode_and_assemble_chunks: time it from here.
                started_at = time.perf_counter()
                chunks = decode_and_assemble_chunks(m.vae, latents, plan, between_chunks)
                frames_THWC = feed_video_sink(video_sink, chunks, source.audio, float(source.fps), timings, "decode",
                                              started_at=started_at, sample_aspect_ratio=sample_aspect_ratio)
        elif spatial_shard_of(m.vae) is not None:
            # A spatial-shard replica's ranks must make the collectives of the leader, which streams its segments
            # when it saves the MP4: the same segment-major decode here, the blend inside it.
            with _timed(timings, "decode", m.device), self.residency.stage("vae"):
                frames_THWC = np.concatenate(list(decode_and_assemble_chunks(m.vae, latents, plan, between_chunks)))
        else:
            with _timed(timings, "decode", m.device), self.residency.stage("vae"):
                tiles = decode_tiles(m.vae, latents, between_chunks)
            with _timed(timings, "blend", m.device):
                frames_THWC = assemble_frames(tiles, plan)
        timings["dit_per_call"] = timings["dit"] / (
            sampler.num_steps * -(-plan.num_tiles // request.tiles_batch_size)
        )
        # Tile noise is drawn on the DiT's device: CUDA's Philox generator takes all 64 bits of a seed, the CPU's 32.
        seed_note = cpu_seed_note(request.seed) if m.device.type == "cpu" else None
        notes = [*source.notes, *plan.notes, *aspect_note, *([seed_note] if seed_note else []),
                 FlagWordedNote.naming(lambda name: f"{plan.describe(name)}, {sampler.num_steps} DiT calls per tile")]
        return SuperResolutionOutput(
            video=UpscaledVideo(frames_THWC=frames_THWC),
            audio=source.audio,
            fps=float(source.fps),
            timings=timings,
            notes=notes,
            sample_aspect_ratio=sample_aspect_ratio,
        )


def _output_pixel_shape(source_ratio: Fraction | None, plan: UpscalePlan) -> tuple[Fraction | None, list[str]]:
    """The output's pixel aspect ratio and the note about it. The upscale scales both sides alike, so the source's
    non-square pixels stay that shape and the output is tagged with their ratio (players then show the source's
    shape). An 'exact' sr_target_resolution that reshapes the result sets the output's shape itself: its frames
    are written with square pixels (tagged with the source's ratio they would show at another shape again)."""
    if source_ratio is None:
        return None, []
    ratio = f"{source_ratio.numerator}:{source_ratio.denominator}"
    if stretches_aspect(plan.delivery_size, plan.crop_size):
        height, width = plan.delivery_size
        return None, [FlagWordedNote.naming(lambda name: (
            f"the 'exact' {name('sr_target_resolution')} sets the output's shape: its {width}x{height} frames have "
            f"square pixels, not the source's {ratio}"))]
    # The note is also an HTTP job's warning (beside the job's sample_aspect_ratio), so it names no field.
    return source_ratio, [f"the output keeps the source's sample aspect ratio {ratio}: the MP4 is tagged with it, "
                          "so players show the source's shape"]


@contextmanager
def _timed(timings: dict[str, float], name: str, device: torch.device) -> Iterator[None]:
    start = time.perf_counter()
    yield
    if device.type == "cuda":
        torch.cuda.synchronize(
            device
        )  # GPU work is asynchronous: charge it to the stage that queued it
    timings[name] = time.perf_counter() - start


def build_super_resolution_pipeline(
    folder: Path | None,
    variant: Variant,
    *,
    device: torch.device,
    dtype: torch.dtype,
    load_format: str,
    attention_backend: str,
    weights_device: torch.device | None = None,
) -> SuperResolutionPipeline:
    """Load the SR checkpoint (head/scheduler check first) and wrap it in the pipeline."""
    models = load_sr_models(folder, variant, device=device, dtype=dtype, load_format=load_format,
                            weights_device=weights_device)
    models.transformer.set_attention_backend(attention_backend)
    return SuperResolutionPipeline(models)
