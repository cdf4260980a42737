"""expand_prompts (Qwen2.5-VL rewrites the prompt first) against diffusers' `Kandinsky6TI2VAPipeline.expand_prompts`
on the same tiny checkpoint: the same generate inputs as its Qwen2.5-VL processor makes (text, and an image's
patches and widened placeholder), the same rewrite for the same seed (also when sampling), and the whole pipeline's
frames and audio bitwise equal with expand_prompts=True."""

from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from k6serve.models.kandinsky6.checkpoint import load_generation_models
from k6serve.models.variants import recognise
from k6serve.pipelines.expand_prompt import expand_prompt, expansion_inputs, load_image_processor
from k6serve.pipelines.text_to_video import TextToVideoPipeline
from k6serve.request import SamplingParams
from k6serve.request_resolution import resolve_generate
from k6serve.testing.tiny_checkpoints import load_reference_pipeline

HEIGHT, WIDTH, FRAMES = 64, 96, 5


def _models(folder: Path):
    variant = recognise(str(folder), None, folder)
    return variant, load_generation_models(folder, variant, device=torch.device("cpu"), dtype=torch.float32,
                                           load_format="auto")


def _image(seed: int = 0) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 255, (80, 120, 3), dtype=np.uint8))


@pytest.mark.parametrize("with_image", [False, True])
def test_generate_inputs_are_the_processors(tiny_distill_dir, with_image):
    from k6serve.testing.tokenizers import load_qwen_processor

    _, models = _models(tiny_distill_dir)
    processor = load_qwen_processor(tiny_distill_dir / "tokenizer")
    if with_image:
        # diffusers loads its processor with from_pretrained, whose image processor is transformers' torchvision one
        # where torchvision is installed (the GPU host: its pixel values differ from the PIL one's in the last
        # bits) and the PIL one elsewhere (CI): the reference takes the class from_pretrained picks here.
        import transformers

        processor.image_processor = transformers.AutoImageProcessor.from_pretrained(tiny_distill_dir / "tokenizer")
    image = _image() if with_image else None
    ours = expansion_inputs("a fox in the snow", tokenizer=models.tokenizer,
                            image_processor=load_image_processor(str(tiny_distill_dir)) if with_image else None,
                            image=image)
    content = ([{"type": "image", "image": image}] if with_image else []) + [
        {"type": "text", "text": ours_instruction("a fox in the snow", with_image)}]
    text = processor.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                         add_generation_prompt=True)
    theirs = processor(text=[text], images=[image] if with_image else None, videos=None, padding=True,
                       return_tensors="pt")
    # Every input the processor makes, mm_token_type_ids included (without it generate gave the image's tokens text
    # positions, not their rotary grid), each equal, dtype too.
    assert set(ours) == set(theirs) == ({"input_ids", "attention_mask", "mm_token_type_ids", "pixel_values",
                                         "image_grid_thw"} if with_image
                                        else {"input_ids", "attention_mask", "mm_token_type_ids"})
    for name, value in ours.items():
        assert value.dtype == theirs[name].dtype and torch.equal(value, theirs[name]), name
    if with_image:
        # 80x120 is resized to 84x112 (multiples of 28), 6 x 8 patches of 14, merged 2 x 2: 12 tokens.
        assert ours["image_grid_thw"].tolist() == [[1, 6, 8]]
        assert int((ours["input_ids"] == models.tokenizer.convert_tokens_to_ids("<|image_pad|>")).sum()) == 12


def ours_instruction(prompt: str, with_image: bool) -> str:
    from k6serve.pipelines.expand_prompt import I2VA_INSTRUCTION, T2VA_INSTRUCTION

    return (I2VA_INSTRUCTION if with_image else T2VA_INSTRUCTION).format(prompt)


def test_the_instructions_are_diffusers_own():
    from diffusers.pipelines.kandinsky6 import pipeline_kandinsky6_ti2va as reference

    from k6serve.pipelines.expand_prompt import I2VA_INSTRUCTION, T2VA_INSTRUCTION

    assert T2VA_INSTRUCTION == reference._T2VA_EXPANSION_INSTRUCTION
    assert I2VA_INSTRUCTION == reference._I2VA_EXPANSION_INSTRUCTION


