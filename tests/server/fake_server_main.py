"""Runs a fake-worker server in its own process, for the tests that kill the server (SIGKILL) and restart it.

    python fake_server_main.py ROOT PORT_FILE [--release-holds]
"""

from __future__ import annotations

import sys
import threading
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import start_server


def main() -> None:
    root, port_file = Path(sys.argv[1]), Path(sys.argv[2])
    server = start_server(root)
    if "--release-holds" in sys.argv:
        server.worker.release.set()
    port_file.write_text(server.base_url)
    threading.Event().wait()


if __name__ == "__main__":
    main()
