"""`k6serve generate | serve | bench`: the command line, with the seed documents' flag names.

`main` parses (flags.py; `--config FILE` in config_file.py, unknown flags told in unknown_flags.py), runs the
command (generate.py, serve_flags.py) and turns how it ended into one line and an exit code; `console_main` is the
`k6serve` console script.
"""

from __future__ import annotations

import argparse
import codecs
import contextlib
import errno
import logging
import os
import signal
import sys
import threading
import traceback
import typing
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

from k6serve.cli.config_file import merged_options, unsaved_by
from k6serve.cli.flags import build_parser, split_options
from k6serve.cli.unknown_flags import unrecognized_arguments
from k6serve.step_bar import is_terminal

logger = logging.getLogger(__name__)

# With the time: a server's lines are matched to jobs' created_at / completed_at and to its metrics by it.
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def _printable_stdout() -> None:
    """Print what the console's encoding cannot show as escapes, as stderr already does: a saved video's Cyrillic
    or Chinese path under a cp1251 or ASCII stdout (Windows redirected to a file) failed the command after the video
    was written, and a prompt file stopped at its first such line."""
    reconfigure = getattr(sys.stdout, "reconfigure", None)  # a replaced stdout (a test's, an IDE's) may have none
    if reconfigure is not None and codecs.lookup(sys.stdout.encoding).name != "utf-8":
        reconfigure(errors="backslashreplace")


# A request or flag refused (argparse's own code), the machine failed the run (a file could not be written or
# read), or a bug in k6serve.
EXIT_USER_ERROR = 2
EXIT_SYSTEM_ERROR = 1
EXIT_INTERNAL_ERROR = 70  # sysexits' EX_SOFTWARE
EXIT_INTERRUPTED = 130  # 128 + SIGINT, what a shell reports for a command stopped by Ctrl-C
EXIT_BROKEN_PIPE = 141  # 128 + SIGPIPE: the reader of stdout (`| head -1`) stopped reading


def _leave_a_hung_up_terminal() -> None:
    """Point stdout and stderr at /dev/null where they are a terminal that has hung up (closed: every write fails with
    EIO). The stop's own messages then raised OSError in place of the KeyboardInterrupt, and the run ended with exit
    code 1 and without its --prompt-file-path summary's cleanup path. A terminal that is still there (a `kill -HUP`),
    a file or a pipe keeps its output: a hung-up terminal is a character device that no longer answers as a terminal
    (isatty asks it, and it answers EIO), and /dev/null is one too but not that."""
    import stat

    try:
        null = os.stat(os.devnull).st_rdev
    except OSError:
        return
    for fd in (1, 2):
        try:
            status = os.fstat(fd)
            if stat.S_ISCHR(status.st_mode) and not os.isatty(fd) and status.st_rdev != null:
                with open(os.devnull, "wb") as sink:
                    os.dup2(sink.fileno(), fd)
        except OSError:
            continue


