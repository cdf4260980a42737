"""Parallel building blocks on CPU (gloo) against single-process results, on random tensors.

One pool of 4 persistent gloo processes (`GlooPool`; the `pool` fixture of tests/parity/conftest.py, shared with the
other parity modules) serves the module; 2-process layouts run as two dp replicas (both compute the same thing), so
every test reuses the same world. Each rank computes the single-process reference itself, so reference and parallel
run under identical kernels and thread settings.

Tolerances: Ulysses (for every head-chunk count), gathered K/V and CFG-parallel are bitwise; Ring (and
Ulysses x Ring) reorder the softmax sums, so they are held to 1e-5 relative (max |diff| <= 1e-5 * max |ref|).
Collectives are counted by wrapping them in the worker (Q/K/V in one all-to-all per chunk, K/V in one gather).
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import traceback

import pytest
import torch
import torch.distributed as dist

from k6serve.models.common.inner_attention import InnerAttention
from k6serve.parallel import sequence as sequence_module
from k6serve.parallel.cfg import gather_cfg_branches, select_cfg_branch
from k6serve.parallel.mesh import ParallelLayout, build_groups
from k6serve.parallel.ring import ring_attention
from k6serve.parallel.sequence import SequenceShard, gather_sequence, pad_sequence, shard_sequence
from k6serve.parallel.sequence_attention import GatherKVAttention, ShardedAttention, ShardState
from k6serve.parallel.ulysses import (
    CHUNKS_ENVIRONMENT_VARIABLE,
    default_overlap_chunks,
    overlap_chunks_from_environment,
)
from k6serve.pipelines.guidance import cfg_combine
from k6serve.runtime.launch import find_free_port

pytestmark = pytest.mark.multiprocess
WORLD = 4
_GROUPS: dict = {}  # per worker process: layout -> ParallelGroups (created once, in the same order everywhere)


def _groups(layout: ParallelLayout):
    if layout not in _GROUPS:
        _GROUPS[layout] = build_groups(layout, dist.get_rank(), backend="gloo", timeout_s=60)
    return _GROUPS[layout]


def first_replica_groups(layout: ParallelLayout):
    """This rank's groups, or None on the ranks of every replica after the first. Every rank builds the groups (a
    collective); a task that returns early on None leaves the later replicas idle. A dp=2 layout fills the pool's 4
    ranks, but its second replica repeats the first one's work on the same 2 CPU cores (the test's time doubled for
    no check the first replica does not make); the generation tests keep both replicas, which checks that replicas
    run apart."""
    groups = _groups(layout)
    return groups if groups.replica == 0 else None


def first_replica_results(results: list, layout: ParallelLayout) -> list:
    """`GlooPool.run`'s results of the first replica's ranks (see `first_replica_groups`), checked to be all there."""
    kept = [result for result in results if result is not None]
    assert len(kept) == layout.replica_size, f"{len(kept)} results for a replica of {layout.replica_size} ranks"
    return kept


def _pool_main(rank: int, port: int, tasks, results) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    while (task := tasks.get()) is not None:
        function, args = task
        try:
            results.put((rank, True, function(*args)))
        except Exception:  # noqa: BLE001 (the failure is raised in the test process)
            results.put((rank, False, traceback.format_exc()))
    dist.destroy_process_group()


class GlooPool:
    """WORLD persistent processes; `run(f, *args)` calls f(*args) on every rank and returns the rank-ordered results."""

    def __init__(self):
        context = multiprocessing.get_context("spawn")
        port = find_free_port()
        self.tasks = [context.Queue() for _ in range(WORLD)]
        self.results = context.Queue()
        self.processes = [
            context.Process(target=_pool_main, args=(rank, port, self.tasks[rank], self.results), daemon=True)
            for rank in range(WORLD)
        ]
        for process in self.processes:
            process.start()

    def run(self, function, *args) -> list:
        for queue in self.tasks:
            queue.put((function, args))
        outcomes = sorted(self.results.get(timeout=120) for _ in range(WORLD))
        failures = [value for _, ok, value in outcomes if not ok]
        assert not failures, failures[0]
        return [value for _, _, value in outcomes]

    def close(self):
        for queue in self.tasks:
            queue.put(None)
        for process in self.processes:
            process.join(10)


def random_qkv(length: int, *, heads: int = 8, head_dim: int = 16, batch: int = 2, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(batch, length, heads, head_dim, generator=generator) for _ in range(3)]


@contextlib.contextmanager
def _counting_calls(owner, name: str):
    """Count the calls of `owner.name` (a collective) inside the block; yields the list of calls."""
    original, calls = getattr(owner, name), []

    def counted(*args, **kwargs):
        calls.append(name)
        return original(*args, **kwargs)

    setattr(owner, name, counted)
    try:
        yield calls
    finally:
        setattr(owner, name, original)


def _sharded_attention_task(layout: ParallelLayout, query, key, value, chunk_counts=(None,)):
    """Shard Q/K/V over the sequence group, run `ShardedAttention` once per overlap chunk count, gather.

    Returns the 1-process result and, per chunk count, (gathered output, number of all-to-all calls).
    """
    groups = _groups(layout)
    rank = dist.get_rank()
    shard = SequenceShard(total_length=query.shape[1], degree=layout.sequence_degree,
                          index=layout.sequence_index(rank))
    inner = InnerAttention("video_self")
    runs = []
    for chunks in chunk_counts:
        module = ShardedAttention(inner, ulysses_group=groups.axis["ulysses"], ring_group=groups.axis["ring"],
                                  state=ShardState(shard), overlap_chunks=chunks)
        with _counting_calls(dist, "all_to_all_single") as calls:
            out_local = module(*(shard_sequence(x, 1, shard) for x in (query, key, value)))
        assert out_local.shape[1] == shard.local_length
        runs.append((gather_sequence(out_local, 1, shard, groups.sequence), len(calls)))
    return inner(query, key, value), runs


ULYSSES_LAYOUTS = {
    "ulysses2": ParallelLayout(dp=2, ulysses=2),
    "ulysses4": ParallelLayout(ulysses=4),
}
RING_LAYOUTS = {
    "ring2": ParallelLayout(dp=2, ring=2),
    "ring4": ParallelLayout(ring=4),
    "ulysses2_ring2": ParallelLayout(ring=2, ulysses=2),
}


ULYSSES_CHUNK_COUNTS = {  # 8 heads: 4 local heads on Ulysses2, 2 on Ulysses4; None is the default (1 chunk)
    "ulysses2": ((None, 1), (1, 1), (2, 2), (4, 4)),
    "ulysses4": ((None, 1), (1, 1), (2, 2)),
}


@pytest.mark.parametrize(("length", "batch"), [(37, 2), (9, 2), (301, 2), (37, 1)])
@pytest.mark.parametrize("name", list(ULYSSES_LAYOUTS))
def test_ulysses_attention_is_bitwise_single_process(pool, name, length, batch):
    # Every head-chunk count gives the same bits; Q, K and V share one all-to-all per chunk, the output one more.
    query, key, value = random_qkv(length, batch=batch)
    chunk_counts = [requested for requested, _ in ULYSSES_CHUNK_COUNTS[name]]
    for reference, runs in pool.run(_sharded_attention_task, ULYSSES_LAYOUTS[name], query, key, value,
                                    chunk_counts):
        for (parallel, num_all_to_all), (_, used_chunks) in zip(runs, ULYSSES_CHUNK_COUNTS[name], strict=True):
            assert parallel.shape == reference.shape == query.shape
            assert torch.equal(parallel, reference)
            assert num_all_to_all == 2 * used_chunks


@pytest.mark.parametrize("length", [37, 9])
@pytest.mark.parametrize("name", list(RING_LAYOUTS))
def test_ring_attention_matches_single_process(pool, name, length):
    # length 9 on 4 sequence ranks: shards of 3 tokens, the last one all padding (its K/V block is skipped)
    query, key, value = random_qkv(length, seed=1)
    # Ulysses x Ring defaults to 1 chunk; 2 chunks run the ring once per chunk and still agree.
    chunk_counts = (None, 2) if name == "ulysses2_ring2" else (None,)
    for reference, runs in pool.run(_sharded_attention_task, RING_LAYOUTS[name], query, key, value, chunk_counts):
        for (parallel, num_all_to_all), chunks in zip(runs, chunk_counts, strict=True):
            assert parallel.shape == reference.shape
            assert (parallel - reference).abs().max() <= 1e-5 * reference.abs().max()
            assert num_all_to_all == (2 * (chunks or 1) if name == "ulysses2_ring2" else 0)


class _CompiledBlock(torch.nn.Module):
    """A stand-in for a DiT block: projections around a (possibly sharded) attention, 4 heads of 4."""

    def __init__(self, attention: torch.nn.Module):
        super().__init__()
        self.project = torch.nn.Linear(16, 48)
        self.attention = attention
        self.out = torch.nn.Linear(16, 16)

    def forward(self, x_BLC):
        query_BLHD, key_BLHD, value_BLHD = self.project(x_BLC).unflatten(-1, (3, 4, 4)).unbind(2)
        return self.out(torch.tanh(self.attention(query_BLHD.sin(), key_BLHD, value_BLHD)).flatten(2))


def _compiled_block_task(x_BLC):
    """A regionally compiled block around Ulysses2 attention: the eager output, the compiled output of two
    forwards with a new shard each time (a recompile raises), and dynamo's graph count and break reasons."""
    import torch._dynamo

    groups = _groups(ULYSSES_LAYOUTS["ulysses2"])
    index = ULYSSES_LAYOUTS["ulysses2"].sequence_index(dist.get_rank())
    state = ShardState()
    torch.manual_seed(0)
    block = _CompiledBlock(ShardedAttention(InnerAttention("video_self"), ulysses_group=groups.axis["ulysses"],
                                            ring_group=groups.axis["ring"], state=state, overlap_chunks=2))
    outputs = []
    for compiled in (False, True, True):
        state.current = SequenceShard(total_length=x_BLC.shape[1], degree=2, index=index)
        if compiled and not outputs[1:]:
            block.compile(backend="eager", fullgraph=False, dynamic=False)
        with torch._dynamo.config.patch(error_on_recompile=len(outputs) == 2), torch.inference_mode():
            outputs.append(block(shard_sequence(x_BLC, 1, state.current)))
    with torch.inference_mode():
        explanation = torch._dynamo.explain(block.forward)(shard_sequence(x_BLC, 1, state.current))
    torch._dynamo.reset()
    return outputs, explanation.graph_count, [str(reason.reason) for reason in explanation.break_reasons]


