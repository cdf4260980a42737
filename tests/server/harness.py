"""Test harness for the HTTP server: a fast fake worker, and real uvicorn servers on free loopback ports."""

from __future__ import annotations

import errno
import hashlib
import socket
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import uvicorn

from k6serve.engine_arguments import build_engine_config
from k6serve.media.image import load_conditioning_image
from k6serve.media.mux import write_mp4
from k6serve.models.variants import GENERATION, VARIANTS, Variant
from k6serve.request import OutputOptions, SamplingParams, VideoResult
from k6serve.request_resolution import resolve_generate, resolve_upscale
from k6serve.runtime.engine import Engine
from k6serve.serve.app import build_app
from k6serve.serve.artifacts import ArtifactStore
from k6serve.serve.jobs import SqliteJobStore
from k6serve.serve.server_process import uvicorn_config
from k6serve.serve.settings import ServerSettings


class FakeWorker:
    """Quacks like ModelWorker: real request resolution, fake steps, a tiny real MP4 that depends on the inputs.

    Prompt directives: "hold" keeps stepping until `release` is set (a job that stays running), "slow decode"
    reports every step then, until `release` is set, reports the final step again every 10 ms as the pipelines do
    between the video decode's chunks (`decoding` is set meanwhile), "slow tail" reports every step then waits for
    `release` with no boundary left (like the MP4's tail after the last chunk; `decoding` is set meanwhile too),
    "fail" raises, "fill the disk" raises the OSError of a full disk, "exhaust memory" raises a worker process's out-of-memory error, "lack a package" its missing-package error,
    "rewrite first" reports step 0 three times before the steps (the expand_prompts rewrite's cancellation points),
    "load image" decodes the
    conditioning image as the pipeline does (so a file broken past its header fails the job).
    """

    def __init__(self, variant: Variant, *, step_delay_s: float = 0.0) -> None:
        self.variant = variant
        self.step_delay_s = step_delay_s
        self.release = threading.Event()
        self.decoding = threading.Event()
        self.started: list[str] = []  # prompts / video names in start order
        self.requests: list[Any] = []  # the resolved requests, in start order
        self.lock = threading.Lock()

    def resolve(self, params: SamplingParams):
        if self.variant.family == GENERATION:
            return resolve_generate(params, self.variant)
        return resolve_upscale(params, self.variant)

    def run(self, params: SamplingParams, output: OutputOptions, on_step=None) -> VideoResult:
        request, notes = self.resolve(params)
        prompt = getattr(request, "prompt", "") or ""
        with self.lock:
            self.started.append(prompt or Path(request.video_path).name)
            self.requests.append(request)
        total = getattr(request, "num_inference_steps", 2)
        if "rewrite first" in prompt and on_step is not None:
            for _ in range(3):  # the prompt rewrite's (or a warm-up's) cancellation points, reported as step 0
                time.sleep(0.02)
                on_step(0, total)
        step = 0
        while step < total:
            if "hold" in prompt and not self.release.is_set():
                self.release.wait(0.01)
                if on_step is not None:
                    on_step(min(step, total - 1), total)
                continue
            if self.step_delay_s:
                time.sleep(self.step_delay_s)
            step += 1
            if on_step is not None:
                on_step(step, total)
        if "slow decode" in prompt:
            self.decoding.set()
            deadline = time.monotonic() + 30
            while not self.release.wait(0.01) and time.monotonic() < deadline:
                if on_step is not None:
                    on_step(total, total)
        if "slow tail" in prompt:
            self.decoding.set()
            self.release.wait(30)
        if "exhaust memory" in prompt:
            # What a worker process's OOM looks like once the engine has it (replica_failures.failure_error).
            raise RuntimeError("request 1 failed on replica 0: rank 0: OutOfMemoryError: CUDA out of memory. "
                               "Tried to allocate 9.00 GiB.\nTraceback (most recent call last): ...")
        if "exhaust host memory" in prompt:
            # A worker's CPU allocation failing, as the engine carries it (the worker's traceback as text).
            raise RuntimeError("request 1 failed on replica 0: rank 0: RuntimeError: [enforce fail at "
                               "alloc_cpu.cpp:117] data. DefaultCPUAllocator: can't allocate memory: you tried to "
                               "allocate 3221225472 bytes. Error code 12 (Cannot allocate memory)\nTraceback (most "
                               "recent call last):\n  File \"/srv/k6serve/pipelines/x.py\", line 1\n")
        if "break with a traceback" in prompt:
            raise RuntimeError("request 1 failed on replica 0: rank 0: KeyError: 'x'\nTraceback (most recent call "
                               "last):\n  File \"/srv/k6serve/models/secret_path.py\", line 9, in f\n" + "x" * 4000)
        if "kill the worker" in prompt:
            from k6serve.runtime.out_of_memory import WorkerKilled

            # What the engine raises when a rank is killed mid-request (process_group_worker._replica_died).
            raise WorkerKilled("request 1 failed: worker replica 0 (ranks [0]) died while running it: rank 0 (pid 7) "
                               "was killed by SIGKILL. The replica was shut down; 0 replica(s) still serving. On "
                               "Linux SIGKILL is usually the out-of-memory killer: free host memory")
        if "lack a package" in prompt:
            # What the engine raises when a worker process's interpreter lacks a package
            # (replica_failures.failure_error keeps a ModuleNotFoundError with its name).
            raise ModuleNotFoundError("No module named 'av'", name="av")
        if "fill the disk" in prompt:
            # What the engine raises when the MP4 write meets a full disk (replica_failures.failure_error
            # keeps an OSError's errno and file name).
            raise OSError(errno.ENOSPC, "No space left on device", "/srv/k6/outputs/.video_x.mp4.part")
        if "fail" in prompt:
            raise RuntimeError("fake worker failure")
        if "load image" in prompt and getattr(request, "image_path", None):
            load_conditioning_image(request.image_path, request.height, request.width)
        digest = hashlib.sha256(repr((prompt, request.seed)).encode())
        if self.variant.family != GENERATION:
            digest.update(Path(request.video_path).read_bytes())
        if getattr(request, "image_path", None):
            digest.update(Path(request.image_path).read_bytes())
        value = digest.digest()[0]
        frames = np.full((5, 16, 16, 3), value, dtype=np.uint8)
        fps = getattr(request, "fps", 24.0)
        folder = Path(output.output_path)
        path = write_mp4(folder / (output.output_file_name or "out.mp4"), frames, fps)
        height, width = (getattr(request, "height", 16), getattr(request, "width", 16))
        num_frames = getattr(request, "num_frames", 5)
        # Stage seconds as the pipelines name them, for /metrics' k6serve_stage_seconds and the job's log line.
        timings = {"total": 0.01, "encode": 0.002, "denoise": 0.006, "decode_video": 0.001, "mux": 0.001,
                   "graphs_compiled": 0.0}
        if getattr(request, "expand_prompts", False):
            timings["expand_prompt"] = 0.004
        return VideoResult(output_file_path=str(path), frames=None, audio=None, audio_sample_rate=44100, fps=fps,
                           seed=request.seed, timings=timings, peak_memory_mb=12.5, num_frames=num_frames,
                           height=height, width=width, notes=notes)


