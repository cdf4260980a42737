"""The whole T2AV / TI2AV pipeline against diffusers' Kandinsky6TI2VAPipeline on the same tiny checkpoint.

Same seed, fp32 on CPU: decoded frames (floats in [0, 1], before quantisation) and the waveform agree within
1e-4. Covers Pro with CFG (FlowMatch Euler), the distilled model with PiFlow, and TI2AV with a reference image.
"""

from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from k6serve.models.kandinsky6.checkpoint import load_generation_models
from k6serve.models.variants import recognise, resolve_generate
from k6serve.pipelines.text_to_video import TextToVideoPipeline
from k6serve.request import SamplingParams
from k6serve.testing.tiny_checkpoints import load_reference_pipeline

HEIGHT, WIDTH, FRAMES = 64, 96, 9


def _ours(folder: Path, params: SamplingParams):
    variant = recognise(str(folder), None, folder)
    models = load_generation_models(folder, variant, device=torch.device("cpu"), dtype=torch.float32,
                                    load_format="auto")
    request, _ = resolve_generate(params, variant)
    return TextToVideoPipeline(models)(request), request


def _reference(folder: Path, request, image=None):
    pipe = load_reference_pipeline(folder)
    output = pipe(
        prompt=request.prompt,
        negative_prompt=request.negative_prompt,
        image=image,
        height=HEIGHT,
        width=WIDTH,
        num_frames=FRAMES,
        num_inference_steps=request.num_inference_steps,
        guidance_scale=request.guidance_scale,
        generator=torch.Generator("cpu").manual_seed(request.seed),
        output_type="np",
    )
    return np.asarray(output.frames[0]), np.asarray(output.audio[0])


def _assert_close(ours, reference_frames, reference_audio):
    frames = ours.video.frames_float_THWC.numpy()
    assert frames.shape == reference_frames.shape == (FRAMES, HEIGHT, WIDTH, 3)
    assert np.abs(frames - reference_frames).max() <= 1e-4
    assert ours.audio.waveform.shape == reference_audio.shape
    scale = max(1.0, float(np.abs(reference_audio).max()))
    assert np.abs(ours.audio.waveform - reference_audio).max() <= 1e-4 * scale


def test_pro_with_cfg_matches_diffusers(tiny_pro_dir):
    params = SamplingParams(prompt="a red fox runs", seed=7, height=HEIGHT, width=WIDTH, num_frames=FRAMES,
                            num_inference_steps=3, guidance_scale=5.0)
    ours, request = _ours(tiny_pro_dir, params)
    _assert_close(ours, *_reference(tiny_pro_dir, request))
    # the waveform is exactly L_a * 1024 samples, as the reference
    assert ours.audio.waveform.shape[0] % 1024 == 0


def test_distill_with_piflow_matches_diffusers(tiny_distill_dir):
    params = SamplingParams(prompt="waves on a beach", seed=3, height=HEIGHT, width=WIDTH, num_frames=FRAMES,
                            num_inference_steps=4)
    ours, request = _ours(tiny_distill_dir, params)
    assert request.guidance_scale == 1.0 and request.negative_prompt is None
    _assert_close(ours, *_reference(tiny_distill_dir, request))


def test_ti2av_matches_diffusers(tiny_pro_dir, tmp_path):
    rng = np.random.default_rng(0)
    image = Image.fromarray(rng.integers(0, 255, (80, 120, 3), dtype=np.uint8))
    path = tmp_path / "ref.png"
    image.save(path)
    params = SamplingParams(prompt="a dog", image_path=str(path), seed=11, height=HEIGHT, width=WIDTH,
                            num_frames=FRAMES, num_inference_steps=2, guidance_scale=3.0)
    ours, request = _ours(tiny_pro_dir, params)
    _assert_close(ours, *_reference(tiny_pro_dir, request, image=Image.open(path)))


def test_trimmed_text_padding_matches_full_padding(tiny_pro_dir):
    """Speed mode cuts the common trailing padding: the same video and audio up to kernel rounding."""
    variant = recognise(str(tiny_pro_dir), None, tiny_pro_dir)
    models = load_generation_models(tiny_pro_dir, variant, device=torch.device("cpu"), dtype=torch.float32,
                                    load_format="auto")
    request, _ = resolve_generate(SamplingParams(prompt="a red fox runs", seed=7, height=HEIGHT, width=WIDTH,
                                                 num_frames=FRAMES, num_inference_steps=3), variant)
    full = TextToVideoPipeline(models)
    trimmed = TextToVideoPipeline(models, trim_text_padding=True)
    cond_full, cond_trimmed = full.encode(request), trimmed.encode(request)
    assert cond_full.positive.tokens_BLD.shape[1] == 1024
    assert cond_trimmed.positive.tokens_BLD.shape[1] < 1024 and cond_trimmed.negative.tokens_BLD.shape[1] < 1024
    a, b = full(request), trimmed(request)
    assert np.abs(a.video.frames_float_THWC.numpy() - b.video.frames_float_THWC.numpy()).max() <= 1e-5
    assert np.abs(a.audio.waveform - b.audio.waveform).max() <= 1e-5 * max(1.0, float(np.abs(a.audio.waveform).max()))
