"""`serve`, the `k6serve serve` process: the listening socket, bound before the model loads; the output folder and
the job store, each held by one server at a time; the loading responder; then uvicorn (`uvicorn_config`,
`uvicorn_server`) serving the app `build_app` makes, SIGTERM and SIGHUP stopping it as Ctrl-C does; and the stop, in
its order (the runner, the engine, the last outcomes, the store). Also the start-up's log lines (the URL, the
open-server warning) and uvicorn's access lines without the successful probes.
"""

from __future__ import annotations

import codecs
import contextlib
import errno
import logging
import signal
import socket
import sqlite3
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

from k6serve.caching.preflight import warn_if_the_default_steps_do_not_fit
from k6serve.runtime.engine import Engine, check_before_loading
from k6serve.serve.app import build_app
from k6serve.serve.artifacts import ArtifactStore
from k6serve.serve.jobs import SqliteJobStore, hold_exclusively
from k6serve.serve.loading import LoadingResponder
from k6serve.serve.middleware import is_loopback
from k6serve.serve.settings import API_KEY_ENV, settings_from_options

# The name the server's start-up and stop lines were always logged under (app.py held `serve`): log filters and
# the saved server logs (docs/benchmarks/) know them by it.
logger = logging.getLogger("k6serve.serve.app")

# The output folder's lock file (`serve`): hidden, beside the videos, in no job's name space.
SERVER_LOCK_NAME = ".k6serve-server.lock"

# How long uvicorn waits for the HTTP requests in flight on SIGTERM. Ours end at once (the runner answers its waiting
# calls with the shutdown error), so this bounds only a slow client's own transfer.
GRACEFUL_SHUTDOWN_S = 10.0
# After the engine's shutdown has ended the ranks, how long the server waits for a job that outlived the runner's
# stop() to have its outcome recorded, before closing the job store.
_OUTCOMES_AFTER_SHUTDOWN_S = 5.0
# How long the engine's shutdown waits, after the runner's stop, for a job still running to reach a boundary.
_CANCEL_WAIT_AFTER_STOP_S = 10.0


def uvicorn_config(app: Any, **kwargs: Any) -> Any:
    """The uvicorn.Config the server runs under: the h11 protocol whose unparsable-request 400 is the API's JSON
    (`http_protocol.py`), no WebSockets (the API has none). The tests' servers take it from here too, so they answer
    what production answers."""
    import uvicorn

    from k6serve.serve.http_protocol import JsonErrorH11Protocol

    return uvicorn.Config(app, http=JsonErrorH11Protocol, ws="none", **kwargs)


def uvicorn_server(config: Any, on_exit: Callable[[], None], on_force: Callable[[], None] | None = None) -> Any:
    """A uvicorn.Server that calls `on_exit` (in a thread) as soon as a SIGINT / SIGTERM arrives.

    uvicorn first waits up to timeout_graceful_shutdown for the HTTP requests in flight and only then runs the
    lifespan teardown that stops the job runner. A LoRA request waiting behind a running job is such a request:
    it waited out the 10 s, was cancelled into a text/plain 500, and the running job went on meanwhile. Stopping
    the runner at the signal cancels the job at its next step and answers the waiting LoRA callers with the
    documented shutdown error, so the graceful wait ends at once."""
    import uvicorn

    class Server(uvicorn.Server):
        forced = False  # a second signal came: `serve` stops the engine without waiting for the running job

        def handle_exit(self, sig: int, frame: Any) -> None:
            if self.should_exit and not self.forced:
                # A second SIGTERM did nothing (uvicorn forces only on a second SIGINT) while a hung rank made the
                # stop take two minutes. The job stays queued either way (`JobRunner.stop`).
                self.forced = self.force_exit = True
                logger.warning("a second stop signal: stopping now, without waiting for the running job (it stays "
                               "in the queue)")
                if on_force is not None:
                    on_force()
            if not self.should_exit:
                threading.Thread(target=on_exit, name="k6serve-stop-at-signal", daemon=True).start()
            super().handle_exit(sig, frame)

    return Server(config)


class _Terminated(Exception):
    """SIGTERM's counterpart of KeyboardInterrupt, raised once uvicorn has shut down (see `_sigterm_raises`)."""


