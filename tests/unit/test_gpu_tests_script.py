"""scripts/gpu_tests.sh's logic on the CPU (the GPU host runs the whole suite through it): the test files dealt to
NGROUPS pytest processes, largest work first to the least loaded group; each group's pytest summary, its failures'
names and a time limit's cut in summary.txt; every group's log joined in groups.log. Run in a scratch tree of tiny
test files; the wheel folder comes from K6SERVE_GPU_SITE (nothing to install there)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "gpu_tests.sh"


def _write(tree: Path, name: str, body: str, pad_to: int = 0) -> None:
    text = body + "\n"
    if pad_to:
        text += "#" * (pad_to - len(text) - 1) + "\n"  # its size is its work when the seconds table lacks it
    (tree / name).write_text(text)


def _run(tmp_path: Path, files: list[str], **env_extra: str) -> tuple[subprocess.CompletedProcess[str], Path]:
    tree, out = tmp_path / "tree", tmp_path / "out"
    env = {key: value for key, value in os.environ.items() if key not in ("PYTEST_ADDOPTS", "PYTEST_XDIST_WORKER")}
    env.update(OUT=str(out), K6SERVE_GPU_SITE=str(tmp_path / "site"),
               PATH=f"{Path(sys.executable).parent}:{env['PATH']}", **env_extra)
    result = subprocess.run(["bash", str(SCRIPT), *files], cwd=tree, env=env, capture_output=True, text=True,
                            timeout=120)
    return result, out


def test_groups_summaries_failures_and_the_joined_log(tmp_path: Path) -> None:
    tree = tmp_path / "tree"
    tree.mkdir()
    _write(tree, "test_big.py", "def test_a():\n    pass\n\ndef test_b():\n    pass", pad_to=6000)
    _write(tree, "test_mid.py", "def test_fails():\n    assert 1 == 2", pad_to=4000)
    _write(tree, "test_small.py", "import pytest\n\ndef test_skip():\n    pytest.skip('no GPU here')", pad_to=1500)
    result, out = _run(tmp_path, ["test_big.py", "test_mid.py", "test_small.py"], NGROUPS="2", LIMIT="60")
    assert result.returncode == 0, result.stderr
    summary = (out / "tests" / "summary.txt").read_text().splitlines()
    # test_big.py (3 s of work) to group 0; test_mid.py (2 s) to group 1; test_small.py (0.75 s) to the lighter, 1.
    assert summary[0].startswith("group0 rc=0 files=1: 2 passed")
    assert summary[1].startswith("group1 rc=1 files=2: 1 failed, 1 skipped")
    assert summary[2] == "FAILED test_mid.py::test_fails - assert 1 == 2"
    assert result.stdout.splitlines() == summary
    joined = (out / "tests" / "groups.log").read_text()
    assert "===== group0: test_big.py \n" in joined
    assert "===== group1: test_mid.py test_small.py \n" in joined
    assert "SKIPPED [1] test_small.py:4: no GPU here" in joined


def test_a_group_past_its_limit_is_named(tmp_path: Path) -> None:
    tree = tmp_path / "tree"
    tree.mkdir()
    _write(tree, "test_slow.py", "import time\n\ndef test_sleeps():\n    time.sleep(60)")
    result, out = _run(tmp_path, ["test_slow.py"], NGROUPS="1", LIMIT="3")
    assert result.returncode == 0, result.stderr
    line = (out / "tests" / "summary.txt").read_text().splitlines()[0]
    assert line.startswith("group0 rc=124 files=1: TIMED OUT after 3s;")


def test_script_parses() -> None:
    result = subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
