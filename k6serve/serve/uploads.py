"""Reading request bodies ourselves, with hard byte limits, so nothing oversized is buffered or written.

The framework is never asked to parse a form (Starlette would spool every upload to a temporary file first): the body is
read from `request.stream()`, a declared `Content-Length` over the limit is refused before any of the body is parsed or
stored (what the client sends is drained for at most an idle second, `drain`, so that it reads the 413 rather than a
reset connection), and bytes are counted as they arrive. Upload data stays in memory up to `SPOOL_BYTES` and only then
spills to a hidden `.part` file, which is renamed into place when the part is complete and removed on any error; so with
a limit below `SPOOL_BYTES` an oversized upload never touches the disk at all.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import secrets
import time
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

from python_multipart.multipart import MultipartParseError, MultipartParser, parse_options_header
from starlette.requests import ClientDisconnect, Request

from k6serve.serve.body_parsing import (
    MAX_JSON_DEPTH,
    json_depth,
    lone_surrogate,
    long_number_digits,
    object_without_duplicate_keys,
)
from k6serve.serve.errors import (
    ApiError,
    disk_full,
    insufficient_storage,
    output_not_writable,
    write_refused,
)
from k6serve.serve.loading import DRAIN_BYTES, DRAIN_IDLE_S, DRAIN_TOTAL_S
from k6serve.serve.video_create_body import bracketed_object_field, json_text_hint

# Small: every complete upload is written to disk anyway (the spool only delays the file's creation), and each
# connection holds its spool for as long as its client takes to send the part; at 8 MiB, 60 clients that sent 7.5
# MiB and stalled held 520 MB of the server's memory, which it kept after they left.
SPOOL_BYTES = 256 * 2**10
MAX_JSON_BYTES = 1 * 2**20
MAX_FORM_TEXT_BYTES = 1 * 2**20  # all non-file form fields together, with every part's headers
# A body whose client sends nothing for this long is refused with a 408 and its connection closed: a stalled
# upload held its connection, its handler and its spooled bytes for as long as the client kept the socket open.
# Generous for any client that is still sending (a slow link delivers bytes every few seconds).
BODY_IDLE_S = 60.0


@dataclass(frozen=True, kw_only=True, slots=True)
class UploadedFile:
    field_name: str
    client_file_name: str | None
    content_type: str | None
    path: Path
    size: int
    sha256: str


@dataclass(kw_only=True, slots=True)
class ParsedForm:
    fields: dict[str, str] = field(default_factory=dict)
    files: dict[str, UploadedFile] = field(default_factory=dict)


# What the create route's 413 says to do: files go as multipart/form-data uploads, whose limit is --max-upload-mb.
UPLOAD_ADVICE = "upload files with multipart/form-data instead"


def too_large(what: str, limit_bytes: int) -> ApiError:
    return ApiError(413, f"{what} is larger than the server's limit of {limit_bytes / 2**20:g} MiB "
                         "(--max-upload-mb); send a smaller file.", code="payload_too_large",
                    headers={"Connection": "close"})


def declared_length(request: Request) -> int | None:
    value = request.headers.get("content-length")
    if value is None:
        return None
    if not value.isdigit():
        raise ApiError(400, f"Content-Length must be a non-negative integer, got {value!r}", code="invalid_request")
    return int(value)


async def refuse_declared_length(request: Request, limit_bytes: int, error: ApiError) -> None:
    """Raise `error` (a 413 that closes the connection) when the declared Content-Length is over `limit_bytes`,
    before any of the body is parsed or stored.

    A client that waits for `100-continue` has sent nothing, and is answered at once; any other has started
    sending, and what it sends is drained first (`drain`: bounded in bytes and by an idle second)."""
    length = declared_length(request)
    if length is not None and length > limit_bytes:
        if request.headers.get("expect", "").lower() != "100-continue":
            await drain(request)
        raise error


async def _read_small_body(request: Request, too_large_advice: str = UPLOAD_ADVICE) -> bytes:
    await refuse_declared_length(request, MAX_JSON_BYTES, too_large_json(too_large_advice))
    body = bytearray()
    async for chunk in _stream(request):
        body += chunk
        if len(body) > MAX_JSON_BYTES:
            await drain(request)
            raise too_large_json(too_large_advice)
    return bytes(body)


async def read_urlencoded_body(request: Request) -> dict[str, str]:
    """`application/x-www-form-urlencoded` (what `curl -d a=b` sends): text fields only."""
    body = await _read_small_body(request)
    if body.lstrip()[:1] in (b"{", b"["):
        # curl -d sends this Content-Type by default, so a JSON body arrives here far more often than a form.
        raise ApiError(400, "The body looks like JSON but its Content-Type is application/x-www-form-urlencoded "
                            "(curl -d's default); send it with -H 'Content-Type: application/json'.",
                       code="invalid_form")
    try:
        # Latin-1 first: each byte (raw or percent-encoded) as one character, so each field is decoded as UTF-8 on
        # its own below and a bad one is named. parse_qsl's own UTF-8 decode replaces what is not UTF-8 with U+FFFD:
        # a form of Windows-1251 or KOI8-R text ran with a prompt of question marks.
        pairs = urllib.parse.parse_qsl(body.decode("latin-1"), keep_blank_values=True, strict_parsing=bool(body),
                                       encoding="latin-1")
    except (UnicodeDecodeError, ValueError) as exc:
        raise ApiError(400, f"Invalid form body: {exc}", code="invalid_form") from None
    fields: dict[str, str] = {}
    for raw_name, raw_value in pairs:
        try:
            name = raw_name.encode("latin-1").decode("utf-8")
        except UnicodeDecodeError:
            raise ApiError(400, "A form field's name is not UTF-8 text; send the form percent-encoded as UTF-8.",
                           code="invalid_form") from None
        try:
            value = raw_value.encode("latin-1").decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ApiError(400, f"Form field {name!r} is not UTF-8 text (byte {exc.start + 1} of its value); send "
                                "the form percent-encoded as UTF-8 (a charset such as windows-1251 is not read).",
                           code="invalid_form", param=name) from None
        if name in fields:
            raise ApiError(400, twice_message(name), code="invalid_form", param=bracketed_object_field(name) or name)
        fields[name] = value
    return fields


def twice_message(name: str) -> str:
    """The refusal of form field `name` sent twice. `loras[x][]` twice is a list that a form encoder (OpenAI's SDK)
    flattened into repeated fields: the answer says how to send it."""
    field = bracketed_object_field(name)
    if field is not None:
        return (f"Form field {name!r} was sent more than once: a list inside {field}, flattened into repeated "
                f"fields, which the server does not read; {json_text_hint(field)}.")
    return f"Form field {name!r} was sent twice."


async def read_json_body(request: Request, *, allow_empty: bool = False, example: str = '{"prompt": "..."}',
                         too_large_advice: str = UPLOAD_ADVICE) -> Any:
    """The decoded JSON body; an empty one is `{}` when `allow_empty` (a body whose fields all have defaults), else
    a 400 showing `example`, the route's smallest valid body. `too_large_advice`: what a 413 tells the client to do
    (the create route's, by default: its files go as multipart uploads)."""
    body = await _read_small_body(request, too_large_advice)
    if not body.strip() and allow_empty:
        return {}
    if not body.strip():
        raise ApiError(400, f"The request body is empty; send a JSON object such as {example}.", code="invalid_json")
    try:
        value = json.loads(body, object_pairs_hook=object_without_duplicate_keys)
        too_deep = json_depth(value) > MAX_JSON_DEPTH
    except UnicodeDecodeError as exc:
        # json.loads reads UTF-8, -16 and -32; a declared charset such as windows-1251 is not read (RFC 8259: JSON
        # is UTF-8), and the codec's words alone did not say what to send.
        raise ApiError(400, f"Invalid JSON body: it is not UTF-8 text ({exc.reason} at byte {exc.start + 1}); send "
                            "JSON as UTF-8.", code="invalid_json") from None
    except json.JSONDecodeError as exc:
        raise ApiError(400, f"Invalid JSON body: {exc}", code="invalid_json") from None
    except ValueError as exc:  # Python's limit on an integer's digits (4,300): it was a 500 with a traceback
        raise ApiError(400, f"Invalid JSON body: a number in it is too long{long_number_digits(exc)}; no field takes "
                            "more than a few dozen digits.", code="invalid_json") from None
    except RecursionError:  # the decoder recurses once per nesting level (Python 3.11 gives up near 1,000)
        too_deep = True
    if too_deep:
        raise ApiError(400, "Invalid JSON body: nested too deeply; no field takes more than a few levels of "
                       "objects or arrays.", code="invalid_json")
    if (escape := lone_surrogate(value)) is not None:
        # Such a prompt was queued, then failed the job in the text encoder ("TypeError: TextEncodeInput must be
        # Union[...]").
        raise ApiError(400, f"Invalid JSON body: {escape} is one half of a UTF-16 surrogate pair without the other, so "
                            "the text is not valid Unicode; send the character itself, or the escapes of both halves.",
                       code="invalid_json")
    return value


async def refuse_content_encoding(request: Request) -> None:
    """A 415 for a compressed body (`Content-Encoding: gzip`, ...), as RFC 9110 (8.4) asks of a server that does
    not decode it: it was parsed as it came, and refused as "Invalid JSON body: 'utf-8' codec can't decode byte
    0x8b", which did not say what to change."""
    codings = [coding.strip().lower() for coding in request.headers.get("content-encoding", "").split(",")]
    codings = [coding for coding in codings if coding and coding != "identity"]
    if codings:
        await drain(request)
        raise ApiError(415, f"Content-Encoding {', '.join(codings)!r} is not supported: the server reads request "
                            "bodies uncompressed; send the body without compressing it (no Content-Encoding "
                            "header).", code="unsupported_content_type", param="Content-Encoding",
                       headers={"Accept-Encoding": "identity"})


async def read_control_body(request: Request, *, allow_empty: bool, routes: str,
                            example: str = '{"lora_nickname": "...", "lora_path": "/path/to/adapter.safetensors"}',
                            too_large_advice: str | None = None) -> Any:
    """A JSON-only route's body (`routes` names them in a 415); `allow_empty`: an empty body is `{}`, else a 400
    showing `example`; `too_large_advice`: what a 413 says to do (these routes take no upload, so not the create
    route's multipart)."""
    await refuse_content_encoding(request)
    content_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if content_type not in ("application/json", ""):
        await drain(request)
        raise ApiError(415, f"Content-Type {content_type!r} is not supported; {routes} take application/json "
                            "(with curl: -H 'Content-Type: application/json').", code="unsupported_content_type",
                       param="Content-Type")
    # Of the LoRA and memory routes only set_lora refuses an empty body; its message shows set_lora's fields (the
    # default `example`), not the video route's prompt.
    return await read_json_body(request, allow_empty=allow_empty, example=example,
                                too_large_advice=too_large_advice or f"no field of {routes} needs that much")


def too_large_json(advice: str) -> ApiError:
    return ApiError(413, f"JSON and url-encoded bodies are limited to {MAX_JSON_BYTES // 2**20} MiB; {advice}.",
                    code="payload_too_large", headers={"Connection": "close"})


async def drain(request: Request) -> None:
    """Discard the rest of a refused body, so the client can read our answer (closing a socket with unread data makes
    the kernel send RST, which can discard the answer before the client reads it): at most DRAIN_BYTES, no longer
    than DRAIN_IDLE_S without a byte, and no longer than DRAIN_TOTAL_S in all (a client trickling a byte every half
    second held the refusal of a 2 MB body back for its whole length; one that declared more than it sends would
    wait for the answer forever). The bounds are the loading responder's (`serve/loading.py`), one set for both."""
    seen = 0
    chunks = request.stream().__aiter__()
    deadline = time.monotonic() + DRAIN_TOTAL_S
    try:
        while seen <= DRAIN_BYTES:
            left = deadline - time.monotonic()
            if left <= 0:
                return
            seen += len(await asyncio.wait_for(chunks.__anext__(), min(DRAIN_IDLE_S, left)))
    except (StopAsyncIteration, TimeoutError, ClientDisconnect, RuntimeError):
        return


async def _stream(request: Request):
    chunks = request.stream().__aiter__()
    try:
        while True:
            try:
                chunk = await asyncio.wait_for(chunks.__anext__(), BODY_IDLE_S)
            except StopAsyncIteration:
                return
            yield chunk
    except ClientDisconnect:
        raise ApiError(400, "The client disconnected before the body was complete.", code="incomplete_body") from None
    except TimeoutError:
        raise ApiError(408, f"The client sent no byte of the request body for {BODY_IDLE_S:g} s; send the whole body "
                            "without stopping (an HTTP client library does), and retry.", code="request_timeout",
                       headers={"Connection": "close"}) from None


def _text(header_value: str) -> str:
    """A part header's value (held as latin-1, one character a byte) as the UTF-8 text clients send."""
    return header_value.encode("latin-1").decode("utf-8", "replace")


class _Part:
    """One form part being received: a text field (kept in memory) or a file (spooled, then spilled)."""

    def __init__(self, headers: dict[str, str]) -> None:
        _, options = parse_options_header(headers.get("content-disposition", ""))
        name = options.get(b"name")
        if name is None:
            raise ApiError(400, "Malformed multipart body: a part has no Content-Disposition name.",
                           code="invalid_multipart")
        self.name = name.decode("utf-8", "replace")
        file_name = options.get(b"filename")
        self.file_name = file_name.decode("utf-8", "replace") if file_name is not None else None
        content_type = headers.get("content-type")
        self.content_type = _text(content_type) if content_type is not None else None
        self.buffer = bytearray()
        self.spill_path: Path | None = None
        self.spill: BinaryIO | None = None
        self.size = 0
        self.digest = hashlib.sha256()

    @property
    def is_file(self) -> bool:
        return self.file_name is not None


class MultipartReader:
    """Parses one multipart/form-data body; files named by `file_path(field, client_name)`."""

    def __init__(self, *, boundary: bytes, file_fields: set[str], max_file_bytes: int,
                 file_path: Callable[[str, str | None], Path]) -> None:
        self.file_fields = file_fields
        self.max_file_bytes = max_file_bytes
        self.file_path = file_path
        self.form = ParsedForm()
        self.written: list[Path] = []
        self.text_bytes = 0
        self.file_bytes = 0
        self._headers: dict[str, str] = {}
        self._header_field = bytearray()
        self._header_value = bytearray()
        self._part: _Part | None = None
        self._error: ApiError | None = None
        self.finished = False
        self.parser = MultipartParser(boundary, {
            "on_part_begin": self._on_part_begin,
            "on_header_field": lambda data, start, end: self._on_header_bytes(self._header_field, data[start:end]),
            "on_header_value": lambda data, start, end: self._on_header_bytes(self._header_value, data[start:end]),
            "on_header_end": self._on_header_end,
            "on_headers_finished": self._on_headers_finished,
            "on_part_data": self._on_part_data,
            "on_part_end": self._on_part_end,
            "on_end": self._on_end,
        })

    # The parser swallows nothing: an ApiError raised in a callback propagates out of `write`.
    def _on_part_begin(self) -> None:
        self._headers = {}

    def _on_header_bytes(self, into: bytearray, chunk: bytes) -> None:
        # Part headers are form text too: uncounted, a body of two million empty fields (111 MiB, no text) was
        # parsed whole, holding the event loop (every other request) for 25 s, before its first field was refused.
        self._count_text(len(chunk))
        into.extend(chunk)

    def _count_text(self, num_bytes: int) -> None:
        self.text_bytes += num_bytes
        if self.text_bytes > MAX_FORM_TEXT_BYTES:
            raise ApiError(413, f"Form fields (names, part headers and text) are limited to "
                                f"{MAX_FORM_TEXT_BYTES // 2**20} MiB in total; send files as the "
                                f"{' or '.join(sorted(self.file_fields))} upload.", code="payload_too_large",
                           headers={"Connection": "close"})

    def _on_header_end(self) -> None:
        name = self._header_field.decode("latin-1").strip().lower()
        # Kept as latin-1, which maps every byte to one character: browsers, curl and httpx send a part's file name
        # as raw UTF-8 bytes, and python-multipart's parse_options_header encodes its text back to latin-1 (a name
        # decoded as UTF-8 raised UnicodeEncodeError there, a 500, for "видео.mp4"). `_text` decodes the values.
        # Only spaces and tabs are stripped: str.strip() also takes U+0085 and U+00A0, here the last bytes of a
        # UTF-8 "à" or "х" that ends an unquoted file name.
        self._headers[name] = self._header_value.decode("latin-1").strip(" \t")
        self._header_field.clear()
        self._header_value.clear()

    def _on_headers_finished(self) -> None:
        part = _Part(self._headers)
        if part.name in self.form.fields or part.name in self.form.files:
            raise ApiError(400, twice_message(part.name), code="invalid_multipart",
                           param=bracketed_object_field(part.name) or part.name)
        if part.is_file and part.name not in self.file_fields:
            raise ApiError(400, f"Unexpected file field {part.name!r}; upload files as "
                                f"{' or '.join(sorted(self.file_fields))}.", code="invalid_multipart",
                           param=part.name)
        self._part = part

    def _on_part_data(self, data: bytes, start: int, end: int) -> None:
        part = self._part
        assert part is not None
        chunk = data[start:end]
        if not part.is_file:
            self._count_text(len(chunk))
            part.buffer += chunk
            return
        self.file_bytes += len(chunk)
        if self.file_bytes > self.max_file_bytes:
            raise too_large("The upload", self.max_file_bytes)
        part.size += len(chunk)
        part.digest.update(chunk)
        if part.spill is None and len(part.buffer) + len(chunk) <= SPOOL_BYTES:
            part.buffer += chunk
            return
        if part.spill is None:
            final = self.file_path(part.name, part.file_name)
            part.spill_path = final.parent / f".{final.name}.{secrets.token_hex(6)}.part"
            self.written.append(part.spill_path)
            part.spill = open(part.spill_path, "wb")  # noqa: SIM115 - stays open across parser callbacks
            part.spill.write(part.buffer)
            part.buffer = bytearray()
        part.spill.write(chunk)

    def _on_part_end(self) -> None:
        part = self._part
        assert part is not None
        self._part = None
        if not part.is_file:
            try:
                self.form.fields[part.name] = part.buffer.decode("utf-8")
            except UnicodeDecodeError:
                if part.name in self.file_fields:
                    # A file's bytes in a part without a filename (curl -F 'input_reference=<file.png', or a client
                    # given no file name) are a text field to multipart; "not valid UTF-8" did not say what to fix.
                    raise ApiError(400, f"{part.name} is a file upload but came as a text part (one without a "
                                        "filename in its Content-Disposition); send it as a file part with a "
                                        f"filename (curl -F {part.name}=@path/to/file).", code="invalid_parameter",
                                   param=part.name) from None
                raise ApiError(400, f"Form field {part.name!r} is not valid UTF-8.", code="invalid_multipart",
                               param=part.name) from None
            return
        if part.size == 0:
            raise ApiError(400, f"The uploaded file {part.name!r} is empty.", code="invalid_upload", param=part.name)
        final = self.file_path(part.name, part.file_name)
        if part.spill is None:
            temporary = final.parent / f".{final.name}.{secrets.token_hex(6)}.part"
            self.written.append(temporary)
            with open(temporary, "wb") as handle:
                handle.write(part.buffer)
        else:
            assert part.spill_path is not None  # set with part.spill
            temporary = part.spill_path
            part.spill.close()
        os.replace(temporary, final)
        self.written.append(final)
        self.form.files[part.name] = UploadedFile(
            field_name=part.name, client_file_name=part.file_name, content_type=part.content_type, path=final,
            size=part.size, sha256=part.digest.hexdigest())

    def _on_end(self) -> None:
        self.finished = True

    def cleanup(self) -> None:
        if self._part is not None and self._part.spill is not None:
            self._part.spill.close()
        for path in self.written:
            path.unlink(missing_ok=True)


def multipart_boundary(content_type: str) -> bytes:
    _, options = parse_options_header(content_type)
    boundary = options.get(b"boundary")
    if not boundary:
        raise ApiError(400, "multipart/form-data needs a boundary parameter in Content-Type.",
                       code="invalid_multipart")
    return boundary


async def read_multipart(request: Request, *, file_fields: set[str], max_file_bytes: int,
                         file_path: Callable[[str, str | None], Path]) -> ParsedForm:
    """Stream-parse a multipart body. On any error every file written for it is removed."""
    boundary = multipart_boundary(request.headers.get("content-type", ""))
    await refuse_declared_length(request, max_file_bytes + MAX_FORM_TEXT_BYTES,
                                 too_large("The request body", max_file_bytes))
    reader = MultipartReader(boundary=boundary, file_fields=file_fields, max_file_bytes=max_file_bytes,
                             file_path=file_path)
    try:
        try:
            async for chunk in _stream(request):
                reader.parser.write(chunk)
            reader.parser.finalize()
        except MultipartParseError as exc:
            # python-multipart's own words name bytes by number ("Expected boundary character 45, got 103 at index
            # 2"): say what that means for the client too.
            hint = (f" The body must start with the boundary given in Content-Type ('--{boundary.decode('latin-1')}'),"
                    " as an HTTP client's multipart encoder writes it." if "boundary" in str(exc).lower() else "")
            raise ApiError(400, f"Malformed multipart body: {exc}.{hint}", code="invalid_multipart") from None
        if not reader.finished:
            raise ApiError(400, "Malformed multipart body: it ended before the closing boundary.",
                           code="invalid_multipart")
    except ApiError as error:
        reader.cleanup()
        if error.status == 413:
            await drain(request)
        raise
    except OSError as exc:
        reader.cleanup()
        if disk_full(exc):
            refusal = insufficient_storage(exc)
        elif write_refused(exc):  # the upload folder was made read-only after the start
            refusal = output_not_writable(exc)
        else:
            raise
        await drain(request)  # so that the client reads the 507, not a reset connection
        raise refusal from None
    except BaseException:
        reader.cleanup()
        raise
    return reader.form
