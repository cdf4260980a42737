"""How a rank process logs: its rank in front of every line, and what every rank would say alike said once.

Messages that follow from the configuration alone (the built-in demo checkpoint, an offload flag on the CPU, the
SR decode that the `--vae-config.*` flags chose, the speed-mode caveat under Ulysses...) are the same on every rank,
and a run on N GPUs printed each of them N times. Such a record is logged with `extra=ONCE`; ranks other than 0
drop it. Everything else (a rank's own warm-up time, a lost connection, a failure) is still written by the rank it
happened on.
"""

from __future__ import annotations

import logging

ONCE = {"k6serve_same_on_every_rank": True}


class _OnRankZeroOnly(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not getattr(record, "k6serve_same_on_every_rank", False)


def configure_rank_logging(rank: int, level: int | str) -> None:
    """Root logging for the process of global rank `rank` (called first thing in the rank's process)."""
    logging.basicConfig(level=level, format=f"%(asctime)s [rank {rank}] %(levelname)s %(name)s: %(message)s")
    if rank != 0:
        for handler in logging.getLogger().handlers:
            handler.addFilter(_OnRankZeroOnly())
