"""What `k6serve generate` prints for a finished request: the timing table and the summary line, or `--json`'s line,
on a stdout that may fail (`StdoutFailed`)."""

from __future__ import annotations

import codecs
import json
import math
import sys
from typing import Any

from k6serve.request import TIMING_COUNTS, note_for_cli


def format_timings(result) -> str:
    rows = [
        ("encode", result.timings.get("encode")),
        ("denoise total", result.timings.get("denoise")),
        ("denoise per step", result.timings.get("denoise_per_step")),
        ("decode video", result.timings.get("decode_video")),
        ("decode audio", result.timings.get("decode_audio")),
        ("mux", result.timings.get("mux")),
        ("total", result.timings.get("total")),
    ]
    # Counts among the times: printed below them, as whole numbers (Cache-DiT's was "8.000" seconds).
    counts = set(TIMING_COUNTS)
    for key in sorted(result.timings):
        if key not in {"encode", "denoise", "denoise_per_step", "decode_video", "decode_audio", "mux", "total",
                       *counts}:
            rows.insert(-1, (key.replace("_", " "), result.timings[key]))
    count_rows = [(key.replace("_", " "), int(result.timings[key])) for key in sorted(counts) if key in result.timings]
    # As wide as the longest name: a longer one pushed its value out of the column.
    width = max(20, *(len(name) for name, _ in rows + count_rows))
    lines = [f"{'stage':<{width}} {'seconds':>10}", "-" * (width + 11)]
    lines += [f"{name:<{width}} {value:>10.3f}" for name, value in rows if value is not None]
    lines += [f"{name:<{width}} {value:>10d}" for name, value in count_rows]
    lines.append(f"{'peak memory (MiB)':<{width}} {result.peak_memory_mb:>10.1f}")
    return "\n".join(lines)


def format_summary(result, unsaved_by: str = "--no-save-output") -> str:
    """The last line: where the video went, its shape and its seed. `unsaved_by`: what turned saving off, as the
    user wrote it (`unsaved_by` in config_file.py: a --config file's key is named as the file's)."""
    frames = f"{result.num_frames} frame{'' if result.num_frames == 1 else 's'}"
    # The seed too: with --output-file-name, --no-save-output or an SR name, the file name does not carry it.
    shape = (f"{result.width}x{result.height}, {frames}, {result.fps:g} fps"
             f"{', with audio' if result.has_audio else ', no audio'}, seed {result.seed}")
    if result.output_file_path:
        return f"saved {result.output_file_path} ({shape})"
    return f"not saved ({unsaved_by}): {shape}"


class StdoutFailed(Exception):
    """Standard output could not take the results (`| head -1` closed it, `>/dev/full`): told as such, not as the
    disk or file error its OSError reads as ("No space left on device; free space on that disk" for /dev/full, a
    video saved), and the same whether Python buffers stdout or not (buffered, the failure surfaced only at exit,
    where it was ignored: exit 0 with the results lost)."""

    def __init__(self, error: OSError, saved: str | None) -> None:
        super().__init__(error)
        self.error = error
        self.saved = saved


def out(text: str, saved: str | None = None) -> None:
    """One result line (or table) on stdout, flushed now so a failure is this line's; `saved`: the video it is about."""
    try:
        print(text)
        sys.stdout.flush()
    except OSError as exc:
        raise StdoutFailed(exc, saved) from exc


def result_record(result, label: str = "", prompt: str | None = None) -> dict[str, Any]:
    """`--json`'s line for one finished request: what the table and the `saved ...` line say, as values a script
    reads without parsing text. `label` / `prompt`: a --prompt-file-path request's "line N" and prompt."""
    record: dict[str, Any] = {}
    if label:
        kind, _, number = label.partition(" ")
        record["line"] = int(number) if kind == "line" and number.isdigit() else label
        record["prompt"] = prompt
    aspect = result.sample_aspect_ratio
    record.update({
        "output_file_path": result.output_file_path,  # null with --no-save-output
        "width": result.width,
        "height": result.height,
        "num_frames": result.num_frames,
        "fps": result.fps,
        "has_audio": result.has_audio,
        "audio_sample_rate": result.audio_sample_rate if result.has_audio else None,
        "seed": result.seed,
        # Non-square pixels of an anamorphic SR source, width over height, "4:3" as ffprobe's field of this name
        # writes it (and the HTTP job's); null for square ones. It read "4/3", the job "4:3".
        "sample_aspect_ratio": None if aspect is None else f"{aspect.numerator}:{aspect.denominator}",
        # Seconds, but the counts (TIMING_COUNTS) as whole numbers; a time not measured (NaN) is null, so the line
        # stays JSON (Python's json writes NaN, which JSON parsers such as jq's refuse).
        "timings": {key: (int(value) if key in TIMING_COUNTS else value) if math.isfinite(value) else None
                    for key, value in result.timings.items()},
        "peak_memory_mb": result.peak_memory_mb if math.isfinite(result.peak_memory_mb) else None,
        "notes": [note_for_cli(note) for note in result.notes],  # naming the flags, as the printed notes do
        "expanded_prompt": result.expanded_prompt,  # null unless --expand-prompts rewrote the prompt
    })
    return record


def print_result(result, as_json: bool = False, label: str = "", prompt: str | None = None, *,
                 unsaved_by: str = "--no-save-output") -> None:
    for note in result.notes:
        print(f"note: {note_for_cli(note)}", file=sys.stderr)
    if as_json:
        # One line per request (JSON Lines): a prompt file's results read one by one as they finish. On a UTF-8
        # stdout a Cyrillic path stays readable; on another (a Windows pipe's cp1252) it is written as JSON's \u
        # escapes, since the console's backslashreplace would write \xe9 or \U0001f98a, which are no JSON.
        utf8 = codecs.lookup(getattr(sys.stdout, "encoding", None) or "ascii").name == "utf-8"
        out(json.dumps(result_record(result, label, prompt), ensure_ascii=not utf8, allow_nan=False),
            result.output_file_path)
        return
    if result.expanded_prompt is not None:
        # A result (the text the video was made from), so on stdout, before the table and the saved line.
        out(f"expanded prompt: {result.expanded_prompt}", result.output_file_path)
    out(format_timings(result), result.output_file_path)
    out(format_summary(result, unsaved_by), result.output_file_path)
