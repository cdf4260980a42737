"""Cache-DiT request parameters (torch-free: the CLI, the HTTP schema and the request resolver import it).

Names and meanings are cache-dit's `DBCacheConfig` / `TaylorSeerCalibratorConfig` / `steps_mask` (1.5.3), so a
`cache_dit_params` object written for the reference server works here unchanged, but for its DMD keys (enable_dmd,
dmd_*, secondary), which are refused as unknown. The defaults are the reference
server's native-backend ones (F1B0, 4 warmup steps, threshold 0.24, at most 3 cached steps in a row); cache-dit's
own dataclass defaults (F8B0, 8 steps, 0.08, no limit) are tuned for image models with 28+ steps.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import numbers
from collections.abc import Mapping
from pathlib import Path
from typing import Any

SCM_PRESETS = ("none", "slow", "medium", "fast", "ultra")
SCM_POLICIES = ("dynamic", "static")


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class CacheDitParams:
    """One request's DBCache settings. Steps count denoising steps (one per scheduler step, whatever the CFG)."""

    # Blocks always computed first: their output residual, compared with the last computed step's, decides.
    Fn_compute_blocks: int = 1
    # Blocks always computed last, after the cached middle residual is added (0: none).
    Bn_compute_blocks: int = 0
    # Steps 0, warmup_interval, 2*warmup_interval, ... below max_warmup_steps always compute.
    max_warmup_steps: int = 4
    warmup_interval: int = 1
    # Relative L1 distance of the Fn residuals under which the middle blocks are skipped; 0 never skips on the
    # distance, >= 1 always does.
    residual_diff_threshold: float = 0.24
    max_cached_steps: int = -1  # per CFG branch and request; -1: no limit
    max_continuous_cached_steps: int = 3  # -1: no limit
    # Forecast the skipped residual from the computed ones by a Taylor expansion of this order.
    enable_taylorseer: bool = False
    taylorseer_order: int = 1
    # Step computation mask: which steps must compute (1) and which may use the cache (0), from a preset or
    # from alternating compute / cache run lengths. "static": every 0 step uses the cache; "dynamic": a 0 step
    # still has to pass the threshold and the limits.
    scm_preset: str = "none"
    scm_compute_bins: tuple[int, ...] | None = None
    scm_cache_bins: tuple[int, ...] | None = None
    scm_policy: str = "dynamic"

    def __post_init__(self) -> None:
        _check_int("Fn_compute_blocks", self.Fn_compute_blocks, minimum=1,
                   why="the first blocks' residual is what decides whether a step can use the cache")
        _check_int("Bn_compute_blocks", self.Bn_compute_blocks, minimum=0)
        _check_int("max_warmup_steps", self.max_warmup_steps, minimum=0)
        _check_int("warmup_interval", self.warmup_interval, minimum=1)
        _check_int("max_cached_steps", self.max_cached_steps, minimum=-1)
        _check_int("max_continuous_cached_steps", self.max_continuous_cached_steps, minimum=-1)
        _check_int("taylorseer_order", self.taylorseer_order, minimum=1)
        threshold = self.residual_diff_threshold
        if isinstance(threshold, bool) or not isinstance(threshold, numbers.Real) or not threshold >= 0 or \
                threshold == float("inf"):
            raise ValueError(f"cache_dit_params.residual_diff_threshold must be a finite number >= 0, got "
                             f"{threshold!r}")
        if not isinstance(self.enable_taylorseer, bool):
            raise ValueError(f"cache_dit_params.enable_taylorseer must be true or false, got "
                             f"{self.enable_taylorseer!r}")
        if self.scm_preset not in SCM_PRESETS:
            raise ValueError(f"cache_dit_params.scm_preset must be one of {SCM_PRESETS}, got {self.scm_preset!r}")
        if self.scm_policy not in SCM_POLICIES:
            raise ValueError(f"cache_dit_params.scm_policy must be one of {SCM_POLICIES}, got {self.scm_policy!r}")
        bins = (self.scm_compute_bins, self.scm_cache_bins)
        if (bins[0] is None) != (bins[1] is None):
            raise ValueError("cache_dit_params: give scm_compute_bins and scm_cache_bins together (compute / cache "
                             "run lengths that alternate, e.g. [4, 2, 2] and [1, 2]), or neither.")
        if bins[0] is not None:
            if self.scm_preset != "none":
                raise ValueError(f"cache_dit_params: scm_preset {self.scm_preset!r} and explicit scm_*_bins both "
                                 "define the step mask; give one of them.")
            for name, values in (("scm_compute_bins", bins[0]), ("scm_cache_bins", bins[1])):
                if not isinstance(values, tuple) or not values or not all(
                        isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in values):
                    raise ValueError(f"cache_dit_params.{name} must be a non-empty list of integers >= 1, "
                                     f"got {values!r}")

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any], *, base: CacheDitParams | None = None) -> CacheDitParams:
        """`base` (default: the defaults) with the keys of `values` replaced; unknown keys are refused."""
        if not isinstance(values, Mapping):
            raise ValueError(f"cache_dit_params must be a JSON object, got {type(values).__name__}")
        names = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(values) - set(names))
        if unknown:
            from k6serve.request import did_you_mean  # imported here: request.py imports this module

            # A typo (residual_diff_treshold) gets the key it resembles, as a mistyped flag or field does.
            raise ValueError(f"Unknown cache_dit_params key(s) {unknown}{did_you_mean(unknown, names)}. Valid keys: "
                             f"{names}.")
        # Any: JSON values, which the dataclass's __post_init__ checks.
        changes: dict[str, Any] = {key: tuple(value) if key.endswith("_bins") and isinstance(value, list) else value
                                   for key, value in values.items()}
        return dataclasses.replace(base or cls(), **changes)

    @property
    def uses_step_mask(self) -> bool:
        return self.scm_preset != "none" or self.scm_compute_bins is not None

    def check_against(self, *, num_blocks: int, num_steps: int) -> None:
        """Raise ValueError when these settings cannot run on a DiT of `num_blocks` for `num_steps` steps."""
        self.check_blocks(num_blocks)
        self.steps_mask(num_steps)

    def check_blocks(self, num_blocks: int, *, source: str = "cache_dit_params") -> None:
        """Raise ValueError unless Fn + Bn leave a block of a DiT of `num_blocks` to cache; `source` names where
        the settings came from (the request's field, or --cache-dit-config)."""
        if self.Fn_compute_blocks + self.Bn_compute_blocks >= num_blocks:
            raise ValueError(
                f"{source}: Fn_compute_blocks ({self.Fn_compute_blocks}) + Bn_compute_blocks "
                f"({self.Bn_compute_blocks}) must leave at least one of the DiT's {num_blocks} fused blocks to "
                f"cache; lower them to a sum of at most {num_blocks - 1}.")

    def steps_mask(self, num_steps: int) -> tuple[int, ...] | None:
        """The step computation mask for `num_steps` steps (1 = compute), or None without one."""
        if not self.uses_step_mask:
            return None
        if self.scm_compute_bins is not None and self.scm_cache_bins is not None:  # given together (__post_init__)
            covered = sum(self.scm_compute_bins) + sum(self.scm_cache_bins)
            if covered < num_steps:
                raise StepMaskMismatch(
                    f"cache_dit_params: scm_compute_bins and scm_cache_bins cover {covered} steps; the request has "
                    f"{num_steps}. Lengthen the bins to cover every step.",
                    what=f"scm_compute_bins and scm_cache_bins cover {covered} steps")
            return tuple(_bins_mask(list(self.scm_compute_bins), list(self.scm_cache_bins), num_steps))
        if num_steps < 8 and num_steps not in (4, 6):
            raise StepMaskMismatch(
                f"cache_dit_params.scm_preset needs 4, 6 or at least 8 steps, the request has {num_steps}; drop "
                "scm_preset or give scm_compute_bins / scm_cache_bins.",
                what=f"scm_preset {self.scm_preset!r} needs 4, 6 or at least 8 steps")
        return tuple(_preset_mask(self.scm_preset, num_steps))


