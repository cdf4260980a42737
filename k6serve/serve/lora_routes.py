"""The LoRA routes: `/v1/set_lora`, `/v1/merge_lora_weights`, `/v1/unmerge_lora_weights` and `/v1/unload_lora`
change the generation DiT's adapters, queued behind the stored jobs (`JobRunner.submit_lora`), and answer once the
engine has applied them on every replica; `GET /v1/list_loras` waits only for the running job. Each operation is
built by the Python API's own argument checks (`k6serve.lora.arguments`)."""

from __future__ import annotations

import asyncio
import logging
import re
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel

from k6serve.lora.adapter_file import names_adapter_file
from k6serve.lora.arguments import (
    HTTP_LORA_NAMES,
    LoraArgumentError,
    merge_lora_operation,
    set_lora_operation,
    unload_lora_operation,
    unmerge_lora_operation,
)
from k6serve.lora.spec import ListLoras
from k6serve.models.variants import SUPER_RESOLUTION
from k6serve.serve.control_bodies import MergeLoraBody, SetLoraBody, UnloadLoraBody, UnmergeLoraBody, parse_lora_body
from k6serve.serve.errors import ApiError, client_words
from k6serve.serve.response_models import CONTROL_ERROR_RESPONSES, LoraList, LoraResult
from k6serve.serve.runner_refusals import ServerShuttingDown
from k6serve.serve.server_context import ServerContext, refuse_without_replicas, server_context
from k6serve.serve.uploads import read_control_body

logger = logging.getLogger(__name__)
router = APIRouter()


