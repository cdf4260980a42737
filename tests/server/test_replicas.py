"""An engine with several replicas (`--dp-size`): the server runs as many jobs at once, one per replica.

Fake workers with two replicas: "hold" jobs stay running until released, so the test sees two in progress and the
third queued, a cancel of one running job while the other runs on, and the queued job taking the freed replica.
"""

from __future__ import annotations

from harness import FakeWorker, start_server, wait_for, wait_until

from k6serve.models.variants import VARIANTS


class TwoReplicaWorker(FakeWorker):
    num_replicas = 2  # what a ProcessGroupWorker with --dp-size 2 reports; the engine runs one thread per replica


def test_two_replicas_run_two_jobs_at_once_and_a_cancel_frees_one(tmp_path):
    worker = TwoReplicaWorker(VARIANTS["pro-distill"])
    server = start_server(tmp_path, worker=worker)
    try:
        with server.client() as client:
            ids = [client.post("/v1/videos", json={"prompt": f"hold {index}"}).json()["id"] for index in range(3)]
            wait_until(lambda: len(worker.started) == 2)
            statuses = [client.get(f"/v1/videos/{video_id}").json()["status"] for video_id in ids]
            assert statuses == ["in_progress", "in_progress", "queued"]
            assert "k6serve_running_jobs 2" in client.get("/metrics").text
            assert client.post(f"/v1/videos/{ids[0]}/cancel").status_code == 200
            assert wait_for(client, ids[0])["status"] == "cancelled"
            wait_until(lambda: len(worker.started) == 3)  # the freed replica takes the queued job
            assert client.get(f"/v1/videos/{ids[1]}").json()["status"] == "in_progress"
            worker.release.set()
            assert [wait_for(client, video_id)["status"] for video_id in ids[1:]] == ["completed", "completed"]
            # The two replicas' threads take jobs 0 and 1 at once and may note them in either order.
            assert sorted(worker.started[:2]) == ["hold 0", "hold 1"] and worker.started[2:] == ["hold 2"]
    finally:
        worker.release.set()
        server.stop()


def test_a_shutdown_requeues_every_running_job_and_a_restart_runs_them(tmp_path):
    from k6serve.serve.jobs import JobStatus, SqliteJobStore

    worker = TwoReplicaWorker(VARIANTS["pro-distill"])
    server = start_server(tmp_path, worker=worker)
    with server.client() as client:
        ids = [client.post("/v1/videos", json={"prompt": f"hold {index}"}).json()["id"] for index in range(2)]
        wait_until(lambda: len(worker.started) == 2)
    server.stop()  # no release: the held jobs return only through the cancel at their next step
    store = SqliteJobStore(tmp_path / "jobs.sqlite3")
    assert [(store.get(video_id).status, store.get(video_id).attempts) for video_id in ids] == \
        [(JobStatus.QUEUED, 0), (JobStatus.QUEUED, 0)]
    store.close()
    again = TwoReplicaWorker(VARIANTS["pro-distill"])
    again.release.set()
    restarted = start_server(tmp_path, worker=again)
    try:
        with restarted.client() as client:
            assert [wait_for(client, video_id)["status"] for video_id in ids] == ["completed", "completed"]
    finally:
        restarted.stop()
