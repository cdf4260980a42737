"""The multi-process runtime on CPU (gloo), driven through the real `Engine`, with a fake per-rank worker.

The fake worker does real collectives (an all-reduce per step over the replica), so a wrong rank layout, a
missing broadcast or a rank that runs a different request shows up in the returned value.
"""

from __future__ import annotations

import dataclasses
import importlib
import multiprocessing
import ipaddress
import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from k6serve.config import EngineConfig, ModelConfig, ParallelConfig, RuntimeConfig
from k6serve.media.output_names import partial_file_path
from k6serve.models.variants import VARIANTS
from k6serve.request import OutputOptions, SamplingParams, VideoResult
from k6serve.request_resolution import resolve_generate
from k6serve.runtime.engine import Engine, RequestCancelled
from k6serve.runtime.launch import find_free_port, local_rank_specs, torchrun_rank
from k6serve.runtime.process_group_worker import MultiProcessWorker
from k6serve.runtime.rank_process import RankContext

pytestmark = pytest.mark.multiprocess
TIMEOUT_S = 20.0  # the tests' own waits, once the ranks are up
# The ranks' start-up budget (and gloo's timeout): a start spawns interpreters that import torch, two at once on
# CI's two busy cores, so 20 s left only about 2x margin.
DIST_TIMEOUT_S = 60.0


class FakeRankWorker:
    """Per-rank stand-in for ModelWorker: one all-reduce per step; the prompt picks test behaviours."""

    def __init__(self, config: EngineConfig, context: RankContext):
        self.variant = VARIANTS["pro"]
        self.context = context

    def run(self, params: SamplingParams, output: OutputOptions, on_step=None) -> VideoResult:
        request, _ = resolve_generate(params, self.variant)
        prompt, rank = request.prompt, self.context.spec.rank
        if prompt.startswith("touch:"):
            Path(prompt.removeprefix("touch:")).touch()
        if prompt.startswith("wait-for:"):
            path = Path(prompt.removeprefix("wait-for:"))
            deadline = time.monotonic() + TIMEOUT_S
            while not path.exists():
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{path} never appeared: the other replica did not run concurrently")
                time.sleep(0.02)
        if prompt == "lack-a-package":
            importlib.import_module("av_not_installed")  # a package this worker's interpreter lacks
        if prompt == "bad-value":
            raise ValueError("the fake worker rejects this prompt")
        if prompt == "write-partial" and output.save_output:  # as the MP4 writer begins: its hidden partial file
            partial_file_path(Path(output.output_path) / "clip.mp4").write_bytes(b"half a video")
        total = 0.0
        for step in range(request.num_inference_steps):
            value = torch.tensor([float(request.seed + step + rank)])
            dist.all_reduce(value, group=self.context.groups.replica_group)
            total += value.item()
            if prompt == "slow":
                time.sleep(0.2)
            if on_step is not None:
                on_step(step + 1, request.num_inference_steps)
        return VideoResult(
            output_file_path=None, frames=None, audio=None, audio_sample_rate=44100, fps=request.fps,
            seed=request.seed, timings={"total": 0.0}, peak_memory_mb=0.0, num_frames=request.num_frames,
            height=request.height, width=request.width,
            notes=[f"replica={self.context.groups.replica}", f"value={total}", f"leader_output={output}",
                   f"gloo_interface={os.environ.get('GLOO_SOCKET_IFNAME')}"],
        )


class PackageLessRankWorker(FakeRankWorker):
    """A rank whose model needs a package its interpreter lacks, found while it loads."""

    def __init__(self, config: EngineConfig, context: RankContext):
        importlib.import_module("av_not_installed")


def make_config(**parallel) -> EngineConfig:
    return EngineConfig(
        model=ModelConfig(model_path="fake-k6", load_format="dummy"),
        parallel=ParallelConfig(dist_timeout_s=DIST_TIMEOUT_S, **parallel),
        runtime=RuntimeConfig(device="cpu"),
    )


def expected_value(seed: int, steps: int, ranks: list[int]) -> float:
    return sum(len(ranks) * (seed + step) + sum(ranks) for step in range(steps))


def note(result: VideoResult, key: str) -> str:
    return next(n.split("=", 1)[1] for n in result.notes if n.startswith(key + "="))


@pytest.fixture(scope="module")
def engine_two_ranks():
    worker = MultiProcessWorker(make_config(num_gpus=2, ulysses_degree=2), build_rank_worker=FakeRankWorker)
    engine = Engine(worker.config, worker=worker)
    yield engine, worker
    engine.shutdown()
    worker.close()


def test_gpus_asked_for_without_a_visible_gpu_are_warned_of(caplog):
    from k6serve.runtime.launch import warn_of_cpu_ranks

    with caplog.at_level("WARNING", logger="k6serve.runtime.launch"):
        warn_of_cpu_ranks("auto", "cpu", 4)
        warn_of_cpu_ranks("cpu", "cpu", 4)  # --device cpu: asked for
        warn_of_cpu_ranks("auto", "cpu", 1)  # one process: as without --num-gpus
        warn_of_cpu_ranks("auto", "cuda", 4)
    assert [record.getMessage().split(" (gloo)")[0] for record in caplog.records] == [
        "no CUDA GPU is visible: --num-gpus 4 runs 4 processes on this host's CPUs"]
    assert "pass --device cpu if that is what you want" in caplog.records[0].getMessage()


@pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="reads Linux's table of listening sockets")
def test_the_rendezvous_store_listens_on_the_loopback_only():
    """Given a port, TCPStore listened on every interface: the unauthenticated store, whose keys the ranks read, was
    open to the network for the engine's life."""
    from k6serve.runtime.launch import rendezvous_store

    from datetime import timedelta

    store = rendezvous_store(10.0)
    tables = [Path("/proc/net/tcp"), Path("/proc/net/tcp6")]
    listening = {line.split()[1] for table in tables if table.exists()
                 for line in table.read_text().splitlines()[1:] if line.split()[3] == "0A"}  # LISTEN, hex IP:PORT
    ours = {address for address in listening if address.endswith(f":{store.port:04X}")}
    assert ours == {f"0100007F:{store.port:04X}"}  # not 0.0.0.0, nor IPv6's [::] (every interface, both families)
    client = dist.TCPStore("127.0.0.1", store.port, is_master=False, timeout=timedelta(seconds=10))
    client.set("key", "value")
    assert store.get("key") == b"value"


LOOPBACK_VARIABLES = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")


def unset_for_the_test(monkeypatch, *names: str) -> None:
    """Unset `names` until the test ends, and unset them again then if code under test set them (a bare
    `delenv` of an unset variable records nothing to undo)."""
    for name in names:
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)


def test_only_a_single_hosts_process_groups_are_kept_on_the_loopback():
    """gloo's groups listened on the address the host's name resolves to, NCCL's bootstrap on the interface it
    picks: ports on the network for ranks that all run on one host. Such ranks are told the loopback interface;
    a variable the user set stays, and ranks on several hosts keep what they had."""
    from k6serve.runtime import launch

    single = local_rank_specs(ParallelConfig(num_gpus=2, ulysses_degree=2), "cpu")[0]
    assert single.single_host
    assert launch.loopback_environment(single, {}, "lo") == {"GLOO_SOCKET_IFNAME": "lo"}  # CPU: no NCCL to set
    gpu = dataclasses.replace(single, device_type="cuda")
    assert launch.loopback_environment(gpu, {}, "lo0") == {"GLOO_SOCKET_IFNAME": "lo0", "NCCL_SOCKET_IFNAME": "=lo0"}
    assert launch.loopback_environment(gpu, {"NCCL_SOCKET_IFNAME": "eth0"}, "lo") == {"GLOO_SOCKET_IFNAME": "lo"}
    assert launch.loopback_environment(gpu, {"GLOO_SOCKET_IFNAME": ""}, "lo") == {"NCCL_SOCKET_IFNAME": "=lo"}
    assert launch.loopback_environment(gpu, {}, None) == {}  # no loopback interface found: as before
    one_rank = local_rank_specs(ParallelConfig(num_gpus=1), "cpu")[0]
    assert launch.loopback_environment(one_rank, {}, "lo") == {"GLOO_SOCKET_IFNAME": "lo"}

    two_hosts = ParallelConfig(num_gpus=4, ulysses_degree=4, nnodes=2, dist_init_addr="127.0.0.1:29600")
    for node_rank in (0, 1):
        for spec in local_rank_specs(dataclasses.replace(two_hosts, node_rank=node_rank), "cpu"):
            assert not spec.single_host
            assert launch.loopback_environment(dataclasses.replace(spec, device_type="cuda"), {}, "lo") == {}

    environ = {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "h", "MASTER_PORT": "1"}

    def torchrun(**extra):
        return torchrun_rank({**environ, **extra}, world_size=2, device_type="cuda", timeout_s=5)
    assert torchrun(LOCAL_WORLD_SIZE="2").single_host  # torchrun --nnodes 1
    assert not torchrun(LOCAL_WORLD_SIZE="1").single_host  # one rank here, the other elsewhere
    assert not torchrun().single_host  # a launcher that does not say: left as it was
    assert launch.loopback_environment(torchrun(), {}, "lo") == {}

    if sys.platform.startswith("linux"):
        assert launch.loopback_interface() == "lo"


def test_a_rank_sets_the_loopback_before_it_joins_and_keeps_the_users_choice(monkeypatch):
    from k6serve.runtime import launch

    unset_for_the_test(monkeypatch, "GLOO_SOCKET_IFNAME")
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", "ib0")
    monkeypatch.setattr(launch, "loopback_interface", lambda: "lo")
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    seen = {}
    monkeypatch.setattr(dist, "init_process_group", lambda backend, **kwargs: seen.update(os.environ))
    spec = dataclasses.replace(local_rank_specs(ParallelConfig(num_gpus=2, ulysses_degree=2), "cpu")[1],
                               device_type="cuda")
    launch.init_distributed(spec)
    assert (seen["GLOO_SOCKET_IFNAME"], seen["NCCL_SOCKET_IFNAME"]) == ("lo", "ib0")


