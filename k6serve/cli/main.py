"""`k6serve generate | serve | bench`: the command line, with the seed documents' flag names.

`main` parses (the flags and the parser in flags.py; unknown flags told in unknown_flags.py), reads `--config
FILE` (YAML or JSON, keys are flag names: defaults, the command line wins), runs the command (generate.py,
serve_flags.py) and turns how it ended into one line and an exit code; `console_main` is the `k6serve` console
script.
"""

from __future__ import annotations

import argparse
import codecs
import contextlib
import errno
import json
import logging
import os
import re
import signal
import sys
import threading
import traceback
import typing
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from k6serve.cli.flags import _bool, _flag, build_parser, split_options
from k6serve.cli.unknown_flags import _other_command_notes, _surface, unrecognized_arguments
from k6serve.config import SEED_FLAG_SPELLINGS
from k6serve.reference_names import aliases, unknown_names_hint
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


def load_config_file(path: str) -> dict[str, Any]:
    try:
        # UTF-8 whatever the locale (a Russian Windows reads cp1251 by default: a UTF-8 file's Cyrillic prompt ran as
        # mojibake), a byte-order mark allowed (JSON refused one that YAML took).
        text = Path(path).read_text(encoding="utf-8-sig")
    except OSError as exc:
        raise ValueError(f"cannot read --config {path}: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        raise ValueError(f"--config {path} is not UTF-8 text ({exc.reason} at byte {exc.start + 1}); save it as "
                         "UTF-8.") from None
    if path.lower().endswith((".yaml", ".yml")):  # run.YAML too: it was read as JSON and refused as such
        import yaml

        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise ValueError(f"--config {path} is not valid YAML: {exc}") from None
        if data is None:
            # An empty file, or one whose lines are all commented out, sets nothing (as a key with no value does);
            # it was refused as not holding a mapping.
            data = {}
    else:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"--config {path} is not valid JSON ({exc}); a YAML file must end in .yaml or .yml"
                             ) from None
    if not isinstance(data, dict):
        raise ValueError(f"--config {path} must hold a mapping of flag names to values")
    options = {str(key).lstrip("-").replace("-", "_"): value for key, value in data.items()}
    for key, value in options.items():
        # A shell expands $VAR on the command line; a file's value arrives as written: `output-path: ${OUT}/videos`
        # wrote into a folder named "${OUT}" under the working folder, with no word.
        if key.endswith(("_path", "_dir", "_config", "_store")) and isinstance(value, str) and _ENV_REFERENCE.search(
                value):
            raise ValueError(f"--config {path}: {key.replace('_', '-')} {value!r} names an environment variable, "
                             "which k6serve does not expand in a config file; write the value out, or pass it as a "
                             "flag, which the shell expands.")
    return options


_ENV_REFERENCE = re.compile(r"\$(\{[A-Za-z_][A-Za-z0-9_]*\}|[A-Za-z_][A-Za-z0-9_]*)")


_COMPONENT_LIST_FLAGS = ("cpu_offload_components", "layerwise_offload_components", "component_residency")
# Lists of names in a --config file whose items must be strings: a number or a mapping would be turned into its text.
_NAME_LIST_FLAGS = ("quantization_ignored_layers",)
# Lists of sizes (`1280x720`) in a --config file: strings, parsed by the config (a YAML 1280 would be a number).
_SIZE_LIST_FLAGS = ("warmup_resolutions",)
# String flags whose --config value may be a mapping (the JSON object the flag would carry as text).
_MAPPING_FLAGS = ("cache_dit_config",)


