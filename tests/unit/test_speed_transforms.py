"""Speed transforms on a tiny Kandinsky 6 DiT: fused projections, regional compile, performance mode, warm-up.

Tolerances: fused projections in fp32 on CPU within 1e-5 * max|ref| of the unfused model; in bf16 the
velocities keep cosine >= 0.9999 (rounding of a different GEMM shape only). Regional compile is checked
with the cheap "eager" dynamo backend (traces every block, bitwise equal) and, when K6SERVE_SLOW_TESTS is
set, with inductor within 1e-4 relative.
"""

import copy
import dataclasses
import os
import types

import pytest
import torch

from k6serve.bench.dit import dit_inputs
from k6serve.bench.geometry import generation_geometry
from k6serve.bench.measure import cosine_similarity
from k6serve.bench.tiny import TINY_TRANSFORMER_CONFIG
from k6serve.models.kandinsky6.checkpoint import build_dummy_transformer
from k6serve.models.kandinsky6.config import Kandinsky6TransformerConfig
from k6serve.models.kandinsky6.plan import kandinsky6_plan
from k6serve.models.kandinsky6.attention import Kandinsky6Attention
from k6serve.request import GenerateRequest
from k6serve.speed import (
    FusedProjectionAttention,
    apply_fused_projections,
    apply_performance_mode,
    apply_regional_compile,
    apply_vae_speedups,
    is_compiled,
    warmup,
)

CONFIG = Kandinsky6TransformerConfig.from_json_dict(TINY_TRANSFORMER_CONFIG)
GEOMETRY = generation_geometry(64, 96, 9, num_text_tokens=10)
CPU = torch.device("cpu")


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _model(dtype=torch.float32):
    return build_dummy_transformer(TINY_TRANSFORMER_CONFIG, device=CPU, dtype=dtype, seed=3)


def _inputs(dtype=torch.float32, with_mask=True):
    inputs = dit_inputs(CONFIG, GEOMETRY, device=CPU, dtype=dtype, seed=4)
    if with_mask:
        mask = torch.ones(1, GEOMETRY.num_text_tokens, dtype=torch.bool)
        mask[:, 7:] = False  # padded prompt: the masked text self/cross-attention paths run too
        inputs["encoder_attention_mask"] = mask
    return inputs


def _run(model, inputs):
    with torch.inference_mode():
        return model(**inputs)


def _relative_error(actual, expected):
    return float((actual.double() - expected.double()).abs().max() / expected.double().abs().max())


def test_fused_projections_match_unfused_in_fp32():
    reference = _model()
    fused = copy.deepcopy(reference)
    num_attentions = sum(isinstance(m, Kandinsky6Attention) for m in reference.modules())
    assert apply_fused_projections(fused) == num_attentions == 16
    attentions = [m for m in fused.modules() if isinstance(m, Kandinsky6Attention)]
    assert len(attentions) == 16 and all(isinstance(m, FusedProjectionAttention) for m in attentions)
    inputs = _inputs()
    (video, audio), (expected_video, expected_audio) = _run(fused, inputs), _run(reference, inputs)
    print(
        f"fp32 fused vs unfused: video {_relative_error(video, expected_video):.2e}, "
        f"audio {_relative_error(audio, expected_audio):.2e} (relative max abs diff)"
    )
    assert _relative_error(video, expected_video) <= 1e-5
    assert _relative_error(audio, expected_audio) <= 1e-5


def test_fused_projections_in_bf16_keep_cosine():
    reference = _model(torch.bfloat16)
    fused = copy.deepcopy(reference)
    apply_fused_projections(fused)
    inputs = _inputs(torch.bfloat16)
    (video, audio), (expected_video, expected_audio) = _run(fused, inputs), _run(reference, inputs)
    cos_video, cos_audio = (
        cosine_similarity(video, expected_video),
        cosine_similarity(audio, expected_audio),
    )
    print(f"bf16 fused vs unfused: cosine video {cos_video:.6f}, audio {cos_audio:.6f}")
    assert cos_video >= 0.9999 and cos_audio >= 0.9999