def listening_addresses(pid: int) -> set[ipaddress.IPv4Address | ipaddress.IPv6Address]:
    """The addresses process `pid`'s TCP sockets listen on: its descriptors' socket inodes looked up in its network
    namespace's tables (Linux's /proc; the hex addresses are in the host's byte order, 4-byte words for IPv6)."""
    inodes = set()
    for descriptor in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(descriptor)
        except OSError:  # closed since it was listed
            continue
        if target.startswith("socket:["):
            inodes.add(target.removeprefix("socket:[").removesuffix("]"))
    addresses = set()
    for table in ("tcp", "tcp6"):
        path = Path(f"/proc/{pid}/net/{table}")
        if not path.exists():  # no IPv6 in this kernel
            continue
        for line in path.read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] != "0A" or fields[9] not in inodes:  # 0A: LISTEN
                continue
            raw = bytes.fromhex(fields[1].split(":")[0])
            host_order = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
            addresses.add(ipaddress.ip_address(host_order))
    return addresses


def is_loopback(address: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    mapped = getattr(address, "ipv4_mapped", None)  # ::ffff:127.0.0.1, an IPv4 socket in the IPv6 table
    return address.is_loopback or (mapped is not None and mapped.is_loopback)


def ranks_listening(monkeypatch, gloo_interface: str | None) -> tuple[dict, str]:
    """A two-rank engine's ranks, started as the engine starts them, once their groups have run a request: the
    addresses each listens on, and the interface their gloo groups were told. `gloo_interface`: the user's."""
    unset_for_the_test(monkeypatch, *LOOPBACK_VARIABLES)  # the ranks inherit this process's environment
    if gloo_interface is not None:
        monkeypatch.setenv("GLOO_SOCKET_IFNAME", gloo_interface)
    worker = MultiProcessWorker(make_config(num_gpus=2, ulysses_degree=2), build_rank_worker=FakeRankWorker)
    try:
        result = worker.run(SamplingParams(prompt="cat", seed=2, num_inference_steps=2),
                            OutputOptions(save_output=False))
        assert float(note(result, "value")) == expected_value(2, 2, [0, 1])
        listening = {rank: listening_addresses(pid) for rank, pid in worker.pids.items()}
    finally:
        worker.close()
    return listening, note(result, "gloo_interface")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads the ranks' sockets from Linux's /proc")
def test_a_single_hosts_ranks_listen_on_the_loopback_only(monkeypatch):
    """On a host whose name resolves to its network address, each gloo group listened there for its peers (every
    rank, for the engine's life). Where the name resolves to the loopback, as on many containers, gloo listened on
    it already: the interface the ranks were told shows that the loopback is chosen, not left to the host's name."""
    listening, interface = ranks_listening(monkeypatch, None)
    assert interface == "lo"
    assert all(listening.values()), f"no listening socket found for a rank: the check would pass vacuously {listening}"
    assert all(is_loopback(address) for addresses in listening.values() for address in addresses), listening


def network_interface() -> tuple[str, ipaddress.IPv4Address] | None:
    """An interface that is up with an IPv4 address off the loopback, and that address (Linux's ioctls)."""
    import fcntl
    import struct

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        for _, name in socket.if_nameindex():
            request = struct.pack("256s", name.encode()[:15])
            try:
                flags = struct.unpack_from("H", fcntl.ioctl(probe, 0x8913, request), 16)[0]  # SIOCGIFFLAGS
                address = ipaddress.IPv4Address(fcntl.ioctl(probe, 0x8915, request)[20:24])  # SIOCGIFADDR
            except OSError:  # no IPv4 address
                continue
            if flags & 1 and not address.is_loopback:  # IFF_UP
                return name, address
    return None


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads the ranks' sockets from Linux's /proc")
def test_the_users_gloo_interface_is_kept(monkeypatch):
    """A GLOO_SOCKET_IFNAME the user set is the one the ranks use; and the listening sockets read above are the
    gloo groups' (told a network interface, the ranks listen on its address: a leak would have been seen)."""
    found = network_interface()
    if found is None:
        pytest.skip("no interface up with an IPv4 address besides the loopback")
    name, address = found
    listening, interface = ranks_listening(monkeypatch, name)
    assert interface == name
    assert all(address in addresses for addresses in listening.values()), (address, listening)


def test_torchrun_environment_is_parsed():
    environ = {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29511"}
    spec = torchrun_rank(environ, world_size=4, device_type="cpu", timeout_s=5)
    assert (spec.rank, spec.local_rank, spec.master_addr, spec.master_port) == (3, 1, "10.0.0.1", 29511)
    assert spec.from_torchrun and spec.backend == "gloo"
    assert torchrun_rank({}, world_size=4, device_type="cpu", timeout_s=5) is None
    with pytest.raises(ValueError, match="WORLD_SIZE=4 .* --num-gpus 2"):
        torchrun_rank(environ, world_size=2, device_type="cpu", timeout_s=5)
    with pytest.raises(ValueError, match="MASTER_PORT"):
        torchrun_rank({k: v for k, v in environ.items() if k != "MASTER_PORT"}, world_size=4,
                      device_type="cpu", timeout_s=5)


@pytest.mark.parametrize("world_size", [1, 2])
def test_nccl_never_binds_the_device(monkeypatch, world_size):
    """A bound device makes NCCL create every group's communicator at once (about 650 MiB each on an H200, 2.9 GB
    for a one-GPU worker's groups, which never run a collective): ranks join unbound, so a communicator exists only
    for a group that runs a collective, on the device set before joining."""
    from k6serve.runtime import launch

    joined, devices = {}, []
    monkeypatch.setattr(torch.cuda, "set_device", devices.append)
    monkeypatch.setattr(dist, "init_process_group", lambda backend, **kwargs: joined.update(kwargs, backend=backend))
    spec = launch.RankSpec(rank=world_size - 1, world_size=world_size, local_rank=world_size - 1,
                           master_addr="127.0.0.1", master_port=1, device_type="cuda", timeout_s=5)
    assert launch.init_distributed(spec) == torch.device("cuda", world_size - 1)
    assert devices == [world_size - 1]
    assert joined["backend"] == "nccl" and joined["world_size"] == world_size
    assert joined.get("device_id") is None


def test_cpu_ranks_split_the_hosts_cores(monkeypatch):
    """Ranks computing at once with a thread per core each spin against each other (a two-rank CPU run varied 2.5x in
    wall time): CPU ranks take cores / ranks-on-host threads, unless OMP_NUM_THREADS says otherwise."""
    from k6serve.runtime import launch

    threads = []
    monkeypatch.setattr(torch, "set_num_threads", threads.append)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 4)  # torch's choice: the physical cores of 8 logical ones
    monkeypatch.setattr(launch.os, "sched_getaffinity", lambda pid: set(range(8)), raising=False)
    monkeypatch.setattr(dist, "init_process_group", lambda backend, **kwargs: None)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    unset_for_the_test(monkeypatch, *LOOPBACK_VARIABLES)  # init_distributed sets them in this process
    specs = local_rank_specs(ParallelConfig(num_gpus=4, ulysses_degree=2, dp_size=2), "cpu")
    assert [spec.ranks_on_host for spec in specs] == [4] * 4
    assert launch.init_distributed(specs[1]) == torch.device("cpu") and threads == [2]
    assert launch.share_cpu_cores(3) == 2 and launch.share_cpu_cores(16) == 1 and threads == [2, 2, 1]
    assert launch.share_cpu_cores(2) == 4 and threads[-1] == 4  # never more than torch would start
    assert launch.share_cpu_cores(1) == 4 and len(threads) == 4  # one rank keeps torch's choice
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    launch.share_cpu_cores(4)
    assert len(threads) == 4  # the user's setting stands
    environ = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "h",
               "MASTER_PORT": "1"}
    assert torchrun_rank(environ, world_size=2, device_type="cpu", timeout_s=5).ranks_on_host == 2


