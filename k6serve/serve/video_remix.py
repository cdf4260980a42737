"""Remixing a video job (`POST /v1/videos/{video_id}/remix`, OpenAI's `client.videos.remix(video_id, prompt=...)`):
a new job with a completed generation job's settings and seed, and a new prompt.

What a remix is here: Kandinsky 6 has no video-to-video edit, so k6serve's remix is the source request run again
with the prompt replaced: the same size, duration, steps, guidance, negative prompt, LoRA adapters, reference image
and, above all, the same seed (the one the source ran with, a drawn one included), so the same initial noise under
another prompt: a variation that keeps what the seed decided where the prompts agree. The remix's job object shows
`remixed_from_video_id`; its settings are the source's as they are shown (`size`, `seconds`, `seed`). A server-side
`image_path` is checked against `--allowed-input-dir` again, as the server's settings may have changed since; an
uploaded reference image, which a completed job keeps until it is deleted (`jobs.kept_upload`), becomes the remix's
own upload (a hard link or a copy), so deleting either job leaves the other's image. A source whose upload is gone
(it completed under a server that deleted uploads when their job ended) is refused (400) with what to send instead.
Also refused: an unknown or expired source (404), one not completed (409 `video_not_ready`, as
OpenAI's remix takes a completed video), a super-resolution job (its model reads no prompt), and a body with other
fields than `prompt` (to change them, create a job with POST /v1/videos).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import secrets
import time
from pathlib import Path
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from k6serve.models.variants import DEFAULT_SEED, SUPER_RESOLUTION
from k6serve.request import GenerateRequest, SamplingParams
from k6serve.request_resolution import MAX_PROMPT_CHARACTERS
from k6serve.serve.body_parsing import parse_json_body
from k6serve.serve.errors import ApiError
from k6serve.serve.expiry import live_job
from k6serve.serve.jobs import Job, JobStatus, seconds_text, size_text
from k6serve.serve.server_context import ServerContext, refuse_without_replicas
from k6serve.serve.uploads import drain, read_control_body
from k6serve.serve.video_creation import (
    admit_job,
    check_idempotency_key,
    check_inputs_readable,
    on_input_check_threads,
    refuse_unwritable_output,
)


class VideoRemixBody(BaseModel):
    """POST /v1/videos/{video_id}/remix (JSON): OpenAI's one field."""

    model_config = ConfigDict(extra="forbid")
    prompt: str = Field(description="The remix's prompt; every other setting, the seed included, is the source "
                                    "job's.", json_schema_extra={"minLength": 1, "maxLength": MAX_PROMPT_CHARACTERS})


REMIX_EXAMPLE = '{"prompt": "The same scene at night, in the rain"}'


async def create_remix_job(request: Request, ctx: ServerContext, video_id: str,
                           idempotency_key: str | None) -> JSONResponse:
    """`POST /v1/videos/{video_id}/remix`: the source job's request with the body's prompt, stored as a new job."""
    await refuse_without_replicas(request, ctx)
    try:
        check_idempotency_key(idempotency_key)
        raw = await read_control_body(request, allow_empty=False, routes="remixes", example=REMIX_EXAMPLE,
                                      too_large_advice=f"a remix's one field, prompt, takes at most "
                                                       f"{MAX_PROMPT_CHARACTERS:,} characters")
    except ApiError:
        await drain(request)
        raise
    body = _parse_body(raw)
    if idempotency_key is not None:
        # A retry whose first answer was lost gets its remix back even where the source has since been deleted or
        # expired (the remix does not need it any more); another body under the key is admit's 409.
        replayed = live_job(ctx, ctx.store.get_by_idempotency_key(idempotency_key))
        if replayed is not None and replayed.request_hash == _remix_hash(video_id, body.prompt):
            return JSONResponse(ctx.view(replayed), headers={"Idempotent-Replayed": "true"})
    if ctx.variant.family == SUPER_RESOLUTION:
        raise ApiError(400, "This server runs the super-resolution model, whose jobs read no prompt, so there is "
                            "nothing to remix: upscale another source with POST /v1/videos.",
                       code="invalid_request", param="video_id")
    source = live_job(ctx, ctx.store.get(video_id))
    if source is None:
        raise ApiError(404, f"Video {video_id!r} not found.", code="video_not_found", param="video_id")
    if source.status.is_terminal and source.status != JobStatus.COMPLETED:
        # Failed or cancelled: it will never complete, so "poll it" would be a dead end (the content route's rule).
        raise ApiError(409, f"Video {video_id!r} is {source.status.value} and will never be completed, so there is "
                            "nothing to remix: create a new job with POST /v1/videos with the new prompt, seed "
                            f"{_seed(source)} and the source's other settings.",
                       code="video_not_ready", param="video_id")
    if source.status != JobStatus.COMPLETED:
        raise ApiError(409, f"Video {video_id!r} is {source.status.value}; a remix takes a completed video: poll GET "
                            f"/v1/videos/{video_id} until its status is completed, then remix it.",
                       code="video_not_ready", param="video_id")
    params = dataclasses.replace(SamplingParams(**source.params), prompt=body.prompt)
    params = await on_input_check_threads(_own_inputs, ctx, source, params)
    try:
        resolved, notes = ctx.engine.resolve(params)
    except ValueError as exc:
        # The prompt (too long for the text encoder, say), or a source setting this server no longer takes
        # (restarted with other limits): either way the client is told what the engine said.
        raise ApiError(400, f"The remix of {video_id!r} cannot run: {exc}", code="invalid_parameter",
                       param="prompt" if "prompt" in str(exc) else "video_id") from None
    assert isinstance(resolved, GenerateRequest)  # a generation server (checked above)
    uploaded = params.image_path is not None and params.image_path in source.upload_files
    # An uploaded image is named as the upload it was in any message, never by the server's path for it.
    await on_input_check_threads(check_inputs_readable, params, {"image_path": "input_reference"} if uploaded else {},
                                 (resolved.height, resolved.width))
    await refuse_unwritable_output(request, ctx, uploads=uploaded)
    job_id = f"video_{secrets.token_hex(16)}"
    uploads: tuple[str, ...] = ()
    try:
        if uploaded:
            assert params.image_path is not None
            uploads = (str(await on_input_check_threads(_own_copy, ctx, source, params.image_path, job_id)),)
            params = dataclasses.replace(params, image_path=uploads[0])
        job = Job(
            id=job_id, model=ctx.model_name, created_at=time.time(),
            params={k: v for k, v in dataclasses.asdict(params).items() if k in source.params or k == "prompt"},
            size=size_text(resolved.height, resolved.width), seconds=seconds_text(resolved.num_frames, resolved.fps),
            upload_files=uploads, idempotency_key=idempotency_key, request_hash=_remix_hash(video_id, body.prompt),
            warnings=tuple(notes), remixed_from_video_id=source.id,
        )
        stored, created = admit_job(ctx, job)
    except BaseException:
        ctx.artifacts.remove(list(uploads))
        raise
    if not created:
        ctx.artifacts.remove(list(uploads))  # a replay: the stored remix owns its own copy
    return JSONResponse(ctx.view(stored), headers={} if created else {"Idempotent-Replayed": "true"})


