"""Two-GPU proof of the parallel runtime: Ulysses2 and CFG-parallel equal one GPU, step speed-ups, FSDP memory.

Run one stage per command (each well under 10 minutes on two H200s), with torchrun or without (the script then
starts its two ranks itself):

    python scripts/gpu_multi.py --stage ulysses   # Pro-distill 512x768x121: Ulysses2 == 1 GPU, step times
    python scripts/gpu_multi.py --stage cfg       # Pro, 2 steps: CFG-parallel == serial CFG, step times
    python scripts/gpu_multi.py --stage fsdp      # Pro-distill: peak memory of Ulysses2 vs FSDP + Ulysses2
    python scripts/gpu_multi.py --stage tp --lora merge  # Pro-distill TP2 vs 1 GPU (within rounding), with LoRA
    python scripts/gpu_multi.py --stage ring      # Pro-distill Ring2 vs 1 GPU (within rounding: blockwise softmax)
    python scripts/gpu_multi.py --stage fold      # Pro-distill Ulysses2 with the text encoders folded over both GPUs

Weights are `--load-format dummy` (released sizes, random, seeded identically on both ranks). The 1-GPU baseline
runs on rank 0 with the same code minus parallelisation, before the model is parallelised (for fsdp the baseline is
the resident Ulysses2 run); equality is checked on the float frames before quantisation and on the waveform, bit
for bit. A DiT step time is the wall time between
two step callbacks (synchronised), the first step (warm-up) excluded. Results: $OUT/gpu_multi_<stage>.json and
$OUT/gpu_multi_<stage>.md (a table). CPU check of the logic: `--device cpu --model-path <tiny checkpoint>` with a
small geometry (tests/unit/test_multi_gpu_script.py).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

WORLD_SIZE = 2
# stage -> (variant, default steps, [(run name, layout kwargs)])
STAGES: dict[str, tuple[str, int, list[tuple[str, dict[str, Any]]]]] = {
    "ulysses": ("pro-distill", 4, [("ulysses2", {"ulysses": 2})]),
    "cfg": ("pro", 2, [("cfg_parallel", {"cfg": 2})]),
    "fsdp": ("pro-distill", 2, [("ulysses2", {"ulysses": 2}), ("fsdp_ulysses2", {"ulysses": 2, "fsdp": True})]),
    "tp": ("pro-distill", 2, [("tp2", {"tp": 2})]),
    "ring": ("pro-distill", 2, [("ring2", {"ring": 2})]),
    # Ulysses2 with the Qwen2.5-VL and CLIP encoders tensor-parallel over both ranks (`--encoder-parallel fold`).
    "fold": ("pro-distill", 2, [("ulysses2_fold", {"ulysses": 2, "encoder_parallel": "fold"})]),
}
# --lora: an adapter on column-parallel (a key, an FFN input), row-parallel (an attention output, an FFN output) and
# replicated (a time embedding) Linears under TP, all in blocks 0 and 1 so tiny checkpoints have them too.
LORA_MODULES = (
    "visual_transformer_blocks.0.video_dec_block.self_attention.to_key",
    "visual_transformer_blocks.0.video_dec_block.feed_forward.net.0.proj",
    "visual_transformer_blocks.1.video_dec_block.self_attention.out_layer",
    "visual_transformer_blocks.1.video_dec_block.feed_forward.net.2",
    "video_time_embeddings.timestep_embedder.linear_1",
)
LORA_RANK = 16


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stage", choices=sorted(STAGES), required=True)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--model-path", default=None, help="a checkpoint folder; default: dummy released weights")
    parser.add_argument("--height", type=int, default=512)
    parser.add_argument("--width", type=int, default=768)
    parser.add_argument("--num-frames", type=int, default=121)
    parser.add_argument("--steps", type=int, default=None, help="denoising steps (default per stage)")
    parser.add_argument("--out", default=os.environ.get("OUT", "."), help="output folder (default $OUT)")
    parser.add_argument("--performance-mode", default="default", choices=("default", "speed"),
                        help="speed: fused projections + regionally compiled blocks (as the engine's "
                             "--performance-mode speed), applied before the 1-GPU baseline")
    parser.add_argument("--ulysses-chunks", type=lambda text: [int(c) for c in text.split(",")], default=None,
                        help="ulysses stage: one Ulysses2 run per head-chunk count, e.g. 1,2 (default: one run "
                             "with the engine's default / $K6SERVE_ULYSSES_CHUNKS)")
    parser.add_argument("--cache-dit-params", type=json.loads, default=None,
                        help="run every request with Cache-DiT on, with these cache_dit_params (JSON): the parallel "
                             "runs must take the 1-GPU run's caching decisions and equal its output")
    parser.add_argument("--lora", choices=("merge", "dynamic"), default=None,
                        help="after each run's request, apply a random rank-16 adapter (written by the script, its "
                             "update about 30%% of each weight's spread) as this merge mode, run again, and compare that too")
    parser.add_argument("--profile", action="store_true",
                        help="kernel profile of the second denoising step of every run (rank 0 in full; the "
                             "parallel runs also every rank's totals by category)")
    return parser.parse_args(argv)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _peak_memory_gib(device: torch.device) -> float | None:
    return torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None


def load_models(args: argparse.Namespace, variant_name: str, device: torch.device):
    from k6serve.models.kandinsky6.checkpoint import load_generation_models
    from k6serve.models.variants import VARIANTS, recognise
    from k6serve.ops.attention import resolve_attention_backend

    torch.manual_seed(0)  # dummy encoders / VAEs initialise from the global RNG: same weights on every rank
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if args.model_path is None:
        models = load_generation_models(None, VARIANTS[variant_name], device=device, dtype=dtype,
                                        load_format="dummy")
    else:
        folder = Path(args.model_path)
        models = load_generation_models(folder, recognise(str(folder), None, folder), device=device, dtype=dtype,
                                        load_format="auto")
    models.transformer.set_attention_backend(resolve_attention_backend(None, device))
    return models


def run_pipeline(models, args: argparse.Namespace, steps: int, device: torch.device, *,
                 profile: bool = False) -> dict:
    """One request; returns outputs (on the CPU), per-step times and the peak memory of this run.

    With `profile`, the second denoising step runs under `torch.profiler` and its kernel summary is returned.
    """
    from k6serve.request_resolution import resolve_generate
    from k6serve.pipelines.text_to_video import TextToVideoPipeline
    from k6serve.request import SamplingParams

    params = SamplingParams(prompt="a red fox runs through fresh snow at dawn", seed=42, height=args.height,
                            width=args.width, num_frames=args.num_frames, num_inference_steps=steps,
                            cache_dit_params=args.cache_dit_params)
    request, _ = resolve_generate(params, models.variant)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    stamps: list[float] = []
    profiler = None
    if profile and steps >= 3:
        activities = [torch.profiler.ProfilerActivity.CPU]
        if device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        profiler = torch.profiler.profile(activities=activities)

    def on_step(step: int, total: int) -> None:
        _sync(device)
        stamps.append(time.perf_counter())
        if profiler is not None and len(stamps) == 1:
            profiler.start()
        elif profiler is not None and len(stamps) == 2:
            profiler.stop()

    _sync(device)
    start = time.perf_counter()
    output = TextToVideoPipeline(models)(request, on_step=on_step)
    _sync(device)
    step_times = [later - earlier for earlier, later in itertools.pairwise(stamps)]
    if profiler is not None:
        step_times = step_times[1:]  # the profiled step (the second) runs slower: it is no step time
    kernel_profile = None
    if profiler is not None and len(stamps) >= 2:
        from k6serve.bench.kernel_profile import summarize

        kernel_profile = summarize(profiler.key_averages(), wall_s=stamps[1] - stamps[0],
                                   device=device.type == "cuda")
    return {
        "kernel_profile": kernel_profile,
        "frames": output.video.frames_float_THWC,
        "waveform": None if output.audio is None else torch.from_numpy(output.audio.waveform),
        "step_times_s": step_times,
        "step_s": statistics.median(step_times) if step_times else None,
        "total_s": time.perf_counter() - start,
        "timings": output.timings,
        "notes": output.notes,  # with Cache-DiT: which steps of each branch used the cache
        "peak_memory_gib": _peak_memory_gib(device),
    }


def compare(parallel: dict, baseline: dict) -> dict:
    """Bitwise equality of frames and waveform, and the largest differences."""
    report: dict[str, bool | float] = {}
    for key in ("frames", "waveform"):
        ours, reference = parallel[key], baseline[key]
        if ours is None or reference is None:
            report[f"{key}_equal"] = ours is None and reference is None
            continue
        report[f"{key}_equal"] = bool(ours.shape == reference.shape and torch.equal(ours, reference))
        report[f"{key}_max_abs_diff"] = float((ours.double() - reference.double()).abs().max())
        report[f"{key}_mean_abs_diff"] = float((ours.double() - reference.double()).abs().mean())
    report["num_frames_compared"] = int(baseline["frames"].shape[0])
    return report


def _summary(run: dict) -> dict:
    return {key: run[key] for key in ("step_s", "step_times_s", "total_s", "timings", "notes", "peak_memory_gib",
                                      "kernel_profile")}


def write_lora_adapter(models, out: Path) -> Path:
    """A rank-16 diffusers-layout adapter on `LORA_MODULES`, B @ A of about 0.3 of each weight's spread (a tenth
    moved the bf16 frames by barely twice TP's own rounding on two H200s); the same file on every rank (seeded)."""
    from safetensors.torch import save_file

    generator = torch.Generator().manual_seed(1234)
    tensors = {}
    for module in LORA_MODULES:
        weight = models.transformer.get_submodule(module).weight
        out_features, in_features = weight.shape
        spread = float(weight.float().std())  # written before any parallelisation: a plain, whole weight
        tensors[f"transformer.{module}.lora_A.weight"] = torch.randn(LORA_RANK, in_features, generator=generator)
        tensors[f"transformer.{module}.lora_B.weight"] = (0.3 * spread / LORA_RANK**0.5) * torch.randn(
            out_features, LORA_RANK, generator=generator)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"lora_rank{dist.get_rank()}.safetensors"
    save_file(tensors, str(path))
    return path