@dataclass
class RunningServer:
    base_url: str
    app: Any
    engine: Engine
    store: SqliteJobStore
    artifacts: ArtifactStore
    settings: ServerSettings
    server: uvicorn.Server
    thread: threading.Thread
    worker: Any = None
    headers: dict[str, str] = field(default_factory=dict)

    def client(self, **kwargs: Any) -> httpx.Client:
        kwargs.setdefault("headers", self.headers)
        return httpx.Client(base_url=self.base_url, timeout=30, **kwargs)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)
        self.engine.shutdown(timeout=30)
        self.store.close()


def start_server(root: Path, *, worker: Any = None, engine: Engine | None = None, db_path: Path | None = None,
                 **settings: Any) -> RunningServer:
    """Start uvicorn in a thread on a free 127.0.0.1 port, serving a fake (or given) engine."""
    if engine is None:
        worker = worker if worker is not None else FakeWorker(VARIANTS["pro-distill"])
        engine = Engine(build_engine_config("fake-k6-model"), worker=worker)
    output = root / "outputs"
    inputs = root / "inputs"
    inputs.mkdir(parents=True, exist_ok=True)
    artifacts = ArtifactStore(output)
    settings.setdefault("allowed_input_dirs", (inputs, artifacts.upload_dir))
    settings.setdefault("cancel_wait_s", 10.0)
    server_settings = ServerSettings(output_path=output, job_store=db_path or root / "jobs.sqlite3", **settings)
    store = SqliteJobStore(server_settings.job_store_path)
    app = build_app(engine=engine, store=store, artifacts=artifacts, settings=server_settings)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    config = uvicorn_config(app, log_level="warning", lifespan="on", timeout_graceful_shutdown=5)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.01)
    headers = {"Authorization": f"Bearer {server_settings.api_key}"} if server_settings.api_key else {}
    return RunningServer(base_url=f"http://127.0.0.1:{port}", app=app, engine=engine, store=store,
                         artifacts=artifacts, settings=server_settings, server=server, thread=thread, worker=worker,
                         headers=headers)


def wait_for(client: httpx.Client, video_id: str, statuses: tuple[str, ...] = ("completed", "failed", "cancelled"),
             timeout: float = 30.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        response = client.get(f"/v1/videos/{video_id}")
        assert response.status_code == 200, response.text
        job = response.json()
        if job["status"] in statuses:
            return job
        if time.monotonic() > deadline:
            raise AssertionError(f"job {video_id} stayed {job['status']} (wanted {statuses}): {job}")
        time.sleep(0.02)


def wait_until(predicate, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        time.sleep(0.01)
