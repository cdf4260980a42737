"""Answers on the server's socket while the model loads, so that clients and supervisors hear "loading" at once.

`serve` binds and listens before the model loads (a port in use fails at once), but uvicorn takes the socket only
once the load has ended, minutes later for real checkpoints. Until then connections waited unanswered in the
kernel's backlog: a load balancer's or Kubernetes' GET /health hung, unable to tell "loading" from "dead", and a
client's POST /v1/videos hung too. `LoadingResponder` accepts on that socket in a thread meanwhile and answers every
request with a 503 at once, then closes the connection: GET (or HEAD) /health with `{"status": "loading", ...}`,
anything else with the API's error JSON, code `model_loading`, and Retry-After. No request is served, so none needs
the API key. Each connection gets its own short-lived thread with deadlines, so a slow or silent client delays no
other. The responder stops (its accept thread joined) right before uvicorn accepts on the same socket; a connection
not accepted by then waits in the backlog for uvicorn. The load itself runs in the main thread as before, so Ctrl-C
and SIGTERM during it behave as before.
"""

from __future__ import annotations

import json
import logging
import selectors
import socket
import threading
import time
import urllib.parse

from k6serve.serve.errors import error_body

logger = logging.getLogger(__name__)

RETRY_AFTER_S = 10
# The request's head (request line and headers) is awaited this long, then answered whatever has come.
HEAD_TIMEOUT_S = 0.5
MAX_HEAD_BYTES = 16 * 1024  # h11's (uvicorn's) limit too
# After the answer the connection is half-closed and what the client still sends (a request body) is read and
# discarded, so that its kernel does not reset the connection before it reads the 503 (closing a socket with unread
# data sends RST): at most DRAIN_BYTES, DRAIN_TOTAL_S in all, and DRAIN_IDLE_S without a byte.
DRAIN_BYTES = 64 * 2**20
DRAIN_IDLE_S = 1.0
DRAIN_TOTAL_S = 5.0
# Connections answered at once, each by its own thread; one beyond them is answered without its request being read.
MAX_CONNECTIONS = 64

HEALTH_MESSAGE = ('The server is loading the model; it serves requests once GET /health answers 200 with "status": '
                  '"ok".')
LOADING_MESSAGE = ("The server is still loading the model and serves no request yet; retry after the Retry-After "
                   'delay, once GET /health answers 200 with "status": "ok".')


class LoadingResponder:
    """Answers 503 "loading" on a listening socket from `start()` to `stop()` (idempotent, from any thread)."""

    def __init__(self, sock: socket.socket, root_path: str = "", allowed_origins: tuple[str, ...] = ()) -> None:
        self.sock = sock
        # --allowed-origin: a listed page's script polling /health while the model loads reads the 503 as the
        # server will answer it (with CORS headers), not as a network error.
        self._origins = frozenset(allowed_origins)
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._wake_reader: socket.socket | None = None  # stop() writes to the other end to end the accept loop
        self._wake_writer: socket.socket | None = None
        self._slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        self._timeout = sock.gettimeout()
        self._started = time.monotonic()
        self._health_paths = {"/health", f"{root_path}/health"}
        self.num_answered = 0

    def start(self) -> None:
        self._timeout = self.sock.gettimeout()
        self.sock.setblocking(False)  # accept() after select() must not block when the client has gone meanwhile
        self._started = time.monotonic()
        self._wake_reader, self._wake_writer = socket.socketpair()
        self._thread = threading.Thread(target=self._accept_loop, name="k6serve-loading-responder", daemon=True)
        self._thread.start()
        logger.info("answering on port %d while the model loads (GET /health: 503 \"loading\"; other routes: 503 "
                    "model_loading)", self.sock.getsockname()[1])

    def stop(self) -> None:
        """Stop accepting and give the socket back as it was (blocking mode included), for uvicorn."""
        with self._lock:
            thread, self._thread = self._thread, None
        if thread is None:
            return
        # start() makes the pair before it starts the thread
        assert self._wake_reader is not None and self._wake_writer is not None
        self._wake_writer.send(b"x")
        thread.join()
        self.sock.settimeout(self._timeout)
        self._wake_reader.close()
        self._wake_writer.close()
        logger.info("loading responder stopped after %.1f s (%d request(s) answered 503)",
                    time.monotonic() - self._started, self.num_answered)

    def _accept_loop(self) -> None:
        assert self._wake_reader is not None  # start() makes it before it starts this thread
        with selectors.DefaultSelector() as selector:
            selector.register(self.sock, selectors.EVENT_READ)
            selector.register(self._wake_reader, selectors.EVENT_READ)
            while True:
                ready = {key.fileobj for key, _ in selector.select()}
                if self._wake_reader in ready:
                    return  # a connection not accepted yet stays in the backlog, for uvicorn
                self._accept_one()

    def _accept_one(self) -> None:
        try:
            conn, _ = self.sock.accept()
        except (BlockingIOError, InterruptedError, ConnectionAbortedError):
            return
        except OSError as exc:  # out of file descriptors: wait rather than spin; uvicorn gets the backlog later
            logger.warning("the loading responder could not accept a connection: %s", exc)
            time.sleep(0.1)
            return
        if not self._slots.acquire(blocking=False):
            self._answer_unread(conn)
            return
        try:
            threading.Thread(target=self._serve_connection, args=(conn,), name="k6serve-loading-answer",
                             daemon=True).start()
        except RuntimeError:  # no thread could be started
            self._slots.release()
            self._answer_unread(conn)

    def _answer_unread(self, conn: socket.socket) -> None:
        with conn:
            try:
                conn.settimeout(0.1)
                conn.sendall(self.response(b""))
            except OSError:
                pass

    def _serve_connection(self, conn: socket.socket) -> None:
        try:
            with conn:
                head = _read_head(conn)
                if head is None:
                    return  # connected and closed without a byte (a TCP probe)
                conn.sendall(self.response(head))
                with self._lock:
                    self.num_answered += 1
                _drain(conn)
        except OSError:
            pass  # the client went away
        except Exception:  # noqa: BLE001 - one connection's bug must not stop the answers to the others
            logger.exception("the loading responder failed on a connection")
        finally:
            self._slots.release()

    def response(self, head: bytes) -> bytes:
        """The whole HTTP answer to a request whose head (as far as it came) is `head`."""
        method, path = _method_and_path(head)
        fields = _header_fields(head) if self._origins else {}
        origin = fields.get("origin", "")
        allowed = "*" if "*" in self._origins else origin if origin in self._origins else None
        cors = "" if allowed is None else (f"access-control-allow-origin: {allowed}\r\n"
                                           f"access-control-expose-headers: retry-after\r\n"
                                           + ("vary: origin\r\n" if allowed != "*" else ""))
        if allowed is not None and method == b"OPTIONS" and "access-control-request-method" in fields:
            # A browser's preflight: allowed as the server will allow it, so the request itself comes and reads
            # the 503 below. No max-age: once loaded, the server answers its own preflights.
            requested = fields.get("access-control-request-headers", "")
            return ("HTTP/1.1 204 No Content\r\n" + cors
                    + "access-control-allow-methods: GET, HEAD, POST, DELETE\r\n"
                    + (f"access-control-allow-headers: {requested}\r\n" if requested else "")
                    + "content-length: 0\r\nconnection: close\r\n\r\n").encode("latin-1")
        # Under --root-path a proxy that passes the path on sends /k6/health.
        if path in self._health_paths and method in (b"GET", b"HEAD"):
            body = {"status": "loading", "message": HEALTH_MESSAGE,
                    "elapsed_s": round(time.monotonic() - self._started, 1)}
        else:
            body = error_body(503, LOADING_MESSAGE, code="model_loading")
        payload = json.dumps(body).encode()
        headers = ("HTTP/1.1 503 Service Unavailable\r\n"
                   "content-type: application/json\r\n"
                   f"content-length: {len(payload)}\r\n"
                   f"retry-after: {RETRY_AFTER_S}\r\n"
                   "cache-control: no-store\r\n"
                   f"{cors}"
                   "connection: close\r\n\r\n")
        return headers.encode("latin-1") + (b"" if method == b"HEAD" else payload)


