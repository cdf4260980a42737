"""Keep Python's cyclic garbage collector off the objects that compilation leaves behind.

`torch.compile` leaves millions of long-lived Python objects (FX graphs, guards, generated code, Triton kernel
handles). Every later full collection walks all of them, and a full collection can land in the middle of a
denoising step: on H200 a warm request spent ~5.5 s more in its denoising loop than ten steady-state steps
(docs/benchmarks.md, second session) for Pro and Lite alike, i.e. independent of the model's compute. After a
request that compiled something, `CompileGcFreezer` runs one collection and then `gc.freeze()`s every object
that survived it into the permanent generation, which collections skip. vLLM does the same after its start-up
compilation. New objects are collected as usual; nothing is leaked (frozen objects stay alive because they are
alive: they belong to the compiled graphs).
"""

from __future__ import annotations

import gc
import time


def compiled_graph_count() -> int:
    """How many graphs dynamo has compiled in this process so far (0 without torch.compile)."""
    try:
        from torch._dynamo.utils import counters
    except ImportError:  # pragma: no cover - torch without dynamo
        return 0
    return int(counters["stats"].get("unique_graphs", 0))


class CompileGcFreezer:
    """Freeze the surviving objects once after every request that compiled new graphs."""

    def __init__(self) -> None:
        self._graphs_frozen = -1  # nothing frozen yet: the first call always freezes (model load, warm-up)

    def after_request(self) -> float | None:
        """Collect and freeze if new graphs were compiled since the last freeze; returns the seconds it took."""
        graphs = compiled_graph_count()
        if graphs == self._graphs_frozen:
            return None
        start = time.perf_counter()
        gc.collect()
        gc.freeze()
        self._graphs_frozen = graphs
        return time.perf_counter() - start