def test_compiled_block_breaks_its_graph_around_sharded_attention(pool):
    x_BLC = torch.randn(1, 9, 16, generator=torch.Generator().manual_seed(8))
    for (eager, compiled, compiled_again), num_graphs, reasons in pool.run(_compiled_block_task, x_BLC):
        assert torch.equal(eager, compiled) and torch.equal(eager, compiled_again)
        # one graph before and one after the attention (without the disable: 9, a break at every async collective)
        assert num_graphs == 2 and len(reasons) == 1 and "torch.compiler.disable" in reasons[0]


def _chunks_from_environment_task(query, key, value, setting: str):
    """Ulysses2 built while $K6SERVE_ULYSSES_CHUNKS=`setting`: output, all-to-all count, or the ValueError text."""
    groups = _groups(ULYSSES_LAYOUTS["ulysses2"])
    shard = SequenceShard(total_length=query.shape[1], degree=2, index=ULYSSES_LAYOUTS["ulysses2"].sequence_index(
        dist.get_rank()))
    os.environ[CHUNKS_ENVIRONMENT_VARIABLE] = setting
    try:
        module = ShardedAttention(InnerAttention("video_self"), ulysses_group=groups.axis["ulysses"],
                                  ring_group=groups.axis["ring"], state=ShardState(shard))
    finally:
        del os.environ[CHUNKS_ENVIRONMENT_VARIABLE]
    try:
        with _counting_calls(dist, "all_to_all_single") as calls:
            out_local = module(*(shard_sequence(x, 1, shard) for x in (query, key, value)))
    except ValueError as error:
        return str(error)
    return gather_sequence(out_local, 1, shard, groups.sequence), len(calls)