def _parse_body(raw: Any) -> VideoRemixBody:
    if isinstance(raw, dict):
        others = sorted(set(raw) - {"prompt"})
        if others:
            raise ApiError(400, f"A remix takes only prompt, not {', '.join(others)}: it keeps every other setting "
                                "of the source job, the seed included. To change them, create a job with POST "
                                "/v1/videos.", code="invalid_parameter", param=others[0])
    body = parse_json_body(VideoRemixBody, raw, string_fields={"prompt"})
    if not body.prompt.strip():
        raise ApiError(400, "prompt is empty; send the remix's prompt, e.g. " + REMIX_EXAMPLE + ".",
                       code="invalid_parameter", param="prompt")
    if len(body.prompt) > MAX_PROMPT_CHARACTERS:
        raise ApiError(400, f"prompt has {len(body.prompt):,} characters; at most {MAX_PROMPT_CHARACTERS:,} are "
                            "taken.", code="invalid_parameter", param="prompt")
    return body


def _own_inputs(ctx: ServerContext, source: Job, params: SamplingParams) -> SamplingParams:
    """The remix's reference image: the source's upload if it still has it (copied to the remix's own upload once
    every check has passed: `_own_copy`), or its server-side `image_path`, checked against --allowed-input-dir as the
    server has it now."""
    image = params.image_path
    if image is None:
        return params
    if image in source.upload_files:
        if not Path(image).is_file():
            raise _upload_gone(source)
        return params
    try:
        checked = ctx.inputs.check("image_path", image)
    except ApiError as error:  # the source was created under other --allowed-input-dir folders, or the file left
        raise ApiError(error.status, f"The source job's reference image can no longer be read: {error.message} "
                                     "Create a new job with POST /v1/videos (uploading the image) instead.",
                       code=error.code, param="video_id") from None
    return dataclasses.replace(params, image_path=checked)


def _own_copy(ctx: ServerContext, source: Job, image: str, job_id: str) -> Path:
    """The remix's own upload of the source's uploaded image (a hard link or a copy): each job deletes only its own,
    so the source's deletion while the remix waits or runs leaves the remix its image."""
    try:
        return ctx.artifacts.copy_upload(image, job_id, "input_reference")
    except FileNotFoundError:  # the source was deleted (or expired) since it was looked up: as if before
        raise ApiError(404, f"Video {source.id!r} not found.", code="video_not_found", param="video_id") from None


def _seed(source: Job) -> int:
    """The seed the source ran (or would have run) with: its stored one, else the variants' default."""
    seed = source.params.get("seed")
    return DEFAULT_SEED if seed is None else seed


def _upload_gone(source: Job) -> ApiError:
    """A 400 for a source made from an uploaded image the server no longer has: one that completed under a server
    that deleted uploads when their job ended, or whose file was removed from the upload folder."""
    seed = _seed(source)
    return ApiError(400, f"Video {source.id!r} was made from an uploaded reference image that the server no longer "
                         "has (servers before this one deleted an upload when its job ended), so it cannot be "
                         "remixed: create a new job with POST /v1/videos, uploading the image again "
                         f"(input_reference), with the new prompt, seed {seed} and the source's other settings.",
                    code="invalid_request", param="video_id")


def _remix_hash(video_id: str, prompt: str) -> str:
    """What an Idempotency-Key replay must repeat: the source and the prompt."""
    return hashlib.sha256(json.dumps({"remix_of": video_id, "prompt": prompt}).encode()).hexdigest()
