"""A full disk or an unwritable output folder: the requests refused say so (507), a DELETE frees space, jobs go on
once space is back, and a folder the server cannot write stops it at start."""

from __future__ import annotations

import errno
import os
import socket
import sqlite3
import tempfile
import time

import pytest
from harness import wait_for

from k6serve.serve import uploads

SMALL = {"size": "32x32", "num_frames": 5}


def _disk_full() -> sqlite3.OperationalError:
    error = sqlite3.OperationalError("database or disk is full")
    error.sqlite_errorcode = sqlite3.SQLITE_FULL  # as SQLite sets it
    return error


def _assert_insufficient_storage(response) -> None:
    assert response.status_code == 507, response.text
    error = response.json()["error"]
    assert error["code"] == "insufficient_storage" and error["type"] == "server_error"
    assert "disk is full" in error["message"] and "retry" in error["message"]


def test_a_job_store_that_cannot_grow_is_507_and_creation_works_again_after(fake_server, fake_client):
    database = fake_server.store._db
    pages = database.execute("PRAGMA page_count").fetchone()[0]
    database.execute(f"PRAGMA max_page_count = {pages}")  # SQLite's own "database or disk is full" from here on
    try:
        _assert_insufficient_storage(fake_client.post("/v1/videos", json={"prompt": "a long prompt " * 2000}))
    finally:
        database.execute("PRAGMA max_page_count = 1073741823")
    assert fake_client.get("/v1/videos").json()["data"] == []
    created = fake_client.post("/v1/videos", json={"prompt": "a long prompt " * 2000, **SMALL})
    assert created.status_code == 200, created.text


def test_an_upload_on_a_full_disk_is_507_and_leaves_no_file(fake_server, fake_client, monkeypatch):
    class FullDisk:
        def __init__(self, path, mode):
            self.file = open(path, mode)  # noqa: SIM115 - the file a full disk leaves: created, nothing written

        def write(self, data):
            raise OSError(errno.ENOSPC, "No space left on device")

        def close(self):
            self.file.close()

        def __enter__(self):
            return self

        def __exit__(self, *exc_info):
            self.close()

    monkeypatch.setattr(uploads, "open", FullDisk, raising=False)
    for size in (1000, uploads.SPOOL_BYTES + 1000):  # written when complete, and spilled while it arrives
        response = fake_client.post("/v1/videos", data={"prompt": "p"},
                                    files={"input_reference": ("a.png", b"\x89PNG" + b"\0" * size, "image/png")})
        _assert_insufficient_storage(response)  # it was a 500 "Internal server error: OSError"
        assert list(fake_server.artifacts.upload_dir.iterdir()) == []
    monkeypatch.undo()
    assert fake_client.post("/v1/videos", json={"prompt": "after", **SMALL}).status_code == 200


def test_a_delete_on_a_full_disk_frees_the_video_first(fake_server, fake_client, monkeypatch):
    fake_server.worker.release.set()
    job = wait_for(fake_client, fake_client.post("/v1/videos", json={"prompt": "kept", **SMALL}).json()["id"])
    video = fake_server.artifacts.output_path(f"{job['id']}.mp4")
    assert video.is_file()
    delete = type(fake_server.store).delete

    def full(store, job_id, now=None):
        raise _disk_full()

    monkeypatch.setattr(type(fake_server.store), "delete", full)
    _assert_insufficient_storage(fake_client.delete(f"/v1/videos/{job['id']}"))
    assert not video.exists()  # the space a client can free; the record could not be written
    assert fake_client.get(f"/v1/videos/{job['id']}/content").json()["error"]["code"] == "content_missing"
    monkeypatch.setattr(type(fake_server.store), "delete", delete)
    assert fake_client.delete(f"/v1/videos/{job['id']}").json()["deleted"] is True


def test_a_full_disk_neither_fails_the_running_job_nor_stops_the_queue(fake_server, fake_client, monkeypatch):
    running = fake_client.post("/v1/videos", json={"prompt": "hold", **SMALL}).json()["id"]
    wait_for(fake_client, running, ("in_progress",))
    queued = fake_client.post("/v1/videos", json={"prompt": "behind", **SMALL}).json()["id"]
    transition = type(fake_server.store).transition
    full = True

    def maybe_full(store, *args, **kwargs):
        if full:
            raise _disk_full()
        return transition(store, *args, **kwargs)

    monkeypatch.setattr(type(fake_server.store), "transition", maybe_full)
    fake_server.worker.release.set()  # it finishes while its progress and its outcome cannot be written
    time.sleep(1.5)
    assert fake_client.get(f"/v1/videos/{running}").json()["status"] == "in_progress"
    full = False
    # The progress write's error failed the job, and the dispatcher thread died on the next start: every later job
    # stayed queued (and this one in_progress) until a restart, while /health said ok.
    assert wait_for(fake_client, running)["status"] == "completed"
    assert wait_for(fake_client, queued)["status"] == "completed"
    later = fake_client.post("/v1/videos", json={"prompt": "later", **SMALL}).json()["id"]
    assert wait_for(fake_client, later)["status"] == "completed"


