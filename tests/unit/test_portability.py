"""What Windows lacks (SIGHUP, SIGBUS, SIGKILL, the `resource` module) does not stop k6serve's modules from
importing: it failed at import there, before any message could say what is supported. Linux is the tested
platform; this keeps the failure, where there is one, out of the import."""

from __future__ import annotations

import subprocess
import sys
import textwrap


def test_the_runtime_imports_without_the_signals_and_modules_windows_lacks():
    script = textwrap.dedent("""
        import signal, sys
        for name in ("SIGHUP", "SIGBUS", "SIGKILL", "pthread_sigmask"):
            delattr(signal, name)
        sys.modules["resource"] = None  # `import resource` raises ImportError, as on Windows
        import torch
        import k6serve.cli.main, k6serve.runtime.launch, k6serve.runtime.process_group_worker
        import k6serve.runtime.rank_process
        from k6serve.runtime.out_of_memory import worker_killed_hint
        import k6serve.runtime.worker
        from k6serve.runtime.devices import peak_memory_mb
        from k6serve.runtime.launch import ENGINE_HANDLED_SIGNALS
        print(peak_memory_mb(torch.device("cpu")), [s.name for s in ENGINE_HANDLED_SIGNALS], worker_killed_hint([-15]))
    """)
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.split(" ", 1)[0] == "0.0"
    assert "['SIGINT', 'SIGTERM']" in run.stdout and "stopped from outside k6serve" in run.stdout
