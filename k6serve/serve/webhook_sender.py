"""Webhooks: the server POSTs an event to the operator's `--webhook-url`s when a job completes or fails, as OpenAI's
video API does (event types `video.completed` and `video.failed`), so a client need not poll.

Delivery runs on a thread per URL, never in a job's way (nor in another URL's): each event is POSTed with 10 s for the
whole attempt (`AttemptDeadline`); a 2xx is delivered; a connection error, timeout, 408, 429 or 5xx is retried with
OpenAI's exponential backoff (1, 2, 4, ... 1024 s, then every 30 minutes) until the next wait would end past the age
bound after the event was first queued (`age_bound`: 72 hours, `RESEND_WINDOW_S`, or the output TTL where shorter, so no
event names a video already deleted; counted from its row's `queued_at` when resent), then given up; a redirect or any
other answer is given up at once. A URL's thread keeps a schedule, not a queue: it attempts whichever event is due first
(a new one at once, a failed one after its wait), so an event the receiver keeps refusing with a 5xx holds back no
other, and events may arrive out of order, as OpenAI's do: receivers order them by `created_at` and drop an id seen
before. Logs name the URL's scheme, host and port only: a WARNING once per URL when it starts failing (an event's 6th
attempt failed, about 31 s), with the count of events waiting on it, an INFO when it delivers again, and a WARNING per
event given up.

Events are durable: the runner stores a job's end and its event's rows (one per URL, in the job store's
`webhook_outbox`) in one transaction, so a crash keeps both or neither, and schedules the event after it; a row goes
once that URL's delivery succeeded or was given up. A stop attempts, until its deadline, the events never attempted
yet (no retry), and keeps the rest, in one log line; so does every undelivered one of a server killed outright, and
the next start sends it again, with its own id and `created_at`, unless its URL is no longer configured or it was
queued longer ago than the age bound: those rows are removed with a warning, as are all of them at a start with no
--webhook-url (`drop_unsent_events`). A row queued "in the future" (a clock stepped back) counts as queued at that
start. Warnings about many events count them per URL and name a few. When the rows cannot be written (a full disk)
the job's end is stored without them and the event is sent from memory, and a stop before its delivery loses it. A
cancelled job sends none (the client that cancelled it knows; OpenAI's API has no such event).

The event's body and signature and the HTTP opener are `webhook_transport.py`'s, the URL checks and how logs show a
URL `webhook_urls.py`'s, the outbox's protocol and the start's dropping of rows no URL takes `webhook_outbox.py`'s.
"""

from __future__ import annotations

import contextlib
import heapq
import http.client
import logging
import secrets
import threading
import time
import urllib.error
import urllib.request
from collections import deque
from collections.abc import Callable, Collection
from dataclasses import dataclass, field

from k6serve.serve.jobs import OutboxEvent
from k6serve.serve.webhook_outbox import Tally, WebhookOutbox, canonical_or_none, remove_dropped_events
from k6serve.serve.webhook_transport import OPENER, AttemptDeadline, Event, secret_key, signature
from k6serve.serve.webhook_urls import check_webhook_url, failure_reason, may_quote_url, shown_location, shown_url

# The name of the module this was split from (webhooks.py): operators' log filters and saved logs name it.
logger = logging.getLogger("k6serve.serve.webhooks")

TIMEOUT_S = 10.0
# How long a stopping server goes on attempting the events never attempted yet (a job that ended just before it).
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


def backoff_delays(first_s: float, cap_s: float, total_s: float) -> tuple[float, ...]:
    """Waits doubling from `first_s` up to `cap_s`, then `cap_s` repeated, until they add up to `total_s`."""
    if first_s <= 0 or cap_s <= 0:  # the sum would never grow: an endless loop
        raise ValueError(f"backoff_delays needs first_s and cap_s > 0, got {first_s} and {cap_s}")
    delays: list[float] = []
    while sum(delays) < total_s:
        delays.append(min(first_s * 2 ** len(delays), cap_s))
    return tuple(delays)


