"""One-H200 measurements for issue 5, one subcommand per device command (each well under 8 minutes).

Install the carried wheels first (diffusers 0.42.1, av, fa3-fwd), then for example:

    python scripts/gpu_single.py env      --out $OUT   # versions, FA3 and diffusers availability (seconds)
    python scripts/gpu_single.py dit      --out $OUT   # Pro- and Lite-distill DiT forward 512x768x121 (~5-6 min)
    python scripts/gpu_single.py dit      --out $OUT --models pro-distill --reference-compiled   # + diffusers compiled
    python scripts/gpu_single.py generate --out $OUT --models pro-distill    # whole request, cold + warm (~4 min)
    python scripts/gpu_single.py generate --out $OUT --models lite-distill   # (~2 min)
    python scripts/gpu_single.py decoders --out $OUT   # VAE decode ours vs diffusers, audio decode, text encode
    python scripts/gpu_single.py sr       --out $OUT   # VSR x2 of a synthetic 768x512x121 clip, cold + warm

Every part (one model, one stage) runs in its own try/except: a failure is written to the JSON with its
traceback and the remaining parts still run. Results: `<out>/<subcommand>.json` (environment + rows + errors)
and `<out>/<subcommand>.md` (the table). `--tiny` runs the same code at toy sizes on the CPU (tests).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
import time
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import NoReturn

import torch

from k6serve.bench.flags import COMPILE_MODES
from k6serve.bench.flags import build_parser as build_bench_parser
from k6serve.bench.report import BenchRow, environment, format_table, json_text
from k6serve.bench.stage_runners import run_stages
from k6serve.config import ATTENTION_BACKENDS, PERFORMANCE_MODES

SUBCOMMANDS = ("env", "dit", "generate", "decoders", "sr")
DEFAULT_MODELS = ("pro-distill", "lite-distill")


def log(message: str) -> None:
    print(f"[gpu_single {time.strftime('%H:%M:%S')}] {message}", flush=True)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("subcommand", choices=SUBCOMMANDS)
    parser.add_argument(
        "--out",
        default=os.environ.get("OUT", "gpu_single_out"),
        help="Folder for <subcommand>.json and .md (default: $OUT).",
    )
    parser.add_argument(
        "--models",
        default=",".join(DEFAULT_MODELS),
        help="dit/generate: comma-separated generation variants.",
    )
    parser.add_argument("--height", type=int, default=512)
    parser.add_argument("--width", type=int, default=768)
    parser.add_argument("--num-frames", type=int, default=121)
    parser.add_argument(
        "--repeats", type=int, default=3, help="Timed warm runs (generate/sr: warm requests)."
    )
    parser.add_argument(
        "--backends", default="fa,torch_sdpa", help="dit: attention backends of our DiT."
    )
    parser.add_argument(
        "--reference-compiled",
        action="store_true",
        help="dit: also time diffusers with compile_repeated_blocks (adds ~1.5 min for Pro).",
    )
    # The same choices as k6serve bench's: free strings failed a whole part (after the others had run) instead.
    parser.add_argument(
        "--compile-mode",
        choices=COMPILE_MODES,
        help="dit: torch.compile mode of our blocks (k6serve bench --compile-mode).",
    )
    parser.add_argument(
        "--skip-eager", action="store_true", help="dit: do not time our DiT without transforms."
    )
    parser.add_argument(
        "--norm-rope-kernel",
        action="store_true",
        help="dit: also time our fast DiT with the Triton RMSNorm + RoPE kernel.",
    )
    parser.add_argument(
        "--fp8-attention",
        action="store_true",
        help="dit: then our fastest DiT once more with the FA3 FP8 backend fa_fp8 (lossy, opt-in).",
    )
    parser.add_argument(
        "--compile-decoder",
        action="store_true",
        help="decoders: also time a compiled VAE decoder; generate/sr: the engine with --compile-vae true.",
    )
    parser.add_argument(
        "--attention-backend", default="fa", choices=ATTENTION_BACKENDS, help="generate/sr: engine attention backend."
    )
    parser.add_argument(
        "--performance-mode", default="speed", choices=PERFORMANCE_MODES, help="generate/sr: engine performance mode."
    )
    parser.add_argument(
        "--silent-request",
        action="store_true",
        help="generate: then the same request with sample_audio=False (k6serve bench --silent-request).",
    )
    parser.add_argument(
        "--expand-prompts-request",
        action="store_true",
        help="generate: then the same request with expand_prompts=True (k6serve bench --expand-prompts-request).",
    )
    parser.add_argument(
        "--compile-prompt-rewrite",
        action="store_true",
        help="generate: the engine with --compile-prompt-rewrite true (k6serve bench --compile-prompt-rewrite).",
    )
    parser.add_argument("--tiny", action="store_true", help="CPU smoke run at toy sizes.")
    return parser


def _bench_argv(
    args: argparse.Namespace, stages: Sequence[str], extra: Sequence[str] = ()
) -> list[str]:
    argv = [arg for stage in stages for arg in ("--stage", stage)]
    if args.tiny:
        argv += ["--tiny", "--device", "cpu"]
    else:
        argv += ["--device", "cuda"]
        if stages != ["text"]:  # the text stage reads no size (k6serve bench notes such a flag as ignored)
            argv += ["--height", str(args.height), "--width", str(args.width), "--num-frames", str(args.num_frames)]
    return argv + ["--repeats", str(args.repeats), *extra]


def parts(args: argparse.Namespace) -> list[tuple[str, list[str]]]:
    """(part name, `k6serve bench` arguments) for the subcommand; "env" has none."""
    models = [model.strip() for model in args.models.split(",") if model.strip()]
    if args.subcommand == "dit":
        backends = "torch_sdpa" if args.tiny else args.backends
        extra = ["--backends", backends] + (
            ["--reference-compiled"] if args.reference_compiled else []
        ) + (["--norm-rope-kernel"] if args.norm_rope_kernel else []) + (
            ["--fp8-attention"] if args.fp8_attention else []
        ) + (
            ["--skip-eager"] if args.skip_eager else []
        ) + (["--compile-mode", args.compile_mode] if args.compile_mode else [])
        return [
            (f"dit {model}", _bench_argv(args, ["dit"], ["--variant", model, *extra]))
            for model in models
        ]
    compile_vae = ["--compile-vae-decoder"] if args.compile_decoder else []
    if args.subcommand == "generate":
        extra = ["--performance-mode", args.performance_mode, *compile_vae]
        if args.silent_request:
            extra.append("--silent-request")
        if args.expand_prompts_request:
            extra.append("--expand-prompts-request")
        if args.compile_prompt_rewrite:
            extra.append("--compile-prompt-rewrite")
        if not args.tiny:
            extra += ["--attention-backend", args.attention_backend]
        else:
            extra += ["--num-inference-steps", "2"]
        return [
            (f"generate {model}", _bench_argv(args, ["generate"], ["--variant", model, *extra]))
            for model in models
        ]
    if args.subcommand == "decoders":
        vae_extra = ["--compile-vae-decoder"] if args.compile_decoder else []
        return [
            ("vae", _bench_argv(args, ["vae"], vae_extra)),
            ("audio", _bench_argv(args, ["audio"])),
            ("text", _bench_argv(args, ["text"])),
        ]
    if args.subcommand == "sr":
        extra = ["--performance-mode", args.performance_mode, "--sr-scale", "2", *compile_vae]
        if not args.tiny:
            extra += ["--attention-backend", args.attention_backend]
        return [("sr x2", _bench_argv(args, ["sr"], extra))]
    return []


def _free_device() -> None:
    gc.collect()
    torch._dynamo.reset()  # drop compiled graphs that hold the previous model's guards
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _parse_bench_argv(bench_argv: list[str]) -> argparse.Namespace:
    """`k6serve bench`'s parse of a part's arguments, a refusal raised with argparse's message: its SystemExit(2)
    was recorded as the part's error "SystemExit: 2", the message only on stderr."""
    parser = build_bench_parser()

    def refuse(message: str) -> NoReturn:
        raise ValueError(f"k6serve bench {' '.join(bench_argv)}: {message}")

    parser.error = refuse  # type: ignore[method-assign]  # replaced on this instance alone (k6serve bench's own parser)
    return parser.parse_args(bench_argv)


