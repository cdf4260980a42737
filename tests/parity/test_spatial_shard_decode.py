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
from test_parallel_primitives import (  # the pool fixture: tests/parity/conftest.py
    _groups,
    first_replica_groups,
    first_replica_results,
)

from k6serve.parallel.mesh import ParallelLayout
from k6serve.testing.tiny_sr_checkpoint import TINY_CHANNELS

pytestmark = pytest.mark.multiprocess
LAYOUTS = {2: ParallelLayout(dp=2, ulysses=2), 4: ParallelLayout(ulysses=4)}


def _kvae(folder: Path, rewrites: bool, group):
    """The tiny K-VAE, hooked for the spatial-shard decode over `group` as the engine does it: after the weights and
    the decode rewrites, before the blocks are compiled (dynamo would not see hooks added after it traced)."""
    from k6serve.models.kandinsky6_sr.checkpoint import load_sr_models
    from k6serve.models.variants import VARIANTS
    from k6serve.parallel.spatial_shard_decode import attach_spatial_shard

    vae = load_sr_models(folder, VARIANTS["vsr-distilled2steps"], device=torch.device("cpu"), dtype=torch.float32,
                         load_format="auto").vae
    decoder = vae.model.decoder
    if rewrites:  # what --compile-vae true installs on CUDA, with dynamo's eager backend (tracing, no inductor)
        from k6serve.speed.kvae_causal_conv import apply_single_causal_conv
        from k6serve.speed.kvae_spatial_norm import apply_commuted_spatial_norms
        from k6serve.speed.kvae_upsample import apply_subpixel_upsample

        assert apply_commuted_spatial_norms(decoder) and apply_subpixel_upsample(decoder)
        assert apply_single_causal_conv(decoder)
    exchange = attach_spatial_shard(vae, group)
    if rewrites:
        from k6serve.speed.vae import compile_sr_decoder_blocks

        compile_sr_decoder_blocks(vae.model, backend="eager")
    return vae, exchange


def _latent(height: int, width: int = 6, frames: int = 6) -> torch.Tensor:
    # 6 latent frames: causal segments of 5 and 1, so the second segment reads the carried (halo-extended) caches.
    return torch.randn(1, TINY_CHANNELS, frames, height, width, generator=torch.Generator().manual_seed(height))


def _decode_task(folder: Path, layout: ParallelLayout, height: int, rewrites: bool):
    from k6serve.parallel.spatial_shard_decode import iter_decode_tile_sharded, row_bounds

    groups = first_replica_groups(layout)
    if groups is None:
        return None
    vae, exchange = _kvae(folder, rewrites, groups.replica_group)
    latent = _latent(height)
    assert not exchange.active
    # The references run the same modules (rewritten or not) without tracing: dynamo's eager backend computes what
    # eager does, and tracing each reference's shapes would triple the test's time for no extra check.
    with torch.compiler.set_stance("force_eager"):
        serial_raw = vae.decode_tile_raw(latent)  # the hooks are idle outside `exchange.sharding()`
        serial = vae.decode_tile(latent)
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
        # The control: the same slabs without their halo rows (zero padding at every seam). Compiled too: the
        # blocks' graphs must guard on the idle exchange (a tile too short to split, under --compile-vae true),
        # not reuse the halo-exchanging graph, which would give the serial rows here.
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
    layout = LAYOUTS[world]
    for serial_raw, serial, raw, sharded in first_replica_results(
            pool.run(_decode_task, tiny_sr_dir, layout, 9, rewrites), layout):
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
    if layout is not None and first_replica_groups(layout) is None:
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
            results = first_replica_results(
                pool.run(_pipeline_task, tiny_sr_dir, clip, layout, leader_streams), layout)
            for frames in results:
                # Each tile's uint8 frames move by at most one level (fp32 rounding across the row split); where
                # two tiles overlap the blend can add both.
                assert frames.shape == reference.shape
                assert np.abs(frames.astype(int) - reference).max() <= 2
            assert all(np.array_equal(frames, results[0]) for frames in results)  # every rank holds the same


