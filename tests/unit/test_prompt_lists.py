"""`DiffGenerator.generate(prompt=[...])` on an engine of two replicas (`--dp-size 2`): the list's prompts run two at
a time, not one after another on one replica while the other idles. A fake worker that reports two replicas (the
engine runs a thread per replica) keeps these in seconds; what the prompt says is how it runs."""

from __future__ import annotations

import _thread
import asyncio
import threading
import time

import pytest
from test_api_edge_cases import StepWorker, fake_config

from k6serve.api import DiffGenerator
from k6serve.request import VideoResult
from k6serve.runtime.engine import Engine


class TwoReplicas(StepWorker):
    """Two replicas: "fail" raises at once ("fail late" after 0.5 s), "slow" takes 20 steps, "long" 500 (10 s),
    others 3."""

    num_replicas = 2

    def __init__(self) -> None:
        super().__init__(step_s=0.02)
        self.lock = threading.Lock()
        self.running = 0
        self.most = 0
        self.started: list[str] = []
        self.ended: dict[str, str] = {}
        self.on_first_step = None

    def run(self, params, output, on_step=None) -> VideoResult:
        prompt = params.prompt
        with self.lock:
            self.started.append(prompt)
            self.running += 1
            self.most = max(self.most, self.running)
        try:
            if prompt.startswith("fail"):
                time.sleep(0.5 if prompt.startswith("fail late") else 0.05)
                raise RuntimeError(f"{prompt}: the replica's GPU fell off the bus")
            total = 20 if prompt.startswith("slow") else 500 if prompt.startswith("long") else 3
            for step in range(1, total + 1):
                time.sleep(self.step_s)
                if step == 1 and self.on_first_step is not None:
                    self.on_first_step(prompt)
                if on_step is not None:
                    on_step(step, total)
        except BaseException:
            self.ended[prompt] = "stopped"
            raise
        finally:
            with self.lock:
                self.running -= 1
        self.ended[prompt] = "finished"
        return VideoResult(output_file_path=None, frames=None, audio=None, audio_sample_rate=44100, fps=24.0,
                           seed=params.seed or 42, timings={"total": 0.0}, peak_memory_mb=0.0, num_frames=1,
                           height=16, width=16, notes=[f"ran {prompt}"])


@pytest.fixture
def two_replicas():
    worker = TwoReplicas()
    with DiffGenerator(Engine(fake_config(), worker=worker)) as generator:
        yield generator, worker


def test_a_list_runs_two_at_a_time_and_its_results_keep_the_lists_order(two_replicas):
    generator, worker = two_replicas
    steps: list[tuple[int, int]] = []
    results = generator.generate(prompt=["slow a", "b", "c", "d"], save_output=False,
                                 on_progress=lambda step, total: steps.append((step, total)))
    assert worker.most == 2 and sorted(worker.started) == ["b", "c", "d", "slow a"]
    # "b" ended long before "slow a": the freed replica took "c", then "d", while "slow a" ran on.
    assert worker.started[2:] == ["c", "d"] and worker.ended["slow a"] == "finished"
    assert [result.notes[-1] for result in results] == ["ran slow a", "ran b", "ran c", "ran d"]
    assert steps.count((20, 20)) == 1 and steps.count((3, 3)) == 3 and (0, 3) not in steps


def test_a_failure_starts_no_more_prompts_lets_the_running_one_finish_and_says_what_to_run(two_replicas):
    generator, worker = two_replicas
    with pytest.raises(RuntimeError, match="fail: the replica's GPU fell off the bus") as caught:
        generator.generate(prompt=["slow a", "fail", "c", "d"], save_output=False)
    assert sorted(worker.started) == ["fail", "slow a"] and worker.ended["slow a"] == "finished"
    assert caught.value.__notes__ == [
        "prompt 1 of the list of 4 stopped it (2 ran at a time, one per dp replica): prompt 0 had finished; to run "
        "the rest, pass the list from prompt 1 on (prompts[1:])."]


