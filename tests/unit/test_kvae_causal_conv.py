"""The SR K-VAE decoder's causal convolutions as one convolution per segment (speed/kvae_causal_conv.py): the same
outputs and carried padding as diffusers' two-convolution form over first and later segments (long and shorter
than the kernel), for the decoded tile, compiled by inductor, and sharing a cache chain with the original; strided
convolutions are left alone; parameters are untouched."""

from __future__ import annotations

import copy

import pytest
import torch

from k6serve.speed.kvae_causal_conv import apply_single_causal_conv


def _causal_conv(kernel, stride=(1, 1, 1), channels=(3, 4), seed=0):
    from diffusers.models.autoencoders.autoencoder_kandinsky6_sr import Kandinsky6SRCausalConv3d

    torch.manual_seed(seed)
    return Kandinsky6SRCausalConv3d(*channels, kernel_size=kernel, stride=stride).double()


@pytest.mark.parametrize("kernel", [3, (3, 1, 1), (2, 1, 1), (1, 3, 3)])
def test_one_convolution_equals_the_two(kernel):
    """Segments of 5, 1 (shorter than the padding), 2 and 4 frames in one cache chain: outputs and carried padding
    equal diffusers' in fp64 to the last bits."""
    reference = _causal_conv(kernel)
    rewritten = copy.deepcopy(reference)
    assert apply_single_causal_conv(rewritten) == 1 and apply_single_causal_conv(rewritten) == 0
    generator = torch.Generator().manual_seed(1)
    segments = [torch.randn(2, 3, frames, 5, 6, generator=generator, dtype=torch.float64) for frames in (5, 1, 2, 4)]
    reference_cache, rewritten_cache = reference.make_cache(), rewritten.make_cache()
    with torch.no_grad():
        for segment in segments:
            expected = reference(segment, reference_cache)
            got = rewritten(segment, rewritten_cache)
            assert got.shape == expected.shape
            torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)
            torch.testing.assert_close(rewritten_cache["padding"], reference_cache["padding"], rtol=0, atol=0)


def test_strided_convolutions_are_left_alone():
    conv = _causal_conv((2, 1, 1), stride=(2, 1, 1))
    assert apply_single_causal_conv(conv) == 0 and "forward" not in vars(conv)


def test_the_decoded_tile_is_the_same(tiny_sr_configs, build_tiny_kvae):
    """The whole decoder in fp32 over three causal segments (13 latent frames: 5, 4, 4): within fp32 rounding of
    diffusers' form; the state dict is untouched."""
    vae = build_tiny_kvae(torch.float32)
    latent = torch.randn(1, tiny_sr_configs.vae.latent_channels, 13, 4, 6, generator=torch.Generator().manual_seed(0))
    keys = list(vae.model.state_dict())
    causal = [m for m in vae.model.decoder.modules() if type(m).__name__ == "Kandinsky6SRCausalConv3d"]
    with torch.inference_mode():
        reference = vae.decode_tile_raw(latent)
        assert apply_single_causal_conv(vae.model.decoder) == len(causal) > 0
        rewritten = vae.decode_tile_raw(latent)
    assert rewritten.shape == reference.shape
    torch.testing.assert_close(rewritten, reference, rtol=1e-5, atol=1e-5)
    assert list(vae.model.state_dict()) == keys


def test_compiled_and_mixed_with_the_original_form():
    """What --compile-vae compiles: inductor over a first and a later segment; then the original forward continues
    the rewritten one's cache chain (the cache format is diffusers')."""
    reference = _causal_conv(3, channels=(4, 4)).float()
    rewritten = copy.deepcopy(reference)
    apply_single_causal_conv(rewritten)
    compiled = torch.compile(rewritten, backend="inductor", fullgraph=True)
    generator = torch.Generator().manual_seed(2)
    segments = [torch.randn(1, 4, frames, 6, 8, generator=generator) for frames in (5, 4, 4)]
    reference_cache, rewritten_cache = reference.make_cache(), rewritten.make_cache()
    with torch.no_grad():
        for segment in segments[:2]:
            torch.testing.assert_close(compiled(segment, rewritten_cache), reference(segment, reference_cache),
                                       rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(reference(segments[2], rewritten_cache), reference(segments[2], reference_cache),
                                   rtol=1e-5, atol=1e-5)
    torch._dynamo.reset()


def test_bf16_decoded_tile_stays_at_bf16_rounding(tiny_sr_configs, build_tiny_kvae):
    """The dtype --compile-vae runs in (segments 5 + 4): the same sums in another convolution shape, so bf16 may
    differ from diffusers' form by rounding (module docstring; on this CPU it happens to be bitwise); bounded by
    diffusers' own bf16 error against the fp32 decode."""
    vae = build_tiny_kvae(torch.float32)
    latent = torch.randn(1, tiny_sr_configs.vae.latent_channels, 9, 4, 6, generator=torch.Generator().manual_seed(0))
    stock, rewritten = (type(vae)(copy.deepcopy(vae.model).to(torch.bfloat16)) for _ in range(2))
    with torch.inference_mode():
        reference = vae.decode_tile_raw(latent).double()
        expected = stock.decode_tile_raw(latent).double()
        assert apply_single_causal_conv(rewritten.model.decoder) > 0
        got = rewritten.decode_tile_raw(latent).double()
    scale = reference.abs().max()
    print(f"bf16 max|diff| to diffusers' bf16 form: {((got - expected).abs().max() / scale).item():.3g} of max|ref|")
    assert (got - reference).abs().max() <= 1.5 * (expected - reference).abs().max()
    assert (got - expected).abs().max() <= 2 ** -7 * 4 * scale  # a few bf16 ulps at most
