"""max_sequence_length (diffusers' argument; SGLang's request field): the prompt tokens the model reads and the
rewrite's most new tokens, against diffusers' own on the same tiny checkpoint: frames and audio bitwise."""

import numpy as np
import pytest
import torch

from k6serve.models.kandinsky6.checkpoint import load_generation_models
from k6serve.models.variants import VARIANTS, recognise
from k6serve.pipelines.text_to_video import TextToVideoPipeline
from k6serve.request import SamplingParams
from k6serve.request_resolution import resolve_generate, resolve_upscale
from k6serve.testing.tiny_checkpoints import load_reference_pipeline

HEIGHT, WIDTH, FRAMES = 64, 96, 5
PROMPT = "A red fox runs through a snowy forest at dawn, cinematic lighting, slow camera pan, and the wind howls."


@pytest.mark.parametrize("expand", [False, True])
def test_a_shorter_sequence_matches_diffusers(tiny_pro_dir, expand):
    variant = recognise(str(tiny_pro_dir), None, tiny_pro_dir)
    models = load_generation_models(tiny_pro_dir, variant, device=torch.device("cpu"), dtype=torch.float32,
                                    load_format="auto")
    params = SamplingParams(prompt=PROMPT, seed=9, height=HEIGHT, width=WIDTH, num_frames=FRAMES,
                            num_inference_steps=2, guidance_scale=3.0, max_sequence_length=12, expand_prompts=expand)
    request, _ = resolve_generate(params, variant)
    ours = TextToVideoPipeline(models)(request)
    pipe = load_reference_pipeline(tiny_pro_dir)
    theirs = pipe(prompt=PROMPT, negative_prompt=request.negative_prompt, height=HEIGHT, width=WIDTH,
                  num_frames=FRAMES, num_inference_steps=2, guidance_scale=3.0, max_sequence_length=12,
                  expand_prompts=expand, generator=torch.Generator("cpu").manual_seed(9), output_type="np")
    assert np.array_equal(ours.video.frames_float_THWC.numpy(), np.asarray(theirs.frames[0]))
    assert np.array_equal(ours.audio.waveform, np.asarray(theirs.audio[0]))
    assert any("kept its first 12 of" in note for note in ours.notes)
    if expand:
        # Its 12 new tokens, as diffusers' (the frames above are conditioned on the same rewrite).
        assert ours.expanded_prompt and ours.expanded_prompt == pipe.expand_prompts(
            PROMPT, pipe.tokenizer, pipe.text_encoder, torch.device("cpu"), max_sequence_length=12,
            generator=torch.Generator("cpu").manual_seed(9))


def test_its_range_and_the_super_resolution_model():
    for value in (0, 1025):
        with pytest.raises(ValueError, match=f"max_sequence_length must be between 1 and 1024 .*got {value}"):
            resolve_generate(SamplingParams(prompt="p", max_sequence_length=value), VARIANTS["pro"])
    assert resolve_generate(SamplingParams(prompt="p"), VARIANTS["pro"])[0].max_sequence_length == 1024
    with pytest.raises(ValueError, match="max_sequence_length sets how much of a generation prompt is read"):
        resolve_upscale(SamplingParams(video_path="in.mp4", max_sequence_length=64), VARIANTS["vsr-distilled2steps"])