def test_fused_modules_keep_norms_core_and_backend():
    model = _model()
    original = model.visual_transformer_blocks[0].video_dec_block.self_attention
    cross = model.visual_transformer_blocks[0].va_cross_attention
    apply_fused_projections(model)
    fused = model.visual_transformer_blocks[0].video_dec_block.self_attention
    assert isinstance(fused, FusedProjectionAttention) and fused.is_self_attention
    assert (
        fused.inner_attention is original.inner_attention
        and fused.query_norm is original.query_norm
    )
    assert fused.to_query_key_value.weight.shape == (3 * CONFIG.model_dim, CONFIG.model_dim)
    fused_cross = model.visual_transformer_blocks[0].va_cross_attention
    assert not fused_cross.is_self_attention and fused_cross.to_query is cross.to_query
    # K/V come from the audio stream (width model_dim_a) and project to the video width.
    assert fused_cross.to_key_value.weight.shape == (2 * CONFIG.model_dim, CONFIG.audio_model_dim)
    assert torch.equal(fused_cross.to_key_value.weight[: CONFIG.model_dim], cross.to_key.weight)
    model.set_attention_backend("sdpa")  # still reaches every core
    assert apply_fused_projections(model) == 0  # idempotent


def test_regional_compile_raises_dynamos_limit_of_graph_variants():
    """All blocks of a class share one code object; past dynamo's default of 8 variants (a served DiT gathers them:
    dynamic lengths, each new set of LoRA-wrapped layers) they would run eager for good, silently."""
    import torch._dynamo.config as dynamo_config

    limit_name = "recompile_limit" if hasattr(dynamo_config, "recompile_limit") else "cache_size_limit"
    # dynamo's own patch(), not monkeypatch: pytest 9's undo deletes an attribute that was not in the module's
    # __dict__, which hides a dynamo config for good (test_compiled_vae_decoder_only_when_asked).
    with dynamo_config.patch(**{limit_name: 8}):
        apply_regional_compile(_model(), kandinsky6_plan(CONFIG), backend="eager")
        assert getattr(dynamo_config, limit_name) >= 64
    torch._dynamo.reset()


def _compile_calls(monkeypatch, **kwargs):
    """The keyword arguments `apply_regional_compile` gives each block's `nn.Module.compile` (nothing compiled)."""
    calls = []
    monkeypatch.setattr(torch.nn.Module, "compile", lambda self, **options: calls.append(options))
    apply_regional_compile(_model(), kandinsky6_plan(CONFIG), **kwargs)
    assert len(calls) == 6
    return calls


@pytest.mark.parametrize("mode", [None, "default"])
def test_regional_compile_is_deterministic_by_default(monkeypatch, mode):
    """Inductor's timed choice of reduction configurations made two GPU processes' MP4s differ (fifty-eighth
    session): the blocks compile in its deterministic mode unless the environment says otherwise."""
    monkeypatch.delenv("TORCHINDUCTOR_DETERMINISTIC", raising=False)
    calls = _compile_calls(monkeypatch, mode=mode)
    assert all(call["options"] == {"deterministic": True} and call["mode"] is None for call in calls)
    assert all(call["backend"] == "inductor" for call in calls)


@pytest.mark.parametrize("setting", ["0", "1"])
def test_regional_compile_leaves_the_environment_switch_to_torch(monkeypatch, setting):
    # "0": the user asked for inductor's timing back; "1": torch's global switch already does it for every compile.
    monkeypatch.setenv("TORCHINDUCTOR_DETERMINISTIC", setting)
    assert all(call["options"] is None for call in _compile_calls(monkeypatch))


@pytest.mark.parametrize("kwargs", [{"mode": "max-autotune"}, {"backend": "eager"}])
def test_regional_compile_options_only_for_inductor_default_mode(monkeypatch, kwargs):
    # max-autotune chooses its GEMM templates by timing them, which the deterministic mode would skip; another backend
    # takes no inductor options.
    monkeypatch.delenv("TORCHINDUCTOR_DETERMINISTIC", raising=False)
    calls = _compile_calls(monkeypatch, **kwargs)
    assert all(call["options"] is None for call in calls)
    assert all(call["mode"] == kwargs.get("mode") for call in calls)


def test_regional_compile_options_are_accepted_by_torch(monkeypatch):
    """torch.compile checks the option names when it wraps (inductor's config has `deterministic`): a block wrapped
    with them is compiled, and nothing runs."""
    monkeypatch.delenv("TORCHINDUCTOR_DETERMINISTIC", raising=False)
    torch._dynamo.reset()
    model = _model()
    assert apply_regional_compile(model, kandinsky6_plan(CONFIG)) == 6
    assert all(is_compiled(block) for block in model.visual_transformer_blocks)
    with pytest.raises(RuntimeError, match="Unexpected optimization option"):
        torch.compile(torch.nn.Identity(), options={"no_such_option": True})
    torch._dynamo.reset()


