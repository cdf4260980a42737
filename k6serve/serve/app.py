"""Builds the FastAPI app from an Engine, a JobStore and an ArtifactStore (tests pass fakes): the job runner, the
routes, the middlewares (`middleware.py`) with CORS, the lifespan (runner, webhooks, expiry sweep) and the OpenAPI
document as the server answers. `serve()`, the `k6serve serve` entry point that runs it under uvicorn, is in
`server_process.py`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from k6serve.models.kandinsky6_sr.config_before_loading import sr_tiling_before_loading
from k6serve.models.variants import SUPER_RESOLUTION
from k6serve.runtime.engine import Engine
from k6serve.serve.artifacts import ArtifactStore
from k6serve.serve.body_documentation import SHARED_SCHEMAS, request_body_schema
from k6serve.serve.control_bodies import (
    MemoryOccupationBody,
    MergeLoraBody,
    SetLoraBody,
    UnloadLoraBody,
    UnmergeLoraBody,
)
from k6serve.serve.errors import install_error_handlers
from k6serve.serve.input_paths import InputPathPolicy, LoraPathPolicy
from k6serve.serve.expiry import sweep_expired
from k6serve.serve.jobs import JobStore
from k6serve.serve.metrics import ServerMetrics
from k6serve.serve.middleware import BearerAuth, NormaliseRequestTarget, RefuseConflictingFraming, RefuseOtherSites
from k6serve.serve.routes import OPENAPI_TAGS, router
from k6serve.serve.runner import JobRunner
from k6serve.serve.server_context import ServerContext
from k6serve.serve.settings import ServerSettings
from k6serve.serve.video_create_body import FILE_FIELDS, VideoCreateBody, input_reference_target
from k6serve.serve.video_remix import VideoRemixBody
from k6serve.serve.webhook_outbox import drop_unsent_events
from k6serve.serve.webhook_sender import WebhookSender, age_bound

logger = logging.getLogger(__name__)

# What a page of an --allowed-origin may do: the routes' methods (HEAD and GET for the download), and every request
# header (the OpenAI JS SDK sends its own X-Stainless-* ones besides Authorization and Idempotency-Key).
CORS_METHODS = ("GET", "HEAD", "POST", "DELETE")
# The answers' headers a page's script may read beyond the ones browsers always show (Content-Type, -Length, ...):
# the poll hint the SDK reads, the retry advice of a 429 / 503, the replayed create, the download's range and name.
CORS_EXPOSED = ("openai-poll-after-ms", "Retry-After", "X-Should-Retry", "Idempotent-Replayed", "Accept-Ranges",
                "Content-Range", "Content-Disposition", "ETag", "WWW-Authenticate")


def served_model_names(engine: Engine, served_model_name: str | None = None) -> tuple[str, ...]:
    """The id shown by /v1/models first (`--served-model-name` when given), then the other names a request's `model`
    may use, lower-cased (a request naming the checkpoint keeps working when the operator renames it)."""
    variant = engine.variant
    model_path = engine.config.model.model_path
    names = [served_model_name, variant.hub_id or Path(model_path).name, variant.name, Path(model_path).name]
    if variant.hub_id:
        names.append(variant.hub_id.split("/")[-1])
    unique = list(dict.fromkeys(n for n in names if n))
    return tuple([unique[0]] + [n.lower() for n in unique])


def build_app(*, engine: Engine, store: JobStore, artifacts: ArtifactStore, settings: ServerSettings,
              before_serving: Callable[[], None] | None = None) -> FastAPI:
    """The app; `before_serving` is called once its start-up (the job runner's) is done, right before uvicorn
    accepts connections (`serve` stops its loading responder there)."""
    metrics = ServerMetrics()
    runner = JobRunner(engine, store, artifacts, metrics, max_queued_jobs=settings.max_queued_jobs)
    if settings.webhook_urls:
        from k6serve import __version__

        # The job store keeps each event until it is delivered: a restart, or a start after a crash, sends it then.
        # No event is retried or resent past the output TTL: its video is deleted by then (a late video.completed
        # would name a 404).
        runner.webhooks = WebhookSender(settings.webhook_urls, settings.webhook_secret or "",
                                        user_agent=f"k6serve/{__version__}", on_outcome=metrics.webhook, outbox=store,
                                        give_up_after_s=age_bound(settings.output_ttl_s))
    allowed = list(settings.allowed_input_dirs) or [Path("inputs")]
    names = served_model_names(engine, settings.served_model_name)
    model = engine.config.model
    ctx = ServerContext(engine=engine, store=store, artifacts=artifacts, settings=settings, metrics=metrics,
                        runner=runner, inputs=InputPathPolicy(allowed, upload_dir=artifacts.upload_dir),
                        lora_paths=LoraPathPolicy(settings.allowed_lora_dirs),
                        model_name=names[0], served_names=names[1:], started_at=time.time(),
                        sr_tiling=sr_tiling_before_loading(model.model_path, model.model_id, model.load_format))
    runner.inputs = ctx.inputs

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if runner.webhooks is not None:
            runner.webhooks.start()
        else:  # what a run with --webhook-url kept has no one to send it now
            drop_unsent_events(store)
        runner.start()
        if before_serving is not None:
            await asyncio.to_thread(before_serving)
        sweeper = asyncio.create_task(_sweep_expired(ctx))
        try:
            yield
        finally:
            sweeper.cancel()
            await asyncio.to_thread(runner.stop)
            if runner.webhooks is not None:  # after the runner: the last jobs' events are queued by then
                await asyncio.to_thread(runner.webhooks.stop)

    app = FastAPI(title="k6serve", version="0.1.0", lifespan=lifespan,
                  description="OpenAI-style asynchronous video jobs for Kandinsky 6 generation and super-resolution.")
    app.state.ctx = ctx
    install_error_handlers(app)
    app.include_router(router)
    app.openapi = lambda: _openapi(app)  # type: ignore[method-assign]  # FastAPI's documented way to replace it
    if settings.api_key:
        app.add_middleware(BearerAuth, api_key=settings.api_key, metrics=metrics)
    else:
        app.add_middleware(RefuseOtherSites, bound_host=settings.host, metrics=metrics,
                           allowed_origins=settings.allowed_origins)
    if settings.allowed_origins:
        # Outside the key check: a browser asks first (a preflight OPTIONS, which carries no Authorization header),
        # and a 401 or 403 must carry these headers too, or the page's script reads a network error, not why.
        from starlette.middleware.cors import CORSMiddleware

        app.add_middleware(CORSMiddleware, allow_origins=list(settings.allowed_origins),
                           allow_methods=list(CORS_METHODS), allow_headers=["*"], expose_headers=list(CORS_EXPOSED),
                           allow_credentials=False, max_age=600)
    app.add_middleware(NormaliseRequestTarget, root_path=settings.root_path)
    app.add_middleware(RefuseConflictingFraming)  # added last: outermost
    return app


def _openapi(app: FastAPI) -> dict[str, Any]:
    """FastAPI's schema plus the create, LoRA and memory bodies, which the handlers read themselves (so FastAPI cannot
    see them)."""
    if app.openapi_schema is None:
        root_path = app.state.ctx.settings.root_path
        schema = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes,
                             servers=[{"url": root_path}] if root_path else None,
                             tags=OPENAPI_TAGS)  # the routes' groups, described (each route has its tag)
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        body = request_body_schema(VideoCreateBody)
        components["VideoCreateBody"] = body
        # A form field is text or absent, never JSON null: a client generated with null in the type sent "None".
        form = {**body, "title": "VideoCreateForm",
                "properties": {name: _without_null(value) for name, value in body["properties"].items()}}
        super_resolution = app.state.ctx.variant.family == SUPER_RESOLUTION
        for field_name, target in FILE_FIELDS.items():
            if field_name == "input_reference":  # what the served model reads it as (the SR source video there)
                target = input_reference_target(super_resolution=super_resolution)
            form["properties"][field_name] = {"type": "string", "format": "binary",
                                              "description": f"Uploaded file, used as {target}."}
        components["VideoCreateForm"] = form
        for model in (SetLoraBody, MergeLoraBody, UnmergeLoraBody, UnloadLoraBody, MemoryOccupationBody,
                      VideoRemixBody):
            components[model.__name__] = request_body_schema(model)
        components.update(SHARED_SCHEMAS)  # the enums several fields refer to
        _errors_as_served(schema, api_key=bool(app.state.ctx.settings.api_key))
        app.openapi_schema = schema
    return app.openapi_schema


def _without_null(schema: dict[str, Any]) -> dict[str, Any]:
    """A property's schema without its `null` alternative (`anyOf: [X, null]` becomes X, with the description)."""
    options = [option for option in schema.get("anyOf", ()) if option != {"type": "null"}]
    if "anyOf" not in schema or len(options) == len(schema["anyOf"]):
        return schema
    rest = {key: value for key, value in schema.items() if key != "anyOf" and not (key == "default" and value is None)}
    return {**rest, **options[0]} if len(options) == 1 else {**rest, "anyOf": options}


