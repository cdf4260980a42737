"""What the server answers, as the pydantic models the OpenAPI document shows: a video job (`VideoJob`, made from a
stored `Job` by `job_view`), the job list, a deleted or a cancelled job, the model cards, the LoRA and memory routes'
answers, and the OpenAI-shaped error (`ErrorResponse`, with the statuses each group of routes lists).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from k6serve.lora.spec import LoraAdapterState
from k6serve.models.variants import DEFAULT_SEED
from k6serve.runtime.memory import MemoryRankReport
from k6serve.serve.jobs import Job, JobStatus, expires_at

# The answers' models: a field with a default is still always sent, so it is `required` in the document (a generated
# TypeScript client typed `warnings?: string[]` and made every reader check for undefined).
_ANSWER_CONFIG = ConfigDict(json_schema_serialization_defaults_required=True)


class MemoryReply(BaseModel):
    # Not _ANSWER_CONFIG: every field here is sent, and pydantic's setting would mark the rank reports' optional keys
    # (`replica` and `rank`, sent only by multi-process engines; the GPU figures of `after`) required too.
    status: Literal["ok", "already_released", "not_released"] = Field(
        description="'ok' when memory moved; otherwise nothing changed (released twice, or resumed while not "
                    "released).")
    message: str
    memory_released: bool = Field(description="Whether the memory is released now (generation waits meanwhile).")
    moved_bytes: int = Field(description="Bytes moved between the GPUs and host memory, over every rank.")
    num_waiting_requests: int = Field(description="Requests held in the engine for a resume (not the stored queue).")
    ranks: list[MemoryRankReport] = Field(description="One report per rank of every replica: what moved, by owner, "
                                                      "and what the process still holds on its GPU ('after').")


class LoraResult(BaseModel):
    model_config = _ANSWER_CONFIG
    status: Literal["ok"] = "ok"
    message: str
    loras: list[LoraAdapterState] = Field(description="The loaded adapters and their state, one object each.")


class LoraList(BaseModel):
    model_config = _ANSWER_CONFIG
    loras: list[LoraAdapterState] = Field(description="The loaded adapters and their state, one object each.")


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
    # OpenAI's Video object has it, required (null or an id) in its SDKs' types.
    remixed_from_video_id: str | None = Field(
        default=None, description="For a remix (POST /v1/videos/{video_id}/remix), the id of the video it remixed; "
                                  "null otherwise.")
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
ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {status: {"model": ErrorResponse}
                                                    for status in (400, 401, 404, 409, 413, 415, 429, 503, 507)}
CONTROL_ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {status: {"model": ErrorResponse}
                                                            for status in (400, 401, 413, 415, 500, 503)}


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
        remixed_from_video_id=job.remixed_from_video_id,
        url=f"{root_path}/v1/videos/{job.id}/content" if job.status == JobStatus.COMPLETED else None,
        warnings=list(job.warnings),
        waiting_for="resume_memory_occupation" if memory_released and job.status == JobStatus.QUEUED else None,
    )
