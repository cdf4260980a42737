"""How fast host memory can be page-locked, and what a full-size memory release costs, on the GPU host.

    python scripts/gpu_pinned.py buffers --out $OUT            # 4 GiB: two ways to get page-locked memory
    python scripts/gpu_pinned.py release --out $OUT            # Pro-distill (dummy) weights: release, resume

`buffers` times, for one `--gib` GiB buffer each: `PinnedBuffer` as it is (a pageable allocation whose pages
torch's intra-op threads touch before `cudaHostRegister` locks them; registering untouched pages faulted them in on
one thread, 3x slower: 1.32 against 0.43 s on the H200 host), and torch's pinned allocator (`pin_memory=True`,
`cudaHostAlloc`, rounded up to a power of two); then a device-to-host and a host-to-device copy of the whole buffer into each. Offloading's load
and a memory release spend their time here (`offload/host_weights.py`, `runtime/memory.py`).

`release` loads `--model` with dummy weights in speed mode through `DiffGenerator`, then releases and resumes its
memory twice, the first resume with `keep_host_copy=True` (so the second release copies nothing), and reports each
reply's seconds, bytes and what the device still holds.

Results: <out>/gpu_pinned_<mode>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch


def timed(function):
    torch.cuda.synchronize()
    start = time.perf_counter()
    value = function()
    torch.cuda.synchronize()
    return value, round(time.perf_counter() - start, 3)


def buffers(args: argparse.Namespace) -> dict:
    from k6serve.offload.host_weights import PinnedBuffer

    num_bytes = int(args.gib * 2**30)
    device = torch.empty(num_bytes, dtype=torch.uint8, device="cuda").fill_(3)
    report: dict = {"gib": args.gib, "threads": torch.get_num_threads(), "ways": {}}
    keep: list[PinnedBuffer] = []

    ways = {
        # The buffer object is kept with its view: collecting it unregisters the memory.
        "PinnedBuffer": lambda: keep.append(PinnedBuffer(num_bytes)) or keep[-1].view(torch.uint8),
        "torch pin_memory=True": lambda: torch.empty(num_bytes, dtype=torch.uint8, pin_memory=True),
    }
    for name, make in ways.items():
        host, seconds = timed(make)
        report.setdefault("is_pinned", {})[name] = host.is_pinned()  # registered memory may report False
        _, d2h = timed(lambda host=host: host.copy_(device, non_blocking=True))
        _, h2d = timed(lambda host=host: device.copy_(host, non_blocking=True))
        report["ways"][name] = {"allocate_and_lock_s": seconds, "gb_per_s_lock": round(num_bytes / seconds / 1e9, 2),
                                "d2h_gb_per_s": round(num_bytes / d2h / 1e9, 1),
                                "h2d_gb_per_s": round(num_bytes / h2d / 1e9, 1)}
        print(name, report["ways"][name], flush=True)
        del host
    return report


def release(args: argparse.Namespace) -> dict:
    from k6serve.api import DiffGenerator

    start = time.perf_counter()
    generator = DiffGenerator.from_pretrained(args.model, load_format="dummy", performance_mode="speed")
    report: dict = {"model": args.model, "load_s": round(time.perf_counter() - start, 1), "rounds": []}
    try:
        for keep in (True, False):  # the second release re-points to the copy the first resume kept
            released = generator.release_memory()
            resumed = generator.resume_memory(keep_host_copy=keep)
            report["rounds"].append({
                name: {"seconds": reply["ranks"][0]["seconds"], "moved_gib": round(reply["moved_bytes"] / 2**30, 2),
                       "after": {key: reply["ranks"][0]["after"].get(key) for key in
                                 ("allocated_bytes", "reserved_bytes", "process_used_bytes", "explanation")}}
                for name, reply in (("release", released), ("resume", resumed))})
            print(report["rounds"][-1], flush=True)
    finally:
        generator.shutdown()
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mode", choices=("buffers", "release"))
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--gib", type=float, default=4.0)
    parser.add_argument("--model", default="kandinskylab/Kandinsky-6.0-Pro-distill-5s-Diffusers")
    args = parser.parse_args()
    report = buffers(args) if args.mode == "buffers" else release(args)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / f"gpu_pinned_{args.mode}.json").write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
