"""The HTTP server end to end on real GPUs: concurrent jobs on replicas, a cancel during the decode, and (when the
server has the routes) releasing and resuming its GPU memory.

    python scripts/gpu_server.py --out $OUT                          # Lite-distill, --num-gpus 2 --dp-size 2
    python scripts/gpu_server.py --out $OUT --num-gpus 1 --dp-size 1 # one replica: the pair runs one after the other

Starts `k6serve serve --load-format dummy` as a child process (its log: <out>/server.log) and drives it over HTTP
like a client:

1. **pair (cold)**: two jobs created together; each job's polled timeline (when it was first seen `in_progress`,
   when `completed`). With two replicas both run at once, so they overlap; the first pair pays for compilation.
2. **pair (warm)** and **single (warm)**: the same again, then one job alone, so the pair's wall time can be set
   against one job's (two replicas: about equal; one replica: about twice).
3. **cancel in decode**: a job polled every 20 ms until its `progress` is 99 (the denoising is over, the video decode
   runs), then POST /v1/videos/{id}/cancel (DELETE would delete the record it follows); the final status and
   error message say whether the engine stopped between decoded chunks.
   A decode shorter than the polling (tiny CPU models) is reported as `missed`, not as a failure.
4. **release / resume** (only if `/release_memory_occupation` is in the server's OpenAPI schema): release, the GPUs'
   used memory from nvidia-smi, a job created while released (it must stay `queued`), resume, and that job's end.
5. **rewrite** (`--phases rewrite`): one job after another with `expand_prompts`, prompts of three lengths; each job's
   stage seconds (the job's `stage_seconds`: `expand_prompt` is the rewrite),
   its inference time and the words it wrote. With `--serve-arg=--compile-prompt-rewrite --serve-arg=true
   --serve-arg=--warmup-mode --serve-arg=server` the warm-up compiled the rewrite before the first job; the server
   log's warm-up lines are in the report (`warmup_log`).

`--phases` picks and orders them (default `pair,cancel,release`: 1-4; `pair` is 1 and 2).

Results: <out>/gpu_server.json and <out>/gpu_server.md. CPU check of the logic (tests/unit/test_gpu_server_script.py):
`--model-path demo --load-format auto --device cpu --num-gpus 1 --dp-size 1` with a small size.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=os.environ.get("OUT", "."), help="output folder (default $OUT)")
    parser.add_argument("--model-path", default="kandinskylab/Kandinsky-6.0-Lite-distill-5s-Diffusers")
    parser.add_argument("--load-format", default="dummy", choices=("dummy", "auto"),
                        help="dummy: released sizes, random weights (GPU); auto for a real folder or 'demo'")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--num-gpus", type=int, default=2)
    parser.add_argument("--dp-size", type=int, default=2)
    parser.add_argument("--size", default="768x512", help="OpenAI size, WIDTH x HEIGHT (width first)")
    parser.add_argument("--num-frames", type=int, default=121)
    parser.add_argument("--num-inference-steps", type=int, default=None)
    parser.add_argument("--performance-mode", default="speed")
    parser.add_argument("--load-timeout", type=float, default=600.0, help="seconds to wait for /health")
    parser.add_argument("--job-timeout", type=float, default=400.0, help="seconds to wait for one phase's jobs")
    parser.add_argument("--serve-arg", action="append", default=[], help="extra `k6serve serve` argument (repeat)")
    parser.add_argument("--phases", default="pair,cancel,release",
                        help="comma-separated phases in order: pair (cold, warm and a single job), cancel (in the "
                             "decode), release (release / resume, if the server has the route), rewrite "
                             "(expand_prompts jobs, their stage seconds)")
    args = parser.parse_args(argv)
    args.phases = [name.strip() for name in args.phases.split(",") if name.strip()]
    unknown = sorted(set(args.phases) - set(PHASES))
    if unknown or not args.phases:
        parser.error(f"--phases: unknown {unknown}; choose among {', '.join(PHASES)}")
    return args


PHASES = ("pair", "cancel", "release", "rewrite")
# Three lengths of prompt for the rewrite phase: the compiled rewrite's static cache holds any of them, so none
# should compile a graph of its own once the warm-up has.
REWRITE_PROMPTS = (
    "A cat.",
    "A red fox runs through fresh snow at dawn, wind in the trees.",
    "An old fisherman mends a green net on a wooden pier at sunset while gulls circle overhead, waves slap the "
    "pilings, a radio plays an accordion waltz somewhere behind him, and the harbour lights come on one by one "
    "across the water as the sky turns from orange to violet.",
)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def gpu_memory_used_mib() -> list[int] | None:
    """Each GPU's used memory as nvidia-smi reports it (every process, the CUDA contexts included)."""
    try:
        text = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                              capture_output=True, text=True, timeout=30, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return [int(line) for line in text.split() if line.strip().isdigit()]


