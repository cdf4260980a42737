"""A full-size Diffusers-layout checkpoint folder, loaded and run the way a user's download is, on the GPU host.

    python3 scripts/gpu_folder_checkpoint.py --out $OUT/folder [--variant lite-distill] [--budget-s 420]

Weights cannot be downloaded here, so the folder is written from `--load-format dummy`'s full-size random components
(built on the GPU in bf16): the DiT in the released files' form (bf16, modulations and time embeddings in fp32, 10 GB
shards and their index), Qwen2.5-VL-7B and CLIP by transformers' `save_pretrained`, the HunyuanVideo VAE, MMAudio
VAE and vocoder by diffusers', with the tiny checkpoint's model_index.json, scheduler and (trained offline)
tokenizers. Then, in this process: `DiffGenerator.from_pretrained(folder)` (its seconds: ranks, load, warm-up none),
one request (`--height` x `--width` x `--num-frames`, `--steps` steps, seed 7, MP4 under `--out`), and the same from
`--load-format dummy`, whose weights are the ones written: the two MP4 files must be equal byte for byte (the
folder's load reads back exactly what the dummy build made, and the encoders are bit-exact).
Where they differ, it prints how far; `scripts/gpu_folder_diagnose.py` says which tensor or module differs.

Results: <out>/gpu_folder_checkpoint.json.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from gpu_load import write_dit  # scripts/gpu_load.py, beside this one

if TYPE_CHECKING:
    from k6serve.request import VideoResult

# (the tiny checkpoint whose model_index.json, scheduler and tokenizers the folder takes; the released DiT config)
VARIANT_KEYS = {"lite-distill": ("distill", "lite_distill"), "pro-distill": ("distill", "pro_distill")}
HUB_IDS = {"lite-distill": "kandinskylab/Kandinsky-6.0-Lite-distill-5s-Diffusers",
           "pro-distill": "kandinskylab/Kandinsky-6.0-Pro-distill-5s-Diffusers"}


def _replace(folder: Path) -> Path:
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    return folder


def write_folder(variant_name: str, folder: Path) -> dict:
    from k6serve.models.kandinsky6.checkpoint import _build_dummy
    from k6serve.models.kandinsky6.released_configs import RELEASED_TRANSFORMER_CONFIGS
    from k6serve.models.variants import VARIANTS
    from k6serve.testing.tiny_checkpoints import build_generation_checkpoint

    tiny_key, config_key = VARIANT_KEYS[variant_name]
    shutil.rmtree(folder, ignore_errors=True)
    build_generation_checkpoint(folder, tiny_key, seed=0)  # model_index.json, scheduler, tokenizers
    cuda = torch.device("cuda")
    models = _build_dummy(VARIANTS[variant_name], device=cuda, dtype=torch.bfloat16, where=lambda component: cuda)
    write_dit(models.transformer, RELEASED_TRANSFORMER_CONFIGS[config_key], _replace(folder / "transformer"))
    # The dummy build's scheduler settings, so that both runs sample alike.
    scheduler_file = folder / "scheduler" / "scheduler_config.json"
    scheduler = json.loads(scheduler_file.read_text())
    if scheduler.get("_class_name") != models.scheduler_class:
        raise SystemExit(f"the tiny checkpoint's scheduler is {scheduler.get('_class_name')}, the dummy's "
                         f"{models.scheduler_class}")
    scheduler_file.write_text(json.dumps({**scheduler, **models.scheduler_config}))
    for component in ("text_encoder", "text_encoder_2", "vae", "audio_vae", "vocoder"):
        getattr(models, component).save_pretrained(str(_replace(folder / component)), safe_serialization=True)
    del models
    torch.cuda.empty_cache()
    os.sync()
    sizes = {}
    for component_folder in sorted(path for path in folder.iterdir() if path.is_dir()):
        sizes[component_folder.name] = round(sum(f.stat().st_size for f in component_folder.iterdir()) / 1e9, 3)
    return sizes


def run(model_path: str, out: Path, args: argparse.Namespace, **options) -> tuple[dict, VideoResult]:
    from k6serve import DiffGenerator

    start = time.perf_counter()
    generator = DiffGenerator.from_pretrained(model_path, **options)
    loaded = time.perf_counter() - start
    try:
        start = time.perf_counter()
        result = generator.generate({"prompt": "A red fox runs through fresh snow at dawn.", "seed": 7,
                                     "height": args.height, "width": args.width, "num_frames": args.num_frames,
                                     "num_inference_steps": args.steps, "save_output": True,
                                     "output_path": str(out)})
        request = time.perf_counter() - start
    finally:
        generator.shutdown()
    return {"from_pretrained_s": round(loaded, 2), "request_s": round(request, 2), "timings": result.timings,
            "file": str(result.output_file_path), "peak_memory_mb": result.peak_memory_mb}, result


def _distance(path_a, path_b) -> dict:
    """The decoded videos' and audio tracks' largest differences and the share of values that differ."""
    import av
    import numpy as np

    from k6serve.media.video import read_video

    def decoded(path, kind):
        if kind == "video":
            return read_video(path).frames
        # The AAC track as decoded (the project's reader mixes and may rescale it, which could hide a difference).
        with av.open(str(path)) as container:
            return np.concatenate([frame.to_ndarray() for frame in container.decode(audio=0)], axis=-1)

    distance: dict[str, dict[str, Any]] = {}
    for kind in ("video", "audio"):
        a, b = decoded(path_a, kind), decoded(path_b, kind)
        if a.shape != b.shape:
            distance[kind] = {"shapes": [list(a.shape), list(b.shape)]}
            continue
        difference = np.abs(a.astype(np.float64) - b.astype(np.float64))
        distance[kind] = {"max": float(difference.max()), "share_differing": float((difference > 0).mean())}
    return distance


def _sha256(path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--variant", choices=list(VARIANT_KEYS), default="lite-distill")
    parser.add_argument("--folder", type=Path, default=Path("/tmp/k6serve-folder"))
    parser.add_argument("--height", type=int, default=256)
    parser.add_argument("--width", type=int, default=384)
    parser.add_argument("--num-frames", type=int, default=17)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--budget-s", type=float, default=420.0)
    args = parser.parse_args()
    start = time.perf_counter()
    args.out.mkdir(parents=True, exist_ok=True)
    report: dict = {"commit": os.environ.get("K6SERVE_COMMIT"), "torch": torch.__version__,
                    "device": torch.cuda.get_device_name(), "variant": args.variant}

    def save() -> None:
        (args.out / "gpu_folder_checkpoint.json").write_text(json.dumps(report, indent=2, default=str))

    written = time.perf_counter()
    report["component_gb"] = write_folder(args.variant, args.folder)
    report["write_s"] = round(time.perf_counter() - written, 1)
    print("written", report["component_gb"], report["write_s"], flush=True)
    save()
    report["folder"], folder_result = run(str(args.folder), args.out / "folder", args)
    print("folder", report["folder"], flush=True)
    save()
    if time.perf_counter() - start > args.budget_s:
        report["stopped"] = "no time left for the dummy run"
        save()
        return
    report["dummy"], dummy_result = run(HUB_IDS[args.variant], args.out / "dummy", args, load_format="dummy")
    print("dummy", report["dummy"], flush=True)
    # x264 and the AAC encoder run bit-exact (`media/mux.py`), so equal frames and samples give equal files.
    report["same_mp4_bytes"] = _sha256(folder_result.output_file_path) == _sha256(dummy_result.output_file_path)
    print("same MP4 bytes", report["same_mp4_bytes"], flush=True)
    if not report["same_mp4_bytes"]:
        # How far apart: a few levels point at a cast or a kernel, every pixel at other weights (the fifty-fourth
        # session's first run: the dummy build's encoders were unseeded).
        report["distance"] = _distance(folder_result.output_file_path, dummy_result.output_file_path)
        print("distance", report["distance"], flush=True)
    save()
    shutil.rmtree(args.folder, ignore_errors=True)


if __name__ == "__main__":
    main()
