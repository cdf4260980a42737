"""The server's LoRA state, kept in the job store so that jobs queued before a restart run with the adapters they
were created under.

The state is the shortest list of operations that rebuilds the adapters the worker holds:
- every adapter loaded but not active (a `SetLora` replaced it, or an unmerge deactivated it), loaded again by one
  dynamic `SetLora` followed by an `UnmergeLora`, since a job queued before the restart may name it in its own
  `loras` (the `--lora-path` adapter, which the worker loads at start, is left out unless set again since);
- then the active ones: the last `SetLora` (every spec with its path written out, since a restarted worker has no
  adapter cache to resolve `path=None` from) and the `MergeLora` after it (merges in a row folded into one, at the
  last strength given: a merge rebuilds from the base weights); or, after an `UnmergeLora` or an empty
  `SetLora`, an `UnmergeLora`, which also takes the `--lora-path` adapter out again (an empty list would bring it back
  active, though the jobs queued since were created without it).
An `UnloadLora` is not replayed: the adapters it drops leave the first step. The runner records the state after each
successful change and replays it at start, before any job is dispatched.

Beside it the state keeps what the worker holds (`Adapters`: the nicknames loaded, the active adapters and whether
they are merged), folded from the `--lora-path` adapter and each successful operation with the worker's own rules,
and predicts it after the operations queued before a new job: `JobRunner._check_loras` checks the job's `loras`
against that.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any

from k6serve.lora.spec import (
    ListLoras,
    LoraOperation,
    LoraSpec,
    MergeLora,
    SetLora,
    UnloadLora,
    UnmergeLora,
    set_lora_merge_mode,
)

# `Adapters.mode` after a LoRA operation that dp replicas disagree on (`ReplicasDisagree`): merged on some maybe.
MODE_VARIES = "varies"


@dataclass(frozen=True, slots=True)
class Adapters:
    """What the worker holds: `loaded`, the nicknames of the adapters it has read (active or not); `active`, the
    active ones (strengths as applied); `mode`, how those are applied: "merge", "dynamic", None when none is active,
    or `MODE_VARIES` (then `active` is not known)."""

    loaded: frozenset[str] = frozenset()
    active: tuple[LoraSpec, ...] = ()
    mode: str | None = None

    def after(self, operation: LoraOperation, *, server_merge_mode: str, fsdp: bool) -> Adapters:
        """The adapters once `operation` has run, assuming it succeeds unless the worker refuses it for sure (then
        nothing changes, as the worker changes nothing on a refusal): a SetLora that reuses (path None) a nickname
        not loaded, or whose merge mode the layout refuses (merge under FSDP), and a MergeLora with no adapter active
        or under FSDP. `server_merge_mode` (--lora-merge-mode) and `fsdp` resolve "auto" as the worker does."""
        if isinstance(operation, SetLora):
            try:
                mode = set_lora_merge_mode(operation.merge_mode, server_merge_mode=server_merge_mode, fsdp=fsdp)
            except ValueError:
                return self
            if any(spec.path is None and spec.nickname not in self.loaded for spec in operation.specs):
                return self
            return Adapters(self.loaded | {spec.nickname for spec in operation.specs}, operation.specs,
                            mode if operation.specs else None)
        if isinstance(operation, MergeLora):
            if self.mode is None or fsdp:
                return self
            active = self.active if operation.strength is None else tuple(
                dataclasses.replace(spec, strength=operation.strength) for spec in self.active)
            return Adapters(self.loaded, active, "merge")
        if isinstance(operation, UnmergeLora):
            return Adapters(self.loaded)
        if isinstance(operation, UnloadLora):
            nicknames = set(operation.nicknames)
            if not nicknames <= self.loaded or nicknames & {spec.nickname for spec in self.active}:
                return self  # the worker refuses an adapter it does not hold or one that is active
            return Adapters(self.loaded - nicknames, self.active, self.mode)
        return self


class LoraState:
    """The replay list (`operations`), where each nickname's adapter was loaded from and with which alpha override
    (to write out `path=None` and to load inactive adapters again), and the adapters the worker holds now (`now`,
    `loaded`).

    The worker holds the `--lora-path` adapter (`start`, applied as `server_merge_mode` says) and each one a
    successful `SetLora` loaded (a failed one changes nothing). No operation drops an adapter: deactivated ones stay
    cached, and a restart loads them again."""

    def __init__(self, operations: list[LoraOperation] | None = None, *, start: SetLora | None = None,
                 server_merge_mode: str = "auto", fsdp: bool = False):
        self.server_merge_mode = server_merge_mode  # --lora-merge-mode: what a SetLora's "auto" means
        self.fsdp = fsdp  # --use-fsdp-inference: "auto" is dynamic, a merge refused
        self.start = start
        self.paths: dict[str, str] = {}
        self.alphas: dict[str, float | None] = {}  # the alpha override of each nickname's last successful SetLora
        self.now = Adapters()
        # The operations that make the active adapters: None while they are still the start's (nothing recorded),
        # [] once deactivated.
        self._active: list[LoraOperation] | None = None
        if start is not None:
            self._loaded_by(start)
            self.now = self.after([start])
        for operation in operations or []:
            self.record(operation)

    def _loaded_by(self, operation: SetLora) -> None:
        self.paths.update((spec.nickname, spec.path) for spec in operation.specs if spec.path)
        self.alphas.update((spec.nickname, spec.alpha) for spec in operation.specs)

    def record(self, operation: LoraOperation) -> bool:
        """Fold a successful `operation` in; True when the replay list changed (and needs saving)."""
        self.now = self.after([operation])
        if isinstance(operation, ListLoras):
            return False
        if isinstance(operation, UnloadLora):
            # Not replayed: the adapters leave the list that loads the inactive ones again (the --lora-path adapter
            # is loaded at every start all the same: the flag asks for it).
            for nickname in operation.nicknames:
                self.paths.pop(nickname, None)
                self.alphas.pop(nickname, None)
            return True
        if isinstance(operation, UnmergeLora):
            self._active = []
        elif isinstance(operation, MergeLora):
            # A merge rebuilds the merged weights from the base at the strength it gives (one without a strength
            # keeps the strengths the adapters have), so of merges in a row only the last strength given matters:
            # one merge stands for them, and the list a restart replays stays as long as the adapters, not as the
            # number of strength changes (300 merges were 300 replayed merges, each rewriting every adapted weight).
            earlier = self._active or []
            if earlier and isinstance(earlier[-1], MergeLora):
                strength = earlier[-1].strength if operation.strength is None else operation.strength
                operation = dataclasses.replace(operation, strength=strength)
                earlier = earlier[:-1]
            self._active = [*earlier, operation]
        else:
            specs = tuple(dataclasses.replace(spec, path=_as_replayable(spec.path) or self.paths.get(spec.nickname))
                          for spec in operation.specs)
            operation = dataclasses.replace(operation, specs=specs)
            self._loaded_by(operation)
            self._active = [operation] if specs else []
        return True

    @property
    def operations(self) -> list[LoraOperation]:
        """The operations that rebuild the adapters on a worker that has just loaded the `--lora-path` adapter."""
        start = {spec.nickname: spec for spec in self.start.specs} if self.start is not None else {}
        first = self._active[0] if self._active else None
        # The active adapters: the SetLora's, or the start's when only merges followed it
        active = [spec.nickname for spec in first.specs] if isinstance(first, SetLora) else list(start) if first else []
        inactive = tuple(LoraSpec(nickname=nickname, path=path, alpha=self.alphas.get(nickname))
                         for nickname, path in self.paths.items()
                         if nickname in self.now.loaded and nickname not in active
                         # the start adapter as it was given: the worker has loaded it already
                         and not (nickname in start and (start[nickname].path, start[nickname].alpha) == (
                             path, self.alphas.get(nickname))))
        replay: list[LoraOperation] = []
        if inactive:
            replay += [SetLora(specs=inactive, merge_mode="dynamic"), UnmergeLora()]
        if self._active:
            replay += self._active
        elif self._active == [] and self.start is not None and not inactive:
            replay.append(UnmergeLora())
        return replay

    def inactive_reload(self) -> SetLora | None:
        """The replay list's step that loads the inactive adapters again, if it has one: by construction
        (`operations`) a first SetLora followed by an UnmergeLora."""
        replay = self.operations
        if len(replay) >= 2 and isinstance(replay[0], SetLora) and isinstance(replay[1], UnmergeLora):
            return replay[0]
        return None

    def forget(self, nicknames: set[str]) -> None:
        """Adapters that could not be loaded again at a restart (their file gone): no longer held, nor replayed."""
        for nickname in nicknames:
            self.paths.pop(nickname, None)
            self.alphas.pop(nickname, None)
        self.now = Adapters(self.now.loaded - nicknames, self.now.active, self.now.mode)

    def replicas_disagree(self) -> None:
        """A LoRA operation succeeded on some dp replicas only: whether their adapters are merged is not known."""
        self.now = Adapters(self.now.loaded, (), MODE_VARIES)

    def after(self, operations: list[LoraOperation]) -> Adapters:
        """The adapters the worker will hold once `operations` have run in order (see `Adapters.after`)."""
        adapters = self.now
        for operation in operations:
            adapters = adapters.after(operation, server_merge_mode=self.server_merge_mode, fsdp=self.fsdp)
        return adapters

    @property
    def loaded(self) -> frozenset[str]:
        """The nicknames of the adapters the worker holds now, active or not."""
        return self.now.loaded

    def to_json(self) -> list[dict[str, Any]]:
        return [{"type": type(operation).__name__, **_fields(operation)} for operation in self.operations]

    @classmethod
    def from_json(cls, items: list[dict[str, Any]], *, start: SetLora | None = None, server_merge_mode: str = "auto",
                  fsdp: bool = False) -> LoraState:
        operations: list[LoraOperation] = []
        for item in items:
            fields = {key: value for key, value in item.items() if key != "type"}
            if item["type"] == "SetLora":
                fields["specs"] = tuple(LoraSpec(**spec) for spec in fields["specs"])
                operations.append(SetLora(**fields))
            elif item["type"] == "MergeLora":
                operations.append(MergeLora(**fields))
            elif item["type"] == "UnmergeLora":
                operations.append(UnmergeLora(**fields))
            else:
                raise ValueError(f"unknown LoRA operation {item['type']!r} in the job store")
        return cls(operations, start=start, server_merge_mode=server_merge_mode, fsdp=fsdp)


def _as_replayable(path: str | None) -> str | None:
    """A local adapter path made absolute: the worker resolved a relative one against the server's working folder,
    and a restart from another folder could not rebuild it ("cannot be rebuilt"). Hub ids stay as they are."""
    if path is not None and not os.path.isabs(path) and os.path.exists(path):
        return os.path.abspath(path)
    return path


def _fields(operation: LoraOperation) -> dict[str, Any]:
    values = {field.name: getattr(operation, field.name) for field in dataclasses.fields(operation)}
    if "specs" in values:
        values["specs"] = [dataclasses.asdict(spec) for spec in values["specs"]]
    return values
