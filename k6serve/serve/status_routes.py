"""The status routes: the served model (OpenAI's `GET /v1/models` and `/v1/models/{model}`), `GET /health` for
supervisors and load balancers, and `GET /metrics` in Prometheus text."""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, PlainTextResponse

from k6serve.serve.errors import ApiError
from k6serve.serve.jobs import JobStatus
from k6serve.serve.metrics import CONTENT_TYPE
from k6serve.serve.response_models import ERROR_RESPONSES, ModelCard, ModelList
from k6serve.serve.server_context import NO_REPLICA, ServerContext, server_context

router = APIRouter()


def _model_card(ctx: ServerContext) -> dict[str, Any]:
    variant = ctx.variant
    card = ModelCard(id=ctx.model_name, created=int(ctx.started_at), root=ctx.engine.config.model.model_path,
                     num_gpus=ctx.engine.config.parallel.num_gpus, dit_precision=ctx.engine.precision,
                     vae_precision=ctx.engine.precision, family=variant.family, variant=variant.name,
                     default_num_inference_steps=variant.num_inference_steps,
                     default_guidance_scale=variant.guidance_scale,
                     quantization=ctx.engine.config.model.quantization)
    return card.model_dump(mode="json")


@router.get("/v1/models", response_model=ModelList, responses=ERROR_RESPONSES, summary="The served model",
            operation_id="listModels", tags=["models"])
async def list_models(request: Request) -> JSONResponse:
    return JSONResponse({"object": "list", "data": [_model_card(server_context(request))]})


# `:path`: a hub id has a slash (kandinskylab/Kandinsky-6.0-...), and a request's `model` may name the checkpoint.
@router.get("/v1/models/{model:path}", response_model=ModelCard, responses=ERROR_RESPONSES,
            summary="The served model, by name", operation_id="retrieveModel", tags=["models"])
async def retrieve_model(request: Request, model: str) -> JSONResponse:
    """OpenAI's `GET /v1/models/{model}` (the SDK's `client.models.retrieve`), which answered 404 "unknown route":
    the served model's card under any name a job's `model` may use, else 404 `model_not_found`."""
    ctx = server_context(request)
    if model.lower() not in ctx.served_names:  # the names a job's `model` takes, lower-cased
        raise ApiError(404, f"The model {model!r} is not served here: this server serves {ctx.model_name!r} (GET "
                            "/v1/models lists it).", code="model_not_found", param="model")
    return JSONResponse(_model_card(ctx))


@router.get("/health", summary="Liveness, and whether the GPU memory is released (no authentication)",
            operation_id="getHealth", tags=["operations"],
            responses={503: {"description": "The model is still loading (status 'loading') or no worker replica is "
                                            "left (status 'unavailable')"}})
async def health(request: Request) -> JSONResponse:
    """200 while a replica serves ("ok", or "degraded" with `dead_replicas`); 503 "unavailable" once none does, so
    a supervisor or load balancer sees a server whose workers died (it said "ok" before)."""
    ctx = server_context(request)
    # In a thread: finding a dead rank stops the rest of its replica, which can take a second or two.
    dead = await asyncio.to_thread(ctx.engine.dead_replicas)
    body: dict[str, Any] = {"status": "ok", "memory_released": ctx.runner.holds_queue()}
    if ctx.runner.running_count():
        # A hung worker's processes are alive, so the status stays "ok": this says how long the job has been silent.
        body["seconds_since_progress"] = round(ctx.runner.seconds_since_progress(), 1)
    warmups = ctx.engine.startup_warmups
    if warmups:  # `--warmup-mode server`: what start-up warmed, each shape's cost and the total
        body["warmup"] = {"seconds": round(sum(report.seconds for report in warmups), 3),
                          "shapes": [{"size": report.size, "seconds": round(report.seconds, 3)} for report in warmups]}
    if not dead:
        return JSONResponse(body)
    body["dead_replicas"] = dead
    if len(dead) < ctx.engine.num_replicas:
        return JSONResponse({**body, "status": "degraded"})
    return JSONResponse({**body, "status": "unavailable", "message": NO_REPLICA}, status_code=503)


@router.get("/metrics", response_class=PlainTextResponse, responses=ERROR_RESPONSES, summary="Prometheus metrics",
            operation_id="getMetrics", tags=["operations"])
async def metrics(request: Request) -> PlainTextResponse:
    ctx = server_context(request)
    counts = ctx.store.count_by_status()
    dead = await asyncio.to_thread(ctx.engine.dead_replicas)
    text = ctx.metrics.render(queue_depth=counts[JobStatus.QUEUED], jobs_by_status=counts,
                              running=ctx.runner.running_count(),
                              seconds_since_progress=ctx.runner.seconds_since_progress(),
                              replicas=ctx.engine.num_replicas, dead_replicas=len(dead),
                              webhook_pending=0 if ctx.runner.webhooks is None else ctx.runner.webhooks.pending)
    return PlainTextResponse(text, media_type=CONTENT_TYPE)
