#!/usr/bin/env bash
# The video-token GEMMs in e4m3 (speed/fp8_linears.py; issue 5's last lever), on one H200, in one device call.
# Carry .whlR (diffusers without PyAV, for the reference rows and the cosine), .whlH (fa3-fwd) and .whlP (pytest)
# for tests/pro/lite, or .whlG (diffusers and PyAV: the engine's VAEs and the MP4) for generate (fa3-fwd does not fit
# beside them in one call's carry, so FA3 for generate takes two calls, below; with .whlG alone attention runs on
# cuDNN); run from the repository root with OUT set:
#   bash scripts/gpu_fp8_linears.sh [tests] [pro] [lite] [pro-partial] [generate] [generate-bf16]
# Wheels install once per machine (each file is remembered in /tmp/site/.installed), so a second call on the still
# warm machine can carry .whlG after a first that carried .whlH and .whlR (`bash scripts/gpu_fp8_linears.sh none`
# installs only): FA3 and PyAV in one engine request. Issue the second call at once: the machine is given back after
# 30 s idle.
# steps:
#   tests  tests/unit/test_fp8_linear.py on the GPU (cuBLASLt's row-wise e4m3 GEMM, eager and compiled)
#   pro    k6serve bench --stage dit, Pro-distill: diffusers eager, ours fused + compiled (+ norm/RoPE kernel), then
#          the FFN in e4m3, every video-token linear in e4m3, and that with fast accumulation -> $OUT/dit_pro.json
#   lite   the same for Lite-distill -> $OUT/dit_lite.json
#   pro-partial  Pro-distill, e4m3 in part of the blocks only (FFN in the last 45, the first 45, the last 30; every
#          video-token linear in the last 15), then the last with fast accumulation: the speed / cosine trade inside
#          speed mode's 0.999 tolerance -> $OUT/dit_pro_partial.json
#   generate       a whole Pro-distill request through the engine with --quantization fp8 (k6serve bench --stage
#                  generate: load, a cold and a warm request) -> $OUT/generate_fp8.json
#   generate-bf16  the same without quantization, for the ratio -> $OUT/generate_bf16.json
#   (IGNORED_LAYERS="visual_transformer_blocks.0-29" keeps those linears of the fp8 request in bf16)
set -u
: "${OUT:?set OUT to the folder for logs and JSON}"
mkdir -p /tmp/site
todo=""
for wheel in .whlR/*.whl .whlG/*.whl .whlH/*.whl .whlP/*.whl; do
  [ -e "$wheel" ] || continue
  grep -qx "$(basename "$wheel")" /tmp/site/.installed 2>/dev/null || todo="$todo $wheel"
done
if [ -n "$todo" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site --upgrade $todo \
    >> "$OUT/install.log" 2>&1 && for wheel in $todo; do basename "$wheel" >> /tmp/site/.installed; done
fi
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv > "$OUT/nvidia-smi.csv" 2>&1
step_done() { echo "$1 rc=$2 $(date +%T)" >> "$OUT/steps.txt"; }
[ $# -eq 0 ] && set -- tests pro
for step in "$@"; do
  case "$step" in
    tests)
      timeout 120 python3 -m pytest -q -p no:cacheprovider tests/unit/test_fp8_linear.py > "$OUT/tests.log" 2>&1
      step_done tests $?
      ;;
    pro|lite)
      variant=$([ "$step" = pro ] && echo pro-distill || echo lite-distill)
      timeout "${LIMIT:-420}" python3 -m k6serve.bench --stage dit --variant "$variant" --device cuda --backends fa \
        --skip-eager --norm-rope-kernel --fp8-linears ffn video --fp8-fast-accumulation --repeats 3 \
        --json "$OUT/dit_$step.json" > "$OUT/dit_$step.log" 2>&1
      step_done "$step" $?
      ;;
    pro-partial)
      blocks=visual_transformer_blocks
      # FP8_ENTRIES (space-separated --fp8-linears entries) replaces the default set; FP8_FAST=0 drops the
      # fast-accumulation row; BENCH_ARGS adds bench flags (e.g. --reference-compiled).
      entries=${FP8_ENTRIES:-"ffn:$blocks.?,$blocks.1[0-4] ffn:$blocks.4[5-9],$blocks.5? ffn:$blocks.?,$blocks.[12]? video:$blocks.?,$blocks.[1-3]?,$blocks.4[0-4]"}
      fast=$([ "${FP8_FAST:-1}" = 1 ] && echo --fp8-fast-accumulation)
      set -f  # the entries' globs are for fnmatch, not for the shell
      timeout "${LIMIT:-540}" python3 -m k6serve.bench --stage dit --variant pro-distill --device cuda --backends fa \
        --skip-eager --norm-rope-kernel --repeats 3 $fast ${BENCH_ARGS:-} --fp8-linears $entries \
        --json "$OUT/dit_pro_partial.json" > "$OUT/dit_pro_partial.log" 2>&1
      step_done "$step" $?
      set +f
      ;;
    generate|generate-bf16)
      quantization=$([ "$step" = generate ] && echo fp8 || echo none)
      timeout "${GENERATE_LIMIT:-300}" python3 -m k6serve.bench --stage generate --variant pro-distill --device cuda \
        --quantization "$quantization" ${IGNORED_LAYERS:+--quantization-ignored-layers $IGNORED_LAYERS} \
        --repeats 1 --warmup 0 \
        --json "$OUT/generate_$quantization.json" > "$OUT/generate_$quantization.log" 2>&1
      step_done "$step" $?
      ;;
    *) echo "unknown step $step" >> "$OUT/steps.txt" ;;
  esac
done
