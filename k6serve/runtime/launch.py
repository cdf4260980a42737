"""Process launch and torch.distributed start-up: one process per GPU, or the ranks torchrun started.

Nothing is hard-coded: a single host's ranks rendezvous on a store the engine binds on a port the OS
picks; several hosts use `--dist-init-addr HOST:PORT` (node 0's address) with `--nnodes/--node-rank`;
under torchrun the RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT variables win. NCCL on
CUDA, gloo on CPU; every collective carries the configured timeout so a dead peer turns into an error
instead of a hang. When every rank runs on this host, the process groups listen on the loopback only
(`loopback_environment`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import multiprocessing
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Mapping
from datetime import timedelta
from multiprocessing.process import BaseProcess
from typing import TypedDict

import torch
import torch.distributed as dist

from k6serve.config import ParallelConfig

TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
LOCAL_HOST = "127.0.0.1"
logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class RankSpec:
    """Everything a process needs to join the job as one rank."""

    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int
    device_type: str  # "cuda" | "cpu"
    timeout_s: float
    from_torchrun: bool = False  # the launcher set the environment: rendezvous with init_method env://
    # The engine's process holds the rendezvous store's server on master_port (`rendezvous_store`): every rank,
    # rank 0 too, joins it as a client instead of rank 0 binding the port.
    store_from_engine: bool = False
    ranks_on_host: int = 1  # the ranks sharing this host's CPU cores
    # Every rank of the job runs on this host: its process groups stay on the loopback (`loopback_environment`).
    # False where that is not known (a launcher's environment without LOCAL_WORLD_SIZE): left as before.
    single_host: bool = False
    log_level: int = logging.INFO  # the starting process's (`parent_log_level`): --log-level debug reaches the ranks

    @property
    def backend(self) -> str:
        return "nccl" if self.device_type == "cuda" else "gloo"


def find_free_port(host: str = LOCAL_HOST) -> int:
    """A port the OS reports free right now (whoever uses it binds it moments later, so another process can take it
    in between: the engine's own ranks rendezvous on `rendezvous_store` instead)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((host, 0))
        return probe.getsockname()[1]


def rendezvous_store(timeout_s: float) -> dist.TCPStore:
    """The rendezvous store's server for one host's ranks, bound here on a port the OS picks (port 0).

    Before, the engine picked a free port and rank 0 bound it seconds later, after its interpreter had started and
    imported torch: a port taken in between by anything else on the host failed the whole start ("address already
    in use"). Bound by the engine, the port is never free between choosing and binding. The engine keeps the store
    while its ranks live (`MultiProcessWorker.close` drops it).

    On the loopback only: given a port, TCPStore listens on every interface, so the unauthenticated store, where any
    client may set keys the ranks read (a group's communicator ids), was open to the network for the engine's life
    (and on a Mac asked the firewall for it). The socket is bound here and handed over; a torch that cannot take it
    gets the port as before."""
    timeout = timedelta(seconds=timeout_s)
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        listener.bind((LOCAL_HOST, 0))
        listener.listen(128)
        store = dist.TCPStore(LOCAL_HOST, listener.getsockname()[1], is_master=True, wait_for_workers=False,
                              timeout=timeout, master_listen_fd=listener.fileno())
    except (TypeError, RuntimeError, ValueError) as exc:
        listener.close()
        logger.debug("TCPStore took no listening socket (%s); it binds its own port", exc)
        return dist.TCPStore(LOCAL_HOST, 0, is_master=True, wait_for_workers=False, timeout=timeout)
    listener.detach()  # the store's server owns the descriptor now (closing ours would close its socket)
    return store


def device_type_for(device: str) -> str:
    """The runtime's --device ("auto", "cuda", "cpu") as the device type every rank uses."""
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda was requested but no CUDA GPU is visible; use --device cpu.")
    return device


def warn_of_cpu_ranks(device: str, device_type: str, num_gpus: int) -> None:
    """Warn when --device auto found no GPU and --num-gpus N > 1 will start N CPU processes: on a host whose GPUs
    are not visible (no driver in the container, CUDA_VISIBLE_DEVICES="") they started without a word, a run
    hundreds of times slower that looked like a slow GPU."""
    if device == "auto" and device_type == "cpu" and num_gpus > 1:
        logger.warning("no CUDA GPU is visible: --num-gpus %d runs %d processes on this host's CPUs (gloo), sharing "
                       "its %d cores; pass --device cpu if that is what you want, or make the GPUs visible "
                       "(nvidia-smi; CUDA_VISIBLE_DEVICES)", num_gpus, num_gpus, os.cpu_count() or 1)


def parse_host_port(address: str) -> tuple[str, int]:
    host, separator, port = address.rpartition(":")
    if not separator or not host or not port.isdigit():
        raise ValueError(f"--dist-init-addr must be HOST:PORT (node 0's address), got {address!r}")
    return host, int(port)


def torchrun_rank(
    environ: Mapping[str, str], *, world_size: int, device_type: str, timeout_s: float
) -> RankSpec | None:
    """This process's rank when a launcher such as torchrun set the environment, else None."""
    present = [name for name in TORCHRUN_VARIABLES if name in environ]
    if not present:
        return None
    missing = [name for name in TORCHRUN_VARIABLES if name not in environ]
    if missing:
        raise ValueError(
            f"incomplete launcher environment: {present} are set but {missing} are not. Start with torchrun, "
            f"or unset {present} to let k6serve start its own processes."
        )
    if int(environ["WORLD_SIZE"]) != world_size:
        raise ValueError(
            f"the launcher started WORLD_SIZE={environ['WORLD_SIZE']} processes but the layout needs "
            f"--num-gpus {world_size}; make them equal (--num-gpus = torchrun's --nproc-per-node x --nnodes)."
        )
    return RankSpec(
        rank=int(environ["RANK"]), world_size=world_size, local_rank=int(environ["LOCAL_RANK"]),
        master_addr=environ["MASTER_ADDR"], master_port=int(environ["MASTER_PORT"]),
        device_type=device_type, timeout_s=timeout_s, from_torchrun=True,
        ranks_on_host=int(environ.get("LOCAL_WORLD_SIZE", "1")),
        # torchrun sets LOCAL_WORLD_SIZE; equal to the world, no rank runs elsewhere. Another launcher may not set it.
        single_host=environ.get("LOCAL_WORLD_SIZE", "").strip() == str(world_size),
    )


def parent_log_level() -> int:
    """The level a rank process logs at: this process's for k6serve, where its logging is configured (the CLI's
    --log-level; a host's root level, or its level for the "k6serve" logger: one set to ERROR still saw the
    ranks' warnings), else INFO, what the ranks always used (a Python API caller who configured nothing still sees
    their INFO lines, which its own unconfigured logging would hide)."""
    package = logging.getLogger("k6serve")
    if logging.getLogger().handlers or package.level != logging.NOTSET:
        return package.getEffectiveLevel()
    return logging.INFO


def local_rank_specs(
    parallel: ParallelConfig, device_type: str, *, store_port: int | None = None
) -> list[RankSpec]:
    """The ranks this host starts: all of them on one host, its slice of the world with --nnodes > 1.

    `store_port`: on one host without --dist-init-addr, the port of the engine's `rendezvous_store`, which the
    ranks join as clients; without it a free port is picked for rank 0 to bind."""
    if parallel.num_gpus % parallel.nnodes:
        raise ValueError(
            f"--num-gpus {parallel.num_gpus} must be a multiple of --nnodes {parallel.nnodes} (every host "
            f"runs the same number of GPUs)."
        )
    if not 0 <= parallel.node_rank < parallel.nnodes:
        raise ValueError(f"--node-rank must be in [0, {parallel.nnodes - 1}], got {parallel.node_rank}")
    per_node = parallel.num_gpus // parallel.nnodes
    store_from_engine = False
    if parallel.dist_init_addr is not None:
        master_addr, master_port = parse_host_port(parallel.dist_init_addr)
    elif parallel.nnodes > 1:
        raise ValueError("--nnodes > 1 needs --dist-init-addr HOST:PORT (node 0's address, same on every host).")
    elif store_port is not None:
        master_addr, master_port, store_from_engine = LOCAL_HOST, store_port, True
    else:
        master_addr, master_port = LOCAL_HOST, find_free_port()
    if device_type == "cuda" and torch.cuda.device_count() < per_node:
        raise ValueError(
            f"{per_node} GPU processes per host were asked for but {torch.cuda.device_count()} GPU(s) are "
            f"visible; lower --num-gpus or use --device cpu."
        )
    first = parallel.node_rank * per_node
    return [
        RankSpec(
            rank=first + local, world_size=parallel.num_gpus, local_rank=local, master_addr=master_addr,
            master_port=master_port, device_type=device_type, timeout_s=parallel.dist_timeout_s,
            ranks_on_host=per_node, store_from_engine=store_from_engine, log_level=parent_log_level(),
            single_host=parallel.nnodes == 1,
        )
        for local in range(per_node)
    ]


# The loopback interface's name: Linux's, then macOS's and the BSDs'. Their kernels fix these names, which gloo and
# NCCL take, where finding the interface by its address would need each platform's ioctl.
LOOPBACK_INTERFACES = ("lo", "lo0")


def loopback_interface() -> str | None:
    """This host's loopback interface, None where it is named otherwise (Windows) or no interfaces are listed."""
    try:
        names = {name for _, name in socket.if_nameindex()}
    except (AttributeError, OSError):
        return None
    return next((name for name in LOOPBACK_INTERFACES if name in names), None)


def loopback_environment(spec: RankSpec, environ: Mapping[str, str], interface: str | None) -> dict[str, str]:
    """The variables to set before this rank joins, so that a single host's process groups listen on the loopback.

    Each gloo group listens for its peers on the address this host's name resolves to (the host's network address
    where DNS or /etc/hosts gives one), and NCCL's bootstrap and proxy on the interface NCCL picks, the network's
    before the loopback: for a job whose ranks all run here, ports open to the network (and a firewall's prompt on a
    Mac). Both read the interface from the environment: GLOO_SOCKET_IFNAME, NCCL_SOCKET_IFNAME ("=" for that name
    exactly, not every name it begins). The environment, not a gloo device passed as `pg_options`: torch 2.13's
    `init_process_group` and `new_group` build a gloo group without reading its options, while GLOO_SOCKET_IFNAME is
    read by every torch, each time a gloo group is made, so `build_groups`'s groups (an NCCL run's gloo control groups
    too) follow it. A value the user set is kept (an interface chosen on purpose). Ranks on several hosts must reach
    each other: their environment is left as it was."""
    if not spec.single_host or interface is None:
        return {}
    wanted = {"GLOO_SOCKET_IFNAME": interface}
    if spec.backend == "nccl":
        wanted["NCCL_SOCKET_IFNAME"] = f"={interface}"
    return {name: value for name, value in wanted.items() if name not in environ}


class _Rendezvous(TypedDict, total=False):
    """How `init_process_group` finds the other ranks: one of the two."""

    store: dist.Store
    init_method: str


def init_distributed(spec: RankSpec) -> torch.device:
    """Join the process group (with the collective timeout) and return this rank's device."""
    if spec.device_type == "cuda":
        torch.cuda.set_device(spec.local_rank)
        device = torch.device("cuda", spec.local_rank)
    else:
        device = torch.device("cpu")
        share_cpu_cores(spec.ranks_on_host)
    timeout = timedelta(seconds=spec.timeout_s)
    # Set in this rank's own process before its first group: the engine's ranks are processes of their own, so the
    # engine's environment stays as it was (under torchrun rank 0 runs in the engine's process, which is the rank's).
    loopback = loopback_environment(spec, os.environ, loopback_interface())
    if loopback:
        logger.debug("process groups on the loopback: %s", loopback)
        os.environ.update(loopback)
    rendezvous: _Rendezvous
    if spec.store_from_engine:
        rendezvous = {"store": dist.TCPStore(spec.master_addr, spec.master_port, is_master=False, timeout=timeout)}
    else:
        rendezvous = {"init_method": "env://" if spec.from_torchrun else f"tcp://{spec.master_addr}:{spec.master_port}"}
    # No bound device (`device_id`), on any number of ranks: a bound device makes NCCL create every group's
    # communicator at once, and each holds device memory that no release can free (a one-GPU worker held 3.5 GB after
    # releasing its weights where the same steps without a process group held 0.7 GB; one communicator on one rank
    # took about 650 MiB: scripts/gpu_context.py). Unbound, NCCL creates a group's communicator at its first
    # collective, so the groups of size 1 (e.g. cfg, tp and ring under Ulysses2), which never run one, cost nothing.
    # The device is already current (set_device above), which is where those communicators are then created.
    dist.init_process_group(
        spec.backend, **rendezvous, rank=spec.rank, world_size=spec.world_size, timeout=timeout
    )
    return device


def share_cpu_cores(ranks_on_host: int) -> int:
    """CPU ranks split the host's cores instead of each starting one intra-op thread per core; returns the count.

    Every rank computes at the same time, so with a thread per core each the OpenMP workers spin against each other:
    on a 2-core machine a two-rank CPU run's wall time varied 2.5x from run to run, and its CPU time doubled. torchrun
    sets OMP_NUM_THREADS=1 for the same reason; an OMP_NUM_THREADS the user set wins here too."""
    if os.environ.get("OMP_NUM_THREADS") or ranks_on_host <= 1:
        return torch.get_num_threads()  # one rank keeps torch's own choice (physical cores), so its numbers too
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    threads = max(1, min(torch.get_num_threads(), cores // ranks_on_host))
    torch.set_num_threads(threads)
    return threads


# The signals a rank the engine started leaves to the engine (ignored there, blocked while it starts): a terminal's
# Ctrl-C and closing (SIGHUP) reach the whole process group, and so does `timeout`'s SIGTERM.
ENGINE_HANDLED_SIGNALS = (signal.SIGINT, signal.SIGTERM, *((signal.SIGHUP,) if hasattr(signal, "SIGHUP") else ()))


def start_process(target: Callable[..., None], args: tuple, *, name: str, block_sigint: bool = False) -> BaseProcess:
    """Start `target(*args)` in a fresh interpreter (spawn: CUDA cannot be forked).

    `block_sigint`: the child starts with SIGINT (and SIGTERM, SIGHUP: `ENGINE_HANDLED_SIGNALS`) blocked, for ranks
    whose Ctrl-C is the engine's to handle. A
    terminal's Ctrl-C reaches the whole process group, and a target that ignores SIGINT only does so once its
    interpreter has booted and imported torch (seconds): a Ctrl-C while the ranks started printed a
    KeyboardInterrupt traceback from each. The signal mask survives fork and exec, so the child never sees one.
    """
    process = multiprocessing.get_context("spawn").Process(target=target, args=args, name=name, daemon=True)
    try:
        with _START_LOCK, _main_module_hidden(), _start_method_kept(), (
                _sigint_blocked() if block_sigint else contextlib.nullcontext()):
            process.start()
    except BaseException:
        # A Ctrl-C held back while the child started arrives as the mask is restored, before the caller could keep
        # the process to stop it: stop it here (SIGTERM; SIGINT is blocked there).
        if process.pid is not None:
            stop_processes([process], grace_s=0.0, terminate=not block_sigint)
        raise
    return process


@contextlib.contextmanager
def _sigint_blocked():
    """SIGINT, SIGTERM and SIGHUP blocked for this thread while the block runs; one that arrived meanwhile is
    delivered at its end (a Ctrl-C in the window is not lost: the caller sees its KeyboardInterrupt right after)."""
    if not hasattr(signal, "pthread_sigmask"):  # not on Windows, where spawn does not share the console's signal
        yield
        return
    # spawn starts multiprocessing's resource tracker with the first process, and that start unblocks SIGINT in
    # this thread (it blocks and then unblocks, not restores): started first, the child's start keeps the mask.
    # The tracker ignores SIGINT and SIGTERM but not SIGHUP: a closed terminal's SIGHUP killed it, and the one
    # started again in its place printed a KeyError traceback for each name it had never been told of. It starts
    # with SIGHUP blocked, which it keeps.
    from multiprocessing import resource_tracker

    before = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGHUP})
    try:
        resource_tracker.ensure_running()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, before)
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, set(ENGINE_HANDLED_SIGNALS))
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


