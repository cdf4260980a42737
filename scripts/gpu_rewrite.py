"""The compiled prompt rewrite (--compile-prompt-rewrite true) alone, as the worker runs it, in one short GPU call:
the full-size Qwen2.5-VL-7B with random weights (`--load-format dummy`'s: the trained tokenizer and its vision token
ids), one `StaticRewriteCache` for a rewrite of up to 1,024 new tokens, and

1. the warm-up's two 4-token rewrites, with a gray 768x512 image and without (`speed.warmup.warm_rewrite`): their
   seconds are the compile (two graphs under transformers 5.17, whose image step takes `image_grid_thw`);
2. then rewrites of `--tokens` tokens, with the image and without, timed warm (ms a token), and the graphs compiled
   during them (0 expected: the cache and the compiled step are the warm-up's);
3. the eager rewrite (no cache passed) of the same tokens, for the ratio.

    python3 scripts/gpu_rewrite.py --out $OUT                      # on the GPU host (~3 min)
    python scripts/gpu_rewrite.py --out /tmp/r --tiny --device cpu  # the logic on a CPU (tests/unit/test_gpu_rewrite_script.py)

Writes <out>/gpu_rewrite.json and prints a table.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import PIL.Image
import torch


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--tiny", action="store_true", help="the tiny random encoder (a CPU check of the logic)")
    parser.add_argument("--tokens", type=int, default=256, help="tokens each timed rewrite writes (default 256)")
    parser.add_argument("--max-new-tokens", type=int, default=1024, help="the cache's budget, as a request's")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    from k6serve.bench.components import build_text_components
    from k6serve.pipelines.expand_prompt import StaticRewriteCache, expanded_token_ids, load_image_processor
    from k6serve.runtime.gc_freeze import compiled_graph_count
    from k6serve.speed.warmup import WARMUP_REWRITE_TOKENS

    args = parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    start = time.perf_counter()
    parts = build_text_components(tiny=args.tiny, device=device, dtype=dtype)
    report: dict = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                    "torch": torch.__version__, "tiny": args.tiny, "tokens": args.tokens,
                    "load_s": round(time.perf_counter() - start, 3), "rows": []}
    import transformers

    report["transformers"] = transformers.__version__
    image_processor = load_image_processor("dummy")
    image = PIL.Image.new("RGB", (768, 512), (128, 128, 128))
    cache = StaticRewriteCache(parts.text_encoder.config)

    def rewrite(name: str, *, with_image: bool, tokens: int, static: bool) -> None:
        graphs = compiled_graph_count()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        began = time.perf_counter()
        error = None
        try:
            ids = expanded_token_ids("A red fox runs through fresh snow at dawn.", tokenizer=parts.tokenizer,
                                     text_encoder=parts.text_encoder, device=device, seed=1,
                                     image_processor=image_processor, image=image if with_image else None,
                                     max_new_tokens=args.max_new_tokens, static_cache=cache if static else None,
                                     num_tokens_written=tokens)
            written = int(ids.shape[1])
        except Exception as exc:  # noqa: BLE001 - the report names it, the other rows still run
            error, written = f"{type(exc).__name__}: {exc}", 0
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        seconds = time.perf_counter() - began
        report["rows"].append({"name": name, "image": with_image, "static_cache": static, "tokens": written,
                               "seconds": round(seconds, 3),
                               "ms_per_token": round(1000 * seconds / written, 2) if written else None,
                               "graphs_compiled": compiled_graph_count() - graphs, "error": error})
        (out / "gpu_rewrite.json").write_text(json.dumps(report, indent=2))

    rewrite("warm-up, image (compile)", with_image=True, tokens=WARMUP_REWRITE_TOKENS, static=True)
    rewrite("warm-up, text (compile)", with_image=False, tokens=WARMUP_REWRITE_TOKENS, static=True)
    rewrite("compiled, image", with_image=True, tokens=args.tokens, static=True)
    rewrite("compiled, text", with_image=False, tokens=args.tokens, static=True)
    rewrite("eager, text", with_image=False, tokens=args.tokens, static=False)
    report["cache_tokens"] = cache.num_tokens
    (out / "gpu_rewrite.json").write_text(json.dumps(report, indent=2))
    print(f"### gpu_rewrite: {report['device']}, torch {report['torch']}, transformers {report['transformers']}, "
          f"cache {cache.num_tokens} positions, load {report['load_s']} s\n")
    print("| rewrite | tokens | seconds | ms a token | graphs compiled | error |\n|---|---|---|---|---|---|")
    for row in report["rows"]:
        print(f"| {row['name']} | {row['tokens']} | {row['seconds']} | {row['ms_per_token']} | "
              f"{row['graphs_compiled']} | {row['error'] or ''} |")
    return 1 if any(row["error"] for row in report["rows"]) else 0


if __name__ == "__main__":
    sys.exit(main())
