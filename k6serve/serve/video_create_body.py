"""POST /v1/videos' body: `VideoCreateBody`, read from JSON or form fields (`parse_create_body`), and its
conversion to `k6serve.request.SamplingParams` (`to_sampling_params`).

`VideoCreateBody` is generated from `parameter_fields(surface="http")` (the one definition of request
parameters shared with the CLI and the Python API) plus the OpenAI fields `model`, `size` and `seconds`.
Pydantic lives only in the HTTP boundary's body and answer modules (this one, `body_parsing.py`,
`body_documentation.py`, `control_bodies.py`, `response_models.py`) and the route modules (`routes.py` lists them).
"""

from __future__ import annotations

import json
import math
import re
import typing
from collections.abc import Callable
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, create_model

from k6serve.lora.spec import MAX_LORA_STRENGTH
from k6serve.models.variants import SUPER_RESOLUTION, Variant
from k6serve.reference_names import unknown_names_hint
from k6serve.request import SamplingParams, parameter_fields, parse_size
from k6serve.request_resolution import MAX_PROMPT_CHARACTERS, seconds_to_num_frames, sr_source_field_refusal
from k6serve.serve.body_documentation import documented, shared
from k6serve.serve.body_parsing import (
    DECIMAL,
    MAX_JSON_DEPTH,
    MAX_NUMBER_TEXT,
    is_number_text,
    json_depth,
    lone_surrogate,
    long_number_digits,
    object_without_duplicate_keys,
    parse_json_body,
    shown_value,
)
from k6serve.serve.errors import ApiError

FILE_FIELDS = {"input_reference": "image_path", "video_reference": "video_path"}
# ASCII digits only: str.isdigit() also takes '²' and full-width digits, which int() then refuses or misreads.
_SIZE = re.compile(r"\s*([0-9]+)\s*[xX]\s*([0-9]+)\s*")


# A client-chosen job id is a URL path segment and the listing's paging cursor: no '/' or ':', and no leading '.'
# ('..' segments). Its output file is named by a digest of it (`artifacts.output_file_name`), not by the id.
REQUEST_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"
# The OpenAI fields and the job id: HTTP only, not SamplingParams fields.
_HTTP_ONLY_FIELDS = ("model", "size", "seconds", "request_id")


_NUMBER_TEXT_PATTERN = "^" + DECIMAL.pattern + "$"  # ECMA-262 reads it as Python does (ASCII classes only)
_TEXT = {"string": {"maxLength": MAX_PROMPT_CHARACTERS}}
# The ranges the server enforces on every model (`request_resolution` resolve_*, `_frames_for_seconds`), as documented
# by the fields' help; tests/server/test_openapi.py checks each bound against the server's answers. A value within
# them can still be refused for a combination (seconds x fps past 128 latent frames or the audio's 47.55 s) or by the
# served model (a distilled checkpoint takes guidance_scale 1.0 only, the SR model no width).
_DOCUMENTED_BOUNDS: dict[str, Callable[[dict[str, Any]], None]] = {
    "prompt": documented(**_TEXT),
    "negative_prompt": documented(**_TEXT),
    "seed": documented(integer={"minimum": -1, "maximum": 2**63 - 1}),  # -1: a seed drawn for the job
    "height": documented(integer={"minimum": 16, "maximum": 2048, "multipleOf": 16}),
    "width": documented(integer={"minimum": 16, "maximum": 2048, "multipleOf": 16}),
    # 510 and 511 round down to 509 frames (n // 4 * 4 + 1), the most the DiT's 128 latent frames hold.
    "num_frames": documented(integer={"minimum": 1, "maximum": 511}),
    "fps": documented(number={"minimum": 1, "maximum": 240}),
    "num_inference_steps": documented(integer={"minimum": 1, "maximum": 1000}),
    "max_sequence_length": documented(integer={"minimum": 1, "maximum": 1024}),
    "guidance_scale": documented(number={"minimum": 1}),
    # 2, 2.25 or 4, as the description says: over an enum of numbers openapi-python-client drops the whole body.
    "sr_resolution_scale": documented(number={"minimum": 2, "maximum": 4}),
    "sr_tiles_batch_size": documented(integer={"minimum": 1, "maximum": 64}),
    "sr_tile_min_overlap": documented(number={"minimum": 0, "exclusiveMaximum": 1}),
    "sr_target_resize_mode": documented(**shared("SrTargetResizeMode")),
    "loras": documented(object={"additionalProperties": {
        "type": "number", "minimum": -MAX_LORA_STRENGTH, "maximum": MAX_LORA_STRENGTH}}),
    "size": documented(string={"pattern": r"^\s*[0-9]+\s*[xX]\s*[0-9]+\s*$"}),
    "seconds": documented(number={"exclusiveMinimum": 0, "maximum": 600},
                          string={"pattern": _NUMBER_TEXT_PATTERN, "maxLength": MAX_NUMBER_TEXT}),
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


if typing.TYPE_CHECKING:
    class VideoCreateBody(BaseModel):
        """What a type checker can know of the model `create_model` builds below: the fields read by name (the
        others are read with getattr, by `HTTP_FIELD_NAMES`)."""

        model: str | None
        size: str | None
        seconds: str | float | None
        request_id: str | None
else:
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


def parse_create_body(raw: Any, *, form: bool = False) -> VideoCreateBody:
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
                    raise ApiError(400, f"{name} holds a number that is too long{long_number_digits(exc)}; no "
                                        "setting takes more than a few dozen digits.", code="invalid_parameter",
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


def to_sampling_params(body: VideoCreateBody, variant: Variant, *, served_names: tuple[str, ...],
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
        if isinstance(seconds, str) and not is_number_text(seconds):
            raise ValueError(seconds)
        value = float(seconds)
    except ValueError:
        raise ApiError(400, f"seconds must be a number such as \"4\", got {shown_value(seconds)}",
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
