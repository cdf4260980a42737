"""`k6serve bench`'s flags checked beyond what argparse checks, before any stage runs: the device, --transformer-path,
the dit stage's flag combinations, the folders the run writes to and the JSON values."""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch

from k6serve.bench.dit import parse_fp8_entry
from k6serve.speed.fp8_linears import check_ignored_layers, possible_linear_names


def transformer_dir(path: str) -> Path:
    """The folder with the DiT's config.json: `path` itself, or a Diffusers checkpoint's transformer/."""
    folder = Path(path).expanduser()
    for candidate in (folder, folder / "transformer"):
        if (candidate / "config.json").is_file() and any(candidate.glob("*.safetensors")):
            return candidate
    raise SystemExit(f"--transformer-path {path}: neither it nor its transformer/ holds a config.json with "
                     "safetensors weights; give a local Diffusers checkpoint folder (download it first, e.g. "
                     "`huggingface-cli download kandinskylab/Kandinsky-6.0-Pro-distill-5s-Diffusers --include "
                     "'transformer/*' --local-dir DIR`).")


def _check_fp8_patterns(entries: list[str], transformer_config: dict) -> None:
    """A pattern that keeps nothing in bf16 is refused before the model is built, not after the bf16 rows."""
    from k6serve.models.kandinsky6.config import Kandinsky6TransformerConfig

    num_blocks = Kandinsky6TransformerConfig.from_json_dict(transformer_config).num_visual_blocks
    names = possible_linear_names(num_blocks)
    for entry in entries:
        try:
            check_ignored_layers(parse_fp8_entry(entry)[1], names)
        except ValueError as error:
            raise SystemExit(f"--fp8-linears {entry}: {error}") from None


def check_dit_flags(args: argparse.Namespace, device: torch.device, compile_backend: str,
                    transformer_config: dict) -> None:
    """The dit flags' combinations that cannot run or would add nothing, refused before any stage runs."""
    if args.fp8_attention and args.skip_speed:
        # The FP8 row re-times the fused + compiled DiT; without it the flag would add nothing, silently.
        raise SystemExit("--fp8-attention times the fused + compiled DiT once more with fa_fp8: drop --skip-speed")
    if args.fp8_linears and args.skip_speed:
        raise SystemExit("--fp8-linears times the fused + compiled DiT once more in e4m3: drop --skip-speed")
    if args.blas_libraries and args.skip_speed:
        raise SystemExit("--blas-libraries times the fused + compiled DiT once more per library: drop --skip-speed")
    if args.blas_libraries and device.type != "cuda":
        raise SystemExit("--blas-libraries picks among cuBLAS's kernels: it needs a CUDA device")
    # Each of these adds rows to a part that the skip flag removes: the row went missing without a word.
    if args.reference_compiled and args.skip_reference:
        raise SystemExit("--reference-compiled times diffusers' DiT compiled after its eager row: "
                         "drop --skip-reference")
    if args.norm_rope_kernel and args.skip_speed:
        raise SystemExit("--norm-rope-kernel times the fused + compiled DiT once more with the kernel: "
                         "drop --skip-speed")
    if args.compile_mode and args.skip_speed:
        raise SystemExit("--compile-mode sets how the fused + compiled DiT compiles: drop --skip-speed")
    if args.skip_reference and args.skip_eager and args.skip_speed:
        raise SystemExit("--skip-reference, --skip-eager and --skip-speed together leave the dit stage no row to time")
    if args.fp8_fast_accumulation and not args.fp8_linears:
        raise SystemExit("--fp8-fast-accumulation times the --fp8-linears rows' model once more: add --fp8-linears")
    _check_fp8_patterns(args.fp8_linears, transformer_config)
    from torch._dynamo import list_backends

    if compile_backend not in list_backends(exclude_tags=()):
        # A typo (inductr) failed each compiled row after the model was built (minutes at full size).
        raise SystemExit(f"--compile-backend {compile_backend!r} is no torch.compile backend; e.g. inductor, eager "
                         "or aot_eager (torch._dynamo.list_backends(exclude_tags=()) lists them all)")
    if args.compile_mode and compile_backend != "inductor":
        # torch.compile refuses a mode with any other backend; say so before minutes of setup.
        raise SystemExit(f"--compile-mode needs the inductor backend (got --compile-backend {compile_backend})")


def writable_folder(folder: Path, flag: str) -> None:
    """Create `folder` and prove it writable now, before any stage runs, or refuse `flag` (e.g. "--json PATH")."""
    if folder.exists() and not folder.is_dir():
        raise SystemExit(f"{flag}: {folder} is a file, not a folder; give a path in a folder")
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as error:
        raise SystemExit(f"cannot write {flag} ({error.strerror or error}); give a writable folder") from None


def json_object(text: str | None, flag: str) -> dict | None:
    if text is None:
        return None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise SystemExit(f"{flag} must be a JSON object ({exc})") from None
    if not isinstance(value, dict):
        raise SystemExit(f"{flag} must be a JSON object, got {text!r}")
    return value


def bench_device(name: str, *, tiny: bool = False) -> torch.device:
    if name == "auto":
        # --tiny is the CPU smoke mode (CI): on a GPU host it still checks the CPU path, whose rows the tests know;
        # `--tiny --device cuda` runs the toy sizes on the GPU.
        if not tiny and not torch.cuda.is_available():
            # A plain `k6serve bench` on a host without a GPU built the released Pro DiT (56 GiB in bf16) on the CPU
            # and ran it for hours; asked for by name it still runs.
            raise ValueError("no CUDA GPU is visible, and the released sizes on the CPU take hours and tens of GiB of "
                             "memory a stage; add --tiny for the CPU smoke mode, or --device cpu to run them anyway.")
        return torch.device("cuda" if torch.cuda.is_available() and not tiny else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError(
            "--device cuda was requested but no CUDA GPU is visible; use --device cpu."
        )
    return torch.device(name)
