#!/usr/bin/env bash
# Cache-DiT on one GPU: the CUDA tests (Cache-DiT with memory mode's streamed blocks, and LoRA's bf16 check), then a
# Lite generation with and without caching in one process (`k6serve bench --stage generate --cache-dit-params`).
# Run from the repository root on the device machine with .whlG (diffusers, av) and .whlP (pytest) carried; every
# step has its own time limit and writes its log under $OUT.
#   bash scripts/gpu_cache_dit.sh test lite-static
#   steps: test, lite-static (20 steps, cache-dit's "medium" mask with the static policy: a fixed 9 of 20 steps
#          cached, so the time saved is the weights' property-free cost of a cached step), lite-dynamic (50 steps,
#          the default settings: what random weights' residuals decide)
source "$(dirname "$0")/gpu_setup.sh"  # wheels into /tmp/site, PYTHONPATH, nvidia-smi.csv
bench() {  # name, time limit, then the bench's own flags
  local name=$1 limit=$2; shift 2
  timeout "$limit" python3 -m k6serve.bench --stage generate --repeats 1 --json "$OUT/$name.json" "$@" \
    > "$OUT/$name.log" 2>&1
  echo "$name rc=$?" >> "$OUT/steps.txt"
}
[ $# -eq 0 ] && set -- test lite-static
for step in "$@"; do
  case "$step" in
    test)
      timeout 180 python3 -m pytest -q -p no:cacheprovider tests/unit/test_cache_dit.py tests/unit/test_lora.py -k cuda \
        > "$OUT/pytest_cuda.log" 2>&1
      echo "pytest rc=$?" >> "$OUT/steps.txt"
      ;;
    lite-static)
      bench lite_static 380 --variant lite --num-inference-steps 20 \
        --cache-dit-params '{"scm_preset": "medium", "scm_policy": "static"}'
      ;;
    lite-dynamic)
      bench lite_dynamic 560 --variant lite --num-inference-steps 50 --cache-dit-params '{}'
      ;;
    *) echo "unknown step $step" >> "$OUT/steps.txt" ;;
  esac
done
