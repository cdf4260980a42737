"""scripts/gpu_context.py's `engine` mode on CPU with the demo checkpoint: the DiffGenerator options it passes
(`--option KEY=VALUE`, JSON-typed) and its per-rank report after a release; the GPU run uses exactly this code."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.multiprocess
SCRIPT = Path(__file__).parents[2] / "scripts" / "gpu_context.py"


def test_engine_mode_reports_every_rank_after_a_release(demo_dir, tmp_path):
    completed = subprocess.run(
        [sys.executable, str(SCRIPT), "--mode", "engine", "--model", "demo", "--out", str(tmp_path),
         "--option", "device=cpu", "--option", "load_format=auto", "--option", "num_gpus=1",
         "--request", "num_inference_steps=1", "--request", "num_frames=5", "--request", "height=32",
         "--request", "width=32"],
        check=False, capture_output=True, text=True, timeout=300,
    )
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-3000:]
    report = json.loads((tmp_path / "gpu_context_engine.json").read_text())
    assert report["options"] == {"load_format": "auto", "performance_mode": "speed", "device": "cpu", "num_gpus": 1}
    [rank] = report["after_release"]
    assert (rank["replica"], rank["rank"], rank["device"]) == (0, 0, "cpu") and "CPU device" in rank["explanation"]
    # The request ran first (on a GPU its collectives create the communicators the release then reports).
    assert report["request"]["num_inference_steps"] == 1 and report["request_s"] > 0
    assert "gpu_processes_after_release" in report and "gpu_processes_after_resume" in report


def test_an_option_without_a_value_is_refused():
    completed = subprocess.run([sys.executable, str(SCRIPT), "--mode", "engine", "--option", "num_gpus"],
                               check=False, capture_output=True, text=True, timeout=120)
    assert completed.returncode == 2 and "--option takes KEY=VALUE, got 'num_gpus'" in completed.stderr
