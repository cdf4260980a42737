"""`LoraManager`: which adapters are active on a DiT, and whether they are merged into its weights or added at run
time. It runs between requests, on every rank, through `ModelWorker.apply_lora_operation`.

* merge: W <- (W.float() + sum strength * (alpha / rank) * B.float() @ A.float()).to(W.dtype), in place on the
  weight's current storage. In-place matters twice: the `nn.Parameter` objects are shared with offloading and
  compiled graphs, and under `--performance-mode balanced / memory` the weight's `.data` is the host copy between
  requests, which every later stage copies to the GPU. Each Linear's original weight is snapshotted to the CPU
  (no GPU memory spent) before its first change; restoring `.copy_`s it back into the same storage, bit for bit.
* dynamic: weights untouched; the targeted Linears are wrapped (`dynamic.LoraLinear`) to add the update per call.
  Costs two thin GEMMs per targeted Linear and call, but set / unset is instant and exact by construction.
* PEFT's variants, as PEFT applies them (tests/parity/test_lora_parity.py): a lora_B bias adds strength *
  (alpha / rank) * bias to the layer's bias (merged; refused on a layer without one, as PEFT's merge refuses it) or
  to its output (dynamic). DoRA (`use_dora`) makes the weight m / ||W + s B A|| * (W + s B A), the norm per output
  row over the base weight W (not the weight with earlier adapters merged, as PEFT's `_unmerged_base_weight`),
  s = strength * alpha / rank in both places (PEFT's `set_scale`): so a DoRA adapter at strength 0 still rescales
  the rows to its magnitudes, as in PEFT. Stacked on other adapters of the same layer, it also scales the rows
  of the ones before it (PEFT's order: its forward scales the output so far, its merge the weight so far); the
  bias is not scaled (PEFT's unfused forward does scale an earlier adapter's lora_B bias, unlike its merge: both
  our modes follow the merge). An Embedding's LoRA is that of the Linear whose weight is the table transposed.
* auto: merge, except dynamic under FSDP (the reference server's rule). Merged weights make the steps as fast as
  without an adapter.

Sharded weights (`sharding.py`): under tensor parallelism each rank merges its block of B @ A into its local shard
(and snapshots only that); dynamic wrappers add the update to the local output (see `dynamic.py`). Under FSDP a
block's weight is a shard between requests and gathered whole inside the forward: dynamic adds the update there,
merge is refused (FSDP's root unit may keep a gathered copy that a merge into the shard would not reach). DoRA's
row norms on a shard (`dora.py`) are local where the rank holds whole rows (column-parallel, FSDP's Linears) and
all-reduced over the shard's group where it holds input columns (row-parallel, FSDP's Embedding).

Several adapters may target the same Linear: their updates add up (summed in fp32, rounded once when merged).
Adapters stay cached by nickname after deactivation, so `LoraSpec(path=None)` reactivates one without re-reading.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

import torch
from torch import nn

from k6serve.lora.adapter import LoraAdapter, read_adapter
from k6serve.lora.dora import DoraCache, row_norms
from k6serve.lora.dynamic import LoraDelta, LoraEmbedding, LoraLinear
from k6serve.lora.sharding import ShardedWeight, local_tensor
from k6serve.lora.spec import (
    AppliedMode,
    LoraAdapterState,
    LoraOperation,
    LoraSpec,
    MergeLora,
    SetLora,
    UnloadLora,
    UnmergeLora,
    check_lora_alpha,
    check_lora_strength,
    resolve_merge_mode,
    set_lora_merge_mode,
)
from k6serve.lora.state_dict import LoraModule
from k6serve.lora.targets import LoraTarget, check_mergeable, linear_view, resolve_targets

if TYPE_CHECKING:
    from k6serve.config import EngineConfig

logger = logging.getLogger(__name__)


@dataclass(eq=False, slots=True)
class _Active:
    """An adapter in use: its strength, alpha override and resolved targets (aligned with `adapter.modules`)."""

    nickname: str
    adapter: LoraAdapter
    strength: float
    alpha: float | None  # LoraSpec.alpha; None: the file's, else rank
    targets: list[LoraTarget]

    def scale(self, module: LoraModule) -> float:
        alpha = self.alpha if self.alpha is not None else module.alpha if module.alpha is not None else module.rank
        return self.strength * alpha / module.rank

    def updates(self):
        """(target, module, scale) for each module of the adapter."""
        for target, module in zip(self.targets, self.adapter.modules.values(), strict=True):
            yield target, module, self.scale(module)


class LoraManager:
    """The LoRA adapters of one model (the generation DiT): cache, active list, merged or dynamic application."""

    def __init__(self, model: nn.Module, *, fsdp: bool = False) -> None:
        self.model = model
        self.fsdp = fsdp  # the DiT's blocks are FSDP units: dynamic only
        self.adapters: dict[str, LoraAdapter] = {}  # nickname -> adapter, active or not
        self.active: list[_Active] = []
        # nickname -> the alpha override of its last successful set (None: the file's). A request's own `loras`
        # name adapters by nickname and strength only: without this they ran at the file's alpha, silently not
        # the --lora-alpha / set_lora lora_alpha the adapter was loaded with.
        self.alphas: dict[str, float | None] = {}
        self.applied_mode: AppliedMode | None = None  # while `active` is applied
        # (layer, "weight" | "bias") -> the original tensor of each merged layer, on the CPU
        self.snapshots: dict[tuple[nn.Module, str], torch.Tensor] = {}
        self.wrappers: list[tuple[LoraTarget, LoraLinear | LoraEmbedding]] = []
        self.dora_rows = DoraCache()  # dynamic DoRA's row factors, kept across switches of adapters
        # Counts the times the model's weights or modules were changed: the worker drops a memory release's kept
        # host copy after an operation that changed them, and keeps it after a refusal, which changes nothing.
        self.num_changes = 0

    def set(self, specs: tuple[LoraSpec, ...] | list[LoraSpec], merge_mode: str = "auto") -> None:
        """Replace the active adapters by `specs` (empty: none), applied as `merge_mode`.

        Every adapter is read and checked against the model before anything changes, so a bad file or nickname
        leaves the current adapters as they were."""
        mode = resolve_merge_mode(merge_mode, fsdp=self.fsdp)
        for spec in specs:
            check_lora_strength(spec.strength, "strength")
            if spec.alpha is not None:
                check_lora_alpha(spec.alpha, "lora_alpha")
        nicknames = [spec.nickname for spec in specs]
        if len(set(nicknames)) != len(nicknames):
            raise ValueError(f"each LoRA nickname may appear once per request, got {nicknames}")
        loaded = {spec.nickname: self._adapter(spec) for spec in specs}
        active = [_Active(spec.nickname, loaded[spec.nickname], float(spec.strength), spec.alpha,
                          resolve_targets(self.model, loaded[spec.nickname].modules, source=loaded[spec.nickname].path))
                  for spec in specs]
        if mode == "merge":
            _check_mergeable(active)
        try:
            self._switch(active, mode)
            self.adapters.update(loaded)
            self.alphas.update((spec.nickname, spec.alpha) for spec in specs)
        finally:  # an adapter replaced under its nickname (or never stored) keeps no cached rows alive
            self.dora_rows.retain({id(module) for adapter in self.adapters.values()
                                   for module in adapter.modules.values()})

    def merge(self, strength: float | None = None) -> None:
        """Merge the active adapters into the weights (from dynamic, or again at `strength` for all of them)."""
        if not self.active:
            raise ValueError("no LoRA adapter is active: set one first (set_lora with a path)")
        if self.fsdp:
            raise ValueError("the LoRA adapters cannot be merged with --use-fsdp-inference: the weights are FSDP "
                             "shards between requests. The active adapters stay dynamic, as they are; nothing changed.")
        if strength is not None:
            check_lora_strength(strength, "strength")
        # merge_lora_weights has no merge_mode: the fix is to leave the adapters dynamic, as they are
        _check_mergeable(self.active, fix="they stay dynamic (which adds the bias at run time), as they are; nothing "
                                          "changed.")
        self._switch([entry if strength is None else dataclasses.replace(entry, strength=float(strength))
                      for entry in self.active], "merge")

    def unmerge(self) -> None:
        """Deactivate every adapter and restore the base weights bit for bit (the adapters stay cached)."""
        self.num_changes += 1
        self._restore()
        self.active = []

    def unload(self, nicknames: tuple[str, ...] | list[str]) -> None:
        """Drop loaded adapters that are not active (their tensors go with their last reference); an unknown or
        active nickname raises ValueError and nothing changes."""
        unknown = [nickname for nickname in nicknames if nickname not in self.adapters]
        if unknown:
            raise ValueError(f"no LoRA adapter is loaded under the nickname(s) {', '.join(map(repr, unknown))} "
                             f"(loaded: {', '.join(self.adapters) or 'none'}); nothing was unloaded.")
        active = [entry.nickname for entry in self.active if entry.nickname in nicknames]
        if active:
            raise ValueError(f"the LoRA adapter(s) {', '.join(map(repr, active))} are active: deactivate them first "
                             "(set_lora with the adapters to keep active, or unmerge_lora_weights for none), then "
                             "unload; nothing was unloaded.")
        for nickname in nicknames:
            del self.adapters[nickname]
            self.alphas.pop(nickname, None)
        self.dora_rows.retain({id(module) for adapter in self.adapters.values() for module in adapter.modules.values()})

    def check_request(self, loras: tuple[tuple[str, float], ...]) -> None:
        """Raise the ValueError `for_request(loras)` would raise before changing anything."""
        # Unknown names first: switching the engine's adapters to dynamic would not make this request run.
        unknown = [nickname for nickname, _ in loras if nickname not in self.adapters]
        if unknown:
            raise ValueError(f"this request names LoRA adapter(s) {unknown} that are not loaded (loaded: "
                             f"{', '.join(self.adapters) or 'none'}); load them first with set_lora or --lora-path.")
        if self.applied_mode == "merge":
            raise ValueError("this request chooses its LoRA adapters, but the engine's adapters are merged into the "
                             "weights; switch them to dynamic (set_lora with merge_mode 'dynamic', or start with "
                             "--lora-merge-mode dynamic) or unmerge them to choose adapters per request.")
        for nickname, strength in loras:
            check_lora_strength(strength, f"loras[{nickname!r}]")

    @contextlib.contextmanager
    def for_request(self, loras: tuple[tuple[str, float], ...]) -> Iterator[None]:
        """Run one request with exactly `loras` ((nickname, strength) of cached adapters; empty: none), added
        dynamically; the adapters active before come back afterwards, whatever happened.

        Refused while the active adapters are merged: restoring and re-merging the weights around every request
        would copy every targeted weight twice per request."""
        self.check_request(loras)
        previous = self.active
        requested = [_Active(nickname, self.adapters[nickname], float(strength), self.alphas.get(nickname),
                             resolve_targets(self.model, self.adapters[nickname].modules,
                                             source=self.adapters[nickname].path))
                     for nickname, strength in loras]
        self._switch(requested, "dynamic", log=False)  # per request: the worker logs the request, not each swap
        try:
            yield
        finally:
            try:
                # On failure, the base model: `_switch`'s own fallback, the adapters active before the switch, would
                # be this request's, serving every later request.
                self._switch(previous, "dynamic", log=False, fallback=[])
            except Exception as exc:
                lost = ", ".join(f"{entry.nickname} x{entry.strength:g}" for entry in previous)
                logger.error("LoRA: the engine's adapters (%s) could not be put back after a request's own; none is "
                             "active now", lost)
                raise RuntimeError(
                    f"This request ran with its own LoRA adapters, but the engine's ({lost}) could not be put back "
                    f"after it ({type(exc).__name__}: {exc}): no adapter is active now, so later requests run the base "
                    "model. Set them again (set_lora with their nicknames, or restart the server)."
                ) from exc

    def prepare(self, device: torch.device) -> None:
        """Ready the dynamic wrappers for a request on `device` (`LoraLinear.prepare`), so that the compiled blocks'
        first call runs the same code as every later one. Under FSDP they read the layout in the forward, as before."""
        if self.fsdp:
            return
        for _, wrapper in self.wrappers:
            wrapper.prepare(device)

    def state(self) -> list[LoraAdapterState]:
        """One JSON-able dict per cached adapter, the active ones first in activation order."""
        by_nickname = {entry.nickname: entry for entry in self.active}
        ordered = [*by_nickname, *(nickname for nickname in self.adapters if nickname not in by_nickname)]
        rows: list[LoraAdapterState] = []
        for nickname in ordered:
            adapter, entry = self.adapters[nickname], by_nickname.get(nickname)
            override = entry.alpha if entry is not None else self.alphas.get(nickname)  # what a request would use
            alpha = override if override is not None else adapter.file_alpha
            rows.append({
                "nickname": nickname,
                "path": adapter.path,
                "rank": adapter.rank,
                "alpha": float(alpha if alpha is not None else adapter.rank),
                "strength": entry.strength if entry is not None else None,
                "num_modules": len(adapter.modules),
                # PEFT's variants the file carries (state_dict.py): DoRA magnitudes, lora_B biases, an Embedding's pair
                "dora": any(module.magnitude is not None for module in adapter.modules.values()),
                "lora_bias": any(module.bias is not None for module in adapter.modules.values()),
                "embedding": any(module.embedding for module in adapter.modules.values()),
                "active": entry is not None,
                "merged": entry is not None and self.applied_mode == "merge",
                "merge_mode": self.applied_mode if entry is not None else None,
            })
        return rows

    def _adapter(self, spec: LoraSpec) -> LoraAdapter:
        cached = self.adapters.get(spec.nickname)
        if spec.path is None:
            if cached is None:
                known = ", ".join(self.adapters) or "none"
                raise ValueError(f"no LoRA adapter is loaded under the nickname {spec.nickname!r} (loaded: {known}); "
                                 "pass its path to load it")
            return cached
        # The same path under the same nickname is the cached adapter, unless its file changed since it was read
        # (an adapter retrained and saved over it); another path replaces it.
        if cached is not None and cached.path == spec.path and cached.unchanged():
            return cached
        return read_adapter(spec.path)

    def _switch(self, active: list[_Active], mode: AppliedMode, *, log: bool = True,
                fallback: list[_Active] | None = None) -> None:
        """Make `active` the applied adapters, as `mode`. A failure part-way (say, out of memory while merging)
        restores the base weights and puts the previous adapters (or `fallback`, [] for the base model) back as they
        were before raising: a half-merged DiT, or adapters listed as active but never applied, would otherwise serve
        every later request."""
        previous, previous_mode = self.active, self.applied_mode
        if fallback is not None:
            previous = fallback
        self.num_changes += 1
        self._restore()
        self.active = active
        try:
            if active:
                self._apply(mode, log=log)
        except BaseException:
            self._restore()
            self.active = previous
            if previous:
                try:
                    # adapters are active only while applied, so the previous ones had a mode
                    self._apply(cast(AppliedMode, previous_mode), log=False)
                except BaseException:
                    self._restore()  # the base model, rather than part of the previous adapters
                    self.active = []
                    logger.error("LoRA: the previous adapters could not be put back either; none is active now")
            raise

    def _apply(self, mode: AppliedMode, *, log: bool = True) -> None:
        if mode == "merge":
            self._merge()
        else:
            self._install_dynamic()
        self.applied_mode = mode
        if log:
            logger.info("LoRA %s: %s", mode,
                        ", ".join(f"{entry.nickname} x{entry.strength:g}" for entry in self.active))

    def _merge(self) -> None:
        # Group by (layer, rows) so that adapters sharing a layer are summed in fp32 and rounded once.
        updates: dict[tuple[nn.Linear | nn.Embedding, int, int], list[tuple[LoraModule, float]]] = {}
        for entry in self.active:
            for target, module, scale in entry.updates():
                key = (target.layer, target.rows.start, target.rows.stop)
                updates.setdefault(key, []).append((module, scale))
        with torch.inference_mode():  # also when the weights were loaded as inference tensors
            for (layer, start, stop), terms in updates.items():
                shard = ShardedWeight.of(layer)
                weight = self._snapshot(layer, "weight")  # this rank's block under tensor parallelism
                view = linear_view(layer, weight)
                rows = view[start:stop] if shard.dim is None else view  # fused slices are never sharded
                rows.copy_(_merged_rows(rows, terms, shard))  # a view of the weight's storage: the merge is in place
                if any(module.bias is not None for module, _ in terms):
                    bias = self._snapshot(layer, "bias")
                    bias_rows = bias[start:stop] if shard.dim is None else bias
                    merged = bias_rows.float()
                    for module, scale in terms:
                        if module.bias is not None:  # PEFT: bias += lora_B.bias * scaling
                            merged = merged + shard.slice_rows(module.bias).to(bias.device, torch.float32) * scale
                    bias_rows.copy_(merged)

    def _snapshot(self, layer: nn.Module, name: str) -> torch.Tensor:
        """The local storage of `layer.<name>`, its original copied to the CPU before the first change."""
        tensor = local_tensor(getattr(layer, name))
        if (layer, name) not in self.snapshots:
            self.snapshots[layer, name] = tensor.to("cpu", copy=True)
        return tensor

    def _install_dynamic(self) -> None:
        wrappers: dict[nn.Module, LoraLinear | LoraEmbedding] = {}
        lora_biases: dict[tuple[nn.Module, int, int], list[torch.Tensor]] = {}  # the earlier deltas' biases, per rows
        for entry in self.active:
            for target, module, scale in entry.updates():
                wrapper = wrappers.get(target.layer)
                if wrapper is None:
                    wrapper = (LoraEmbedding if isinstance(target.layer, nn.Embedding) else LoraLinear)(target.layer)
                    wrappers[target.layer] = wrapper
                    setattr(target.parent, target.attribute, wrapper)
                    self.wrappers.append((target, wrapper))
                earlier = lora_biases.setdefault((target.layer, target.rows.start, target.rows.stop), [])
                factor = shift = None
                if module.magnitude is not None:
                    rows = self.dora_rows.rows(target, module, scale)
                    factor = rows.factor
                    bias = _bias_so_far(rows.bias, earlier)
                    shift = None if bias is None else (1 - factor) * bias
                elif module.bias is not None:
                    earlier.append(module.bias.float() * scale)
                wrapper.deltas.append(LoraDelta(module.down, module.up, scale, target.rows,
                                                full_width=not target.is_fused_slice, bias=module.bias, factor=factor,
                                                shift=shift))

    def _restore(self) -> None:
        """Put every wrapped layer back and copy every snapshot back into its tensor's storage."""
        for target, _ in self.wrappers:
            setattr(target.parent, target.attribute, target.layer)
        self.wrappers = []
        with torch.inference_mode():  # also when the weights were loaded as inference tensors
            for (layer, name), snapshot in self.snapshots.items():
                local_tensor(getattr(layer, name)).copy_(snapshot)
        self.snapshots = {}
        self.applied_mode = None


