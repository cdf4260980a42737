"""Warm requests with per component offloading against everything resident (one H200, `--load-format dummy`).

    python3 scripts/gpu_offload_components.py --out $OUT [--model ...] [--steps 1] [--repeats 3]
        [--cpu-offload-components text_encoders]

Loads the model once per configuration in this process (speed mode), runs `--repeats` requests, and writes one JSON
line per request (stage timings, peak memory) to <out>/offload_components.jsonl and a table to stdout. The first
request of each configuration includes compilation; the rest are warm.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

from k6serve import DiffGenerator


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--model", default="kandinskylab/Kandinsky-6.0-Pro-distill-5s-Diffusers")
    parser.add_argument("--load-format", default="dummy")
    parser.add_argument("--steps", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--cpu-offload-components", nargs="*", default=["text_encoders"])
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    configurations = {"resident": {}, "offloaded " + " ".join(args.cpu_offload_components):
                      {"cpu_offload_components": args.cpu_offload_components}}
    rows = []
    for name, options in configurations.items():
        start = time.perf_counter()
        generator = DiffGenerator.from_pretrained(args.model, load_format=args.load_format, num_gpus=1, **options)
        load_s = time.perf_counter() - start
        try:
            for index in range(args.repeats):
                result = generator.generate({"prompt": "A woman chops vegetables in a sunlit kitchen.", "seed": 42,
                                             "num_inference_steps": args.steps, "save_output": False,
                                             "return_frames": False})
                row = {"configuration": name, "request": index, "load_s": round(load_s, 2),
                       "peak_memory_mib": round(result.peak_memory_mb, 1),
                       **{k: round(v, 3) for k, v in result.timings.items()},
                       "commit": os.environ.get("K6SERVE_COMMIT", "")}
                rows.append(row)
                print(json.dumps(row), flush=True)
        finally:
            generator.shutdown()
    with open(out / "offload_components.jsonl", "w") as handle:
        for row in rows:
            handle.write(json.dumps(row) + "\n")
    print(f"{'configuration':40} {'req':>3} {'encode':>8} {'denoise':>8} {'total':>8} {'peak MiB':>10}")
    for row in rows:
        print(f"{row['configuration']:40} {row['request']:>3} {row.get('encode', 0):8.3f} "
              f"{row.get('denoise', row.get('denoise total', 0)):8.3f} {row.get('total', 0):8.3f} "
              f"{row['peak_memory_mib']:10.1f}")


if __name__ == "__main__":
    main()