def test_chunk_count_from_environment(pool):
    query, key, value = random_qkv(37, seed=6)
    reference = InnerAttention("video_self")(query, key, value)
    for parallel, num_all_to_all in pool.run(_chunks_from_environment_task, query, key, value, "4"):
        assert torch.equal(parallel, reference) and num_all_to_all == 8
    for message in pool.run(_chunks_from_environment_task, query, key, value, "3"):
        assert "must divide the 4 heads" in message and "[1, 2, 4]" in message


def test_default_chunk_count_and_environment_parsing(monkeypatch):
    assert [default_overlap_chunks(h) for h in (1, 2, 3, 15, 16)] == [1, 1, 1, 1, 1]  # measured best on 2 H200s
    monkeypatch.delenv(CHUNKS_ENVIRONMENT_VARIABLE, raising=False)
    assert overlap_chunks_from_environment() is None
    for setting, expected in (("", None), (" 2 ", 2), ("1", 1)):
        monkeypatch.setenv(CHUNKS_ENVIRONMENT_VARIABLE, setting)
        assert overlap_chunks_from_environment() == expected
    monkeypatch.setenv(CHUNKS_ENVIRONMENT_VARIABLE, "3")
    unset = {"ulysses_group": None, "ring_group": None, "state": ShardState()}  # construction needs no group
    assert ShardedAttention(InnerAttention("video_self"), **unset).overlap_chunks == 3
    assert ShardedAttention(InnerAttention("video_self"), **unset, overlap_chunks=1).overlap_chunks == 1
    for setting in ("0", "two", "-1"):
        monkeypatch.setenv(CHUNKS_ENVIRONMENT_VARIABLE, setting)
        with pytest.raises(ValueError, match="K6SERVE_ULYSSES_CHUNKS=.* is not a positive integer"):
            ShardedAttention(InnerAttention("video_self"), **unset)
    with pytest.raises(ValueError, match="overlap_chunks must be a positive"):
        ShardedAttention(InnerAttention("video_self"), **unset, overlap_chunks=0)


