"""HTTP client for a `k6serve serve` server (standard library only): create a job, follow it, download the MP4.

Errors reach the user as `K6ServeError`, worded for a ComfyUI user: which node, which input, and what to change.
"""

from __future__ import annotations

import http.client
import json
import logging
import os
import select
import socket
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

API_KEY_ENV = "K6SERVE_API_KEY"
FINAL_STATUSES = ("completed", "failed", "cancelled")
# A poll that cannot reach the server is retried for this long before the node gives up (and tries to cancel).
POLL_OUTAGE_S = 30.0
# A server still loading its model (503 `model_loading`, from `k6serve serve`'s start until it serves) is waited
# for this long when the node has no timeout_s: a released checkpoint loads in minutes, not in half an hour.
LOADING_WAIT_S = 30 * 60.0
LOADING_POLL_S = 2.0
# A cancel that cannot reach the server is retried in the background this often, for POLL_OUTAGE_S: a server that
# restarts keeps its unfinished jobs (SQLite) and runs them again, so a job whose cancel was lost would take the GPU.
CANCEL_RETRY_S = 2.0
# An upload is sent with `Expect: 100-continue` and its body held back this long for the server's answer: k6serve
# answers at once, with 100 or with its refusal (413 over --max-upload-mb, 503 while loading). A server or proxy
# that ignores the header gets the body after the wait, as RFC 9110 10.1.1 lets a client do.
EXPECT_CONTINUE_S = 5.0
# K6ServeError.code of an upload whose connection the server closed while it was being sent (no 100-continue
# confirmed the size first): most likely over --max-upload-mb, so the create is not sent again.
UPLOAD_CUT_OFF = "upload_cut_off"
# While a request blocks the node (an upload being sent, an MP4 coming in), Cancel and timeout_s are looked at this
# often beside it (`_RequestWatch`): the socket's timeout bounds each read or write alone, so a server that took an
# upload or sent a video slowly held the node, deaf to both, for as long as it kept the bytes moving.
WATCH_S = 0.1


