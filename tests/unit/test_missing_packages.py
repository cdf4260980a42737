"""A package k6serve needs, missing from the interpreter, is refused before the model loads with the pip command
that installs it within k6serve's declared versions: not a "bug in k6serve" after the load and the whole run.

`sys.modules[name] = None` makes `import name` raise ModuleNotFoundError as an uninstalled package does."""

from __future__ import annotations

import importlib.metadata
import logging
import socket
import subprocess
import sys

import pytest

from k6serve import DiffGenerator
from k6serve.cli.main import main
from k6serve.dependencies import MissingPackage, pip_install_command
from k6serve.output_checks import require_media_package
from k6serve.request_arguments import split_kwargs

DECLARED = ["torch>=2.11", "av<19,>=14", "huggingface-hub>=0.30", "uvicorn>=0.29", 'pytest>=8; extra == "test"']


@pytest.fixture
def declared(monkeypatch):
    monkeypatch.setattr(importlib.metadata, "requires", lambda name: DECLARED)


def _no_load(*args, **kwargs):
    raise AssertionError("the model loaded")


def test_the_pip_command_keeps_the_declared_versions(declared):
    # A bare `pip install av` takes PyAV 19 where it has wheels, a version k6serve excludes.
    assert pip_install_command("av") == f'{sys.executable} -m pip install "av<19,>=14"'
    assert pip_install_command("huggingface_hub.utils").endswith('pip install "huggingface-hub>=0.30"')
    assert pip_install_command("pytest").endswith("pip install pytest")  # an extra's: the bare name
    assert pip_install_command("yaml").endswith("pip install pyyaml")  # not declared here: the bare name


def test_generate_without_pyav_is_refused_before_the_load(declared, monkeypatch, tmp_path, capsys):
    import k6serve.cli.generate as generate_module

    monkeypatch.setitem(sys.modules, "av", None)
    monkeypatch.setattr(generate_module.DiffGenerator, "from_cli_options", _no_load)
    code = main(["generate", "--model-path", "demo", "--prompt", "x", "--output-path", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert code == 1, err
    assert (f"error: the Python package 'av' (module 'av'), which k6serve needs to write the MP4, is not installed "
            f"for {sys.executable}: run `{sys.executable} -m pip install \"av<19,>=14\"`") in err
    assert "bug" not in err and not (tmp_path / "out").exists()


def test_serve_without_uvicorn_is_refused_before_the_load(declared, monkeypatch, tmp_path, capsys):
    from k6serve.serve import server_process

    monkeypatch.chdir(tmp_path)  # the job store's default folder
    monkeypatch.setitem(sys.modules, "uvicorn", None)
    monkeypatch.setattr(server_process, "Engine", _no_load)
    with socket.socket() as probe:  # a free port, so that only the missing package can stop the start
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    code = main(["serve", "--model-path", "demo", "--host", "127.0.0.1", "--port", str(port)])
    err = capsys.readouterr().err
    assert code == 1, err
    assert "'uvicorn' (module 'uvicorn'), which k6serve needs to run the HTTP server" in err
    assert '-m pip install "uvicorn>=0.29"`' in err


class _NoRunEngine:
    def resolve(self, params):
        raise AssertionError("the request was resolved")

    def generate(self, *args, **kwargs):
        raise AssertionError("the request ran")

    def shutdown(self):
        pass


def test_api_generate_without_pyav_is_refused_before_the_run(declared, monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "av", None)
    with DiffGenerator(_NoRunEngine()) as generator, pytest.raises(
            MissingPackage, match=r"needs to write the MP4.*pip install \"av<19,>=14\""):
        generator.generate(prompt="x", output_path=str(tmp_path))


def test_only_requests_with_files_need_pyav(monkeypatch):
    monkeypatch.setitem(sys.modules, "av", None)
    require_media_package(*split_kwargs({"prompt": "x", "save_output": False}))  # frames only: runs without it
    # A conditioning image is read with Pillow: the frames-only TI2AV request runs too.
    require_media_package(*split_kwargs({"prompt": "x", "image_path": "in.png", "save_output": False}))
    with pytest.raises(MissingPackage, match="needs to read the source video"):
        require_media_package(*split_kwargs({"video_path": "in.mp4", "save_output": False}))


def test_the_conditioning_image_loads_without_pyav(tmp_path):
    """k6serve.media imported every module, PyAV's among them, for the image loader: the server warm-up's image
    pass failed with "No module named 'av'" on a host without PyAV."""
    from PIL import Image

    Image.new("RGB", (96, 64), (200, 10, 10)).save(tmp_path / "in.png")
    code = ("import sys; sys.modules['av'] = None; "
            "from k6serve.pipelines import text_to_video; from k6serve import media; "
            "image = media.load_conditioning_image(sys.argv[1], 64, 96); "
            "assert 'k6serve.media.audio' not in sys.modules and 'k6serve.media.mux' not in sys.modules; "
            "print(tuple(image.shape) if hasattr(image, 'shape') else image.size)")
    done = subprocess.run([sys.executable, "-c", code, str(tmp_path / "in.png")], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    # The MP4 writer still needs PyAV, and its import says so.
    writer = subprocess.run([sys.executable, "-c", "import sys; sys.modules['av'] = None; "
                             "from k6serve import media; media.write_mp4"], capture_output=True, text=True)
    assert writer.returncode != 0 and "ModuleNotFoundError" in writer.stderr and "av" in writer.stderr


def test_from_pretrained_warns_before_the_load_without_pyav(monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "av", None)
    monkeypatch.setattr(DiffGenerator, "_load", classmethod(lambda cls, *args, **kwargs: "loaded"))
    with caplog.at_level(logging.WARNING, logger="k6serve.api"):
        assert DiffGenerator.from_pretrained("demo") == "loaded"
    assert "which k6serve needs to write the MP4" in caplog.text
    assert "generate() runs only requests with save_output=False and no source video" in caplog.text


def test_the_package_version_is_the_projects():
    """`k6serve --version` and the server's OpenAPI version read `k6serve.__version__`; pip reads pyproject's."""
    import tomllib
    from pathlib import Path

    import k6serve

    pyproject = tomllib.loads((Path(k6serve.__file__).parents[1] / "pyproject.toml").read_text())
    assert pyproject["project"]["version"] == k6serve.__version__
    try:
        installed = importlib.metadata.version("k6serve")
    except importlib.metadata.PackageNotFoundError:  # a source tree on PYTHONPATH (the GPU host's runs): no metadata
        installed = k6serve.__version__
    assert installed == k6serve.__version__
    # PEP 561's marker ships with the package, so type checkers read its annotations from an installed copy.
    assert (Path(k6serve.__file__).parent / "py.typed").is_file()
    assert pyproject["tool"]["setuptools"]["package-data"]["k6serve"] == ["py.typed"]


def test_a_standard_library_module_the_platform_lacks_is_no_package_to_install():
    # Windows has no `resource`: the worker's import failed there as "run pip install resource".
    from k6serve.dependencies import missing_package

    assert missing_package(ModuleNotFoundError("No module named 'av'", name="av"))
    assert not missing_package(ModuleNotFoundError("No module named 'resource'", name="resource"))
    assert not missing_package(ModuleNotFoundError("No module named 'k6serve.x'", name="k6serve.x"))
