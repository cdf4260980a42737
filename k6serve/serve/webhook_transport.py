"""What goes over the wire in a webhook attempt: the event's body (`Event`), its signature (`secret_key`,
`signature`) and the opener that POSTs it (`OPENER`: no redirect followed, the whole attempt bounded by an
`AttemptDeadline`, whose length, TIMEOUT_S, is the sender's: `webhook_sender.py`).

The event is OpenAI's: `{"id": "evt_...", "object": "event", "created_at": <the job's completed_at>, "type":
"video.completed", "data": {"id": "<video id>"}}`, signed as OpenAI signs its webhooks (the Standard Webhooks
scheme): headers `webhook-id` (the event id, the same on every retry, to drop duplicates), `webhook-timestamp` (Unix
seconds of this attempt) and `webhook-signature` (`v1,` + base64 HMAC-SHA256 of `<id>.<timestamp>.<body>` keyed
with `--webhook-secret`, whose `whsec_` base64 form is decoded as OpenAI's SDKs decode it). OpenAI's SDKs verify
them: `client.webhooks.verify_signature(body, headers, secret=...)`.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import hmac
import http.client
import json
import socket
import threading
import urllib.request
from dataclasses import dataclass

WEBHOOK_SECRET_ENV = "K6SERVE_WEBHOOK_SECRET"


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    """A 3xx is an answer, not a place to resend to: urllib turned the POST into a GET without its body, sent the
    signature headers to wherever it pointed (another host, maybe), and the event counted as delivered."""

    def redirect_request(self, req, fp, code, msg, headers, newurl):  # noqa: ANN001 - urllib's signature
        return None


class AttemptDeadline:
    """TIMEOUT_S for a whole attempt. The socket's timeout bounds each read and write alone, so a receiver that
    sent its answer a byte a second held one attempt (and its URL's events) for as long as it liked: 39 s for a
    39-byte answer. At the deadline the attempt's socket is shut, which ends the read blocked on it at once; a socket
    connected after the deadline is shut as soon as it is registered. A TLS handshake, before its socket can be
    registered, is bounded as a whole by the socket's timeout (CPython's ssl module keeps one deadline across the
    handshake's reads), also TIMEOUT_S."""

    _current = threading.local()  # the attempt in progress on this thread (one thread a URL), for its connection

    def __init__(self, seconds: float) -> None:
        self.expired = False
        self._socket = None
        self._lock = threading.Lock()
        self._timer = threading.Timer(seconds, self._expire)
        self._timer.daemon = True

    def __enter__(self) -> AttemptDeadline:
        AttemptDeadline._current.value = self
        self._timer.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._timer.cancel()
        AttemptDeadline._current.value = None

    @classmethod
    def register(cls, sock) -> None:  # noqa: ANN001 - a socket or an SSL socket
        deadline = getattr(cls._current, "value", None)
        if deadline is not None:
            with deadline._lock:
                deadline._socket = sock
                expired = deadline.expired
            if expired:
                _shut(sock)

    def _expire(self) -> None:
        with self._lock:
            self.expired = True
            sock = self._socket
        if sock is not None:
            _shut(sock)


def _shut(sock) -> None:  # noqa: ANN001
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)


class _DeadlineHTTPConnection(http.client.HTTPConnection):
    def connect(self) -> None:
        super().connect()
        AttemptDeadline.register(self.sock)


class _DeadlineHTTPSConnection(http.client.HTTPSConnection):
    def connect(self) -> None:
        # Registered once the TLS handshake is done (wrapping detaches the TCP socket, which then cannot be shut):
        # the handshake is bounded by the socket timeout as a whole (not read by read), the answer by the deadline.
        super().connect()
        AttemptDeadline.register(self.sock)


class _DeadlineHTTPHandler(urllib.request.HTTPHandler):
    def http_open(self, req):  # noqa: ANN001, ANN201 - urllib's signature
        return self.do_open(_DeadlineHTTPConnection, req)


class _DeadlineHTTPSHandler(urllib.request.HTTPSHandler):
    def https_open(self, req):  # noqa: ANN001, ANN201 - urllib's signature
        # HTTPSHandler keeps its SSL context in `_context`, which typeshed does not declare.
        return self.do_open(_DeadlineHTTPSConnection, req, context=self._context)  # type: ignore[attr-defined]


OPENER = urllib.request.build_opener(_NoRedirect, _DeadlineHTTPHandler, _DeadlineHTTPSHandler)


def secret_key(secret: str) -> bytes:
    """The HMAC key of a webhook secret, as OpenAI's SDKs read it: `whsec_<base64>` decoded, any other text as is."""
    if secret.startswith("whsec_"):
        try:
            key = base64.b64decode(secret[6:], validate=True)
        except ValueError:
            raise ValueError("--webhook-secret starts with whsec_ but the rest is not base64; generate one with "
                             "python -c \"import base64, secrets; print('whsec_' + "
                             "base64.b64encode(secrets.token_bytes(32)).decode())\"") from None
    else:
        key = secret.encode()
    if len(key) < 16:
        raise ValueError("--webhook-secret is too short to sign with (under 16 bytes); generate one with python -c "
                         "\"import base64, secrets; print('whsec_' + base64.b64encode(secrets.token_bytes(32))"
                         ".decode())\"")
    return key


def signature(key: bytes, event_id: str, timestamp: int, body: bytes) -> str:
    """The `webhook-signature` header's value for one attempt (Standard Webhooks v1)."""
    mac = hmac.new(key, f"{event_id}.{timestamp}.".encode() + body, hashlib.sha256)
    return "v1," + base64.b64encode(mac.digest()).decode()


@dataclass(frozen=True, slots=True)
class Event:
    id: str
    type: str
    created_at: int
    video_id: str

    def body(self) -> bytes:
        return json.dumps({"id": self.id, "object": "event", "created_at": self.created_at, "type": self.type,
                           "data": {"id": self.video_id}}, separators=(",", ":")).encode()