class Client:
    def __init__(self, base: str, args: argparse.Namespace) -> None:
        self.http = httpx.Client(base_url=base, timeout=60.0)
        self.args = args
        self.start = time.monotonic()

    def now(self) -> float:
        return round(time.monotonic() - self.start, 3)

    def create(self, seed: int, prompt: str = REWRITE_PROMPTS[1], **extra) -> str:
        body = {"prompt": prompt, "seed": seed, "size": self.args.size, "num_frames": self.args.num_frames, **extra}
        if self.args.num_inference_steps:
            body["num_inference_steps"] = self.args.num_inference_steps
        response = self.http.post("/v1/videos", json=body)
        response.raise_for_status()
        return response.json()["id"]

    def get(self, video_id: str) -> dict:
        response = self.http.get(f"/v1/videos/{video_id}")
        response.raise_for_status()
        return response.json()

    def follow(self, video_ids: list[str], timeout: float, poll_s: float = 0.25) -> dict[str, dict]:
        """Poll until every job has ended; each job's timeline in seconds since the client started."""
        timelines: dict[str, dict[str, Any]] = {video_id: {"created_s": self.now()} for video_id in video_ids}
        deadline = time.monotonic() + timeout
        pending = set(video_ids)
        while pending and time.monotonic() < deadline:
            for video_id in sorted(pending):
                job = self.get(video_id)
                timeline = timelines[video_id]
                if job["status"] == "in_progress":
                    timeline.setdefault("started_s", self.now())
                if job["status"] in ("completed", "failed", "cancelled"):
                    timeline.update(ended_s=self.now(), status=job["status"], error=job.get("error"),
                                    warnings=job.get("warnings"))
                    pending.discard(video_id)
            time.sleep(poll_s)
        for video_id in pending:
            timelines[video_id].update(status="timeout", last=self.get(video_id)["status"])
        return timelines


def overlap_s(timelines: dict[str, dict]) -> float:
    """How long the jobs were all running at the same time (0 when they ran one after the other)."""
    spans = [(t["started_s"], t["ended_s"]) for t in timelines.values() if "started_s" in t and "ended_s" in t]
    if len(spans) < len(timelines):  # a job that never ran or never ended
        return 0.0
    return round(max(0.0, min(end for _, end in spans) - max(start for start, _ in spans)), 3)


def pair_phase(client: Client, seeds: tuple[int, int], timeout: float) -> dict:
    started = client.now()
    ids = [client.create(seed) for seed in seeds]
    timelines = client.follow(ids, timeout)
    return {"jobs": timelines, "wall_s": round(client.now() - started, 3), "overlap_s": overlap_s(timelines),
            "all_completed": all(t.get("status") == "completed" for t in timelines.values())}


def cancel_in_decode_phase(client: Client, timeout: float) -> dict:
    video_id = client.create(7)
    deadline = time.monotonic() + timeout
    seen: list[tuple[str, int]] = []
    while time.monotonic() < deadline:
        job = client.get(video_id)
        if not seen or seen[-1] != (job["status"], job["progress"]):
            seen.append((job["status"], job["progress"]))
        if job["status"] in ("completed", "failed", "cancelled"):
            return {"result": "missed", "status": job["status"], "seen": seen}
        if job["status"] == "in_progress" and job["progress"] >= 99:
            cancelled_at = client.now()
            # The cancel route, not DELETE: DELETE deletes the job once it has stopped, and there would be nothing
            # left to follow.
            response = client.http.post(f"/v1/videos/{video_id}/cancel")
            if response.status_code == 409:
                # The job finished between the poll and the cancel (a short decode on a fast host).
                return {"result": "missed", "status": "finished_before_the_cancel", "seen": seen}
            final = client.follow([video_id], timeout, poll_s=0.05)[video_id]
            message = (final.get("error") or {}).get("message") or ""
            # The engine words the two cancels apart: stopped between decoded chunks, or the MP4 tail finished and
            # the video discarded (both report progress 99).
            result = ("not_cancelled" if final.get("status") != "cancelled" else
                      "stopped_between_decoded_chunks" if "between two decoded chunks" in message else
                      "discarded_after_mp4_tail" if "discarded" in message else "cancelled")
            return {"result": result,
                    "cancel_status_code": response.status_code, "cancel_response_status": response.json().get("status"),
                    "final_status": final.get("status"), "error": final.get("error"),
                    "warnings": final.get("warnings"), "seconds_to_end": round(final["ended_s"] - cancelled_at, 3)
                    if "ended_s" in final else None, "seen": seen}
        time.sleep(0.02)
    return {"result": "timeout", "seen": seen}


