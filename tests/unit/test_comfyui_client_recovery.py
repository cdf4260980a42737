"""The ComfyUI nodes' client through restarts, lost answers, late cancels and oversized uploads, against the fake
engine (tests/server/harness.py) and `k6serve serve`'s real loading responder. The nodes are loaded, with stub
ComfyUI modules, by test_comfyui_nodes.py."""

from __future__ import annotations

import http.client
import socket
import sys
import threading
import time
import urllib.error
from pathlib import Path

import pytest
import uvicorn

import test_comfyui_nodes as nodes_tests
from k6serve.engine_arguments import build_engine_config
from k6serve.models.variants import VARIANTS
from k6serve.runtime.engine import Engine
from k6serve.serve.app import build_app
from k6serve.serve.artifacts import ArtifactStore
from k6serve.serve.jobs import SqliteJobStore
from k6serve.serve.loading import LoadingResponder
from k6serve.serve.server_process import uvicorn_config
from k6serve.serve.settings import ServerSettings

harness = nodes_tests.harness
client_module = sys.modules["k6serve_nodes.client"]
K6ServeClient, K6ServeError = client_module.K6ServeClient, client_module.K6ServeError
Generate, Upscale, TINY = nodes_tests.Generate, nodes_tests.Upscale, nodes_tests.TINY
Interrupt = nodes_tests.InterruptProcessingException


@pytest.fixture
def comfy(monkeypatch, tmp_path) -> nodes_tests.ComfyStub:
    stub = nodes_tests.ComfyStub(tmp_path / "comfy_output")
    stub.install(monkeypatch)
    return stub


@pytest.fixture
def fast_retries(monkeypatch):
    """Retries every 10 ms instead of every 1-2 s."""
    real_sleep = time.sleep
    monkeypatch.setattr(client_module.time, "sleep", lambda seconds: real_sleep(min(seconds, 0.01)))


def _unreachable_error(client) -> Exception:
    error = client._connection_error(urllib.error.URLError(ConnectionRefusedError()))
    error.__cause__ = urllib.error.URLError(ConnectionRefusedError())
    return error


LOADING = K6ServeError("K6Serve Generate: GET ... answered HTTP 503, model_loading: loading", status=503,
                       code="model_loading")


# ---- a restart under a running node ----

def _serve(sock: socket.socket, root: Path, worker) -> harness.RunningServer:
    """harness.start_server on a given socket (a restart keeps its port) and job store (root/jobs.sqlite3)."""
    engine = Engine(build_engine_config("fake-k6-model"), worker=worker)
    artifacts = ArtifactStore(root / "outputs")
    (root / "inputs").mkdir(parents=True, exist_ok=True)
    settings = ServerSettings(output_path=root / "outputs", job_store=root / "jobs.sqlite3", cancel_wait_s=10.0,
                              allowed_input_dirs=(root / "inputs", artifacts.upload_dir))
    store = SqliteJobStore(settings.job_store_path)
    app = build_app(engine=engine, store=store, artifacts=artifacts, settings=settings)
    server = uvicorn.Server(uvicorn_config(app, log_level="warning", lifespan="on", timeout_graceful_shutdown=5))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    harness.wait_until(lambda: server.started, timeout=30)
    return harness.RunningServer(base_url=f"http://127.0.0.1:{sock.getsockname()[1]}", app=app, engine=engine,
                                 store=store, artifacts=artifacts, settings=settings, server=server, thread=thread,
                                 worker=worker)


def _bound_socket(port: int = 0) -> socket.socket:
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", port))
    return sock


