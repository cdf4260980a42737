"""Runs a fake-worker server in its own process, for the tests that kill the server (SIGKILL) and restart it.

    python fake_server_main.py ROOT PORT_FILE [--release-holds] [--through-serve [--load-until FILE [--load-fails]]]
                               [--start-on-stdin]

--through-serve runs `k6serve.serve.server_process.serve`, the `k6serve serve` entry point, with only the model
replaced by the fake worker: its uvicorn server, signal handling and shutdown are the real ones (for the SIGTERM
tests).
--load-until FILE makes that model's load last until FILE exists (at most 60 s), and --load-fails makes the load
then fail (RuntimeError "the fake checkpoint is broken"), for the tests of what the server answers while it loads.
--start-on-stdin imports everything, then waits for a line on stdin before it opens the job store and serves (a test
starts the next server's slow imports while the one before it still runs; exits if stdin closes first).
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import FakeWorker, start_server


def serve_with_fake_worker(root: Path, port_file: Path, *, load_until: Path | None = None,
                           load_fails: bool = False) -> None:
    from k6serve.models.variants import VARIANTS
    from k6serve.runtime.engine import Engine
    from k6serve.serve import server_process

    worker = FakeWorker(VARIANTS["pro-distill"])

    def load(config):
        deadline = time.monotonic() + 60
        while load_until is not None and not load_until.exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        if load_fails:
            raise RuntimeError("the fake checkpoint is broken")
        return Engine(config, worker=worker)

    server_process.Engine = load
    bind = server_process.listening_socket

    def bind_a_free_port(host: str, port: int):
        sock = bind(host, 0)  # listening from here on: a client that connects now waits in the backlog
        port_file.write_text(f"http://{host}:{sock.getsockname()[1]}")
        return sock

    server_process.listening_socket = bind_a_free_port
    # Far longer than the SIGTERM tests' bound on the exit, so "ended at once" is told from "after uvicorn's graceful
    # wait" with room on a busy machine (the real 10 s left 2 s).
    server_process.GRACEFUL_SHUTDOWN_S = 60.0
    server_process.serve({"model_path": "fake-k6-model"}, {"output_path": str(root / "outputs")})


def main() -> None:
    root, port_file = Path(sys.argv[1]), Path(sys.argv[2])
    if "--start-on-stdin" in sys.argv and not sys.stdin.readline():
        return
    if "--through-serve" in sys.argv:
        logging.basicConfig(level=logging.INFO)  # as `k6serve serve` does (--log-level)
        load_until = Path(sys.argv[sys.argv.index("--load-until") + 1]) if "--load-until" in sys.argv else None
        serve_with_fake_worker(root, port_file, load_until=load_until, load_fails="--load-fails" in sys.argv)
        return
    server = start_server(root)
    if "--release-holds" in sys.argv:
        server.worker.release.set()
    port_file.write_text(server.base_url)
    threading.Event().wait()


if __name__ == "__main__":
    main()