def _config_value(action: argparse.Action, value: Any) -> Any:
    """A file value as the same flag on the command line gives it: JSON "64" is the integer 64 and YAML "no" is
    false, not a truthy string that would still save the file."""
    if isinstance(action, (argparse._StoreTrueAction, argparse.BooleanOptionalAction)):
        return _bool(value)
    if value == [] and (action.nargs == "+" or isinstance(action, argparse._AppendAction)):
        # The flag takes one value or more, and the file's [] ran as if the key were absent: a list emptied to mean
        # "none" silently kept the default.
        offload = action.dest in ("cpu_offload_components", "layerwise_offload_components")
        none = " (`[none]` to offload none)" if offload else ""
        raise ValueError(f"is an empty list; the flag takes at least one value: drop the key for the default{none}")
    if action.dest in _COMPONENT_LIST_FLAGS:
        # Checked here too, so that a bad value names the file (the config normalises it again).
        from k6serve.offload.residency import normalise_component_names, normalise_residency_settings

        if action.dest == "component_residency":
            normalise_residency_settings(value)
        else:
            normalise_component_names(value, action.option_strings[0])
        return value
    if action.dest in _SIZE_LIST_FLAGS:
        items = value if isinstance(value, list) else [value]
        if not all(isinstance(item, str) for item in items):
            raise ValueError(f"takes sizes WxH or WxHxF (a string, or a list of strings, e.g. [1280x720, 768x512x61]), "
                             f"got {value!r}")
        return items
    if action.dest in _NAME_LIST_FLAGS:
        items = value if isinstance(value, list) else [value]
        if not all(isinstance(item, str) for item in items):
            raise ValueError(f"takes names (a string, or a list of strings), got {value!r}; quote a number to mean "
                             "it as a name")
        return items
    if isinstance(action, argparse._AppendAction):
        items = value if isinstance(value, list) else [value]
        if not all(isinstance(item, (str, int, float)) and not isinstance(item, bool) for item in items):
            # str() made a folder named "{'a': 1}" of a mapping.
            raise ValueError(f"takes a string or a list of strings, got {value!r}")
        return [str(item) for item in items]
    if action.type in (None, str):
        if isinstance(value, (list, dict)) and action.dest not in _MAPPING_FLAGS:
            # Passed on as is, a list or mapping failed later as an internal error (`host: [a, b]`). A list of prompts
            # (the Python API's generate takes one) is what --prompt-file-path runs.
            several = (" (several prompts: write them one per line in a file and give it as prompt-file-path)"
                       if action.dest == "prompt" and isinstance(value, list) else "")
            raise ValueError(f"takes one string, got {value!r}{several}")
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            value = str(value)  # YAML reads "output-path: 2026" as a number; the flag would give the string
        value = _yaml_scalar_as_text(action, value)
    elif action.type in (int, float):
        wanted = "an integer" if action.type is int else "a number"
        if isinstance(value, str):
            try:
                value = action.type(value)
            except ValueError:
                raise argparse.ArgumentTypeError(f"expected {wanted}, got {value!r}") from None
        elif isinstance(value, bool) or not isinstance(value, (int, float)) or (
                action.type is int and isinstance(value, float)):
            # As `--seed 1.0` is refused. Caught here, with the file and the flag in the message, not later as a
            # bare "height must be an integer".
            raise argparse.ArgumentTypeError(f"expected {wanted}, got {value!r}")
    else:
        value = action.type(value)
    if action.choices is not None and value not in action.choices:
        raise argparse.ArgumentTypeError(f"expected one of {', '.join(map(str, action.choices))}, got {value!r}")
    return value


def _yaml_scalar_as_text(action: argparse.Action, value: Any) -> Any:
    """A string flag's --config value that YAML read as a boolean or a date, as the text the flag would give.

    YAML 1.1 reads unquoted off / on / yes / no as booleans and 2026-01-01 as a date: `warmup-mode: off` and
    `vae-tiling: off` (the flags' own choices) were refused as "expected one of off, request, server, got False",
    and `output-path: 2026-01-01` failed as "output_path must be a string, got datetime.date(2026, 1, 1)"."""
    import datetime

    if isinstance(value, bool):
        word = "on" if value else "off"
        if action.choices is not None and word in action.choices:
            return word
        # yes, true and on all read as True: the word written cannot be told, so it must be quoted.
        raise ValueError(f"takes one string, got {str(value).lower()} (YAML reads an unquoted yes, no, on, off, true "
                         "or false as a boolean); quote the value, e.g. 'no'")
    if isinstance(value, datetime.datetime):
        raise ValueError(f"takes one string, got the date and time {value} (YAML reads an unquoted date and time as "
                         "a timestamp); quote the value")
    if isinstance(value, datetime.date):
        return value.isoformat()  # YAML's only form of a plain date: 2026-01-01, as written
    return value


# Keys that give the same thing in two ways (`k6serve generate` refuses both at once).
_EITHER_OR_KEYS = (("prompt", "prompt_file_path"),)


