#!/usr/bin/env bash
# The test suite on the GPU host (torch 2.11, transformers 5.17: the floor the project supports; CI runs torch 2.13
# on a CPU), split so that it fits one 10-minute device call: the test files are dealt to NGROUPS pytest processes
# that run at once (the host has 16 cores and one GPU; each process gets 16 / NGROUPS threads), each under LIMIT
# seconds. Each file goes, longest first, to the group with the least work so far; a file's work is its seconds in
# scripts/gpu_test_seconds.txt (measured on the GPU host), else its size at 2 kB a second. Size alone misled: the
# multi-process files are small and slow (test_stop_signals.py, 9 tests, 200 s), and in the fiftieth session the
# group that drew several of them ran past its limit in both of the whole suite's calls. The device brings back at
# most 8 files, so the groups' logs are written under /tmp and joined into one $OUT/tests/groups.log. Carry .whlA
# (or .whlG and .whlP; then FA3's tests skip) and .whlS.
#   NGROUPS=14 LIMIT=500 bash scripts/gpu_tests.sh tests/unit tests/server tests/parity
#   (the whole suite: 3,137 tests in the sixtieth session with FA3's, 259 s; its fourteen groups took 187-249 s each)
#   bash scripts/gpu_tests.sh tests/unit/test_generate_cli_api.py tests/server/test_api.py
# Prints one line per group (its files, its pytest summary) and the failures' names; $OUT/tests/summary.txt
# keeps the same.
set -u
source "$(dirname "$0")/gpu_setup.sh"  # .whlA (or .whlG / .whlP) into $site (/tmp/site), PYTHONPATH, nvidia-smi.csv
if [ -d .whlS ] && [ ! -d "$site/fastapi" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" .whlS/*.whl \
    >> "$OUT/install.log" 2>&1
fi
NGROUPS=${NGROUPS:-8}
LIMIT=${LIMIT:-540}
[ $# -eq 0 ] && set -- tests/unit tests/server
mkdir -p "$OUT/tests"
LOGS=$(mktemp -d)  # the groups' lists and logs, joined into $OUT/tests/groups.log at the end
trap 'rm -rf "$LOGS"' EXIT
# Longest first, each to the least loaded group (work: the measured seconds, else the size at 2 kB a second).
python3 - "$NGROUPS" "$LOGS" "$(dirname "$0")/gpu_test_seconds.txt" "$@" <<'PY'
import os, sys
from pathlib import Path
groups, logs, table, roots = int(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3]), sys.argv[4:]
seconds = {}
if table.is_file():
    for line in table.read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            value, path = line.split(None, 1)
            seconds[path.strip()] = float(value)
files = sorted({str(f) for root in roots
                 for f in ([Path(root)] if root.endswith(".py") else Path(root).rglob("test_*.py"))})
work = {f: seconds.get(f, os.path.getsize(f) / 2000) for f in files}
load, members = [0.0] * groups, [[] for _ in range(groups)]
for f in sorted(files, key=lambda f: -work[f]):
    g = load.index(min(load))
    load[g] += work[f]
    members[g].append(f)
for g, group in enumerate(members):
    if group:
        (logs / f"group{g}.files").write_text("\n".join(group) + "\n")
PY
THREADS=$(( $(nproc) / NGROUPS )); [ "$THREADS" -lt 1 ] && THREADS=1
pids=()
for ((g = 0; g < NGROUPS; g++)); do
  [ -f "$LOGS/group$g.files" ] || continue
  mapfile -t group < "$LOGS/group$g.files"
  OMP_NUM_THREADS=$THREADS MKL_NUM_THREADS=$THREADS timeout "$LIMIT" python3 -m pytest -q -p no:cacheprovider -rfEs \
    --durations=10 "${group[@]}" > "$LOGS/group$g.log" 2>&1 &
  pids+=("$!:$g")
done
: > "$OUT/tests/summary.txt"
for entry in "${pids[@]}"; do
  pid=${entry%%:*} g=${entry##*:}
  wait "$pid"; rc=$?
  last=$(grep -E '(passed|failed|error)' "$LOGS/group$g.log" | tail -1)
  [ "$rc" -eq 124 ] && last="TIMED OUT after ${LIMIT}s; $(tail -c 300 "$LOGS/group$g.log" | tr '\n' ' ')"
  echo "group$g rc=$rc files=$(wc -l < "$LOGS/group$g.files"): $last" >> "$OUT/tests/summary.txt"
  grep -E '^(FAILED|ERROR) ' "$LOGS/group$g.log" >> "$OUT/tests/summary.txt"
done
for entry in "${pids[@]}"; do
  g=${entry##*:}
  echo "===== group$g: $(tr '\n' ' ' < "$LOGS/group$g.files")"
  cat "$LOGS/group$g.log"
done > "$OUT/tests/groups.log"
cat "$OUT/tests/summary.txt"
