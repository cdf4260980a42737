"""`k6serve generate`: one request offline, a progress bar over steps, a timing table at the end."""

from __future__ import annotations

import codecs
import json
import math
import sys
import threading
import unicodedata
from pathlib import Path
from typing import Any

from k6serve.api import DiffGenerator
from k6serve.config import EngineConfig
from k6serve.engine_arguments import build_engine_config
from k6serve.media.output_names import numbered_file_names
from k6serve.models.variants import GENERATION
from k6serve.output_checks import check_output, final_file_name, require_media_package, unsaved_output_keys
from k6serve.request import TIMING_COUNTS, FlagWorded, SamplingParams, has_visible_text, note_for_cli
from k6serve.request_arguments import split_kwargs
from k6serve.request_refusals import MissingPrompt, MissingSourceVideo
from k6serve.request_resolution import prompt_text_refusal
from k6serve.runtime.engine import RequestCancelled


class Interrupted(KeyboardInterrupt):
    """Ctrl-C during `k6serve generate`, with what it stopped, for the CLI's last line ("error: interrupted
    (Ctrl-C); the request was stopped."): one that came while the MP4 was already saved (the summary printing, the
    workers shutting down) said the request was stopped, though its video was on disk."""


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


def _variant_before_loading(engine_options: dict[str, Any]):
    """The variant the worker will recognise, where that needs no download, else None
    (`checkpoint_files.variant_before_loading`)."""
    from k6serve.models.checkpoint_files import variant_before_loading

    return variant_before_loading(engine_options["model_path"], engine_options.get("model_id"),
                                  engine_options.get("load_format"))[0]


def _checked_engine_config(engine_options: dict[str, Any], variant) -> EngineConfig:
    """The engine options built and checked alone, without a request: a prompt file's run checks them once, before
    its lines, and `check_request_before_loading` with each request."""
    config = build_engine_config(**engine_options)
    if variant is not None and variant.family == GENERATION:
        from k6serve.caching.preflight import check_cache_dit_config_before_loading

        check_cache_dit_config_before_loading(config)  # named as --cache-dit-config, not as the request's params
    return config


def check_request_before_loading(engine_options: dict[str, Any], params: SamplingParams) -> None:
    """Resolve the one request against the model's variant, and open its input file, before the model loads
    (minutes for a real checkpoint): a --seed, --height or --num-inference-steps out of range, a flag of the other
    model family, an --sr-target-resolution with an odd side, Cache-DiT settings that leave no DiT block to cache,
    or a missing or unreadable --image-path / --video-path fails now with its fix, as it would after the load; so
    does a --video-path smaller than one super-resolution tile, or an upscale to a size that cannot be made, planned
    as the server plans a job at its creation. The worker resolves the request again; this only moves the refusal
    earlier."""
    variant = _variant_before_loading(engine_options)
    if variant is None:
        return
    config = _checked_engine_config(engine_options, variant)
    try:
        _check_request(engine_options, params, variant, config)
    except FlagWorded as exc:
        # Chained, so --log-level debug still shows the rule that refused the request (request_resolution.py).
        raise ValueError(exc.flag_wording) from exc


def _check_request(engine_options: dict[str, Any], params: SamplingParams, variant, config: EngineConfig) -> None:
    """`check_request_before_loading`'s checks, in the request's own words (`FlagWorded` carries the flags')."""
    from k6serve.request_resolution import resolve_generate, resolve_upscale

    if variant.family == GENERATION:
        import torch

        from k6serve.models.kandinsky6.config_before_loading import (
            dit_blocks_before_loading,
            has_audio_before_loading,
        )
        from k6serve.offload.residency import streams_text_encoder

        # streams_text_encoder: --expand-prompts under a streamed text encoder was refused only once the model had
        # loaded (minutes on a GPU). --device cuda without a GPU is the worker's refusal to make (resolve_device).
        on_cuda = config.runtime.device in ("auto", "cuda") and torch.cuda.is_available()
        request, _ = resolve_generate(params, variant, engine_cache_dit=config.runtime.cache_dit_config,
                                      cache_dit_unavailable=config.parallel.cache_dit_unavailable,
                                      num_dit_blocks=dit_blocks_before_loading(config.model),
                                      streams_text_encoder=streams_text_encoder(
                                          config.runtime.residency_plan(super_resolution=False),
                                          "cuda" if on_cuda else "cpu"),
                                      has_audio=has_audio_before_loading(config.model))
        if request.image_path is not None:
            from k6serve.media.image import load_conditioning_image

            # log=False: the pipeline's own load of the image logs its colour conversion; this is only the check.
            load_conditioning_image(request.image_path, request.height, request.width, log=False)
    else:
        _refuse_text_for_upscaling(params)
        request, _ = resolve_upscale(params, variant)
        from k6serve.media.container import open_input
        from k6serve.models.kandinsky6_sr.config_before_loading import sr_tiling_before_loading
        from k6serve.serve.upscale_output import expected_upscale_output

        open_input(request.video_path).close()
        expected_upscale_output(request, sr_tiling_before_loading(
            engine_options["model_path"], engine_options.get("model_id"), engine_options.get("load_format")))