def _check_mergeable(active: list[_Active], **fix: str) -> None:
    for entry in active:
        check_mergeable(entry.targets, entry.adapter.modules, source=entry.adapter.path, **fix)


def _merged_rows(rows: torch.Tensor, terms: list[tuple[LoraModule, float]], shard: ShardedWeight) -> torch.Tensor:
    """The fp32 weight rows with every term applied in order: + scale * B A, or DoRA's m / ||W + scale B A|| *
    (rows so far + scale * B A) with W the original `rows` (PEFT's DoRA merge, in the same ops)."""
    merged = rows.to(torch.float32, copy=True)  # `rows` stays the original until the caller copies this back
    for module, scale in terms:
        up, down = shard.slice_update(module.up, module.down)
        delta = scale * (up.to(rows.device, torch.float32) @ down.to(rows.device, torch.float32))
        if module.magnitude is None:
            merged += delta
        else:  # DoRA; on a shard, this rank's rows of the magnitudes, and the norms completed over its group
            norm = row_norms(rows.float() + delta, shard)
            factor = shard.slice_rows(module.magnitude).to(rows.device, torch.float32) / norm
            merged = factor[:, None] * (merged + delta)
    return merged


def _bias_so_far(base: torch.Tensor | None, lora_biases: list[torch.Tensor]) -> torch.Tensor | None:
    """The bias the target's rows get before a DoRA delta (fp32, CPU): the layer's own (`base`, all the rows) and the
    earlier deltas' (None: none); DoRA leaves it unscaled."""
    terms = ([] if base is None else [base]) + lora_biases
    return sum(terms[1:], terms[0]) if terms else None


def run_lora_operation(manager, operation: LoraOperation, config: EngineConfig) -> str:
    """Run a SetLora / MergeLora / UnmergeLora on `manager`; the reply's message."""
    if isinstance(operation, SetLora):
        # The HTTP server predicts the mode with the same function (`JobRunner._check_loras`).
        merge_mode = set_lora_merge_mode(operation.merge_mode, server_merge_mode=config.model.lora_merge_mode,
                                         fsdp=config.parallel.use_fsdp_inference)
        manager.set(operation.specs, merge_mode)
        names = ", ".join(spec.nickname for spec in operation.specs)
        return f"LoRA adapters active: {names}" if names else "no LoRA adapter active"
    if isinstance(operation, MergeLora):
        manager.merge(operation.strength)
        return "LoRA adapters merged into the weights"
    if isinstance(operation, UnmergeLora):
        manager.unmerge()
        return "LoRA adapters deactivated; base weights restored"
    if isinstance(operation, UnloadLora):
        manager.unload(operation.nicknames)
        return f"LoRA adapters unloaded: {', '.join(operation.nicknames)}"
    raise TypeError(f"not a LoRA operation: {operation!r}")
