"""The HunyuanVideo decoder's upsamplers (nearest upsampling, replicate padding, causal 3x3x3 convolution) folded into
one phase convolution on the low-resolution grid (speed/hunyuan_upsample.py): diffusers' values exactly in fp64 and
within fp32 rounding in fp32, with and without the temporal upsampling, for one frame and odd sizes, split along time
where cuDNN's indexing needs it, in the whole tiny decoder, and compiled by inductor; only the modules it fits are
routed; the kernel follows weight changes when applied again."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from diffusers import AutoencoderKLHunyuanVideo
from diffusers.models.autoencoders.autoencoder_kl_hunyuan_video import HunyuanVideoUpsampleCausal3D

from k6serve.speed.hunyuan_upsample import (
    apply_folded_upsample,
    folded_upsample,
    folded_upsampler_kernel,
)


def _upsampler(channels: int, out_channels: int, factor, seed: int, dtype=torch.float64) -> HunyuanVideoUpsampleCausal3D:
    torch.manual_seed(seed)
    module = HunyuanVideoUpsampleCausal3D(channels, out_channels=out_channels, upsample_factor=factor).to(dtype)
    with torch.no_grad():
        for parameter in module.parameters():
            parameter.normal_()
    return module


@pytest.mark.parametrize("factor", [(1, 2, 2), (2, 2, 2)])
@pytest.mark.parametrize("frames,height,width", [(1, 3, 4), (4, 5, 7), (3, 1, 1), (2, 4, 6)])
def test_folded_upsampler_equals_diffusers_in_fp64(factor, frames, height, width):
    """To the last bits in fp64: every output phase, the first frame's spatial-only upsampling, a single frame,
    a 1x1 image (all borders replicated) and a channel change."""
    module = _upsampler(3, 5, factor, seed=frames * 100 + height * 10 + width)
    x = torch.randn(2, 3, frames, height, width, dtype=torch.float64)
    with torch.no_grad():
        expected = module(x)
        got = folded_upsample(x, *folded_upsampler_kernel(module.conv.conv, factor[0] == 2), factor[0] == 2)
    expected_frames = 2 * frames - 1 if factor[0] == 2 else frames
    assert got.shape == expected.shape == (2, 5, expected_frames, 2 * height, 2 * width)
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("factor", [(1, 2, 2), (2, 2, 2)])
def test_folded_upsampler_within_fp32_rounding(factor):
    module = _upsampler(8, 8, factor, seed=3, dtype=torch.float32)
    x = torch.randn(1, 8, 5, 6, 10)
    with torch.no_grad():
        expected = module(x)
        apply_folded_upsample(module)
        got = module(x)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_folded_upsampler_splits_long_clips_along_time(monkeypatch):
    """Past cuDNN's 32-bit indexing the phase convolution runs in time chunks that overlap by the kernel's extent
    minus one frame: the same values, and more than one convolution."""
    from k6serve.speed import hunyuan_upsample

    for factor in ((1, 2, 2), (2, 2, 2)):
        module = _upsampler(2, 2, factor, seed=7)
        x = torch.randn(1, 2, 7, 3, 4, dtype=torch.float64)
        kernel = folded_upsampler_kernel(module.conv.conv, factor[0] == 2)
        with torch.no_grad():
            expected = module(x)
            phase_channels = kernel[0].shape[0]
            monkeypatch.setattr(hunyuan_upsample, "MAX_CONV_OUTPUT_ELEMENTS", 2 * phase_channels * 4 * 5)  # two frames
            calls = []

            def counted(*args, calls=calls, real_conv3d=F.conv3d, **kwargs):
                calls.append(1)
                return real_conv3d(*args, **kwargs)

            monkeypatch.setattr(hunyuan_upsample.F, "conv3d", counted)
            got = folded_upsample(x, *kernel, factor[0] == 2)
            monkeypatch.undo()
        assert len(calls) == 4  # 7 frames, two per convolution
        torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)


def test_whole_decoder_with_folded_upsamplers_matches_diffusers():
    """The tiny four-level VAE (8x space, 4x time; two temporal and three spatial upsamplers) decodes a latent the
    same with the rewrite, in fp32; parameters and state-dict keys are untouched."""
    torch.manual_seed(0)
    vae = AutoencoderKLHunyuanVideo(block_out_channels=(8, 8, 8, 8), layers_per_block=1, norm_num_groups=4).eval()
    latent = torch.randn(1, 16, 3, 4, 6)
    keys = set(vae.state_dict())
    with torch.no_grad():
        expected = vae.decode(latent).sample
        assert apply_folded_upsample(vae.decoder) == 3
        got = vae.decode(latent).sample
    assert got.shape == expected.shape == (1, 3, 9, 32, 48)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert set(vae.state_dict()) == keys


def test_apply_is_idempotent_refreshes_kernels_and_skips_what_does_not_fit():
    module = _upsampler(3, 3, (2, 2, 2), seed=11)
    x = torch.randn(1, 3, 3, 4, 4, dtype=torch.float64)
    assert apply_folded_upsample(module) == 1
    assert apply_folded_upsample(module) == 0  # already routed: kernel recomputed, not counted
    with torch.no_grad():
        module.conv.conv.weight.mul_(2.0)
        apply_folded_upsample(module)
        folded = module(x)
        del module.forward  # back to diffusers' forward
        torch.testing.assert_close(folded, module(x), rtol=1e-12, atol=1e-12)

    zero_padded = _upsampler(3, 3, (2, 2, 2), seed=12)
    zero_padded.conv.pad_mode = "constant"
    other_factor = _upsampler(3, 3, (2, 3, 3), seed=13)
    assert apply_folded_upsample(zero_padded) == apply_folded_upsample(other_factor) == 0
    assert "forward" not in vars(zero_padded) and "forward" not in vars(other_factor)


def test_folded_kernel_keeps_channels_last_weights():
    module = _upsampler(4, 4, (2, 2, 2), seed=5, dtype=torch.float32)
    module.conv.conv.weight.data = module.conv.conv.weight.data.contiguous(memory_format=torch.channels_last_3d)
    weight, bias = folded_upsampler_kernel(module.conv.conv, True)
    assert weight.shape == (32, 4, 2, 2, 2) and bias.shape == (32,)
    assert weight.is_contiguous(memory_format=torch.channels_last_3d)


def test_folded_upsampler_compiles():
    """What --compile-vae compiles: the routed upsampler through inductor, fullgraph, the same values."""
    module = _upsampler(4, 4, (2, 2, 2), seed=9, dtype=torch.float32)
    x = torch.randn(1, 4, 3, 4, 6)
    with torch.no_grad():
        expected = module(x)
        apply_folded_upsample(module)
        compiled = torch.compile(module, backend="inductor", fullgraph=True)
        torch.testing.assert_close(compiled(x), expected, rtol=1e-5, atol=1e-5)


def test_on_by_default_beside_the_compiled_decoder_only(monkeypatch):
    """`apply_vae_speedups` routes HunyuanVideo's three upsamplers before compiling the decoder; the eager decode and
    `K6SERVE_HUNYUAN_FOLDED_UPSAMPLE=0` keep diffusers' forward."""
    from k6serve.speed import vae as vae_speed

    monkeypatch.setattr(torch.backends.cudnn, "benchmark", False)
    monkeypatch.delenv(vae_speed.CHANNELS_LAST_ENVIRONMENT_VARIABLE, raising=False)

    def upsamplers(vae):
        return [m for m in vae.decoder.modules() if isinstance(m, HunyuanVideoUpsampleCausal3D)]

    def fresh():
        return AutoencoderKLHunyuanVideo(block_out_channels=(8, 8, 8, 8), layers_per_block=1, norm_num_groups=4)

    monkeypatch.delenv(vae_speed.HUNYUAN_FOLDED_UPSAMPLE_ENVIRONMENT_VARIABLE, raising=False)
    vae = fresh()
    assert "folded_upsample" not in vae_speed.apply_vae_speedups(vae, torch.device("cuda"))
    assert not any("forward" in vars(m) for m in upsamplers(vae))
    applied = vae_speed.apply_vae_speedups(vae, torch.device("cuda"), compile_decoder=True)
    assert applied == ["folded_upsample", "compile_decoder"]
    assert len(upsamplers(vae)) == 3 and all("forward" in vars(m) for m in upsamplers(vae))

    monkeypatch.setenv(vae_speed.HUNYUAN_FOLDED_UPSAMPLE_ENVIRONMENT_VARIABLE, "0")
    vae = fresh()
    assert vae_speed.apply_vae_speedups(vae, torch.device("cuda"), compile_decoder=True) == ["compile_decoder"]
    assert not any("forward" in vars(m) for m in upsamplers(vae))
    torch._dynamo.reset()


