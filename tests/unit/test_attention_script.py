"""scripts/gpu_attention.py's logic on the CPU: SDPA is timed, the GPU kernels are listed with why they did not run;
with --fa4-tiles one row per listed FA4 tile config, and a config that fails does not stop the others."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).parents[2] / "scripts" / "gpu_attention.py"


def _run_script(tmp_path, *arguments):
    """The script in a subprocess, k6serve from this checkout (an editable install may point elsewhere)."""
    completed = subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", "--tiny", "--repeats", "2",
                                *arguments], check=False, capture_output=True, text=True, timeout=120,
                               env=os.environ | {"OUT": str(tmp_path), "PYTHONPATH": os.pathsep.join(
                                   filter(None, [str(SCRIPT.parents[1]), os.environ.get("PYTHONPATH")]))})
    assert completed.returncode == 0, completed.stderr[-3000:]
    return json.loads((tmp_path / "attention.json").read_text())["rows"]


MAIN = ["sdpa", "fa3", "fa4", "fa3 fp8", "fa3 fp8 kernel", "sdpa fp8 inputs", "fa3 splits 2", "fa3 splits 4",
        "fa3 splits 8"]


def test_cpu_run_times_sdpa_and_reports_the_gpu_kernels(tmp_path):
    every = _run_script(tmp_path)
    assert [row["shape"] for row in every] == ["tiny"] * len(MAIN) + ["tiny-av"] * len(MAIN)
    rows = {row["kernel"]: row for row in every if row["shape"] == "tiny"}
    assert list(rows) == MAIN
    assert rows["sdpa"]["ms"] > 0 and rows["sdpa"]["tflops"] > 0 and rows["sdpa"]["max_abs_difference"] == 0
    assert rows["sdpa"]["relative_rms_difference"] == 0
    for name in ("fa3", "fa4", "fa3 fp8", "fa3 fp8 kernel", "fa3 splits 4"):
        assert rows[name]["error"] == "needs CUDA" and rows[name]["ms"] is None
    # The e4m3 rounding of the inputs alone: clearly visible (3 mantissa bits), but a few percent, not garbage.
    assert 0.005 < rows["sdpa fp8 inputs"]["relative_rms_difference"] < 0.08
    markdown = (tmp_path / "attention.md").read_text()
    assert "| tiny (4x16) | fa4 | - | - | - | - | needs CUDA |" in markdown
    # The short-query shape (as the audio-from-video attention): 5 queries on 96 keys, its FLOPs from both.
    cross = {row["kernel"]: row for row in every if row["shape"] == "tiny-av"}
    assert (cross["sdpa"]["tokens"], cross["sdpa"]["key_tokens"]) == (5, 96) and cross["sdpa"]["ms"] > 0
    assert cross["sdpa"]["tflops"] == pytest.approx(4 * 5 * 96 * 4 * 16 / cross["sdpa"]["ms"] / 1e9)
    assert 0.005 < cross["sdpa fp8 inputs"]["relative_rms_difference"] < 0.08


def test_split_kernels_pass_num_splits_to_fa3(load_script):
    calls = []
    splits = load_script("gpu_attention").split_kernels(lambda q, k, v, **options: calls.append(options) or q)
    assert list(splits) == ["fa3 splits 2", "fa3 splits 4", "fa3 splits 8"]
    assert splits["fa3 splits 4"]("q", "k", "v") == "q" and calls == [{"num_splits": 4}]
    assert load_script("gpu_attention").split_kernels("no fa3") == {name: "no fa3" for name in splits}


def test_fa4_tile_configs_are_plausible_sm90_configs_with_the_default_first(load_script):
    script = load_script("gpu_attention")
    assert set(script.FA4_TILES) == {64, 128}
    defaults = {128: (128, 128, True, True), 64: (192, 128, True, True)}  # flash_attn/cute/interface.py's
    for head_dim, configs in script.FA4_TILES.items():
        assert configs[0] == defaults[head_dim] and len(set(configs)) == len(configs)
        for tile_m, tile_n, mma_pv_is_rs, intra_wg_overlap in configs:
            assert tile_m in (64, 128, 192) and tile_n % 8 == 0 and tile_n <= 256  # 1-3 MMA warpgroups, wgmma N
            assert isinstance(mma_pv_is_rs, bool) and isinstance(intra_wg_overlap, bool)
    assert (128, 176, True, True) in script.FA4_TILES[128]  # FA3's tile for 128-wide heads
    assert script.fa4_tile_configs(16) == script.fa4_tile_configs(64) and script.fa4_tile_configs(80) == \
        script.fa4_tile_configs(128) == script.fa4_tile_configs(256)
    assert script.fa4_tile_name(128, 176, True, True) == "fa4 128x176 rs ol"
    assert script.fa4_tile_name(192, 192, False, True) == "fa4 192x192 ol"
    assert script.fa4_tile_name(192, 128, True, False) == "fa4 192x128 rs"


def test_cpu_run_with_fa4_tiles_lists_every_config_with_why_it_did_not_run(tmp_path, load_script):
    script = load_script("gpu_attention")
    rows = _run_script(tmp_path, "--fa4-tiles", "--shapes", "tiny")
    names = [script.fa4_tile_name(*config) for config in script.fa4_tile_configs(16)]  # the tiny shape's 16
    main = MAIN
    assert [row["kernel"] for row in rows] == [*main, *names]
    for row in rows[len(main):]:
        assert row["shape"] == "tiny" and row["error"] == "needs CUDA"
        assert row["ms"] is row["tflops"] is row["max_abs_difference"] is None
    markdown = (tmp_path / "attention.md").read_text()
    assert all(f"| tiny (4x16) | {name} | - | - | - | - | needs CUDA |" in markdown for name in names)


def test_a_failing_tile_config_is_recorded_and_the_next_one_still_runs(monkeypatch, capsys, load_script):
    script = load_script("gpu_attention")

    def broken(query, key, value):
        raise RuntimeError("no kernel for this tile\n" + "x" * 1000)

    monkeypatch.setattr(script, "fa4_tile_kernels", lambda device, head_dim: {
        "fa4 1x1": broken, "fa4 2x2": script._sdpa, "fa4 3x3": "needs CUDA"})
    rows = script.run(torch.device("cpu"), {"tiny": script.TINY["tiny"]}, repeats=1, fa4_tiles=True)
    tiles = {row["kernel"]: row for row in rows[len(MAIN):]}  # after the main rows
    assert list(tiles) == ["fa4 1x1", "fa4 2x2", "fa4 3x3"]
    error = tiles["fa4 1x1"]["error"]
    assert error.startswith("RuntimeError: no kernel for this tile x") and "\n" not in error
    assert len(error) == script.ERROR_CHARACTERS and error.endswith("...") and tiles["fa4 1x1"]["ms"] is None
    assert tiles["fa4 2x2"]["error"] is None and tiles["fa4 2x2"]["ms"] > 0
    assert tiles["fa4 2x2"]["max_abs_difference"] == 0  # the same inputs as the sdpa row, which is the reference
    assert tiles["fa4 3x3"]["error"] == "needs CUDA"


def test_kernels_option_times_only_the_named_kernels_in_that_order(tmp_path, load_script):
    rows = _run_script(tmp_path, "--kernels", "sdpa fp8 inputs,sdpa", "--shapes", "tiny")
    assert [row["kernel"] for row in rows] == ["sdpa fp8 inputs", "sdpa"]
    assert rows[0]["max_abs_difference"] == 0 and rows[1]["relative_rms_difference"] > 0  # the first is the reference
    with pytest.raises(SystemExit, match="--kernels: unknown \\['fa5'\\]"):
        load_script("gpu_attention").main(["--device", "cpu", "--tiny", "--kernels", "sdpa,fa5",
                                           "--out", str(tmp_path)])


def test_shapes_option_checks_the_names_of_the_mode(tmp_path, load_script):
    script = load_script("gpu_attention")
    with pytest.raises(SystemExit, match="--shapes: unknown \\['lite'\\]; the shapes with --tiny are "
                       "\\['tiny', 'tiny-av'\\]"):
        script.main(["--device", "cpu", "--tiny", "--shapes", "lite", "--out", str(tmp_path)])
    assert [row["shape"] for row in _run_script(tmp_path, "--shapes", "tiny", "--kernels", "sdpa")] == ["tiny"]
