"""Job lifecycle against a fake worker: cancel, restart (graceful and SIGKILL), TTL, load, the seed script."""

from __future__ import annotations

import io
import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import PIL.Image
import pytest
from harness import FakeWorker, start_server, wait_for, wait_until

from k6serve.engine_arguments import build_engine_config
from k6serve.models.variants import VARIANTS
from k6serve.runtime.engine import Engine
from k6serve.serve.artifacts import ArtifactStore
from k6serve.serve.jobs import Job, JobStatus, SqliteJobStore
from k6serve.serve.expiry import sweep_expired_once
from k6serve.serve.job_outcomes import CANCEL_IN_DECODE, CANCELLED_AFTER_DECODE, CANCELLED_IN_DECODE

SMALL = {"size": "32x32", "num_frames": 5}
HERE = Path(__file__).resolve().parent
SEED = sorted(Path("/work/shared/seeds").glob("000_*.txt"))


def seed_download_script() -> str:
    """Section 5 of the seed document: the urllib polling and download example, exactly as written. Where the seed
    documents are not beside the checkout (the GPU host, a user's clone) the committed copy stands in for it;
    `test_the_committed_download_example_is_the_seeds` keeps the two the same."""
    if SEED:
        text = SEED[0].read_text()
        match = re.search(r"^import json\n.*?raise TimeoutError\([^\n]*\)\n", text, re.DOTALL | re.MULTILINE)
        assert match, "the seed's download example was not found"
        return match.group(0)
    return (HERE / "seed_download_example.py").read_text()


@pytest.mark.skipif(not SEED, reason="the seed documents are not on this machine")
def test_the_committed_download_example_is_the_seeds():
    assert seed_download_script() == (HERE / "seed_download_example.py").read_text()


def run_seed_script(base_url: str, video_id: str, cwd: Path) -> bytes:
    script = seed_download_script()
    assert 'base_url = "http://localhost:30000"' in script and 'video_id = "REPLACE_WITH_RETURNED_ID"' in script
    script = script.replace("http://localhost:30000", base_url).replace("REPLACE_WITH_RETURNED_ID", video_id)
    subprocess.run([sys.executable, "-c", script], cwd=cwd, check=True, timeout=120)
    return (cwd / "output.mp4").read_bytes()


def test_seed_polling_script_works_unchanged(fake_client, fake_server, tmp_path):
    job = fake_client.post("/v1/videos", json={"prompt": "seed example", **SMALL}).json()
    downloaded = run_seed_script(fake_server.base_url, job["id"], tmp_path)
    assert downloaded == fake_client.get(f"/v1/videos/{job['id']}/content").content
    assert downloaded[4:8] == b"ftyp"


def test_cancel_a_queued_job(fake_server, fake_client):
    running = fake_client.post("/v1/videos", json={"prompt": "hold", **SMALL}).json()
    wait_for(fake_client, running["id"], ("in_progress",))
    queued = fake_client.post("/v1/videos", json={"prompt": "never runs", **SMALL}).json()
    cancelled = fake_client.post(f"/v1/videos/{queued['id']}/cancel")
    assert cancelled.status_code == 200
    body = cancelled.json()
    assert body["status"] == "cancelled" and body["error"]["code"] == "cancelled" and body["completed_at"]
    fake_server.worker.release.set()
    assert wait_for(fake_client, running["id"])["status"] == "completed"
    assert "never runs" not in fake_server.worker.started
    assert fake_client.get(f"/v1/videos/{queued['id']}/content").status_code == 404
    assert fake_client.delete(f"/v1/videos/{queued['id']}").json()["deleted"] is True


def test_delete_of_an_unfinished_job_cancels_and_deletes_it(fake_server, fake_client):
    # OpenAI SDK code checks `client.videos.delete(id).deleted`; a DELETE used to cancel and leave the record (deleted
    # false) until a second DELETE. A queued job is gone at once, with its upload; a running one once it stops.
    running = fake_client.post("/v1/videos", json={"prompt": "hold", **SMALL}).json()
    wait_for(fake_client, running["id"], ("in_progress",))
    image = io.BytesIO()
    PIL.Image.new("RGB", (32, 32)).save(image, format="PNG")
    queued = fake_client.post("/v1/videos", data={"prompt": "never runs", "size": "32x32", "seconds": "0.2"},
                              files={"input_reference": ("first.png", image.getvalue(), "image/png")}).json()
    uploads = list(fake_server.artifacts.upload_dir.iterdir())
    assert uploads
    for job in (queued, running):
        answer = fake_client.delete(f"/v1/videos/{job['id']}")
        assert answer.status_code == 200
        assert answer.json() == {"id": job["id"], "object": "video.deleted", "deleted": True}
        assert fake_client.get(f"/v1/videos/{job['id']}").status_code == 404
        assert fake_client.delete(f"/v1/videos/{job['id']}").status_code == 404
    assert not any(path.exists() for path in uploads)
    assert "never runs" not in fake_server.worker.started
    assert not (fake_server.artifacts.root / f"{running['id']}.mp4").exists()
    # The engine was freed: the next job runs (no release needed).
    after = fake_client.post("/v1/videos", json={"prompt": "after", **SMALL}).json()
    assert wait_for(fake_client, after["id"])["status"] == "completed"


def test_deleting_a_cancelled_job_removes_a_video_its_interrupted_attempt_left(fake_server, fake_client):
    # A job re-queued after its worker wrote the MP4 (the process died before the job was recorded completed), then
    # cancelled before it ran again: its video stayed on disk for good, owned by no job.
    running = fake_client.post("/v1/videos", json={"prompt": "hold", **SMALL}).json()
    wait_for(fake_client, running["id"], ("in_progress",))
    queued = fake_client.post("/v1/videos", json={"prompt": "re-queued", **SMALL}).json()
    leftover = fake_server.artifacts.root / f"{queued['id']}.mp4"
    leftover.write_bytes(b"left by the interrupted attempt")
    assert fake_client.post(f"/v1/videos/{queued['id']}/cancel").json()["status"] == "cancelled"
    assert fake_client.delete(f"/v1/videos/{queued['id']}").json()["deleted"] is True
    assert not leftover.exists()


def test_cancel_a_running_job_frees_the_engine(fake_server, fake_client):
    running = fake_client.post("/v1/videos", json={"prompt": "hold forever", **SMALL}).json()
    job = wait_for(fake_client, running["id"], ("in_progress",))
    assert job["started_at"] is not None
    waiting = fake_client.post("/v1/videos", json={"prompt": "next in line", **SMALL}).json()
    response = fake_client.post(f"/v1/videos/{running['id']}/cancel")
    assert response.status_code == 200
    cancelled = response.json()
    assert cancelled["status"] == "cancelled" and cancelled["progress"] < 100  # acknowledged at a step boundary
    assert "step boundary" in cancelled["error"]["message"]
    assert wait_for(fake_client, waiting["id"])["status"] == "completed"  # held job never released
    assert not (fake_server.artifacts.root / f"{running['id']}.mp4").exists()


def test_a_cancel_during_the_decode_stops_at_the_next_chunk(tmp_path):
    # The decode used to have no boundary: a cancel after the last step waited for the whole decode and MP4 write
    # (seconds on a GPU, tens of seconds on a CPU). The engine now stops at the next decoded chunk.
    server = start_server(tmp_path, cancel_wait_s=5.0)
    try:
        with server.client() as client:
            job = client.post("/v1/videos", json={"prompt": "slow decode", **SMALL}).json()
            assert server.worker.decoding.wait(10)
            waiting = client.post("/v1/videos", json={"prompt": "next in line", **SMALL}).json()
            answer = client.post(f"/v1/videos/{job['id']}/cancel")
            assert answer.status_code == 200
            ended = answer.json()
            assert ended["status"] == "cancelled" and ended["url"] is None and ended["progress"] == 99
            assert ended["error"] == {"code": "cancelled", "message": CANCELLED_IN_DECODE}
            assert ended["warnings"] == [CANCEL_IN_DECODE]
            assert not server.worker.release.is_set()  # stopped by the cancel, not by the end of the decode
            assert not (server.artifacts.root / f"{job['id']}.mp4").exists()
            assert wait_for(client, waiting["id"])["status"] == "completed"
    finally:
        server.stop()