def _ring_uneven_blocks_task(query, key, value, lengths):
    """Ring over 4 ranks whose K/V blocks have explicit real lengths (block j padded to the longest)."""
    group = _groups(ParallelLayout(ring=4)).axis["ring"]
    rank = dist.get_rank()
    starts = [sum(lengths[:j]) for j in range(4)]
    block = max(lengths)
    local_kv = [pad_sequence(x[:, starts[rank]:starts[rank] + lengths[rank]], 1, block) for x in (key, value)]
    out = ring_attention(query, *local_kv, group=group, key_lengths=lengths, backend="torch_sdpa")
    return out, InnerAttention("video_self")(query, key, value)


def test_ring_attention_drops_padded_keys(pool):
    lengths = [5, 5, 3, 0]
    query, key, value = random_qkv(sum(lengths), seed=2)
    for parallel, reference in pool.run(_ring_uneven_blocks_task, query[:, :4], key, value, lengths):
        assert (parallel - reference).abs().max() <= 1e-5 * reference.abs().max()


def _gather_kv_task(layout: ParallelLayout, audio_query, video_key, video_value, fused):
    """Replicated audio queries over sharded video K/V ("audio_from_video"); `fused`: V is a strided view of a
    K/V buffer, as a fused K/V projection gives it."""
    groups = _groups(layout)
    shard = SequenceShard(total_length=video_key.shape[1], degree=layout.sequence_degree,
                          index=layout.sequence_index(dist.get_rank()))
    inner = InnerAttention("audio_from_video")
    module = GatherKVAttention(inner, sequence_group=groups.sequence, state=ShardState(shard))
    local_key, local_value = (shard_sequence(x, 1, shard).contiguous() for x in (video_key, video_value))
    if fused:
        local_key, local_value = torch.stack([local_key, local_value], dim=-2).unbind(-2)
        assert not local_value.is_contiguous()
    with _counting_calls(sequence_module, "_all_gather_into_tensor") as calls:
        out = module(audio_query, local_key, local_value)
    return out, inner(audio_query, video_key, video_value), len(calls)


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("batch", [2, 1])
@pytest.mark.parametrize("name", ["ulysses4", "ulysses2_ring2"])
def test_gathered_video_kv_is_bitwise_single_process(pool, name, batch, fused):
    layout = {**ULYSSES_LAYOUTS, **RING_LAYOUTS}[name]
    audio_query = random_qkv(6, seed=3, batch=batch)[0]
    _, video_key, video_value = random_qkv(37, seed=4, batch=batch)
    for parallel, reference, num_gathers in pool.run(
        _gather_kv_task, layout, audio_query, video_key, video_value, fused
    ):
        assert torch.equal(parallel, reference)
        # Contiguous K and V are gathered as they are, one collective each; a strided V is packed with K.
        assert num_gathers == (1 if fused else 2)


def _gather_sequence_task(tensors_and_dims):
    """`gather_sequence` over 4 ranks of each (full tensor, dim): the result and whether it lives in the buffer
    the collective wrote (no copy after the gather)."""
    group = _groups(ParallelLayout(ulysses=4)).sequence
    original, buffers = sequence_module._all_gather_into_tensor, []

    def recording(output, *args, **kwargs):
        buffers.append(output)
        return original(output, *args, **kwargs)

    results = []
    sequence_module._all_gather_into_tensor = recording
    try:
        for full, dim in tensors_and_dims:
            shard = SequenceShard(total_length=full.shape[dim], degree=4, index=dist.get_rank())
            gathered = gather_sequence(shard_sequence(full, dim, shard), dim, shard, group)
            in_buffer = gathered.untyped_storage().data_ptr() == buffers[-1].untyped_storage().data_ptr()
            results.append((gathered, in_buffer))
    finally:
        sequence_module._all_gather_into_tensor = original
    return results