def test_regional_compile_eager_backend_traces_blocks_bitwise():
    torch._dynamo.reset()
    reference = _model()
    compiled = copy.deepcopy(reference)
    apply_fused_projections(compiled)
    plan = kandinsky6_plan(CONFIG)
    assert apply_regional_compile(compiled, plan, backend="eager") == 2 + 2 + 2
    assert all(is_compiled(block) for block in compiled.visual_transformer_blocks)
    assert apply_regional_compile(compiled, plan, backend="eager") == 0
    fused_eager = copy.deepcopy(reference)
    apply_fused_projections(fused_eager)
    inputs = _inputs()
    video, audio = _run(compiled, inputs)
    expected_video, expected_audio = _run(fused_eager, inputs)
    assert torch.equal(video, expected_video) and torch.equal(audio, expected_audio)
    # The state dict keeps its names (nn.Module.compile wraps in place, no `_orig_mod.` prefix).
    assert list(compiled.state_dict()) == list(fused_eager.state_dict())


@pytest.mark.skipif(
    not os.environ.get("K6SERVE_SLOW_TESTS"), reason="inductor on CPU takes minutes"
)
def test_regional_compile_inductor_matches_eager():
    torch._dynamo.reset()
    reference = _model()
    compiled = copy.deepcopy(reference)
    apply_regional_compile(compiled, kandinsky6_plan(CONFIG))
    inputs = _inputs()
    (video, audio), (expected_video, expected_audio) = (
        _run(compiled, inputs),
        _run(reference, inputs),
    )
    assert _relative_error(video, expected_video) <= 1e-4
    assert _relative_error(audio, expected_audio) <= 1e-4


@dataclasses.dataclass
class _Models:
    transformer: torch.nn.Module
    vae: torch.nn.Module | None = None


def test_performance_mode_is_a_no_op_on_cpu():
    model = _model()
    before = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    for mode in ("speed", "balanced", "memory"):
        report = apply_performance_mode(
            _Models(transformer=model, vae=torch.nn.Conv3d(2, 2, 1)), mode, "cpu"
        )
        assert not report.applied and report.mode == mode
    assert any(isinstance(m, Kandinsky6Attention) for m in model.modules())
    assert not any(is_compiled(block) for block in model.visual_transformer_blocks)
    assert all(torch.equal(before[name], tensor) for name, tensor in model.state_dict().items())


def test_speed_mode_composition_for_cuda(monkeypatch):
    """The "speed" composition, exercised on CPU modules by naming a CUDA device (no forward is run)."""
    from k6serve.speed.vae import CUDNN_BENCHMARK_ENVIRONMENT_VARIABLE

    monkeypatch.setattr(torch.backends.cudnn, "benchmark", False)
    monkeypatch.delenv(CUDNN_BENCHMARK_ENVIRONMENT_VARIABLE, raising=False)
    model, vae = _model(), torch.nn.Conv3d(2, 2, 3)
    report = apply_performance_mode(_Models(transformer=model, vae=vae), "speed", "cuda")
    assert (report.num_fused_attentions, report.num_compiled_blocks) == (16, 6)
    # channels_last_3d stays off: on an H200 it made the decode 1.55x slower (docs/benchmarks.md). cuDNN's
    # autotuner too: outputs differed from engine to engine, for no gain (fifty-eighth session).
    assert report.vae == () and report.applied
    assert not torch.backends.cudnn.benchmark
    assert not vae.weight.is_contiguous(memory_format=torch.channels_last_3d)
    assert all(is_compiled(block) for block in model.video_text_transformer_blocks)
    again = apply_performance_mode(_Models(transformer=model, vae=vae), "speed", "cuda")
    assert (again.num_fused_attentions, again.num_compiled_blocks) == (0, 0)
    # The SR pipeline wraps its K-VAE module as `.model`; the autotuner asked for shows that it is reached.
    monkeypatch.setenv(CUDNN_BENCHMARK_ENVIRONMENT_VARIABLE, "1")
    wrapped = torch.nn.Conv3d(2, 2, 3)
    report = apply_performance_mode(
        _Models(transformer=_model(), vae=types.SimpleNamespace(model=wrapped)), "speed", "cuda"
    )
    assert report.vae == ("cudnn_benchmark",)  # the SR K-VAE gets the same (wrapped) treatment
    assert torch.backends.cudnn.benchmark
    torch._dynamo.reset()


