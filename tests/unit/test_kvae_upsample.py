"""The SR K-VAE upsampler's 3x3 convolution as four 2x2 phase convolutions on the low-resolution grid
(speed/kvae_upsample.py): the same values as diffusers' upsample-then-convolve up to fp32 rounding (exact in fp64),
for the spatial-only and the temporal upsamplers over first and later causal segments, for the decoded tile, and
compiled by inductor; only zero-padded (1, 3, 3) convolutions are rewritten; parameters are untouched."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from k6serve.speed.kvae_upsample import (
    apply_subpixel_upsample,
    phase_kernels,
    subpixel_upsample_conv,
)


@pytest.mark.parametrize("height,width", [(5, 7), (4, 6), (1, 1)])
def test_phase_convolutions_equal_convolving_the_upsampled_image(height, width):
    """In fp64 the four phase convolutions equal conv3x3(nearest_up(x)) to the last bits; odd sizes and a 1x1
    image exercise the zero borders."""
    generator = torch.Generator().manual_seed(height * 10 + width)
    conv = nn.Conv3d(3, 5, kernel_size=(1, 3, 3), padding=(0, 1, 1)).double()
    with torch.no_grad():
        conv.weight.copy_(torch.randn(conv.weight.shape, generator=generator, dtype=torch.float64))
        conv.bias.copy_(torch.randn(conv.bias.shape, generator=generator, dtype=torch.float64))
    x = torch.randn(2, 3, 4, height, width, generator=generator, dtype=torch.float64)
    with torch.no_grad():
        expected = conv(F.interpolate(x, scale_factor=(1, 2, 2), mode="nearest"))
        got = subpixel_upsample_conv(x, conv)
    assert got.shape == expected.shape == (2, 5, 4, 2 * height, 2 * width)
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)


def test_phase_kernels_sum_the_taps_each_phase_reads():
    weight = torch.arange(9.0).reshape(1, 1, 1, 3, 3)  # rows [0 1 2], [3 4 5], [6 7 8]
    k00, k01, k10, k11 = (k[0, 0, 0] for k in phase_kernels(weight))
    # Phase (0, 0): rows (top | middle + bottom), columns (left | middle + right).
    assert k00.tolist() == [[0, 1 + 2], [3 + 6, 4 + 5 + 7 + 8]]
    assert k11.tolist() == [[0 + 1 + 3 + 4, 2 + 5], [6 + 7, 8]]
    assert k01.tolist() == [[0 + 1, 2], [3 + 4 + 6 + 7, 5 + 8]]
    assert k10.tolist() == [[0 + 3, 1 + 2 + 4 + 5], [6, 7 + 8]]


def test_subpixel_upsampler_decodes_the_same_tile(tiny_sr_configs, build_tiny_kvae):
    """The decoded tile in fp32 over three causal segments (13 latent frames: 5, 4, 4), with the spatial-only and the
    temporal upsamplers rewritten: within fp32 rounding of diffusers' upsample-then-convolve."""
    vae = build_tiny_kvae(torch.float32)
    generator = torch.Generator().manual_seed(0)
    latent = torch.randn(1, tiny_sr_configs.vae.latent_channels, 13, 4, 6, generator=generator)
    keys = list(vae.model.state_dict())
    upsamplers = [m for m in vae.model.decoder.modules() if type(m).__name__ == "Kandinsky6SRUpsample"]
    assert any(m.compress_time for m in upsamplers) and any(not m.compress_time for m in upsamplers)
    with torch.inference_mode():
        reference = vae.decode_tile_raw(latent)
        assert apply_subpixel_upsample(vae.model.decoder) == len(upsamplers) > 0
        assert apply_subpixel_upsample(vae.model.decoder) == 0  # idempotent
        rewritten = vae.decode_tile_raw(latent)
    assert rewritten.shape == reference.shape and reference.shape[2] == 49
    torch.testing.assert_close(rewritten, reference, rtol=1e-5, atol=1e-5)
    assert list(vae.model.state_dict()) == keys


def test_subpixel_upsampler_compiles(build_tiny_kvae):
    """What --compile-vae compiles: one temporal upsampler, compiled by inductor, over a first and a later segment
    (the causal cache carried): the values of diffusers' forward within fp32 rounding."""
    vae = build_tiny_kvae(torch.float32)
    upsampler = next(m for m in vae.model.decoder.modules()
                     if type(m).__name__ == "Kandinsky6SRUpsample" and m.compress_time)
    channels = upsampler.spatial_conv.in_channels
    generator = torch.Generator().manual_seed(1)
    segments = [torch.randn(1, channels, 3, 8, 12, generator=generator),
                torch.randn(1, channels, 2, 8, 12, generator=generator)]
    with torch.inference_mode():
        cache = upsampler.make_cache()
        expected = [upsampler(hidden, cache) for hidden in segments]
        assert apply_subpixel_upsample(upsampler) == 1
        compiled = torch.compile(upsampler, backend="inductor", fullgraph=True)
        cache = upsampler.make_cache()
        for hidden, reference in zip(segments, expected, strict=True):
            torch.testing.assert_close(compiled(hidden, cache), reference, rtol=1e-5, atol=1e-5)
    torch._dynamo.reset()


def test_upsamplers_with_other_convolutions_are_left_alone(build_tiny_kvae):
    vae = build_tiny_kvae(torch.float32)
    upsamplers = [m for m in vae.model.decoder.modules() if type(m).__name__ == "Kandinsky6SRUpsample"]
    conv = upsamplers[0].spatial_conv
    upsamplers[0].spatial_conv = nn.Conv3d(conv.in_channels, conv.out_channels, (1, 3, 3), padding=(0, 1, 1),
                                           padding_mode="replicate")
    assert apply_subpixel_upsample(vae.model.decoder) == len(upsamplers) - 1
    assert "forward" not in vars(upsamplers[0]) and all("forward" in vars(m) for m in upsamplers[1:])


def test_phase_kernels_keep_channels_last_weights_channels_last():
    """Beside channels-last decoder weights the phase kernels are channels-last too (cuDNN would otherwise
    transpose around them); the values do not depend on the layout."""
    generator = torch.Generator().manual_seed(3)
    weight = torch.randn(6, 4, 1, 3, 3, generator=generator)
    channels_last = weight.contiguous(memory_format=torch.channels_last_3d)
    for plain, converted in zip(phase_kernels(weight), phase_kernels(channels_last), strict=True):
        assert plain.is_contiguous() and converted.is_contiguous(memory_format=torch.channels_last_3d)
        assert not converted.is_contiguous() and torch.equal(plain, converted)