class K6ServeError(RuntimeError):
    """A failure the user can act on; the message names the node, the input and the fix. `status` is the HTTP
    status when the server answered with an error."""

    def __init__(self, message: str, *, status: int | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.code = code  # the server's error code (`model_loading`, ...), when it sent one


@dataclass(frozen=True)
class Deadline:
    """A node's timeout_s as one clock for its whole run (waiting for a loading server, creating the job, the job,
    its download): the input promises a limit with queue time included, not one per phase. `at` is None for 0."""

    timeout_s: float = 0.0
    at: float | None = None

    @classmethod
    def after(cls, timeout_s: float) -> Deadline:
        return cls(timeout_s, time.monotonic() + timeout_s if timeout_s > 0 else None)

    def passed(self) -> bool:
        return self.at is not None and time.monotonic() > self.at


def new_request_id() -> str:
    """The `request_id` of one node run: the job's id, so a create whose answer was lost can be sent again (the
    server replays the job) or cancelled by its id. 40 characters of the server's allowed `A-Za-z0-9._-`."""
    return f"comfyui-{uuid.uuid4().hex}"


@dataclass(frozen=True)
class Upload:
    """One multipart file field."""

    field: str
    file_name: str
    content_type: str
    data: bytes


class K6ServeClient:
    """One server, as seen by one node: `node_name` and `input_names` (server field -> node input) word errors."""

    def __init__(self, server_url: str, api_key: str = "", *, node_name: str,
                 input_names: Mapping[str, str] | None = None, request_timeout_s: float = 60.0) -> None:
        url = server_url.strip().rstrip("/")
        if not url.startswith(("http://", "https://")):
            raise K6ServeError(f"{node_name}: server_url must start with http:// or https://, got {server_url!r} "
                               "(e.g. http://127.0.0.1:30000).")
        self.base_url = url
        self.api_key = api_key.strip() or os.environ.get(API_KEY_ENV, "")
        self.node_name = node_name
        self.input_names = dict(input_names or {})
        self.request_timeout_s = request_timeout_s
        self.cancel_retry: threading.Thread | None = None  # the background retries of a lost cancel, if any

    # ---- routes ----

    def served_model(self, *, check_interrupt: Callable[[], None] = lambda: None, timeout_s: float = 0.0,
                     deadline: Deadline | None = None) -> dict:
        """The first entry of GET /v1/models (a server serves one model), which names its family. A server still
        loading its model is waited for (ComfyUI's Cancel and the deadline, `timeout_s` from now unless given,
        stop the wait; none: LOADING_WAIT_S), so a workflow queued while `k6serve serve` starts runs once it can."""
        deadline = deadline or Deadline.after(timeout_s)
        try:
            model = self._when_loaded(lambda: self._json("GET", "/v1/models"), check_interrupt, deadline)["data"][0]
        except K6ServeError as error:
            if error.status != 404:
                raise
            model = None  # some other web server (ComfyUI's own port, a URL ending in /v1): said below
        except (KeyError, IndexError, TypeError):
            model = None
        if not isinstance(model, dict) or "family" not in model:
            raise K6ServeError(
                f"{self.node_name}: the server at {self.base_url} is not a k6serve server (GET /v1/models did not "
                "answer as `k6serve serve` does). Set server_url to the address `k6serve serve` listens on, without "
                "a path such as /v1 (e.g. http://127.0.0.1:30000).")
        return model

    def _when_loaded(self, call: Callable[[], dict], check_interrupt: Callable[[], None], deadline: Deadline) -> dict:
        """`call()`, again every LOADING_POLL_S while the server answers 503 `model_loading`."""
        def still_loading(error: K6ServeError) -> K6ServeError:
            limit = deadline.timeout_s if deadline.at is not None else LOADING_WAIT_S
            fix = (f"Raise timeout_s, or set it to 0 to wait up to {LOADING_WAIT_S:g} s." if deadline.at is not None
                   else "Check the server's log, and run again once its GET /health says ok.")
            return K6ServeError(f"{self.node_name}: the server at {self.base_url} was still loading its model after "
                                f"{limit:g} s. {fix}", status=503, code="model_loading")

        return self._ride_out(call, check_interrupt, deadline, what="checking the server's model before sending "
                              "the job", retry_unreachable=False, give_up=still_loading,
                              on_deadline=lambda error: still_loading(error) if _loading(error) else error)

    def _ride_out(self, call: Callable[[], Any], check_interrupt: Callable[[], None], deadline: Deadline, *,
                  what: str, retry_unreachable: bool | Callable[[K6ServeError], bool] = True,
                  give_up: Callable[[K6ServeError], BaseException] = lambda error: error,
                  on_deadline: Callable[[K6ServeError], BaseException] = lambda error: error) -> Any:
        """`call()`, again while the server is unreachable (for POLL_OUTAGE_S) or answers that it is loading its
        model (a restart: until the deadline, or for LOADING_WAIT_S without one). A restarted `k6serve serve` binds
        its port before it loads, so a restart is a few seconds of refused connections, then minutes of 503
        `model_loading`; its jobs wait in SQLite meanwhile. Cancel (`check_interrupt`) and the deadline are heard
        between tries and while each one blocks (`_watched`)."""
        outage_since = loading_since = None
        while True:
            try:
                return self._watched(call, check_interrupt, deadline, what)
            except K6ServeError as error:
                if isinstance(error, _OutOfTime):
                    failure = on_deadline(error)
                    if failure is error:
                        raise
                    raise failure from error
                now = time.monotonic()
                if _loading(error):
                    if loading_since is None:
                        logger.info("%s: the server at %s is loading its model (started, or restarted); waiting "
                                    "for it (%s)", self.node_name, self.base_url, what)
                    loading_since, outage_since = loading_since or now, None
                    give_up_at = deadline.at if deadline.at is not None else loading_since + LOADING_WAIT_S
                    pause = LOADING_POLL_S
                elif _unreachable(error) and (retry_unreachable(error) if callable(retry_unreachable)
                                              else retry_unreachable):
                    outage_since = outage_since or now
                    give_up_at = outage_since + POLL_OUTAGE_S
                    pause = 1.0
                    logger.warning("%s: %s: the server did not answer (%s); retrying", self.node_name, what,
                                   error.__cause__)
                else:
                    raise
                # With a deadline, give_up_at is the deadline itself: a try that ends past it is worded as the
                # deadline (timeout_s), not as the loading limit that applies only without one.
                failure = (on_deadline(error) if deadline.passed() else give_up(error)) if now >= give_up_at else None
                if failure is None:
                    time.sleep(pause)
                    check_interrupt()
                    failure = on_deadline(error) if deadline.passed() else None
                if failure is error:
                    raise
                if failure is not None:
                    raise failure from error

    def _watched(self, call: Callable[[], Any], check_interrupt: Callable[[], None], deadline: Deadline,
                 what: str) -> Any:
        """`call()`, its sockets shut at Cancel or at the deadline (`_RequestWatch`): then ComfyUI's interrupt, or an
        `_OutOfTime` for the caller to word, instead of what the cut connection raised (a reset mid-upload would
        otherwise read as a refused size, a short MP4 as the network's fault, and be tried again)."""
        watch = _RequestWatch(check_interrupt, deadline)
        failure = None
        with watch:
            try:
                result = call()
            except BaseException as error:  # noqa: BLE001 - raised below, unless Cancel came meanwhile
                failure = error
        if watch.interrupt is not None:  # taken from ComfyUI on the watch's thread: raised here, or Cancel is lost
            raise watch.interrupt
        if failure is None:
            return result  # complete, even if the deadline came with its last bytes
        if watch.expired and isinstance(failure, K6ServeError):
            raise _OutOfTime(f"{self.node_name}: timeout_s={deadline.timeout_s:g} s ran out while {what}.") \
                from failure
        raise failure

    def create_job(self, fields: Mapping[str, Any], uploads: list[Upload] = (), *, request_id: str | None = None,
                   check_interrupt: Callable[[], None] = lambda: None, deadline: Deadline | None = None) -> dict:
        """POST /v1/videos: JSON without uploads, multipart/form-data with them.

        With a `request_id` (the job's id) the POST is sent again, the same bytes, while the server is unreachable
        or loading its model: one whose answer was lost created the job, and the server replays it for the same
        body rather than making a second. Given up (or Cancel meanwhile), the id is cancelled, so that a job the
        server did create does not run untracked."""
        fields = dict(fields)
        if request_id is not None:
            fields["request_id"] = request_id
        if uploads:
            body, content_type = _multipart(fields, uploads)  # built once: a retry must send the same bytes
        else:
            body, content_type = json.dumps(fields).encode(), "application/json"
        deadline = deadline or Deadline()

        def post() -> dict:
            return self._json("POST", "/v1/videos", body=body, content_type=content_type, upload=bool(uploads))

        if request_id is None:
            return post()

        def out_of_time(error: K6ServeError) -> K6ServeError:
            why = (": the server had not taken the request and answered by then." if isinstance(error, _OutOfTime)
                   else f": {error}")
            return K6ServeError(f"{self.node_name}: the job could not be sent within timeout_s="
                                f"{deadline.timeout_s:g} s (queue time included){why} Raise timeout_s, or 0 for "
                                "no limit.", status=error.status, code=error.code)

        try:
            return self._ride_out(post, check_interrupt, deadline, what="sending the job",
                                  retry_unreachable=lambda error: error.code != UPLOAD_CUT_OFF,
                                  on_deadline=out_of_time)
        except BaseException as error:
            if not _refused(error):  # the server may hold the job: its answer was lost, or the node stopped
                self._cancel_quietly(request_id)
            raise

    def get_job(self, job_id: str) -> dict:
        return self._json("GET", f"/v1/videos/{job_id}")

    def cancel_job(self, job_id: str) -> dict:
        """POST /v1/videos/{id}/cancel: a queued or running job stops at its next step (the server waits up to 10 s
        for that); a finished one is left as it is, answered 409 `video_finished`. Not DELETE, which deletes a
        finished job's record and MP4: a retried cancel may meet a job that completed meanwhile."""
        return self._json("POST", f"/v1/videos/{job_id}/cancel", timeout_s=max(self.request_timeout_s, 30.0))

    def download_content(self, job_id: str, path: Path, *, check_interrupt: Callable[[], None] = lambda: None,
                         deadline: Deadline | None = None) -> Path:
        """Stream GET /v1/videos/{id}/content into `path` (via a hidden partial file, renamed when complete). A
        download the network cuts off is started again, for POLL_OUTAGE_S, and one that meets a restarted server
        loading its model waits for it (until the deadline, or LOADING_WAIT_S): the job is done and its video waits
        on the server, so losing it to a reset would throw away the GPU's minutes for nothing. The job is finished:
        Cancel and the deadline stop the node, never delete the job."""
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(f".{path.name}.part")

        def where(error: K6ServeError) -> K6ServeError:
            return K6ServeError(f"{error} The video of job {job_id} is finished and stays on the server until it "
                                f"expires: GET {self.base_url}/v1/videos/{job_id}/content fetches it.",
                                status=error.status, code=error.code)

        try:
            self._ride_out(lambda: self._download_once(job_id, partial), check_interrupt, deadline or Deadline(),
                           what=f"downloading job {job_id}'s video", give_up=where, on_deadline=where)
            os.replace(partial, path)
        finally:
            partial.unlink(missing_ok=True)
        return path

    def _download_once(self, job_id: str, partial: Path) -> None:
        with self._open("GET", f"/v1/videos/{job_id}/content") as response, open(partial, "wb") as file:
            while True:
                try:  # the network's failures only: a local write error (a full disk) is not retried
                    chunk = response.read(1 << 20)
                except (http.client.HTTPException, OSError) as error:
                    raise self._connection_error(error) from error
                if not chunk:
                    break
                file.write(chunk)
        if response.length:
            # http.client ends a body that the peer closed short of its Content-Length without an error (by design,
            # for compatibility): the MP4 was saved cut short, as if complete.
            short = http.client.IncompleteRead(b"", response.length)
            raise self._connection_error(short) from short

    # ---- following a job ----

    def wait(self, job: dict, *, check_interrupt: Callable[[], None] = lambda: None,
             on_progress: Callable[[int], None] = lambda progress: None, timeout_s: float = 0.0,
             deadline: Deadline | None = None, poll_interval_s: float = 1.0) -> dict:
        """Poll until the job is final and return it; raise K6ServeError unless it completed.

        `check_interrupt` raises to stop waiting (ComfyUI's interrupt): the job is then cancelled on the server
        (POST /v1/videos/{id}/cancel), so the GPU moves on, and the exception propagates. The deadline (`timeout_s`
        from now unless given; 0 = none) cancels likewise."""
        job_id = job["id"]
        deadline = deadline or Deadline.after(timeout_s)
        interval = min(0.1, poll_interval_s)
        try:
            while job["status"] not in FINAL_STATUSES:
                on_progress(int(job.get("progress") or 0))
                check_interrupt()
                if deadline.passed():
                    raise self._timed_out(job, deadline.timeout_s)
                time.sleep(interval)
                interval = min(poll_interval_s, interval * 1.5)
                job = self._poll(job, check_interrupt, deadline)
        except BaseException:
            self._cancel_quietly(job_id)
            raise
        on_progress(int(job.get("progress") or 0))
        for warning in job.get("warnings") or ():
            logger.warning("%s: job %s: %s", self.node_name, job_id, warning)
        return self._check_final(job)

    def _poll(self, job: dict, check_interrupt: Callable[[], None], deadline: Deadline) -> dict:
        """GET the job, riding out an outage or a restart (the server keeps its jobs in SQLite, re-queues the
        running one and runs it once its model is loaded again); Cancel and timeout_s still stop the wait."""
        job_id = job["id"]

        def given_up(error: K6ServeError) -> K6ServeError:
            if not _loading(error):
                return error
            return K6ServeError(f"{self.node_name}: the server at {self.base_url} was still loading its model "
                                f"{LOADING_WAIT_S:g} s after it restarted under job {job_id}; the node gave up on "
                                "the job and asked the server to cancel it. Check the server's log.",
                                status=503, code="model_loading")

        return self._ride_out(lambda: self.get_job(job_id), check_interrupt, deadline,
                              what=f"polling job {job_id}", give_up=given_up,
                              on_deadline=lambda error: self._timed_out(job, deadline.timeout_s))

    def _timed_out(self, job: dict, timeout_s: float) -> K6ServeError:
        # Said before the cancel that follows it (`wait`), which may find the job ending its decode or the server
        # still unreachable: the node asks for the cancel, it cannot promise it.
        return K6ServeError(f"{self.node_name}: job {job['id']} did not finish within timeout_s={timeout_s:g} s "
                            f"(last seen {job['status']}, progress {job.get('progress')}%); the node asked the server "
                            "to cancel it (POST /v1/videos/{id}/cancel; the log says whether it did). Raise "
                            "timeout_s, or 0 for no limit.")

    def _cancel(self, job_id: str, *, when: str = "") -> None:
        """Cancel the job and log what happened; raises K6ServeError when the server did not answer (or is loading
        its model). The server decides in one step whether the job is still running: no GET before, no race."""
        try:
            answer = self.cancel_job(job_id)
        except K6ServeError as error:
            if error.status == 409 and error.code == "video_finished":
                self._log_already_ended(job_id, when)
            # Only the job's own 404: a plain `not_found` is a server without the cancel route (older than the nodes).
            elif error.status == 404 and error.code == "video_not_found":
                logger.info("%s: job %s is not on the server (never created there, or deleted)%s; nothing to "
                            "cancel", self.node_name, job_id, when)
            else:
                raise
            return
        logger.info("%s: cancelled job %s on the server%s (status %s)", self.node_name, job_id, when,
                    answer.get("status"))

    def _log_already_ended(self, job_id: str, when: str) -> None:
        """The 409 does not say how the job ended: a GET, for the log only (the video's URL when it completed)."""
        try:
            status = self.get_job(job_id).get("status")
        except (K6ServeError, ValueError, AttributeError):
            status = None
        kept = f"; its video: GET {self.base_url}/v1/videos/{job_id}/content" if status == "completed" else ""
        logger.info("%s: job %s had already ended on the server%s%s, so it was not cancelled%s", self.node_name,
                    job_id, f" ({status})" if status else "", when, kept)

    def _cancel_quietly(self, job_id: str) -> None:
        try:
            self._cancel(job_id)
        except (K6ServeError, ValueError) as error:  # the original exception matters more than a failed cancel
            if not (_unreachable(error) or _loading(error)):
                logger.warning("%s: could not cancel job %s on %s: %s", self.node_name, job_id, self.base_url,
                               error)
                return
            # Tried once, the cancel was lost with the server (a restart, a network blip) and the job ran on. The
            # retries run beside ComfyUI, which gets the node's error now (Cancel must not wait for an outage).
            logger.warning("%s: could not cancel job %s: %s (%s); retrying in the background every %g s",
                           self.node_name, job_id, self.base_url,
                           "is loading its model" if _loading(error) else error.__cause__, CANCEL_RETRY_S)
            self.cancel_retry = threading.Thread(target=self._cancel_when_reachable, args=(job_id,), daemon=True,
                                                 name=f"k6serve-cancel-{job_id}")
            self.cancel_retry.start()

    def _cancel_when_reachable(self, job_id: str) -> None:
        """Unreachable, the server is given POLL_OUTAGE_S to come back; once it answers that it is loading its model
        (a restart: the job is requeued and runs when the load ends), it is given the load's LOADING_WAIT_S."""
        started = time.monotonic()
        give_up_at = started + POLL_OUTAGE_S
        while time.monotonic() < give_up_at:
            time.sleep(CANCEL_RETRY_S)
            try:
                self._cancel(job_id, when=" once it answered again")
            except (K6ServeError, ValueError) as error:
                if _loading(error):
                    give_up_at = max(give_up_at, started + LOADING_WAIT_S)
                    continue
                if _unreachable(error):
                    continue
                logger.warning("%s: could not cancel job %s on %s: %s", self.node_name, job_id, self.base_url,
                               error)
            return
        logger.warning("%s: gave up cancelling job %s after %.0f s: %s did not take the cancel; the job may still "
                       "run there (POST /v1/videos/%s/cancel cancels it)", self.node_name, job_id,
                       time.monotonic() - started, self.base_url, job_id)

    def _check_final(self, job: dict) -> dict:
        if job["status"] == "completed":
            return job
        error = job.get("error") or {}
        if job["status"] == "cancelled":
            raise K6ServeError(f"{self.node_name}: job {job['id']} was cancelled on the server "
                               f"({error.get('message') or 'a cancel from another client'}).")
        code = error.get("code") or "unknown"
        hint = {
            "out_of_memory": " Lower width/height or num_frames, or start the server with --performance-mode "
                             "balanced or memory.",
            "invalid_request": " Check the inputs named in the message.",
            "server_restarted": " The server died twice while running it; check the server's log.",
        }.get(code, " See the server's log for details.")
        raise K6ServeError(f"{self.node_name}: job {job['id']} failed on the server ({code}): "
                           f"{error.get('message') or 'no message'}.{hint}")

    # ---- HTTP ----

    def _json(self, method: str, route: str, *, body: bytes | None = None, content_type: str | None = None,
              timeout_s: float | None = None, upload: bool = False) -> dict:
        if upload and self._direct():
            raw = self._send_expecting_continue(route, body, content_type, timeout_s)
        else:
            upload_bytes = len(body) if upload and body else 0
            try:
                with self._open(method, route, body=body, content_type=content_type, timeout_s=timeout_s,
                                upload_bytes=upload_bytes) as response:
                    raw = response.read()
            except (http.client.HTTPException, OSError) as error:
                # Cut off after the headers (a reset, a short body): unreachable like a refused connection, so a
                # poll rides it out and a lost cancel is retried, instead of a raw traceback from the node.
                raise self._connection_error(error, upload_bytes=upload_bytes) from error
        try:
            return json.loads(raw)
        except ValueError:  # e.g. an HTML page from another web server or a proxy in front of it
            raise K6ServeError(f"{self.node_name}: {method} {self.base_url}{route} answered with something other "
                               f"than JSON ({raw[:80]!r}); is server_url the address of `k6serve serve`?") from None

    def _open(self, method: str, route: str, *, body: bytes | None = None, content_type: str | None = None,
              timeout_s: float | None = None, upload_bytes: int = 0):
        request = urllib.request.Request(self.base_url + route, data=body, method=method,
                                         headers=self._headers(content_type))
        # urlopen's opener, proxies from the environment included, with connections that `_RequestWatch` can shut.
        opener = urllib.request.build_opener(_WatchedHTTPHandler, _WatchedHTTPSHandler)
        try:
            return opener.open(request, timeout=timeout_s or self.request_timeout_s)
        except urllib.error.HTTPError as error:
            raise self._http_error(error.code, error.headers, error.read(), method, route) from None
        except (urllib.error.URLError, OSError) as error:
            raise self._connection_error(error, upload_bytes=upload_bytes) from error

    def _headers(self, content_type: str | None) -> dict[str, str]:
        headers = {"Accept": "application/json"}
        if content_type is not None:
            headers["Content-Type"] = content_type
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        return headers

    def _direct(self) -> bool:
        """Whether urllib would reach the server without a proxy (HTTP_PROXY, ...): uploads then go through
        `_send_expecting_continue`. Through a proxy, or over https, they take urllib's way."""
        parts = urllib.parse.urlsplit(self.base_url)
        return parts.scheme == "http" and (
            "http" not in urllib.request.getproxies() or bool(urllib.request.proxy_bypass(parts.hostname or "")))

    def _send_expecting_continue(self, route: str, body: bytes, content_type: str | None,
                                 timeout_s: float | None) -> bytes:
        """POST an upload with `Expect: 100-continue` (urllib cannot), so a server refusing it answers before the
        body is sent: over --max-upload-mb, k6serve reads at most 64 MiB of a body it refuses and then closes, and
        urllib, still sending, got a reset and said that the server could not be reached instead of the 413."""
        parts = urllib.parse.urlsplit(self.base_url)
        connection = _WatchedHTTPConnection(parts.hostname, parts.port or 80,
                                            timeout=timeout_s or self.request_timeout_s)
        confirmed = False  # the server said 100 Continue: the size is accepted, a reset is the network's
        try:
            connection.putrequest("POST", parts.path + route)
            for name, value in {**self._headers(content_type), "Content-Length": str(len(body)),
                                "Expect": "100-continue"}.items():
                connection.putheader(name, value)
            connection.endheaders()
            answer = _await_continue(connection.sock)
            confirmed = answer == "continue"
            if answer != "final":
                connection.send(body)
            response = connection.getresponse()
            raw = response.read()
        except (http.client.HTTPException, OSError) as error:
            raise self._connection_error(error, upload_bytes=0 if confirmed else len(body)) from error
        finally:
            connection.close()
        if response.status >= 400:
            raise self._http_error(response.status, response.headers, raw, "POST", route)
        return raw

    def _http_error(self, status: int, headers: Any, raw: bytes, method: str, route: str) -> K6ServeError:
        try:
            detail = json.loads(raw)["error"]
            message, code, param = detail.get("message", ""), detail.get("code", ""), detail.get("param")
        except (ValueError, KeyError, TypeError):
            message, code, param = raw.decode("utf-8", "replace")[:500], "", None
        where = f"{method} {self.base_url}{route}"
        said = {"status": status, "code": code or None}
        if status == 401:
            return K6ServeError(f"{self.node_name}: the server at {self.base_url} needs an API key ({message}). "
                                f"Set the api_key input, or {API_KEY_ENV} in ComfyUI's environment, to the "
                                "server's --api-key.", **said)
        if status == 429:
            retry = headers.get("Retry-After")
            return K6ServeError(f"{self.node_name}: the server's queue is full ({message}). Try again"
                                f"{f' in {retry} s' if retry else ' later'}, or start the server with a larger "
                                "--max-queued-jobs.", **said)
        if status == 413:
            return K6ServeError(f"{self.node_name}: the upload is too large for the server ({message}). Send a "
                                "shorter or smaller clip, or start the server with a larger --max-upload-mb.", **said)
        if status == 400 and param:
            node_input = self.input_names.get(param, param)
            return K6ServeError(f"{self.node_name}: the server refused the input '{node_input}' "
                                f"(server field '{param}', {code}): {message} Change '{node_input}' and run again.",
                                **said)
        code_text = f", {code}" if code else ""
        return K6ServeError(f"{self.node_name}: {where} answered HTTP {status}{code_text}: {message}", **said)

    def _connection_error(self, error: Exception, *, upload_bytes: int = 0) -> K6ServeError:
        reason = getattr(error, "reason", error)
        if upload_bytes and isinstance(reason, (ConnectionResetError, BrokenPipeError, ConnectionAbortedError)):
            # A server closing the connection mid-upload is most often refusing its size (k6serve reads at most
            # 64 MiB of a refused body, then closes); "cannot reach the server" would send the user looking for it.
            return K6ServeError(
                f"{self.node_name}: the server at {self.base_url} closed the connection while the node was sending "
                f"its {upload_bytes / 2**20:.1f} MiB upload ({reason}); most likely the upload is larger than the "
                "server's --max-upload-mb (default 512). Send a shorter or smaller clip, or start the server with a "
                "larger --max-upload-mb.", code=UPLOAD_CUT_OFF)
        if isinstance(reason, ConnectionRefusedError):
            port = urllib.parse.urlsplit(self.base_url).port or 30000
            return K6ServeError(
                f"{self.node_name}: no k6serve server is listening at {self.base_url} (connection refused). "
                f"Start one with `k6serve serve --model-path <checkpoint> --port {port}` (a generation checkpoint "
                "for K6Serve Generate, a VSR checkpoint for K6Serve Upscale), or set server_url to where it runs.")
        if isinstance(reason, (socket.timeout, TimeoutError)):
            return K6ServeError(f"{self.node_name}: the server at {self.base_url} did not answer within "
                                f"{self.request_timeout_s:g} s. Check that it is running and reachable.")
        return K6ServeError(f"{self.node_name}: cannot reach the server at {self.base_url}: {reason}. Check "
                            "server_url and that `k6serve serve` is running.")


class _OutOfTime(K6ServeError):
    """The deadline came while a request was under way and its connection was shut (`_watched`)."""


class _RequestWatch:
    """Cancel and the deadline, heard while one request blocks the node's thread in a send or a read: every WATCH_S a
    thread beside it calls `check_interrupt` and looks at the deadline, and on either shuts the request's sockets,
    which ends the blocked call at once. ComfyUI's check clears its flag as it raises, so the exception is kept in
    `interrupt` for the node's thread to raise. The connections made on the node's thread while the watch is on
    register their sockets (`_WatchedHTTPConnection`); one registered after the watch tripped is shut at once."""

    _current = threading.local()  # the watch on this thread, for the connections its request opens

    def __init__(self, check_interrupt: Callable[[], None], deadline: Deadline) -> None:
        self.check_interrupt = check_interrupt
        self.deadline = deadline
        self.interrupt: BaseException | None = None
        self.expired = False
        self._sockets: list[socket.socket] = []
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True, name="k6serve-request-watch")

    def __enter__(self) -> _RequestWatch:
        _RequestWatch._current.value = self
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._done.set()
        self._thread.join()  # so that no interrupt is taken after the node's thread looked
        _RequestWatch._current.value = None

    @classmethod
    def register(cls, sock: socket.socket) -> None:
        watch = getattr(cls._current, "value", None)
        if watch is None:
            return
        with watch._lock:
            watch._sockets.append(sock)
            tripped = watch.interrupt is not None or watch.expired
        if tripped:
            _shut(sock)

    def _watch(self) -> None:
        while not self._done.wait(WATCH_S):
            try:
                self.check_interrupt()
            except BaseException as error:  # noqa: BLE001 - ComfyUI's interrupt, raised on the node's thread
                with self._lock:
                    self.interrupt = error
                    sockets = list(self._sockets)
            else:
                if not self.deadline.passed():
                    continue
                with self._lock:
                    self.expired = True
                    sockets = list(self._sockets)
            for sock in sockets:
                _shut(sock)
            return


