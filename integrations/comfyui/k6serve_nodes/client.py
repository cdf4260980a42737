"""HTTP client for a `k6serve serve` server (standard library only): create a job, follow it, download the MP4.

Errors reach the user as `K6ServeError`, worded for a ComfyUI user: which node, which input, and what to change.
"""

from __future__ import annotations

import http.client
import json
import logging
import os
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
# restarts keeps its unfinished jobs (SQLite) and runs them again, so a job whose DELETE was lost would take the GPU.
CANCEL_RETRY_S = 2.0


class K6ServeError(RuntimeError):
    """A failure the user can act on; the message names the node, the input and the fix. `status` is the HTTP
    status when the server answered with an error."""

    def __init__(self, message: str, *, status: int | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.code = code  # the server's error code (`model_loading`, ...), when it sent one


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
        self.cancel_retry: threading.Thread | None = None  # the background retries of a lost DELETE, if any

    # ---- routes ----

    def served_model(self, *, check_interrupt: Callable[[], None] = lambda: None, timeout_s: float = 0.0) -> dict:
        """The first entry of GET /v1/models (a server serves one model), which names its family. A server still
        loading its model is waited for (ComfyUI's Cancel and `timeout_s`, 0 = LOADING_WAIT_S, stop the wait), so
        a workflow queued while `k6serve serve` starts runs once it can."""
        try:
            model = self._when_loaded(lambda: self._json("GET", "/v1/models"), check_interrupt, timeout_s)["data"][0]
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

    def _when_loaded(self, call: Callable[[], dict], check_interrupt: Callable[[], None], timeout_s: float) -> dict:
        """`call()`, again every LOADING_POLL_S while the server answers 503 `model_loading`."""
        limit = timeout_s if timeout_s > 0 else LOADING_WAIT_S
        deadline = time.monotonic() + limit
        said = False
        while True:
            try:
                return call()
            except K6ServeError as error:
                if error.code != "model_loading":
                    raise
                if not said:
                    logger.info("%s: the server at %s is loading its model; waiting for it", self.node_name,
                                self.base_url)
                    said = True
                check_interrupt()
                if time.monotonic() > deadline:
                    fix = (f"Raise timeout_s, or set it to 0 to wait up to {LOADING_WAIT_S:g} s." if timeout_s > 0
                           else "Check the server's log, and run again once its GET /health says ok.")
                    raise K6ServeError(f"{self.node_name}: the server at {self.base_url} was still loading its model "
                                       f"after {limit:g} s. {fix}", status=503, code="model_loading") from None
                time.sleep(LOADING_POLL_S)

    def create_job(self, fields: Mapping[str, Any], uploads: list[Upload] = ()) -> dict:
        """POST /v1/videos: JSON without uploads, multipart/form-data with them."""
        if uploads:
            body, content_type = _multipart(fields, uploads)
        else:
            body, content_type = json.dumps(dict(fields)).encode(), "application/json"
        return self._json("POST", "/v1/videos", body=body, content_type=content_type)

    def get_job(self, job_id: str) -> dict:
        return self._json("GET", f"/v1/videos/{job_id}")

    def cancel_job(self, job_id: str) -> dict:
        """DELETE on a running job stops it at the next step; the server waits up to 10 s for that."""
        return self._json("DELETE", f"/v1/videos/{job_id}", timeout_s=max(self.request_timeout_s, 30.0))

    def download_content(self, job_id: str, path: Path) -> Path:
        """Stream GET /v1/videos/{id}/content into `path` (via a hidden partial file, renamed when complete). A
        download the network cuts off is started again, for POLL_OUTAGE_S: the job is done and its video waits on
        the server, so losing it to a reset would throw away the GPU's minutes for nothing."""
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(f".{path.name}.part")
        give_up_at = time.monotonic() + POLL_OUTAGE_S
        try:
            while True:
                try:
                    self._download_once(job_id, partial)
                    break
                except K6ServeError as error:
                    if not _unreachable(error):
                        raise
                    if time.monotonic() > give_up_at:
                        raise K6ServeError(f"{error} The video of job {job_id} is finished and stays on the server "
                                           f"until it expires: GET {self.base_url}/v1/videos/{job_id}/content "
                                           "fetches it.") from error
                    logger.warning("%s: downloading job %s's video failed (%s); retrying", self.node_name, job_id,
                                   error.__cause__)
                    time.sleep(1.0)
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
             poll_interval_s: float = 1.0) -> dict:
        """Poll until the job is final and return it; raise K6ServeError unless it completed.

        `check_interrupt` raises to stop waiting (ComfyUI's interrupt): the job is then cancelled on the server
        with DELETE, so the GPU moves on, and the exception propagates. A timeout (0 = none) cancels likewise."""
        job_id = job["id"]
        deadline = time.monotonic() + timeout_s if timeout_s > 0 else None
        interval = min(0.1, poll_interval_s)
        try:
            while job["status"] not in FINAL_STATUSES:
                on_progress(int(job.get("progress") or 0))
                check_interrupt()
                if deadline is not None and time.monotonic() > deadline:
                    raise self._timed_out(job, timeout_s)
                time.sleep(interval)
                interval = min(poll_interval_s, interval * 1.5)
                job = self._poll(job, check_interrupt, deadline=deadline, timeout_s=timeout_s)
        except BaseException:
            self._cancel_quietly(job_id)
            raise
        on_progress(int(job.get("progress") or 0))
        for warning in job.get("warnings") or ():
            logger.warning("%s: job %s: %s", self.node_name, job_id, warning)
        return self._check_final(job)

    def _poll(self, job: dict, check_interrupt: Callable[[], None], *, deadline: float | None,
              timeout_s: float) -> dict:
        """GET the job, riding out a short outage (a restarting server keeps its jobs in SQLite); Cancel and
        timeout_s still stop the wait meanwhile."""
        job_id = job["id"]
        outage_until = time.monotonic() + POLL_OUTAGE_S
        while True:
            try:
                return self.get_job(job_id)
            except K6ServeError as error:
                if not _unreachable(error) or time.monotonic() > outage_until:
                    raise
                logger.warning("%s: polling job %s failed (%s); retrying", self.node_name, job_id, error.__cause__)
                time.sleep(1.0)
                check_interrupt()
                if deadline is not None and time.monotonic() > deadline:
                    raise self._timed_out(job, timeout_s) from None

    def _timed_out(self, job: dict, timeout_s: float) -> K6ServeError:
        # Said before the DELETE that follows it (`wait`), which may find the job ending its decode or the server
        # still unreachable: the node asks for the cancel, it cannot promise it.
        return K6ServeError(f"{self.node_name}: job {job['id']} did not finish within timeout_s={timeout_s:g} s "
                            f"(last seen {job['status']}, progress {job.get('progress')}%); the node asked the server "
                            "to cancel it (DELETE /v1/videos/{id}; the log says whether it did). Raise timeout_s, or "
                            "0 for no limit.")

    def _cancel_quietly(self, job_id: str) -> None:
        try:
            job = self.cancel_job(job_id)
            logger.info("%s: cancelled job %s on the server (status %s)", self.node_name, job_id,
                        job.get("status"))
        except (K6ServeError, ValueError) as error:  # the original exception matters more than a failed cancel
            if not (_unreachable(error) or _loading(error)):
                logger.warning("%s: could not cancel job %s on %s: %s", self.node_name, job_id, self.base_url,
                               error)
                return
            # Tried once, the DELETE was lost with the server (a restart, a network blip) and the job ran on. The
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
                job = self.cancel_job(job_id)
            except (K6ServeError, ValueError) as error:
                if _loading(error):
                    give_up_at = max(give_up_at, started + LOADING_WAIT_S)
                    continue
                if _unreachable(error):
                    continue
                logger.warning("%s: could not cancel job %s on %s: %s", self.node_name, job_id, self.base_url,
                               error)
                return
            logger.info("%s: cancelled job %s on the server once it answered again (status %s)", self.node_name,
                        job_id, job.get("status"))
            return
        logger.warning("%s: gave up cancelling job %s after %.0f s: %s did not take the DELETE; the job may still "
                       "run there (DELETE /v1/videos/%s cancels it)", self.node_name, job_id,
                       time.monotonic() - started, self.base_url, job_id)

    def _check_final(self, job: dict) -> dict:
        if job["status"] == "completed":
            return job
        error = job.get("error") or {}
        if job["status"] == "cancelled":
            raise K6ServeError(f"{self.node_name}: job {job['id']} was cancelled on the server "
                               f"({error.get('message') or 'DELETE from another client'}).")
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
              timeout_s: float | None = None) -> dict:
        try:
            with self._open(method, route, body=body, content_type=content_type, timeout_s=timeout_s) as response:
                raw = response.read()
        except (http.client.HTTPException, OSError) as error:
            # Cut off after the headers (a reset, a short body): unreachable like a refused connection, so a poll
            # rides it out and a lost cancel is retried, instead of a raw traceback from the node.
            raise self._connection_error(error) from error
        try:
            return json.loads(raw)
        except ValueError:  # e.g. an HTML page from another web server or a proxy in front of it
            raise K6ServeError(f"{self.node_name}: {method} {self.base_url}{route} answered with something other "
                               f"than JSON ({raw[:80]!r}); is server_url the address of `k6serve serve`?") from None

    def _open(self, method: str, route: str, *, body: bytes | None = None, content_type: str | None = None,
              timeout_s: float | None = None):
        request = urllib.request.Request(self.base_url + route, data=body, method=method)
        request.add_header("Accept", "application/json")
        if content_type is not None:
            request.add_header("Content-Type", content_type)
        if self.api_key:
            request.add_header("Authorization", f"Bearer {self.api_key}")
        try:
            return urllib.request.urlopen(request, timeout=timeout_s or self.request_timeout_s)
        except urllib.error.HTTPError as error:
            raise self._http_error(error, method, route) from None
        except (urllib.error.URLError, OSError) as error:
            raise self._connection_error(error) from error

    def _http_error(self, error: urllib.error.HTTPError, method: str, route: str) -> K6ServeError:
        raw = error.read()
        try:
            detail = json.loads(raw)["error"]
            message, code, param = detail.get("message", ""), detail.get("code", ""), detail.get("param")
        except (ValueError, KeyError, TypeError):
            message, code, param = raw.decode("utf-8", "replace")[:500], "", None
        where = f"{method} {self.base_url}{route}"
        if error.code == 401:
            return K6ServeError(f"{self.node_name}: the server at {self.base_url} needs an API key ({message}). "
                                f"Set the api_key input, or {API_KEY_ENV} in ComfyUI's environment, to the "
                                "server's --api-key.")
        if error.code == 429:
            retry = error.headers.get("Retry-After")
            return K6ServeError(f"{self.node_name}: the server's queue is full ({message}). Try again"
                                f"{f' in {retry} s' if retry else ' later'}, or start the server with a larger "
                                "--max-queued-jobs.")
        if error.code == 413:
            return K6ServeError(f"{self.node_name}: the upload is too large for the server ({message}). Send a "
                                "shorter or smaller clip, or start the server with a larger --max-upload-mb.")
        if error.code == 400 and param:
            node_input = self.input_names.get(param, param)
            return K6ServeError(f"{self.node_name}: the server refused the input '{node_input}' "
                                f"(server field '{param}', {code}): {message} Change '{node_input}' and run again.")
        code_text = f", {code}" if code else ""
        return K6ServeError(f"{self.node_name}: {where} answered HTTP {error.code}{code_text}: {message}",
                            status=error.code, code=code or None)

    def _connection_error(self, error: Exception) -> K6ServeError:
        reason = getattr(error, "reason", error)
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


def _unreachable(error: Exception) -> bool:
    """The server did not answer (refused, reset, timed out), as opposed to answering with an error."""
    return isinstance(error.__cause__, (urllib.error.URLError, OSError, http.client.HTTPException))


def _loading(error: Exception) -> bool:
    """The server answered that it is still loading its model (`k6serve serve` while it starts, or restarts)."""
    return isinstance(error, K6ServeError) and error.status == 503 and error.code == "model_loading"


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
