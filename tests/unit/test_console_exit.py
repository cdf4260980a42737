"""The `k6serve` command ends without the interpreter's teardown (`cli.main.console_main`): main's exit code, the
atexit handlers and the buffered output kept, the module teardown skipped."""

import importlib.metadata
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest


def test_the_command_is_console_main():
    pyproject = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())
    assert pyproject["project"]["scripts"] == {"k6serve": "k6serve.cli.main:console_main"}
    # An install of this tree (CI's, the README's) has the entry point; the GPU host runs the tree from PYTHONPATH,
    # not installed, so there may be none.
    installed = [e for e in importlib.metadata.entry_points(group="console_scripts") if e.name == "k6serve"]
    assert [e.value for e in installed] in ([], ["k6serve.cli.main:console_main"])


def test_console_main_exits_with_mains_code(monkeypatch):
    from k6serve import process_exit
    from k6serve.cli import main as cli_main

    class Exited(Exception):
        pass

    def exit_without_teardown(code):
        raise Exited(code)

    monkeypatch.setattr(cli_main, "main", lambda: 3)
    monkeypatch.setattr(process_exit, "exit_without_teardown", exit_without_teardown)
    with pytest.raises(Exited, match="3"):
        cli_main.console_main()


def test_a_refused_run_keeps_its_code_output_and_atexit_handlers_but_skips_the_teardown(tmp_path):
    # A refusal (exit 2) before any model loads: the process runs main, then console_main's exit.
    script = (
        "import atexit, sys\n"
        "class Torn:\n"
        "    def __del__(self):\n"
        "        print('teardown ran', flush=True)\n"
        "kept = Torn()  # a module global: collected by the interpreter's teardown, not by os._exit\n"
        "atexit.register(lambda: print('atexit ran'))\n"
        "print('buffered line')  # stdout is a pipe: block-buffered until the exit flushes it\n"
        "sys.argv = ['k6serve', 'generate', '--model-path', 'demo', '--prompt', 'a fox', '--num-frames', '0',\n"
        f"            '--output-path', {str(tmp_path)!r}]\n"
        "from k6serve.cli.main import console_main\n"
        "console_main()\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert "error: --num-frames must be >= 1, got 0" in done.stderr
    assert done.stdout.splitlines() == ["buffered line", "atexit ran"]
