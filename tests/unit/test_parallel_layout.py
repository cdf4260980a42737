"""Layout arithmetic (rank coordinates, groups) and the start-up validation of every invalid layout."""

from __future__ import annotations

import re

import pytest

from k6serve.config import ParallelConfig
from k6serve.models.kandinsky6.config import Kandinsky6TransformerConfig
from k6serve.models.kandinsky6.plan import kandinsky6_plan
from k6serve.models.kandinsky6.released_configs import RELEASED_TRANSFORMER_CONFIGS
from k6serve.models.kandinsky6_sr.config import SRTransformerConfig
from k6serve.models.kandinsky6_sr.plan import sr_plan
from k6serve.models.kandinsky6_sr.released_configs import (
    TRANSFORMER_CONFIG as SR_TRANSFORMER_CONFIG,
)
from k6serve.parallel.mesh import ParallelLayout, validate_layout

PRO = kandinsky6_plan(Kandinsky6TransformerConfig.from_json_dict(RELEASED_TRANSFORMER_CONFIGS["pro"]))
LITE = kandinsky6_plan(Kandinsky6TransformerConfig.from_json_dict(RELEASED_TRANSFORMER_CONFIGS["lite"]))
SR = sr_plan(SRTransformerConfig.from_dict(SR_TRANSFORMER_CONFIG))


def check(plan, has_guidance=True, **degrees):
    validate_layout(ParallelLayout(**degrees), plan, model_name="model", has_guidance=has_guidance)


def test_layout_from_config_and_coordinates():
    layout = ParallelLayout.from_config(
        ParallelConfig(num_gpus=16, dp_size=2, enable_cfg_parallel=True, ring_degree=2, ulysses_degree=2)
    )
    assert layout.shape == (2, 2, 1, 2, 2) and layout.world_size == 16 and layout.replica_size == 8
    assert layout.coordinates(15) == {"dp": 1, "cfg": 1, "tp": 0, "ring": 1, "ulysses": 1}
    assert all(layout.rank_at(layout.coordinates(r)) == r for r in range(16))
    assert layout.replica_ranks(1) == list(range(8, 16)) and layout.replica_of(7) == 0
    # ulysses is innermost (neighbouring ranks), cfg outermost inside a replica
    assert layout.axis_groups("ulysses")[:2] == [[0, 1], [2, 3]]
    assert layout.axis_groups("cfg")[0] == [0, 4]
    # a sequence group holds ring blocks of consecutive ulysses ranks, ordered by sequence index
    assert layout.sequence_groups()[0] == [0, 1, 2, 3]
    assert [layout.sequence_index(r) for r in (0, 1, 2, 3)] == [0, 1, 2, 3]
    every_rank = sorted(r for group in layout.axis_groups("ring") for r in group)
    assert every_rank == list(range(16))


@pytest.mark.parametrize(
    "plan, degrees",
    [
        (PRO, {"tp": 2, "ulysses": 2}), (PRO, {"ulysses": 8}), (PRO, {"tp": 16}),
        (LITE, {"ulysses": 4}),  # 28 video heads / 4; the 14 audio heads stay replicated
        (LITE, {"tp": 2, "ulysses": 2, "ring": 2}), (LITE, {"cfg": 2, "ulysses": 2}),
        (SR, {"ulysses": 4, "ring": 2}), (SR, {"tp": 4, "ring": 2}), (PRO, {"ulysses": 2, "fsdp": True}),
    ],
)
def test_valid_layouts_pass(plan, degrees):
    check(plan, **degrees)


@pytest.mark.parametrize(
    "plan, has_guidance, degrees, message",
    [
        (PRO, True, {"tp": 3}, (r"tensor parallelism must divide the heads of every attention.*'text_self' has 32 "
                               r"heads and --tp-size is 3.*valid tp sizes: \[1, 2, 4, 8, 16\].*--tp-size 2")),
        (LITE, True, {"tp": 4}, r"'text_self' has 14 heads and --tp-size is 4.*\[1, 2, 7, 14\].*--tp-size 2"),
        (LITE, True, {"ulysses": 8}, (r"Ulysses must divide the TP-local heads.*'video_self' has 28 heads / tp 1 "
                                    r"= 28 per rank.*--ulysses-degree 4 --ring-degree 2")),
        (SR, False, {"ulysses": 8}, r"--ulysses-degree 4 --ring-degree 2"),
        (LITE, True, {"tp": 2, "ulysses": 4}, r"28 heads / tp 2 = 14 per rank.*--ulysses-degree 2 --ring-degree 2"),
        (PRO, False, {"cfg": 2}, (r"no classifier-free guidance branch.*drop --enable-cfg-parallel and use "
                                 r"--ulysses-degree 2")),
        (SR, False, {"cfg": 2, "ulysses": 2}, r"no classifier-free guidance.*--ulysses-degree 4"),
        (PRO, True, {"fsdp": True}, r"--use-fsdp-inference .* one GPU.*--ulysses-degree 2"),
    ],
)
def test_invalid_layouts_name_the_rule_and_an_alternative(plan, has_guidance, degrees, message):
    with pytest.raises(ValueError, match=message):
        check(plan, has_guidance, **degrees)


def test_suggested_alternatives_are_valid():
    check(SR, False, ulysses=4, ring=2)
    check(LITE, True, tp=2, ulysses=2, ring=2)
    check(PRO, False, ulysses=2)



