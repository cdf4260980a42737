# the sixty-second session's call 5 (637394e with deterministic_compile/rewrite_det.patch applied, for the compiled rows)
export K6SERVE_COMMIT=637394e+wt; source scripts/gpu_setup.sh; base=$OUT
show() { for r in "$@"; do echo "== $r $(grep -a 'expanded prompt' $r.log | sha256sum | cut -c1-16) | $(grep -a 'expanded prompt' $r.log | cut -c1-50 | tr -d '\r' | tr '\n' '/') | $(grep -aE '^expand prompt|^total' $r.log | tr -s ' ' | tr '\n' ' ')"; done; }
M="--model-path kandinskylab/Kandinsky-6.0-Lite-distill-5s-Diffusers --load-format dummy --height 256 --width 384 --num-frames 17 --num-inference-steps 2 --seed 7 --expand-prompts --no-save-output"
P="A red fox runs through fresh snow at dawn"
for r in eager1 eager2; do timeout 80 python3 -m k6serve generate $M --prompt "$P" --max-sequence-length 256 > $base/$r.log 2>&1; done
show $base/eager1 $base/eager2
printf '%s\n%s\n%s\n' "$P" "$P" "$P" > /tmp/p3.txt
timeout 150 python3 -m k6serve generate $M --prompt-file-path /tmp/p3.txt --max-sequence-length 256 > $base/eager_same_process.log 2>&1; show $base/eager_same_process
timeout 200 python3 -m k6serve generate $M --prompt-file-path /tmp/p3.txt --max-sequence-length 256 --compile-prompt-rewrite true > $base/det_same_process.log 2>&1; show $base/det_same_process