def test_a_cancel_in_the_mp4_tail_says_so_and_ends_cancelled(tmp_path):
    # After the last decoded chunk only the MP4's tail is left, which has no boundary: the job used to become
    # `completed` although DELETE had been accepted, and nothing told the client why it stayed in_progress.
    server = start_server(tmp_path, cancel_wait_s=0.2)
    try:
        with server.client() as client:
            job = client.post("/v1/videos", json={"prompt": "slow tail", **SMALL}).json()
            assert server.worker.decoding.wait(10)
            answer = client.delete(f"/v1/videos/{job['id']}")
            assert answer.status_code == 200
            assert answer.json()["status"] == "in_progress" and answer.json()["warnings"] == [CANCEL_IN_DECODE]
            assert answer.json()["deleted"] is False  # not stopped within the wait: the record stays
            polled = client.get(f"/v1/videos/{job['id']}").json()
            assert polled["status"] == "in_progress" and polled["error"] is None
            assert client.delete(f"/v1/videos/{job['id']}").json()["warnings"] == [CANCEL_IN_DECODE]  # once
            waiting = client.post("/v1/videos", json={"prompt": "next in line", **SMALL}).json()
            server.worker.release.set()
            ended = wait_for(client, job["id"])
            assert ended["status"] == "cancelled" and ended["url"] is None
            assert ended["error"] == {"code": "cancelled", "message": CANCELLED_AFTER_DECODE}
            assert not (server.artifacts.root / f"{job['id']}.mp4").exists()
            assert client.get(f"/v1/videos/{job['id']}/content").json()["error"]["code"] == "video_not_ready"
            assert wait_for(client, waiting["id"])["status"] == "completed"
    finally:
        server.stop()


def test_a_job_cancelled_in_its_mp4_tail_is_never_requeued(tmp_path):
    # A clean shutdown put the running job back in the queue even when its cancel had been accepted, so it was
    # completed by the MP4 write it was waiting for, or ran again after the restart.
    server = start_server(tmp_path, cancel_wait_s=0.0)
    with server.client() as client:
        job = client.post("/v1/videos", json={"prompt": "slow tail", **SMALL}).json()
        assert server.worker.decoding.wait(10)
        assert client.delete(f"/v1/videos/{job['id']}").json()["status"] == "in_progress"
    threading.Timer(0.3, server.worker.release.set).start()
    server.stop()  # waits for the MP4's tail, which cannot be interrupted
    store = SqliteJobStore(tmp_path / "jobs.sqlite3")
    stopped = store.get(job["id"])
    assert stopped.status == JobStatus.CANCELLED and stopped.error_message == CANCELLED_AFTER_DECODE
    assert not (server.artifacts.root / f"{job['id']}.mp4").exists()
    # The process exited before the MP4 was finished: the restart cancels the job instead of re-queueing it.
    store.insert(Job(id="video_cancelling", model="m", status=JobStatus.IN_PROGRESS, created_at=1.0, attempts=1,
                     params={"prompt": "p"}, cancel_requested_at=2.0))
    requeued, cancelled, died_twice = store.recover_interrupted()
    assert requeued == [] == died_twice and [(j.id, j.status, j.error_code) for j in cancelled] == \
        [("video_cancelling", JobStatus.CANCELLED, "cancelled")]
    store.close()


def test_a_shutdown_during_the_decode_requeues_the_job_at_the_next_chunk(tmp_path):
    server = start_server(tmp_path)
    with server.client() as client:
        job = client.post("/v1/videos", json={"prompt": "slow decode", **SMALL}).json()
        assert server.worker.decoding.wait(10)
    server.stop()  # no release: only the cancel at a decode chunk lets it return
    store = SqliteJobStore(tmp_path / "jobs.sqlite3")
    requeued = store.get(job["id"])
    assert requeued.status == JobStatus.QUEUED and requeued.attempts == 0
    assert not (server.artifacts.root / f"{job['id']}.mp4").exists()
    store.close()


def test_a_shutdown_during_the_mp4_tail_waits_for_it_and_keeps_the_video(tmp_path):
    server = start_server(tmp_path)
    with server.client() as client:
        job = client.post("/v1/videos", json={"prompt": "slow tail", **SMALL}).json()
        assert server.worker.decoding.wait(10)
    threading.Timer(0.3, server.worker.release.set).start()
    server.stop()
    store = SqliteJobStore(tmp_path / "jobs.sqlite3")
    assert store.get(job["id"]).status == JobStatus.COMPLETED
    assert (server.artifacts.root / f"{job['id']}.mp4").exists()
    store.close()


def _reopened_without(tmp_path, *columns: str, status: JobStatus = JobStatus.COMPLETED) -> SqliteJobStore:
    """A store holding one job ("video_old") written by a server from before `columns`, reopened by this one."""
    store = SqliteJobStore(tmp_path / "jobs.sqlite3")
    store.insert(_job("video_old", "old", status, attempts=0 if status == JobStatus.QUEUED else 1))
    for column in columns:
        store._db.execute(f"ALTER TABLE jobs DROP COLUMN {column}")
    store.close()
    return SqliteJobStore(tmp_path / "jobs.sqlite3")


def test_a_job_store_from_before_cancel_requests_opens(tmp_path):
    reopened = _reopened_without(tmp_path, "cancel_requested_at", status=JobStatus.QUEUED)
    assert reopened.get("video_old").cancel_requested_at is None
    assert reopened.update("video_old", cancel_requested_at=3.0).cancel_requested_at == 3.0
    reopened.close()


def test_a_job_store_from_before_expand_prompts_opens(tmp_path):
    # A server upgraded in place keeps its jobs: the column is added, old jobs read null.
    reopened = _reopened_without(tmp_path, "expanded_prompt", "cancel_requested_at")  # and from before that
    assert reopened.get("video_old").expanded_prompt is None
    assert reopened.update("video_old", expanded_prompt="a fox, in detail").expanded_prompt == "a fox, in detail"
    reopened.close()


def test_a_job_store_from_before_sample_aspect_ratio_opens(tmp_path):
    reopened = _reopened_without(tmp_path, "sample_aspect_ratio")
    assert reopened.get("video_old").sample_aspect_ratio is None
    assert reopened.update("video_old", sample_aspect_ratio="32:27").sample_aspect_ratio == "32:27"
    reopened.close()


def test_a_job_store_from_before_remixes_opens(tmp_path):
    reopened = _reopened_without(tmp_path, "remixed_from_video_id")
    assert reopened.get("video_old").remixed_from_video_id is None
    assert reopened.update("video_old", remixed_from_video_id="video_a").remixed_from_video_id == "video_a"
    reopened.close()


def test_a_job_store_from_before_stage_seconds_opens(tmp_path):
    # Old jobs read as having no stages ({}), and a job's stages survive the store's reopening in their order.
    reopened = _reopened_without(tmp_path, "stage_seconds")
    assert reopened.get("video_old").stage_seconds == {}
    stages = {"expand_prompt": 7.9, "encode": 0.05, "denoise": 58.4}
    assert list(reopened.update("video_old", stage_seconds=stages).stage_seconds.items()) == list(stages.items())
    reopened.close()
    again = SqliteJobStore(tmp_path / "jobs.sqlite3")
    assert list(again.get("video_old").stage_seconds) == list(stages)
    again.close()


def test_progress_advances_at_every_step(tmp_path):
    # 0.1 s a step (2 s in all), so polls slowed to a few hundred ms on a busy machine still see five steps.
    worker = FakeWorker(VARIANTS["pro-distill"], step_delay_s=0.1)
    server = start_server(tmp_path, worker=worker)
    try:
        with server.client() as client:
            job = client.post("/v1/videos", json={"prompt": "steps", **SMALL, "num_inference_steps": 20}).json()
            seen = set()
            while True:
                state = client.get(f"/v1/videos/{job['id']}").json()
                seen.add(state["progress"])
                if state["status"] == "completed":
                    break
                time.sleep(0.01)
            intermediate = {p for p in seen if 0 < p < 100}
            # 20 steps: multiples of 5; the last step shows 99 because 100 means the MP4 is written.
            assert len(intermediate) >= 5 and all(p % 5 == 0 or p == 99 for p in intermediate), intermediate
    finally:
        server.stop()


