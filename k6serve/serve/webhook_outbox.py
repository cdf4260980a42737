"""Where webhook events wait until each URL is done with them (`WebhookOutbox`, the job store's `webhook_outbox`
table), what a start with no --webhook-url does with the rows an earlier run kept (`drop_unsent_events`), and how a
warning about many events counts them per URL (`Tally`).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Protocol

from k6serve.serve.jobs import STORE_WRITE_ERRORS, PendingWebhook
from k6serve.serve.webhook_urls import check_webhook_url, shown_url

# The name of the module this was split from (webhooks.py): operators' log filters and saved logs name it.
logger = logging.getLogger("k6serve.serve.webhooks")

# Events a warning names per URL; the rest are counted (naming each made one line of megabytes after an outage).
LOGGED_EXAMPLES = 3


class WebhookOutbox(Protocol):
    """Where events wait until each URL is done with them (`SqliteJobStore`'s `webhook_outbox` table)."""

    def remove_webhook_event(self, event_id: str, url: str) -> None: ...
    def remove_webhook_events(self, rows: Iterable[tuple[str, str]]) -> None: ...
    def pending_webhook_events(self) -> list[PendingWebhook]: ...


class Tally:
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


def canonical_or_none(url: str) -> str | None:
    """A stored row's URL in canonical form (an older server stored it as given); None if it is no usable URL."""
    try:
        return check_webhook_url(url)
    except ValueError:
        return None


def _shown_row_url(url: str) -> str:
    canonical = canonical_or_none(url)
    return shown_url(canonical) if canonical is not None else "a URL that is no longer valid"


def drop_unsent_events(outbox: WebhookOutbox) -> None:
    """At the start of a server with no --webhook-url: remove the events an earlier run kept, with one warning (none
    is sent, and kept they would go out whenever a URL is given again, however late)."""
    rows = outbox.pending_webhook_events()
    if not rows:
        return
    dropped = Tally()
    for row in rows:
        dropped.add(_shown_row_url(row.url), f"{row.event_type} {row.video_id}")
    remove_dropped_events(outbox, [(row.event_id, row.url) for row in rows])
    logger.warning("%d webhook event(s) left from the last run are dropped, not sent, as no --webhook-url is given: "
                   "%s", dropped.total(), dropped)


def remove_dropped_events(outbox: WebhookOutbox, rows: list[tuple[str, str]]) -> None:
    """Remove rows dropped at a start, in one transaction; a failure leaves them for the next start to drop."""
    if not rows:
        return
    try:
        outbox.remove_webhook_events(rows)
    except STORE_WRITE_ERRORS as exc:
        logger.warning("%d webhook event(s) dropped at this start could not be removed from the job store (%s); the "
                       "next start drops them again", len(rows), exc)
