"""`k6serve generate`: one request offline, a progress bar over steps, a timing table at the end.

The checks before the model loads are in preflight.py, a prompt file's reading and report in prompt_file.py, what
is printed for each finished request in result_output.py."""

from __future__ import annotations

import sys
import threading
import unicodedata
from typing import Any

from k6serve.api import DiffGenerator
from k6serve.cli import preflight, result_output
from k6serve.cli.preflight import (
    check_request_before_loading,
    checked_engine_config,
    checked_output_options,
    is_upscaler_before_loading,
    refuse_text_for_upscaling,
)
from k6serve.cli.prompt_file import batch_report, prompt_file_batch, refuse_prompt_file_for_upscaling
from k6serve.cli.result_output import out, print_result
from k6serve.models.variants import GENERATION
from k6serve.output_checks import require_media_package
from k6serve.request import FlagWorded
from k6serve.request_arguments import split_kwargs
from k6serve.request_refusals import MissingPrompt, MissingSourceVideo
from k6serve.runtime.engine import RequestCancelled


class Interrupted(KeyboardInterrupt):
    """Ctrl-C during `k6serve generate`, with what it stopped, for the CLI's last line ("error: interrupted
    (Ctrl-C); the request was stopped."): one that came while the MP4 was already saved (the summary printing, the
    workers shutting down) said the request was stopped, though its video was on disk."""


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
                return Interrupted(f" after the request finished; "
                                   f"{result_output.format_summary(self.done[-1][1], self.unsaved_by)}")
            return Interrupted(" before the request started; nothing was generated")
        if len(self.done) == len(self.batch):
            return Interrupted(" after the last prompt finished; every video is kept")
        return Interrupted((" between two prompts; none was running" if self.done or failed_before else
                            " before the first prompt started; nothing was generated") + failed_before)

    def report(self) -> str:
        finished = {label for label, _ in self.done}
        left = [label for label, _ in self.batch if label not in finished and label != self.failed]
        return batch_report(self.done, self.failed, left, len(self.batch))


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
        print_result(result, progress.as_json, label, options.get("prompt"), unsaved_by=progress.unsaved_by)


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
        print_result(result, progress.as_json, label, options["prompt"], unsaved_by=progress.unsaved_by)

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
    batch = prompt_file_batch(request_options) if from_file else [("", request_options)]
    params, output = split_kwargs(batch[0][1])
    require_media_package(params, output)
    if from_file and is_upscaler_before_loading(engine_options):
        refuse_prompt_file_for_upscaling()
    if from_file:
        # The engine flags are the run's, not a prompt's: checked once here, an error in them (a --dp-size without
        # the --num-gpus for it, a --cache-dit-config with no block to cache) was reported as "line 1 of
        # --prompt-file-path: ...", sending the user to a prompt that was fine.
        # Through its module, as preflight's own callers look it up: one patch in the tests covers every call.
        checked_engine_config(engine_options, preflight.engine_variant_before_loading(engine_options))
    checked = []
    for index, (label, options) in enumerate(batch):
        try:
            check_request_before_loading(engine_options, split_kwargs(options)[0])
            checked.append((label, checked_output_options(options, quiet=index > 0, unsaved_by=unsaved_by)))
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
                    refuse_prompt_file_for_upscaling()
                refuse_text_for_upscaling(params)
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
            print(batch_report(progress.done, None, [], len(checked)), file=sys.stderr)
        else:
            out(batch_report(progress.done, None, [], len(checked)))
    return 0


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
