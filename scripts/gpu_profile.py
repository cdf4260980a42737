"""Where the time goes on one H200: kernel profiles of the DiT, the VAE decodes and the MP4 encode.

Diagnostics for issue 5 (the timed comparisons live in `gpu_single.py` / `k6serve bench`). One subcommand per
device command, each a few minutes; several can run at once on different GPUs (`CUDA_VISIBLE_DEVICES`):

    python scripts/gpu_profile.py dit  --out $OUT --models pro-distill,lite-distill   # fused + compiled, FA3
    python scripts/gpu_profile.py vae  --out $OUT   # HunyuanVideo decode: eager vs compiled decoder, profile
    python scripts/gpu_profile.py kvae --out $OUT   # SR K-VAE one-tile decode: eager vs compiled blocks, profile
    python scripts/gpu_profile.py srdit --out $OUT  # SR DiT, one x2 tile: eager, fused + compiled, + norm/RoPE kernel
    python scripts/gpu_profile.py mux  --out $OUT   # x264 encode of 121 frames at 1536x1024: threads, content;
                                                    # the tail after a paced feed per rc-lookahead
    python scripts/gpu_profile.py step --out $OUT --models lite-distill   # pipeline steps, text trim on/off

Writes `<out>/profile_<subcommand>.json` and `.md` after every part (a failing part is recorded, the rest run).
`--tiny` runs the same code at toy sizes on the CPU (tests/unit/test_bench.py).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

import numpy as np
import torch

from k6serve.bench.kernel_profile import format_summary, profile_call
from k6serve.bench.report import environment


_SAVE = None  # set by main: writes the JSON and markdown so far (after every part, so a timeout loses little)


def save() -> None:
    if _SAVE is not None:
        _SAVE()


def log(message: str) -> None:
    print(f"[gpu_profile {time.strftime('%H:%M:%S')}] {message}", flush=True)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(call, device: torch.device, repeats: int) -> tuple[float, list[float]]:
    times = []
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        call()
        _sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times), times


def first_call(call, device: torch.device) -> float:
    _sync(device)
    start = time.perf_counter()
    call()
    _sync(device)
    return time.perf_counter() - start


def record_failure(part: dict, name: str, error: Exception) -> None:
    part["error"] = f"{type(error).__name__}: {error}"
    part["traceback"] = traceback.format_exc()
    log(f"{name} FAILED: {part['error']}")


def measure_eager(part: dict, label: str, call, device: torch.device, repeats: int, markdown: list[str]) -> None:
    """Median of `repeats` eager calls and a kernel profile of one; saved at once (the compile may time out)."""
    part["eager_s"], part["eager_times_s"] = timed(call, device, repeats)
    part["eager_profile"] = profile_call(call, device=device)
    markdown.append(format_summary(f"{label}: {part['eager_s']:.3f} s", part["eager_profile"]))
    log(f"{label} {part['eager_s']:.3f} s")
    save()


def measure_compiled(part: dict, label: str, call, device: torch.device, repeats: int, difference,
                     markdown: list[str]) -> None:
    """First call (compilation), median of `repeats`, `difference(output)` (a dict with the uint8 max diff
    under "compiled_max_uint8_diff") and a kernel profile of the compiled `call`."""
    part["compiled_first_call_s"] = first_call(call, device)
    part["compiled_s"], part["compiled_times_s"] = timed(call, device, repeats)
    part.update(difference(call()))
    part["compiled_profile"] = profile_call(call, device=device)
    markdown.append(format_summary(f"{label}: {part['compiled_s']:.3f} s, max diff "
                                   f"{part['compiled_max_uint8_diff']}", part["compiled_profile"]))
    log(f"{label} {part['compiled_s']:.3f} s (first {part['compiled_first_call_s']:.1f} s)")


def _free() -> None:
    save()
    gc.collect()
    torch._dynamo.reset()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# --- dit -------------------------------------------------------------------------------------------------------


def profile_dit(args, device, dtype, report: dict, markdown: list[str]) -> None:
    from k6serve.bench.dit import dit_inputs
    from k6serve.bench.geometry import NUM_TEXT_TOKENS, generation_geometry
    from k6serve.bench.tiny import TINY_NUM_TEXT_TOKENS, TINY_TRANSFORMER_CONFIG
    from k6serve.models.kandinsky6.checkpoint import build_dummy_transformer, released_transformer_config
    from k6serve.models.kandinsky6.config import Kandinsky6TransformerConfig
    from k6serve.models.kandinsky6.plan import kandinsky6_plan
    from k6serve.models.variants import VARIANTS
    from k6serve.ops.attention import resolve_attention_backend
    from k6serve.speed.fused_projections import apply_fused_projections
    from k6serve.speed.regional_compile import apply_regional_compile

    for name in [model.strip() for model in args.models.split(",") if model.strip()]:
        part: dict = {}
        report["parts"][f"dit {name}"] = part
        try:
            config_dict = TINY_TRANSFORMER_CONFIG if args.tiny else released_transformer_config(VARIANTS[name])
            config = Kandinsky6TransformerConfig.from_json_dict(config_dict)
            geometry = generation_geometry(
                args.height, args.width, args.num_frames,
                num_text_tokens=TINY_NUM_TEXT_TOKENS if args.tiny else NUM_TEXT_TOKENS,
            )
            model = build_dummy_transformer(config_dict, device=device, dtype=dtype, seed=0)
            inputs = dit_inputs(config, geometry, device=device, dtype=dtype, seed=1)
            model.set_attention_backend(resolve_attention_backend(args.backend, device))
            apply_fused_projections(model)
            if not args.tiny:
                apply_regional_compile(model, kandinsky6_plan(config))

            # The objects bound as defaults, not read from this scope: `del` below drops every reference to them
            # (a closure over the loop's names would leave pyflakes reading deleted names).
            def call(model=model, inputs=inputs):
                with torch.inference_mode():
                    return model(**inputs)

            part["first_call_s"] = first_call(call, device)
            call()
            part["median_s"], part["times_s"] = timed(call, device, args.repeats)
            part["profile"] = profile_call(call, device=device)
            markdown.append(format_summary(f"dit {name}: median {part['median_s']:.3f} s", part["profile"]))
            log(f"dit {name}: {part['median_s']:.3f} s")
            del model, inputs, call  # freed before the next model is built
        except Exception as error:  # noqa: BLE001
            record_failure(part, f"dit {name}", error)
        _free()


# --- srdit -----------------------------------------------------------------------------------------------------


def profile_srdit(args, device, dtype, report: dict, markdown: list[str]) -> None:
    """One SR DiT call on one x2 tile (31 x 32 x 48 latent tokens): eager, fused + compiled, and with the
    RMSNorm + RoPE kernel (what `--performance-mode speed` runs), TFLOP/s, cosine to eager, a kernel profile.
    The whole VSR request (`gpu_single.py sr`) takes ~5 minutes; this isolates the DiT in ~2."""
    import tempfile

    from k6serve.bench.flops import FLOOR_TFLOPS, sr_dit_forward_flops
    from k6serve.bench.measure import cosine_similarity
    from k6serve.models.kandinsky6_sr.checkpoint import build_dummy_sr_models, read_sr_configs, released_sr_configs
    from k6serve.models.kandinsky6_sr.plan import sr_plan
    from k6serve.models.variants import VARIANTS
    from k6serve.ops.attention import resolve_attention_backend
    from k6serve.speed.fused_projections import apply_fused_norm_rope, apply_fused_projections
    from k6serve.speed.regional_compile import apply_regional_compile

    part: dict = {}
    report["parts"]["srdit"] = part
    try:
        variant = VARIANTS["vsr-distilled2steps"]
        if args.tiny:
            from k6serve.testing.tiny_sr_checkpoint import build_sr_checkpoint

            with tempfile.TemporaryDirectory() as folder:
                configs = read_sr_configs(build_sr_checkpoint(folder))
        else:
            configs = released_sr_configs(variant)
        models = build_dummy_sr_models(configs, variant, device=device, dtype=dtype)
        transformer = models.transformer
        del models  # the K-VAE and the upscaler bank are not timed
        config = configs.transformer
        # One tile of an x2 upscale: the latent of a 512 x 768 x 121 output tile (16x spatial, 4x temporal).
        grid = ((args.num_frames - 1) // 4 + 1, args.height // 16, args.width // 16)
        generator = torch.Generator().manual_seed(0)
        latent = torch.randn(1, *grid, config.in_channels, generator=generator).to(device=device, dtype=dtype)
        timestep = torch.full((1,), 500.0, device=device)
        tflop = 1e-12 * sr_dit_forward_flops(config, num_tokens=grid[0] * grid[1] * grid[2])
        part.update(grid=list(grid), tflop=tflop, backend=args.backend)
        transformer.set_attention_backend(resolve_attention_backend(args.backend, device))

        def call(transformer=transformer, latent=latent, timestep=timestep):  # bound as profile_dit's `call`
            with torch.inference_mode():
                return transformer(latent, timestep)

        reference = call().float()
        rows = ["| variant | seconds | TFLOP/s | % of floor | cosine to eager |", "|---|---|---|---|---|"]
        variants = [("eager", None), ("fused+compiled", "compile"), ("fused+compiled+norm_rope", "norm_rope")]
        for name, step in variants:
            if step == "compile":
                part["fused_attentions"] = apply_fused_projections(transformer)
                if not args.tiny:  # inductor on CPU takes minutes; the tiny run checks the wiring eagerly
                    part["compiled_blocks"] = apply_regional_compile(transformer, sr_plan(config))
            elif step == "norm_rope":
                part["norm_rope_attentions"] = apply_fused_norm_rope(transformer)
            if step is not None:
                part[f"{name} first_call_s"] = first_call(call, device)
            seconds, times = timed(call, device, args.repeats)
            cosine = cosine_similarity(call().float(), reference)
            part[name] = {"seconds": seconds, "times_s": times, "tflops": tflop / seconds, "cosine": cosine}
            rows.append(f"| {name} | {seconds:.3f} | {tflop / seconds:.0f} | "
                        f"{100 * tflop / seconds / FLOOR_TFLOPS:.1f} | {cosine:.5f} |")
            log(f"srdit {name}: {seconds:.3f} s ({tflop / seconds:.0f} TFLOP/s), cosine {cosine:.5f}")
            save()
        part["profile"] = profile_call(call, device=device)
        markdown.append(f"### srdit, one tile {grid[0]}x{grid[1]}x{grid[2]} ({tflop:.1f} TFLOP), {args.backend}\n\n"
                        + "\n".join(rows) + "\n")
        markdown.append(format_summary(f"srdit {variants[-1][0]}: {part[variants[-1][0]]['seconds']:.3f} s",
                                       part["profile"]))
        del transformer, latent, call  # freed before `_free` empties the GPU's cache
    except Exception as error:  # noqa: BLE001
        record_failure(part, "srdit", error)
    _free()


# --- vae -------------------------------------------------------------------------------------------------------


def uint8_difference(frames: np.ndarray, reference: np.ndarray) -> dict:
    """Max and mean |difference| in uint8 levels, and the share of values more than 1 level off."""
    difference = np.abs(frames.astype(np.int16) - reference.astype(np.int16))
    return {"max": int(difference.max()), "mean": float(difference.mean()),
            "share_over_1": float((difference > 1).mean())}


def profile_vae(args, device, dtype, report: dict, markdown: list[str]) -> None:
    from k6serve.bench.components import build_video_vae
    from k6serve.pipelines.decode import decode_video

    part: dict = {}
    report["parts"]["vae"] = part
    try:
        vae = build_video_vae(tiny=args.tiny, device=device, dtype=dtype)
        scale = 8  # the HunyuanVideo VAE's spatial compression
        generator = torch.Generator().manual_seed(0)
        latents = torch.randn(1, (args.num_frames - 1) // 4 + 1, args.height // scale, args.width // scale, 16,
                              generator=generator).to(device=device, dtype=dtype)
        torch.backends.cudnn.benchmark = True
        call = lambda: decode_video(vae, latents, keep_float=False)  # noqa: E731
        reference = call()
        # An fp32 decode (TF32 off) as the accuracy yardstick for both bf16 decodes: with random weights
        # bf16 rounding differences are amplified, so "equal to eager bf16" is not the right question.
        vae.to(torch.float32)  # bf16 -> fp32 -> bf16 restores the weights exactly
        previous_tf32 = torch.backends.cudnn.allow_tf32
        torch.backends.cudnn.allow_tf32 = False
        exact = decode_video(vae, latents, keep_float=False).frames_THWC
        torch.backends.cudnn.allow_tf32 = previous_tf32
        vae.to(dtype)
        part["eager_vs_fp32"] = uint8_difference(reference.frames_THWC, exact)
        log(f"vae eager bf16 vs fp32: {part['eager_vs_fp32']}")
        measure_eager(part, "vae eager", call, device, args.repeats, markdown)
        if not args.tiny:
            vae.decoder.compile(dynamic=False)

            def difference(output) -> dict:
                return {
                    "compiled_max_uint8_diff": uint8_difference(output.frames_THWC, reference.frames_THWC)["max"],
                    "compiled_vs_eager": uint8_difference(output.frames_THWC, reference.frames_THWC),
                    "compiled_vs_fp32": uint8_difference(output.frames_THWC, exact),
                }

            measure_compiled(part, "vae compiled decoder", call, device, args.repeats, difference, markdown)
        if args.folded_upsample:
            # The same decode with HunyuanVideo's upsamplers folded (speed/hunyuan_upsample.py), compiled afresh, in
            # the same process as the row above so the two compiled rows compare on one GPU state.
            from k6serve.speed.hunyuan_upsample import apply_folded_upsample

            folded: dict = {}
            report["parts"]["vae folded upsample"] = folded
            torch._dynamo.reset()
            folded["folded_upsamplers"] = apply_folded_upsample(vae.decoder)
            if args.tiny:
                output = call()
                folded["eager_vs_fp32"] = uint8_difference(output.frames_THWC, exact)
                folded["eager_vs_unfolded"] = uint8_difference(output.frames_THWC, reference.frames_THWC)
            else:
                measure_compiled(folded, "vae compiled decoder, folded upsamplers", call, device, args.repeats,
                                 difference, markdown)
    except Exception as error:  # noqa: BLE001
        record_failure(part, "vae", error)
    _free()


# --- kvae ------------------------------------------------------------------------------------------------------


def profile_kvae(args, device, dtype, report: dict, markdown: list[str]) -> None:
    import tempfile

    from k6serve.models.kandinsky6_sr.checkpoint import (
        build_dummy_sr_models,
        read_sr_configs,
        released_sr_configs,
    )
    from k6serve.models.variants import VARIANTS

    part: dict = {}
    report["parts"]["kvae"] = part
    try:
        variant = VARIANTS["vsr-distilled2steps"]
        if args.tiny:  # the released K-VAE would need ~28 GB of fp32 host memory
            from k6serve.testing.tiny_sr_checkpoint import build_sr_checkpoint

            with tempfile.TemporaryDirectory() as folder:
                configs = read_sr_configs(build_sr_checkpoint(folder))
        else:
            configs = released_sr_configs(variant)
        models = build_dummy_sr_models(configs, variant, device=device, dtype=dtype)
        del models.transformer  # only the K-VAE is profiled
        sr_vae = models.vae
        channels = configs.vae.latent_channels
        size = (args.height // 16, args.width // 16)  # one 512x768 output tile of an x2 upscale
        generator = torch.Generator().manual_seed(0)
        latent = torch.randn(1, channels, (args.num_frames - 1) // 4 + 1, *size, generator=generator)
        latent = latent.to(device=device, dtype=dtype)
        call = lambda: sr_vae.decode_tile(latent)  # noqa: E731
        from k6serve.bench.flops import sr_vae_tile_decode_flops

        # All convolutions (837.6 TFLOP for the released K-VAE's 512x768x121 tile): the rate the profile's
        # convolution time is compared with.
        part["tflop"] = sr_vae_tile_decode_flops(configs, *latent.shape[2:]) / 1e12
        with torch.inference_mode():
            torch.backends.cudnn.benchmark = True
            reference = call()
            measure_eager(part, "kvae one tile eager", call, device, args.repeats, markdown)
        part["eager_tflops"] = part["tflop"] / part["eager_s"]
        from k6serve.speed.kvae_causal_conv import apply_single_causal_conv
        from k6serve.speed.kvae_spatial_norm import apply_commuted_spatial_norms
        from k6serve.speed.kvae_upsample import apply_subpixel_upsample
        from k6serve.speed.vae import apply_channels_last_3d

        # Each asked-for transform on top of the previous ones: (flag, JSON key of what it changed, JSON key of the
        # CPU check, transform).
        # On CPU (--tiny) the eager decode is compared with the reference after each: the commuted norms
        # (speed/kvae_spatial_norm.py) and NDHWC weights (speed/vae.py) change no value, the upsampler phases
        # (speed/kvae_upsample.py) round differently.
        transforms = (
            (args.commuted_norms, "commuted_norms", "commuted_norms_max_uint8_diff", apply_commuted_spatial_norms),
            (args.channels_last, "channels_last_convs", "channels_last_max_uint8_diff", apply_channels_last_3d),
            (args.subpixel_upsample, "subpixel_upsamplers", "subpixel_max_uint8_diff", apply_subpixel_upsample),
            (args.single_causal_conv, "single_causal_convs", "single_causal_conv_max_uint8_diff",
             apply_single_causal_conv),
        )
        for wanted, key, difference_key, transform in transforms:
            if not wanted:
                continue
            part[key] = transform(sr_vae.model.decoder)
            if args.tiny:
                with torch.inference_mode():
                    part[difference_key] = int((call().short() - reference.short()).abs().max())
        if args.subpixel_upsample:
            # What the rewritten decode computes (102 TFLOP less per released tile): the compiled rate's numerator.
            part["subpixel_tflop"] = sr_vae_tile_decode_flops(configs, *latent.shape[2:], subpixel_upsample=True) / 1e12
        if not args.tiny:
            from k6serve.speed.vae import compile_sr_decoder_blocks

            part["compiled_modules"] = compile_sr_decoder_blocks(sr_vae.model)
            def difference(output) -> dict:
                return {"compiled_max_uint8_diff": int((output.short() - reference.short()).abs().max())}

            with torch.inference_mode():
                label = ("kvae compiled blocks" + (", channels-last" if args.channels_last else "")
                         + (", commuted norms" if args.commuted_norms else "")
                         + (", subpixel upsample" if args.subpixel_upsample else "")
                         + (", single causal conv" if args.single_causal_conv else ""))
                measure_compiled(part, label, call, device, args.repeats, difference, markdown)
                compiled_tflop = part.get("subpixel_tflop", part["tflop"])
                part["compiled_tflops"] = compiled_tflop / part["compiled_s"]
                markdown.append(f"{part['tflop']:.1f} TFLOP per tile: eager {part['eager_tflops']:.0f}, compiled "
                                f"({compiled_tflop:.1f} TFLOP) {part['compiled_tflops']:.0f} TFLOP/s\n")
    except Exception as error:  # noqa: BLE001
        record_failure(part, "kvae", error)
    _free()


# --- mux -------------------------------------------------------------------------------------------------------


def profile_mux(args, device, dtype, report: dict, markdown: list[str]) -> None:
    import tempfile

    import k6serve.media.mux as mux

    height, width, count = (1024, 1536, 121) if not args.tiny else (64, 96, 9)
    rng = np.random.default_rng(0)
    y, x = np.mgrid[0:height, 0:width]
    smooth = np.stack([
        ((np.sin(x / 40 + t / 5) + np.cos(y / 30 - t / 7)) * 60 + 128).astype(np.uint8)[..., None].repeat(3, -1)
        for t in range(count)
    ])
    noise = rng.integers(0, 256, (count, height, width, 3), dtype=np.uint8)
    waveform = (0.1 * np.sin(np.arange(int(count / 24 * 44100)) / 20)).astype(np.float32)
    lines = [f"### mux (x264 medium, rc-lookahead {mux.X264_RC_LOOKAHEAD}, crf 18, 24 fps, AAC mono)", "",
             "| content | threads | seconds | MB |",
             "|---|---|---|---|"]
    default_threads = mux.X264_THREADS
    with tempfile.TemporaryDirectory() as folder:
        for content, frames in (("smooth", smooth), ("noise", noise)):
            for threads in (8, 16, 0):
                key = f"{content} threads={threads}"
                try:
                    mux.X264_THREADS = threads
                    path = Path(folder) / f"{content}_{threads}.mp4"
                    start = time.perf_counter()
                    mux.write_mp4(path, frames, 24.0, waveform, 44100)
                    seconds = time.perf_counter() - start
                    megabytes = path.stat().st_size / 1e6
                    report["parts"][f"mux {key}"] = {"seconds": seconds, "megabytes": megabytes}
                    lines.append(f"| {content} | {threads} | {seconds:.2f} | {megabytes:.1f} |")
                    log(f"mux {key}: {seconds:.2f} s")
                except Exception as error:  # noqa: BLE001
                    report["parts"][f"mux {key}"] = {"error": f"{type(error).__name__}: {error}"}
    mux.X264_THREADS = default_threads
    markdown.append("\n".join(lines) + "\n")
    markdown.append(_mux_tail(mux, smooth, noise, waveform, report, tiny=args.tiny))


# The VSR request's decode hands the encoder its 121 frames in segments (17, then 16 each) over ~16.7 s on the H200.
MUX_TAIL_SEGMENT_SECONDS = 16.7 / 8
MUX_TAIL_LOOKAHEADS = (40, 20, 10)  # x264's own with the medium preset, k6serve's default, x264's "veryfast" one


def _mux_tail(mux, smooth, noise, waveform, report: dict, *, tiny: bool) -> str:
    """The encoder's tail after a paced feed, per rc-lookahead ($K6SERVE_X264_RC_LOOKAHEAD): frames arrive in the
    decode's segments at its pace, and the row reports the seconds from the last segment to the finished file (what
    the VSR request waits for), the whole write and the file size (what a shorter lookahead costs)."""
    import tempfile

    pace = 0.01 if tiny else MUX_TAIL_SEGMENT_SECONDS
    lines = [f"### mux tail: frames in segments of 17, 16, ... every {pace:.2f} s, {mux.X264_THREADS} threads", "",
             "| content | rc-lookahead | tail seconds | write seconds | MB |", "|---|---|---|---|---|"]
    default_lookahead = mux.X264_RC_LOOKAHEAD
    with tempfile.TemporaryDirectory() as folder:
        for content, frames in (("smooth", smooth), ("noise", noise)):
            for lookahead in MUX_TAIL_LOOKAHEADS:
                key = f"mux tail {content} rc_lookahead={lookahead}"
                last_segment: list[float] = []

                def segments(frames=frames, last_segment=last_segment):
                    bounds = [0, *range(17, len(frames), 16), len(frames)]
                    for begin, end in zip(bounds, bounds[1:]):
                        time.sleep(pace)  # the decode of this segment
                        last_segment[:] = [time.perf_counter()]
                        yield frames[begin:end]

                try:
                    mux.X264_RC_LOOKAHEAD = lookahead
                    path = Path(folder) / f"tail_{content}_{lookahead}.mp4"
                    start = time.perf_counter()
                    mux.write_mp4_stream(path, segments(), 24.0, waveform, 44100)
                    end = time.perf_counter()
                    part = {"tail_seconds": end - last_segment[0], "write_seconds": end - start,
                            "megabytes": path.stat().st_size / 1e6}
                    report["parts"][key] = part
                    lines.append(f"| {content} | {lookahead} | {part['tail_seconds']:.2f} | "
                                 f"{part['write_seconds']:.2f} | {part['megabytes']:.2f} |")
                    log(f"{key}: tail {part['tail_seconds']:.2f} s")
                except Exception as error:  # noqa: BLE001
                    report["parts"][key] = {"error": f"{type(error).__name__}: {error}"}
    mux.X264_RC_LOOKAHEAD = default_lookahead
    return "\n".join(lines) + "\n"


# --- step ------------------------------------------------------------------------------------------------------


def profile_step(args, device, dtype, report: dict, markdown: list[str]) -> None:
    """Whole denoising steps through the pipeline (speed mode, VAE eager), with and without the text trim:
    how far a step is from one DiT forward, and whether the trimmed (short, unmasked) text costs anything."""
    import itertools

    from k6serve.models.kandinsky6.checkpoint import load_generation_models
    from k6serve.models.variants import VARIANTS
    from k6serve.request_resolution import resolve_generate
    from k6serve.ops.attention import resolve_attention_backend
    from k6serve.pipelines.text_to_video import TextToVideoPipeline
    from k6serve.request import SamplingParams
    from k6serve.speed.performance_mode import apply_performance_mode

    for name in [model.strip() for model in args.models.split(",") if model.strip()]:
        try:
            if args.tiny:
                from k6serve.testing.tiny_checkpoints import build_generation_pipeline

                import tempfile

                folder = Path(tempfile.mkdtemp())
                build_generation_pipeline("distill").save_pretrained(folder)
                models = load_generation_models(folder, VARIANTS["lite-distill"], device=device, dtype=dtype,
                                                load_format="auto")
            else:
                models = load_generation_models(None, VARIANTS[name], device=device, dtype=dtype,
                                                load_format="dummy")
            models.transformer.set_attention_backend(resolve_attention_backend(args.backend, device))
            apply_performance_mode(models, "speed", device, compile_vae_decoder=False)
            params = SamplingParams(prompt="a red fox runs through fresh snow at dawn", seed=42, height=args.height,
                                    width=args.width, num_frames=args.num_frames, num_inference_steps=5)
            request, _ = resolve_generate(params, models.variant)
            for trim in (False, True):
                part: dict = {}
                report["parts"][f"step {name} trim={trim}"] = part
                pipeline = TextToVideoPipeline(models, trim_text_padding=trim, keep_float_frames=False)
                stamps: list[float] = []
                profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU] + (
                    [torch.profiler.ProfilerActivity.CUDA] if device.type == "cuda" else []))

                def on_step(step: int, total: int) -> None:
                    _sync(device)
                    stamps.append(time.perf_counter())
                    if len(stamps) == 3:
                        profiler.start()
                    elif len(stamps) == 4:
                        profiler.stop()

                output = pipeline(request, on_step=on_step)
                intervals = [b - a for a, b in itertools.pairwise(stamps)]
                part["step_times_s"] = intervals
                part["step_s"] = statistics.median(intervals)
                part["timings"] = output.timings
                from k6serve.bench.kernel_profile import summarize

                part["profile"] = summarize(profiler.key_averages(), wall_s=stamps[3] - stamps[2],
                                            device=device.type == "cuda")
                markdown.append(format_summary(f"step {name} trim={trim}: median {part['step_s']:.3f} s "
                                               f"(steps {', '.join(f'{x:.3f}' for x in intervals)})",
                                               part["profile"]))
                log(f"step {name} trim={trim}: {part['step_s']:.3f} s {intervals}")
                save()
            del models
        except Exception as error:  # noqa: BLE001
            record_failure(report["parts"].setdefault(f"step {name}", {}), f"step {name}", error)
        _free()


SUBCOMMANDS = {"dit": profile_dit, "srdit": profile_srdit, "vae": profile_vae, "kvae": profile_kvae,
               "mux": profile_mux, "step": profile_step}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("subcommand", choices=sorted(SUBCOMMANDS))
    parser.add_argument("--out", default=os.environ.get("OUT", "gpu_profile_out"))
    parser.add_argument("--models", default="pro-distill,lite-distill")
    parser.add_argument("--backend", default="fa")
    parser.add_argument("--height", type=int, default=512)
    parser.add_argument("--width", type=int, default=768)
    parser.add_argument("--num-frames", type=int, default=121)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--subpixel-upsample", action="store_true",
                        help="kvae: the upsamplers folded into one 2x2 phase convolution ($K6SERVE_KVAE_SUBPIXEL_UPSAMPLE).")
    parser.add_argument("--single-causal-conv", action="store_true",
                        help="kvae: each causal convolution as one convolution per segment "
                             "($K6SERVE_KVAE_SINGLE_CAUSAL_CONV).")
    parser.add_argument("--commuted-norms", action="store_true",
                        help="kvae: the norms' 1x1x1 convolutions before the upsampling ($K6SERVE_KVAE_COMMUTED_NORMS).")
    parser.add_argument("--folded-upsample", action="store_true",
                        help="vae: then the compiled decoder again with the upsamplers folded into one phase "
                             "convolution ($K6SERVE_HUNYUAN_FOLDED_UPSAMPLE).")
    parser.add_argument("--channels-last", action="store_true",
                        help="kvae: compiled blocks with channels-last 3-D conv weights ($K6SERVE_VAE_CHANNELS_LAST).")
    parser.add_argument("--tiny", action="store_true", help="CPU smoke run at toy sizes.")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.tiny:
        args.height, args.width, args.num_frames, args.repeats, args.backend = 64, 96, 9, 1, "torch_sdpa"
    device = torch.device("cpu" if args.tiny else "cuda")
    dtype = torch.float32 if args.tiny else torch.bfloat16
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report: dict = {"environment": environment(), "argv": sys.argv[1:] if argv is None else argv, "parts": {}}
    markdown: list[str] = [f"# gpu_profile {args.subcommand}", ""]
    def write() -> None:
        (out / f"profile_{args.subcommand}.json").write_text(json.dumps(report, indent=2, default=str))
        (out / f"profile_{args.subcommand}.md").write_text("\n".join(markdown))

    global _SAVE
    _SAVE = write
    SUBCOMMANDS[args.subcommand](args, device, dtype, report, markdown)
    write()
    print("\n".join(markdown), flush=True)
    failed = [name for name, part in report["parts"].items() if "error" in part]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