def _errors_as_served(schema: dict[str, Any], *, api_key: bool) -> None:
    """The error answers as the server gives them: no 422 (validation errors are 400s with the ErrorResponse body,
    `errors.py`; a generated client carried a dead HTTPValidationError branch), any other status as the `default`
    ErrorResponse (403 cross_site_request, 405, 500...), and with --api-key the bearer scheme, /health excepted."""
    for path, item in schema["paths"].items():
        for operation in item.values():
            responses = operation.setdefault("responses", {})
            responses.pop("422", None)
            if path != "/metrics":  # its answers are text; its errors JSON, as everywhere
                responses.setdefault("default", {"description": "Error", "content": {
                    "application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}}})
            if api_key and path == "/health":
                operation["security"] = []
    components = schema["components"]["schemas"]
    for name in ("HTTPValidationError", "ValidationError"):
        components.pop(name, None)
    if api_key:
        schema["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer",
                                                              "description": "The server's --api-key."}}
        schema["security"] = [{"bearer": []}]


async def _sweep_expired(ctx: ServerContext) -> None:
    """Delete finished jobs and their files once past their `expires_at` (the routes already answer for such a job
    as if it were gone; this frees the disk of the jobs nobody asks about)."""
    while True:
        if ctx.settings.output_ttl_s > 0:
            try:
                removed = await asyncio.to_thread(sweep_expired, ctx)
                if removed:
                    logger.info("removed %d expired job(s)", removed)
            except Exception:  # the sweep must never take the server down
                logger.exception("expired-output sweep failed")
        await asyncio.sleep(ctx.settings.cleanup_interval_s)
