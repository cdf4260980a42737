"""Keep Python's cyclic garbage collector off the objects that compilation leaves behind.

`torch.compile` leaves millions of long-lived Python objects (FX graphs, guards, generated code, Triton kernel
handles). Every later full collection walks all of them, and it can land in the middle of a denoising step.
On H200 a warm request spent ~5.5 s more in its denoising loop than ten steady-state steps (docs/benchmarks.md,
second session); such a collection was the first suspect. The fourth session's run showed the remaining gap to be
a recompilation instead (one 10.2 s step in the first warm request only, and this freezer finding new graphs
before the second; the cause, dynamo guarding on `sys.modules` through the FA3 loader, is fixed in
`k6serve.ops.attention`). The freeze stays: it is cheap (0.2-0.4 s, once per compilation) and keeps a full
collection's walk over the compiled objects out of later requests. Before a
request, if graphs were compiled since the last freeze, `CompileGcFreezer` runs one collection and then
`gc.freeze()`s every object that survived it into the permanent generation, which collections skip. vLLM does
the same after its start-up compilation. It runs before a request rather than after one so that a finished
request's objects (frames, latents) are already gone: frozen objects are still freed by reference counting, but
a frozen reference cycle would never be collected, so only long-lived objects (weights, compiled graphs,
modules) should be frozen. New objects are collected as usual.
"""

from __future__ import annotations

import atexit
import gc
import time


def compiled_graph_count() -> int:
    """How many graphs dynamo has compiled in this process so far (0 without torch.compile)."""
    try:
        from torch._dynamo.utils import counters
    except ImportError:  # pragma: no cover - torch without dynamo
        return 0
    return int(counters["stats"].get("unique_graphs", 0))


# Hand frozen objects back to the collector when the interpreter exits: frozen objects are never collected at
# shutdown, and extension modules that check for leaked instances at exit (Triton >= 3.9's nanobind bindings) then
# print pages of "leaked instance" reports after every run. Harmless when nothing was frozen.
atexit.register(gc.unfreeze)


class CompileGcFreezer:
    """Freeze the surviving objects once after every compilation (checked before each request)."""

    def __init__(self) -> None:
        self._graphs_frozen = -1  # nothing frozen yet: the first call always freezes (model load, warm-up)

    def freeze_if_compiled(self) -> float | None:
        """Collect and freeze if new graphs were compiled since the last freeze; returns the seconds it took."""
        graphs = compiled_graph_count()
        if graphs == self._graphs_frozen:
            return None
        start = time.perf_counter()
        gc.collect()
        gc.freeze()
        self._graphs_frozen = graphs
        return time.perf_counter() - start
