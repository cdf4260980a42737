"""Does the prompt rewrite (expand_prompts) repeat on a GPU? The eager rewrite of the full-size dummy Qwen2.5-VL-7B
(the engine's seeded random weights, bf16, the offline tokenizer), three times in one process:

1. its prefill logits at the last position, three times: NaN and infinity counts, the two largest logits and whether
   the three are equal bit for bit;
2. the eager rewrite's ids (`expanded_token_ids`, seed 7), three times: where the second and third part from the first,
   and which forward's logits (0 the prefill, k the k-th token's) first differ bit for bit: logits that part before
   the ids do point at the model's kernels, ids that part beside equal logits at the sampling;
3. with `--engine MODEL`, the same through a worker's own models (a `--load-format dummy` worker, speed mode), then
   three whole requests with expand_prompts in that worker (their rewritten prompts).

Run it in two processes to compare across them: `digest` is the first rewrite's ids. `--deterministic` runs under
torch.use_deterministic_algorithms(True) with CUBLAS_WORKSPACE_CONFIG=:4096:8 (set before CUDA starts), to tell a
nondeterministic kernel from another cause; `--no-cudnn-attention` runs the rewrites (and the worker's requests)
with torch's SDPA on its flash, memory-efficient and math backends only (the first guess at that kernel: SDPA's
cuDNN backend on Hopper, which torch declines under deterministic algorithms; the rewrite itself keeps clear of it
since the sixty-third session, so this now also covers the worker's other stages); `--compile-rewrite` runs the
script's rewrites through the static cache, compiled on CUDA as with --compile-prompt-rewrite true (in inductor's
deterministic mode, as the worker compiles it; `--inductor-default`: transformers' own compile config);
`--cudnn-attention` lets the rewrite's `generate` use SDPA's cuDNN backend again, as before the fix (to time the
eager rewrite on the kernel it had, against the flash one it has now: `rewrite_seconds`).

    python3 scripts/gpu_rewrite_repeat.py --engine kandinskylab/Kandinsky-6.0-Lite-distill-5s-Diffusers   # GPU host
    python scripts/gpu_rewrite_repeat.py --device cpu --tiny --engine demo   # the logic (tests/unit/test_gpu_rewrite_script.py)

Prints one JSON object (and the lines above it).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import sys
import time

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

PROMPT = "A red fox runs through fresh snow at dawn"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=64, help="the most tokens each rewrite writes (default 64)")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--tiny", action="store_true", help="the tiny random encoder (a CPU check of the logic)")
    parser.add_argument("--deterministic", action="store_true", help="torch's deterministic algorithms")
    parser.add_argument("--no-cudnn-attention", action="store_true", help="the rewrites with torch's SDPA kept off "
                        "its cuDNN backend (flash, memory-efficient or math only)")
    parser.add_argument("--cudnn-attention", action="store_true", help="the rewrite's generate with SDPA's cuDNN "
                        "backend allowed again, as before the sixty-third session's fix (to time it)")
    parser.add_argument("--compile-rewrite", action="store_true", help="the rewrites through the static cache, "
                        "compiled on CUDA (as --compile-prompt-rewrite true)")
    parser.add_argument("--inductor-default", action="store_true", help="with --compile-rewrite: transformers' "
                        "own compile config, not the worker's (inductor's deterministic mode)")
    parser.add_argument("--engine", default=None, help="also through a worker of this model (dummy weights; demo, "
                        "the built-in checkpoint, on the CPU)")
    return parser.parse_args(argv)


def _parted(runs: list[list[int]]) -> list[int | None]:
    """Where each later run's ids first differ from the first run's (None: equal)."""
    return [None if ids == runs[0] else next((i for i, (a, b) in enumerate(zip(runs[0], ids)) if a != b),
                                             min(len(ids), len(runs[0]))) for ids in runs[1:]]


def _digest(ids: list[int]) -> str:
    return hashlib.sha256(str(ids).encode()).hexdigest()[:16]


@contextlib.contextmanager
def recorded_logits(text_encoder, logits: list[list[torch.Tensor]]):
    """Within it, the text encoder's lm_head outputs at the last position (the prefill's, then one per token written)
    are appended to a new list at the end of `logits`."""
    seen: list[torch.Tensor] = []
    hook = text_encoder.lm_head.register_forward_hook(
        lambda module, args, output: seen.append(output[0, -1].float().cpu()))
    try:
        yield
    finally:
        hook.remove()
        logits.append(seen)


def rewrites(tokenizer, text_encoder, device: torch.device, tokens: int,
             logits: list[list[torch.Tensor]] | None = None, static_cache=None,
             seconds: list[float] | None = None) -> list[list[int]]:
    """Three rewrites' ids; with `logits`, each rewrite's logits (`recorded_logits`), to tell logits that part (the
    model's kernels) from ids that part with equal logits (the sampling). `static_cache`: through it (compiled on
    CUDA, as --compile-prompt-rewrite true); `seconds`: each rewrite's wall time appended to it."""
    from k6serve.pipelines.expand_prompt import expanded_token_ids

    runs = []
    for _ in range(3):
        start = time.perf_counter()
        with contextlib.nullcontext() if logits is None else recorded_logits(text_encoder, logits):
            runs.append(expanded_token_ids(PROMPT, tokenizer=tokenizer, text_encoder=text_encoder, device=device,
                                           seed=7, max_new_tokens=tokens, static_cache=static_cache)[0].tolist())
        if seconds is not None:
            seconds.append(round(time.perf_counter() - start, 3))  # .tolist() waited for the device
    return runs


def _logits_parted(logits: list[list[torch.Tensor]]) -> list[int | None]:
    """Which forward (0 the prefill, k the k-th token's) first gives other logits than the first rewrite's, bit for
    bit (None: every common forward equal)."""
    return [next((i for i, (a, b) in enumerate(zip(logits[0], run)) if not torch.equal(a, b)), None)
            for run in logits[1:]] if logits else []