@pytest.mark.parametrize("sample", [False, True])
@pytest.mark.parametrize("with_image", [False, True])
def test_the_rewrite_is_diffusers_for_the_same_seed(tiny_distill_dir, with_image, sample):
    _, models = _models(tiny_distill_dir)
    pipe = load_reference_pipeline(tiny_distill_dir)
    for model in (models.text_encoder, pipe.text_encoder):
        # The tiny checkpoint's config is greedy; the released Qwen2.5-VL's samples (top_k 1): the seed must reach
        # the sampler as diffusers hands it on.
        model.generation_config.do_sample = sample
        model.generation_config.top_k = 50 if sample else None
    image = _image() if with_image else None
    rewrites = []
    for seed in (7, 8):
        theirs = pipe.expand_prompts("a fox in the snow", pipe.tokenizer, pipe.text_encoder, torch.device("cpu"),
                                     image=image, max_sequence_length=24,
                                     generator=torch.Generator("cpu").manual_seed(seed))
        before = torch.random.get_rng_state()
        ours = expand_prompt("a fox in the snow", tokenizer=models.tokenizer, text_encoder=models.text_encoder,
                             device=torch.device("cpu"), seed=seed, max_new_tokens=24, image=image,
                             image_processor=load_image_processor(str(tiny_distill_dir)) if with_image else None)
        assert torch.equal(torch.random.get_rng_state(), before)  # the global RNG is left as it was
        assert ours == theirs and ours.strip()
        rewrites.append(ours)
    assert (rewrites[0] != rewrites[1]) == sample


@pytest.mark.slow
@pytest.mark.parametrize("with_image", [False, True])
def test_the_pipeline_with_expand_prompts_matches_diffusers(tiny_pro_dir, tmp_path, with_image):
    variant, models = _models(tiny_pro_dir)
    image_path = None
    if with_image:
        image_path = tmp_path / "ref.png"
        _image(1).save(image_path)
    params = SamplingParams(prompt="a dog barks", image_path=None if image_path is None else str(image_path),
                            seed=5, height=HEIGHT, width=WIDTH, num_frames=FRAMES, num_inference_steps=2,
                            guidance_scale=3.0, expand_prompts=True)
    request, _ = resolve_generate(params, variant)
    ours = TextToVideoPipeline(models)(request)
    pipe = load_reference_pipeline(tiny_pro_dir)
    theirs = pipe(prompt="a dog barks", negative_prompt=request.negative_prompt,
                  image=None if image_path is None else Image.open(image_path), height=HEIGHT, width=WIDTH,
                  num_frames=FRAMES, num_inference_steps=2, guidance_scale=3.0, expand_prompts=True,
                  generator=torch.Generator("cpu").manual_seed(5), output_type="np")
    assert ours.expanded_prompt and ours.expanded_prompt != "a dog barks"
    assert "timings" and ours.timings["expand_prompt"] > 0
    assert np.array_equal(ours.video.frames_float_THWC.numpy(), np.asarray(theirs.frames[0]))
    assert np.array_equal(ours.audio.waveform, np.asarray(theirs.audio[0]))


def test_the_super_resolution_model_refuses_it():
    from k6serve.models.variants import VARIANTS
    from k6serve.request_resolution import resolve_upscale

    with pytest.raises(ValueError, match="expand_prompts rewrites a generation prompt; the super-resolution model "
                                         "takes no text"):
        resolve_upscale(SamplingParams(video_path="clip.mp4", expand_prompts=True), VARIANTS["vsr-distilled2steps"])


def test_a_streamed_text_encoder_is_refused_with_the_fix(tiny_distill_dir):
    # generate would copy every streamed layer from host memory for each of up to 1024 tokens.
    variant, models = _models(tiny_distill_dir)
    pipeline = TextToVideoPipeline(models)

    class Streaming:
        streamers = {"text_encoder": object()}

    pipeline.residency = Streaming()
    request, _ = resolve_generate(SamplingParams(prompt="a fox", expand_prompts=True, height=HEIGHT, width=WIDTH,
                                                 num_frames=FRAMES, num_inference_steps=1), variant)
    with pytest.raises(ValueError, match="streams its layers from host memory.*"
                                         "--component-residency text_encoder=component_offload"):
        pipeline(request)
    pipeline.check(resolve_generate(SamplingParams(prompt="a fox"), variant)[0])  # without expand_prompts: runs


