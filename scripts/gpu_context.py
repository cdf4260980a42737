"""What the memory a released worker keeps on its GPU is made of (3.5 GB on an H200 until the thirteenth session,
of which 2.9 GB were NCCL communicators a one-GPU worker never used; 0.6 GB since).

    python scripts/gpu_context.py --out $OUT [--model kandinskylab/Kandinsky-6.0-Lite-distill-5s-Diffusers]
    python scripts/gpu_context.py --mode nccl-eager --out $OUT   # a one-rank process group as a worker builds it
    python scripts/gpu_context.py --mode nccl-lazy --out $OUT    # ... without a bound device (launch.py since 13th)
    python scripts/gpu_context.py --mode engine --out $OUT       # DiffGenerator (worker process): load, release
    python scripts/gpu_context.py --mode engine --option num_gpus=2 --option ulysses_degree=2   # per rank, 2 GPUs
    ... --request num_inference_steps=1 --request num_frames=25   # one request first: communicators exist then

`steps` (the default): one process takes the steps a worker takes, one at a time, and after each frees torch's caches the way a release
does (`runtime/device_memory.free_allocator_caches`) and records this process's device memory per NVML next to
torch's reserved bytes: the CUDA context alone; a bf16 GEMM (cuBLAS); a Linear with bias (cuBLASLt); a 3-D
convolution (cuDNN); scaled-dot-product attention; a `torch.compile`d function (Triton); then a `ModelWorker` of
`--model` built with dummy weights in `--performance-mode`, and its memory released
(`runtime/memory.py`). What NVML counts beyond torch's reserved bytes is memory torch's allocator never saw: each
step's increase is what that library loaded (kernel images, handles) or allocated itself.

`nccl-eager` / `nccl-lazy`: a one-GPU process group as the worker process joins it (`launch.init_distributed`, with
and without the device bound, which makes NCCL create each communicator at once), its groups (`build_groups`) and a
broadcast on the default group; the process's device memory after each. `engine`: the release reply of a
`DiffGenerator` (the worker in its own process, as users run it) says what that process keeps.

Results: <out>/gpu_context_<mode>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import time
from pathlib import Path

import torch
import torch.nn.functional as F


def record(rows: list[dict], step: str, device: torch.device) -> None:
    from k6serve.runtime.device_memory import _process_used_bytes, free_allocator_caches

    free_allocator_caches(device)
    process = _process_used_bytes(device)
    reserved = torch.cuda.memory_reserved(device)
    row = {"step": step, "process_mib": None if process is None else round(process / 2**20),
           "torch_reserved_mib": round(reserved / 2**20, 1),
           "outside_torch_mib": None if process is None else round((process - reserved) / 2**20)}
    if rows and row["outside_torch_mib"] is not None and rows[-1]["outside_torch_mib"] is not None:
        row["added_outside_torch_mib"] = row["outside_torch_mib"] - rows[-1]["outside_torch_mib"]
    rows.append(row)
    print(row, flush=True)


def nccl(rows: list[dict], device: torch.device, *, bind_device: bool) -> None:
    import torch.distributed as dist

    from k6serve.config import ParallelConfig
    from k6serve.parallel.mesh import ParallelLayout, build_groups
    from k6serve.runtime.launch import find_free_port

    torch.cuda.set_device(device)
    torch.empty(1, device=device)
    record(rows, "CUDA context (first tensor)", device)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{find_free_port()}", rank=0, world_size=1,
                            device_id=device if bind_device else None)
    record(rows, f"init_process_group(nccl{', device_id' if bind_device else ''})", device)
    build_groups(ParallelLayout.from_config(ParallelConfig()), 0, backend="nccl", timeout_s=60)
    record(rows, "the worker's groups (build_groups)", device)
    dist.broadcast_object_list([1], src=0)
    record(rows, "a broadcast on the default group", device)
    dist.destroy_process_group()


def _option(text: str) -> tuple[str, object]:
    """`KEY=VALUE` for `DiffGenerator.from_pretrained`; the value read as JSON where it parses (2, true), else text."""
    key, sep, value = text.partition("=")
    if not sep:
        raise argparse.ArgumentTypeError(f"--option takes KEY=VALUE, got {text!r}")
    try:
        return key, json.loads(value)
    except json.JSONDecodeError:
        return key, value


def gpu_processes() -> list[dict] | None:
    """Every process on every GPU per nvidia-smi (pid, GPU, MiB), or None without it: a rank's process on a GPU other
    than its own is a CUDA context made on the wrong device."""
    try:
        completed = subprocess.run(
            ["nvidia-smi", "--query-compute-apps=pid,gpu_bus_id,used_memory", "--format=csv,noheader,nounits"],
            capture_output=True, text=True, timeout=60, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if completed.returncode:
        return None
    rows = [line.split(", ") for line in completed.stdout.strip().splitlines() if line.strip()]
    return [{"pid": int(pid), "gpu_bus_id": bus, "used_mib": int(used)} for pid, bus, used in rows]


def engine(report: dict, args: argparse.Namespace) -> None:
    from k6serve.api import DiffGenerator

    options = {"load_format": "dummy", "performance_mode": args.performance_mode, **dict(args.option)}
    report["options"] = options
    generator = DiffGenerator.from_pretrained(args.model, **options)
    try:
        if args.request:
            # A request first: NCCL creates a group's communicator at its first collective, so only after one does
            # the release reply show what the communicators of the layout hold.
            request = {"prompt": "a red fox runs through snow", "save_output": False, "return_frames": False,
                       **dict(args.request)}
            report["request"] = request
            started = time.perf_counter()
            generator.generate(**request)
            report["request_s"] = round(time.perf_counter() - started, 3)
        reply = generator.release_memory()
        report["after_release"] = [
            {"replica": rank.get("replica"), "rank": rank.get("rank"),
             **{key: rank["after"].get(key) for key in
                ("device", "allocated_bytes", "reserved_bytes", "process_used_bytes", "explanation")}}
            for rank in reply["ranks"]]
        for rank in report["after_release"]:
            print(rank, flush=True)
        report["gpu_processes_after_release"] = gpu_processes()
        generator.resume_memory()
        report["gpu_processes_after_resume"] = gpu_processes()
        print({key: report[key] for key in ("gpu_processes_after_release", "gpu_processes_after_resume")}, flush=True)
    finally:
        generator.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mode", choices=("steps", "nccl-eager", "nccl-lazy", "engine"), default="steps")
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--model", default="kandinskylab/Kandinsky-6.0-Lite-distill-5s-Diffusers")
    parser.add_argument("--performance-mode", default="speed")
    parser.add_argument("--option", type=_option, action="append", default=[],
                        help="engine mode: a DiffGenerator option KEY=VALUE (repeat), e.g. num_gpus=2 ulysses_degree=2")
    parser.add_argument("--request", type=_option, action="append", default=[],
                        help="engine mode: run one request with these generate() keywords before the release "
                             "(repeat), e.g. num_inference_steps=1 num_frames=25; the communicators exist only after")
    args = parser.parse_args()
    device = torch.device("cuda", 0)
    rows: list[dict] = []
    report = {"mode": args.mode, "torch": torch.__version__, "cuda": torch.version.cuda,
              "CUDA_MODULE_LOADING": os.environ.get("CUDA_MODULE_LOADING"), "rows": rows}
    if args.mode == "steps":
        steps(rows, report, device, args)
    elif args.mode == "engine":
        engine(report, args)
    else:
        nccl(rows, device, bind_device=args.mode == "nccl-eager")
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / f"gpu_context_{args.mode}.json").write_text(json.dumps(report, indent=2))


def steps(rows: list[dict], report: dict, device: torch.device, args: argparse.Namespace) -> None:
    torch.empty(1, device=device)
    record(rows, "CUDA context (first tensor)", device)
    a = torch.randn(4096, 4096, device=device, dtype=torch.bfloat16)
    (a @ a).sum().item()
    record(rows, "bf16 GEMM (cuBLAS)", device)
    F.linear(a, a, a[0]).sum().item()
    record(rows, "Linear with bias (cuBLASLt)", device)
    video = torch.randn(1, 16, 8, 64, 64, device=device, dtype=torch.bfloat16)
    F.conv3d(video, torch.randn(16, 16, 3, 3, 3, device=device, dtype=torch.bfloat16), padding=1).sum().item()
    record(rows, "3-D convolution (cuDNN)", device)
    q = torch.randn(1, 24, 4096, 128, device=device, dtype=torch.bfloat16)
    F.scaled_dot_product_attention(q, q, q).sum().item()
    record(rows, "scaled-dot-product attention", device)
    compiled = torch.compile(lambda x: torch.nn.functional.gelu(x) * 2 + 1)
    compiled(a).sum().item()
    record(rows, "a torch.compile'd function (Triton)", device)
    del a, video, q, compiled

    from k6serve.api import build_engine_config
    from k6serve.runtime.memory import ReleaseMemory
    from k6serve.runtime.worker import ModelWorker

    start = time.perf_counter()
    worker = ModelWorker(build_engine_config(args.model, load_format="dummy", performance_mode=args.performance_mode))
    report["load_s"] = round(time.perf_counter() - start, 1)
    record(rows, f"ModelWorker ({args.model.split('/')[-1]}, dummy, {args.performance_mode})", device)
    [released] = worker.apply_memory_operation(ReleaseMemory())
    report["release_s"] = released["seconds"]
    record(rows, "after a memory release", device)


if __name__ == "__main__":
    main()