def test_a_failure_after_a_later_prompt_finished_names_the_prompts_to_run_again(two_replicas):
    generator, worker = two_replicas
    with pytest.raises(RuntimeError) as caught:
        # "b" ends first and its replica takes "c"; then "fail late" (prompt 0) fails: 1 and 2 finished, 0 did not.
        generator.generate(prompt=["fail late", "b", "c"], save_output=False)
    assert worker.ended == {"fail late": "stopped", "b": "finished", "c": "finished"}
    assert caught.value.__notes__ == [
        "prompt 0 of the list of 3 stopped it (2 ran at a time, one per dp replica): prompts 1-2 had finished; to "
        "run the rest, pass prompt 0: [prompts[i] for i in (0,)]."]


def test_ctrl_c_stops_the_running_prompts_at_their_next_step(two_replicas):
    generator, worker = two_replicas
    # Ctrl-C is handed to the thread waiting in generate(), not to the engine's threads running the prompts.
    worker.on_first_step = lambda prompt: _thread.interrupt_main() if prompt == "long a" else None
    started = time.monotonic()
    with pytest.raises(KeyboardInterrupt) as caught:
        generator.generate(prompt=["long a", "long b", "c"], save_output=False)
    assert time.monotonic() - started < 5  # not the 10 s each would take
    assert worker.ended == {"long a": "stopped", "long b": "stopped"} and "c" not in worker.started
    assert caught.value.__notes__[0].startswith("prompt 0 of the list of 3 stopped it (2 ran at a time, one per dp "
                                                "replica): none had finished; to run the rest, pass the list from "
                                                "prompt 0 on (prompts[0:])")


def test_a_cancelled_agenerate_stops_the_running_prompts(two_replicas):
    generator, worker = two_replicas

    async def main():
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(generator.agenerate(prompt=["long a", "long b", "c"], save_output=False), 0.3)

    asyncio.run(main())
    deadline = time.monotonic() + 5
    while len(worker.ended) < 2 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert worker.ended == {"long a": "stopped", "long b": "stopped"} and "c" not in worker.started
    assert len(generator.generate(prompt=["a", "b"], save_output=False)) == 2  # the replicas serve on


def test_agenerate_runs_a_list_two_at_a_time(two_replicas):
    generator, worker = two_replicas
    results = asyncio.run(generator.agenerate(prompt=["slow a", "b", "c"], save_output=False))
    assert worker.most == 2 and [result.notes[-1] for result in results] == ["ran slow a", "ran b", "ran c"]


def test_the_progress_bar_of_a_list_side_by_side_counts_its_prompts(two_replicas, capsys):
    generator, _ = two_replicas
    generator.generate(prompt=["a", "b", "c"], save_output=False, progress_bar=True)
    err = capsys.readouterr().err
    assert "prompts: 3/3 prompts" in err and "steps" not in err  # not a step bar jumping between two prompts
    with pytest.raises(ValueError, match=r"progress_bar must be True or False, got 'yes'"):
        generator.generate(prompt=["a", "b"], save_output=False, progress_bar="yes")



class _DoneAtOnce:
    """An engine of two replicas whose requests have ended when submitted ("fail" with an error), so that one wait
    hands back several ended prompts at once."""

    num_replicas = 2

    def __init__(self) -> None:
        self.submitted: list[str] = []

    def submit(self, params, output, on_progress=None, log_failure=True):
        from concurrent.futures import Future
        from types import SimpleNamespace

        self.submitted.append(params.prompt)
        future: Future = Future()
        future.set_running_or_notify_cancel()
        if params.prompt == "fail":
            future.set_exception(RuntimeError("fail: the replica's GPU fell off the bus"))
        else:
            future.set_result(VideoResult(output_file_path=None, frames=None, audio=None, audio_sample_rate=44100,
                                          fps=24.0, seed=42, timings={"total": 0.0}, peak_memory_mb=0.0, num_frames=1,
                                          height=16, width=16, notes=[]))
        return SimpleNamespace(future=future, abandon=lambda: None)


