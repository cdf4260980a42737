"""The spatial-shard SR decode (`--vae-config.parallel-decode-mode spatial_shard`) on 2 and 4 gloo ranks against the
serial decode of the same tile in one process: the tiny K-VAE's raw output within 1e-5 relative (fp32), its uint8
frames within one level, with diffusers' forwards and with the speed rewrites under compiled blocks; tiles too short
to split decode replicated, bit for bit; the whole SR pipeline, streaming or not, gives the frames of the whole-tile
decode up to that rounding (which the blend can double).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from test_parallel_primitives import GlooPool, _groups  # noqa: F401 (GlooPool: the pool fixture below)

from k6serve.parallel.mesh import ParallelLayout
from k6serve.testing.tiny_sr_checkpoint import TINY_CHANNELS

pytestmark = pytest.mark.multiprocess
LAYOUTS = {2: ParallelLayout(dp=2, ulysses=2), 4: ParallelLayout(ulysses=4)}


@pytest.fixture(scope="module")
def pool():
    pool = GlooPool()
    yield pool
    pool.close()


def _kvae(folder: Path, rewrites: bool):
    from k6serve.models.kandinsky6_sr.checkpoint import load_sr_models
    from k6serve.models.variants import VARIANTS

    vae = load_sr_models(folder, VARIANTS["vsr-distilled2steps"], device=torch.device("cpu"), dtype=torch.float32,
                         load_format="auto").vae
    if rewrites:  # what --compile-vae true installs on CUDA, with dynamo's eager backend (tracing, no inductor)
        from k6serve.speed.kvae_causal_conv import apply_single_causal_conv
        from k6serve.speed.kvae_spatial_norm import apply_commuted_spatial_norms
        from k6serve.speed.kvae_upsample import apply_subpixel_upsample
        from k6serve.speed.vae import compile_sr_decoder_blocks

        decoder = vae.model.decoder
        assert apply_commuted_spatial_norms(decoder) and apply_subpixel_upsample(decoder)
        assert apply_single_causal_conv(decoder)
        compile_sr_decoder_blocks(vae.model, backend="eager")
    return vae


def _latent(height: int, width: int = 6, frames: int = 6) -> torch.Tensor:
    # 6 latent frames: causal segments of 5 and 1, so the second segment reads the carried (halo-extended) caches.
    return torch.randn(1, TINY_CHANNELS, frames, height, width, generator=torch.Generator().manual_seed(height))


def _decode_task(folder: Path, layout: ParallelLayout, height: int, rewrites: bool):
    from k6serve.parallel.spatial_shard_decode import (
        attach_spatial_shard,
        iter_decode_tile_sharded,
        row_bounds,
    )

    vae = _kvae(folder, rewrites)
    latent = _latent(height)
    serial_raw = vae.decode_tile_raw(latent)
    serial = vae.decode_tile(latent)
    exchange = attach_spatial_shard(vae, _groups(layout).replica_group)
    assert not exchange.active and torch.equal(vae.decode_tile_raw(latent), serial_raw)  # hooks idle outside
    counters = torch._dynamo.utils.counters
    counters.clear()
    sharded = torch.cat(list(iter_decode_tile_sharded(vae, latent, exchange)), dim=1)
    # The exchange is traced into the compiled blocks' graphs: no graph break (a break at every convolution made
    # the compiled slab decode slower than the whole tile's on the GPU).
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert not rewrites or counters["stats"]["unique_graphs"] > 0
    raw = None
    if height >= exchange.world:  # the raw rows too, gathered the same way
        start, stop = row_bounds(height, exchange.world)[exchange.rank]
        with exchange.sharding():
            slab = vae.decode_tile_raw(latent[:, :, :, start:stop])
        heights = [(high - low) * vae.spatial_compression_ratio for low, high in row_bounds(height, exchange.world)]
        raw = exchange.gather_rows(slab, heights)
        # The control: the same slabs without their halo rows (zero padding at every seam).
        seams = exchange.gather_rows(vae.decode_tile_raw(latent[:, :, :, start:stop]), heights)
        assert _relative(seams, serial_raw) > 1e-3
    torch._dynamo.reset()
    return serial_raw, serial, raw, sharded


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


@pytest.mark.parametrize(("world", "rewrites"), [(2, False), (4, False), (2, True)],
                         ids=["2-diffusers_forwards", "4-diffusers_forwards", "2-compiled_rewrites"])
def test_sharded_tile_decode_matches_serial(pool, tiny_sr_dir, world, rewrites):
    # 9 latent rows: slabs of 5/4 on 2 ranks, 3/2/2/2 on 4 (uneven slabs are padded for the gather, then trimmed).
    for serial_raw, serial, raw, sharded in pool.run(_decode_task, tiny_sr_dir, LAYOUTS[world], 9, rewrites):
        assert raw.shape == serial_raw.shape == (1, 3, 21, 72, 48)
        assert _relative(raw, serial_raw) < 1e-5
        assert sharded.shape == serial.shape and sharded.dtype == torch.uint8
        assert (sharded.int() - serial.int()).abs().max() <= 1


def test_a_tile_too_short_to_split_decodes_whole_on_every_rank(pool, tiny_sr_dir):
    for _, serial, raw, sharded in pool.run(_decode_task, tiny_sr_dir, LAYOUTS[4], 3, False):
        assert raw is None and torch.equal(sharded, serial)  # 3 latent rows over 4 ranks: replicated, bit for bit


def _pipeline_task(folder: Path, clip: Path, layout: ParallelLayout | None, leader_streams: bool,
                   decode: str = "spatial_shard"):
    from k6serve.models.kandinsky6_sr.checkpoint import load_sr_models
    from k6serve.models.variants import VARIANTS
    from k6serve.parallel.parallelize import parallelize_sr_models
    from k6serve.parallel.spatial_shard_decode import spatial_shard_of
    from k6serve.parallel.tile_decode import decode_group_of
    from k6serve.pipelines.super_resolution import SuperResolutionPipeline
    from k6serve.request import UpscaleRequest

    if layout is None and torch.distributed.get_rank() != 0:
        return None
    models = load_sr_models(folder, VARIANTS["vsr-distilled2steps"], device=torch.device("cpu"),
                            dtype=torch.float32, load_format="auto")
    if layout is not None:
        parallelize_sr_models(models, _groups(layout), model_name="tiny-sr", device_type="cpu", decode=decode)
        assert (spatial_shard_of(models.vae) is not None) == (decode == "spatial_shard")
        assert (decode_group_of(models.vae) is not None) == (decode == "whole_tile")
    request = UpscaleRequest(video_path=str(clip), scale=2.0, tiles_batch_size=2, tile_min_overlap=0.2,
                             target_resolution=None, target_resize_mode="fit", seed=42, requested_steps=2)
    if leader_streams and torch.distributed.get_rank() == 0:
        chunks: list[np.ndarray] = []
        frames = SuperResolutionPipeline(models)(
            request, video_sink=lambda frame_chunks, audio, fps: chunks.extend(frame_chunks)).video.frames_THWC
        # Streamed as one rank streams: a chunk per causal segment (9 frames: 9), equal to the whole array.
        assert np.array_equal(np.concatenate(chunks), frames)
        return frames
    return SuperResolutionPipeline(models)(request).video.frames_THWC


def test_the_sr_pipeline_with_spatial_shard_matches_the_whole_tile_decode(pool, tiny_sr_dir, tmp_path):
    """Against the whole-tile decode of the same layout (one process's frames bit for bit under Ulysses2), so only
    the decode differs; the tiny DiT's 2 heads allow Ulysses2, so 4 ranks are Ulysses2 x Ring2."""
    from k6serve.testing.clips import make_clip

    clip = make_clip(tmp_path / "six_tiles.mp4", width=64, height=48, num_frames=9, fps=24)
    one_process = pool.run(_pipeline_task, tiny_sr_dir, clip, None, False)[0]
    for layout in (ParallelLayout(dp=2, ulysses=2), ParallelLayout(ring=2, ulysses=2)):
        reference = pool.run(_pipeline_task, tiny_sr_dir, clip, layout, False, "whole_tile")[0]
        if layout.ring == 1:
            assert np.array_equal(reference, one_process)
        for leader_streams in (False, True):
            results = pool.run(_pipeline_task, tiny_sr_dir, clip, layout, leader_streams)
            for frames in results:
                # Each tile's uint8 frames move by at most one level (fp32 rounding across the row split); where
                # two tiles overlap the blend can add both.
                assert frames.shape == reference.shape
                assert np.abs(frames.astype(int) - reference).max() <= 2
            assert all(np.array_equal(frames, results[0]) for frames in results)  # every rank holds the same