def _job(job_id: str, prompt: str, status: JobStatus, attempts: int) -> Job:
    return Job(id=job_id, model="m", status=status, created_at=time.time(), attempts=attempts,
               params={"prompt": prompt, "height": 32, "width": 32, "num_frames": 5})


def test_restart_keeps_every_job_and_requeues_running_ones_once(tmp_path):
    first = start_server(tmp_path)
    with first.client() as client:
        done = client.post("/v1/videos", json={"prompt": "before restart", **SMALL}).json()
        wait_for(client, done["id"])
        content = client.get(f"/v1/videos/{done['id']}/content").content
        held = client.post("/v1/videos", json={"prompt": "hold then restart", **SMALL}).json()
        wait_for(client, held["id"], ("in_progress",))
        behind = client.post("/v1/videos", json={"prompt": "queued behind", **SMALL}).json()
    first.stop()  # graceful: the running job goes back to the queue without using up an attempt
    store = SqliteJobStore(tmp_path / "jobs.sqlite3")
    assert store.get(held["id"]).status == JobStatus.QUEUED and store.get(held["id"]).attempts == 0
    # As if the server had died twice more: once during each of these jobs.
    store.insert(_job("video_died_once", "died once", JobStatus.IN_PROGRESS, attempts=1))
    store.insert(_job("video_died_twice", "died twice", JobStatus.IN_PROGRESS, attempts=2))
    store.insert(_job("video_queued", "queued at death", JobStatus.QUEUED, attempts=0))
    store.close()
    # The first death came after the worker had written its video: the re-run replaces that leftover, which the
    # worker alone would refuse to (it never replaces a file).
    (tmp_path / "outputs" / "video_died_once.mp4").write_bytes(b"left by the interrupted attempt")

    second = start_server(tmp_path)
    second.worker.release.set()
    try:
        with second.client() as client:
            listed = {j["id"]: j for j in client.get("/v1/videos", params={"limit": 100}).json()["data"]}
            assert set(listed) == {done["id"], held["id"], behind["id"], "video_died_once", "video_died_twice",
                                   "video_queued"}
            assert client.get(f"/v1/videos/{done['id']}/content").content == content
            failed = listed["video_died_twice"]
            assert failed["status"] == "failed" and failed["error"]["code"] == "server_restarted"
            assert "stopped twice" in failed["error"]["message"]
            for job_id in (held["id"], behind["id"], "video_died_once", "video_queued"):
                assert wait_for(client, job_id)["status"] == "completed", job_id
            rerun = client.get("/v1/videos/video_died_once/content")
            assert rerun.status_code == 200 and rerun.content[4:8] == b"ftyp"
            requeued = client.get("/v1/videos/video_died_once").json()
            assert any("re-queued" in w for w in requeued["warnings"])
            assert "died twice" not in second.worker.started
            # Queue order survives: older jobs first.
            assert second.worker.started.index("hold then restart") < second.worker.started.index("queued behind")
    finally:
        second.stop()


def test_a_request_id_survives_a_restart(tmp_path):
    body = {"prompt": "named before restart", **SMALL, "request_id": "client-7"}
    first = start_server(tmp_path)
    with first.client() as client:
        assert client.post("/v1/videos", json=body).json()["id"] == "client-7"
        content = client.get(f"/v1/videos/{wait_for(client, 'client-7')['id']}/content").content
        client.post("/v1/videos", json={**body, "request_id": "gone-8"})
        wait_for(client, "gone-8")
        assert client.delete("/v1/videos/gone-8").json()["deleted"] is True
    first.stop()
    second = start_server(tmp_path)
    try:
        with second.client() as client:
            assert client.get("/v1/videos/client-7").json()["status"] == "completed"
            assert client.get("/v1/videos/client-7/content").content == content
            replay = client.post("/v1/videos", json=body)
            assert replay.json()["id"] == "client-7" and replay.headers["Idempotent-Replayed"] == "true"
            conflict = client.post("/v1/videos", json={**body, "seed": 3})
            assert conflict.status_code == 409 and conflict.json()["error"]["param"] == "request_id"
            reused = client.post("/v1/videos", json={**body, "request_id": "gone-8"})
            assert reused.status_code == 409 and "deleted" in reused.json()["error"]["message"]
            assert second.worker.started == []
    finally:
        second.stop()


def test_a_second_server_on_the_same_job_store_refuses_to_start(tmp_path):
    # Say super-resolution started beside generation in the same folder (both on outputs/jobs.sqlite3): it
    # re-queued the first server's running job as if that server had died, and ran its queued job on the other
    # model, failing both.
    first = start_server(tmp_path)
    sr_worker = FakeWorker(VARIANTS["vsr-distilled2steps"])
    sr_engine = Engine(build_engine_config("kandinskylab/Kandinsky-6.0-VSR-distilled2steps-5s-Diffusers"),
                       worker=sr_worker)
    try:
        with first.client() as client:
            running = client.post("/v1/videos", json={"prompt": "hold", **SMALL}).json()["id"]
            wait_for(client, running, ("in_progress",))
            queued = client.post("/v1/videos", json={"prompt": "behind", **SMALL}).json()["id"]
            with pytest.raises(ValueError, match=r"job store '.*jobs.sqlite3' is in use by another k6serve server "
                                                 rf"\(process {os.getpid()}\); .* its own --output-path"):
                start_server(tmp_path, worker=sr_worker, engine=sr_engine)
            first.worker.release.set()
            assert wait_for(client, running)["status"] == "completed"
            assert wait_for(client, queued)["status"] == "completed"
            assert client.get(f"/v1/videos/{running}").json()["warnings"] == []
        assert sr_worker.started == []
    finally:
        first.stop()
        sr_engine.shutdown(timeout=30)
    SqliteJobStore(tmp_path / "jobs.sqlite3").close()  # free once the first server has stopped


def _spawn(root: Path, *extra: str, **popen: object) -> tuple[subprocess.Popen, str]:
    port_file = root / f"port-{time.monotonic_ns()}"
    process = subprocess.Popen([sys.executable, str(HERE / "fake_server_main.py"), str(root), str(port_file), *extra],
                               **popen)
    return process, _wait_for_port(process, port_file)


def _prepare(root: Path, *extra: str) -> tuple[subprocess.Popen, Path]:
    """A fake server process that does its imports (about 5 s) now and serves only once `_start` says so: the next
    server of a restart test gets ready while the one before it still runs, and opens the job store after its end."""
    port_file = root / f"port-{time.monotonic_ns()}"
    process = subprocess.Popen([sys.executable, str(HERE / "fake_server_main.py"), str(root), str(port_file), *extra,
                                "--start-on-stdin"], stdin=subprocess.PIPE)
    return process, port_file


def _start(process: subprocess.Popen, port_file: Path) -> tuple[subprocess.Popen, str]:
    process.stdin.write(b"start\n")
    process.stdin.close()
    return process, _wait_for_port(process, port_file)


def _wait_for_port(process: subprocess.Popen, port_file: Path) -> str:
    deadline = time.monotonic() + 60
    while not port_file.exists() or not port_file.read_text():
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            raise AssertionError("fake server process did not start")
        time.sleep(0.05)
    return port_file.read_text()


def _kill(process: subprocess.Popen) -> None:
    os.kill(process.pid, signal.SIGKILL)
    process.wait(10)


