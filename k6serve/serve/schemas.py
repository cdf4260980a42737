"""The HTTP boundary's pydantic models, and their conversion to `k6serve.request` dataclasses.

`VideoCreateBody` is generated from `parameter_fields(surface="http")` (the one definition of request
parameters shared with the CLI and the Python API) plus the OpenAI fields `model`, `size` and `seconds`.
Pydantic lives only in this module and the route modules (`routes.py` lists them).
"""

from __future__ import annotations

import copy
import functools
import json
import math
import re
import typing
from collections.abc import Callable
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, ValidationError, create_model

from k6serve.lora.spec import LORA_MERGE_MODES, LORA_TARGETS, MAX_LORA_ALPHA, MAX_LORA_STRENGTH
from k6serve.models.variants import (
    DEFAULT_SEED,
    MAX_PROMPT_CHARACTERS,
    SUPER_RESOLUTION,
    Variant,
    seconds_to_num_frames,
    sr_source_field_refusal,
)
from k6serve.reference_names import unknown_names_hint
from k6serve.request import SR_RESIZE_MODES, SamplingParams, parameter_fields, parse_size
from k6serve.serve.errors import ApiError
from k6serve.serve.jobs import Job, JobStatus, expires_at

FILE_FIELDS = {"input_reference": "image_path", "video_reference": "video_path"}
# ASCII digits only: str.isdigit() also takes '²' and full-width digits, which int() then refuses or misreads.
_SIZE = re.compile(r"\s*([0-9]+)\s*[xX]\s*([0-9]+)\s*")
# A number sent as text (every form field; `seconds` in OpenAI's JSON): a plain decimal number. float() and pydantic
# also read '4_0' as 40 (Python's digit grouping), and float() 'inf' and other scripts' digits ('\u0661' is 1,
# full-width '\uff14' is 4). Unambiguous, so that it runs in linear time ('[0-9]+\.?[0-9]*' backtracked: 20,000
# digits and an 'x' took 14 s on the event loop), and at most _MAX_NUMBER_TEXT characters.
_DECIMAL = re.compile(r"[ \t\r\n]*[+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]+)?[ \t\r\n]*")
# An integer field's text: a whole number, "4" or "4.0" (pydantic takes the latter; "4.5" and "1e1" it refuses).
_INTEGER = re.compile(r"[ \t\r\n]*[+-]?[0-9]+(?:\.0*)?[ \t\r\n]*")
_MAX_NUMBER_TEXT = 64


def _is_number_text(text: str, pattern: re.Pattern = _DECIMAL) -> bool:
    return len(text) <= _MAX_NUMBER_TEXT and pattern.fullmatch(text) is not None


def _shown_value(value: Any) -> str:
    """A refused value as JSON for its message, its start only when long (a form field can hold a megabyte). Text is
    shown as sent, not as \\u escapes ("пять" read "\\u043f\\u044f\\u0442\\u044c", and a long one was cut inside an
    escape); the response body is UTF-8 JSON either way."""
    shown = json.dumps(value, ensure_ascii=False)
    if len(shown) <= 80:
        return shown
    if isinstance(value, str):
        return f"{json.dumps(value[:60], ensure_ascii=False)[:-1]}... ({len(value):,} characters)"
    return f"{shown[:60]}... ({len(shown):,} characters)"


# A client-chosen job id is a URL path segment and the listing's paging cursor: no '/' or ':', and no leading '.'
# ('..' segments). Its output file is named by a digest of it (`artifacts.output_file_name`), not by the id.
REQUEST_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"
# The OpenAI fields and the job id: HTTP only, not SamplingParams fields.
_HTTP_ONLY_FIELDS = ("model", "size", "seconds", "request_id")


def _documented(**by_type: dict[str, Any]) -> Callable[[dict[str, Any]], None]:
    """A field's `json_schema_extra` that writes JSON-schema keywords into the branches of its schema of each JSON type
    (`integer={"minimum": 1}`; an array's items count as its type), the `null` branch left as it is: the OpenAPI
    document shows the ranges to client generators and validators. In the document only: pydantic does not check
    them, the server's own checks do, with their own 400 messages (a pydantic constraint would answer in its words)."""
    def extra(schema: dict[str, Any]) -> None:
        for branch in schema.get("anyOf", [schema]):
            target = branch.get("items", branch) if branch.get("type") == "array" else branch
            keywords = copy.deepcopy(by_type.get(target.get("type"), {}))
            if _SHARED in keywords:  # a shared component (`SHARED_SCHEMAS`) says the type
                del target["type"]
            target.update(keywords)
    return extra


