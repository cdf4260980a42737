"""Random LoRA adapter files for tests, in the diffusers/PEFT layout users download
(`transformer.<module>.lora_A.weight` / `.lora_B.weight`, optionally `<module>.alpha`), saved with safetensors."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import cast

import torch
from safetensors.torch import save_file


def module_shapes(model: torch.nn.Module, paths: Iterable[str]) -> dict[str, tuple[int, int]]:
    """(out, in) of the Linear weight at each of `paths` in `model`: what `write_lora_adapter` takes."""
    # a Linear's weight is 2-D
    return {path: cast(tuple[int, int], tuple(cast(torch.nn.Linear, model.get_submodule(path)).weight.shape))
            for path in paths}


def write_lora_adapter(file: Path, shapes: Mapping[str, tuple[int, int]], *, rank: int = 2, seed: int = 0,
                       amplitude: float = 0.3, prefix: str = "transformer.",
                       alphas: Mapping[str, float] | None = None) -> Path:
    """A rank-`rank` adapter on the modules of `shapes` (path -> (out, in)) with N(0, amplitude²) factors, written to
    `file` (its folder is created). A large `amplitude` (1e10) makes an update that overflows the latents, while the
    file's values stay finite."""
    alphas = alphas or {}
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for path, (out_features, in_features) in shapes.items():
        tensors[f"{prefix}{path}.lora_A.weight"] = amplitude * torch.randn(rank, in_features, generator=generator)
        tensors[f"{prefix}{path}.lora_B.weight"] = amplitude * torch.randn(out_features, rank, generator=generator)
        if path in alphas:
            tensors[f"{prefix}{path}.alpha"] = torch.tensor(alphas[path])
    file.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(file))
    return file
