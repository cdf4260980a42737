"""Kandinsky 6 SR components vs diffusers 0.42.1 on the same tiny random weights (k6-super-resolution.md §0).

The weights come from a tiny checkpoint in the Hub layout (vendor config formats), so the configs our loader reads
are the ones under test. Tolerance: max |ours - ref| <= 1e-5 * max |ref| in fp32 on CPU, bitwise where the code is
diffusers' own.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from diffusers import Kandinsky6SRTransformer3DModel, PiflowScheduler
from safetensors.torch import load_file

from k6serve.models.kandinsky6_sr.config import (
    SRSchedulerConfig,
    SRTransformerConfig,
    SRUpscalerConfig,
    SRVAEConfig,
)
from k6serve.models.kandinsky6_sr.piflow import SRPiflowSampler
from k6serve.models.kandinsky6_sr.plan import sr_plan
from k6serve.models.kandinsky6_sr.transformer import SRTransformer
from k6serve.models.kandinsky6_sr.upscaler import SRLatentUpscaler, build_upscaler
from k6serve.models.kandinsky6_sr.vae import (
    SRVAE,
    build_vae,
    decode_segment_lengths,
    encode_segment_lengths,
    latent_to_uint8,
)
from k6serve.models.plan import keeps_fp32
from k6serve.testing.tiny_sr_checkpoint import TINY_TRANSFORMER, build_sr_checkpoint

RELATIVE_TOLERANCE = 1e-5
# diffusers' SR attention always runs flex attention; eager is fine at these sizes.
pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")


def assert_close_relative(
    ours: torch.Tensor, ref: torch.Tensor, tolerance: float = RELATIVE_TOLERANCE
) -> None:
    assert ours.shape == ref.shape and ours.dtype == ref.dtype
    max_diff = (ours.double() - ref.double()).abs().max().item()
    assert max_diff <= tolerance * ref.abs().max().item(), (max_diff, ref.abs().max().item())


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return build_sr_checkpoint(tmp_path_factory.mktemp("sr") / "tiny", head="distilled", seed=3)


def _weights(checkpoint, component):
    return load_file(checkpoint / component / "diffusion_pytorch_model.safetensors")


@pytest.fixture(scope="module")
def transformers(checkpoint):
    """(ours, diffusers with NABLA threshold 1.0 = dense), same weights, fp32."""
    config = SRTransformerConfig.from_json_file(checkpoint / "transformer" / "config.json")
    weights = _weights(checkpoint, "transformer")
    ours = SRTransformer(config).eval()
    ours.load_state_dict(weights, strict=True)
    # With P = 1.0 the NABLA keep rule (cumsum >= 1 - P = 0) keeps every block: dense attention (§0).
    reference = Kandinsky6SRTransformer3DModel(
        **TINY_TRANSFORMER,
        out_visual_dim=config.out_visual_dim,
        scale_factor=config.rope_scale,
        nabla_threshold=1.0,
        nabla_window=config.nabla_window,
        tile_sizes=config.tile_sizes,
    ).eval()
    reference.load_state_dict(weights, strict=True)
    return ours, reference


def _dit_inputs(dtype=torch.float32):
    generator = torch.Generator().manual_seed(0)
    latent = torch.randn(2, 3, 8, 16, 2 * 8 + 1, generator=generator).to(dtype)
    return latent, torch.tensor([1000.0, 636.36365])


def test_dit_matches_diffusers_dense_in_fp32(transformers):
    ours, reference = transformers
    latent, timestep = _dit_inputs()
    with torch.no_grad():
        expected = reference(latent, timestep, return_dict=False)[0]
        actual = ours(latent, timestep)
    assert actual.shape == (2, 3, 8, 16, 80)
    assert_close_relative(actual, expected)


def _cast_like_loader(model, dtype, keep_fp32):
    model = copy.deepcopy(model)
    for name, param in model.named_parameters():
        if not keeps_fp32(name, keep_fp32):
            param.data = param.data.to(dtype)
    return model


def _block_output_dtypes(model, run):
    dtypes = []
    hooks = [
        block.register_forward_hook(lambda _module, _args, output: dtypes.append(output.dtype))
        for block in model.visual_transformer_blocks
    ]
    with torch.no_grad():
        output = run()
    for hook in hooks:
        hook.remove()
    return dtypes, output


def test_dit_bf16_keeps_an_fp32_residual_unlike_diffusers(transformers):
    ours, reference = transformers
    config = ours.config
    ours_bf16 = _cast_like_loader(ours, torch.bfloat16, sr_plan(config).keep_fp32)
    reference_bf16 = _cast_like_loader(
        reference, torch.bfloat16, tuple(reference._keep_in_fp32_modules)
    )
    latent, timestep = _dit_inputs(torch.bfloat16)
    our_dtypes, actual = _block_output_dtypes(ours_bf16, lambda: ours_bf16(latent, timestep))
    ref_dtypes, expected = _block_output_dtypes(
        reference_bf16, lambda: reference_bf16(latent, timestep, return_dict=False)[0]
    )
    # Seeds' choice: the residual is never cast back to bf16; diffusers rounds it after every add (T:76-80).
    assert our_dtypes == [torch.float32] * config.num_visual_blocks
    assert ref_dtypes == [torch.bfloat16] * config.num_visual_blocks
    assert actual.dtype == expected.dtype == torch.bfloat16
    assert not torch.equal(actual, expected)
    with torch.no_grad():
        fp32 = ours(latent.float(), timestep)
    assert_close_relative(actual.float(), fp32, tolerance=5e-2)
    assert_close_relative(expected.float(), fp32, tolerance=5e-2)


@pytest.fixture(scope="module")
def vae(checkpoint):
    model = build_vae(SRVAEConfig.from_json_file(checkpoint / "vae" / "config.json")).eval()
    model.load_state_dict(_weights(checkpoint, "vae"), strict=True)
    return SRVAE(model)


def test_segment_lengths():
    assert encode_segment_lengths(121) == [17, 16, 16, 16, 16, 16, 16, 8]
    assert encode_segment_lengths(17) == [17]
    assert decode_segment_lengths(31) == [5, 4, 4, 4, 4, 4, 4, 2]
    assert decode_segment_lengths(1) == [1]


def test_vae_encode_clip_matches_diffusers(vae):
    # 21 frames = segments 17 + 4, so the carried causal caches matter.
    video = torch.randint(
        0, 256, (1, 3, 21, 32, 48), dtype=torch.uint8, generator=torch.Generator().manual_seed(1)
    )
    latent = vae.encode_clip(video)
    with torch.no_grad():
        expected = vae.model.encode(video.float() / 128 - 1).latent_dist.mode() * vae.scaling_factor
    assert latent.shape == (1, 8, 6, 4, 6)
    assert torch.equal(latent, expected)
    with pytest.raises(ValueError, match="1 \\+ 4k"):
        vae.encode_clip(video[:, :, :20])


def test_vae_decode_tile_matches_diffusers_raw_output(vae):
    # 6 latent frames = segments 5 + 1; the tile gets a fresh cache chain.
    latent = torch.randn(1, 8, 6, 4, 4, generator=torch.Generator().manual_seed(2))
    raw = vae.decode_tile_raw(latent)
    with torch.no_grad():
        expected = vae.model.decode(latent / vae.scaling_factor).sample  # F.silu at norm_out
    assert raw.shape == (1, 3, 21, 32, 32)
    assert_close_relative(raw, expected)
    # A second decode gives the same frames: no cache state leaks from one tile to the next.
    frames = vae.decode_tile(latent)
    assert frames.dtype == torch.uint8 and frames.shape == (1, 21, 3, 32, 32)
    truncated = (((raw + 1) * 128 / 255).clamp(0, 1) * 255).to(torch.uint8)
    assert torch.equal(frames, truncated.transpose(1, 2))
    edges = latent_to_uint8(torch.tensor([-1.0, 0.9921875, 0.99, 2.0]))
    assert edges.tolist() == [0, 255, 254, 255]


def _upscaler_bank_and_latent(checkpoint, scale: int, dtype: torch.dtype):
    """The checkpoint's latent upscaler (diffusers' class, in `dtype`) and an fp32 latent seeded by `scale`."""
    bank = build_upscaler(
        SRUpscalerConfig.from_json_file(checkpoint / "latent_upscaler" / "config.json")
    ).eval()
    bank.load_state_dict(_weights(checkpoint, "latent_upscaler"), strict=True)
    return bank.to(dtype), torch.randn(1, 8, 3, 4, 6, generator=torch.Generator().manual_seed(scale))


@pytest.mark.parametrize("scale", [2, 4])
def test_latent_upscaler_matches_diffusers(checkpoint, scale):
    bank, latent = _upscaler_bank_and_latent(checkpoint, scale, torch.float32)
    upscaler = SRLatentUpscaler(bank)
    actual = upscaler.upscale(latent, scale)
    with torch.no_grad():
        expected = bank(latent, scale=scale, return_dict=False)[0]
    assert actual.shape == (1, 8, 3, 4 * scale, 6 * scale)
    assert torch.equal(actual, expected)
    with pytest.raises(ValueError, match="no latent upscaler for x3"):
        upscaler.upscale(latent, 3)


def _hand_piflow_step(
    output, sample, step_index, nfe=2, n_grid=10, shift=3.5, final_scale=0.5, substeps=128, eps=1e-6
):
    """§2.8 written out in float64: grid x0 predictions, then the network-free DX policy rollout."""
    warp = lambda raw: shift * raw / (1 + (shift - 1) * raw)
    segment = 1 / (nfe - (1 - final_scale))
    raw_src = 1 - step_index * segment
    raw_dst = 1 - (step_index + 1) * segment if step_index + 1 < nfe else eps
    sigma = warp(raw_src)
    x = sample.double()
    x0_grid = x.unsqueeze(-2) - sigma * output.double().unflatten(
        -1, (n_grid, -1)
    )  # channel = g * C + c
    num_substeps = max(1, round((raw_src - raw_dst) * substeps))
    delta, raw = (raw_src - raw_dst) / num_substeps, raw_src
    for _ in range(num_substeps):
        raw_now = sigma / (shift + (1 - shift) * sigma)
        u = min(max((raw_now - raw_dst) / (raw_src - raw_dst), 0.0), 1.0) * (n_grid - 1)
        j = min(max(math.floor(u), 0), n_grid - 2)
        x0 = (j + 1 - u) * x0_grid[..., j, :] + (u - j) * x0_grid[..., j + 1, :]
        velocity = (x - x0) / max(sigma, eps)
        raw = max(raw - delta, 0.0)
        next_sigma = warp(raw)
        x, sigma = x + velocity * (next_sigma - sigma), next_sigma
    return x


def test_piflow_sampler_schedule_and_steps(checkpoint):
    config = SRSchedulerConfig.from_json_file(checkpoint / "scheduler" / "scheduler_config.json")
    sampler = SRPiflowSampler(config)
    timesteps = sampler.timesteps()
    assert timesteps.dtype == torch.float32 and len(timesteps) == config.nfe == 2
    assert torch.allclose(
        timesteps.double(), torch.tensor([1000.0, 7000 / 11], dtype=torch.float64), rtol=1e-7
    )
    generator = torch.Generator().manual_seed(4)
    sample = torch.randn(1, 3, 4, 4, 8, generator=generator)
    for step_index, timestep in enumerate(timesteps):
        output = torch.randn(1, 3, 4, 4, 80, generator=generator).to(
            torch.bfloat16
        )  # bf16 DiT output
        updated = sampler.step(output, timestep, sample)
        assert updated.dtype == torch.float32  # the state stays fp32
        assert_close_relative(
            updated.double(), _hand_piflow_step(output.float(), sample, step_index)
        )
        sample = updated
    with pytest.raises(ValueError, match="must be fp32"):
        sampler.timesteps()
        sampler.step(output, timesteps[0], sample.to(torch.bfloat16))


def test_piflow_sampler_equals_diffusers_step_on_fp32_samples(checkpoint):
    config = SRSchedulerConfig.from_json_file(checkpoint / "scheduler" / "scheduler_config.json")
    sampler = SRPiflowSampler(config)
    reference = PiflowScheduler(**config.to_diffusers_kwargs())
    reference.set_timesteps(2)
    generator = torch.Generator().manual_seed(5)
    sample = torch.randn(2, 3, 4, 4, 8, generator=generator)
    expected, actual = sample, sample
    for timestep in sampler.timesteps():
        output = torch.randn(2, 3, 4, 4, 80, generator=generator)
        actual = sampler.step(output, timestep, actual)
        expected = reference.step(output, timestep, expected, return_dict=False)[0]
    assert torch.equal(actual, expected)


def test_vae_single_segment_encode_and_decode_match_diffusers(vae):
    # 17 frames and 5 latent frames are exactly one segment each: no cache is carried.
    video = torch.randint(
        0, 256, (1, 3, 17, 32, 32), dtype=torch.uint8, generator=torch.Generator().manual_seed(3)
    )
    with torch.no_grad():
        expected = vae.model.encode(video.float() / 128 - 1).latent_dist.mode() * vae.scaling_factor
    assert torch.equal(vae.encode_clip(video), expected)
    latent = torch.randn(1, 8, 5, 4, 4, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        reference = vae.model.decode(latent / vae.scaling_factor).sample
    raw = vae.decode_tile_raw(latent)
    assert raw.shape == (1, 3, 17, 32, 32)
    assert_close_relative(raw, reference)


# ---- bf16: the dtype the K-VAE and the latent-upscaler bank are loaded in by default ----


@pytest.fixture(scope="module")
def vae_bf16(checkpoint):
    model = build_vae(SRVAEConfig.from_json_file(checkpoint / "vae" / "config.json")).eval()
    model.load_state_dict(_weights(checkpoint, "vae"), strict=True)
    return SRVAE(model.to(torch.bfloat16))


def test_bf16_vae_encode_clip_equals_diffusers_bitwise(vae_bf16):
    """Our segment loop and cache chain in bf16 (21 frames: segments 17 + 4) against diffusers' own `encode` on the
    same x/128 - 1 pixels cast to bf16: the same ops in the same dtype, bit for bit."""
    video = torch.randint(
        0, 256, (1, 3, 21, 32, 48), dtype=torch.uint8, generator=torch.Generator().manual_seed(1)
    )
    latent = vae_bf16.encode_clip(video)
    with torch.no_grad():
        pixels = (video.float() / 128 - 1).to(torch.bfloat16)
        expected = vae_bf16.model.encode(pixels).latent_dist.mode() * vae_bf16.scaling_factor
    assert latent.dtype == expected.dtype == torch.bfloat16
    assert torch.equal(latent, expected)


def test_bf16_vae_decode_is_diffusers_with_the_documented_norm_out_activation(vae_bf16):
    """bf16 decode over segments 5 + 4 (9 latent frames). Documented choice (vae.py, k6-super-resolution.md §0/§2.10):
    x * sigmoid(x) at norm_out, as SG, where diffusers calls F.silu. Swapping only that activation in diffusers'
    own `decode` (forward hooks around it) gives our output bit for bit; stock diffusers differs by bf16 rounding
    only."""
    latent = torch.randn(1, 8, 9, 4, 4, generator=torch.Generator().manual_seed(2))
    raw = vae_bf16.decode_tile_raw(latent)
    decoder = vae_bf16.model.decoder
    scaled = latent.to(torch.bfloat16) / vae_bf16.scaling_factor
    with torch.no_grad():
        stock = vae_bf16.model.decode(scaled).sample
        normed = []
        hooks = [
            decoder.norm_out.register_forward_hook(lambda _m, _a, output: normed.append(output)),
            decoder.conv_out.register_forward_pre_hook(
                lambda _m, args: (normed[-1] * torch.sigmoid(normed[-1]), *args[1:])
            ),
        ]
        try:
            swapped = vae_bf16.model.decode(scaled).sample
        finally:
            for hook in hooks:
                hook.remove()
    assert len(normed) == 2  # one norm_out per causal segment
    assert raw.dtype == swapped.dtype == torch.bfloat16 and raw.shape == (1, 3, 33, 32, 32)
    assert torch.equal(raw, swapped)
    assert not torch.equal(raw, stock)  # the choice is visible in bf16 ...
    assert_close_relative(raw.float(), stock.float(), tolerance=2e-2)  # ... at bf16 rounding level


@pytest.mark.parametrize("scale", [2, 4])
def test_bf16_latent_upscaler_equals_diffusers_bitwise(checkpoint, scale):
    bank, latent = _upscaler_bank_and_latent(checkpoint, scale, torch.bfloat16)
    actual = SRLatentUpscaler(bank).upscale(latent, scale)
    with torch.no_grad():
        expected = bank(latent.to(torch.bfloat16), scale=scale, return_dict=False)[0]
    assert actual.dtype == torch.float32 and expected.dtype == torch.bfloat16  # ours hands fp32 on, as R
    assert torch.equal(actual, expected.float())