def test_multi_node_rank_specs():
    parallel = ParallelConfig(num_gpus=4, ulysses_degree=4, nnodes=2, node_rank=1, dist_init_addr="node0:29600")
    specs = local_rank_specs(parallel, "cpu")
    assert [(s.rank, s.local_rank, s.master_addr, s.master_port) for s in specs] == [
        (2, 0, "node0", 29600), (3, 1, "node0", 29600)
    ]
    with pytest.raises(ValueError, match="--dist-init-addr"):
        local_rank_specs(ParallelConfig(num_gpus=2, ulysses_degree=2, nnodes=2), "cpu")
    with pytest.raises(ValueError, match="multiple of --nnodes"):
        local_rank_specs(ParallelConfig(num_gpus=3, ulysses_degree=3, nnodes=2, dist_init_addr="h:1"), "cpu")
    single = local_rank_specs(ParallelConfig(num_gpus=2, ulysses_degree=2), "cpu")
    assert single[0].master_addr == "127.0.0.1" and single[0].master_port > 0


def test_engine_held_store_port_goes_to_every_local_rank():
    """On one host the engine binds the rendezvous port itself and hands it to the ranks, which join as clients; a
    given --dist-init-addr is the user's port and stays rank 0's to bind."""
    specs = local_rank_specs(ParallelConfig(num_gpus=2, ulysses_degree=2), "cpu", store_port=4321)
    assert [(s.master_addr, s.master_port, s.store_from_engine) for s in specs] == [("127.0.0.1", 4321, True)] * 2
    given = local_rank_specs(ParallelConfig(num_gpus=2, ulysses_degree=2, dist_init_addr="127.0.0.1:29700"), "cpu",
                             store_port=4321)
    assert [(s.master_port, s.store_from_engine) for s in given] == [(29700, False)] * 2
    assert not any(s.store_from_engine for s in local_rank_specs(ParallelConfig(num_gpus=2, ulysses_degree=2), "cpu"))


def test_a_rank_joins_the_engines_store_as_a_client(monkeypatch):
    from datetime import timedelta

    from k6serve.runtime import launch

    joined = {}
    monkeypatch.setattr(dist, "init_process_group", lambda backend, **kwargs: joined.update(kwargs))
    server = launch.rendezvous_store(timeout_s=5)
    assert server.port > 0
    spec = launch.RankSpec(rank=0, world_size=2, local_rank=0, master_addr="127.0.0.1", master_port=server.port,
                           device_type="cpu", timeout_s=5, store_from_engine=True)
    launch.init_distributed(spec)
    assert "init_method" not in joined and joined["timeout"] == timedelta(seconds=5)
    joined["store"].set("k6serve-test", "seen")  # the rank's client reaches the engine's server
    assert server.get("k6serve-test") == b"seen"


