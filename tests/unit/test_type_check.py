"""The whole package and scripts/ under mypy, with the installed torch, transformers, diffusers and pydantic types:
no error.

The annotations are read by users' type checkers (the package ships py.typed) and say what the code does; an
Optional used unchecked, a wrong return type or a misspelt attribute is an error here rather than at run time, and
in a GPU script rather than after its model has loaded on a rented GPU. To see the errors: `mypy` from the
repository root (its settings are pyproject.toml's [tool.mypy]).
"""

from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]


def test_the_package_and_scripts_are_clean_under_mypy(request, tmp_path, monkeypatch):
    mypy_api = pytest.importorskip("mypy.api", reason="mypy is a test dependency: pip install -e '.[test]'")
    monkeypatch.chdir(ROOT)  # the package of this checkout, and pyproject.toml's settings
    # mypy's incremental cache in pytest's own cache folder where there is one: a fresh check takes half a
    # minute on one core, a re-check of a few changed modules seconds (mypy re-reads what changed, installed
    # packages included). A clean clone (CI) or -p no:cacheprovider checks afresh.
    pytest_cache = getattr(request.config, "cache", None)  # absent under -p no:cacheprovider
    cache = pytest_cache.mkdir("mypy") if pytest_cache is not None else tmp_path / "mypy"
    report, errors, status = mypy_api.run(["--config-file", str(ROOT / "pyproject.toml"), "--cache-dir", str(cache),
                                           "--no-error-summary"])
    assert (status, report, errors) == (0, "", ""), report + errors