# OpenAI's exponential backoff: 1, 2, 4, ..., 1024 s, then every 30 minutes; the age bound (`give_up_after_s`)
# ends it before its last wait.
RETRY_DELAYS_S = backoff_delays(1.0, MAX_RETRY_DELAY_S, RESEND_WINDOW_S)


def age_bound(output_ttl_s: float) -> float:
    """How long after it was queued an event is still retried or resent (`give_up_after_s`): RESEND_WINDOW_S, or
    the output TTL where that is shorter (0 keeps outputs forever): the job is deleted then, and a later
    `video.completed` would name a video that answers 404."""
    return min(RESEND_WINDOW_S, output_ttl_s) if output_ttl_s > 0 else RESEND_WINDOW_S


def _duration(seconds: float) -> str:
    """`seconds` as a log line shows them: 31 s, 30 min, 72 h."""
    if seconds < 60:
        return f"{seconds:.3g} s"
    if seconds < 3600:
        return f"{seconds / 60:.3g} min"
    return f"{seconds / 3600:.3g} h"


@dataclass(slots=True, eq=False)
class _Delivery:
    """One event on its way to one URL: its attempts so far and when the age bound started counting."""

    event: Event
    # Monotonic time it was queued (a resent row's age carried over): the age bound is counted on this clock, so a
    # wall clock stepped forward gives up nothing and one stepped back keeps nothing longer.
    queued_mono: float
    attempts: int = 0
    first_try: float = 0.0  # monotonic time of this run's first attempt (the "over T" of the log lines)
    problem: str = ""  # the last failed attempt's, as logs show it


@dataclass(slots=True, eq=False)
class _Lane:
    """One URL's schedule: its thread attempts the earliest due event, one at a time."""

    # (due monotonic time, sequence number, delivery): the sequence keeps events due at once in the order queued.
    heap: list[tuple[float, int, _Delivery]] = field(default_factory=list)
    # At the stop: the events never attempted, each tried once before the deadline (a job that ended just before).
    draining: deque[_Delivery] | None = None
    in_flight: _Delivery | None = None
    failing_since: float | None = None  # set by the URL's failing warning, cleared (with an INFO) by a delivery

    def waiting(self) -> int:
        return len(self.heap) + len(self.draining or ()) + (self.in_flight is not None)


