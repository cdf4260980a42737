"""Builds the FastAPI app from an Engine, a JobStore and an ArtifactStore (tests pass fakes), and `serve()`,
the `k6serve serve` entry point that runs it under uvicorn.
"""

from __future__ import annotations

import asyncio
import codecs
import contextlib
import errno
import hmac
import ipaddress
import logging
import os
import re
import signal
import socket
import sqlite3
import sys
import threading
import time
import urllib.parse
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from starlette.types import ASGIApp, Receive, Scope, Send

from k6serve.caching.preflight import warn_if_the_default_steps_do_not_fit
from k6serve.models.kandinsky6_sr.config_before_loading import sr_tiling_before_loading
from k6serve.models.variants import SUPER_RESOLUTION
from k6serve.runtime.engine import Engine, check_before_loading
from k6serve.serve.artifacts import ArtifactStore
from k6serve.serve.errors import error_body, install_error_handlers
from k6serve.serve.input_paths import InputPathPolicy, LoraPathPolicy
from k6serve.serve.expiry import sweep_expired
from k6serve.serve.jobs import JobStore, SqliteJobStore, hold_exclusively
from k6serve.serve.loading import LoadingResponder
from k6serve.serve.metrics import ServerMetrics
from k6serve.serve.routes import OPENAPI_TAGS, router
from k6serve.serve.runner import JobRunner
from k6serve.serve.schemas import (
    FILE_FIELDS,
    SHARED_SCHEMAS,
    MemoryOccupationBody,
    MergeLoraBody,
    SetLoraBody,
    UnloadLoraBody,
    UnmergeLoraBody,
    VideoCreateBody,
    input_reference_target,
    request_body_schema,
)
from k6serve.serve.server_context import ServerContext
from k6serve.serve.settings import ServerSettings, normal_origin, normal_root_path
from k6serve.serve.webhooks import (WEBHOOK_SECRET_ENV, WebhookSender, age_bound, check_webhook_url,
                                   drop_unsent_events)

logger = logging.getLogger(__name__)

API_KEY_ENV = "K6SERVE_API_KEY"
PUBLIC_PATHS = ("/health",)
# The API's description, which holds no job or secret: a browser opening /docs sends no Authorization header, so
# on a server with a key the interactive docs answered 401 and could not be used (its Authorize button sends the key).
DOCS_PATHS = ("/docs", "/docs/oauth2-redirect", "/redoc", "/openapi.json")
# What a page of an --allowed-origin may do: the routes' methods (HEAD and GET for the download), and every request
# header (the OpenAI JS SDK sends its own X-Stainless-* ones besides Authorization and Idempotency-Key).
CORS_METHODS = ("GET", "HEAD", "POST", "DELETE")
# The answers' headers a page's script may read beyond the ones browsers always show (Content-Type, -Length, ...):
# the poll hint the SDK reads, the retry advice of a 429 / 503, the replayed create, the download's range and name.
CORS_EXPOSED = ("openai-poll-after-ms", "Retry-After", "X-Should-Retry", "Idempotent-Replayed", "Accept-Ranges",
                "Content-Range", "Content-Disposition", "ETag", "WWW-Authenticate")


class BearerAuth:
    """Pure ASGI (so request bodies stay unread streams): every path but /health needs the API key."""

    def __init__(self, app: ASGIApp, api_key: str, metrics: ServerMetrics | None = None) -> None:
        self.app = app
        self.expected = api_key.encode()
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in PUBLIC_PATHS or (
                scope["path"] in DOCS_PATHS and scope["method"] in ("GET", "HEAD")):
            await self.app(scope, receive, send)
            return
        scheme, _, given = dict(scope["headers"]).get(b"authorization", b"").partition(b" ")
        # RFC 6750 / 9110: the auth scheme's name is case-insensitive ("bearer" is "Bearer").
        if scheme.lower() == b"bearer" and hmac.compare_digest(given.strip(), self.expected):
            await self.app(scope, receive, send)
            return
        from fastapi.responses import JSONResponse

        if self.metrics is not None and scope["method"] == "POST" and scope["path"] == "/v1/videos":
            # `k6serve_requests_rejected_total` counts every refused create, and this one never reaches the route
            # that counts the others: a client with a wrong key showed on no dashboard.
            self.metrics.rejected("invalid_api_key")
        message = "Missing or invalid API key: send 'Authorization: Bearer <key>' (the server's --api-key)."
        response = JSONResponse(error_body(401, message, code="invalid_api_key"), status_code=401,
                                headers={"WWW-Authenticate": "Bearer", "Connection": "close"})
        await _answer_unread(scope, receive, send, response)


