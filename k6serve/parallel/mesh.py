"""Parallel layout: degrees -> rank coordinates, layout validation, and the process groups of one rank.

Ranks are laid out row-major over the named axes `AXES` (outermost first): dp replicas are the outermost
blocks of consecutive ranks, and inside a replica cfg is outermost and ulysses innermost. The axes that talk in
every block (ulysses all-to-all, ring K/V rotation, TP all-reduce) get the nearest ranks; cfg talks once per
step and dp never, so they may cross hosts. FSDP is not an axis: it shards over all ranks of a replica.

The sequence index of a rank (which chunk of the video tokens it holds) is `ring_rank * ulysses + ulysses_rank`,
so one Ulysses all-to-all gathers one contiguous ring block (USP layout).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, cast

from k6serve.config import ParallelConfig
from k6serve.models.plan import AttentionSite, ModelPlan

if TYPE_CHECKING:  # this module imports torch only inside the functions that use it
    from torch.distributed import ProcessGroup

AXES = ("dp", "cfg", "tp", "ring", "ulysses")
REPLICA_AXES = AXES[1:]


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class ParallelLayout:
    """The parallel degrees of one engine; world size = dp x cfg x tp x ring x ulysses."""

    dp: int = 1
    cfg: int = 1
    tp: int = 1
    ring: int = 1
    ulysses: int = 1
    fsdp: bool = False

    def __post_init__(self) -> None:
        assert all(self.degree(axis) >= 1 for axis in AXES), self
        assert self.cfg in (1, 2), "CFG-parallel has exactly two branches"

    @classmethod
    def from_config(cls, parallel: ParallelConfig) -> ParallelLayout:
        return cls(
            dp=parallel.dp_size,
            cfg=2 if parallel.enable_cfg_parallel else 1,
            tp=parallel.tp_size,
            ring=parallel.ring_degree,
            ulysses=parallel.ulysses_degree,
            fsdp=parallel.use_fsdp_inference,
        )

    def degree(self, axis: str) -> int:
        return getattr(self, axis)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.degree(axis) for axis in AXES)

    @property
    def world_size(self) -> int:
        return math.prod(self.shape)

    @property
    def replica_size(self) -> int:
        return self.world_size // self.dp

    @property
    def sequence_degree(self) -> int:
        return self.ring * self.ulysses

    def coordinates(self, rank: int) -> dict[str, int]:
        """The index of `rank` along every axis."""
        assert 0 <= rank < self.world_size, (rank, self.world_size)
        coordinates = {}
        for axis in reversed(AXES):
            rank, coordinates[axis] = divmod(rank, self.degree(axis))
        return {axis: coordinates[axis] for axis in AXES}

    def rank_at(self, coordinates: dict[str, int]) -> int:
        rank = 0
        for axis in AXES:
            rank = rank * self.degree(axis) + coordinates[axis]
        return rank

    def axis_groups(self, axis: str) -> list[list[int]]:
        """Every group of ranks that differ only along `axis`, in a fixed order (all ranks agree on it)."""
        others = [a for a in AXES if a != axis]
        groups = []
        for rank in range(self.world_size):
            coordinates = self.coordinates(rank)
            if coordinates[axis] == 0:
                groups.append([self.rank_at({**coordinates, axis: i}) for i in range(self.degree(axis))])
        assert len(groups) == math.prod(self.degree(a) for a in others)
        return groups

    def sequence_groups(self) -> list[list[int]]:
        """Ranks sharing one sequence-parallel group (ring x ulysses), ordered by sequence index."""
        groups = []
        for rank in range(self.world_size):
            coordinates = self.coordinates(rank)
            if coordinates["ring"] == 0 and coordinates["ulysses"] == 0:
                groups.append([
                    self.rank_at({**coordinates, "ring": r, "ulysses": u})
                    for r in range(self.ring)
                    for u in range(self.ulysses)
                ])
        return groups

    def replica_ranks(self, replica: int) -> list[int]:
        return list(range(replica * self.replica_size, (replica + 1) * self.replica_size))

    def replica_of(self, rank: int) -> int:
        return rank // self.replica_size

    def sequence_index(self, rank: int) -> int:
        coordinates = self.coordinates(rank)
        return coordinates["ring"] * self.ulysses + coordinates["ulysses"]


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _largest_divisor_within(value: int, limit: int) -> int:
    """The largest d <= limit with value % d == 0 and limit % d == 0 (so the GPU count is kept by scaling)."""
    return max(d for d in _divisors(value) if limit % d == 0)


def _check_tp(layout: ParallelLayout, attention: Sequence[AttentionSite], model_name: str) -> None:
    for site in attention:
        if site.num_heads % layout.tp:
            heads = sorted({s.num_heads for s in attention})
            valid = [d for d in _divisors(math.gcd(*heads)) if d > 1]
            alternative = (
                f"use --tp-size {max(d for d in valid if d <= layout.tp)}" if any(d <= layout.tp for d in valid)
                else "use --tp-size 1"
            )
            raise ValueError(
                f"{model_name}: tensor parallelism must divide the heads of every attention, but "
                f"'{site.role}' has {site.num_heads} heads and --tp-size is {layout.tp} (heads per attention: "
                f"{heads}; valid tp sizes: {[1, *valid]}). Fix: {alternative}, or put the remaining GPUs on "
                f"--ulysses-degree / --ring-degree."
            )


def _check_ulysses(
    layout: ParallelLayout, attention: Sequence[AttentionSite], sharded_roles: Sequence[str], model_name: str
) -> None:
    for site in attention:
        if site.role not in sharded_roles:
            continue  # replicated streams (text, audio) run whole on every rank: no head constraint
        local_heads = site.num_heads // layout.tp
        if local_heads % layout.ulysses:
            ulysses = _largest_divisor_within(local_heads, layout.ulysses)
            ring = layout.ring * layout.ulysses // ulysses
            raise ValueError(
                f"{model_name}: Ulysses must divide the TP-local heads of the sharded attention, but "
                f"'{site.role}' has {site.num_heads} heads / tp {layout.tp} = {local_heads} per rank and "
                f"--ulysses-degree is {layout.ulysses}. Fix: --ulysses-degree {ulysses} --ring-degree {ring} "
                f"(Ulysses{ulysses} x Ring{ring} uses the same GPUs; ring rotates whole K/V shards, so it "
                f"imposes no head constraint)."
            )
        _check_overlap_chunks(layout, site, local_heads // layout.ulysses, model_name)


def _check_overlap_chunks(layout: ParallelLayout, site: AttentionSite, rank_heads: int, model_name: str) -> None:
    """$K6SERVE_ULYSSES_CHUNKS must divide the heads each Ulysses rank attends to: checked with the layout, before
    the load, not by the first request's exchange (`ulysses._check_chunks`), minutes later."""
    from k6serve.parallel.ulysses import CHUNKS_ENVIRONMENT_VARIABLE, overlap_chunks_from_environment

    if layout.ulysses == 1:
        return  # no Ulysses exchange: the variable is not read (a leftover value must not refuse a TP or CFG run)
    chunks = overlap_chunks_from_environment()
    if chunks is not None and rank_heads % chunks:
        raise ValueError(
            f"{model_name}: ${CHUNKS_ENVIRONMENT_VARIABLE}={chunks} must divide the heads each Ulysses rank attends "
            f"to, but '{site.role}' has {site.num_heads} heads / tp {layout.tp} / ulysses {layout.ulysses} = "
            f"{rank_heads}. Fix: set it to one of {_divisors(rank_heads)}, or unset it."
        )


