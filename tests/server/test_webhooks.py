"""Webhooks (`--webhook-url`): a job's completion or failure POSTed as OpenAI's video.completed / video.failed event,
signed as OpenAI signs its webhooks, so OpenAI's own SDK verifies it; retried on errors, never in a job's way."""

from __future__ import annotations

import base64
import contextlib
import http.client
import json
import logging
import os
import signal
import socket
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from harness import start_server, wait_for

from k6serve.serve.settings import settings_from_options
from k6serve.serve.jobs import STORE_WRITE_ERRORS, Job, SqliteJobStore
from k6serve.serve.webhook_sender import RESEND_WINDOW_S, RETRY_DELAYS_S, WebhookSender, age_bound, backoff_delays
from k6serve.serve.webhook_urls import check_webhook_url

SECRET = "whsec_" + base64.b64encode(b"k6serve-webhook-test-secret-32b!").decode()
SMALL = {"size": "32x32", "num_frames": 5}


def send(sender: WebhookSender, event_type: str, video_id: str, completed_at: float) -> None:
    """Keep and schedule an event without a job: its rows written on their own (the store's add_webhook_event, which
    tests make fail as a full disk), where the runner writes them in the job's end's transaction."""
    event = sender.new_event(event_type, video_id, completed_at)
    store_error = None
    if sender._outbox is not None:
        try:
            sender._outbox.add_webhook_event(event.id, event.type, event.video_id, event.created_at, sender.urls)
        except STORE_WRITE_ERRORS as exc:
            store_error = exc
    sender.schedule(event, store_error)


class Receiver:
    """A webhook endpoint on a free port: records every POST, answers the statuses queued in `answers` (then 200)."""

    def __init__(self) -> None:
        self.received: list[tuple[dict[str, str], bytes]] = []
        self.answers: list[int] = []
        self.failing: set[str] = set()  # video ids answered 500 whatever `answers` holds
        self.location = "/moved"  # a 3xx answer's
        self.arrived = threading.Condition()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                body = self.rfile.read(int(self.headers["Content-Length"]))
                with receiver.arrived:
                    receiver.received.append(({k.lower(): v for k, v in self.headers.items()}, body))
                    status = receiver.answers.pop(0) if receiver.answers else 200
                    if json.loads(body)["data"]["id"] in receiver.failing:
                        status = 500
                    receiver.arrived.notify_all()
                self.send_response(status)
                if 300 <= status < 400:
                    self.send_header("Location", receiver.location)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def do_GET(self) -> None:  # noqa: N802 - a followed redirect would arrive here
                with receiver.arrived:
                    headers = {k.lower(): v for k, v in self.headers.items()}
                    receiver.received.append((headers, b"GET " + self.path.encode()))
                    receiver.arrived.notify_all()
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hooks"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def wait(self, count: int, timeout_s: float = 20.0) -> list[tuple[dict[str, str], bytes]]:
        with self.arrived:
            assert self.arrived.wait_for(lambda: len(self.received) >= count, timeout_s), self.received
            return list(self.received)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def receiver():
    endpoint = Receiver()
    yield endpoint
    endpoint.close()


def _verified(headers: dict[str, str], body: bytes) -> dict:
    """The event, once OpenAI's SDK has checked its signature (it raises on a wrong one)."""
    from openai import OpenAI

    OpenAI(api_key="unused").webhooks.verify_signature(body, headers, secret=SECRET)
    return json.loads(body)


def test_completed_and_failed_jobs_post_openais_signed_events(tmp_path, receiver):
    server = start_server(tmp_path, webhook_urls=(receiver.url,), webhook_secret=SECRET)
    try:
        with server.client() as client:
            done = wait_for(client, client.post("/v1/videos", json={"prompt": "ok", **SMALL}).json()["id"])
            failed = wait_for(client, client.post("/v1/videos", json={"prompt": "fail", **SMALL}).json()["id"])
            events = [(headers, _verified(headers, body)) for headers, body in receiver.wait(2)]
            # Counted once the receiver's answer is read, a moment after it got the request.
            deadline = time.monotonic() + 10
            while 'k6serve_webhook_deliveries_total{outcome="delivered"} 2' not in client.get("/metrics").text:
                assert time.monotonic() < deadline, client.get("/metrics").text
                time.sleep(0.05)
            assert "k6serve_webhook_events_pending 0" in client.get("/metrics").text
        assert [event["type"] for _, event in events] == ["video.completed", "video.failed"]
        for (headers, event), job in zip(events, (done, failed)):
            assert event["object"] == "event" and event["data"] == {"id": job["id"]}
            assert event["created_at"] == job["completed_at"] and event["id"].startswith("evt_")
            assert headers["webhook-id"] == event["id"] and headers["content-type"] == "application/json"
            assert headers["user-agent"].startswith("k6serve/")
    finally:
        server.stop()
    assert len(receiver.received) == 2


def test_a_cancelled_job_sends_no_event(tmp_path, receiver):
    server = start_server(tmp_path, webhook_urls=(receiver.url,), webhook_secret=SECRET)
    try:
        with server.client() as client:
            running = client.post("/v1/videos", json={"prompt": "hold", **SMALL}).json()
            wait_for(client, running["id"], ("in_progress",))
            queued = client.post("/v1/videos", json={"prompt": "next", **SMALL}).json()
            assert client.post(f"/v1/videos/{queued['id']}/cancel").json()["status"] == "cancelled"
            server.worker.release.set()
            wait_for(client, running["id"])
            receiver.wait(1)
            time.sleep(0.5)
        assert [json.loads(body)["data"]["id"] for _, body in receiver.received] == [running["id"]]
    finally:
        server.stop()


def test_errors_are_retried_with_the_same_event_id_and_refusals_are_not(receiver):
    outcomes = []
    sender = WebhookSender((receiver.url,), SECRET, retry_delays_s=(0.05, 0.05, 0.05), on_outcome=outcomes.append)
    sender.start()
    try:
        receiver.answers += [503, 429]
        send(sender, "video.completed", "video_a", 1_700_000_000)
        first = receiver.wait(3)
        assert [headers["webhook-id"] for headers, _ in first] == [first[0][0]["webhook-id"]] * 3
        for headers, body in first:
            _verified(headers, body)  # signed again at each attempt, with that attempt's timestamp
        receiver.answers += [400]
        send(sender, "video.failed", "video_b", 1_700_000_001)
        receiver.wait(4)
        _until(lambda: outcomes == ["delivered", "failed"])
        assert len(receiver.received) == 4  # a 400 is the receiver's answer: not retried
        receiver.answers += [500] * 4
        send(sender, "video.failed", "video_c", 1_700_000_002)
        receiver.wait(8)
        _until(lambda: outcomes == ["delivered", "failed", "failed"])
        assert len(receiver.received) == 8  # 1 + 3 retries, then given up
    finally:
        sender.stop(timeout_s=2.0)


def test_an_unreachable_url_costs_no_job_time_and_stop_does_not_hang(tmp_path):
    # A receiver that is down: the events retry on their own thread; the jobs complete at once, and the stop waits
    # DRAIN_AT_STOP_S at most before it keeps what is left for the next start, saying so.
    server = start_server(tmp_path, webhook_urls=("http://127.0.0.1:9/down",), webhook_secret=SECRET)
    with server.client() as client:
        started = time.monotonic()
        done = wait_for(client, client.post("/v1/videos", json={"prompt": "ok", **SMALL}).json()["id"])
        assert done["status"] == "completed" and time.monotonic() - started < 10
    started = time.monotonic()
    server.stop()
    assert time.monotonic() - started < 20


