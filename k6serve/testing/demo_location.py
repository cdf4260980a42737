"""Where the built-in demo checkpoint lives, and whether it is built: what `--model-path demo` needs before the
demo's builder (k6serve/testing/tiny_checkpoints.py, which imports diffusers and transformers to build it) is
needed at all. The engine's process only looks the folder up; it imports no model library to do so."""

from __future__ import annotations

import os
from pathlib import Path

# Bump when the demo builder's output changes, so stale cached demos are not reused.
DEMO_FORMAT_VERSION = 1
DEMO_MARKER_NAME = "k6serve_demo.json"
DEMO_DEFAULTS = {"height": 64, "width": 96, "num_frames": 17, "fps": 24}
# `--model-path` names of the built-in checkpoints and their kinds: generation (T2AV / TI2AV) and super-resolution
# (the distilled 2-step VSR, so that the SR surfaces, the ComfyUI Upscale node included, can be tried offline too).
DEMO_MODEL_PATHS = {"demo": "t2av", "demo-sr": "sr"}
_DEMO_FOLDERS = {"t2av": "kandinsky6-demo-distill", "sr": "kandinsky6-demo-sr"}


def demo_cache_root() -> Path:
    """The k6serve cache folder: `$K6SERVE_CACHE`, else `~/.cache/k6serve`."""
    return Path(os.environ.get("K6SERVE_CACHE") or Path.home() / ".cache" / "k6serve")


def demo_checkpoint_dir(kind: str = "t2av") -> Path:
    """The folder the demo checkpoint of `kind` is (or will be) built in."""
    if kind not in _DEMO_FOLDERS:
        raise ValueError(
            f"unknown demo checkpoint kind {kind!r}; use one of {', '.join(_DEMO_FOLDERS)}"
        )
    return demo_cache_root() / "demo" / f"{_DEMO_FOLDERS[kind]}-v{DEMO_FORMAT_VERSION}"


def built_demo_checkpoint(kind: str = "t2av") -> Path | None:
    """The demo checkpoint's folder if it is built (its marker is written last, after an atomic rename), else None."""
    folder = demo_checkpoint_dir(kind)
    return folder if (folder / DEMO_MARKER_NAME).is_file() else None
