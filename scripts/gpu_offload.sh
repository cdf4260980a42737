#!/usr/bin/env bash
# Offloading on one GPU (`--performance-mode balanced` / `memory`): the CUDA test, then whole generations whose
# rows give the peak memory and the per-step time against speed mode. Run from the repository root on the device
# machine with the wheels of .whlG (diffusers, av) and .whlP (pytest) carried; every step has its own time limit
# and writes its log under $OUT, so a step that runs long still leaves the others' results.
#   bash scripts/gpu_offload.sh test lite   # the CUDA test + Lite-distill memory and balanced (the default)
#   bash scripts/gpu_offload.sh pro         # Pro-distill memory and balanced, 3 steps
#   bash scripts/gpu_offload.sh pro-memory pro-streaming   # memory mode's streaming knobs next to its defaults
#   steps: pinned (a registered host buffer: size, pinned, copy speed), test, lite, lite-memory, pro, pro-memory,
#   pro-streaming (Pro-distill memory mode with --offload-prefetch-blocks 2, then --offload-resident-blocks 20:
#   compare their step times and peaks with pro_memory's), lite-streaming (the same for Lite-distill, 16 resident),
#   speed-offload (Lite-distill in speed mode with the DiT offloaded whole against resident: 512x768x121, 2 steps,
#   one cold and one warm request each; step time, peak, recompiles, and the frames and audio bit for bit:
#   scripts/gpu_speed_offload.py)
source "$(dirname "$0")/gpu_setup.sh"  # wheels into /tmp/site, PYTHONPATH, nvidia-smi.csv
bench() {  # name, time limit, then the bench's own flags
  local name=$1 limit=$2; shift 2
  /usr/bin/time -v timeout "$limit" python3 -m k6serve.bench --stage generate --repeats 1 --json "$OUT/$name.json" "$@" \
    > "$OUT/$name.log" 2>&1
  echo "$name rc=$?" >> "$OUT/steps.txt"
}
pinned_check() {  # a 1 GiB PinnedBuffer: exact resident size, pinned, copied at DMA speed (pageable: ~3x slower)
  timeout 90 python3 -c "
import time, torch
from k6serve.offload.host_weights import PinnedBuffer
def rss():
    return next(int(line.split()[1]) for line in open('/proc/self/status') if line.startswith('VmRSS')) / 2**20
torch.cuda.init(); before = rss()
buffer = PinnedBuffer(2**30); after = rss()
host = buffer.view(torch.uint8)
pageable = torch.empty(2**30, dtype=torch.uint8); pageable.fill_(1)
for name, source in (('registered', host), ('pageable', pageable)):
    source.to('cuda', non_blocking=True); torch.cuda.synchronize()
    start = time.perf_counter(); source.to('cuda', non_blocking=True); torch.cuda.synchronize()
    print(name, 'pinned', source.is_pinned(), 'GB/s', round(2**30 / (time.perf_counter() - start) / 1e9, 1))
print('resident GiB added by the 1 GiB buffer', round(after - before, 3))
del buffer, host; print('unregistered')
" > "$OUT/pinned_check.log" 2>&1
  echo "pinned_check rc=$?" >> "$OUT/steps.txt"
}
[ $# -eq 0 ] && set -- test lite
for step in "$@"; do
  case "$step" in
    pinned) pinned_check ;;
    test)
      timeout 240 python3 -m pytest -q -p no:cacheprovider tests/unit/test_offload.py tests/unit/test_speed_offload.py \
        -k cuda > "$OUT/pytest_offload.log" 2>&1
      echo "pytest rc=$?" >> "$OUT/steps.txt"
      ;;
    lite)
      bench lite_memory 200 --variant lite-distill --performance-mode memory
      bench lite_balanced 170 --variant lite-distill --performance-mode balanced
      ;;
    lite-memory) bench lite_memory 200 --variant lite-distill --performance-mode memory ;;
    pro)
      bench pro_memory 300 --variant pro-distill --performance-mode memory --num-inference-steps 3
      bench pro_balanced 230 --variant pro-distill --performance-mode balanced --num-inference-steps 3
      ;;
    pro-memory) bench pro_memory 300 --variant pro-distill --performance-mode memory --num-inference-steps 3 ;;
    pro-streaming)
      bench pro_memory_prefetch2 300 --variant pro-distill --performance-mode memory --num-inference-steps 3 \
        --offload-prefetch-blocks 2
      bench pro_memory_resident20 300 --variant pro-distill --performance-mode memory --num-inference-steps 3 \
        --offload-resident-blocks 20
      ;;
    speed-offload)  # the compiled, fused DiT offloaded whole: same bits as resident, one DiT copy per request
      /usr/bin/time -v timeout 420 python3 scripts/gpu_speed_offload.py --out "$OUT/speed_offload" \
        > "$OUT/speed_offload.log" 2>&1
      echo "speed_offload rc=$?" >> "$OUT/steps.txt"
      ;;
    lite-streaming)  # Lite's blocks are 5x smaller than Pro's and its steps 4x shorter: copies are less hidden
      bench lite_memory_prefetch2 200 --variant lite-distill --performance-mode memory --offload-prefetch-blocks 2
      bench lite_memory_resident16 200 --variant lite-distill --performance-mode memory --offload-resident-blocks 16
      ;;
    *) echo "unknown step $step (pinned, test, lite, lite-memory, lite-streaming, pro, pro-memory, pro-streaming," \
         "speed-offload)" >&2
       exit 2 ;;
  esac
done
