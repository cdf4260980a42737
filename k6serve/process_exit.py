"""How a k6serve process ends once its work is done: without the interpreter's teardown."""

from __future__ import annotations

import contextlib
import os
import sys
from typing import NoReturn


def exit_without_teardown(code: int = 0) -> NoReturn:
    """End this process now, after what an orderly exit must do, but without the interpreter's teardown.

    A rank process holds torch, diffusers and transformers; tearing the interpreter down (clearing every module and
    collecting their objects several times, `Py_FinalizeEx`) took 0.6 s for torch alone and about 2 s for a rank on a
    2-core CPU machine (AMD EPYC), and the engine waits for it at every shutdown (`k6serve generate` ended that much
    later). What an exit must still do is done first, in the interpreter's own order: threading's shutdown (its exit
    hooks, which wake idle `concurrent.futures` workers such as inductor's compile pool: joined without them, those
    never ended; then every non-daemon thread finishes), the atexit handlers (logging's flush, multiprocessing's
    finalizers such as a queue's feeder, weakref finalizers, torch's own), and the standard streams are flushed; the
    operating system frees the memory, the files and the device context. Called from the main thread, once
    everything the process wrote is closed (a buffered file left open loses what the teardown would have flushed).

    A leaf module (no torch): the `k6serve` command ends through it too (`cli.main.console_main`), also after a
    refusal that imported nothing heavy."""
    import atexit
    import threading

    # what Py_FinalizeEx runs first (wait_for_thread_shutdown); private, so typeshed does not declare it
    threading._shutdown()  # type: ignore[attr-defined]
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)