class RefuseOtherSites:
    """Pure ASGI, for a server without --api-key: requests that a web page of another site makes through a visitor's
    browser are refused (/health excepted).

    A browser sends a cross-site POST of a form, or of a body without a JSON Content-Type, without asking the server
    first: the page reads nothing back, but the job is made, or the memory released (cross-site request forgery). A
    page whose own name it re-points at 127.0.0.1 (DNS rebinding) is same-origin with the server and reads every
    answer. So an `Origin` other than the server's own authority is a 403, and a server bound to a loopback address
    answers only Host names of the loopback. With --api-key neither can happen (a page cannot send the key), and
    programs (curl, the SDKs, the ComfyUI nodes) send no Origin. Pages of an --allowed-origin pass the Origin check:
    the operator chose to serve them (the CORS headers that let them read the answers come from outside)."""

    def __init__(self, app: ASGIApp, *, bound_host: str, metrics: ServerMetrics | None = None,
                 allowed_origins: tuple[str, ...] = ()) -> None:
        self.app = app
        self.loopback_only = _loopback(bound_host)
        self.metrics = metrics
        # --allowed-origin: pages the operator chose to serve ("*" needs --api-key, so never here).
        self.allowed_origins = frozenset(origin.encode("latin-1") for origin in allowed_origins)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in PUBLIC_PATHS:
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        host = headers.get(b"host", b"").decode("latin-1").strip()
        origin = headers.get(b"origin")
        problem = None
        if origin is not None and origin.strip() not in self.allowed_origins:
            text = origin.decode("latin-1").strip()
            if text == "null" or _authority(text) != host.lower():
                problem = f"it comes from a web page of another site (Origin {text!r})"
        if problem is None and self.loopback_only and host and not _loopback(_hostname(host)):
            problem = (f"its Host {host!r} is not a loopback name, and this server listens on the loopback only (a "
                       "web page re-pointing its name at this machine: DNS rebinding; a reverse proxy in front of it "
                       "should send Host: localhost)")
        if problem is None:
            await self.app(scope, receive, send)
            return
        from fastapi.responses import JSONResponse

        if self.metrics is not None and scope["method"] == "POST" and scope["path"] == "/v1/videos":
            self.metrics.rejected("cross_site_request")  # a refused create, as BearerAuth counts its own
        message = (f"Request refused: {problem}. A server without --api-key answers the programs of this machine "
                   "(curl, the OpenAI SDK, the ComfyUI nodes) and the web pages its --allowed-origin names, not other "
                   "pages, which could make jobs through a visitor's browser; to serve a browser client, start the "
                   "server with --allowed-origin <the page's origin> (and --api-key where others can reach it).")
        response = JSONResponse(error_body(403, message, code="cross_site_request"), status_code=403,
                                headers={"Connection": "close"})
        await _answer_unread(scope, receive, send, response)


async def _answer_unread(scope: Scope, receive: Receive, send: Send, response: Any) -> None:
    """Send a refusal made before the body was read, once what the client sends of it is drained (`drain`: bounded
    in bytes and time): closing the connection over unread bytes resets it, and a client still writing its body read
    the reset, not the 401 or 403 (the OpenAI SDK then retried and reported "Connection error"). A client that waits
    for "100 Continue" has sent no body: it gets the answer at once, and no Continue."""
    from starlette.requests import Request

    from k6serve.serve.uploads import drain

    if b"100-continue" not in dict(scope.get("headers", ())).get(b"expect", b"").lower():
        await drain(Request(scope, receive))
    await response(scope, receive, send)