# Choices that several fields share, as named components of the document (`_openapi` adds them): a generated client
# gets one enum, LoraTarget, not SetLoraBodyTarget, MergeLoraBodyTarget and UnmergeLoraBodyTarget.
SHARED_SCHEMAS = {
    "LoraTarget": {"type": "string", "enum": list(LORA_TARGETS), "title": "LoraTarget",
                   "description": "What the LoRA routes change: 'all' or 'transformer' (the one DiT)."},
    "LoraMergeMode": {"type": "string", "enum": list(LORA_MERGE_MODES), "title": "LoraMergeMode",
                      "description": "'auto', 'merge' (into the weights) or 'dynamic' (per forward)."},
    "SrTargetResizeMode": {"type": "string", "enum": list(SR_RESIZE_MODES), "title": "SrTargetResizeMode",
                           "description": "How super-resolution reaches sr_target_resolution: fit or exact."},
}


# Pydantic refuses a $ref to a schema it did not make (KeyError), so `_documented` leaves this mark, which
# `request_body_schema` turns into the $ref.
_SHARED = "x-k6serve-shared"


def _shared(name: str) -> dict[str, dict[str, str]]:
    return {"string": {_SHARED: name}}


def request_body_schema(model: type[BaseModel]) -> dict[str, Any]:
    """A request body's model as a component of the OpenAPI document: its shared choices as $refs to
    `SHARED_SCHEMAS`, and no `default`s. openapi-typescript makes a component's property with a default required
    (its defaultNonNullable), so a TypeScript client had to send every field of a create, null or not, and
    `target` and `strength` with an empty merge; the descriptions say the defaults that are not null."""
    def refer(node: Any) -> Any:
        if isinstance(node, list):
            return [refer(item) for item in node]
        if not isinstance(node, dict):
            return node
        shared = {"$ref": f"#/components/schemas/{node[_SHARED]}"} if _SHARED in node else {}
        return {**{key: refer(value) for key, value in node.items() if key != _SHARED}, **shared}
    schema = refer(model.model_json_schema(ref_template="#/components/schemas/{model}"))
    for value in schema["properties"].values():
        value.pop("default", None)
    return schema


_NUMBER_TEXT_PATTERN = "^" + _DECIMAL.pattern + "$"  # ECMA-262 reads it as Python does (ASCII classes only)
_TEXT = {"string": {"maxLength": MAX_PROMPT_CHARACTERS}}
# The ranges the server enforces on every model (`models/variants.py` resolve_*, `_frames_for_seconds`), as documented
# by the fields' help; tests/server/test_openapi.py checks each bound against the server's answers. A value within
# them can still be refused for a combination (seconds x fps past 128 latent frames or the audio's 47.55 s) or by the
# served model (a distilled checkpoint takes guidance_scale 1.0 only, the SR model no width).
_DOCUMENTED_BOUNDS: dict[str, Callable[[dict[str, Any]], None]] = {
    "prompt": _documented(**_TEXT),
    "negative_prompt": _documented(**_TEXT),
    "seed": _documented(integer={"minimum": -1, "maximum": 2**63 - 1}),  # -1: a seed drawn for the job
    "height": _documented(integer={"minimum": 16, "maximum": 2048, "multipleOf": 16}),
    "width": _documented(integer={"minimum": 16, "maximum": 2048, "multipleOf": 16}),
    # 510 and 511 round down to 509 frames (n // 4 * 4 + 1), the most the DiT's 128 latent frames hold.
    "num_frames": _documented(integer={"minimum": 1, "maximum": 511}),
    "fps": _documented(number={"minimum": 1, "maximum": 240}),
    "num_inference_steps": _documented(integer={"minimum": 1, "maximum": 1000}),
    "max_sequence_length": _documented(integer={"minimum": 1, "maximum": 1024}),
    "guidance_scale": _documented(number={"minimum": 1}),
    # 2, 2.25 or 4, as the description says: over an enum of numbers openapi-python-client drops the whole body.
    "sr_resolution_scale": _documented(number={"minimum": 2, "maximum": 4}),
    "sr_tiles_batch_size": _documented(integer={"minimum": 1, "maximum": 64}),
    "sr_tile_min_overlap": _documented(number={"minimum": 0, "exclusiveMaximum": 1}),
    "sr_target_resize_mode": _documented(**_shared("SrTargetResizeMode")),
    "loras": _documented(object={"additionalProperties": {
        "type": "number", "minimum": -MAX_LORA_STRENGTH, "maximum": MAX_LORA_STRENGTH}}),
    "size": _documented(string={"pattern": r"^\s*[0-9]+\s*[xX]\s*[0-9]+\s*$"}),
    "seconds": _documented(number={"exclusiveMinimum": 0, "maximum": 600},
                          string={"pattern": _NUMBER_TEXT_PATTERN, "maxLength": _MAX_NUMBER_TEXT}),
}


