"""Schedulers: the diffusers classes, reused as they are (tiny CPU maths with exactness traps, §3.5).

The audio stream steps a deep copy of the video scheduler (same sigmas, its own step index), as the reference.
"""

from __future__ import annotations

import copy

import torch

from k6serve.models.kandinsky6.config import SCHEDULER_CLASSES


def build_scheduler(class_name: str, config: dict):
    import diffusers

    if class_name not in SCHEDULER_CLASSES:
        raise ValueError(f"Unsupported scheduler {class_name!r}; Kandinsky 6 uses one of {SCHEDULER_CLASSES}.")
    cls = getattr(diffusers, class_name)
    known = {k: v for k, v in config.items() if not k.startswith("_")}
    return cls.from_config(known)


def make_schedulers(class_name: str, config: dict, num_steps: int, device: torch.device, with_audio: bool):
    """(video scheduler, audio scheduler or None, timesteps) with timesteps set for `num_steps`."""
    scheduler = build_scheduler(class_name, config)
    scheduler.set_timesteps(num_steps, device=device)
    audio = copy.deepcopy(scheduler) if with_audio else None
    return scheduler, audio, scheduler.timesteps