class StepMaskMismatch(ValueError):
    """A step computation mask that cannot run a request's steps. The message is worded for the request's own
    `cache_dit_params`; `what` says what the mask needs, for a mask that came from the engine's --cache-dit-config."""

    def __init__(self, message: str, *, what: str = "") -> None:
        super().__init__(message)  # the one positional argument, as copy and pickle rebuild it
        self.what = what


def parse_cache_dit_config(value: Any) -> CacheDitParams:
    """`--cache-dit-config`: a mapping, a JSON object string, or the path of a .json / .yaml / .yml file. Every
    error names the flag, and the file when one was given (an unknown key in a file read "Unknown cache_dit_params
    key(s)", with neither)."""
    if isinstance(value, CacheDitParams):
        return value
    source = "--cache-dit-config"
    if isinstance(value, str):
        text = value.strip()
        if not text.startswith("{"):
            path = Path(text)
            source = f"--cache-dit-config {value!r}"
            try:
                text = path.read_text(encoding="utf-8-sig")  # UTF-8 whatever the locale, as --config
            except OSError as exc:
                raise ValueError(f"{source} is neither a JSON object nor a readable file "
                                 f"({exc.strerror or exc}).") from None
            except UnicodeDecodeError as exc:
                raise ValueError(f"{source} is not UTF-8 text ({exc.reason} at byte {exc.start + 1}); save it as "
                                 "UTF-8.") from None
            if path.suffix.lower() in (".yaml", ".yml"):  # cache.YAML too, not read as JSON
                import yaml

                try:
                    mapping = yaml.safe_load(text)
                except yaml.YAMLError as exc:
                    raise ValueError(f"{source} is not valid YAML: {exc}") from None
                return _from_config(mapping, source)
        try:
            value = json.loads(text)
        except json.JSONDecodeError as exc:
            if source == "--cache-dit-config":  # the flag's own text
                raise ValueError(f"--cache-dit-config is not a valid JSON object ({exc}); e.g. "
                                 '\'{"residual_diff_threshold": 0.12}\', or a .json / .yaml file.') from None
            raise ValueError(f"{source} is not valid JSON ({exc}); write a JSON object of cache_dit_params keys, "
                             'e.g. {"residual_diff_threshold": 0.12}, or YAML in a .yaml file.') from None
    return _from_config(value, source)