@contextlib.contextmanager
def _sigterm_raises(server: Any) -> Iterator[None]:
    """After its graceful shutdown uvicorn raises the signal it handled again, for the handler that was there before
    it. For SIGINT that is a KeyboardInterrupt; for SIGTERM the default handler ended the process on the spot, before
    the engine's shutdown and the job store's close in `serve`. Here SIGTERM raises instead, and `serve` returns 0
    as after Ctrl-C.

    SIGHUP (the terminal or SSH session closed, or a supervisor's reload) is not among uvicorn's signals: it ended
    the server on the spot, with no log line, its running job left in_progress (a second such exit during one job
    failed it as server_restarted). It now shuts `server` down as SIGTERM does (the ranks block it already), unless
    SIGHUP was ignored when the server started (`nohup`)."""

    def raise_terminated(signum: int, frame: Any) -> None:
        raise _Terminated

    def hang_up(signum: int, frame: Any) -> None:
        if server.should_exit:
            return  # a closed session sends SIGHUP twice (the shell's and the kernel's): not a second, forcing stop
        logger.warning("SIGHUP received (a closed terminal or session?): shutting down as on SIGTERM")
        server.handle_exit(signal.SIGTERM, frame)

    previous = signal.signal(signal.SIGTERM, raise_terminated)
    # Only where SIGHUP would end the process: `nohup` (or a supervisor) ignores it so that the server outlives the
    # session, and that stays so.
    hang_up_default = hasattr(signal, "SIGHUP") and signal.getsignal(signal.SIGHUP) == signal.SIG_DFL
    previous_hangup = signal.signal(signal.SIGHUP, hang_up) if hang_up_default else None
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
        if previous_hangup is not None:
            signal.signal(signal.SIGHUP, previous_hangup)


class _QuietProbes(logging.Filter):
    """Leaves out uvicorn's access lines for probes that succeed (GET / HEAD of /health and /metrics under 400): a
    supervisor's probe every few seconds buried the job lines, and --log-level warning, the only way to quiet them,
    dropped the jobs' start and end lines too. A failing probe is still logged. uvicorn logs the path as sent, so
    under a --root-path the prefixed paths count too."""

    def __init__(self, root_path: str = "") -> None:
        super().__init__()
        self.paths = _PROBE_PATHS | {root_path + path for path in _PROBE_PATHS}

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if not isinstance(args, tuple) or len(args) != 5:  # uvicorn's (client, method, path, version, status)
            return True
        _, method, path, _, status = args
        probe = method in ("GET", "HEAD") and str(path).split("?")[0] in self.paths
        return not (probe and isinstance(status, int) and status < 400)


_PROBE_PATHS = frozenset({"/health", "/metrics"})


def quiet_probe_access_lines(root_path: str = "") -> None:
    """Install `_QuietProbes` on uvicorn's access logger (in place of one installed before)."""
    access = logging.getLogger("uvicorn.access")
    for existing in [existing for existing in access.filters if isinstance(existing, _QuietProbes)]:
        access.removeFilter(existing)
    access.addFilter(_QuietProbes(root_path))


def server_url(host: str, port: int) -> str:
    """The server's URL for the log: an IPv6 address bracketed ("http://:::30000" for --host :: was no URL)."""
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def open_server_warning(host: str, port: int, api_key: str | None, *, lora_dirs: bool = False) -> str | None:
    """The start-up warning of a server that other machines can reach without a key, or None. Every client that
    reaches it can make jobs, and load LoRA adapters from any path the server can read (docs/http-api.md
    "Exposing the server"): a choice to make knowingly, not a default to miss."""
    if api_key or is_loopback(host):
        return None
    reach = ("" if lora_dirs else
             ", set_lora with any path this server can read included (or limit it: --allowed-lora-dir)")
    return (f"serving on {host} without --api-key: any client that reaches port {port} can use every route{reach}; "
            f"set --api-key (or ${API_KEY_ENV}), or bind 127.0.0.1 behind a proxy that authenticates")


def listening_socket(host: str, port: int) -> socket.socket:
    """The server's socket, bound and listening before the model loads: a port in use or a host that is not this
    machine's fails at once with the fix (a ValueError), not after minutes of loading as uvicorn's own bind did.
    uvicorn then serves on this very socket, so no other process can take the port in between."""
    try:
        family, _, _, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                      flags=socket.AI_PASSIVE)[0]
    except socket.gaierror as exc:
        raise ValueError(f"--host {host!r} does not resolve ({exc.strerror}); pass an address of this machine, "
                         "e.g. 127.0.0.1 or 0.0.0.0 (every interface).") from None
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn: restart while old ones linger
        sock.bind(address)
        sock.listen(2048)
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise ValueError(f"port {port} on {host} is already in use; pass another --port, or stop the process "
                             "that listens on it.") from None
        if exc.errno in (errno.EADDRNOTAVAIL, errno.EACCES):
            fix = ("pass an address of this machine, e.g. 127.0.0.1 or 0.0.0.0" if exc.errno == errno.EADDRNOTAVAIL
                   else "ports below 1024 need privileges; pass a --port of 1024 or more")
            raise ValueError(f"cannot listen on {host}:{port} ({exc.strerror}); {fix}.") from None
        raise
    return sock


