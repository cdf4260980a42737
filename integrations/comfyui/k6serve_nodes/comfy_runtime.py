"""What the nodes take from ComfyUI when they run inside it: interrupt, progress bar, output folder.

Each import is tried at call time and has a stand-in outside ComfyUI, so the nodes also run from plain Python
(and in tests, which insert stub `comfy.*` modules into `sys.modules`).
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from pathlib import Path


def interrupt_check() -> Callable[[], None]:
    """A function that raises ComfyUI's InterruptProcessingException once the user pressed Cancel."""
    try:
        from comfy import model_management
    except ImportError:
        return lambda: None
    throw = getattr(model_management, "throw_exception_if_processing_interrupted", None)
    if throw is not None:
        return throw

    def check() -> None:  # older ComfyUI: only the flag
        if model_management.processing_interrupted():
            raise model_management.InterruptProcessingException()

    return check


def progress_reporter() -> Callable[[int], None]:
    """A function taking the job's progress (0-100) for ComfyUI's progress bar on the node."""
    try:
        from comfy.utils import ProgressBar
    except ImportError:
        return lambda progress: None
    bar = ProgressBar(100)
    return lambda progress: bar.update_absolute(progress, 100)


def output_directory() -> Path:
    """ComfyUI's output folder, or a folder in the system temp directory outside ComfyUI."""
    try:
        import folder_paths
    except ImportError:
        return Path(tempfile.gettempdir()) / "k6serve_comfyui"
    return Path(folder_paths.get_output_directory())
