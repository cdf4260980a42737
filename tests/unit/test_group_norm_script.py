"""scripts/gpu_group_norm.py's logic on the CPU (toy shapes, eager): every variant timed and compared with
nn.GroupNorm in bf16 units in the last place; the split-statistics GroupNorm keeps the native formula."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch
from torch import nn

SCRIPT = Path(__file__).parents[2] / "scripts" / "gpu_group_norm.py"


def test_split_statistics_group_norm_is_within_one_ulp_of_native(load_script):
    script = load_script("gpu_group_norm")
    torch.manual_seed(0)
    x = (torch.randn(2, 64, 3, 5, 7) * 3 + 1).to(torch.bfloat16)
    norm = nn.GroupNorm(32, 64, eps=1e-6).to(torch.bfloat16)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
        norm.bias.uniform_(-0.5, 0.5)
        out, reference = script.split_statistics_group_norm(x, norm), norm(x)
    assert out.dtype == torch.bfloat16 and out.shape == x.shape
    assert script._ulps(out, reference) <= 1
    assert script._ulps(reference, reference) == 0 and script._ulps(reference * 1.25, reference) >= 32


def test_cpu_run_reports_every_variant(tmp_path):
    completed = subprocess.run(
        [sys.executable, str(SCRIPT), "--device", "cpu", "--tiny", "--backend", "eager", "--repeats", "2"],
        check=False, capture_output=True, text=True, timeout=180, env=os.environ | {"OUT": str(tmp_path)},
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    rows = json.loads((tmp_path / "group_norm.json").read_text())["rows"]
    assert [row["variant"] for row in rows] == ["native", "split", "compiled"] * 2
    assert all(row["ms"] > 0 and row["max_ulps_vs_native"] <= 1 for row in rows)
    assert "| 1x64x2x8x12 | split |" in (tmp_path / "group_norm.md").read_text()