def _shut(sock: socket.socket) -> None:
    # shutdown, not close: it wakes a send or recv blocked on the socket in another thread; close may not.
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:  # already closed by the peer or by http.client
        pass


class _WatchedHTTPConnection(http.client.HTTPConnection):
    def connect(self) -> None:
        super().connect()
        _RequestWatch.register(self.sock)


class _WatchedHTTPSConnection(http.client.HTTPSConnection):
    def connect(self) -> None:
        # http.client's HTTPSConnection.connect, with the TLS handshake watched too: a server that took the TCP
        # connection and never answered the handshake held a Cancel for the socket's whole timeout (60 s). Wrapping
        # detaches the TCP socket's descriptor from its object, so the watch holds a duplicate through the
        # handshake: shutdown acts on the connection, not on one descriptor, and ends the handshake's blocked read.
        http.client.HTTPConnection.connect(self)  # TCP, and a proxy's CONNECT tunnel where there is one
        handshake = self.sock.dup()
        try:
            _RequestWatch.register(handshake)
            self.sock = self._context.wrap_socket(self.sock, server_hostname=self._tunnel_host or self.host)
            _RequestWatch.register(self.sock)
        finally:
            handshake.close()  # a shutdown of it after this raises OSError, which `_shut` ignores


class _WatchedHTTPHandler(urllib.request.HTTPHandler):
    def http_open(self, req: urllib.request.Request) -> http.client.HTTPResponse:
        return self.do_open(_WatchedHTTPConnection, req)


