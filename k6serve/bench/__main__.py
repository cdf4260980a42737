"""`python -m k6serve.bench` / `k6serve bench`: stage-by-stage benchmark against diffusers.

    python -m k6serve.bench --stage dit --variant pro-distill --json dit_pro.json
    python -m k6serve.bench --stage vae --stage audio --stage text
    python -m k6serve.bench --stage generate --variant lite-distill
    python -m k6serve.bench --tiny --stage all          # CPU smoke mode (CI): toy sizes, checks fields

Prints a markdown table (median of `--repeats` warm runs: seconds, TFLOP/s, % of the 790 TFLOP/s floor rate,
speed-up over diffusers, peak memory, cosine similarity to diffusers) and writes the rows as JSON. Each stage
runs in its own try/except, so one failure is recorded as an error row and the others still run.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

from k6serve.bench.flag_checks import bench_device, writable_folder
from k6serve.bench.flags import build_parser
from k6serve.bench.report import BenchRow, format_table, write_json
from k6serve.bench.stage_runners import ignored_flags, run_stages, stage_runners


def _json_path(text: str) -> Path:
    """--json's file, checked before any stage runs: a folder, a file in the way or an unwritable folder ended the
    run in a traceback after every stage had run, and an existing file (an earlier run's rows) was replaced."""
    if not text.strip():
        raise SystemExit("--json is empty; give the file to write the rows to (e.g. --json bench.json)")
    if text == "-":
        # Read elsewhere as stdout, which carries the table here: it wrote a file named "-".
        raise SystemExit("--json - would write a file named '-' (stdout carries the table); give a file path, e.g. "
                         "--json bench.json")
    path = Path(text).expanduser()  # `--json=~/x.json` reaches us unexpanded, as --transformer-path may
    if path.is_dir():
        raise SystemExit(f"--json {text} is a folder; give the file to write in it (e.g. --json {path / 'bench.json'})")
    if path.exists() or path.is_symlink():
        raise SystemExit(f"--json {text} already exists, and the bench never replaces a file (it may hold an earlier "
                         "run's rows); delete it or give another path")
    writable_folder(path.parent, f"--json {text}")
    return path


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns 0 when every row ran, 1 when any row recorded an error (or the JSON could not be
    written), 130 after Ctrl-C; a refused flag exits 2 before any stage runs, as argparse's own refusals and
    `k6serve generate`'s."""
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    # `k6serve bench -- ARGS` forwards the separator too.
    args = parser.parse_args(argv[1:] if argv[:1] == ["--"] else argv)
    try:
        device = bench_device(args.device, tiny=args.tiny)
    except ValueError as error:
        parser.error(str(error))
    try:
        json_path = _json_path(args.json) if args.json is not None else None
        runners = stage_runners(args)
    except SystemExit as refusal:
        # The checks raise SystemExit(message), which exited 1, the code of a row that failed: a script could not
        # tell "nothing ran" from "a row failed". Exit 2 as argparse's refusals, without their page of usage.
        if isinstance(refusal.code, str):
            parser.exit(2, f"{parser.prog}: error: {refusal.code}\n")
        raise
    written: list[bool] = []  # whether this run has written the file already (then it replaces its own)

    def save(rows: list[BenchRow], *, complete: bool) -> bool:
        assert json_path is not None  # saved only with --json
        try:
            write_json(json_path, rows, vars(args), device=device, notes=ignored_flags(args), complete=complete,
                       replace=bool(written))
        except OSError as error:
            # Checked writable before the stages, it can still fail (disk full): a message, not a traceback.
            print(f"[bench] could not write --json {args.json}: {error}", file=sys.stderr, flush=True)
            return False
        written.append(True)
        return True

    # After each stage, so a run killed later (out of host memory, a timeout, Ctrl-C) keeps the stages that finished,
    # marked "complete": false; it lost every row.
    after_stage = (lambda rows: save(rows, complete=False)) if json_path is not None else None
    try:
        rows = run_stages(args, log=lambda text: print(text, flush=True), runners=runners, after_stage=after_stage)
    except KeyboardInterrupt:
        kept = f"; --json {args.json} holds the stages that finished" if written else ""
        print(f"\n[bench] interrupted{kept}", file=sys.stderr, flush=True)
        return 130
    print("\n" + format_table(rows), flush=True)
    if json_path is not None:
        if not save(rows, complete=True):
            return 1  # the rows are the table above
        print(f"[bench] wrote {json_path}", flush=True)
    return 1 if any(row.error for row in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
