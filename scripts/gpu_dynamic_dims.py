"""Do the compiled DiT's graphs with dynamic text and audio lengths run as fast as static ones?

    python3 scripts/gpu_dynamic_dims.py --out $OUT [--variant pro-distill] [--steps 3]
    python3 scripts/gpu_dynamic_dims.py --out /tmp/x --tiny    # the demo checkpoint on the CPU (plumbing only)

Speed mode trims the text padding, so the compiled blocks see each prompt's token count and each soundtrack's
length: dynamo compiles them static for the first request and, at the first request of another prompt length or
fps, once more with those dimensions dynamic; a server runs on the dynamic graphs from then on, while the benchmarks
(one prompt) time the static ones. One worker in this process (`--performance-mode speed`, `--load-format dummy`,
no warm-up): request 1 (prompt A, cold: the static compile), request 2 (A, warm: static), request 3 (a prompt of
another length at another fps: the dynamic compile), request 4 (A again, on the graphs dynamo now picks), request 5
(another prompt again), request 6 (A at half the height: the video dimensions' compile), request 7 (A at its own
size again, on the graphs dynamic in every length). Per request: graphs compiled and the median DiT step. Writes
<out>/dynamic_dims.json and a table.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import torch

from k6serve.api import build_engine_config
from k6serve.models.variants import VARIANTS
from k6serve.request import OutputOptions, SamplingParams
from k6serve.runtime.worker import ModelWorker

PROMPT_A = "A woman chops vegetables in a sunlit kitchen, with soft jazz playing."
PROMPT_B = ("An old fisherman mends a net on a wooden pier at dawn while gulls cry overhead and waves slap against "
            "the posts; the camera slowly circles him.")
PROMPT_C = "A red fox trots through fresh snow."
NO_OUTPUT = OutputOptions(save_output=False, return_frames=False)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--variant", default="pro-distill", choices=sorted(VARIANTS))
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--attention-backend", default="auto")
    parser.add_argument("--tiny", action="store_true", help="the demo checkpoint on the CPU")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.tiny:
        config = build_engine_config("demo", device="cpu")
        shape: dict[str, Any] = dict(height=32, width=48, num_frames=5)  # SamplingParams keywords
    else:
        hub_id = VARIANTS[args.variant].hub_id
        assert hub_id is not None  # every variant in VARIANTS is released (the demo ones, without one, are not in it)
        config = build_engine_config(hub_id, load_format="dummy", device="cuda", performance_mode="speed",
                                     attention_backend=args.attention_backend)
        shape = {}
    start = time.perf_counter()
    worker = ModelWorker(config)
    load_s = time.perf_counter() - start
    # A smaller shape for the video dimensions' recompile: half the height (a multiple of 16 at both sizes).
    small: dict[str, Any] = dict(height=16, width=48, num_frames=5) if args.tiny else dict(height=256, width=768)
    plan = [("1 A cold (static compile)", PROMPT_A, 24.0, shape), ("2 A warm (static)", PROMPT_A, 24.0, shape),
            ("3 B at 30 fps (recompile)", PROMPT_B, 30.0, shape), ("4 A again", PROMPT_A, 24.0, shape),
            ("5 C (dynamic)", PROMPT_C, 24.0, shape), ("6 A at half height", PROMPT_A, 24.0, small),
            ("7 A again", PROMPT_A, 24.0, shape)]
    rows = []
    for label, prompt, fps, size in plan:
        params = SamplingParams(prompt=prompt, fps=fps, num_inference_steps=args.steps, seed=7, **size)
        begin = time.perf_counter()
        result = worker.run(params, NO_OUTPUT)
        rows.append({"request": label, "wall_s": round(time.perf_counter() - begin, 3),
                     "graphs_compiled": int(result.timings.get("graphs_compiled", 0)),
                     "step_median_s": round(result.timings.get("denoise_step_median", 0.0), 4),
                     "step_max_s": round(result.timings.get("denoise_step_max", 0.0), 4)})
    report = {"variant": "demo" if args.tiny else args.variant, "torch": torch.__version__,
              "device": "cpu" if args.tiny else torch.cuda.get_device_name(), "load_s": round(load_s, 2),
              "steps": args.steps, "requests": rows}
    (out / "dynamic_dims.json").write_text(json.dumps(report, indent=2) + "\n")
    print(f"{report['variant']}, load {load_s:.1f} s, {args.steps} steps a request")
    print(f"{'request':<28} {'wall s':>8} {'graphs':>7} {'step median s':>14} {'step max s':>11}")
    for row in rows:
        print(f"{row['request']:<28} {row['wall_s']:>8.2f} {row['graphs_compiled']:>7d} {row['step_median_s']:>14.4f} "
              f"{row['step_max_s']:>11.4f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
