"""scripts/gpu_server.py's logic on CPU with the demo checkpoint: it starts `k6serve serve`, runs every phase over
HTTP and writes its report; the GPU run (two replicas of Lite-distill) uses exactly this code."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.multiprocess
SCRIPT = Path(__file__).parents[2] / "scripts" / "gpu_server.py"


def test_every_phase_runs_against_a_real_server(demo_dir, tmp_path):
    completed = subprocess.run(
        [sys.executable, str(SCRIPT), "--out", str(tmp_path), "--model-path", "demo", "--load-format", "auto",
         "--device", "cpu", "--num-gpus", "1", "--dp-size", "1", "--size", "64x48", "--num-frames", "5",
         "--load-timeout", "240", "--job-timeout", "120", "--phases", "pair,cancel,release,rewrite"],
        check=False, capture_output=True, text=True, timeout=400,
    )
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-3000:]
    report = json.loads((tmp_path / "gpu_server.json").read_text())
    phases = report["phases"]
    for name in ("pair_cold", "pair_warm", "single_warm"):
        assert phases[name]["all_completed"], phases[name]
    assert len(phases["pair_warm"]["jobs"]) == 2 and phases["pair_warm"]["wall_s"] > 0
    # One replica: the pair runs one job after the other (polling can see both in_progress for one poll at most).
    assert phases["pair_warm"]["overlap_s"] < 0.5
    # A tiny decode can end before the poll sees progress 99; whatever happened is named.
    assert phases["cancel_in_decode"]["result"] in (
        "stopped_between_decoded_chunks", "discarded_after_mp4_tail", "missed")
    # The rewrite phase: each expand_prompts job's own stage seconds, read from /metrics around it
    rewrite = phases["rewrite"]
    assert rewrite["all_completed"] and [job["prompt_words"] for job in rewrite["jobs"]] == [2, 13, 50]
    for job in rewrite["jobs"]:
        assert set(job["stages_s"]) >= {"expand_prompt", "encode", "denoise", "decode_video"}, job
        assert 0 < job["stages_s"]["expand_prompt"] < job["inference_time_s"] and job["expanded_prompt_words"] > 0
    assert report["server_exit_code"] == 0
    assert (tmp_path / "gpu_server.md").read_text().startswith("### gpu_server: demo")


def test_an_unknown_phase_is_refused_before_a_server_starts():
    completed = subprocess.run([sys.executable, str(SCRIPT), "--phases", "pair,rewrit"], check=False,
                               capture_output=True, text=True, timeout=60)
    assert completed.returncode == 2
    assert "--phases: unknown ['rewrit']; choose among pair, cancel, release, rewrite" in completed.stderr