def release_phase(client: Client, timeout: float) -> dict:
    report: dict = {"gpu_memory_used_mib_before": gpu_memory_used_mib()}
    started = time.monotonic()
    response = client.http.post("/release_memory_occupation", json={}, timeout=timeout)
    report.update(release_status_code=response.status_code, release_s=round(time.monotonic() - started, 3),
                  release_response=_json_or_text(response), gpu_memory_used_mib_released=gpu_memory_used_mib())
    health = client.http.get("/health")
    report["health_while_released"] = _json_or_text(health)
    video_id = client.create(11)
    time.sleep(3.0)
    report["job_status_while_released"] = client.get(video_id)["status"]
    started = time.monotonic()
    response = client.http.post("/resume_memory_occupation", json={}, timeout=timeout)
    report.update(resume_status_code=response.status_code, resume_s=round(time.monotonic() - started, 3),
                  resume_response=_json_or_text(response), gpu_memory_used_mib_resumed=gpu_memory_used_mib())
    report["job_after_resume"] = client.follow([video_id], timeout)[video_id]
    return report


def rewrite_phase(client: Client, timeout: float) -> dict:
    """One expand_prompts job at a time; each one's stage seconds as the job reports them (`stage_seconds`)."""
    jobs = []
    for seed, prompt in enumerate(REWRITE_PROMPTS, start=11):
        video_id = client.create(seed, prompt, expand_prompts=True)
        timeline = client.follow([video_id], timeout)[video_id]
        job = client.get(video_id)
        jobs.append({"id": video_id, "prompt_words": len(prompt.split()), "status": timeline.get("status"),
                     "error": timeline.get("error"), "wall_s": round(timeline.get("ended_s", client.now())
                                                                     - timeline["created_s"], 3),
                     "inference_time_s": job.get("inference_time_s"), "stages_s": job.get("stage_seconds") or {},
                     "expanded_prompt_words": len((job.get("expanded_prompt") or "").split())})
    return {"jobs": jobs, "all_completed": all(job["status"] == "completed" for job in jobs)}


def warmup_log(path: Path) -> list[str]:
    """The server log's warm-up lines (each names its seconds; with the compiled rewrite, the rewrite's part)."""
    if not path.exists():
        return []
    return [line.rstrip() for line in path.read_text(errors="replace").splitlines() if "warm-up" in line]


def _json_or_text(response: httpx.Response):
    try:
        return response.json()
    except ValueError:
        return response.text[:2000]


