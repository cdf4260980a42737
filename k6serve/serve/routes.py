"""The HTTP routes: OpenAI-style async video jobs, LoRA adapters, models, health and metrics.

Handlers only translate: HTTP in (validated by `schemas`), `SamplingParams` to the engine through the
`JobRunner`, job records out. Nothing here runs model code, so the event loop never waits on the GPU.
The LoRA routes that change adapters queue behind the stored jobs (`JobRunner.submit_lora`) and answer once the
engine has applied them on every replica; `GET /v1/list_loras` waits only for the running job. The memory routes
(`/release_memory_occupation`, `/resume_memory_occupation`) go to the engine at once (`JobRunner.submit_memory`).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import hashlib
import json
import logging
import os
import re
import secrets
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime, timezone
from stat import S_ISREG
from typing import Any, BinaryIO, Literal

import anyio
from fastapi import APIRouter, Header, Query, Request
from fastapi.responses import FileResponse, JSONResponse, Response
from starlette.datastructures import Headers
from starlette.responses import MalformedRangeHeader, RangeNotSatisfiable
from starlette.types import Receive, Scope, Send

from k6serve.models.variants import SUPER_RESOLUTION, AudioTooLong, MissingPrompt, MissingSourceVideo, Variant
from k6serve.pipelines.sr_plan import UpscaleTooLarge
from k6serve.pipelines.sr_tiling import SourceTooSmall
from k6serve.request import GenerateRequest, SamplingParams, drawn_seed
from k6serve.serve import lora_routes, memory_routes, status_routes
from k6serve.serve.artifacts import output_file_name
from k6serve.serve.errors import ApiError, error_response, output_not_writable
from k6serve.serve.expiry import forget_job, live_job, sweep_expired
from k6serve.serve.input_paths import check_readable
from k6serve.serve.jobs import (
    DELETED_CURSOR_RETENTION_S,
    IdempotencyConflict,
    Job,
    JobStatus,
    RequestIdConflict,
    expires_at,
    is_expired,
    seconds_text,
    size_text,
)
from k6serve.serve.runner import (
    LorasMerged,
    LorasNotLoaded,
    LorasQuantized,
    QueueFull,
    without_upload_paths,
)
from k6serve.serve.schemas import (
    FILE_FIELDS,
    HTTP_FIELD_NAMES,
    ERROR_RESPONSES,
    ErrorResponse,
    VideoCancelled,
    VideoDeleted,
    VideoJob,
    VideoList,
    input_reference_target,
    parse_create_body,
    seconds_rounding_note,
    to_sampling_params,
)
from k6serve.serve.server_context import ServerContext, refuse_without_replicas, server_context
from k6serve.serve.uploads import (drain, read_json_body, read_multipart, read_urlencoded_body,
                                  refuse_content_encoding)
from k6serve.serve.upscale_output import SourceUnusable, expected_upscale_output

logger = logging.getLogger(__name__)
_IDEMPOTENCY_KEY = re.compile(r"[\x21-\x7e]{1,255}")
ACCEPTED_CONTENT_TYPES = ("application/json", "multipart/form-data", "application/x-www-form-urlencoded")


# The OpenAPI document's groups, which name a generated client's modules (openapi-python-client's
# `api/videos/create_video.py`); each route has a tag and an operationId, OpenAI's where it has the route
# (createVideo, listVideos, retrieveVideo, deleteVideo, retrieveVideoContent, listModels, retrieveModel), since
# generators name methods after it (FastAPI's default made `create_video_v1_videos_post`).
OPENAPI_TAGS = [
    {"name": "videos", "description": "OpenAI-style asynchronous video jobs: create, poll, download, cancel, delete."},
    {"name": "lora", "description": "LoRA adapters of the generation DiT: set, merge, unmerge, unload, list."},
    {"name": "memory", "description": "Release and resume the GPU memory (sleep and wake)."},
    {"name": "models", "description": "The served model, as OpenAI's /v1/models."},
    {"name": "operations", "description": "Health and Prometheus metrics, for supervisors and monitoring."},
]
_router = APIRouter()


def _not_found(video_id: str) -> ApiError:
    return ApiError(404, f"Video {video_id!r} not found.", code="video_not_found", param="video_id")


def _param_in_message(message: str, sent: set[str]) -> str | None:
    """The request field a ValueError message is about: the first one it names that the body sent, else the first
    one it names (resolve's messages start with the field, but words such as "model" are also plain English: "The
    super-resolution model has no guidance; guidance_scale must be ...")."""
    named = re.findall(r"\b(" + "|".join(HTTP_FIELD_NAMES) + r")\b", message)
    return next((name for name in named if name in sent), named[0] if named else None)


def _resolve_error(error: ValueError, body: Any, params: SamplingParams, variant: Variant,
                   upload_fields: dict[str, str]) -> ApiError:
    """A 400 for the field the client actually sent: `size` and `seconds` arrive as width/height/num_frames,
    uploads as image_path/video_path."""
    message = str(error)
    sent = {name for name in body.model_fields_set if getattr(body, name) is not None}
    sent |= {"width", "height"} if body.size is not None else set()
    sent |= {"num_frames"} if body.seconds is not None else set()
    param = _param_in_message(message, sent)
    if param in upload_fields:
        return ApiError(400, f"The uploaded {upload_fields[param]} became {param}: {message}",
                        code="invalid_parameter", param=upload_fields[param])
    if body.size is not None and param in ("width", "height"):
        return ApiError(400, f"size {body.size!r} (width x height): {message}", code="invalid_parameter",
                        param="size")
    if body.seconds is not None and body.num_frames is None and param == "num_frames":
        fps = params.fps if params.fps is not None else variant.fps
        if isinstance(error, AudioTooLong):
            # The soundtrack lasts `seconds` at any fps: "raise fps" (the frame count's fix) only added frames.
            return ApiError(400, f"seconds {body.seconds!r} at {fps:g} fps means {params.num_frames} frames, "
                                 f"{error.too_long}; send seconds up to {error.max_frames / fps:g}, or make a silent "
                                 "video (sample_audio false).", code="invalid_parameter", param="seconds")
        most = re.search(r"use at most (\d+)\.$", message)
        if most:  # the limit in the client's unit too: a job of N frames reports N / fps seconds
            message = f"{message[:-1]} frames, seconds up to {int(most.group(1)) / fps:g} at {fps:g} fps."
        return ApiError(400, f"seconds {body.seconds!r} at {fps:g} fps means {params.num_frames} frames: {message}",
                        code="invalid_parameter", param="seconds")
    return ApiError(400, message, code="invalid_parameter", param=param)


CREATE_BODY_DOC = {
    "requestBody": {
        "required": True,
        "content": {
            "application/json": {"schema": {"$ref": "#/components/schemas/VideoCreateBody"}},
            "multipart/form-data": {"schema": {"$ref": "#/components/schemas/VideoCreateForm"}},
        },
    }
}


@_router.post("/v1/videos", response_model=VideoJob, responses=ERROR_RESPONSES, openapi_extra=CREATE_BODY_DOC,
             operation_id="createVideo", tags=["videos"],
             summary="Create a video job (JSON, or multipart with input_reference / video_reference uploads)")
async def create_video(request: Request,
                       idempotency_key: str | None = Header(None, alias="Idempotency-Key")) -> JSONResponse:
    ctx = server_context(request)
    try:
        return await _create_video(request, ctx, idempotency_key)
    except ApiError as error:
        # Every refusal by its code (queue_full, payload_too_large, invalid_parameter, ...), so a dashboard sees
        # clients sending bad requests, not only a full queue.
        ctx.metrics.rejected(error.code or f"http_{error.status}")
        raise


async def _create_video(request: Request, ctx: ServerContext, idempotency_key: str | None) -> JSONResponse:
    await refuse_without_replicas(request, ctx)
    if idempotency_key is not None and not _IDEMPOTENCY_KEY.fullmatch(idempotency_key):
        await drain(request)
        raise ApiError(400, "Idempotency-Key must be 1-255 printable ASCII characters without spaces.",
                       code="invalid_idempotency_key", param="Idempotency-Key")
    replay = idempotency_key is not None and live_job(ctx, ctx.store.get_by_idempotency_key(idempotency_key)) is not None
    multipart = request.headers.get("content-type", "").split(";")[0].strip().lower() == "multipart/form-data"
    # Refuse an upload before anything is written. Other bodies are small and read first, so a retry naming an
    # existing job by its `request_id` is answered (admit replays it) rather than refused.
    if multipart and not replay and ctx.runner.queue_is_full():
        await drain(request)
        raise _queue_full(ctx)
    if multipart and not replay:
        await _refuse_unwritable_output(request, ctx, uploads=True)
    # Uploads are named after a fresh id even when the body chooses the job's id (`request_id`): it is read only
    # after them, and a refused replay's files must never clash with the stored job's.
    upload_id = f"video_{secrets.token_hex(16)}"
    uploads: tuple[str, ...] = ()
    try:
        sent = await _read_body(request, ctx, upload_id)
        uploads = sent.uploads
        body = parse_create_body(sent.fields, form=sent.form)
        params = to_sampling_params(body, ctx.variant, served_names=ctx.served_names, model_name=ctx.model_name)
        params = _checked_paths(params, ctx, uploaded=set(uploads))
        # seed -1 is drawn now, once: the job object shows the seed it runs with from its creation, and a restart's
        # re-queue runs that seed again.
        params, seed_note = drawn_seed(params)
        try:
            resolved, notes = ctx.engine.resolve(params)
        except MissingPrompt as exc:
            # The shared message shows the CLI flag; over HTTP it is the body field.
            raise ApiError(400, "prompt is required for Kandinsky 6 generation: send a non-empty prompt field "
                                '(JSON {"prompt": "A cat plays piano"}, or the form field prompt).' + exc.detail,
                           code="invalid_parameter", param="prompt") from None
        except MissingSourceVideo:
            # The shared message leads with the CLI's --video-path; an HTTP client (OpenAI's SDK above all) sends
            # the source as the input_reference upload, which it did not mention.
            raise ApiError(400, "Super-resolution needs a source video: upload it as input_reference (OpenAI's SDK: "
                                "input_reference=Path(\"input.mp4\")) or video_reference in multipart/form-data, or "
                                "give a server-side video_path inside --allowed-input-dir.",
                           code="invalid_parameter", param="video_path") from None
        except ValueError as exc:
            raise _resolve_error(exc, body, params, ctx.variant, sent.upload_fields) from None
        # (height, width) of a generation, which a conditioning image must be able to cover.
        video_size = (resolved.height, resolved.width) if isinstance(resolved, GenerateRequest) else None
        await _on_input_check_threads(_check_inputs_readable, params, sent.upload_fields, video_size)
        if isinstance(resolved, GenerateRequest):
            size, seconds = size_text(resolved.height, resolved.width), seconds_text(resolved.num_frames, resolved.fps)
            rounded = seconds_rounding_note(body.seconds, resolved.num_frames, resolved.fps)
            notes = [*notes, *([rounded] if rounded else [])]
        else:
            # After the readability check, so a source that is no video keeps that check's 400.
            try:
                output = await _on_input_check_threads(expected_upscale_output, resolved, ctx.sr_tiling)
            except SourceTooSmall as exc:  # the source, not a setting: refused now, not after waiting in the queue
                source = sent.upload_fields.get("video_path", "video_path")
                raise ApiError(400, str(exc), code="invalid_parameter", param=source) from None
            except SourceUnusable as exc:  # the reader's refusal of the file itself (e.g. 0.5 fps, cover art only)
                source = sent.upload_fields.get("video_path", "video_path")
                code = "invalid_upload" if "video_path" in sent.upload_fields else "invalid_path"
                raise ApiError(400, without_upload_paths(str(exc), uploads), code=code, param=source) from None
            except ValueError as exc:  # a size that cannot be made: refused now, not after the upscale ran
                too_large = isinstance(exc, UpscaleTooLarge) or not resolved.target_resolution
                param = "sr_resolution_scale" if too_large else "sr_target_resolution"
                raise ApiError(400, str(exc), code="invalid_parameter", param=param) from None
            size, seconds = output.size, output.seconds
            notes = [*notes, *output.notes]  # shown from creation on
        notes = [*notes, *([seed_note] if seed_note else [])]
        job_id = body.request_id or upload_id
        if body.request_id is not None:
            live_job(ctx, ctx.store.get(job_id))  # an expired job with this id is deleted first, as the sweep would
        # A replay, or a request_id conflict, writes no file: it is answered as what it is.
        if not replay and not (body.request_id is not None and ctx.store.id_taken(job_id)):
            await _refuse_unwritable_output(request, ctx, uploads=False)
        job = Job(
            id=job_id, model=ctx.model_name, created_at=time.time(),
            params={k: v for k, v in dataclasses.asdict(params).items() if k in HTTP_FIELD_NAMES and v is not None},
            size=size, seconds=seconds, upload_files=uploads, idempotency_key=idempotency_key,
            request_hash=_request_hash(body.model_dump(exclude_none=True), sent.file_digests, uploads),
            warnings=tuple(notes),
        )
        try:
            stored, created = ctx.runner.admit(job)
        except QueueFull:
            raise _queue_full(ctx) from None
        except (LorasNotLoaded, LorasMerged, LorasQuantized) as exc:
            raise ApiError(400, str(exc), code=exc.code, param="loras") from None
        except IdempotencyConflict as conflict:
            raise ApiError(409, f"Idempotency-Key {idempotency_key!r} was already used for job "
                                f"{conflict.existing.id} with a different request body; use a new key.",
                           code="idempotency_conflict", param="Idempotency-Key") from None
        except RequestIdConflict as conflict:
            raise _request_id_conflict(conflict) from None
    except BaseException:
        ctx.artifacts.remove(list(uploads))
        raise
    if not created:
        ctx.artifacts.remove(list(uploads))  # the replay's copy of the files; the stored job owns its own
    return JSONResponse(ctx.view(stored), headers={} if created else {"Idempotent-Replayed": "true"})


async def _refuse_unwritable_output(request: Request, ctx: ServerContext, *, uploads: bool) -> None:
    """A 507 when the output folder (or, for `uploads`, the upload folder) no longer takes files: an upload would
    fail, and a job could only fail at its MP4's write, after its whole run."""
    folder = await asyncio.to_thread(ctx.artifacts.unwritable_folder, uploads=uploads)
    if folder is not None:
        await drain(request)  # the rest of an unread body, so that the client reads the 507 (a no-op once read)
        raise output_not_writable(folder)


def _request_id_conflict(conflict: RequestIdConflict) -> ApiError:
    if conflict.existing is not None:
        message = (f"request_id {conflict.job_id!r} is the id of a job created with a different request body; send "
                   "the same body to get that job, or choose another request_id.")
    else:
        days = DELETED_CURSOR_RETENTION_S // 86400
        message = (f"request_id {conflict.job_id!r} was the id of a job deleted (or expired) "
                   f"{max(0, round(time.time() - (conflict.deleted_at or 0)))} s ago; a deleted job's id keeps its "
                   f"place in GET /v1/videos paging for {days} days and is not given to another job until then: "
                   "choose another request_id.")
    return ApiError(409, message, code="request_id_conflict", param="request_id")


def _queue_full(ctx: ServerContext) -> ApiError:
    return ApiError(429, f"The job queue is full ({ctx.settings.max_queued_jobs} queued jobs, --max-queued-jobs); "
                         "retry after the Retry-After delay.", code="queue_full",
                    headers={"Retry-After": str(ctx.runner.retry_after_s())})


@dataclass(frozen=True, kw_only=True, slots=True)
class _SentBody:
    """A POST /v1/videos body as read, before validation."""

    fields: Any  # the decoded JSON value, or a form's text fields with each upload's path under its target field
    form: bool  # multipart or url-encoded: every value is text
    file_digests: dict[str, str] = field(default_factory=dict)  # {file field: sha256}
    uploads: tuple[str, ...] = ()  # the uploaded files' paths
    upload_fields: dict[str, str] = field(default_factory=dict)  # {image_path / video_path: the file field}


async def _read_body(request: Request, ctx: ServerContext, upload_id: str) -> _SentBody:
    """The JSON or form body; uploads are written as `<upload_id>_<field>.<ext>`."""
    await refuse_content_encoding(request)
    content_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if content_type == "multipart/form-data":
        form = await read_multipart(
            request, file_fields=set(FILE_FIELDS), max_file_bytes=ctx.settings.max_upload_bytes,
            file_path=lambda field_name, name: ctx.artifacts.upload_path(upload_id, field_name, name))
        raw: dict[str, Any] = dict(form.fields)
        uploads = [str(f.path) for f in form.files.values()]
        try:
            _refuse_file_fields_as_text(raw, super_resolution=ctx.variant.family == SUPER_RESOLUTION)
        except ApiError:
            ctx.artifacts.remove(uploads)
            raise
        upload_fields: dict[str, str] = {}
        for field_name, upload in form.files.items():
            target = FILE_FIELDS[field_name]
            if field_name == "input_reference":
                target = input_reference_target(super_resolution=ctx.variant.family == SUPER_RESOLUTION)
            if target in upload_fields:
                # Both uploads name the SR source (input_reference is it there): "Send either the video_reference
                # upload or video_path" spoke of a video_path that was never sent.
                ctx.artifacts.remove(uploads)
                raise ApiError(400, f"{upload_fields[target]} and {field_name} were both uploaded, and on this "
                                    f"model both are its {target} (the source video); send one of them.",
                               code="invalid_parameter", param=field_name)
            if raw.get(target) is not None:
                ctx.artifacts.remove(uploads)
                raise ApiError(400, f"Send either the {field_name} upload or {target}, not both.",
                               code="invalid_parameter", param=target)
            raw[target] = str(upload.path)
            upload_fields[target] = field_name
        return _SentBody(fields=raw, form=True, file_digests={name: f.sha256 for name, f in form.files.items()},
                         uploads=tuple(uploads), upload_fields=upload_fields)
    if content_type == "application/x-www-form-urlencoded":
        fields = await read_urlencoded_body(request)
        return _SentBody(fields=_refuse_file_fields_as_text(
            fields, super_resolution=ctx.variant.family == SUPER_RESOLUTION), form=True)
    if content_type not in ("application/json", ""):
        await drain(request)
        raise ApiError(415, f"Content-Type {content_type!r} is not supported; send one of "
                            f"{', '.join(ACCEPTED_CONTENT_TYPES)}.", code="unsupported_content_type",
                       param="Content-Type")
    raw = await read_json_body(request)
    if isinstance(raw, dict):
        _refuse_reference_objects(raw, super_resolution=ctx.variant.family == SUPER_RESOLUTION)
        for field_name in FILE_FIELDS:
            if field_name in raw:
                raise ApiError(400, f"{field_name} is a file upload: send it with multipart/form-data (or give a "
                                    f"server-side {FILE_FIELDS[field_name]} in JSON).", code="invalid_parameter",
                               param=field_name)
    return _SentBody(fields=raw, form=False)


def _refuse_reference_objects(fields: dict[str, Any], *, super_resolution: bool = False) -> None:
    """OpenAI's newer `input_reference` object ({"image_url": ...} or {"file_id": ...}; its SDKs send it as JSON, or
    in a form as `input_reference[image_url]`): a 400 saying what to send instead, not "Unknown field
    'input_reference[image_url]'" or "send it with multipart", which left the user guessing that URLs and file ids
    are what is not taken."""
    for name, value in fields.items():
        match = _BRACKETED_REFERENCE.fullmatch(name)
        field_name = match[1] if match else name if name in FILE_FIELDS and isinstance(value, dict) else None
        if field_name is None:
            continue
        keys = [match[2]] if match else sorted(value) or ["{}"]
        # What the upload is on this server: the source video on a super-resolution one (`input_reference_target`).
        video = field_name == "video_reference" or super_resolution
        example, server_field = ("input.mp4", "video_path") if video else ("first.png", "image_path")
        raise ApiError(400, f"{field_name} came as a reference object ({', '.join(keys)}), OpenAI's way to point at "
                            "a file by URL or in its Files API; k6serve fetches no URLs and has no Files API: upload "
                            f"the file itself as {field_name} in multipart/form-data (OpenAI's Python SDK: "
                            f"{field_name}=Path(\"{example}\"); its Node SDK: {field_name}: await toFile(fs."
                            f"createReadStream(\"{example}\"))), or give a server-side {server_field} inside "
                            "--allowed-input-dir.", code="invalid_parameter", param=field_name)


_BRACKETED_REFERENCE = re.compile(rf"({'|'.join(FILE_FIELDS)})\[([^\]]*)\].*")


def _refuse_file_fields_as_text(fields: dict[str, Any], *, super_resolution: bool = False) -> dict[str, Any]:
    """A form's text value under a file field (`curl -F input_reference=first.png`, without the @): a 400 saying how
    to send the file, rather than "unknown field" with a list of valid fields that leaves the file fields out."""
    _refuse_reference_objects(fields, super_resolution=super_resolution)
    sent_as_text = sorted(FILE_FIELDS.keys() & fields.keys())
    if sent_as_text:
        field_name = sent_as_text[0]
        raise ApiError(400, f"{field_name} is a file upload but came as a text field ({fields[field_name][:80]!r}); "
                            f"send the file itself in multipart/form-data (curl -F {field_name}=@path/to/file), or "
                            f"give a server-side {FILE_FIELDS[field_name]}.", code="invalid_parameter",
                       param=field_name)
    return fields


# The input checks decode images and probe videos (seconds for a large one), on threads of their own: on asyncio's
# default pool (min(32, cores + 4) threads: 6 on 2 cores) a dozen large uploads held every thread, and /health and
# every other create, which need one too, waited 35 s behind them.
_INPUT_CHECKS = ThreadPoolExecutor(max_workers=2, thread_name_prefix="k6serve-input-check")


async def _on_input_check_threads(function, *args):
    return await asyncio.get_running_loop().run_in_executor(_INPUT_CHECKS, functools.partial(function, *args))


def _check_inputs_readable(params: SamplingParams, upload_fields: dict[str, str],
                           video_size: tuple[int, int] | None) -> None:
    for name, kind in (("image_path", "image"), ("video_path", "video")):
        path = getattr(params, name)
        if path is not None:
            check_readable(kind, path, param=upload_fields.get(name, name), uploaded=name in upload_fields,
                           video_size=video_size)


def _checked_paths(params: SamplingParams, ctx: ServerContext, *, uploaded: set[str]) -> SamplingParams:
    changes = {}
    for name in ("image_path", "video_path"):
        value = getattr(params, name)
        if value is not None and value not in uploaded:
            changes[name] = ctx.inputs.check(name, value)
    return dataclasses.replace(params, **changes) if changes else params


def _request_hash(body: dict[str, Any], file_digests: dict[str, str], uploads: tuple[str, ...]) -> str:
    # Upload paths differ on every retry; the files' contents identify the request instead.
    fields = {k: v for k, v in body.items() if v not in uploads}
    if isinstance(fields.get("seconds"), str):
        # OpenAI sends seconds as text ("4"), others as a number: one duration, one request (validated by now).
        fields["seconds"] = float(fields["seconds"])
    if isinstance(fields.get("loras"), dict):
        # The canonical form sorts keys, but the adapters' order is part of the request (they are stacked in it).
        fields["loras"] = list(fields["loras"].items())
    canonical = json.dumps({"fields": fields, "files": file_digests}, sort_keys=True, default=str)
    return hashlib.sha256(canonical.encode()).hexdigest()


_AFTER_DOC = "Cursor: a video id; one deleted or expired since still marks its place."


@_router.get("/v1/videos", response_model=VideoList, responses=ERROR_RESPONSES, summary="List video jobs",
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


@_router.get("/v1/videos/{video_id}", response_model=VideoJob, responses=ERROR_RESPONSES, summary="Get a video job",
            operation_id="retrieveVideo", tags=["videos"])
async def get_video(request: Request, video_id: str) -> JSONResponse:
    ctx = server_context(request)
    job = live_job(ctx, ctx.store.get(video_id))
    if job is None:
        raise _not_found(video_id)
    # OpenAI's poll hint, which its SDK's videos.poll / create_and_poll read (1 s without it).
    headers = None if job.status.is_terminal else {"openai-poll-after-ms": str(ctx.runner.poll_after_ms())}
    return JSONResponse(ctx.view(job), headers=headers)


class _Unsatisfiable(Exception):
    def __init__(self, file_size: int) -> None:
        super().__init__(file_size)
        self.file_size = file_size


# RFC 9110 14.1.1: int-range ("first-last", "first-") or suffix-range ("-length"), ASCII digits only.
_RANGE_SPEC = re.compile(r"[0-9]+-[0-9]*|-[0-9]+")
# An entity-tag, weak (W/) or strong (RFC 9110 8.8.3). Its opaque part may hold a comma, so an If-None-Match list is
# read tag by tag rather than split on commas.
_ENTITY_TAG = re.compile(r'(W/)?"([^"]*)"')
# What a 304 keeps of the 200's headers (RFC 9110 15.4.5): those a cache refreshes its stored copy with. The body's
# own (Content-Length, Content-Type, Content-Disposition, Accept-Ranges) would describe a body that is not sent.
_NOT_MODIFIED_HEADERS = frozenset({"cache-control", "content-location", "date", "etag", "expires", "last-modified",
                                   "vary"})


def _names_etag(header: str, etag: str, *, strong: bool) -> bool:
    """Whether an If-None-Match (weak comparison) or If-Match (`strong`: a W/ tag never matches) list names `etag`
    (RFC 9110 13.1.1, 13.1.2); `*` names any file, and the route answers only for one that exists."""
    if any(item.strip(" \t") == "*" for item in header.split(",")):
        return True
    ours = _ENTITY_TAG.fullmatch(etag).group(2)
    return any(tag.group(2) == ours and not (strong and tag.group(1)) for tag in _ENTITY_TAG.finditer(header))


_MONTHS = ("Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec")
_MONTH = "(" + "|".join(_MONTHS) + ")"
# RFC 9110 5.6.7's three forms, GMT only: IMF-fixdate, the obsolete RFC 850 form (two-digit year) and asctime.
_IMF_FIXDATE = re.compile(r"(?:Mon|Tue|Wed|Thu|Fri|Sat|Sun), (\d\d) " + _MONTH + r" (\d{4}) (\d\d):(\d\d):(\d\d) GMT",
                          re.ASCII)
_RFC850_DATE = re.compile(r"(?:Monday|Tuesday|Wednesday|Thursday|Friday|Saturday|Sunday), (\d\d)-" + _MONTH
                          + r"-(\d\d) (\d\d):(\d\d):(\d\d) GMT", re.ASCII)
_ASCTIME_DATE = re.compile(r"(?:Mon|Tue|Wed|Thu|Fri|Sat|Sun) " + _MONTH + r" ([ \d]\d) (\d\d):(\d\d):(\d\d) (\d{4})",
                           re.ASCII)


def _http_date(values: list[str]) -> float | None:
    """A conditional header's HTTP date as a POSIX time; None where RFC 9110 (13.1.3, 13.1.4) says to ignore the
    header: a value that is not one HTTP-date in one of its three forms (a list of dates, another zone than GMT, a
    missing field, an hour of 25, a year of 20 digits: Python's e-mail date parser took most of those), or the header
    given more than once."""
    if len(values) != 1:
        return None
    value = values[0].strip(" \t")
    try:
        if match := _IMF_FIXDATE.fullmatch(value):
            day, month, year, hour, minute, second = match.groups()
        elif match := _ASCTIME_DATE.fullmatch(value):
            month, day, hour, minute, second, year = match.groups()
        elif match := _RFC850_DATE.fullmatch(value):
            day, month, short_year, hour, minute, second = match.groups()
            # 5.6.7: a two-digit year more than 50 years ahead is the latest past year with those digits.
            year = 2000 + int(short_year)
            if year > datetime.now(timezone.utc).year + 50:
                year -= 100
        else:
            return None
        date = datetime(int(year), _MONTHS.index(month) + 1, int(day), int(hour), int(minute), int(second),
                        tzinfo=timezone.utc)
    except ValueError:  # a day, hour, minute or second out of range
        return None
    return date.timestamp()


def _not_modified_since(if_modified_since: list[str], mtime: float) -> bool:
    """Whether the file is not newer than the If-Modified-Since date; False for a header to ignore.
    Last-Modified shows whole seconds, so the file's time is compared as such."""
    since = _http_date(if_modified_since)
    return since is not None and int(mtime) <= since


class VideoFileResponse(FileResponse):
    """Starlette's FileResponse with RFC 9110 Range errors: an unparsable Range (or another unit than bytes) is
    ignored and the whole file sent, as the RFC asks, instead of a text/plain 400; 416 carries an OpenAI body.

    With conditional requests too, which Starlette's FileResponse ignores, evaluated in RFC 9110 13.2.2's order:
    412 Precondition Failed when If-Match names no strong tag of the file or, without If-Match, the file is newer
    than If-Unmodified-Since (a client resuming a download into a copy of the file it had: a file replaced since
    would be spliced into it); then 304 Not Modified when If-None-Match names the file's ETag or, without
    If-None-Match, the file is not newer than If-Modified-Since (it sent the whole file again to a client or cache
    revalidating its copy). A request that passes goes on to Range and If-Range as before. The route passes
    `stat_result`, which the ETag comes from.

    It sends the file the route opened (`file`), not the one its path names when the body starts: Starlette opens
    the path only after the 200 and its Content-Length are sent, so a DELETE landing in between (another client, or
    the TTL sweep) cut the download off with no byte of the body and a traceback in the log. An open file stays
    readable after it is unlinked."""

    def __init__(self, path: Any, *, file: BinaryIO | None = None, **kwargs: Any) -> None:
        super().__init__(path, **kwargs)
        self._file = file

    @contextlib.asynccontextmanager
    async def _open_file(self):
        if self._file is None:
            async with super()._open_file() as file:
                yield file
            return
        # Each of Starlette's senders opens the file once and seeks where it needs (the whole file reads from 0).
        self._file.seek(0)
        yield anyio.wrap_file(self._file)

    def _parse_range_header(self, http_range: str, file_size: int) -> list[tuple[int, int]]:
        # Starlette skips the range-specs it cannot read, so `bytes=1-2,,x` was served as `bytes=1-2`; a Range
        # with any malformed spec is malformed as a whole. Empty list elements are allowed (RFC 9110 5.6.1).
        _, _, range_set = http_range.partition("=")
        specs = [spec.strip(" \t") for spec in range_set.split(",")]
        if not all(_RANGE_SPEC.fullmatch(spec) for spec in specs if spec):
            return []
        try:
            return super()._parse_range_header(http_range, file_size)
        except MalformedRangeHeader:
            return []
        except RangeNotSatisfiable as exc:
            raise _Unsatisfiable(exc.max_size) from None

    def _precondition_failed(self, request: Headers) -> str | None:
        """The header whose condition the file fails, or None (RFC 9110 13.2.2 steps 1 and 2)."""
        if "if-match" in request:  # then If-Unmodified-Since is ignored, even when no tag matches
            matched = _names_etag(",".join(request.getlist("if-match")), self.headers["etag"], strong=True)
            return None if matched else "If-Match"
        since = _http_date(request.getlist("if-unmodified-since"))
        return "If-Unmodified-Since" if since is not None and int(self.stat_result.st_mtime) > since else None

    def _not_modified(self, request: Headers) -> bool:
        if "if-none-match" in request:  # then If-Modified-Since is ignored, even when no tag matches
            return _names_etag(",".join(request.getlist("if-none-match")), self.headers["etag"], strong=False)
        return _not_modified_since(request.getlist("if-modified-since"), self.stat_result.st_mtime)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            failed = self._precondition_failed(Headers(scope=scope))
            if failed is not None:
                await error_response(ApiError(
                    412, f"The video's file does not meet the request's {failed} condition: it is not the file "
                         f"{'named by that entity-tag' if failed == 'If-Match' else 'as of that date'} (now ETag "
                         f"{self.headers['etag']}, Last-Modified {self.headers['last-modified']}). Download it again "
                         f"without {failed}.", code="precondition_failed", param=failed,
                    headers={"ETag": self.headers["etag"]}))(scope, receive, send)
            elif self._not_modified(Headers(scope=scope)):
                kept = {name: value for name, value in self.headers.items() if name in _NOT_MODIFIED_HEADERS}
                await Response(status_code=304, headers=kept)(scope, receive, send)
            else:
                await super().__call__(scope, receive, send)
        except _Unsatisfiable as exc:  # raised while parsing the header, before anything was sent
            response = error_response(ApiError(
                416, f"The Range {Headers(scope=scope).get('range')!r} is outside the file (bytes 0-"
                     f"{exc.file_size - 1}); ask for a range that starts before byte {exc.file_size}.",
                code="range_not_satisfiable", param="Range", headers={"Content-Range": f"bytes */{exc.file_size}"}))
            await response(scope, receive, send)
        finally:
            if self._file is not None:
                self._file.close()


_MP4_BYTES = {"video/mp4": {"schema": {"type": "string", "format": "binary"}}}  # a generated client's bytes


@_router.get("/v1/videos/{video_id}/content", responses={**ERROR_RESPONSES, 200: {"content": _MP4_BYTES},
                                                         206: {"description": "Partial content (Range)",
                                                               "content": _MP4_BYTES},
                                                         304: {"description": "Not modified (If-None-Match, "
                                                                              "If-Modified-Since)"},
                                                         412: {"model": ErrorResponse,
                                                               "description": "Precondition failed (If-Match, "
                                                                              "If-Unmodified-Since)"},
                                                         416: {"model": ErrorResponse,
                                                               "description": "Range not satisfiable"}},
            response_class=FileResponse, summary="Download the MP4 (supports HTTP Range)",
            operation_id="retrieveVideoContent", tags=["videos"])
async def get_video_content(request: Request, video_id: str,
                            variant: Literal["video"] = Query("video")) -> FileResponse:
    ctx = server_context(request)
    job = live_job(ctx, ctx.store.get(video_id))
    if job is None:
        raise _not_found(video_id)
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
    stat_result = os.fstat(file.fileno())  # the file being sent, whatever its path names by now
    return VideoFileResponse(path, file=file, media_type="video/mp4", filename=f"{video_id}.mp4",
                             stat_result=stat_result, headers={"Cache-Control": _content_cache_control(ctx, job)})


def _content_cache_control(ctx: ServerContext, job: Job) -> str:
    """A job's MP4 never changes under its URL (ids are not reused), so a browser or player may keep it until the
    job expires instead of downloading it again on every visit (no Cache-Control let a cache guess from
    Last-Modified). `private`: the answer is one client's (and, with --api-key, authorized); shared caches keep
    nothing. Finished jobs kept forever (--output-ttl 0) get a day."""
    expiry = expires_at(job, ctx.settings.output_ttl_s)
    max_age = 86400 if expiry is None else max(0, int(expiry - time.time()))
    return f"private, max-age={max_age}, immutable"


@_router.delete("/v1/videos/{video_id}", response_model=VideoCancelled | VideoDeleted, responses=ERROR_RESPONSES,
               summary="Delete a job and its files, cancelling it first if it is queued or running",
               operation_id="deleteVideo", tags=["videos"])
async def delete_video(request: Request, video_id: str) -> JSONResponse:
    ctx = server_context(request)
    job = live_job(ctx, ctx.store.get(video_id))
    if job is None:
        raise _not_found(video_id)
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


@_router.post("/v1/videos/{video_id}/cancel", response_model=VideoJob, responses=ERROR_RESPONSES,
             summary="Cancel a queued/running job; a finished one is left as it is (409)",
             operation_id="cancelVideo", tags=["videos"])
async def cancel_video(request: Request, video_id: str) -> JSONResponse:
    """DELETE deletes a job (cancelling it first if it still runs), its record and video: a client that retries a
    cancel with it (after a restart, a lost answer) could delete the video of a job that completed meanwhile, and
    never reads how the job ended. This route only cancels, and keeps the record."""
    ctx = server_context(request)
    job = live_job(ctx, ctx.store.get(video_id))
    if job is None:
        raise _not_found(video_id)
    if job.status.is_terminal:
        raise ApiError(409, f"Video {video_id!r} has already ended ({job.status.value}); nothing to cancel. GET "
                            f"/v1/videos/{video_id} shows it (and /content its video, if it completed).",
                       code="video_finished", param="video_id")
    return JSONResponse(ctx.view(await _cancel_and_wait(ctx, video_id)))


# The resources' routers, in the order of the OpenAPI document's paths (and of docs/http-api.md's tables).
RESOURCE_ROUTERS = (_router, lora_routes.router, memory_routes.router, status_routes.router)
router = APIRouter()
for _resource_router in RESOURCE_ROUTERS:
    router.include_router(_resource_router)


def _head_wherever_get() -> None:
    """HEAD on every GET route, answered as the GET without its body, as RFC 9110 (9.1) asks of every server. It
    answered 405 but on two paths: a load balancer probing /health with HEAD never saw the server come up (the
    loading responder answers HEAD /health), and curl -I or a download manager sizing a ranged download of
    /content got no size; HEAD /v1/videos/{id} and the rest answered 405 too. Kept out of the schema, which lists
    the documented GETs. Added after every resource's routes, as they were when one router held them all."""
    for resource_router in RESOURCE_ROUTERS:
        for route in list(resource_router.routes):
            if "GET" in route.methods:
                router.head(route.path, include_in_schema=False)(route.endpoint)


_head_wherever_get()
