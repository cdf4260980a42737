"""Creating a video job (`POST /v1/videos`): the JSON, url-encoded or multipart body read (uploads written under
their byte limits), its fields resolved as the engine will run them and its input files checked, then the job
stored through `JobRunner.admit`; each refusal a 4xx naming the field the client sent, before anything is queued.
Nothing here runs model code: the input checks run on threads of their own, so the event loop never waits on them.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import hashlib
import json
import re
import secrets
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse

from k6serve.models.variants import SUPER_RESOLUTION, Variant
from k6serve.pipelines.sr_plan import UpscaleTooLarge
from k6serve.pipelines.sr_tiling import SourceTooSmall
from k6serve.request import GenerateRequest, SamplingParams, drawn_seed
from k6serve.request_refusals import AudioTooLong, MissingPrompt, MissingSourceVideo
from k6serve.serve.errors import ApiError, output_not_writable
from k6serve.serve.expiry import live_job
from k6serve.serve.input_paths import check_readable
from k6serve.serve.job_outcomes import without_upload_paths
from k6serve.serve.jobs import (
    DELETED_CURSOR_RETENTION_S,
    IdempotencyConflict,
    Job,
    RequestIdConflict,
    seconds_text,
    size_text,
)
from k6serve.serve.runner_refusals import LorasMerged, LorasNotLoaded, LorasQuantized, QueueFull
from k6serve.serve.server_context import ServerContext, refuse_without_replicas
from k6serve.serve.uploads import drain, read_json_body, read_multipart, read_urlencoded_body, refuse_content_encoding
from k6serve.serve.upscale_output import SourceUnusable, expected_upscale_output
from k6serve.serve.video_create_body import (
    FILE_FIELDS,
    HTTP_FIELD_NAMES,
    input_reference_target,
    parse_create_body,
    seconds_rounding_note,
    to_sampling_params,
)

_IDEMPOTENCY_KEY = re.compile(r"[\x21-\x7e]{1,255}")
ACCEPTED_CONTENT_TYPES = ("application/json", "multipart/form-data", "application/x-www-form-urlencoded")


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


async def create_video_job(request: Request, ctx: ServerContext, idempotency_key: str | None) -> JSONResponse:
    """`POST /v1/videos`: the body read and checked, the job stored (or the stored one replayed), its object."""
    await refuse_without_replicas(request, ctx)
    try:
        check_idempotency_key(idempotency_key)
    except ApiError:
        await drain(request)
        raise
    replay = (idempotency_key is not None
              and live_job(ctx, ctx.store.get_by_idempotency_key(idempotency_key)) is not None)
    multipart = request.headers.get("content-type", "").split(";")[0].strip().lower() == "multipart/form-data"
    # Refuse an upload before anything is written. Other bodies are small and read first, so a retry naming an
    # existing job by its `request_id` is answered (admit replays it) rather than refused.
    if multipart and not replay and ctx.runner.queue_is_full():
        await drain(request)
        raise _queue_full(ctx)
    if multipart and not replay:
        await refuse_unwritable_output(request, ctx, uploads=True)
    # Uploads are named after a fresh id even when the body chooses the job's id (`request_id`): it is read only
    # after them, and a refused replay's files must never clash with the stored job's.
    upload_id = f"video_{secrets.token_hex(16)}"
    uploads: tuple[str, ...] = ()
    try:
        sent = await _read_body(request, ctx, upload_id)
        uploads = sent.uploads
        body = parse_create_body(sent.fields, form=sent.form)
        params = to_sampling_params(body, ctx.variant, served_names=ctx.served_names, model_name=ctx.model_name)
        params = ctx.inputs.checked_params(params, uploaded=uploads)
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
        await on_input_check_threads(check_inputs_readable, params, sent.upload_fields, video_size)
        if isinstance(resolved, GenerateRequest):
            size, seconds = size_text(resolved.height, resolved.width), seconds_text(resolved.num_frames, resolved.fps)
            rounded = seconds_rounding_note(body.seconds, resolved.num_frames, resolved.fps)
            notes = [*notes, *([rounded] if rounded else [])]
        else:
            # After the readability check, so a source that is no video keeps that check's 400.
            try:
                output = await on_input_check_threads(expected_upscale_output, resolved, ctx.sr_tiling)
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
            await refuse_unwritable_output(request, ctx, uploads=False)
        job = Job(
            id=job_id, model=ctx.model_name, created_at=time.time(),
            params={k: v for k, v in dataclasses.asdict(params).items() if k in HTTP_FIELD_NAMES and v is not None},
            size=size, seconds=seconds, upload_files=uploads, idempotency_key=idempotency_key,
            request_hash=_request_hash(body.model_dump(exclude_none=True), sent.file_digests, uploads),
            warnings=tuple(notes),
        )
        stored, created = admit_job(ctx, job)
    except BaseException:
        ctx.artifacts.remove(list(uploads))
        raise
    if not created:
        ctx.artifacts.remove(list(uploads))  # the replay's copy of the files; the stored job owns its own
    return JSONResponse(ctx.view(stored), headers={} if created else {"Idempotent-Replayed": "true"})


def admit_job(ctx: ServerContext, job: Job) -> tuple[Job, bool]:
    """`JobRunner.admit`, its refusals as the 4xx a client reads: (the stored job, whether it is new)."""
    try:
        return ctx.runner.admit(job)
    except QueueFull:
        raise _queue_full(ctx) from None
    except (LorasNotLoaded, LorasMerged, LorasQuantized) as exc:
        raise ApiError(400, str(exc), code=exc.code, param="loras") from None
    except IdempotencyConflict as conflict:
        raise ApiError(409, f"Idempotency-Key {job.idempotency_key!r} was already used for job "
                            f"{conflict.existing.id} with a different request body; use a new key.",
                       code="idempotency_conflict", param="Idempotency-Key") from None
    except RequestIdConflict as conflict:
        raise _request_id_conflict(conflict) from None


def check_idempotency_key(idempotency_key: str | None) -> None:
    if idempotency_key is not None and not _IDEMPOTENCY_KEY.fullmatch(idempotency_key):
        raise ApiError(400, "Idempotency-Key must be 1-255 printable ASCII characters without spaces.",
                       code="invalid_idempotency_key", param="Idempotency-Key")


async def refuse_unwritable_output(request: Request, ctx: ServerContext, *, uploads: bool) -> None:
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


async def on_input_check_threads(function, *args):
    return await asyncio.get_running_loop().run_in_executor(_INPUT_CHECKS, functools.partial(function, *args))


def check_inputs_readable(params: SamplingParams, upload_fields: dict[str, str],
                          video_size: tuple[int, int] | None) -> None:
    for name, kind in (("image_path", "image"), ("video_path", "video")):
        path = getattr(params, name)
        if path is not None:
            check_readable(kind, path, param=upload_fields.get(name, name), uploaded=name in upload_fields,
                           video_size=video_size)


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