def test_a_restart_mid_job_is_waited_out_and_the_requeued_job_completes(comfy, tmp_path, monkeypatch, caplog):
    """Before: the restarted server's 503 model_loading failed the node at once, and its cancel then deleted the job
    the server had re-queued. Now the node waits for the load and gets the re-run job's video."""
    caplog.set_level("INFO")
    monkeypatch.setattr(client_module, "LOADING_POLL_S", 0.1)
    first_worker = harness.FakeWorker(VARIANTS["pro-distill"])
    first = _serve(_bound_socket(), tmp_path, first_worker)
    port = int(first.base_url.rsplit(":", 1)[1])
    outcome = {}

    def run_node():
        try:
            outcome["path"] = Generate().generate(first.base_url, **{**TINY, "prompt": "hold"})["result"][2]
        except BaseException as error:  # noqa: BLE001 - reported by the assertion below
            outcome["error"] = error

    node = threading.Thread(target=run_node)
    node.start()
    harness.wait_until(lambda: first_worker.started and comfy.progress, timeout=30)
    first.stop()  # a clean shutdown re-queues the running job
    sock = _bound_socket(port)
    sock.listen()
    responder = LoadingResponder(sock)  # `k6serve serve` binds its port, then loads the model
    responder.start()
    harness.wait_until(lambda: responder.num_answered >= 2, timeout=30)
    responder.stop()
    second_worker = harness.FakeWorker(VARIANTS["pro-distill"])
    second_worker.release.set()
    second = _serve(sock, tmp_path, second_worker)
    try:
        node.join(60)
        assert "error" not in outcome, outcome.get("error")
        assert Path(outcome["path"]).is_file() and second_worker.started == ["hold"]
        with second.client() as client:
            jobs = client.get("/v1/videos").json()["data"]
        assert [job["status"] for job in jobs] == ["completed"]
        assert outcome["path"].endswith(f"_{jobs[0]['id']}.mp4") and jobs[0]["id"].startswith("comfyui-")
        assert "is loading its model" in caplog.text and "cancel" not in caplog.text
    finally:
        second.stop()


def test_polling_waits_for_a_loading_server_and_still_hears_cancel_and_timeout(monkeypatch, fast_retries):
    client = K6ServeClient("http://127.0.0.1:9", node_name="K6Serve Generate")
    answers = ["unreachable"] * 3 + [LOADING] * 50 + [{"id": "video_1", "status": "completed", "progress": 100}]
    polls = []

    def get_job(job_id):
        polls.append(job_id)
        answer = answers[min(len(polls), len(answers)) - 1]
        if answer == "unreachable":
            raise _unreachable_error(client)
        if isinstance(answer, Exception):
            raise answer
        return answer

    cancels = []
    monkeypatch.setattr(client, "get_job", get_job)
    monkeypatch.setattr(client, "cancel_job", lambda job_id: cancels.append(job_id) or {"status": "cancelled"})
    monkeypatch.setattr(client_module, "POLL_OUTAGE_S", 0.2)  # far shorter than the 50 loading answers
    job = {"id": "video_1", "status": "in_progress", "progress": 5}
    assert client.wait(dict(job))["status"] == "completed" and len(polls) == len(answers) and cancels == []

    answers[:] = [LOADING]  # loading for ever: Cancel and timeout_s still end the wait, and cancel the job
    polls.clear()
    with pytest.raises(Interrupt):
        client.wait(dict(job), check_interrupt=nodes_tests._interrupt_after(5))
    assert len(polls) >= 5
    with pytest.raises(K6ServeError, match=r"did not finish within timeout_s=0.2 s"):
        client.wait(dict(job), timeout_s=0.2)
    monkeypatch.setattr(client_module, "LOADING_WAIT_S", 0.2)  # timeout_s 0: the load is waited for this long
    with pytest.raises(K6ServeError, match=r"was still loading its model 0.2 s after it restarted under job video_1"):
        client.wait(dict(job))


def test_a_poll_that_outlives_timeout_s_and_meets_a_loading_server_is_worded_as_the_timeout(monkeypatch):
    # The poll returns "loading" only after timeout_s ran out, and the request watch does not trip first (its
    # interval is set past the call): the failure must name timeout_s, not the 30-minute loading limit that applies
    # only without one (it did, on a slow machine).
    client = K6ServeClient("http://127.0.0.1:9", node_name="K6Serve Generate")

    def get_job(job_id):
        time.sleep(0.1)  # real seconds: no fast_retries here, which shortens every sleep
        raise LOADING

    monkeypatch.setattr(client, "get_job", get_job)
    monkeypatch.setattr(client, "cancel_job", lambda job_id: {"status": "cancelled"})
    monkeypatch.setattr(client_module, "WATCH_S", 60.0)
    job = {"id": "video_1", "status": "in_progress", "progress": 5}
    with pytest.raises(K6ServeError, match=r"did not finish within timeout_s=0.05 s") as caught:
        client.wait(dict(job), timeout_s=0.05)
    assert "still loading" not in str(caught.value)


