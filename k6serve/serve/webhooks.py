"""Webhooks: the server POSTs an event to the operator's `--webhook-url`s when a job completes or fails, as OpenAI's
video API does (event types `video.completed` and `video.failed`), so a client need not poll.

The event is OpenAI's: `{"id": "evt_...", "object": "event", "created_at": <the job's completed_at>, "type":
"video.completed", "data": {"id": "<video id>"}}`, signed as OpenAI signs its webhooks (the Standard Webhooks
scheme): headers `webhook-id` (the event id, the same on every retry, to drop duplicates), `webhook-timestamp` (Unix
seconds of this attempt) and `webhook-signature` (`v1,` + base64 HMAC-SHA256 of `<id>.<timestamp>.<body>` keyed
with `--webhook-secret`, whose `whsec_` base64 form is decoded as OpenAI's SDKs decode it). OpenAI's SDKs verify
them: `client.webhooks.verify_signature(body, headers, secret=...)`.

URLs are compared in the canonical form `check_webhook_url` gives them (scheme and host lower-cased, the scheme's
default port dropped; path and query as given), and one with whitespace or a control character is refused. Logs show
a URL as `shown_url` does (scheme://host[:port]/...: a hook URL's path or query often holds its token), a redirect's
Location too, and never an error text that could quote the URL's path or query.

Delivery runs on a thread per URL, never in a job's way (nor in another URL's): each event is POSTed with a 10 s
timeout; a 2xx is delivered; a connection error, timeout, 408, 429 or 5xx is retried with OpenAI's exponential
backoff (1, 2, 4, ... 1024 s, then every 30 minutes) until the next wait would end over 72 hours after the event was
first queued (`RESEND_WINDOW_S`, counted from its row's `queued_at` when resent), then given up; a redirect or any
other answer is given up at once. Events for one URL go in the order queued: the head event's retries hold back that
URL's later events (a receiver down for a deploy gets them all, in order, once back), never another URL's. Logs name
the URL's scheme, host and port only: a WARNING once an event has failed 6 attempts (about 31 s), then nothing per
attempt until an INFO line on its delivery or a WARNING when it is given up.

Events are durable: `send` writes one row per event and URL to the job store's `webhook_outbox` before queueing it,
and a row goes once that URL's delivery succeeded or was given up. One the stop cut short (still queued, or
between attempts) stays, as does every undelivered one of a server killed outright, and the next start sends it
again, in the order it was queued, with its own id and `created_at` (receivers drop an id seen before), unless its
URL is no longer configured or it was queued over 72 hours ago (OpenAI's own retry window): those rows are removed
with a warning, as are all of them at a start with no --webhook-url (`drop_unsent_events`). Warnings about many
events count them per URL and name a few. When the store cannot be written (a full disk) the event is still sent
from memory, and a stop before its delivery loses it. A cancelled job sends none (the client that cancelled it
knows; OpenAI's API has no such event).
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import http.client
import json
import logging
import queue
import secrets
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass
from typing import Protocol

from k6serve.serve.jobs import STORE_WRITE_ERRORS, PendingWebhook

logger = logging.getLogger(__name__)

WEBHOOK_SECRET_ENV = "K6SERVE_WEBHOOK_SECRET"
TIMEOUT_S = 10.0
# How long a stopping server waits for the events still queued (a job that ended just before the stop).
DRAIN_AT_STOP_S = 5.0
RETRIED_STATUSES = frozenset({408, 429})
# A kept event older than this is dropped at the next start, not sent, and no retry is made past it: OpenAI retries
# its own webhooks for up to 72 hours, so a receiver built for OpenAI's keeps the ids it has seen (to drop a resent
# one) no longer.
RESEND_WINDOW_S = 72 * 3600.0
# Retries wait at most this long apart: a receiver back from a long outage gets its events within half an hour.
MAX_RETRY_DELAY_S = 1800.0
# Failed attempts after which a delivery is logged as late (the first 31 s of retries): a receiver down for hours
# would otherwise show in no log line until its events were given up, 72 hours on.
LATE_AFTER_ATTEMPTS = 6
VIDEO_COMPLETED, VIDEO_FAILED = "video.completed", "video.failed"
DEFAULT_PORTS = {"http": 80, "https": 443}
# Events a warning names per URL; the rest are counted (naming each made one line of megabytes after an outage).
LOGGED_EXAMPLES = 3


def backoff_delays(first_s: float, cap_s: float, total_s: float) -> tuple[float, ...]:
    """Waits doubling from `first_s` up to `cap_s`, then `cap_s` repeated, until they add up to `total_s`."""
    delays: list[float] = []
    while sum(delays) < total_s:
        delays.append(min(first_s * 2 ** len(delays), cap_s))
    return tuple(delays)


# OpenAI's exponential backoff: 1, 2, 4, ..., 1024 s, then every 30 minutes; the age bound (`give_up_after_s`)
# ends it before its last wait.
RETRY_DELAYS_S = backoff_delays(1.0, MAX_RETRY_DELAY_S, RESEND_WINDOW_S)


def _duration(seconds: float) -> str:
    """`seconds` as a log line shows them: 31 s, 30 min, 72 h."""
    if seconds < 60:
        return f"{seconds:.3g} s"
    if seconds < 3600:
        return f"{seconds / 60:.3g} min"
    return f"{seconds / 3600:.3g} h"


def check_webhook_url(url: str) -> str:
    """`url`'s canonical form: stripped, scheme and host lower-cased, the scheme's default port dropped, path and
    query as given (so a receiver spelled two ways is one URL); a ValueError with the fix if it is no usable http(s)
    URL with a host (checked at start)."""
    text = url.strip()
    try:
        parts = urllib.parse.urlsplit(text)
        port = parts.port  # raises on a port that is no number or out of range
    except ValueError as exc:
        raise ValueError(f"--webhook-url {url!r} is not a URL ({exc}); pass e.g. "
                         "--webhook-url https://hooks.example.com/k6serve") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"--webhook-url {url!r} must be an http:// or https:// URL with a host, e.g. "
                         "--webhook-url https://hooks.example.com/k6serve")
    if parts.username is not None or parts.password is not None:
        # urllib resolved "user:pw@host" as a host name: every delivery failed, and the warning logged the password.
        raise ValueError(f"--webhook-url {shown_url(text)}: a user name or password in the URL is not sent; put a "
                         "token in the URL's path or query instead (the events are signed with --webhook-secret).")
    position = next((index for index, character in enumerate(text)
                     if character.isspace() or not character.isprintable()), None)
    if position is not None:
        # http.client refused each attempt with an InvalidURL quoting the whole URL, token and all (urlsplit alone
        # drops tabs and line ends silently). Not echoed here either: the token may sit next to the character.
        raise ValueError(f"--webhook-url {shown_url(text)} holds a space or control character (at character "
                         f"{position + 1}), which no HTTP request line can carry: percent-encode it (%20 for a "
                         "space) or remove it (a line end from a file read whole?).")
    host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
    port_part = "" if port is None or port == DEFAULT_PORTS[parts.scheme] else f":{port}"
    # Sliced from the text, not rebuilt by urlunsplit, which drops an empty query's "?" and so changes the URL.
    rest = text[len(parts.scheme) + len("://") + len(parts.netloc):]
    return f"{parts.scheme}://{host}{port_part}{rest}"


def shown_url(url: str) -> str:
    """`url` as logs show it: scheme://host[:port] only, as a hook URL's path or query often holds its token."""
    parts = urllib.parse.urlsplit(url)
    return f"{parts.scheme}://{parts.hostname}{f':{parts.port}' if parts.port else ''}/..."


