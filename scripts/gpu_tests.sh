#!/usr/bin/env bash
# The test suite on the GPU host (torch 2.11, transformers 5.17: the floor the project supports; CI runs torch 2.13
# on a CPU), split so that it fits one 10-minute device call: the test files are dealt round-robin, largest first,
# to NGROUPS pytest processes that run at once (the host has 16 cores and one GPU; each process gets
# 16 / NGROUPS threads), each under LIMIT seconds. The deal snakes (0..N-1, then N-1..0): dealt in one direction,
# group 0 took the largest file of every round, and in the fiftieth session it alone ran past 470 s. The device brings back at most 8 files, so the groups' logs are
# written under /tmp and joined into one $OUT/tests/groups.log. Carry .whlG, .whlP and .whlS.
#   NGROUPS=13 LIMIT=470 bash scripts/gpu_tests.sh tests/unit tests/server tests/parity
#   (the whole suite: at NGROUPS=8 one group of the heaviest multi-process files ran past 550 s in the
#   twenty-eighth session; at ten the call took 443 s and its longest group 415 s in the thirtieth; at eleven 338 s
#   and 320 s in the thirty-second, but in the forty-eighth, with 3,000 tests, its first group ran past 470 s:
#   use NGROUPS=13; in the fiftieth, on an H100 with 3,092 tests, group 0 of the one-way deal still ran past
#   470 s while the others ended by 322 s: hence the snake)
#   bash scripts/gpu_tests.sh tests/unit/test_generate_cli_api.py tests/server/test_api.py
# Prints one line per group (its files, its pytest summary) and the failures' names; $OUT/tests/summary.txt
# keeps the same.
set -u
source "$(dirname "$0")/gpu_setup.sh"  # .whlG / .whlP into /tmp/site, PYTHONPATH, nvidia-smi.csv
if [ -d .whlS ] && [ ! -d /tmp/site/fastapi ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whlS/*.whl \
    >> "$OUT/install.log" 2>&1
fi
NGROUPS=${NGROUPS:-8}
LIMIT=${LIMIT:-540}
[ $# -eq 0 ] && set -- tests/unit tests/server
mkdir -p "$OUT/tests"
LOGS=/tmp/k6serve-gpu-tests
rm -rf "$LOGS" && mkdir -p "$LOGS"
# Largest files first, so the round-robin deal evens out the groups' lengths (size stands in for run time).
mapfile -t FILES < <(find "$@" -name 'test_*.py' -type f -printf '%s %p\n' | sort -rn | cut -d' ' -f2-)
THREADS=$(( $(nproc) / NGROUPS )); [ "$THREADS" -lt 1 ] && THREADS=1
pids=()
for ((g = 0; g < NGROUPS; g++)); do
  group=()
  for ((i = 0; i < ${#FILES[@]}; i++)); do
    round=$(( i / NGROUPS )) place=$(( i % NGROUPS ))
    [ $(( round % 2 )) -eq 1 ] && place=$(( NGROUPS - 1 - place ))
    [ "$place" -eq "$g" ] && group+=("${FILES[$i]}")
  done
  [ ${#group[@]} -eq 0 ] && continue
  printf '%s\n' "${group[@]}" > "$LOGS/group$g.files"
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