def merged_options(args: argparse.Namespace, parser: argparse.ArgumentParser) -> dict[str, Any]:
    """CLI values over --config values; unset flags are omitted so the typed defaults apply."""
    options = {k: v for k, v in vars(args).items() if v is not None and k not in ("command", "config", "log_level")}
    if getattr(args, "config", None):
        from_file = load_config_file(args.config)
        actions = {action.dest: action
                   for action in parser._subparsers._group_actions[0].choices[args.command]._actions
                   if action.dest not in ("help", "config", "log_level")}
        # The seed's dotted `vae-config.*` keys name the same options as its flags; a nested `vae-config:` mapping
        # is read as those keys.
        seed_keys = {flag.lstrip("-").replace("-", "_"): name for name, flag in SEED_FLAG_SPELLINGS.items()}
        flat: dict[str, Any] = {}
        for key, value in from_file.items():
            if key == "vae_config" and isinstance(value, dict):
                flat.update({f"vae_config.{str(inner).replace('-', '_')}": item for inner, item in value.items()})
            else:
                flat[key] = value
        from_file = _renamed_reference_keys({seed_keys.get(key, key): value for key, value in flat.items()},
                                            args.config)
        unknown = sorted(set(from_file) - set(actions))
        if unknown:
            # --no-save-output and the other --no-* flags are the false value of one key, not keys of their own.
            negated = [key for key in unknown if key.startswith("no_")
                       and isinstance(actions.get(key[3:]), argparse.BooleanOptionalAction)]
            hint = "".join(f"; --{key.replace('_', '-')} is written as {key[3:].replace('_', '-')}: false"
                           for key in negated)
            # SGLang's names get what to use instead; other keys a "did you mean" where one is close.
            keys = [key for key in unknown if key not in negated]
            other = _other_command_notes(keys, parser, args.command)
            reference = "".join(f" ({note})" for note in other.values()) + unknown_names_hint(
                [key for key in keys if key not in other], actions, surface=_surface(args.command),
                named=len(keys) > 1)
            raise ValueError(f"--config {args.config}: unknown key(s) {unknown}{reference}{hint}")
        converted = {}
        for key, value in from_file.items():
            if value is None:
                continue  # "key:" with no value in YAML: as if the key were absent
            try:
                converted[key] = _config_value(actions[key], value)
            except (ValueError, TypeError, argparse.ArgumentTypeError) as exc:
                raise ValueError(f"--config {args.config}: {actions[key].option_strings[0]}: {exc}") from None
        file_gives_prompt = any(key in converted for key in ("prompt", "prompt_file_path"))
        for pair in _EITHER_OR_KEYS:
            # The command line wins over the file also where two keys exclude each other: --prompt-file-path typed
            # over a file's `prompt` replaces it, as --prompt would.
            if any(key in options for key in pair):
                converted = {key: value for key, value in converted.items() if key not in pair}
        if (file_gives_prompt and ("prompt" in options or "prompt_file_path" in options)
                and "prompt_file_lines" not in options):
            # The file's lines go with the prompt file it named, which a typed --prompt or --prompt-file-path
            # replaced (another file's lines 3-5 are other prompts). Lines alone in it pick from the typed file.
            converted.pop("prompt_file_lines", None)
        options = {**converted, **options}
    return options


def unsaved_by(args: argparse.Namespace) -> str:
    """What turned `generate`'s saving off, for its notes: --no-save-output typed, or the --config file's key. A
    `save-output: no` in the file was told "note: --no-save-output: ...", a flag the user never typed."""
    if args.save_output is None and args.config:
        return f"save-output: false (--config {args.config})"
    return "--no-save-output"


def _renamed_reference_keys(options: dict[str, Any], path: str) -> dict[str, Any]:
    """A --config file's keys with SGLang's names of k6serve options (`mode: speed`) read as those options."""
    renamed: dict[str, Any] = {}
    given: dict[str, str] = {}
    for key, value in options.items():
        name = aliases().get(key, key)
        if name in renamed:
            sglangs = [each for each in (given[name], key) if each != name]
            which = (f"{sglangs[0]!r} is SGLang's name of it" if len(sglangs) == 1
                     else "both are SGLang's names of it")
            raise ValueError(f"--config {path}: keys {given[name]!r} and {key!r} both set {_flag(name)} ({which}); "
                             "keep one of them.")
        renamed[name], given[name] = value, key
    return renamed


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

_OS_ERROR_FIXES = {
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
    from k6serve.api import build_engine_config
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
    from k6serve.api import build_engine_config
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
        from k6serve.cli.generate import StdoutFailed

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
        message = str(exc) if isinstance(exc, MissingPackage) else describe_missing_package(exc.name)
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
