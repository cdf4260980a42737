"""--compile-prompt-rewrite: the expand_prompts rewrite through one static KV cache of a bucketed length, whose
decoding step transformers compiles on CUDA; its flag, its refusals and its warm-up.

The compile itself is counted on the CPU: transformers compiles only on CUDA unless its compile config says
`_compile_all_devices`, which these tests set, with a dynamo backend that counts graphs and runs them eager. That the
static cache's ids equal the eager rewrite's on the CPU is tests/parity/test_expand_prompts.py's.
"""

from __future__ import annotations

import re

import pytest
import torch

import k6serve.runtime.worker as worker_module
from k6serve.engine_arguments import build_engine_config
from k6serve.models.kandinsky6.checkpoint import load_generation_models
from k6serve.models.variants import recognise
from k6serve.pipelines.expand_prompt import (
    MIN_STATIC_CACHE_TOKENS,
    StaticRewriteCache,
    expanded_token_ids,
    static_cache_tokens,
)
from k6serve.request import SamplingParams
from k6serve.runtime.worker import ModelWorker
from k6serve.speed.warmup import WARMUP_REWRITE_TOKENS

pytestmark = pytest.mark.usefixtures("one_torch_thread")

SHAPE = dict(height=32, width=48, num_frames=5)


def _models(folder):
    variant = recognise(str(folder), None, folder)
    return load_generation_models(folder, variant, device=torch.device("cpu"), dtype=torch.float32,
                                  load_format="auto")


def test_the_flag_reaches_the_runtime_config_off_by_default():
    from k6serve.cli.flags import build_parser

    assert build_engine_config("demo").runtime.compile_prompt_rewrite is False
    assert build_engine_config("demo", compile_prompt_rewrite=True).runtime.compile_prompt_rewrite is True
    with pytest.raises(ValueError, match="--compile-prompt-rewrite must be true or false"):
        build_engine_config("demo", compile_prompt_rewrite="sometimes")
    for command in ("generate", "serve"):
        args = build_parser().parse_args([command, "--model-path", "demo", "--compile-prompt-rewrite", "true"])
        assert args.compile_prompt_rewrite is True
        assert build_parser().parse_args([command, "--model-path", "demo"]).compile_prompt_rewrite is None


# Outside speed mode it is refused as --compile-vae is: tests/unit/test_speed_transforms.py.


def test_a_streamed_text_encoder_or_a_folded_one_is_refused():
    # expand_prompts is refused where the text encoder streams; a folded encoder's compiled step has never run.
    with pytest.raises(ValueError, match=r"which `--performance-mode speed --layerwise-offload-components "
                                         r"text_encoder` refuses: .*--component-residency text_encoder=resident"):
        build_engine_config("demo", compile_prompt_rewrite=True, layerwise_offload_components=["text_encoder"])
    with pytest.raises(ValueError, match=r"^--compile-prompt-rewrite true cannot be used with --encoder-parallel "
                                         r"fold: .*Use --encoder-parallel replicate or auto"):
        build_engine_config("demo", compile_prompt_rewrite=True, encoder_parallel="fold", num_gpus=2,
                            ulysses_degree=2)
    # Offloaded whole, it comes back at new addresses for every request: each a new recording of the CUDA graphs.
    with pytest.raises(ValueError, match=r"needs the text encoder resident on the GPU, which `--performance-mode "
                                         r"speed --cpu-offload-components text_encoder` offloads: .*each request "
                                         r"would record them again\. Keep the text encoder resident"):
        build_engine_config("demo", compile_prompt_rewrite=True, cpu_offload_components=["text_encoder"])
    build_engine_config("demo", compile_prompt_rewrite=True, cpu_offload_components=["text_encoder_2", "vae"])


def test_cache_lengths_are_powers_of_two_from_2048():
    assert MIN_STATIC_CACHE_TOKENS == 2048
    assert [static_cache_tokens(n) for n in (1, 374, 1398, 2048, 2049, 4096, 5000)] == [
        2048, 2048, 2048, 2048, 4096, 4096, 8192]


