"""scripts/gpu_comm.py's logic on the CPU (gloo, small buffers): every collective is timed and reported.

The GPU run (two H200s, NCCL, Ulysses-sized buffers) uses the same measure/table code; only the sizes, the dtype
and the clock differ.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.multiprocess
SCRIPT = Path(__file__).parents[2] / "scripts" / "gpu_comm.py"


def test_cpu_run_reports_every_collective_and_the_overlap(tmp_path):
    completed = subprocess.run([sys.executable, str(SCRIPT), "--cpu"], check=False, capture_output=True, text=True,
                               timeout=180, env=os.environ | {"OUT": str(tmp_path)})
    assert completed.returncode == 0, completed.stderr[-3000:]
    report = json.loads((tmp_path / "gpu_comm.json").read_text())
    assert report["nccl"] is None and report["gpu"] == "CPUs (gloo)"
    timed = [(row["op"], row["buffer_mb"]) for row in report["rows"] if row["op"] != "overlap"]
    assert timed == [(op, size) for size in (1, 2) for op in ("all_to_all", "all_gather", "send_recv")]
    assert all(row["ms"] > 0 and row["gb_per_s_per_direction"] > 0 for row in report["rows"][:-1])
    overlap = report["rows"][-1]
    assert overlap["op"] == "overlap" and overlap["buffer_mb"] == 2 and overlap["gemm"] == [256, 256, 256]
    assert min(overlap["gemm_ms"], overlap["all_to_all_ms"], overlap["together_ms"]) > 0
    text = (tmp_path / "gpu_comm.md").read_text()
    assert text.startswith("### gpu_comm on two CPUs (gloo)") and "beside a 256x256x256 GEMM" in text