def _margin(logits: list[torch.Tensor], step: int | None) -> float | None:
    """The first rewrite's top-1 minus top-2 logit at that forward: how near a tie the choice was."""
    if step is None or step >= len(logits):
        return None
    top = logits[step].topk(2).values
    return float(top[0] - top[1])


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if args.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
    from k6serve.bench.components import build_text_components
    from k6serve.pipelines.expand_prompt import expansion_inputs

    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    parts = build_text_components(tiny=args.tiny, device=device, dtype=dtype)
    encoder, tokenizer = parts.text_encoder, parts.tokenizer
    inputs = {k: v.to(device) for k, v in expansion_inputs(PROMPT, tokenizer=tokenizer).items()}
    with torch.inference_mode():
        logits = [encoder(**inputs).logits[0, -1].float() for _ in range(3)]
    top = logits[0].topk(2).values.tolist()
    report: dict = {
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "deterministic": args.deterministic, "attention": encoder.config._attn_implementation,
        "prefill_nan": int(logits[0].isnan().sum()), "prefill_inf": int(logits[0].isinf().sum()),
        "prefill_top2": top, "prefill_repeats_equal": [bool(torch.equal(logits[0], x)) for x in logits[1:]],
        "prefill_max_difference": max(float((logits[0] - x).abs().max()) for x in logits[1:]),
    }
    generation = encoder.generation_config
    report["generation"] = {name: getattr(generation, name, None) for name in
                            ("do_sample", "top_k", "top_p", "temperature", "repetition_penalty")}
    steps: list[list[torch.Tensor]] = []
    from k6serve.pipelines import expand_prompt

    backends = list(expand_prompt.REWRITE_ATTENTION_BACKENDS)
    if args.cudnn_attention:
        # The list `expanded_token_ids` passes to sdpa_kernel, widened in place (and restored): torch's own choice
        # among all four backends, as before the fix.
        expand_prompt.REWRITE_ATTENTION_BACKENDS.insert(0, SDPBackend.CUDNN_ATTENTION)
    try:
        with contextlib.ExitStack() as stack:
            if args.no_cudnn_attention:  # the rewrites and, with --engine, the worker's requests
                stack.enter_context(sdpa_kernel(backends))
            _rewrite_and_engine(args, report, tokenizer, encoder, device, steps)
    finally:
        expand_prompt.REWRITE_ATTENTION_BACKENDS[:] = backends
    return report


def _rewrite_and_engine(args: argparse.Namespace, report: dict, tokenizer, encoder, device: torch.device,
                        steps: list[list[torch.Tensor]]) -> None:
    cache = None
    if args.compile_rewrite:
        from k6serve.pipelines.expand_prompt import StaticRewriteCache, apply_rewrite_compile_config

        if not args.inductor_default:
            apply_rewrite_compile_config(encoder, device)  # as the worker compiles it
        cache = StaticRewriteCache(encoder.config)
    # No logits recorded through a compiled step: dynamo guards on the lm_head's hooks, and each rewrite's new hook
    # recompiled the step (8 times, dynamo's limit, after which it ran eager).
    seconds: list[float] = []
    runs = rewrites(tokenizer, encoder, device, args.tokens, None if args.compile_rewrite else steps,
                    static_cache=cache, seconds=seconds)
    report["rewrite_seconds"] = seconds  # the first compiles, with --compile-rewrite
    parted = _logits_parted(steps)
    report.update(no_cudnn_attention=args.no_cudnn_attention, cudnn_attention=args.cudnn_attention,
                  compile_rewrite=args.compile_rewrite,
                  rewrite_parts_at=_parted(runs), first_ids=runs[0][:12],
                  rewrite_tokens=[len(ids) for ids in runs], digest=_digest(runs[0]),
                  logits_part_at=parted, forwards=[len(run) for run in steps],
                  logits_max_difference_there=[None if i is None else float((steps[0][i] - run[i]).abs().max())
                                               for i, run in zip(parted, steps[1:])],
                  margin_where_ids_part=[_margin(steps[0], i) for i in _parted(runs)] if steps else [])
    if args.engine:
        from k6serve.engine_arguments import build_engine_config
        from k6serve.request import OutputOptions, SamplingParams
        from k6serve.runtime.worker import ModelWorker

        demo = args.engine == "demo"
        worker = ModelWorker(build_engine_config(args.engine, load_format="auto" if demo else "dummy",
                                                 device=args.device))
        models = worker.pipeline.models
        runs = rewrites(models.tokenizer, models.text_encoder, device, args.tokens)
        report.update(engine_rewrite_parts_at=_parted(runs), engine_digest=_digest(runs[0]))
        params = SamplingParams(prompt=PROMPT, seed=7, height=64 if demo else 256, width=96 if demo else 384,
                                num_frames=17, num_inference_steps=1, expand_prompts=True,
                                max_sequence_length=args.tokens)
        # The dummy's rewrite may decode to little or no text (most of its random ids are past the offline
        # tokenizer's vocabulary), so the requests' rewrites are compared by their logits too.
        texts: list[str] = []
        logits: list[list[torch.Tensor]] = []
        for _ in range(3):
            with recorded_logits(models.text_encoder, logits):
                texts.append(worker.run(params, OutputOptions(save_output=False)).expanded_prompt or "")
        report.update(engine_requests_equal=[text == texts[0] for text in texts[1:]],
                      engine_request_logits_part_at=_logits_parted(logits),
                      engine_request_forwards=[len(run) for run in logits],
                      engine_request_digests=[hashlib.sha256(t.encode()).hexdigest()[:16] for t in texts])


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1:])))
