"""The engine's own process (the CLI, the Python API, the server) starts the ranks and writes the MP4; the ranks build
the models. It imported diffusers, transformers, PEFT and torch._dynamo all the same (the demo's builder, the SR
checkpoint loader for a tile-size check, the worker module for a file-name helper): seconds before `k6serve serve`
even listened, and before every `k6serve generate` started its ranks. Each run here is a fresh interpreter."""

from __future__ import annotations

import socket
import subprocess
import sys
import textwrap

import pytest

HEAVY = ("diffusers", "transformers", "peft", "torch._dynamo")


def _heavy_modules_after(cli_args: list[str], *, stop_at_the_ranks: bool, env_cache: str) -> list[str]:
    script = textwrap.dedent(f"""
        import atexit, os, sys

        def report():
            print("HEAVY", [name for name in {HEAVY!r} if name in sys.modules], flush=True)

        if {stop_at_the_ranks!r}:
            from k6serve.runtime import process_group_worker

            def stop(self, config):  # where the ranks would start: what the engine process imported by now
                report()
                os._exit(0)

            process_group_worker.MultiProcessWorker.__init__ = stop
        else:
            atexit.register(report)
        from k6serve.cli.main import main

        sys.exit(main({cli_args!r}))
    """)
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                         env={**__import__("os").environ, "K6SERVE_CACHE": env_cache})
    assert run.returncode == 0, run.stderr[-3000:]
    line = next(line for line in run.stdout.splitlines() if line.startswith("HEAVY "))
    return eval(line.removeprefix("HEAVY "))  # noqa: S307 (our own list literal)


def test_generate_runs_the_demo_without_importing_a_model_library_in_its_own_process(_demo_cache_dir, tmp_path):
    # The whole run, to the MP4: the results and notes the ranks send back unpickle without them too.
    heavy = _heavy_modules_after(["generate", "--model-path", "demo", "--prompt", "a fox", "--num-frames", "5",
                                  "--num-inference-steps", "2", "--output-path", str(tmp_path)],
                                 stop_at_the_ranks=False, env_cache=str(_demo_cache_dir))
    assert heavy == []
    assert len(list(tmp_path.glob("*.mp4"))) == 1


@pytest.mark.parametrize("model", ["demo", "sr"])
def test_serve_reaches_the_ranks_without_importing_a_model_library(model, _demo_cache_dir, tiny_sr_dir, tmp_path):
    # The server listens (and answers 503 "loading") before this point: that is what the imports delayed.
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    model_path = "demo" if model == "demo" else str(tiny_sr_dir)
    heavy = _heavy_modules_after(["serve", "--model-path", model_path, "--device", "cpu", "--host", "127.0.0.1",
                                  "--port", str(port), "--output-path", str(tmp_path / "out")],
                                 stop_at_the_ranks=True, env_cache=str(_demo_cache_dir))
    assert heavy == []
