"""The parity modules' gloo pool."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def pool():
    """4 persistent gloo processes (test_parallel_primitives.GlooPool) shared by every module that runs tasks on
    them: starting the processes, importing the models in each and stopping them took 16 s on 2 cores, once per module
    and per xdist worker. The tasks leave the processes as they found them (groups are cached per layout, patches
    undone, dynamo reset after compiling)."""
    from test_parallel_primitives import GlooPool

    pool = GlooPool()
    yield pool
    pool.close()