def _authority(origin: str) -> str | None:
    """The host[:port] of an Origin header, lowercased; None for one that does not parse (refused as foreign)."""
    try:
        return urllib.parse.urlsplit(origin).netloc.lower()
    except ValueError:  # "http://[": a malformed header was a 500
        return None


def _hostname(host: str) -> str | None:
    """The name or address in a Host header, without its port or IPv6 brackets; None for one that does not parse."""
    try:
        return urllib.parse.urlsplit(f"//{host}").hostname
    except ValueError:
        return None


def _loopback(host: str | None) -> bool:
    """Whether `host` (a name or an address, IPv6 without brackets) names the loopback."""
    if not host:
        return False
    host = host.strip("[]").lower().removesuffix(".")  # "localhost." is the same name, fully qualified
    if host == "localhost" or host.endswith(".localhost"):
        return True
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        try:
            address = ipaddress.IPv4Address(socket.inet_aton(host))  # 127.1, as inet_aton and browsers read it
        except OSError:
            return False
    mapped = getattr(address, "ipv4_mapped", None)
    return address.is_loopback or (mapped is not None and mapped.is_loopback)


class NormaliseRequestTarget:
    """Pure ASGI: the router sees one path per resource.

    - `/v1/videos/` is `/v1/videos`. Starlette answered it with a bodiless 307 redirect, which curl (without -L) and
      clients that do not follow redirects on POST showed as an empty reply.
    - An absolute-form target (`GET http://host:port/v1/videos HTTP/1.1`) is its path: RFC 9112 (3.2.2) says a
      server MUST accept it, and clients configured to talk through a proxy that forwards targets unchanged send it.
      uvicorn puts the whole URL in `path`, which was a 404 "no route GET /http://...". The host in it is not
      checked against ours: the server has one site, whatever name it is reached by (as with `Host`).

    - With --root-path, a path under the prefix (a proxy that passes the path on: `/k6/v1/videos`) is the path
      below it; one without it (a proxy that strips the prefix) is served as it is.

    Outermost but for the framing check, so that the key check sees the same path as the router."""

    def __init__(self, app: ASGIApp, root_path: str = "") -> None:
        self.app = app
        self.root_path = root_path

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            scope = _origin_form(scope)
            if self.root_path:
                scope = _below_root_path(scope, self.root_path)
            path = scope.get("path", "")
            if len(path) > 1 and path.endswith("/"):
                scope = {**scope, "path": path.rstrip("/") or "/"}
                if scope.get("raw_path"):  # percent-encoded as sent: strip it alike rather than re-encode `path`
                    scope["raw_path"] = scope["raw_path"].rstrip(b"/") or b"/"
        await self.app(scope, receive, send)


_ABSOLUTE_FORM = re.compile(rb"^https?://[^/?#]*", re.IGNORECASE)


def _below_root_path(scope: Scope, root_path: str) -> Scope:
    """`scope` with the --root-path prefix taken off its `path` and `raw_path` when they start with it (`/k6` is `/`,
    `/k6/v1/videos` is `/v1/videos`, `/k6x` stays); the prefix is ASCII without '%' (`check_root_path`), so it is the
    same in both. The scope's `root_path` is set either way: /docs builds its schema's URL from it."""
    path = scope.get("path", "")
    if path != root_path and not path.startswith(root_path + "/"):
        return {**scope, "root_path": root_path}
    below = {**scope, "root_path": root_path, "path": path[len(root_path):] or "/"}
    raw = scope.get("raw_path") or b""
    prefix = root_path.encode("ascii")
    if raw == prefix or raw.startswith(prefix + b"/"):
        below["raw_path"] = raw[len(prefix):] or b"/"
    return below


