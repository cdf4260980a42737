"""scripts/gpu_attention.py's logic on the CPU: SDPA is timed, the GPU kernels are listed with why they did not run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).parents[2] / "scripts" / "gpu_attention.py"


def test_cpu_run_times_sdpa_and_reports_the_gpu_kernels(tmp_path):
    completed = subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", "--tiny", "--repeats", "2"],
                               check=False, capture_output=True, text=True, timeout=120,
                               env=os.environ | {"OUT": str(tmp_path)})
    assert completed.returncode == 0, completed.stderr[-3000:]
    rows = {row["kernel"]: row for row in json.loads((tmp_path / "attention.json").read_text())["rows"]}
    assert list(rows) == ["sdpa", "fa3", "fa4"]
    assert rows["sdpa"]["ms"] > 0 and rows["sdpa"]["tflops"] > 0 and rows["sdpa"]["max_abs_difference"] == 0
    assert rows["fa3"]["error"] == rows["fa4"]["error"] == "needs CUDA" and rows["fa3"]["ms"] is None
    assert "| tiny (4x16) | fa4 | - | - | - | needs CUDA |" in (tmp_path / "attention.md").read_text()
