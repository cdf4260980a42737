"""Flags and entry point of `k6serve serve` (the HTTP server lives in k6serve.serve)."""

from __future__ import annotations

import argparse
from typing import Any


def add_server_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("server")
    group.add_argument("--host", default=None, help="Address to bind (default 127.0.0.1).")
    group.add_argument("--port", type=int, default=None, help="Port (default 30000).")
    group.add_argument("--output-path", default=None, help="Folder for finished videos (default outputs/).")


def run_serve(engine_options: dict[str, Any], server_options: dict[str, Any]) -> int:
    from k6serve.serve.app import serve

    return serve(engine_options, server_options)
