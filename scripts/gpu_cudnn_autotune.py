"""What cuDNN's autotuner (`torch.backends.cudnn.benchmark`, which `--performance-mode speed` turns on) does to the
generation decode: whether each thread's choice gives the same frames and samples, and what it saves.

    python3 scripts/gpu_cudnn_autotune.py --out $OUT/autotune [--compile-decoder]

The fifty-seventh session's traced pair (`gpu_folder_diagnose.py`) found two engines in one process parting at the
vocoder's output with its inputs and tensors equal, while four requests on one engine repeat bit for bit; torch
keeps the autotuner's choices per thread, and each engine runs its requests on its own thread. So:

1. `threads`: the dummy build's vocoder (on a random mel) and HunyuanVideo VAE (a 17-frame decode) run, with the
   autotuner on and then off, in three fresh threads and twice in one thread: the number of distinct outputs.
2. `timing`: the 121-frame 512x768 decode as the engine runs it (`decode_video`, uint8 frames to the host), eager,
   and with `--compile-decoder` compiled as `--compile-vae true` compiles it, with the autotuner off and on: the
   first call (the autotuner times every new shape there) and the median of the next `--repeats`; the vocoder too.

`--family sr` does the same for the super-resolution K-VAE's tile decode (a 512x768 output tile, 121 frames;
`--compile-decoder`: its compiled blocks and rewrites, as `--compile-vae true` applies them), without a vocoder.

Results: <out>/gpu_cudnn_autotune.json. `--tiny` runs the same on the tiny components (CPU test).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import threading
import time
from pathlib import Path
from typing import Any

import torch


def _digest(tensor: torch.Tensor) -> str:
    return hashlib.sha256(tensor.detach().float().cpu().contiguous().numpy().tobytes()).hexdigest()[:16]


def _in_new_thread(fn):
    """`fn()` in a thread of its own (a fresh cuDNN benchmark cache); its exception is raised here, in the caller."""
    result: dict = {}

    def run() -> None:
        try:
            with torch.inference_mode():
                result["value"] = fn()
        except BaseException as error:  # noqa: BLE001 (handed to the caller, not printed by the thread)
            result["error"] = error

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    if "error" in result:
        raise RuntimeError(f"the call failed in its thread: {result['error']!r}") from result["error"]
    return result["value"]


def distinct_outputs(fn, *, fresh_threads: int = 3) -> dict:
    """`fn()`'s output digests from `fresh_threads` new threads, and from two calls in one more thread."""
    fresh = [_digest(_in_new_thread(fn)) for _ in range(fresh_threads)]
    one_thread = _in_new_thread(lambda: [_digest(fn()), _digest(fn())])
    return {"fresh_threads": fresh, "one_thread": one_thread, "distinct_fresh": len(set(fresh)),
            "one_thread_same": one_thread[0] == one_thread[1]}


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device: torch.device, repeats: int) -> dict:
    """The first call's seconds (a new shape's autotuning happens there) and the median of `repeats` more."""
    times = []
    with torch.inference_mode():
        for _ in range(repeats + 1):
            _synchronize(device)
            start = time.perf_counter()
            fn()
            _synchronize(device)
            times.append(time.perf_counter() - start)
    return {"first_s": round(times[0], 3), "median_s": round(statistics.median(times[1:]), 3),
            "times_s": [round(t, 3) for t in times]}


def build(tiny: bool, device: torch.device, dtype: torch.dtype):
    """The released-size video VAE and vocoder, random weights drawn with the dummy build's seeds for them (the bench's
    builders; the question measured does not depend on the weights)."""
    from k6serve.bench.components import build_audio_decoder, build_video_vae
    from k6serve.models.kandinsky6.checkpoint import DUMMY_COMPONENT_SEEDS

    def seeded(component: str, make):
        devices = [device.index or 0] if device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(DUMMY_COMPONENT_SEEDS[component])
            return make()

    vae = seeded("vae", lambda: build_video_vae(tiny=tiny, device=device, dtype=dtype))
    vocoder = seeded("vocoder", lambda: build_audio_decoder(tiny=tiny, device=device, dtype=dtype)[1])
    return vae, vocoder


def build_sr_vae(tiny: bool, device: torch.device, dtype: torch.dtype):
    """The super-resolution K-VAE as `--load-format dummy` builds it (`SRVAE`), or the tiny checkpoint's."""
    from k6serve.models.kandinsky6_sr.checkpoint import load_sr_models
    from k6serve.models.variants import VARIANTS

    if tiny:
        from k6serve.testing.tiny_checkpoints import ensure_demo_checkpoint

        return load_sr_models(ensure_demo_checkpoint("sr"), VARIANTS["vsr-distilled2steps"], device=device, dtype=dtype,
                              load_format="auto").vae
    return load_sr_models(None, VARIANTS["vsr-distilled2steps"], device=device, dtype=dtype,
                          load_format="dummy").vae


