"""What the server answers while its model loads: 503 "loading" on /health, 503 model_loading elsewhere, at once and
whatever the client sends; then the real API on the same port, with nothing lost at the hand-over. A load that fails
still ends the process with its error."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from harness import wait_for, wait_until

from k6serve.serve.loading import HEAD_TIMEOUT_S, RETRY_AFTER_S, LoadingResponder

SMALL = {"size": "32x32", "num_frames": 5}
HERE = Path(__file__).resolve().parent


def _assert_loading_health(response: httpx.Response) -> None:
    assert response.status_code == 503, response.text
    body = response.json()
    assert body["status"] == "loading" and "loading the model" in body["message"], body
    assert isinstance(body["elapsed_s"], float) and body["elapsed_s"] >= 0
    assert response.headers["connection"] == "close"


def _assert_model_loading(response: httpx.Response) -> None:
    assert response.status_code == 503, response.text
    error = response.json()["error"]
    assert error["code"] == "model_loading" and error["type"] == "server_error", error
    assert "loading the model" in error["message"] and "GET /health" in error["message"]
    assert response.headers["retry-after"] == str(RETRY_AFTER_S) and response.headers["connection"] == "close"


def _raw_answer(address: tuple[str, int], data: bytes) -> bytes:
    with socket.create_connection(address, timeout=5) as conn:
        conn.sendall(data)
        answer = b""
        while chunk := conn.recv(65536):
            answer += chunk
        return answer


@pytest.fixture
def responder():
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen(128)
    loading = LoadingResponder(sock)
    loading.start()
    yield loading
    loading.stop()
    sock.close()


def test_the_responder_answers_every_request_at_once(responder):
    address = responder.sock.getsockname()
    url = f"http://{address[0]}:{address[1]}"
    started = time.monotonic()
    _assert_loading_health(httpx.get(f"{url}/health"))
    _assert_loading_health(httpx.get(f"{url}/health/?verbose=1"))
    head = httpx.head(f"{url}/health")
    assert head.status_code == 503 and head.content == b"" and int(head.headers["content-length"]) > 0
    _assert_model_loading(httpx.post(f"{url}/health"))  # /health takes GET only
    _assert_model_loading(httpx.get(f"{url}/v1/videos"))
    _assert_model_loading(httpx.delete(f"{url}/v1/videos/video_1"))
    # A body the responder never reads as such (drained, so the client reads the answer rather than a reset).
    _assert_model_loading(httpx.post(f"{url}/v1/videos", json={"prompt": "too early", **SMALL}))
    upload = ("a.png", b"\x89PNG" + b"\0" * 20 * 2**20, "image/png")
    _assert_model_loading(httpx.post(f"{url}/v1/videos", data={"prompt": "p"}, files={"input_reference": upload}))
    assert time.monotonic() - started < 5
    # Not HTTP at all, an absolute-form target, an HTTP/1.0 request: answered all the same.
    assert _raw_answer(address, b"\x16\x03\x01\x00\xff garbage\r\n\r\n").startswith(b"HTTP/1.1 503 ")
    assert b'"status": "loading"' in _raw_answer(address, f"GET {url}/health HTTP/1.1\r\nHost: localhost\r\n\r\n".encode())
    assert b'"model_loading"' in _raw_answer(address, b"GET /metrics HTTP/1.0\r\n\r\n")
    assert responder.num_answered == 11


def test_a_silent_or_slow_client_delays_no_other(responder):
    address = responder.sock.getsockname()
    url = f"http://{address[0]}:{address[1]}"
    # Served one after another, these would hold the others back HEAD_TIMEOUT_S each: 4 s in all.
    silent = [socket.create_connection(address) for _ in range(7)]
    half = socket.create_connection(address)
    half.sendall(b"POST /v1/videos HTTP/1.1\r\nHost: localhost\r\nContent-Le")  # and nothing more
    socket.create_connection(address).close()  # a TCP probe: connects, says nothing, leaves
    try:
        started = time.monotonic()
        for _ in range(5):
            _assert_loading_health(httpx.get(f"{url}/health"))
        assert time.monotonic() - started < 3  # one after another: over 4 s; room for a busy 2-core machine
        # The silent and the half-sent ones are answered too once their head's time is up, then closed.
        for conn in silent:
            conn.settimeout(5)
            assert conn.recv(65536).startswith(b"HTTP/1.1 503 ")
        half.settimeout(5)
        assert b'"model_loading"' in half.recv(65536)
        assert time.monotonic() - started < HEAD_TIMEOUT_S + 2
    finally:
        for conn in [*silent, half]:
            conn.close()


def test_stop_gives_the_socket_back_as_it_was_and_leaves_unaccepted_connections_for_the_next_owner():
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen(128)
    try:
        assert sock.gettimeout() is None  # blocking, as `listening_socket` makes it and uvicorn expects it
        loading = LoadingResponder(sock)
        loading.start()
        _assert_loading_health(httpx.get(f"http://127.0.0.1:{sock.getsockname()[1]}/health"))
        loading.stop()
        loading.stop()  # idempotent: `serve` stops it again in its cleanup
        assert sock.gettimeout() is None and sock.getblocking()
        assert not any(t.name == "k6serve-loading-responder" for t in threading.enumerate())
        with socket.create_connection(sock.getsockname(), timeout=5) as client:
            client.sendall(b"GET /health HTTP/1.1\r\nHost: localhost\r\n\r\n")
            sock.settimeout(5)
            conn, _ = sock.accept()  # waited in the backlog for the next owner; the responder did not take it
            with conn:
                assert conn.recv(65536).startswith(b"GET /health ")
    finally:
        sock.close()


def _spawn(root: Path, *extra: str) -> tuple[subprocess.Popen, str, Path]:
    """A `k6serve serve` process (fake worker) whose load lasts until `root/loaded` exists; its stderr goes to a
    file. Returns once its port is bound, i.e. while it loads."""
    port_file, log = root / "port", root / "server.log"
    with log.open("wb") as stderr:
        process = subprocess.Popen([sys.executable, str(HERE / "fake_server_main.py"), str(root), str(port_file),
                                    "--through-serve", "--load-until", str(root / "loaded"), *extra], stderr=stderr)
    deadline = time.monotonic() + 60
    while not port_file.exists() or not port_file.read_text():
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            raise AssertionError(f"the server process did not start:\n{log.read_text()}")
        time.sleep(0.05)
    return process, port_file.read_text(), log


def test_serve_answers_while_the_model_loads_then_serves_on_the_same_port(tmp_path):
    # Before: connections waited in the kernel's backlog until the load ended (minutes for a real checkpoint), so a
    # supervisor's GET /health hung, unable to tell "loading" from "dead", and so did a client's POST.
    process, url, log = _spawn(tmp_path)
    try:
        with httpx.Client(base_url=url, timeout=5) as client:
            started = time.monotonic()
            _assert_loading_health(client.get("/health"))
            assert time.monotonic() - started < 2
            _assert_model_loading(client.post("/v1/videos", json={"prompt": "too early", **SMALL}))
            address = httpx.URL(url).host, httpx.URL(url).port
            assert _raw_answer(address, b"NOT HTTP\r\n\r\n").startswith(b"HTTP/1.1 503 ")
            _assert_loading_health(client.get("/health"))  # the garbage stopped nothing
        # Poll through the hand-over: every answer is "loading" or "ok", none a connection error or a hang.
        answers: list[object] = []

        def poll() -> None:
            while not answers or answers[-1] != 200:
                try:
                    answers.append(httpx.get(f"{url}/health", timeout=10).status_code)
                except httpx.HTTPError as exc:
                    answers.append(exc)
                    return
                time.sleep(0.01)

        poller = threading.Thread(target=poll)
        poller.start()
        wait_until(lambda: len(answers) >= 3, timeout=10)
        (tmp_path / "loaded").touch()
        poller.join(30)
        assert not poller.is_alive() and set(answers) == {503, 200}, answers
        with httpx.Client(base_url=url, timeout=30) as client:
            assert client.get("/health").json()["status"] == "ok"
            job = client.post("/v1/videos", json={"prompt": "after the load", **SMALL}).json()
            assert wait_for(client, job["id"])["status"] == "completed"
            assert client.get(f"/v1/videos/{job['id']}/content").status_code == 200
        process.send_signal(signal.SIGTERM)
        assert process.wait(30) == 0
        text = log.read_text()
        assert "answering on port" in text and "loading responder stopped" in text
    finally:
        process.kill()
        process.wait(10)


def test_a_load_that_fails_stops_the_answers_and_exits_with_its_error(tmp_path):
    process, url, log = _spawn(tmp_path, "--load-fails")
    try:
        _assert_loading_health(httpx.get(f"{url}/health", timeout=5))
        (tmp_path / "loaded").touch()
        assert process.wait(30) != 0
        assert "RuntimeError: the fake checkpoint is broken" in log.read_text()
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"{url}/health", timeout=5)
    finally:
        process.kill()
        process.wait(10)


def test_under_a_root_path_the_loading_health_is_answered_with_the_prefix_too():
    # A proxy that passes /k6/health on got the generic model_loading body, not the health one.
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen(8)
    loading = LoadingResponder(sock, root_path="/k6")
    loading.start()
    try:
        address = sock.getsockname()
        url = f"http://{address[0]}:{address[1]}"
        _assert_loading_health(httpx.get(f"{url}/k6/health"))
        _assert_loading_health(httpx.get(f"{url}/health"))
        _assert_model_loading(httpx.get(f"{url}/k6/v1/videos"))
    finally:
        loading.stop()
        sock.close()