def _http_field_definitions() -> dict[str, Any]:
    hints = typing.get_type_hints(SamplingParams)
    definitions: dict[str, Any] = {}
    for field in parameter_fields(surface="http"):
        definitions[field.name] = (hints[field.name], Field(default=None, description=field.metadata["help"],
                                                            json_schema_extra=_DOCUMENTED_BOUNDS.get(field.name)))
    definitions["model"] = (str | None, Field(default=None, description="Served model name (GET /v1/models); "
                                                                         "optional."))
    definitions["size"] = (str | None, Field(default=None, description="OpenAI size 'WxH', width first "
                                                                       "(e.g. '768x512'); same as width+height.",
                                             json_schema_extra=_DOCUMENTED_BOUNDS["size"]))
    definitions["seconds"] = (str | float | None, Field(
        default=None, description="Duration; mapped to num_frames = round(seconds*fps), then n // 4 * 4 + 1.",
        json_schema_extra=_DOCUMENTED_BOUNDS["seconds"]))
    definitions["request_id"] = (str | None, Field(
        default=None, pattern=REQUEST_ID_PATTERN,
        description="The job's id, chosen by the client: 1-128 of A-Z a-z 0-9 . _ -, starting with a letter or "
                    "digit. Sending it again with the same body returns that job; with another body, 409."))
    return definitions


VideoCreateBody = create_model(
    "VideoCreateBody",
    __config__=ConfigDict(extra="forbid", allow_inf_nan=False),
    __doc__="POST /v1/videos body (JSON, or the same names as multipart/form-data fields).",
    **_http_field_definitions(),
)
HTTP_FIELD_NAMES = tuple(VideoCreateBody.model_fields)
_STRING_FIELDS = {name for name, info in VideoCreateBody.model_fields.items()
                  if info.annotation in (str, str | None)}
_BOOL_FIELDS = {name for name, info in VideoCreateBody.model_fields.items() if info.annotation in (bool, bool | None)}
_OBJECT_FIELDS = {name for name, info in VideoCreateBody.model_fields.items()
                  if info.annotation in (dict, dict | None)}


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


def parse_json_body(model: type[BaseModel], raw: Any, *, string_fields: set[str], describe_error=None,
                    bool_fields: frozenset[str] = frozenset(), form: bool = False) -> BaseModel:
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
        pattern = _INTEGER if numeric.get(name) == "an integer" else _DECIMAL
        if name in numeric and any(isinstance(item, str) and not _is_number_text(item, pattern) for item in values):
            # Pydantic's lax mode reads the text "4_0" as 40: a typo of "4.0" or "40" ran a 40-frame video.
            also = " or a list of them" if isinstance(value, list) else ""
            raise ApiError(400, f"{name} must be {numeric[name]} such as 4{also}, got {_shown_value(value)}.",
                           code="invalid_parameter", param=name)
        if numeric.get(name) == "an integer" and any(isinstance(item, float) and not abs(item) < 2**53
                                                     for item in values):
            # A JSON number written with a decimal point or an exponent is a double, which holds every integer only
            # below 2**53: {"seed": 9007199254740993.0} ran with seed 9007199254740992, and 1e19 got pydantic's
            # "unable to parse input string".
            raise ApiError(400, f"{name} must be an integer such as 4, written without a decimal point or an exponent "
                                f"at this size (a decimal number holds every integer only below 2**53), got "
                                f"{_shown_value(value)}.", code="invalid_parameter", param=name)
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
        return set().union(*args) if args and all(arg is not None for arg in args) else None
    found = {name: kinds(info.annotation) for name, info in model.model_fields.items()}
    return {name: "an integer" if kind == {int} else "a number" for name, kind in found.items() if kind}


def _error_message(model: type[BaseModel], raw: dict, param: str | None, error: dict) -> str:
    if error["type"] == "extra_forbidden":
        return f"Unknown field {param!r}. Valid fields: {', '.join(model.model_fields)}."
    if error["type"] == "missing":
        return f"{param} is required."
    return f"{param}: {error['msg']} (got {json.dumps(raw.get(param), default=str)})"


# SamplingParams' fields that say where and how the offline surfaces deliver the result; a job's result is its MP4.
_OFFLINE_OUTPUT_FIELDS = frozenset({"output_path", "output_file_name", "save_output", "return_file_paths_only"})


