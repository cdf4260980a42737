"""The SR K-VAE norms with their 1x1x1 convolutions moved before the upsampling (speed/kvae_spatial_norm.py): the
decoded tile is bit for bit the same as diffusers' module order, over first and later causal segments, eager and
traced by dynamo; only plain 1x1x1 convolutions are commuted; parameters are untouched."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from k6serve.speed.kvae_spatial_norm import apply_commuted_spatial_norms


def _latent(tiny_sr_configs, dtype):
    # 13 latent frames: three causal segments (5, 4, 4), so the first-frame path and the later-segment path both run.
    generator = torch.Generator().manual_seed(0)
    return torch.randn(1, tiny_sr_configs.vae.latent_channels, 13, 4, 6, generator=generator).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_commuted_norms_decode_the_same_bits(tiny_sr_configs, dtype, build_tiny_kvae):
    vae = build_tiny_kvae(dtype)
    latent = _latent(tiny_sr_configs, dtype)
    keys = list(vae.model.state_dict())
    norms = [m for m in vae.model.decoder.modules() if type(m).__name__ == "Kandinsky6SRSpatialNorm3D"]
    with torch.inference_mode():
        reference = vae.decode_tile_raw(latent)
        assert apply_commuted_spatial_norms(vae.model.decoder) == len(norms) > 0
        assert apply_commuted_spatial_norms(vae.model.decoder) == 0  # idempotent
        commuted = vae.decode_tile_raw(latent)
    assert reference.shape[2] == 49 and torch.equal(commuted, reference)
    assert list(vae.model.state_dict()) == keys


def test_commuted_norms_compile_into_the_block(tiny_sr_configs, build_tiny_kvae):
    """What --compile-vae compiles: one resnet block with its two commuted norms, compiled by inductor (~20 s on
    CPU), over the first and a later segment: the upsampling of the convolved latent lowers into the block's
    kernels and the values stay those of diffusers' order, bit for bit."""
    vae = build_tiny_kvae(torch.float32)
    # The top level (full resolution: 8x the latent grid here, 4x its frames): the upsampling is real.
    block = vae.model.decoder.up[0].block[0]
    generator = torch.Generator().manual_seed(1)
    channels = tiny_sr_configs.vae.latent_channels
    # First segment: 5 latent frames -> 1 + 16 frames (the first frame upsampled on its own); then 4 -> 16.
    segments = [(torch.randn(1, channels, 5, 4, 6, generator=generator),
                 torch.randn(1, block.in_channels, 17, 32, 48, generator=generator)),
                (torch.randn(1, channels, 4, 4, 6, generator=generator),
                 torch.randn(1, block.in_channels, 16, 32, 48, generator=generator))]
    with torch.inference_mode():
        cache = block.make_cache()
        expected = [block(hidden, cache, zq=zq) for zq, hidden in segments]  # diffusers' order
        assert apply_commuted_spatial_norms(block) == 2
        compiled = torch.compile(block, backend="inductor", fullgraph=True)
        cache = block.make_cache()
        for (zq, hidden), reference in zip(segments, expected, strict=True):
            assert torch.equal(compiled(hidden, cache, zq=zq), reference)
    torch._dynamo.reset()


def test_norms_with_other_convolutions_are_left_alone(build_tiny_kvae):
    vae = build_tiny_kvae(torch.float32)
    norms = [m for m in vae.model.decoder.modules() if type(m).__name__ == "Kandinsky6SRSpatialNorm3D"]
    norms[0].conv_y = nn.Conv3d(norms[0].conv_y.in_channels, norms[0].conv_y.out_channels, 3, padding=1)
    assert apply_commuted_spatial_norms(vae.model.decoder) == len(norms) - 1
    assert "forward" not in vars(norms[0]) and "forward" in vars(norms[1])
