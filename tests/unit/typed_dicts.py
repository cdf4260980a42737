"""`mismatches(value, hint)`: where a JSON-like reply differs from the TypedDict (nested ones and lists of them
included) that annotates it: a required key missing, a key the type does not name, or a value of the wrong kind. The
replies are plain dicts, so nothing but a test notices when one gains a key its type (and the OpenAPI document made
from it) never lists."""

from __future__ import annotations

import types
import typing

from typing_extensions import is_typeddict


def mismatches(value: object, hint: object, where: str = "reply") -> list[str]:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is typing.Any:
        return []
    if origin in (typing.Union, types.UnionType):
        found = [mismatches(value, option, where) for option in args]
        return [] if any(not problems for problems in found) else min(found, key=len)
    if origin is typing.Literal:
        return [] if value in args else [f"{where}: {value!r} is not one of {args}"]
    if hint is type(None):
        return [] if value is None else [f"{where}: {value!r} is not None"]
    if is_typeddict(hint):
        if not isinstance(value, dict):
            return [f"{where}: {type(value).__name__}, not a {hint.__name__}"]
        fields = typing.get_type_hints(hint)
        problems = [f"{where}: {hint.__name__} lacks the required key {key!r}"
                    for key in sorted(hint.__required_keys__ - value.keys())]
        problems += [f"{where}: {hint.__name__} has no key {key!r}" for key in sorted(value.keys() - fields.keys())]
        for key in value.keys() & fields.keys():
            problems += mismatches(value[key], fields[key], f"{where}[{key!r}]")
        return problems
    if origin is list:
        if not isinstance(value, list):
            return [f"{where}: {type(value).__name__}, not a list"]
        return [problem for index, item in enumerate(value)
                for problem in mismatches(item, args[0], f"{where}[{index}]")]
    if origin is dict:
        if not isinstance(value, dict):
            return [f"{where}: {type(value).__name__}, not a dict"]
        return [problem for key, item in value.items() for problem in mismatches(item, args[1], f"{where}[{key!r}]")]
    kinds = (int, float) if hint is float else hint  # JSON's numbers: an int is a valid float
    if hint in (int, float) and isinstance(value, bool) or not isinstance(value, kinds):
        return [f"{where}: {value!r} is not a {getattr(hint, '__name__', hint)}"]
    return []
