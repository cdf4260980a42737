"""How fast host memory can be page-locked, and what a full-size memory release costs, on the GPU host.

    python scripts/gpu_pinned.py buffers --out $OUT            # 4 GiB and 16 GiB of chunks: ways to page-lock
    python scripts/gpu_pinned.py release --out $OUT            # Pro-distill (dummy) weights: release, resume

`buffers` records the host's transparent-huge-page settings, then times for one `--gib` GiB buffer each: a
`PinnedBuffer` with huge pages asked for (the default) and without (pages faulted in on torch's intra-op threads,
then `cudaHostRegister`), and torch's pinned allocator (`pin_memory=True`, `cudaHostAlloc`, rounded up to a power of
two); then a device-to-host and a host-to-device copy of the whole buffer into each, and the time to free it
(unregister and unmap). Then `--chunks-gib` GiB in 256 MiB chunks, as a release or memory mode's load lock them: one
after the other on this thread, and through `pinned_buffers` (locked ahead on background threads while this thread
copies into the current chunk). Offloading's load and a memory release spend their time here
(`offload/host_weights.py`, `runtime/memory.py`).

`release` loads `--model` with dummy weights in speed mode through `DiffGenerator`, then releases and resumes its
memory three times: the first resume keeps the host copy (so the second release copies nothing), the second and
third free it on the reaper's thread (the worker's process; the third release, sent at once, waits for that free to
end first); each reply's seconds, bytes, what the device still holds and the host bytes still being freed.

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


def _transparent_huge_pages() -> dict:
    settings = {}
    for name in ("enabled", "defrag"):
        path = Path("/sys/kernel/mm/transparent_hugepage") / name
        settings[name] = path.read_text().strip() if path.exists() else None
    return settings


def _anon_huge_kib() -> int:
    return next(int(line.split()[1]) for line in open("/proc/meminfo") if line.startswith("AnonHugePages"))


def buffers(args: argparse.Namespace) -> dict:
    from k6serve.offload.host_weights import CHUNK_BYTES, PinnedBuffer, pinned_buffers

    num_bytes = int(args.gib * 2**30)
    device = torch.empty(num_bytes, dtype=torch.uint8, device="cuda").fill_(3)
    report: dict = {"gib": args.gib, "threads": torch.get_num_threads(), "transparent_huge_pages":
                    _transparent_huge_pages(), "ways": {}, "chunks": {}}
    print(report["transparent_huge_pages"], flush=True)

    ways = {
        # The buffer object is kept with its view: collecting it unregisters the memory.
        "PinnedBuffer, huge pages": lambda: PinnedBuffer(num_bytes, huge_pages=True),
        "PinnedBuffer, 4 KiB pages": lambda: PinnedBuffer(num_bytes, huge_pages=False),
        "torch pin_memory=True": lambda: torch.empty(num_bytes, dtype=torch.uint8, pin_memory=True),
    }
    for name, make in ways.items():
        huge_before = _anon_huge_kib()
        made, seconds = timed(make)
        host = made.view(torch.uint8) if isinstance(made, PinnedBuffer) else made
        huge_gib = round((_anon_huge_kib() - huge_before) / 2**20, 2)
        _, d2h = timed(lambda host=host: host.copy_(device, non_blocking=True))
        _, h2d = timed(lambda host=host: device.copy_(host, non_blocking=True))
        del host
        start = time.perf_counter()
        del made  # a PinnedBuffer unregisters and unmaps; torch's pinned allocator keeps the block cached
        free_s = time.perf_counter() - start
        report["ways"][name] = {"allocate_and_lock_s": seconds, "gb_per_s_lock": round(num_bytes / seconds / 1e9, 2),
                                "anon_huge_gib": huge_gib, "d2h_gb_per_s": round(num_bytes / d2h / 1e9, 1),
                                "h2d_gb_per_s": round(num_bytes / h2d / 1e9, 1), "free_s": round(free_s, 3)}
        print(name, report["ways"][name], flush=True)

    sizes = [CHUNK_BYTES] * int(args.chunks_gib * 2**30 // CHUNK_BYTES)
    source = torch.empty(CHUNK_BYTES, dtype=torch.uint8, device="cuda").fill_(5)
    for name, make in {
        "one after the other": lambda: (PinnedBuffer(size) for size in sizes),
        "pinned_buffers (locked ahead)": lambda: pinned_buffers(sizes),
    }.items():
        def lock_and_copy(make=make):
            kept = []
            for buffer in make():
                buffer.view(torch.uint8).copy_(source)  # what a release does with each chunk
                kept.append(buffer)
            return kept
        kept, seconds = timed(lock_and_copy)
        start = time.perf_counter()
        del kept
        report["chunks"][name] = {"gib": args.chunks_gib, "lock_and_copy_s": seconds,
                                  "gb_per_s": round(len(sizes) * CHUNK_BYTES / seconds / 1e9, 2),
                                  "free_s": round(time.perf_counter() - start, 3)}
        print(name, report["chunks"][name], flush=True)
    return report


def release(args: argparse.Namespace) -> dict:
    from k6serve.api import DiffGenerator

    start = time.perf_counter()
    generator = DiffGenerator.from_pretrained(args.model, load_format="dummy", performance_mode="speed")
    report: dict = {"model": args.model, "load_s": round(time.perf_counter() - start, 1), "rounds": []}
    try:
        # Keep, then free in the background; the third release first waits for that free to end.
        for keep in (True, False, False):
            released = generator.release_memory()
            resumed = generator.resume_memory(keep_host_copy=keep)
            row = {name: {"seconds": reply["ranks"][0]["seconds"], "moved_gib": round(reply["moved_bytes"] / 2**30, 2),
                          "after": {key: reply["ranks"][0]["after"].get(key) for key in
                                    ("allocated_bytes", "reserved_bytes", "process_used_bytes", "explanation")}}
                   for name, reply in (("release", released), ("resume", resumed))}
            row["resume"]["host_gib_being_freed"] = round(resumed["ranks"][0].get("host_bytes_being_freed", 0) / 2**30, 2)
            row["resume"]["message"] = resumed["ranks"][0]["message"]
            report["rounds"].append(row)
            print(row, flush=True)
    finally:
        generator.shutdown()
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mode", choices=("buffers", "release"))
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--gib", type=float, default=4.0)
    parser.add_argument("--chunks-gib", type=float, default=16.0)
    parser.add_argument("--model", default="kandinskylab/Kandinsky-6.0-Pro-distill-5s-Diffusers")
    args = parser.parse_args()
    report = buffers(args) if args.mode == "buffers" else release(args)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / f"gpu_pinned_{args.mode}.json").write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
