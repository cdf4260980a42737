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


def test_bench_rows_and_flag_checks(monkeypatch):
    from k6serve.bench import __main__ as bench

    captured = {}
    monkeypatch.setattr(bench, "run_dit", lambda options: captured.setdefault("options", options) and [])
    args = bench.build_parser().parse_args(["--tiny", "--fp8-linears", "ffn", "video", "--fp8-fast-accumulation"])
    bench.stage_runners(args)["dit"]()
    assert captured["options"].fp8_linears == ("ffn", "video") and captured["options"].fp8_fast_accumulation
    with pytest.raises(SystemExit, match="--fp8-linears times the fused \\+ compiled DiT once more in e4m3: drop "
                                         "--skip-speed"):
        bench.stage_runners(bench.build_parser().parse_args(["--tiny", "--fp8-linears", "ffn", "--skip-speed"]))
    with pytest.raises(SystemExit, match="--fp8-fast-accumulation times the --fp8-linears rows' model once more: "
                                         "add --fp8-linears"):
        bench.stage_runners(bench.build_parser().parse_args(["--tiny", "--fp8-fast-accumulation"]))
    with pytest.raises(SystemExit):  # argparse: not a scope
        bench.build_parser().parse_args(["--fp8-linears", "all"])


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


@pytest.mark.skipif(not torch.cuda.is_available(), reason="cuBLASLt's row-wise FP8 GEMM needs a CUDA GPU (Hopper+)")
@pytest.mark.parametrize("bias", [False, True])
def test_cuda_fp8_linear_matches_its_math_eager_and_compiled(bias):
    """On the GPU the same layer runs cuBLASLt's e4m3 GEMM (fp32 accumulation), eager and inside torch.compile
    (inductor fuses the row maximum and the cast into the producer of the input): both within bf16 rounding of the
    math written out in fp32."""
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("e4m3 GEMMs need compute capability 8.9 or newer")
    generator = torch.Generator(device="cuda").manual_seed(2)
    linear = nn.Linear(512, 384, bias=bias, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(3, 256, 512, device="cuda", generator=generator).to(torch.bfloat16)
    layer = Fp8Linear.from_linear(linear)
    expected = dequantized_linear(x, layer).float()
    eager = layer(x)
    compiled = torch.compile(lambda t: layer(torch.nn.functional.gelu(t) + 0.5 * t), fullgraph=True)(x)
    expected_compiled = dequantized_linear(torch.nn.functional.gelu(x) + 0.5 * x, layer).float()
    for output, reference in ((eager, expected), (compiled, expected_compiled)):
        assert output.dtype == torch.bfloat16
        torch.testing.assert_close(output.float(), reference, rtol=2e-2, atol=2e-2)
    set_fast_accumulation(nn.Sequential(layer), True)
    torch.testing.assert_close(layer(x).float(), expected, rtol=3e-2, atol=3e-2)