def test_an_output_folder_the_server_cannot_write_stops_it_before_the_model_loads(tmp_path, monkeypatch):
    # It started, answered every upload with a 500, and failed every job at its MP4 write, after the whole run.
    from k6serve.serve import server_process

    def read_only(**kwargs):
        raise OSError(errno.EROFS, "Read-only file system")

    def load_model(config):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(tempfile, "TemporaryFile", read_only)
    monkeypatch.setattr(server_process, "Engine", load_model)
    with pytest.raises(ValueError, match=r"cannot write to '.*outputs' \(Read-only file system\); pass a writable "
                                         r"folder with --output-path"):
        server_process.serve({"model_path": "fake-k6-model"},
                         {"output_path": str(tmp_path / "outputs"), "host": "127.0.0.1", "port": _free_port()})


def test_an_output_folder_the_server_cannot_create_stops_it_with_the_same_refusal(tmp_path):
    # Its creation raised a raw OSError (exit 1, "File exists: '.../uploads'"), where a folder that exists but cannot
    # be written gets the documented "cannot write to ..." (exit 2).
    from k6serve.serve.artifacts import ArtifactStore

    (tmp_path / "outputs").mkdir()
    (tmp_path / "outputs" / "uploads").write_bytes(b"a file where the upload folder goes")
    with pytest.raises(ValueError, match=r"cannot write to '.*outputs/uploads' \(File exists\); pass a writable "
                                         r"folder with --output-path"):
        ArtifactStore(tmp_path / "outputs")
    (tmp_path / "file").write_bytes(b"")
    with pytest.raises(ValueError, match=r"cannot write to '.*file/outputs' \(Not a directory\)"):
        ArtifactStore(tmp_path / "file" / "outputs")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_uploads_no_job_owns_are_deleted_at_start(tmp_path):
    """An upload is moved into the upload folder before its job is stored: a server killed between the two left
    the file (up to --max-upload-mb), and neither a restart nor the TTL sweep ever deleted it."""
    from harness import FakeWorker

    from k6serve.engine_arguments import build_engine_config
    from k6serve.models.variants import VARIANTS
    from k6serve.runtime.engine import Engine
    from k6serve.serve.artifacts import ArtifactStore
    from k6serve.serve.jobs import Job, JobStatus, SqliteJobStore
    from k6serve.serve.metrics import ServerMetrics
    from k6serve.serve.runner import JobRunner

    store = SqliteJobStore(tmp_path / "jobs.sqlite3")
    artifacts = ArtifactStore(tmp_path / "outputs")
    owned = artifacts.upload_path("video_owned", "input_reference", "photo.png")
    orphan = artifacts.upload_path("video_orphan", "input_reference", "photo.png")
    partial = artifacts.upload_dir / ".video_part_input_reference.png.part"
    for path in (owned, orphan, partial):
        path.write_bytes(b"\x89PNG")
    store.insert(Job(id="video_owned", model="k6", status=JobStatus.COMPLETED, created_at=time.time(),
                     completed_at=time.time(), upload_files=(str(owned),)))
    engine = Engine(build_engine_config("fake-k6-model"), worker=FakeWorker(VARIANTS["pro-distill"]))
    runner = JobRunner(engine, store, artifacts, ServerMetrics(), max_queued_jobs=4)
    try:
        runner.start()
        assert sorted(path.name for path in artifacts.upload_dir.iterdir()) == [owned.name]
    finally:
        runner.stop()
        engine.shutdown(timeout=10)
        store.close()


@pytest.mark.skipif(os.name != "posix", reason="file modes are POSIX")
def test_a_new_job_store_is_readable_by_its_owner_only_and_an_old_one_keeps_its_mode(tmp_path):
    # It holds every prompt and the webhook URLs with their tokens; sqlite made it 0644, and its -wal and -shm take
    # the database file's mode.
    from k6serve.serve.jobs import SqliteJobStore

    store = SqliteJobStore(tmp_path / "jobs.sqlite3")
    store.set_lora_state([])  # a write: the WAL exists now
    modes = {path.name: path.stat().st_mode & 0o777 for path in tmp_path.glob("jobs.sqlite3*")}
    store.close()
    assert modes["jobs.sqlite3"] == 0o600 and modes.get("jobs.sqlite3-wal", 0o600) == 0o600, modes
    old = tmp_path / "old" / "jobs.sqlite3"
    old.parent.mkdir()
    SqliteJobStore(old).close()
    old.chmod(0o640)  # the operator's choice for a store made before
    SqliteJobStore(old).close()
    assert old.stat().st_mode & 0o777 == 0o640
