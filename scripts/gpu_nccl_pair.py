"""Device memory of a two-rank NCCL communicator on one host.

    torchrun --nproc-per-node 2 scripts/gpu_nccl_pair.py          # two GPUs: NCCL, MiB per process from nvidia-smi
    torchrun --nproc-per-node 2 scripts/gpu_nccl_pair.py --cpu    # CPU check of the sequence (CI): gloo, no MiB

Each step prints every process's used MiB: the CUDA context, then the default group's communicator (made by its
first collective; ranks join unbound, as k6serve's workers do), then a second group of the same two ranks (its own
communicator), then an all-to-all on it (NCCL's point-to-point connections). It tells how much of a released
Ulysses2 rank's memory is communicators (docs/benchmarks.md, fifteenth session).
"""

import argparse
import os
import subprocess
import time

import torch
import torch.distributed as dist

STEPS = (
    "CUDA context and a 4 MiB tensor, no collective yet",
    "after the default group's first all_reduce (one communicator)",
    "after a second two-rank group's all_reduce (two communicators)",
    "after an all_to_all on it",
)


def snapshot(label: str, control: dist.ProcessGroup, cuda: bool) -> None:
    # Synchronised over gloo: an NCCL barrier would itself create the default group's communicator.
    dist.barrier(group=control)
    if cuda:
        torch.cuda.synchronize()
        time.sleep(1.0)
    if dist.get_rank() == 0:
        used = "n/a (CPU)"
        if cuda:
            used = subprocess.run(
                ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader"],
                capture_output=True, text=True,
            ).stdout.strip().replace("\n", "; ")
        print(f"{label}: {used}", flush=True)
    dist.barrier(group=control)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cpu", action="store_true", help="gloo on the CPU: checks the sequence, measures nothing")
    cuda = not parser.parse_args().cpu
    if cuda:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl" if cuda else "gloo")
    control = dist.new_group(backend="gloo")
    x = torch.ones(1 << 20, device="cuda" if cuda else "cpu")
    snapshot(STEPS[0], control, cuda)
    dist.all_reduce(x)
    snapshot(STEPS[1], control, cuda)
    pair = dist.new_group([0, 1])
    dist.all_reduce(x, group=pair)
    snapshot(STEPS[2], control, cuda)
    dist.all_to_all_single(torch.empty_like(x), x, group=pair)
    snapshot(STEPS[3], control, cuda)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
