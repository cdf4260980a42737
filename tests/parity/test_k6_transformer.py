"""k6serve's Kandinsky 6 DiT against diffusers 0.42.1 `Kandinsky6Transformer3DModel` on the same weights.

Tiny config of k6-generation.md §7.1 with every released flag on and re-randomised weights (so every gate
and path matters). fp32 on CPU must match within 1e-5 * max|ref|, and is asserted bitwise because the
math is the same op for op; the bf16 load (keep-fp32 rule) is bitwise too on CPU.
"""

import dataclasses

import pytest
import torch

diffusers = pytest.importorskip("diffusers")
from diffusers import Kandinsky6Transformer3DModel

from k6serve.models.kandinsky6.config import Kandinsky6TransformerConfig
from k6serve.testing.tiny_configs import tiny_transformer_config
from k6serve.models.kandinsky6.released_configs import RELEASED_TRANSFORMER_CONFIGS
from k6serve.models.kandinsky6.transformer import Kandinsky6Transformer, cast_for_inference

TINY = tiny_transformer_config()
DISTILLED = tiny_transformer_config(distilled=True)
BATCH, FRAMES, HEIGHT, WIDTH, TEXT_TOKENS, AUDIO_TOKENS = 2, 3, 4, 6, 10, 7


def _randomise(model, seed):
    """N(0, 0.02) matrices, N(0, 0.01) vectors, norm weights around 1: every gate becomes non-zero."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            std = 0.02 if parameter.ndim > 1 else 0.01
            parameter.copy_(torch.randn(parameter.shape, generator=generator) * std)
            if name.endswith("norm.weight"):
                parameter.add_(1.0)


def _model_pair(config_dict, seed=0):
    reference = Kandinsky6Transformer3DModel(**config_dict).eval()
    _randomise(reference, seed)
    ours = Kandinsky6Transformer(Kandinsky6TransformerConfig(**config_dict)).eval()
    ours.load_state_dict(reference.state_dict(), strict=True)
    return reference, ours


@pytest.fixture(scope="module")
def models():
    return _model_pair(TINY)


def _inputs(dtype=torch.float32, frames=FRAMES, seed=1):
    generator = torch.Generator().manual_seed(seed)
    return {
        "hidden_states": torch.randn(BATCH, frames, HEIGHT, WIDTH, 33, generator=generator).to(
            dtype
        ),
        "encoder_hidden_states": torch.randn(BATCH, TEXT_TOKENS, 32, generator=generator).to(dtype),
        "pooled_projections": torch.randn(BATCH, 32, generator=generator).to(dtype),
        "timestep": torch.tensor([1000.0, 437.5]),
    }


def _audio(dtype=torch.float32):
    return torch.randn(BATCH, AUDIO_TOKENS, 8, generator=torch.Generator().manual_seed(2)).to(dtype)


def _text_mask():
    mask = torch.ones(BATCH, TEXT_TOKENS, dtype=torch.bool)
    mask[1, 6:] = False
    return mask


def _run_both(reference, ours, **inputs):
    with torch.no_grad():
        expected = reference(**inputs, return_dict=False)
        actual = ours(**inputs)
    return expected, actual


def _assert_matches(expected, actual, label):
    """<= 1e-5 * max|ref| and bitwise; prints the numbers."""
    assert actual.shape == expected.shape and actual.dtype == expected.dtype
    max_abs_diff = (actual.double() - expected.double()).abs().max().item()
    reference_scale = expected.double().abs().max().item()
    bitwise = torch.equal(actual, expected)
    print(
        f"{label}: max|diff| {max_abs_diff:.3g}, max|ref| {reference_scale:.3g}, bitwise {bitwise}"
    )
    assert max_abs_diff <= 1e-5 * reference_scale
    assert bitwise


def test_state_dict_keys_and_shapes_match(models):
    reference, ours = models
    assert [(k, v.shape) for k, v in ours.state_dict().items()] == [
        (k, v.shape) for k, v in reference.state_dict().items()
    ]


def test_video_only(models):
    reference, ours = models
    expected, (video, audio) = _run_both(reference, ours, **_inputs())
    assert len(expected) == 1 and audio is None
    _assert_matches(expected[0], video, "video only")


def test_video_and_audio(models):
    reference, ours = models
    expected, actual = _run_both(reference, ours, **_inputs(), audio_hidden_states=_audio())
    _assert_matches(expected[0], actual[0], "video+audio: video")
    _assert_matches(expected[1], actual[1], "video+audio: audio")


def test_text_key_mask(models):
    reference, ours = models
    inputs = dict(**_inputs(), audio_hidden_states=_audio(), encoder_attention_mask=_text_mask())
    expected, actual = _run_both(reference, ours, **inputs)
    _assert_matches(expected[0], actual[0], "masked: video")
    _assert_matches(expected[1], actual[1], "masked: audio")
    # The mask must change the result, or this case would test nothing.
    with torch.no_grad():
        unmasked_video, _ = ours(**_inputs(), audio_hidden_states=_audio())
    assert not torch.allclose(unmasked_video, actual[0])


def test_ti2av_token_types_and_tail_frame_positions(models):
    reference, ours = models
    frames = FRAMES + 1  # generated frames plus the clean reference frame appended as the tail
    token_types = torch.zeros(BATCH, frames, dtype=torch.long)
    token_types[:, -1] = 1
    rope_positions = (
        torch.tensor([*range(FRAMES), 0]),
        torch.arange(HEIGHT // 2),
        torch.arange(WIDTH // 2),
    )
    inputs = dict(
        **_inputs(frames=frames),
        audio_hidden_states=_audio(),
        encoder_attention_mask=_text_mask(),
        visual_rope_pos=rope_positions,
        visual_token_type_ids=token_types,
    )
    expected, actual = _run_both(reference, ours, **inputs)
    _assert_matches(expected[0], actual[0], "TI2AV: video")
    _assert_matches(expected[1], actual[1], "TI2AV: audio")


def test_distilled_heads():
    reference, ours = _model_pair(DISTILLED, seed=3)
    expected, actual = _run_both(reference, ours, **_inputs(), audio_hidden_states=_audio())
    assert actual[0].shape[-1] == 160 and actual[1].shape[-1] == 80
    _assert_matches(expected[0], actual[0], "distilled: video")
    _assert_matches(expected[1], actual[1], "distilled: audio")


def test_bf16_load_with_keep_fp32_rule(models, tmp_path):
    reference, ours = models
    reference.save_pretrained(tmp_path)
    reference_bf16 = Kandinsky6Transformer3DModel.from_pretrained(
        tmp_path, torch_dtype=torch.bfloat16
    ).eval()
    ours_bf16 = Kandinsky6Transformer(ours.config).eval()
    ours_bf16.load_state_dict(ours.state_dict())
    cast_for_inference(ours_bf16, torch.bfloat16)

    def fp32_names(model):
        return {
            name for name, parameter in model.named_parameters() if parameter.dtype == torch.float32
        }

    assert (
        fp32_names(ours_bf16)
        == fp32_names(reference_bf16)
        == {
            "out_layer.modulation.out_layer.weight",
            "out_layer.modulation.out_layer.bias",
            "audio_out_layer.modulation.out_layer.weight",
            "audio_out_layer.modulation.out_layer.bias",
        }
    )
    assert ours_bf16.dtype == reference_bf16.dtype == torch.bfloat16
    inputs = dict(
        **_inputs(torch.bfloat16),
        audio_hidden_states=_audio(torch.bfloat16),
        encoder_attention_mask=_text_mask(),
    )
    expected, actual = _run_both(reference_bf16, ours_bf16, **inputs)
    for label, reference_out, our_out in zip(("video", "audio"), expected, actual):
        cosine = torch.nn.functional.cosine_similarity(
            reference_out.double().flatten(), our_out.double().flatten(), dim=0
        ).item()
        print(f"bf16 {label}: cosine {cosine:.8f}, bitwise {torch.equal(reference_out, our_out)}")
        assert cosine >= 0.9999
        # Same ops in the same dtypes on the same CPU kernels: bitwise (k6-generation.md §2.8).
        assert torch.equal(reference_out, our_out)


def test_meta_build_then_materialise(models):
    """RoPE tables are computed on the fly, so a model built on meta needs no re-initialisation."""
    reference, ours = models
    with torch.device("meta"):
        from_meta = Kandinsky6Transformer(ours.config).eval()
    from_meta.load_state_dict(reference.state_dict(), strict=True, assign=True)
    inputs = dict(**_inputs(), audio_hidden_states=_audio())
    expected, actual = _run_both(reference, from_meta, **inputs)
    _assert_matches(expected[0], actual[0], "meta-built: video")
    _assert_matches(expected[1], actual[1], "meta-built: audio")


@pytest.mark.parametrize("name", ["pro", "lite", "pro_distill"])
def test_released_sizes_match_diffusers_on_meta(name):
    config_json = RELEASED_TRANSFORMER_CONFIGS[name]
    config = Kandinsky6TransformerConfig.from_json_dict(config_json)
    init_args = {field.name: getattr(config, field.name) for field in dataclasses.fields(config)}
    with torch.device("meta"):
        ours = Kandinsky6Transformer(config)
        reference = Kandinsky6Transformer3DModel(**init_args)
    count = sum(parameter.numel() for parameter in ours.parameters())
    print(f"{name}: {count:,} parameters")
    assert count == sum(parameter.numel() for parameter in reference.parameters())
    assert {k: v.shape for k, v in ours.state_dict().items()} == {
        k: v.shape for k, v in reference.state_dict().items()
    }
