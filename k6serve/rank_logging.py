"""How a rank process logs: its rank in front of every line, and what every rank would say alike said once.

Messages that follow from the configuration alone (the built-in demo checkpoint, an offload flag on the CPU, the
SR decode that the `--vae-config.*` flags chose, the speed-mode caveat under Ulysses...) are the same on every rank,
and a run on N GPUs printed each of them N times. Such a record is logged with `extra=ONCE`; ranks other than 0
drop it. Everything else (a rank's own warm-up time, a lost connection, a failure) is still written by the rank it
happened on.
"""

from __future__ import annotations

import logging
from datetime import datetime

ONCE = {"k6serve_same_on_every_rank": True}


class ZonedFormatter(logging.Formatter):
    """Log times with their UTC offset, `2026-12-05 05:01:48.123+0000`: the default `05:01:48,123` said no zone, so
    a server's lines could not be put beside a job's `created_at` (Unix seconds), another host's ranks or a proxy's
    log without knowing each host's time zone. Local time, as before, with the offset in force at that moment."""

    def formatTime(self, record: logging.LogRecord, datefmt: str | None = None) -> str:  # noqa: N802 - logging's
        moment = datetime.fromtimestamp(record.created).astimezone()
        return f"{moment:%Y-%m-%d %H:%M:%S}.{int(record.msecs):03d}{moment:%z}"


def configure_logging(level: int | str, fmt: str) -> None:
    """`logging.basicConfig(level, fmt)` with `ZonedFormatter` on the handler it adds; a root logger that already
    has handlers (a host program's) is left as it is, as basicConfig leaves it."""
    root = logging.getLogger()
    if root.handlers:
        logging.basicConfig(level=level, format=fmt)  # no-op on the handlers, as before
        return
    logging.basicConfig(level=level, format=fmt)
    for handler in root.handlers:
        handler.setFormatter(ZonedFormatter(fmt))


class _OnRankZeroOnly(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not getattr(record, "k6serve_same_on_every_rank", False)


def configure_rank_logging(rank: int, level: int | str) -> None:
    """Root logging for the process of global rank `rank` (called first thing in the rank's process)."""
    configure_logging(level, f"%(asctime)s [rank {rank}] %(levelname)s %(name)s: %(message)s")
    if rank != 0:
        for handler in logging.getLogger().handlers:
            handler.addFilter(_OnRankZeroOnly())