def test_cudnn_benchmark_is_on_only_when_its_variable_is_1(monkeypatch):
    """cuDNN's heuristics choose the algorithms (one choice for every thread and process) unless
    `K6SERVE_CUDNN_BENCHMARK=1` asks for the autotuner."""
    from k6serve.speed.vae import CUDNN_BENCHMARK_ENVIRONMENT_VARIABLE, apply_vae_speedups

    monkeypatch.setattr(torch.backends.cudnn, "benchmark", False)
    for value in (None, "0", "", "yes"):
        if value is None:
            monkeypatch.delenv(CUDNN_BENCHMARK_ENVIRONMENT_VARIABLE, raising=False)
        else:
            monkeypatch.setenv(CUDNN_BENCHMARK_ENVIRONMENT_VARIABLE, value)
        assert apply_vae_speedups(torch.nn.Conv3d(2, 2, 3), torch.device("cuda")) == []
        assert not torch.backends.cudnn.benchmark
    monkeypatch.setenv(CUDNN_BENCHMARK_ENVIRONMENT_VARIABLE, " 1 ")
    assert apply_vae_speedups(torch.nn.Conv3d(2, 2, 3), torch.device("cuda")) == ["cudnn_benchmark"]
    assert torch.backends.cudnn.benchmark


def test_fused_norm_rope_kernel_is_part_of_speed_mode_unless_turned_off(monkeypatch):
    """Speed mode routes every fused attention's Q/K RMSNorm + RoPE through the Triton kernel (reported in the
    notes); `K6SERVE_FUSED_NORM_ROPE=0` keeps inductor's fused ops."""
    from k6serve.speed.performance_mode import FUSED_NORM_ROPE_ENVIRONMENT_VARIABLE

    monkeypatch.setattr(torch.backends.cudnn, "benchmark", False)
    monkeypatch.delenv(FUSED_NORM_ROPE_ENVIRONMENT_VARIABLE, raising=False)
    model = _model()
    report = apply_performance_mode(_Models(transformer=model), "speed", "cuda")
    fused = [module for module in model.modules() if hasattr(module, "fused_norm_rope")]
    assert len(fused) == 16 and all(module.fused_norm_rope for module in fused)
    assert any("fused RMSNorm + RoPE kernel on 16 attentions" in note for note in report.notes)
    torch._dynamo.reset()
    monkeypatch.setenv(FUSED_NORM_ROPE_ENVIRONMENT_VARIABLE, "0")
    model = _model()
    report = apply_performance_mode(_Models(transformer=model), "speed", "cuda")
    assert not any(module.fused_norm_rope for module in model.modules() if hasattr(module, "fused_norm_rope"))
    assert any("kernel off" in note for note in report.notes)
    torch._dynamo.reset()


def test_performance_mode_rejects_unknown_mode():
    with pytest.raises(ValueError, match="--performance-mode must be one of"):
        apply_performance_mode(_Models(transformer=_model()), "turbo", "cpu")


def test_vae_speedups_do_nothing_off_cuda():
    conv = torch.nn.Conv3d(2, 2, 3)
    assert apply_vae_speedups(conv, CPU, compile_decoder=True) == []
    assert conv.weight.is_contiguous()


def test_channels_last_3d_vae_decode_within_one_level():
    """The layout change the CUDA speed-up makes, checked on CPU: uint8 frames within 1/255 of the default."""
    from k6serve.bench.components import build_video_vae
    from k6serve.pipelines.decode import decode_video

    vae = build_video_vae(tiny=True, device=CPU, dtype=torch.float32)
    latents = torch.randn(1, 5, 8, 12, 16, generator=torch.Generator().manual_seed(0))
    expected = decode_video(vae, latents).frames_THWC
    vae.to(memory_format=torch.channels_last_3d)
    actual = decode_video(vae, latents).frames_THWC
    assert actual.shape == expected.shape == (17, 64, 96, 3)
    assert int(abs(actual.astype(int) - expected.astype(int)).max()) <= 1


def _request(steps=10):
    return GenerateRequest(
        prompt="a fox",
        negative_prompt=None,
        image_path=None,
        seed=1,
        height=64,
        width=96,
        num_frames=17,
        fps=24.0,
        num_inference_steps=steps,
        guidance_scale=1.0,
    )


def test_warmup_runs_a_short_request_and_reports_its_cost():
    seen = []
    report = warmup(seen.append, _request(), "server")
    assert len(seen) == 1 and seen[0].num_inference_steps == 2 and seen[0].height == 64
    assert report.mode == "server" and report.seconds >= 0.0
    assert report.shape == (17, 64, 96) and report.num_inference_steps == 2
    assert warmup(seen.append, _request(1), "request").num_inference_steps == 1


def test_warmup_off_runs_nothing_and_rejects_unknown_modes():
    seen = []
    report = warmup(seen.append, _request(), "off")
    assert seen == [] and report.seconds == 0.0 and report.shape is None
    with pytest.raises(ValueError, match="--warmup-mode must be one of"):
        warmup(seen.append, _request(), "always")


