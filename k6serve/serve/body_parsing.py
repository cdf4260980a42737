"""How every JSON body (and the create's form fields) is validated: `parse_json_body` turns a decoded object into
a body's pydantic model, and every problem into a 400 naming the field in words a client can act on (a number sent as
text only as a plain decimal number, a boolean only as JSON's true or false, an integer past 2**53 refused rather than
rounded). Also the checks of a decoded JSON value that the body readers make (`json_depth`, `lone_surrogate`,
`object_without_duplicate_keys`).

The bodies themselves are `video_create_body.py`'s (POST /v1/videos) and `control_bodies.py`'s (LoRA and memory).
"""

from __future__ import annotations

import functools
import json
import re
import typing
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError
from pydantic_core import ErrorDetails

from k6serve.serve.errors import ApiError

Body = TypeVar("Body", bound=BaseModel)  # the route's body model, which `parse_json_body` returns

# A number sent as text (every form field; `seconds` in OpenAI's JSON): a plain decimal number. float() and pydantic
# also read '4_0' as 40 (Python's digit grouping), and float() 'inf' and other scripts' digits ('\u0661' is 1,
# full-width '\uff14' is 4). Unambiguous, so that it runs in linear time ('[0-9]+\.?[0-9]*' backtracked: 20,000
# digits and an 'x' took 14 s on the event loop), and at most MAX_NUMBER_TEXT characters.
DECIMAL = re.compile(r"[ \t\r\n]*[+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]+)?[ \t\r\n]*")
# An integer field's text: a whole number, "4" or "4.0" (pydantic takes the latter; "4.5" and "1e1" it refuses).
_INTEGER = re.compile(r"[ \t\r\n]*[+-]?[0-9]+(?:\.0*)?[ \t\r\n]*")
MAX_NUMBER_TEXT = 64


def is_number_text(text: str, pattern: re.Pattern = DECIMAL) -> bool:
    return len(text) <= MAX_NUMBER_TEXT and pattern.fullmatch(text) is not None


def shown_value(value: Any) -> str:
    """A refused value as JSON for its message, its start only when long (a form field can hold a megabyte). Text is
    shown as sent, not as \\u escapes ("пять" read "\\u043f\\u044f\\u0442\\u044c", and a long one was cut inside an
    escape); the response body is UTF-8 JSON either way."""
    shown = json.dumps(value, ensure_ascii=False)
    if len(shown) <= 80:
        return shown
    if isinstance(value, str):
        return f"{json.dumps(value[:60], ensure_ascii=False)[:-1]}... ({len(value):,} characters)"
    return f"{shown[:60]}... ({len(shown):,} characters)"


