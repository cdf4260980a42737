"""How fast the GPUs of this host exchange data: the collectives Ulysses uses, at Ulysses' message sizes.

Ulysses2 on Pro-distill (512x768x121) moves, per block and rank, one all-to-all of Q/K/V (292 MB sent to the
peer out of a 585 MB buffer) and one of the attention output (97 MB sent out of 195 MB). Whether that hides
behind the step depends on the link: NVLink moves it in about a millisecond, PCIe in ten. This script times
`all_to_all_single`, `all_gather_into_tensor` and a paired send/recv at those sizes, alone and beside a large
GEMM on another stream (the overlap a pipelined exchange relies on), and prints the bandwidth per direction.

    python scripts/gpu_comm.py            # two ranks on two GPUs (spawns them itself, or under torchrun)
    python scripts/gpu_comm.py --cpu      # the same logic on gloo with small buffers (tests/unit/test_gpu_comm_script.py)

Results: $OUT/gpu_comm.json and $OUT/gpu_comm.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

WORLD_SIZE = 2
SIZES_MB = (16, 97, 195, 585)  # whole buffers; each rank sends (N-1)/N of an all-to-all buffer to its peer
CPU_SIZES_MB = (1, 2)  # --cpu: gloo, small buffers, fp32 (gloo has no bf16 all-to-all on every build)
GEMM_SHAPE = (16384, 8192, 8192)
CPU_GEMM_SHAPE = (256, 256, 256)
REPEATS = 10


def _time_ms(fn, device: torch.device, repeats: int = REPEATS) -> float:
    times = []
    for _ in range(repeats + 2):
        dist.barrier()
        if device.type == "cuda":
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            begin = time.perf_counter()
            fn()
            times.append((time.perf_counter() - begin) * 1e3)
    return statistics.median(times[2:])


def _collectives(send, received, half, gathered, peer: int) -> dict:
    """The timed collectives on one set of buffers (`half` = this rank's share of an all-gather)."""

    def all_to_all():
        dist.all_to_all_single(received, send)

    def all_gather():
        dist.all_gather_into_tensor(gathered, half)

    def send_recv():
        ops = [dist.P2POp(dist.isend, half, peer), dist.P2POp(dist.irecv, received[: half.numel()], peer)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()

    return {"all_to_all": all_to_all, "all_gather": all_gather, "send_recv": send_recv}


def measure(rank: int, device: torch.device) -> list[dict]:
    rows = []
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    element_bytes = torch.finfo(dtype).bits // 8
    for size_mb in SIZES_MB if device.type == "cuda" else CPU_SIZES_MB:
        numel = size_mb * 2**20 // element_bytes
        numel -= numel % (2 * WORLD_SIZE)
        send = torch.randn(numel, device=device, dtype=dtype)
        received = torch.empty_like(send)
        half = send[: numel // WORLD_SIZE]
        gathered = torch.empty(numel, device=device, dtype=dtype)
        peer = 1 - rank
        peer_bytes = numel * element_bytes / WORLD_SIZE  # what crosses the link in each direction

        for name, fn in _collectives(send, received, half, gathered, peer).items():
            ms = _time_ms(fn, device)
            rows.append({"op": name, "buffer_mb": size_mb, "ms": ms, "gb_per_s_per_direction": peer_bytes / ms / 1e6})

    # Overlap: an all-to-all of the largest buffer on NCCL's stream beside a GEMM on the compute stream.
    rows_m, inner, cols = GEMM_SHAPE if device.type == "cuda" else CPU_GEMM_SHAPE
    a = torch.randn(rows_m, inner, device=device, dtype=dtype)
    b = torch.randn(inner, cols, device=device, dtype=dtype)
    size_mb = rows[-1]["buffer_mb"]
    numel = size_mb * 2**20 // element_bytes
    numel -= numel % (2 * WORLD_SIZE)
    send = torch.randn(numel, device=device, dtype=dtype)
    received = torch.empty_like(send)
    gemm_ms = _time_ms(lambda: a @ b, device)
    a2a_ms = _time_ms(lambda: dist.all_to_all_single(received, send), device)

    def both():
        work = dist.all_to_all_single(received, send, async_op=True)
        a @ b
        work.wait()

    both_ms = _time_ms(both, device)
    rows.append({"op": "overlap", "buffer_mb": size_mb, "gemm": list(GEMM_SHAPE if device.type == "cuda" else CPU_GEMM_SHAPE),
                 "gemm_ms": gemm_ms, "all_to_all_ms": a2a_ms,
                 "together_ms": both_ms, "hidden_fraction": (gemm_ms + a2a_ms - both_ms) / min(gemm_ms, a2a_ms)})
    return rows


def table(rows: list[dict], gpu: str) -> str:
    lines = [f"### gpu_comm on two {gpu}", "", "| op | buffer (MB) | ms | GB/s per direction |", "|---|---|---|---|"]
    for row in rows:
        if row["op"] != "overlap":
            lines.append(f"| {row['op']} | {row['buffer_mb']} | {row['ms']:.2f} | {row['gb_per_s_per_direction']:.0f} |")
    overlap = rows[-1]
    gemm = "x".join(map(str, overlap["gemm"]))
    lines += ["", (f"all-to-all of {overlap['buffer_mb']} MB beside a {gemm} GEMM: GEMM {overlap['gemm_ms']:.2f} ms, "
              f"all-to-all {overlap['all_to_all_ms']:.2f} ms, together {overlap['together_ms']:.2f} ms "
              f"({overlap['hidden_fraction']:.0%} of the shorter one hidden)")]
    return "\n".join(lines) + "\n"


def rank_main(rank: int, init_method: str, use_cpu: bool = False) -> None:
    if use_cpu:
        device = torch.device("cpu")
        dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=WORLD_SIZE,
                                timeout=timedelta(minutes=5))
    else:
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
        dist.init_process_group("nccl", init_method=init_method, rank=rank, world_size=WORLD_SIZE,
                                timeout=timedelta(minutes=5), device_id=device)
    try:
        rows = measure(rank, device)
        if rank == 0:
            gpu = torch.cuda.get_device_name(0) if device.type == "cuda" else "CPUs (gloo)"
            text = table(rows, gpu)
            out = Path(os.environ.get("OUT", "."))
            out.mkdir(parents=True, exist_ok=True)
            nccl = ".".join(map(str, torch.cuda.nccl.version())) if device.type == "cuda" else None
            (out / "gpu_comm.json").write_text(json.dumps({"gpu": gpu, "torch": torch.__version__, "nccl": nccl,
                                                           "rows": rows}, indent=2))
            (out / "gpu_comm.md").write_text(text)
            print(text, flush=True)
    finally:
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cpu", action="store_true", help="gloo on the CPU with small buffers (a logic check)")
    args = parser.parse_args(argv)
    if "RANK" in os.environ:
        rank_main(int(os.environ["RANK"]), "env://", args.cpu)
        return
    from k6serve.runtime.launch import find_free_port

    torch.multiprocessing.spawn(rank_main, args=(f"tcp://127.0.0.1:{find_free_port()}", args.cpu), nprocs=WORLD_SIZE)


if __name__ == "__main__":
    main()
