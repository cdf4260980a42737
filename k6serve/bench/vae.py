"""Stage `vae`: HunyuanVideo VAE decode of one clip, diffusers' default vs ours with the speed-ups.

Both rows run `k6serve.pipelines.decode.decode_video` (diffusers' default framewise temporal tiling, then
the same uint8 quantisation), so the decode differs only by what `apply_vae_speedups` changed; the speed-ups
are applied cumulatively, in place, after the baseline: speed mode's (nothing but cuDNN's autotuner, and that only
with `K6SERVE_CUDNN_BENCHMARK=1`), then (when asked) a compiled decoder. `max|diff|` is the largest uint8
difference from the baseline's frames.

What reaches the host differs, as it does between the two systems: the baseline also copies the float frames
(570 MB of fp32 at 512x768x121), standing in for diffusers' pipelines, which hand float frames to the host too
(`postprocess_video` copies the decoder's output in its dtype, 285 MB of bf16 at that size, and converts it to
fp32 on the CPU; the Kandinsky 6 pipelines' default `output_type="pil"` then quantises to uint8 on the CPU as
well), while our rows copy the uint8 frames alone, as the engine does
(`TextToVideoPipeline(keep_float_frames=False)` in the worker). So the baseline's host work is not diffusers'
byte for byte: a float copy twice the size of diffusers' (and the uint8 one), none of its CPU conversions.
The H200 profile put the fp32 copy at about 0.33 s of the baseline's 6.7 s. So a second baseline row does the same
host work as ours (`diffusers default decode, uint8 to host`), and our rows' notes give the ratio against it too:
the speed-ups' own share, without the copy the engine's design saves.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

from k6serve.bench.components import build_video_vae
from k6serve.bench.geometry import GenerationGeometry
from k6serve.bench.measure import max_abs_difference, measure
from k6serve.bench.report import BenchRow
from k6serve.pipelines.decode import decode_video
from k6serve.request import error_type_name
from k6serve.speed.vae import apply_vae_speedups

_VIDEO_LATENT_CHANNELS = 16


@dataclass(frozen=True, kw_only=True, slots=True)
class VaeOptions:
    geometry: GenerationGeometry
    device: torch.device
    dtype: torch.dtype
    tiny: bool = False
    compile_decoder: bool = False
    repeats: int = 3
    warmup: int = 1
    seed: int = 0


def _decode_row(name: str, options: VaeOptions, vae, latents, reference_frames, reference_seconds: float | None, *,
                keep_float: bool, baseline: bool = False):
    """One timed decode. The baseline is x 1.00 against itself; a row after a baseline that failed shows no ratio
    (it showed x 1.00, its own time as the reference)."""
    row = BenchRow(stage="vae", name=name, config=options.geometry.label)
    try:
        result = measure(
            lambda: decode_video(vae, latents, keep_float=keep_float),
            device=options.device,
            repeats=options.repeats,
            warmup=options.warmup,
        )
        row.record(result)
        frames = torch.from_numpy(result.output.frames_THWC)
        row.output_sha256 = (hashlib.sha256(result.output.frames_THWC.tobytes()).hexdigest(),)
        row.reference_seconds = row.seconds if baseline else reference_seconds
        if reference_frames is not None:
            row.max_abs_diff = max_abs_difference(frames, reference_frames)
        return row, frames
    except Exception as error:  # noqa: BLE001 (a stage failure is a table row)
        row.error = f"{error_type_name(error)}: {error}"
        return row, None


def run_vae(options: VaeOptions) -> list[BenchRow]:
    geometry = options.geometry
    vae = build_video_vae(tiny=options.tiny, device=options.device, dtype=options.dtype)
    generator = torch.Generator(device="cpu").manual_seed(options.seed)
    latents = torch.randn(
        (
            1,
            geometry.num_latent_frames,
            geometry.latent_height,
            geometry.latent_width,
            _VIDEO_LATENT_CHANNELS,
        ),
        generator=generator,
    ).to(device=options.device, dtype=options.dtype)
    previous_benchmark = torch.backends.cudnn.benchmark
    # Restored however the rows end: a speed-up that fails to compile had left cuDNN autotuning on for the later
    # stages of the same process (audio and text under `decoders` / `--stage all`).
    try:
        torch.backends.cudnn.benchmark = False  # diffusers' default
        baseline, reference_frames = _decode_row(
            "diffusers default decode", options, vae, latents, None, None, keep_float=True, baseline=True
        )
        same_host, _ = _decode_row("diffusers default decode, uint8 to host", options, vae, latents,
                                   reference_frames, baseline.seconds, keep_float=False)
        same_host.note = "the baseline without its float copy to the host: ours' host work"
        rows = [baseline, same_host]
        # channels-last is not timed any more: 1.55x slower than the baseline on H200 (docs/benchmarks.md).
        steps = [("ours speed mode", {"compile_decoder": False})]
        if options.compile_decoder:
            steps.append(("ours +compiled decoder", {"compile_decoder": True}))
        for name, flags in steps:
            try:
                applied = apply_vae_speedups(vae, options.device, **flags)
            except Exception as error:  # noqa: BLE001 (a stage failure is a table row)
                rows.append(BenchRow(stage="vae", name=name, config=geometry.label,
                                     error=f"{error_type_name(error)}: {error}"))
                break
            row, _ = _decode_row(name, options, vae, latents, reference_frames, baseline.seconds, keep_float=False)
            # Speed mode alone applies nothing to the decode (cuDNN's autotuner only with K6SERVE_CUDNN_BENCHMARK=1).
            row.note = "applied: " + (", ".join(applied) or ("nothing" if options.device.type == "cuda"
                                                             else "nothing (not CUDA)"))
            if row.seconds and same_host.seconds:
                row.note += f"; x{same_host.seconds / row.seconds:.2f} against the same host work"
            rows.append(row)
    finally:
        torch.backends.cudnn.benchmark = previous_benchmark
    return rows
