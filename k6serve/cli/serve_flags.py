"""Flags and entry point of `k6serve serve` (the HTTP server lives in k6serve.serve)."""

from __future__ import annotations

import argparse
import logging
from typing import Any

logger = logging.getLogger(__name__)


def add_server_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("server")
    group.add_argument("--host", default=None, help="Address to bind (default 127.0.0.1).")
    group.add_argument("--port", type=int, default=None, help="Port (default 30000).")
    group.add_argument("--output-path", default=None, help="Folder for finished videos and uploads (default outputs/).")
    group.add_argument("--job-store", default=None,
                       help="SQLite file holding the jobs (default <output-path>/jobs.sqlite3).")
    group.add_argument("--output-ttl", type=float, default=None,
                       help="Seconds after finishing that a job and its files are deleted (default 86400; 0 keeps).")
    group.add_argument("--max-queued-jobs", type=int, default=None,
                       help="Queued jobs beyond which POST /v1/videos answers 429 (default 64).")
    group.add_argument("--max-upload-mb", type=float, default=None,
                       help="Largest accepted upload in MiB; larger answers 413 (default 512).")
    group.add_argument("--allowed-input-dir", action="append", default=None,
                       help="Folder that JSON video_path/image_path may point into (repeatable; default: ./inputs; "
                            "never the upload folder).")
    group.add_argument("--allowed-lora-dir", action="append", default=None,
                       help="Folder that set_lora's lora_path must point into (repeatable); with it, other paths and "
                            "hub ids are refused (default: any path the server can read, and hub ids).")
    group.add_argument("--allowed-origin", action="append", default=None, metavar="ORIGIN",
                       help="Web page origin whose scripts may call the API from a browser (CORS), e.g. "
                            "https://app.example.com or http://localhost:5173 (repeatable; '*' any page, only with "
                            "--api-key; default: none, browser pages of other sites are refused).")
    group.add_argument("--webhook-url", action="append", default=None, metavar="URL",
                       help="POST OpenAI's video.completed / video.failed event here when a job ends (repeatable; "
                            "signed with --webhook-secret; retried on errors with backoff up to 30 min apart, for 72 h "
                            "or --output-ttl if shorter; events may arrive out of order: order them by created_at).")
    group.add_argument("--webhook-secret", default=None, metavar="SECRET",
                       help="Key the webhook events are signed with, as OpenAI signs its own (whsec_<base64>, which "
                            "OpenAI's SDKs verify), or set K6SERVE_WEBHOOK_SECRET.")
    group.add_argument("--served-model-name", default=None, metavar="NAME",
                       help="Model id that /v1/models lists and jobs report (default: the checkpoint's hub id, or "
                            "the folder's name); requests may name it or the checkpoint in `model`.")
    group.add_argument("--root-path", default=None, metavar="PREFIX",
                       help="Path prefix a reverse proxy serves the API under, e.g. /k6: job URLs and /docs carry it; "
                            "requests are served with or without it (default: none).")
    group.add_argument("--api-key", default=None,
                       help="Require 'Authorization: Bearer KEY' on every route but /health (or set K6SERVE_API_KEY).")


def run_serve(engine_options: dict[str, Any], server_options: dict[str, Any]) -> int:
    from k6serve.models.checkpoint_files import ignored_revision_note
    from k6serve.serve.server_process import serve

    note = ignored_revision_note(engine_options["model_path"], engine_options.get("revision"),
                                 engine_options.get("load_format") or "auto")
    if note is not None:
        logger.warning(note)  # before the load, which can take minutes

    return serve(engine_options, server_options)