class WebhookSender:
    """Delivers events to `urls` on a daemon thread per URL (`start` / `stop`). An event is made (`new_event`), its
    rows kept by the job store with the job's end that caused it (`outbox_event`), then scheduled (`schedule`).

    Each URL's thread attempts the earliest due event: a new one is due at once, a failed one again after the
    schedule's next wait, so one event that keeps failing holds back no other (events may arrive out of order, as
    OpenAI's do). `retry_delays_s` is the whole schedule (given up after its last wait), and `give_up_after_s` the
    age past which no retry is made (`age_bound`); tests pass short ones.

    With an `outbox`, events outlive the process: what a stop or a crash left undelivered is sent at the next
    `start` (scheduled before the events `schedule` adds after it; one made before it is not scheduled twice)."""

    def __init__(self, urls: tuple[str, ...], secret: str, *, user_agent: str = "k6serve",
                 retry_delays_s: tuple[float, ...] = RETRY_DELAYS_S, give_up_after_s: float = RESEND_WINDOW_S,
                 on_outcome: Callable[[str], None] | None = None, outbox: WebhookOutbox | None = None) -> None:
        self.urls = tuple(dict.fromkeys(check_webhook_url(url) for url in urls))  # as the kept rows name them
        self._key = secret_key(secret)
        self._user_agent = user_agent
        self._retry_delays_s = retry_delays_s
        self._give_up_after_s = give_up_after_s
        # One schedule and thread per URL: a receiver that is down (up to 72 hours of retries) holds back no other.
        # One condition for all: it guards every lane, `_sequence` and the stop's flags, and wakes the threads.
        self._lanes: dict[str, _Lane] = {url: _Lane() for url in self.urls}
        self._changed = threading.Condition()
        self._sequence = 0
        self._threads: list[threading.Thread] = []
        self._stopped = False  # `schedule` schedules nothing more
        self._deadline: float | None = None  # set by `stop`: no retry from then on, no attempt past it
        self._done = False  # the stop is over: what is left is kept (or dropped), and no longer pending
        self._on_outcome = on_outcome  # "delivered" or "failed", once per event and URL (the server's metrics)
        self._outbox = outbox
        # (event id, URL) of the events the outbox could not take (a full disk), until that URL is done with it: a
        # stop before their delivery loses them, and says so.
        self._memory_only: set[tuple[str, str]] = set()
        # Ids `new_event` made before `start`, whose rows the start must not schedule: `schedule` does (or, if the
        # job's end was not stored, nothing does), and scheduled twice they were delivered twice.
        self._sent_before_start: set[str] = set()
        self._started = False
        self._start_lock = threading.Lock()
        # (event id, canonical URL) -> the row's URL where an older server stored another spelling of it.
        self._row_urls: dict[tuple[str, str], str] = {}

    def start(self) -> None:
        if self._outbox is not None:
            self._schedule_left_from_last_run(self._outbox)
        with self._start_lock:
            self._started = True
            self._sent_before_start.clear()
        for index, url in enumerate(self.urls):
            thread = threading.Thread(target=self._run, args=(url,), name=f"k6serve-webhooks-{index}", daemon=True)
            thread.start()
            self._threads.append(thread)

    def new_event(self, event_type: str, video_id: str, completed_at: float) -> Event:
        """An event to keep (`outbox_event`) and then `schedule`; made before its rows are written, so that a start
        reading them does not schedule it too."""
        event = Event(id=f"evt_{secrets.token_hex(16)}", type=event_type, created_at=int(completed_at),
                      video_id=video_id)
        with self._start_lock:  # before its row exists: a start reading the row then finds its id here
            if not self._started:
                self._sent_before_start.add(event.id)
        return event

    def outbox_event(self, event: Event) -> OutboxEvent | None:
        """`event`'s outbox rows, for the job store to write with the job's end; None when there is no outbox."""
        if self._outbox is None:
            return None
        return OutboxEvent(event.id, event.type, event.video_id, event.created_at, self.urls)

    def schedule(self, event: Event, store_error: BaseException | None = None) -> None:
        """Schedule `event` for every URL once its rows are kept, or, after `store_error` (they could not be
        written: the job has ended all the same), from memory only, with a warning."""
        if store_error is not None:
            self._memory_only.update((event.id, url) for url in self.urls)
            logger.warning("webhook %s for %s could not be kept in the job store (%s); it is sent from memory, and "
                           "lost if the server stops before it is delivered", event.type, event.video_id, store_error)
        with self._changed:  # `stop` sets `_stopped` under this lock: no event lands after its summary
            stopped = self._stopped
            if not stopped:
                for url in self.urls:
                    self._push(url, _Delivery(event, time.monotonic()), time.monotonic())
        if not stopped:  # else a job that ended after the stop (its MP4's tail, during the engine's shutdown)
            return
        if self._outbox is not None and store_error is None:
            logger.warning("webhook %s for %s kept in the job store, sent at the next start: the server is stopping",
                           event.type, event.video_id)
        else:
            self._memory_only.difference_update((event.id, url) for url in self.urls)
            logger.warning("webhook %s for %s not sent: the server is stopping", event.type, event.video_id)

    @property
    def pending(self) -> int:
        """Events scheduled or in an attempt for a URL, not yet delivered or given up, summed over the URLs; 0 once
        stopped (what is left is in the job store, for the next start)."""
        with self._changed:
            return 0 if self._done else sum(lane.waiting() for lane in self._lanes.values())

    def _push(self, url: str, delivery: _Delivery, due: float) -> None:
        """Schedule `delivery` at `due` (monotonic) and wake the URL's thread; the caller holds `_changed`."""
        self._sequence += 1
        heapq.heappush(self._lanes[url].heap, (due, self._sequence, delivery))
        self._changed.notify_all()

    def _is_kept(self, event: Event, url: str) -> bool:
        return self._outbox is not None and (event.id, url) not in self._memory_only

    def _forget(self, event_id: str, url: str) -> None:
        """`url` is done with the event (delivered, or given up for good): remove its row, or its `_memory_only`
        entry, which would otherwise grow for as long as the disk stays full."""
        if self._outbox is None:
            return
        if (event_id, url) in self._memory_only:
            # discard, not remove: a stop's summary may have dropped the pair meanwhile (from another thread)
            self._memory_only.discard((event_id, url))
            return
        row_url = self._row_urls.pop((event_id, url), url)
        try:
            self._outbox.remove_webhook_event(event_id, row_url)
        except Exception as exc:  # noqa: BLE001 - a full disk, or the store closed under a thread hung past the stop
            logger.warning("webhook %s to %s: its job store row could not be removed (%s), so the next start sends "
                           "it again (with the same webhook-id)", event_id, shown_url(url), exc)

    def _schedule_left_from_last_run(self, outbox: WebhookOutbox) -> None:
        """Schedule the kept events a previous run did not deliver (before any new one), with their own ids; drop
        those for a URL no longer configured and those past the age bound, in one transaction."""
        now, now_mono = time.time(), time.monotonic()
        configured_shown = {shown_url(url) for url in self.urls}
        unconfigured, stale = Tally(), Tally()
        dropped: list[tuple[str, str]] = []
        scheduled: set[tuple[str, str]] = set()
        rows = outbox.pending_webhook_events()
        with self._start_lock:  # read after the rows: `new_event` adds an id before its row is written
            sent_already = set(self._sent_before_start)
        for row in rows:
            if row.event_id in sent_already:
                continue  # made before this start: its `schedule` schedules it
            url = canonical_or_none(row.url)
            example = f"{row.event_type} {row.video_id}"
            # A queued_at ahead of now is a clock stepped back since: taken as now, or the row was never stale.
            age_s = max(0.0, now - row.queued_at)
            if url is None or url not in self._lanes:
                unconfigured.add(self._unconfigured_label(url, configured_shown), example)
            elif age_s > self._give_up_after_s:
                stale.add(shown_url(url), example)
            elif (row.event_id, url) in scheduled:
                pass  # an older server given two spellings of this URL stored the event twice: sent once
            else:
                if url != row.url:
                    self._row_urls[(row.event_id, url)] = row.url
                scheduled.add((row.event_id, url))
                event = Event(id=row.event_id, type=row.event_type, created_at=row.created_at,
                              video_id=row.video_id)
                with self._changed:
                    self._push(url, _Delivery(event, now_mono - age_s), now_mono)
                continue
            dropped.append((row.event_id, row.url))
        remove_dropped_events(outbox, dropped)
        if unconfigured:
            logger.warning("webhook events left from the last run for URLs no longer given as --webhook-url are "
                           "dropped: %s", unconfigured)
        if stale:
            logger.warning("webhook events left from the last run, queued over %s ago (the retry window: 72 h, or "
                           "--output-ttl if shorter), are dropped, not sent: %s", _duration(self._give_up_after_s),
                           stale)
        if scheduled:
            logger.info("resending %d webhook event(s) left from the last run", len(scheduled))

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
        """Until `timeout_s` from now, attempt once each event never attempted yet (a job that ended just before
        the stop), with no retry; then stop. What is left is logged in one line per outcome (and, with an outbox,
        kept there for the next start); an attempt still in progress ends on its own (at most TIMEOUT_S)."""
        deadline = time.monotonic() + timeout_s
        with self._changed:
            self._stopped = True
            self._deadline = deadline
            self._changed.notify_all()  # threads in a retry wait stop waiting now
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        kept, dropped, in_flight = Tally(), Tally(), Tally()
        with self._changed:
            self._done = True
            self._changed.notify_all()
            for url, lane in self._lanes.items():
                left = [delivery for _, _, delivery in sorted(lane.heap)] + list(lane.draining or ())
                lane.heap.clear()
                lane.draining = deque()
                for delivery in left:
                    event = delivery.event
                    if self._is_kept(event, url):
                        kept.add(shown_url(url), f"{event.type} {event.video_id}")
                    else:
                        dropped.add(shown_url(url), f"{event.type} {event.video_id}")
                        self._memory_only.discard((event.id, url))
                if lane.in_flight is not None:  # its attempt ends on its own; `_settle` counts its outcome
                    event = lane.in_flight.event
                    in_flight.add(shown_url(url), f"{event.type} {event.video_id}")
        if in_flight:
            logger.warning("webhooks still being sent when the server stopped (kept in the job store unless this "
                           "attempt delivers them; one the store could not take is lost if it fails): %s", in_flight)
        if kept:
            logger.warning("webhooks not delivered before the server stopped, kept in the job store and sent at the "
                           "next start: %s", kept)
        if dropped:
            for _ in range(dropped.total()):
                self._count("failed")
            logger.warning("webhooks not delivered before the server stopped (dropped): %s", dropped)

    def _run(self, url: str) -> None:
        lane = self._lanes[url]
        while (delivery := self._next(lane)) is not None:
            now = time.monotonic()
            if not delivery.attempts:
                delivery.first_try = now
            if now - delivery.queued_mono > self._give_up_after_s:
                # It waited past the age bound behind slower attempts (one thread a URL, up to TIMEOUT_S each): its
                # video may be deleted by now (the bound follows --output-ttl), so it is not sent.
                self._settle(url, lane, delivery, (f"not sent: queued over {_duration(self._give_up_after_s)} ago",
                                                   False))
                continue
            delivery.attempts += 1
            self._settle(url, lane, delivery, self._try(delivery, url))

    def _next(self, lane: _Lane) -> _Delivery | None:
        """The lane's next event to attempt, marked in flight, once it is due; None when the thread is to end."""
        with self._changed:
            while True:
                now = time.monotonic()
                if self._done or (self._deadline is not None and now >= self._deadline):
                    return None
                if self._deadline is not None:  # stopping: the events never attempted, then nothing
                    if lane.draining is None:
                        fresh = sorted(entry for entry in lane.heap if not entry[2].attempts)
                        lane.heap[:] = [entry for entry in lane.heap if entry[2].attempts]
                        heapq.heapify(lane.heap)
                        lane.draining = deque(delivery for _, _, delivery in fresh)
                    if not lane.draining:
                        return None
                    lane.in_flight = lane.draining.popleft()
                    return lane.in_flight
                if lane.heap and lane.heap[0][0] <= now:
                    lane.in_flight = heapq.heappop(lane.heap)[2]
                    return lane.in_flight
                self._changed.wait(lane.heap[0][0] - now if lane.heap else None)

    def _try(self, delivery: _Delivery, url: str) -> tuple[str, bool] | None:
        """One attempt, as `_attempt`; an unforeseen error is logged and ends the event (not the URL's thread)."""
        event = delivery.event
        try:
            return self._attempt(event, url, event.body())
        except Exception as exc:  # noqa: BLE001 - one event's unforeseen failure must not end this URL's deliveries
            if may_quote_url(exc, url):  # its traceback would show the token
                logger.error("webhook %s for %s to %s failed (%s)", event.type, event.video_id, shown_url(url),
                             failure_reason(exc, url))
            else:
                logger.exception("webhook %s for %s to %s failed", event.type, event.video_id, shown_url(url))
            return failure_reason(exc, url), False

    def _settle(self, url: str, lane: _Lane, delivery: _Delivery, failure: tuple[str, bool] | None) -> None:
        """After an attempt: delivered, scheduled again after the next wait, or given up (with its log lines)."""
        now = time.monotonic()
        given_up = ""  # why, for the log line, when given up
        recovered_since = failing_warned = None
        with self._changed:
            lane.in_flight = None  # out of `pending` before it is counted delivered
            if failure is None:
                recovered_since, lane.failing_since = lane.failing_since, None
            elif self._done and failure[1]:
                # Attempted past the stop's summary, and to be retried: its row stays for the next start, or, if the
                # store could not take it, it is lost (as the summary said): counted here, once.
                if not self._is_kept(delivery.event, url):
                    self._memory_only.discard((delivery.event.id, url))
                    self._count("failed")
                return
            else:
                delivery.problem, retried = failure
                delay = self._next_delay(delivery, now) if retried else None
                if isinstance(delay, str):
                    given_up = delay
                elif delay is not None:
                    self._push(url, delivery, now + delay)  # not attempted again if stopping: kept
                    if delivery.attempts == LATE_AFTER_ATTEMPTS and lane.failing_since is None:
                        lane.failing_since = delivery.first_try
                        failing_warned = True
                    if not failing_warned:
                        return
            waiting = lane.waiting()
        event = delivery.event
        if failure is None:
            self._count("delivered")
            self._forget(event.id, url)
            logger.debug("webhook %s for %s delivered to %s after %d attempt(s) over %s", event.type,
                         event.video_id, shown_url(url), delivery.attempts, _duration(now - delivery.first_try))
            if recovered_since is not None:  # the end of the failing warning
                logger.info("webhooks to %s delivered again after %s; %d event(s) pending", shown_url(url),
                            _duration(now - recovered_since), waiting)
        elif failing_warned:
            logger.warning("webhooks to %s failing: %s for %s not delivered after %d attempts over %s (%s); %d "
                           "event(s) waiting, each retried with backoff, up to %s apart, until %s after it was queued",
                           shown_url(url), event.type, event.video_id, delivery.attempts,
                           _duration(now - delivery.first_try), delivery.problem, waiting,
                           _duration(max(self._retry_delays_s)), _duration(self._give_up_after_s))
        else:
            self._count("failed")
            self._forget(event.id, url)
            logger.warning("webhook %s for %s to %s not delivered after %d attempt(s) over %s (%s)%s; the job's "
                           "state is at GET /v1/videos/%s", event.type, event.video_id, shown_url(url),
                           delivery.attempts, _duration(now - delivery.first_try), delivery.problem, given_up,
                           event.video_id)

    def _next_delay(self, delivery: _Delivery, now: float) -> float | str:
        """The wait before `delivery`'s next attempt, or why it gets none (schedule over, or past the age bound)."""
        if delivery.attempts > len(self._retry_delays_s):
            return ""
        delay = self._retry_delays_s[delivery.attempts - 1]
        if now + delay - delivery.queued_mono > self._give_up_after_s:
            return f"; the next retry would come over {_duration(self._give_up_after_s)} after it was queued"
        return delay

    def _attempt(self, event: Event, url: str, body: bytes) -> tuple[str, bool] | None:
        """POST `event` once: None if delivered, else the problem (as logs show it) and whether it is retried."""
        timestamp = int(time.time())
        request = urllib.request.Request(url, data=body, method="POST", headers={
            "Content-Type": "application/json", "User-Agent": self._user_agent, "webhook-id": event.id,
            "webhook-timestamp": str(timestamp), "webhook-signature": signature(self._key, event.id, timestamp, body)})
        deadline = AttemptDeadline(TIMEOUT_S)
        try:
            with deadline, OPENER.open(request, timeout=TIMEOUT_S) as answer:
                # Its 2xx status accepted the event: a body cut short (or by the deadline) does not unsay it.
                with contextlib.suppress(OSError, http.client.HTTPException):
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
            if deadline.expired:  # its socket shut at the deadline: the error says "closed", not why
                return f"no whole answer within {TIMEOUT_S:g} s", True
            return failure_reason(exc, url), True
        return None

    def _count(self, outcome: str) -> None:
        if self._on_outcome is not None:
            self._on_outcome(outcome)