def _origin_form(scope: Scope) -> Scope:
    """`scope` with an absolute-form target's scheme and authority dropped from `raw_path` and `path` (`http://h/x`
    -> `/x`, `http://h` -> `/`); any other scope as it is. The query string is uvicorn's already."""
    raw = scope.get("raw_path") or b""
    match = _ABSOLUTE_FORM.match(raw)
    if match is None:
        return scope
    raw_path = raw[match.end():] or b"/"
    return {**scope, "raw_path": raw_path, "path": urllib.parse.unquote(raw_path.decode("latin-1"))}


SUPPORTED_HTTP_VERSIONS = ("1.0", "1.1")
# The output folder's lock file (`serve`): hidden, beside the videos, in no job's name space.
SERVER_LOCK_NAME = ".k6serve-server.lock"

# How long uvicorn waits for the HTTP requests in flight on SIGTERM. Ours end at once (the runner answers its waiting
# calls with the shutdown error), so this bounds only a slow client's own transfer.
GRACEFUL_SHUTDOWN_S = 10.0
# After the engine's shutdown has ended the ranks, how long the server waits for a job that outlived the runner's
# stop() to have its outcome recorded, before closing the job store.
_OUTCOMES_AFTER_SHUTDOWN_S = 5.0
# How long the engine's shutdown waits, after the runner's stop, for a job still running to reach a boundary.
_CANCEL_WAIT_AFTER_STOP_S = 10.0


