"""SR tile geometry, pre-upscale, padding, Hann blending, chunk seeding and target sizes (k6-super-resolution.md §2)."""

from __future__ import annotations

import math

import pytest
import torch

from k6serve.pipelines import sr_tiling
from k6serve.pipelines.sr_tiling import (
    axis_positions,
    blend_tiles,
    chunk_noise,
    chunk_tiles,
    hann_window_2d,
    mix_lq_noise,
    pad_to_multiple,
    plan_tiles,
    pre_upscale_size,
    pre_upscale_x1125,
    resize_frames,
    resolve_scale,
    resolve_target_size,
)

RELEASED_TILES = ((512, 512), (512, 768), (768, 512))


def test_768x512_at_x2_and_x4():
    grid = plan_tiles(512, 768, tiling_scale=2, tile_sizes=RELEASED_TILES)
    assert grid.base_size == (512, 768) and grid.tile_size == (256, 384)
    assert (grid.tops, grid.lefts) == ((0, 128, 256), (0, 192, 384))
    assert len(grid.tiles) == 9 and grid.tiles[:4] == [
        (0, 0),
        (0, 192),
        (0, 384),
        (128, 0),
    ]  # row-major
    assert grid.output_size == (1024, 1536)
    assert grid.latent_window(4) == (slice(8, 24), slice(12, 36))
    assert len(plan_tiles(512, 768, tiling_scale=4, tile_sizes=RELEASED_TILES).tiles) == 25


def test_768x512_at_x2_25():
    plan = resolve_scale(2.25)
    assert (plan.tiling_scale, plan.pre_upscale) == (2, 1.125)
    height, width = pre_upscale_size(512, 768)
    assert (height, width) == (576, 864)
    grid = plan_tiles(height, width, tiling_scale=plan.tiling_scale, tile_sizes=RELEASED_TILES)
    assert (grid.tops, grid.lefts) == ((0, 160, 320), (0, 240, 480))
    assert grid.output_size == (1152, 1728)


def test_1080p_at_x2_has_42_tiles_after_padding():
    frames = torch.zeros(1, 3, 1080, 1920, dtype=torch.uint8)
    padded = pad_to_multiple(frames)
    assert padded.shape[-2:] == (1088, 1920)
    grid = plan_tiles(1088, 1920, tiling_scale=2, tile_sizes=RELEASED_TILES)
    assert (len(grid.tops), len(grid.lefts)) == (6, 7)


def test_positions_round_half_to_even():
    # span 5 cells over 3 tiles: 2.5 rounds to 2 (not 3), so the middle tile starts at 32, not 48.
    assert axis_positions(144, 64, 0.2, 16) == [0, 32, 80]
    # R's unit rule: a length off the 16 grid moves in 1-pixel units.
    assert axis_positions(150, 64, 0.2, 16) == [0, 43, 86]
    assert axis_positions(256, 256) == [0]
    # pre-upscale sizes are half-to-even too: 64 * 1.125 / 16 = 4.5 -> 4, so 64 stays 64; 864x480 -> 976x544.
    assert pre_upscale_size(64, 64) == (64, 64)
    assert pre_upscale_size(480, 864) == (544, 976)
    assert pre_upscale_size(8, 8) == (16, 16)  # the max(16, ...) floor


def test_source_smaller_than_one_tile_names_the_minimum():
    with pytest.raises(ValueError, match="need at least 384x256") as refused:
        plan_tiles(240, 768, tiling_scale=2, tile_sizes=RELEASED_TILES)
    assert str(refused.value).endswith("; use a larger input or a higher sr_resolution_scale.")
    assert refused.value.flag_wording.endswith("; use a larger input or a higher --sr-resolution-scale.")
    with pytest.raises(ValueError, match="use 2, 4 or 2.25"):
        resolve_scale(3)


def test_pre_upscale_is_a_uint8_round_trip():
    frames = torch.randint(
        0, 256, (2, 3, 64, 80), dtype=torch.uint8, generator=torch.Generator().manual_seed(0)
    )
    upscaled = pre_upscale_x1125(frames)
    assert upscaled.dtype == torch.uint8 and upscaled.shape == (2, 3, 64, 96)
    expected = torch.nn.functional.interpolate(
        frames.float(), size=(64, 96), mode="bilinear", align_corners=False
    )
    assert torch.equal(upscaled, expected.round().clamp(0, 255).to(torch.uint8))


