"""The README's quick start and CI agree: `.ci/run` installs with the README's test install command and runs its test
command, so that what CI passes is what a user's two commands do."""

import re
import shlex
from pathlib import Path

ROOT = Path(__file__).parents[2]


def _readme_commands() -> list[str]:
    return re.findall(r"```bash\n(pip install [^\n]*)\n```", (ROOT / "README.md").read_text())


def test_ci_runs_the_readmes_test_commands():
    main_job, tests = _readme_commands()[:2]
    assert "k6serve generate --model-path demo" in main_job
    install, run = (shlex.split(part) for part in tests.split(" && "))
    assert install[:2] == ["pip", "install"] and run[:3] == ["python", "-m", "pytest"]
    ci = [shlex.split(line) for line in (ROOT / ".ci" / "run").read_text().splitlines()
          if line.startswith("python3 ")]
    assert ci == [["python3", "-m", "pip", "install", "--quiet", *install[2:]], ["python3", *run[1:]]]
