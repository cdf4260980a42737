"""The app's own ASGI middlewares, outermost first as `build_app` adds them: `RefuseConflictingFraming` (the
HTTP version and the body's framing), `NormaliseRequestTarget` (one path per resource), then `BearerAuth` (the API
key) or, on a server without one, `RefuseOtherSites` (requests a web page of another site makes through a browser).
Starlette's CORS middleware, for an --allowed-origin, goes between the last two. All pure ASGI, so a request's body
stays an unread stream until its route reads it.
"""

from __future__ import annotations

import hmac
import ipaddress
import re
import socket
import urllib.parse
from typing import Any

from starlette.types import ASGIApp, Receive, Scope, Send

from k6serve.serve.errors import error_body
from k6serve.serve.metrics import ServerMetrics

PUBLIC_PATHS = ("/health",)
# The API's description, which holds no job or secret: a browser opening /docs sends no Authorization header, so
# on a server with a key the interactive docs answered 401 and could not be used (its Authorize button sends the key).
DOCS_PATHS = ("/docs", "/docs/oauth2-redirect", "/redoc", "/openapi.json")


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
        self.loopback_only = is_loopback(bound_host)
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
        if problem is None and self.loopback_only and host and not is_loopback(_hostname(host)):
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


def is_loopback(host: str | None) -> bool:
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
