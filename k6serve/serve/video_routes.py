"""The video job routes, OpenAI's asynchronous `/v1/videos`: create (`video_creation.py` reads and checks the
body), list, retrieve, download the MP4 (`video_file_response.py`), delete, cancel, and remix (`video_remix.py`).
Handlers only translate: HTTP in, `SamplingParams` to the engine through the `JobRunner`, job records out.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from stat import S_ISREG
from typing import BinaryIO, Literal

from fastapi import APIRouter, Header, Query, Request
from fastapi.responses import FileResponse, JSONResponse, Response

from k6serve.media.stills import SPRITESHEET_MEDIA_TYPE, THUMBNAIL_MEDIA_TYPE, spritesheet_jpeg, thumbnail_webp
from k6serve.serve.artifacts import output_file_name
from k6serve.serve.errors import ApiError
from k6serve.serve.expiry import forget_job, live_job, sweep_expired
from k6serve.serve.jobs import DELETED_CURSOR_RETENTION_S, Job, JobStatus, expires_at, is_expired
from k6serve.serve.response_models import (ERROR_RESPONSES, ErrorResponse, VideoCancelled, VideoDeleted, VideoJob,
                                           VideoList)
from k6serve.serve.server_context import ServerContext, server_context
from k6serve.serve.video_creation import create_video_job
from k6serve.serve.video_file_response import VideoFileResponse
from k6serve.serve.video_remix import create_remix_job

logger = logging.getLogger(__name__)
router = APIRouter()


def _not_found(video_id: str) -> ApiError:
    return ApiError(404, f"Video {video_id!r} not found.", code="video_not_found", param="video_id")


def _stored_job(ctx: ServerContext, video_id: str) -> Job:
    """The job a route names, or the 404 `video_not_found` (an expired one is deleted first: `live_job`)."""
    job = live_job(ctx, ctx.store.get(video_id))
    if job is None:
        raise _not_found(video_id)
    return job


CREATE_BODY_DOC = {
    "requestBody": {
        "required": True,
        "content": {
            "application/json": {"schema": {"$ref": "#/components/schemas/VideoCreateBody"}},
            "multipart/form-data": {"schema": {"$ref": "#/components/schemas/VideoCreateForm"}},
        },
    }
}


@router.post("/v1/videos", response_model=VideoJob, responses=ERROR_RESPONSES, openapi_extra=CREATE_BODY_DOC,
             operation_id="createVideo", tags=["videos"],
             summary="Create a video job (JSON, or multipart with input_reference / video_reference uploads)")
async def create_video(request: Request,
                       idempotency_key: str | None = Header(None, alias="Idempotency-Key")) -> JSONResponse:
    ctx = server_context(request)
    try:
        return await create_video_job(request, ctx, idempotency_key)
    except ApiError as error:
        # Every refusal by its code (queue_full, payload_too_large, invalid_parameter, ...), so a dashboard sees
        # clients sending bad requests, not only a full queue.
        ctx.metrics.rejected(error.code or f"http_{error.status}")
        raise


_AFTER_DOC = "Cursor: a video id; one deleted or expired since still marks its place."


@router.get("/v1/videos", response_model=VideoList, responses=ERROR_RESPONSES, summary="List video jobs",
            operation_id="listVideos", tags=["videos"])
async def list_videos(request: Request, after: str | None = Query(None, description=_AFTER_DOC),
                      limit: int = Query(20, ge=1, le=100),
                      order: Literal["asc", "desc"] = Query("desc", description="By creation time.")) -> JSONResponse:
    ctx = server_context(request)
    if ctx.settings.output_ttl_s > 0:
        # As if the periodic sweep had just run; off the event loop like it (many jobs can expire during downtime),
        # and, like it, a failure is logged, not the listing's 500. While another sweep runs this one skips it, and
        # the page leaves out the jobs past their expires_at that it has not reached yet.
        try:
            await asyncio.to_thread(sweep_expired, ctx)
        except Exception:  # noqa: BLE001
            logger.exception("sweeping expired jobs before a listing failed")
    now = time.time()
    data: list = []
    first_id = last_id = None
    has_more, cursor, read = True, after, 0
    # Filled to `limit` live jobs, reading on past expired ones not swept yet: a page of none with has_more true
    # ended the OpenAI SDKs' auto-pagination there (they stop at an empty page), so a live job after a run of expired
    # ones was never listed. Read in chunks (one query per _LIST_CHUNK rows, not one per expired job), at most
    # _LIST_SCAN_ROWS rows a listing (the sweep removes the rest).
    while has_more and len(data) < limit and read < _LIST_SCAN_ROWS:
        try:
            jobs, more = ctx.store.list_page(after=cursor, limit=max(limit - len(data), _LIST_CHUNK),
                                             ascending=order == "asc")
        except KeyError:
            days = DELETED_CURSOR_RETENTION_S // 86400
            raise ApiError(400, f"after={after!r} is not the id of a stored video, nor of one deleted or expired in "
                                f"the last {days} days; page from the start (leave out after).",
                           code="invalid_parameter", param="after") from None
        read += len(jobs)
        has_more = more
        for index, job in enumerate(jobs):
            # The cursors are the page's own ends, an expired job's id among them: `after` takes a deleted id, so
            # paging goes on from where this page stopped.
            first_id = first_id or job.id
            last_id = cursor = job.id
            if not is_expired(job, ctx.settings.output_ttl_s, now):
                data.append(ctx.view(job))
                if len(data) == limit:
                    has_more = more or index + 1 < len(jobs)
                    break
    return JSONResponse({"object": "list", "data": data, "first_id": first_id, "last_id": last_id,
                         "has_more": has_more})


_LIST_CHUNK = 100
# The most job rows one listing reads to fill its page past expired jobs the sweep has not removed yet.
_LIST_SCAN_ROWS = 10_000


@router.get("/v1/videos/{video_id}", response_model=VideoJob, responses=ERROR_RESPONSES, summary="Get a video job",
            operation_id="retrieveVideo", tags=["videos"])
async def get_video(request: Request, video_id: str) -> JSONResponse:
    ctx = server_context(request)
    job = _stored_job(ctx, video_id)
    # OpenAI's poll hint, which its SDK's videos.poll / create_and_poll read (1 s without it).
    headers = None if job.status.is_terminal else {"openai-poll-after-ms": str(ctx.runner.poll_after_ms())}
    return JSONResponse(ctx.view(job), headers=headers)


_BINARY = {"schema": {"type": "string", "format": "binary"}}  # a generated client's bytes
_MP4_BYTES = {"video/mp4": _BINARY}
# variant=thumbnail / spritesheet: still images of the MP4 (media/stills.py), in the formats OpenAI's API serves.
_STILLS = {"thumbnail": (thumbnail_webp, THUMBNAIL_MEDIA_TYPE, "webp"),
           "spritesheet": (spritesheet_jpeg, SPRITESHEET_MEDIA_TYPE, "jpg")}


@router.get("/v1/videos/{video_id}/content", responses={**ERROR_RESPONSES,
                                                         200: {"content": {**_MP4_BYTES, THUMBNAIL_MEDIA_TYPE: _BINARY,
                                                                           SPRITESHEET_MEDIA_TYPE: _BINARY}},
                                                         206: {"description": "Partial content (Range)",
                                                               "content": _MP4_BYTES},
                                                         304: {"description": "Not modified (If-None-Match, "
                                                                              "If-Modified-Since)"},
                                                         412: {"model": ErrorResponse,
                                                               "description": "Precondition failed (If-Match, "
                                                                              "If-Unmodified-Since)"},
                                                         416: {"model": ErrorResponse,
                                                               "description": "Range not satisfiable"}},
            response_class=FileResponse,
            summary="Download the MP4 (supports HTTP Range), or its thumbnail (WebP) or spritesheet (JPEG)",
            operation_id="retrieveVideoContent", tags=["videos"])
async def get_video_content(request: Request, video_id: str,
                            variant: Literal["video", "thumbnail", "spritesheet"] = Query("video")) -> Response:
    ctx = server_context(request)
    job = _stored_job(ctx, video_id)
    if job.status != JobStatus.COMPLETED:
        detail = f" ({job.error_message.rstrip('.')})" if job.error_message else ""
        # A failed or cancelled job never gets content: telling its client to keep polling would be a dead end.
        advice = ("it will never have any; create a new job" if job.status.is_terminal
                  else f"poll GET /v1/videos/{video_id} until status is completed")
        raise ApiError(404, f"Video {video_id} has no content: its status is {job.status.value}{detail}; "
                            f"{advice}.", code="video_not_ready", param="video_id")
    path = ctx.artifacts.output_path(job.output_file or output_file_name(job.id))
    # Opened here, before any byte is answered: a file removed after an is_file() check made FileResponse raise, a
    # 500, and one removed after the 200's headers cut the download off (`VideoFileResponse`). What is open stays
    # readable if a DELETE unlinks it meanwhile. Only a regular file is opened (opening a FIFO would block).
    file = None
    try:
        if S_ISREG(path.stat().st_mode):
            file = open(path, "rb")  # noqa: SIM115 - closed by the response once sent
    except FileNotFoundError:
        pass
    if file is None:
        raise ApiError(404, f"The file of video {video_id} was removed from the server.", code="content_missing",
                       param="video_id")
    if variant in _STILLS:
        return await _still_response(ctx, job, file, variant)
    stat_result = os.fstat(file.fileno())  # the file being sent, whatever its path names by now
    return VideoFileResponse(path, file=file, media_type="video/mp4", filename=f"{video_id}.mp4",
                             stat_result=stat_result, headers={"Cache-Control": _content_cache_control(ctx, job)})


async def _still_response(ctx: ServerContext, job: Job, file: BinaryIO, variant: str) -> Response:
    """The thumbnail or spritesheet of the open MP4, drawn in a thread (decoding blocks: other requests go on).
    Read through the open file's descriptor, so a DELETE meanwhile does not take the video from under it."""
    render, media_type, extension = _STILLS[variant]
    with file:
        try:
            content = await asyncio.to_thread(render, f"/dev/fd/{file.fileno()}" if os.path.isdir("/dev/fd")
                                              else file.name)
        except ValueError as error:  # PyAV could not read the MP4 (a file damaged on the server's disk)
            # The reader's message names the descriptor's path and advises on an input file: the log keeps it, the
            # client is told what it can act on.
            logger.warning("video %s: its %s could not be made: %s", job.id, variant, error)
            raise ApiError(500, f"The {variant} of video {job.id} could not be made: its MP4 on the server cannot "
                                f"be read (damaged on the server's disk?); the server's log has the reader's error.",
                           code="content_unreadable", param="variant") from error
    return Response(content, media_type=media_type, headers={
        "Cache-Control": _content_cache_control(ctx, job),
        "Content-Disposition": f'attachment; filename="{job.id}_{variant}.{extension}"'})


