"""scripts/gpu_clocks.py's logic on the CPU: the nvidia-smi line parser, the reason bits, and a run that writes the
table and the JSON (no samples off CUDA, so the clock columns are empty, not made up)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).parents[2] / "scripts" / "gpu_clocks.py"


def test_sample_lines_and_reasons(load_script):
    clocks = load_script("gpu_clocks")
    sample = clocks.parse_sample("2026/12/03 01:02:03.250, 1755, 698.41, 61, 0x0000000000000004\n")
    assert sample["sm_mhz"] == 1755.0 and sample["power_w"] == 698.41 and sample["temp_c"] == 61.0
    assert sample["reasons"] == 4 and clocks.reasons(sample["reasons"]) == ["sw_power_cap"]
    assert clocks.reasons(0x44) == ["sw_power_cap", "hw_thermal"]
    assert clocks.parse_sample("") is None and clocks.parse_sample("[N/A], 1, 2, 3, 0x0") is None


def test_row_share_of_the_peak_at_the_clock_it_ran_at(load_script):
    clocks = load_script("gpu_clocks")
    times = [(100.0 + i * 0.1, 700.0) for i in range(30)]
    samples = [{"t": 100.5, "sm_mhz": 1830.0, "power_w": 690.0, "temp_c": 60.0, "reasons": 0x4},
               {"t": 101.5, "sm_mhz": 1650.0, "power_w": 700.0, "temp_c": 62.0, "reasons": 0x0}]
    row = clocks.row("gemm", (1, 2, 3), times, samples, sms=132)
    assert row["sm_mhz_median"] == 1740.0 and row["sm_mhz_min"] == 1650.0
    assert abs(row["peak_tflops_at_clock"] - 132 * 4096 * 1740e6 / 1e12) < 1e-9
    assert abs(row["share_of_peak_at_clock"] - 700.0 / row["peak_tflops_at_clock"]) < 1e-12
    assert row["reasons"] == ["sw_power_cap"] and row["calls"] == 30


def test_cpu_run_writes_the_table_and_json(tmp_path):
    completed = subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", "--tiny", "--seconds", "0.1"],
                               check=False, capture_output=True, text=True, timeout=180,
                               env=os.environ | {"OUT": str(tmp_path)})
    assert completed.returncode == 0, completed.stderr[-3000:]
    report = json.loads((tmp_path / "clocks.json").read_text())
    assert [row["kernel"] for row in report["rows"]] == ["attention (torch_sdpa)", "gemm"]
    assert all(row["calls"] >= 1 and row["tflops_median"] > 0 for row in report["rows"])
    assert all(row["sm_mhz_median"] is None and row["share_of_peak_at_clock"] is None for row in report["rows"])
    assert "| gemm |" in (tmp_path / "clocks.md").read_text()