def _describe_video_error(param: str | None, error: dict) -> str | None:
    if error["type"] == "extra_forbidden" and param is not None:
        # SGLang's field names (guidance_rescale) get what to send instead, a typo the field it resembles.
        fields = list(VideoCreateBody.model_fields)
        if param in _OFFLINE_OUTPUT_FIELDS:
            # The CLI's and the API's output options, which a job does not choose (the answer was a bare
            # "Unknown field").
            hint = (" (an option of `k6serve generate` and the Python API, not of a job: the server writes every "
                    "job's MP4 under its own --output-path and serves it at GET /v1/videos/{id}/content)")
        else:
            hint = unknown_names_hint([param], fields, surface="http")
        return f"Unknown field {param!r}{hint}. Valid fields: {', '.join(fields)}."
    if param in _ONE_PER_JOB and isinstance(error.get("input"), list):
        # SGLang takes a list of seeds (one per output) and of one source video; here as everywhere a job is one
        # video, and pydantic's "Input should be a valid integer" said nothing of it.
        return f"{param}: {_ONE_PER_JOB[param]}, got {json.dumps(error['input'], default=str)[:200]}."
    if param == "seconds" and error["type"] != "extra_forbidden":
        return f"seconds must be a number in (0, 600] such as \"4\" or 4, got {error.get('input')!r}"
    if param == "request_id" and error["type"] == "string_pattern_mismatch":
        return ("request_id must be 1-128 characters of A-Z, a-z, 0-9, '.', '_' and '-', starting with a letter or "
                f"digit, got {error.get('input')!r}")
    return None


# Fields that SGLang's body may send as a list, and what a k6serve job takes instead.
_ONE_PER_JOB = {
    "seed": "one integer per job (SGLang's list of seeds is one per output; a job makes one video: send a job per "
            "seed)",
    "prompt": "one string per job (send a POST /v1/videos per prompt)",
    "video_path": "one server-side path per job (send SGLang's list of one source as the path itself)",
}


# No field of any route nests more than three levels of objects or arrays. Deeper JSON is refused by one rule on
# every Python: 3.11's decoder raised RecursionError at about 1,000 levels, 3.12's parses 5,000 and more.
MAX_JSON_DEPTH = 32


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


# `name[key]`: how OpenAI's SDK (which sends every videos.create as multipart) and other form encoders flatten an
# object: extra_body={"loras": {"style": 0.8}} arrives as the form field loras[style] = "0.8". A list inside it is
# sent as repeated `name[key][]` fields, a nested object as `name[key][sub]`, and an empty object not at all.
_BRACKETED_FIELD = re.compile(r"([^\[\]]+)\[([^\[\]]*)\](.*)", re.DOTALL)


def bracketed_object_field(name: str) -> str | None:
    """The object field (`loras`, `cache_dit_params`) a form field named like `loras[style]` flattens, or None."""
    match = _BRACKETED_FIELD.fullmatch(name)
    return match[1] if match is not None and match[1] in _OBJECT_FIELDS else None


def json_text_hint(field: str) -> str:
    """How to send object field `field` in a form: as JSON text, which keeps lists, nesting and `{}`."""
    return (f"send {field} as one form field holding JSON text instead (with OpenAI's Python SDK: "
            f"extra_body={{\"{field}\": json.dumps({{...}})}}; its Node SDK: {field}: JSON.stringify({{...}}); "
            f"curl -F '{field}={{...}}')")


def _fold_bracketed_fields(raw: dict[str, Any]) -> dict[str, Any]:
    """Form fields `loras[style]` / `cache_dit_params[Fn_compute_blocks]` folded back into their object, each value
    read as JSON when it is a JSON scalar ("0.8", "true", "8") and as text otherwise. Only one level of keys with
    one value each: a list or a nested object (or an empty object, which the SDK drops without a trace) needs the
    object sent as JSON text, and the refusal says so."""
    folded: dict[str, dict[str, Any]] = {}
    kept: dict[str, Any] = {}
    for name, value in raw.items():
        match = _BRACKETED_FIELD.fullmatch(name)
        if match is None or match[1] not in _OBJECT_FIELDS:
            kept[name] = value
            continue
        field, key, rest = match[1], match[2], match[3]
        if not key or rest:
            what = "a list" if rest.endswith("[]") or not key else "a nested object"
            raise ApiError(400, f"Form field {name!r} is {what} inside {field}, flattened into bracketed field "
                                f"names, which the server reads one level deep only; {json_text_hint(field)}.",
                           code="invalid_parameter", param=field)
        try:
            decoded = json.loads(value)
        except (json.JSONDecodeError, ValueError, RecursionError):
            decoded = value
        folded.setdefault(field, {})[key] = decoded if not isinstance(decoded, (dict, list)) else value
    for field, value in folded.items():
        if field in kept:
            raise ApiError(400, f"{field} was sent both as the form field {field!r} and as {field}[...] fields; "
                                "send it one way.", code="invalid_parameter", param=field)
        kept[field] = value
    return kept