def run_with_lora(models, adapter: Path, mode: str, args, steps, device, *, fsdp: bool) -> dict:
    """The request with the adapter applied as `mode`; the adapter is removed again afterwards."""
    from k6serve.lora.manager import LoraManager
    from k6serve.lora.spec import LoraSpec

    manager = LoraManager(models.transformer, fsdp=fsdp)
    manager.set([LoraSpec(nickname="gpu_multi", path=str(adapter))], mode)
    try:
        return run_pipeline(models, args, steps, device)
    finally:
        manager.unmerge()


def _set_ulysses_chunks(transformer: torch.nn.Module, chunks: int) -> None:
    """Pipeline every Ulysses exchange of `transformer` in `chunks` head chunks (bitwise the same output)."""
    from k6serve.parallel.sequence_attention import ShardedAttention

    modules = [module for module in transformer.modules() if isinstance(module, ShardedAttention)]
    assert modules, "no sharded attention to set chunks on"
    for module in modules:
        module.overlap_chunks = chunks


def run_stage(args: argparse.Namespace, rank: int, device: torch.device) -> dict | None:
    """The stage on this rank; rank 0 returns the report."""
    from k6serve.parallel.mesh import ParallelLayout, build_groups
    from k6serve.parallel.parallelize import parallelize_generation_models

    variant_name, default_steps, runs = STAGES[args.stage]
    steps = args.steps or default_steps
    models = load_models(args, variant_name, device)
    if args.performance_mode == "speed":
        from k6serve.speed.performance_mode import apply_performance_mode

        apply_performance_mode(models, "speed", device)
    report: dict = {"stage": args.stage, "performance_mode": args.performance_mode, "variant": models.variant.name, "steps": steps,
                    "cache_dit_params": args.cache_dit_params,
                    "geometry": [args.height, args.width, args.num_frames], "device": str(device),
                    "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu", "runs": {}}
    baseline = lora_baseline = None
    adapter = write_lora_adapter(models, Path(args.out)) if args.lora else None
    if args.stage != "fsdp":
        # Every rank runs the 1-GPU baseline on its own GPU at the same time: two "identical" GPUs can differ by a
        # few percent, and a parallel step runs at the pace of the slower one, so the report shows both.
        baseline = run_pipeline(models, args, steps, device, profile=args.profile)  # every rank alike
        step_per_rank = [None] * dist.get_world_size()
        dist.all_gather_object(step_per_rank, baseline["step_s"])
        if adapter is not None:
            lora_baseline = run_with_lora(models, adapter, args.lora, args, steps, device, fsdp=False)
        if rank == 0:
            report["runs"]["one_gpu"] = _summary(baseline) | {"step_s_per_rank": step_per_rank}
            if lora_baseline is not None:
                report["runs"]["one_gpu_lora"] = _summary(lora_baseline) | {
                    "lora": args.lora, "change_from_one_gpu": compare(lora_baseline, baseline)}
        else:
            baseline = lora_baseline = None
        dist.barrier()
    for name, run_options in runs:
        degrees = {key: value for key, value in run_options.items() if key != "encoder_parallel"}
        layout = ParallelLayout(**degrees)
        groups = build_groups(layout, rank, backend=dist.get_backend(), timeout_s=1800)
        if layout.fsdp:
            # FSDP comes last in the fixed order, so it can wrap the model already parallelised by the last run.
            from k6serve.models.kandinsky6.plan import kandinsky6_plan
            from k6serve.parallel.fsdp import apply_fsdp

            apply_fsdp(models.transformer, kandinsky6_plan(models.transformer.config).blocks,
                       groups.axis_mesh("replica", device.type))
        else:
            parallelize_generation_models(models, groups, device_type=device.type,
                                          encoder_parallel=run_options.get("encoder_parallel", "replicate"))
        chunk_counts = args.ulysses_chunks if args.stage == "ulysses" and args.ulysses_chunks else [None]
        for chunks in chunk_counts:
            run_name = name if chunks is None else f"{name}_chunks{chunks}"
            if chunks is not None:
                _set_ulysses_chunks(models.transformer, chunks)
            # Every rank profiles the parallel run: a rank whose collectives take longer is waiting for its peer.
            result = run_pipeline(models, args, steps, device, profile=args.profile)
            categories_by_rank = [None] * dist.get_world_size()
            profile = result["kernel_profile"]
            dist.all_gather_object(categories_by_rank, None if profile is None else {
                "wall_ms": profile["wall_ms"], "busy_ms": profile["busy_ms"], "idle_ms": profile["idle_ms"],
                "categories_ms": profile["categories_ms"]})
            if rank == 0:
                report["runs"][run_name] = _summary(result)
                if profile is not None:
                    report["runs"][run_name]["kernel_profile_by_rank"] = categories_by_rank
                if baseline is None:  # fsdp: the resident Ulysses2 run is the baseline of FSDP + Ulysses2
                    baseline = result
                else:
                    report["runs"][run_name]["equal_to_baseline"] = compare(result, baseline)
                    if baseline["step_s"] and result["step_s"]:
                        report["runs"][run_name]["step_speedup"] = baseline["step_s"] / result["step_s"]
                write_report(report, args)  # after every run: a later failure or timeout keeps what was measured
            if adapter is not None:
                lora_result = run_with_lora(models, adapter, args.lora, args, steps, device, fsdp=layout.fsdp)
                if rank == 0:
                    report["runs"][f"{run_name}_lora"] = _summary(lora_result) | {"lora": args.lora}
                    if lora_baseline is None:  # fsdp: the resident Ulysses2 run's, as for the plain requests
                        lora_baseline = lora_result
                    else:
                        report["runs"][f"{run_name}_lora"]["equal_to_baseline"] = compare(lora_result, lora_baseline)
                    write_report(report, args)
            dist.barrier()
    return report if rank == 0 else None