def run_part(name: str, bench_argv: list[str]) -> tuple[list[BenchRow], dict | None]:
    """Run one part; returns its rows and, on failure, an error record (never raises)."""
    log(f"part {name!r} starts: k6serve bench {' '.join(bench_argv)}")
    start = time.perf_counter()
    rows: list[BenchRow] = []
    error = None
    try:
        bench_args = _parse_bench_argv(bench_argv)
        rows = run_stages(bench_args, log=lambda text: print(text, flush=True))
    except (Exception, SystemExit) as exception:  # noqa: BLE001 (recorded; argparse exits via SystemExit)
        error = {
            "part": name,
            "error": f"{type(exception).__name__}: {exception}",
            "traceback": traceback.format_exc(),
        }
        log(f"part {name!r} FAILED: {error['error']}")
    for row in rows:
        if row.error:
            log(f"part {name!r} row {row.name!r} error: {row.error}")
    _free_device()
    log(f"part {name!r} done in {time.perf_counter() - start:.1f} s")
    return rows, error


def device_status() -> dict:
    """What the GPU machine offers: FA3, FA4, diffusers and PyAV availability, device memory."""
    from k6serve.ops.attention import fa3_unavailable_reason

    status: dict = {"cuda_available": torch.cuda.is_available()}
    device = "cuda" if torch.cuda.is_available() else "cpu"
    status["fa3_unavailable_reason"] = fa3_unavailable_reason(device)
    from k6serve.ops import flash_attention4

    # None: FlashAttention-4 imports (whether it passes its probe shows when the backend is resolved; K6SERVE_FA4,
    # ops/flash_attention4.py).
    fa4_reason = "K6SERVE_FA4=0" if flash_attention4.MODE == "0" else flash_attention4.load()[1]
    status["fa4_unavailable_reason"] = fa4_reason or None
    for package in ("diffusers", "av", "transformers"):
        try:
            status[package] = getattr(__import__(package), "__version__", "installed")
        except ImportError as error:
            status[package] = f"missing ({error})"
    if torch.cuda.is_available():
        free, total = torch.cuda.mem_get_info()
        status.update(
            gpu=torch.cuda.get_device_name(0),
            free_gib=free / 2**30,
            total_gib=total / 2**30,
            capability=torch.cuda.get_device_capability(0),
        )
    return status