class _StopSignals:
    """`k6serve generate` stops at SIGTERM (`timeout`, `kill`, a job scheduler) and SIGHUP (the terminal closed) as at
    Ctrl-C: the request is cancelled at its next step, its temporary file removed, a --prompt-file-path run says
    which prompts ran, and the exit code is 128 + the signal's number. Their default action ended the process on the
    spot: no message, no summary, a hidden `.part` file left in the output folder. (`serve`: uvicorn handles SIGINT
    and SIGTERM; SIGHUP ends it, and its ranks, whose engine is then gone, exit by themselves.)
    """

    def __init__(self) -> None:
        self.received: signal.Signals | None = None

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        """The handlers while the block runs (main() is also called in-process, by tests and scripts); none outside
        the main thread, the only one where Python sets them."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        # SIGHUP where the platform has it (not Windows, which imported, then failed here).
        stops = [signal.SIGTERM, *([signal.SIGHUP] if hasattr(signal, "SIGHUP") else [])]
        previous = {signum: signal.signal(signum, self._raise) for signum in stops}
        try:
            yield
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)

    def _raise(self, signum: int, frame: Any) -> None:
        self.received = signal.Signals(signum)
        if signum == getattr(signal, "SIGHUP", None):
            _leave_a_hung_up_terminal()
        raise KeyboardInterrupt

    def how(self) -> tuple[str, int]:
        """The words for the last line and the exit code."""
        if self.received is None:
            return "interrupted (Ctrl-C)", EXIT_INTERRUPTED
        return f"stopped by {self.received.name}", 128 + int(self.received)


_OS_ERROR_FIXES: dict[int | None, str] = {  # an OSError's errno may be None: no fix
    errno.ENOSPC: "free space on that disk",
    errno.EDQUOT: "free space in your disk quota",
    errno.EACCES: "check the permissions of that path",
    errno.EPERM: "check the permissions of that path",
    errno.EROFS: "the disk is read-only",
    # RLIMIT_FSIZE (a shell's `ulimit -f`, a batch system's file-size limit) or the file system's largest file.
    errno.EFBIG: "the file is larger than this process may write (`ulimit -f`) or than the file system takes (FAT32: "
                 "4 GiB); raise the limit",
}


def describe_os_error(exc: OSError, output_path: str) -> str:
    """One line: what failed on which file, and the fix when the error says it (disk full, no permission)."""
    text = f"{exc.strerror or exc}" + (f": {exc.filename!r}" if exc.filename else "")
    fix = _OS_ERROR_FIXES.get(exc.errno)
    if fix is None:
        return f"{text} (rerun with --log-level debug for the traceback)"
    in_output = exc.filename is not None and Path(os.fsdecode(exc.filename)).resolve().is_relative_to(
        Path(output_path).resolve())
    return f"{text}; {fix}" + (", or pass --output-path on another disk" if in_output else "")


def describe_out_of_memory(exc: BaseException, engine_options: dict[str, Any] | None = None) -> str:
    """One line: the device's memory ran out (not a bug in k6serve), torch's own first line, and what to change."""
    from k6serve.config import RuntimeConfig
    from k6serve.runtime.out_of_memory import is_host_out_of_memory, out_of_memory_detail, server_side_fixes

    if is_host_out_of_memory(exc):
        # The host's RAM, not the GPU's: the GPU flags are no fix (on a CPU run they do nothing).
        return (f"the host ran out of memory ({out_of_memory_detail(exc)}); ask for fewer pixels or frames "
                "(--height, --width, --num-frames), free host memory (other processes, a lower --dp-size), or run "
                "on a machine with more.")

    # The residency the flags give (`none` offloads nothing; --component-residency offloads too).
    try:
        runtime = RuntimeConfig(**{key: value for key, value in (engine_options or {}).items()
                                   if key in ("performance_mode", "cpu_offload_components",
                                              "layerwise_offload_components", "component_residency")})
        fixes = server_side_fixes(runtime.performance_mode, offloaded=runtime.offloads)
    except (ValueError, TypeError):  # options the run got past cannot fail here; the hint must not fail either
        fixes = server_side_fixes("", offloaded=True)
    return (f"the GPU ran out of memory ({out_of_memory_detail(exc)}); ask for fewer pixels or frames "
            f"(--height, --width, --num-frames), {fixes}.")


def _print_traceback(exc: BaseException, log_level: str) -> None:
    """The traceback above the one-line error, with --log-level debug only."""
    if str(log_level).upper() == "DEBUG":
        traceback.print_exception(exc, file=sys.stderr)


def _hosts_no_engine(engine_options: dict[str, Any]) -> bool:
    """Hosts with --node-rank > 0, and torchrun ranks > 0, only run worker ranks; rank 0 runs the engine."""
    return int(engine_options.get("node_rank") or 0) > 0 or int(os.environ.get("RANK", "0")) > 0


def _serve_worker_ranks(engine_options: dict[str, Any]) -> int:
    from k6serve.engine_arguments import build_engine_config
    from k6serve.parallel.preflight import check_layout_before_loading
    from k6serve.runtime.rank_process import serve_worker_ranks

    options = dict(engine_options)
    config = build_engine_config(options.pop("model_path"), **options)
    check_layout_before_loading(config)  # refused here as on the engine's host, not after the load
    serve_worker_ranks(config)
    return 0


def _check_lora_flags(command: str, engine_options: dict[str, Any], request_options: dict[str, Any]) -> None:
    """The LoRA flags refused before the model loads (minutes for a real checkpoint) rather than after: serve's
    --lora-path adapter (generate's is checked by DiffGenerator.from_cli_options) and generate's --loras."""
    if command == "generate" and engine_options.get("lora_merge_mode") and not engine_options.get("lora_path"):
        # A server's later set_lora calls take it as their default; a one-shot generate has none, so it did nothing.
        raise ValueError("--lora-merge-mode says how the --lora-path adapter is applied, but no --lora-path was given "
                         "and `k6serve generate` loads no other adapter; add --lora-path, or drop --lora-merge-mode.")
    if command == "generate" and request_options.get("loras") is None:
        return
    if command == "serve" and not engine_options.get("lora_path"):
        return
    from k6serve.engine_arguments import build_engine_config
    from k6serve.lora.preflight import check_request_loras, check_start_adapter

    options = dict(engine_options)
    config = build_engine_config(options.pop("model_path"), **options)
    if command == "generate":
        check_request_loras(config, request_options["loras"])
    else:
        check_start_adapter(config)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    _printable_stdout()
    if argv and argv[0] == "bench":
        # The harness has its own parser: forward everything after "bench" untouched.
        from k6serve.bench.__main__ import main as bench_main

        return bench_main(argv[1:])
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    from k6serve.rank_logging import configure_logging

    configure_logging(getattr(logging, args.log_level.upper()), LOG_FORMAT)
    if logging.getLogger().getEffectiveLevel() > logging.INFO or not is_terminal(sys.stderr):
        # Above info, the libraries' progress bars go too (transformers' "Loading weights", two per rank at every
        # start, and hub downloads'): huggingface_hub reads this when imported, here and in the rank processes,
        # which inherit the environment. k6serve's own denoising bar on the console stays. So do they when stderr
        # is no terminal (a service's journal, a container's log collector): each redraw was a "\r" line there.
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    if unknown:
        print(f"error: {unrecognized_arguments(unknown, parser, args.command)}", file=sys.stderr)
        return EXIT_USER_ERROR
    request: dict[str, Any] = {}
    engine: dict[str, Any] = {}
    stop_signals = _StopSignals()
    try:
        options = merged_options(args, parser)
        engine, request = split_options(options)
        if "model_path" not in engine:
            raise ValueError("--model-path is required (a checkpoint folder, a hub id, or 'demo' / 'demo-sr').")
        if _hosts_no_engine(engine):
            return _serve_worker_ranks(engine)
        _check_lora_flags(args.command, engine, request)
        if args.command == "generate" and engine.get("warmup_mode") == "server" and not engine.get(
                "warmup_resolutions"):
            # A server's warm-up runs the variant's default shape for the requests to come; generate's one request
            # may have another, and compiling for both would double the wait. Warm up with the request itself.
            # Listed --warmup-resolutions are the user's explicit choice (e.g. to time each shape's compile): kept.
            logger.info("generate: --warmup-mode server warms up with this request's own shape (as request does)")
            engine["warmup_mode"] = "request"
        if args.command == "generate":
            from k6serve.cli.generate import run_generate

            with stop_signals.installed():
                return run_generate(engine, request, unsaved_by=unsaved_by(args))
        from k6serve.cli.serve_flags import run_serve

        return run_serve(engine, request)
    except ValueError as exc:
        _print_traceback(exc, args.log_level)  # --log-level debug: where the refusal came from, too
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USER_ERROR
    except KeyboardInterrupt as exc:
        # Ctrl-C is the user's choice, not a failure: the engine has cancelled the request and the generator shut
        # its workers down on the way out; a traceback of the wait it interrupted would only hide that.
        _print_traceback(exc, args.log_level)
        # generate's says what it stopped (cli/generate.py: Interrupted); a Ctrl-C before it knew, nothing.
        stopped = str(exc) if args.command == "generate" and type(exc) is not KeyboardInterrupt else ""
        how, code = stop_signals.how()
        print(f"error: {how}{stopped}.", file=sys.stderr)
        return code
    except OSError as exc:
        _print_traceback(exc, args.log_level)
        print(f"error: {describe_os_error(exc, request.get('output_path', 'outputs'))}", file=sys.stderr)
        return EXIT_SYSTEM_ERROR
    except Exception as exc:
        from k6serve.cli.result_output import StdoutFailed

        if not isinstance(exc, StdoutFailed):
            return _unexpected(exc, args, engine)
        _print_traceback(exc, args.log_level)
        # Nothing more can reach stdout: what is still buffered would fail again at exit.
        _detach_stdout()
        if exc.error.errno == errno.EPIPE:
            # The reader stopped reading (`| head -1`): as a program killed by SIGPIPE, quietly.
            return EXIT_BROKEN_PIPE
        saved = f"; the video was saved: {exc.saved}" if exc.saved else ""
        print(f"error: cannot write the results to standard output ({exc.error.strerror or exc.error}){saved}.",
              file=sys.stderr)
        return EXIT_SYSTEM_ERROR


def _detach_stdout() -> None:
    """Point fd 1 and sys.stdout at /dev/null, so the exit's flush of what is still buffered does not fail again."""
    with contextlib.suppress(OSError):
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    with contextlib.suppress(Exception):
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - for the rest of the process


def _unexpected(exc: Exception, args: argparse.Namespace, engine: dict[str, Any]) -> int:
    """Anything else is a bug, or the machine's: one line, the traceback at debug level."""
    _print_traceback(exc, args.log_level)
    # A dependency missing from this environment is the machine's fault, not a bug (one of our own modules
    # missing is, and falls through).
    from k6serve.dependencies import MissingPackage, describe_missing_package, missing_package

    if missing_package(exc):
        # A MissingPackage (checked before the load) already says what needed it.
        # exc.name is set, or missing_package is false
        message = str(exc) if isinstance(exc, MissingPackage) else describe_missing_package(cast(str, exc.name))
        print(f"error: {message}", file=sys.stderr)
        return EXIT_SYSTEM_ERROR
    # torch: imported only when a run failed
    from k6serve.runtime.out_of_memory import WorkerKilled, is_out_of_memory

    if is_out_of_memory(exc):
        print(f"error: {describe_out_of_memory(exc, engine)}", file=sys.stderr)
        return EXIT_SYSTEM_ERROR
    if isinstance(exc, WorkerKilled):  # a rank ended by a signal (the OOM killer's SIGKILL): not our bug
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_SYSTEM_ERROR
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    summary = lines[0] if lines else ""
    if summary.endswith(":") and len(lines) > 1:
        # A header over a worker's traceback ("replica 0 failed to start:"): its last line is the error itself.
        summary = f"{summary} {lines[-1]}"
    print(f"error: internal error ({type(exc).__name__}: {summary}); this is a bug in k6serve: rerun with "
          "--log-level debug for the traceback and report it.", file=sys.stderr)
    return EXIT_INTERNAL_ERROR


def console_main() -> typing.NoReturn:
    """The `k6serve` command (and `python -m k6serve.cli.main`): `main`, then the process ends without the
    interpreter's teardown. By then what the run wrote is closed (the MP4s, the server's job store and folder lock)
    and the engine's ranks have ended; tearing down torch and the other modules still took 0.7 s after `main`
    returned, 5% of `k6serve generate` of the demo on the 2-core CPU machine, after its last line was printed.
    threading's shutdown and the atexit handlers still run (`process_exit`). An exception that escapes `main`
    (argparse's SystemExit, for one) exits the ordinary way. Tests call `main` and keep their interpreter.
    `python -m k6serve` (k6serve/__main__.py) runs this too."""
    code = main()
    from k6serve.process_exit import exit_without_teardown

    exit_without_teardown(code)


if __name__ == "__main__":
    console_main()
