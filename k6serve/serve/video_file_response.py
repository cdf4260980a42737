"""`VideoFileResponse`: the MP4 download of `GET /v1/videos/{video_id}/content`, Starlette's FileResponse with RFC
9110's Range errors and conditional requests (If-Match, If-None-Match, If-Modified-Since, If-Unmodified-Since)."""

from __future__ import annotations

import contextlib
import re
from datetime import datetime, timezone
from typing import Any, BinaryIO

import anyio
from fastapi.responses import FileResponse, Response
from starlette.datastructures import Headers
from starlette.responses import MalformedRangeHeader, RangeNotSatisfiable
from starlette.types import Receive, Scope, Send

from k6serve.serve.errors import ApiError, error_response


class _Unsatisfiable(Exception):
    def __init__(self, file_size: int) -> None:
        super().__init__(file_size)
        self.file_size = file_size


# RFC 9110 14.1.1: int-range ("first-last", "first-") or suffix-range ("-length"), ASCII digits only.
_RANGE_SPEC = re.compile(r"[0-9]+-[0-9]*|-[0-9]+")
# An entity-tag, weak (W/) or strong (RFC 9110 8.8.3). Its opaque part may hold a comma, so an If-None-Match list is
# read tag by tag rather than split on commas.
_ENTITY_TAG = re.compile(r'(W/)?"([^"]*)"')
# What a 304 keeps of the 200's headers (RFC 9110 15.4.5): those a cache refreshes its stored copy with. The body's
# own (Content-Length, Content-Type, Content-Disposition, Accept-Ranges) would describe a body that is not sent.
_NOT_MODIFIED_HEADERS = frozenset({"cache-control", "content-location", "date", "etag", "expires", "last-modified",
                                   "vary"})


def _names_etag(header: str, etag: str, *, strong: bool) -> bool:
    """Whether an If-None-Match (weak comparison) or If-Match (`strong`: a W/ tag never matches) list names `etag`
    (RFC 9110 13.1.1, 13.1.2); `*` names any file, and the route answers only for one that exists."""
    if any(item.strip(" \t") == "*" for item in header.split(",")):
        return True
    own_tag = _ENTITY_TAG.fullmatch(etag)
    if own_tag is None:  # Starlette's ETag is always a quoted digest
        raise ValueError(f"the file's ETag {etag!r} is not an entity-tag")
    ours = own_tag.group(2)
    return any(tag.group(2) == ours and not (strong and tag.group(1)) for tag in _ENTITY_TAG.finditer(header))


_MONTHS = ("Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec")
_MONTH = "(" + "|".join(_MONTHS) + ")"
# RFC 9110 5.6.7's three forms, GMT only: IMF-fixdate, the obsolete RFC 850 form (two-digit year) and asctime.
_IMF_FIXDATE = re.compile(r"(?:Mon|Tue|Wed|Thu|Fri|Sat|Sun), (\d\d) " + _MONTH + r" (\d{4}) (\d\d):(\d\d):(\d\d) GMT",
                          re.ASCII)
_RFC850_DATE = re.compile(r"(?:Monday|Tuesday|Wednesday|Thursday|Friday|Saturday|Sunday), (\d\d)-" + _MONTH
                          + r"-(\d\d) (\d\d):(\d\d):(\d\d) GMT", re.ASCII)
_ASCTIME_DATE = re.compile(r"(?:Mon|Tue|Wed|Thu|Fri|Sat|Sun) " + _MONTH + r" ([ \d]\d) (\d\d):(\d\d):(\d\d) (\d{4})",
                           re.ASCII)


def _http_date(values: list[str]) -> float | None:
    """A conditional header's HTTP date as a POSIX time; None where RFC 9110 (13.1.3, 13.1.4) says to ignore the
    header: a value that is not one HTTP-date in one of its three forms (a list of dates, another zone than GMT, a
    missing field, an hour of 25, a year of 20 digits: Python's e-mail date parser took most of those), or the header
    given more than once."""
    if len(values) != 1:
        return None
    value = values[0].strip(" \t")
    try:
        if match := _IMF_FIXDATE.fullmatch(value):
            day, month, year, hour, minute, second = match.groups()
        elif match := _ASCTIME_DATE.fullmatch(value):
            month, day, hour, minute, second, year = match.groups()
        elif match := _RFC850_DATE.fullmatch(value):
            day, month, short_year, hour, minute, second = match.groups()
            # 5.6.7: a two-digit year more than 50 years ahead is the latest past year with those digits.
            year = 2000 + int(short_year)
            if year > datetime.now(timezone.utc).year + 50:
                year -= 100
        else:
            return None
        date = datetime(int(year), _MONTHS.index(month) + 1, int(day), int(hour), int(minute), int(second),
                        tzinfo=timezone.utc)
    except ValueError:  # a day, hour, minute or second out of range
        return None
    return date.timestamp()


def _not_modified_since(if_modified_since: list[str], mtime: float) -> bool:
    """Whether the file is not newer than the If-Modified-Since date; False for a header to ignore.
    Last-Modified shows whole seconds, so the file's time is compared as such."""
    since = _http_date(if_modified_since)
    return since is not None and int(mtime) <= since