def test_ranks_start_when_the_port_a_probe_found_free_is_taken(monkeypatch):
    """The engine used to pick a free port and rank 0 bound it seconds later, once its interpreter had imported
    torch: a port taken in between failed the start. Here every "free" port the probe reports is already taken;
    the ranks rendezvous on the engine's own store and start anyway."""
    import socket

    from k6serve.runtime import launch

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        monkeypatch.setattr(launch, "find_free_port", lambda host="127.0.0.1": taken.getsockname()[1])
        worker = MultiProcessWorker(make_config(num_gpus=2, ulysses_degree=2), build_rank_worker=FakeRankWorker)
        try:
            result = worker.run(SamplingParams(prompt="cat", seed=2, num_inference_steps=2),
                                OutputOptions(save_output=False))
            assert float(note(result, "value")) == expected_value(2, 2, [0, 1])
            assert worker._store is not None and worker._store.port != taken.getsockname()[1]
        finally:
            worker.close()
    assert worker._store is None


def test_two_ranks_run_the_same_request(engine_two_ranks):
    engine, worker = engine_two_ranks
    assert engine.variant.name == "pro"
    progress = []
    output = OutputOptions(save_output=False)
    result = engine.generate(SamplingParams(prompt="cat", seed=7, num_inference_steps=3), output,
                             on_progress=lambda step, total: progress.append((step, total)))
    assert float(note(result, "value")) == expected_value(7, 3, [0, 1])
    assert progress == [(1, 3), (2, 3), (3, 3)]
    assert note(result, "leader_output") == repr(output)  # the leader ran with the caller's output options
    assert sorted(worker.pids) == [0, 1] and len(set(worker.pids.values())) == 2


def test_user_error_and_cancellation_keep_the_replica_serving(engine_two_ranks):
    engine, _ = engine_two_ranks
    with pytest.raises(ValueError, match="rejects this prompt"):
        engine.generate(SamplingParams(prompt="bad-value", num_inference_steps=2))
    job = engine.submit(SamplingParams(prompt="cat", num_inference_steps=5),
                        on_progress=lambda step, total: job.cancel() if step == 2 else None)
    with pytest.raises(RequestCancelled):
        job.future.result(timeout=TIMEOUT_S)
    result = engine.generate(SamplingParams(prompt="cat", seed=1, num_inference_steps=2))
    assert float(note(result, "value")) == expected_value(1, 2, [0, 1])


def test_one_rank_serves_through_the_same_runtime():
    worker = MultiProcessWorker(make_config(num_gpus=1), build_rank_worker=FakeRankWorker)
    engine = Engine(worker.config, worker=worker)
    try:
        result = engine.generate(SamplingParams(prompt="cat", seed=3, num_inference_steps=2))
        assert float(note(result, "value")) == expected_value(3, 2, [0])
    finally:
        engine.shutdown()
        worker.close()
    assert all(p.exitcode == 0 for p in worker._processes.values())


def test_dp2_serves_two_requests_at_once(tmp_path: Path):
    worker = MultiProcessWorker(make_config(num_gpus=2, dp_size=2), build_rank_worker=FakeRankWorker)
    try:
        marker = tmp_path / "second-started"
        results: dict[str, VideoResult] = {}

        def run(name: str, prompt: str) -> None:
            results[name] = worker.run(SamplingParams(prompt=prompt, seed=5, num_inference_steps=2),
                                       OutputOptions(save_output=False))

        # The first request waits until the second one has started: it only finishes if both run at once.
        first = threading.Thread(target=run, args=("first", f"wait-for:{marker}"))
        first.start()
        run("second", f"touch:{marker}")
        first.join(TIMEOUT_S + 5)
        assert {note(r, "replica") for r in results.values()} == {"0", "1"}
        for result in results.values():
            ranks = [int(note(result, "replica"))]  # each replica has one rank, whose rank is its index
            assert float(note(result, "value")) == expected_value(5, 2, ranks)
    finally:
        worker.close()


def test_a_rank_killed_mid_write_has_its_partial_video_removed(tmp_path: Path):
    """The CLI and the API left the hidden `.part` file of a rank killed while it wrote the MP4 (the out-of-memory
    killer) in the user's output folder, one per kill; another process's partial file there is left alone."""
    worker = MultiProcessWorker(make_config(num_gpus=1), build_rank_worker=FakeRankWorker)
    victim = worker.pids[0]
    others = tmp_path / f".other.mp4.{(victim + 1) & 0xFFFFFF:06x}abcdef.part"
    others.write_bytes(b"another writer's")

    def kill_at_step_one(step: int, total: int) -> None:
        if step == 1:
            os.kill(victim, signal.SIGKILL)

    try:
        with pytest.raises(RuntimeError, match=r"died"):
            worker.run(SamplingParams(prompt="write-partial", num_inference_steps=20),
                       OutputOptions(save_output=True, output_path=str(tmp_path)), on_step=kill_at_step_one)
    finally:
        worker.close(timeout_s=5)
    assert sorted(p.name for p in tmp_path.iterdir()) == [others.name]


