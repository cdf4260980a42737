#!/usr/bin/env bash
# The two-GPU measurements still owed (docs/benchmarks.md "Next GPU runs"), one step per argument, each under its own
# time limit with its log under $OUT, so a step that runs long still leaves the others' results. For an
# `nvidia-h200-x2` call from the repository root, carrying .whlG (diffusers, av), .whlP (pytest) and .whlS (the
# server's packages); each step fits one 10-minute device call, two short ones share one.
#   bash scripts/gpu_two.sh memory        # communicators per rank under Ulysses2 after a request, and which GPU each
#                                         # rank's process is on after the release and the resume (nvidia-smi)
#   bash scripts/gpu_two.sh memory-fsdp   # the same with FSDP (its replica group keeps its own communicator)
#   bash scripts/gpu_two.sh ulysses fsdp  # step times with the shared groups against the recorded 1.87x / FSDP rows
#   bash scripts/gpu_two.sh server        # two Lite-distill replicas behind the HTTP server
#   bash scripts/gpu_two.sh tp            # compiled TP2 through the engine (3 steps)
#   bash scripts/gpu_two.sh tp-release    # release and resume under TP2 over NCCL, through the server
#   bash scripts/gpu_two.sh tests         # the CUDA tests in one pytest process
#   bash scripts/gpu_two.sh spatial       # VSR x2 of 768x512x121 on Ulysses2: whole-tile against spatial-shard decode
set -u
source "$(dirname "$0")/gpu_setup.sh"  # .whlG / .whlP into /tmp/site, PYTHONPATH, nvidia-smi.csv
if [ -d .whlS ] && [ ! -d /tmp/site/fastapi ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whlS/*.whl \
    >> "$OUT/install.log" 2>&1
fi
step() {  # name, time limit, command...
  local name=$1 limit=$2; shift 2
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  echo "$name rc=$?" >> "$OUT/steps.txt"
}
# A short request before the release: communicators are made at a group's first collective.
REQUEST=(--request num_inference_steps=1 --request num_frames=25)
PRO=kandinskylab/Kandinsky-6.0-Pro-distill-5s-Diffusers
[ $# -eq 0 ] && set -- memory
for name in "$@"; do
  case "$name" in
    memory)
      step memory 420 python3 scripts/gpu_context.py --mode engine --out "$OUT/memory" --option num_gpus=2 \
        --option ulysses_degree=2 "${REQUEST[@]}" ;;
    memory-fsdp)
      step memory_fsdp 480 python3 scripts/gpu_context.py --mode engine --out "$OUT/memory_fsdp" --model "$PRO" \
        --option num_gpus=2 --option ulysses_degree=2 --option use_fsdp_inference=true "${REQUEST[@]}" ;;
    ulysses) step ulysses 560 python3 scripts/gpu_multi.py --stage ulysses --out "$OUT/ulysses" ;;
    fsdp) step fsdp 560 python3 scripts/gpu_multi.py --stage fsdp --out "$OUT/fsdp" ;;
    server) step server 560 python3 scripts/gpu_server.py --out "$OUT/server" ;;
    tp)
      step tp 560 python3 -m k6serve.cli.main generate --model-path "$PRO" --load-format dummy --num-gpus 2 \
        --tp-size 2 --performance-mode speed --num-inference-steps 3 --no-save-output ;;
    tp-release)
      step tp_release 560 python3 scripts/gpu_server.py --out "$OUT/tp_release" --num-gpus 2 --dp-size 1 \
        --serve-arg=--tp-size --serve-arg=2 ;;
    tests)
      step tests 560 python3 -m pytest -q -p no:cacheprovider -rs tests/unit/test_attention.py \
        tests/unit/test_cache_dit.py tests/unit/test_decode_stream.py tests/unit/test_lora.py \
        tests/unit/test_memory_release.py tests/unit/test_offload.py tests/unit/test_speed_transforms.py ;;
    spatial) step spatial 560 python3 scripts/gpu_sr_decode.py --out "$OUT/spatial" --repeats 1 ;;
    *) echo "unknown step $name (memory, memory-fsdp, ulysses, fsdp, server, tp, tp-release, tests, spatial)" >&2
       exit 2 ;;
  esac
done
cat "$OUT/steps.txt"
