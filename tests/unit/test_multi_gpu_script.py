"""scripts/gpu_multi.py's logic on CPU with tiny checkpoints: every stage runs its two ranks and reports equality.

On CPU (gloo, fp32) Ulysses2, CFG-parallel and FSDP + Ulysses2 are bitwise equal to their baselines, so the report
must say so; the GPU run on two H200s uses exactly this code with the released sizes.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.multiprocess
SCRIPT = Path(__file__).parents[2] / "scripts" / "gpu_multi.py"
SMALL = ["--device", "cpu", "--height", "48", "--width", "80", "--num-frames", "5", "--steps", "2"]


def run_stage(stage: str, checkpoint: Path, out: Path, *extra: str) -> dict:
    completed = subprocess.run(
        [sys.executable, str(SCRIPT), "--stage", stage, "--model-path", str(checkpoint), "--out", str(out), *SMALL,
         *extra],
        check=False, capture_output=True, text=True, timeout=180,
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    assert (out / f"gpu_multi_{stage}.md").read_text().startswith(f"### gpu_multi {stage}")
    return json.loads((out / f"gpu_multi_{stage}.json").read_text())


# The ulysses stage runs once per head-chunk count (the fsdp stage covers its single-run form).
# The cfg stage also runs with --profile and 3 steps: the second step of each run is profiled on rank 0.
@pytest.mark.parametrize(("stage", "run"), [("cfg", "cfg_parallel"), ("fsdp", "fsdp_ulysses2"),
                                            ("ulysses", "ulysses2_chunks2")])
def test_stage_reports_bitwise_equality(stage, run, tiny_pro_dir, tiny_distill_dir, tmp_path):
    checkpoint = tiny_pro_dir if stage == "cfg" else tiny_distill_dir
    extra = {"cfg": ("--profile", "--steps", "3"), "ulysses": ("--ulysses-chunks", "1,2")}.get(stage, ())
    report = run_stage(stage, checkpoint, tmp_path, *extra)
    equal = report["runs"][run]["equal_to_baseline"]
    assert equal["frames_equal"] and equal["waveform_equal"] and equal["num_frames_compared"] == 5
    # One interval per step after the warm-up step; with --profile (cfg, 3 steps) the profiled step is left out.
    assert len(report["runs"][run]["step_times_s"]) == 1
    assert sorted(report["runs"]) == sorted({"cfg": ["one_gpu", run], "fsdp": ["ulysses2", run],
                                             "ulysses": ["one_gpu", "ulysses2_chunks1", run]}[stage])
    if stage == "ulysses":
        assert report["runs"]["ulysses2_chunks1"]["equal_to_baseline"]["frames_equal"]
    if stage == "cfg":
        for name in ("one_gpu", run):
            profile = report["runs"][name]["kernel_profile"]
            assert profile["busy_ms"] > 0 and profile["top"] and "gemm" in profile["categories_ms"]
        assert "second step, rank 0" in (tmp_path / "gpu_multi_cfg.md").read_text()
        # The parallel run was profiled on both ranks.
        by_rank = report["runs"][run]["kernel_profile_by_rank"]
        assert len(by_rank) == 2 and all(summary["busy_ms"] > 0 for summary in by_rank)
        assert f"{run}, profiled step on every rank" in (tmp_path / "gpu_multi_cfg.md").read_text()
        # Both ranks ran the 1-GPU baseline on their own device at the same time.
        per_rank = report["runs"]["one_gpu"]["step_s_per_rank"]
        assert len(per_rank) == 2 and all(step > 0 for step in per_rank)
        assert "1-GPU step on each GPU" in (tmp_path / "gpu_multi_cfg.md").read_text()


def test_chunk_counts_that_do_not_divide_the_heads_fail_before_the_baseline(tiny_distill_dir, tmp_path):
    completed = subprocess.run(
        [sys.executable, str(SCRIPT), "--stage", "ulysses", "--model-path", str(tiny_distill_dir), "--out",
         str(tmp_path), *SMALL, "--ulysses-chunks", "1,3"],
        check=False, capture_output=True, text=True, timeout=180,
    )
    assert completed.returncode != 0
    assert "--ulysses-chunks [3] must divide the 2 video heads of each rank" in completed.stderr
    assert not (tmp_path / "gpu_multi_ulysses.json").exists()  # nothing ran


def test_cached_ulysses_takes_the_one_gpu_decisions(tiny_distill_dir, tmp_path):
    """--cache-dit-params: both the 1-GPU and the Ulysses2 request cache the same steps, and stay bitwise equal."""
    report = run_stage("ulysses", tiny_distill_dir, tmp_path, "--steps", "4", "--cache-dit-params",
                       '{"max_warmup_steps": 1, "residual_diff_threshold": 0.5}')
    assert report["cache_dit_params"] == {"max_warmup_steps": 1, "residual_diff_threshold": 0.5}
    one_gpu, ulysses = report["runs"]["one_gpu"], report["runs"]["ulysses2"]
    assert one_gpu["timings"]["cache_dit_cached_calls"] > 0 and one_gpu["notes"] == ulysses["notes"]
    equal = ulysses["equal_to_baseline"]
    assert equal["frames_equal"] and equal["waveform_equal"]


def test_tp_stage_with_lora_compares_within_rounding(tiny_distill_dir, tmp_path):
    """--stage tp --lora: TP2 against one process with and without the adapter (TP reorders sums: close, not
    bitwise), and how far the adapter moved the 1-process output (far more than TP's rounding). Dynamic LoRA on TP
    shards is checked in tests/parity/test_parallel_models.py."""
    report = run_stage("tp", tiny_distill_dir, tmp_path, "--lora", "merge")
    assert sorted(report["runs"]) == ["one_gpu", "one_gpu_lora", "tp2", "tp2_lora"]
    change = report["runs"]["one_gpu_lora"]["change_from_one_gpu"]["frames_max_abs_diff"]
    for name in ("tp2", "tp2_lora"):
        assert report["runs"][name]["equal_to_baseline"]["frames_max_abs_diff"] <= 1e-4 < change
    assert "frames max abs diff | frames mean abs diff |" in (tmp_path / "gpu_multi_tp.md").read_text()
    tp_lora = report["runs"]["tp2_lora"]["equal_to_baseline"]["frames_mean_abs_diff"]
    assert tp_lora < report["runs"]["one_gpu_lora"]["change_from_one_gpu"]["frames_mean_abs_diff"] / 100


def test_ring_stage_reports_rounding_level_differences(tiny_distill_dir, tmp_path):
    """Ring2's blockwise softmax reorders the attention sums, so the frames match one GPU within fp32 rounding (not
    bit for bit); the report carries the distances the GPU run is judged by."""
    report = run_stage("ring", tiny_distill_dir, tmp_path)
    assert sorted(report["runs"]) == ["one_gpu", "ring2"]
    equal = report["runs"]["ring2"]["equal_to_baseline"]
    assert equal["num_frames_compared"] == 5
    assert 0 <= equal["frames_max_abs_diff"] < 1e-4 and equal["frames_mean_abs_diff"] < 1e-5