def test_pad_replicates_the_last_row_and_column():
    frames = torch.arange(2 * 3 * 5 * 7, dtype=torch.float32).reshape(2, 3, 5, 7).to(torch.uint8)
    padded = pad_to_multiple(frames, 4)
    assert padded.shape == (2, 3, 8, 8)
    assert torch.equal(padded[..., :5, :7], frames)
    assert torch.equal(padded[..., 7, :7], frames[..., 4, :])
    assert torch.equal(padded[..., :5, 7], frames[..., :, 6])


def test_hann_window_is_periodic_and_asymmetric():
    window_y = torch.hann_window(514)[1:-1]
    # periodic=True: w[k] = sin^2(pi (k + 1) / 514), so w[0] != w[511] (§2.11).
    assert math.isclose(window_y[0].item(), 3.73e-5, rel_tol=1e-2)
    assert math.isclose(window_y[-1].item(), 1.49e-4, rel_tol=1e-2)
    window = hann_window_2d(512, 4)
    assert torch.equal(window, window_y[:, None] * torch.hann_window(6)[1:-1][None, :])
    assert (window > 0).all()


def _reference_blend(tiles, grid):
    """Per-tile accumulation written out directly, same op order."""
    height, width = grid.output_size
    base_height, base_width = grid.base_size
    window = (
        torch.hann_window(base_height + 2)[1:-1][:, None]
        * torch.hann_window(base_width + 2)[1:-1][None, :]
    )
    acc = torch.zeros(tiles[0].shape[0], 3, height, width)
    weight = torch.zeros(height, width)
    for (top, left), tile in zip(grid.tiles, tiles):
        top, left = top * grid.scale, left * grid.scale
        acc[..., top : top + base_height, left : left + base_width] += tile.float() * window
        weight[top : top + base_height, left : left + base_width] += window
    return (acc / weight).clamp(0, 255).to(torch.uint8)


def test_blend_is_exact_divide_then_truncation_and_frame_chunks_do_not_matter():
    grid = plan_tiles(48, 64, tiling_scale=2, tile_sizes=((32, 32), (32, 48), (48, 32)), snap=8)
    assert len(grid.tiles) > 1
    generator = torch.Generator().manual_seed(1)
    tiles = [
        torch.randint(0, 256, (5, 3, *grid.base_size), dtype=torch.uint8, generator=generator)
        for _ in grid.tiles
    ]
    blended = blend_tiles(tiles, grid)
    assert blended.dtype == torch.uint8 and blended.shape == (5, 3, 96, 128)
    assert torch.equal(blended, _reference_blend(tiles, grid))
    assert torch.equal(blend_tiles(tiles, grid, frame_chunk=2), blended)
    constant = [torch.full_like(tile, 200) for tile in tiles]
    assert set(blend_tiles(constant, grid).unique().tolist()) <= {
        199,
        200,
    }  # truncation, never rounding up


def test_uncovered_pixels_stay_zero():
    grid = sr_tiling.TileGrid(
        scale=1, base_size=(4, 4), tile_size=(4, 4), source_size=(4, 8), tops=(0,), lefts=(0,)
    )
    blended = blend_tiles([torch.full((1, 3, 4, 4), 100, dtype=torch.uint8)], grid)
    assert (blended[..., 4:] == 0).all() and (blended[..., :4] >= 99).all()


def test_chunk_seeds_and_noise_stream():
    chunks = chunk_tiles(9, 2, seed=42)
    assert [(c.start, c.stop, c.seed) for c in chunks] == [
        (0, 2, 42),
        (2, 4, 44),
        (4, 6, 46),
        (6, 8, 48),
        (8, 9, 50),
    ]
    assert [c.seed for c in chunk_tiles(3, 1, seed=42)] == [42, 43, 44]
    noise = chunk_noise((2, 3, 4, 4, 8), seed=44, device="cpu", dtype=torch.float32)
    flat = torch.randn((6, 4, 4, 8), generator=torch.Generator().manual_seed(44))
    assert torch.equal(noise.reshape(6, 4, 4, 8), flat)  # same stream as R's [n*T', h, w, C] draw
    with pytest.raises(ValueError, match="tiles batch size"):
        chunk_tiles(9, 0, seed=42)


