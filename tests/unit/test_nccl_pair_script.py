"""scripts/gpu_nccl_pair.py's sequence on the CPU (gloo): every step prints once, from rank 0, in order."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parents[2] / "scripts" / "gpu_nccl_pair.py"


@pytest.mark.multiprocess
def test_two_gloo_ranks_print_every_step_in_order():
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         str(SCRIPT), "--cpu"],
        capture_output=True, text=True, timeout=120,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert result.returncode == 0, result.stderr[-2000:]
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        import gpu_nccl_pair
    finally:
        sys.path.pop(0)
    lines = [line for line in result.stdout.splitlines() if line.endswith(": n/a (CPU)")]
    assert lines == [f"{step}: n/a (CPU)" for step in gpu_nccl_pair.STEPS]
