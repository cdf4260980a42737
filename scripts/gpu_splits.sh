#!/usr/bin/env bash
# FA3's split-KV for the short-query attention (issue 5), on one H200, in one device call. Carry .whlR (diffusers
# only, for the reference rows) and .whlH (fa3-fwd); run from the repository root with OUT set:
#   bash scripts/gpu_splits.sh probe pick ours [reference]
# steps:
#   probe      scripts/gpu_attention.py on the audio-from-video shapes (218 queries on 47,616 keys) with FA3 at 1 / 2 /
#              4 / 8 key splits -> $OUT/attention/attention.{json,md}
#   pick       the fastest split count of the Pro row -> $OUT/best_splits.txt (1 when no split wins by 2%)
#   ours       the Pro-distill DiT forward, our fast configuration only, with K6SERVE_FA3_SPLITS=1 and then with the
#              picked count (skipped when it is 1) -> $OUT/dit_splits_<n>.json
#   reference  gpu_single.py dit with diffusers eager and compiled in the same process, at the picked count
#              -> $OUT/reference/dit.{json,md}
set -u
: "${OUT:?set OUT to the folder for logs and JSON}"
mkdir -p /tmp/site
if [ ! -e /tmp/site/fa3_fwd_interface.py ]; then
  wheels=$(ls .whlR/*.whl .whlH/*.whl 2>/dev/null)
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site $wheels \
    > "$OUT/install.log" 2>&1
fi
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$OUT/nvidia-smi.csv" 2>&1
step_done() { echo "$1 rc=$2 $(date +%T)" >> "$OUT/steps.txt"; }
best() { cat "$OUT/best_splits.txt" 2>/dev/null || echo 1; }
[ $# -eq 0 ] && set -- probe pick ours
for step in "$@"; do
  case "$step" in
    probe)
      timeout 200 python3 scripts/gpu_attention.py --shapes pro-av,lite-av \
        --kernels "fa3,fa3 splits 2,fa3 splits 4,fa3 splits 8" --out "$OUT/attention" > "$OUT/probe.log" 2>&1
      step_done probe $?
      ;;
    pick)
      python3 - "$OUT" > "$OUT/pick.log" 2>&1 <<'PY'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
rows = [r for r in json.loads((out / "attention" / "attention.json").read_text())["rows"]
        if r["shape"] == "pro-av" and r.get("ms") and not r.get("error")]
base = next(r["ms"] for r in rows if r["kernel"] == "fa3")
fastest = min(rows, key=lambda r: r["ms"])
splits = int(fastest["kernel"].split()[-1]) if "splits" in fastest["kernel"] else 1
if fastest["ms"] > 0.98 * base:
    splits = 1
print(f"fa3 {base:.4f} ms; fastest {fastest['kernel']} {fastest['ms']:.4f} ms -> {splits}")
(out / "best_splits.txt").write_text(f"{splits}\n")
PY
      step_done pick $?
      ;;
    ours)
      for splits in 1 $(best); do
        [ -f "$OUT/dit_splits_$splits.json" ] && continue
        K6SERVE_FA3_SPLITS=$splits timeout 260 python3 -m k6serve.bench --stage dit --variant pro-distill \
          --device cuda --backends fa --skip-reference --skip-eager --repeats 5 \
          --json "$OUT/dit_splits_$splits.json" > "$OUT/dit_splits_$splits.log" 2>&1
        step_done "ours splits=$splits" $?
      done
      ;;
    reference)
      K6SERVE_FA3_SPLITS=$(best) timeout 560 python3 scripts/gpu_single.py dit --out "$OUT/reference" \
        --models pro-distill --backends fa --skip-eager --reference-compiled > "$OUT/reference.log" 2>&1
      step_done "reference splits=$(best)" $?
      ;;
    *) echo "unknown step $step" >> "$OUT/steps.txt" ;;
  esac
done