def table(report: dict) -> str:
    lines = [f"### gpu_server: {report['model_path']} on {report['num_gpus']} GPU(s), dp {report['dp_size']}, "
             f"size {report['size']} x {report['num_frames']} frames"]
    if any(report["phases"].get(name) for name in ("pair_cold", "pair_warm", "single_warm")):
        lines += ["", "| phase | wall (s) | jobs running together (s) | all completed |", "|---|---|---|---|"]
    for name in ("pair_cold", "pair_warm", "single_warm"):
        phase = report["phases"].get(name)
        if phase:
            lines.append(f"| {name} | {phase['wall_s']} | {phase['overlap_s']} | {phase['all_completed']} |")
    cancel = report["phases"].get("cancel_in_decode")
    if cancel:
        lines += ["", f"Cancel in decode: {cancel['result']} (final status {cancel.get('final_status')}, "
                      f"{cancel.get('seconds_to_end')} s after the cancel; error: {cancel.get('error')})"]
    release = report["phases"].get("release_resume")
    if release:
        lines += ["", f"Release: HTTP {release['release_status_code']} in {release['release_s']} s; GPU memory used "
                      f"(MiB) {release['gpu_memory_used_mib_before']} -> {release['gpu_memory_used_mib_released']} -> "
                      f"{release['gpu_memory_used_mib_resumed']} after resume ({release['resume_s']} s); a job created "
                      f"while released was {release['job_status_while_released']}, then "
                      f"{release['job_after_resume'].get('status')}"]
    rewrite = report["phases"].get("rewrite")
    if rewrite:
        lines += ["", "| rewrite job | prompt words | status | inference s | expand_prompt s | encode s | denoise s "
                      "| words written |", "|---|---|---|---|---|---|---|---|"]
        for number, job in enumerate(rewrite["jobs"], start=1):
            stages = job["stages_s"]
            lines.append(f"| {number} | {job['prompt_words']} | {job['status']} | {job['inference_time_s']} | "
                         f"{stages.get('expand_prompt', '-')} | {stages.get('encode', '-')} | "
                         f"{stages.get('denoise', '-')} | {job['expanded_prompt_words']} |")
    if report.get("warmup_log"):
        lines += ["", "Warm-up (server log):", "", *(f"    {line}" for line in report["warmup_log"])]
    if report.get("error"):
        lines += ["", f"Error: {report['error']}"]
    return "\n".join(lines) + "\n"


def write(report: dict, out: Path) -> None:
    (out / "gpu_server.json").write_text(json.dumps(report, indent=2))
    (out / "gpu_server.md").write_text(table(report))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    port = free_port()
    command = [sys.executable, "-m", "k6serve.cli.main", "serve", "--model-path", args.model_path,
               "--load-format", args.load_format, "--device", args.device, "--num-gpus", str(args.num_gpus),
               "--dp-size", str(args.dp_size), "--performance-mode", args.performance_mode,
               "--port", str(port), "--output-path", str(out / "server_outputs"), *args.serve_arg]
    report: dict = {"model_path": args.model_path, "num_gpus": args.num_gpus, "dp_size": args.dp_size,
                    "size": args.size, "num_frames": args.num_frames, "command": command, "phases": {}}
    log = (out / "server.log").open("w")
    server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    try:
        client = Client(f"http://127.0.0.1:{port}", args)
        deadline = time.monotonic() + args.load_timeout
        while True:
            if server.poll() is not None:
                raise RuntimeError(f"the server exited with {server.returncode} before answering (server.log)")
            try:
                if client.http.get("/health", timeout=2.0).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"no /health answer in {args.load_timeout} s")
            time.sleep(1.0)
        report["load_s"] = client.now()
        routes = client.http.get("/openapi.json").json().get("paths", {})
        report["warmup_log"] = warmup_log(out / "server.log")
        phases = report["phases"]
        for name in args.phases:
            if name == "pair":
                phases["pair_cold"] = pair_phase(client, (1, 2), args.job_timeout)
                write(report, out)
                phases["pair_warm"] = pair_phase(client, (3, 4), args.job_timeout)
                single = client.now()
                phases["single_warm"] = {"jobs": client.follow([client.create(5)], args.job_timeout)}
                phases["single_warm"].update(wall_s=round(client.now() - single, 3), overlap_s=0.0,
                                             all_completed=all(t.get("status") == "completed"
                                                               for t in phases["single_warm"]["jobs"].values()))
            elif name == "cancel":
                phases["cancel_in_decode"] = cancel_in_decode_phase(client, args.job_timeout)
            elif name == "release" and "/release_memory_occupation" in routes:
                phases["release_resume"] = release_phase(client, args.job_timeout)
            elif name == "rewrite":
                phases["rewrite"] = rewrite_phase(client, args.job_timeout)
            write(report, out)
    except Exception as exc:  # noqa: BLE001 - the report keeps what was measured, with the error
        report["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        server.send_signal(signal.SIGINT)
        try:
            report["server_exit_code"] = server.wait(timeout=120)
        except subprocess.TimeoutExpired:
            server.kill()
            report["server_exit_code"] = "killed"
        log.close()
        report["warmup_log"] = warmup_log(out / "server.log")
        write(report, out)
    print(table(report))
    return 1 if report.get("error") else 0


if __name__ == "__main__":
    sys.exit(main())
