"""diffusers as the reference, imported lazily: the GPU machine may not have it installed.

`diffusers_transformer_like(ours)` builds diffusers' `Kandinsky6Transformer3DModel` whose parameters *are*
our model's tensors (`load_state_dict(assign=True)` into a model whose parameters were created on the meta
device), so both models exist with one copy of the weights. Buffers (diffusers' RoPE tables) are built
normally, on the CPU, and then moved.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from k6serve.models.kandinsky6.transformer import Kandinsky6Transformer

MISSING_DIFFUSERS = (
    "diffusers is not installed: this stage compares with diffusers 0.42.1 and builds its VAE/audio "
    "components from it; install the carried diffusers wheel (pip install diffusers-0.42.1-*.whl)"
)


class ReferenceUnavailable(RuntimeError):
    """A benchmark stage needs a package that is not installed."""


def import_diffusers():
    try:
        import diffusers
    except ImportError as error:
        raise ReferenceUnavailable(MISSING_DIFFUSERS) from error
    return diffusers


@contextlib.contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Create parameters on the meta device while buffers stay real (accelerate's `init_empty_weights`)."""
    register_parameter = nn.Module.register_parameter

    def register_on_meta(self: nn.Module, name: str, param: nn.Parameter | None) -> None:
        register_parameter(self, name, param)
        if param is not None:
            self._parameters[name] = nn.Parameter(param.to("meta"), requires_grad=False)

    # patched on the class for the block, as accelerate does; mypy refuses any assignment to a method
    nn.Module.register_parameter = register_on_meta  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = register_parameter  # type: ignore[method-assign]


def diffusers_transformer_like(ours: Kandinsky6Transformer, device: torch.device) -> nn.Module:
    """diffusers' `Kandinsky6Transformer3DModel` sharing `ours`' parameter tensors (same config).

    `ours` must not be fused yet: the state-dict keys are diffusers' names only before fusion.
    """
    diffusers = import_diffusers()
    config = {field: getattr(ours.config, field) for field in ours.config.__dataclass_fields__}
    with parameters_on_meta():
        reference = diffusers.Kandinsky6Transformer3DModel(**config)
    reference.load_state_dict(ours.state_dict(), strict=True, assign=True)
    return reference.to(device).eval().requires_grad_(False)
