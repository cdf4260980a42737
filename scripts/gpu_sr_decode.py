"""VSR x2 on a replica of several GPUs: the whole-tile decode against the spatial-shard decode, through the engine.

    python3 scripts/gpu_sr_decode.py --out $OUT [--num-gpus 2] [--repeats 3] [--compile-vae]
    python3 scripts/gpu_sr_decode.py --out /tmp/x --tiny      # the same on the CPU: tiny checkpoint, gloo

Makes a 768x512x121 source clip (24 fps, moving pattern), loads the distilled VSR model once per decode
(`--load-format dummy`, speed mode, Ulysses over `--num-gpus`), runs one cold and `--repeats` warm x2 requests each,
and writes one JSON line per request (stage timings, peak memory) to <out>/sr_decode.jsonl, the frame difference
between the two decodes (max and mean uint8 distance, PSNR) to <out>/sr_decode.json and a table to stdout.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from k6serve import DiffGenerator

# decode -> from_pretrained's options
DECODES: dict[str, dict[str, Any]] = {"whole_tile": {}, "spatial_shard": {"vae_parallel_decode": True,
                                                                     "vae_parallel_decode_mode": "spatial_shard"}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--model", default="kandinskylab/Kandinsky-6.0-VSR-distilled2steps-5s-Diffusers")
    parser.add_argument("--num-gpus", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--compile-vae", action="store_true")
    parser.add_argument("--tiny", action="store_true")
    args = parser.parse_args(argv)
    from k6serve.testing.clips import make_clip

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp())
    load: dict[str, Any]  # from_pretrained's options
    if args.tiny:
        from k6serve.testing.tiny_sr_checkpoint import build_sr_checkpoint

        model, load = str(build_sr_checkpoint(scratch / "tiny_vsr")), {"device": "cpu"}
        clip = make_clip(scratch / "source.mp4", width=96, height=64, num_frames=17, fps=24)
        repeats = 1
    else:
        model, load = args.model, {"load_format": "dummy", "performance_mode": "speed"}
        if args.compile_vae:
            load["compile_vae"] = True
        clip = make_clip(scratch / "source.mp4", width=768, height=512, num_frames=121, fps=24)
        repeats = args.repeats
    rows: list[dict[str, Any]] = []
    frames = {}
    for decode, options in DECODES.items():
        start = time.perf_counter()
        generator = DiffGenerator.from_pretrained(model, num_gpus=args.num_gpus, ulysses_degree=args.num_gpus,
                                                  **load, **options)
        load_s = time.perf_counter() - start
        try:
            for index in range(1 + repeats):
                result = generator.generate({"video_path": str(clip), "sr_resolution_scale": 2, "seed": 42,
                                             "save_output": False, "return_frames": True})
                row = {"sr_decode": decode, "request": index, "load_s": round(load_s, 2),
                       "peak_memory_mib": round(result.peak_memory_mb, 1),
                       **{k: round(v, 3) for k, v in result.timings.items()},
                       "commit": os.environ.get("K6SERVE_COMMIT", "")}
                rows.append(row)
                print(json.dumps(row), flush=True)
            frames[decode] = np.asarray(result.frames)
        finally:
            generator.shutdown()
    with open(out / "sr_decode.jsonl", "w") as handle:
        for row in rows:
            handle.write(json.dumps(row) + "\n")
    distance = np.abs(frames["spatial_shard"].astype(np.int16) - frames["whole_tile"].astype(np.int16))
    mse = float((distance.astype(np.float64) ** 2).mean())
    summary = {"shape": list(frames["whole_tile"].shape), "max_uint8_diff": int(distance.max()),
               "mean_uint8_diff": float(distance.mean()),
               "psnr_db": math.inf if mse == 0 else 10 * math.log10(255**2 / mse),
               "warm_total_s": {decode: statistics.median(r["total"] for r in rows if r["sr_decode"] == decode
                                                          and r["request"] > 0) for decode in DECODES}}
    (out / "sr_decode.json").write_text(json.dumps(summary, indent=2))
    print(f"{'decode':15} {'req':>3} {'decode s':>9} {'total s':>8} {'peak MiB':>10}")
    for row in rows:
        print(f"{row['sr_decode']:15} {row['request']:>3} {row.get('decode', 0):9.3f} {row.get('total', 0):8.3f} "
              f"{row['peak_memory_mib']:10.1f}")
    print(json.dumps(summary), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