def test_noise_mix_coefficients():
    lq, eps = torch.ones(4, dtype=torch.float64), torch.full((4,), 2.0, dtype=torch.float64)
    mixed = mix_lq_noise(lq, eps, 0.7)
    assert torch.allclose(
        mixed, torch.full((4,), 0.714142842854285 + 1.4, dtype=torch.float64), atol=1e-15
    )


def test_target_resolution_fit_exact_and_downscale_only():
    # 1536x1024 (WxH) result: hd bucket by aspect is 1280x720; fit scale 0.703125 -> 1080x720.
    assert resolve_target_size(1024, 1536, "hd") == (720, 1080)
    assert resolve_target_size(1024, 1536, "hd", mode="exact") == (720, 1280)
    assert resolve_target_size(1024, 1536, "2k") == (1024, 1536)  # fit never upscales
    assert resolve_target_size(1024, 1536, "768x512") == (512, 768)
    with pytest.raises(ValueError, match="only downscale") as refused:
        resolve_target_size(1024, 1536, "2k", mode="exact")
    # The settings to change, each surface in its own names.
    assert str(refused.value) == ("sr_target_resolution '2k' (2560x1440) is larger than the 1536x1024 upscaled "
                                  "result, and target resolutions only downscale; use a larger sr_resolution_scale, "
                                  "a smaller sr_target_resolution, or sr_target_resize_mode 'fit', which keeps the "
                                  "upscaled size.")
    assert refused.value.flag_wording.startswith("--sr-target-resolution '2k' (2560x1440) is larger")
    with pytest.raises(ValueError, match=r"^sr_target_resolution '2000x1000' is larger than the 1536x1024"):
        resolve_target_size(1024, 1536, "2000x1000", mode="exact")
    with pytest.raises(ValueError, match="hd, fullhd, 2k or WxH"):
        resolve_target_size(1024, 1536, "4k")
    # A strip (1024x32 at x2) fitted into 16x16 rounded its height to 0, then stretches_aspect divided by it.
    with pytest.raises(ValueError, match=r"2048x64 upscaled result into target '16x16' \(16x16\) would leave its "
                                         r"height under 2 pixels; use a larger sr_target_resolution"):
        resolve_target_size(64, 2048, "16x16")
    assert resolve_target_size(64, 2048, "64x64") == (2, 64)
    frames = torch.randint(
        0, 256, (9, 3, 32, 48), dtype=torch.uint8, generator=torch.Generator().manual_seed(2)
    )
    resized = resize_frames(frames, (16, 24))
    expected = torch.nn.functional.interpolate(
        frames.float(), size=(16, 24), mode="bilinear", antialias=True, align_corners=False
    )
    assert torch.equal(resized, expected.clamp(0, 255).round().to(torch.uint8))


def test_tiny_checkpoint_geometry_matches_the_spec_table():
    # §6: a 64x48 (WxH) source with the tiny 8-pixel latent cell: 6 tiles at x2, 35 at x4.
    tiny_tiles = ((64, 64), (64, 128), (128, 64))
    assert len(plan_tiles(48, 64, tiling_scale=2, tile_sizes=tiny_tiles, snap=8).tiles) == 6
    assert len(plan_tiles(48, 64, tiling_scale=4, tile_sizes=tiny_tiles, snap=8).tiles) == 35


def test_the_target_tiers_are_told_with_their_sizes():
    # The help (and docs) named hd, fullhd and 2k without a size: "2k" is DCI's 2048x1080 to many, here 2560x1440.
    import dataclasses

    from k6serve.request import SamplingParams

    help_text = next(field.metadata["help"] for field in dataclasses.fields(SamplingParams)
                     if field.name == "sr_target_resolution")
    for tier, ((height, width), square, portrait) in sr_tiling.TARGET_RESOLUTIONS.items():
        assert f"{tier} ({width}x{height}" in help_text
        assert square == (height, height) and portrait == (width, height)
    assert "each also square and portrait, the one closest in aspect taken" in help_text
