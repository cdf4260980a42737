"""How fast the GPU host's disk gives back a file that is not in the page cache, read the ways a loader can read it.

    python3 scripts/gpu_disk_read.py [--gib 8]

Writes `--gib` GiB of random bytes under /tmp, then for each way drops the file's pages (posix_fadvise) and reads it
all: pread in 16 MiB pieces on 1-16 threads (each its own range), torch copies of 64 MiB pieces of the mapping (the
way `load_state_dict` reads: the pages faulted in on torch's threads), and the same with the next 256 MiB asked for
ahead (MADV_WILLNEED). Prints GB/s per way; the file is removed at the end.
"""

from __future__ import annotations

import argparse
import mmap
import os
import threading
import time

import torch

PATH = "/tmp/k6serve-disk.bin"
PIECE = 64 << 20


def drop() -> None:
    fd = os.open(PATH, os.O_RDONLY)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    os.close(fd)


def read_range(start: int, length: int) -> None:
    fd = os.open(PATH, os.O_RDONLY)
    try:
        offset = start
        while offset < start + length:
            data = os.pread(fd, min(16 << 20, start + length - offset), offset)
            if not data:
                break
            offset += len(data)
    finally:
        os.close(fd)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gib", type=int, default=8)
    size = parser.parse_args().gib << 30
    start = time.perf_counter()
    block = os.urandom(PIECE)
    with open(PATH, "wb") as file:
        for _ in range(size // PIECE):
            file.write(block)
    os.sync()
    print(f"write {size / 1e9 / (time.perf_counter() - start):.2f} GB/s")
    for threads in (1, 2, 4, 8, 16):
        drop()
        start = time.perf_counter()
        part = size // threads
        workers = [threading.Thread(target=read_range, args=(i * part, part)) for i in range(threads)]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join()
        print(f"pread, {threads} threads: {size / 1e9 / (time.perf_counter() - start):.2f} GB/s")
    for ahead in (False, True):
        drop()  # before the mapping: pages mapped into this process are not dropped
        fd = os.open(PATH, os.O_RDONLY)
        mapping = mmap.mmap(fd, 0, prot=mmap.PROT_READ)
        source, target = torch.frombuffer(mapping, dtype=torch.uint8), torch.empty(PIECE, dtype=torch.uint8)
        start = time.perf_counter()
        for offset in range(0, size, PIECE):
            if ahead and offset + PIECE < size:
                mapping.madvise(mmap.MADV_WILLNEED, offset + PIECE, min(256 << 20, size - offset - PIECE))
            target.copy_(source[offset:offset + PIECE])
        print(f"torch copies of the mapping ({torch.get_num_threads()} threads){', WILLNEED ahead' if ahead else ''}:"
              f" {size / 1e9 / (time.perf_counter() - start):.2f} GB/s")
        del source
        mapping.close()
        os.close(fd)
    os.unlink(PATH)


if __name__ == "__main__":
    main()