def test_sigkill_requeues_a_running_job_once_then_fails_it(tmp_path):
    # The three server processes import side by side (the restarts then take no import time).
    second, third = _prepare(tmp_path), _prepare(tmp_path, "--release-holds")
    processes = [second[0], third[0]]
    try:
        process, url = _spawn(tmp_path)
        processes.append(process)
        with httpx.Client(base_url=url, timeout=30) as client:
            quick = client.post("/v1/videos", json={"prompt": "quick", **SMALL}).json()
            wait_for(client, quick["id"])
            poison = client.post("/v1/videos", json={"prompt": "hold: the server dies on me", **SMALL}).json()
            wait_for(client, poison["id"], ("in_progress",))
            later = client.post("/v1/videos", json={"prompt": "later", **SMALL}).json()
        _kill(process)

        process, url = _start(*second)
        with httpx.Client(base_url=url, timeout=30) as client:
            again = wait_for(client, poison["id"], ("in_progress",))  # re-queued once and running again
            assert any("re-queued" in w for w in again["warnings"])
            assert client.get(f"/v1/videos/{later['id']}").json()["status"] == "queued"
        _kill(process)

        process, url = _start(*third)
        with httpx.Client(base_url=url, timeout=30) as client:
            failed = client.get(f"/v1/videos/{poison['id']}").json()
            assert failed["status"] == "failed" and failed["error"]["code"] == "server_restarted"
            assert wait_for(client, later["id"])["status"] == "completed"
            assert client.get(f"/v1/videos/{quick['id']}/content").status_code == 200
            assert list((tmp_path / "outputs").glob(".*.part")) == []
    finally:
        for process in processes:
            process.kill()
            process.wait(10)
            if process.stdin is not None:
                process.stdin.close()


def test_output_ttl_deletes_old_jobs_with_their_files(tmp_path):
    # A job reads as gone from its expires_at, int(completed_at) + ttl, maybe 1 s before the TTL; 5 s, so a slow
    # poll still sees the job completed before it expires (wait_for asserts a 200 on every poll).
    server = start_server(tmp_path, output_ttl_s=5, cleanup_interval_s=0.1)
    try:
        with server.client() as client:
            job = client.post("/v1/videos", json={"prompt": "short lived", **SMALL}).json()
            done = wait_for(client, job["id"])
            assert done["expires_at"] - done["completed_at"] == 5
            path = server.artifacts.root / f"{job['id']}.mp4"
            wait_until(lambda: client.get(f"/v1/videos/{job['id']}").status_code == 404, timeout=15)
            assert not path.exists()
    finally:
        server.stop()


def test_a_job_past_its_expires_at_reads_as_deleted_before_the_sweep(tmp_path):
    # The sweep ran once a minute, so an expired job stayed listed and downloadable for up to 60 s more.
    server = start_server(tmp_path, output_ttl_s=3600, cleanup_interval_s=3600)  # no sweep after the first one
    try:
        with server.client() as client:
            body = {"prompt": "expires", **SMALL}
            kept = wait_for(client, client.post("/v1/videos", json={"prompt": "first", **SMALL}).json()["id"])
            job = wait_for(client, client.post("/v1/videos", json=body, headers={"Idempotency-Key": "k"}).json()["id"])
            later = wait_for(client, client.post("/v1/videos", json={"prompt": "later", **SMALL}).json()["id"])
            path = server.artifacts.root / f"{job['id']}.mp4"
            assert path.exists() and client.get(f"/v1/videos/{job['id']}").status_code == 200
            # As if it had finished an hour ago: its expires_at is now.
            server.store.update(job["id"], completed_at=time.time() - 3600)
            expired = server.store.get(job["id"])
            assert expired is not None and int(expired.completed_at) + 3600 <= time.time()
            assert client.get(f"/v1/videos/{job['id']}").json()["error"]["code"] == "video_not_found"
            assert client.get(f"/v1/videos/{job['id']}/content").status_code == 404
            assert client.delete(f"/v1/videos/{job['id']}").status_code == 404
            assert not path.exists() and server.store.get(job["id"]) is None  # deleted, as the sweep does
            listed = [j["id"] for j in client.get("/v1/videos", params={"order": "asc"}).json()["data"]]
            assert listed == [kept["id"], later["id"]]
            # Its place in the paging order is kept, as for a swept job.
            after = client.get("/v1/videos", params={"order": "asc", "after": job["id"]}).json()["data"]
            assert [j["id"] for j in after] == [later["id"]]
            # Its Idempotency-Key is free again: the same request creates a new job.
            again = client.post("/v1/videos", json=body, headers={"Idempotency-Key": "k"})
            assert again.status_code == 200 and "Idempotent-Replayed" not in again.headers
            assert again.json()["id"] != job["id"]
    finally:
        server.stop()


def test_a_listing_during_a_sweep_skips_expired_jobs_and_pages_past_them(tmp_path):
    """Each listing ran its own full sweep: after a backlog of expired jobs eight listings filled the thread pool
    (/health took 14.7 s). One sweep runs at a time; a listing meanwhile leaves out what is past its expires_at and
    reads on past it to fill its page: a page of none with has_more true ended the OpenAI SDKs' auto-pagination, so
    a live job after expired ones was never listed."""
    server = start_server(tmp_path, output_ttl_s=3600, cleanup_interval_s=3600)
    try:
        with server.client() as client:
            ids = [wait_for(client, client.post("/v1/videos", json={"prompt": f"p{i}", **SMALL}).json()["id"])["id"]
                   for i in range(4)]
            for job_id in ids[1:3]:
                server.store.update(job_id, completed_at=time.time() - 3602)
            ctx = server.app.state.ctx
            with ctx.sweep_lock:  # the periodic sweep (or another listing) is at work
                page = client.get("/v1/videos", params={"order": "asc", "limit": 2}).json()
                assert [job["id"] for job in page["data"]] == [ids[0], ids[3]]
                assert (page["first_id"], page["last_id"], page["has_more"]) == (ids[0], ids[3], False)
                page = client.get("/v1/videos", params={"order": "asc", "limit": 1, "after": ids[0]}).json()
                assert [job["id"] for job in page["data"]] == [ids[3]]  # not an empty page with has_more
                assert (page["first_id"], page["last_id"], page["has_more"]) == (ids[1], ids[3], False)
                page = client.get("/v1/videos", params={"order": "asc", "limit": 1}).json()
                assert [job["id"] for job in page["data"]] == [ids[0]] and page["has_more"]
                assert server.store.get(ids[1]) is not None  # left to the sweep that holds the lock
            client.get("/v1/videos")  # no sweep running: this one sweeps
            assert server.store.get(ids[1]) is None and server.store.get(ids[2]) is None
            # The sweep's candidates come from an index, not a sort of every finished job.
            from k6serve.serve.jobs import FINISHED_BEFORE_SQL, TERMINAL

            plan = " ".join(row[-1] for row in server.store._db.execute(
                f"EXPLAIN QUERY PLAN {FINISHED_BEFORE_SQL}", [s.value for s in TERMINAL] + [time.time()]).fetchall())
            assert "jobs_completed" in plan, plan
            assert server.store.count_queued() == 0
    finally:
        server.stop()


@pytest.mark.parametrize("route", ["list", "get", "content"])
def test_each_route_sees_an_expired_job_as_gone(tmp_path, route):
    server = start_server(tmp_path, output_ttl_s=3600, cleanup_interval_s=3600)
    try:
        with server.client() as client:
            job = wait_for(client, client.post("/v1/videos", json={"prompt": "p", **SMALL}).json()["id"])
            server.store.update(job["id"], completed_at=time.time() - 3602)
            if route == "list":
                assert client.get("/v1/videos").json()["data"] == []
            else:
                suffix = "/content" if route == "content" else ""
                assert client.get(f"/v1/videos/{job['id']}{suffix}").status_code == 404
            assert server.store.get(job["id"]) is None
            assert not (server.artifacts.root / f"{job['id']}.mp4").exists()
    finally:
        server.stop()


def test_the_sweep_deletes_exactly_the_jobs_past_their_expires_at(tmp_path):
    store = SqliteJobStore(tmp_path / "jobs.sqlite3")
    artifacts = ArtifactStore(tmp_path / "out")
    store.insert(Job(id="video_a", model="m", status=JobStatus.COMPLETED, created_at=0, completed_at=100.7))
    store.insert(Job(id="video_b", model="m", status=JobStatus.COMPLETED, created_at=0, completed_at=101.2))
    # expires_at shows int(completed_at) + ttl: 600 for video_a, 601 for video_b.
    assert sweep_expired_once(store, artifacts, ttl_s=500, now=599.9) == 0
    assert sweep_expired_once(store, artifacts, ttl_s=500, now=600.0) == 1
    assert store.get("video_a") is None and store.get("video_b") is not None
    store.close()


