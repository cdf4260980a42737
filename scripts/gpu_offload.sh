#!/usr/bin/env bash
# Offloading on one GPU (`--performance-mode balanced` / `memory`): the CUDA test, then whole generations whose
# rows give the peak memory and the per-step time against speed mode. Run from the repository root on the device
# machine with the wheels of .whlG (diffusers, av) and .whlP (pytest) carried; every step has its own time limit
# and writes its log under $OUT, so a step that runs long still leaves the others' results.
#   bash scripts/gpu_offload.sh lite     # the CUDA test + Lite-distill memory and balanced
#   bash scripts/gpu_offload.sh pro      # Pro-distill memory and balanced, 3 steps
set -u
: "${OUT:?set OUT to the folder for logs and JSON}"
mkdir -p /tmp/site
if [ ! -d /tmp/site/diffusers ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whlG/*.whl .whlP/*.whl \
    > "$OUT/install.log" 2>&1
fi
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$OUT/nvidia-smi.csv" 2>&1
bench() {  # name, time limit, then the bench's own flags
  local name=$1 limit=$2; shift 2
  /usr/bin/time -v timeout "$limit" python3 -m k6serve.bench --stage generate --repeats 1 --json "$OUT/$name.json" "$@" \
    > "$OUT/$name.log" 2>&1
  echo "$name rc=$?" >> "$OUT/steps.txt"
}
case "${1:-lite}" in
  lite)
    timeout 150 python3 -m pytest -q -p no:cacheprovider tests/unit/test_offload.py -k cuda > "$OUT/pytest_offload.log" 2>&1
    echo "pytest rc=$?" >> "$OUT/steps.txt"
    bench lite_memory 200 --variant lite-distill --performance-mode memory
    bench lite_balanced 170 --variant lite-distill --performance-mode balanced
    ;;
  pro)
    bench pro_memory 300 --variant pro-distill --performance-mode memory --num-inference-steps 3
    bench pro_balanced 230 --variant pro-distill --performance-mode balanced --num-inference-steps 3
    ;;
esac
