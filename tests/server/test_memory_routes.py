"""The memory routes (sleep / wake) against a fake engine: replies, the queue held while released, bodies, errors."""

from __future__ import annotations

import json
import threading

import pytest
from harness import start_server, wait_for, wait_until
from test_lora_routes import LoraFakeWorker

from k6serve.runtime.memory import ReleaseMemory

JOB = {"prompt": "a fox", "size": "32x32", "num_frames": 5}


class MemoryFakeWorker(LoraFakeWorker):
    """The LoRA routes' fake worker plus `apply_memory_operation`; `log` holds request starts, ends and operations
    in order. With `refuse` set, every memory operation raises the refusal a sharded layout gives."""

    def __init__(self, refuse: bool = False) -> None:
        super().__init__()
        self.refuse = refuse
        self.released = False
        self.memory_operations: list = []

    def run(self, params, output, on_step=None):
        assert not self.released, "a job ran while the memory was released"
        return super().run(params, output, on_step)

    def apply_memory_operation(self, operation) -> list[dict]:
        if self.refuse:
            raise ValueError("release_memory_occupation cannot move weights sharded by --use-fsdp-inference: ... "
                             "Drop --use-fsdp-inference to release memory.")
        release = isinstance(operation, ReleaseMemory)
        changed = release != self.released
        self.released = release
        self.log.append(type(operation).__name__)
        self.memory_operations.append(operation)
        status = ("released" if release else "resumed") if changed else (
            "already_released" if release else "not_released")
        return [{"status": status, "message": status, "moved_bytes": 1024 if changed else 0,
                 "after": {"device": "cuda:0", "allocated_bytes": 0}}]


@pytest.fixture
def memory_server(tmp_path):
    server = start_server(tmp_path, worker=MemoryFakeWorker())
    yield server
    server.worker.release.set()
    server.stop()


def test_release_holds_the_queue_until_resume(memory_server):
    worker = memory_server.worker
    with memory_server.client() as client:
        held = client.post("/v1/videos", json={**JOB, "prompt": "hold on"}).json()
        wait_until(lambda: "start hold on" in worker.log)
        answers = {}

        def release() -> None:
            with memory_server.client() as other:
                answers["release"] = other.post("/release_memory_occupation")

        thread = threading.Thread(target=release)
        thread.start()
        wait_until(lambda: client.get("/health").json()["memory_released"])  # already holding the queue
        queued = client.post("/v1/videos", json=JOB).json()
        assert queued["status"] == "queued" and queued["waiting_for"] == "resume_memory_occupation"
        assert "release" not in answers  # waits for the running job
        worker.release.set()
        thread.join(30)
        reply = answers["release"]
        assert reply.status_code == 200, reply.text
        assert reply.json()["status"] == "ok" and reply.json()["memory_released"] is True
        assert reply.json()["moved_bytes"] == 1024 and reply.json()["ranks"][0]["after"]["device"] == "cuda:0"
        assert wait_for(client, held["id"])["status"] == "completed"
        assert client.get("/v1/list_loras").status_code == 200  # a read-only operation gets through
        again = client.post("/release_memory_occupation", json={}).json()
        assert again["status"] == "already_released" and again["moved_bytes"] == 0
        job = client.get(f"/v1/videos/{queued['id']}").json()
        assert job["status"] == "queued" and job["waiting_for"] == "resume_memory_occupation"
        resumed = client.post("/resume_memory_occupation")
        assert resumed.status_code == 200 and resumed.json()["status"] == "ok", resumed.text
        assert resumed.json()["memory_released"] is False
        finished = wait_for(client, queued["id"])
        assert finished["status"] == "completed" and finished["waiting_for"] is None
        assert client.get("/health").json() == {"status": "ok", "memory_released": False}
    assert worker.log == ["start hold on", "end hold on", "ReleaseMemory", "ListLoras", "ReleaseMemory",
                          "ResumeMemory", "start a fox", "end a fox"]


def test_a_refused_layout_is_a_400_in_the_error_format_and_nothing_is_held(tmp_path):
    server = start_server(tmp_path, worker=MemoryFakeWorker(refuse=True))
    try:
        with server.client() as client:
            response = client.post("/release_memory_occupation")
            assert response.status_code == 400, response.text
            error = response.json()["error"]
            assert error["code"] == "unsupported_layout" and error["type"] == "invalid_request_error"
            assert "Drop --use-fsdp-inference" in error["message"]
            assert client.get("/health").json()["memory_released"] is False
            job = client.post("/v1/videos", json=JOB).json()
            assert job["waiting_for"] is None and wait_for(client, job["id"])["status"] == "completed"
    finally:
        server.stop()


@pytest.mark.parametrize(("body", "status", "param"), [
    ({"tags": ["weights", "kv_cache"]}, 200, None),
    ({"tags": None}, 200, None),
    ({"tags": ["kv_cache"]}, 400, "tags"),
    ({"tags": ["everything"]}, 400, "tags"),
    ({"level": 1}, 400, "level"),
    ([], 400, None),
])
def test_the_optional_body_takes_the_reference_tags(memory_server, body, status, param):
    with memory_server.client() as client:
        response = client.post("/resume_memory_occupation", json=body)
        assert response.status_code == status, response.text
        if status == 200:
            assert response.json()["status"] == "not_released"  # not released: nothing to do, and it says so
        else:
            assert response.json()["error"]["param"] == param
        plain = client.post("/release_memory_occupation", content=b"x", headers={"Content-Type": "text/plain"})
        assert plain.status_code == 415 and "memory routes" in plain.json()["error"]["message"]


def test_the_schema_documents_the_routes(memory_server):
    with memory_server.client() as client:
        schema = client.get("/openapi.json").json()
    for route in ("/release_memory_occupation", "/resume_memory_occupation"):
        assert "MemoryReply" in str(schema["paths"][route]["post"]["responses"]["200"])
    properties = schema["components"]["schemas"]["MemoryOccupationBody"]["properties"]
    assert "tags" in properties and "keep_host_copy" in properties


def test_keep_host_copy_reaches_the_resume_and_is_refused_on_a_release(memory_server):
    """keep_host_copy decides what a resume does with the host copy; on a release it means nothing and is a 400."""
    with memory_server.client() as client:
        refused = client.post("/release_memory_occupation", json={"keep_host_copy": True})
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "keep_host_copy"
        assert "resume_memory_occupation" in refused.json()["error"]["message"]
        assert client.post("/release_memory_occupation", json={}).status_code == 200
        assert client.post("/resume_memory_occupation", json={"keep_host_copy": True}).status_code == 200
        assert client.post("/release_memory_occupation").status_code == 200
        assert client.post("/resume_memory_occupation").status_code == 200
    kinds = [(type(op).__name__, getattr(op, "keep_host_copy", None)) for op in memory_server.worker.memory_operations]
    assert kinds == [("ReleaseMemory", None), ("ResumeMemory", True), ("ReleaseMemory", None), ("ResumeMemory", False)]


@pytest.mark.parametrize("value", ["yes", 1, "true"])
def test_keep_host_copy_takes_only_a_json_boolean_as_the_video_route_does(memory_server, value):
    with memory_server.client() as client:
        refused = client.post("/resume_memory_occupation", json={"keep_host_copy": value})
        assert refused.status_code == 400, refused.text
        error = refused.json()["error"]
        assert error["param"] == "keep_host_copy" and error["code"] == "invalid_parameter"
        assert error["message"] == f"keep_host_copy must be a JSON boolean, true or false, got {json.dumps(value)}."
    assert memory_server.worker.memory_operations == []
