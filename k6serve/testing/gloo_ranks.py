"""Run a function on every rank of one gloo process group, in spawned CPU processes: the tests of code that runs
collectives on sharded weights (LoRA and DoRA under tensor parallelism and FSDP) without GPUs."""

from __future__ import annotations

import multiprocessing
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch


def _rank_main(rank: int, world_size: int, port: int, timeout_s: float, task: Callable[..., Any], args: tuple,
               results) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)  # the ranks share the host's cores; one thread each keeps their sums in one order
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=timeout_s))
    try:
        results.put((rank, True, task(*args)))
    except Exception:  # noqa: BLE001 (raised again in the calling process)
        results.put((rank, False, traceback.format_exc()))
    finally:
        dist.destroy_process_group()
    from k6serve.process_exit import exit_without_teardown

    exit_without_teardown(0)  # the queue's feeder still flushes the result (an atexit finalizer)


def run_on_gloo_ranks(task: Callable[..., Any], *args: Any, world_size: int = 2, collective_timeout_s: float = 120.0,
                      wait_s: float = 180.0) -> list:
    """`task(*args)` on each of `world_size` ranks (`task` a module-level function: it is pickled by reference);
    the results in rank order. A rank that raised fails the call with its traceback; `collective_timeout_s` bounds a
    collective that a peer never joins (a mismatch then fails in seconds, not at `wait_s`)."""
    from k6serve.runtime.launch import find_free_port

    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    port = find_free_port()
    processes = [context.Process(target=_rank_main, daemon=True,
                                 args=(rank, world_size, port, collective_timeout_s, task, args, results))
                 for rank in range(world_size)]
    for process in processes:
        process.start()
    try:
        outcomes = sorted(results.get(timeout=wait_s) for _ in processes)
    finally:
        for process in processes:
            process.join(30)
    failures = [value for _, ok, value in outcomes if not ok]
    assert not failures, failures[0]
    return [value for _, _, value in outcomes]
