"""Parallel building blocks on CPU (gloo) against single-process results, on random tensors.

One pool of 4 persistent gloo processes serves the whole module; 2-process layouts run as two dp replicas
(both compute the same thing), so every test reuses the same world. Each rank computes the single-process
reference itself, so reference and parallel run under identical kernels and thread settings.

Tolerances: Ulysses, gathered K/V and CFG-parallel are bitwise; Ring (and Ulysses x Ring) reorder the
softmax sums, so they are held to 1e-5 relative (max |diff| <= 1e-5 * max |ref|).
"""

from __future__ import annotations

import multiprocessing
import traceback

import pytest
import torch
import torch.distributed as dist

from k6serve.models.common.inner_attention import InnerAttention
from k6serve.parallel.cfg import gather_cfg_branches, select_cfg_branch
from k6serve.parallel.mesh import ParallelLayout, build_groups
from k6serve.parallel.ring import ring_attention
from k6serve.parallel.sequence import SequenceShard, gather_sequence, pad_sequence, shard_sequence
from k6serve.parallel.sequence_attention import GatherKVAttention, ShardedAttention, ShardState
from k6serve.pipelines.guidance import cfg_combine
from k6serve.runtime.launch import find_free_port

pytestmark = pytest.mark.multiprocess
WORLD = 4
_GROUPS: dict = {}  # per worker process: layout -> ParallelGroups (created once, in the same order everywhere)


def _groups(layout: ParallelLayout):
    if layout not in _GROUPS:
        _GROUPS[layout] = build_groups(layout, dist.get_rank(), backend="gloo", timeout_s=60)
    return _GROUPS[layout]


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


@pytest.fixture(scope="module")
def pool():
    pool = GlooPool()
    yield pool
    pool.close()


def random_qkv(length: int, *, heads: int = 8, head_dim: int = 16, batch: int = 2, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(batch, length, heads, head_dim, generator=generator) for _ in range(3)]


def _sharded_attention_task(layout: ParallelLayout, query, key, value):
    """Shard Q/K/V over the sequence group, run `ShardedAttention`, gather; also the 1-process result."""
    groups = _groups(layout)
    rank = dist.get_rank()
    shard = SequenceShard(total_length=query.shape[1], degree=layout.sequence_degree,
                          index=layout.sequence_index(rank))
    inner = InnerAttention("video_self")
    module = ShardedAttention(inner, ulysses_group=groups.axis["ulysses"], ring_group=groups.axis["ring"],
                              state=ShardState(shard))
    out_local = module(*(shard_sequence(x, 1, shard) for x in (query, key, value)))
    assert out_local.shape[1] == shard.local_length
    return gather_sequence(out_local, 1, shard, groups.sequence), inner(query, key, value)


ULYSSES_LAYOUTS = {
    "ulysses2": ParallelLayout(dp=2, ulysses=2),
    "ulysses4": ParallelLayout(ulysses=4),
}
RING_LAYOUTS = {
    "ring2": ParallelLayout(dp=2, ring=2),
    "ring4": ParallelLayout(ring=4),
    "ulysses2_ring2": ParallelLayout(ring=2, ulysses=2),
}


@pytest.mark.parametrize("length", [37, 9, 301])
@pytest.mark.parametrize("name", list(ULYSSES_LAYOUTS))
def test_ulysses_attention_is_bitwise_single_process(pool, name, length):
    query, key, value = random_qkv(length)
    for parallel, reference in pool.run(_sharded_attention_task, ULYSSES_LAYOUTS[name], query, key, value):
        assert parallel.shape == reference.shape == query.shape
        assert torch.equal(parallel, reference)


@pytest.mark.parametrize("length", [37, 9])
@pytest.mark.parametrize("name", list(RING_LAYOUTS))
def test_ring_attention_matches_single_process(pool, name, length):
    # length 9 on 4 sequence ranks: shards of 3 tokens, the last one all padding (its K/V block is skipped)
    query, key, value = random_qkv(length, seed=1)
    for parallel, reference in pool.run(_sharded_attention_task, RING_LAYOUTS[name], query, key, value):
        assert parallel.shape == reference.shape
        assert (parallel - reference).abs().max() <= 1e-5 * reference.abs().max()


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


def _gather_kv_task(layout: ParallelLayout, audio_query, video_key, video_value):
    """Replicated audio queries over sharded video K/V ("audio_from_video")."""
    groups = _groups(layout)
    shard = SequenceShard(total_length=video_key.shape[1], degree=layout.sequence_degree,
                          index=layout.sequence_index(dist.get_rank()))
    inner = InnerAttention("audio_from_video")
    module = GatherKVAttention(inner, sequence_group=groups.sequence, state=ShardState(shard))
    out = module(audio_query, shard_sequence(video_key, 1, shard), shard_sequence(video_value, 1, shard))
    return out, inner(audio_query, video_key, video_value)


@pytest.mark.parametrize("name", ["ulysses4", "ulysses2_ring2"])
def test_gathered_video_kv_is_bitwise_single_process(pool, name):
    layout = {**ULYSSES_LAYOUTS, **RING_LAYOUTS}[name]
    audio_query = random_qkv(6, seed=3)[0]
    _, video_key, video_value = random_qkv(37, seed=4)
    for parallel, reference in pool.run(_gather_kv_task, layout, audio_query, video_key, video_value):
        assert torch.equal(parallel, reference)


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