class RefuseConflictingFraming:
    """Pure ASGI: a request line of another HTTP version than 1.0 or 1.1 is refused (505, the API's JSON), and a request
    with both Transfer-Encoding and Content-Length is refused (400) and its connection closed. h11 reads such a body by
    Transfer-Encoding alone and kept the connection open; RFC 9112 (6.3) requires closing it, since a proxy in front may
    have framed the body by Content-Length instead: the request-smuggling pattern. No HTTP client sends both. Outermost,
    before anything reads the body."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope.get("http_version", "1.1") not in SUPPORTED_HTTP_VERSIONS:
            # h11 takes any "HTTP/d.d" request line (HTTP/9.9, HTTP/2.0 as text) and answered it as HTTP/1.1.
            from fastapi.responses import JSONResponse

            message = (f"HTTP/{scope['http_version']} is not supported: this server speaks HTTP/1.1 (and 1.0). Send "
                       "an HTTP/1.1 request (any HTTP client library does).")
            response = JSONResponse(error_body(505, message, code="http_version_not_supported"), status_code=505,
                                    headers={"Connection": "close"})
            await response(scope, receive, send)
            return
        if scope["type"] == "http":
            names = {name.lower() for name, _ in scope.get("headers", ())}
            if b"transfer-encoding" in names and b"content-length" in names:
                from fastapi.responses import JSONResponse

                message = ("The request has both Transfer-Encoding and Content-Length, which HTTP/1.1 does not allow "
                           "together: send one of them (an HTTP client library does).")
                response = JSONResponse(error_body(400, message, code="invalid_request"), status_code=400,
                                        headers={"Connection": "close"})
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


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
    app.openapi = lambda: _openapi(app)
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
        for model in (SetLoraBody, MergeLoraBody, UnmergeLoraBody, UnloadLoraBody, MemoryOccupationBody):
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


def settings_from_options(options: dict[str, Any]) -> ServerSettings:
    """CLI option names (flag names with '_') to ServerSettings; the API key falls back to $K6SERVE_API_KEY."""
    known = {"host", "port", "output_path", "job_store", "output_ttl", "max_queued_jobs", "max_upload_mb",
             "allowed_input_dir", "allowed_lora_dir", "allowed_origin", "api_key", "served_model_name", "root_path",
             "webhook_url", "webhook_secret"}
    unknown = sorted(set(options) - known)
    if unknown:
        raise ValueError(f"Unknown server option(s) {unknown}; valid: {sorted(known)}")
    values: dict[str, Any] = {}
    for name in ("host", "port", "max_queued_jobs", "max_upload_mb", "served_model_name"):
        if options.get(name) is not None:
            values[name] = options[name]
    for name in ("output_path", "job_store"):
        # Path("") is ".": an empty --output-path served from the working folder, an empty --job-store failed as
        # "PosixPath('.') has an empty name".
        if options.get(name) is not None and not str(options[name]).strip():
            raise ValueError(f"{_flag_name(name)} is empty; pass a path, or leave it out for the default.")
    if options.get("output_path") is not None:
        values["output_path"] = Path(options["output_path"])
    if options.get("root_path") is not None:
        values["root_path"] = normal_root_path(str(options["root_path"]))
    if options.get("job_store") is not None:
        values["job_store"] = Path(options["job_store"])
    if options.get("output_ttl") is not None:
        values["output_ttl_s"] = float(options["output_ttl"])
    for option in ("allowed_input_dir", "allowed_lora_dir"):
        if options.get(option):
            dirs = options[option]
            values[f"{option}s"] = tuple(_allowed_dir(d, option) for d in ([dirs] if isinstance(dirs, str) else dirs))
    if options.get("allowed_origin"):
        origins = options["allowed_origin"]
        normal = (normal_origin(origin) for origin in ([origins] if isinstance(origins, str) else origins))
        values["allowed_origins"] = tuple(dict.fromkeys(normal))  # in order, once each
    if options.get("webhook_url"):
        urls = options["webhook_url"]
        # Canonical, so one receiver spelled two ways is one URL, as the job store's kept events name it.
        values["webhook_urls"] = tuple(dict.fromkeys(check_webhook_url(url) for url in
                                                     ([urls] if isinstance(urls, str) else urls)))
    webhook_secret = options.get("webhook_secret")
    webhook_secret = (os.environ.get(WEBHOOK_SECRET_ENV) or None) if webhook_secret is None else webhook_secret
    if webhook_secret is not None:
        values["webhook_secret"] = webhook_secret
    # An explicit empty --api-key is refused by ServerSettings (it ran with no key at all); an empty
    # $K6SERVE_API_KEY is as if unset.
    api_key = options.get("api_key")
    from_environment = api_key is None and bool(os.environ.get(API_KEY_ENV))
    api_key = (os.environ.get(API_KEY_ENV) or None) if api_key is None else api_key
    if api_key is not None:
        values["api_key"] = api_key
    try:
        return ServerSettings(**values)
    except ValueError as exc:
        if from_environment and "--api-key" in str(exc):
            # The key came from the environment: the message named a flag the user never typed.
            raise ValueError(str(exc).replace("--api-key", f"${API_KEY_ENV} (the --api-key default)", 1)) from None
        raise


def _flag_name(option: str) -> str:
    return "--" + option.replace("_", "-")


def _allowed_dir(value: str, option: str) -> Path:
    """An --allowed-input-dir / --allowed-lora-dir: "" is Path("."), which let requests read any file under the
    working folder; a file allowed nothing."""
    flag, example = _flag_name(option), "./inputs" if option == "allowed_input_dir" else "./loras"
    if not str(value).strip():
        raise ValueError(f"{flag} is empty; pass a folder (e.g. {flag} {example}).")
    folder = Path(value).expanduser()  # a --config file's "~/loras" is not expanded by a shell
    if folder.exists() and not folder.is_dir():
        raise ValueError(f"{flag} {str(folder)!r} is a file, not a folder; pass the folder that holds the "
                         f"{'input files' if option == 'allowed_input_dir' else 'adapters'}.")
    return folder


def uvicorn_config(app: Any, **kwargs: Any) -> Any:
    """The uvicorn.Config the server runs under: the h11 protocol whose unparsable-request 400 is the API's JSON
    (`http_protocol.py`), no WebSockets (the API has none). The tests' servers take it from here too, so they answer
    what production answers."""
    import uvicorn

    from k6serve.serve.http_protocol import JsonErrorH11Protocol

    return uvicorn.Config(app, http=JsonErrorH11Protocol, ws="none", **kwargs)


def uvicorn_server(config: Any, on_exit: Callable[[], None], on_force: Callable[[], None] | None = None) -> Any:
    """A uvicorn.Server that calls `on_exit` (in a thread) as soon as a SIGINT / SIGTERM arrives.

    uvicorn first waits up to timeout_graceful_shutdown for the HTTP requests in flight and only then runs the
    lifespan teardown that stops the job runner. A LoRA request waiting behind a running job is such a request:
    it waited out the 10 s, was cancelled into a text/plain 500, and the running job went on meanwhile. Stopping
    the runner at the signal cancels the job at its next step and answers the waiting LoRA callers with the
    documented shutdown error, so the graceful wait ends at once."""
    import uvicorn

    class Server(uvicorn.Server):
        forced = False  # a second signal came: `serve` stops the engine without waiting for the running job

        def handle_exit(self, sig: int, frame: Any) -> None:
            if self.should_exit and not self.forced:
                # A second SIGTERM did nothing (uvicorn forces only on a second SIGINT) while a hung rank made the
                # stop take two minutes. The job stays queued either way (`JobRunner.stop`).
                self.forced = self.force_exit = True
                logger.warning("a second stop signal: stopping now, without waiting for the running job (it stays "
                               "in the queue)")
                if on_force is not None:
                    on_force()
            if not self.should_exit:
                threading.Thread(target=on_exit, name="k6serve-stop-at-signal", daemon=True).start()
            super().handle_exit(sig, frame)

    return Server(config)


class _Terminated(Exception):
    """SIGTERM's counterpart of KeyboardInterrupt, raised once uvicorn has shut down (see `_sigterm_raises`)."""


