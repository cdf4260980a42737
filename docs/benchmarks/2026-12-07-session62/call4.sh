# the sixty-second session's call 4 (637394e with deterministic_compile/rewrite_det.patch applied; not committed). Its last two parts did not run: `timeout` cannot run a shell function
export K6SERVE_COMMIT=637394e+wt; source scripts/gpu_setup.sh; base=$OUT
nvidia-smi --query-gpu=name,power.limit --format=csv,noheader
show() { for r in "$@"; do echo "== $r $(grep -a -m1 'expanded prompt' $r.log | sha256sum | cut -c1-16) mp4 $(sha256sum $r/clip.mp4 2>/dev/null | cut -c1-16) | $(grep -a -m1 'expanded prompt' $r.log | cut -c1-50 | tr -d '\r') | $(grep -aE '^expand prompt|^total' $r.log | tr -s ' ' | tr '\n' ' ')"; done; }
gen() { python3 -m k6serve generate --model-path kandinskylab/Kandinsky-6.0-Lite-distill-5s-Diffusers --load-format dummy --height 256 --width 384 --num-frames 17 --num-inference-steps 2 --seed 7 --prompt "A red fox runs through fresh snow at dawn" --output-path $1 --output-file-name clip.mp4 --expand-prompts "${@:2}" > $1.log 2>&1 || tail -3 $1.log; }
echo "#### deterministic compile (new default), 1024 tokens"
OUT=$base/det EXTRA_FLAGS="--compile-prompt-rewrite true --expand-prompts" timeout 300 bash scripts/gpu_cross_process.sh
show $base/det/first $base/det/second $base/det/fresh_cache
echo "#### transformers' default compile (TORCHINDUCTOR_DETERMINISTIC=0), fresh cache, twice"
c=$(mktemp -d); export TORCHINDUCTOR_CACHE_DIR=$c
TORCHINDUCTOR_DETERMINISTIC=0 timeout 100 gen $base/nondet1 --compile-prompt-rewrite true
TORCHINDUCTOR_DETERMINISTIC=0 timeout 80 gen $base/nondet2 --compile-prompt-rewrite true
unset TORCHINDUCTOR_CACHE_DIR
show $base/nondet1 $base/nondet2
echo "#### eager, 256 tokens, two processes"
timeout 60 gen $base/eager1 --max-sequence-length 256; timeout 60 gen $base/eager2 --max-sequence-length 256
show $base/eager1 $base/eager2