def _released_structure_task(layout: ParallelLayout, heights: tuple[int, ...]):
    """The released K-VAE's structure (5 levels: x16, 3 blocks per level, time x4 from level 1) at toy widths, in
    fp64, 14 latent frames (causal segments 5, 4, 4, 1): the sharded decode against serial, per height."""
    from diffusers import Kandinsky6SRVAE

    from k6serve.models.kandinsky6_sr.vae import SRVAE, latent_to_uint8
    from k6serve.parallel.spatial_shard_decode import attach_spatial_shard, iter_decode_tile_sharded, row_bounds

    torch.manual_seed(0)
    model = Kandinsky6SRVAE(latent_channels=4, encoder_block_out_channels=(4, 4, 8, 8, 8),
                            decoder_block_out_channels=(4, 8, 8, 8, 8), layers_per_block=2).to(torch.float64)
    with torch.no_grad():  # every path matters: norm gains around 1, matrices scaled to keep activations O(1)
        for name, parameter in model.named_parameters():
            if name.endswith("gamma"):
                parameter.copy_(1 + 0.1 * torch.randn_like(parameter))
            else:
                parameter.copy_(torch.randn_like(parameter) / max(1, parameter[0].numel()) ** 0.5)
    vae = SRVAE(model.eval())
    exchange = attach_spatial_shard(vae, _groups(layout).replica_group)
    results = {}
    for height in heights:
        latent = torch.randn(1, 4, 14, height, 3, generator=torch.Generator().manual_seed(height),
                             dtype=torch.float64)
        # The serial reference is the same on every rank (same seed, same weights): rank 0 decodes it once and
        # sends it to the others (4 serial fp64 decodes, and again for the uint8 frames, were most of the test's time
        # on 2 cores). `decode_tile` is `latent_to_uint8` of `decode_tile_raw`, transposed.
        if torch.distributed.get_rank() == 0:
            serial_raw = vae.decode_tile_raw(latent)
            shapes = [tuple(serial_raw.shape)]
        else:
            shapes = [None]
        torch.distributed.broadcast_object_list(shapes, src=0)
        if torch.distributed.get_rank() != 0:
            serial_raw = torch.empty(shapes[0], dtype=torch.float64)
        torch.distributed.broadcast(serial_raw, src=0)
        serial = latent_to_uint8(serial_raw).transpose(1, 2)
        start, stop = row_bounds(height, exchange.world)[exchange.rank]
        with exchange.sharding():
            slab = vae.decode_tile_raw(latent[:, :, :, start:stop])
        raw = exchange.gather_rows(slab, [(high - low) * 16 for low, high in row_bounds(height, exchange.world)])
        sharded = torch.cat(list(iter_decode_tile_sharded(vae, latent, exchange)), dim=1)
        results[height] = (tuple(serial_raw.shape), _relative(raw, serial_raw), torch.equal(sharded, serial))
    return results


def test_the_released_structure_decodes_exactly_in_fp64(pool):
    """Four causal segments (the carried, halo-extended caches three times), five levels with four upsamplers, one-
    row slabs (5 latent rows on 4 ranks: 2/1/1/1) and uneven ones (9: 3/2/2/2): the same values as serial up to
    fp64 rounding, and the same uint8 frames. (2 ranks: the fp32 tests above.)"""
    world, heights = 4, (5, 9)
    for results in pool.run(_released_structure_task, LAYOUTS[world], heights):
        for height, (shape, relative, frames_equal) in results.items():
            assert shape == (1, 3, 53, 16 * height, 48)
            assert relative < 1e-12 and frames_equal, (height, relative)