def test_killed_rank_fails_the_request_and_engine_shuts_down():
    worker = MultiProcessWorker(make_config(num_gpus=2, ulysses_degree=2), build_rank_worker=FakeRankWorker)
    engine = Engine(worker.config, worker=worker)
    victim = worker.pids[1]

    def kill_at_step_one(step: int, total: int) -> None:
        if step == 1:
            os.kill(victim, signal.SIGKILL)

    try:
        start = time.monotonic()
        job = engine.submit(SamplingParams(prompt="slow", num_inference_steps=20), on_progress=kill_at_step_one)
        with pytest.raises(RuntimeError, match=r"replica 0 .* died .*rank 1 .*exited with code -9"):
            job.future.result(timeout=TIMEOUT_S + 10)
        assert time.monotonic() - start < TIMEOUT_S + 10
        with pytest.raises(RuntimeError, match="every worker replica has died"):
            engine.generate(SamplingParams(prompt="cat", num_inference_steps=1))
    finally:
        engine.shutdown()
        worker.close(timeout_s=5)
    assert all(not p.is_alive() for p in worker._processes.values())


# One host's process of a two-rank run: the engine on the leader (torchrun's rank 0, or --node-rank 0), worker ranks
# only on the other. `layout` adds ParallelConfig fields (several hosts), `leader` is the test of which it is.
HOST_SCRIPT = textwrap.dedent("""
    import logging, os, sys
    sys.path.insert(0, {test_dir!r})
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
    from test_launch import FakeRankWorker, make_config, note
    from k6serve.request import SamplingParams
    from k6serve.runtime.engine import Engine
    from k6serve.runtime.process_group_worker import MultiProcessWorker
    from k6serve.runtime.rank_process import serve_worker_ranks

    config = make_config(num_gpus=2, ulysses_degree=2, **{layout!r})
    if {leader}:
        worker = MultiProcessWorker(config, build_rank_worker=FakeRankWorker)
        engine = Engine(config, worker=worker)
        result = engine.generate(SamplingParams(prompt="cat", seed=11, num_inference_steps=2))
        print("VALUE", note(result, "value"))
        engine.shutdown()
        worker.close()
    else:
        serve_worker_ranks(config, FakeRankWorker)
        print("WORKER DONE")
""")


def test_torchrun_style_environment_is_honoured():
    port = find_free_port()
    script = HOST_SCRIPT.format(test_dir=str(Path(__file__).parent), layout={}, leader='os.environ["RANK"] == "0"')
    procs = []
    for rank in range(2):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": str(rank),
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        procs.append(subprocess.Popen([sys.executable, "-c", script], env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True, cwd=Path(__file__).parents[2]))
    outputs = [p.communicate(timeout=60)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), outputs
    assert f"VALUE {expected_value(11, 2, [0, 1])}" in outputs[0], outputs[0]
    assert "WORKER DONE" in outputs[1], outputs[1]


def test_two_hosts_say_what_they_wait_for_and_how_their_ranks_ended():
    # Node 0 waited for the other host with nothing printed, and the other host printed nothing at all.
    port = find_free_port()
    procs = [subprocess.Popen([sys.executable, "-c", HOST_SCRIPT.format(
        test_dir=str(Path(__file__).parent), leader=node_rank == 0,
        layout={"nnodes": 2, "node_rank": node_rank, "dist_init_addr": f"127.0.0.1:{port}"})],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=Path(__file__).parents[2])
        for node_rank in (1, 0)]
    host1, host0 = [p.communicate(timeout=90)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), (host0, host1)
    assert f"VALUE {expected_value(11, 2, [0, 1])}" in host0, host0
    assert (f"INFO waiting for the worker ranks of the other host (--node-rank 1) to join at 127.0.0.1:{port}, "
            f"within {DIST_TIMEOUT_S:g} s") in host0, host0
    assert (f"INFO host 1 of 2: starting worker rank 1, joining node 0 at 127.0.0.1:{port} within "
            f"{DIST_TIMEOUT_S:g} s") in host1, host1
    assert "INFO host 1 of 2: worker rank 1 ended (exited with code 0)" in host1, host1


ENGINE_KILLED_SCRIPT = textwrap.dedent("""
    import os, signal, sys
    sys.path.insert(0, {test_dir!r})
    from test_launch import FakeRankWorker, make_config
    from k6serve.request import OutputOptions, SamplingParams
    from k6serve.runtime.process_group_worker import MultiProcessWorker

    worker = MultiProcessWorker(make_config(num_gpus=2, ulysses_degree=2), build_rank_worker=FakeRankWorker)
    print("PIDS", *worker.pids.values(), flush=True)

    def die(step, total):  # the engine's process killed mid-request (the OOM killer, kill -9): no cleanup runs
        if step == 2:
            os.kill(os.getpid(), signal.SIGKILL)

    worker.run(SamplingParams(prompt="slow", num_inference_steps=50), OutputOptions(save_output=False), on_step=die)
""")