def _content_cache_control(ctx: ServerContext, job: Job) -> str:
    """A job's MP4 never changes under its URL (ids are not reused), so a browser or player may keep it until the
    job expires instead of downloading it again on every visit (no Cache-Control let a cache guess from
    Last-Modified). `private`: the answer is one client's (and, with --api-key, authorized); shared caches keep
    nothing. Finished jobs kept forever (--output-ttl 0) get a day."""
    expiry = expires_at(job, ctx.settings.output_ttl_s)
    max_age = 86400 if expiry is None else max(0, int(expiry - time.time()))
    return f"private, max-age={max_age}, immutable"


@router.delete("/v1/videos/{video_id}", response_model=VideoCancelled | VideoDeleted, responses=ERROR_RESPONSES,
               summary="Delete a job and its files, cancelling it first if it is queued or running",
               operation_id="deleteVideo", tags=["videos"])
async def delete_video(request: Request, video_id: str) -> JSONResponse:
    ctx = server_context(request)
    job = _stored_job(ctx, video_id)
    if not job.status.is_terminal:
        # Cancelled first. Once it has stopped (a queued job at once, a running one at its next step boundary) it
        # is deleted as a finished one is: OpenAI SDK code checks `client.videos.delete(id).deleted`, and a cancelled
        # record left behind needed a second DELETE. POST .../cancel is the route that keeps the record.
        job = await _cancel_and_wait(ctx, video_id)
        if not job.status.is_terminal:  # a step longer than the wait: the record stays, DELETE again later
            return JSONResponse({**ctx.view(job), "deleted": False})
    forget_job(ctx.store, ctx.artifacts, job)
    return JSONResponse({"id": video_id, "object": "video.deleted", "deleted": True})