def table(report: dict) -> str:
    title = (f"### gpu_multi {report['stage']}: {report['variant']} {report['geometry']} x {report['steps']} "
             f"steps on {report['gpu']}")
    lines = [title, "",
             "| run | DiT step (s) | speed-up | total (s) | peak memory (GiB) | frames equal | waveform equal | "
             "frames max abs diff | frames mean abs diff |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name, run in report["runs"].items():
        equal = run.get("equal_to_baseline", {})
        step = f"{run['step_s']:.3f}" if run["step_s"] else "-"
        speedup = f"{run['step_speedup']:.2f}x" if "step_speedup" in run else "-"
        memory = f"{run['peak_memory_gib']:.1f}" if run["peak_memory_gib"] is not None else "-"
        equal = equal or run.get("change_from_one_gpu", {})  # a LoRA baseline: how far the adapter moved it
        differences = " | ".join("-" if equal.get(key) is None else f"{equal[key]:.3g}"
                                 for key in ("frames_max_abs_diff", "frames_mean_abs_diff"))
        lines.append(f"| {name} | {step} | {speedup} | {run['total_s']:.1f} | {memory} | "
                     f"{equal.get('frames_equal', '-')} | {equal.get('waveform_equal', '-')} | {differences} |")
    per_rank = report["runs"].get("one_gpu", {}).get("step_s_per_rank")
    if per_rank and all(per_rank):
        lines += ["", "1-GPU step on each GPU (run at the same time, one model per GPU): "
                  + " / ".join(f"GPU {index} {step:.3f} s" for index, step in enumerate(per_rank))]
    from k6serve.bench.kernel_profile import format_summary

    for name, run in report["runs"].items():
        by_rank = run.get("kernel_profile_by_rank")
        if by_rank and all(by_rank):
            categories = sorted({category for summary in by_rank for category in summary["categories_ms"]})
            lines += ["", f"{name}, profiled step on every rank (kernel ms by category):", "",
                      "| rank | wall | busy | idle | " + " | ".join(categories) + " |",
                      "|---|---|---|---|" + "---|" * len(categories)]
            for index, summary in enumerate(by_rank):
                cells = " | ".join(f"{summary['categories_ms'].get(category, 0.0):.1f}" for category in categories)
                lines.append(f"| {index} | {summary['wall_ms']:.1f} | {summary['busy_ms']:.1f} | "
                             f"{summary['idle_ms']:.1f} | {cells} |")
    for name, run in report["runs"].items():
        if run.get("kernel_profile"):
            lines += ["", format_summary(f"{name}: second step, rank 0", run["kernel_profile"])]
    return "\n".join(lines) + "\n"


def write_report(report: dict, args: argparse.Namespace) -> None:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"gpu_multi_{args.stage}.json").write_text(json.dumps(report, indent=2))
    (out / f"gpu_multi_{args.stage}.md").write_text(table(report))