def _refuse_text_for_upscaling(params: SamplingParams) -> None:
    """--prompt / --negative-prompt with the super-resolution model: refused on the command line, as every other
    flag of the generation models is. The shared resolver only notes the prompt as ignored, for HTTP clients
    (OpenAI's SDK, ComfyUI) that send one with every video request; a flag typed for this run that does nothing
    is more likely a wrong --model-path."""
    given = [flag for flag, value in (("--prompt", params.prompt), ("--negative-prompt", params.negative_prompt))
             if value]
    if given:
        raise ValueError(f"{' and '.join(given)} {'applies' if len(given) == 1 else 'apply'} to the generation "
                         "models; the super-resolution model upscales --video-path and takes no text: drop "
                         f"{' and '.join(given)}, or pass a generation checkpoint as --model-path.")


def _checked_output_options(request_options: dict[str, Any], *, quiet: bool = False,
                            unsaved_by: str = "--no-save-output") -> dict[str, Any]:
    """Check the output before the model loads and say what will happen to it: a given name changed on its way to
    the file, or output flags that --no-save-output ignores. Returns the request with the name as it will be
    written and without the ignored flags, so the API does not warn about them again. `quiet`: the same flags
    checked again for another prompt of a --prompt-file-path (said once, for the first). `unsaved_by`: what turned
    saving off, as the user wrote it (`unsaved_by` in config_file.py)."""
    _, output = split_kwargs(request_options)
    try:
        output, warnings = check_output(output)
    except FlagWorded as exc:
        raise ValueError(exc.flag_wording) from exc  # --output-file-name, not the API's output_file_name
    for warning in warnings if not quiet else ():
        print(f"warning: {note_for_cli(warning)}", file=sys.stderr)
    if output.save_output:
        if output.output_file_name is None:
            return request_options
        return {**request_options, "output_file_name": output.output_file_name}
    if quiet:
        return {key: value for key, value in request_options.items()
                if key not in unsaved_output_keys(request_options)} | {"return_frames": False}
    drop = unsaved_by if unsaved_by.startswith("--") else "it from the file (or pass --save-output)"
    print(f"note: {unsaved_by}: the video is generated and then discarded; only the timings are printed. "
          f"Drop {drop} to write the MP4.", file=sys.stderr)
    ignored = unsaved_output_keys(request_options)
    if ignored:
        flags = " and ".join("--" + key.replace("_", "-") for key in ignored)
        print(f"warning: {flags} {'is' if len(ignored) == 1 else 'are'} ignored: {unsaved_by} writes no file.",
              file=sys.stderr)
    # The API returns the frames of a request without a file; the CLI would only hold them (GBs for an upscale).
    return {key: value for key, value in request_options.items() if key not in ignored} | {"return_frames": False}


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