def _suggested_degrees(message: str) -> dict[str, int]:
    flags = dict(re.findall(r"--(ulysses-degree|ring-degree) (\d+)", message.split(" GPU(s) with ")[1]))
    return {name.split("-")[0]: int(value) for name, value in flags.items()}


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("num_gpus", [2, 3, 4, 5, 6, 7, 8])
def test_a_gpu_count_mismatch_suggests_degrees_every_released_model_takes(num_gpus, tp):
    """The config is checked before the model is known: its "keep N GPU(s) with ..." must pass each released
    model's head rules (3 GPUs were told --ulysses-degree 3, which Pro's 32 and Lite's 28 heads then refused)."""
    if num_gpus % tp:
        return
    for given in ({"ulysses_degree": 16}, {"ulysses_degree": 2, "ring_degree": 16}):
        with pytest.raises(ValueError, match=rf"but --num-gpus is {num_gpus}\. Pass --num-gpus") as refused:
            ParallelConfig(num_gpus=num_gpus, tp_size=tp, **given)
        # The command line as the user would run it next: the flags given, those the message names replaced.
        degrees = {"ulysses": given["ulysses_degree"], "ring": given.get("ring_degree", 1),
                   **_suggested_degrees(str(refused.value))}
        assert tp * degrees["ulysses"] * degrees["ring"] == num_gpus, refused.value
        for plan in (PRO, LITE, SR):
            check(plan, tp=tp, **degrees)

def _record_new_groups(monkeypatch, world_size):
    """Stand in for torch.distributed's group calls: each new_group returns a fresh tagged object."""
    import torch.distributed as dist

    calls = []

    def new_group(ranks=None, timeout=None, backend=None):
        calls.append((backend, tuple(ranks) if ranks is not None else None))
        return ("group", len(calls))

    monkeypatch.setattr(dist, "new_group", new_group)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: world_size)
    monkeypatch.setattr("k6serve.parallel.mesh._default_group", lambda: "default group")
    return calls


def test_axes_naming_the_same_ranks_share_one_group(monkeypatch):
    """Each NCCL group that runs a collective holds a communicator (hundreds of MiB of device memory), so build_groups
    makes one group per distinct rank set: under Ulysses2 on two GPUs the ulysses, sequence and replica groups are
    the default group, and the size-1 cfg / tp / ring groups are one group per rank."""
    from k6serve.parallel.mesh import build_groups

    calls = _record_new_groups(monkeypatch, 2)
    groups = build_groups(ParallelLayout(ulysses=2), 1, backend="nccl", timeout_s=5)
    # every rank still calls new_group for the same rank sets in the same order (torch requires it)
    assert calls == [("nccl", (0,)), ("nccl", (1,)), ("gloo", (0, 1))]
    assert groups.axis["ulysses"] is groups.sequence is groups.replica_group == "default group"
    assert groups.axis["cfg"] is groups.axis["tp"] is groups.axis["ring"] == ("group", 2)
    assert groups.control == ("group", 3)
    assert groups.world_control is groups.control  # one replica: its gloo group is the world's


def test_distinct_rank_sets_keep_distinct_groups(monkeypatch):
    from k6serve.parallel.mesh import build_groups

    calls = _record_new_groups(monkeypatch, 8)
    layout = ParallelLayout(dp=2, cfg=2, ulysses=2)  # 8 ranks, replicas of 4
    groups = build_groups(layout, 5, backend="nccl", timeout_s=5)
    nccl_sets = [ranks for backend, ranks in calls if backend == "nccl"]
    assert len(nccl_sets) == len(set(nccl_sets))  # no rank set made twice
    # rank 5 = replica 1, cfg 0, ulysses 1: its groups are [4, 5] (ulysses and sequence), [5, 7] (cfg), [5] (tp, ring)
    # and the replica [4..7]; the 8-rank world appears in no axis
    assert groups.axis["ulysses"] is groups.sequence == ("group", calls.index(("nccl", (4, 5))) + 1)
    assert groups.axis["cfg"] == ("group", calls.index(("nccl", (5, 7))) + 1)
    assert groups.axis["tp"] is groups.axis["ring"] == ("group", calls.index(("nccl", (5,))) + 1)
    assert groups.replica_group == ("group", calls.index(("nccl", (4, 5, 6, 7))) + 1)
    assert groups.control == ("group", calls.index(("gloo", (4, 5, 6, 7))) + 1)
    assert groups.world_control == ("group", calls.index(("gloo", tuple(range(8)))) + 1)


def test_fsdp_keeps_its_own_replica_group(monkeypatch):
    """A communicator runs its collectives in turn: FSDP's prefetching all-gathers over the replica must not queue
    behind the Ulysses exchanges on the same ranks, so under FSDP the replica group is a group of its own."""
    from k6serve.parallel.mesh import build_groups

    calls = _record_new_groups(monkeypatch, 2)
    groups = build_groups(ParallelLayout(ulysses=2, fsdp=True), 0, backend="nccl", timeout_s=5)
    assert groups.axis["ulysses"] is groups.sequence == "default group"
    assert groups.replica_group == ("group", calls.index(("nccl", (0, 1))) + 1)
    assert [ranks for backend, ranks in calls if backend == "nccl"] == [(0,), (1,), (0, 1)]