def test_ranks_shut_down_when_the_engine_dies_mid_request(tmp_path: Path):
    # The leader's step report to a dead engine raised out of the request, leaving the other ranks in the step's
    # broadcast: the replica held its memory until the collective timeout (600 s by default, 60 s here). It must
    # cancel the request on every rank and shut down at once, as when the engine dies between requests.
    script = ENGINE_KILLED_SCRIPT.format(test_dir=str(Path(__file__).parent))
    log = tmp_path / "engine.log"  # a file, not a pipe: the orphaned ranks keep a pipe open, and reading it waits
    with log.open("w") as out:
        engine = subprocess.Popen([sys.executable, "-c", script], stdout=out, stderr=subprocess.STDOUT,
                                  cwd=Path(__file__).parents[2])
        engine.wait(timeout=DIST_TIMEOUT_S + 30)
    output = log.read_text()
    assert engine.returncode == -signal.SIGKILL, output
    pids = [int(pid) for pid in next(line for line in output.splitlines() if line.startswith("PIDS")).split()[1:]]
    deadline = time.monotonic() + 20
    alive = pids
    while alive and time.monotonic() < deadline:
        time.sleep(0.2)
        alive = [pid for pid in pids if _is_running(pid)]
    for pid in alive:  # the test's own cleanup: orphaned ranks are nobody's children here
        os.kill(pid, signal.SIGKILL)
    assert not alive, f"ranks {alive} outlived the engine by 20 s"


def _is_running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split(") ", 1)[1][0] != "Z"  # a zombie has exited (no parent left to reap it yet)
    except FileNotFoundError:
        return False


def test_ranks_log_at_the_starting_process_level(monkeypatch):
    """`k6serve --log-level debug` configured the engine's process only: the ranks always logged at INFO, so a
    worker's DEBUG lines (a request's notes, worker.py) never showed. Where nothing configured logging (a Python
    API caller), the ranks keep INFO, as before."""
    import logging

    root = logging.getLogger()
    monkeypatch.setattr(root, "handlers", [])
    assert {spec.log_level for spec in local_rank_specs(ParallelConfig(num_gpus=2, ulysses_degree=2), "cpu")} == {
        logging.INFO}
    monkeypatch.setattr(root, "handlers", [logging.NullHandler()])
    monkeypatch.setattr(root, "level", logging.DEBUG)
    assert {spec.log_level for spec in local_rank_specs(ParallelConfig(num_gpus=2, ulysses_degree=2), "cpu")} == {
        logging.DEBUG}


def test_log_level_debug_reaches_a_rank_process():
    """End to end: `k6serve --log-level debug generate` on the demo (one rank process) prints the rank's DEBUG line
    for a request note (the default level is the unit test above)."""
    command = [sys.executable, "-m", "k6serve.cli.main", "generate", "--model-path", "demo", "--prompt", "x",
               "--no-save-output", "--num-frames", "6"]
    debug = subprocess.run([*command[:3], "--log-level", "debug", *command[3:]], capture_output=True, text=True,
                           timeout=300)
    assert debug.returncode == 0, debug.stderr
    assert "[rank 0] DEBUG k6serve.runtime.worker: num_frames 6 is not of the form 4k+1" in debug.stderr


def test_a_rank_exits_without_the_interpreters_teardown_but_after_what_an_exit_must_do(tmp_path):
    """Ranks end with `exit_without_teardown` (the interpreter's teardown took ~2 s a rank, which every shutdown
    waited for): the other non-daemon threads still finish, atexit handlers and finalizers still run, buffered
    output is still written, and the exit code is the one given."""
    script = textwrap.dedent(f"""
        import atexit, sys, threading, time, weakref
        from pathlib import Path
        from k6serve.process_exit import exit_without_teardown

        folder = Path({str(tmp_path)!r})
        atexit.register(lambda: (folder / "atexit").write_text("ran"))
        class Held: pass
        held = Held()
        weakref.finalize(held, lambda: (folder / "finalizer").write_text("ran"))
        threading.Thread(target=lambda: (time.sleep(0.3), (folder / "thread").write_text("done"))).start()
        # A thread pool still referenced (inductor keeps its compile pool): its idle workers are not daemons and end
        # only when threading's exit hook wakes them; joined without it they waited for ever.
        from concurrent.futures import ThreadPoolExecutor
        pool = ThreadPoolExecutor(1)
        pool.submit(lambda: (folder / "pool").write_text("ran")).result()
        sys.stdout.write("buffered, no newline")
        exit_without_teardown(3)
    """)
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert run.returncode == 3, run.stderr
    assert run.stdout == "buffered, no newline"
    assert {path.name: path.read_text() for path in tmp_path.iterdir()} == {
        "atexit": "ran", "finalizer": "ran", "thread": "done", "pool": "ran"}


