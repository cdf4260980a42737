"""OpenAI-shaped errors: `{"error": {"message", "type", "param", "code"}}` with the right HTTP status."""

from __future__ import annotations

import errno
import logging
import sqlite3
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match

from k6serve.request import error_type_name

logger = logging.getLogger(__name__)

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "invalid_request_error",
    409: "conflict_error",
    412: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    416: "invalid_request_error",
    429: "rate_limit_error",
}


class ApiError(Exception):
    """An error answered to the client; never a crash of the server."""

    def __init__(self, status: int, message: str, *, code: str, param: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param
        self.headers = headers or {}


def disk_full(exc: BaseException) -> bool:
    """A write refused for lack of space: ENOSPC or a quota (EDQUOT), or SQLite's "database or disk is full"."""
    if isinstance(exc, sqlite3.OperationalError):
        return getattr(exc, "sqlite_errorcode", None) == sqlite3.SQLITE_FULL
    return isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT)


def insufficient_storage(exc: BaseException) -> ApiError:
    """The 507 for a request that needed a write the disk had no room for (`disk_full`)."""
    logger.warning("a request failed: the server's disk is full (%s)", exc)
    return ApiError(507, "The server's disk is full, so this request could not be completed (an upload is not kept); "
                         "retry it later. The server's operator must free space where its --output-path and "
                         "--job-store are; DELETE /v1/videos/{id} of a finished job removes its video.",
                    code="insufficient_storage", headers={"Connection": "close"})


# A write refused by the folder's permissions or a read-only mount (chmod, remount), not by a full disk.
WRITE_REFUSED_ERRNOS = (errno.EACCES, errno.EPERM, errno.EROFS)


def write_refused(exc: BaseException) -> bool:
    """A write refused for want of permission or on a read-only mount (`WRITE_REFUSED_ERRNOS`), or SQLite's "attempt
    to write a readonly database"."""
    if isinstance(exc, sqlite3.OperationalError):
        return (getattr(exc, "sqlite_errorcode", None) or 0) & 0xFF == sqlite3.SQLITE_READONLY
    return isinstance(exc, OSError) and exc.errno in WRITE_REFUSED_ERRNOS


def output_not_writable(detail: object, *, where: str = "output folder (--output-path)") -> ApiError:
    """The 507 for a request that needed a write into the output folder (or the job store) once it stopped taking
    writes (`write_refused`). The client is told which of the server's folders, by its flag, and not its path, as
    for a full disk; `detail` (the path or the error) goes to the server's log."""
    logger.warning("a request failed: the server's %s is not writable (%s)", where, detail)
    return ApiError(507, f"The server cannot write to its {where}: it was made read-only, or its permissions "
                         "changed, after the server started, so this request could not be completed (an upload is "
                         "not kept). The server's operator must make it writable again (e.g. chmod u+w, or "
                         "remount it read-write); then retry.",
                    code="output_not_writable", headers={"Connection": "close"})


def error_body(status: int, message: str, *, code: str | None, param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": _TYPES.get(status, "server_error"), "param": param,
                      "code": code}}


