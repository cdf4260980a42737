"""DBCache for the fused-block stack: one request's state, and the runner the stack delegates to.

Per DiT call (one CFG branch of one step), as cache-dit 1.5.3's `CachedBlocks_Pattern_Base.forward`:

1. the first `Fn_compute_blocks` blocks run; their video residual R_F = h_F - h_0 is this call's fingerprint;
2. the step may use the cache if it is past warmup, its step mask allows it, the cached-step limits allow it, and
   the relative L1 distance sum|R_F - R_F'| / sum|R_F'| to the fingerprint R_F' of the branch's last computed
   step is below `residual_diff_threshold` (static mask steps skip the distance);
3. cached: the middle blocks are skipped and their residuals of the last computed step (video and audio, or
   TaylorSeer forecasts of them) are added to h_F; computed: they run and their residuals are kept;
4. the last `Bn_compute_blocks` blocks run either way.

A call that computes runs exactly the blocks and ops of the uncached model, so a request whose every step
computes (e.g. warmup covering all steps) is bit for bit the uncached one. CFG branches keep separate state
(cache-dit's separate-CFG contexts), found by which `TextEmbeddings` the branch was called with.

Departures from cache-dit, both for sequence parallelism: the distance is summed in fp32 over the real tokens of
every rank's shard and reduced over the sequence group (`sequence_token_sum_of`), so every rank decides the same;
cache-dit averages bf16 per-rank means (equal only for equal, unpadded shards).

Shape legend: B batch, L video tokens (this rank's shard under sequence parallelism), A audio tokens, D model dim.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, cast

import torch
import torch.distributed as dist
from torch import Tensor, nn

from k6serve.caching.params import CacheDitParams
from k6serve.parallel.cfg import cfg_group_of
from k6serve.parallel.sequence_parallel import sequence_token_sum_of

if TYPE_CHECKING:  # the DiT's module is imported by whoever built it
    from k6serve.models.kandinsky6.transformer import Kandinsky6Transformer

POSITIVE, NEGATIVE = "positive", "negative"


class TaylorSeer:
    """cache-dit's `TaylorSeerState` as DBCache uses it: `update` with each computed value, `approximate` on a
    cached step (finite differences over computed steps, a Taylor series in the steps since the last one)."""

    def __init__(self, order: int) -> None:
        self.order = order
        self.derivatives: list[Tensor | None] = [None] * (order + 1)
        self.current_step = -1
        self.last_computed_step = -1

    def mark_step_begin(self) -> None:
        self.current_step += 1

    def update(self, value: Tensor) -> None:
        derivatives: list[Tensor | None] = [value] + [None] * self.order
        window = self.current_step - self.last_computed_step
        for i in range(self.order):
            # As cache-dit: no derivative before the third call (its `current_step > 1`).
            previous, current = self.derivatives[i], derivatives[i]
            if previous is None or self.current_step <= 1:
                break
            assert current is not None  # the value, or the derivative the last iteration set
            derivatives[i + 1] = (current - previous) / window
        self.derivatives = derivatives
        self.last_computed_step = self.current_step

    def approximate(self) -> Tensor:
        elapsed = self.current_step - self.last_computed_step
        output: Tensor | int = 0
        for i, derivative in enumerate(self.derivatives):
            if derivative is None:
                break
            output = output + (1 / math.factorial(i)) * derivative * (elapsed**i)
        if isinstance(output, int):  # the callers wait for a computed step (`has_residuals`, `derivatives[0]`)
            raise RuntimeError("TaylorSeer.approximate before its first update: no computed step to forecast from")
        return output


@dataclasses.dataclass(eq=False)
class BranchState:
    """One CFG branch's cache: the last computed step's fingerprint and middle residuals, and its history."""

    fingerprint_BLD: Tensor | None = None  # R_F of the last computed step
    video_residual_BLD: Tensor | None = None  # the middle blocks' residuals (when TaylorSeer is off)
    audio_residual_BAD: Tensor | None = None
    taylor: tuple[TaylorSeer, TaylorSeer] | None = None  # (video, audio) with TaylorSeer on
    cached_steps: list[int] = dataclasses.field(default_factory=list)
    continuous_cached_steps: int = 0
    residual_diffs: dict[int, float] = dataclasses.field(default_factory=dict)

    @property
    def has_residuals(self) -> bool:
        # A computed step has happened. Not "a TaylorSeer exists": it is made with the branch, so with no warm-up
        # steps (max_warmup_steps 0) the first steps skipped blocks never computed, adding a residual of 0 (or
        # comparing against no fingerprint, a crash).
        return self.fingerprint_BLD is not None and (self.taylor is not None or self.video_residual_BLD is not None)

    def keep_residuals(self, video_BLD: Tensor, audio_BAD: Tensor | None) -> None:
        if self.taylor is not None:
            video_taylor, audio_taylor = self.taylor
            video_taylor.update(video_BLD)
            if audio_BAD is not None:
                audio_taylor.update(audio_BAD)
        else:
            self.video_residual_BLD, self.audio_residual_BAD = video_BLD, audio_BAD

    def residuals(self) -> tuple[Tensor, Tensor | None]:
        if self.taylor is not None:
            video_taylor, audio_taylor = self.taylor
            audio = audio_taylor.approximate() if audio_taylor.derivatives[0] is not None else None
            return video_taylor.approximate(), audio
        if self.video_residual_BLD is None:  # callers check `has_residuals` first
            raise RuntimeError("no computed step's residuals to reuse")
        return self.video_residual_BLD, self.audio_residual_BAD


class BlockCacheSession:
    """One request's DBCache state; installed as the fused-block stack's runner by `block_cache`."""

    def __init__(self, params: CacheDitParams, *, num_steps: int, num_blocks: int,
                 token_sum: Callable[[Tensor], Tensor], cfg_group: dist.ProcessGroup | None = None) -> None:
        params.check_against(num_blocks=num_blocks, num_steps=num_steps)
        self.params = params
        self.cfg_group = cfg_group
        self.num_steps, self.num_blocks = num_steps, num_blocks
        self.token_sum = token_sum
        self.mask = params.steps_mask(num_steps)
        warmup_limit = params.max_warmup_steps
        if self.mask is not None:
            # cache-dit: warmup never reaches past the mask's leading run of compute steps.
            leading = next((i for i, m in enumerate(self.mask) if m == 0), len(self.mask))
            warmup_limit = min(warmup_limit, leading)
        self.warmup_steps = frozenset(range(0, warmup_limit, params.warmup_interval))
        self.branches: dict[str, BranchState] = {}
        self.step = -1
        self.branch = POSITIVE

    # -- driven by the denoising loop --------------------------------------------------------------------------
    def begin_step(self, index: int) -> None:
        self.step = index

    def branch_aware(self, predict_fn: Callable, conditioning) -> Callable:
        """`predict_fn` that first selects the branch state of the `TextEmbeddings` it is called with."""

        def predict(transformer, hidden, latents, text, timestep):
            self.branch = NEGATIVE if text is conditioning.negative else POSITIVE
            return predict_fn(transformer, hidden, latents, text, timestep)

        return predict

    # -- the stack's runner --------------------------------------------------------------------------------------
    def __call__(self, blocks: nn.ModuleList, video_BLD: Tensor, audio_BAD: Tensor | None,
                 block_kwargs: dict) -> tuple[Tensor, Tensor | None]:
        assert len(blocks) == self.num_blocks, (len(blocks), self.num_blocks)
        state = self._begin_call()
        first, last = self.params.Fn_compute_blocks, self.num_blocks - self.params.Bn_compute_blocks

        def run(selected, video, audio):
            for block in selected:
                video, audio = block(video_BLD=video, audio_BAD=audio, **block_kwargs)
            return video, audio

        video_in_BLD = video_BLD
        video_BLD, audio_BAD = run(blocks[:first], video_BLD, audio_BAD)
        fingerprint_BLD = video_BLD - video_in_BLD
        del video_in_BLD
        if self._can_use_cache(state, fingerprint_BLD):
            state.cached_steps.append(self.step)
            state.continuous_cached_steps += 1
            video_residual_BLD, audio_residual_BAD = state.residuals()
            video_BLD = video_residual_BLD + video_BLD
            if audio_BAD is not None and audio_residual_BAD is not None:
                audio_BAD = audio_residual_BAD + audio_BAD
        else:
            state.fingerprint_BLD = fingerprint_BLD
            middle_video_BLD, middle_audio_BAD = video_BLD, audio_BAD
            video_BLD, audio_BAD = run(blocks[first:last], video_BLD, audio_BAD)
            state.keep_residuals(video_BLD - middle_video_BLD,
                                 audio_BAD - middle_audio_BAD if audio_BAD is not None else None)
        return run(blocks[last:], video_BLD, audio_BAD)

    def _begin_call(self) -> BranchState:
        state = self.branches.get(self.branch)
        if state is None:
            state = self.branches[self.branch] = BranchState()
            if self.params.enable_taylorseer:
                state.taylor = (TaylorSeer(self.params.taylorseer_order), TaylorSeer(self.params.taylorseer_order))
        if not state.cached_steps or state.cached_steps[-1] != self.step - 1:
            state.continuous_cached_steps = 0
        if state.taylor is not None:
            for taylor in state.taylor:
                taylor.mark_step_begin()
        return state

    def _can_use_cache(self, state: BranchState, fingerprint_BLD: Tensor) -> bool:
        """cache-dit's `can_cache` + `similarity`, in its order (`max_accumulated_residual_diff_threshold`,
        off by default there, is not offered)."""
        params, step = self.params, self.step
        if step in self.warmup_steps or not state.has_residuals:
            return False
        if self.mask is not None:  # one entry per step of the request
            if self.mask[step] == 1:
                return False
            if params.scm_policy == "static":
                return True
        if 0 <= params.max_cached_steps <= len(state.cached_steps):
            return False
        if 0 <= params.max_continuous_cached_steps <= state.continuous_cached_steps:
            return False
        threshold = params.residual_diff_threshold
        if threshold <= 0.0:
            return False
        if threshold >= 1.0:
            state.residual_diffs[step] = -1.0  # cache-dit's marker for "always similar"
            return True
        previous_BLD = state.fingerprint_BLD  # set with the residuals (`has_residuals`), same shape all request
        if previous_BLD is None:
            raise RuntimeError("no computed step's fingerprint to compare with")
        distance_L = (previous_BLD - fingerprint_BLD).abs().float().sum(dim=(0, 2))
        reference_L = previous_BLD.abs().float().sum(dim=(0, 2))
        sums = self.token_sum(torch.stack([distance_L, reference_L]))
        diff = (sums[0] / sums[1]).item()  # the one host sync of a step: the decision steers the host
        state.residual_diffs[step] = diff
        return diff < threshold

    # -- reporting -----------------------------------------------------------------------------------------------
    def share_branches(self) -> None:
        """CFG-parallel: each rank of the cfg group ran (and cached) one guidance branch, so the request's note and
        `cache_dit_cached_calls` named the leader's branch only; take the other rank's cached steps and distances.
        A collective: every rank of the cfg group calls it, after the denoising loop. Nothing without the group."""
        if self.cfg_group is None:
            return
        records: list[object] = [None] * dist.get_world_size(self.cfg_group)
        dist.all_gather_object(records, {name: (state.cached_steps, state.residual_diffs)
                                         for name, state in self.branches.items()}, group=self.cfg_group)
        # Each rank's {branch: (cached steps, distances)}, as gathered above.
        for record in cast("list[dict[str, tuple[list[int], dict[int, float]]]]", records):
            for name, (cached_steps, residual_diffs) in record.items():
                if name not in self.branches:
                    self.branches[name] = BranchState(cached_steps=list(cached_steps),
                                                      residual_diffs=dict(residual_diffs))
        # In the order one process runs them: conditional, then unconditional.
        self.branches = {name: self.branches[name] for name in (POSITIVE, NEGATIVE) if name in self.branches}

    @property
    def num_cached_calls(self) -> int:
        return sum(len(state.cached_steps) for state in self.branches.values())

    def describe(self) -> str:
        """What the request cached, and the range of the distances it measured (to tune the threshold by)."""
        params = self.params
        middle = self.num_blocks - params.Fn_compute_blocks - params.Bn_compute_blocks
        parts = [f"{name}: steps {', '.join(map(str, state.cached_steps)) or 'none'}"
                 for name, state in self.branches.items()]
        distances = [d for state in self.branches.values() for d in state.residual_diffs.values() if d >= 0]
        measured = (f"; residual distances {min(distances):.3g}-{max(distances):.3g} against threshold "
                    f"{params.residual_diff_threshold:g}" if distances else "")
        return (f"Cache-DiT skipped the middle {middle} of {self.num_blocks} DiT blocks on {self.num_cached_calls} of "
                f"{self.num_steps * max(1, len(self.branches))} calls ({'; '.join(parts)}; steps count from 0"
                f"{measured}).")


@contextlib.contextmanager
def block_cache(transformer: Kandinsky6Transformer, params: CacheDitParams, *,
                num_steps: int) -> Iterator[BlockCacheSession]:
    """Run `transformer`'s fused blocks through a fresh DBCache session for one request; the uncached stack is
    back when the block exits, whatever happened."""
    stack = transformer.fused_blocks
    if stack.runner is not None:
        raise RuntimeError("the DiT's fused-block stack already has a runner; one cached request at a time")
    session = BlockCacheSession(params, num_steps=num_steps, num_blocks=len(transformer.visual_transformer_blocks),
                                token_sum=sequence_token_sum_of(transformer), cfg_group=cfg_group_of(transformer))
    stack.runner = session
    try:
        yield session
    finally:
        stack.runner = None
