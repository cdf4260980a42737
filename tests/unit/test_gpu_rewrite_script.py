"""scripts/gpu_rewrite.py's logic on CPU with the tiny encoder: every row runs, with and without an image, through
the static cache and eager; the GPU run (the full-size dummy Qwen2.5-VL-7B) uses exactly this code."""

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).parents[2] / "scripts" / "gpu_rewrite.py"


def test_every_rewrite_row_runs_on_the_tiny_encoder(tmp_path):
    completed = subprocess.run([sys.executable, str(SCRIPT), "--out", str(tmp_path), "--tiny", "--device", "cpu",
                                "--tokens", "8"], check=False, capture_output=True, text=True, timeout=300)
    assert completed.returncode == 0, completed.stdout[-2000:] + completed.stderr[-2000:]
    report = json.loads((tmp_path / "gpu_rewrite.json").read_text())
    assert [(row["name"], row["image"], row["static_cache"], row["tokens"]) for row in report["rows"]] == [
        ("warm-up, image (compile)", True, True, 4), ("warm-up, text (compile)", False, True, 4),
        ("compiled, image", True, True, 8), ("compiled, text", False, True, 8), ("eager, text", False, False, 8)]
    assert all(row["error"] is None and row["ms_per_token"] > 0 for row in report["rows"])
    assert report["cache_tokens"] == 2048  # one cache, sized for 1,024 new tokens
    assert "| compiled, image | 8 |" in completed.stdout
