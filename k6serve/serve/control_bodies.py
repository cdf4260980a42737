"""The control routes' request bodies: the LoRA routes' (`SetLoraBody`, `MergeLoraBody`, `UnmergeLoraBody`,
`UnloadLoraBody`, read by `parse_lora_body`) and the memory routes' (`MemoryOccupationBody`, read by
`parse_memory_body`), validated as the video route's body is (`body_parsing.parse_json_body`).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool

from k6serve.lora.spec import MAX_LORA_ALPHA, MAX_LORA_STRENGTH
from k6serve.serve.body_documentation import documented, shared
from k6serve.serve.body_parsing import parse_json_body
from k6serve.serve.errors import ApiError

_LORA_BODY_CONFIG = ConfigDict(extra="forbid", allow_inf_nan=False)


# The LoRA bodies' ranges and choices, in the document only (`documented`): `lora.arguments.set_lora_operation`
# and the others refuse the rest with their own 400s.
_LORA_TARGET = documented(**shared("LoraTarget"))
_LORA_STRENGTH = documented(number={"minimum": -MAX_LORA_STRENGTH, "maximum": MAX_LORA_STRENGTH})
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
                            json_schema_extra=documented(**shared("LoraMergeMode")))
    lora_alpha: float | None = Field(None, description="Overrides the alpha stored in the adapter file; from -10000 "
                                                       "to 10000.",
                                     json_schema_extra=documented(number={"minimum": -MAX_LORA_ALPHA,
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