def test_a_download_waits_for_a_loading_server(tmp_path, monkeypatch, fast_retries):
    client = K6ServeClient("http://127.0.0.1:9", node_name="K6Serve Generate")
    attempts = []

    def download_once(job_id, partial):
        attempts.append(job_id)
        if len(attempts) < 20:
            raise LOADING
        partial.write_bytes(b"mp4")

    monkeypatch.setattr(client, "_download_once", download_once)
    monkeypatch.setattr(client_module, "POLL_OUTAGE_S", 0.0)
    target = tmp_path / "clip.mp4"
    assert client.download_content("video_1", target).read_bytes() == b"mp4" and len(attempts) == 20
    attempts.clear()
    with pytest.raises(Interrupt):
        client.download_content("video_1", target, check_interrupt=nodes_tests._interrupt_after(3))
    attempts.clear()
    deadline = client_module.Deadline.after(0.1)
    with pytest.raises(K6ServeError, match=r"The video of job video_1 is finished and stays on the server"):
        client.download_content("video_1", target, deadline=deadline)


def test_timeout_s_is_one_clock_for_the_wait_for_a_loading_server_and_the_job(fake_server, comfy, monkeypatch):
    """Before: a server loading for most of timeout_s, then a job that would not end, took timeout_s twice."""
    monkeypatch.setattr(client_module, "LOADING_POLL_S", 0.05)
    real_json = K6ServeClient._json
    loading_until = time.monotonic() + 2.0

    def json_while_loading(self, method, route, **kwargs):
        if route == "/v1/models" and time.monotonic() < loading_until:
            raise LOADING
        return real_json(self, method, route, **kwargs)

    monkeypatch.setattr(K6ServeClient, "_json", json_while_loading)
    started = time.monotonic()
    with pytest.raises(K6ServeError, match="did not finish within timeout_s=3 s"):
        Generate().generate(fake_server.base_url, **{**TINY, "prompt": "hold"}, api_key="secret-key", timeout_s=3)
    assert time.monotonic() - started < 4.3  # one clock: 3 s (and the cancel); two were 5 s and more
    assert nodes_tests._newest_job(fake_server)["status"] == "cancelled"


fake_server = nodes_tests.fake_server  # the same fixture: a fake engine behind the API key


# ---- a cancel that waited out a restart ----

FINISHED = K6ServeError("K6Serve Generate: POST ... answered HTTP 409, video_finished: already ended", status=409,
                        code="video_finished")


def _late_cancel(monkeypatch, cancel_answer: Exception, job_after_restart: dict | Exception):
    """A node interrupted while the server is unreachable; once it answers, the cancel meets `cancel_answer` and a
    GET `job_after_restart`. Returns the cancel attempts and the GETs."""
    client = K6ServeClient("http://127.0.0.1:9", node_name="K6Serve Generate")
    cancels, gets = [], []

    def cancel_job(job_id):
        cancels.append(job_id)
        raise _unreachable_error(client) if len(cancels) < 3 else cancel_answer

    def get_job(job_id):
        gets.append(job_id)
        if isinstance(job_after_restart, Exception):
            raise job_after_restart
        return job_after_restart

    monkeypatch.setattr(client, "cancel_job", cancel_job)
    monkeypatch.setattr(client, "get_job", get_job)
    monkeypatch.setattr(client_module, "CANCEL_RETRY_S", 0.01)
    with pytest.raises(Interrupt):
        client.wait({"id": "video_1", "status": "in_progress", "progress": 5},
                    check_interrupt=nodes_tests._interrupt_after(0))
    client.cancel_retry.join(timeout=10)
    return cancels, gets


@pytest.mark.parametrize("status", ["completed", "failed", "cancelled"])
def test_a_late_cancel_leaves_a_job_that_ended_meanwhile_alone(monkeypatch, caplog, status):
    """Before: the retried DELETE went out blindly, and on a job that had completed meanwhile (re-run after a
    restart) it deleted the job and its MP4; the log said "cancelled". Then a GET went first, and a job ending
    between it and the DELETE was still deleted. Now the cancel route answers 409, and the GET after it words the
    log only."""
    caplog.set_level("INFO")
    cancels, gets = _late_cancel(monkeypatch, FINISHED, {"id": "video_1", "status": status})
    assert cancels == ["video_1"] * 3 and gets == ["video_1"]
    assert f"job video_1 had already ended on the server ({status}) once it answered again, so it was not " \
           "cancelled" in caplog.text
    assert "cancelled job" not in caplog.text
    assert ("GET http://127.0.0.1:9/v1/videos/video_1/content" in caplog.text) == (status == "completed")


