"""The SR K-VAE's spatial upsampler (nearest 2x, 3x3 convolution, 1x1x1 `linear`) folded into one 2x2 convolution
on the low-resolution grid (speed/kvae_upsample.py): the same values as diffusers' upsample-then-convolve up to fp32
rounding (exact in fp64), for the spatial-only and the temporal upsamplers over first and later causal segments, for
the decoded tile, and compiled by inductor; only zero-padded (1, 3, 3) convolutions are rewritten; parameters are
untouched; the folded kernel keeps the channels-last layout."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from k6serve.speed.kvae_upsample import (
    apply_subpixel_upsample,
    folded_upsample,
    folded_upsampler_kernel,
    phase_taps,
)


def _random_conv(shape_in: int, shape_out: int, kernel, padding, generator) -> nn.Conv3d:
    conv = nn.Conv3d(shape_in, shape_out, kernel_size=kernel, padding=padding).double()
    with torch.no_grad():
        conv.weight.copy_(torch.randn(conv.weight.shape, generator=generator, dtype=torch.float64))
        conv.bias.copy_(torch.randn(conv.bias.shape, generator=generator, dtype=torch.float64))
    return conv


@pytest.mark.parametrize("height,width", [(5, 7), (4, 6), (1, 1)])
def test_folded_upsampler_equals_upsample_convolve_linear(height, width):
    """In fp64 the folded convolution equals linear(up(x) + conv3x3(up(x))) to the last bits; odd sizes and a 1x1
    image exercise the zero borders, and the output is laid out channels-last."""
    generator = torch.Generator().manual_seed(height * 10 + width)
    spatial = _random_conv(5, 5, (1, 3, 3), (0, 1, 1), generator)
    linear = _random_conv(5, 5, 1, 0, generator)
    x = torch.randn(2, 5, 4, height, width, generator=generator, dtype=torch.float64)
    with torch.no_grad():
        upsampled = F.interpolate(x, scale_factor=(1, 2, 2), mode="nearest")
        expected = linear(upsampled + spatial(upsampled))
        got = folded_upsample(x, *folded_upsampler_kernel(spatial, linear))
    assert got.shape == expected.shape == (2, 5, 4, 2 * height, 2 * width)
    assert got.is_contiguous(memory_format=torch.channels_last_3d)
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)


def test_folded_upsampler_splits_long_clips_along_time(monkeypatch):
    """Where the 4C-channel output would pass cuDNN's 32-bit indexing the frames go through in chunks (the kernel
    mixes no frames): the same values."""
    import k6serve.speed.kvae_upsample as module

    generator = torch.Generator().manual_seed(5)
    spatial = _random_conv(3, 3, (1, 3, 3), (0, 1, 1), generator)
    linear = _random_conv(3, 3, 1, 0, generator)
    x = torch.randn(1, 3, 7, 4, 5, generator=generator, dtype=torch.float64)
    kernel = folded_upsampler_kernel(spatial, linear)
    whole = folded_upsample(x, *kernel)
    calls = []
    monkeypatch.setattr(module, "MAX_CONV_OUTPUT_ELEMENTS", 4 * 3 * 5 * 6 * 2)  # two frames per convolution
    real_conv3d = F.conv3d
    def counting_conv3d(chunk, *args, **kwargs):
        calls.append(chunk.shape[2])
        return real_conv3d(chunk, *args, **kwargs)

    monkeypatch.setattr(module.F, "conv3d", counting_conv3d)
    torch.testing.assert_close(folded_upsample(x, *kernel), whole, rtol=0, atol=0)
    assert calls == [2, 2, 2, 1]


def test_phase_taps_sum_the_taps_each_phase_reads():
    weight = torch.arange(9.0).reshape(1, 1, 1, 3, 3)  # rows [0 1 2], [3 4 5], [6 7 8]
    k00, k01, k10, k11 = (k[0, 0, 0] for k in phase_taps(weight))
    # Phase (0, 0): rows (top | middle + bottom), columns (left | middle + right).
    assert k00.tolist() == [[0, 1 + 2], [3 + 6, 4 + 5 + 7 + 8]]
    assert k11.tolist() == [[0 + 1 + 3 + 4, 2 + 5], [6 + 7, 8]]
    assert k01.tolist() == [[0 + 1, 2], [3 + 4 + 6 + 7, 5 + 8]]
    assert k10.tolist() == [[0 + 3, 1 + 2 + 4 + 5], [6, 7 + 8]]


def test_subpixel_upsampler_decodes_the_same_tile(tiny_sr_configs, build_tiny_kvae):
    """The decoded tile in fp32 over three causal segments (13 latent frames: 5, 4, 4), with the spatial-only and the
    temporal upsamplers rewritten: within fp32 rounding of diffusers' upsample-then-convolve; the folded kernels are
    buffers outside the state dict."""
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


def test_folded_kernel_keeps_channels_last_weights_channels_last():
    """Beside channels-last decoder weights the folded kernel is channels-last too (cuDNN would otherwise transpose
    input, kernel and output around it); the values do not depend on the layout; bf16 weights give a bf16 kernel
    rounded once from the fp32 fold."""
    generator = torch.Generator().manual_seed(3)
    spatial = _random_conv(4, 4, (1, 3, 3), (0, 1, 1), generator).to(torch.bfloat16)
    linear = _random_conv(4, 4, 1, 0, generator).to(torch.bfloat16)
    plain_weight, plain_bias = folded_upsampler_kernel(spatial, linear)
    spatial.weight.data = spatial.weight.data.contiguous(memory_format=torch.channels_last_3d)
    converted_weight, converted_bias = folded_upsampler_kernel(spatial, linear)
    assert plain_weight.shape == (16, 4, 1, 2, 2) and plain_weight.dtype == plain_bias.dtype == torch.bfloat16
    assert plain_weight.is_contiguous() and not converted_weight.is_contiguous()
    assert converted_weight.is_contiguous(memory_format=torch.channels_last_3d)
    assert torch.equal(plain_weight, converted_weight) and torch.equal(plain_bias, converted_bias)
    # Rounded once: phase (1, 1)'s first output channel, folded in fp32 from the bf16 weights, then rounded.
    mix = linear.weight.float().reshape(4, 4)
    taps = phase_taps(spatial.weight.float())[3][:, :, 0].clone()
    taps[:, :, 0, 0] += torch.eye(4)
    expected = torch.einsum("om,mikl->oikl", mix, taps)[0].to(torch.bfloat16)
    assert torch.equal(plain_weight[12, :, 0], expected)


def test_applying_again_refreshes_the_folded_kernel_after_the_weights_change():
    """The folded kernel is a buffer computed from the weights: the module docstring's remedy for weights changed
    after the rewrite (apply it again) recomputes it, so the output follows the new weights."""
    from diffusers.models.autoencoders.autoencoder_kandinsky6_sr import Kandinsky6SRUpsample

    torch.manual_seed(4)
    reference = Kandinsky6SRUpsample(4, compress_time=False).double()
    rewritten = Kandinsky6SRUpsample(4, compress_time=False).double()
    rewritten.load_state_dict(reference.state_dict())
    assert apply_subpixel_upsample(rewritten) == 1
    x = torch.randn(1, 4, 2, 3, 5, dtype=torch.float64)
    with torch.no_grad():
        new_weights = {name: 2 * tensor + 1 for name, tensor in reference.state_dict().items()}
        reference.load_state_dict(new_weights)
        rewritten.load_state_dict(new_weights)
        assert apply_subpixel_upsample(rewritten) == 0  # already routed: nothing new, the kernel recomputed
        torch.testing.assert_close(rewritten(x, {}), reference(x, {}), rtol=1e-12, atol=1e-12)


def test_bf16_subpixel_upsampler_decodes_at_bf16_rounding(tiny_sr_configs, build_tiny_kvae):
    """The dtype --compile-vae runs in: the folded kernel is rounded once to bf16 and accumulates in fp32 where
    diffusers rounds `up(x) + conv` (module docstring), so no bitwise claim; the rewritten bf16 tile must stay as
    close to the fp32 decode as diffusers' own bf16 decode is (measured: RMS 0.0105 vs 0.0107 of the reference's)."""
    import copy

    from k6serve.models.kandinsky6_sr.vae import SRVAE

    vae = build_tiny_kvae(torch.float32)
    latent = torch.randn(1, tiny_sr_configs.vae.latent_channels, 9, 4, 6, generator=torch.Generator().manual_seed(0))
    stock, rewritten = (SRVAE(copy.deepcopy(vae.model).to(torch.bfloat16)) for _ in range(2))
    with torch.inference_mode():
        reference = vae.decode_tile_raw(latent).double()
        expected = stock.decode_tile_raw(latent).double()
        assert apply_subpixel_upsample(rewritten.model.decoder) > 0
        got = rewritten.decode_tile_raw(latent).double()

    def rms(x):
        return ((x - reference).pow(2).mean().sqrt() / reference.pow(2).mean().sqrt()).item()

    print(f"bf16 vs fp32 RMS: subpixel {rms(got):.4f}, diffusers {rms(expected):.4f}")
    assert rms(got) <= 1.5 * rms(expected)
    assert (got - reference).abs().max() <= 2 * (expected - reference).abs().max()