def _read_head(conn: socket.socket) -> bytes | None:
    """The request's head, or what came of it in HEAD_TIMEOUT_S (up to MAX_HEAD_BYTES); None if the client closed
    without sending anything."""
    deadline = time.monotonic() + HEAD_TIMEOUT_S
    head = b""
    while len(head) < MAX_HEAD_BYTES:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            break
        conn.settimeout(remaining)
        try:
            chunk = conn.recv(4096)
        except TimeoutError:
            break
        if not chunk:
            return head or None
        head += chunk
        start = head.lstrip(b"\r\n")  # RFC 9112 2.2: empty lines before the request line are ignored
        if b"\r\n\r\n" in start or b"\n\n" in start:
            break
    return head


def _header_fields(head: bytes) -> dict[str, str]:
    """The head's header fields, names lower-cased, values stripped (the last of a repeated one); only what may be
    echoed: values with control characters (a CR / LF would split the answer's headers) are left out."""
    fields = {}
    for line in head.lstrip(b"\r\n").split(b"\n")[1:]:
        name, colon, value = line.rstrip(b"\r").partition(b":")
        text = value.strip().decode("latin-1")
        if colon and name and all(" " <= char != "\x7f" for char in text):
            fields[name.strip().lower().decode("latin-1")] = text
    return fields


def _method_and_path(head: bytes) -> tuple[bytes, str]:
    """The request line's method and its target's path (without query, trailing slash, or an absolute form's
    scheme and host); empty ones for a request line that is none."""
    parts = head.lstrip(b"\r\n").split(b"\n", 1)[0].split()
    if len(parts) < 2:
        return b"", ""
    target = parts[1].decode("latin-1")
    if "://" in target:
        target = urllib.parse.urlsplit(target).path
    path = target.split("?", 1)[0].split("#", 1)[0]
    return parts[0], path.rstrip("/") or "/"


def _drain(conn: socket.socket) -> None:
    """Half-close after the answer, then read and discard what the client still sends, within the DRAIN_ bounds."""
    conn.shutdown(socket.SHUT_WR)
    deadline = time.monotonic() + DRAIN_TOTAL_S
    seen = 0
    while seen <= DRAIN_BYTES:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return
        conn.settimeout(min(DRAIN_IDLE_S, remaining))
        try:
            chunk = conn.recv(65536)
        except TimeoutError:
            return
        if not chunk:
            return
        seen += len(chunk)
