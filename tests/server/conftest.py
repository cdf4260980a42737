"""Fixtures for the HTTP server tests (helpers live in harness.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
from harness import start_server


@pytest.fixture
def fake_server(tmp_path):
    server = start_server(tmp_path)
    yield server
    server.worker.release.set()
    server.stop()


@pytest.fixture
def fake_client(fake_server):
    with fake_server.client() as client:
        yield client


@pytest.fixture(scope="session")
def server_distill_dir(request, tmp_path_factory) -> Path:
    """The shared tiny distilled checkpoint when tests/conftest.py provides it, else our own build."""
    try:
        return Path(request.getfixturevalue("tiny_distill_dir"))
    except pytest.FixtureLookupError:
        from k6serve.testing.tiny_checkpoints import build_generation_checkpoint

        return build_generation_checkpoint(tmp_path_factory.mktemp("server_tiny") / "distill", "distill")


@pytest.fixture(scope="session")
def server_vsr_dir(tmp_path_factory) -> Path:
    from k6serve.testing.tiny_sr_checkpoint import build_sr_checkpoint

    return build_sr_checkpoint(tmp_path_factory.mktemp("server_tiny_sr") / "Kandinsky-6.0-VSR-distilled2steps")
