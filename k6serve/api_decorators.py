"""The decorators of `DiffGenerator`'s methods: errors worded for the caller (`in_callers_words`), a LoRA method
answering the HTTP body's names (`http_names_answered`) and SGLang's argument order (`sglang_order_answered`)."""

from __future__ import annotations

import functools
import inspect
import typing
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from k6serve.api_errors import reworded_errors
from k6serve.lora.arguments import HTTP_LORA_NAMES
from k6serve.lora.spec import LORA_TARGETS
from k6serve.request import did_you_mean

if TYPE_CHECKING:
    from k6serve.api import DiffGenerator

# A `DiffGenerator` method's decorators keep its signature for type checkers and IDEs (`Callable -> Callable` made
# set_lora and the other LoRA and memory methods `(*Any, **Any) -> Any`: no keyword or type was checked).
Method = typing.TypeVar("Method", bound=Callable[..., Any])


def http_names_answered(method: Method) -> Method:
    """A `DiffGenerator` LoRA method that answers a keyword it does not take with the argument meant: the HTTP
    body's name (`lora_path`, typed by a caller who moved a working request body over) got Python's bare
    "unexpected keyword argument 'lora_path'", and a typo a `did_you_mean` guess. Still a TypeError, as Python's."""
    signature = inspect.signature(method)
    python_names = {http: name for name, http in HTTP_LORA_NAMES.items() if name in signature.parameters}

    @functools.wraps(method)
    def answered(self: "DiffGenerator", *args: Any, **kwargs: Any) -> Any:
        unknown = [key for key in kwargs if key not in signature.parameters]
        if unknown:
            key = unknown[0]
            if key in python_names:
                hint = (f": {key} is the HTTP API's name (POST /v1/{method.__name__}'s body); the Python argument is "
                        f"{python_names[key]}: {method.__name__}(..., {python_names[key]}=...)")
            else:
                hint = did_you_mean([key], (name for name in signature.parameters if name != "self"))
            raise TypeError(f"{method.__name__}() got an unexpected keyword argument {key!r}{hint}.")
        return method(self, *args, **kwargs)

    return typing.cast(Method, answered)


def sglang_order_answered(method: Method) -> Method:
    """`DiffGenerator.set_lora` called in SGLang's argument order, (nickname, path, target, strength): its third
    argument, a target, was refused as "strength must be a finite number, got 'transformer'", and a fourth as
    Python's "takes from 2 to 4 positional arguments". Said as the order it is, with the call to make."""
    @functools.wraps(method)
    def ordered(self: "DiffGenerator", *args: Any, **kwargs: Any) -> Any:
        if len(args) >= 3 and isinstance(args[2], str) and args[2] in LORA_TARGETS:
            strength = "" if len(args) < 4 else f", {args[3]!r}"
            raise TypeError(f"{method.__name__}()'s third argument is the strength, got the target {args[2]!r}: "
                            "SGLang's set_lora takes (nickname, path, target, strength), and here target is a "
                            f"keyword: {method.__name__}({args[0]!r}, {args[1]!r}{strength}, target={args[2]!r}).")
        return method(self, *args, **kwargs)

    return typing.cast(Method, ordered)


def in_callers_words(method: Method) -> Method:
    """A `DiffGenerator` method whose ValueErrors are worded for its caller (`DiffGenerator._wording`)."""
    if inspect.iscoroutinefunction(method):
        @functools.wraps(method)
        async def worded_async(self: "DiffGenerator", *args: Any, **kwargs: Any) -> Any:
            with reworded_errors(self._wording):
                return await method(self, *args, **kwargs)

        return typing.cast(Method, worded_async)

    @functools.wraps(method)
    def worded(self: "DiffGenerator", *args: Any, **kwargs: Any) -> Any:
        with reworded_errors(self._wording):
            return method(self, *args, **kwargs)

    return typing.cast(Method, worded)