@pytest.mark.parametrize(("options", "message"), [
    ({"webhook_url": ["https://hooks.example/k6"]}, "--webhook-url needs --webhook-secret"),
    ({"webhook_url": ["ftp://hooks.example/k6"], "webhook_secret": SECRET}, "must be an http:// or https:// URL"),
    ({"webhook_url": ["https://hooks.example:99999/k6"], "webhook_secret": SECRET}, "is not a URL"),
    ({"webhook_url": ["https://hooks.example/k6"], "webhook_secret": "whsec_not*base64"}, "the rest is not base64"),
    ({"webhook_url": ["https://hooks.example/k6"], "webhook_secret": "short"}, "too short to sign with"),
])
def test_webhook_settings_that_cannot_work_are_refused_at_start(options, message, monkeypatch):
    monkeypatch.delenv("K6SERVE_WEBHOOK_SECRET", raising=False)
    with pytest.raises(ValueError, match=message):
        settings_from_options(options)


def test_the_secret_may_come_from_the_environment(monkeypatch):
    monkeypatch.setenv("K6SERVE_WEBHOOK_SECRET", SECRET)
    settings = settings_from_options({"webhook_url": ["https://hooks.example/k6", "https://hooks.example/k6"]})
    assert settings.webhook_urls == ("https://hooks.example/k6",) and settings.webhook_secret == SECRET


@pytest.mark.parametrize(("location", "shown"), [
    ("/moved?token=loc-token", "http://127.0.0.1:{port}/..."),
    ("https://Elsewhere.example.com/new?token=loc-token", "https://elsewhere.example.com/..."),
    ("mailto:loc-token@moved", None),
], ids=["relative", "another-host", "no-host"])
def test_a_redirect_is_not_followed_and_counts_as_not_delivered(receiver, caplog, location, shown):
    # urllib turned the POST into a bodiless GET to the new place, the signature headers with it, and counted it.
    # Its Location is logged as the hook URL is (scheme://host[:port]/...): it logged up to 200 characters of it,
    # and a receiver's redirect often carries a token too.
    receiver.location = location
    outcomes = []
    sender = WebhookSender((receiver.url + "?token=secret-token",), SECRET, retry_delays_s=(0.05,),
                           on_outcome=outcomes.append)
    sender.start()
    try:
        receiver.answers += [301]
        send(sender, "video.completed", "video_a", 1_700_000_000)
        receiver.wait(1)
        _until(lambda: outcomes)
    finally:
        sender.stop(timeout_s=1.0)
    assert outcomes == ["failed"] and len(receiver.received) == 1  # no GET to /moved
    port = receiver.server.server_address[1]
    target = "a Location with no host" if shown is None else repr(shown.format(port=port))
    assert f"HTTP 301 to {target}: a redirect is not followed, give that URL as --webhook-url" in caplog.text
    for hidden in ("secret-token", "/hooks", "loc-token", "/moved", "/new"):  # the log shows scheme://host:port/...
        assert hidden not in caplog.text


class SilentListener:
    """A URL whose server accepts connections and never answers (a hung receiver), on the loopback only."""

    def __init__(self) -> None:
        self.socket = socket.socket()
        self.socket.bind(("127.0.0.1", 0))
        self.socket.listen(8)
        self.url = f"http://127.0.0.1:{self.socket.getsockname()[1]}/hung"
        self.connections: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        with contextlib.suppress(OSError):
            while True:
                self.connections.append(self.socket.accept()[0])

    def close(self) -> None:
        for connection in self.connections:
            connection.close()
        self.socket.close()


