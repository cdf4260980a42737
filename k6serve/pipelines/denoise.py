"""Stage: the denoising loop (k6-generation.md §3.6), with CFG, TI2AV tail re-pinning and step callbacks.

The DiT's own text towers depend on the timestep, so they run inside every forward (as in the reference);
the Qwen/CLIP features are computed once per request and branch. `on_step(i, n)` runs after every step: the
engine uses it for progress and raises from it to cancel at a step boundary.

CFG-parallel: when the DiT carries a cfg group (`k6serve.parallel.cfg.attach_cfg_group`), each of its two ranks
runs one guidance branch and both outputs are gathered before the same `cfg_combine`, so the result is
bit-identical to the serial loop.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from k6serve.parallel.cfg import cfg_group_of, gather_cfg_branches, select_cfg_branch
from k6serve.pipelines.guidance import cfg_combine
from k6serve.pipelines.state import Conditioning, Latents, TextEmbeddings
from k6serve.request import ProgressCallback


def model_input(latents: Latents, visual_cond: bool) -> torch.Tensor:
    """[noisy latent | zero conditioning latent | mask] along channels; the mask is 1 on the TI2AV tail only."""
    video = latents.video_BTHWC
    if latents.tail_BHWC is not None:
        video[:, -1] = latents.tail_BHWC  # re-pin the clean reference frame every step
    if not visual_cond:
        return video
    mask = torch.zeros((*video.shape[:-1], 1), dtype=video.dtype, device=video.device)
    if latents.tail_BHWC is not None:
        mask[:, -1] = 1
    return torch.cat([video, torch.zeros_like(video), mask], dim=-1)


def predict(transformer, hidden: torch.Tensor, latents: Latents, text: TextEmbeddings, timestep: torch.Tensor):
    return transformer(
        hidden_states=hidden,
        audio_hidden_states=latents.audio_BLC,
        encoder_hidden_states=text.tokens_BLD,
        pooled_projections=text.pooled_BD,
        timestep=timestep,
        visual_rope_pos=latents.rope_positions,
        encoder_attention_mask=text.mask_BL,
        visual_token_type_ids=latents.token_type_ids_BT,
    )


def guided_prediction(transformer, hidden: torch.Tensor, latents: Latents, conditioning: Conditioning,
                      timestep: torch.Tensor, *, guidance_scale: float, predict_fn: Callable = predict):
    """(video, audio) velocity of one step: the positive branch, or both branches combined by CFG."""
    if conditioning.negative is None:
        return predict_fn(transformer, hidden, latents, conditioning.positive, timestep)
    cfg_group = cfg_group_of(transformer)
    if cfg_group is None:
        video_v, audio_v = predict_fn(transformer, hidden, latents, conditioning.positive, timestep)
        video_u, audio_u = predict_fn(transformer, hidden, latents, conditioning.negative, timestep)
    else:
        branch = select_cfg_branch((conditioning.positive, conditioning.negative), cfg_group)
        video_local, audio_local = predict_fn(transformer, hidden, latents, branch, timestep)
        video_v, video_u = gather_cfg_branches(video_local, cfg_group)
        audio_v, audio_u = gather_cfg_branches(audio_local, cfg_group)
    video_v = cfg_combine(video_v, video_u, guidance_scale)
    audio_v = cfg_combine(audio_v, audio_u, guidance_scale) if audio_v is not None else None
    return video_v, audio_v


@torch.inference_mode()
def denoise(
    transformer,
    latents: Latents,
    conditioning: Conditioning,
    *,
    scheduler,
    audio_scheduler,
    timesteps: torch.Tensor,
    guidance_scale: float,
    visual_cond: bool,
    on_step: ProgressCallback | None = None,
    predict_fn: Callable = predict,
    step_seconds: list[float] | None = None,
    step_cache=None,
) -> Latents:
    """Run the denoising loop in place on `latents`.

    With `step_seconds`, the duration of every step is appended to it, measured with CUDA events on a GPU so the
    loop gains no host synchronisation (the events are read once, after the last step). With `step_cache` (a
    `k6serve.caching.block_cache.BlockCacheSession` installed on the DiT), the loop tells it the step and the
    CFG branch of every DiT call.
    """
    num_steps = len(timesteps)
    clock = _StepClock(latents.video_BTHWC.device) if step_seconds is not None else None
    if step_cache is not None:
        predict_fn = step_cache.branch_aware(predict_fn, conditioning)
    for index, t in enumerate(timesteps):
        if step_cache is not None:
            step_cache.begin_step(index)
        timestep = t.expand(latents.video_BTHWC.shape[0])
        hidden = model_input(latents, visual_cond)
        video_v, audio_v = guided_prediction(transformer, hidden, latents, conditioning, timestep,
                                             guidance_scale=guidance_scale, predict_fn=predict_fn)
        latents.video_BTHWC = scheduler.step(video_v, t, latents.video_BTHWC, return_dict=False)[0]
        if latents.audio_BLC is not None:
            latents.audio_BLC = audio_scheduler.step(audio_v, t, latents.audio_BLC, return_dict=False)[0]
        if clock is not None:
            clock.mark()
        if on_step is not None:
            on_step(index + 1, num_steps)
    if clock is not None and step_seconds is not None:  # the clock runs for step_seconds
        step_seconds.extend(clock.durations())
    if latents.tail_BHWC is not None:
        latents.video_BTHWC = latents.video_BTHWC[:, :-1]  # the reference frame is not decoded
    return latents


class _StepClock:
    """Step boundaries as CUDA events (no host sync until `durations`) or, on the CPU, wall-clock stamps."""

    def __init__(self, device: torch.device) -> None:
        self.on_cuda = device.type == "cuda"
        self.marks: list = []
        self.mark()

    def mark(self) -> None:
        if self.on_cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks.append(event)
        else:
            self.marks.append(time.perf_counter())

    def durations(self) -> list[float]:
        if self.on_cuda:
            self.marks[-1].synchronize()
            return [start.elapsed_time(end) / 1e3 for start, end in zip(self.marks, self.marks[1:])]
        return [end - start for start, end in zip(self.marks, self.marks[1:])]