def test_one_cache_object_serves_every_length_of_its_bucket_and_only_grows(tiny_distill_dir):
    cache = StaticRewriteCache(_models(tiny_distill_dir).text_encoder.config)
    with torch.inference_mode():  # as in expanded_token_ids: the cache's tensors are inference tensors
        first = cache.prepared(1200)
        assert cache.prepared(374 + 1024) is first and cache.prepared(2048) is first  # no new allocation
        longer = cache.prepared(2500)
        assert longer is not first and cache.num_tokens == 4096
        assert cache.prepared(400) is longer  # a shorter rewrite keeps the longer cache: no compile for 2,048 again


@pytest.fixture
def counted_compiles(monkeypatch):
    """Make transformers compile generate's decoding step on the CPU with a dynamo backend that counts the graphs and
    runs them eager; yields the list of graphs (one per compile)."""
    from transformers.generation import CompileConfig

    graphs = []

    def backend(graph, example_inputs, **options):
        graphs.append(graph)
        return graph.forward

    def install(text_encoder):
        config = CompileConfig(backend=backend, mode=None)
        config._compile_all_devices = True  # transformers' own switch for compiling off CUDA (5.17 and 5.25)
        text_encoder.generation_config.compile_config = config

    torch._dynamo.reset()
    yield install, graphs
    torch._dynamo.reset()


def test_prompts_of_other_lengths_and_an_image_reuse_the_warm_ups_compiled_step(tiny_distill_dir, counted_compiles):
    """The warm-up's few tokens (`warm_rewrite`: with an image and without) compile the decoding step for the cache a
    rewrite of `max_sequence_length` tokens uses; later rewrites of other prompt lengths, with or without an image,
    run that step: no recompile (45 s each on an H200). transformers 5.25 compiles one graph for both; 5.17 (the GPU
    host's) passes an image rewrite's `image_grid_thw` to each decoding step, a graph of its own, which a text-only
    warm-up left to the first request with an image."""
    import numpy as np
    from PIL import Image

    from k6serve.request_resolution import resolve_generate
    from k6serve.pipelines.expand_prompt import load_image_processor
    from k6serve.pipelines.text_to_video import TextToVideoPipeline
    from k6serve.speed.warmup import warm_rewrite

    install, graphs = counted_compiles
    models = _models(tiny_distill_dir)
    install(models.text_encoder)
    pipeline = TextToVideoPipeline(models)
    cache = pipeline.rewrite_cache = StaticRewriteCache(models.text_encoder.config)
    request, _ = resolve_generate(SamplingParams(prompt="warm-up", **SHAPE), recognise(str(tiny_distill_dir), None,
                                                                                       tiny_distill_dir))
    assert warm_rewrite(pipeline, request) > 0
    warmed = len(graphs)
    assert warmed in (1, 2)
    kwargs = dict(tokenizer=models.tokenizer, text_encoder=models.text_encoder, device=torch.device("cpu"), seed=1,
                  max_new_tokens=1024, static_cache=cache)
    image = Image.fromarray(np.random.default_rng(0).integers(0, 255, (80, 120, 3), dtype=np.uint8))
    for prompt, with_image in (("a fox", False), ("a cat plays the piano by the sea at night, slowly", False),
                               ("a dog", True), ("a bird", False)):
        extra = dict(image=image, image_processor=load_image_processor(str(tiny_distill_dir))) if with_image else {}
        written = expanded_token_ids(prompt, num_tokens_written=24, **kwargs, **extra)
        assert written.shape[1] == 24
    assert len(graphs) == warmed and cache.num_tokens == 2048


def _recording_rewrite_warmups(monkeypatch) -> list:
    """(prompt, max_sequence_length, with an image, tokens) of each rewrite warm-up the worker runs."""
    from k6serve.pipelines.text_to_video import TextToVideoPipeline

    seen = []
    original = TextToVideoPipeline.warm_up_rewrite

    def recording(self, request, num_tokens):
        seen.append((request.prompt, request.max_sequence_length, request.image_path is not None, num_tokens))
        return original(self, request, num_tokens)

    monkeypatch.setattr(TextToVideoPipeline, "warm_up_rewrite", recording)
    return seen