@contextlib.contextmanager
def _sigterm_raises(server: Any) -> Iterator[None]:
    """After its graceful shutdown uvicorn raises the signal it handled again, for the handler that was there before
    it. For SIGINT that is a KeyboardInterrupt; for SIGTERM the default handler ended the process on the spot, before
    the engine's shutdown and the job store's close in `serve`. Here SIGTERM raises instead, and `serve` returns 0
    as after Ctrl-C.

    SIGHUP (the terminal or SSH session closed, or a supervisor's reload) is not among uvicorn's signals: it ended
    the server on the spot, with no log line, its running job left in_progress (a second such exit during one job
    failed it as server_restarted). It now shuts `server` down as SIGTERM does (the ranks block it already), unless
    SIGHUP was ignored when the server started (`nohup`)."""

    def raise_terminated(signum: int, frame: Any) -> None:
        raise _Terminated

    def hang_up(signum: int, frame: Any) -> None:
        if server.should_exit:
            return  # a closed session sends SIGHUP twice (the shell's and the kernel's): not a second, forcing stop
        logger.warning("SIGHUP received (a closed terminal or session?): shutting down as on SIGTERM")
        server.handle_exit(signal.SIGTERM, frame)

    previous = signal.signal(signal.SIGTERM, raise_terminated)
    # Only where SIGHUP would end the process: `nohup` (or a supervisor) ignores it so that the server outlives the
    # session, and that stays so.
    hang_up_default = hasattr(signal, "SIGHUP") and signal.getsignal(signal.SIGHUP) == signal.SIG_DFL
    previous_hangup = signal.signal(signal.SIGHUP, hang_up) if hang_up_default else None
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
        if previous_hangup is not None:
            signal.signal(signal.SIGHUP, previous_hangup)


class _QuietProbes(logging.Filter):
    """Leaves out uvicorn's access lines for probes that succeed (GET / HEAD of /health and /metrics under 400): a
    supervisor's probe every few seconds buried the job lines, and --log-level warning, the only way to quiet them,
    dropped the jobs' start and end lines too. A failing probe is still logged. uvicorn logs the path as sent, so
    under a --root-path the prefixed paths count too."""

    def __init__(self, root_path: str = "") -> None:
        super().__init__()
        self.paths = _PROBE_PATHS | {root_path + path for path in _PROBE_PATHS}

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if not isinstance(args, tuple) or len(args) != 5:  # uvicorn's (client, method, path, version, status)
            return True
        _, method, path, _, status = args
        probe = method in ("GET", "HEAD") and str(path).split("?")[0] in self.paths
        return not (probe and isinstance(status, int) and status < 400)