def _listed(prompts):
    from k6serve.request import OutputOptions, SamplingParams

    return [(SamplingParams(prompt=prompt), OutputOptions(save_output=False), []) for prompt in prompts]


def test_a_failure_ended_in_the_same_wait_as_a_success_starts_no_more(monkeypatch):
    # The wait hands back a set: read with the success first, the success started the next prompt before the
    # failure beside it was seen, so a prompt started after the list had failed.
    import k6serve.prompt_lists as prompt_lists

    wait = prompt_lists.futures_wait

    def success_first(futures, **kwargs):
        ended, pending = wait(futures, **kwargs)
        return sorted(ended, key=lambda future: future.exception() is not None), pending

    monkeypatch.setattr(prompt_lists, "futures_wait", success_first)
    engine = _DoneAtOnce()
    with pytest.raises(RuntimeError, match="fell off the bus"):
        prompt_lists.run_side_by_side(engine, _listed(["fail", "b", "c", "d"]), None, None, threading.Event())
    assert engine.submitted == ["fail", "b"]



def test_ctrl_c_once_every_prompt_had_finished_is_raised_as_it_is():
    # Ctrl-C in the bar's last update: the note's "rest" was empty, and its rest[0] raised an IndexError in place of
    # the KeyboardInterrupt.
    import k6serve.prompt_lists as prompt_lists

    class InterruptedBar:
        def update(self, step, total):
            if step == total:
                raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt) as caught:
        prompt_lists.run_side_by_side(_DoneAtOnce(), _listed(["a", "b"]), None, InterruptedBar(), threading.Event())
    assert caught.value.__notes__ == ["all 2 prompts of the list had finished; none is left to run."]


def test_a_failure_before_ctrl_c_is_named_in_the_note():
    # A prompt that failed while another ran on, then Ctrl-C (or a cancel): the note named only what had finished,
    # and the failure (logged by no one: the list's requests are not logged) was lost with its cause.
    import k6serve.prompt_lists as prompt_lists
    from k6serve.runtime.engine import RequestCancelled

    class RunsOn(_DoneAtOnce):
        """"long" runs until abandoned."""

        def submit(self, params, output, on_progress=None, log_failure=True):
            if params.prompt != "long":
                return super().submit(params, output, on_progress, log_failure)
            from concurrent.futures import Future
            from types import SimpleNamespace

            self.submitted.append(params.prompt)
            future: Future = Future()
            future.set_running_or_notify_cancel()
            return SimpleNamespace(future=future, abandon=lambda: future.set_exception(RequestCancelled("stopped")))

    stop = threading.Event()
    threading.Timer(0.3, stop.set).start()
    with pytest.raises(RequestCancelled) as caught:
        prompt_lists.run_side_by_side(RunsOn(), _listed(["long", "fail", "c"]), None, None, stop)
    assert caught.value.__notes__ == [
        "prompt 0 of the list of 3 stopped it (2 ran at a time, one per dp replica): none had finished; prompt 1 "
        "failed too (RuntimeError: fail: the replica's GPU fell off the bus); to run the rest, pass the list from "
        "prompt 0 on (prompts[0:])."]


@pytest.mark.parametrize("awaited", [False, True])
def test_a_list_from_an_on_progress_callback_is_refused_as_one_prompt_is(two_replicas, awaited):
    # One prompt from the engine's own thread is refused (it would wait for itself); a list went to the other
    # replica, and hung for good once every replica waited in such a callback, or a LoRA call waited behind it.
    generator, _ = two_replicas
    raised: list[BaseException] = []

    def on_progress(step, total):
        if step == 1:
            try:
                if awaited:
                    asyncio.run(generator.agenerate(prompt=["b", "c"], save_output=False))
                else:
                    generator.generate(prompt=["b", "c"], save_output=False)
            except RuntimeError as exc:
                raised.append(exc)

    generator.generate(prompt="a", save_output=False, on_progress=on_progress)
    assert len(raised) == 1 and "was made from an on_progress callback" in str(raised[0])