def test_a_late_cancel_says_the_job_ended_even_when_the_get_after_it_fails(monkeypatch, caplog):
    caplog.set_level("INFO")
    get_lost = _unreachable_error(K6ServeClient("http://127.0.0.1:9", node_name="K6Serve Generate"))
    _late_cancel(monkeypatch, FINISHED, get_lost)
    assert "job video_1 had already ended on the server once it answered again, so it was not cancelled" \
        in caplog.text
    assert "retrying" in caplog.text and caplog.text.count("could not cancel") == 1  # the first attempt's only


def test_a_server_without_the_cancel_route_is_not_taken_for_a_missing_job(monkeypatch, caplog):
    """A server older than the nodes answers 404 `not_found` (no such route), not the job's `video_not_found`."""
    caplog.set_level("INFO")
    no_route = K6ServeError("K6Serve Generate: POST ... answered HTTP 404, not_found: There is no route POST ...",
                            status=404, code="not_found")
    cancels, gets = _late_cancel(monkeypatch, no_route, {})
    assert cancels == ["video_1"] * 3 and gets == []
    assert "not on the server" not in caplog.text and "could not cancel job video_1" in caplog.text
    assert "There is no route POST" in caplog.text


def test_a_cancel_retried_after_the_job_completed_keeps_its_video(fake_server, monkeypatch, caplog):
    """Against the real routes: the first cancel is lost (a restart, a network blip), the job completes meanwhile,
    and the retried cancel (POST .../cancel, not DELETE) leaves the job and its MP4 on the server."""
    caplog.set_level("INFO")
    client = K6ServeClient(fake_server.base_url, "secret-key", node_name="K6Serve Generate")
    job = client.create_job({"prompt": "hold", "size": "32x32", "num_frames": 5})
    harness.wait_until(lambda: fake_server.worker.started, timeout=30)
    real_json = client._json
    cancels = []

    def lose_the_first_cancel(method, route, **kwargs):
        if route.endswith("/cancel"):
            cancels.append((method, route))
            if len(cancels) == 1:
                fake_server.worker.release.set()
                with fake_server.client() as http:
                    assert harness.wait_for(http, job["id"])["status"] == "completed"
                raise _unreachable_error(client)
        return real_json(method, route, **kwargs)

    monkeypatch.setattr(client, "_json", lose_the_first_cancel)
    monkeypatch.setattr(client_module, "CANCEL_RETRY_S", 0.01)
    with pytest.raises(Interrupt):
        client.wait(job, check_interrupt=nodes_tests._interrupt_after(0))
    client.cancel_retry.join(timeout=30)
    assert not client.cancel_retry.is_alive()
    assert cancels == [("POST", f"/v1/videos/{job['id']}/cancel")] * 2
    with fake_server.client() as http:
        assert http.get(f"/v1/videos/{job['id']}").json()["status"] == "completed"
        content = http.get(f"/v1/videos/{job['id']}/content")
    assert content.status_code == 200 and content.headers["content-type"] == "video/mp4" and content.content
    assert f"job {job['id']} had already ended on the server (completed) once it answered again, so it was not " \
           f"cancelled; its video: GET {fake_server.base_url}/v1/videos/{job['id']}/content" in caplog.text