_PROBE_PATHS = frozenset({"/health", "/metrics"})


def quiet_probe_access_lines(root_path: str = "") -> None:
    """Install `_QuietProbes` on uvicorn's access logger (in place of one installed before)."""
    access = logging.getLogger("uvicorn.access")
    for existing in [existing for existing in access.filters if isinstance(existing, _QuietProbes)]:
        access.removeFilter(existing)
    access.addFilter(_QuietProbes(root_path))


def server_url(host: str, port: int) -> str:
    """The server's URL for the log: an IPv6 address bracketed ("http://:::30000" for --host :: was no URL)."""
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def open_server_warning(host: str, port: int, api_key: str | None, *, lora_dirs: bool = False) -> str | None:
    """The start-up warning of a server that other machines can reach without a key, or None. Every client that
    reaches it can make jobs, and load LoRA adapters from any path the server can read (docs/http-api.md
    "Exposing the server"): a choice to make knowingly, not a default to miss."""
    if api_key or _loopback(host):
        return None
    reach = ("" if lora_dirs else
             ", set_lora with any path this server can read included (or limit it: --allowed-lora-dir)")
    return (f"serving on {host} without --api-key: any client that reaches port {port} can use every route{reach}; "
            f"set --api-key (or ${API_KEY_ENV}), or bind 127.0.0.1 behind a proxy that authenticates")


def listening_socket(host: str, port: int) -> socket.socket:
    """The server's socket, bound and listening before the model loads: a port in use or a host that is not this
    machine's fails at once with the fix (a ValueError), not after minutes of loading as uvicorn's own bind did.
    uvicorn then serves on this very socket, so no other process can take the port in between."""
    try:
        family, _, _, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                      flags=socket.AI_PASSIVE)[0]
    except socket.gaierror as exc:
        raise ValueError(f"--host {host!r} does not resolve ({exc.strerror}); pass an address of this machine, "
                         "e.g. 127.0.0.1 or 0.0.0.0 (every interface).") from None
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn: restart while old ones linger
        sock.bind(address)
        sock.listen(2048)
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise ValueError(f"port {port} on {host} is already in use; pass another --port, or stop the process "
                             "that listens on it.") from None
        if exc.errno in (errno.EADDRNOTAVAIL, errno.EACCES):
            fix = ("pass an address of this machine, e.g. 127.0.0.1 or 0.0.0.0" if exc.errno == errno.EADDRNOTAVAIL
                   else "ports below 1024 need privileges; pass a --port of 1024 or more")
            raise ValueError(f"cannot listen on {host}:{port} ({exc.strerror}); {fix}.") from None
        raise
    return sock


