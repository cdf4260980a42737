"""scripts/gpu_cross_process.sh's logic on the CPU, with a stand-in `python3` first on PATH (the real request takes
about 45 s a process here): three processes, the third alone with an empty inductor cache folder of its own; each
MP4's sha256 in cross_process.txt (with a rewrite's digest where the log has one); the verdicts; a failed process
named with its log's tail."""

from __future__ import annotations

import hashlib
import os
import subprocess
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "gpu_cross_process.sh"

# Writes clip.mp4 under --output-path; its bytes are the cache folder the process was given (STUB_VARY=1) or fixed.
# STUB_FAIL names a run (the folder's last part) that fails as a process would, after writing its log.
STUB = r'''#!/usr/bin/env bash
out=""; prev=""
for arg in "$@"; do
  [ "$prev" = "--output-path" ] && out=$arg
  prev=$arg
done
echo "args: $*"
echo "cache: ${TORCHINDUCTOR_CACHE_DIR:-unset}"
# STUB_REWRITE: print a rewrite as k6serve generate --expand-prompts does, the cache folder in it with STUB_VARY=1.
if [ -n "${STUB_REWRITE:-}" ]; then
  if [ "${STUB_VARY:-0}" = 1 ]; then echo "expanded prompt: $STUB_REWRITE ${TORCHINDUCTOR_CACHE_DIR:-shared}"
  else echo "expanded prompt: $STUB_REWRITE"; fi
fi
if [ "${STUB_FAIL:-}" = "$(basename "$out")" ]; then echo "RuntimeError: CUDA out of memory" >&2; exit 3; fi
mkdir -p "$out"
if [ "${STUB_VARY:-0}" = 1 ]; then printf '%s' "${TORCHINDUCTOR_CACHE_DIR:-shared}" > "$out/clip.mp4"
else printf 'same' > "$out/clip.mp4"; fi
'''


def _run(tmp_path: Path, **env_extra: str) -> tuple[subprocess.CompletedProcess[str], Path]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    stub = bin_dir / "python3"
    stub.write_text(STUB)
    stub.chmod(0o755)
    out = tmp_path / "out"
    # The script's own settings (MODEL, LOAD_FORMAT, SIZE) and the cache folder from the environment would change it.
    env = {key: value for key, value in os.environ.items()
           if key not in ("TORCHINDUCTOR_CACHE_DIR", "MODEL", "LOAD_FORMAT", "SIZE", "EXTRA_FLAGS")}
    env.update(OUT=str(out), PATH=f"{bin_dir}:{env['PATH']}", **env_extra)
    result = subprocess.run(["bash", str(SCRIPT)], env=env, capture_output=True, text=True, timeout=60)
    return result, out


def test_three_equal_mp4s(tmp_path: Path) -> None:
    result, out = _run(tmp_path)
    assert result.returncode == 0, result.stderr
    digest = hashlib.sha256(b"same").hexdigest()
    assert (out / "cross_process.txt").read_text().splitlines() == [
        f"first {digest}", f"second {digest}", f"fresh_cache {digest}"]
    assert result.stdout.splitlines()[-1] == "same MP4 bytes in all three processes"
    # The defaults: Lite-distill, dummy weights, 256x384x17, 2 steps, seed 7.
    log = (out / "first.log").read_text()
    assert "-m k6serve generate --model-path kandinskylab/Kandinsky-6.0-Lite-distill-5s-Diffusers" in log
    assert "--load-format dummy --height 256 --width 384 --num-frames 17 --num-inference-steps 2 --seed 7" in log
    assert log.splitlines()[0].endswith("--output-file-name clip.mp4")  # no extra flags unless asked


def test_extra_flags_reach_every_process(tmp_path: Path) -> None:
    result, out = _run(tmp_path, EXTRA_FLAGS="--compile-vae true --attention-backend sdpa")
    assert result.returncode == 0, result.stderr
    for run in ("first", "second", "fresh_cache"):
        first_line = (out / f"{run}.log").read_text().splitlines()[0]
        assert first_line.endswith("--output-file-name clip.mp4 --compile-vae true --attention-backend sdpa")


def test_only_the_third_process_gets_a_fresh_cache_folder(tmp_path: Path) -> None:
    result, out = _run(tmp_path, STUB_VARY="1")
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[-1] == "the MP4s differ"
    lines = (out / "cross_process.txt").read_text().splitlines()
    assert lines[0].split()[1] == lines[1].split()[1] != lines[2].split()[1]
    assert "cache: unset" in (out / "first.log").read_text()
    assert "cache: unset" in (out / "second.log").read_text()
    fresh = (out / "fresh_cache.log").read_text().split("cache: ")[1].split()[0]
    assert fresh != "unset" and not Path(fresh).exists()  # made for the run, removed after it


def test_a_failed_process_stops_the_run_with_its_log(tmp_path: Path) -> None:
    result, out = _run(tmp_path, STUB_FAIL="second")
    assert result.returncode == 1
    assert "second failed:" in result.stdout
    assert "RuntimeError: CUDA out of memory" in result.stdout
    assert len((out / "cross_process.txt").read_text().splitlines()) == 1


def test_refuses_without_an_output_folder(tmp_path: Path) -> None:
    env = {key: value for key, value in os.environ.items() if key != "OUT"}
    result = subprocess.run(["bash", str(SCRIPT)], env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode != 0
    assert "set OUT to a folder for the results" in result.stderr


def test_the_fresh_cache_folder_is_removed_when_its_process_fails(tmp_path: Path) -> None:
    result, out = _run(tmp_path, STUB_FAIL="fresh_cache")
    assert result.returncode == 1 and "fresh_cache failed:" in result.stdout
    fresh = (out / "fresh_cache.log").read_text().split("cache: ")[1].split()[0]
    assert fresh != "unset" and not Path(fresh).exists()


def test_a_rewrite_is_compared_too(tmp_path: Path) -> None:
    """With --expand-prompts each line also holds the `expanded prompt:` line's digest, and a second verdict says
    whether the three processes rewrote alike (the MP4s' verdict stays as it was)."""
    result, out = _run(tmp_path, STUB_REWRITE="a fox in the snow")
    assert result.returncode == 0, result.stderr
    rewrite = hashlib.sha256(b"expanded prompt: a fox in the snow").hexdigest()[:16]
    digest = hashlib.sha256(b"same").hexdigest()
    assert (out / "cross_process.txt").read_text().splitlines() == [
        f"{run} {digest} rewrite {rewrite}" for run in ("first", "second", "fresh_cache")]
    assert result.stdout.splitlines()[-2:] == ["same MP4 bytes in all three processes",
                                              "the same rewrite in all three processes"]
    (tmp_path / "vary").mkdir()
    result, out = _run(tmp_path / "vary", STUB_REWRITE="a fox", STUB_VARY="1")
    assert result.stdout.splitlines()[-2:] == ["the MP4s differ", "the rewrites differ"]
