"""How long the engine takes to start and to stop, as a user waits for it: `k6serve generate` of the built-in demo from
the command line to its exit, `k6serve serve` from the command to its first answer (503 "loading") and to ready,
and from Ctrl-C to its exit, and the Python API's `Engine` start, request and shutdown. Each run is a fresh
interpreter. `--tree` runs another checkout of k6serve (an older commit, for a before/after table) with the same
interpreter and packages.

    python scripts/startup_times.py --repeats 3 --out out/ [--tree /path/to/other/checkout]
        [--device cuda --performance-mode balanced]

On a GPU the default mode (speed) compiles the DiT's blocks in every fresh process, which is not what this times:
pass `--performance-mode balanced` there.

Prints a table (median of the repeats, seconds) and writes `<out>/startup_times.json`.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_ENGINE = textwrap.dedent("""
    import json, sys, time
    start = time.perf_counter()
    from k6serve.config import EngineConfig, ModelConfig, RuntimeConfig
    from k6serve.request import OutputOptions, SamplingParams
    from k6serve.runtime.engine import Engine
    imported = time.perf_counter()
    mode = {"performance_mode": sys.argv[2]} if sys.argv[2] else {}
    runtime = RuntimeConfig(device=sys.argv[1], **mode)
    engine = Engine(EngineConfig(model=ModelConfig(model_path="demo"), runtime=runtime))
    started = time.perf_counter()
    engine.generate(SamplingParams(prompt="a fox", num_frames=5, num_inference_steps=2),
                    OutputOptions(save_output=False, return_frames=True))
    generated = time.perf_counter()
    engine.shutdown()
    stopped = time.perf_counter()
    print(json.dumps({"engine_import": imported - start, "engine_start": started - imported,
                      "engine_request": generated - started, "engine_shutdown": stopped - generated}))
""")


def _env(tree: Path, cache: str) -> dict[str, str]:
    path = os.pathsep.join(filter(None, [str(tree), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": path, "K6SERVE_CACHE": cache}


def folder_parent(folder: str) -> str:
    """The scratch folder, as the runs' working directory: `python -m` and `-c` put the working directory first on
    sys.path, so run from a checkout they would import that checkout's k6serve whatever `--tree` says."""
    return str(Path(folder).parent)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _status(port: int) -> int | None:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as response:
            return response.status
    except urllib.error.HTTPError as error:
        return error.code
    except OSError:
        return None


def _mode(mode: str | None) -> list[str]:
    return ["--performance-mode", mode] if mode else []


def time_generate(env: dict, device: str, folder: str, mode: str | None = None) -> dict:
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "k6serve.cli.main", "generate", "--model-path", "demo", "--prompt", "a fox",
                    "--num-frames", "5", "--num-inference-steps", "2", "--device", device, "--output-path", folder,
                    *_mode(mode)],
                   env=env, cwd=folder_parent(folder), check=True, capture_output=True, timeout=600)
    return {"generate_wall": time.perf_counter() - start}


def time_serve(env: dict, device: str, folder: str, mode: str | None = None) -> dict:
    port = _free_port()
    start = time.perf_counter()
    process = subprocess.Popen([sys.executable, "-m", "k6serve.cli.main", "serve", "--model-path", "demo", "--device",
                                device, "--host", "127.0.0.1", "--port", str(port), "--output-path", folder,
                                *_mode(mode)],
                               env=env, cwd=folder_parent(folder), stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL)
    first = ready = None
    try:
        while ready is None:
            if process.poll() is not None:
                raise RuntimeError(f"k6serve serve exited with {process.returncode} before it was ready")
            status = _status(port)
            now = time.perf_counter() - start
            if status is not None and first is None:
                first = now
            if status == 200:
                ready = now
            time.sleep(0.05)
        stop = time.perf_counter()
        process.send_signal(signal.SIGINT)
        process.wait(120)
        return {"serve_first_answer": first, "serve_ready": ready, "serve_ctrl_c_to_exit": time.perf_counter() - stop}
    finally:
        if process.poll() is None:
            process.kill()


def time_engine(env: dict, device: str, folder: str, mode: str | None = None) -> dict:
    completed = subprocess.run([sys.executable, "-c", _ENGINE, device, mode or ""], env=env, cwd=folder_parent(folder),
                               check=True, capture_output=True, text=True, timeout=600)
    return json.loads(completed.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tree", type=Path, default=ROOT, help="the k6serve checkout to time (default: this one)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--performance-mode", default=None, help="passed to every run (default: the engine's)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="k6serve-startup-") as scratch:
        env = _env(args.tree.resolve(), os.path.join(scratch, "cache"))
        # builds the demo once; not counted
        time_generate(env, args.device, os.path.join(scratch, "warm"), args.performance_mode)
        runs: dict[str, list[float]] = {}
        for repeat in range(args.repeats):
            for measure in (time_generate, time_serve, time_engine):
                folder = os.path.join(scratch, f"{measure.__name__}{repeat}")
                for key, seconds in measure(env, args.device, folder, args.performance_mode).items():
                    runs.setdefault(key, []).append(seconds)
    medians = {key: statistics.median(values) for key, values in runs.items()}
    print(f"| measure ({args.tree}) | median s | runs |\n|---|---|---|")
    for key, value in medians.items():
        print(f"| {key} | {value:.2f} | {', '.join(f'{v:.2f}' for v in runs[key])} |")
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "startup_times.json").write_text(json.dumps(
            {"tree": str(args.tree), "device": args.device, "performance_mode": args.performance_mode,
             "repeats": args.repeats, "median_s": medians,
             "runs_s": runs}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