# One start at a time: `_main_module_hidden` edits the process-wide `__main__`, and two generators loading at once
# from two threads could restore its names out of order.
_START_LOCK = threading.Lock()


@contextlib.contextmanager
def _start_method_kept():
    """Leave the host's default multiprocessing start method unset if it was: CPython's spawn preparation asks for
    it, which fixes it for the process ('fork' on Linux), and a host's later set_start_method("spawn") then raised
    "context has already been set"."""
    before = multiprocessing.get_start_method(allow_none=True)
    try:
        yield
    finally:
        if before is None and multiprocessing.get_start_method(allow_none=True) is not None:
            multiprocessing.set_start_method(None, force=True)


@contextlib.contextmanager
def _main_module_hidden():
    """Keep spawned ranks from re-running the caller's script.

    spawn normally re-imports the parent's `__main__` (by path or module name) in every child, which runs a
    script's top-level code again: the seed documents' `DiffGenerator` example has no `if __name__ ==
    "__main__"` guard and would start workers recursively. Our rank targets live in k6serve modules, so the
    children never need the caller's `__main__`; hiding it while `start()` snapshots the preparation data
    (synchronously) makes them skip it.
    """
    main = sys.modules.get("__main__")
    if main is None:  # an embedding interpreter may have none: nothing to hide
        yield
        return
    saved = {key: getattr(main, key) for key in ("__file__", "__spec__") if hasattr(main, key)}
    try:
        for key in saved:
            if key == "__spec__":
                main.__spec__ = None
            else:
                delattr(main, key)
        yield
    finally:
        for key, value in saved.items():
            setattr(main, key, value)


def stop_processes(processes: list[BaseProcess], *, grace_s: float = 5.0, terminate: bool = True) -> None:
    """Wait up to `grace_s` for processes to exit, then terminate (SIGTERM; `terminate=False` for the engine's ranks,
    which ignore it) and wait up to `grace_s` again, then kill what is left. One grace for all of them, not one each:
    joined in turn, eight hung ranks (a Ctrl-C while they load: no connection tells them to stop) took eight."""
    _join_within(processes, grace_s)
    if terminate:
        for process in processes:
            if process.is_alive():
                process.terminate()
        _join_within(processes, grace_s)
    for process in processes:
        if process.is_alive():
            process.kill()
            process.join()


def _join_within(processes: list[BaseProcess], seconds: float) -> None:
    deadline = time.monotonic() + seconds
    for process in processes:
        process.join(max(0.0, deadline - time.monotonic()))
