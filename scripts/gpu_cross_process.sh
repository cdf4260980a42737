#!/usr/bin/env bash
# The same request in three `k6serve generate` processes, one after another (docs/cli.md "Reproducibility": the same
# MP4 in one process or two): the first two share inductor's cache folder, as two runs on one machine do; the third
# has a fresh one, so inductor compiles, and times its Triton kernels' candidates, again. Prints each MP4's sha256
# and writes them to $OUT/cross_process.txt, each process's output beside them.
#   bash scripts/gpu_cross_process.sh                                  # Lite-distill, --load-format dummy, the GPU
#   MODEL=demo LOAD_FORMAT=auto OUT=/tmp/x bash scripts/gpu_cross_process.sh   # the CPU, the demo checkpoint
#   EXTRA_FLAGS="--compile-vae true" bash scripts/gpu_cross_process.sh         # more engine flags (the compiled decoders)
set -euo pipefail
: "${OUT:?set OUT to a folder for the results}"
MODEL=${MODEL:-kandinskylab/Kandinsky-6.0-Lite-distill-5s-Diffusers}
LOAD_FORMAT=${LOAD_FORMAT:-dummy}
SIZE=${SIZE:-"--height 256 --width 384 --num-frames 17"}
EXTRA_FLAGS=${EXTRA_FLAGS:-}
mkdir -p "$OUT"
: > "$OUT/cross_process.txt"
fresh_cache=$(mktemp -d)
trap 'rm -rf "$fresh_cache"' EXIT  # a failed process ends the script early
for run in first second fresh_cache; do
  # SIZE and EXTRA_FLAGS are lists of flags, split on purpose.
  # shellcheck disable=SC2086
  (if [ "$run" = fresh_cache ]; then export TORCHINDUCTOR_CACHE_DIR=$fresh_cache; fi
   python3 -m k6serve generate --model-path "$MODEL" --load-format "$LOAD_FORMAT" $SIZE --num-inference-steps 2 \
     --seed 7 --prompt "A red fox runs through fresh snow at dawn" --output-path "$OUT/$run" \
     --output-file-name clip.mp4 $EXTRA_FLAGS > "$OUT/$run.log" 2>&1) || { echo "$run failed:"; tail -5 "$OUT/$run.log"; exit 1; }
  line="$run $(sha256sum "$OUT/$run/clip.mp4" | cut -c1-64)"
  # With --expand-prompts the rewrite's digest too (the log's `expanded prompt:` line): a rewrite that differs
  # explains MP4s that differ (sixty-second session).
  rewrite=$(grep -a -m1 '^expanded prompt: ' "$OUT/$run.log" || true)
  if [ -n "$rewrite" ]; then line="$line rewrite $(printf '%s' "$rewrite" | sha256sum | cut -c1-16)"; fi
  echo "$line" | tee -a "$OUT/cross_process.txt"
done
if [ "$(cut -d' ' -f2 "$OUT/cross_process.txt" | sort -u | wc -l)" = 1 ]; then
  echo "same MP4 bytes in all three processes"
else
  echo "the MP4s differ"
fi
if grep -q ' rewrite ' "$OUT/cross_process.txt"; then
  if [ "$(cut -d' ' -f4 "$OUT/cross_process.txt" | sort -u | wc -l)" = 1 ]; then
    echo "the same rewrite in all three processes"
  else
    echo "the rewrites differ"
  fi
fi