def _sequence_flags(layout: ParallelLayout, plan: ModelPlan, degree: int) -> str:
    """Flags that put `degree` sequence-parallel ranks on the model: Ulysses where it divides the TP-local heads of
    the sharded attention, the rest on Ring (which has no head constraint)."""
    heads = [site.num_heads // layout.tp for site in plan.attention if site.role in plan.sp.sharded_roles]
    ulysses = _largest_divisor_within(math.gcd(*heads), degree) if heads else degree
    ring = degree // ulysses
    # A --ring-degree already given is restated even at 1, so the command line does not keep the old one.
    return f"--ulysses-degree {ulysses}" + (f" --ring-degree {ring}" if ring > 1 or layout.ring > 1 else "")


def validate_degrees(layout: ParallelLayout) -> None:
    """The rules that hold for any model: FSDP needs a replica of several ranks and does not compose with TP."""
    if layout.fsdp and layout.replica_size == 1:
        same_gpus = (f"; or, on the same {layout.dp} GPUs, one replica: --dp-size 1 --ulysses-degree {layout.dp}"
                     if layout.dp > 1 else "")
        raise ValueError(
            "--use-fsdp-inference shards the DiT over the ranks of a replica, and this replica has one GPU. "
            f"Fix: drop --use-fsdp-inference, or give each replica more GPUs (e.g. --num-gpus {2 * layout.dp} "
            f"--ulysses-degree 2{same_gpus})."
        )
    if layout.fsdp and layout.tp > 1:
        raise ValueError(
            "--use-fsdp-inference shards whole parameters over the replica and cannot also shard them with "
            f"--tp-size {layout.tp}. Fix: use FSDP with --ulysses-degree {layout.tp * layout.ulysses} (same GPUs), "
            "or drop --use-fsdp-inference and keep TP."
        )


def validate_layout(layout: ParallelLayout, plan: ModelPlan, *, model_name: str, has_guidance: bool) -> None:
    """Raise ValueError naming the broken rule and a valid alternative when `layout` cannot run the model.

    `plan` is the model's plan (head counts, sharded roles, capabilities); `has_guidance` is False for
    checkpoints that run one forward per step (distilled generation, SR).
    """
    validate_degrees(layout)
    requested = {
        "tp": layout.tp > 1, "ulysses": layout.ulysses > 1, "ring": layout.ring > 1,
        "cfg_parallel": layout.cfg > 1, "fsdp": layout.fsdp,
    }
    for technique, on in requested.items():
        if technique == "cfg_parallel" and not has_guidance:
            continue  # the guidance message below is the more useful one
        if on and not getattr(plan.capabilities, technique):
            raise ValueError(
                f"{model_name} does not support {technique.replace('_', '-')}; use --ulysses-degree "
                f"{layout.replica_size} for the same GPUs instead."
            )
    if layout.cfg > 1 and not has_guidance:
        # The suggestion keeps the GPUs and must itself be valid: Ulysses only as far as it divides the heads.
        raise ValueError(
            f"{model_name} has no classifier-free guidance branch (it runs one forward per step), so "
            f"--enable-cfg-parallel would leave half the GPUs idle. Fix: drop --enable-cfg-parallel and use "
            f"{_sequence_flags(layout, plan, layout.cfg * layout.sequence_degree)} for the same GPUs."
        )
    _check_tp(layout, plan.attention, model_name)
    _check_ulysses(layout, plan.attention, plan.sp.sharded_roles, model_name)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ParallelGroups:
    """The process groups one rank uses. Groups of size 1 are real groups too, so callers never branch. Axes that
    name the same ranks share one group object (`build_groups`).

    `control` is a CPU (gloo) group over the replica, used to broadcast requests even when the model's
    groups are NCCL.
    """

    layout: ParallelLayout
    rank: int
    replica: int
    axis: dict[str, ProcessGroup]  # axis name -> its group (cfg, tp, ring, ulysses)
    sequence: ProcessGroup  # ring x ulysses, ranks ordered by sequence index
    replica_group: ProcessGroup  # every rank of the replica, model backend (FSDP shards over it)
    control: ProcessGroup  # every rank of the replica, gloo
    world_control: ProcessGroup  # every rank of every replica, gloo (the start-up broadcast of the engine's address)
    replica_ranks: tuple[int, ...]

    def axis_rank(self, axis: str) -> int:
        return self.layout.coordinates(self.rank)[axis]

    def axis_mesh(self, axis: str, device_type: str):
        """A 1-D DeviceMesh over this rank's group along `axis` ("replica" for the whole replica)."""
        from torch.distributed.device_mesh import DeviceMesh

        group = self.replica_group if axis == "replica" else self.axis[axis]
        return DeviceMesh.from_group(group, device_type)

    def device_mesh(self, device_type: str):
        """A DeviceMesh over this replica with named axes cfg, tp, ring, ulysses (built from our groups)."""
        import torch
        from torch.distributed.device_mesh import DeviceMesh

        layout = self.layout
        mesh = torch.arange(layout.world_size).reshape(layout.shape)[self.replica]
        return DeviceMesh.from_group(
            [self.axis[axis] for axis in REPLICA_AXES], device_type, mesh=mesh, mesh_dim_names=REPLICA_AXES
        )


def _default_group() -> ProcessGroup:
    import torch.distributed as dist

    # Typed optional for before `init_process_group`; `build_groups` has read the default group's backend already.
    return cast("ProcessGroup", dist.group.WORLD)


def build_groups(layout: ParallelLayout, rank: int, *, backend: str, timeout_s: float) -> ParallelGroups:
    """Create every group of the layout (all ranks must call this, in the same order) and keep ours."""
    import torch.distributed as dist

    timeout = timedelta(seconds=timeout_s)
    # One group per distinct (backend, ranks): with NCCL every group that runs a collective holds a communicator
    # (hundreds of MiB of device memory each, docs/parallelism.md), and several axes often name the same ranks
    # (Ulysses2 on two GPUs: the ulysses, sequence and replica groups are all ranks 0 and 1). Sharing one object is
    # safe because every rank issues its collectives in the same program order, whichever axis they belong to. torch
    # numbers a group's ranks in sorted order, so ranks given in another order make the same group. A group of
    # every rank on the default group's backend is the default group itself. One exception: FSDP's replica group.
    # A communicator runs its collectives one after another, and FSDP's prefetching all-gathers are meant to run
    # beside the sequence-parallel exchanges, so that group keeps its own communicator.
    made: dict[tuple[str, tuple[int, ...]], ProcessGroup] = {}
    default_backend, world_size = dist.get_backend(), dist.get_world_size()

    def create(groups: list[list[int]], group_backend: str, *, shared: bool = True) -> ProcessGroup:
        mine = None
        for ranks in groups:
            key = (group_backend, tuple(sorted(ranks)))
            if not shared:
                group = dist.new_group(ranks, timeout=timeout, backend=group_backend)
            elif key in made:
                group = made[key]
            else:  # the first group of these ranks
                whole_world = len(ranks) == world_size and group_backend == default_backend
                group = made[key] = (
                    _default_group() if whole_world
                    else dist.new_group(ranks, timeout=timeout, backend=group_backend)
                )
            if rank in ranks:
                mine = group
        assert mine is not None
        return mine

    replicas = [layout.replica_ranks(r) for r in range(layout.dp)]
    axis = {name: create(layout.axis_groups(name), backend) for name in REPLICA_AXES}
    sequence = create(layout.sequence_groups(), backend)
    replica_group = create(replicas, backend, shared=not layout.fsdp)
    control = replica_group if backend == "gloo" else create(replicas, "gloo")
    # The replica's gloo group when there is one replica, the default group when that is gloo.
    world_control = create([list(range(world_size))], "gloo")
    replica = layout.replica_of(rank)
    return ParallelGroups(
        layout=layout, rank=rank, replica=replica, axis=axis, sequence=sequence, replica_group=replica_group,
        control=control, world_control=world_control, replica_ranks=tuple(replicas[replica]),
    )
