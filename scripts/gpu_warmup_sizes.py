"""What `--warmup-mode server --warmup-resolutions` buys: each listed shape's start-up cost, then requests of those
shapes compiling nothing, against a shape not listed, which compiles on its first request.

    python3 scripts/gpu_warmup_sizes.py --out $OUT [--variant lite-distill] [--sizes 768x512 512x512x61]
        [--unlisted 640x384] [--steps 4]
    python3 scripts/gpu_warmup_sizes.py --out /tmp/x --tiny    # the demo checkpoint on the CPU (plumbing only:
                                                               # nothing is compiled there)

One worker in this process (`--performance-mode speed`, `--load-format dummy`): its load includes the server warm-up
of every `--sizes` item (`ModelWorker.server_warmups`: seconds per shape). Then one request per listed size and two of
the `--unlisted` one (cold, then warm), `--steps` steps each, frames not kept. Per request: `graphs_compiled` (graphs
dynamo compiled during it: 0 for a warmed shape), the denoise time and median step. Writes <out>/warmup_sizes.json and
a table to stdout; exits 1 when a listed shape compiled anything.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from k6serve.api import build_engine_config
from k6serve.config import parse_warmup_sizes
from k6serve.models.variants import VARIANTS
from k6serve.request import OutputOptions, SamplingParams
from k6serve.runtime.worker import ModelWorker

PROMPT = "A woman chops vegetables in a sunlit kitchen, with soft jazz playing."
NO_OUTPUT = OutputOptions(save_output=False, return_frames=False)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--variant", default="lite-distill", choices=sorted(VARIANTS))
    parser.add_argument("--sizes", nargs="+", default=["768x512", "512x512x61"])
    parser.add_argument("--unlisted", default="640x384", help="a shape not warmed: WxH or WxHxF")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--attention-backend", default="auto")
    parser.add_argument("--tiny", action="store_true", help="the demo checkpoint on the CPU")
    return parser


def engine_options(args) -> tuple[str, dict]:
    if args.tiny:
        return "demo", dict(device="cpu", warmup_mode="server", warmup_resolutions=args.sizes)
    hub_id = VARIANTS[args.variant].hub_id
    assert hub_id is not None  # every variant in VARIANTS is released (the demo ones, without one, are not in it)
    return hub_id, dict(
        load_format="dummy", device="cuda", performance_mode="speed", attention_backend=args.attention_backend,
        warmup_mode="server", warmup_resolutions=args.sizes)


def request_row(worker: ModelWorker, label: str, size, steps: int) -> dict:
    params = SamplingParams(prompt=PROMPT, width=size.width, height=size.height, num_frames=size.num_frames,
                            num_inference_steps=steps, seed=7)
    start = time.perf_counter()
    result = worker.run(params, NO_OUTPUT)
    wall = time.perf_counter() - start
    timings = result.timings
    return {"request": label, "size": str(size), "wall_s": round(wall, 3),
            "graphs_compiled": int(timings.get("graphs_compiled", 0)),
            "denoise_s": round(timings.get("denoise", 0.0), 3),
            "step_median_s": round(timings.get("denoise_step_median", 0.0), 4),
            "frames": f"{result.width}x{result.height}x{result.num_frames}"}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model_path, options = engine_options(args)
    config = build_engine_config(model_path, **options)
    start = time.perf_counter()
    worker = ModelWorker(config)
    load_s = time.perf_counter() - start
    warmups = [{"size": report.size, "seconds": round(report.seconds, 3)} for report in worker.server_warmups]
    listed = parse_warmup_sizes(args.sizes)
    (unlisted,) = parse_warmup_sizes(args.unlisted)
    rows = [request_row(worker, "listed", size, args.steps) for size in listed]
    rows += [request_row(worker, label, unlisted, args.steps) for label in ("unlisted cold", "unlisted warm")]
    report = {
        "variant": "demo" if args.tiny else args.variant, "device": torch.cuda.get_device_name()
        if torch.cuda.is_available() and not args.tiny else "cpu", "torch": torch.__version__,
        "load_with_warmup_s": round(load_s, 3), "warmup_total_s": round(worker.server_warmup_s or 0.0, 3),
        "warmups": warmups, "requests": rows,
    }
    (out / "warmup_sizes.json").write_text(json.dumps(report, indent=2) + "\n")
    print(f"load (with the server warm-up) {load_s:.1f} s; warm-up {report['warmup_total_s']:.1f} s: "
          + ", ".join(f"{w['size']} {w['seconds']:.1f} s" for w in warmups))
    print(f"{'request':<15} {'size':<14} {'wall s':>8} {'graphs':>7} {'denoise s':>10} {'step s':>8}")
    for row in rows:
        print(f"{row['request']:<15} {row['size']:<14} {row['wall_s']:>8.2f} {row['graphs_compiled']:>7d} "
              f"{row['denoise_s']:>10.2f} {row['step_median_s']:>8.3f}")
    return 1 if any(row["graphs_compiled"] for row in rows if row["request"] == "listed") else 0


if __name__ == "__main__":
    raise SystemExit(main())