def json_type_name(value: Any) -> str:
    """What a decoded JSON value is, in JSON's words: the client sent `null` or `[...]`, not Python's "NoneType" or
    "list", which the refusal of a body that is no object named."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, str):
        return "a string"
    return "an array" if isinstance(value, list) else type(value).__name__


def parse_json_body(model: type[Body], raw: Any, *, string_fields: set[str], describe_error=None,
                    bool_fields: frozenset[str] = frozenset(), form: bool = False) -> Body:
    """Validate a decoded JSON object (or form fields, `form`) as `model`; every problem is a 400 naming the field.

    `describe_error(param, error)` may word a pydantic error for one field; None keeps the generic message."""
    if not isinstance(raw, dict):
        raise ApiError(400, f"The request body must be a JSON object ({{...}}), got {json_type_name(raw)}.",
                       code="invalid_request")
    if not form:
        # Pydantic's lax mode reads "yes", "off", 1... as booleans. A form field can only hold text, so there
        # that coercion is the documented way to send a boolean; JSON has true and false.
        for name in bool_fields & raw.keys():
            if raw[name] is not None and not isinstance(raw[name], bool):
                raise ApiError(400, f"{name} must be a JSON boolean, true or false, got "
                                    f"{json.dumps(raw[name], default=str)}.", code="invalid_parameter", param=name)
    numeric = _numeric_fields(model)
    for name, value in raw.items():
        # Pydantic's lax mode reads true as 1 (seed, fps, strength...): only the boolean fields take one.
        values = value if isinstance(value, list) else [value]
        pattern = _INTEGER if numeric.get(name) == "an integer" else DECIMAL
        if name in numeric and any(isinstance(item, str) and not is_number_text(item, pattern) for item in values):
            # Pydantic's lax mode reads the text "4_0" as 40: a typo of "4.0" or "40" ran a 40-frame video.
            also = " or a list of them" if isinstance(value, list) else ""
            raise ApiError(400, f"{name} must be {numeric[name]} such as 4{also}, got {shown_value(value)}.",
                           code="invalid_parameter", param=name)
        if numeric.get(name) == "an integer" and any(isinstance(item, float) and not abs(item) < 2**53
                                                     for item in values):
            # A JSON number written with a decimal point or an exponent is a double, which holds every integer only
            # below 2**53: {"seed": 9007199254740993.0} ran with seed 9007199254740992, and 1e19 got pydantic's
            # "unable to parse input string".
            raise ApiError(400, f"{name} must be an integer such as 4, written without a decimal point or an exponent "
                                f"at this size (a decimal number holds every integer only below 2**53), got "
                                f"{shown_value(value)}.", code="invalid_parameter", param=name)
        if name in model.model_fields and name not in bool_fields and any(isinstance(item, bool) for item in values):
            # `loras` / `cache_dit_params` take an object: "must be a number, got true" sent the client astray.
            is_object = model.model_fields[name].annotation in (dict, dict | None)
            # An integer field says so, as its other refusals do ("num_frames must be an integer such as 4").
            kind = ("a string" if name in string_fields else "a JSON object" if is_object
                    else numeric.get(name, "a number"))
            also = " or a list of them" if isinstance(value, list) else ""
            raise ApiError(400, f"{name} must be {kind}{also}, got {json.dumps(value)}.",
                           code="invalid_parameter", param=name)
    try:
        return model.model_validate(raw)
    except ValidationError as exc:
        first = exc.errors()[0]
        # Only the field: a union type adds its member to the location ('seconds.str').
        param = str(first["loc"][0]) if first["loc"] else None
        message = (describe_error(param, first) if describe_error is not None else None) or _error_message(
            model, raw, param, first)
        raise ApiError(400, message, code="invalid_parameter", param=param) from None


@functools.cache
def _numeric_fields(model: type[BaseModel]) -> dict[str, str]:
    """The fields that hold numbers only (int, float, or a list of them; None allowed) -> "an integer" or "a number";
    not `seconds`, which is text or a number and checked on its own."""
    def kinds(annotation: Any) -> set[type] | None:
        if annotation in (int, float):
            return {annotation}
        args = [kinds(arg) for arg in typing.get_args(annotation) if arg is not type(None)]
        known = [arg for arg in args if arg is not None]
        return set().union(*known) if args and len(known) == len(args) else None
    found = {name: kinds(info.annotation) for name, info in model.model_fields.items()}
    return {name: "an integer" if kind == {int} else "a number" for name, kind in found.items() if kind}


def _error_message(model: type[BaseModel], raw: dict, param: str | None, error: ErrorDetails) -> str:
    if error["type"] == "extra_forbidden":
        return f"Unknown field {param!r}. Valid fields: {', '.join(model.model_fields)}."
    if error["type"] == "missing":
        return f"{param} is required."
    return f"{param}: {error['msg']} (got {json.dumps(raw.get(param), default=str)})"


# No field of any route nests more than three levels of objects or arrays. Deeper JSON is refused by one rule on
# every Python: 3.11's decoder raised RecursionError at about 1,000 levels, 3.12's parses 5,000 and more.
MAX_JSON_DEPTH = 32


def long_number_digits(error: ValueError) -> str:
    """" (5,000 digits)" from the ValueError of Python's 4,300-digit limit on an integer's text ("" if it does not
    say): its own words end by advising sys.set_int_max_str_digits(), a call inside the server, not the client's."""
    digits = re.search(r"value has (\d+) digits", str(error))
    return f" ({int(digits.group(1)):,} digits)" if digits else ""


def json_depth(value: Any) -> int:
    """Levels of objects and arrays in a decoded JSON value (a scalar is 0, `{}` is 1); iterative, so a value the
    decoder could build is measured without recursing."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, level = stack.pop()
        if isinstance(item, (dict, list)):
            deepest = max(deepest, level)
            stack.extend((child, level + 1) for child in (item.values() if isinstance(item, dict) else item))
    return deepest


def lone_surrogate(value: Any) -> str | None:
    """The first half of a UTF-16 surrogate pair standing alone in a decoded JSON value, as its `\\uXXXX` escape, or
    None. JSON's grammar lets "\\ud800" stand alone, but it is no character: no answer that quotes it can be encoded
    as UTF-8."""
    try:
        json.dumps(value, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError as exc:
        return f"\\u{ord(exc.object[exc.start]):04x}"
    return None


def object_without_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    # json.loads keeps the last of two equal keys, so {"seed": 1, "seed": 2} silently ran with seed 2; which
    # one the client meant cannot be known, and other parsers keep the first.
    fields: dict[str, Any] = {}
    for name, value in pairs:
        if name in fields:
            raise ApiError(400, f"The JSON body has the key {name!r} more than once; send each field once.",
                           code="invalid_json", param=name)
        fields[name] = value
    return fields