def write_results(
    out: Path,
    subcommand: str,
    rows: list[BenchRow],
    errors: list[dict],
    status: dict,
    argv: Sequence[str],
    device: torch.device,
) -> None:
    """`device`: where the parts ran (--tiny: the CPU), so a CPU run's environment names no GPU (`status` keeps the
    host's)."""
    out.mkdir(parents=True, exist_ok=True)
    payload = {
        "environment": environment(device),
        "device_status": status,
        "argv": list(argv),
        "rows": [row.to_json() for row in rows],
        "errors": errors,
    }
    (out / f"{subcommand}.json").write_text(json_text(payload))  # NaN as null, as k6serve bench writes it
    lines = [f"# gpu_single {subcommand}", "", f"`{' '.join(argv)}`", "", format_table(rows)]
    lines += [f"\n**{error['part']}**: {error['error']}" for error in errors]
    (out / f"{subcommand}.md").write_text("\n".join(lines) + "\n")


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.repeats < 1:
        # Passed to every part's k6serve bench, which refused it in each: a run of failed parts, exit 1.
        parser.error(f"--repeats must be >= 1 (the median of the timed runs is reported), got {args.repeats}")
    if args.subcommand in ("dit", "generate") and not parts(args):
        # `--models ,` (an unset variable in a loop) wrote a JSON of no rows and exited 0.
        parser.error(f"--models {args.models!r} names no model; give one or more, comma-separated (e.g. "
                     f"{','.join(DEFAULT_MODELS)})")
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        parser.error(f"--out {args.out} is a file, not a folder; give the folder for {args.subcommand}.json and .md")
    try:
        # Before the first part: a --out that is a file, or not writable, failed at the first write, after that part.
        out.mkdir(parents=True, exist_ok=True)
        tempfile.TemporaryFile(dir=out).close()
    except OSError as error:
        parser.error(f"cannot write to --out {args.out} ({error.strerror or error}); give a writable folder")
    # The device each part's `k6serve bench` arguments name (_bench_argv): a --tiny run on a GPU host recorded the GPU.
    device = torch.device("cpu" if args.tiny else "cuda")
    status = device_status()
    log(f"device status: {json.dumps(status, default=str)}")
    rows: list[BenchRow] = []
    errors: list[dict] = []
    for name, bench_argv in parts(args):
        part_rows, failure = run_part(name, bench_argv)
        rows += part_rows
        if failure:
            errors.append(failure)
        write_results(out, args.subcommand, rows, errors, status, argv, device)  # after every part: nothing is lost
    write_results(out, args.subcommand, rows, errors, status, argv, device)
    print(format_table(rows), flush=True)
    log(f"wrote {out / (args.subcommand + '.json')} and .md")
    return 1 if errors or any(row.error for row in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
