"""Third-party packages missing from the running interpreter: the one line that names the package and the pip
command installing it within k6serve's declared versions, and the check that refuses a command needing one
before its model loads (minutes for a real checkpoint) rather than at its first use."""

from __future__ import annotations

import importlib
import importlib.metadata
import re
import sys
import tomllib
from pathlib import Path
from typing import TypeGuard

# Import names whose PyPI distribution is named otherwise (k6serve's own dependencies).
_DISTRIBUTIONS = {"PIL": "pillow", "yaml": "pyyaml", "multipart": "python-multipart",
                  "python_multipart": "python-multipart", "huggingface_hub": "huggingface_hub"}


def _normalised(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _declared_requirements() -> list[str]:
    """k6serve's requirements: the installed distribution's, else (a source tree on PYTHONPATH, never installed, as
    on a GPU host that gets a copy of the tree) those of the pyproject.toml beside the package; none if neither."""
    try:
        return importlib.metadata.requires("k6serve") or []
    except importlib.metadata.PackageNotFoundError:
        pass
    pyproject = Path(__file__).resolve().parent.parent / "pyproject.toml"
    try:
        with pyproject.open("rb") as file:
            project = tomllib.load(file).get("project", {})
    except (OSError, tomllib.TOMLDecodeError):
        return []
    if project.get("name") != "k6serve":
        return []  # another project's file (k6serve vendored into it)
    return list(project.get("dependencies", []))


def declared_requirement(distribution: str) -> str:
    """The requirement k6serve declares for `distribution` (e.g. `av<19,>=14`), else its bare name: a bare
    `pip install av` takes the newest release, which may be one k6serve excludes."""
    for requirement in _declared_requirements():
        if ";" in requirement:
            continue  # an extra's (pytest, triton) or a platform's requirement
        name = re.match(r"[A-Za-z0-9._-]+", requirement)
        if name and _normalised(name.group(0)) == _normalised(distribution):
            return requirement.strip()
    return distribution


def pip_install_command(module: str) -> str:
    """`<this python> -m pip install <requirement>` for the package that provides `module`."""
    top = module.partition(".")[0]
    requirement = declared_requirement(_DISTRIBUTIONS.get(top, top))
    # Quoted where a shell would read > or < as a redirection (double quotes work in sh, cmd and PowerShell).
    argument = f'"{requirement}"' if re.search(r"[<>=!~,\s]", requirement) else requirement
    return f"{sys.executable} -m pip install {argument}"


def describe_missing_package(module: str, needed_for: str | None = None) -> str:
    """One line for a dependency missing from the running environment (a bare venv, a PYTHONPATH that replaced the
    one holding it): not a bug in k6serve, and fixed by one pip command for this interpreter."""
    top = module.partition(".")[0]
    distribution = _DISTRIBUTIONS.get(top, top)
    needs = f"needs {needed_for}" if needed_for else "needs"
    return (f"the Python package {distribution!r} (module {top!r}), which k6serve {needs}, is not installed for "
            f"{sys.executable}: run `{pip_install_command(module)}`, or reinstall k6serve with its dependencies.")


def missing_package(exc: BaseException) -> TypeGuard[ModuleNotFoundError]:
    """`exc` says a third-party package is not installed (one of k6serve's own modules missing is a bug, not this;
    so is a standard-library module this platform lacks, such as `resource` on Windows, which pip cannot install).
    When true, `exc.name` is set: the missing module's name."""
    top = (getattr(exc, "name", None) or "k6serve").partition(".")[0]
    return isinstance(exc, ModuleNotFoundError) and top != "k6serve" and top not in sys.stdlib_module_names


class MissingPackage(ModuleNotFoundError):
    """A package the command is about to need is not installed; the message says how to install it."""


def require_package(module: str, needed_for: str) -> None:
    """Import `module` now, or raise `MissingPackage` naming it, what needs it and the pip command. Only `module`
    itself missing is reworded; a dependency of it missing raises as it is (named by the caller's handler)."""
    try:
        importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name != module:
            raise
        raise MissingPackage(describe_missing_package(module, needed_for), name=module) from None