def parse_create_body(raw: Any, *, form: bool = False) -> BaseModel:
    """POST /v1/videos: validate a decoded JSON object or form fields (`parse_json_body`). A form field can only
    hold text, so an object field (cache_dit_params) sent as a form field is JSON text, decoded here, and a boolean
    is read from text ("true", "false", ...); `loras[style]`-style fields, OpenAI's SDK's flattening of an object
    in extra_body, are folded back into their object (`_fold_bracketed_fields`)."""
    if form and isinstance(raw, dict):
        raw = _fold_bracketed_fields(raw)
    if isinstance(raw, dict):
        for name in _OBJECT_FIELDS & raw.keys():
            if isinstance(raw[name], str):
                try:
                    decoded = json.loads(raw[name], object_pairs_hook=object_without_duplicate_keys)
                    too_deep = json_depth(decoded) > MAX_JSON_DEPTH
                except ApiError as duplicate:  # the same key twice: which value was meant cannot be known
                    raise ApiError(400, f"{name} has the key {duplicate.param!r} more than once; send each key "
                                        "once.", code="invalid_parameter", param=name) from None
                except json.JSONDecodeError:
                    raise ApiError(400, f"{name} must be a JSON object, got {raw[name][:200]!r}.",
                                   code="invalid_parameter", param=name) from None
                except ValueError as exc:  # Python's 4,300-digit limit on an integer: it was a 500
                    raise ApiError(400, f"{name} holds a number that is too long ({exc}).", code="invalid_parameter",
                                   param=name) from None
                except RecursionError:  # valid JSON, but the decoder recurses once per level (Python 3.11)
                    too_deep = True
                if too_deep:
                    raise ApiError(400, f"{name} is nested too deeply; it takes one JSON object of settings, a few "
                                        "levels at most.", code="invalid_parameter", param=name)
                if (escape := lone_surrogate(decoded)) is not None:
                    # The JSON body refuses it too (`read_json_body`); here it named a LoRA nickname that the 400
                    # quoting it could not encode: a 500.
                    raise ApiError(400, f"{name} holds {escape}, one half of a UTF-16 surrogate pair without the "
                                        "other, so the text is not valid Unicode; send the character itself, or the "
                                        "escapes of both halves.", code="invalid_parameter", param=name)
                raw = {**raw, name: decoded}
    return parse_json_body(VideoCreateBody, raw, string_fields=_STRING_FIELDS, describe_error=_describe_video_error,
                           bool_fields=frozenset(_BOOL_FIELDS), form=form)


def to_sampling_params(body: BaseModel, variant: Variant, *, served_names: tuple[str, ...],
                       model_name: str | None = None) -> SamplingParams:
    """OpenAI fields mapped onto SamplingParams (size -> width/height, seconds -> num_frames). `served_names`: the
    lower-cased names `model` may take; `model_name`: the id /v1/models lists, as the refusal names it."""
    values = {name: getattr(body, name) for name in HTTP_FIELD_NAMES if name not in _HTTP_ONLY_FIELDS}
    if body.model is not None and body.model.lower() not in served_names:
        listed = model_name or served_names[0]
        raise ApiError(400, f"model {body.model!r} is not served here; use {listed!r} or omit model "
                            "(GET /v1/models lists it).", code="model_not_found", param="model")
    is_sr = variant.family == SUPER_RESOLUTION
    if is_sr and (body.size is not None or body.seconds is not None):
        name = "size" if body.size is not None else "seconds"
        raise ApiError(400, sr_source_field_refusal(name), code="invalid_parameter", param=name)
    if body.size is not None:
        if not _SIZE.fullmatch(body.size):
            raise ApiError(400, f"size must be 'WIDTHxHEIGHT' in ASCII digits, width first (e.g. '768x512'), got "
                                f"{body.size!r}", code="invalid_parameter", param="size")
        height, width = parse_size(body.size.strip())
        for name, value in (("height", height), ("width", width)):
            if values[name] is not None and values[name] != value:
                raise ApiError(400, f"size {body.size!r} disagrees with {name}={values[name]}; send one of them.",
                               code="invalid_parameter", param="size")
        values["height"], values["width"] = height, width
    if body.seconds is not None:
        values["num_frames"] = _frames_for_seconds(body.seconds, values["num_frames"],
                                                   values["fps"] if values["fps"] is not None else variant.fps)
    return SamplingParams(**values)


def _frames_for_seconds(seconds: str | float, num_frames: int | None, fps: float) -> int:
    try:
        if isinstance(seconds, str) and not _is_number_text(seconds):
            raise ValueError(seconds)
        value = float(seconds)
    except ValueError:
        raise ApiError(400, f"seconds must be a number such as \"4\", got {_shown_value(seconds)}",
                       code="invalid_parameter",
                       param="seconds") from None
    if not math.isfinite(value) or value <= 0 or value > 600:
        raise ApiError(400, f"seconds must be in (0, 600], got {seconds!r}", code="invalid_parameter",
                       param="seconds")
    if not (math.isfinite(fps) and fps > 0):
        return 1  # the invalid fps itself is reported by resolve, with its own message
    frames = seconds_to_num_frames(value, fps)
    if num_frames is not None and num_frames != frames:
        raise ApiError(400, f"seconds={seconds} gives {frames} frames at {fps:g} fps but num_frames={num_frames}; "
                            "send one of them.", code="invalid_parameter", param="seconds")
    return frames