def rank_main(rank: int, args: argparse.Namespace, init_method: str) -> None:
    if args.device == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())
        # The same GEMM reduction rules for the baseline and the parallel run.
        torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
    else:
        from k6serve.runtime.launch import share_cpu_cores

        share_cpu_cores(WORLD_SIZE)  # both ranks compute at once: a thread per core each would spin against the other
    device = torch.device(args.device, torch.cuda.current_device()) if args.device == "cuda" else torch.device("cpu")
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo", init_method=init_method, rank=rank,
                            world_size=WORLD_SIZE, timeout=timedelta(minutes=30))
    try:
        report = run_stage(args, rank, device)
        if report is not None:
            write_report(report, args)
            print(table(report), flush=True)
    finally:
        dist.destroy_process_group()
    from k6serve.process_exit import exit_without_teardown

    exit_without_teardown(0)  # as the engine's ranks do: the interpreter's teardown took ~2 s per rank


def check_before_starting(args: argparse.Namespace) -> None:
    """What the arguments cannot run, said before the ranks start and load the model (minutes at full size)."""
    from k6serve.models.kandinsky6.config_before_loading import transformer_config_before_loading
    from k6serve.models.variants import VARIANTS, recognise

    if args.performance_mode == "speed" and args.stage == "tp":
        # The speed transforms fuse the Q/K/V projections that the TP plan shards by name (the engine shards
        # first and skips fusing DTensor weights); compiled TP is measured through the engine instead.
        raise SystemExit("--stage tp runs eager only: for compiled TP use `k6serve generate --tp-size 2 "
                         "--num-gpus 2 --performance-mode speed` (the engine shards before the speed transforms)")
    if args.stage == "ulysses" and args.ulysses_chunks:
        if args.model_path is None:
            config = transformer_config_before_loading(VARIANTS[STAGES[args.stage][0]], None)
        else:
            folder = Path(args.model_path)
            config = transformer_config_before_loading(recognise(str(folder), None, folder), folder)
        local_heads = config.num_video_heads // WORLD_SIZE
        bad = [chunks for chunks in args.ulysses_chunks if chunks < 1 or local_heads % chunks]
        if bad:  # before any rank starts, not at the first sharded attention
            raise SystemExit(f"--ulysses-chunks {bad} must divide the {local_heads} video heads of each rank")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    check_before_starting(args)
    if "RANK" in os.environ:  # torchrun --nproc-per-node 2
        rank_main(int(os.environ["RANK"]), args, "env://")
        return
    from k6serve.runtime.launch import find_free_port

    torch.multiprocessing.spawn(rank_main, args=(args, f"tcp://127.0.0.1:{find_free_port()}"), nprocs=WORLD_SIZE)


if __name__ == "__main__":
    main()