def _lora_body_doc(model: type) -> dict[str, Any]:
    return {"requestBody": {"required": model in (SetLoraBody, UnloadLoraBody), "content": {
        "application/json": {"schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}}


async def _read_lora_body(request: Request, model: type) -> Any:
    return parse_lora_body(model, await read_control_body(request,
                                                           allow_empty=model not in (SetLoraBody, UnloadLoraBody),
                                                          routes="the LoRA routes"))


def _lora_operation(build, *args, **kwargs):
    """The operation built by the Python API's own checks (strengths and alpha within their bounds too): a bad
    argument is refused now, not once the running and queued jobs are done (the worker refuses it too)."""
    try:
        return build(*args, **kwargs)
    except LoraArgumentError as exc:
        raise ApiError(400, str(exc), code="invalid_parameter", param=exc.argument) from None


def _lora_error_param(message: str, body: type[BaseModel] | None) -> str | None:
    """The field of the route's `body` a worker's ValueError is about: for set_lora, `lora_path` for the adapter
    file's errors, whose messages say "LoRA path" / "LoRA file" (the CLI's and the API's wording too), else the first
    field the message names (a merge_lora_weights refusal that names merge_mode was answered with that param, which
    the route does not take)."""
    if body is None:
        return None
    if body is SetLoraBody and names_adapter_file(message):
        return "lora_path"
    match = re.search(r"\b(" + "|".join(body.model_fields) + r")\b", message)
    if match:
        return match.group(1)
    # The manager's "no LoRA adapter is loaded under the nickname 'x'" (a set_lora without lora_path) says
    # "nickname", its word in the Python API too; it was answered with param null.
    return "lora_nickname" if body is SetLoraBody and re.search(r"\bnickname\b", message) else None


def _refuse_lora_on_super_resolution(ctx: ServerContext) -> None:
    """The worker's refusal of any adapter change on a super-resolution model, now: it waited behind every queued
    job (45 s behind two) before saying so."""
    if ctx.variant.family == SUPER_RESOLUTION:
        raise ApiError(400, f"LoRA adapters apply to the Kandinsky 6 generation DiT; {ctx.variant.name} is a "
                            "super-resolution model, which takes none.", code="invalid_lora")


async def _lora_answer(submit, body: type[BaseModel] | None = None) -> JSONResponse:
    """Submit a LoRA operation and answer its result: 400 for a ValueError (bad adapter, nothing changed), 500 for
    any other failure, with its message (the reference answers every failure with 500 and a detail string)."""
    try:
        result = await asyncio.wrap_future(submit())
    except ValueError as exc:
        raise ApiError(400, str(exc), code="invalid_lora", param=_lora_error_param(str(exc), body)) from None
    except ServerShuttingDown as exc:
        raise ApiError(503, str(exc), code="shutting_down") from None
    except Exception as exc:
        logger.exception("LoRA operation failed")
        # In the client's words: a rank's error carries its traceback as text (2 KB with the server's paths),
        # which the log keeps.
        raise ApiError(500, client_words(exc), code="lora_failed") from None
    return JSONResponse(result)


async def _lora_route(request: Request, model: type, build) -> JSONResponse:
    """The adapter-changing routes' one flow: the body read and checked, a super-resolution server's refusal, the
    operation built by the Python API's checks (`build(body)`), then queued behind the jobs created before it."""
    ctx = server_context(request)
    await refuse_without_replicas(request, ctx)
    body = await _read_lora_body(request, model)
    _refuse_lora_on_super_resolution(ctx)
    operation = _lora_operation(build, body)
    return await _lora_answer(lambda: ctx.runner.submit_lora(operation), model)


@router.post("/v1/set_lora", response_model=LoraResult, responses=CONTROL_ERROR_RESPONSES,
             openapi_extra=_lora_body_doc(SetLoraBody), summary="Replace the active LoRA adapters",
             operation_id="setLora", tags=["lora"])
async def set_lora(request: Request) -> JSONResponse:
    lora_paths = server_context(request).lora_paths
    return await _lora_route(request, SetLoraBody, lambda body: set_lora_operation(
        body.lora_nickname, lora_paths.check(body.lora_path), body.strength, merge_mode=body.merge_mode,
        target=body.target, lora_alpha=body.lora_alpha, names=HTTP_LORA_NAMES))


@router.post("/v1/merge_lora_weights", response_model=LoraResult, responses=CONTROL_ERROR_RESPONSES,
             openapi_extra=_lora_body_doc(MergeLoraBody), summary="Merge the active LoRA adapters into the weights",
             operation_id="mergeLoraWeights", tags=["lora"])
async def merge_lora_weights(request: Request) -> JSONResponse:
    return await _lora_route(request, MergeLoraBody, lambda body: merge_lora_operation(body.target, body.strength))


@router.post("/v1/unmerge_lora_weights", response_model=LoraResult, responses=CONTROL_ERROR_RESPONSES,
             openapi_extra=_lora_body_doc(UnmergeLoraBody),
             summary="Deactivate every LoRA adapter and restore the base weights bit for bit",
             operation_id="unmergeLoraWeights", tags=["lora"])
async def unmerge_lora_weights(request: Request) -> JSONResponse:
    return await _lora_route(request, UnmergeLoraBody, lambda body: unmerge_lora_operation(body.target))


@router.post("/v1/unload_lora", response_model=LoraResult, responses=CONTROL_ERROR_RESPONSES,
             openapi_extra=_lora_body_doc(UnloadLoraBody),
             summary="Forget loaded LoRA adapters that are not active, freeing their memory",
             operation_id="unloadLora", tags=["lora"])
async def unload_lora(request: Request) -> JSONResponse:
    return await _lora_route(request, UnloadLoraBody,
                             lambda body: unload_lora_operation(body.lora_nickname, name=HTTP_LORA_NAMES["nickname"]))


@router.get("/v1/list_loras", response_model=LoraList, responses=CONTROL_ERROR_RESPONSES,
            summary="The loaded LoRA adapters", operation_id="listLoras", tags=["lora"])
async def list_loras(request: Request) -> JSONResponse:
    ctx = server_context(request)
    await refuse_without_replicas(request, ctx)
    return await _lora_answer(lambda: ctx.engine.submit_lora(ListLoras()))