def _hook_order_task(folder: Path):
    from k6serve.parallel.spatial_shard_decode import HaloExchange, attach_spatial_shard, hook_decoder
    from k6serve.speed.vae import compile_sr_decoder_blocks

    group = _groups(LAYOUTS[2]).replica_group
    vae, exchange = _kvae(folder, False, group)
    assert hook_decoder(vae.model.decoder, exchange) == 0  # the same exchange again: nothing new
    messages = []
    for attempt in (lambda: attach_spatial_shard(vae, group),
                    lambda: hook_decoder(vae.model.decoder, HaloExchange(group))):
        try:
            attempt()
        except RuntimeError as error:
            messages.append(str(error))
    from k6serve.models.kandinsky6_sr.checkpoint import load_sr_models
    from k6serve.models.variants import VARIANTS

    compiled = load_sr_models(folder, VARIANTS["vsr-distilled2steps"], device=torch.device("cpu"),
                              dtype=torch.float32, load_format="auto").vae
    compile_sr_decoder_blocks(compiled.model, backend="eager")
    try:
        attach_spatial_shard(compiled, group)
    except RuntimeError as error:
        messages.append(str(error))
    torch._dynamo.reset()
    return messages


def test_hooks_are_attached_once_and_before_the_blocks_compile(pool, tiny_sr_dir):
    for messages in pool.run(_hook_order_task, tiny_sr_dir):
        assert messages[:2] == ["this K-VAE decoder is hooked for another spatial-shard exchange already"] * 2
        assert messages[2].startswith("hook the K-VAE decoder for the spatial-shard decode before compiling its "
                                      "blocks")


def _leader_sink_task(folder: Path, clip: Path, layout: ParallelLayout, fits: tuple[bool, bool]):
    from k6serve.models.kandinsky6_sr.checkpoint import load_sr_models
    from k6serve.models.variants import VARIANTS
    from k6serve.parallel.parallelize import parallelize_sr_models
    from k6serve.pipelines import sr_decode
    from k6serve.pipelines.super_resolution import SuperResolutionPipeline
    from k6serve.request import UpscaleRequest

    groups = first_replica_groups(layout)
    if groups is None:
        return None
    rank = torch.distributed.get_rank()
    models = load_sr_models(folder, VARIANTS["vsr-distilled2steps"], device=torch.device("cpu"),
                            dtype=torch.float32, load_format="auto")
    parallelize_sr_models(models, groups, model_name="tiny-sr", device_type="cpu", decode="spatial_shard")
    # What each rank measured: whether the segment-major order fits (leader, others). Where they differ they must
    # agree on the tile-major order.
    fits_here = fits[0] if rank == 0 else fits[1]
    original = sr_decode._segment_major_fits
    sr_decode._segment_major_fits = lambda device, per_tile_bytes, num_tiles: fits_here
    request = UpscaleRequest(video_path=str(clip), scale=2.0, tiles_batch_size=2, tile_min_overlap=0.2,
                             target_resolution=None, target_resize_mode="fit", seed=42, requested_steps=2)
    outcome = "finished"
    try:
        if rank == 0:
            def sink(frame_chunks, audio, fps):
                next(frame_chunks)
                raise OSError(28, "No space left on device")

            SuperResolutionPipeline(models)(request, video_sink=sink)
        else:
            SuperResolutionPipeline(models)(request)
    except OSError as error:
        outcome = f"OSError {error.errno}"
    finally:
        sr_decode._segment_major_fits = original
    # Still in step: one more collective on the replica returns at once on every rank.
    flag = torch.ones(1)
    torch.distributed.all_reduce(flag, group=groups.replica_group)
    return outcome, int(flag.item())


@pytest.mark.parametrize("fits", [(True, True), (True, False)], ids=["segment_major", "leader_fits_only"])
def test_a_failing_leader_sink_leaves_the_replica_in_step(pool, tiny_sr_dir, tmp_path, fits):
    """49 frames: three causal segments, and a chunk is handed out once the next segment is decoded, so segment-
    major the leader's sink fails while the others still have a segment to decode (and halo rows to exchange): the
    leader decodes its share to the end, with the cancellation checks, before its error goes up. Where the ranks
    measured different fits they agree on whole tiles first."""
    from k6serve.testing.clips import make_clip

    clip = make_clip(tmp_path / "three_segments.mp4", width=64, height=48, num_frames=49, fps=24)
    results = first_replica_results(pool.run(_leader_sink_task, tiny_sr_dir, clip, LAYOUTS[2], fits), LAYOUTS[2])
    assert results == [("OSError 28", 2), ("finished", 2)]