def test_ttl_sweep_leaves_unfinished_jobs(tmp_path):
    store = SqliteJobStore(tmp_path / "jobs.sqlite3")
    artifacts = ArtifactStore(tmp_path / "out")
    (artifacts.root / "video_old.mp4").write_bytes(b"x")
    store.insert(Job(id="video_old", model="m", status=JobStatus.COMPLETED, created_at=0, completed_at=100,
                     output_file="video_old.mp4"))
    store.insert(Job(id="video_new", model="m", status=JobStatus.FAILED, created_at=0, completed_at=1000))
    store.insert(Job(id="video_waiting", model="m", status=JobStatus.QUEUED, created_at=0))
    assert sweep_expired_once(store, artifacts, ttl_s=500, now=1000) == 1
    assert store.get("video_old") is None and not (artifacts.root / "video_old.mp4").exists()
    assert store.get("video_new") is not None and store.get("video_waiting") is not None
    store.close()


def test_load_50_requests_from_10_clients_none_lost_or_duplicated(tmp_path):
    worker = FakeWorker(VARIANTS["pro-distill"], step_delay_s=0.002)
    server = start_server(tmp_path, worker=worker, max_queued_jobs=8)
    try:
        def client_run(client_index: int) -> list[tuple[int, str | None]]:
            outcomes = []
            with server.client() as client:
                for request_index in range(5):
                    prompt = f"load {client_index}-{request_index}"
                    response = client.post("/v1/videos", json={"prompt": prompt, **SMALL})
                    assert response.status_code in (200, 429), response.text
                    outcomes.append((response.status_code, response.json().get("id"), prompt))
            return outcomes

        with ThreadPoolExecutor(10) as pool:
            outcomes = [o for batch in pool.map(client_run, range(10)) for o in batch]
        assert len(outcomes) == 50
        accepted = {job_id: prompt for status, job_id, prompt in outcomes if status == 200}
        assert len(accepted) == sum(1 for o in outcomes if o[0] == 200) > 0  # unique ids
        with server.client() as client:
            for job_id in accepted:
                assert wait_for(client, job_id, timeout=60)["status"] == "completed"
            listed = client.get("/v1/videos", params={"limit": 100}).json()
            assert {j["id"] for j in listed["data"]} == set(accepted) and not listed["has_more"]
            metrics = client.get("/metrics").text
        assert sorted(worker.started) == sorted(accepted.values())  # each accepted job ran exactly once
        rejected = sum(1 for o in outcomes if o[0] == 429)
        assert rejected == 0 or f'k6serve_requests_rejected_total{{reason="queue_full"}} {rejected}' in metrics
    finally:
        server.stop()


def test_store_transitions_are_compare_and_set(tmp_path):
    store = SqliteJobStore(tmp_path / "jobs.sqlite3")
    store.insert(Job(id="video_a", model="m", created_at=1.0, idempotency_key="k", request_hash="h1"))
    assert store.transition("video_a", (JobStatus.IN_PROGRESS,), status=JobStatus.COMPLETED) is None
    started = store.transition("video_a", (JobStatus.QUEUED,), status=JobStatus.IN_PROGRESS, attempts=1)
    assert started.status == JobStatus.IN_PROGRESS and started.attempts == 1
    same, created = store.insert(Job(id="video_b", model="m", created_at=2.0, idempotency_key="k", request_hash="h1"))
    assert same.id == "video_a" and not created
    from k6serve.serve.jobs import IdempotencyConflict

    with pytest.raises(IdempotencyConflict):
        store.insert(Job(id="video_c", model="m", created_at=2.0, idempotency_key="k", request_hash="h2"))
    store.close()
    reopened = SqliteJobStore(tmp_path / "jobs.sqlite3")
    assert reopened.get("video_a") == started
    reopened.close()


def test_serve_cli_flags_become_settings(monkeypatch):
    from k6serve.cli.config_file import merged_options
    from k6serve.cli.flags import build_parser, split_options
    from k6serve.serve.settings import settings_from_options

    monkeypatch.delenv("K6SERVE_API_KEY", raising=False)
    parser = build_parser()
    args = parser.parse_args(["serve", "--model-path", "m", "--host", "0.0.0.0", "--port", "8080", "--output-path",
                              "out", "--job-store", "j.db", "--output-ttl", "60", "--max-queued-jobs", "3",
                              "--max-upload-mb", "2.5", "--allowed-input-dir", "a", "--allowed-input-dir", "b",
                              "--api-key", "k", "--served-model-name", "k6-pro"])
    engine, server = split_options(merged_options(args, parser))
    assert engine == {"model_path": "m"}
    settings = settings_from_options(server)
    assert (settings.host, settings.port, str(settings.output_path), str(settings.job_store_path)) == \
        ("0.0.0.0", 8080, "out", "j.db")
    assert (settings.output_ttl_s, settings.max_queued_jobs, settings.max_upload_bytes, settings.api_key) == \
        (60.0, 3, int(2.5 * 2**20), "k")
    assert [str(d) for d in settings.allowed_input_dirs] == ["a", "b"]
    assert settings.served_model_name == "k6-pro"
    defaults = settings_from_options(split_options(merged_options(parser.parse_args(["serve", "--model-path", "m"]),
                                                                  parser))[1])
    assert (defaults.port, defaults.api_key, str(defaults.job_store_path)) == (30000, None, "outputs/jobs.sqlite3")
    with pytest.raises(ValueError, match="max-queued-jobs"):
        settings_from_options({"max_queued_jobs": 0})
    assert defaults.served_model_name is None
    for bad in ("", " k6", "k6\n"):
        with pytest.raises(ValueError, match=r"--served-model-name must be a non-empty name without spaces around it "
                                             r"or control characters, got .*; e.g. --served-model-name k6-pro-distill"):
            settings_from_options({"served_model_name": bad})


def test_sigterm_stops_the_running_job_at_once_and_answers_a_waiting_lora_call_in_json(tmp_path):
    # Through `k6serve serve`'s own entry point and a real signal. uvicorn first waits up to its 10 s graceful timeout
    # for requests in flight (a LoRA call queued behind jobs is one) and only then let the runner stop: the running
    # job kept running, the exit took ~12 s, and the LoRA caller got a text/plain 500 when uvicorn cancelled it.
    process, url = _spawn(tmp_path, "--through-serve")
    try:
        with httpx.Client(base_url=url, timeout=30) as client:
            wait_until(lambda: client.get("/health").status_code == 200, timeout=30)
            running = client.post("/v1/videos", json={"prompt": "hold", **SMALL}).json()
            wait_for(client, running["id"], ("in_progress",))
            queued = client.post("/v1/videos", json={"prompt": "next", **SMALL}).json()
            with ThreadPoolExecutor(1) as pool:
                lora = pool.submit(client.post, "/v1/unmerge_lora_weights")
                # The LoRA call waits behind both jobs. 2 s for it to reach the server (nothing over HTTP tells when
                # it has; sent after the signal it would meet a closed socket).
                time.sleep(2.0)
                assert not lora.done()
                signalled = time.monotonic()
                process.send_signal(signal.SIGTERM)
                answer = lora.result(timeout=30)
                answered_s = time.monotonic() - signalled
            process.wait(30)
            exited_s = time.monotonic() - signalled
        assert answer.status_code == 503 and answer.headers["content-type"] == "application/json", answer.text
        error = answer.json()["error"]
        assert error["code"] == "shutting_down" and "The server is shutting down" in error["message"]
        # Not after uvicorn's graceful wait (60 s in the fake server's process).
        assert answered_s < 20 and exited_s < 30, (answered_s, exited_s)
        assert process.returncode == 0
        store = SqliteJobStore(tmp_path / "outputs" / "jobs.sqlite3")
        try:
            stopped = store.get(running["id"])  # stopped at a step and re-queued, not counted as an attempt
            assert (stopped.status, stopped.attempts) == (JobStatus.QUEUED, 0)
            assert store.get(queued["id"]).status == JobStatus.QUEUED
        finally:
            store.close()
    finally:
        process.kill()
        process.wait(10)


