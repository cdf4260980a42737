"""An output folder made unwritable (read-only, permissions changed, a read-only remount) after the server started:
creating a job and writing its MP4 say so (`output_not_writable`, naming the folder by its flag, not its path),
instead of a 500 or a job failed with the server's file paths, and the server goes on serving.

Root ignores permissions, and the CI runs as root on some machines: the write is made to fail as a read-only folder
makes it fail, with the errno it raises; one test chmods the folder for real where the user is not root."""

from __future__ import annotations

import errno
import os
import sqlite3
import tempfile
from pathlib import Path

import harness
import pytest
from harness import wait_for

from k6serve.serve import uploads

SMALL = {"size": "32x32", "num_frames": 5}


def _read_only(*args, **kwargs):
    raise OSError(errno.EROFS, "Read-only file system")


def _assert_output_not_writable(response, server, flag: str = "--output-path") -> None:
    assert response.status_code == 507, response.text
    error = response.json()["error"]
    assert error["code"] == "output_not_writable" and error["type"] == "server_error", error
    message = error["message"]
    assert "cannot write to its" in message and flag in message and "writable again" in message, message
    assert str(server.artifacts.root) not in message and "/" not in message.replace("--output-path", ""), message


def test_job_creation_while_the_output_folder_is_read_only_is_507_and_works_again_after(fake_server, fake_client,
                                                                                        monkeypatch):
    # Before: a JSON job was accepted, ran to its end and failed at its MP4; an upload was a 500 "Internal server
    # error: PermissionError".
    fake_server.worker.release.set()
    earlier = fake_client.post("/v1/videos", json={"prompt": "earlier", "request_id": "mine-1", **SMALL})
    assert earlier.status_code == 200
    monkeypatch.setattr(tempfile, "TemporaryFile", _read_only)  # the folder's probe meets a read-only folder
    _assert_output_not_writable(fake_client.post("/v1/videos", json={"prompt": "p", **SMALL}), fake_server)
    upload = ("a.png", b"\x89PNG" + b"\0" * 1000, "image/png")
    _assert_output_not_writable(fake_client.post("/v1/videos", data={"prompt": "p"},
                                                 files={"input_reference": upload}), fake_server)
    # A retry of a job already created writes nothing: it still gets its job.
    replay = fake_client.post("/v1/videos", json={"prompt": "earlier", "request_id": "mine-1", **SMALL})
    assert replay.status_code == 200 and replay.headers["Idempotent-Replayed"] == "true"
    assert fake_client.get("/health").json()["status"] == "ok"
    assert [job["id"] for job in fake_client.get("/v1/videos").json()["data"]] == ["mine-1"]
    assert list(fake_server.artifacts.upload_dir.iterdir()) == []
    metrics = fake_client.get("/metrics").text
    assert 'k6serve_requests_rejected_total{reason="output_not_writable"} 2' in metrics
    monkeypatch.undo()
    created = fake_client.post("/v1/videos", json={"prompt": "after", **SMALL}).json()
    assert wait_for(fake_client, created["id"])["status"] == "completed"


def test_an_upload_refused_by_the_folder_is_507_and_leaves_no_file(fake_server, fake_client, monkeypatch):
    # The folder took the probe but refuses the upload's own file (a race with the chmod, or a permission on uploads/
    # alone): the write's own error says so.
    real_open = open

    def refused(path, mode="r", *args, **kwargs):
        if "w" in mode:
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return real_open(path, mode, *args, **kwargs)

    monkeypatch.setattr(uploads, "open", refused, raising=False)
    for size in (1000, uploads.SPOOL_BYTES + 1000):  # written when complete, and spilled while it arrives
        response = fake_client.post("/v1/videos", data={"prompt": "p"},
                                    files={"input_reference": ("a.png", b"\x89PNG" + b"\0" * size, "image/png")})
        _assert_output_not_writable(response, fake_server)  # it was a 500 "Internal server error: PermissionError"
        assert list(fake_server.artifacts.upload_dir.iterdir()) == []
    monkeypatch.undo()
    assert fake_client.post("/v1/videos", json={"prompt": "after", **SMALL}).status_code == 200


