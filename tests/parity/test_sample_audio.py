"""sample_audio=False (a silent video, the DiT on the video tokens alone) against diffusers' own
`sample_audio=False` on the same tiny checkpoint: frames bitwise, no waveform, and what the surfaces do with it."""

import numpy as np
import pytest
import torch

from k6serve.models.kandinsky6.checkpoint import load_generation_models
from k6serve.models.variants import VARIANTS, recognise, resolve_generate, resolve_upscale
from k6serve.pipelines.text_to_video import TextToVideoPipeline
from k6serve.request import SamplingParams
from k6serve.testing.tiny_checkpoints import load_reference_pipeline

HEIGHT, WIDTH, FRAMES = 64, 96, 9


def _run(folder, params: SamplingParams):
    variant = recognise(str(folder), None, folder)
    models = load_generation_models(folder, variant, device=torch.device("cpu"), dtype=torch.float32,
                                    load_format="auto")
    request, _ = resolve_generate(params, variant)
    return TextToVideoPipeline(models)(request), request


@pytest.mark.parametrize("checkpoint", ["tiny_pro_dir", "tiny_distill_dir"])
def test_a_silent_video_matches_diffusers(request, checkpoint):
    folder = request.getfixturevalue(checkpoint)
    distilled = checkpoint == "tiny_distill_dir"
    params = SamplingParams(prompt="a dog runs", seed=3, height=HEIGHT, width=WIDTH, num_frames=FRAMES,
                            num_inference_steps=2, guidance_scale=1.0 if distilled else 3.0, sample_audio=False)
    ours, resolved = _run(folder, params)
    assert ours.audio is None and resolved.with_audio is False
    pipe = load_reference_pipeline(folder)
    theirs = pipe(prompt="a dog runs", negative_prompt=resolved.negative_prompt, height=HEIGHT, width=WIDTH,
                  num_frames=FRAMES, num_inference_steps=2, guidance_scale=resolved.guidance_scale,
                  sample_audio=False, generator=torch.Generator("cpu").manual_seed(3), output_type="np")
    assert theirs.audio is None
    assert np.array_equal(ours.video.frames_float_THWC.numpy(), np.asarray(theirs.frames[0]))
    with_sound, _ = _run(folder, _with_sound(params))
    # The video attends to the soundtrack while it denoises: the picture made with sound is another one.
    assert not np.array_equal(with_sound.video.frames_float_THWC.numpy(), ours.video.frames_float_THWC.numpy())


def _with_sound(params: SamplingParams) -> SamplingParams:
    import dataclasses

    return dataclasses.replace(params, sample_audio=None)


def test_a_silent_clip_has_no_fps_floor_and_sound_on_a_silent_checkpoint_is_refused(tmp_path):
    variant = VARIANTS["pro-distill"]
    with pytest.raises(ValueError, match="or make a silent video"):
        resolve_generate(SamplingParams(prompt="p", num_frames=509, fps=5.0), variant)
    request, _ = resolve_generate(SamplingParams(prompt="p", num_frames=509, fps=5.0, sample_audio=False), variant)
    assert request.with_audio is False and request.num_frames == 509
    with pytest.raises(ValueError, match="sample_audio applies to the generation models; super-resolution keeps"):
        resolve_upscale(SamplingParams(video_path="clip.mp4", sample_audio=False), VARIANTS["vsr-distilled2steps"])

    from k6serve.testing.tiny_checkpoints import build_generation_checkpoint

    folder = build_generation_checkpoint(tmp_path / "silent", "lite", seed=1, with_audio=False)
    params = SamplingParams(prompt="p", height=32, width=32, num_frames=5, num_inference_steps=1)
    with pytest.raises(ValueError, match="sample_audio is true, but this checkpoint has no audio_vae and vocoder"):
        _run(folder, _sample(params, True))
    assert _run(folder, params)[0].audio is None  # unset: the checkpoint's silent videos, as before


def _sample(params: SamplingParams, value):
    import dataclasses

    return dataclasses.replace(params, sample_audio=value)