def _stop_a_served_job(tmp_path, prompt: str, *signals_sent: int):
    """A job running in a `k6serve serve` process, then `signals_sent` (each a second after the one before): the exit
    code, the seconds from the first signal to the exit, and the job as stored."""
    # SIGHUP as a terminal leaves it: under `nohup pytest` the server inherits it ignored, and keeps it so.
    inherited = signal.signal(signal.SIGHUP, signal.SIG_DFL)
    try:
        process, url = _spawn(tmp_path, "--through-serve")
    finally:
        signal.signal(signal.SIGHUP, inherited)
    try:
        with httpx.Client(base_url=url, timeout=30) as client:
            wait_until(lambda: client.get("/health").status_code == 200, timeout=30)
            job = client.post("/v1/videos", json={"prompt": prompt, **SMALL}).json()
            # A "slow tail" job is past its steps (progress 99) before its tail, which has no boundary.
            wait_for(client, job["id"], ("in_progress",))
            if "tail" in prompt:
                wait_until(lambda: client.get(f"/v1/videos/{job['id']}").json()["progress"] == 99, timeout=30)
            signalled = time.monotonic()
            for index, sent in enumerate(signals_sent):
                if index:
                    time.sleep(1.0)
                process.send_signal(sent)
            process.wait(60)
            exited_s = time.monotonic() - signalled
        store = SqliteJobStore(tmp_path / "outputs" / "jobs.sqlite3")
        try:
            return process.returncode, exited_s, store.get(job["id"])
        finally:
            store.close()
    finally:
        process.kill()
        process.wait(10)


def test_sighup_shuts_the_server_down_as_sigterm_does(tmp_path):
    # A closed terminal or SSH session sends SIGHUP, which uvicorn does not handle: the server died on the spot
    # (exit 129, no log line) with its running job left in_progress; two such exits during one job failed it.
    code, _, stopped = _stop_a_served_job(tmp_path, "hold", signal.SIGHUP)
    assert code == 0 and (stopped.status, stopped.attempts) == (JobStatus.QUEUED, 0)


def test_sighup_is_left_ignored_under_nohup(tmp_path):
    # `nohup k6serve serve ...` starts it with SIGHUP ignored so that it outlives the session: that stays so.
    process, url = _spawn(tmp_path, "--through-serve",
                          preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_IGN))
    try:
        with httpx.Client(base_url=url, timeout=30) as client:
            wait_until(lambda: client.get("/health").status_code == 200, timeout=30)
            process.send_signal(signal.SIGHUP)
            time.sleep(1.0)
            assert process.poll() is None and client.get("/health").status_code == 200
        process.send_signal(signal.SIGTERM)
        assert process.wait(30) == 0
    finally:
        process.kill()
        process.wait(10)


def test_a_second_sigterm_stops_a_server_whose_job_does_not_stop(tmp_path):
    # A hung rank (here a job in a tail with no boundary for 30 s) made the stop wait for it: 30 s in the runner's
    # stop, 30 s and 60 s more in the engine's shutdown. A second SIGTERM did nothing (uvicorn forces only on a
    # second SIGINT); now it stops the server at once, the job left in the queue.
    code, exited_s, stuck = _stop_a_served_job(tmp_path, "slow tail", signal.SIGTERM, signal.SIGTERM)
    assert code == 0 and exited_s < 20 and stuck.status == JobStatus.QUEUED, (code, exited_s, stuck)


def test_a_signal_stops_the_runner_at_once_not_after_the_graceful_wait():
    # uvicorn would first wait up to timeout_graceful_shutdown for requests in flight (a LoRA request queued behind
    # a running job is one), then stop the runner; the server stops it at the signal instead.
    import signal as signals
    import threading

    import uvicorn

    from k6serve.serve.server_process import uvicorn_server

    calls: list[str] = []
    called = threading.Event()

    def on_exit() -> None:
        calls.append(threading.current_thread().name)
        called.set()

    server = uvicorn_server(uvicorn.Config(lambda scope, receive, send: None), on_exit=on_exit)
    server.handle_exit(signals.SIGTERM, None)
    assert called.wait(5) and server.should_exit
    server.handle_exit(signals.SIGINT, None)  # a second signal forces the exit; the runner is not stopped twice
    assert server.force_exit and calls == ["k6serve-stop-at-signal"]


def test_a_second_server_on_the_same_output_folder_refuses_to_start_whatever_its_job_store(tmp_path, monkeypatch):
    """Two servers on one --output-path with their own --job-store: the second one's start-up sweep of partial files
    would delete the first one's MP4 being written. It is refused before its model loads."""
    from k6serve.serve import server_process
    from k6serve.serve.jobs import hold_exclusively

    def no_load(config):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(server_process, "Engine", no_load)
    bind = server_process.listening_socket
    monkeypatch.setattr(server_process, "listening_socket", lambda host, port: bind(host, 0))  # any free port
    outputs = tmp_path / "outputs"
    outputs.mkdir()
    first = hold_exclusively(outputs / server_process.SERVER_LOCK_NAME, "held {holder}")  # the running server's
    try:
        with pytest.raises(ValueError, match=rf"the output folder '.*outputs' is in use by another k6serve server "
                                             rf"\(process {os.getpid()}\); stop that one, or give this one its own "
                                             r"--output-path\.$"):
            server_process.serve({"model_path": "demo"}, {"output_path": str(outputs),
                                                      "job_store": str(tmp_path / "other.sqlite3")})
    finally:
        first.close()
    # Free again: the next server takes the folder (and gets as far as the model, which this test refuses).
    with pytest.raises(AssertionError, match="the model was loaded"):
        server_process.serve({"model_path": "demo"}, {"output_path": str(outputs),
                                                  "job_store": str(tmp_path / "other.sqlite3")})
    hold_exclusively(outputs / server_process.SERVER_LOCK_NAME, "still held {holder}").close()  # and it let go


@pytest.mark.parametrize(("flags", "message"), [
    # Each once started a server: with no key at all, serving the working folder, letting requests read any file
    # under it, or answering 500 on every finished job (math.ceil of nan / inf in expires_at) or upload.
    (["--api-key", ""], r"--api-key must not be empty; leave it unset"),
    (["--api-key", " key "], r"--api-key must not start or end with whitespace"),
    # Accepted, and then every request was a 401: no header carries a line end (a key file read whole).
    (["--api-key", "k1\nk2"], r"--api-key must be printable ASCII .*\(a line end from a file read whole\?\)"),
    (["--api-key", "ключ"], r"--api-key must be printable ASCII"),
    (["--output-path", ""], r"--output-path is empty; pass a path"),
    (["--job-store", " "], r"--job-store is empty; pass a path"),  # was "PosixPath('.') has an empty name"
    (["--allowed-input-dir", ""], r"--allowed-input-dir is empty; pass a folder"),
    (["--allowed-input-dir", "FILE"], r"--allowed-input-dir '.*afile' is a file, not a folder"),
    (["--allowed-lora-dir", ""], r"--allowed-lora-dir is empty; pass a folder \(e.g. --allowed-lora-dir ./loras\)"),
    (["--allowed-lora-dir", "FILE"], r"--allowed-lora-dir '.*afile' is a file, not a folder; pass the folder that "
                                     r"holds the adapters"),
    (["--output-ttl", "nan"], r"--output-ttl must be a finite number of seconds"),
    (["--output-ttl", "inf"], r"--output-ttl must be a finite number of seconds"),
    (["--max-upload-mb", "nan"], r"--max-upload-mb must be a finite number > 0"),
    (["--max-upload-mb", "inf"], r"--max-upload-mb must be a finite number > 0"),
    # Exit 1 with a bare "File exists", and exit 70 (an internal sqlite error), after binding the port.
    (["--output-path", "FILE"], r"--output-path '.*afile' is a file, not a folder; pass a folder"),
    (["--output-path", "FILE/sub"], r"--output-path '.*afile/sub' lies under '.*afile', which is a file"),
    (["--job-store", "DIR"], r"--job-store '.*' is a folder, not a file; pass the path of a SQLite file"),
    (["--job-store", "FILE/jobs.sqlite3"], r"--job-store '.*afile/jobs.sqlite3' lies under '.*afile', which is a "
                                           r"file"),
])
def test_bad_server_flags_exit_2_before_the_model_loads(tmp_path, monkeypatch, capsys, flags, message):
    from k6serve.cli.main import main
    from k6serve.serve import server_process

    monkeypatch.delenv("K6SERVE_API_KEY", raising=False)
    monkeypatch.setattr(server_process, "Engine", lambda config: pytest.fail("the model loaded"))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "afile").write_text("")
    flags = [flag.replace("FILE", str(tmp_path / "afile")).replace("DIR", str(tmp_path)) for flag in flags]
    assert main(["serve", "--model-path", "demo", "--device", "cpu", "--port", "1", *flags]) == 2
    err = capsys.readouterr().err
    assert re.search(rf"^error: {message}", err), err
    assert err.count("\n") == 1