@pytest.mark.parametrize("mode", ["request", "server"])
def test_a_warm_up_compiles_the_rewrite_once_when_on(tiny_distill_dir, monkeypatch, caplog, mode):
    seen = _recording_rewrite_warmups(monkeypatch)
    monkeypatch.setattr(ModelWorker, "variant_warmup_params", lambda self: SamplingParams(
        prompt="warm-up", **SHAPE))  # the variant's 512x768x121 is slow on a CPU
    config = build_engine_config(str(tiny_distill_dir), device="cpu", compile_prompt_rewrite=True, warmup_mode=mode,
                                 **({"warmup_resolutions": ["32x32x5", "48x32x5"]} if mode == "server" else {}))
    with caplog.at_level("INFO", logger="k6serve.runtime.worker"):
        worker = ModelWorker(config)
        assert isinstance(worker.pipeline.rewrite_cache, StaticRewriteCache)
        assert "--compile-prompt-rewrite true: transformers compiles generate's decoding step on CUDA only" in (
            caplog.text)
        params = SamplingParams(prompt="a fox", seed=1, num_inference_steps=2, max_sequence_length=64, **SHAPE)
        result = worker.run(params, worker_module.OutputOptions(save_output=False))  # the request itself: no rewrite
        worker.run(params, worker_module.OutputOptions(save_output=False))
    # Once per worker, with the warm-up's own prompt and token budget, whether or not its request rewrites.
    warmed = ("warm-up", 1024) if mode == "server" else ("a fox", 64)
    assert seen == [(*warmed, True, WARMUP_REWRITE_TOKENS), (*warmed, False, WARMUP_REWRITE_TOKENS)]
    if mode == "server":
        # At the largest listed size, not the first: its image's rewrite sizes the cache (which only grows) for all
        reports = worker.server_warmups
        assert reports[0].rewrite_seconds is None and reports[1].rewrite_seconds > 0
        assert reports[1].seconds > reports[1].rewrite_seconds
        assert re.search(r"warm-up \(server, 48x32x5\) took [0-9.]+ s \(the prompt rewrite's compile", caplog.text)
    else:
        assert result.timings["warmup"] > 0
    assert "(the prompt rewrite's compile, --compile-prompt-rewrite true: " in caplog.text
    assert worker.pipeline.rewrite_cache.num_tokens == 2048


def test_the_server_warm_up_compiles_the_rewrite_at_the_most_tokens_not_the_largest_area(tiny_distill_dir,
                                                                                           monkeypatch):
    """The worker orders the listed sizes by their image's rewrite tokens, the area only breaking ties: here the
    smaller 32x32 is said to give more tokens than 48x32 (as 416x448 gives more than 432x432), so it is the one
    warmed with the rewrite."""
    from k6serve.pipelines.text_to_video import TextToVideoPipeline

    seen = _recording_rewrite_warmups(monkeypatch)
    monkeypatch.setattr(TextToVideoPipeline, "rewrite_image_tokens", lambda self, height, width: (
        50 if (height, width) == (32, 32) else 1))
    worker = ModelWorker(build_engine_config(str(tiny_distill_dir), device="cpu", compile_prompt_rewrite=True,
                                             warmup_mode="server", warmup_resolutions=["48x32x5", "32x32x5"]))
    first, second = worker.server_warmups
    assert (first.size, second.size) == ("48x32x5", "32x32x5")
    assert first.rewrite_seconds is None and second.rewrite_seconds > 0
    assert len(seen) == 2  # one rewrite with the gray image, one without: at that size only


def test_no_rewrite_warm_up_or_cache_when_off(tiny_distill_dir, monkeypatch, caplog):
    seen = _recording_rewrite_warmups(monkeypatch)
    with caplog.at_level("INFO", logger="k6serve.runtime.worker"):
        worker = ModelWorker(build_engine_config(str(tiny_distill_dir), device="cpu", warmup_mode="request"))
        result = worker.run(SamplingParams(prompt="a fox", seed=1, num_inference_steps=2, expand_prompts=True,
                                           max_sequence_length=16, **SHAPE),
                            worker_module.OutputOptions(save_output=False))
    assert seen == [] and worker.pipeline.rewrite_cache is None
    assert result.expanded_prompt and "prompt rewrite's compile" not in caplog.text


