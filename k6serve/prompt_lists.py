"""Running `DiffGenerator.generate(prompt=[...])`'s list: one request per prompt, in order on one replica, side by
side on several (`--dp-size`), and the note a stopped list's error carries (what finished, where its videos are,
how to run the rest). Its own module so api.py keeps to `DiffGenerator`."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from concurrent.futures import FIRST_COMPLETED, CancelledError, Future
from concurrent.futures import wait as futures_wait
from pathlib import Path
from typing import TYPE_CHECKING, Any

from k6serve.request import OutputOptions, SamplingParams, error_type_name
from k6serve.runtime.engine import RequestCancelled

if TYPE_CHECKING:
    from k6serve.request import ProgressCallback, VideoResult
    from k6serve.runtime.engine import Engine, EngineJob
    from k6serve.step_bar import StepBar

# One checked request per prompt: (params, output, the warnings its checks gave, for the result's notes).
Listed = list[tuple[SamplingParams, OutputOptions, list[str]]]


@contextlib.contextmanager
def stopped_list(listed: Listed, results: list[VideoResult]) -> Iterator[None]:
    """Around one prompt of a list run in order: its failure (or Ctrl-C, a cancel) is raised with a note of what had
    finished, where their videos are, and how to run the rest."""
    try:
        yield
    except BaseException as error:
        error.add_note(stopped_note(listed, dict(enumerate(results)), len(results)))
        raise


def stopped_note(listed: Listed, finished: dict[int, VideoResult], stopper: int, *, side_by_side: int = 1,
                 also_failed: dict[int, BaseException] | None = None) -> str:
    """What a list's error says: which prompt stopped it, which had finished (`finished`, by place; with prompts run
    side by side not always the ones before it), their files, and the call that runs the rest."""
    count = len(listed)
    rest = [index for index in range(count) if index not in finished]
    saved = [path for index in sorted(finished) if (path := finished[index].output_file_path)]
    done = sorted(finished)
    if not rest:  # Ctrl-C after the last prompt ended (in the bar's last update): rest[0] below raised IndexError
        return (f"all {count} prompts of the list had finished" + (f" (saved: {', '.join(saved)})" if saved else "")
                + "; none is left to run.")
    note = (f"prompt {stopper} of the list of {count} stopped it"
            + (f" ({side_by_side} ran at a time, one per dp replica)" if side_by_side > 1 else "") + ": "
            + (f"{_places(done)} had finished" if done else "none had finished")
            + (f" (saved: {', '.join(saved)})" if saved else ""))
    for index, error in sorted((also_failed or {}).items()):
        note += f"; prompt {index} failed too ({error_type_name(error)}: {_first_line(error)})"
    if rest == list(range(rest[0], count)):
        note += f"; to run the rest, pass the list from prompt {rest[0]} on (prompts[{rest[0]}:])"
    else:  # a later prompt finished beside the one that failed: the rest is not a tail of the list
        places = ", ".join(map(str, rest)) + ("," if len(rest) == 1 else "")
        note += f"; to run the rest, pass {_places(rest)}: [prompts[i] for i in ({places})]"
    return note + _renumbered_names_note(listed, saved) + "."


def shown_prompt(prompt: Any) -> str:
    """A list's prompt as an error shows it: its start, or what else it is."""
    if isinstance(prompt, str):
        return repr(prompt if len(prompt) <= 40 else prompt[:40] + "...")
    return f"{prompt!r} ({type(prompt).__name__})"


def _places(indices: list[int]) -> str:
    """"prompt 3", "prompts 0-2" (a run), "prompts 0, 2 and 3"."""
    if len(indices) == 1:
        return f"prompt {indices[0]}"
    if indices == list(range(indices[0], indices[-1] + 1)):
        return f"prompts {indices[0]}-{indices[-1]}"
    return f"prompts {', '.join(map(str, indices[:-1]))} and {indices[-1]}"


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return text[0] if text else "no message"


def _renumbered_names_note(listed: Listed, saved: list[str]) -> str:
    """What a rerun of a stopped list's rest needs when its output_file_name was numbered: the rest's names start
    again from 1, which the finished prompts' files hold, so the rerun the note advised was refused as "already
    exists"."""
    numbered = len(listed) > 1 and listed[0][1].save_output and listed[0][1].output_file_name is not None
    if not numbered or not saved:
        return ""
    return (f" with another output_file_name, as a list's names are numbered from 1 and {Path(saved[0]).name} is "
            "taken")


def run_side_by_side(engine: Engine, listed: Listed, on_step: ProgressCallback | None, bar: StepBar | None,
                     stop: threading.Event) -> list[VideoResult]:
    """A list's prompts on an engine of N replicas (`--dp-size N`): N at a time, the next started as soon as one
    ends, so no replica waits while another works (in order, the list took N times as long as it needed). Results
    come back in the list's order. `on_step` hears every running prompt's steps, interleaved; `bar` counts finished
    prompts. As the CLI's prompt file does side by side: after a failure no prompt starts, the running ones finish
    (their videos are kept) and the first failure in list order is raised, noting what finished and how to run the
    rest. Ctrl-C in the waiting thread, or `stop` (set when an awaiting asyncio task is cancelled), stops the
    running ones at their next step, with no file left behind; those that end anyway count as finished."""
    width = min(engine.num_replicas, len(listed))
    waiting = iter(range(len(listed)))
    running: dict[Future, tuple[int, EngineJob]] = {}
    finished: dict[int, VideoResult] = {}
    failures: dict[int, BaseException] = {}

    def start_next() -> None:
        index = next(waiting, None)
        if index is not None:
            params, output, _ = listed[index]
            job = engine.submit(params, output, on_progress=on_step, log_failure=False)
            running[job.future] = (index, job)

    def take_ended(start_more: bool) -> None:
        # Timed: the kernel may hand Ctrl-C's SIGINT to any thread, which only sets Python's flag; a main thread in
        # an untimed wait saw it only when a request ended (engine.py: _interruptible_result).
        ended, _ = futures_wait(list(running), timeout=0.1, return_when=FIRST_COMPLETED)
        for future in ended:
            index, _ = running.pop(future)
            try:
                result = future.result()
            except BaseException as exc:  # noqa: BLE001 - raised below, the first in list order
                failures[index] = exc
                continue
            result.notes[:0] = listed[index][2]
            finished[index] = result
            if bar is not None:
                bar.update(len(finished), len(listed))
        # Once all that ended are read: a failure among them starts no more, in whatever order the set gave them.
        if start_more and not failures:
            for _ in ended:
                start_next()

    try:
        for _ in range(width):
            start_next()
        while running:
            if stop.is_set():
                raise RequestCancelled("the list was cancelled (its awaiting task was cancelled)")
            take_ended(start_more=True)
    except BaseException as stopped:
        for _, job in running.values():
            job.abandon()  # at its next step; its on_progress is not called again
        while running:  # seconds: each ends at its next step boundary (a second Ctrl-C stops waiting)
            take_ended(start_more=False)
        stopper = min((index for index in range(len(listed)) if index not in finished), default=0)
        # A prompt that failed before the stop is named: the list's requests log no failure, so it was lost.
        failed = {index: error for index, error in failures.items()
                  if index != stopper and not isinstance(error, (RequestCancelled, CancelledError))}
        stopped.add_note(stopped_note(listed, finished, stopper, side_by_side=width, also_failed=failed))
        raise
    if failures:
        first = min(failures)
        error = failures.pop(first)
        error.add_note(stopped_note(listed, finished, first, side_by_side=width, also_failed=failures))
        raise error
    return [finished[index] for index in range(len(listed))]
