"""A progress bar over a request's denoising steps (SR: DiT calls), fed by `on_progress(step, total)`: the CLI's,
and the Python API's with `progress_bar=True`. Its own module so the API and the CLI share it without the API
importing the CLI."""

from __future__ import annotations

from typing import Any

from tqdm import tqdm


class StepBar:
    """The CLI's progress bar over the steps, fed by the API's `on_progress(step, total)`.

    Opened at the first step, so a request rejected before it runs prints no empty bar above its error; the steps
    before it opened are its `initial`, not counted in its rate (it opened at 190,000 step/s). Closed at the last
    step: the decode that follows would otherwise count in the final rate (it read 3 s/step where the steps took
    0.7 s). A step reported again (the decode's chunk boundaries repeat the last) draws nothing: every redraw is a
    new line where stderr is not a terminal. A step count that starts over (a new total, or a lower step) opens a
    new bar, or resets the open one.
    """

    def __init__(self, description: str, **tqdm_options: Any) -> None:
        self.description = description
        self.tqdm_options = tqdm_options
        self.bar: tqdm | None = None
        self.finished = False

    def update(self, step: int, total: int) -> None:
        bar = self.bar
        if bar is None or (self.finished and (step < bar.n or total != bar.total)):
            self.bar = bar = tqdm(desc=self.description, unit="step", total=total, initial=step, **self.tqdm_options)
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