def test_an_empty_api_key_variable_is_unset_but_an_empty_flag_is_refused(monkeypatch):
    from k6serve.serve.settings import settings_from_options

    monkeypatch.setenv("K6SERVE_API_KEY", "")
    assert settings_from_options({}).api_key is None
    monkeypatch.setenv("K6SERVE_API_KEY", "secret")
    assert settings_from_options({}).api_key == "secret"
    with pytest.raises(ValueError, match="--api-key must not be empty"):
        settings_from_options({"api_key": ""})  # not the variable's key in its place, nor none at all
    # A bad key from the variable is named as the variable, not as a flag the user never typed.
    monkeypatch.setenv("K6SERVE_API_KEY", " secret\n")
    with pytest.raises(ValueError, match=r"^\$K6SERVE_API_KEY \(the --api-key default\) must not start or end with "
                                         r"whitespace"):
        settings_from_options({})
    with pytest.raises(ValueError, match=r"^--api-key must be printable ASCII"):
        settings_from_options({"api_key": "k\n1"})  # the flag's own key keeps the flag's name


def test_the_latency_metric_stays_positive_when_the_wall_clock_steps_back(tmp_path, monkeypatch):
    """NTP stepping the clock back an hour made k6serve_job_latency_seconds_sum -3,600 (a counter reset to
    Prometheus): a job created in this process is timed on the monotonic clock."""
    server = start_server(tmp_path)
    try:
        with server.client() as client:
            job = client.post("/v1/videos", json={"prompt": "hold", **SMALL}).json()  # runs until released
            wait_until(lambda: client.get(f"/v1/videos/{job['id']}").json()["status"] == "in_progress")
            real = time.time
            monkeypatch.setattr(time, "time", lambda: real() - 3600)
            server.worker.release.set()
            wait_for(client, job["id"])
            monkeypatch.setattr(time, "time", real)
            body = client.get("/metrics").text
        total = float(re.search(r"^k6serve_job_latency_seconds_sum (\S+)$", body, re.MULTILINE)[1])
        assert 0 <= total < 60
    finally:
        server.stop()


def test_a_refused_body_is_drained_for_a_few_seconds_at_most(monkeypatch):
    """A client trickling a byte every half second held the refusal of a 2 MB body back for its whole length."""
    import asyncio

    from k6serve.serve import uploads

    class Trickle:
        def stream(self):
            async def chunks():
                while True:
                    await asyncio.sleep(0.05)
                    yield b"x"
            return chunks()

    monkeypatch.setattr(uploads, "DRAIN_TOTAL_S", 0.5)
    started = time.monotonic()
    asyncio.run(uploads.drain(Trickle()))
    assert time.monotonic() - started < 2.0


class _DiesAtTheShutdown(FakeWorker):
    """A worker whose ranks are killed (or hang and are killed) as the server stops: the running job ends with
    WorkerKilled, not with the cancel."""

    def run(self, params, output, on_step=None):
        from k6serve.runtime.engine import RequestCancelled
        from k6serve.runtime.out_of_memory import WorkerKilled

        try:
            return super().run(params, output, on_step)
        except RequestCancelled:
            raise WorkerKilled("request 1 failed: worker replica 0 (ranks [0]) died while running it") from None


def test_a_job_put_back_in_the_queue_at_the_shutdown_stays_queued_whatever_ends_it(tmp_path, caplog):
    # stop() put the running job back in the queue and logged so; the worker then died as the server stopped, and
    # the job was recorded failed (worker_died): it would not run again after the restart.
    server = start_server(tmp_path, worker=_DiesAtTheShutdown(VARIANTS["pro-distill"]))
    try:
        with server.client() as client:
            job = client.post("/v1/videos", json={"prompt": "hold", **SMALL}).json()
            wait_for(client, job["id"], ("in_progress",))
        # in_progress is recorded as the runner hands the job to the engine; until the worker has it, the stop
        # cancels the engine's future instead (CancelledError, also left in the queue), and the worker never dies.
        wait_until(lambda: server.worker.started == ["hold"])
        caplog.set_level("INFO", logger="k6serve.serve.runner")
        runner = server.app.state.ctx.runner
        runner.stop(timeout=10)
        runner.stop(timeout=10)  # the lifespan's end and uvicorn's exit both call it
        stored = server.store.get(job["id"])
        assert stored.status == JobStatus.QUEUED and stored.error_code is None, stored
        messages = [record.getMessage() for record in caplog.records]
        assert sum("was running at the shutdown" in message for message in messages) == 1
        assert any(f"job {job['id']} ended as the server stopped (WorkerKilled)" in message for message in messages)
    finally:
        server.stop()


def test_the_start_line_url_and_the_open_server_warning():
    from k6serve.serve.server_process import open_server_warning, server_url

    assert server_url("::", 30000) == "http://[::]:30000" and server_url("0.0.0.0", 8) == "http://0.0.0.0:8"
    assert server_url("fe80::1%eth0", 5) == "http://[fe80::1%eth0]:5"
    for host in ("127.0.0.1", "localhost", "::1"):
        assert open_server_warning(host, 30000, None) is None
    for host in ("0.0.0.0", "::", "10.0.0.5"):
        assert open_server_warning(host, 30000, "key") is None
        warning = open_server_warning(host, 30000, None)
        assert warning.startswith(f"serving on {host} without --api-key: any client that reaches port 30000 can use "
                                  "every route, set_lora with any path this server can read included (or limit "
                                  "it: --allowed-lora-dir); ")
        assert "$K6SERVE_API_KEY" in warning
        assert "set_lora" not in open_server_warning(host, 30000, None, lora_dirs=True)


def test_a_root_path_serves_behind_a_proxy_that_keeps_or_strips_the_prefix(tmp_path):
    # Behind a proxy at https://example.com/k6/ the job's url pointed at /v1/videos/... (the proxy's own root), and a
    # proxy that passes the prefix on got 404s.
    server = start_server(tmp_path, root_path="/k6", api_key="key")
    try:
        with server.client() as client:
            kept = client.post("/k6/v1/videos", json={"prompt": "through a proxy", **SMALL})
            assert kept.status_code == 200, kept.text
            stripped = client.post("/v1/videos", json={"prompt": "stripped", **SMALL})
            assert stripped.status_code == 200, stripped.text
            for job in (kept.json(), stripped.json()):
                done = wait_for(client, job["id"])
                assert done["url"] == f"/k6/v1/videos/{job['id']}/content"
                assert client.get(done["url"]).content[4:8] == b"ftyp"
            listed = client.get("/k6/v1/videos").json()["data"]
            assert {job["url"] for job in listed} == {f"/k6/v1/videos/{kept.json()['id']}/content",
                                                      f"/k6/v1/videos/{stripped.json()['id']}/content"}
            assert client.get("/k6/openapi.json").json()["servers"] == [{"url": "/k6"}]
            assert "/k6/openapi.json" in client.get("/k6/docs").text
        with httpx.Client(base_url=server.base_url) as anonymous:  # /health stays public under the prefix
            assert anonymous.get("/k6/health").status_code == 200
            assert anonymous.get("/k6/v1/videos").status_code == 401
            assert anonymous.get("/k6x/health").status_code == 401  # not under the prefix: no such route, keyed
    finally:
        server.stop()


