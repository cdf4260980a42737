"""The memory routes (sleep and wake): `/release_memory_occupation` and `/resume_memory_occupation` go to the
engine at once (`JobRunner.submit_memory`), not behind the stored jobs; the engine runs them between requests."""

from __future__ import annotations

import asyncio
import logging

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from k6serve.runtime.memory import MemoryOperation, ReleaseMemory, ResumeMemory
from k6serve.serve.control_bodies import parse_memory_body
from k6serve.serve.errors import ApiError, client_words
from k6serve.serve.response_models import CONTROL_ERROR_RESPONSES, MemoryReply
from k6serve.serve.runner_refusals import ServerShuttingDown
from k6serve.serve.server_context import refuse_without_replicas, server_context
from k6serve.serve.uploads import read_control_body

logger = logging.getLogger(__name__)
router = APIRouter()

_MEMORY_BODY_DOC = {"requestBody": {"required": False, "content": {
    "application/json": {"schema": {"$ref": "#/components/schemas/MemoryOccupationBody"}}}}}


async def _memory_answer(request: Request, resume: bool) -> JSONResponse:
    """Read the optional body, run the operation, answer its reply: 400 for a refused layout (ValueError), 500 for
    any other failure (nothing changed: a failed release or resume is undone on every rank)."""
    ctx = server_context(request)
    await refuse_without_replicas(request, ctx)
    body = parse_memory_body(await read_control_body(request, allow_empty=True, routes="the memory routes"),
                             resume=resume)
    operation: MemoryOperation = (ResumeMemory(keep_host_copy=bool(body.keep_host_copy)) if resume
                                  else ReleaseMemory())
    try:
        result = await asyncio.wrap_future(ctx.runner.submit_memory(operation))
    except ValueError as exc:
        raise ApiError(400, str(exc), code="unsupported_layout") from None
    except ServerShuttingDown as exc:
        raise ApiError(503, str(exc), code="shutting_down") from None
    except Exception as exc:
        logger.exception("%s failed", type(operation).__name__)
        raise ApiError(500, client_words(exc), code="memory_operation_failed") from None
    return JSONResponse(result)


@router.post("/release_memory_occupation", response_model=MemoryReply, responses=CONTROL_ERROR_RESPONSES,
             openapi_extra=_MEMORY_BODY_DOC,
             summary="Give the GPU memory back (sleep): after the running jobs, move every weight to host memory",
             operation_id="releaseMemoryOccupation", tags=["memory"])
async def release_memory_occupation(request: Request) -> JSONResponse:
    return await _memory_answer(request, resume=False)


@router.post("/resume_memory_occupation", response_model=MemoryReply, responses=CONTROL_ERROR_RESPONSES,
             openapi_extra=_MEMORY_BODY_DOC,
             summary="Take the GPU memory again (wake): copy the weights back; queued jobs then start",
             operation_id="resumeMemoryOccupation", tags=["memory"])
async def resume_memory_occupation(request: Request) -> JSONResponse:
    return await _memory_answer(request, resume=True)