async def _cancel_and_wait(ctx: ServerContext, video_id: str) -> Job:
    """Cancel a queued or running job; the job once the engine has stopped it, or after the cancel wait."""
    job = ctx.runner.cancel(video_id)
    deadline = time.monotonic() + ctx.settings.cancel_wait_s
    while job is not None and not job.status.is_terminal and time.monotonic() < deadline:
        await asyncio.sleep(0.02)  # the engine acknowledges at its next step boundary
        job = ctx.store.get(video_id)
    if job is None:
        raise _not_found(video_id)
    return job


@router.post("/v1/videos/{video_id}/cancel", response_model=VideoJob, responses=ERROR_RESPONSES,
             summary="Cancel a queued/running job; a finished one is left as it is (409)",
             operation_id="cancelVideo", tags=["videos"])
async def cancel_video(request: Request, video_id: str) -> JSONResponse:
    """DELETE deletes a job (cancelling it first if it still runs), its record and video: a client that retries a
    cancel with it (after a restart, a lost answer) could delete the video of a job that completed meanwhile, and
    never reads how the job ended. This route only cancels, and keeps the record."""
    ctx = server_context(request)
    job = _stored_job(ctx, video_id)
    if job.status.is_terminal:
        raise ApiError(409, f"Video {video_id!r} has already ended ({job.status.value}); nothing to cancel. GET "
                            f"/v1/videos/{video_id} shows it (and /content its video, if it completed).",
                       code="video_finished", param="video_id")
    return JSONResponse(ctx.view(await _cancel_and_wait(ctx, video_id)))


@router.post("/v1/videos/{video_id}/remix", response_model=VideoJob, responses=ERROR_RESPONSES,
             openapi_extra={"requestBody": {"required": True, "content": {"application/json": {
                 "schema": {"$ref": "#/components/schemas/VideoRemixBody"}}}}},
             summary="Remix a completed video: a new job with its settings and seed and a new prompt",
             operation_id="remixVideo", tags=["videos"])
async def remix_video(request: Request, video_id: str,
                      idempotency_key: str | None = Header(None, alias="Idempotency-Key")) -> JSONResponse:
    ctx = server_context(request)
    try:
        return await create_remix_job(request, ctx, video_id, idempotency_key)
    except ApiError as error:
        ctx.metrics.rejected(error.code or f"http_{error.status}")  # as the create route counts its refusals
        raise
