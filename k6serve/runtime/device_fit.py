"""Refusing, before anything loads, a full-size model on a machine without a CUDA GPU unless the CPU was asked for.

With the default `--device auto` and no CUDA device (a machine without a GPU, or torch's CPU build on one with a
GPU, which `pip install torch` can give), every model ran on the CPU in float32: a full-size one grew the host's
memory for minutes with no word of why (the Pro DiT alone is 30 B parameters, 112 GiB in float32) until the kernel's
out-of-memory killer ended it, or some other process, and even with the memory a Pro step takes hours there. The
built-in demos and small local checkpoints (the tests') still run on the CPU by default; `--device cpu` runs any
model there, on purpose.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

from k6serve.config import EngineConfig

logger = logging.getLogger(__name__)

# Weights past this size on the CPU by default are refused: the demos hold a few MB, the smallest released model
# (Lite) tens of GB.
CPU_DEFAULT_LIMIT_BYTES = 2 * 2**30


def check_device_fits(config: EngineConfig) -> None:
    """Raise ValueError when `--device auto` would put a full-size model on the CPU (no CUDA device visible)."""
    if config.runtime.device != "auto":
        return  # --device cpu is a choice; --device cuda is checked where it resolves
    import torch

    if torch.cuda.is_available():
        return
    weights = _weights_before_loading(config)
    if weights is None:
        return
    size_bytes, what = weights
    if size_bytes < CPU_DEFAULT_LIMIT_BYTES:
        return
    build = torch.__version__
    why = (f"torch {build} is a CPU-only build" if torch.version.cuda is None
           else "no CUDA GPU is visible (torch.cuda.is_available() is False)")
    # A Mac has no CUDA build of torch to install; its GPU (MPS) is not one k6serve runs on.
    where = ("a Linux host with a CUDA GPU (k6serve does not run on Apple's GPUs, MPS)" if sys.platform == "darwin"
             else "a CUDA GPU (install a CUDA build of torch)")
    raise ValueError(
        f"{what} is a full-size model, about {size_bytes / 2**30:.0f} GiB of weights in float32 on the CPU, and "
        f"{why}: on the CPU it would fill the host's memory for minutes and take hours a step. Run it on {where}, "
        "try the built-in demo (--model-path demo, or demo-sr for super-resolution), or pass --device cpu to run "
        "it on the CPU all the same.")


def _weights_before_loading(config: EngineConfig) -> tuple[float, str] | None:
    """(float32 bytes of the model's weights, its name) where they can be told without a download: a local
    folder's safetensors files (bf16 on disk, so twice as much in float32), or the released model's parameters for
    --load-format dummy and a released hub id; None when it cannot be told."""
    from k6serve.models.checkpoint_files import CheckpointError, variant_before_loading
    from k6serve.models.variants import GENERATION, RELEASED_NUM_PARAMETERS, TEXT_ENCODERS_NUM_PARAMETERS

    model = config.model
    try:
        variant, folder = variant_before_loading(model.model_path, model.model_id, model.load_format)
    except (CheckpointError, OSError, ValueError):
        return None  # the load reports it, in its words
    name = repr(str(model.model_path))
    if folder is not None:
        # The components' weights, where the loaders read (checkpoint_files.check_checkpoint_files: not the tree).
        on_disk = sum(path.stat().st_size for path in Path(folder).glob("*/*.safetensors") if path.is_file())
        return on_disk * 2, name  # released weights are bf16 on disk
    if variant is None or variant.is_demo or variant.size not in RELEASED_NUM_PARAMETERS:
        return None
    parameters = RELEASED_NUM_PARAMETERS[variant.size]
    if variant.family == GENERATION:
        parameters += TEXT_ENCODERS_NUM_PARAMETERS
    return parameters * 4, f"{name} ({variant.name})"