def _prompt_file_batch(request_options: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """One request per prompt of --prompt-file-path (or of its --prompt-file-lines), each with every other flag as
    given: [(label, options)]."""
    path = request_options.pop("prompt_file_path")
    lines = request_options.pop("prompt_file_lines", None)
    if request_options.get("prompt"):
        raise ValueError("--prompt and --prompt-file-path both give the prompt; pass one of them.")
    prompts = read_prompt_file(path)
    names = [None] * len(prompts)
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


def _refuse_prompt_file_for_upscaling() -> None:
    raise ValueError("--prompt-file-path gives prompts to the generation models; the super-resolution model "
                     "upscales --video-path and takes no text: drop --prompt-file-path, or pass a generation "
                     "checkpoint as --model-path.")


def _batch_report(done: list[tuple[str, Any]], failed: str | None, left: list[str], count: int) -> str:
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
        kind, _, number = label.partition(" ")
        if kind == "line" and number.isdigit():
            numbers.append(int(number))
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


class StdoutFailed(Exception):
    """Standard output could not take the results (`| head -1` closed it, `>/dev/full`): told as such, not as the
    disk or file error its OSError reads as ("No space left on device; free space on that disk" for /dev/full, a
    video saved), and the same whether Python buffers stdout or not (buffered, the failure surfaced only at exit,
    where it was ignored: exit 0 with the results lost)."""

    def __init__(self, error: OSError, saved: str | None) -> None:
        super().__init__(error)
        self.error = error
        self.saved = saved


def _out(text: str, saved: str | None = None) -> None:
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


def _print_result(result, as_json: bool = False, label: str = "", prompt: str | None = None, *,
                  unsaved_by: str = "--no-save-output") -> None:
    for note in result.notes:
        print(f"note: {note_for_cli(note)}", file=sys.stderr)
    if as_json:
        # One line per request (JSON Lines): a prompt file's results read one by one as they finish. On a UTF-8
        # stdout a Cyrillic path stays readable; on another (a Windows pipe's cp1252) it is written as JSON's \u
        # escapes, since the console's backslashreplace would write \xe9 or \U0001f98a, which are no JSON.
        utf8 = codecs.lookup(getattr(sys.stdout, "encoding", None) or "ascii").name == "utf-8"
        _out(json.dumps(result_record(result, label, prompt), ensure_ascii=not utf8, allow_nan=False),
             result.output_file_path)
        return
    if result.expanded_prompt is not None:
        # A result (the text the video was made from), so on stdout, before the table and the saved line.
        _out(f"expanded prompt: {result.expanded_prompt}", result.output_file_path)
    _out(format_timings(result), result.output_file_path)
    _out(format_summary(result, unsaved_by), result.output_file_path)


class _Batch:
    """A --prompt-file-path run's progress, for the report when it stops early: the requests finished, the one that
    failed (None for Ctrl-C or a stop between requests), and the rest, not run or not finished."""

    def __init__(self, batch: list[tuple[str, dict[str, Any]]], as_json: bool = False,
                 unsaved_by: str = "--no-save-output") -> None:
        self.batch = batch
        self.as_json = as_json  # --json: each result as one JSON line on stdout, the run's summary on stderr
        self.unsaved_by = unsaved_by  # what turned saving off, for the summary line (`format_summary`)
        self.done: list[tuple[str, Any]] = []
        self.failed: str | None = None
        # Side by side (--dp-size): `failed` is the prompt that failed, `error` its error, `stopped` the running
        # prompts a Ctrl-C stopped. In order, `failed` is the prompt running, which a Ctrl-C stops.
        self.side_by_side = False
        self.error: BaseException | None = None
        self.stopped = 0

    def interrupted(self, *, from_file: bool) -> Interrupted:
        """What a Ctrl-C stopped, for the CLI's last line."""
        stopped = self.stopped if self.side_by_side else int(self.failed is not None)
        # An error side by side waits for the running prompts to finish; a Ctrl-C then must not hide it.
        failed_before = f"; {self.failed} had failed before it: {self.error}" if self.error is not None else ""
        if stopped:
            return Interrupted(("; the request was stopped" if not from_file else
                                f"; the {'request' if stopped == 1 else f'{stopped} requests'} running then "
                                f"{'was' if stopped == 1 else 'were'} stopped") + failed_before)
        if not from_file:
            if self.done:
                return Interrupted(f" after the request finished; {format_summary(self.done[-1][1], self.unsaved_by)}")
            return Interrupted(" before the request started; nothing was generated")
        if len(self.done) == len(self.batch):
            return Interrupted(" after the last prompt finished; every video is kept")
        return Interrupted((" between two prompts; none was running" if self.done or failed_before else
                            " before the first prompt started; nothing was generated") + failed_before)

    def report(self) -> str:
        finished = {label for label, _ in self.done}
        left = [label for label, _ in self.batch if label not in finished and label != self.failed]
        return _batch_report(self.done, self.failed, left, len(self.batch))


def _progress_prompt(prompt: str, limit: int = 160) -> str:
    """A prompt as a progress line shows it: its first `limit` characters on one line (a 5,000-character prompt
    filled the terminal at every start and finish; the file holds the whole of it), cut where no character is
    split (not on a combining mark, nor inside an emoji's joined sequence). Control characters and the bidi
    embedding, override and isolate marks are shown escaped, not sent to the terminal (an escape sequence or a
    right-to-left override in a prompt file recoloured or reversed the line); other format characters (a zero-width
    non-joiner in a Persian word, left-to-right marks) are text and stay."""
    flat = " ".join(prompt.split())
    if len(flat) > limit:
        cut = limit - 3
        # Back to the start of the character the cut would split.
        while cut > 0 and (unicodedata.category(flat[cut]) in ("Mn", "Mc", "Me")
                           or "\u200d" in flat[cut - 1:cut + 1]):
            cut -= 1
        flat = flat[:cut] + "..."
    return "".join(ascii(char)[1:-1] if unicodedata.category(char) == "Cc" or char in _BIDI_CONTROLS else char
                   for char in flat)


_BIDI_CONTROLS = frozenset("\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069")


def _run_in_order(generator: DiffGenerator, progress: _Batch, numbered: bool) -> None:
    for index, (label, options) in enumerate(progress.batch):
        progress.failed = label
        if numbered:
            print(f"[{index + 1}/{len(progress.batch)}] {label}: {_progress_prompt(options['prompt'])}",
                  file=sys.stderr)
        result = _run_one(generator, options)
        progress.done.append((label, result))
        progress.failed = None  # finished: a stop while its results print is not this prompt's (nor skips the next)
        _print_result(result, progress.as_json, label, options.get("prompt"), unsaved_by=progress.unsaved_by)


def _run_side_by_side(generator: DiffGenerator, progress: _Batch, replicas: int) -> None:
    """--prompt-file-path with `--dp-size` N: N prompts at once (`DiffGenerator.generate` runs N requests at a time,
    one per replica, from as many threads), the next one given as soon as one finishes, so no replica waits while
    another works; each result prints as it finishes. After a failure no prompt is started; the running ones finish
    (their videos are kept) and the failure is raised."""
    from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait

    print(f"prompt file: {len(progress.batch)} prompts, {replicas} at a time (--dp-size {replicas}); no progress "
          "bars", file=sys.stderr)
    progress.side_by_side = True
    queue = iter(progress.batch)
    error: BaseException | None = None
    running: dict = {}
    pool = ThreadPoolExecutor(max_workers=replicas, thread_name_prefix="k6serve-prompt")
    stop = threading.Event()

    def stop_point(step: int, total: int) -> None:
        # Ctrl-C reaches the main thread, which waits below, not the pool's threads waiting in generate(): those
        # requests learn of it here, at their next step boundary, and end there with no file left behind (raising
        # from on_progress cancels a request on every rank of its replica).
        if stop.is_set():
            raise RequestCancelled("stopped by Ctrl-C")

    def report_finished(label: str, options: dict[str, Any], result) -> None:
        progress.done.append((label, result))
        print(f"[{len(progress.done)}/{len(progress.batch)} finished] {label}: {_progress_prompt(options['prompt'])}",
              file=sys.stderr)
        _print_result(result, progress.as_json, label, options["prompt"], unsaved_by=progress.unsaved_by)

    def start_next() -> None:
        item = next(queue, None)
        if item is not None:
            running[pool.submit(generator.generate, item[1], on_progress=stop_point)] = item

    try:
        for _ in range(replicas):
            start_next()
        while running:
            # Timed: the kernel may hand Ctrl-C's SIGINT to any thread, which only sets Python's flag; a main thread
            # in an untimed wait saw it when a request ended (engine.py: _interruptible_result).
            finished, _ = wait(running, timeout=0.1, return_when=FIRST_COMPLETED)
            for future in finished:
                label, options = running.pop(future)
                try:
                    result = future.result()
                except Exception as exc:  # noqa: BLE001 - the first is raised once the running ones finish
                    if error is None:
                        error = progress.error = exc
                        progress.failed = label
                    continue
                report_finished(label, options, result)
                if error is None:
                    start_next()
    except BaseException:
        # Ctrl-C: the generator's shutdown() finishes running requests, so without this the prompts running then
        # were saved after the report had named them "not run". Stop them, and count those that end anyway (past
        # their last step) as finished, so the report names exactly the lines to run again.
        stop.set()
        for future, (label, options) in list(running.items()):
            try:
                result = future.result()
            except Exception:  # noqa: BLE001 - stopped (or failed): not saved, so "not run"
                progress.stopped += 1
                continue
            report_finished(label, options, result)
        raise
    finally:
        pool.shutdown(wait=error is not None)
    if error is not None:
        raise error


def run_generate(engine_options: dict[str, Any], request_options: dict[str, Any], *,
                 unsaved_by: str = "--no-save-output") -> int:
    # Checked before the model loads (minutes for a real checkpoint): typos, types, an unusable output folder and
    # an unusable or taken --output-file-name, and the request against the model's defaults and limits; warnings
    # are said now, not after the load and the run. With --prompt-file-path, every prompt's request is checked
    # before the first runs, and the model loads once for all of them.
    as_json = bool(request_options.pop("json", None))
    from_file = request_options.get("prompt_file_path") is not None
    if not from_file and request_options.pop("prompt_file_lines", None) is not None:
        raise ValueError("--prompt-file-lines picks lines of --prompt-file-path; pass the prompt file too, or drop "
                         "--prompt-file-lines.")
    batch = _prompt_file_batch(request_options) if from_file else [("", request_options)]
    params, output = split_kwargs(batch[0][1])
    require_media_package(params, output)
    if from_file and _is_upscaler_before_loading(engine_options):
        _refuse_prompt_file_for_upscaling()
    if from_file:
        # The engine flags are the run's, not a prompt's: checked once here, an error in them (a --dp-size without
        # the --num-gpus for it, a --cache-dit-config with no block to cache) was reported as "line 1 of
        # --prompt-file-path: ...", sending the user to a prompt that was fine.
        _checked_engine_config(engine_options, _variant_before_loading(engine_options))
    checked = []
    for index, (label, options) in enumerate(batch):
        try:
            check_request_before_loading(engine_options, split_kwargs(options)[0])
            checked.append((label, _checked_output_options(options, quiet=index > 0, unsaved_by=unsaved_by)))
        except ValueError as exc:
            if not label:
                raise  # one request: its own error, with where it came from for --log-level debug
            raise ValueError(f"{label} of --prompt-file-path: {exc}") from exc
    progress = _Batch(checked, as_json, unsaved_by)
    model_path = engine_options.pop("model_path")
    try:
        generator = DiffGenerator.from_cli_options(model_path, **engine_options)
    except KeyboardInterrupt as exc:
        raise Interrupted(" while the model loaded; nothing was generated") from exc
    try:
        try:
            variant = generator.variant
            if variant.family != GENERATION:  # recognised only now (e.g. a hub id not among the released ones)
                if from_file:
                    _refuse_prompt_file_for_upscaling()
                _refuse_text_for_upscaling(params)
            replicas = generator.engine.num_replicas
            if from_file and replicas > 1 and len(checked) > 1:
                _run_side_by_side(generator, progress, replicas)
            else:
                _run_in_order(generator, progress, numbered=from_file)
        except KeyboardInterrupt:
            # The request stops at its next step or decode chunk, then the workers shut down: seconds (a CPU decode
            # chunk took 20 s) in which nothing was printed. A second Ctrl-C during the shutdown stops at once.
            print("\nstopping: the running request ends at its next step, then the workers shut down (Ctrl-C again "
                  "to stop at once)", file=sys.stderr, flush=True)
            raise
        finally:
            generator.shutdown()  # a Ctrl-C here, after the last video was saved, is told as such below
    except BaseException as exc:
        if from_file:
            print(progress.report(), file=sys.stderr)
        if isinstance(exc, KeyboardInterrupt) and not isinstance(exc, Interrupted):
            raise progress.interrupted(from_file=from_file) from exc
        raise
    if from_file and len(checked) > 1:
        if as_json:
            # stdout holds only the JSON lines, one per request: a summary line of another shape among them would
            # break a reader that takes every line as a result.
            print(_batch_report(progress.done, None, [], len(checked)), file=sys.stderr)
        else:
            _out(_batch_report(progress.done, None, [], len(checked)))
    return 0


def _is_upscaler_before_loading(engine_options: dict[str, Any]) -> bool:
    variant = _variant_before_loading(engine_options)
    return variant is not None and variant.family != GENERATION


def _run_one(generator: DiffGenerator, options: dict[str, Any]):
    """One request with its own progress bar, the API's errors in the flags' words."""
    try:
        return generator.generate(options, progress_bar=True)
    except MissingSourceVideo:
        # The model was recognised only once loaded (a hub id not among the released ones): the API's message
        # names its keyword, this one the flag.
        raise ValueError(MissingSourceVideo.FLAG_WORDING) from None
    except MissingPrompt as exc:
        raise ValueError(MissingPrompt.FLAG_WORDING + exc.detail) from None
    except FlagWorded as exc:
        raise ValueError(exc.flag_wording) from None
