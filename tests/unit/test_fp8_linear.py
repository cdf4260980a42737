"""The opt-in e4m3 linears (ops/fp8_linear.py, speed/fp8_linears.py) on the CPU, where torch has the same
`_scaled_mm` with row-wise scales as on CUDA: the quantization, the layer against its math written out, what each
scope converts, and the bench rows that measure it."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from k6serve.models.kandinsky6.checkpoint import build_dummy_transformer
from k6serve.ops.fp8_linear import FP8_MAX, Fp8Linear, dequantized_linear, quantize_rowwise
from k6serve.speed.fp8_linears import apply_fp8_linears, fp8_linear_paths, set_fast_accumulation
from k6serve.speed.fused_projections import apply_fused_projections
from k6serve.testing.tiny_configs import TINY_TRANSFORMER_CONFIG


def test_quantize_rowwise_maps_each_rows_max_to_448_and_keeps_zero_rows_zero():
    x = torch.randn(6, 96, generator=torch.Generator().manual_seed(0))
    x[2] *= 1e4  # a row far larger gets its own scale; the others are unaffected
    x[4] = 0.0
    values, scale = quantize_rowwise(x)
    assert values.dtype == torch.float8_e4m3fn and values.shape == x.shape
    assert scale.dtype == torch.float32 and scale.shape == (6, 1)
    nonzero = [0, 1, 2, 3, 5]
    torch.testing.assert_close(scale[nonzero], x[nonzero].abs().amax(dim=1, keepdim=True) / FP8_MAX)
    assert torch.equal(values.float().abs().amax(dim=1)[nonzero], torch.full((5,), FP8_MAX))  # the max is exact
    assert torch.equal(values[4].float(), torch.zeros(96)) and bool(torch.isfinite(scale).all())
    # Round to nearest with 3 mantissa bits: at most 2^-4 of the value for normal e4m3 numbers, else the
    # subnormals' absolute step (2^-9 of the scale).
    error = (values.float() * scale - x).abs()
    bound = torch.maximum(x.abs() * 2.0**-4, scale * 2.0**-9)
    assert bool((error <= bound * (1 + 1e-6)).all()) and error.max() > 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
def test_fp8_linear_is_its_math_written_out_and_close_to_the_linear(dtype, bias):
    generator = torch.Generator().manual_seed(1)
    linear = nn.Linear(128, 96, bias=bias).to(dtype)
    x = torch.randn(2, 40, 128, generator=generator).to(dtype)
    layer = Fp8Linear.from_linear(linear)
    assert layer.weight.dtype == torch.float8_e4m3fn and layer.weight_scale.shape == (1, 96)
    output = layer(x)
    assert output.shape == (2, 40, 96) and output.dtype == dtype
    torch.testing.assert_close(output, dequantized_linear(x, layer), rtol=1e-5, atol=1e-5)
    exact = linear(x).float()
    relative = ((output.float() - exact).norm() / exact.norm()).item()
    # e4m3 keeps 3 mantissa bits: a few percent per GEMM (bf16 keeps 8: ~0.3%), which is why it is opt-in.
    assert 0.01 < relative < 0.06


def test_fp8_linear_refuses_the_wrong_width():
    layer = Fp8Linear.from_linear(nn.Linear(32, 16))
    with pytest.raises(ValueError, match="Fp8Linear expects 32 input features, got shape \\(4, 31\\)"):
        layer(torch.randn(4, 31))


def test_scopes_name_the_video_token_linears_and_refuse_others():
    assert fp8_linear_paths("ffn") == ("video_dec_block.feed_forward.net.0.proj", "video_dec_block.feed_forward.net.2")
    video = fp8_linear_paths("video")
    assert video[:2] == fp8_linear_paths("ffn")
    assert "video_dec_block.self_attention.to_query_key_value" in video and "av_cross_attention.to_key_value" in video
    assert not any(path.startswith("audio_dec_block") for path in video)  # 218 audio rows: launch-bound
    with pytest.raises(ValueError, match="FP8 linear scope must be one of ffn, video, got 'all'"):
        fp8_linear_paths("all")


def _tiny_dit(fused: bool):
    model = build_dummy_transformer(TINY_TRANSFORMER_CONFIG, device=torch.device("cpu"), dtype=torch.float32)
    if fused:
        apply_fused_projections(model)
    return model


@pytest.mark.parametrize("fused", [False, True])
def test_apply_converts_each_blocks_video_linears_once(fused):
    model = _tiny_dit(fused)
    num_blocks = len(model.visual_transformer_blocks)
    assert apply_fp8_linears(model, "ffn") == 2 * num_blocks
    block = model.visual_transformer_blocks[0]
    assert isinstance(block.video_dec_block.feed_forward.net[2], Fp8Linear)
    assert type(block.audio_dec_block.feed_forward.net[2]) is nn.Linear
    # "video" after "ffn" converts the rest: self-attention Q/K/V (one fused linear or three) and output, the text
    # cross-attention's query and output, video_from_audio's query and output, audio_from_video's key/value.
    per_block = (2 if fused else 4) + 2 + 2 + (1 if fused else 2)
    assert apply_fp8_linears(model, "video") == per_block * num_blocks
    assert apply_fp8_linears(model, "video") == 0  # already converted
    assert type(block.video_dec_block.cross_attention.to_key_value if fused
                else block.video_dec_block.cross_attention.to_key) is nn.Linear  # text tokens: left in bf16
    assert set_fast_accumulation(model, True) == (2 + per_block) * num_blocks
    assert all(module.fast_accumulation for module in model.modules() if isinstance(module, Fp8Linear))


def test_the_converted_dit_runs_close_to_the_original():
    from k6serve.bench.dit import dit_inputs
    from k6serve.bench.geometry import generation_geometry
    from k6serve.models.kandinsky6.config import Kandinsky6TransformerConfig

    config = Kandinsky6TransformerConfig.from_json_dict(TINY_TRANSFORMER_CONFIG)
    inputs = dit_inputs(config, generation_geometry(64, 96, 17, num_text_tokens=16), device=torch.device("cpu"),
                        dtype=torch.float32, seed=1)
    model = _tiny_dit(fused=True)
    with torch.inference_mode():
        video, audio = model(**inputs)
        apply_fp8_linears(model, "video")
        video8, audio8 = model(**inputs)
    assert not torch.equal(video8, video)  # the e4m3 rounding is really there
    for exact, rounded in ((video, video8), (audio, audio8)):
        cosine = torch.nn.functional.cosine_similarity(rounded.double().flatten(), exact.double().flatten(), dim=0)
        assert cosine > 0.99


def test_bench_rows_and_flag_checks(monkeypatch, capsys):
    from k6serve.bench import stage_runners as bench
    from k6serve.bench.flags import build_parser

    captured = {}
    monkeypatch.setattr(bench, "run_dit", lambda options: captured.setdefault("options", options) and [])
    args = build_parser().parse_args(["--tiny", "--fp8-linears", "ffn", "video", "--fp8-fast-accumulation"])
    bench.stage_runners(args)["dit"]()
    assert captured["options"].fp8_linears == ("ffn", "video") and captured["options"].fp8_fast_accumulation
    with pytest.raises(SystemExit, match="--fp8-linears times the fused \\+ compiled DiT once more in e4m3: drop "
                                         "--skip-speed"):
        bench.stage_runners(build_parser().parse_args(["--tiny", "--fp8-linears", "ffn", "--skip-speed"]))
    with pytest.raises(SystemExit, match="--fp8-fast-accumulation times the --fp8-linears rows' model once more: "
                                         "add --fp8-linears"):
        bench.stage_runners(build_parser().parse_args(["--tiny", "--fp8-fast-accumulation"]))
    for entry, message in (("all", "SCOPE one of ffn, video, got 'all'"),
                           ("ffn:", "give patterns after the colon, or drop it")):
        with pytest.raises(SystemExit):  # argparse refuses it before any model is built, saying why
            build_parser().parse_args(["--fp8-linears", entry])
        assert message in capsys.readouterr().err
    # The generate stage passes the engine's --quantization through.
    monkeypatch.setattr(bench, "run_generate", lambda options: captured.setdefault("generate", options) and [])
    args = build_parser().parse_args(["--tiny", "--quantization", "fp8", "--quantization-ignored-layers",
                                      "feed_forward"])
    bench.stage_runners(args)["generate"]()
    from k6serve.bench.end_to_end import _engine_kwargs

    kwargs = _engine_kwargs(captured["generate"])
    assert (kwargs["quantization"], kwargs["quantization_ignored_layers"]) == ("fp8", ("feed_forward",))


def test_tiny_bench_times_each_scope(tmp_path):
    from k6serve.bench.__main__ import main

    assert main(["--tiny", "--stage", "dit", "--skip-reference", "--skip-eager", "--repeats", "1",
                 "--fp8-linears", "ffn", "video", "--fp8-fast-accumulation", "--json", str(tmp_path / "dit.json")]) == 0
    rows = json.loads((tmp_path / "dit.json").read_text())["rows"]
    assert [row["name"] for row in rows] == [
        "ours torch_sdpa fused+compiled",
        "ours torch_sdpa fused+compiled+fp8 ffn",
        "ours torch_sdpa fused+compiled+fp8 video",
        "ours torch_sdpa fused+compiled+fp8 video fast-accum",
    ]
    assert all(row["error"] is None for row in rows)
    assert rows[1]["note"].startswith("4 video-token linears in e4m3") and rows[2]["note"].startswith("18 ")


def test_tiny_bench_entries_start_from_the_bf16_model(tmp_path, capsys):
    """Each --fp8-linears entry converts the bf16 model, not the last entry's: "video" keeping block 0 in bf16
    after "video" converts only block 1's 9 linears, and its output differs from the full conversion's."""
    from k6serve.bench.__main__ import main

    assert main(["--tiny", "--stage", "dit", "--skip-reference", "--skip-eager", "--repeats", "1",
                 "--fp8-linears", "video", "video:visual_transformer_blocks.0", "ffn",
                 "--json", str(tmp_path / "dit.json")]) == 0
    rows = json.loads((tmp_path / "dit.json").read_text())["rows"]
    assert [row["name"] for row in rows][1:] == [
        "ours torch_sdpa fused+compiled+fp8 video",
        "ours torch_sdpa fused+compiled+fp8 video:visual_transformer_blocks.0",
        "ours torch_sdpa fused+compiled+fp8 ffn",
    ]
    assert all(row["error"] is None for row in rows)
    assert [row["note"].split(" ")[0] for row in rows[1:]] == ["18", "9", "4"]
    # A pattern that keeps nothing (the tiny DiT has 2 blocks) is refused before any model is built.
    with pytest.raises(SystemExit) as refused:
        main(["--tiny", "--stage", "dit", "--fp8-linears", "ffn:visual_transformer_blocks.7"])
    assert refused.value.code == 2  # a refused flag, not a failed row
    assert ("k6serve bench: error: --fp8-linears ffn:visual_transformer_blocks.7: --quantization-ignored-layers "
            "'visual_transformer_blocks.7' matches none of the DiT's") in capsys.readouterr().err


@pytest.mark.skipif(not torch.cuda.is_available(), reason="cuBLASLt's row-wise FP8 GEMM needs a CUDA GPU (Hopper+)")
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])  # fp32: --dtype float32, the bias added after
def test_cuda_fp8_linear_matches_its_math_eager_and_compiled(bias, dtype):
    """On the GPU the same layer runs cuBLASLt's e4m3 GEMM (fp32 accumulation), eager and inside torch.compile
    (inductor fuses the row maximum and the cast into the producer of the input): both within bf16 rounding of the
    math written out in fp32."""
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("e4m3 GEMMs need compute capability 8.9 or newer")
    generator = torch.Generator(device="cuda").manual_seed(2)
    linear = nn.Linear(512, 384, bias=bias, device="cuda", dtype=dtype)
    x = torch.randn(3, 256, 512, device="cuda", generator=generator).to(dtype)
    layer = Fp8Linear.from_linear(linear)
    expected = dequantized_linear(x, layer).float()
    eager = layer(x)
    compiled = torch.compile(lambda t: layer(torch.nn.functional.gelu(t) + 0.5 * t), fullgraph=True)(x)
    expected_compiled = dequantized_linear(torch.nn.functional.gelu(x) + 0.5 * x, layer).float()
    assert eager.dtype == compiled.dtype == dtype
    # The same e4m3 inputs: cuBLASLt's accumulation order and bf16 output rounding only.
    assert ((eager.float() - expected).norm() / expected.norm()).item() < 5e-3
    # Compiled, the quantized input is the GELU's fp32 result (eager rounds it to bf16 first): the 0.4% of bf16
    # rounding moves some inputs across an e4m3 rounding boundary (one step is 6%), so the outputs are compared as a
    # whole; measured on an H200: 1.48% relative.
    relative = ((compiled.float() - expected_compiled).norm() / expected_compiled.norm()).item()
    assert relative < 2.5e-2
    set_fast_accumulation(nn.Sequential(layer), True)
    assert ((layer(x).float() - expected).norm() / expected.norm()).item() < 1e-2


# --- the engine's --quantization fp8 (config.py, speed/performance_mode.py, runtime/worker.py) -------------------


def test_quantization_config_checks_name_the_fix():
    from k6serve.config import EngineConfig, ModelConfig, ParallelConfig, RuntimeConfig

    assert ModelConfig(model_path="demo", quantization="fp8",
                       quantization_ignored_layers="feed_forward, self_attention").quantization_ignored_layers == (
        "feed_forward", "self_attention")  # the API's and a --config file's string form
    assert ModelConfig(model_path="demo", quantization="fp8", quantization_ignored_layers=[
        "feed_forward, self_attention", "av_cross_attention"]).quantization_ignored_layers == (
        "feed_forward", "self_attention", "av_cross_attention")  # a --config file's string, as the CLI's list
    refusals = [
        (dict(quantization="int8"), "--quantization must be one of none, fp8, got 'int8'"),
        (dict(quantization_ignored_layers=["feed_forward"]), "--quantization-ignored-layers names the layers "
         "--quantization leaves in bf16, but --quantization is none; add --quantization fp8, or drop it."),
        (dict(quantization="fp8", quantization_ignored_layers=[""]), "--quantization-ignored-layers must be module "
         "names or globs"),
        (dict(quantization="fp8", lora_path="a.safetensors"), "--lora-path cannot be used with --quantization fp8"),
    ]
    for options, message in refusals:
        with pytest.raises(ValueError) as refused:
            ModelConfig(model_path="demo", **options)
        assert str(refused.value).startswith(message)
    model = ModelConfig(model_path="demo", quantization="fp8")
    with pytest.raises(ValueError, match="--quantization fp8 cannot be used with --tp-size 2: the linears are "
                                         "quantized whole on each GPU, not as shards; drop --quantization fp8, or "
                                         "drop --tp-size 2"):
        EngineConfig(model=model, parallel=ParallelConfig(num_gpus=2, tp_size=2))
    with pytest.raises(ValueError, match="drop --quantization fp8, or drop --tp-size 2 and --use-fsdp-inference"):
        EngineConfig(model=model, parallel=ParallelConfig(num_gpus=2, tp_size=2, use_fsdp_inference=True))
    assert ModelConfig(model_path="demo", quantization="fp8",
                       quantization_ignored_layers=None).quantization_ignored_layers == ()  # as the offload lists
    EngineConfig(model=model, parallel=ParallelConfig(num_gpus=2, ulysses_degree=2))  # replicated weights: fine
    for runtime, flags in ((RuntimeConfig(performance_mode="balanced"), "--performance-mode balanced"),
                           (RuntimeConfig(cpu_offload_components=("dit",)),
                            "--performance-mode speed --cpu-offload-components dit")):
        with pytest.raises(ValueError) as refused:
            EngineConfig(model=model, runtime=runtime)
        assert str(refused.value).startswith("--quantization fp8 needs the DiT resident on the GPU (offloading its "
                                             f"e4m3 weights is not supported), but `{flags}` offloads it. Offload the "
                                             "other components instead")
    # A super-resolution checkpoint known by its name is refused as one, before the offload rule's fixes.
    with pytest.raises(ValueError, match="--quantization fp8 applies to the generation DiT; vsr-distilled2steps is a "
                                         "super-resolution model. Drop the flag."):
        EngineConfig(model=ModelConfig(model_path="kandinskylab/Kandinsky-6.0-VSR-distilled2steps-5s-Diffusers",
                                       quantization="fp8"), runtime=RuntimeConfig(performance_mode="balanced"))
    # The DiT kept resident while the rest is offloaded: the point of quantizing on a smaller GPU.
    EngineConfig(model=model, runtime=RuntimeConfig(performance_mode="balanced",
                                                    component_residency=(("transformer", "resident"),)))
    EngineConfig(model=model, runtime=RuntimeConfig(cpu_offload_components=("text_encoders", "vae")))


def test_apply_quantization_skips_the_ignored_layers_and_refuses_a_pattern_that_matches_nothing():
    from k6serve.speed.fp8_linears import apply_quantization

    model = _tiny_dit(fused=True)
    assert apply_quantization(model, "none") == 0
    num_blocks = len(model.visual_transformer_blocks)
    converted = apply_quantization(model, "fp8", ("feed_forward", "visual_transformer_blocks.0.*"))
    assert converted == 7 * (num_blocks - 1)  # 9 video-token linears per fused block, minus the 2 FFN ones
    first, last = model.visual_transformer_blocks[0], model.visual_transformer_blocks[-1]
    assert not any(isinstance(module, Fp8Linear) for module in first.modules())
    assert type(last.video_dec_block.feed_forward.net[2]) is nn.Linear
    assert isinstance(last.video_dec_block.self_attention.to_query_key_value, Fp8Linear)
    # docs/cli.md's "the feed-forwards only": a glob over a part matches every attention (self_attention,
    # cross_attention, va_cross_attention, av_cross_attention); the plain part only its own.
    ffn_only = _tiny_dit(fused=True)
    assert apply_quantization(ffn_only, "fp8", ("*_attention",)) == 2 * num_blocks
    assert apply_quantization(_tiny_dit(fused=True), "fp8", ("cross_attention",)) == 7 * num_blocks
    assert all(name.endswith(("net.0.proj", "net.2")) for name, module in ffn_only.named_modules()
               if isinstance(module, Fp8Linear))
    with pytest.raises(ValueError) as refused:
        apply_quantization(_tiny_dit(fused=True), "fp8", ("feed_forwrd", "feed_forward"))
    assert str(refused.value).startswith(
        "--quantization-ignored-layers 'feed_forwrd' matches none of the DiT's quantizable linears (e.g. "
        "visual_transformer_blocks.0.video_dec_block.feed_forward.net.0.proj, ")


def test_patterns_match_whole_name_parts_and_keep_each_fused_gemm_whole():
    """`visual_transformer_blocks.1` is block 1, not 10-19; naming one of Q, K, V keeps the three in bf16 in both
    layouts (speed mode runs them as one GEMM), so the same GEMMs are quantized fused or not; a pattern that keeps
    everything in bf16 is refused."""
    from k6serve.speed.fp8_linears import apply_quantization, is_ignored, possible_linear_names

    names = possible_linear_names(60)
    assert {name.split(".")[1] for name in names if is_ignored(name, ("visual_transformer_blocks.1",))} == {"1"}
    assert sum(is_ignored(name, ("*feed*",)) for name in names) == sum(is_ignored(name, ("feed_forward",))
                                                                       for name in names) == 120
    # A part N-M is a range of block indices: the first 30 blocks, as the two globs that spell it.
    blocks = {int(name.split(".")[1]) for name in names if is_ignored(name, ("visual_transformer_blocks.0-29",))}
    assert blocks == set(range(30)) == {int(name.split(".")[1]) for name in names if is_ignored(
        name, ("visual_transformer_blocks.?", "visual_transformer_blocks.[12]?"))}
    assert not any(is_ignored(name, ("visual_transformer_blocks.29-0",)) for name in names)  # reversed: nothing
    assert sum(is_ignored(name, ("30-59.video_dec_block.feed_forward",)) for name in names) == 60
    unfused, fused = _tiny_dit(fused=False), _tiny_dit(fused=True)
    for pattern in ("to_query", "self_attention.to_key", "to_query_key_value", "av_cross_attention.to_value"):
        kept = {}
        for name, model in (("unfused", unfused), ("fused", fused)):
            model = _tiny_dit(fused=name == "fused")
            apply_quantization(model, "fp8", (pattern,))
            attention = model.visual_transformer_blocks[0].video_dec_block.self_attention
            kept[name] = not any(isinstance(module, Fp8Linear) for module in attention.children()
                                 if module is not attention.out_layer)
        assert kept["unfused"] == kept["fused"] == (not pattern.startswith("av_")), pattern
    with pytest.raises(ValueError, match="--quantization-ignored-layers visual_transformer_blocks keeps every "
                                         "quantizable linear of the DiT in bf16, so --quantization fp8 would change "
                                         "nothing"):
        apply_quantization(_tiny_dit(fused=True), "fp8", ("visual_transformer_blocks",))


def test_speed_mode_quantizes_after_fusing_and_before_compiling(monkeypatch):
    """Exercised on CPU modules by naming a CUDA device (no forward is run): the fused Q/K/V is one e4m3 linear, and
    the compiled blocks are the quantized ones."""
    from k6serve.speed import apply_performance_mode

    monkeypatch.setattr(torch.backends.cudnn, "benchmark", False)
    model = _tiny_dit(fused=False)

    class Models:
        transformer = model

    report = apply_performance_mode(Models(), "speed", "cuda", quantization="fp8",
                                    quantization_ignored_layers=("av_cross_attention",))
    num_blocks = len(model.visual_transformer_blocks)
    assert report.num_quantized_linears == 8 * num_blocks and report.num_compiled_blocks > 0
    assert any(f"{8 * num_blocks} DiT linears in e4m3" in note for note in report.notes)
    block = model.visual_transformer_blocks[0]
    assert isinstance(block.video_dec_block.self_attention.to_query_key_value, Fp8Linear)
    assert type(block.av_cross_attention.to_key_value) is nn.Linear
    torch._dynamo.reset()
    eager = _tiny_dit(fused=False)

    class EagerModels:
        transformer = eager

    report = apply_performance_mode(EagerModels(), "balanced", "cpu", quantization="fp8")
    assert report.num_quantized_linears == 12 * num_blocks  # unfused: Q, K, V and audio_from_video's K, V apart
    assert report.notes == (f"balanced: {12 * num_blocks} DiT linears in e4m3 (--quantization fp8), no other "
                            "transforms",)


def test_the_worker_refuses_sr_models_and_gpus_without_e4m3_before_loading(monkeypatch):
    import types

    from k6serve.config import ModelConfig
    from k6serve.models.variants import GENERATION
    from k6serve.runtime.worker_preflight import check_quantization

    def check(family, device):
        check_quantization(types.SimpleNamespace(model=ModelConfig(model_path="demo", quantization="fp8")),
                           types.SimpleNamespace(family=family, name="Kandinsky-6.0-VSR"), torch.device(device),
                           folder=None)

    with pytest.raises(ValueError, match="--quantization fp8 applies to the generation DiT; Kandinsky-6.0-VSR is a "
                                         "super-resolution model. Drop the flag."):
        check("super_resolution", "cpu")
    check(GENERATION, "cpu")  # the CPU runs the math written out
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    with pytest.raises(ValueError, match="--quantization fp8 needs e4m3 GEMMs, which GPUs of compute capability 8.9 "
                                         "or newer have \\(Ada, Hopper, Blackwell\\); NVIDIA A100-SXM4-80GB is 8.0. "
                                         "Drop the flag."):
        check(GENERATION, "cuda")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    check(GENERATION, "cuda")


def test_an_ignored_layer_pattern_that_matches_nothing_is_refused_before_the_weights_load(monkeypatch):
    from k6serve.engine_arguments import build_engine_config
    from k6serve.runtime.worker import ModelWorker

    def no_load(self, folder):
        raise AssertionError("the weights were loaded")

    monkeypatch.setattr(ModelWorker, "_build_pipeline", no_load)
    with pytest.raises(ValueError, match="--quantization-ignored-layers 'visual_transformer_blocks.7.' matches none "
                                         "of the DiT's quantizable linears"):
        ModelWorker(build_engine_config("demo", device="cpu", quantization="fp8",
                                        quantization_ignored_layers=["feed_forward", "visual_transformer_blocks.7."]))
    with pytest.raises(AssertionError, match="the weights were loaded"):  # the demo DiT's blocks 0 and 1 pass
        ModelWorker(build_engine_config("demo", device="cpu", quantization="fp8",
                                        quantization_ignored_layers=["visual_transformer_blocks.1."]))


def test_the_demo_generates_quantized_and_refuses_adapters(tmp_path):
    from k6serve import DiffGenerator

    with DiffGenerator.from_pretrained("demo", device="cpu", quantization="fp8",
                                       quantization_ignored_layers=["self_attention"]) as generator:
        result = generator.generate(prompt="x", seed=1, output_path=str(tmp_path))
        assert len(list(tmp_path.glob("*.mp4"))) == 1
        assert (result.num_frames, result.height, result.width) == (17, 64, 96)
        with pytest.raises(ValueError, match="The DiT is quantized with quantization='fp8' and takes no LoRA "
                                             "adapters: its linears hold e4m3 weights"):
            generator.set_lora("style", str(tmp_path / "missing.safetensors"))
        base = generator.generate(prompt="x", seed=1, save_output=False, loras={})  # the base model: all it runs
        assert base.num_frames == 17


def test_a_typod_ignored_layer_is_refused_before_the_ranks_start(capsys, no_ranks):
    """Before any rank process starts (a load of minutes for a real checkpoint)."""
    from k6serve.cli.main import main

    assert main(["generate", "--model-path", "demo", "--prompt", "x", "--quantization", "fp8",
                 "--quantization-ignored-layers", "feed_forwrd", "--no-save-output"]) == 2
    assert "error: --quantization-ignored-layers 'feed_forwrd' matches none of the DiT's" in capsys.readouterr().err


def test_cli_loras_naming_adapters_are_refused_before_the_load_and_the_base_model_is_not():
    from k6serve.engine_arguments import build_engine_config
    from k6serve.lora.preflight import check_request_loras

    config = build_engine_config("demo", quantization="fp8")
    with pytest.raises(ValueError) as refused:
        check_request_loras(config, {"style": 1.0})
    assert str(refused.value) == ("--loras names LoRA adapters, but the DiT is quantized with --quantization fp8 and "
                                  "takes no LoRA adapters: its linears hold e4m3 weights, and adapters update bf16 "
                                  "ones. Drop --loras, or --quantization.")
    check_request_loras(config, {})  # the base model


def test_a_config_file_gives_the_ignored_layers_as_names_only(tmp_path, capsys):
    from k6serve.cli.main import main

    config = tmp_path / "run.yaml"
    config.write_text("quantization: fp8\nquantization-ignored-layers: [0]\n")
    assert main(["generate", "--model-path", "demo", "--prompt", "x", "--config", str(config)]) == 2
    assert (f"error: --config {config}: --quantization-ignored-layers: takes names (a string, or a list of strings), "
            "got [0]; quote a number to mean it as a name") in capsys.readouterr().err
