"""Device memory of a two-rank NCCL communicator on one host (torchrun --nproc-per-node 2).

Each step prints every process's used MiB per nvidia-smi: the CUDA context, then the default group's communicator
(made by its first collective, ranks joined unbound as k6serve's workers do), then a second group of the same two
ranks (its own communicator). It tells how much of a released Ulysses2 rank's memory one communicator is.
"""

import os
import subprocess
import time

import torch
import torch.distributed as dist


def snapshot(label: str, control) -> None:
    # Synchronised over gloo: an NCCL barrier would itself create the default group's communicator.
    dist.barrier(group=control)
    torch.cuda.synchronize()
    time.sleep(1.0)
    if dist.get_rank() == 0:
        used = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader"],
                              capture_output=True, text=True).stdout.strip().replace("\n", "; ")
        print(f"{label}: {used}", flush=True)
    dist.barrier(group=control)


def main() -> None:
    rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl")
    control = dist.new_group(backend="gloo")
    x = torch.ones(1 << 20, device="cuda")
    snapshot("CUDA context and a 4 MiB tensor, no collective yet", control)
    dist.all_reduce(x)
    snapshot("after the default group's first all_reduce (one communicator)", control)
    pair = dist.new_group([0, 1])
    dist.all_reduce(x, group=pair)
    snapshot("after a second two-rank group's all_reduce (two communicators)", control)
    dist.all_to_all_single(torch.empty_like(x), x, group=pair)
    snapshot("after an all_to_all on it", control)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