def shown_location(url: str, location: str) -> str:
    """A redirect's Location (relative to `url`) as logs show it: reduced as by `shown_url`, as it may hold a token
    too."""
    if not location:
        return "no Location"
    try:
        target = urllib.parse.urljoin(url, location)
        if not urllib.parse.urlsplit(target).hostname:
            return "a Location with no host"
        return repr(shown_url(target)[:200])
    except ValueError:  # a port that is no number, an unclosed "[" in the host
        return "an unreadable Location"


def failure_reason(exc: BaseException, url: str) -> str:
    """`exc` as a log about `url` shows it: its type and text, or its type and a generic reason where the text (or
    the one of an exception it came from) could quote the URL's path or query, as http.client's InvalidURL does."""
    if _may_quote_url(exc, url):
        return f"{type(exc).__name__}: the URL or request was refused (details not shown: they quote the URL)"
    return f"{type(exc).__name__}: {getattr(exc, 'reason', exc)}"


def _may_quote_url(exc: BaseException, url: str) -> bool:
    parts = urllib.parse.urlsplit(url)
    pieces = [piece for piece in (parts.path, parts.query) if len(piece) > 1]  # a bare "/" holds no token
    seen: list[BaseException] = []
    cause: BaseException | None = exc
    while cause is not None and cause not in seen:
        text = str(cause)
        if isinstance(cause, http.client.InvalidURL) or any(piece in text for piece in pieces):
            return True
        seen.append(cause)
        cause = cause.__cause__ or cause.__context__
    return False


