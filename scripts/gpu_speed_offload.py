"""Speed mode with the DiT offloaded whole against speed mode with everything resident, through the worker.

    python3 scripts/gpu_speed_offload.py --out $OUT [--variant lite-distill] [--steps 2] [--repeats 1]
        [--height 512 --width 768 --num-frames 121] [--cpu-offload-components transformer]
    python3 scripts/gpu_speed_offload.py --out /tmp/x --tiny      # the demo checkpoint on the CPU (plumbing only:
                                                                  # nothing is offloaded or compiled there)

Both configurations run in this process, one after the other, each with one cold request (compilation) and
`--repeats` warm ones of the same seed: first `--performance-mode speed --cpu-offload-components transformer` (so its
peak is measured in a clean process), then speed with everything resident. `--load-format dummy` builds the same
random weights for both (the DiT from its own seeded generator, the rest after `torch.manual_seed(0)`), and the
second configuration reuses the first's compiled kernels and cuDNN choices, so the two must give the same frames and
audio bit for bit: same kernels, same weights, only where the DiT's weights live between requests differs.

Writes one JSON line per request to <out>/speed_offload.jsonl (stage timings: `denoise`, `denoise_step_median`,
`total`; `graphs_compiled`: graphs dynamo compiled during that request, 0 when a warm request recompiles nothing;
peak memory; the GPU memory allocated before and after the load: the resident configuration's peak includes
whatever the first one left), <out>/speed_offload.json (the workers' performance and offload reports, the peak after
each stage, the sha256 of each configuration's last frames and audio and whether they are equal) and a table to
stdout. Exits 1 when the outputs differ.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import os
import time
from pathlib import Path

import torch

from k6serve.api import build_engine_config
from k6serve.models.variants import VARIANTS
from k6serve.request import OutputOptions, SamplingParams
from k6serve.runtime.worker import ModelWorker

PROMPT = "A woman chops vegetables in a sunlit kitchen, with soft jazz playing."
RETURN_FRAMES = OutputOptions(save_output=False, return_frames=True)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--variant", default="lite-distill", choices=sorted(VARIANTS))
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=1, help="warm requests after the cold one")
    parser.add_argument("--height", type=int, default=512)
    parser.add_argument("--width", type=int, default=768)
    parser.add_argument("--num-frames", type=int, default=121)
    parser.add_argument("--cpu-offload-components", nargs="+", default=["transformer"])
    parser.add_argument("--attention-backend", default="auto")
    parser.add_argument("--tiny", action="store_true", help="the demo checkpoint on the CPU, at 32x48x5")
    return parser


def configurations(args) -> dict[str, dict]:
    """Engine options per configuration, the offloaded one first."""
    offloaded = "speed, --cpu-offload-components " + " ".join(args.cpu_offload_components)
    return {offloaded: {"cpu_offload_components": tuple(args.cpu_offload_components)}, "speed, resident": {}}


def _digest(array) -> str:
    return hashlib.sha256(array.tobytes()).hexdigest() if array is not None else ""


def _allocated_gib(device: torch.device) -> float:
    return torch.cuda.memory_allocated(device) / 2**30 if device.type == "cuda" else 0.0


def run_configuration(name: str, options: dict, args, params: SamplingParams) -> tuple[list[dict], dict]:
    """Load, run the cold and warm requests; the rows, and a summary with the last request's digests."""
    if args.tiny:
        model, load = "demo", {"device": "cpu", "attention_backend": "sdpa"}
    else:
        hub_id = VARIANTS[args.variant].hub_id
        assert hub_id is not None  # every variant in VARIANTS is released (the demo ones, without one, are not in it)
        model, load = hub_id, {"load_format": "dummy", "attention_backend": args.attention_backend}
    config = build_engine_config(model, performance_mode="speed", **load, **options)
    device = torch.device("cuda" if not args.tiny and torch.cuda.is_available() else "cpu")
    allocated_before_load = _allocated_gib(device)  # what the previous configuration left (0 when it freed all)
    torch.manual_seed(0)  # the dummy build's components other than the DiT draw from the global generators
    start = time.perf_counter()
    worker = ModelWorker(config)
    load_s = time.perf_counter() - start
    allocated_after_load = _allocated_gib(worker.device)
    rows, result = [], None
    for index in range(1 + args.repeats):
        result = worker.run(params, RETURN_FRAMES)
        row = {"configuration": name, "request": index, "load_s": round(load_s, 2),
               "allocated_before_load_gib": round(allocated_before_load, 2),
               "allocated_after_load_gib": round(allocated_after_load, 2),
               "peak_memory_gib": round(result.peak_memory_mb / 1024, 2),
               **{key: round(value, 4) for key, value in result.timings.items()},
               "commit": os.environ.get("K6SERVE_COMMIT", "")}
        rows.append(row)
        print(json.dumps(row), flush=True)
    # One request at least (main refuses a negative --repeats), and RETURN_FRAMES asks for the frames.
    assert result is not None and result.frames is not None
    report = worker.performance_report
    describe_peaks = getattr(worker.pipeline.residency, "describe_peaks", None)
    summary = {
        "performance": {"fused_attentions": report.num_fused_attentions,
                        "compiled_blocks": report.num_compiled_blocks, "vae": list(report.vae),
                        "notes": list(report.notes)},
        "offload": worker.offload_report.describe() if worker.offload_report is not None else None,
        "peak_after_stage": describe_peaks() if describe_peaks is not None else "",
        "frames_sha256": _digest(result.frames), "audio_sha256": _digest(result.audio),
        "shape": list(result.frames.shape),
    }
    del worker, result
    gc.collect()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()
    return rows, summary


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.repeats < 0:  # no request would run, and the summary of the last one failed on None
        parser.error(f"--repeats must be >= 0 (warm requests after the cold one), got {args.repeats}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    height, width, num_frames = (32, 48, 5) if args.tiny else (args.height, args.width, args.num_frames)
    params = SamplingParams(prompt=PROMPT, seed=42, height=height, width=width, num_frames=num_frames,
                            num_inference_steps=args.steps)
    rows, summaries = [], {}
    for name, options in configurations(args).items():
        configuration_rows, summaries[name] = run_configuration(name, options, args, params)
        rows += configuration_rows
    with open(out / "speed_offload.jsonl", "w") as handle:
        for row in rows:
            handle.write(json.dumps(row) + "\n")
    first, second = summaries.values()
    equal = {part: first[f"{part}_sha256"] == second[f"{part}_sha256"] for part in ("frames", "audio")}
    summary = {"variant": "demo" if args.tiny else args.variant, "size": [height, width, num_frames],
               "steps": args.steps, "configurations": summaries, "bitwise_equal": equal}
    (out / "speed_offload.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(f"{'configuration':48} {'req':>3} {'load':>6} {'denoise':>8} {'step':>7} {'total':>7} {'peak GiB':>9} "
          f"{'graphs':>6}")
    for row in rows:
        print(f"{row['configuration']:48} {row['request']:>3} {row['load_s']:6.1f} {row.get('denoise', 0):8.3f} "
              f"{row.get('denoise_step_median', 0):7.3f} {row.get('total', 0):7.3f} {row['peak_memory_gib']:9.2f} "
              f"{row.get('graphs_compiled', 0):6.0f}")
    for name, configuration in summaries.items():
        print(f"{name}: {configuration['performance']['compiled_blocks']} compiled blocks, "
              f"{configuration['performance']['fused_attentions']} fused attentions; "
              f"peak after each stage: {configuration['peak_after_stage'] or '-'}")
    print(f"bitwise equal: frames {equal['frames']}, audio {equal['audio']}")
    return 0 if all(equal.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