def _until(condition, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline
        time.sleep(0.02)


def _send_kept(urls: tuple[str, ...], receiver, store, count: int) -> list:
    """Start a sender over `store` for `urls`, wait until `receiver` holds `count` events and the outbox is empty,
    stop it; the received (headers, body) pairs."""
    sender = WebhookSender(urls, SECRET, outbox=store)
    sender.start()
    try:
        received = receiver.wait(count)
        _until(lambda: not store.pending_webhook_events())
    finally:
        sender.stop(timeout_s=1.0)
    return received


def test_a_hung_url_holds_back_no_other_and_its_thread_ends_after_the_stop(receiver, monkeypatch):
    from k6serve.serve import webhook_sender

    monkeypatch.setattr(webhook_sender, "TIMEOUT_S", 1.0)
    hung = SilentListener()
    sender = WebhookSender((hung.url, receiver.url), SECRET)
    try:
        sender.start()
        started = time.monotonic()
        send(sender, "video.completed", "video_a", 1_700_000_000)
        receiver.wait(1, timeout_s=5.0)
        assert time.monotonic() - started < 0.9  # not behind the hung URL's timeout
        sender.stop(timeout_s=0.2)
        # The hung URL's thread was inside an attempt at the stop: it finds the end mark when the attempt ends.
        _until(lambda: not any(thread.is_alive() for thread in sender._threads), timeout_s=5.0)
    finally:
        hung.close()


class DrippingListener:
    """A receiver that answers `at_once`, then `dripped` one byte every `every_s` (each read of the sender's gets a
    byte in time, so the socket timeout alone never fires), on the loopback only."""

    def __init__(self, at_once: bytes, dripped: bytes, every_s: float) -> None:
        self.socket = socket.socket()
        self.socket.bind(("127.0.0.1", 0))
        self.socket.listen(8)
        self.url = f"http://127.0.0.1:{self.socket.getsockname()[1]}/drip"
        self.at_once, self.dripped, self.every_s = at_once, dripped, every_s
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        with contextlib.suppress(OSError):
            while True:
                connection = self.socket.accept()[0]
                threading.Thread(target=self._answer, args=(connection,), daemon=True).start()

    def _answer(self, connection: socket.socket) -> None:
        with contextlib.suppress(OSError), connection:
            connection.recv(65536)
            connection.sendall(self.at_once)
            for byte in self.dripped:
                connection.sendall(bytes([byte]))
                time.sleep(self.every_s)

    def close(self) -> None:
        self.socket.close()


@pytest.mark.parametrize("cut", ["head", "body"])
def test_an_attempt_ends_at_its_deadline_however_slowly_the_answer_comes(monkeypatch, cut):
    """TIMEOUT_S bounds the whole attempt, not each read: a receiver dripping its answer a byte at a time held one
    attempt for 39 s (a byte a second), the URL's other events behind it. Cut in its head, the attempt failed and is
    retried; cut in the body after a 2xx status line and headers, the event was accepted and counts delivered."""
    from k6serve.serve import webhook_sender

    monkeypatch.setattr(webhook_sender, "TIMEOUT_S", 1.0)
    head = b"HTTP/1.1 200 OK\r\nContent-Length: 200\r\n\r\n"
    dripping = (DrippingListener(b"", head, every_s=0.1) if cut == "head"  # the head alone takes 3.8 s
                else DrippingListener(head, b"x" * 200, every_s=0.1))
    sender = WebhookSender((dripping.url,), SECRET)
    try:
        event = sender.new_event("video.completed", "video_a", 1_700_000_000)
        started = time.monotonic()
        outcome = sender._attempt(event, dripping.url, event.body())
        elapsed = time.monotonic() - started
    finally:
        dripping.close()
    assert elapsed < 2.0
    assert outcome == (("no whole answer within 1 s", True) if cut == "head" else None)


def test_a_tls_handshake_dripped_a_byte_at_a_time_ends_at_the_deadline(monkeypatch):
    """A receiver that answers the ClientHello with a record header, then one byte of its 16 KiB a tenth of a second
    (each read gets a byte in time): the handshake happens before the deadline holds the socket, and is bounded as a
    whole by the socket timeout (CPython's ssl keeps one deadline across its reads), so the attempt still ends at
    TIMEOUT_S and says so."""
    from k6serve.serve import webhook_sender

    monkeypatch.setattr(webhook_sender, "TIMEOUT_S", 1.0)
    dripping = DrippingListener(b"\x16\x03\x03\x40\x00", b"\x02" * 16384, every_s=0.1)  # a handshake record
    url = dripping.url.replace("http://", "https://")
    sender = WebhookSender((url,), SECRET)
    try:
        event = sender.new_event("video.completed", "video_a", 1_700_000_000)
        started = time.monotonic()
        outcome = sender._attempt(event, url, event.body())
        elapsed = time.monotonic() - started
    finally:
        dripping.close()
    assert elapsed < 2.0
    assert outcome == ("no whole answer within 1 s", True)


def test_https_attempts_have_the_deadline_too():
    """The deadline's connections replace urllib's default HTTP and HTTPS handlers in the opener (build_opener keeps
    a default handler only where no subclass of it is given): an https:// receiver that drips is cut as well."""
    import urllib.request

    from k6serve.serve import webhook_transport

    kinds = [type(handler) for handler in webhook_transport.OPENER.handlers]
    assert webhook_transport._DeadlineHTTPSHandler in kinds and webhook_transport._DeadlineHTTPHandler in kinds
    assert urllib.request.HTTPSHandler not in kinds and urllib.request.HTTPHandler not in kinds
    assert issubclass(webhook_transport._DeadlineHTTPSConnection, http.client.HTTPSConnection)


def test_a_garbled_answer_is_retried_and_the_urls_thread_goes_on(monkeypatch):
    # http.client's BadStatusLine escaped the thread: every later event to that URL sat unsent until the stop.
    answers = [b"NOT HTTP AT ALL\r\n\r\n", b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n"]
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    got = []

    def serve() -> None:
        with contextlib.suppress(OSError):
            while True:
                connection = listener.accept()[0]
                with connection:
                    got.append(connection.recv(65536))
                    connection.sendall(answers[0] if len(got) == 1 else answers[1])

    threading.Thread(target=serve, daemon=True).start()
    outcomes = []
    sender = WebhookSender((f"http://127.0.0.1:{listener.getsockname()[1]}/h",), SECRET, retry_delays_s=(0.05,),
                           on_outcome=outcomes.append)
    try:
        sender.start()
        send(sender, "video.completed", "video_a", 1_700_000_000)
        _until(lambda: outcomes == ["delivered"])  # the garbled first answer, then the retry
        send(sender, "video.completed", "video_b", 1_700_000_001)
        _until(lambda: outcomes == ["delivered", "delivered"])
        assert all(thread.is_alive() for thread in sender._threads)
    finally:
        sender.stop(timeout_s=1.0)
        listener.close()


def test_an_event_after_the_stop_is_said_not_sent(caplog):
    sender = WebhookSender(("http://127.0.0.1:9/down",), SECRET)
    sender.start()
    sender.stop(timeout_s=0.5)
    send(sender, "video.completed", "video_late", 1_700_000_000)
    assert "webhook video.completed for video_late not sent: the server is stopping" in caplog.text


def test_a_url_with_a_password_is_refused_and_a_stray_secret_alone_is_unused(monkeypatch):
    with pytest.raises(ValueError, match=r"a user name or password in the URL is not sent") as raised:
        settings_from_options({"webhook_url": ["https://user:pw@hooks.example/k6"], "webhook_secret": SECRET})
    assert "pw" not in str(raised.value)
    monkeypatch.setenv("K6SERVE_WEBHOOK_SECRET", "short")  # no --webhook-url: not checked, not in the way
    assert settings_from_options({}).webhook_urls == ()


def test_a_job_failed_at_start_up_sends_its_event(tmp_path, receiver, monkeypatch):
    # Running when the server stopped for the second time: failed as the next server starts, which told no one.
    from k6serve.serve.jobs import MAX_ATTEMPTS, Job, JobStatus, SqliteJobStore

    store = SqliteJobStore(tmp_path / "jobs.sqlite3")
    store.insert(Job(id="video_twice", model="m", status=JobStatus.IN_PROGRESS, created_at=time.time(),
                     attempts=MAX_ATTEMPTS, params={"prompt": "p", "height": 32, "width": 32, "num_frames": 5}))
    store.close()
    kept_with_the_failure = []
    transition = SqliteJobStore.transition

    def watched(store, *args, **fields):
        job = transition(store, *args, **fields)
        if job is not None and fields.get("status") == JobStatus.FAILED:  # a process killed now keeps the rows
            kept_with_the_failure.extend((row.event_id, row.event_type) for row in store.pending_webhook_events())
        return job

    monkeypatch.setattr(SqliteJobStore, "transition", watched)
    server = start_server(tmp_path, webhook_urls=(receiver.url,), webhook_secret=SECRET)
    try:
        (headers, body), = receiver.wait(1)
        event = _verified(headers, body)
        assert (event["type"], event["data"]["id"]) == ("video.failed", "video_twice")
        assert kept_with_the_failure == [(event["id"], "video.failed")]
        assert server.store.get("video_twice").error_code == "server_restarted"
    finally:
        server.stop()


def test_a_job_failed_at_start_up_on_a_full_disk_still_fails_and_sends_from_memory(tmp_path, receiver, monkeypatch,
                                                                                   caplog):
    # The rows do not fit: the job's end is stored without them (else the start would fail), the event goes from
    # memory, and the memory-only entry is dropped once delivered.
    from k6serve.serve.jobs import MAX_ATTEMPTS, Job, JobStatus, SqliteJobStore

    store = SqliteJobStore(tmp_path / "jobs.sqlite3")
    store.insert(Job(id="video_twice", model="m", status=JobStatus.IN_PROGRESS, created_at=time.time(),
                     attempts=MAX_ATTEMPTS, params={"prompt": "p", "height": 32, "width": 32, "num_frames": 5}))
    store.close()
    transition = SqliteJobStore.transition

    def full_for_rows(store, *args, webhook_event=None, **fields):
        if webhook_event is not None:
            raise sqlite3.OperationalError("database or disk is full")
        return transition(store, *args, **fields)

    monkeypatch.setattr(SqliteJobStore, "transition", full_for_rows)
    server = start_server(tmp_path, webhook_urls=(receiver.url,), webhook_secret=SECRET)
    sender = server.app.state.ctx.runner.webhooks
    try:
        (headers, body), = receiver.wait(1)
        event = _verified(headers, body)
        assert (event["type"], event["data"]["id"]) == ("video.failed", "video_twice")
        assert server.store.get("video_twice").error_code == "server_restarted"
        assert server.store.pending_webhook_events() == []
        _until(lambda: not sender._memory_only)
        assert "could not be kept in the job store" in caplog.text
    finally:
        server.stop()


@pytest.fixture
def store(tmp_path):
    jobs = SqliteJobStore(tmp_path / "jobs.sqlite3")
    yield jobs
    jobs.close()


def test_events_undelivered_at_the_stop_are_kept_and_sent_at_the_next_start(receiver, store, caplog):
    # A receiver answering 503: both events are in a 30-minute wait at the stop, which ends it at once; both stay
    # in the store and the next sender delivers them with their own ids.
    caplog.set_level(logging.INFO, logger="k6serve.serve.webhooks")
    receiver.answers += [503] * 14
    first = WebhookSender((receiver.url,), SECRET, retry_delays_s=(0.01,) * 6 + (1800.0,), outbox=store)
    first.start()
    send(first, "video.completed", "video_a", 1_700_000_000)
    send(first, "video.failed", "video_b", 1_700_000_001)
    receiver.wait(14)  # 7 attempts each, then the 30-minute waits
    tried = {headers["webhook-id"] for headers, _ in receiver.received}
    stopping = time.monotonic()
    first.stop(timeout_s=0.2)
    assert time.monotonic() - stopping < 1.0  # the 30-minute waits were cut short, none attempted again
    _until(lambda: not any(thread.is_alive() for thread in first._threads))
    kept = store.pending_webhook_events()
    assert [(row.event_type, row.video_id, row.created_at, row.url) for row in kept] == [
        ("video.completed", "video_a", 1_700_000_000, receiver.url),
        ("video.failed", "video_b", 1_700_000_001, receiver.url)]
    assert {row.event_id for row in kept} == tried and len(receiver.received) == 14
    assert "kept in the job store and sent at the next start" in caplog.text and "dropped" not in caplog.text
    attempts_before = len(receiver.received)

    receiver.answers.clear()
    outcomes = []
    second = WebhookSender((receiver.url,), SECRET, outbox=store, on_outcome=outcomes.append)
    second.start()
    try:
        resent = receiver.wait(attempts_before + 2)[attempts_before:]
        _until(lambda: outcomes == ["delivered", "delivered"] and not store.pending_webhook_events())
    finally:
        second.stop(timeout_s=1.0)
    assert [headers["webhook-id"] for headers, _ in resent] == [row.event_id for row in kept]
    events = [_verified(headers, body) for headers, body in resent]  # signed again, with the same secret
    assert [(e["id"], e["type"], e["data"]["id"], e["created_at"]) for e in events] == [
        (row.event_id, row.event_type, row.video_id, row.created_at) for row in kept]
    assert "resending 2 webhook event(s) left from the last run" in caplog.text


def test_a_receiver_down_for_a_while_gets_its_events_with_one_warning_and_one_info(receiver, caplog):
    # Given up after five retries (~31 s), every event of a receiver's deploy or restart was lost for good; then a
    # warning per late event made one line per event of an outage.
    caplog.set_level(logging.INFO, logger="k6serve.serve.webhooks")
    outcomes = []
    sender = WebhookSender((receiver.url + "?token=secret-token",), SECRET, retry_delays_s=(0.02,) * 10,
                           on_outcome=outcomes.append)
    sender.start()
    try:
        receiver.answers += [503] * 14  # 7 attempts each
        send(sender, "video.completed", "video_a", 1_700_000_000)
        send(sender, "video.completed", "video_b", 1_700_000_001)
        _until(lambda: outcomes == ["delivered", "delivered"])
    finally:
        sender.stop(timeout_s=1.0)
    assert len(receiver.received) == 16
    warnings = [record.getMessage() for record in caplog.records if record.levelno == logging.WARNING]
    origin = receiver.url.removesuffix("/hooks")
    assert len(warnings) == 1 and warnings[0].startswith(f"webhooks to {origin}/... failing: video.completed for ")
    assert ("not delivered after 6 attempts over " in warnings[0] and "(HTTP 503); 2 event(s) waiting, each retried "
            "with backoff, up to 0.02 s apart, until 72 h after it was queued") in warnings[0]
    infos = [record.getMessage() for record in caplog.records if record.levelno == logging.INFO]
    assert len(infos) == 1 and infos[0].startswith(f"webhooks to {origin}/... delivered again after ")
    assert infos[0].endswith("; 1 event(s) pending")
    assert "secret-token" not in caplog.text and "/hooks" not in caplog.text


def test_an_event_its_receiver_keeps_refusing_holds_back_no_other(receiver):
    # In strict order, one payload a receiver's handler failed on blocked every later event for 72 hours.
    receiver.failing.add("video_a")
    outcomes = []
    sender = WebhookSender((receiver.url,), SECRET, retry_delays_s=(0.5,) * 4, on_outcome=outcomes.append)
    sender.start()
    try:
        started = time.monotonic()
        send(sender, "video.completed", "video_a", 1_700_000_000)
        send(sender, "video.completed", "video_b", 1_700_000_001)
        _until(lambda: outcomes == ["delivered"])
        assert time.monotonic() - started < 0.4  # before video_a's first retry
        ids = [json.loads(body)["data"]["id"] for _, body in receiver.received]
        assert ids == ["video_a", "video_b"]  # video_a's failed attempt, then video_b, delivered
    finally:
        sender.stop(timeout_s=0.2)


def test_a_stop_during_an_outage_returns_at_once_with_one_line(receiver, store, caplog):
    # Stopping with 2,000 events queued made 1,084 POSTs and 1,085 warnings, and waited 5 s for each retry wait.
    receiver.answers += [503] * 200
    outcomes = []
    sender = WebhookSender((receiver.url,), SECRET, retry_delays_s=(1800.0,), outbox=store,
                           on_outcome=outcomes.append)
    sender.start()
    for index in range(200):
        send(sender, "video.completed", f"video_{index}", 1_700_000_000 + index)
    receiver.wait(200)  # each attempted once, all in a 30-minute wait
    _until(lambda: sender.pending == 200)
    caplog.clear()
    stopping = time.monotonic()
    sender.stop()
    assert time.monotonic() - stopping < 1.0
    _until(lambda: not any(thread.is_alive() for thread in sender._threads))
    time.sleep(0.2)  # a POST made after the stop would show by now
    assert len(receiver.received) == 200 and outcomes == [] and sender.pending == 0
    warnings = [record.getMessage() for record in caplog.records if record.levelno >= logging.WARNING]
    assert len(warnings) == 1 and warnings[0].startswith(
        "webhooks not delivered before the server stopped, kept in the job store and sent at the next start: 200 to ")
    assert len(store.pending_webhook_events()) == 200


def test_a_stop_attempts_once_the_events_never_attempted_and_no_retry(receiver, store):
    from k6serve.serve import webhook_sender, webhook_transport

    receiver.failing.add("video_a")
    sender = WebhookSender((receiver.url,), SECRET, retry_delays_s=(0.3,) * 10, outbox=store)
    sender.start()
    try:
        send(sender, "video.completed", "video_a", 1_700_000_000)
        receiver.wait(1)  # video_a in its 0.3 s wait
        with sender._changed:  # video_b scheduled, not yet attempted, when the stop comes
            event = webhook_transport.Event("evt_b", "video.completed", 1, "video_b")
            sender._push(receiver.url, webhook_sender._Delivery(event, time.monotonic()), time.monotonic())
            sender._stopped = True
            sender._deadline = time.monotonic() + 2.0
            sender._changed.notify_all()
        receiver.wait(2)
        time.sleep(0.5)
    finally:
        sender.stop(timeout_s=0.1)
    assert [json.loads(body)["data"]["id"] for _, body in receiver.received] == ["video_a", "video_b"]


def test_a_retry_past_the_age_bound_gives_the_event_up(receiver, store, caplog):
    # Counted from when the event was first queued (the row's queued_at, an hour ago), not from this start.
    store.add_webhook_event("evt_old", "video.completed", "video_a", 1_700_000_000, (receiver.url,),
                            queued_at=time.time() - 3600)
    outcomes = []
    receiver.answers += [503] * 5  # before the start: its first attempt may come at once
    sender = WebhookSender((receiver.url,), SECRET, retry_delays_s=(0.05, 30.0), give_up_after_s=3610.0,
                           outbox=store, on_outcome=outcomes.append)
    sender.start()
    try:
        _until(lambda: outcomes == ["failed"] and not store.pending_webhook_events())
    finally:
        sender.stop(timeout_s=1.0)
    assert len(receiver.received) == 2  # the 0.05 s retry is made, the 30 s one would pass the bound
    assert "not delivered after 2 attempt(s) over " in caplog.text
    assert "(HTTP 503); the next retry would come over 1 h after it was queued" in caplog.text


def test_the_default_schedule_doubles_to_30_minutes_for_72_hours():
    assert RETRY_DELAYS_S[:12] == (1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0, 1800.0)
    assert set(RETRY_DELAYS_S[11:]) == {1800.0}
    assert sum(RETRY_DELAYS_S[:-1]) < RESEND_WINDOW_S == 72 * 3600 <= sum(RETRY_DELAYS_S)
    assert sum(RETRY_DELAYS_S[:5]) == 31.0  # the sixth attempt, after which the delivery is logged as late


_KILLED_AFTER_SEND = """
import os, signal, sys
from k6serve.serve.jobs import SqliteJobStore
from k6serve.serve.webhook_sender import WebhookSender
store = SqliteJobStore(sys.argv[1])
sender = WebhookSender((sys.argv[2],), sys.argv[3], outbox=store)
event = sender.new_event("video.completed", "video_killed", 1_700_000_000)
store.add_webhook_event(event.id, event.type, event.video_id, event.created_at, sender.urls)
sender.schedule(event)
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_a_server_killed_before_the_delivery_sends_the_event_at_its_next_start(tmp_path, receiver):
    # A job completed and its event queued, then SIGKILL before any attempt: the restarted server sends it.
    root = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    killed = subprocess.run([sys.executable, "-c", _KILLED_AFTER_SEND, str(tmp_path / "jobs.sqlite3"), receiver.url,
                             SECRET], env=env, capture_output=True, text=True, timeout=60)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    server = start_server(tmp_path, webhook_urls=(receiver.url,), webhook_secret=SECRET)
    try:
        (headers, body), = receiver.wait(1)
        event = _verified(headers, body)
        assert (event["type"], event["data"]["id"], event["created_at"]) == ("video.completed", "video_killed",
                                                                             1_700_000_000)
        assert headers["webhook-id"] == event["id"] and event["id"].startswith("evt_")
        _until(lambda: not server.store.pending_webhook_events())
    finally:
        server.stop()


def test_kept_events_for_a_removed_url_or_past_72_hours_are_dropped_at_the_start(receiver, store, caplog):
    caplog.set_level(logging.INFO, logger="k6serve.serve.webhooks")
    gone = "http://127.0.0.1:9/old-hook?token=tok-secret"
    store.add_webhook_event("evt_stale", "video.completed", "video_stale", 1_700_000_000, (receiver.url,),
                            queued_at=time.time() - 73 * 3600)
    store.add_webhook_event("evt_gone", "video.completed", "video_gone", 1_700_000_001, (gone, receiver.url))
    # Rows go in the order they were queued: had the stale one been sent, it would have come first.
    (headers, _), = _send_kept((receiver.url,), receiver, store, 1)
    assert headers["webhook-id"] == "evt_gone" and len(receiver.received) == 1
    assert ("webhook events left from the last run for URLs no longer given as --webhook-url are dropped: "
            "1 to http://127.0.0.1:9/...") in caplog.text
    assert ("webhook events left from the last run, queued over 72 h ago (the retry window: 72 h, or --output-ttl if "
            f"shorter), are dropped, not sent: 1 to {receiver.url.removesuffix('/hooks')}/... "
            "(video.completed video_stale)") in caplog.text
    assert "resending 1 webhook event(s) left from the last run" in caplog.text
    assert "tok-secret" not in caplog.text and "old-hook" not in caplog.text


@pytest.mark.parametrize("answers", [[400], [500, 500], [301]], ids=["refused", "retries-exhausted", "redirect"])
def test_a_delivery_given_up_for_good_removes_its_row(receiver, store, answers, monkeypatch):
    removed = []
    remove = store.remove_webhook_event
    monkeypatch.setattr(store, "remove_webhook_event", lambda *row: (removed.append(row), remove(*row)))
    outcomes = []
    sender = WebhookSender((receiver.url,), SECRET, retry_delays_s=(0.05,), outbox=store, on_outcome=outcomes.append)
    sender.start()
    try:
        receiver.answers += answers
        send(sender, "video.completed", "video_a", 1_700_000_000)
        received = receiver.wait(len(answers))
        _until(lambda: outcomes == ["failed"] and not store.pending_webhook_events())
    finally:
        sender.stop(timeout_s=1.0)
    assert len(receiver.received) == len(answers)
    assert removed == [(received[0][0]["webhook-id"], receiver.url)]


def test_an_event_the_store_cannot_keep_is_still_delivered_from_memory(tmp_path, receiver, caplog, monkeypatch):
    # The job's end and its event's rows are one write: the rows failing (a full disk) must not lose the job's end.
    server = start_server(tmp_path, webhook_urls=(receiver.url,), webhook_secret=SECRET)
    sender = server.app.state.ctx.runner.webhooks
    try:
        transition = server.store.transition

        def full_for_rows(*args, webhook_event=None, **fields):
            if webhook_event is not None:
                raise sqlite3.OperationalError("database or disk is full")
            return transition(*args, **fields)

        monkeypatch.setattr(server.store, "transition", full_for_rows)
        with server.client() as client:
            done = wait_for(client, client.post("/v1/videos", json={"prompt": "ok", **SMALL}).json()["id"])
            failed = wait_for(client, client.post("/v1/videos", json={"prompt": "fail", **SMALL}).json()["id"])
            received = receiver.wait(2)
        assert (done["status"], failed["status"]) == ("completed", "failed")
        assert [(event["type"], event["data"]["id"]) for event in (_verified(*pair) for pair in received)] == [
            ("video.completed", done["id"]), ("video.failed", failed["id"])]
        for job in (done, failed):
            assert (f"for {job['id']} could not be kept in the job store (database or disk is full); it is sent "
                    "from memory") in caplog.text
        assert server.store.pending_webhook_events() == []
        _until(lambda: not sender._memory_only)  # forgotten once delivered
    finally:
        server.stop()


def test_a_jobs_end_the_full_disk_holds_back_sends_one_event_once_written(tmp_path, receiver, monkeypatch):
    # Neither write fits: the finisher retries the job's end (a new event each time), and only the end that was
    # stored schedules its event.
    from k6serve.serve.jobs import JobStatus

    server = start_server(tmp_path, webhook_urls=(receiver.url,), webhook_secret=SECRET)
    sender = server.app.state.ctx.runner.webhooks
    try:
        transition = server.store.transition
        full = True

        def maybe_full(*args, **fields):
            if full and fields.get("status") == JobStatus.COMPLETED:
                raise sqlite3.OperationalError("database or disk is full")
            return transition(*args, **fields)

        monkeypatch.setattr(server.store, "transition", maybe_full)
        with server.client() as client:
            job = client.post("/v1/videos", json={"prompt": "ok", **SMALL}).json()["id"]
            time.sleep(1.5)  # the first try and one retry, each refused twice (with the rows, then without)
            assert client.get(f"/v1/videos/{job}").json()["status"] == "in_progress"
            full = False
            assert wait_for(client, job)["status"] == "completed"
            (headers, body), = receiver.wait(1)
        assert _verified(headers, body)["data"]["id"] == job
        _until(lambda: not server.store.pending_webhook_events())
        time.sleep(0.3)
        assert len(receiver.received) == 1 and not sender._memory_only
    finally:
        server.stop()


class ProcessKilled(Exception):
    """Stands for a SIGKILL: the code after the point it is raised at never runs."""


def test_a_server_killed_right_after_a_jobs_end_sends_its_event_at_the_next_start(tmp_path, receiver, monkeypatch):
    # The job's end was stored, then its event written in a second transaction: a process killed between the two
    # lost the event for good, though the job read completed.
    from k6serve.serve.jobs import JobStatus

    transition = SqliteJobStore.transition

    def killed_after_the_end(store, *args, **fields):
        job = transition(store, *args, **fields)
        if job is not None and fields.get("status") == JobStatus.COMPLETED:
            raise ProcessKilled
        return job

    monkeypatch.setattr(SqliteJobStore, "transition", killed_after_the_end)
    first = start_server(tmp_path, webhook_urls=(receiver.url,), webhook_secret=SECRET)
    try:
        with first.client() as client:
            done = wait_for(client, client.post("/v1/videos", json={"prompt": "ok", **SMALL}).json()["id"])
    finally:
        first.stop()
    monkeypatch.undo()
    assert done["status"] == "completed" and receiver.received == []
    second = start_server(tmp_path, webhook_urls=(receiver.url,), webhook_secret=SECRET)
    try:
        (headers, body), = receiver.wait(1)
        event = _verified(headers, body)
        assert (event["type"], event["data"]["id"], event["created_at"]) == ("video.completed", done["id"],
                                                                             done["completed_at"])
        _until(lambda: not second.store.pending_webhook_events())
    finally:
        second.stop()


def test_a_jobs_end_and_its_events_rows_are_written_together_or_not_at_all(store):
    from k6serve.serve.jobs import JobStatus, OutboxEvent

    for video_id in ("video_a", "video_b"):
        store.insert(Job(id=video_id, model="m", status=JobStatus.IN_PROGRESS, created_at=time.time(),
                         params={"prompt": "p"}))
    urls = ("http://a/1", "http://b/2")
    completed = store.transition("video_a", (JobStatus.IN_PROGRESS,), status=JobStatus.COMPLETED, completed_at=5.0,
                                 webhook_event=OutboxEvent("evt_a", "video.completed", "video_a", 5, urls))
    assert completed.status == JobStatus.COMPLETED
    assert [(row.event_id, row.url, row.event_type, row.video_id, row.created_at)
            for row in store.pending_webhook_events()] == [("evt_a", url, "video.completed", "video_a", 5)
                                                           for url in urls]
    # A transition that does not happen (the job has ended already) writes no rows.
    assert store.transition("video_a", (JobStatus.IN_PROGRESS,), status=JobStatus.FAILED,
                            webhook_event=OutboxEvent("evt_late", "video.failed", "video_a", 6, urls)) is None
    assert {row.event_id for row in store.pending_webhook_events()} == {"evt_a"}
    # Rows that do not fit (a full disk, as SQLite's max_page_count makes it) undo the job's end with them; the job's
    # end alone, an update in place, still fits: the runner's fallback.
    pages = store._db.execute("PRAGMA page_count").fetchone()[0]
    store._db.execute(f"PRAGMA max_page_count = {pages}")
    long_urls = tuple(f"http://a/{index}?token={'t' * 20_000}" for index in range(2))
    with pytest.raises(sqlite3.OperationalError, match="full"):
        store.transition("video_b", (JobStatus.IN_PROGRESS,), status=JobStatus.COMPLETED,
                         webhook_event=OutboxEvent("evt_b", "video.completed", "video_b", 7, long_urls))
    assert store.get("video_b").status == JobStatus.IN_PROGRESS
    assert {row.event_id for row in store.pending_webhook_events()} == {"evt_a"}
    assert store.transition("video_b", (JobStatus.IN_PROGRESS,), status=JobStatus.FAILED).status == JobStatus.FAILED


def test_an_event_kept_with_its_jobs_end_before_the_start_is_delivered_once(receiver, store):
    # The start reads the row of an event made before it and scheduled after it: it must leave it to `schedule`.
    from k6serve.serve.jobs import JobStatus

    store.insert(Job(id="video_a", model="m", status=JobStatus.IN_PROGRESS, created_at=time.time(),
                     params={"prompt": "p"}))
    outcomes = []
    sender = WebhookSender((receiver.url,), SECRET, outbox=store, on_outcome=outcomes.append)
    event = sender.new_event("video.completed", "video_a", 1_700_000_000)
    assert store.transition("video_a", (JobStatus.IN_PROGRESS,), status=JobStatus.COMPLETED,
                            webhook_event=sender.outbox_event(event)) is not None
    sender.start()
    sender.schedule(event)
    try:
        (headers, _), = receiver.wait(1)
        _until(lambda: outcomes == ["delivered"] and not store.pending_webhook_events())
        time.sleep(0.3)
    finally:
        sender.stop(timeout_s=1.0)
    assert len(receiver.received) == 1 and headers["webhook-id"] == event.id


def _full_disk_outbox(store, monkeypatch):
    def full_disk(*args, **kwargs) -> None:
        raise sqlite3.OperationalError("database or disk is full")

    monkeypatch.setattr(store, "add_webhook_event", full_disk)


def test_an_event_in_memory_only_is_forgotten_once_each_url_is_done_with_it(receiver, store, monkeypatch):
    # Its id stayed in the sender's memory-only set for good: one entry per event for as long as the disk was full.
    # Each state checked lasts until the test ends it (a retry 60 s away; no retry at all), not a second: a loaded
    # host could miss a one-second window.
    _full_disk_outbox(store, monkeypatch)
    refusing = Receiver()
    refusing.failing = {"video_a", "video_b"}
    try:
        # Delivered to one URL: forgotten there; kept for the other, which waits for its retry, until a stop drops it.
        sender = WebhookSender((receiver.url, refusing.url), SECRET, retry_delays_s=(60.0,), outbox=store)
        sender.start()
        try:
            send(sender, "video.completed", "video_a", 1_700_000_000)
            (headers, _), = receiver.wait(1)
            refusing.wait(1)
            _until(lambda: sender._memory_only == {(headers["webhook-id"], refusing.url)})
        finally:
            sender.stop(timeout_s=0.2)
        assert not sender._memory_only
        # Given up (no retry in this schedule): forgotten as well.
        outcomes = []
        sender = WebhookSender((refusing.url,), SECRET, retry_delays_s=(), outbox=store, on_outcome=outcomes.append)
        sender.start()
        try:
            send(sender, "video.failed", "video_b", 1_700_000_001)
            _until(lambda: outcomes == ["failed"])
            assert not sender._memory_only
        finally:
            sender.stop(timeout_s=0.2)
    finally:
        refusing.close()
    assert store.pending_webhook_events() == []


def test_a_store_from_before_the_outbox_opens_and_gains_it(tmp_path):
    path = tmp_path / "jobs.sqlite3"
    old = SqliteJobStore(path)
    old.insert(Job(id="video_old", model="m", created_at=time.time(), params={"prompt": "p"}))
    old.close()
    with contextlib.closing(sqlite3.connect(path)) as db:
        db.execute("DROP TABLE webhook_outbox")  # as a store written before it was
        db.commit()
        assert "webhook_outbox" not in {row[0] for row in db.execute("SELECT name FROM sqlite_master")}
    store = SqliteJobStore(path)
    try:
        assert store.get("video_old") is not None and store.pending_webhook_events() == []
        store.add_webhook_event("evt_1", "video.failed", "video_old", 1_700_000_000, ("http://a/1", "http://b/2"))
        assert [(row.event_id, row.url) for row in store.pending_webhook_events()] == [
            ("evt_1", "http://a/1"), ("evt_1", "http://b/2")]
        store.remove_webhook_event("evt_1", "http://a/1")
        assert [row.url for row in store.pending_webhook_events()] == ["http://b/2"]
    finally:
        store.close()


@pytest.mark.parametrize("spelling", ["https://hooks.example.com/k6", "https://Hooks.Example.com/k6",
                                      "HTTPS://hooks.example.com/k6", "https://hooks.example.com:443/k6",
                                      " https://HOOKS.example.com:443/k6 "])
def test_a_receiver_spelled_another_way_is_the_same_url(spelling):
    settings = settings_from_options({"webhook_url": [spelling, "https://hooks.example.com/k6"],
                                      "webhook_secret": SECRET})
    assert settings.webhook_urls == ("https://hooks.example.com/k6",)


@pytest.mark.parametrize(("given", "canonical"), [
    ("https://hooks.example.com/K6?Token=AbC", "https://hooks.example.com/K6?Token=AbC"),  # path, query as given
    ("http://hooks.example.com:443/k6", "http://hooks.example.com:443/k6"),  # not http's default port
    ("http://Hooks.example.com:80/k6?", "http://hooks.example.com/k6?"),  # an empty query's "?" kept
    ("https://[::1]:443/k6", "https://[::1]/k6"),
    ("https://hooks.example.com:8443", "https://hooks.example.com:8443"),
])
def test_only_the_scheme_host_and_default_port_are_made_canonical(given, canonical):
    assert check_webhook_url(given) == canonical


def test_a_restart_with_the_receiver_spelled_differently_sends_the_kept_events(receiver, store, caplog):
    # Matched as given, such a start dropped every kept row "for URLs no longer given as --webhook-url", and the
    # warning showed the configured URL's own scheme://host:port.
    caplog.set_level(logging.INFO, logger="k6serve.serve.webhooks")
    shouted = receiver.url.replace("http://", "HTTP://")
    store.add_webhook_event("evt_kept", "video.completed", "video_a", 1_700_000_000, (receiver.url,))
    (headers, _), = _send_kept((shouted,), receiver, store, 1)
    assert headers["webhook-id"] == "evt_kept" and "dropped" not in caplog.text
    # A row an older server stored under another spelling is sent too, and its row removed once delivered.
    store.add_webhook_event("evt_older", "video.failed", "video_b", 1_700_000_001, (shouted,))
    _send_kept((receiver.url,), receiver, store, 2)
    assert [headers["webhook-id"] for headers, _ in receiver.received] == ["evt_kept", "evt_older"]
    assert "dropped" not in caplog.text


def test_a_kept_event_for_another_path_on_a_configured_host_says_the_path_differs(receiver, store, caplog):
    origin = receiver.url.removesuffix("/hooks")
    store.add_webhook_event("evt_other", "video.completed", "video_a", 1_700_000_000,
                            (f"{origin}/old-hook?token=tok-secret", "http://127.0.0.1:9/gone"))
    sender = WebhookSender((receiver.url,), SECRET, outbox=store)
    sender.start()
    sender.stop(timeout_s=1.0)
    assert store.pending_webhook_events() == [] and receiver.received == []
    assert ("webhook events left from the last run for URLs no longer given as --webhook-url are dropped: "
            f"1 to {origin}/..., a --webhook-url's scheme, host and port with another path or query "
            "(video.completed video_a); 1 to http://127.0.0.1:9/... (video.completed video_a)") in caplog.text
    assert "tok-secret" not in caplog.text and "old-hook" not in caplog.text


def test_a_server_started_without_webhook_urls_drops_the_kept_events_saying_so(tmp_path, caplog):
    # Nothing read them: they waited, unsent, while the docs said this start dropped them.
    store = SqliteJobStore(tmp_path / "jobs.sqlite3")
    store.add_webhook_event("evt_a", "video.completed", "video_a", 1, ("https://hooks.example.com/k6?token=tok-a",))
    store.add_webhook_event("evt_b", "video.failed", "video_b", 2, ("https://hooks.example.com/k6?token=tok-a",
                                                                    "http://127.0.0.1:9/other"))
    store.close()
    server = start_server(tmp_path)
    try:
        assert server.store.pending_webhook_events() == []
    finally:
        server.stop()
    lines = [record.getMessage() for record in caplog.records if "webhook" in record.getMessage()]
    assert lines == ["3 webhook event(s) left from the last run are dropped, not sent, as no --webhook-url is given: "
                     "2 to https://hooks.example.com/... (video.completed video_a, video.failed video_b); "
                     "1 to http://127.0.0.1:9/... (video.failed video_b)"]


def test_many_dropped_events_make_a_short_warning_and_one_removal(store, caplog, monkeypatch):
    # Each dropped row was named in the warning (megabytes of log) and removed by its own DELETE and commit.
    now = time.time()
    for index in range(50):
        store.add_webhook_event(f"evt_g{index}", "video.completed", f"video_{index}", 1, ("https://old.example/h",),
                                queued_at=now - 10)
        store.add_webhook_event(f"evt_s{index}", "video.failed", f"video_{index}", 1, ("http://127.0.0.1:9/dead",),
                                queued_at=now - 80 * 3600)
    one_by_one, at_once = [], []
    remove_all = store.remove_webhook_events
    monkeypatch.setattr(store, "remove_webhook_event", lambda *row: one_by_one.append(row))
    monkeypatch.setattr(store, "remove_webhook_events", lambda rows: (at_once.append(list(rows)),
                                                                      remove_all(at_once[-1])))
    sender = WebhookSender(("http://127.0.0.1:9/dead",), SECRET, outbox=store)
    sender.start()
    sender.stop(timeout_s=0.5)
    assert one_by_one == [] and len(at_once) == 1 and len(at_once[0]) == 100
    assert store.pending_webhook_events() == []
    assert ("are dropped: 50 to https://old.example/... (video.completed video_0, video.completed video_1, "
            "video.completed video_2, and 47 more)") in caplog.text
    assert ("are dropped, not sent: 50 to http://127.0.0.1:9/... (video.failed video_0, video.failed video_1, "
            "video.failed video_2, and 47 more)") in caplog.text
    assert "video_3" not in caplog.text


def test_the_stops_warning_counts_the_events_it_leaves(store, caplog, monkeypatch):
    from k6serve.serve import webhook_sender

    monkeypatch.setattr(webhook_sender, "TIMEOUT_S", 2.5)  # the first event's attempt outlasts the stop's waits (1.2 s)
    hung = SilentListener()
    sender = WebhookSender((hung.url,), SECRET, outbox=store)
    try:
        sender.start()
        for index in range(20):
            send(sender, "video.completed", f"video_{index}", 1_700_000_000)
        _until(lambda: hung.connections)
        sender.stop(timeout_s=0.2)
        _until(lambda: not any(thread.is_alive() for thread in sender._threads), timeout_s=5.0)
    finally:
        hung.close()
    assert (f"kept in the job store and sent at the next start: 19 to {hung.url.removesuffix('/hung')}/... "
            "(video.completed video_1, video.completed video_2, video.completed video_3, and 16 more)") in caplog.text
    assert "video_4" not in caplog.text and len(store.pending_webhook_events()) == 20


def test_an_event_sent_before_the_start_is_delivered_once(receiver, store):
    # The start queued the kept row of the event `send` had queued already: the receiver got it twice.
    outcomes = []
    sender = WebhookSender((receiver.url,), SECRET, outbox=store, on_outcome=outcomes.append)
    send(sender, "video.failed", "video_a", 1_700_000_000)
    sender.start()
    try:
        receiver.wait(1)
        _until(lambda: outcomes == ["delivered"] and not store.pending_webhook_events())
        time.sleep(0.3)
    finally:
        sender.stop(timeout_s=1.0)
    assert len(receiver.received) == 1 and outcomes == ["delivered"]


def test_kept_events_are_resent_in_the_order_they_were_queued_whatever_the_clock(store):
    # Ordered by queued_at, a wall clock stepped back an hour between two events sent the later one first.
    store.add_webhook_event("evt_first", "video.completed", "video_a", 1, ("http://a/1",), queued_at=time.time())
    store.add_webhook_event("evt_second", "video.completed", "video_b", 2, ("http://a/1",),
                            queued_at=time.time() - 3600)
    assert [row.event_id for row in store.pending_webhook_events()] == ["evt_first", "evt_second"]


@pytest.mark.parametrize("url", ["http://127.0.0.1:9/hook?token=tok-secret x",
                                 "http://127.0.0.1:9/hook?token=tok-secret\n1",
                                 "http://127.0.0.1:9/ho\tok?token=tok-secret",
                                 "http://127.0.0.1:9/hook?token=tok\x7f"])
def test_a_url_with_whitespace_or_a_control_character_is_refused_without_its_token(url):
    # Accepted, each attempt raised http.client's InvalidURL, whose logged text held the whole URL, token and all.
    with pytest.raises(ValueError, match="holds a space or control character .* percent-encode it") as raised:
        settings_from_options({"webhook_url": [url], "webhook_secret": SECRET})
    assert "tok" not in str(raised.value) and "/ho" not in str(raised.value)


@pytest.mark.parametrize("url", ["http://127.0.0.1:9/caf\u00e9?token=tok-secret",
                                 "http://127.0.0.1:9/hook?token=tok-secr\u00e9t"])
def test_a_url_with_a_non_ascii_path_or_query_is_refused_without_its_token(url):
    # Accepted, each attempt raised UnicodeEncodeError (the request line is ASCII), retried for 72 hours.
    with pytest.raises(ValueError, match="non-ASCII character in its path or query.*percent-encode it") as raised:
        settings_from_options({"webhook_url": [url], "webhook_secret": SECRET})
    assert "tok" not in str(raised.value) and "caf" not in str(raised.value)


def test_a_non_ascii_host_is_kept_as_it_is_sent_idna_encoded():
    assert check_webhook_url("http://b\u00fccher.example/hook") == "http://b\u00fccher.example/hook"


@pytest.mark.parametrize("error", [
    lambda url: http.client.InvalidURL(f"URL can't contain control characters. {url!r} (found at least ' ')"),
    lambda url: OSError(f"could not send to {url}"),
    lambda url: RuntimeError(f"unforeseen, with {url.split('?')[1]}"),  # escapes `_deliver`: logged by its thread
], ids=["InvalidURL", "OSError", "unforeseen"])
def test_an_error_quoting_the_url_is_logged_without_its_path_or_query(caplog, monkeypatch, error):
    from k6serve.serve import webhook_sender

    url = "http://127.0.0.1:9/hook-path?token=tok-secret"

    class Refusing:
        def open(self, request, timeout):  # noqa: ANN001 - the opener's signature
            raise error(request.full_url)

    monkeypatch.setattr(webhook_sender, "OPENER", Refusing())
    outcomes = []
    sender = WebhookSender((url,), SECRET, retry_delays_s=(0.01,), on_outcome=outcomes.append)
    sender.start()
    try:
        send(sender, "video.completed", "video_a", 1_700_000_000)
        _until(lambda: outcomes == ["failed"])
    finally:
        sender.stop(timeout_s=1.0)
    failed = error(url)
    assert f"{type(failed).__name__}: the URL or request was refused (details not shown: they quote the URL)" in (
        caplog.text)
    assert "tok-secret" not in caplog.text and "hook-path" not in caplog.text


def test_pending_counts_the_scheduled_events_and_the_one_in_flight(receiver, monkeypatch):
    # GET /metrics shows a receiver that is down as a pending count that grows, for the hours its events are
    # retried, before anything is given up; a delivered event leaves it before it is counted delivered.
    from k6serve.serve import webhook_sender

    monkeypatch.setattr(webhook_sender, "TIMEOUT_S", 1.0)
    hung = SilentListener()
    sender = WebhookSender((hung.url,), SECRET, retry_delays_s=(1800.0,))
    try:
        sender.start()
        send(sender, "video.completed", "video_a", 1_700_000_000)
        send(sender, "video.completed", "video_b", 1_700_000_001)
        _until(lambda: hung.connections)  # video_a in flight, video_b scheduled
        with sender._changed:
            lane = sender._lanes[sender.urls[0]]
            assert lane.in_flight is not None and sender.pending == 2
        _until(lambda: len(hung.connections) == 2)  # timed out, in its wait; video_b in flight
        assert sender.pending == 2
        sender.stop(timeout_s=0.1)
        assert sender.pending == 0
    finally:
        hung.close()
    seen = []
    sender = WebhookSender((receiver.url,), SECRET, retry_delays_s=(0.05,),
                           on_outcome=lambda outcome: seen.append((outcome, sender.pending)))
    sender.start()
    try:
        receiver.answers = [503]
        send(sender, "video.completed", "video_a", 1_700_000_000)
        _until(lambda: seen)
        assert seen == [("delivered", 0)] and sender.pending == 0
    finally:
        sender.stop(timeout_s=1.0)


def test_the_age_bound_follows_the_output_ttl_and_drops_older_rows_at_the_start(receiver, store, caplog):
    # With the 24 h TTL, a 72 h retry named videos already deleted (404).
    assert age_bound(86400.0) == 86400.0 and age_bound(0.0) == RESEND_WINDOW_S == age_bound(10 * RESEND_WINDOW_S)
    store.add_webhook_event("evt_old", "video.completed", "video_old", 1, (receiver.url,),
                            queued_at=time.time() - 7200)
    store.add_webhook_event("evt_new", "video.completed", "video_new", 2, (receiver.url,),
                            queued_at=time.time() - 600)
    sender = WebhookSender((receiver.url,), SECRET, give_up_after_s=age_bound(3600.0), outbox=store)
    sender.start()
    try:
        (headers, _), = receiver.wait(1)
        _until(lambda: not store.pending_webhook_events())
    finally:
        sender.stop(timeout_s=0.5)
    assert headers["webhook-id"] == "evt_new" and len(receiver.received) == 1
    assert "queued over 1 h ago" in caplog.text and "(video.completed video_old)" in caplog.text


def test_a_row_queued_in_the_future_counts_as_queued_at_the_start(receiver, store, caplog):
    # A clock stepped back made its age negative: never dropped, and retried past the age bound.
    store.add_webhook_event("evt_ahead", "video.completed", "video_a", 1, (receiver.url,),
                            queued_at=time.time() + 3600)
    receiver.failing.add("video_a")
    outcomes = []
    sender = WebhookSender((receiver.url,), SECRET, retry_delays_s=(0.05,) * 40, give_up_after_s=0.5, outbox=store,
                           on_outcome=outcomes.append)
    sender.start()
    try:
        _until(lambda: outcomes == ["failed"])
    finally:
        sender.stop(timeout_s=0.5)
    assert 5 <= len(receiver.received) <= 12  # about 0.5 s of 0.05 s waits, not the 40 retries
    # Given up at the age bound: when a failed attempt finds its next retry past it, or, the retry's thread taking
    # the row late on a loaded machine (a CI run beside others), when the row comes due already past it.
    assert ("the next retry would come over 0.5 s after it was queued" in caplog.text
            or "(not sent: queued over 0.5 s ago)" in caplog.text), caplog.text


def test_backoff_delays_refuses_a_schedule_that_never_grows():
    with pytest.raises(ValueError, match="first_s and cap_s > 0"):
        backoff_delays(0.0, 1800.0, 3600.0)
    with pytest.raises(ValueError, match="first_s and cap_s > 0"):
        backoff_delays(1.0, -1.0, 3600.0)


def test_an_event_that_waited_past_the_age_bound_is_not_sent(caplog):
    # One thread a URL: behind slow attempts (up to 10 s each) an event waited past the bound, which follows
    # --output-ttl, and was sent for a video already deleted. It is given up before its attempt now.
    caplog.set_level(logging.WARNING, logger="k6serve.serve.webhooks")
    sender = WebhookSender(("http://127.0.0.1:9/h",), SECRET, give_up_after_s=1.0, retry_delays_s=(0.1,))
    attempted = []

    def slow_attempt(event, url, body):
        time.sleep(0.3)
        attempted.append(event.video_id)

    sender._attempt = slow_attempt  # noqa: SLF001 - a receiver answering in 0.3 s
    sender.start()
    try:
        for index in range(8):
            send(sender, "video.completed", f"v{index}", time.time())
        _until(lambda: sender.pending == 0)
    finally:
        sender.stop(timeout_s=0.2)
    assert 2 <= len(attempted) <= 4 and attempted == [f"v{index}" for index in range(len(attempted))]
    assert caplog.text.count("(not sent: queued over 1 s ago)") == 8 - len(attempted)


def test_an_attempt_in_flight_at_the_stop_is_in_its_summary_and_counted_once(caplog):
    caplog.set_level(logging.WARNING, logger="k6serve.serve.webhooks")
    outcomes: list[str] = []
    sender = WebhookSender(("http://127.0.0.1:9/h",), SECRET, retry_delays_s=(0.1,) * 5, on_outcome=outcomes.append)
    started = threading.Event()

    def failing_attempt(event, url, body):
        started.set()
        time.sleep(0.6)
        return "HTTP 503", True

    sender._attempt = failing_attempt  # noqa: SLF001
    sender.start()
    send(sender, "video.completed", "v_in_flight", time.time())
    assert started.wait(5)
    send(sender, "video.completed", "v_queued", time.time())
    sender.stop(timeout_s=0.1)
    assert "webhooks still being sent when the server stopped" in caplog.text and "v_in_flight" in caplog.text
    # Memory-only (no job store): the queued one is dropped at the stop, the one in flight once its attempt fails.
    _until(lambda: len(outcomes) == 2)
    time.sleep(0.7)
    assert outcomes == ["failed", "failed"]
