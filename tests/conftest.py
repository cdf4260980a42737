"""Shared fixtures: tiny random-weight checkpoints in the real Diffusers layout, built once.

Builders are imported inside the fixtures, so tests that do not use them skip importing diffusers.
"""

from pathlib import Path

import pytest

# ---- Kandinsky 6 generation (T2AV / TI2AV) ----


@pytest.fixture(scope="session")
def tiny_pro_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Pro-style checkpoint: FlowMatch Euler scheduler, video + audio, seed 0."""
    from k6serve.testing.tiny_checkpoints import build_generation_checkpoint

    return build_generation_checkpoint(tmp_path_factory.mktemp("tiny_pro"), "pro", seed=0)


@pytest.fixture(scope="session")
def tiny_distill_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Pro-distill-style checkpoint: PiFlow scheduler, 10x heads, with audio, seed 0."""
    from k6serve.testing.tiny_checkpoints import build_generation_checkpoint

    return build_generation_checkpoint(tmp_path_factory.mktemp("tiny_distill"), "distill", seed=0)


@pytest.fixture(scope="session")
def _demo_cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from k6serve.testing.tiny_checkpoints import ensure_demo_checkpoint

    cache_dir = tmp_path_factory.mktemp("k6serve_cache")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("K6SERVE_CACHE", str(cache_dir))
        ensure_demo_checkpoint()
    return cache_dir


@pytest.fixture
def demo_dir(_demo_cache_dir: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The demo checkpoint; K6SERVE_CACHE points at this session's cache while the test runs."""
    from k6serve.testing.tiny_checkpoints import ensure_demo_checkpoint

    monkeypatch.setenv("K6SERVE_CACHE", str(_demo_cache_dir))
    return ensure_demo_checkpoint()


# ---- Kandinsky 6 super-resolution ----
# (SR fixtures go here.)
