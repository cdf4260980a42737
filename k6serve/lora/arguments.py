"""The LoRA calls' arguments checked and built into their operations (`lora/spec.py`): `DiffGenerator.set_lora`,
`merge_lora_weights`, `unmerge_lora_weights` and `unload_lora`, and the HTTP routes' bodies (`serve/lora_routes.py`),
so both refuse a bad argument before it queues, each naming it as its caller spells it. Torch-free, as `spec.py`."""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from k6serve.lora.spec import (
    LORA_MERGE_MODES,
    LORA_TARGETS,
    LoraSpec,
    MergeLora,
    SetLora,
    UnloadLora,
    UnmergeLora,
    check_lora_alpha,
    check_lora_strength,
    odd_nickname,
)


class LoraArgumentError(ValueError):
    """A bad LoRA argument; `argument` is its name as the caller spelled it (the HTTP field, or the keyword)."""

    def __init__(self, argument: str, message: str) -> None:
        super().__init__(message)
        self.argument = argument


def _lora_number(value: Any, argument: str, check: Callable[[float, str], None]) -> float:
    """`value` as a float, refused unless a number that `check` (`check_lora_strength`, `check_lora_alpha`: finite,
    within the bound) accepts: the HTTP routes build their operations here too, so both refuse it before it queues."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise LoraArgumentError(argument, f"{argument} must be a finite number, got {value!r}.")
    try:
        number = float(value)
    except OverflowError:  # an int past float's range
        number = math.inf if value > 0 else -math.inf
    try:
        check(number, argument)
    except ValueError as exc:
        raise LoraArgumentError(argument, str(exc)) from None
    return number


def _lora_choice(value: Any, argument: str, choices: tuple[str, ...]) -> str:
    if not isinstance(value, str) or value not in choices:
        raise LoraArgumentError(argument, f"{argument} must be one of {', '.join(map(repr, choices))}, got {value!r}.")
    return value


def _lora_list(value: Any, argument: str, length: int, nickname_argument: str) -> list[Any]:
    if not isinstance(value, (list, tuple)):
        raise LoraArgumentError(argument, f"{argument} must be a list as long as {nickname_argument} ({length}) "
                                          f"when {nickname_argument} is a list, got {value!r}.")
    if len(value) != length:
        raise LoraArgumentError(argument, f"{argument} has {len(value)} entries but {nickname_argument} has "
                                          f"{length}; give one per adapter.")
    return list(value)


# `set_lora`'s path: one, or one per nickname (None: the adapter already loaded), pathlib paths too; a Sequence, since
# a list[str] is no list[str | None] to a type checker (lists are invariant), and a tuple is taken as a list.
LoraPaths = str | os.PathLike[str] | Sequence[str | os.PathLike[str] | None] | None

# The HTTP bodies' names of the LoRA calls' arguments (POST /v1/set_lora, /v1/unload_lora), by the Python name.
HTTP_LORA_NAMES = {"nickname": "lora_nickname", "path": "lora_path"}


def set_lora_operation(nickname: str | list[str], path: LoraPaths = None,
                       strength: float | Sequence[float] = 1.0, *, merge_mode: str = "auto",
                       target: str | list[str] = "all",
                       lora_alpha: float | None = None, names: Mapping[str, str] | None = None) -> SetLora:
    """Check `DiffGenerator.set_lora`'s arguments (also the HTTP body's) and build the operation; a bad one raises
    LoraArgumentError naming it as `names` spells it (e.g. {"nickname": "lora_nickname"} for HTTP)."""
    names = {"nickname": "nickname", "path": "path", **(names or {})}
    name_arg, path_arg = names["nickname"], names["path"]
    many = isinstance(nickname, (list, tuple))
    nicknames = list(nickname) if isinstance(nickname, (list, tuple)) else [nickname]  # as `many`, for the checker
    for item in nicknames:
        if not isinstance(item, str) or not item.strip():
            raise LoraArgumentError(name_arg, f"{name_arg} must be a non-empty string or a list of them, got "
                                              f"{nickname!r}.")
        if odd_nickname(item):
            raise LoraArgumentError(name_arg, f"{name_arg} {odd_nickname(item)}")
    if len(set(nicknames)) != len(nicknames):
        raise LoraArgumentError(name_arg, f"{name_arg} names an adapter more than once: {nicknames!r}.")
    if many:
        paths = [None] * len(nicknames) if path is None else _lora_list(path, path_arg, len(nicknames), name_arg)
    elif isinstance(path, (list, tuple)):
        raise LoraArgumentError(path_arg, f"{path_arg} is a list but {name_arg} is one name; give a list of "
                                          f"{name_arg} too.")
    else:
        paths = [path]
    paths = [os.fspath(p) if isinstance(p, os.PathLike) else p for p in paths]
    for entry in paths:
        if entry is not None and (not isinstance(entry, str) or not entry.strip()):
            raise LoraArgumentError(path_arg, f"{path_arg} must be a non-empty string (a .safetensors file, a folder "
                                              f"holding one, or a hub id) or None, got {entry!r}.")
    if isinstance(strength, (list, tuple)):
        if not many:
            raise LoraArgumentError("strength", f"strength is a list but {name_arg} is one name; give a list of "
                                                f"{name_arg} too.")
        strengths = [_lora_number(s, "strength", check_lora_strength)
                     for s in _lora_list(strength, "strength", len(nicknames), name_arg)]
    else:
        strengths = [_lora_number(strength, "strength", check_lora_strength)] * len(nicknames)
    if isinstance(target, (list, tuple)):
        # SGLang's one target per adapter: Kandinsky 6 has one DiT, which "all" and "transformer" both name, so a
        # list of them is that one target (it was refused as "must be one of 'all', 'transformer'").
        target = [_lora_choice(item, "target", LORA_TARGETS)
                  for item in _lora_list(target, "target", len(nicknames), name_arg)][0]
    alpha = None if lora_alpha is None else _lora_number(lora_alpha, "lora_alpha", check_lora_alpha)
    specs = tuple(LoraSpec(nickname=n, path=p, strength=s, alpha=alpha)
                  for n, p, s in zip(nicknames, paths, strengths))
    return SetLora(specs=specs, merge_mode=_lora_choice(merge_mode, "merge_mode", LORA_MERGE_MODES),
                   target=_lora_choice(target, "target", LORA_TARGETS))


def merge_lora_operation(target: str = "all", strength: float | None = None) -> MergeLora:
    return MergeLora(target=_lora_choice(target, "target", LORA_TARGETS),
                     strength=None if strength is None else _lora_number(strength, "strength", check_lora_strength))


def unmerge_lora_operation(target: str = "all") -> UnmergeLora:
    return UnmergeLora(target=_lora_choice(target, "target", LORA_TARGETS))


def unload_lora_operation(nickname: str | list[str], *, name: str = "nickname") -> UnloadLora:
    """Check `DiffGenerator.unload_lora`'s argument (also the HTTP body's, `name` as it spells it)."""
    nicknames = list(nickname) if isinstance(nickname, (list, tuple)) else [nickname]
    if not nicknames or any(not isinstance(item, str) or not item.strip() for item in nicknames):
        raise LoraArgumentError(name, f"{name} must be a non-empty string or a non-empty list of them, got "
                                      f"{nickname!r}.")
    if len(set(nicknames)) != len(nicknames):
        raise LoraArgumentError(name, f"{name} names an adapter more than once: {nicknames!r}.")
    return UnloadLora(nicknames=tuple(nicknames))
