"""LoRA adapters set through the HTTP routes survive a restart: jobs queued before it were created under them.

A fake worker records the operations it is given; a second server on the same job store must replay the shortest
list that rebuilds the adapters (the adapters loaded but not active, loaded again and deactivated; the last set_lora
with every path written out and the merges after it) before any job runs, and refuse to start when they cannot be
rebuilt.
"""

from __future__ import annotations

import pytest
from harness import FakeWorker, start_server

from k6serve.engine_arguments import build_engine_config
from k6serve.lora.spec import ListLoras, LoraSpec, MergeLora, SetLora, UnmergeLora
from k6serve.models.variants import VARIANTS
from k6serve.runtime.engine import Engine
from k6serve.serve.artifacts import ArtifactStore
from k6serve.serve.jobs import SqliteJobStore
from k6serve.serve.metrics import ServerMetrics
from k6serve.serve.runner import JobRunner


class RecordingWorker(FakeWorker):
    def __init__(self, *, refuse: bool = False) -> None:
        super().__init__(VARIANTS["pro-distill"])
        self.operations: list[object] = []
        self.refuse = refuse

    def apply_lora_operation(self, operation) -> dict:
        if self.refuse and not isinstance(operation, ListLoras):
            raise ValueError("LoRA path '/adapters/a.safetensors' is not a local file or folder")
        self.operations.append(operation)
        return {"status": "ok", "message": "done", "loras": []}


def _post(server, route: str, body: dict) -> None:
    with server.client() as client:
        response = client.post(route, json=body)
    assert response.status_code == 200, response.text


def test_the_adapters_are_rebuilt_after_a_restart(tmp_path):
    db = tmp_path / "jobs.sqlite3"
    first = start_server(tmp_path / "one", worker=RecordingWorker(), db_path=db)
    try:
        _post(first, "/v1/set_lora", {"lora_nickname": "old", "lora_path": "/adapters/old.safetensors"})
        _post(first, "/v1/set_lora", {"lora_nickname": "a", "lora_path": "/adapters/a.safetensors", "strength": 0.5})
        # "a" by nickname only: the restarted worker has no cache, so the state writes its path out.
        _post(first, "/v1/set_lora", {"lora_nickname": ["a", "b"], "lora_path": [None, "/adapters/b.safetensors"],
                                      "merge_mode": "dynamic"})
        # Merges in a row replay as one, at the last strength given (a merge without one keeps it): 300 merges
        # were 300 replayed merges, each rewriting every adapted weight.
        for strength in (0.3, 0.6, 0.8):
            _post(first, "/v1/merge_lora_weights", {"strength": strength})
        _post(first, "/v1/merge_lora_weights", {})
        with first.client() as client:
            assert client.get("/v1/list_loras").status_code == 200  # reading changes nothing
    finally:
        first.stop()
    second = start_server(tmp_path / "two", worker=RecordingWorker(), db_path=db)
    try:
        assert second.worker.operations == [
            # "old" is loaded, not active: a job queued before the restart may name it in its own loras
            SetLora(specs=(LoraSpec(nickname="old", path="/adapters/old.safetensors"),), merge_mode="dynamic"),
            UnmergeLora(),
            SetLora(specs=(LoraSpec(nickname="a", path="/adapters/a.safetensors"),
                           LoraSpec(nickname="b", path="/adapters/b.safetensors")), merge_mode="dynamic"),
            MergeLora(strength=0.8),
        ]
        _post(second, "/v1/unmerge_lora_weights", {})
    finally:
        second.stop()
    third = start_server(tmp_path / "three", worker=RecordingWorker(), db_path=db)
    try:
        # unmerged: the base weights, with every adapter loaded again (one at a time, so that one whose file is
        # gone drops only itself) and none active
        assert third.worker.operations == [
            *(SetLora(specs=(LoraSpec(nickname=name, path=f"/adapters/{name}.safetensors"),), merge_mode="dynamic")
              for name in ("old", "a", "b")),
            UnmergeLora(),
        ]
    finally:
        third.stop()


