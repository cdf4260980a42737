"""The latent-upscaler bank of Kandinsky 6 SR: diffusers' `Kandinsky6SRLatentUpscalerBank` behind a typed call.

The released config enables no attention in the bank (`temporal_mix false`; the x2/x4 forwards are convolutions,
modulated RMSNorms and nearest upsampling only), so there is nothing for natten or SDPA to run. `SRUpscalerConfig`
rejects `temporal_mix true`. See README.md.

Shape legend: B batch (tiles), C latent channels, T latent frames, h/w latent tile size.
"""

from __future__ import annotations

import torch
# From its defining module: mypy types the top-level name as diffusers' torch-less placeholder (dummy_pt_objects).
from diffusers.models.latent_upscaler.latent_upscaler_kandinsky6_sr import Kandinsky6SRLatentUpscalerBank
from torch import Tensor

from k6serve.models.kandinsky6_sr.config import SRUpscalerConfig


def build_upscaler(config: SRUpscalerConfig) -> Kandinsky6SRLatentUpscalerBank:
    """Construct the diffusers bank (x2 entry first: weights `_models.0.` = x2, `_models.1.` = x4)."""
    return Kandinsky6SRLatentUpscalerBank(**config.to_diffusers_kwargs())


class SRLatentUpscaler:
    """Upscales scaled K-VAE latent tiles by 2 or 4 in space."""

    def __init__(self, bank: Kandinsky6SRLatentUpscalerBank) -> None:
        self.bank = bank
        self.scales = tuple(int(scale) for scale in bank.config["scales"])

    def model(self, scale: int) -> torch.nn.Module:
        """The bank's upscaler for x`scale`."""
        if scale not in self.scales:
            raise ValueError(
                f"no latent upscaler for x{scale}; this checkpoint has {list(self.scales)} (scale 2.25 uses x2)."
            )
        return self.bank._models[self.scales.index(scale)]

    @torch.no_grad()
    def upscale(self, latent_BCThw: Tensor, scale: int) -> Tensor:
        """(B, C, T, h, w) latent x scaling_factor -> (B, C, T, h*scale, w*scale) in fp32.

        zq (the modulation input) is the same tensor; the bank runs in its parameter dtype, the result returns in
        fp32 as in R.
        """
        model = self.model(scale)
        dtype = next(model.parameters()).dtype
        return model(latent_BCThw.to(dtype)).float()
