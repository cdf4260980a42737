"""sample_audio=False (a silent video, the DiT on the video tokens alone) against diffusers' own
`sample_audio=False` on the same tiny checkpoint: frames bitwise, no waveform, and what the surfaces do with it."""

import numpy as np
import pytest
import torch

from k6serve.models.kandinsky6.checkpoint import load_generation_models
from k6serve.models.variants import VARIANTS, recognise
from k6serve.pipelines.text_to_video import TextToVideoPipeline
from k6serve.request import SamplingParams
from k6serve.request_resolution import resolve_generate, resolve_upscale
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
    assert "decode_audio" not in ours.timings and "decode_video" in ours.timings  # no audio stage, not a 0 s one
    pipe = load_reference_pipeline(folder)
    theirs = pipe(prompt="a dog runs", negative_prompt=resolved.negative_prompt, height=HEIGHT, width=WIDTH,
                  num_frames=FRAMES, num_inference_steps=2, guidance_scale=resolved.guidance_scale,
                  sample_audio=False, generator=torch.Generator("cpu").manual_seed(3), output_type="np")
    assert theirs.audio is None
    assert np.array_equal(ours.video.frames_float_THWC.numpy(), np.asarray(theirs.frames[0]))
    with_sound, _ = _run(folder, _with_sound(params))
    assert with_sound.timings["decode_audio"] > 0
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


def test_the_engine_refuses_sound_from_a_silent_checkpoint_with_the_request(tmp_path):
    # Checked when the request is resolved (the server's job creation: a 400), not once it runs.
    from k6serve.engine_arguments import build_engine_config
    from k6serve.request_refusals import NO_AUDIO_PARTS, STREAMED_TEXT_ENCODER
    from k6serve.runtime.engine import Engine
    from k6serve.runtime.worker import ModelWorker
    from k6serve.testing.tiny_checkpoints import build_generation_checkpoint

    folder = build_generation_checkpoint(tmp_path / "silent", "lite", seed=1, with_audio=False)
    config = build_engine_config(str(folder), device="cpu")
    engine = Engine(config, worker=ModelWorker(config))
    try:
        with pytest.raises(ValueError, match="sample_audio is true, but this checkpoint has no audio_vae"):
            engine.resolve(SamplingParams(prompt="p", sample_audio=True))
        assert engine.resolve(SamplingParams(prompt="p", sample_audio=False))[0].with_audio is False
        assert engine.worker.streams_text_encoder is False  # on the CPU nothing streams
    finally:
        engine.shutdown()
    with pytest.raises(ValueError, match=NO_AUDIO_PARTS.split(",")[0]):
        resolve_generate(SamplingParams(prompt="p", sample_audio=True), VARIANTS["pro"], has_audio=False)
    with pytest.raises(ValueError, match="expand_prompts runs the text encoder once per generated token"):
        resolve_generate(SamplingParams(prompt="p", expand_prompts=True), VARIANTS["pro"],
                         streams_text_encoder=True)
    assert STREAMED_TEXT_ENCODER.endswith("or drop expand_prompts.")
    resolve_generate(SamplingParams(prompt="p"), VARIANTS["pro"], has_audio=False, streams_text_encoder=True)


def test_the_rewrite_and_the_encoding_share_one_stage_of_the_text_encoders(tiny_distill_dir):
    # An offloaded Qwen2.5-VL (15.5 GiB) was copied to the GPU for the rewrite, back, and again for the encoding.
    import contextlib

    variant = recognise(str(tiny_distill_dir), None, tiny_distill_dir)
    models = load_generation_models(tiny_distill_dir, variant, device=torch.device("cpu"), dtype=torch.float32,
                                    load_format="auto")
    pipeline = TextToVideoPipeline(models)
    stages = []

    class Recording:
        @contextlib.contextmanager
        def stage(self, *components):
            stages.append(components)
            yield

    pipeline.residency = Recording()
    request, _ = resolve_generate(SamplingParams(prompt="a fox", expand_prompts=True, height=32, width=32,
                                                 num_frames=5, num_inference_steps=1), variant)
    output = pipeline(request)
    assert [stage for stage in stages if "text_encoder" in stage] == [("text_encoder", "text_encoder_2")]
    assert output.timings["expand_prompt"] > 0 and output.timings["encode"] > 0