def serve(engine_options: dict[str, Any], server_options: dict[str, Any]) -> int:
    """Bind the port, open the job store, load the model (answering 503 "loading" on the port meanwhile) and serve
    until interrupted."""
    from k6serve.dependencies import require_package
    from k6serve.engine_arguments import build_engine_config

    require_package("uvicorn", "to run the HTTP server")  # imported where it runs: after the load, minutes away
    settings = settings_from_options(server_options)
    settings.check_paths()
    if codecs.lookup(sys.getfilesystemencoding()).name != "utf-8":
        # Requests' paths (image_path, video_path, lora_path) with non-ASCII characters cannot be opened then; each
        # is refused saying so (`unencodable_path`), and this says it once, at the start.
        logger.warning("this server's filesystem encoding is %s, not UTF-8: paths with characters it cannot hold "
                       "(Cyrillic, Chinese...) cannot be opened; start it under a UTF-8 locale (e.g. LANG=C.UTF-8) "
                       "or with PYTHONUTF8=1", sys.getfilesystemencoding())
    engine_options = dict(engine_options)
    config = build_engine_config(engine_options.pop("model_path"), **engine_options)
    # Before the port, the folders and their locks, so that a flag's mistake is told as such, not hidden behind a
    # port in use (the engine runs it again: reading a config or two).
    check_before_loading(config)
    warn_if_the_default_steps_do_not_fit(config)
    sock = listening_socket(settings.host, settings.port)
    folder_lock = None
    try:
        artifacts = ArtifactStore(settings.output_path)
        # One server per output folder too, whatever --job-store says: a second one's start-up sweep of partial
        # files would delete the first one's MP4 being written, and the two would name uploads alike.
        folder_lock = hold_exclusively(artifacts.root / SERVER_LOCK_NAME, (
            f"the output folder {str(artifacts.root)!r} is in use by another k6serve server (process {{holder}}); "
            "stop that one, or give this one its own --output-path."))
        try:
            store = SqliteJobStore(settings.job_store_path)
        except sqlite3.Error as exc:
            raise ValueError(f"cannot open the job store {str(settings.job_store_path)!r} ({exc}); pass a writable "
                             "--job-store file.") from None
    except BaseException:
        sock.close()
        if folder_lock is not None:
            folder_lock.close()
        raise
    # Answers 503 "loading" on the socket until uvicorn takes it (`loading.py`).
    responder = LoadingResponder(sock, root_path=settings.root_path, allowed_origins=settings.allowed_origins)
    responder.start()
    try:
        engine = Engine(config)
    except BaseException:
        responder.stop()
        sock.close()
        store.close()
        folder_lock.close()
        raise
    app = server = None
    try:
        app = build_app(engine=engine, store=store, artifacts=artifacts, settings=settings,
                        before_serving=responder.stop)
        port = sock.getsockname()[1]
        logger.info("serving %s on %s (jobs: %s, outputs: %s)", app.state.ctx.model_name,
                    server_url(settings.host, port), settings.job_store_path, artifacts.root)
        warning = open_server_warning(settings.host, port, settings.api_key, lora_dirs=bool(settings.allowed_lora_dirs))
        if warning is not None:
            logger.warning("%s", warning)
        if settings.allowed_origins:
            logger.info("web pages allowed to call the API from a browser (--allowed-origin): %s",
                        ", ".join(settings.allowed_origins))
        # uvicorn's lines (start-up, one access line per request) at --log-level (it was always "info": every poll
        # was logged, whatever the flag), through the root handler, so they carry its format and timestamps.
        quiet_probe_access_lines(settings.root_path)
        server = uvicorn_server(uvicorn_config(app, host=settings.host, port=port,
                                               log_level=logging.getLogger().getEffectiveLevel(), log_config=None,
                                               timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S),
                                on_exit=app.state.ctx.runner.stop, on_force=app.state.ctx.runner.stop_waiting)
        with _sigterm_raises(server), contextlib.suppress(KeyboardInterrupt, _Terminated):
            server.run(sockets=[sock])
    finally:
        responder.stop()  # a no-op once the app's start-up stopped it
        sock.close()
        # The runner's stop (at the signal and at the lifespan's end) has cancelled the running job and waited up to
        # 30 s for it: a job still running is in its MP4's tail or on a hung rank. The engine's own waits (30 s, then
        # 60 s after its cancel) made a hung rank's stop take two minutes, past every supervisor's grace period.
        forced = server is not None and server.forced
        engine.shutdown(timeout=0.0, cancel_wait_s=0.0 if forced else _CANCEL_WAIT_AFTER_STOP_S)
        if app is not None:
            # After a forced stop too (briefly): the ranks have ended, and a finisher must not meet a closed store.
            app.state.ctx.runner.wait_for_outcomes(1.0 if forced else _OUTCOMES_AFTER_SHUTDOWN_S, forced_too=True)
        store.close()
        folder_lock.close()
    return 0