def seconds_rounding_note(seconds: str | float | None, num_frames: int, fps: float) -> str | None:
    """The job's warning when `seconds` (already accepted by `to_sampling_params`) did not come to a 4k+1 frame
    count, so `num_frames` (what runs) is another duration: said as a `num_frames` off the rule is said, since the
    client sent no frame count to see it in. A duration under half a frame rounds to 0 frames and runs as 1: said
    too (the clamp to 1 hid it, though the docs promise a warning whenever the rounding changes the count)."""
    frames = round(float(seconds) * fps) if seconds is not None else num_frames
    if frames == num_frames:
        return None
    if frames < 1:
        return (f"seconds {seconds} at {fps:g} fps is {frames} frames, fewer than one; using {num_frames} "
                f"({num_frames / fps:g} s; a video has at least 1 frame).")
    return (f"seconds {seconds} at {fps:g} fps is {frames} frames, not of the form 4k+1; using {num_frames} "
            f"({num_frames / fps:g} s; n // 4 * 4 + 1 frames, as the reference).")


def input_reference_target(*, super_resolution: bool) -> str:
    """The request field an `input_reference` upload fills, decided by the served model alone: the source video on
    the super-resolution model, the conditioning image on a generation model (which takes no video).

    Not by the client's file name or type: a GIF sent as image/gif was refused as a video, and an SR source called
    "clip" sent as application/octet-stream as missing. What the bytes are is checked next (`check_readable`), which
    says when an image was expected and a video came."""
    return "video_path" if super_resolution else "image_path"


_LORA_BODY_CONFIG = ConfigDict(extra="forbid", allow_inf_nan=False)


# The LoRA bodies' ranges and choices, in the document only (`_documented`): `lora.arguments.set_lora_operation`
# and the others refuse the rest with their own 400s.
_LORA_TARGET = _documented(**_shared("LoraTarget"))
_LORA_STRENGTH = _documented(number={"minimum": -MAX_LORA_STRENGTH, "maximum": MAX_LORA_STRENGTH})
_TARGET_DOC = "'all' (default) or 'transformer' (the one DiT)."


class SetLoraBody(BaseModel):
    """POST /v1/set_lora (JSON)."""

    model_config = _LORA_BODY_CONFIG
    lora_nickname: str | list[str] = Field(description="The adapter's name, or a list of names (one per adapter).")
    lora_path: str | list[str | None] | None = Field(
        None, description="A .safetensors file, a folder holding one, or a hub id, per nickname; null reuses the "
                          "adapter already loaded under the nickname.")
    target: str | list[str] = Field(
        "all", description="'all' (default) or 'transformer' (the one DiT), or one of them per adapter (SGLang's "
                           "list).",
        json_schema_extra=_LORA_TARGET)
    strength: float | list[float] = Field(1.0, description="One number for every adapter, or one per adapter; "
                                                           "from -100 to 100 (default 1).",
                                          json_schema_extra=_LORA_STRENGTH)
    merge_mode: str = Field("auto", description="'auto' (default), 'merge' (into the weights) or 'dynamic' (per "
                                                "forward).",
                            json_schema_extra=_documented(**_shared("LoraMergeMode")))
    lora_alpha: float | None = Field(None, description="Overrides the alpha stored in the adapter file; from -10000 "
                                                       "to 10000.",
                                     json_schema_extra=_documented(number={"minimum": -MAX_LORA_ALPHA,
                                                                           "maximum": MAX_LORA_ALPHA}))


class MergeLoraBody(BaseModel):
    """POST /v1/merge_lora_weights (JSON; an empty body means the defaults)."""

    model_config = _LORA_BODY_CONFIG
    target: str = Field("all", description=_TARGET_DOC, json_schema_extra=_LORA_TARGET)
    strength: float | None = Field(None, description="Merge again at this strength (from -100 to 100); null keeps "
                                                     "the set one.", json_schema_extra=_LORA_STRENGTH)


class UnmergeLoraBody(BaseModel):
    """POST /v1/unmerge_lora_weights (JSON; an empty body means the defaults)."""

    model_config = _LORA_BODY_CONFIG
    target: str = Field("all", description=_TARGET_DOC, json_schema_extra=_LORA_TARGET)


class UnloadLoraBody(BaseModel):
    """POST /v1/unload_lora (JSON)."""

    model_config = _LORA_BODY_CONFIG
    lora_nickname: str | list[str] = Field(description="The loaded, inactive adapter to forget, or a list of them.")


_LORA_STRING_FIELDS = {"lora_nickname", "lora_path", "target", "merge_mode"}