def test_a_relative_adapter_path_is_rebuilt_from_another_working_folder(tmp_path, monkeypatch):
    """set_lora with a path relative to the server's working folder: the state keeps it absolute, so a server
    restarted from another folder rebuilds the same file (it kept the path as typed, and the start failed). A hub
    id is kept as typed."""
    (tmp_path / "adapters").mkdir()
    (tmp_path / "adapters" / "style.safetensors").write_bytes(b"")
    db = tmp_path / "jobs.sqlite3"
    monkeypatch.chdir(tmp_path)
    first = start_server(tmp_path / "one", worker=RecordingWorker(), db_path=db)
    try:
        _post(first, "/v1/set_lora", {"lora_nickname": ["style", "hub"],
                                      "lora_path": ["adapters/style.safetensors", "someone/some-lora"]})
    finally:
        first.stop()
    monkeypatch.chdir(tmp_path / "one")
    second = start_server(tmp_path / "two", worker=RecordingWorker(), db_path=db)
    try:
        (replayed,) = second.worker.operations
        assert [spec.path for spec in replayed.specs] == [str(tmp_path / "adapters" / "style.safetensors"),
                                                          "someone/some-lora"]
    finally:
        second.stop()


def test_a_state_that_cannot_be_rebuilt_stops_the_start_and_says_how_to_go_on(tmp_path):
    store = SqliteJobStore(tmp_path / "jobs.sqlite3")
    store.set_lora_state([{"type": "SetLora", "merge_mode": "auto", "target": "all",
                           "specs": [{"nickname": "a", "path": "/adapters/a.safetensors", "strength": 1.0,
                                      "alpha": None}]}])
    engine = Engine(build_engine_config("fake-k6-model"), worker=RecordingWorker(refuse=True))
    runner = JobRunner(engine, store, ArtifactStore(tmp_path / "outputs"), ServerMetrics(), max_queued_jobs=4)
    try:
        with pytest.raises(RuntimeError, match=r"could not be restored \(ValueError: LoRA path .*Jobs queued then "
                                               r"were created with them.*another --job-store"):
            runner.start()
    finally:
        engine.shutdown(timeout=10)
        store.close()


class MissingFileWorker(RecordingWorker):
    """Refuses any SetLora naming `gone` (its file deleted since it was set)."""

    def apply_lora_operation(self, operation) -> dict:
        if any(spec.nickname == "gone" for spec in getattr(operation, "specs", ())):
            raise ValueError("LoRA path '/adapters/gone.safetensors' is not a local file or folder")
        return super().apply_lora_operation(operation)


def test_an_inactive_adapter_whose_file_is_gone_is_dropped_not_fatal(tmp_path, caplog):
    """Every adapter ever loaded is loaded again at a restart; one set long ago whose file was deleted since
    stopped the start-up (the fix offered: a new job store, losing every job). It is dropped with a warning; the
    active adapters are rebuilt, and the next restart no longer tries it."""
    db = tmp_path / "jobs.sqlite3"
    first = start_server(tmp_path / "one", worker=RecordingWorker(), db_path=db)
    try:
        _post(first, "/v1/set_lora", {"lora_nickname": "gone", "lora_path": "/adapters/gone.safetensors"})
        _post(first, "/v1/set_lora", {"lora_nickname": "kept", "lora_path": "/adapters/kept.safetensors"})
        _post(first, "/v1/set_lora", {"lora_nickname": "a", "lora_path": "/adapters/a.safetensors"})
    finally:
        first.stop()
    with caplog.at_level("WARNING", logger="k6serve.serve.runner"):
        second = start_server(tmp_path / "two", worker=MissingFileWorker(), db_path=db)
    try:
        assert second.worker.operations == [
            SetLora(specs=(LoraSpec(nickname="kept", path="/adapters/kept.safetensors"),), merge_mode="dynamic"),
            UnmergeLora(),
            SetLora(specs=(LoraSpec(nickname="a", path="/adapters/a.safetensors"),)),
        ]
        assert "could not be loaded again, and are dropped" in caplog.text and "gone" in caplog.text
    finally:
        second.stop()
    third = start_server(tmp_path / "three", worker=RecordingWorker(), db_path=db)
    try:
        assert [spec.nickname for spec in third.worker.operations[0].specs] == ["kept"]
    finally:
        third.stop()
