"""scripts/gpu_setup.sh, sourced by the GPU scripts on the device: it unpacks the carried `.whlA/site.tar.xz`
(diffusers, PyAV, pytest and FA3 packed by scripts/gpu_wheels.sh) once per machine and puts the folder first on
PYTHONPATH. Run here in a scratch tree with a tiny archive; the folder comes from K6SERVE_GPU_SITE."""

from __future__ import annotations

import io
import os
import subprocess
import tarfile
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "gpu_setup.sh"


def _pack(tree: Path, files: dict[str, str]) -> None:
    (tree / ".whlA").mkdir(parents=True)
    with tarfile.open(tree / ".whlA" / "site.tar.xz", "w:xz") as archive:
        for name, text in files.items():
            data = text.encode()
            info = tarfile.TarInfo(f"./{name}")
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))


def _source(tree: Path, site: Path, out: Path | None) -> subprocess.CompletedProcess[str]:
    env = {key: value for key, value in os.environ.items() if key not in ("OUT", "PYTHONPATH")}
    env["K6SERVE_GPU_SITE"] = str(site)
    if out is not None:
        env["OUT"] = str(out)
    # `;`, not `&&`: without a GPU the script's last command, nvidia-smi, is not found; its refusals exit the shell.
    return subprocess.run(
        ["bash", "-c", f'source "{SCRIPT}"; echo "PYTHONPATH=$PYTHONPATH"'],
        cwd=tree, env=env, capture_output=True, text=True, timeout=60,
    )


def test_unpacks_the_packed_folder_and_puts_it_first(tmp_path: Path) -> None:
    tree, site, out = tmp_path / "tree", tmp_path / "site", tmp_path / "out"
    out.mkdir()
    _pack(tree, {"diffusers/__init__.py": "__version__ = '0.42.1'\n", "fa3_fwd_interface.py": "x = 1\n"})
    result = _source(tree, site, out)
    assert result.returncode == 0, result.stderr
    assert (site / "diffusers" / "__init__.py").read_text() == "__version__ = '0.42.1'\n"
    assert (site / "fa3_fwd_interface.py").is_file()
    assert f"PYTHONPATH={site}:{tree}" in result.stdout
    assert (out / "install.log").is_file() and (out / "nvidia-smi.csv").is_file()


def test_a_machine_that_has_the_folder_is_not_unpacked_into_again(tmp_path: Path) -> None:
    """Once per machine: the calls after the first on a warm machine keep what the first installed."""
    tree, site, out = tmp_path / "tree", tmp_path / "site", tmp_path / "out"
    out.mkdir()
    (site / "diffusers").mkdir(parents=True)
    _pack(tree, {"diffusers/__init__.py": "new\n", "marker.py": ""})
    result = _source(tree, site, out)
    assert result.returncode == 0, result.stderr
    assert not (site / "marker.py").exists()
    assert not (site / "diffusers" / "__init__.py").exists()


def test_refuses_without_an_output_folder(tmp_path: Path) -> None:
    tree = tmp_path / "tree"
    _pack(tree, {"diffusers/__init__.py": ""})
    result = _source(tree, tmp_path / "site", None)
    assert result.returncode != 0
    assert "set OUT to the folder for logs and JSON" in result.stderr
    assert not (tmp_path / "site").exists()


@pytest.mark.parametrize("name", ["gpu_setup.sh", "gpu_wheels.sh"])
def test_scripts_parse(name: str) -> None:
    result = subprocess.run(["bash", "-n", str(SCRIPT.parent / name)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