def _from_config(value: Any, source: str) -> CacheDitParams:
    if value is None:
        return CacheDitParams()  # an empty file or `{}`: every setting at its default
    if not isinstance(value, Mapping):
        raise ValueError(f"{source} must hold a mapping of cache_dit_params keys, got {type(value).__name__}")
    try:
        return CacheDitParams.from_mapping(value)
    except ValueError as exc:
        raise ValueError(f"{source}: {exc}") from None


def _check_int(name: str, value: Any, *, minimum: int, why: str = "") -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        reason = f" ({why})" if why else ""
        raise ValueError(f"cache_dit_params.{name} must be an integer >= {minimum}{reason}, got {value!r}")


# The two functions below port cache-dit 1.5.3's `_steps_mask` / `steps_mask` (cache_interface.py, Apache-2.0,
# Copyright (c) 2025 Cache-DiT Authors) so the presets give the same masks; test_cache_dit.py holds its outputs.
def _bins_mask(compute_bins: list[int], cache_bins: list[int], total_steps: int) -> list[int]:
    mask: list[int] = []
    compute_bins, cache_bins = compute_bins[::-1], cache_bins[::-1]  # used as stacks
    while len(mask) < total_steps:
        if compute_bins:
            mask.extend([1] * compute_bins.pop())
        if cache_bins:
            mask.extend([0] * cache_bins.pop())
    return mask[:total_steps]


