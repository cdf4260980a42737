"""A progress bar over a request's denoising steps (SR: DiT calls), fed by `on_progress(step, total)`: the CLI's,
and the Python API's with `progress_bar=True`. Its own module so the API and the CLI share it without the API
importing the CLI."""

from __future__ import annotations

import sys
import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tqdm import tqdm


class StepBar:
    """The CLI's progress bar over the steps, fed by the API's `on_progress(step, total)`.

    Opened at the first step, so a request rejected before it runs prints no empty bar above its error; the steps
    before it opened are its `initial`, not counted in its rate (it opened at 190,000 step/s). Closed at the last
    step: the decode that follows would otherwise count in the final rate (it read 3 s/step where the steps took
    0.7 s). A step reported again (the decode's chunk boundaries repeat the last) draws nothing. A step count that
    starts over (a new total, or a lower step) opens a new bar, or resets the open one.

    Where the stream is no terminal (a CI log, a service's journal, `2>log`) and no notebook, whose output cell
    handles a bar's carriage returns, it writes plain lines instead, at each tenth of the steps and the last: the
    bar's redraws were one line of `\r`-joined frames there.
    """

    def __init__(self, description: str, unit: str = "step", **tqdm_options: Any) -> None:
        self.description = description
        self.unit = unit  # "prompt" for a bar over a list's prompts run side by side (api.py)
        self.tqdm_options = tqdm_options
        self.bar: tqdm | None = None
        self.finished = False
        stream = tqdm_options.get("file") or sys.stderr
        self.lines = not (is_terminal(stream) or "ipykernel" in sys.modules)
        self._shown = (0, -1)  # line mode: (total, tenth) of the last line written
        self._started = 0.0

    def update(self, step: int, total: int) -> None:
        if step <= 0:
            # A cancellation point before the first step (a warm-up, the prompt's rewrite): no step is done yet, and
            # a bar opened here counted that wait in its rate (a minute of compiling, or a rewrite of 26 s or more).
            return
        if self.lines:
            self._write_line(step, total)
            return
        bar = self.bar
        if bar is None or (self.finished and (step < bar.n or total != bar.total)):
            from tqdm import tqdm  # here: `is_terminal` is imported by the CLI's entry, which stays light

            self.bar = bar = tqdm(desc=self.description, unit=self.unit, total=total, initial=step,
                                  **self.tqdm_options)
            self.finished = False
        elif self.finished:
            return
        elif step < bar.n or total != bar.total:
            bar.reset(total=total)
            bar.update(step)
        elif step > bar.n:
            bar.update(step - bar.n)
        if step >= total:
            bar.close()
            self.finished = True

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()

    def _write_line(self, step: int, total: int) -> None:
        shown_total, shown_tenth = self._shown
        tenth = step * 10 // max(total, 1)
        if total != shown_total or tenth < shown_tenth:  # a count that starts over
            shown_tenth, self._started = -1, time.monotonic()
        if tenth <= shown_tenth:
            return
        self._shown = (total, tenth)
        stream = self.tqdm_options.get("file") or sys.stderr
        print(f"{self.description}: {step}/{total} {self.unit}s, {time.monotonic() - self._started:.1f} s",
              file=stream, flush=True)


def is_terminal(stream: Any) -> bool:
    """Whether `stream` is a terminal; False for a replaced stream without isatty, or a closed one."""
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError, OSError):  # no isatty, or closed
        return False
