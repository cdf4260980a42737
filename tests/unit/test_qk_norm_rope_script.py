"""scripts/gpu_qk_norm_rope.py's logic on the CPU (toy shapes, eager): every variant timed, and the swapped-pairs
RoPE gives the bits of the DiT's RMSNorm + RoPE (the GPU run compiles the same functions at the DiT's shapes)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).parents[2] / "scripts" / "gpu_qk_norm_rope.py"


def test_cpu_run_times_every_variant_and_checks_bits(tmp_path):
    completed = subprocess.run(
        [sys.executable, str(SCRIPT), "--device", "cpu", "--tiny", "--backend", "eager", "--repeats", "2"],
        check=False, capture_output=True, text=True, timeout=180, env=os.environ | {"OUT": str(tmp_path)},
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    report = json.loads((tmp_path / "qk_norm_rope.json").read_text())
    rows = {row["variant"]: row for row in report["rows"]}
    assert list(rows) == ["copy", "norm", "rope", "norm_rope", "norm_rope_contiguous", "norm_rope_swap",
                          "triton_kernel", "triton_kernel_tokens"]
    assert all(row["ms"] > 0 and row["gb_per_s"] > 0 for row in rows.values())
    assert rows["norm_rope"]["bits_equal_to_norm_rope"] is None
    assert rows["norm_rope_contiguous"]["bits_equal_to_norm_rope"] is True
    assert rows["norm_rope_swap"]["bits_equal_to_norm_rope"] is True  # eager: the same products and sums
    assert rows["triton_kernel"]["bits_equal_to_norm_rope"] is True  # off CUDA the op is the model's own code
    assert rows["triton_kernel_tokens"]["bits_equal_to_norm_rope"] is True
    # The GPU run reports how close the kernel comes, not only whether every bit agrees (it rarely will).
    assert rows["triton_kernel"]["equal_share"] == 1.0 and rows["triton_kernel"]["max_abs_difference"] == 0.0
    assert rows["copy"]["equal_share"] is None
    assert "| tiny | norm_rope_swap |" in (tmp_path / "qk_norm_rope.md").read_text()