def parse_lora_body(model: type[BaseModel], raw: Any) -> BaseModel:
    """The LoRA routes' bodies, validated as the video route's are (`parse_json_body`)."""
    return parse_json_body(model, raw, string_fields=_LORA_STRING_FIELDS)


# The reference's tags for what a release frees. This server's device memory is all weights (no KV cache, no CUDA
# graphs), so every release frees all of it; a list without "weights" would expect weights to stay and is refused.
MEMORY_TAGS = ("weights", "kv_cache", "cuda_graph")


class MemoryOccupationBody(BaseModel):
    """POST /release_memory_occupation and /resume_memory_occupation (JSON; optional, an empty body is the default)."""

    model_config = _LORA_BODY_CONFIG
    tags: list[Literal[MEMORY_TAGS]] | None = Field(  # type: ignore[valid-type]
        None, description="The reference's memory kinds, accepted for its clients; the list must hold 'weights' "
                          "(the weights are all this server keeps on the GPU, so it releases them all).")
    keep_host_copy: StrictBool | None = Field(
        None, description="Resume only: keep the host copy of the weights (host memory stays taken), so the next "
                          "release re-points them to it without copying; a LoRA change drops it. Default false.")


def parse_memory_body(raw: Any, *, resume: bool) -> MemoryOccupationBody:
    body = parse_json_body(MemoryOccupationBody, raw, string_fields={"tags"}, bool_fields=frozenset({"keep_host_copy"}))
    if body.keep_host_copy is not None and not resume:
        raise ApiError(400, "keep_host_copy applies to /resume_memory_occupation (it decides whether the resume keeps "
                            "the host copy); drop it here.", code="invalid_parameter", param="keep_host_copy")
    if body.tags is not None and "weights" not in body.tags:
        raise ApiError(400, f"tags {body.tags} leave out 'weights', but the weights are all this server keeps on the "
                            "GPU (no KV cache, no CUDA graphs): send tags ['weights'], or no body.",
                       code="invalid_parameter", param="tags")
    return body


# The answers' models: a field with a default is still always sent, so it is `required` in the document (a generated
# TypeScript client typed `warnings?: string[]` and made every reader check for undefined).
_ANSWER_CONFIG = ConfigDict(json_schema_serialization_defaults_required=True)


class MemoryReply(BaseModel):
    model_config = _ANSWER_CONFIG
    status: Literal["ok", "already_released", "not_released"] = Field(
        description="'ok' when memory moved; otherwise nothing changed (released twice, or resumed while not "
                    "released).")
    message: str
    memory_released: bool = Field(description="Whether the memory is released now (generation waits meanwhile).")
    moved_bytes: int = Field(description="Bytes moved between the GPUs and host memory, over every rank.")
    num_waiting_requests: int = Field(description="Requests held in the engine for a resume (not the stored queue).")
    ranks: list[dict[str, Any]] = Field(description="One report per rank of every replica: what moved, by owner, "
                                                    "and what the process still holds on its GPU ('after').")


class LoraResult(BaseModel):
    model_config = _ANSWER_CONFIG
    status: Literal["ok"] = "ok"
    message: str
    loras: list[dict[str, Any]] = Field(description="The loaded adapters and their state, one object each.")


class LoraList(BaseModel):
    model_config = _ANSWER_CONFIG
    loras: list[dict[str, Any]] = Field(description="The loaded adapters and their state, one object each.")


class JobError(BaseModel):
    model_config = _ANSWER_CONFIG
    code: str
    message: str


class VideoJob(BaseModel):
    model_config = _ANSWER_CONFIG
    id: str
    object: Literal["video"] = "video"
    model: str
    # OpenAI's Video object has it, and its SDK's `Video.prompt` read None from every job before.
    prompt: str | None = Field(None, description="The job's prompt as sent; null for super-resolution.")
    # OpenAI's Video object has it, required (null or an id) in its SDKs' types: k6serve makes no remixes.
    remixed_from_video_id: None = Field(None, description="Always null: k6serve has no remix.")
    expanded_prompt: str | None = Field(None, description="With expand_prompts, once completed: the prompt as the "
                                                          "text encoder rewrote it, which the model was given.")
    status: JobStatus
    progress: int = Field(description="0-100; advanced at every denoising step (every tile for VSR).")
    created_at: int
    started_at: int | None = None
    completed_at: int | None = None
    expires_at: int | None = Field(None, description="When the output and this record are deleted (--output-ttl).")
    size: str | None = Field(None, description="'WxH', width first.")
    seconds: str | None = None
    seed: int | None = Field(None, description="The noise seed the job runs with (42 when the request gave none): "
                                               "the same request with this seed gives the same video.")
    error: JobError | None = None
    inference_time_s: float | None = None
    stage_seconds: dict[str, float] = Field(
        default_factory=dict, description="Once completed: the seconds of each stage the engine ran, in the order it "
                                          "ran them (generation: expand_prompt with expand_prompts, encode, denoise, "
                                          "decode_audio, decode_video, mux; super-resolution: read, encode, upscale, "
                                          "dit, decode, blend, mux; warmup, a --warmup-mode request warm-up run "
                                          "first); empty before.")
    peak_memory_mb: float | None = None
    sample_aspect_ratio: str | None = Field(
        None, description="Once completed, super-resolution of a source with non-square pixels: their width over "
                          "height, 'N:M' (the MP4 is tagged with it, so players show the source's shape; `size` is "
                          "the stored frames' WxH); null for square pixels.")
    url: str | None = Field(None, description="Relative URL of the MP4 once completed.")
    warnings: list[str] = Field(default_factory=list)
    waiting_for: Literal["resume_memory_occupation"] | None = Field(
        None, description="Set on a queued job that cannot start because the GPU memory is released; it starts "
                          "after POST /resume_memory_occupation.")