@pytest.mark.parametrize("rank", [0, 1])
def test_what_every_rank_would_say_alike_is_said_by_rank_0_only(rank):
    """A run on N GPUs printed each configuration message (the demo checkpoint, an offload flag on the CPU, the SR
    decode choice) N times: records marked `ONCE` are written by rank 0 only; a rank's own records by every rank.
    (A fresh interpreter: the rank's root logging is process-wide.)"""
    script = textwrap.dedent(f"""
        import logging
        from k6serve.rank_logging import ONCE, configure_rank_logging
        configure_rank_logging({rank}, "INFO")
        logging.getLogger("k6serve.x").warning("the same on every rank", extra=ONCE)
        logging.getLogger("k6serve.x").info("this rank's own")
    """)
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    alike = ["[rank 0] WARNING k6serve.x: the same on every rank"] if rank == 0 else []
    # Each line starts with its time, with its UTC offset, then the rank.
    lines = run.stderr.splitlines()
    assert all(re.match(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{3}[+-]\d{4} \[rank", line) for line in lines), lines
    assert [line.split(" ", 2)[2] for line in lines] == [*alike, f"[rank {rank}] INFO k6serve.x: this rank's own"]


def test_a_rank_started_with_sigint_blocked_survives_ctrl_c_while_its_interpreter_boots():
    """A terminal's Ctrl-C reaches every process of the group, the ranks too, while they still import torch (before
    they can ignore it): each printed a KeyboardInterrupt traceback. Started with SIGINT blocked, a rank outlives
    it; the same signal ends a child started without the block, and one sent to the parent during the start is
    delivered to it after, not lost."""
    from k6serve.runtime.launch import _sigint_blocked, start_process

    blocked = start_process(time.sleep, (1.0,), name="k6serve-test-blocked", block_sigint=True)
    unblocked = start_process(time.sleep, (1.0,), name="k6serve-test-unblocked")
    for process in (blocked, unblocked):
        os.kill(process.pid, signal.SIGINT)  # during the boot: spawn's child is still starting Python
    blocked.join(20)
    unblocked.join(20)
    assert blocked.exitcode == 0
    assert unblocked.exitcode != 0

    with pytest.raises(KeyboardInterrupt):
        with _sigint_blocked():
            signal.pthread_kill(threading.get_ident(), signal.SIGINT)  # to this thread, the one blocking it
            time.sleep(0.05)  # blocked: no KeyboardInterrupt inside the block
            inside = True
    assert inside


def test_a_ctrl_c_held_back_while_a_rank_started_stops_that_rank(monkeypatch):
    """The Ctrl-C that arrives while SIGINT is blocked is raised as the mask is restored, inside `start_process`,
    before the caller holds the process: the rank must not be left running (in a notebook that goes on)."""
    import multiprocessing.process

    from k6serve.runtime import launch

    start = multiprocessing.process.BaseProcess.start
    started = []

    def start_then_ctrl_c(self):
        start(self)
        started.append(self)
        signal.pthread_kill(threading.get_ident(), signal.SIGINT)  # pending until the mask is restored

    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", start_then_ctrl_c)
    with pytest.raises(KeyboardInterrupt):
        launch.start_process(time.sleep, (30.0,), name="k6serve-test-interrupted", block_sigint=True)
    assert len(started) == 1 and not started[0].is_alive()


def test_stopping_hung_processes_waits_one_grace_for_all_not_one_each():
    """close() after a Ctrl-C while the ranks load (nothing tells them to stop) joined each rank for the whole grace
    in turn: eight ranks took eight times the grace before the first was killed."""
    from k6serve.runtime.launch import stop_processes

    context = multiprocessing.get_context("spawn")
    processes = [context.Process(target=time.sleep, args=(60,), daemon=True) for _ in range(3)]
    for process in processes:
        process.start()
    start = time.monotonic()
    stop_processes(processes, grace_s=1.0, terminate=False)
    assert time.monotonic() - start < 2.5  # one grace (1 s), not three
    assert all(process.exitcode == -signal.SIGKILL for process in processes)


def test_close_under_a_running_request_stops_its_ranks_at_the_next_step():
    """close() while a request ran (the server's forced stop) sent Shutdown where the leader waited for a step's
    reply: the leader failed alone ("AssertionError: Shutdown()") and the ranks, told nothing more, were SIGKILLed
    after close()'s whole grace. They stop at the next step now and exit by themselves."""
    worker = MultiProcessWorker(make_config(num_gpus=2, ulysses_degree=2), build_rank_worker=FakeRankWorker)
    stepped = threading.Event()
    outcome: list[BaseException] = []

    def run() -> None:
        try:
            worker.run(SamplingParams(prompt="slow", num_inference_steps=100), OutputOptions(save_output=False),
                       on_step=lambda step, total: stepped.set())
        except BaseException as exc:  # noqa: BLE001 - checked below
            outcome.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    assert stepped.wait(TIMEOUT_S)
    start = time.monotonic()
    worker.close(timeout_s=TIMEOUT_S)
    thread.join(TIMEOUT_S)
    assert time.monotonic() - start < TIMEOUT_S / 2  # not close()'s whole grace
    assert [process.exitcode for process in worker._processes.values()] == [0, 0]  # not SIGKILLed
    assert [str(exc) for exc in outcome] == ["request 0 was stopped by the engine's shutdown while it ran."]
