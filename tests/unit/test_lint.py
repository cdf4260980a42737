"""pyflakes over everything Python in the repository, and pycodestyle's layout checks over the package: no warning.

pyflakes finds what runs only on a rare path (a name used after `del`, a misspelt or missing import, an unused one
left by a refactor) without running it; the GPU scripts in `scripts/` run only where device time is scarce, so a
name error there costs a device call. To see the warnings: `python -m pyflakes k6serve tests scripts integrations`
and `python -m pycodestyle --select=E302,E303,E305,W391,E501 --max-line-length=120 k6serve`.
"""

import contextlib
import io
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]
PYFLAKES_PATHS = ("k6serve", "tests", "scripts", "integrations")
# Blank lines between definitions, trailing blank lines, and the line length the package is written to.
PYCODESTYLE_CHECKS = ["E302", "E303", "E305", "W391", "E501"]


def test_pyflakes_finds_nothing():
    api = pytest.importorskip("pyflakes.api", reason="pyflakes is a test dependency: pip install -e '.[test]'")
    from pyflakes.reporter import Reporter

    out, errors = io.StringIO(), io.StringIO()
    count = api.checkRecursive([str(ROOT / path) for path in PYFLAKES_PATHS], Reporter(out, errors))
    assert (count, errors.getvalue()) == (0, ""), out.getvalue() + errors.getvalue()


def test_the_package_keeps_its_layout():
    pycodestyle = pytest.importorskip("pycodestyle", reason="pycodestyle is a test dependency")
    out = io.StringIO()
    style = pycodestyle.StyleGuide(select=PYCODESTYLE_CHECKS, max_line_length=120)
    with contextlib.redirect_stdout(out):
        report = style.check_files([str(ROOT / "k6serve")])
    assert report.total_errors == 0, out.getvalue()