class _WatchedHTTPSHandler(urllib.request.HTTPSHandler):
    def https_open(self, req: urllib.request.Request) -> http.client.HTTPResponse:
        return self.do_open(_WatchedHTTPSConnection, req, context=self._context)


def _unreachable(error: Exception) -> bool:
    """The server did not answer (refused, reset, timed out), as opposed to answering with an error."""
    return isinstance(error.__cause__, (urllib.error.URLError, OSError, http.client.HTTPException))


def _loading(error: Exception) -> bool:
    """The server answered that it is still loading its model (`k6serve serve` while it starts, or restarts)."""
    return isinstance(error, K6ServeError) and error.status == 503 and error.code == "model_loading"


def _refused(error: BaseException) -> bool:
    """The server answered a create with a 4xx: it made no job (a 409 `request_id_conflict` names another one)."""
    return isinstance(error, K6ServeError) and error.status is not None and 400 <= error.status < 500


def _await_continue(sock: socket.socket) -> str:
    """After a request's head sent with `Expect: 100-continue`: "continue" once the server's interim 100 has come
    (and was read off the socket), "final" when its final answer came instead (left unread, for http.client), or
    "silent" when nothing came within EXPECT_CONTINUE_S."""
    deadline = time.monotonic() + EXPECT_CONTINUE_S
    while True:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([sock], [], [], left)[0]:
            return "silent"
        head = sock.recv(1024, socket.MSG_PEEK)  # "HTTP/1.1 100 Continue\r\n\r\n"; bytes 9-11 the status
        if not head or (len(head) >= 12 and head[9:12] != b"100"):
            return "final"  # or closed: getresponse() says so
        end = head.find(b"\r\n\r\n")
        if end >= 0:
            sock.recv(end + 4)  # only the 100's bytes: nothing else comes before the body is sent
            return "continue"
        time.sleep(0.01)  # the interim answer came in pieces


def _multipart(fields: Mapping[str, Any], uploads: list[Upload]) -> tuple[bytes, str]:
    """A multipart/form-data body: text fields as strings (objects as JSON text, booleans as true/false)."""
    boundary = f"k6serve-comfyui-{uuid.uuid4().hex}"
    parts: list[bytes] = []
    for name, value in fields.items():
        if isinstance(value, bool):
            text = "true" if value else "false"
        elif isinstance(value, (dict, list)):
            text = json.dumps(value)
        else:
            text = str(value)
        parts.append(f'--{boundary}\r\nContent-Disposition: form-data; name="{name}"\r\n\r\n'.encode()
                     + text.encode("utf-8") + b"\r\n")
    for upload in uploads:
        file_name = upload.file_name.replace('"', "_").replace("\r", "_").replace("\n", "_")
        parts.append(f'--{boundary}\r\nContent-Disposition: form-data; name="{upload.field}"; '
                     f'filename="{file_name}"\r\nContent-Type: {upload.content_type}\r\n\r\n'.encode()
                     + upload.data + b"\r\n")
    parts.append(f"--{boundary}--\r\n".encode())
    return b"".join(parts), f"multipart/form-data; boundary={boundary}"