def test_the_warm_up_report_says_the_rewrite_and_its_seconds():
    from k6serve.request import GenerateRequest
    from k6serve.speed.warmup import warmup

    class Pipeline:
        def __init__(self):
            self.calls = []

        def __call__(self, request):
            self.calls.append("request")

        def warm_up_rewrite(self, request, num_tokens):
            from pathlib import Path

            assert request.image_path is None or Path(request.image_path).is_file()
            self.calls.append(("rewrite", request.prompt, request.expand_prompts, request.image_path is not None,
                               num_tokens))

    request = GenerateRequest(prompt="p", negative_prompt=None, image_path=None, seed=1, height=32, width=32,
                              num_frames=5, fps=24.0, num_inference_steps=10, guidance_scale=1.0, expand_prompts=True)
    pipeline = Pipeline()
    report = warmup(pipeline, request, "server", rewrite=True)
    # The rewrite passes come after the request's, with an image first (a gray one here), then without; the request
    # itself does not rewrite.
    assert pipeline.calls == ["request", ("rewrite", "p", False, True, WARMUP_REWRITE_TOKENS),
                              ("rewrite", "p", False, False, WARMUP_REWRITE_TOKENS)]
    assert report.rewrite_seconds is not None and 0 <= report.rewrite_seconds <= report.seconds
    pipeline = Pipeline()
    assert warmup(pipeline, request, "server").rewrite_seconds is None and pipeline.calls == ["request"]
    assert warmup(pipeline, request, "off", rewrite=True).rewrite_seconds is None and pipeline.calls == ["request"]


@pytest.mark.multiprocess
def test_every_rank_of_a_replica_warms_the_rewrite_and_rewrites_through_its_cache(tiny_pro_dir):
    """Ulysses over 2 ranks: both ranks run the rewrite's warm-up pass (the decision is the configuration's, so no
    rank waits for another in the next pass's collectives), the leader's report carries its seconds, and a request
    that rewrites runs, each rank through its own static cache, encoding the leader's text."""
    from k6serve.config import EngineConfig, ModelConfig, ParallelConfig, RuntimeConfig
    from k6serve.request import OutputOptions
    from k6serve.runtime.engine import Engine

    config = EngineConfig(model=ModelConfig(model_path=str(tiny_pro_dir)),
                          parallel=ParallelConfig(num_gpus=2, ulysses_degree=2, dist_timeout_s=60.0),
                          runtime=RuntimeConfig(device="cpu", warmup_mode="server", warmup_resolutions=("48x32x5",),
                                                compile_prompt_rewrite=True))
    engine = Engine(config)
    try:
        [report] = engine.startup_warmups
        assert report.rewrite_seconds is not None and 0 < report.rewrite_seconds < report.seconds
        result = engine.generate(SamplingParams(prompt="a fox", num_inference_steps=1, expand_prompts=True,
                                                max_sequence_length=24, **SHAPE), OutputOptions(save_output=False))
        assert result.expanded_prompt
    finally:
        engine.shutdown()


def test_a_memory_release_drops_the_static_cache_and_the_next_rewrite_remakes_it(tiny_distill_dir):
    """The static KV cache is device memory the worker keeps between requests (117 MB for Qwen2.5-VL-7B at 2,048):
    a release drops it, and the rewrite after the resume makes a new one of the same length, the same text."""
    from k6serve.runtime.memory import ReleaseMemory, ResumeMemory

    worker = ModelWorker(build_engine_config(str(tiny_distill_dir), device="cpu", compile_prompt_rewrite=True))
    params = SamplingParams(prompt="a fox", seed=1, num_inference_steps=1, expand_prompts=True,
                            max_sequence_length=16, **SHAPE)
    before = worker.run(params, worker_module.OutputOptions(save_output=False))
    cache = worker.pipeline.rewrite_cache
    assert cache.cache is not None and cache.num_tokens == 2048
    [report] = worker.apply_memory_operation(ReleaseMemory())
    assert report["status"] == "released" and cache.cache is None
    worker.apply_memory_operation(ResumeMemory())
    after = worker.run(params, worker_module.OutputOptions(save_output=False))
    assert after.expanded_prompt == before.expanded_prompt
    assert cache.cache is not None and cache.num_tokens == 2048


