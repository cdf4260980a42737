"""`k6serve generate` and its rank processes under the signals a process is stopped with: SIGTERM (`timeout`, `kill`,
a job scheduler) and SIGHUP (the terminal closed) stop the request as Ctrl-C does, and ranks whose engine is gone
exit by themselves.

Each test runs the real command in its own session (process group), as a shell runs a command, so that a signal to
the group reaches the ranks too, as `timeout`'s and a terminal's do.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.multiprocess


def _group_members(pgid: int) -> list[int]:
    """The live processes of process group `pgid` (zombies, ended but not yet reaped, are not counted)."""
    members = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()  # after "pid (comm) ": state, ppid, pgrp, ...
        if int(fields[2]) == pgid and fields[0] != "Z":
            members.append(int(entry.name))
    return members


def _rank_started(pgid: int) -> bool:
    """A rank process (multiprocessing's spawn child) runs in the group; the resource tracker, which starts
    first, is not one."""
    for pid in _group_members(pgid):
        try:
            if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes():
                return True
        except OSError:
            continue
    return False


def _wait_until(condition, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.1)
    return condition()


def _start_generate(tmp_path: Path, *extra: str) -> tuple[subprocess.Popen, Path]:
    """`k6serve generate` of the demo with more steps than the test waits for, its stderr in a file."""
    err = tmp_path / "stderr.txt"
    env = {**os.environ, "K6SERVE_CACHE": os.environ.get("K6SERVE_CACHE", str(tmp_path / "cache"))}
    process = subprocess.Popen(
        [sys.executable, "-m", "k6serve.cli.main", "generate", "--model-path", "demo", "--prompt", "a fox",
         "--num-inference-steps", "1000", "--height", "128", "--width", "192", "--num-frames", "33",
         "--output-path", str(tmp_path / "out"), *extra],
        stdout=subprocess.DEVNULL, stderr=err.open("w"), start_new_session=True, env=env)
    return process, err


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP])
def test_a_stop_signal_to_the_group_stops_the_request_as_ctrl_c_does(tmp_path, signum, _demo_cache_dir, monkeypatch):
    """SIGTERM ended `k6serve generate` on the spot (its default action): no message, no summary, the ranks killed
    alike mid-write, a hidden `.part` file left in the output folder."""
    monkeypatch.setenv("K6SERVE_CACHE", str(_demo_cache_dir))
    process, err = _start_generate(tmp_path)
    try:
        assert _wait_until(lambda: "denoising:" in err.read_text(), 120), err.read_text()
        os.killpg(process.pid, signum)
        assert process.wait(60) == 128 + signum
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    text = err.read_text()
    assert text.rstrip().endswith(f"error: stopped by {signal.Signals(signum).name}; the request was stopped."), text
    assert "Traceback" not in text and "leaked semaphore" not in text
    assert "stopping: the running request ends at its next step, then the workers shut down (Ctrl-C again to stop " \
           "at once)" in text  # said at once: the stop can take a decode chunk's time
    assert list((tmp_path / "out").iterdir()) == []  # no video, no temporary file
    assert _wait_until(lambda: not _group_members(process.pid), 10), _group_members(process.pid)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_ranks_exit_when_the_engine_is_killed_while_they_start(tmp_path, _demo_cache_dir, monkeypatch):
    """The engine killed while the model loaded left its rank waiting in the rendezvous for --dist-timeout-s (600 s),
    a process with no parent (holding a CUDA context on a GPU)."""
    monkeypatch.setenv("K6SERVE_CACHE", str(_demo_cache_dir))
    process, err = _start_generate(tmp_path)
    try:
        # The rank has read what spawn hands it and logs (killed before, while the engine still wrote it to the
        # rank's pipe, the rank ended in an EOFError of its unpickling instead: a busy CI machine's flake).
        # 120 s, as for the first step above: under two suites at once on two cores the rank took over 60 s to
        # start (sixty-third session); the bound only limits how long a failure takes.
        assert _wait_until(lambda: _rank_started(process.pid) and "[rank 0]" in err.read_text(), 120), \
            err.read_text()[-2000:]
        os.kill(process.pid, signal.SIGKILL)
        process.wait(10)
        assert _wait_until(lambda: not _group_members(process.pid), 15), _group_members(process.pid)
    finally:
        for pid in _group_members(process.pid):
            os.kill(pid, signal.SIGKILL)
    # Told by the watcher of the parent while it loads, or by the engine's connection once it serves (the tiny demo
    # may be past its load by the time the kill lands).
    said = err.read_text()
    assert (f"the engine process {process.pid} that started it is gone; exiting." in said
            or "the engine closed its connection; replica 0 shuts down" in said), said


def test_a_process_exiting_with_its_ranks_alive_does_not_wait_for_them_forever(tmp_path, _demo_cache_dir):
    """multiprocessing's exit hook stops daemonic children with SIGTERM and joins them; the ranks ignore SIGTERM
    (the engine's to handle), so an exit with ranks alive (a shutdown cut short by a second Ctrl-C) hung."""
    script = ("from k6serve import DiffGenerator\n"
              "generator = DiffGenerator.from_pretrained('demo')\n"
              "generator._shutdown.detach()  # its shutdown never runs: the ranks are alive at the exit\n"
              "print('exiting', flush=True)\n")
    env = {**os.environ, "K6SERVE_CACHE": str(_demo_cache_dir)}
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0 and done.stdout == "exiting\n", done.stderr
    assert time.monotonic() - start < 60


def test_a_generator_left_open_at_exit_is_shut_down_before_its_ranks_are_killed(tmp_path, _demo_cache_dir):
    """The exit hook that kills ranks still alive ran before the generator's finalizer (atexit runs the last
    registered first): the finalizer found its ranks dead, a request running in a daemon thread failed as "replica
    died while running it", and the resource tracker warned of a leaked semaphore."""
    script = ("import logging, threading, time\n"
              "from k6serve import DiffGenerator\n"
              "generator = DiffGenerator.from_pretrained('demo')\n"
              "result = {}\n"
              "def run():\n"
              "    result['r'] = generator.generate(prompt='x', num_inference_steps=3, save_output=False)\n"
              "thread = threading.Thread(target=run, daemon=True)\n"
              "thread.start()\n"
              "time.sleep(0.05)\n"
              "print('exiting', flush=True)\n")
    env = {**os.environ, "K6SERVE_CACHE": str(_demo_cache_dir)}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0 and done.stdout == "exiting\n", done.stderr
    assert "died" not in done.stderr and "leaked semaphore" not in done.stderr and "Traceback" not in done.stderr, \
        done.stderr


def test_what_a_rank_starts_can_still_be_stopped_with_sigterm():
    """A rank leaves SIGTERM and SIGHUP to the engine; with SIG_IGN, or the signals left blocked, every process it
    started (inductor's compile workers, stopped with SIGTERM) ignored them too. It uses a handler, which exec
    resets, and unblocks them."""
    script = (
        "import signal, subprocess\n"
        "from k6serve.runtime import rank_process\n"
        "from k6serve.runtime.launch import ENGINE_HANDLED_SIGNALS\n"
        "signal.pthread_sigmask(signal.SIG_BLOCK, set(ENGINE_HANDLED_SIGNALS))  # as start_process starts a rank\n"
        "def rank_main(*args):\n"
        "    child = subprocess.Popen(['sleep', '30'])\n"
        "    child.terminate()\n"
        "    print('child', child.wait(timeout=10), flush=True)\n"
        "    signal.raise_signal(signal.SIGTERM)  # the rank itself: left to the engine\n"
        "    print('rank alive', flush=True)\n"
        "rank_process.rank_main = rank_main\n"
        "rank_process.engine_rank_main()\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.stdout == f"child {-signal.SIGTERM}\nrank alive\n", done.stderr
    assert done.returncode == 0


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="a pseudo-terminal and /proc")
def test_closing_the_terminal_stops_the_request_with_exit_code_129(tmp_path, _demo_cache_dir):
    """A closed terminal sends SIGHUP and then fails every write with EIO: the stop's own messages raised OSError in
    place of the KeyboardInterrupt, and the run ended with exit code 1."""
    import pty
    import select

    env = {**os.environ, "K6SERVE_CACHE": str(_demo_cache_dir)}
    pid, terminal = pty.fork()
    if pid == 0:  # the child: the command, on the pseudo-terminal
        os.execvpe(sys.executable, [sys.executable, "-m", "k6serve.cli.main", "generate", "--model-path", "demo",
                                    "--prompt", "a fox", "--num-inference-steps", "1000", "--height", "128",
                                    "--width", "192", "--num-frames", "33", "--output-path", str(tmp_path / "out")],
                   env)
    seen = b""
    deadline = time.monotonic() + 120
    try:
        # The load's last line (a pseudo-terminal of 0 columns shows no progress bar), then a second of denoising.
        while b"built-in tiny demo" not in seen and time.monotonic() < deadline:
            if select.select([terminal], [], [], 1)[0]:
                try:
                    seen += os.read(terminal, 65536)
                except OSError:  # EIO: the command ended (its side of the terminal closed)
                    break
        time.sleep(1.0)
    finally:
        os.close(terminal)  # the terminal window closed
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 128 + signal.SIGHUP, seen[-500:]
    assert list((tmp_path / "out").iterdir()) == []
    assert _wait_until(lambda: not _group_members(pid), 10), _group_members(pid)


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full")
@pytest.mark.parametrize("buffered", [True, False])
def test_results_that_stdout_cannot_take_are_told_as_such_buffered_or_not(tmp_path, _demo_cache_dir, buffered):
    """`>/dev/full` exited 0 with the results lost (buffered stdout: the failure came at exit, ignored) or 1 with
    'No space left on device; free space on that disk' (unbuffered), the video saved either way."""
    env = {key: value for key, value in os.environ.items() if key != "PYTHONUNBUFFERED"}
    env.update(K6SERVE_CACHE=str(_demo_cache_dir), **({} if buffered else {"PYTHONUNBUFFERED": "1"}))
    command = [sys.executable, "-m", "k6serve.cli.main", "generate", "--model-path", "demo", "--prompt", "a fox",
               "--output-path", str(tmp_path / "out")]
    with open("/dev/full", "w") as full:
        done = subprocess.run(command, stdout=full, stderr=subprocess.PIPE, text=True, env=env, timeout=180)
    saved = next((tmp_path / "out").iterdir())
    assert done.returncode == 1, done.stderr
    assert done.stderr.rstrip().endswith(f"error: cannot write the results to standard output (No space left on "
                                         f"device); the video was saved: {tmp_path / 'out' / saved.name}.")
    # A reader that stops reading (`| head -1`): quietly, as a program killed by SIGPIPE.
    reader = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    reader.stdout.close()
    assert reader.wait(180) == 141
    assert "error" not in reader.stderr.read()
