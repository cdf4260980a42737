"""π-Flow sampling for SR tiles: diffusers' `PiflowScheduler`, driven with fp32 state and the checkpoint's nfe.

diffusers' scheduler ignores the config's `nfe` and casts its result back to the sample dtype (S:353-354). k6serve
always runs `nfe` DiT calls per tile whatever the request says (seeds: "changing num_inference_steps does not
increase quality or the number of evaluations") and passes fp32 samples, so that cast is a no-op and the state
stays fp32 between the two calls as in R and SG (§2.8). The last segment ends at eps (1e-6), as in D and SG.
"""

from __future__ import annotations

import torch
# From its defining module: mypy types the top-level name as diffusers' torch-less placeholder (dummy_pt_objects).
from diffusers.schedulers.scheduling_piflow import PiflowScheduler
from torch import Tensor

from k6serve.models.kandinsky6_sr.config import SRSchedulerConfig


class SRPiflowSampler:
    """One π-Flow schedule per tile: `timesteps()` resets it, then `step()` once per DiT call."""

    def __init__(self, config: SRSchedulerConfig) -> None:
        if not config.is_piflow:
            raise ValueError(
                f"the SR sampler needs a PiflowScheduler checkpoint, got {config.class_name}; use "
                "kandinskylab/Kandinsky-6.0-VSR-distilled2steps-5s-Diffusers."
            )
        if config.nfe is None:
            raise ValueError("a PiflowScheduler config needs nfe (scheduler/scheduler_config.json)")
        self.num_steps = int(config.nfe)
        self.scheduler = PiflowScheduler(**config.to_diffusers_kwargs())

    def timesteps(self, device: torch.device | str = "cpu") -> Tensor:
        """Fresh schedule: fp32 DiT timesteps 1000 * sigma, e.g. [1000, 636.36...] for nfe 2 and shift 3.5."""
        self.scheduler.set_timesteps(self.num_steps, device=device)
        return self.scheduler.timesteps

    def step(self, model_output: Tensor, timestep: Tensor, sample_fp32: Tensor) -> Tensor:
        """Integrate the DX policy from this timestep to the next grid point; the state stays fp32."""
        if sample_fp32.dtype != torch.float32:
            raise ValueError(
                f"the π-Flow state must be fp32, got {sample_fp32.dtype}; pass sample.float()"
            )
        return self.scheduler.step(model_output, timestep, sample_fp32, return_dict=False)[0]