def test_the_super_resolution_model_refuses_it_before_loading(tiny_sr_dir):
    # The upscaler takes no prompt: accepted, the flag did nothing, silently.
    with pytest.raises(ValueError, match=r"^--compile-prompt-rewrite applies to the generation models' expand_prompts "
                                         r"rewrite; .* is a super-resolution model, which rewrites no prompt\. Drop "
                                         r"the flag\.$"):
        ModelWorker(build_engine_config(str(tiny_sr_dir), device="cpu", compile_prompt_rewrite=True))


def test_the_rewrite_warm_up_size_is_the_one_whose_image_gives_the_most_tokens():
    """Qwen2.5-VL's processor rounds each side to a multiple of 28, so area does not order the image tokens: a
    416x448 image (smaller) gives 240, a 432x432 one 225. The server warm-up compiles the rewrite at the size that
    gives the most (the cache only grows), counted by the checkpoint's own processor."""
    from types import SimpleNamespace

    from k6serve.pipelines.text_to_video import TextToVideoPipeline

    pipeline = object.__new__(TextToVideoPipeline)
    pipeline._image_processor, pipeline.models = None, SimpleNamespace(source="dummy")  # Qwen2.5-VL's defaults
    assert pipeline.rewrite_image_tokens(416, 448) == 240 and pipeline.rewrite_image_tokens(432, 432) == 225
    assert pipeline.rewrite_image_tokens(512, 768) == 486 and pipeline.rewrite_image_tokens(720, 1280) == 1196


def test_the_rewrite_compiles_in_inductors_deterministic_mode_on_cuda_only(tiny_distill_dir, monkeypatch):
    """`apply_rewrite_compile_config`: on CUDA transformers' compile config becomes "reduce-overhead"'s one option
    (CUDA graphs) plus inductor's deterministic mode, as the DiT's blocks compile; left alone on the CPU (where
    transformers compiles nothing), where the checkpoint set its own, and where TORCHINDUCTOR_DETERMINISTIC is set."""
    from transformers.generation import CompileConfig

    from k6serve.pipelines.expand_prompt import apply_rewrite_compile_config

    monkeypatch.delenv("TORCHINDUCTOR_DETERMINISTIC", raising=False)
    encoder = _models(tiny_distill_dir).text_encoder
    apply_rewrite_compile_config(encoder, torch.device("cpu"))
    assert encoder.generation_config.compile_config is None
    apply_rewrite_compile_config(encoder, torch.device("cuda"))  # the device's type only: no GPU touched
    config = encoder.generation_config.compile_config
    assert config.mode is None and config.options == {"triton.cudagraphs": True, "deterministic": True}
    assert config.fullgraph == CompileConfig().fullgraph and config.dynamic == CompileConfig().dynamic
    own = CompileConfig(mode="max-autotune")
    encoder.generation_config.compile_config = own
    apply_rewrite_compile_config(encoder, torch.device("cuda"))
    assert encoder.generation_config.compile_config is own
    encoder.generation_config.compile_config = None
    monkeypatch.setenv("TORCHINDUCTOR_DETERMINISTIC", "0")
    apply_rewrite_compile_config(encoder, torch.device("cuda"))
    assert encoder.generation_config.compile_config is None


def test_the_worker_applies_the_deterministic_compile_with_the_static_cache(tiny_distill_dir, monkeypatch):
    """The worker sets the config where it makes the static cache (--compile-prompt-rewrite true), not without."""
    calls = []
    import k6serve.pipelines.expand_prompt as expand_prompt

    monkeypatch.setattr(expand_prompt, "apply_rewrite_compile_config",
                        lambda encoder, device: calls.append((type(encoder).__name__, device.type)))
    ModelWorker(build_engine_config(str(tiny_distill_dir), device="cpu"))
    assert calls == []
    ModelWorker(build_engine_config(str(tiny_distill_dir), device="cpu", performance_mode="speed",
                                    compile_prompt_rewrite=True))
    assert calls == [("Qwen2_5_VLForConditionalGeneration", "cpu")]