def test_every_rank_encodes_the_leaders_rewrite(tiny_distill_dir):
    # Several ranks of a replica: the runtime hands the pipeline its leader's broadcast; whatever this rank wrote,
    # the leader's text is the one encoded and reported.
    variant, models = _models(tiny_distill_dir)
    pipeline = TextToVideoPipeline(models)
    seen = []
    pipeline.agree_on_text = lambda text: seen.append(text) or "the leader's rewrite"
    request, _ = resolve_generate(SamplingParams(prompt="a fox", expand_prompts=True, height=HEIGHT, width=WIDTH,
                                                 num_frames=FRAMES, num_inference_steps=1), variant)
    output = pipeline(request)
    assert len(seen) == 1 and seen[0] != "the leader's rewrite"
    assert output.expanded_prompt == "the leader's rewrite"
    assert not any("was truncated" in note for note in output.notes)  # the leader's short text was what ran


@pytest.mark.parametrize("sample", [False, True])
@pytest.mark.parametrize("with_image", [False, True])
def test_the_static_cache_rewrite_writes_the_eager_ids_on_the_cpu(tiny_distill_dir, with_image, sample):
    """--compile-prompt-rewrite true on the CPU, in fp32: transformers compiles nothing there, so the static cache's
    rewrite is the eager one's, id for id (its attention reads the cache's unused positions masked out; on CUDA the
    compiled step rounds differently, which is why the option is opt-in). Two prompts share one cache."""
    from k6serve.pipelines.expand_prompt import StaticRewriteCache, expanded_token_ids

    _, models = _models(tiny_distill_dir)
    models.text_encoder.generation_config.do_sample = sample
    models.text_encoder.generation_config.top_k = 50 if sample else None
    image = _image() if with_image else None
    kwargs = dict(tokenizer=models.tokenizer, text_encoder=models.text_encoder, device=torch.device("cpu"), seed=5,
                  max_new_tokens=48, image=image,
                  image_processor=load_image_processor(str(tiny_distill_dir)) if with_image else None)
    cache = StaticRewriteCache(models.text_encoder.config)
    for prompt in ("a fox in the snow", "a cat plays the piano by the sea at night, slowly, in the rain"):
        eager = expanded_token_ids(prompt, **kwargs)
        static = expanded_token_ids(prompt, static_cache=cache, **kwargs)
        assert eager.shape[1] > 1 and torch.equal(static, eager), prompt
    assert cache.num_tokens == 2048


def test_the_pipeline_rewrites_through_its_static_cache(tiny_distill_dir):
    """A pipeline given a `StaticRewriteCache` (the worker, with --compile-prompt-rewrite true) generates through it:
    on the CPU the same rewrite and frames as without it."""
    from k6serve.pipelines.expand_prompt import StaticRewriteCache

    variant, models = _models(tiny_distill_dir)
    request, _ = resolve_generate(SamplingParams(prompt="a fox", expand_prompts=True, height=HEIGHT, width=WIDTH,
                                                 num_frames=FRAMES, num_inference_steps=1, seed=3,
                                                 max_sequence_length=32), variant)
    eager = TextToVideoPipeline(models)(request)
    pipeline = TextToVideoPipeline(models)
    pipeline.rewrite_cache = StaticRewriteCache(models.text_encoder.config)
    prepared = []
    original = pipeline.rewrite_cache.prepared
    pipeline.rewrite_cache.prepared = lambda num_tokens: prepared.append(num_tokens) or original(num_tokens)
    static = pipeline(request)
    assert len(prepared) == 1 and static.expanded_prompt == eager.expanded_prompt
    assert torch.equal(static.video.frames_float_THWC, eager.video.frames_float_THWC)


def test_a_warm_up_does_not_rewrite():
    from k6serve.request import GenerateRequest
    from k6serve.speed.warmup import warmup_request

    request = GenerateRequest(prompt="p", negative_prompt=None, image_path=None, seed=1, height=32, width=32,
                              num_frames=5, fps=24.0, num_inference_steps=10, guidance_scale=1.0,
                              expand_prompts=True)
    assert warmup_request(request).expand_prompts is False