class _Decoder(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv3d(2, 2, 1)

    def forward(self, x):
        return self.conv(x)


class _HunyuanLikeVae(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.decoder = _Decoder()


def test_compiled_vae_decoder_only_when_asked(monkeypatch, tiny_sr_configs):
    """--compile-vae is opt-in: "speed" alone leaves the decoder eager; with it, HunyuanVideo's decoder is compiled
    and the SR K-VAE's blocks are (SRVAE calls them one by one, never decoder.forward)."""
    from k6serve.speed.vae import CHANNELS_LAST_ENVIRONMENT_VARIABLE

    monkeypatch.delenv(CHANNELS_LAST_ENVIRONMENT_VARIABLE, raising=False)  # the default, whatever the shell says
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", False)
    vae = _HunyuanLikeVae()
    report = apply_performance_mode(_Models(transformer=_model(), vae=vae), "speed", "cuda")
    assert report.vae == () and not is_compiled(vae.decoder)
    import torch._dynamo.config as dynamo_config

    limit_name = "recompile_limit" if hasattr(dynamo_config, "recompile_limit") else "cache_size_limit"
    # dynamo's default, whatever earlier tests raised it to. Its own patch(), not monkeypatch: pytest 9's undo
    # deletes an attribute that was not in the module's __dict__, which hides a dynamo config for good.
    with dynamo_config.patch(**{limit_name: 8}):
        report = apply_performance_mode(_Models(transformer=_model(), vae=vae), "speed", "cuda",
                                        compile_vae_decoder=True)
        assert report.vae == ("folded_upsample", "compile_decoder") and is_compiled(vae.decoder)
        # Every tile shape gets its graph (spatial tiles add shapes), rather than dynamo's eager fallback after 8.
        assert getattr(dynamo_config, limit_name) >= 64

    from k6serve.models.kandinsky6_sr.checkpoint import build_empty_modules
    from k6serve.speed.vae import compile_sr_decoder_blocks

    configs = tiny_sr_configs
    _, kvae, _ = build_empty_modules(configs, dtype=torch.float32)
    applied = apply_vae_speedups(kvae, torch.device("cuda"), compile_decoder=True)
    assert applied == ["channels_last_3d", "commuted_spatial_norms", "subpixel_upsample",
                       "single_causal_conv", "compile_decoder_blocks"]
    decoder = kvae.decoder
    blocks = [decoder.mid.block_1, decoder.mid.block_2, decoder.norm_out] + [b for up in decoder.up for b in up.block]
    assert all(is_compiled(block) for block in blocks) and not is_compiled(decoder)
    assert compile_sr_decoder_blocks(kvae) == len(blocks) + sum(hasattr(up, "upsample") for up in decoder.up)
    torch._dynamo.reset()


@pytest.mark.parametrize("setting", [None, "0", "1"])
def test_compiled_vae_decoders_compile_deterministically_unless_the_environment_says(monkeypatch, tiny_sr_configs,
                                                                                    setting):
    """The decoders' compiles take the DiT blocks' choice (`inductor_options`): inductor's deterministic mode unless
    `TORCHINDUCTOR_DETERMINISTIC` is set, which then rules every compile of the process (torch's own switch)."""
    from k6serve.models.kandinsky6_sr.checkpoint import build_empty_modules

    if setting is None:
        monkeypatch.delenv("TORCHINDUCTOR_DETERMINISTIC", raising=False)
    else:
        monkeypatch.setenv("TORCHINDUCTOR_DETERMINISTIC", setting)
    calls = []
    monkeypatch.setattr(torch.nn.Module, "compile", lambda self, **options: calls.append(options))
    apply_vae_speedups(_HunyuanLikeVae(), torch.device("cuda"), compile_decoder=True)
    _, kvae, _ = build_empty_modules(tiny_sr_configs, dtype=torch.float32)
    apply_vae_speedups(kvae, torch.device("cuda"), compile_decoder=True)
    assert len(calls) > 2  # HunyuanVideo's decoder, then the K-VAE decoder's blocks one by one
    expected = {"deterministic": True} if setting is None else None
    assert all(call["options"] == expected and call["dynamic"] is False for call in calls)


def test_vae_channels_last_beside_the_compiled_sr_decoder(monkeypatch, tiny_sr_configs):
    """With --compile-vae the SR K-VAE's 5-D Conv3d weights are stored NDHWC (measured faster on the H200);
    `K6SERVE_VAE_CHANNELS_LAST=0` leaves them; eager decoders are never converted; HunyuanVideo's compiled
    decoder only with `=1`. (Meta weights here; that the decoded frames do not change is checked by
    test_bench.py's `gpu_profile.py kvae --tiny --channels-last` run.)"""
    from k6serve.models.kandinsky6_sr.checkpoint import build_empty_modules
    from k6serve.speed.vae import CHANNELS_LAST_ENVIRONMENT_VARIABLE
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", False)
    configs = tiny_sr_configs

    def fresh_kvae():
        _, kvae, _ = build_empty_modules(configs, dtype=torch.float32)
        return kvae, [m for m in kvae.decoder.modules() if isinstance(m, torch.nn.Conv3d) and m.kernel_size != (1, 1, 1)]

    def channels_last(conv):
        return conv.weight.is_contiguous(memory_format=torch.channels_last_3d) and not conv.weight.is_contiguous()

    monkeypatch.delenv(CHANNELS_LAST_ENVIRONMENT_VARIABLE, raising=False)
    kvae, convs = fresh_kvae()
    assert "channels_last_3d" not in apply_vae_speedups(kvae, torch.device("cuda"))  # eager: never converted
    assert convs and not any(channels_last(conv) for conv in convs)
    applied = apply_vae_speedups(kvae, torch.device("cuda"), compile_decoder=True)
    assert applied == ["channels_last_3d", "commuted_spatial_norms", "subpixel_upsample",
                       "single_causal_conv", "compile_decoder_blocks"]
    assert all(channels_last(conv) for conv in convs)
    assert apply_vae_speedups(fresh_kvae()[0], torch.device("cpu"), compile_decoder=True) == []  # CPU: untouched
    torch._dynamo.reset()

    monkeypatch.setenv(CHANNELS_LAST_ENVIRONMENT_VARIABLE, "0")
    kvae, convs = fresh_kvae()
    assert "channels_last_3d" not in apply_vae_speedups(kvae, torch.device("cuda"), compile_decoder=True)
    assert not any(channels_last(conv) for conv in convs)
    torch._dynamo.reset()

    hunyuan = _HunyuanLikeVae()
    monkeypatch.delenv(CHANNELS_LAST_ENVIRONMENT_VARIABLE)
    assert "channels_last_3d" not in apply_vae_speedups(hunyuan, torch.device("cuda"), compile_decoder=True)
    monkeypatch.setenv(CHANNELS_LAST_ENVIRONMENT_VARIABLE, "1")
    assert "channels_last_3d" in apply_vae_speedups(_HunyuanLikeVae(), torch.device("cuda"), compile_decoder=True)
    torch._dynamo.reset()


@pytest.mark.parametrize(
    ("variable", "name", "module_class"),
    [
        ("K6SERVE_KVAE_COMMUTED_NORMS", "commuted_spatial_norms", "Kandinsky6SRSpatialNorm3D"),
        ("K6SERVE_KVAE_SUBPIXEL_UPSAMPLE", "subpixel_upsample", "Kandinsky6SRUpsample"),
        ("K6SERVE_KVAE_SINGLE_CAUSAL_CONV", "single_causal_conv", "Kandinsky6SRCausalConv3d"),
    ],
)
def test_kvae_rewrites_by_default_beside_the_compiled_decoder(monkeypatch, tiny_sr_configs, variable, name,
                                                               module_class):
    """With --compile-vae the SR K-VAE's latent-conditioned norms (speed/kvae_spatial_norm.py), upsamplers
    (speed/kvae_upsample.py) and causal convolutions (speed/kvae_causal_conv.py) are rewritten before the blocks are
    compiled; their variable set to "0", or the eager decode, keep diffusers' forward."""
    from k6serve.models.kandinsky6_sr.checkpoint import build_empty_modules
    from k6serve.speed import vae as vae_speed
    assert variable in (vae_speed.COMMUTED_NORMS_ENVIRONMENT_VARIABLE, vae_speed.SUBPIXEL_UPSAMPLE_ENVIRONMENT_VARIABLE,
                        vae_speed.SINGLE_CAUSAL_CONV_ENVIRONMENT_VARIABLE)
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", False)
    configs = tiny_sr_configs

    def rewritten(kvae):
        return [m for m in kvae.decoder.modules() if type(m).__name__ == module_class]

    monkeypatch.setenv(variable, "0")
    _, kvae, _ = build_empty_modules(configs, dtype=torch.float32)
    assert name not in apply_vae_speedups(kvae, torch.device("cuda"), compile_decoder=True)
    assert not any("forward" in vars(module) for module in rewritten(kvae))
    torch._dynamo.reset()
    monkeypatch.delenv(variable)
    _, kvae, _ = build_empty_modules(configs, dtype=torch.float32)
    assert name not in apply_vae_speedups(kvae, torch.device("cuda"))  # eager: nothing applied
    assert not any("forward" in vars(module) for module in rewritten(kvae))
    applied = apply_vae_speedups(kvae, torch.device("cuda"), compile_decoder=True)
    assert applied.index(name) < applied.index("compile_decoder_blocks")
    assert rewritten(kvae) and all("forward" in vars(module) for module in rewritten(kvae))
    torch._dynamo.reset()


def test_compile_vae_flag_reaches_the_runtime_config():
    from k6serve.cli.flags import build_parser
    from k6serve.engine_arguments import build_engine_config

    assert build_engine_config("demo").runtime.compile_vae is False
    assert build_engine_config("demo", compile_vae=True).runtime.compile_vae is True
    with pytest.raises(ValueError, match="--compile-vae must be true or false"):
        build_engine_config("demo", compile_vae="sometimes")
    args = build_parser().parse_args(["generate", "--model-path", "demo", "--compile-vae", "true"])
    assert args.compile_vae is True


# The compile flags, each opt-in and for speed mode only: what one compiles, and the fix its refusal ends with.
COMPILE_FLAGS = {
    "compile_vae": ("the VAE decoder", r"Use --performance-mode speed \(with --cpu-offload-components vae .*\), or "
                    r"drop --compile-vae\."),
    "compile_prompt_rewrite": ("the expand_prompts rewrite", r"Use --performance-mode speed, or drop "
                               r"--compile-prompt-rewrite\."),
}


@pytest.mark.parametrize("field", COMPILE_FLAGS)
@pytest.mark.parametrize("mode", ["balanced", "memory"])
def test_compile_flags_outside_speed_mode_are_refused_not_ignored(mode, field, capsys):
    """Only speed mode compiles: `--compile-vae true --performance-mode balanced` ran eager without a word."""
    from k6serve import DiffGenerator
    from k6serve.cli.main import main
    from k6serve.engine_arguments import build_engine_config

    what, fix = COMPILE_FLAGS[field]
    flag = "--" + field.replace("_", "-")
    with pytest.raises(ValueError, match=rf"^{flag} true compiles {what} only under --performance-mode speed; "
                                         rf"--performance-mode {mode} runs eager kernels and would ignore it\. {fix}$"):
        build_engine_config("demo", **{field: True}, performance_mode=mode)
    build_engine_config("demo", **{field: False}, performance_mode=mode)
    with pytest.raises(ValueError, match=rf"^{field}=True compiles .* performance_mode='{mode}' runs eager"):
        DiffGenerator.from_pretrained("demo", **{field: True}, performance_mode=mode)
    assert main(["generate", "--model-path", "demo", "--prompt", "x", "--performance-mode", mode,
                 flag, "true", "--no-save-output"]) == 2
    assert f"error: {flag} true compiles {what} only" in capsys.readouterr().err


@pytest.fixture(scope="module")
def sr_transformer(tmp_path_factory):
    """The tiny SR DiT with the random weights of a tiny Hub-layout checkpoint, fp32."""
    from safetensors.torch import load_file

    from k6serve.models.kandinsky6_sr.config import SRTransformerConfig
    from k6serve.models.kandinsky6_sr.transformer import SRTransformer
    from k6serve.testing.tiny_sr_checkpoint import build_sr_checkpoint

    folder = build_sr_checkpoint(tmp_path_factory.mktemp("sr") / "tiny", seed=3)
    config = SRTransformerConfig.from_json_file(folder / "transformer" / "config.json")
    model = SRTransformer(config).eval().requires_grad_(False)
    model.load_state_dict(
        load_file(folder / "transformer" / "diffusion_pytorch_model.safetensors"), strict=True
    )
    return model


def _sr_inputs():
    generator = torch.Generator().manual_seed(0)
    latent = torch.randn(2, 3, 8, 16, 2 * 8 + 1, generator=generator)
    return {"latent_BTHWC": latent, "timestep_B": torch.tensor([1000.0, 636.4])}


def test_fused_sr_self_attention_matches_unfused_in_fp32(sr_transformer):
    from k6serve.models.kandinsky6_sr.transformer import SelfAttention
    from k6serve.speed.fused_projections import FusedSRSelfAttention

    reference = sr_transformer
    fused = copy.deepcopy(reference)
    num_blocks = reference.config.num_visual_blocks
    assert apply_fused_projections(fused) == num_blocks == 2
    attentions = [m for m in fused.modules() if isinstance(m, SelfAttention)]
    assert len(attentions) == 2 and all(isinstance(m, FusedSRSelfAttention) for m in attentions)
    inputs = _sr_inputs()
    expected, actual = _run(reference, inputs), _run(fused, inputs)
    assert actual.shape == expected.shape == (2, 3, 8, 16, 80)
    print(f"SR fp32 fused vs unfused: {_relative_error(actual, expected):.2e} (relative max abs diff)")
    assert _relative_error(actual, expected) <= 1e-5


def test_fused_sr_self_attention_shares_modules_and_is_idempotent(sr_transformer):
    from k6serve.speed.fused_projections import FusedSRSelfAttention

    model = copy.deepcopy(sr_transformer)
    original = model.visual_transformer_blocks[1].self_attention
    apply_fused_projections(model)
    fused = model.visual_transformer_blocks[1].self_attention
    assert isinstance(fused, FusedSRSelfAttention)
    assert all(
        getattr(fused, name) is getattr(original, name)
        for name in ("query_norm", "key_norm", "inner_attention", "out_layer")
    )
    model_dim = model.config.model_dim
    assert fused.to_query_key_value.weight.shape == (3 * model_dim, model_dim)
    expected_weight = torch.cat([original.to_query.weight, original.to_key.weight, original.to_value.weight])
    expected_bias = torch.cat([original.to_query.bias, original.to_key.bias, original.to_value.bias])
    assert torch.equal(fused.to_query_key_value.weight, expected_weight)
    assert torch.equal(fused.to_query_key_value.bias, expected_bias)
    assert not hasattr(fused, "to_query")
    assert "visual_transformer_blocks.1.self_attention.to_query_key_value.weight" in model.state_dict()
    model.set_attention_backend("sdpa")  # still reaches every core
    assert fused.inner_attention.backend == "torch_sdpa"
    assert apply_fused_projections(model) == 0  # idempotent


def test_fused_projections_skip_meta_sr_weights(sr_transformer):
    from k6serve.models.kandinsky6_sr.transformer import SRTransformer

    with torch.device("meta"):
        model = SRTransformer(sr_transformer.config)
    assert apply_fused_projections(model) == 0


def test_speed_mode_composition_for_cuda_fuses_the_sr_transformer(monkeypatch, sr_transformer):
    """SR-like models object (transformer + wrapped K-VAE) on a named CUDA device; no forward is run."""
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", False)
    model = copy.deepcopy(sr_transformer)
    models = _Models(transformer=model, vae=types.SimpleNamespace(model=torch.nn.Conv3d(2, 2, 3)))
    report = apply_performance_mode(models, "speed", "cuda")
    assert (report.num_fused_attentions, report.num_compiled_blocks) == (2, 2)
    assert report.vae == () and report.applied
    assert all(is_compiled(block) for block in model.visual_transformer_blocks)
    again = apply_performance_mode(models, "speed", "cuda")
    assert (again.num_fused_attentions, again.num_compiled_blocks) == (0, 0)
    torch._dynamo.reset()


def test_speed_mode_blocks_lower_through_inductor_on_cpu(sr_transformer, monkeypatch):
    """One block of each DiT as speed mode builds it (fused projections, the RMSNorm + RoPE op), compiled by
    inductor rather than the eager backend: inductor lowers the custom op itself (`FallbackKernel`), which the
    eager-backend tests never reach; an op argument named `kernel` once broke exactly that on the GPU. The op is
    CUDA-only, so here the call sites are told it applies and the op's launch runs the reference math (~20 s)."""
    from k6serve.ops import rms_norm_rope as op
    from k6serve.speed.fused_projections import apply_fused_norm_rope

    launched = []

    def reference_launch(x, weight, eps, rope, variant=None):
        launched.append(x.shape)
        return op.rms_norm_rope_reference(x, weight, eps, rope, x.dtype).contiguous()

    # Everything the real check asks except a CUDA device (a RoPE table and a norm weight).
    monkeypatch.setattr(op, "supports", lambda x, weight, rope: weight is not None and rope is not None)
    monkeypatch.setattr(op, "launch", reference_launch)
    reference = _model()
    model = copy.deepcopy(reference)
    apply_fused_projections(model)
    assert apply_fused_norm_rope(model) > 0
    model.visual_transformer_blocks[0].compile(backend="inductor", dynamic=False)
    inputs = _inputs()
    (video, audio), (expected_video, expected_audio) = _run(model, inputs), _run(reference, inputs)
    assert _relative_error(video, expected_video) <= 1e-5 and _relative_error(audio, expected_audio) <= 1e-5

    sr_model = copy.deepcopy(sr_transformer)
    apply_fused_projections(sr_model)
    assert apply_fused_norm_rope(sr_model) > 0
    sr_model.visual_transformer_blocks[0].compile(backend="inductor", dynamic=False)
    assert _relative_error(_run(sr_model, _sr_inputs()), _run(sr_transformer, _sr_inputs())) <= 1e-5
    assert launched  # the op ran inside the compiled blocks
    torch._dynamo.reset()