def test_a_job_store_made_read_only_is_507_naming_the_job_store(fake_server, fake_client, monkeypatch):
    def read_only_database(store, job):
        error = sqlite3.OperationalError("attempt to write a readonly database")
        error.sqlite_errorcode = sqlite3.SQLITE_READONLY  # as SQLite sets it
        raise error

    monkeypatch.setattr(type(fake_server.store), "insert", read_only_database)
    response = fake_client.post("/v1/videos", json={"prompt": "p", **SMALL})
    _assert_output_not_writable(response, fake_server, flag="--job-store")  # it was a 500 "OperationalError"


def test_a_job_whose_video_cannot_be_written_fails_with_output_not_writable(fake_server, fake_client, monkeypatch):
    refused_errno = {"value": errno.EACCES}

    def write_refused(path, *args, **kwargs):
        # What `write_mp4` raises in a folder made read-only: on its hidden partial file, beside the video.
        partial = Path(path).parent / f".{Path(path).name}.part"
        raise OSError(refused_errno["value"], os.strerror(refused_errno["value"]), str(partial))

    monkeypatch.setattr(harness, "write_mp4", write_refused)
    fake_server.worker.release.set()
    # ENOENT: the folder removed while the job ran (the MP4 writer's FileNotFoundError; it was a ValueError, failed
    # as the client's invalid_request with the server's path).
    for refused_errno["value"] in (errno.EACCES, errno.EROFS, errno.ENOENT):
        job = wait_for(fake_client, fake_client.post("/v1/videos", json={"prompt": "p", **SMALL}).json()["id"])
        assert job["status"] == "failed" and job["error"]["code"] == "output_not_writable", job
        message = job["error"]["message"]
        assert "--output-path" in message and "writable again" in message and "submit the job again" in message
        assert str(fake_server.artifacts.root) not in message  # it was "PermissionError: [Errno 13] ... '/srv/...'"
    monkeypatch.undo()
    job = wait_for(fake_client, fake_client.post("/v1/videos", json={"prompt": "after", **SMALL}).json()["id"])
    assert job["status"] == "completed"


def test_a_refused_read_elsewhere_is_no_unwritable_output(fake_server, fake_client, monkeypatch):
    # An input the worker may not read is the request's, not the output folder's.
    def unreadable_input(*args, **kwargs):
        raise PermissionError(errno.EACCES, "Permission denied", "/srv/inputs/first.png")

    monkeypatch.setattr(harness, "write_mp4", unreadable_input)
    fake_server.worker.release.set()
    job = wait_for(fake_client, fake_client.post("/v1/videos", json={"prompt": "p", **SMALL}).json()["id"])
    assert job["status"] == "failed" and job["error"]["code"] == "generation_failed"


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into a read-only folder all the same")
def test_a_folder_chmod_read_only_is_507_for_real(fake_server, fake_client):
    root = fake_server.artifacts.root
    root.chmod(0o555)
    try:
        _assert_output_not_writable(fake_client.post("/v1/videos", json={"prompt": "p", **SMALL}), fake_server)
    finally:
        root.chmod(0o755)
    assert fake_client.post("/v1/videos", json={"prompt": "after", **SMALL}).status_code == 200


def test_a_queued_job_fails_before_it_runs_once_the_folder_is_read_only(fake_server, fake_client, monkeypatch):
    # Before: it ran to its end on the GPU (minutes) and only then failed at its MP4.
    running = fake_client.post("/v1/videos", json={"prompt": "hold", **SMALL}).json()
    queued = fake_client.post("/v1/videos", json={"prompt": "queued", **SMALL}).json()
    assert queued["status"] == "queued"
    monkeypatch.setattr(tempfile, "TemporaryFile", _read_only)  # made read-only while the first one runs
    fake_server.worker.release.set()
    failed = wait_for(fake_client, queued["id"])
    assert failed["status"] == "failed" and failed["error"]["code"] == "output_not_writable", failed
    assert "writable again" in failed["error"]["message"]
    assert "queued" not in fake_server.worker.started  # the worker never ran it
    assert wait_for(fake_client, running["id"])["status"] == "completed"  # its MP4 went in before the change
    monkeypatch.undo()
    later = fake_client.post("/v1/videos", json={"prompt": "later", **SMALL}).json()
    assert wait_for(fake_client, later["id"])["status"] == "completed"
