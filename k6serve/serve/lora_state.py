"""The server's LoRA state, kept in the job store so that jobs queued before a restart run with the adapters they
were created under.

The state is the shortest list of operations that rebuilds the adapters: the last `SetLora` (every spec with its
path written out, since a restarted worker has no adapter cache to resolve `path=None` from) and the `MergeLora`s
after it; an `UnmergeLora` or a `SetLora` with no specs empties it. The runner records it after each successful
change and replays it at start, before any job is dispatched.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from k6serve.lora.spec import ListLoras, LoraOperation, LoraSpec, MergeLora, SetLora, UnmergeLora


class LoraState:
    """The replay list, and where each nickname's adapter was loaded from (to write out `path=None`).

    The nicknames in `paths` are also the adapters the worker holds (`loaded`): the `--lora-path` one and each one a
    successful `SetLora` loaded (a failed one changes nothing). No operation drops an adapter, deactivated ones stay
    cached; only a restart does, rebuilding the replay list's adapters, from which `paths` is rebuilt too."""

    def __init__(self, operations: list[LoraOperation] | None = None, *, start_adapter: tuple[str, str] | None = None):
        self.operations: list[LoraOperation] = list(operations or [])
        # The adapter `--lora-path` loaded at start, under `--lora-nickname`.
        self.paths: dict[str, str] = dict([start_adapter]) if start_adapter else {}
        for operation in self.operations:
            if isinstance(operation, SetLora):
                self.paths.update((spec.nickname, spec.path) for spec in operation.specs if spec.path)

    def record(self, operation: LoraOperation) -> bool:
        """Fold a successful `operation` in; True when the state changed (and needs saving)."""
        if isinstance(operation, ListLoras):
            return False
        if isinstance(operation, UnmergeLora):
            self.operations = []
        elif isinstance(operation, MergeLora):
            self.operations.append(operation)
        else:
            specs = tuple(dataclasses.replace(spec, path=_as_replayable(spec.path) or self.paths.get(spec.nickname))
                          for spec in operation.specs)
            self.paths.update((spec.nickname, spec.path) for spec in specs if spec.path)
            self.operations = [dataclasses.replace(operation, specs=specs)] if specs else []
        return True

    @property
    def loaded(self) -> frozenset[str]:
        """The nicknames of the adapters the worker holds now, active or not."""
        return frozenset(self.paths)

    def to_json(self) -> list[dict[str, Any]]:
        return [{"type": type(operation).__name__, **_fields(operation)} for operation in self.operations]

    @classmethod
    def from_json(cls, items: list[dict[str, Any]], *, start_adapter: tuple[str, str] | None = None) -> LoraState:
        operations: list[LoraOperation] = []
        for item in items:
            fields = {key: value for key, value in item.items() if key != "type"}
            if item["type"] == "SetLora":
                fields["specs"] = tuple(LoraSpec(**spec) for spec in fields["specs"])
                operations.append(SetLora(**fields))
            elif item["type"] == "MergeLora":
                operations.append(MergeLora(**fields))
            else:
                raise ValueError(f"unknown LoRA operation {item['type']!r} in the job store")
        return cls(operations, start_adapter=start_adapter)


def loaded_after(loaded: frozenset[str], operations: list[LoraOperation]) -> frozenset[str]:
    """The nicknames the worker will hold after `operations` run in order, from `loaded`, assuming each succeeds
    unless it cannot: a `SetLora` that reuses (path None) a nickname not held then fails and loads nothing."""
    nicknames = set(loaded)
    for operation in operations:
        if isinstance(operation, SetLora) and all(spec.path is not None or spec.nickname in nicknames
                                                  for spec in operation.specs):
            nicknames.update(spec.nickname for spec in operation.specs)
    return frozenset(nicknames)


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