class VideoFileResponse(FileResponse):
    """Starlette's FileResponse with RFC 9110 Range errors: an unparsable Range (or another unit than bytes) is
    ignored and the whole file sent, as the RFC asks, instead of a text/plain 400; 416 carries an OpenAI body.

    With conditional requests too, which Starlette's FileResponse ignores, evaluated in RFC 9110 13.2.2's order:
    412 Precondition Failed when If-Match names no strong tag of the file or, without If-Match, the file is newer
    than If-Unmodified-Since (a client resuming a download into a copy of the file it had: a file replaced since
    would be spliced into it); then 304 Not Modified when If-None-Match names the file's ETag or, without
    If-None-Match, the file is not newer than If-Modified-Since (it sent the whole file again to a client or cache
    revalidating its copy). A request that passes goes on to Range and If-Range as before. The route passes
    `stat_result`, which the ETag comes from.

    It sends the file the route opened (`file`), not the one its path names when the body starts: Starlette opens
    the path only after the 200 and its Content-Length are sent, so a DELETE landing in between (another client, or
    the TTL sweep) cut the download off with no byte of the body and a traceback in the log. An open file stays
    readable after it is unlinked."""

    def __init__(self, path: Any, *, file: BinaryIO | None = None, **kwargs: Any) -> None:
        super().__init__(path, **kwargs)
        self._file = file

    @contextlib.asynccontextmanager
    async def _open_file(self):
        if self._file is None:
            async with super()._open_file() as file:
                yield file
            return
        # Each of Starlette's senders opens the file once and seeks where it needs (the whole file reads from 0).
        self._file.seek(0)
        yield anyio.wrap_file(self._file)

    @classmethod
    def _parse_range_header(cls, http_range: str, file_size: int) -> list[tuple[int, int]]:
        # Starlette skips the range-specs it cannot read, so `bytes=1-2,,x` was served as `bytes=1-2`; a Range
        # with any malformed spec is malformed as a whole. Empty list elements are allowed (RFC 9110 5.6.1).
        _, _, range_set = http_range.partition("=")
        specs = [spec.strip(" \t") for spec in range_set.split(",")]
        if not all(_RANGE_SPEC.fullmatch(spec) for spec in specs if spec):
            return []
        try:
            return super()._parse_range_header(http_range, file_size)
        except MalformedRangeHeader:
            return []
        except RangeNotSatisfiable as exc:
            raise _Unsatisfiable(exc.max_size) from None

    def _precondition_failed(self, request: Headers) -> str | None:
        """The header whose condition the file fails, or None (RFC 9110 13.2.2 steps 1 and 2)."""
        if "if-match" in request:  # then If-Unmodified-Since is ignored, even when no tag matches
            matched = _names_etag(",".join(request.getlist("if-match")), self.headers["etag"], strong=True)
            return None if matched else "If-Match"
        since = _http_date(request.getlist("if-unmodified-since"))
        return "If-Unmodified-Since" if since is not None and int(self._mtime()) > since else None

    def _not_modified(self, request: Headers) -> bool:
        if "if-none-match" in request:  # then If-Modified-Since is ignored, even when no tag matches
            return _names_etag(",".join(request.getlist("if-none-match")), self.headers["etag"], strong=False)
        return _not_modified_since(request.getlist("if-modified-since"), self._mtime())

    def _mtime(self) -> float:
        if self.stat_result is None:  # the route passes it; the ETag and Last-Modified come from it too
            raise RuntimeError("VideoFileResponse needs the file's stat_result for a conditional request")
        return self.stat_result.st_mtime

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            failed = self._precondition_failed(Headers(scope=scope))
            if failed is not None:
                await error_response(ApiError(
                    412, f"The video's file does not meet the request's {failed} condition: it is not the file "
                         f"{'named by that entity-tag' if failed == 'If-Match' else 'as of that date'} (now ETag "
                         f"{self.headers['etag']}, Last-Modified {self.headers['last-modified']}). Download it again "
                         f"without {failed}.", code="precondition_failed", param=failed,
                    headers={"ETag": self.headers["etag"]}))(scope, receive, send)
            elif self._not_modified(Headers(scope=scope)):
                kept = {name: value for name, value in self.headers.items() if name in _NOT_MODIFIED_HEADERS}
                await Response(status_code=304, headers=kept)(scope, receive, send)
            else:
                await super().__call__(scope, receive, send)
        except _Unsatisfiable as exc:  # raised while parsing the header, before anything was sent
            response = error_response(ApiError(
                416, f"The Range {Headers(scope=scope).get('range')!r} is outside the file (bytes 0-"
                     f"{exc.file_size - 1}); ask for a range that starts before byte {exc.file_size}.",
                code="range_not_satisfiable", param="Range", headers={"Content-Range": f"bytes */{exc.file_size}"}))
            await response(scope, receive, send)
        finally:
            if self._file is not None:
                self._file.close()
