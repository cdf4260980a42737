"""scripts/gpu_rewrite.py's logic on CPU with the tiny encoder: every row runs, with and without an image, through
the static cache and eager; the GPU run (the full-size dummy Qwen2.5-VL-7B) uses exactly this code."""

import json
import subprocess
import sys
from pathlib import Path

import torch
from torch.nn.attention import SDPBackend

from k6serve.pipelines.expand_prompt import REWRITE_ATTENTION_BACKENDS

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


def test_the_repeat_check_runs_on_the_tiny_encoder_and_the_demo_worker(one_torch_thread):
    """scripts/gpu_rewrite_repeat.py's logic (in this process: it is a library of functions and a main): on the CPU
    the prefill logits, the rewrites and the demo worker's requests repeat exactly, as a GPU's should."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_rewrite_repeat", SCRIPT.parent / "gpu_rewrite_repeat.py")
    assert spec is not None and spec.loader is not None
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    report = script.main(["--device", "cpu", "--tiny", "--tokens", "8", "--engine", "demo"])
    assert report["prefill_repeats_equal"] == [True, True] and report["prefill_max_difference"] == 0.0
    assert report["prefill_nan"] == report["prefill_inf"] == 0
    assert report["prefill_top2"][0] >= report["prefill_top2"][1]
    assert report["rewrite_parts_at"] == [None, None] and report["rewrite_tokens"] == [8, 8, 8]
    # the prefill and one forward per token after the first (the prefill's logits give the first)
    assert report["forwards"] == [8, 8, 8] and report["logits_part_at"] == [None, None]
    assert report["margin_where_ids_part"] == [None, None] and "do_sample" in report["generation"]
    steps = [torch.zeros(3), torch.tensor([1.0, 3.0, 2.5])]
    assert script._logits_parted([steps, steps, [steps[0], torch.ones(3)]]) == [None, 1]
    assert script._margin(steps, 1) == 0.5 and script._margin(steps, None) is None
    # the demo worker's models are the tiny encoder the bench builds: the same ids
    assert report["engine_rewrite_parts_at"] == [None, None] and report["engine_digest"] == report["digest"]
    assert report["engine_requests_equal"] == [True, True]
    # the rewrite's forwards of each request (the encode's own forward reaches no lm_head)
    assert report["engine_request_forwards"] == [8, 8, 8] and report["engine_request_logits_part_at"] == [None, None]
    assert script._parted([[1, 2, 3], [1, 2, 3], [1, 5, 3], [1, 2]]) == [None, 1, 2]
    # SDPA kept off cuDNN (a GPU's question; on the CPU the same ids)
    report = script.main(["--device", "cpu", "--tiny", "--tokens", "8", "--no-cudnn-attention"])
    assert report["no_cudnn_attention"] and report["rewrite_parts_at"] == [None, None]
    # cuDNN allowed again for the rewrite (the pre-fix timing), then the product's list restored
    kept = list(REWRITE_ATTENTION_BACKENDS)
    cudnn = script.main(["--device", "cpu", "--tiny", "--tokens", "8", "--cudnn-attention"])
    assert cudnn["cudnn_attention"] and cudnn["digest"] == report["digest"] and len(cudnn["rewrite_seconds"]) == 3
    assert REWRITE_ATTENTION_BACKENDS == kept and SDPBackend.CUDNN_ATTENTION not in kept
    # through the static cache (compiled on CUDA only): on the CPU the eager ids
    compiled = script.main(["--device", "cpu", "--tiny", "--tokens", "8", "--compile-rewrite"])
    assert compiled["compile_rewrite"] and compiled["digest"] == report["digest"]
    assert compiled["rewrite_parts_at"] == [None, None] and len(compiled["first_ids"]) == 8
    assert compiled["forwards"] == [] and compiled["logits_part_at"] == []  # no hooks on a compiled step
    assert len(compiled["rewrite_seconds"]) == 3 and min(compiled["rewrite_seconds"]) > 0
