"""The engine's rank processes, killed with SIGKILL when the interpreter exits (after the engines still alive are
shut down)."""

from __future__ import annotations

import atexit
import importlib
import logging
import weakref
from multiprocessing.process import BaseProcess

# The engine side's name: these lines were logged under it when the hook lived in process_group_worker.py (log
# filters, saved logs).
logger = logging.getLogger("k6serve.runtime.process_group_worker")

# multiprocessing registers its own exit hook when its `util` module is first imported: imported here, before the
# hook below is registered, so that atexit (last registered, first run) runs this module's hook before that one.
importlib.import_module("multiprocessing.util")

# The engine's rank processes still running, stopped with SIGKILL when the interpreter exits (`_kill_ranks_at_exit`).
ENGINE_RANKS: "weakref.WeakSet[BaseProcess]" = weakref.WeakSet()


@atexit.register  # after multiprocessing's own exit hook (imported above), so it runs before that hook
def _kill_ranks_at_exit() -> None:
    """multiprocessing's exit hook stops daemonic children with SIGTERM, then joins them: the engine's ranks ignore
    SIGTERM (`rank_process.engine_rank_main`), and a process exiting with its ranks alive (a shutdown cut short by a
    second Ctrl-C, a generator's finalizer detached) waited for them forever. They get SIGKILL here first.

    But only after every engine still alive has been shut down as its owner would have (`Engine.shutdown`: the
    running request finished or cancelled with the reason, the ranks told to stop): atexit runs this hook before a
    generator's finalizer registered earlier, which found its ranks killed ("replica died while running it")."""
    from k6serve.runtime.engine import LIVE_ENGINES

    for engine in list(LIVE_ENGINES):
        try:
            engine.shutdown()
        except Exception:  # noqa: BLE001 (the process is exiting: what is left is killed below)
            logger.exception("shutting an engine down at exit failed")
    for process in list(ENGINE_RANKS):
        if process.is_alive():
            process.kill()
            process.join(5)