class VideoList(BaseModel):
    model_config = _ANSWER_CONFIG
    object: Literal["list"] = "list"
    data: list[VideoJob]
    first_id: str | None
    last_id: str | None
    has_more: bool


class VideoCancelled(VideoJob):
    """DELETE on a running job whose step outlasted the cancel wait: the job object (still in_progress, its cancel
    accepted), with `deleted: false`."""

    # OpenAI's SDK reads every DELETE answer as its VideoDeleteResponse, whose `deleted` is required: without it a
    # cancel parsed as deleted=None. False says the truth (the record stays) and a later DELETE removes it.
    deleted: Literal[False] = False


class VideoDeleted(BaseModel):
    model_config = _ANSWER_CONFIG
    id: str
    object: Literal["video.deleted"] = "video.deleted"
    deleted: bool = True


class ModelCard(BaseModel):
    model_config = _ANSWER_CONFIG
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "k6serve"
    root: str
    # SGLang's diffusion card's fields, where k6serve has a value: `parent` is null (no adapter is listed as a model
    # of its own), `num_gpus` the GPUs the model runs on (all replicas and nodes), the precisions the dtype the
    # workers loaded the DiT and the VAE in (one --dtype for both; null only from a stand-in worker).
    parent: str | None = None
    num_gpus: int
    dit_precision: str | None
    vae_precision: str | None
    family: str
    variant: str
    default_num_inference_steps: int
    default_guidance_scale: float
    # The server's --quantization: "fp8" serves a lossy DiT (velocity cosine 0.998 to bf16), which a client may need
    # to know.
    quantization: str = "none"


class ModelList(BaseModel):
    model_config = _ANSWER_CONFIG
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorDetail(BaseModel):
    model_config = _ANSWER_CONFIG
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    model_config = _ANSWER_CONFIG
    error: ErrorDetail


# The error answers the OpenAPI document lists: the video, model and metrics routes', and the control routes' (LoRA
# and memory, which answer a worker's failure with 500).
ERROR_RESPONSES = {status: {"model": ErrorResponse} for status in (400, 401, 404, 409, 413, 415, 429, 503, 507)}
CONTROL_ERROR_RESPONSES = {status: {"model": ErrorResponse} for status in (400, 401, 413, 415, 500, 503)}


def job_view(job: Job, *, output_ttl_s: float, memory_released: bool = False, root_path: str = "") -> VideoJob:
    return VideoJob(
        id=job.id,
        model=job.model,
        # Super-resolution ignores a prompt (the OpenAI SDK sends one with every request, "" or not; a note says so).
        prompt=None if "video_path" in job.params else job.params.get("prompt"),
        expanded_prompt=job.expanded_prompt,
        status=job.status,
        progress=job.progress,
        created_at=int(job.created_at),
        started_at=int(job.started_at) if job.started_at is not None else None,
        completed_at=int(job.completed_at) if job.completed_at is not None else None,
        expires_at=expires_at(job, output_ttl_s),
        size=job.size,
        seconds=job.seconds,
        seed=DEFAULT_SEED if job.params.get("seed") is None else job.params["seed"],
        error=JobError(code=job.error_code or "error", message=job.error_message or "")
        if job.status == JobStatus.FAILED or job.error_message else None,
        inference_time_s=job.inference_time_s,
        stage_seconds=dict(job.stage_seconds),
        peak_memory_mb=job.peak_memory_mb,
        sample_aspect_ratio=job.sample_aspect_ratio,
        url=f"{root_path}/v1/videos/{job.id}/content" if job.status == JobStatus.COMPLETED else None,
        warnings=list(job.warnings),
        waiting_for="resume_memory_occupation" if memory_released and job.status == JobStatus.QUEUED else None,
    )