class _Tally:
    """Events counted per label (a URL as `shown_url` shows it), naming the first LOGGED_EXAMPLES of each: a
    warning about thousands stays one short line."""

    def __init__(self) -> None:
        self._counts: dict[str, int] = {}
        self._examples: dict[str, list[str]] = {}

    def add(self, label: str, example: str) -> None:
        self._counts[label] = self._counts.get(label, 0) + 1
        examples = self._examples.setdefault(label, [])
        if len(examples) < LOGGED_EXAMPLES:
            examples.append(example)

    def total(self) -> int:
        return sum(self._counts.values())

    def __bool__(self) -> bool:
        return bool(self._counts)

    def __str__(self) -> str:
        parts = []
        for label, count in self._counts.items():
            named = self._examples[label]
            more = f", and {count - len(named)} more" if count > len(named) else ""
            parts.append(f"{count} to {label} ({', '.join(named)}{more})")
        return "; ".join(parts)


def _canonical_or_none(url: str) -> str | None:
    """A stored row's URL in canonical form (an older server stored it as given); None if it is no usable URL."""
    try:
        return check_webhook_url(url)
    except ValueError:
        return None


def _shown_row_url(url: str) -> str:
    canonical = _canonical_or_none(url)
    return shown_url(canonical) if canonical is not None else "a URL that is no longer valid"


def drop_unsent_events(outbox: WebhookOutbox) -> None:
    """At the start of a server with no --webhook-url: remove the events an earlier run kept, with one warning (none
    is sent, and kept they would go out whenever a URL is given again, however late)."""
    rows = outbox.pending_webhook_events()
    if not rows:
        return
    dropped = _Tally()
    for row in rows:
        dropped.add(_shown_row_url(row.url), f"{row.event_type} {row.video_id}")
    _remove(outbox, [(row.event_id, row.url) for row in rows])
    logger.warning("%d webhook event(s) left from the last run are dropped, not sent, as no --webhook-url is given: "
                   "%s", dropped.total(), dropped)


def _remove(outbox: WebhookOutbox, rows: list[tuple[str, str]]) -> None:
    """Remove rows dropped at a start, in one transaction; a failure leaves them for the next start to drop."""
    if not rows:
        return
    try:
        outbox.remove_webhook_events(rows)
    except STORE_WRITE_ERRORS as exc:
        logger.warning("%d webhook event(s) dropped at this start could not be removed from the job store (%s); the "
                       "next start drops them again", len(rows), exc)


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    """A 3xx is an answer, not a place to resend to: urllib turned the POST into a GET without its body, sent the
    signature headers to wherever it pointed (another host, maybe), and the event counted as delivered."""

    def redirect_request(self, req, fp, code, msg, headers, newurl):  # noqa: ANN001 - urllib's signature
        return None