def test_gather_sequence_rebuilds_every_layout(pool):
    # B == 1 along dim 1 (and any dim with only size-1 dims before it) comes back as a view of the gathered
    # buffer, with no concatenation copy; the other layouts pay one copy.
    generator = torch.Generator().manual_seed(7)
    cases = [
        (torch.randn(1, 10, 3, 2, generator=generator), 1, True),
        (torch.randn(2, 10, 3, generator=generator), 1, False),
        (torch.randn(10, 4, generator=generator), 0, True),
        (torch.randn(2, 3, 9, generator=generator), -1, False),
        (torch.randn(1, 1, 7, 2, generator=generator), 2, True),
    ]
    for results in pool.run(_gather_sequence_task, [(full, dim) for full, dim, _ in cases]):
        for (gathered, is_view), (full, _, expected_view) in zip(results, cases, strict=True):
            assert torch.equal(gathered, full)
            assert is_view == expected_view


def _branch_forward(weight, latents, text):
    """A stand-in for one DiT forward of one guidance branch (video and audio outputs)."""
    hidden = torch.tanh(latents @ weight + text.mean(dim=1, keepdim=True))
    return hidden * 1.5, hidden[:, :3] - 0.25


def _cfg_task(weight, latents, positive, negative, scale):
    groups = _groups(ParallelLayout(dp=2, cfg=2))
    cfg_group = groups.axis["cfg"]
    video_local, audio_local = _branch_forward(weight, latents, select_cfg_branch((positive, negative), cfg_group))
    video_cond, video_uncond = gather_cfg_branches(video_local, cfg_group)
    audio_cond, audio_uncond = gather_cfg_branches(audio_local, cfg_group)
    assert gather_cfg_branches(None, cfg_group) == [None, None]
    parallel = cfg_combine(video_cond, video_uncond, scale), cfg_combine(audio_cond, audio_uncond, scale)
    # serial CFG on this rank: both branches one after the other, the same combine
    video_v, audio_v = _branch_forward(weight, latents, positive)
    video_u, audio_u = _branch_forward(weight, latents, negative)
    serial = cfg_combine(video_v, video_u, scale), cfg_combine(audio_v, audio_u, scale)
    return parallel, serial


def test_cfg_parallel_is_bitwise_serial_cfg(pool):
    generator = torch.Generator().manual_seed(5)
    weight, latents = torch.randn(16, 16, generator=generator), torch.randn(1, 10, 16, generator=generator)
    positive, negative = torch.randn(1, 7, 16, generator=generator), torch.randn(1, 4, 16, generator=generator)
    for parallel, serial in pool.run(_cfg_task, weight, latents, positive, negative, 5.0):
        assert all(torch.equal(p, s) for p, s in zip(parallel, serial, strict=True))
        assert not torch.equal(parallel[0], _branch_forward(weight, latents, positive)[0])  # guidance did act


def test_sequence_shard_arithmetic():
    shard = SequenceShard(total_length=9, degree=4, index=3)
    assert (shard.local_length, shard.padded_length) == (3, 12)
    assert [shard.real_length(j) for j in range(4)] == [3, 3, 3, 0]
    assert [shard.real_length(j, block=2) for j in range(2)] == [6, 3]
    x = torch.arange(9.0).reshape(1, 9, 1)
    assert shard_sequence(x, 1, shard).flatten().tolist() == [0.0, 0.0, 0.0]
    assert pad_sequence(x, 1, 12, mode="edge").flatten().tolist()[-4:] == [8.0, 8.0, 8.0, 8.0]
    assert pad_sequence(x, -2, 12).flatten().tolist()[-4:] == [8.0, 0.0, 0.0, 0.0]


def _device_mesh_task(layout: ParallelLayout):
    groups = _groups(layout)
    mesh = groups.device_mesh("cpu")
    value = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(value, group=mesh.get_group("ulysses"))
    return mesh.mesh_dim_names, tuple(mesh.mesh.shape), value.item(), mesh.get_local_rank("ring")


def test_device_mesh_has_named_replica_axes(pool):
    results = pool.run(_device_mesh_task, ParallelLayout(dp=2, ulysses=2))
    assert [r[0] for r in results] == [("cfg", "tp", "ring", "ulysses")] * 4
    assert [r[1] for r in results] == [(1, 1, 1, 2)] * 4
    assert [r[2] for r in results] == [1.0, 1.0, 5.0, 5.0]  # ulysses groups {0, 1} and {2, 3}
