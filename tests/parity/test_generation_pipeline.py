"""The whole T2AV / TI2AV pipeline against diffusers' Kandinsky6TI2VAPipeline on the same tiny checkpoint.

Same seed on CPU: decoded frames (floats in [0, 1], before quantisation) and the waveform are bitwise equal, in
fp32 and in the default bf16 load (keep-fp32 rule on both sides); the same math op for op, so nothing looser is
needed. Covers Pro with CFG (FlowMatch Euler), the distilled model with PiFlow, and TI2AV with a reference image;
in bf16 also the worker's uint8 path (`keep_float_frames=False`) against diffusers' PIL frames, and a clip long
enough for the VAE's temporally tiled decode.
"""

from pathlib import Path

import numpy as np
import torch
from PIL import Image

from k6serve.models.kandinsky6.checkpoint import load_generation_models
from k6serve.models.variants import recognise
from k6serve.pipelines.text_to_video import TextToVideoPipeline
from k6serve.request import SamplingParams
from k6serve.request_resolution import resolve_generate
from k6serve.testing.tiny_checkpoints import load_reference_pipeline

HEIGHT, WIDTH, FRAMES = 64, 96, 9


def _ours(folder: Path, params: SamplingParams, dtype=torch.float32, keep_float_frames=True):
    variant = recognise(str(folder), None, folder)
    models = load_generation_models(folder, variant, device=torch.device("cpu"), dtype=dtype,
                                    load_format="auto")
    request, _ = resolve_generate(params, variant)
    return TextToVideoPipeline(models, keep_float_frames=keep_float_frames)(request), request


def _reference(folder: Path, request, image=None, dtype=torch.float32, output_type="np", num_frames=FRAMES):
    pipe = load_reference_pipeline(folder, dtype)
    output = pipe(
        prompt=request.prompt,
        negative_prompt=request.negative_prompt,
        image=image,
        height=HEIGHT,
        width=WIDTH,
        num_frames=num_frames,
        num_inference_steps=request.num_inference_steps,
        guidance_scale=request.guidance_scale,
        generator=torch.Generator("cpu").manual_seed(request.seed),
        output_type=output_type,
    )
    if output_type == "pil":
        return np.stack([np.asarray(frame) for frame in output.frames[0]]), np.asarray(output.audio[0])
    return np.asarray(output.frames[0]), np.asarray(output.audio[0])


def _assert_close(ours, reference_frames, reference_audio, num_frames=FRAMES):
    """Bitwise (which is within the 1e-5 relative rule); the numbers are printed for the record."""
    frames = ours.video.frames_float_THWC.numpy()
    assert frames.shape == reference_frames.shape == (num_frames, HEIGHT, WIDTH, 3)
    assert ours.audio.waveform.shape == reference_audio.shape
    print(f"frames max|diff| {np.abs(frames - reference_frames).max():.3g}, "
          f"audio max|diff| {np.abs(ours.audio.waveform - reference_audio).max():.3g}")
    assert np.array_equal(frames, reference_frames)
    assert np.array_equal(ours.audio.waveform, reference_audio)


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


def test_temporally_tiled_decode_matches_diffusers(tiny_distill_dir, monkeypatch):
    """25 frames are 7 latent frames: more than the 4 that diffusers' HunyuanVideo VAE decodes at once, so it
    decodes overlapping temporal tiles (the last one short) and blends them; the worker's uint8 path mirrors that in
    its own chunked decode (pipelines/decode_stream.py), which the 9-frame cases above never leave one tile of.
    fp32 (bf16 triples the test's time on the CPU; the rounding is the 9-frame bf16 cases'), the worker's frames
    against diffusers' PIL frames: bitwise."""
    from diffusers import AutoencoderKLHunyuanVideo

    tiled_calls = []
    original = AutoencoderKLHunyuanVideo._temporal_tiled_decode

    def counted(self, *args, **kwargs):
        tiled_calls.append(args[0].shape[2])
        return original(self, *args, **kwargs)

    monkeypatch.setattr(AutoencoderKLHunyuanVideo, "_temporal_tiled_decode", counted)
    params = SamplingParams(prompt="waves on a beach", seed=9, height=HEIGHT, width=WIDTH, num_frames=25,
                            num_inference_steps=2)
    ours, request = _ours(tiny_distill_dir, params, keep_float_frames=False)
    assert request.num_frames == 25 and not tiled_calls  # ours decodes the tiles itself
    frames, audio = _reference(tiny_distill_dir, request, output_type="pil", num_frames=25)
    assert tiled_calls == [7], tiled_calls  # the reference did take the temporally tiled path
    assert ours.video.frames_THWC.shape == frames.shape == (25, HEIGHT, WIDTH, 3)
    assert np.array_equal(ours.video.frames_THWC, frames)
    assert np.array_equal(ours.audio.waveform, audio)


def test_ti2av_matches_diffusers(tiny_pro_dir, tmp_path):
    rng = np.random.default_rng(0)
    image = Image.fromarray(rng.integers(0, 255, (80, 120, 3), dtype=np.uint8))
    path = tmp_path / "ref.png"
    image.save(path)
    params = SamplingParams(prompt="a dog", image_path=str(path), seed=11, height=HEIGHT, width=WIDTH,
                            num_frames=FRAMES, num_inference_steps=2, guidance_scale=3.0)
    ours, request = _ours(tiny_pro_dir, params)
    _assert_close(ours, *_reference(tiny_pro_dir, request, image=Image.open(path)))


def test_bf16_pro_with_cfg_worker_frames_equal_diffusers_pil(tiny_pro_dir):
    """The default load (bf16, keep-fp32 modules on both sides) and the worker's uint8 path: the decoder output is
    denormalised in bf16 before round(x * 255), as diffusers' postprocess does, so the frames are diffusers' PIL
    frames bit for bit (they once differed by one level where fp32 denormalisation rounded the other way)."""
    params = SamplingParams(prompt="a red fox runs", seed=7, height=HEIGHT, width=WIDTH, num_frames=FRAMES,
                            num_inference_steps=3, guidance_scale=5.0)
    ours, request = _ours(tiny_pro_dir, params, dtype=torch.bfloat16, keep_float_frames=False)
    frames, audio = _reference(tiny_pro_dir, request, dtype=torch.bfloat16, output_type="pil")
    assert ours.video.frames_THWC.dtype == frames.dtype == np.uint8
    assert ours.video.frames_THWC.shape == frames.shape == (FRAMES, HEIGHT, WIDTH, 3)
    assert np.array_equal(ours.video.frames_THWC, frames)
    assert np.array_equal(ours.audio.waveform, audio)


def test_bf16_distill_ti2av_matches_diffusers(tiny_distill_dir, tmp_path):
    """The distilled model (PiFlow, 10x heads) with a reference image in the default bf16 load: bitwise."""
    rng = np.random.default_rng(1)
    path = tmp_path / "ref.png"
    Image.fromarray(rng.integers(0, 255, (80, 120, 3), dtype=np.uint8)).save(path)
    params = SamplingParams(prompt="waves on a beach", image_path=str(path), seed=5, height=HEIGHT, width=WIDTH,
                            num_frames=FRAMES, num_inference_steps=3)
    ours, request = _ours(tiny_distill_dir, params, dtype=torch.bfloat16)
    _assert_close(ours, *_reference(tiny_distill_dir, request, image=Image.open(path), dtype=torch.bfloat16))


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