def serve(engine_options: dict[str, Any], server_options: dict[str, Any]) -> int:
    """Bind the port, open the job store, load the model (answering 503 "loading" on the port meanwhile) and serve
    until interrupted."""
    from k6serve.dependencies import require_package
    from k6serve.engine_arguments import build_engine_config

    require_package("uvicorn", "to run the HTTP server")  # imported where it runs: after the load, minutes away
    settings = settings_from_options(server_options)
    settings.check_paths()
    if codecs.lookup(sys.getfilesystemencoding()).name != "utf-8":
        # Requests' paths (image_path, video_path, lora_path) with non-ASCII characters cannot be opened then; each
        # is refused saying so (`unencodable_path`), and this says it once, at the start.
        logger.warning("this server's filesystem encoding is %s, not UTF-8: paths with characters it cannot hold "
                       "(Cyrillic, Chinese...) cannot be opened; start it under a UTF-8 locale (e.g. LANG=C.UTF-8) "
                       "or with PYTHONUTF8=1", sys.getfilesystemencoding())
    engine_options = dict(engine_options)
    config = build_engine_config(engine_options.pop("model_path"), **engine_options)
    # Before the port, the folders and their locks, so that a flag's mistake is told as such, not hidden behind a
    # port in use (the engine runs it again: reading a config or two).
    check_before_loading(config)
    warn_if_the_default_steps_do_not_fit(config)
    sock = listening_socket(settings.host, settings.port)
    folder_lock = None
    try:
        artifacts = ArtifactStore(settings.output_path)
        # One server per output folder too, whatever --job-store says: a second one's start-up sweep of partial
        # files would delete the first one's MP4 being written, and the two would name uploads alike.
        folder_lock = hold_exclusively(artifacts.root / SERVER_LOCK_NAME, (
            f"the output folder {str(artifacts.root)!r} is in use by another k6serve server (process {{holder}}); "
            "stop that one, or give this one its own --output-path."))
        try:
            store = SqliteJobStore(settings.job_store_path)
        except sqlite3.Error as exc:
            raise ValueError(f"cannot open the job store {str(settings.job_store_path)!r} ({exc}); pass a writable "
                             "--job-store file.") from None
    except BaseException:
        sock.close()
        if folder_lock is not None:
            folder_lock.close()
        raise
    # Answers 503 "loading" on the socket until uvicorn takes it (`loading.py`).
    responder = LoadingResponder(sock, root_path=settings.root_path, allowed_origins=settings.allowed_origins)
    responder.start()
    try:
        engine = Engine(config)
    except BaseException:
        responder.stop()
        sock.close()
        store.close()
        folder_lock.close()
        raise
    app = server = None
    try:
        app = build_app(engine=engine, store=store, artifacts=artifacts, settings=settings,
                        before_serving=responder.stop)
        port = sock.getsockname()[1]
        logger.info("serving %s on %s (jobs: %s, outputs: %s)", app.state.ctx.model_name,
                    server_url(settings.host, port), settings.job_store_path, artifacts.root)
        warning = open_server_warning(settings.host, port, settings.api_key, lora_dirs=bool(settings.allowed_lora_dirs))
        if warning is not None:
            logger.warning("%s", warning)
        if settings.allowed_origins:
            logger.info("web pages allowed to call the API from a browser (--allowed-origin): %s",
                        ", ".join(settings.allowed_origins))
        # uvicorn's lines (start-up, one access line per request) at --log-level (it was always "info": every poll
        # was logged, whatever the flag), through the root handler, so they carry its format and timestamps.
        quiet_probe_access_lines(settings.root_path)
        server = uvicorn_server(uvicorn_config(app, host=settings.host, port=port,
                                               log_level=logging.getLogger().getEffectiveLevel(), log_config=None,
                                               timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S),
                                on_exit=app.state.ctx.runner.stop, on_force=app.state.ctx.runner.stop_waiting)
        with _sigterm_raises(server), contextlib.suppress(KeyboardInterrupt, _Terminated):
            server.run(sockets=[sock])
    finally:
        responder.stop()  # a no-op once the app's start-up stopped it
        sock.close()
        # The runner's stop (at the signal and at the lifespan's end) has cancelled the running job and waited up to
        # 30 s for it: a job still running is in its MP4's tail or on a hung rank. The engine's own waits (30 s, then
        # 60 s after its cancel) made a hung rank's stop take two minutes, past every supervisor's grace period.
        forced = server is not None and server.forced
        engine.shutdown(timeout=0.0, cancel_wait_s=0.0 if forced else _CANCEL_WAIT_AFTER_STOP_S)
        if app is not None:
            # After a forced stop too (briefly): the ranks have ended, and a finisher must not meet a closed store.
            app.state.ctx.runner.wait_for_outcomes(1.0 if forced else _OUTCOMES_AFTER_SHUTDOWN_S, forced_too=True)
        store.close()
        folder_lock.close()
    return 0