# Tuned by cache-dit for 28 steps; shorter runs truncate them, longer ones stretch them.
_PRESETS_28 = {
    "slow": ([8, 3, 3, 2, 1, 1], [1, 2, 2, 2, 3]),
    "medium": ([6, 2, 2, 2, 2, 1], [1, 3, 3, 3, 3]),
    "fast": ([6, 1, 1, 1, 1, 1], [1, 3, 4, 5, 4]),
    "ultra": ([4, 1, 1, 1, 1], [2, 5, 6, 7]),
}
# For distilled models with 9-15 steps, 9 steps, and 8 steps.
_PRESETS_9_TO_15 = {
    "slow": ([4, 2, 2, 2, 1], [1, 1, 1, 1]),
    "medium": ([4, 2, 1, 1, 1], [1, 1, 2, 2]),
    "fast": ([3, 1, 1, 1, 1], [1, 2, 2, 3]),
    "ultra": ([2, 1, 1, 1, 1], [1, 2, 3, 3]),
}
_PRESETS_9 = {"slow": ([5, 2, 1], [1]), "medium": ([5, 1, 1], [1, 1]), "fast": ([4, 1, 1], [1, 2]),
              "ultra": ([3, 1, 1], [2, 2])}
_PRESETS_8 = {"slow": ([5, 1, 1], [1]), "medium": ([4, 1, 1], [1, 1]), "fast": ([3, 1, 1], [1, 2]),
              "ultra": ([2, 1, 1], [2, 2])}


def _policy_length(policy: tuple[list[int], list[int]]) -> int:
    return sum(policy[0]) + sum(policy[1])


def _truncate(policy: tuple[list[int], list[int]], total_steps: int) -> None:
    """Shorten the last cache bin, then the last compute bin, alternately, until the policy fits."""
    compute_bins, cache_bins = policy
    while _policy_length(policy) > total_steps:
        if cache_bins:
            cache_bins[-1] -= 1
            if cache_bins[-1] == 0:
                cache_bins.pop()
        if _policy_length(policy) <= total_steps:
            break
        if compute_bins:
            compute_bins[-1] -= 1
            if compute_bins[-1] == 0:
                compute_bins.pop()


def _stretch(policy: tuple[list[int], list[int]], total_steps: int) -> None:
    """Grow every bin in proportion (as cache-dit does beyond 28 steps), then truncate to `total_steps`."""
    original_compute, original_cache = copy.deepcopy(policy)
    shortest = min(len(policy[0]), len(policy[1]))
    while _policy_length(policy) < total_steps:
        for i in range(shortest):
            policy[0][i] += max(int(original_compute[i] * ((total_steps / 28) * 0.5)), 1)
            if _policy_length(policy) >= total_steps:
                break
            policy[1][i] += max(int(original_cache[i] * ((total_steps / 28) * 0.5)), 1)
            if _policy_length(policy) >= total_steps:
                break
        if _policy_length(policy) >= total_steps:
            break
        policy[0][-1] += 1


def _preset_mask(preset: str, total_steps: int) -> list[int]:
    if total_steps >= 16:
        policy = copy.deepcopy(_PRESETS_28[preset])
        if total_steps > 28:
            _stretch(policy, total_steps)
    elif total_steps >= 8:
        table = _PRESETS_8 if total_steps == 8 else _PRESETS_9 if total_steps == 9 else _PRESETS_9_TO_15
        policy = copy.deepcopy(table[preset])
    else:
        policy = ([2, 1], [1]) if total_steps == 4 else ([3, 1], [2])
    _truncate(policy, total_steps)
    mask = _bins_mask(policy[0], policy[1], total_steps)
    mask[-1] = 1  # the last step always computes
    return mask
