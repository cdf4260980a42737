"""The HTTP/1.1 protocol the server runs: uvicorn's h11 protocol, with its parse errors answered in the API's shape.

A request that h11 cannot parse (a `Content-Length` that is not one non-negative number, two that disagree, a
malformed request line or header) never reaches the ASGI app: uvicorn answers it itself with a text/plain
"Invalid HTTP request received." Every other error of this API is OpenAI's JSON, and clients parse that, so the
parser's 400 is rewritten here into the same JSON (code `invalid_request`); the connection is still closed, as h11
cannot tell where such a request ends.

The h11 protocol is named explicitly (not uvicorn's "auto", which takes httptools when it is installed), and
WebSockets are off (the API has none; "auto" would take them when the websockets package is installed), so that the
server answers the same bytes on every machine.
"""

from __future__ import annotations

import json

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from k6serve.serve.errors import error_body

UNPARSABLE_REQUEST_MESSAGE = (
    "The HTTP request could not be parsed as HTTP/1.1: a malformed request line or header, a missing Host header, "
    "headers over 16 KiB in all, or a body whose framing is wrong (a Content-Length that is not a single "
    "non-negative number, an unsupported Transfer-Encoding, bad chunked encoding). Send a well-formed HTTP/1.1 "
    "request (any HTTP client library does)."
)


class JsonErrorH11Protocol(H11Protocol):
    """uvicorn's H11Protocol whose 400 for an unparsable request is the API's JSON error."""

    def send_400_response(self, msg: str) -> None:
        # A body that breaks its framing (bad chunked encoding) fails after its headers parsed and the app began
        # answering that request: the request is over for the app now, as when the client goes away
        # (uvicorn's `connection_lost`), so that its answer is dropped rather than sent on a connection in the
        # wrong state, which logged "Exception in ASGI application".
        if self.cycle is not None and not self.cycle.response_complete:
            self.cycle.disconnected = True
            self.cycle.message_event.set()
        body = json.dumps(error_body(400, UNPARSABLE_REQUEST_MESSAGE, code="invalid_request"),
                          separators=(",", ":")).encode()
        headers = [*self.server_state.default_headers, (b"content-type", b"application/json"),
                   (b"content-length", str(len(body)).encode()), (b"connection", b"close")]
        try:
            self.transport.write(self.conn.send(h11.Response(status_code=400, headers=headers, reason=b"Bad Request")))
            self.transport.write(self.conn.send(h11.Data(data=body)))
            self.transport.write(self.conn.send(h11.EndOfMessage()))
        except h11.LocalProtocolError:
            # h11 will not send (the rest of) a response in this state (one had begun already, or the request
            # was a HEAD, whose answer has no body): closing the connection is all that is left to do.
            pass
        self.transport.close()