def test_bf16_decoder_with_folded_upsamplers_stays_at_bf16_rounding():
    """The dtype --compile-vae runs in: bf16 phase taps are rounded once where diffusers rounds products (module
    docstring), so bitwise parity is not claimed; the folded bf16 decode must stay as close to the fp32 decode as
    diffusers' own bf16 decode is (measured: RMS 0.040 vs 0.033, max 0.053 vs 0.029 of max|ref|)."""
    import copy

    torch.manual_seed(0)
    vae = AutoencoderKLHunyuanVideo(block_out_channels=(8, 8, 8, 8), layers_per_block=1, norm_num_groups=4).eval()
    latent = torch.randn(1, 16, 3, 4, 6)
    bf16 = copy.deepcopy(vae).to(torch.bfloat16)
    with torch.no_grad():
        reference = vae.decode(latent).sample.double()
        stock = bf16.decode(latent.to(torch.bfloat16)).sample.double()
        assert apply_folded_upsample(bf16.decoder) == 3
        folded = bf16.decode(latent.to(torch.bfloat16)).sample.double()

    def errors(x):
        rms = ((x - reference).pow(2).mean().sqrt() / reference.pow(2).mean().sqrt()).item()
        return rms, ((x - reference).abs().max() / reference.abs().max()).item()

    (folded_rms, folded_max), (stock_rms, stock_max) = errors(folded), errors(stock)
    print(f"bf16 vs fp32: folded rms {folded_rms:.4f} max {folded_max:.4f}; diffusers rms {stock_rms:.4f} "
          f"max {stock_max:.4f}")
    assert folded_rms <= 1.5 * stock_rms and folded_max <= 3 * stock_max