def main() -> None:
    from k6serve.pipelines.decode import decode_video
    from k6serve.speed.vae import CUDNN_BENCHMARK_ENVIRONMENT_VARIABLE, apply_vae_speedups

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--tiny", action="store_true", help="the tiny components, on the CPU unless a GPU is here")
    parser.add_argument("--compile-decoder", action="store_true", help="also time the compiled decoder")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--family", choices=("generation", "sr"), default="generation")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    report: dict = {"commit": os.environ.get("K6SERVE_COMMIT"), "torch": torch.__version__, "family": args.family,
                    "cudnn": torch.backends.cudnn.version() if device.type == "cuda" else None,
                    "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu"}

    def save() -> None:
        (args.out / "gpu_cudnn_autotune.json").write_text(json.dumps(report, indent=2))

    generator = torch.Generator().manual_seed(0)
    vocoder: Any  # diffusers' MMAudioVocoder (untyped here), or None: the SR K-VAE has no vocoder
    if args.family == "sr":
        sr_vae = build_sr_vae(args.tiny, device, dtype)
        vae, vocoder = sr_vae.model, None
        # (B, C, T, h, w) scaled latent tiles: a 512x768 output tile (16x smaller), 5 and 31 latent frames.
        tile_h, tile_w = (4, 6) if args.tiny else (32, 48)
        small, whole = (torch.randn(1, sr_vae.model.config["latent_channels"], frames, tile_h, tile_w,
                                    generator=generator).to(device=device, dtype=dtype) for frames in (5, 31))

        def decode_frames(latents):
            return lambda: sr_vae.decode_tile(latents).cpu()
    else:
        vae, vocoder = build(args.tiny, device, dtype)
        channels = vae.config.latent_channels
        # 17 frames at a quarter of 512x768 for the thread test; the whole clip for the timing. (B, T, H, W, C)
        # latents, as the pipeline hands them to `decode_video`.
        small = torch.randn(1, 5, 16 if args.tiny else 32, 24 if args.tiny else 48, channels, generator=generator)
        whole = torch.randn(1, 5 if args.tiny else 31, 16 if args.tiny else 64, 24 if args.tiny else 96, channels,
                            generator=generator)
        # 121 frames at 24 fps are 5.04 s of sound: 434 mel frames of 512 samples at 44.1 kHz.
        mel = torch.randn(1, vocoder.config.num_mels, 64 if args.tiny else 434, generator=generator)
        small, whole, mel = (t.to(device=device, dtype=dtype) for t in (small, whole, mel))

        def decode_frames(latents):
            return lambda: torch.from_numpy(decode_video(vae, latents, keep_float=False).frames_THWC)

    def vocode():
        return vocoder(mel).sample

    report["threads"] = {}
    for setting in (True, False):
        torch.backends.cudnn.benchmark = setting
        name = "benchmark_on" if setting else "benchmark_off"
        report["threads"][name] = {"vae_decode": distinct_outputs(decode_frames(small))}
        if vocoder is not None:
            report["threads"][name]["vocoder"] = distinct_outputs(vocode)
        print("threads", name, json.dumps(report["threads"][name]), flush=True)
        save()

    report["timing"] = {}
    decoded = {}
    for setting in (False, True):
        torch.backends.cudnn.benchmark = setting
        name = "benchmark_on" if setting else "benchmark_off"
        report["timing"][f"eager_{name}"] = timed(decode_frames(whole), device, args.repeats)
        with torch.inference_mode():
            decoded[name] = decode_frames(whole)()
        if vocoder is not None:
            report["timing"][f"vocoder_{name}"] = timed(vocode, device, args.repeats * 3)
        print("timing", name, report["timing"][f"eager_{name}"], report["timing"].get(f"vocoder_{name}"), flush=True)
        save()
    report["eager_on_vs_off_max_levels"] = int((decoded["benchmark_on"].int() - decoded["benchmark_off"].int())
                                               .abs().max())
    if args.compile_decoder:
        os.environ[CUDNN_BENCHMARK_ENVIRONMENT_VARIABLE] = "0"  # the speed-ups without turning the autotuner on
        torch.backends.cudnn.benchmark = False
        report["compiled_applied"] = apply_vae_speedups(vae, device, compile_decoder=True)
        for setting in (False, True):
            torch.backends.cudnn.benchmark = setting
            name = "benchmark_on" if setting else "benchmark_off"
            report["timing"][f"compiled_{name}"] = timed(decode_frames(whole), device, args.repeats)
            print("timing compiled", name, report["timing"][f"compiled_{name}"], flush=True)
            save()
    save()
    print("done", flush=True)


if __name__ == "__main__":
    main()