_OPENER = urllib.request.build_opener(_NoRedirect)


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
    queued_at: float  # wall-clock time it was first queued (a resent row's own): retries end RESEND_WINDOW_S on

    def body(self) -> bytes:
        return json.dumps({"id": self.id, "object": "event", "created_at": self.created_at, "type": self.type,
                           "data": {"id": self.video_id}}, separators=(",", ":")).encode()


class WebhookOutbox(Protocol):
    """Where events wait until each URL is done with them (`SqliteJobStore`'s `webhook_outbox` table)."""

    def add_webhook_event(self, event_id: str, event_type: str, video_id: str, created_at: int,
                          urls: Iterable[str], queued_at: float | None = None) -> None: ...
    def remove_webhook_event(self, event_id: str, url: str) -> None: ...
    def remove_webhook_events(self, rows: Iterable[tuple[str, str]]) -> None: ...
    def pending_webhook_events(self) -> list[PendingWebhook]: ...


class WebhookSender:
    """Delivers events to `urls` on a daemon thread per URL (`start` / `stop`); `send` only stores and queues.

    A URL's events go in order: its head event's retries (up to `give_up_after_s` after it was queued) hold back
    that URL's later ones, never another URL's. `retry_delays_s` is the whole schedule (given up after its last
    wait); tests pass short ones, and a short `give_up_after_s`.

    With an `outbox`, events outlive the process: what a stop or a crash left undelivered is sent at the next
    `start` (before the events `send` queues after it; one sent before it is not queued twice)."""

    def __init__(self, urls: tuple[str, ...], secret: str, *, user_agent: str = "k6serve",
                 retry_delays_s: tuple[float, ...] = RETRY_DELAYS_S, give_up_after_s: float = RESEND_WINDOW_S,
                 on_outcome: Callable[[str], None] | None = None, outbox: WebhookOutbox | None = None) -> None:
        self.urls = tuple(dict.fromkeys(check_webhook_url(url) for url in urls))  # as the kept rows name them
        self._key = secret_key(secret)
        self._user_agent = user_agent
        self._retry_delays_s = retry_delays_s
        self._give_up_after_s = give_up_after_s
        # One queue and thread per URL: a receiver that is down (up to 72 hours of retries for its head event) holds
        # back its own events only, not the others'.
        self._queues: dict[str, queue.Queue[Event | None]] = {url: queue.Queue() for url in self.urls}
        # Events queued for a URL and not yet delivered or given up, summed over the URLs (GET /metrics): a receiver
        # that is down shows as a count that grows, for up to 72 hours, before any event is given up.
        self._pending = 0
        self._pending_lock = threading.Lock()
        self._stopping = threading.Event()
        self._threads: list[threading.Thread] = []
        self._stopped = False
        self._on_outcome = on_outcome  # "delivered" or "failed", once per event and URL (the server's metrics)
        self._outbox = outbox
        # Events the outbox could not take (a full disk): a stop before their delivery loses them, and says so.
        self._memory_only: set[str] = set()
        # Ids `send` queued before `start`, whose rows the start must not queue again (it delivered them twice).
        self._sent_before_start: set[str] = set()
        self._started = False
        self._start_lock = threading.Lock()
        # (event id, canonical URL) -> the row's URL where an older server stored another spelling of it.
        self._row_urls: dict[tuple[str, str], str] = {}

    def start(self) -> None:
        if self._outbox is not None:
            self._queue_left_from_last_run(self._outbox)
        with self._start_lock:
            self._started = True
            self._sent_before_start.clear()
        for index, url in enumerate(self.urls):
            thread = threading.Thread(target=self._run, args=(url,), name=f"k6serve-webhooks-{index}", daemon=True)
            thread.start()
            self._threads.append(thread)

    def send(self, event_type: str, video_id: str, completed_at: float) -> None:
        event = Event(id=f"evt_{secrets.token_hex(16)}", type=event_type, created_at=int(completed_at),
                      video_id=video_id, queued_at=time.time())
        with self._start_lock:  # before its row exists: a start reading the row then finds its id here
            if not self._started:
                self._sent_before_start.add(event.id)
        # The runner stored the job's end before this call: a process killed in between (its log line, metrics and
        # upload removal) loses the event, though the job's state is right. A short window, accepted rather than
        # one transaction across the job's transition and these rows.
        kept = self._keep(event)
        if self._stopped:  # a job that ended after the stop (its MP4's tail, during the engine's shutdown)
            if kept:
                logger.warning("webhook %s for %s kept in the job store, sent at the next start: the server is "
                               "stopping", event_type, video_id)
            else:
                logger.warning("webhook %s for %s not sent: the server is stopping", event_type, video_id)
            return
        for url_queue in self._queues.values():
            self._put(url_queue, event)

    @property
    def pending(self) -> int:
        """Events queued for a URL and not yet delivered or given up, summed over the URLs."""
        with self._pending_lock:
            return self._pending

    def _put(self, url_queue: queue.Queue[Event | None], event: Event) -> None:
        with self._pending_lock:
            self._pending += 1
        url_queue.put(event)

    def _keep(self, event: Event) -> bool:
        """Write `event` to the outbox; False when there is none or the write failed (then it lives in memory)."""
        if self._outbox is None:
            return False
        try:
            self._outbox.add_webhook_event(event.id, event.type, event.video_id, event.created_at, self.urls,
                                           queued_at=event.queued_at)
        except STORE_WRITE_ERRORS as exc:  # the job has ended all the same: its event still goes, from memory
            self._memory_only.add(event.id)
            logger.warning("webhook %s for %s could not be kept in the job store (%s); it is sent from memory, and "
                           "lost if the server stops before it is delivered", event.type, event.video_id, exc)
            return False
        return True

    def _is_kept(self, event: Event) -> bool:
        return self._outbox is not None and event.id not in self._memory_only

    def _forget(self, event_id: str, url: str) -> None:
        """Remove the (event, URL) row: delivered, or given up for good."""
        if self._outbox is None or event_id in self._memory_only:
            return
        row_url = self._row_urls.pop((event_id, url), url)
        try:
            self._outbox.remove_webhook_event(event_id, row_url)
        except Exception as exc:  # noqa: BLE001 - a full disk, or the store closed under a thread hung past the stop
            logger.warning("webhook %s to %s: its job store row could not be removed (%s), so the next start sends "
                           "it again (with the same webhook-id)", event_id, shown_url(url), exc)

    def _queue_left_from_last_run(self, outbox: WebhookOutbox) -> None:
        """Queue the kept events a previous run did not deliver (before any new one), with their own ids; drop those
        for a URL no longer configured and those past RESEND_WINDOW_S, in one transaction."""
        now = time.time()
        configured_shown = {shown_url(url) for url in self.urls}
        unconfigured, stale = _Tally(), _Tally()
        dropped: list[tuple[str, str]] = []
        queued: set[tuple[str, str]] = set()
        rows = outbox.pending_webhook_events()
        with self._start_lock:  # read after the rows: `send` adds an id before writing its row
            sent_already = set(self._sent_before_start)
        for row in rows:
            if row.event_id in sent_already:
                continue  # `send` queued it before this start
            url = _canonical_or_none(row.url)
            example = f"{row.event_type} {row.video_id}"
            if url is None or url not in self._queues:
                unconfigured.add(self._unconfigured_label(url, configured_shown), example)
            elif now - row.queued_at > RESEND_WINDOW_S:
                stale.add(shown_url(url), example)
            elif (row.event_id, url) in queued:
                pass  # an older server given two spellings of this URL stored the event twice: sent once
            else:
                if url != row.url:
                    self._row_urls[(row.event_id, url)] = row.url
                queued.add((row.event_id, url))
                self._put(self._queues[url], Event(id=row.event_id, type=row.event_type, created_at=row.created_at,
                                                   video_id=row.video_id, queued_at=row.queued_at))
                continue
            dropped.append((row.event_id, row.url))
        _remove(outbox, dropped)
        if unconfigured:
            logger.warning("webhook events left from the last run for URLs no longer given as --webhook-url are "
                           "dropped: %s", unconfigured)
        if stale:
            logger.warning("webhook events left from the last run, queued over %g hours ago (OpenAI's retry window), "
                           "are dropped, not sent: %s", RESEND_WINDOW_S / 3600, stale)
        if queued:
            logger.info("resending %d webhook event(s) left from the last run", len(queued))

    @staticmethod
    def _unconfigured_label(url: str | None, configured_shown: Collection[str]) -> str:
        if url is None:
            return "a URL that is no longer valid"
        shown = shown_url(url)
        if shown in configured_shown:
            # The log hides paths: without this the dropped rows' URL read as the one configured.
            return f"{shown}, a --webhook-url's scheme, host and port with another path or query"
        return shown

    def stop(self, timeout_s: float = DRAIN_AT_STOP_S) -> None:
        """Deliver what is queued within `timeout_s` (no retry waits past it), then stop; what is left is logged
        (and, with an outbox, kept there for the next start)."""
        self._stopped = True
        if not self._threads:
            return
        for url_queue in self._queues.values():
            url_queue.put(None)
        deadline = time.monotonic() + timeout_s
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        self._stopping.set()  # retry waits in progress end now
        for thread in self._threads:
            thread.join(1.0)
        kept, dropped = _Tally(), _Tally()
        for url, url_queue in self._queues.items():
            while True:
                try:
                    item = url_queue.get_nowait()
                except queue.Empty:
                    break
                if item is not None:
                    (kept if self._is_kept(item) else dropped).add(shown_url(url), f"{item.type} {item.video_id}")
            # Its thread may still be in an attempt (a receiver that accepts and never answers, up to the timeout):
            # it must find the end mark when it comes back, or it waits on the queue for good.
            url_queue.put(None)
        if kept:
            logger.warning("webhooks not delivered before the server stopped, kept in the job store and sent at the "
                           "next start: %s", kept)
        if dropped:
            logger.warning("webhooks not delivered before the server stopped (dropped): %s", dropped)

    def _run(self, url: str) -> None:
        url_queue = self._queues[url]
        while True:
            event = url_queue.get()
            if event is None:
                return
            try:
                settled = self._deliver(event, url)
            except Exception as exc:  # noqa: BLE001 - one event's unforeseen failure must not end this URL's deliveries
                if _may_quote_url(exc, url):  # its traceback would show the token
                    logger.error("webhook %s for %s to %s failed (%s)", event.type, event.video_id, shown_url(url),
                                 failure_reason(exc, url))
                else:
                    logger.exception("webhook %s for %s to %s failed", event.type, event.video_id, shown_url(url))
                self._count("failed")
                settled = True
            with self._pending_lock:
                self._pending -= 1
            if settled:
                self._forget(event.id, url)

    def _deliver(self, event: Event, url: str) -> bool:
        """Attempt `event` until it is delivered or given up (True), or until the stop cuts it short (False)."""
        body = event.body()
        problem, attempts, too_old = "", 0, ""
        started = time.monotonic()
        for delay in (0.0, *self._retry_delays_s):
            if delay:
                if time.time() + delay - event.queued_at > self._give_up_after_s:
                    too_old = f"; the next retry would come over {_duration(self._give_up_after_s)} after it was queued"
                    break
                if attempts == LATE_AFTER_ATTEMPTS:
                    self._warn_late(event, url, attempts, time.monotonic() - started, problem)
                if self._stopping.wait(delay):
                    self._cut_short(event, url, attempts, problem)
                    return False
            attempts += 1
            failure = self._attempt(event, url, body)
            if failure is None:
                self._delivered(event, url, attempts, time.monotonic() - started)
                return True
            problem, retried = failure
            if not retried:
                break
        self._count("failed")
        logger.warning("webhook %s for %s to %s not delivered after %d attempt(s) over %s (%s)%s; the job's state is "
                       "at GET /v1/videos/%s", event.type, event.video_id, shown_url(url), attempts,
                       _duration(time.monotonic() - started), problem, too_old, event.video_id)
        return True

    def _attempt(self, event: Event, url: str, body: bytes) -> tuple[str, bool] | None:
        """POST `event` once: None if delivered, else the problem (as logs show it) and whether it is retried."""
        timestamp = int(time.time())
        request = urllib.request.Request(url, data=body, method="POST", headers={
            "Content-Type": "application/json", "User-Agent": self._user_agent, "webhook-id": event.id,
            "webhook-timestamp": str(timestamp), "webhook-signature": signature(self._key, event.id, timestamp, body)})
        try:
            with _OPENER.open(request, timeout=TIMEOUT_S) as answer:
                answer.read(65536)
        except urllib.error.HTTPError as exc:
            problem = f"HTTP {exc.code}"
            if 300 <= exc.code < 400:
                location = exc.headers.get("Location", "") if exc.headers else ""
                return (f"{problem} to {shown_location(url, location)}: a redirect is not followed, give that URL as "
                        "--webhook-url (the log hides its path; curl -si -X POST <the URL> shows it)", False)
            # Any other 4xx is the receiver refusing it: trying again would get the same answer.
            return problem, exc.code in RETRIED_STATUSES or exc.code >= 500
        except (OSError, ValueError, http.client.HTTPException) as exc:  # refused, DNS, timeout, TLS, garbage
            return failure_reason(exc, url), True
        return None

    def _warn_late(self, event: Event, url: str, attempts: int, elapsed_s: float, problem: str) -> None:
        """The one line between the first attempt and the outcome: a receiver down for hours is seen in the log."""
        logger.warning("webhook %s for %s to %s: not delivered after %d attempts over %s (%s); retried with backoff, "
                       "up to %s apart, until %s after it was queued, while this URL's later events wait behind it",
                       event.type, event.video_id, shown_url(url), attempts, _duration(elapsed_s), problem,
                       _duration(max(self._retry_delays_s)), _duration(self._give_up_after_s))

    def _delivered(self, event: Event, url: str, attempts: int, elapsed_s: float) -> None:
        self._count("delivered")
        # INFO where `_warn_late` said it was late, so that warning gets its end; DEBUG otherwise.
        level = logging.INFO if attempts > LATE_AFTER_ATTEMPTS else logging.DEBUG
        logger.log(level, "webhook %s for %s delivered to %s after %d attempt(s) over %s", event.type, event.video_id,
                   shown_url(url), attempts, _duration(elapsed_s))

    def _cut_short(self, event: Event, url: str, attempts: int, problem: str) -> None:
        if self._is_kept(event):  # not a failure: the next start goes on with it
            logger.warning("webhook %s for %s to %s: the server stopped after %d attempt(s) (%s); kept in the job "
                           "store and sent at the next start", event.type, event.video_id, shown_url(url), attempts,
                           problem)
            return
        self._count("failed")
        logger.warning("webhook %s for %s to %s not delivered after %d attempt(s) (%s, then the server stopped "
                       "while waiting to retry; dropped); the job's state is at GET /v1/videos/%s", event.type,
                       event.video_id, shown_url(url), attempts, problem, event.video_id)

    def _count(self, outcome: str) -> None:
        if self._on_outcome is not None:
            self._on_outcome(outcome)
