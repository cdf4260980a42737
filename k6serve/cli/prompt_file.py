"""`--prompt-file-path`: the file read as one prompt a line, `--prompt-file-lines` picking some of them, one request
per prompt, and the report of the run, naming the lines to run again."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from k6serve.media.output_names import numbered_file_names
from k6serve.output_checks import final_file_name
from k6serve.request import FlagWorded, has_visible_text, note_for_cli
from k6serve.request_resolution import prompt_text_refusal


def read_prompt_file(path: str) -> list[tuple[int, str]]:
    """`--prompt-file-path`: (line number, prompt) for each line with text, in order; a clear error for a file that
    cannot be read as UTF-8 text or holds no prompt. A line is one prompt, as in the reference's flag; blank lines
    are skipped (a trailing newline or a gap between groups of prompts is not a request for an empty one), and the
    text is stripped of the spaces around it, nothing else (a '#' may begin a prompt)."""
    try:
        # A shell expands ~ on the command line; a --config file's value arrives as written (split_kwargs does the
        # same for the request's paths).
        text = Path(path).expanduser().read_bytes()
    except IsADirectoryError:
        raise ValueError(f"--prompt-file-path {path!r} is a folder; pass a text file with one prompt per "
                         "line.") from None
    except FileNotFoundError:
        raise ValueError(f"--prompt-file-path {path!r} does not exist; pass a text file with one prompt per "
                         "line.") from None
    except OSError as exc:
        raise ValueError(f"cannot read --prompt-file-path {path!r} ({exc.strerror or exc}).") from None
    if b"\x00" in text:
        # UTF-16 (what Windows Notepad saves as "Unicode"): without a byte-order mark, Cyrillic text is valid UTF-8
        # byte for byte, and ran as a prompt of control characters.
        raise ValueError(f"--prompt-file-path {path!r} holds NUL bytes, as a UTF-16 file does; save it as UTF-8.")
    prompts = []
    for number, raw in enumerate(text.splitlines(), start=1):
        try:
            # A byte-order mark some editors write is not text, also where files were joined (on a later line).
            line = raw.decode("utf-8").lstrip("\ufeff")
        except UnicodeDecodeError as exc:
            raise ValueError(f"--prompt-file-path {path!r}: line {number} is not UTF-8 text ({exc.reason} at byte "
                             f"{exc.start + 1}); save the file as UTF-8.") from None
        if has_visible_text(line):  # a line that shows as blank (spaces, zero-width characters) is skipped
            prompts.append((number, line.strip()))
    if not prompts:
        raise ValueError(f"--prompt-file-path {path!r} holds no prompt; write one prompt per line.")
    return prompts


def parse_line_selection(spec: str) -> list[tuple[int, int | None]]:
    """`--prompt-file-lines`: "3-200", "5", "3-5,9,12-" as [(first, last)] ranges of file line numbers (last None:
    to the end of the file), the form the report of a stopped run prints."""
    ranges: list[tuple[int, int | None]] = []
    for part in spec.replace(" ", "").split(","):
        first, dash, last = part.partition("-")
        if first.isdecimal() and last.isdecimal() and 1 <= int(last) < int(first):
            # A range written backwards was "not a line number or range", which it is.
            raise ValueError(f"--prompt-file-lines {spec!r}: {part!r} runs backwards; write the lower line first: "
                             f"{int(last)}-{int(first)}.")
        if (not first.isdecimal() or (last and not last.isdecimal()) or int(first) < 1
                or (last and int(last) < int(first))):
            raise ValueError(f"--prompt-file-lines {spec!r}: {part!r} is not a line number or range; write lines "
                             "as the stopped run's report names them, e.g. 5, 3-200 or 3-5,9,12- (12 to the end).")
        ranges.append((int(first), int(last) if last else (None if dash else int(first))))
    return ranges


def _selected_prompts(prompts: list[tuple[int, str]], spec: str, path: str) -> set[int]:
    """The line numbers of `prompts` that --prompt-file-lines `spec` names; an error for a line past the file's last
    prompt or a single line named that holds no prompt (a range may span blank lines, as the report's ranges do)."""
    numbers = {number for number, _ in prompts}
    chosen: set[int] = set()
    for first, last in parse_line_selection(spec):
        if first > max(numbers):
            raise ValueError(f"--prompt-file-lines {spec!r}: the last prompt of {path!r} is on line {max(numbers)}, "
                             f"so none is on line {first} or after it.")
        if last == first and first not in numbers:
            raise ValueError(f"--prompt-file-lines {spec!r}: line {first} of {path!r} holds no prompt (blank lines "
                             "are skipped).")
        chosen |= {number for number in numbers if first <= number and (last is None or number <= last)}
    if not chosen:
        raise ValueError(f"--prompt-file-lines {spec!r}: no line of {path!r} in it holds a prompt.")
    return chosen


def prompt_file_batch(request_options: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """One request per prompt of --prompt-file-path (or of its --prompt-file-lines), each with every other flag as
    given: [(label, options)]."""
    path = request_options.pop("prompt_file_path")
    lines = request_options.pop("prompt_file_lines", None)
    if request_options.get("prompt"):
        raise ValueError("--prompt and --prompt-file-path both give the prompt; pass one of them.")
    prompts = read_prompt_file(path)
    names: Sequence[str | None] = [None] * len(prompts)
    name = request_options.get("output_file_name")
    if name is not None and request_options.get("save_output") is not False and len(prompts) > 1:
        # The name as given is checked, and said changed, once, before it is numbered: numbered, a name refused
        # alone ("..mp4") passed as "._1.mp4", and one with folders was refused as "sub/clip_1.mp4" of line 1.
        try:
            final, warning = final_file_name(name)
        except FlagWorded as exc:
            raise ValueError(exc.flag_wording) from exc
        if warning:
            print(f"warning: {note_for_cli(warning)}", file=sys.stderr)
        names = numbered_file_names(final, len(prompts))
    # Chosen after the names are numbered: a rerun of the lines a stopped run names writes clip_7.mp4 for the
    # seventh prompt, as the whole run would have, beside the videos the first run saved.
    chosen = None if lines is None else _selected_prompts(prompts, lines, path)
    batch = []
    for (number, prompt), name in zip(prompts, names):
        if chosen is not None and number not in chosen:
            continue
        # Checked here, in the line's name: the request's check names the prompt as --prompt, which was not given.
        if refusal := prompt_text_refusal(f"line {number} of --prompt-file-path", prompt):
            raise ValueError(refusal)
        options = {**request_options, "prompt": prompt}
        if name is not None:
            options["output_file_name"] = name
        batch.append((f"line {number}", options))
    return batch


def refuse_prompt_file_for_upscaling() -> None:
    raise ValueError("--prompt-file-path gives prompts to the generation models; the super-resolution model "
                     "upscales --video-path and takes no text: drop --prompt-file-path, or pass a generation "
                     "checkpoint as --model-path.")


def batch_report(done: list[tuple[str, Any]], failed: str | None, left: list[str], count: int) -> str:
    """The --prompt-file-path run in one or three lines: how many finished and were saved, and, when it stopped
    early, the prompt that stopped it and those not run (by line, to run again)."""
    saved = sum(1 for _, result in done if result.output_file_path)
    lines = [f"prompt file: {len(done)} of {count} request{'' if count == 1 else 's'} finished, {saved} saved"]
    if failed is not None:
        lines.append(f"prompt file: {failed} stopped the run (the videos saved before it are kept)")
    if left:
        lines.append(f"prompt file: not run: {_line_ranges(left)}")
    unfinished = ([failed] if failed is not None else []) + left
    if unfinished:
        # The flag that runs them, with the same other flags (the failed line too: a full disk or a Ctrl-C is no
        # fault of its prompt; leave it out where it is).
        lines.append(f"prompt file: to run {'it' if len(unfinished) == 1 else 'them'} again, add "
                     f"--prompt-file-lines {_line_spec(unfinished)}")
    return "\n".join(lines)


def _line_spec(labels: list[str]) -> str:
    """"line 5", "line 6", ..., "line 200" as --prompt-file-lines's "5-200" (in the file's order: side by side, a
    failed line may come after lines stopped with it)."""
    labels = sorted(labels, key=lambda label: int(label.partition(" ")[2]))
    return _line_ranges(labels).removeprefix("lines ").removeprefix("line ").replace(" ", "")


def _line_ranges(labels: list[str]) -> str:
    """"line 3", "line 4", ..., "line 200" as "lines 3-200" (126 labels of one line each were unreadable, and could
    not be turned back into a prompt file); labels that are not "line N" are listed as they are."""
    numbers, others = [], []
    for label in labels:
        kind, _, digits = label.partition(" ")
        if kind == "line" and digits.isdigit():
            numbers.append(int(digits))
        else:
            others.append(label)
    runs: list[list[int]] = []
    for number in numbers:
        if runs and number == runs[-1][1] + 1:
            runs[-1][1] = number
        else:
            runs.append([number, number])
    parts = [f"{start}" if start == end else f"{start}-{end}" for start, end in runs]
    named = [f"line{'s' if len(numbers) > 1 else ''} {', '.join(parts)}"] if parts else []
    return ", ".join(named + others)