def _serve_each(sock: socket.socket, handle) -> None:
    """Accept connections on `sock` until it is closed, each handled by `handle(connection)` on its own thread."""
    def accept() -> None:
        while True:
            try:
                connection, _ = sock.accept()
            except OSError:
                return
            threading.Thread(target=handle, args=(connection,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()


def _request_head(connection: socket.socket):
    """The request line's method and path, its headers (names lower-cased) and the reader left at its body."""
    reader = connection.makefile("rb")
    method, path, _ = reader.readline().decode().split(" ", 2)
    headers = {}
    while (line := reader.readline().decode().strip()):
        name, value = line.split(":", 1)
        headers[name.strip().lower()] = value.strip()
    return reader, method, path, headers


# ---- a create whose answer is lost ----

class LossyProxy:
    """An HTTP proxy in front of `upstream` that drops its answer to the first `drop` POST /v1/videos (the job is
    created, the answer lost: a reset, a proxy's timeout) and records each POST's body. It answers an
    `Expect: 100-continue` itself, as reverse proxies do. With `drip_content`, a video's MP4 comes 16 bytes every
    0.1 s (`dripping` set, at `dripping_since`, once the first are out), the connection closed after DRIP_LIMIT_S."""

    DRIP_LIMIT_S = 8.0

    def __init__(self, upstream: str, drop: int = 0, *, drip_content: bool = False) -> None:
        self.upstream = upstream.removeprefix("http://")
        self.drop = drop
        self.drip_content = drip_content
        self.dripping = threading.Event()
        self.dripping_since: float | None = None
        self.posts: list[bytes] = []
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        _serve_each(self.sock, self._relay)

    def _relay(self, connection: socket.socket) -> None:
        with connection:
            reader, method, path, headers = _request_head(connection)
            if headers.pop("expect", "").lower() == "100-continue":
                connection.sendall(b"HTTP/1.1 100 Continue\r\n\r\n")
            body = reader.read(int(headers.get("content-length", 0)))
            for hop in ("host", "connection", "accept-encoding"):
                headers.pop(hop, None)
            upstream = http.client.HTTPConnection(self.upstream, timeout=30)
            upstream.request(method, path, body=body, headers=headers)
            response = upstream.getresponse()
            answer = response.read()
            upstream.close()
            if method == "POST" and path == "/v1/videos":
                self.posts.append(body)
                if len(self.posts) <= self.drop:
                    connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
                    return  # closed with a reset, unanswered
            head = f"HTTP/1.1 {response.status} {response.reason}\r\n"
            for name, value in response.getheaders():
                if name.lower() not in ("connection", "content-length", "transfer-encoding"):
                    head += f"{name}: {value}\r\n"
            head += f"Content-Length: {len(answer)}\r\nConnection: close\r\n\r\n"
            if self.drip_content and path.endswith("/content") and response.status == 200:
                self._drip(connection, head.encode(), answer)
                return
            connection.sendall(head.encode() + answer)

    def _drip(self, connection: socket.socket, head: bytes, body: bytes) -> None:
        give_up_at = time.monotonic() + self.DRIP_LIMIT_S
        try:
            connection.sendall(head)
            for start in range(0, len(body), 16):
                if time.monotonic() > give_up_at:
                    return
                connection.sendall(body[start:start + 16])
                if not self.dripping.is_set():
                    self.dripping_since = time.monotonic()
                    self.dripping.set()
                time.sleep(0.1)
        except OSError:  # the node shut its end
            pass

    def close(self) -> None:
        self.sock.close()


@pytest.mark.parametrize("with_image", [False, True], ids=["json", "multipart"])
def test_a_create_whose_answer_was_lost_is_sent_again_and_replayed(fake_server, comfy, monkeypatch, fast_retries,
                                                                   with_image):
    """Before: no request_id and no retry: the node failed with "cannot reach the server" while its job ran on,
    untracked and uncancellable, and running the node again made a second job."""
    proxy = LossyProxy(fake_server.base_url, drop=2)
    image = nodes_tests.torch.rand(1, 16, 16, 3) if with_image else None
    try:
        result = Generate().generate(proxy.url, **TINY, api_key="secret-key", image=image)
    finally:
        proxy.close()
    assert len(proxy.posts) == 3 and len(set(proxy.posts)) == 1  # the same bytes, upload included
    assert (b"Content-Disposition: form-data" in proxy.posts[0]) == with_image
    with fake_server.client() as client:
        jobs = client.get("/v1/videos").json()["data"]
    assert len(jobs) == 1 and jobs[0]["status"] == "completed" and jobs[0]["id"].startswith("comfyui-")
    assert jobs[0]["id"].encode() in proxy.posts[0]
    assert result["result"][2].endswith(f"_{jobs[0]['id']}.mp4")


def test_a_create_that_never_gets_an_answer_cancels_its_job(fake_server, comfy, monkeypatch, fast_retries, caplog):
    caplog.set_level("INFO")
    monkeypatch.setattr(client_module, "POLL_OUTAGE_S", 0.3)
    real_json = K6ServeClient._json
    posts = []

    def answer_lost(self, method, route, **kwargs):
        answer = real_json(self, method, route, **kwargs)
        if method == "POST" and route == "/v1/videos":
            posts.append(answer["id"])
            raise self._connection_error(ConnectionResetError()) from ConnectionResetError()
        return answer

    monkeypatch.setattr(K6ServeClient, "_json", answer_lost)
    with pytest.raises(K6ServeError, match="cannot reach the server"):
        Generate().generate(fake_server.base_url, **{**TINY, "prompt": "hold"}, api_key="secret-key")
    assert len(posts) > 1 and set(posts) == {posts[0]}  # replayed: one job
    with fake_server.client() as client:
        jobs = client.get("/v1/videos").json()["data"]
        if jobs and jobs[0]["status"] == "in_progress":  # the cancel waits for a step boundary
            jobs = [harness.wait_for(client, jobs[0]["id"])]
    assert [(job["id"], job["status"]) for job in jobs] == [(posts[0], "cancelled")]
    assert f"cancelled job {posts[0]} on the server" in caplog.text


def test_a_create_cancelled_before_the_server_saw_it_is_fine(monkeypatch, fast_retries, caplog):
    caplog.set_level("INFO")
    client = K6ServeClient("http://127.0.0.1:9", node_name="K6Serve Generate")

    routes = []

    def loading_then_not_found(method, route, **kwargs):
        routes.append((method, route))
        if route == "/v1/videos":
            raise LOADING
        raise K6ServeError("not found", status=404, code="video_not_found")  # the cancel, once the server serves

    monkeypatch.setattr(client, "_json", loading_then_not_found)
    with pytest.raises(Interrupt):
        client.create_job({"prompt": "p"}, request_id="comfyui-1", check_interrupt=nodes_tests._interrupt_after(2))
    assert client.cancel_retry is None and routes[-1] == ("POST", "/v1/videos/comfyui-1/cancel")
    assert "job comfyui-1 is not on the server (never created there, or deleted); nothing to cancel" in caplog.text
    monkeypatch.setattr(client, "_json", lambda *args, **kwargs: (_ for _ in ()).throw(
        K6ServeError("refused", status=400, code="invalid_parameter")))
    monkeypatch.setattr(client, "cancel_job", lambda job_id: pytest.fail("a refused create made no job to cancel"))
    with pytest.raises(K6ServeError, match="refused"):
        client.create_job({"prompt": "p"}, request_id="comfyui-2")


# ---- an upload over --max-upload-mb ----

@pytest.fixture
def small_upload_server(tmp_path):
    server = harness.start_server(tmp_path / "sr", worker=harness.FakeWorker(VARIANTS["vsr-distilled2steps"]),
                                  max_upload_mb=1)
    yield server
    server.stop()


def test_an_upload_over_the_server_limit_is_told_as_such(small_upload_server, comfy, tmp_path, monkeypatch):
    """Before: past the 64 MiB the server drains of a refused body it closed the connection, and the node, still
    sending, said "cannot reach the server ... that `k6serve serve` is running"."""
    clip = tmp_path / "big.mp4"
    clip.write_bytes(bytes(80 << 20))
    started = time.monotonic()
    with pytest.raises(K6ServeError, match=r"K6Serve Upscale: the upload is too large for the server \(.*"
                                           r"--max-upload-mb.*start the server with a larger --max-upload-mb"):
        Upscale().upscale(small_upload_server.base_url, video_path=str(clip), scale="2", seed=1)
    assert time.monotonic() - started < 5  # answered before the 80 MiB were sent
    # Without the Expect handshake (through a proxy): the reset is read as the likely size refusal, not sent again.
    monkeypatch.setattr(K6ServeClient, "_direct", lambda self: False)
    with pytest.raises(K6ServeError, match=r"closed the connection while the node was sending its 80\.0 MiB upload.*"
                                           r"most likely the upload is larger than the server's --max-upload-mb") \
            as raised:
        Upscale().upscale(small_upload_server.base_url, video_path=str(clip), scale="2", seed=1)
    assert raised.value.code == client_module.UPLOAD_CUT_OFF
    with small_upload_server.client() as client:
        assert client.get("/v1/videos").json()["data"] == []


def test_an_upload_the_server_takes_waits_for_100_continue(small_upload_server, comfy, tmp_path, monkeypatch):
    answers = []
    await_continue = client_module._await_continue
    monkeypatch.setattr(client_module, "_await_continue", lambda sock: answers.append(await_continue(sock)) or
                        answers[-1])
    clip = tmp_path / "small.mp4"
    clip.write_bytes(b"not a video")
    with pytest.raises(K6ServeError, match="refused the input 'video_path'"):  # the upload was read and checked
        Upscale().upscale(small_upload_server.base_url, video_path=str(clip), scale="2", seed=1)
    assert answers == ["continue"]


# ---- Cancel and timeout_s while an upload is sent, the MP4 comes in, or it is decoded ----

class ComfyInterrupt:
    """ComfyUI's throw_exception_if_processing_interrupted: raises once after `flag` is set, clearing it as ComfyUI
    clears its global (so a check that swallowed it would lose the Cancel)."""

    def __init__(self, flag: threading.Event) -> None:
        self.flag = flag
        self.raised_at: float | None = None

    def __call__(self) -> None:
        if self.flag.is_set():
            self.flag.clear()
            self.raised_at = time.monotonic()
            raise Interrupt()


class SlowUploadServer:
    """Takes a POST /v1/videos body 4 KiB every 50 ms (answering an `Expect: 100-continue` first), hanging up after
    8 s; `reading` is set, at `reading_since`, once the body has begun to come. Any other request (the node's
    cancel) is answered at once with a 404 video_not_found, and its path recorded in `other`."""

    def __init__(self) -> None:
        self.reading = threading.Event()
        self.reading_since: float | None = None
        self.other: list[str] = []
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # a small window, so the upload stalls
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen()
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        _serve_each(self.sock, self._answer)

    def _answer(self, connection: socket.socket) -> None:
        with connection:
            reader, method, path, headers = _request_head(connection)
            if (method, path) != ("POST", "/v1/videos"):
                self.other.append(path)
                body = b'{"error": {"code": "video_not_found", "message": "no such video"}}'
                connection.sendall(f"HTTP/1.1 404 Not Found\r\nContent-Type: application/json\r\nContent-Length: "
                                   f"{len(body)}\r\nConnection: close\r\n\r\n".encode() + body)
                return
            if headers.get("expect", "").lower() == "100-continue":
                connection.sendall(b"HTTP/1.1 100 Continue\r\n\r\n")
            give_up_at = time.monotonic() + 8.0
            try:
                while time.monotonic() < give_up_at and reader.read1(4096):
                    if not self.reading.is_set():
                        self.reading_since = time.monotonic()
                        self.reading.set()
                    time.sleep(0.05)
            except OSError:
                pass

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def slow_upload_server():
    server = SlowUploadServer()
    yield server
    server.close()


BIG_UPLOAD = [client_module.Upload("video_reference", "big.mp4", "video/mp4", bytes(32 << 20))]


@pytest.mark.parametrize("direct", [True, False], ids=["expect-100-continue", "urllib"])
def test_timeout_s_is_heard_while_an_upload_is_being_sent(slow_upload_server, monkeypatch, direct):
    """Before: timeout_s was looked at only between tries, so an upload the server took slowly held the node for
    as long as it went on (here until the server hung up at 8 s), and that reset then read as an upload over
    --max-upload-mb."""
    monkeypatch.setattr(K6ServeClient, "_direct", lambda self: direct)  # False: urllib's way (a proxy, https)
    client = K6ServeClient(slow_upload_server.url, node_name="K6Serve Upscale")
    started = time.monotonic()
    with pytest.raises(K6ServeError, match=r"^K6Serve Upscale: the job could not be sent within timeout_s=1 s \(queue "
                                           r"time included\): the server had not taken the request and answered by "
                                           r"then\. Raise timeout_s, or 0 for no limit\.$") as raised:
        client.create_job({"sr_resolution_scale": 2.0}, BIG_UPLOAD, request_id="comfyui-1",
                          deadline=client_module.Deadline.after(1.0))
    assert 1.0 <= time.monotonic() - started < 2.5 and slow_upload_server.reading.is_set()
    assert raised.value.code != client_module.UPLOAD_CUT_OFF
    assert slow_upload_server.other == ["/v1/videos/comfyui-1/cancel"]  # the id it may have made a job of


def test_cancel_is_heard_while_an_upload_is_being_sent(slow_upload_server):
    client = K6ServeClient(slow_upload_server.url, node_name="K6Serve Upscale")
    check_interrupt = ComfyInterrupt(slow_upload_server.reading)  # Cancel once the body has begun to go out
    with pytest.raises(Interrupt):
        client.create_job({"sr_resolution_scale": 2.0}, BIG_UPLOAD, request_id="comfyui-1",
                          check_interrupt=check_interrupt)
    # Before: heard only once the server hung up, 8 s on (the reset after its 100 Continue was retried).
    assert check_interrupt.raised_at - slow_upload_server.reading_since < 1.0
    assert slow_upload_server.other == ["/v1/videos/comfyui-1/cancel"]


def test_timeout_s_is_heard_while_the_video_is_downloaded(fake_server, comfy, monkeypatch, tmp_path):
    """Before: the download was one read per MiB, each bounded only by the socket's 60 s, so an MP4 coming slowly
    was waited for to its end; docs/comfyui.md promised the URL at timeout_s. Now the node stops at timeout_s."""
    monkeypatch.setattr(client_module, "POLL_OUTAGE_S", 0.0)  # the unfixed node gives up when the proxy hangs up
    proxy = LossyProxy(fake_server.base_url, drip_content=True)
    started = time.monotonic()
    try:
        with pytest.raises(K6ServeError, match=r"^K6Serve Generate: timeout_s=2 s ran out while downloading job "
                                               r"(comfyui-\w+)'s video\. The video of job \1 is finished and stays on "
                                               r"the server until it expires: GET http://127\.0\.0\.1:\d+/v1/videos/"
                                               r"\1/content fetches it\.$"):
            Generate().generate(proxy.url, **TINY, api_key="secret-key", timeout_s=2)
    finally:
        proxy.close()
    assert proxy.dripping.is_set() and 2.0 <= time.monotonic() - started < 3.5
    assert nodes_tests._newest_job(fake_server)["status"] == "completed"  # a finished job is never cancelled
    assert not list((tmp_path / "comfy_output").rglob("*.mp4*"))  # no partial file left


def test_cancel_is_heard_while_the_video_is_downloaded(fake_server, comfy, monkeypatch, tmp_path):
    proxy = LossyProxy(fake_server.base_url, drip_content=True)
    check_interrupt = ComfyInterrupt(proxy.dripping)
    monkeypatch.setattr(sys.modules["comfy.model_management"], "throw_exception_if_processing_interrupted",
                        check_interrupt)
    try:
        with pytest.raises(Interrupt):
            Generate().generate(proxy.url, **TINY, api_key="secret-key")
    finally:
        proxy.close()
    assert check_interrupt.raised_at - proxy.dripping_since < 1.0  # before: once the proxy hung up, 8 s on
    assert nodes_tests._newest_job(fake_server)["status"] == "completed"
    assert not list((tmp_path / "comfy_output").rglob("*.mp4*"))


@pytest.mark.parametrize("stop", ["cancel", "timeout"])
def test_cancel_and_timeout_s_are_heard_while_the_video_is_decoded(fake_server, comfy, monkeypatch, stop):
    """Before: the decode of the saved MP4 (a 4x upscale's frames take a while) ran to its end whatever came."""
    nodes_module = sys.modules["k6serve_nodes.nodes"]
    decoding = threading.Event()
    frames_decoded = []
    real_decode = nodes_module.decode_video

    def decode_slowly(path, check=lambda: None):
        decoding.set()

        def check_each_frame():
            frames_decoded.append(path)
            time.sleep(0.6)  # frames that take long: timeout_s=2 runs out before the last of TINY's 5
            check()

        return real_decode(path, check=check_each_frame)

    monkeypatch.setattr(nodes_module, "decode_video", decode_slowly)
    if stop == "cancel":
        monkeypatch.setattr(sys.modules["comfy.model_management"], "throw_exception_if_processing_interrupted",
                            ComfyInterrupt(decoding))
        with pytest.raises(Interrupt):
            Generate().generate(fake_server.base_url, **TINY, api_key="secret-key")
        assert len(frames_decoded) == 1
    else:
        with pytest.raises(K6ServeError, match=r"^K6Serve Generate: timeout_s=2 s ran out while the video was "
                                               r"decoded; the MP4 is saved at .*_comfyui-\w+\.mp4\. Raise timeout_s, "
                                               r"or 0 for no limit\.$") as raised:
            Generate().generate(fake_server.base_url, **TINY, api_key="secret-key", timeout_s=2)
        assert Path(str(raised.value).split("saved at ")[1].split(". Raise")[0]).is_file()
        assert len(frames_decoded) < 5  # TINY has 5 frames


def test_cancel_is_heard_while_a_tls_handshake_hangs():
    """An https:// server_url whose server took the TCP connection and never answered the handshake held a Cancel
    for the socket's whole timeout (60 s): the watch shut the request's socket only once the handshake was done."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    taken = []
    threading.Thread(target=lambda: taken.append(listener.accept()[0]), daemon=True).start()
    client = K6ServeClient(f"https://127.0.0.1:{listener.getsockname()[1]}", node_name="K6Serve Upscale")
    cancel = threading.Event()
    threading.Timer(0.3, cancel.set).start()
    check_interrupt = ComfyInterrupt(cancel)
    started = time.monotonic()
    try:
        with pytest.raises(Interrupt):
            client._watched(lambda: client._open("GET", "/v1/models"), check_interrupt,
                            client_module.Deadline.after(0), "asking for the models")
    finally:
        listener.close()
        for connection in taken:
            connection.close()
    assert taken and time.monotonic() - started < 1.5