def test_the_rewrite_keeps_attention_off_cudnn_and_gives_the_choice_back(tiny_distill_dir, monkeypatch):
    """The rewrite's generate runs with torch's cuDNN SDPA kernel off (its one-query decoding steps did not repeat on
    Hopper; `REWRITE_ATTENTION_BACKENDS`) and flash, memory-efficient and math on; the caller's settings are back
    afterwards, after a failure too (the text encoding and the DiT keep torch's choice)."""
    from k6serve.pipelines.expand_prompt import expanded_token_ids

    _, models = _models(tiny_distill_dir)
    seen = []
    original = models.text_encoder.generate

    def generate(**kwargs):
        backends = torch.backends.cuda
        seen.append((backends.cudnn_sdp_enabled(), backends.flash_sdp_enabled(),
                     backends.mem_efficient_sdp_enabled(), backends.math_sdp_enabled()))
        return original(**kwargs)

    monkeypatch.setattr(models.text_encoder, "generate", generate)
    kwargs = dict(tokenizer=models.tokenizer, text_encoder=models.text_encoder, device=torch.device("cpu"), seed=3,
                  max_new_tokens=4)
    assert torch.backends.cuda.cudnn_sdp_enabled()
    expanded_token_ids("a fox in the snow", **kwargs)
    assert seen == [(False, True, True, True)] and torch.backends.cuda.cudnn_sdp_enabled()

    def failing(**kwargs):
        raise RuntimeError("out of memory")

    monkeypatch.setattr(models.text_encoder, "generate", failing)
    with pytest.raises(RuntimeError, match="out of memory"):
        expanded_token_ids("a fox in the snow", **kwargs)
    assert torch.backends.cuda.cudnn_sdp_enabled()


def test_the_rewrite_calls_on_tokens_every_16_tokens_and_writes_the_same_ids(tiny_distill_dir):
    from k6serve.pipelines.expand_prompt import TOKENS_PER_CHECK, expanded_token_ids

    _, models = _models(tiny_distill_dir)
    kwargs = dict(tokenizer=models.tokenizer, text_encoder=models.text_encoder, device=torch.device("cpu"), seed=3,
                  max_new_tokens=40)
    plain = expanded_token_ids("a fox in the snow", **kwargs)
    calls = []
    checked = expanded_token_ids("a fox in the snow", on_tokens=lambda: calls.append(1), **kwargs)
    assert torch.equal(checked, plain)  # a criterion that never stops changes nothing written
    assert plain.shape[1] >= 2 * TOKENS_PER_CHECK and len(calls) == plain.shape[1] // TOKENS_PER_CHECK


class _Cancelled(Exception):
    pass


def test_a_cancel_during_the_rewrite_ends_it_before_the_encoding(tiny_distill_dir):
    # One process: the request's on_step is a cancellation point every 16 tokens of the rewrite, reported as step 0
    # (a 1,024-token rewrite ran about 26 s on an H100 with no point to stop at).
    variant, models = _models(tiny_distill_dir)
    pipeline = TextToVideoPipeline(models)
    request, _ = resolve_generate(SamplingParams(prompt="a fox", expand_prompts=True, height=HEIGHT, width=WIDTH,
                                                 num_frames=FRAMES, num_inference_steps=2,
                                                 max_sequence_length=64), variant)
    steps = []

    def on_step(step: int, total: int) -> None:
        steps.append((step, total))
        raise _Cancelled

    encoded = []
    pipeline._encode = lambda request: encoded.append(request)  # noqa: SLF001 - must not be reached
    with pytest.raises(_Cancelled):
        pipeline(request, on_step=on_step)
    assert steps == [(0, 2)] and encoded == []


def test_a_replicas_rewrite_has_no_cancellation_point(tiny_distill_dir):
    # Several ranks call on_step together (a collective); their rewrites could stop at different tokens, so the
    # rewrite leaves it alone there and the first point is the first step, as before.
    variant, models = _models(tiny_distill_dir)
    pipeline = TextToVideoPipeline(models)
    pipeline.agree_on_text = lambda text: text
    request, _ = resolve_generate(SamplingParams(prompt="a fox", expand_prompts=True, height=HEIGHT, width=WIDTH,
                                                 num_frames=FRAMES, num_inference_steps=1,
                                                 max_sequence_length=64), variant)
    steps = []
    pipeline(request, on_step=lambda step, total: steps.append((step, total)))
    assert steps and steps[0] == (1, 1)
