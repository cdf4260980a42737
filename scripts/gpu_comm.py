"""How fast the GPUs of this host exchange data: the collectives Ulysses uses, at Ulysses' message sizes.

Ulysses2 on Pro-distill (512x768x121) moves, per block and rank, one all-to-all of Q/K/V (292 MB sent to the
peer out of a 585 MB buffer) and one of the attention output (97 MB sent out of 195 MB). Whether that hides
behind the step depends on the link: NVLink moves it in about a millisecond, PCIe in ten. This script times
`all_to_all_single`, `all_gather_into_tensor` and a paired send/recv at those sizes, alone and beside a large
GEMM on another stream (the overlap a pipelined exchange relies on), and prints the bandwidth per direction.

    python scripts/gpu_comm.py            # two ranks on two GPUs (spawns them itself, or under torchrun)

Results: $OUT/gpu_comm.json and $OUT/gpu_comm.md.
"""

from __future__ import annotations

import json
import os
import statistics
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

WORLD_SIZE = 2
SIZES_MB = (16, 97, 195, 585)  # whole buffers; each rank sends (N-1)/N of an all-to-all buffer to its peer
REPEATS = 10


def _time_ms(fn, repeats: int = REPEATS) -> float:
    times = []
    for _ in range(repeats + 2):
        dist.barrier()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
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


def measure(rank: int) -> list[dict]:
    rows = []
    device = torch.device("cuda", rank)
    for size_mb in SIZES_MB:
        numel = size_mb * 2**20 // 2
        numel -= numel % (2 * WORLD_SIZE)
        send = torch.randn(numel, device=device, dtype=torch.bfloat16)
        received = torch.empty_like(send)
        half = send[: numel // WORLD_SIZE]
        gathered = torch.empty(numel, device=device, dtype=torch.bfloat16)
        peer = 1 - rank
        peer_bytes = numel * 2 / WORLD_SIZE  # what crosses the link in each direction

        for name, fn in _collectives(send, received, half, gathered, peer).items():
            ms = _time_ms(fn)
            rows.append({"op": name, "buffer_mb": size_mb, "ms": ms, "gb_per_s_per_direction": peer_bytes / ms / 1e6})

    # Overlap: an all-to-all of the largest buffer on NCCL's stream beside a GEMM on the compute stream.
    a = torch.randn(16384, 8192, device=device, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    numel = SIZES_MB[-1] * 2**20 // 2
    numel -= numel % (2 * WORLD_SIZE)
    send = torch.randn(numel, device=device, dtype=torch.bfloat16)
    received = torch.empty_like(send)
    gemm_ms = _time_ms(lambda: a @ b)
    a2a_ms = _time_ms(lambda: dist.all_to_all_single(received, send))

    def both():
        work = dist.all_to_all_single(received, send, async_op=True)
        a @ b
        work.wait()

    both_ms = _time_ms(both)
    rows.append({"op": "overlap", "buffer_mb": SIZES_MB[-1], "gemm_ms": gemm_ms, "all_to_all_ms": a2a_ms,
                 "together_ms": both_ms, "hidden_fraction": (gemm_ms + a2a_ms - both_ms) / min(gemm_ms, a2a_ms)})
    return rows


def table(rows: list[dict], gpu: str) -> str:
    lines = [f"### gpu_comm on two {gpu}", "", "| op | buffer (MB) | ms | GB/s per direction |", "|---|---|---|---|"]
    for row in rows:
        if row["op"] != "overlap":
            lines.append(f"| {row['op']} | {row['buffer_mb']} | {row['ms']:.2f} | {row['gb_per_s_per_direction']:.0f} |")
    overlap = rows[-1]
    lines += ["", (f"all-to-all of {overlap['buffer_mb']} MB beside a 16384x8192x8192 GEMM: GEMM {overlap['gemm_ms']:.2f} ms, "
              f"all-to-all {overlap['all_to_all_ms']:.2f} ms, together {overlap['together_ms']:.2f} ms "
              f"({overlap['hidden_fraction']:.0%} of the shorter one hidden)")]
    return "\n".join(lines) + "\n"


def rank_main(rank: int, init_method: str) -> None:
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=init_method, rank=rank, world_size=WORLD_SIZE,
                            timeout=timedelta(minutes=5), device_id=torch.device("cuda", rank))
    try:
        rows = measure(rank)
        if rank == 0:
            gpu = torch.cuda.get_device_name(0)
            text = table(rows, gpu)
            out = Path(os.environ.get("OUT", "."))
            out.mkdir(parents=True, exist_ok=True)
            (out / "gpu_comm.json").write_text(json.dumps({"gpu": gpu, "torch": torch.__version__,
                                                           "nccl": ".".join(map(str, torch.cuda.nccl.version())),
                                                           "rows": rows}, indent=2))
            (out / "gpu_comm.md").write_text(text)
            print(text, flush=True)
    finally:
        dist.destroy_process_group()


def main() -> None:
    if "RANK" in os.environ:
        rank_main(int(os.environ["RANK"]), "env://")
        return
    from k6serve.runtime.launch import find_free_port

    torch.multiprocessing.spawn(rank_main, args=(f"tcp://127.0.0.1:{find_free_port()}",), nprocs=WORLD_SIZE)


if __name__ == "__main__":
    main()