def error_response(error: ApiError) -> JSONResponse:
    headers = error.headers
    if error.status == 409:
        # OpenAI's SDKs retry a 409 twice (at OpenAI it is a lock timeout), re-sending any upload; ours is a
        # conflict of the request itself (idempotency key, request_id), which every retry gets again.
        headers = {"X-Should-Retry": "false", **headers}
    return JSONResponse(error_body(error.status, error.message, code=error.code, param=error.param),
                        status_code=error.status, headers=headers)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {"loc": (), "msg": "invalid request"}
        param = ".".join(str(p) for p in first.get("loc", ()) if p not in ("body", "query", "path")) or None
        message = f"{param or 'request'}: {first['msg']}"
        if param == "variant" and request.url.path.endswith("/content"):
            # pydantic's "Input should be 'video', 'thumbnail' or 'spritesheet'" does not say what each one is.
            given = first.get("input")
            message = (f"variant: one of 'video' (the MP4, the default), 'thumbnail' (its middle frame, WebP) or "
                       f"'spritesheet' (16 of its frames, JPEG), got {given!r}.")
            if isinstance(given, str) and given.strip().isdigit():
                # SGLang's ?variant=N indexes a job's outputs; its client's ?variant=0 read as a thumbnail's refusal.
                message = (f"variant: {given!r} is SGLang's index of a job's outputs; a k6serve job makes one video, "
                           "served without variant (or with variant=video).")
        return JSONResponse(error_body(400, message, code="invalid_parameter", param=param), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 405 and request.url.path.rstrip("/") in _UNSERVED_VIDEO_ROUTES:
            # POST /v1/videos/edits matches GET/DELETE /v1/videos/{video_id}: a 405 "does not take POST, only GET
            # or HEAD or DELETE" read as if the route existed, and the SDK has no class for 405 (a 404 is its
            # NotFoundError). These are OpenAI routes this server does not have: 404.
            exc = StarletteHTTPException(404)
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
        headers = getattr(exc, "headers", None)
        if exc.status_code == 405:
            # RFC 9110 15.5.6: Allow lists every method the path takes; Starlette's names those of the first route
            # that matched it only (POST for /v1/videos, which takes GET too).
            headers = {**(headers or {}), "Allow": ", ".join(_allowed_methods(request))}
        return JSONResponse(error_body(exc.status_code, _routing_message(request, exc), code=code),
                            status_code=exc.status_code, headers=headers)

    @app.exception_handler(OSError)
    @app.exception_handler(sqlite3.OperationalError)
    async def _storage(request: Request, exc: Exception) -> JSONResponse:
        # A full disk, or a job store made read-only, is the machine's state, not a bug: say so (507) rather than
        # "Internal server error".
        if disk_full(exc):
            return error_response(insufficient_storage(exc))
        if isinstance(exc, sqlite3.OperationalError) and write_refused(exc):
            return error_response(output_not_writable(exc, where="job store (--job-store)"))
        raise exc  # answered by `_unexpected`, as before

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        # Logged by Starlette; the client gets a shaped 500 and the server keeps serving.
        return JSONResponse(error_body(500, f"Internal server error: {type(exc).__name__}", code="internal_error"),
                            status_code=500)


# OpenAI's video routes that sit where a job id would (client.videos.edit, .extend, .create_character).
_UNSERVED_VIDEO_ROUTES = frozenset({"/v1/videos/edits", "/v1/videos/extensions", "/v1/videos/characters"})


def _routing_message(request: Request, exc: StarletteHTTPException) -> str:
    """Starlette's bare "Not Found" / "Method Not Allowed", with the request's route and where the routes are."""
    if exc.status_code not in (404, 405):
        return str(exc.detail)
    path = request.url.path
    message = (f"There is no route {request.method} {path} on this server" if exc.status_code == 404 else
               f"{path} does not take {request.method}, only {' or '.join(_allowed_methods(request))}")
    message += "; GET /openapi.json lists the routes and their methods."
    if path.startswith("/v1/videos/"):
        # OpenAI's SDK has these calls (client.videos.edit, .extend, .create_character); a bare 404 or 405 left
        # its user guessing whether the id or the server was wrong.
        message += (" k6serve serves OpenAI's video create, retrieve, list, download, delete and remix, not edits, "
                    "extensions or characters: create a new job with POST /v1/videos.")
    elif exc.status_code == 404 and (instead := _sglang_route_note(path)) is not None:
        # SGLang's server has these routes: a health check or a client moved over got only "no route".
        message += f" {path} is SGLang's route; {instead}"
    return message


def _sglang_route_note(path: str) -> str | None:
    """What k6serve serves instead of SGLang's diffusion route `path`, or None when `path` is not one of them."""
    path = path.rstrip("/") or "/"
    if path == "/v1/images" or path.startswith("/v1/images/"):
        return "Kandinsky 6 makes videos, so there is no image API: create a video job with POST /v1/videos."
    return _SGLANG_ROUTES.get(path)


_SGLANG_ROUTES = {
    "/health_generate": "k6serve's liveness check is GET /health (503 while the model loads).",
    "/v1/model_info": "GET /v1/models describes the served model.",
    "/models": "GET /v1/models describes the served model.",
    "/vertex_generate": "k6serve has no Vertex AI shim: create a job with POST /v1/videos and download its MP4 from "
                        "GET /v1/videos/{id}/content.",
}


def _allowed_methods(request: Request) -> list[str]:
    """The methods some route takes at the request's path (asked of each route as the router asks it: FastAPI nests
    an included router's routes in one route)."""
    routes = request.app.router.routes
    return [method for method in _METHODS
            if any(route.matches({**request.scope, "method": method})[0] == Match.FULL for route in routes)]


_METHODS = ("GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS")


def client_words(error: BaseException) -> str:
    """An unexpected failure as the client reads it: its type and first lines, without the worker's traceback that
    a rank's error carries as text (4,800 characters with the server's file paths), which the log keeps."""
    text = str(error).split("\nTraceback (most recent call last)")[0].strip()
    text = text if len(text) <= _CLIENT_MESSAGE_CHARS else text[:_CLIENT_MESSAGE_CHARS - 3] + "..."
    return f"{error_type_name(error)}: {text}" if text else error_type_name(error)


_CLIENT_MESSAGE_CHARS = 500
