"""Load a Kandinsky 6 SR checkpoint (Diffusers layout, vendor configs) into k6serve's components.

Order matters: configs are read and the head/scheduler pairing is checked from safetensors headers (checks.py)
before any weight is read, so the known-bad non-distilled checkpoint fails at load time, before any encode. Our SR
DiT takes the diffusers state-dict keys unchanged; the K-VAE and the latent-upscaler bank are diffusers' modules
(vae.py, upscaler.py). `load_format="dummy"` builds the released sizes (DiT 1.414 B, K-VAE 1.739 B, bank 3.654 B
parameters) on the meta device and materialises them directly on the target device in the target dtype, so no fp32
host copy of 6.8 B parameters is ever made. `weights_device` (default: `device`) is where the weights are placed: the
host when the engine offloads them (`--performance-mode balanced / memory`).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import torch
from torch import nn

from k6serve.models.checkpoint_files import (
    check_block_counts,
    check_state_dict,
    header_state_dict,
    load_state_dict,
)
from k6serve.models.kandinsky6_sr import released_configs as released
from k6serve.models.kandinsky6_sr.checks import check_head_fits_scheduler
from k6serve.models.kandinsky6_sr.config import SRSchedulerConfig
from k6serve.models.kandinsky6_sr.config_before_loading import (  # read before any weight; tests import them here too
    SRConfigs,
    read_sr_configs,
    released_sr_configs,
)
from k6serve.models.kandinsky6_sr.piflow import SRPiflowSampler
from k6serve.models.kandinsky6_sr.plan import KEEP_FP32_MODULES
from k6serve.models.kandinsky6_sr.transformer import SRTransformer
from k6serve.models.kandinsky6_sr.upscaler import Kandinsky6SRLatentUpscalerBank, SRLatentUpscaler, build_upscaler
from k6serve.models.kandinsky6_sr.vae import SRVAE, Kandinsky6SRVAE, build_vae
from k6serve.models.plan import keeps_fp32
from k6serve.models.variants import Variant

logger = logging.getLogger(__name__)

_Module = TypeVar("_Module", bound=nn.Module)

META = torch.device("meta")


@dataclass(kw_only=True)
class SRModels:
    """Everything an upscale request needs, placed on one device."""

    transformer: SRTransformer
    vae: SRVAE
    upscaler: SRLatentUpscaler
    scheduler: SRSchedulerConfig
    device: torch.device
    # The DiT's linear dtype (the noise is drawn in it); the K-VAE and the bank run in it too.
    dtype: torch.dtype
    variant: Variant
    source: str  # folder path or "dummy"

    def sampler(self) -> SRPiflowSampler:
        """A fresh π-Flow sampler (it keeps a step index, so one per request)."""
        return SRPiflowSampler(self.scheduler)


def load_sr_models(
    folder: Path | None,
    variant: Variant,
    *,
    device: torch.device,
    dtype: torch.dtype,
    load_format: str,
    weights_device: torch.device | None = None,
) -> SRModels:
    """Load (or, with load_format "dummy", build with random weights) the SR components for `device`, their weights
    on `weights_device` (default: `device`)."""
    if load_format == "dummy":
        return build_dummy_sr_models(
            released_sr_configs(variant), variant, device=device, dtype=dtype, weights_device=weights_device
        )
    assert folder is not None
    configs = read_sr_configs(folder)
    _require_piflow(configs.scheduler)
    check_block_counts(folder / "transformer", {
        "visual_transformer_blocks": ("num_visual_blocks", configs.transformer.num_visual_blocks)})
    transformer, vae, bank = build_empty_modules(configs, dtype=dtype)
    weights_device = device if weights_device is None else weights_device
    _load_weights(transformer, folder / "transformer", weights_device)
    _load_weights(vae, folder / "vae", weights_device)
    _load_weights(bank, folder / "latent_upscaler", weights_device)
    return _assemble(configs, transformer, vae, bank, variant, device, dtype, source=str(folder),
                     weights_device=weights_device)


def build_dummy_sr_models(
    configs: SRConfigs, variant: Variant, *, device: torch.device, dtype: torch.dtype, seed: int = 0,
    weights_device: torch.device | None = None,
) -> SRModels:
    """Random weights at the sizes of `configs`, allocated on `weights_device` (default: `device`) in `dtype`
    (outputs are noise).

    On the meta device nothing is allocated or initialised, which is how the full-size build is tested on CPU.
    """
    _require_piflow(configs.scheduler)
    transformer, vae, bank = build_empty_modules(configs, dtype=dtype)
    shapes = {name: tuple(parameter.shape) for name, parameter in transformer.named_parameters()}
    check_head_fits_scheduler(configs.transformer, configs.scheduler, shapes)
    weights_device = device if weights_device is None else weights_device
    # On the host beside a GPU (offloading) the numbers are still drawn on the GPU, parameter by parameter: one CPU
    # generator takes minutes for the released sizes, and the weights then equal a GPU build's.
    random_device = device if device.type == "cuda" and weights_device.type == "cpu" else weights_device
    if weights_device.type != "meta":
        for offset, module in enumerate((transformer, vae, bank)):
            module.to_empty(device=weights_device)
            init_dummy_weights_(module, seed=seed + offset, random_device=random_device)
    return _assemble(configs, transformer, vae, bank, variant, device, dtype, source="dummy",
                     weights_device=weights_device)


def build_empty_modules(
    configs: SRConfigs, *, dtype: torch.dtype
) -> tuple[SRTransformer, Kandinsky6SRVAE, Kandinsky6SRLatentUpscalerBank]:
    """The three modules on the meta device (no storage), with the dtypes they run in.

    DiT: `dtype` except the fp32 modules of the plan (time embeddings, pooled bias, every modulation). K-VAE and
    latent-upscaler bank: `dtype` throughout (R casts both to bf16).
    """
    with torch.device(META):
        transformer = SRTransformer(configs.transformer)
        vae = build_vae(configs.vae)
        bank = build_upscaler(configs.upscaler)
    _cast(transformer, dtype, KEEP_FP32_MODULES)
    _cast(vae, dtype)
    _cast(bank, dtype)
    return transformer, vae, bank


@torch.no_grad()
def init_dummy_weights_(module: nn.Module, seed: int, random_device: torch.device | None = None) -> None:
    """N(0, 1/fan_in) matrices and kernels, unit norm gains, zero biases: O(1) activations in bf16. The normal
    draws come from a generator on `random_device` (default: the module's device): the same values for any
    module device."""
    parameters = list(module.named_parameters())
    device = parameters[0][1].device
    random_device = torch.device(device if random_device is None else random_device)
    generator = torch.Generator(device=random_device).manual_seed(seed)
    for name, parameter in parameters:
        if parameter.ndim >= 2:
            std = 1.0 / math.sqrt(parameter[0].numel())
            if parameter.device == random_device:
                parameter.normal_(0.0, std, generator=generator)
            else:
                parameter.copy_(torch.empty(parameter.shape, dtype=parameter.dtype, device=random_device).normal_(
                    0.0, std, generator=generator))
        elif name.endswith(("gamma", "norm.weight")):
            parameter.fill_(1.0)
        else:
            parameter.zero_()
    module.eval().requires_grad_(False)


def _cast(module: nn.Module, dtype: torch.dtype, keep_fp32: tuple[str, ...] = ()) -> None:
    for name, parameter in module.named_parameters():
        if parameter.is_floating_point():
            target = torch.float32 if keeps_fp32(name, keep_fp32) else dtype
            parameter.data = parameter.data.to(target)


def _load_weights(module: nn.Module, component_dir: Path, device: torch.device) -> None:
    """`module`'s weights (on the meta device, its parameters in the dtypes they run in: `build_empty_modules`) read
    from `component_dir` straight onto `device` in those dtypes, as the generation loader reads its DiT."""
    expected = {name: tensor.shape for name, tensor in module.state_dict().items()}
    floating = [name for name, tensor in module.state_dict().items() if tensor.is_floating_point()]
    # From the headers first, as the generation loader: a mismatch is found before the weights are read.
    check_state_dict(expected, header_state_dict(component_dir), f"{component_dir.name} ({component_dir})", floating)
    state = load_state_dict(component_dir, device, dtypes={name: p.dtype for name, p in module.named_parameters()})
    check_state_dict(expected, state, f"{component_dir.name} ({component_dir})", floating)
    module.load_state_dict(state, strict=True, assign=True)


def _require_piflow(scheduler: SRSchedulerConfig) -> None:
    if not scheduler.is_piflow:
        raise ValueError(
            f"this SR checkpoint uses {scheduler.class_name}; k6serve serves the distilled two-step PiFlow model "
            f"only. Use {released.DISTILLED_REPO}."
        )


def _moved(module: _Module, device: torch.device) -> _Module:
    # `module.to(device)`, read through nn.Module's signature: diffusers' `ModelMixin.to` is typed by
    # functools.wraps(nn.Module.to), which mypy takes for the unbound function (the device passed as `self`).
    return module.to(device)


def _assemble(
    configs: SRConfigs,
    transformer: SRTransformer,
    vae: Kandinsky6SRVAE,
    bank: Kandinsky6SRLatentUpscalerBank,
    variant: Variant,
    device: torch.device,
    dtype: torch.dtype,
    *,
    source: str,
    weights_device: torch.device | None = None,
) -> SRModels:
    weights_device = device if weights_device is None else weights_device
    if weights_device.type != "meta":
        transformer = transformer.to(weights_device)
        vae, bank = _moved(vae, weights_device), _moved(bank, weights_device)
    for module in (transformer, vae, bank):
        module.eval().requires_grad_(False)
    return SRModels(
        transformer=transformer,
        vae=SRVAE(vae),
        upscaler=SRLatentUpscaler(bank),
        scheduler=configs.scheduler,
        device=device,
        dtype=dtype,
        variant=variant,
        source=source,
    )