@pytest.mark.parametrize(("given", "kept"), [("/k6", "/k6"), ("/k6/", "/k6"), ("k6", "/k6"), ("/a/b", "/a/b"),
                                             ("/", ""), ("", "")])
def test_root_path_values(given, kept):
    from k6serve.serve.settings import settings_from_options

    assert settings_from_options({"root_path": given}).root_path == kept


def test_root_paths_may_not_start_with_any_route_of_the_server(tmp_path):
    from k6serve.serve.settings import _ROUTE_SEGMENTS

    server = start_server(tmp_path)
    try:
        paths = server.app.openapi()["paths"]
    finally:
        server.stop()
    served = {path.split("/")[1] for path in paths} | {"docs", "redoc", "openapi.json"}
    assert served <= _ROUTE_SEGMENTS, served - _ROUTE_SEGMENTS
    assert {"release_memory_occupation", "v1", "health"} <= served


@pytest.mark.parametrize(("given", "message"), [
    ("/v1", "--root-path '/v1' starts with /v1, one of the server's own routes; choose another prefix, e.g. /k6"),
    ("/health/x", "--root-path '/health/x' starts with /health"),
    ("/release_memory_occupation", "starts with /release_memory_occupation, one of the server's own routes"),
    ("/a b", "--root-path must be a URL path prefix such as /k6"),
    ("/a?b", "--root-path must be a URL path prefix such as /k6"),
    ("/a//b", "--root-path must be a URL path prefix such as /k6"),
    ("/%41", "--root-path must be a URL path prefix such as /k6"),
])
def test_bad_root_paths_are_refused(given, message):
    from k6serve.serve.settings import settings_from_options

    with pytest.raises(ValueError, match=re.escape(message)):
        settings_from_options({"root_path": given})


def _gauge(text: str, name: str) -> float:
    (line,) = [line for line in text.splitlines() if line.startswith(name + " ")]
    return float(line.split()[1])


def test_a_silent_running_job_shows_in_health_and_metrics(tmp_path):
    # A hung rank keeps its process alive: /health said "ok" and nothing told how long the job had been silent.
    server = start_server(tmp_path)
    try:
        with server.client() as client:
            idle = client.get("/metrics").text
            assert _gauge(idle, "k6serve_seconds_since_progress") == 0
            assert 'k6serve_replicas{state="serving"} 1' in idle and 'k6serve_replicas{state="dead"} 0' in idle
            assert "seconds_since_progress" not in client.get("/health").json()
            stepping = client.post("/v1/videos", json={"prompt": "hold", **SMALL}).json()
            wait_for(client, stepping["id"], ("in_progress",))
            time.sleep(0.5)
            assert client.get("/health").json()["seconds_since_progress"] < 0.5  # a step every 10 ms
            server.worker.release.set()
            wait_for(client, stepping["id"])
            server.worker.release.clear()
            silent = client.post("/v1/videos", json={"prompt": "slow tail", **SMALL}).json()
            assert server.worker.decoding.wait(10)
            time.sleep(1.2)
            health = client.get("/health").json()
            assert health["status"] == "ok" and health["seconds_since_progress"] >= 1.0
            assert _gauge(client.get("/metrics").text, "k6serve_seconds_since_progress") >= 1.0
            server.worker.release.set()
            wait_for(client, silent["id"])
            assert _gauge(client.get("/metrics").text, "k6serve_seconds_since_progress") == 0
    finally:
        server.worker.release.set()
        server.stop()


def test_successful_probes_are_left_out_of_the_access_log(tmp_path):
    # A supervisor's probe every few seconds buried the job lines; --log-level warning, the only way to quiet it,
    # dropped the jobs' own lines too.
    from k6serve.serve.server_process import quiet_probe_access_lines

    server = start_server(tmp_path, root_path="/k6", api_key="key")
    access = logging.getLogger("uvicorn.access")
    lines: list[str] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda record: lines.append(record.getMessage())
    level = access.level
    access.setLevel(logging.INFO)
    access.addHandler(handler)
    quiet_probe_access_lines("/k6")
    try:
        with server.client() as client:
            for path in ("/health", "/k6/health", "/metrics", "/k6/metrics?x=1", "/v1/models"):
                assert client.get(path).status_code == 200
            client.head("/health")
        with httpx.Client(base_url=server.base_url) as anonymous:
            assert anonymous.get("/metrics").status_code == 401  # a failing probe stays in the log
        assert [line.split('"')[1] for line in lines] == ["GET /v1/models HTTP/1.1", "GET /metrics HTTP/1.1"], lines
    finally:
        access.removeHandler(handler)
        access.setLevel(level)
        access.filters.clear()
        server.stop()


def test_a_listing_reads_past_many_expired_jobs_in_few_queries(tmp_path, monkeypatch):
    # One query per expired row (9,981 for 19 live jobs ahead of 10,000 expired ones) held the event loop.
    server = start_server(tmp_path, output_ttl_s=3600, cleanup_interval_s=3600)
    try:
        old = time.time() - 7200
        for index in range(250):
            server.store.insert(_job(f"video_old{index:03d}", "old", JobStatus.COMPLETED, attempts=1))
            server.store.update(f"video_old{index:03d}", completed_at=old)
        live = _job("video_live", "live", JobStatus.COMPLETED, attempts=1)
        server.store.insert(live)
        server.store.update("video_live", completed_at=time.time())
        calls = []
        real = server.store.list_page
        monkeypatch.setattr(server.store, "list_page", lambda **kw: calls.append(kw) or real(**kw))
        with server.client() as client:
            with server.app.state.ctx.sweep_lock:  # the sweep is at work: the expired rows are still there
                page = client.get("/v1/videos", params={"order": "asc", "limit": 1}).json()
        assert [job["id"] for job in page["data"]] == ["video_live"] and page["has_more"] is False
        assert len(calls) <= 3
    finally:
        server.stop()


class _EndedByTheShutdown(FakeWorker):
    """A worker in a step too long for the cancel and the stop's waits: the ranks are ended under it, and the job
    ends with the engine's shutdown error, not with the cancel."""

    def __init__(self, variant) -> None:
        super().__init__(variant)
        self.ranks_ended = threading.Event()

    def run(self, params, output, on_step=None):
        self.started.append(params.prompt)
        self.ranks_ended.wait(30)
        raise RuntimeError("request 1 was stopped by the engine's shutdown while it ran.")


def test_a_job_whose_cancel_was_accepted_ends_cancelled_when_the_shutdown_ends_its_ranks(tmp_path, caplog):
    # The cancel was accepted in a long step, then SIGTERM's wait ran out and the ranks were ended: the job was
    # recorded failed (generation_failed, with a traceback and a video.failed event), not cancelled.
    worker = _EndedByTheShutdown(VARIANTS["pro-distill"])
    server = start_server(tmp_path, worker=worker, cancel_wait_s=0.0)
    try:
        with server.client() as client:
            job = client.post("/v1/videos", json={"prompt": "a long step", **SMALL}).json()
            wait_until(lambda: worker.started)
            assert client.post(f"/v1/videos/{job['id']}/cancel").json()["status"] == "in_progress"
        caplog.set_level("INFO", logger="k6serve.serve.runner")
        runner = server.app.state.ctx.runner
        runner.stop(timeout=0.1)
        worker.ranks_ended.set()
        runner.wait_for_outcomes(10)
        stored = server.store.get(job["id"])
        assert stored.status == JobStatus.CANCELLED and stored.error_code == "cancelled", stored
        assert "the server stopped before the engine did" in stored.error_message
        assert not any(record.levelno >= logging.ERROR for record in caplog.records)
    finally:
        server.stop()
