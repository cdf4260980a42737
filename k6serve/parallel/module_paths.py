"""Resolve the module globs of a `ModelPlan` ("blocks.*.attn.to_query") to a model's submodules.

`*` matches exactly one dotted path component (one block index); everything else must match literally.
"""

from __future__ import annotations

from fnmatch import fnmatchcase

from torch import nn


def _matches(name: str, glob: str) -> bool:
    parts, glob_parts = name.split("."), glob.split(".")
    return len(parts) == len(glob_parts) and all(
        fnmatchcase(part, pattern) for part, pattern in zip(parts, glob_parts)
    )


def match_modules(model: nn.Module, glob: str) -> list[tuple[str, nn.Module]]:
    """Every (name, module) of `model` whose dotted name matches `glob`; at least one must match."""
    found = [(name, module) for name, module in model.named_modules() if name and _matches(name, glob)]
    assert found, f"the plan names {glob!r} but the model has no such module"
    return found


def parent_list(model: nn.Module, name: str) -> tuple[nn.ModuleList, int] | None:
    """The `nn.ModuleList` that holds `name` directly and its index there, or None."""
    parent_name, _, index = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    if isinstance(parent, nn.ModuleList) and index.isdigit():
        return parent, int(index)
    return None
