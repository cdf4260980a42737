"""The real DiTs and pipeline under every parallel layout (CPU, gloo) against one process.

One pool of 4 persistent gloo processes (tests/parity/conftest.py, shared with the other parity modules) serves the
module; 2-rank layouts run as two dp replicas. Every rank runs the same per-rank code as the runtime
(`parallelize_generation_models` / `parallelize_sr_transformer` on models loaded from a tiny checkpoint) and returns
the decoded frames (floats before quantisation) and the waveform; rank 0 of the pool computes the 1-process reference
under the same thread settings.

Geometry: 48x80 pixels = 3x5 tokens per latent frame; T2AV 9 frames = 3 latent frames, TI2AV 5 frames = 2 latent
frames + the reference frame: 45 video tokens both, not a multiple of 2 or 4, and on 4 sequence ranks (shards of 12)
the reference frame (tokens 30-44) crosses a shard boundary.

Tolerances (docs/parallelism.md): Ulysses, CFG-parallel, FSDP and FSDP x Ulysses/CFG are bitwise; Ring, TP and their
combinations and encoder folding reorder sums and are held to 1e-5 relative (max |diff| <= 1e-5 * max |ref|), the
waveform to 2e-5: the vocoder amplifies the latents' differences, and on an AVX2 CPU (AMD EPYC) encoder folding and
TP with DoRA put it at 1.03-1.29e-5.
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import re
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
from test_parallel_primitives import (  # the pool fixture: tests/parity/conftest.py
    _groups,
    first_replica_groups,
    first_replica_results,
)

from k6serve.parallel.mesh import ParallelLayout

pytestmark = pytest.mark.multiprocess
HEIGHT, WIDTH = 48, 80
REQUESTS = {
    "t2av": {"prompt": "a red fox runs", "seed": 7, "num_frames": 9, "num_inference_steps": 2,
             "guidance_scale": 5.0},
    "ti2av": {"prompt": "a dog", "seed": 11, "num_frames": 5, "num_inference_steps": 2, "guidance_scale": 3.0},
}
EXACT, CLOSE = "exact", "close"
GENERATION_LAYOUTS = {  # name -> (layout, --encoder-parallel, tolerance)
    "ulysses2": (ParallelLayout(dp=2, ulysses=2), "replicate", EXACT),
    "ulysses4": (ParallelLayout(ulysses=4), "replicate", EXACT),
    "cfg2": (ParallelLayout(dp=2, cfg=2), "replicate", EXACT),
    "fsdp_cfg2": (ParallelLayout(dp=2, cfg=2, fsdp=True), "replicate", EXACT),
    # The seed's "FSDP + Ulysses matches resident Ulysses": FSDP only gathers whole weights, and auto keeps the
    # encoders replicated (encoder_folding.AUTO_FOLD_MIN_HIDDEN), so every frame and the waveform stay bitwise.
    "fsdp_ulysses2": (ParallelLayout(dp=2, ulysses=2, fsdp=True), "auto", EXACT),
    "ring2": (ParallelLayout(dp=2, ring=2), "replicate", CLOSE),
    "ring4": (ParallelLayout(ring=4), "replicate", CLOSE),  # the seed's Ring4 and TP2 x Ring2 topologies
    "tp2_ring2": (ParallelLayout(tp=2, ring=2), "replicate", CLOSE),
    "tp2": (ParallelLayout(dp=2, tp=2), "replicate", CLOSE),
    "tp2_ulysses2": (ParallelLayout(tp=2, ulysses=2), "replicate", CLOSE),
    "ulysses2_ring2": (ParallelLayout(ring=2, ulysses=2), "replicate", CLOSE),
    "fold_ulysses2": (ParallelLayout(dp=2, ulysses=2), "fold", CLOSE),
}
TI2AV_LAYOUTS = ("ulysses2", "ring2", "tp2", "ulysses2_ring2")
SR_LAYOUTS = {
    "ulysses2": (ParallelLayout(dp=2, ulysses=2), EXACT),
    "fsdp_ulysses2": (ParallelLayout(dp=2, ulysses=2, fsdp=True), EXACT),
    "ring2": (ParallelLayout(dp=2, ring=2), CLOSE),
    "tp2": (ParallelLayout(dp=2, tp=2), CLOSE),
    "ulysses2_ring2": (ParallelLayout(ring=2, ulysses=2), CLOSE),
}


_LOADED: dict = {}  # per pool process: checkpoint folder -> models loaded once


def _fresh_generation_models(folder: Path):
    from k6serve.models.kandinsky6.checkpoint import load_generation_models
    from k6serve.models.variants import recognise

    if folder not in _LOADED:
        variant = recognise(str(folder), None, folder)
        _LOADED[folder] = load_generation_models(folder, variant, device=torch.device("cpu"), dtype=torch.float32,
                                                 load_format="auto")
    models = _LOADED[folder]
    # parallelize mutates the modules it shards: every layout starts from its own copy
    return dataclasses.replace(
        models, transformer=copy.deepcopy(models.transformer), text_encoder=copy.deepcopy(models.text_encoder),
        text_encoder_2=copy.deepcopy(models.text_encoder_2),
    )


def _laid_out_models(folder: Path, layout: ParallelLayout | None, encoder_parallel: str):
    """This rank's models under `layout`, or None on the ranks other than 0 for the 1-process reference (None)."""
    from k6serve.parallel.parallelize import parallelize_generation_models

    if layout is None and dist.get_rank() != 0:
        return None
    models = _fresh_generation_models(folder)
    if layout is not None:
        parallelize_generation_models(models, _groups(layout), encoder_parallel=encoder_parallel, device_type="cpu")
    return models


def _generate_task(folder: Path, layout: ParallelLayout | None, encoder_parallel: str, request_kwargs: dict):
    """The pipeline's frames and waveform under `layout` (None: the 1-process reference, on rank 0 only)."""
    from k6serve.request_resolution import resolve_generate
    from k6serve.pipelines.text_to_video import TextToVideoPipeline
    from k6serve.request import SamplingParams

    models = _laid_out_models(folder, layout, encoder_parallel)
    if models is None:
        return None
    request, _ = resolve_generate(SamplingParams(height=HEIGHT, width=WIDTH, **request_kwargs), models.variant)
    output = TextToVideoPipeline(models)(request)
    return output.video.frames_float_THWC.numpy(), output.audio.waveform, _applied(models.transformer)


def _applied(model: torch.nn.Module) -> dict[str, int]:
    """What parallelisation did to the DiT: swapped attention modules and sharded (DTensor) parameters."""
    from torch.distributed.tensor import DTensor

    from k6serve.parallel.sequence_attention import GatherKVAttention, ShardedAttention

    return {
        "sharded_attention": sum(isinstance(m, ShardedAttention) for m in model.modules()),
        "gather_kv_attention": sum(isinstance(m, GatherKVAttention) for m in model.modules()),
        "dtensor_parameters": sum(isinstance(p, DTensor) for p in model.parameters()),
    }


WAVEFORM_BOUND = 2e-5  # relative, for CLOSE layouts (the module docstring says why)


def _assert_matches(parallel: np.ndarray, reference: np.ndarray, tolerance: str, bound: float = 1e-5) -> None:
    assert parallel.shape == reference.shape
    if tolerance == EXACT:
        assert np.array_equal(parallel, reference), np.abs(parallel - reference).max()
    else:
        difference = np.abs(parallel.astype(np.float64) - reference).max()
        assert difference <= bound * np.abs(reference).max(), difference


@pytest.fixture(scope="module")
def checkpoint(tiny_pro_foldable_dir) -> Path:
    return tiny_pro_foldable_dir


@pytest.fixture(scope="module")
def requests(tmp_path_factory) -> dict[str, dict]:
    from PIL import Image

    image_path = tmp_path_factory.mktemp("ti2av") / "reference.png"
    rng = np.random.default_rng(0)
    Image.fromarray(rng.integers(0, 255, (60, 100, 3), dtype=np.uint8)).save(image_path)
    return {**REQUESTS, "ti2av": {**REQUESTS["ti2av"], "image_path": str(image_path)}}


@pytest.fixture(scope="module")
def references(pool, checkpoint, requests) -> dict:
    """Lazily computed 1-process outputs, by request name."""
    cache: dict = {}

    def get(name: str):
        if name not in cache:
            cache[name] = pool.run(_generate_task, checkpoint, None, "replicate", requests[name])[0]
        return cache[name]

    return get


@pytest.mark.parametrize(
    ("request_name", "layout_name"),
    [("t2av", name) for name in GENERATION_LAYOUTS] + [("ti2av", name) for name in TI2AV_LAYOUTS],
)
def test_generation_matches_one_process(pool, checkpoint, requests, references, request_name, layout_name):
    layout, encoder_parallel, tolerance = GENERATION_LAYOUTS[layout_name]
    reference_frames, reference_audio, _ = references(request_name)
    for frames, audio, applied in pool.run(_generate_task, checkpoint, layout, encoder_parallel,
                                           requests[request_name]):
        _assert_matches(frames, reference_frames, tolerance)
        _assert_matches(audio, reference_audio, tolerance, bound=WAVEFORM_BOUND)
        num_blocks = 2  # the tiny DiT's fused blocks: one video_self and one audio_from_video each
        sequence_parallel = layout.sequence_degree > 1
        assert applied["sharded_attention"] == applied["gather_kv_attention"] == num_blocks * sequence_parallel
        assert (applied["dtensor_parameters"] > 0) == (layout.tp > 1 or layout.fsdp)


def _quantized_generate_task(folder: Path, layout: ParallelLayout | None, request_kwargs: dict):
    """`_generate_task` with --quantization fp8, applied as the worker does: after the layout's swaps."""
    from k6serve.request_resolution import resolve_generate
    from k6serve.parallel.parallelize import parallelize_generation_models
    from k6serve.pipelines.text_to_video import TextToVideoPipeline
    from k6serve.request import SamplingParams
    from k6serve.speed.fp8_linears import apply_quantization

    if layout is None and dist.get_rank() != 0:
        return None
    if layout is not None and first_replica_groups(layout) is None:
        return None
    models = _fresh_generation_models(folder)
    if layout is not None:
        parallelize_generation_models(models, _groups(layout), encoder_parallel="replicate", device_type="cpu")
    num_quantized = apply_quantization(models.transformer, "fp8")
    request, _ = resolve_generate(SamplingParams(height=HEIGHT, width=WIDTH, **request_kwargs), models.variant)
    output = TextToVideoPipeline(models)(request)
    return output.video.frames_float_THWC.numpy(), output.audio.waveform, num_quantized


@pytest.mark.parametrize("layout_name", ["ulysses2", "cfg2", "ring2"])
def test_quantized_generation_matches_one_process(pool, checkpoint, requests, references, layout_name):
    """--quantization fp8 with Ulysses and CFG parallel (docs/cli.md: they work with it) gives the one-process
    quantized output bit for bit: the activation scales are per token, so a rank's share of the tokens is quantized
    exactly as in the whole sequence (Ring: within rounding, as unquantized). The e4m3 rounding itself moves the
    output away from the unquantized one."""
    layout, _, tolerance = GENERATION_LAYOUTS[layout_name]
    reference_frames, reference_audio, quantized = pool.run(_quantized_generate_task, checkpoint, None,
                                                            requests["t2av"])[0]
    assert quantized == 2 * 12  # the tiny DiT's 2 fused blocks, unfused: 12 video-token linears each
    assert not np.array_equal(reference_frames, references("t2av")[0])
    for frames, audio, count in first_replica_results(
            pool.run(_quantized_generate_task, checkpoint, layout, requests["t2av"]), layout):
        assert count == quantized
        _assert_matches(frames, reference_frames, tolerance)
        _assert_matches(audio, reference_audio, tolerance, bound=WAVEFORM_BOUND)


def _fold_layout_task(folder: Path):
    """Which encoder linears are sharded after folding over 2 ranks (DTensor weights), and their local widths."""
    from torch.distributed.tensor import DTensor

    from k6serve.parallel.parallelize import fold_text_encoders

    models = _fresh_generation_models(folder)
    folded = fold_text_encoders([models.text_encoder, models.text_encoder_2], "fold",
                                _groups(ParallelLayout(dp=2, ulysses=2)), device_type="cpu")
    q_proj = models.text_encoder.model.language_model.layers[0].self_attn.q_proj.weight
    fc2 = next(m for n, m in models.text_encoder_2.named_modules() if n.endswith("layers.0.mlp.fc2")).weight
    return folded, isinstance(q_proj, DTensor), tuple(q_proj.to_local().shape), tuple(fc2.to_local().shape)


def test_encoder_fold_shards_both_encoders(pool, checkpoint):
    for folded, is_dtensor, q_shape, fc2_shape in pool.run(_fold_layout_task, checkpoint):
        assert folded and is_dtensor
        assert q_shape == (16, 32) and fc2_shape == (32, 32)  # half of the 32 query rows, half of the 64 MLP inputs


def _sr_task(folder: Path, layout: ParallelLayout | None):
    from safetensors.torch import load_file

    from k6serve.models.kandinsky6_sr.config import SRTransformerConfig
    from k6serve.models.kandinsky6_sr.transformer import SRTransformer
    from k6serve.parallel.parallelize import parallelize_sr_transformer

    if layout is None and dist.get_rank() != 0:
        return None
    config = SRTransformerConfig.from_json_file(folder / "transformer" / "config.json")
    model = SRTransformer(config).eval().requires_grad_(False)
    model.load_state_dict(load_file(folder / "transformer" / "diffusion_pytorch_model.safetensors"), strict=True)
    if layout is not None:
        parallelize_sr_transformer(model, _groups(layout), model_name="tiny-sr", device_type="cpu")
    generator = torch.Generator().manual_seed(0)
    # 3 x 5 x 7 = 105 tokens: odd, so every sequence layout pads
    latent = torch.randn(1, 3, 5, 7, 2 * config.in_visual_dim + 1, generator=generator)
    with torch.inference_mode():
        return model(latent, torch.tensor([636.36365])).numpy()


@pytest.fixture(scope="module")
def sr_reference(pool, tiny_sr_dir):
    return pool.run(_sr_task, tiny_sr_dir, None)[0]


@pytest.mark.parametrize("layout_name", list(SR_LAYOUTS))
def test_sr_transformer_matches_one_process(pool, tiny_sr_dir, sr_reference, layout_name):
    layout, tolerance = SR_LAYOUTS[layout_name]
    for output in pool.run(_sr_task, tiny_sr_dir, layout):
        _assert_matches(output, sr_reference, tolerance)


def _sr_pipeline_task(folder: Path, clip: Path, layout: ParallelLayout | None, leader_streams: bool = False):
    """The whole SR pipeline (x2, six tiles in batches of 2) under `layout`; uint8 frames.

    With `leader_streams`, rank 0 runs as the engine's leader does when it saves the MP4 (a video sink consumes
    the decode), the other ranks as followers (no sink): both must take part in the same tile-decode collectives.
    """
    from k6serve.models.kandinsky6_sr.checkpoint import load_sr_models
    from k6serve.models.variants import VARIANTS
    from k6serve.parallel.parallelize import parallelize_sr_models
    from k6serve.pipelines.super_resolution import SuperResolutionPipeline
    from k6serve.request import UpscaleRequest

    if layout is None and dist.get_rank() != 0:
        return None
    models = load_sr_models(folder, VARIANTS["vsr-distilled2steps"], device=torch.device("cpu"),
                            dtype=torch.float32, load_format="auto")
    if layout is not None:
        # The DiT layout plus whole-tile parallel decode (six tiles round-robin over the replica).
        parallelize_sr_models(models, _groups(layout), model_name="tiny-sr", device_type="cpu")
    request = UpscaleRequest(video_path=str(clip), scale=2.0, tiles_batch_size=2, tile_min_overlap=0.2,
                             target_resolution=None, target_resize_mode="fit", seed=42, requested_steps=2)
    if leader_streams and dist.get_rank() == 0:
        chunks: list[np.ndarray] = []
        frames = SuperResolutionPipeline(models)(
            request, video_sink=lambda frame_chunks, audio, fps: chunks.extend(frame_chunks)).video.frames_THWC
        assert len(chunks) == 1 and np.array_equal(chunks[0], frames)  # a replica decodes whole tiles: one chunk
        return frames
    return SuperResolutionPipeline(models)(request).video.frames_THWC


def test_sr_pipeline_matches_one_process(pool, tiny_sr_dir, tmp_path):
    from k6serve.testing.clips import make_clip

    clip = make_clip(tmp_path / "six_tiles.mp4", width=64, height=48, num_frames=9, fps=24)
    reference = pool.run(_sr_pipeline_task, tiny_sr_dir, clip, None)[0]
    for frames in pool.run(_sr_pipeline_task, tiny_sr_dir, clip, SR_LAYOUTS["ulysses2"][0]):
        assert np.array_equal(frames, reference)
    for frames in pool.run(_sr_pipeline_task, tiny_sr_dir, clip, SR_LAYOUTS["ulysses2"][0], True):
        assert np.array_equal(frames, reference)
    for frames in pool.run(_sr_pipeline_task, tiny_sr_dir, clip, SR_LAYOUTS["ulysses2_ring2"][0]):
        # Ring changes rounding (~1e-6 relative, see the DiT tests); after per-tile uint8 truncation a pixel can
        # move by one level in each of two overlapping tiles, so by two after blending.
        assert np.abs(frames.astype(int) - reference).max() <= 2


def _round_robin_task(num_tiles: int, layout: ParallelLayout):
    from k6serve.parallel.tile_decode import decode_round_robin

    calls: list[int] = []

    def decode_one(index: int) -> torch.Tensor:
        calls.append(index)
        return torch.full((2, 3, 4, 4), index, dtype=torch.uint8) + torch.arange(4, dtype=torch.uint8)

    tiles = decode_round_robin(decode_one, num_tiles, _groups(layout).replica_group)
    return tiles, calls


@pytest.mark.parametrize("num_tiles", [1, 3, 5, 8])
def test_whole_tile_parallel_decode_equals_serial_and_splits_the_work(pool, num_tiles):
    expected = [torch.full((2, 3, 4, 4), i, dtype=torch.uint8) + torch.arange(4, dtype=torch.uint8)
                for i in range(num_tiles)]
    for layout in (ParallelLayout(dp=2, ulysses=2), ParallelLayout(ulysses=4)):
        world = layout.replica_size
        for rank, (tiles, calls) in enumerate(pool.run(_round_robin_task, num_tiles, layout)):
            assert len(tiles) == num_tiles and all(torch.equal(a, b) for a, b in zip(tiles, expected))
            if num_tiles < world:  # nothing to distribute: every rank decodes every tile
                assert calls == list(range(num_tiles))
            else:
                assert calls == list(range(rank % world, num_tiles, world))


ULYSSES2 = ParallelLayout(dp=2, ulysses=2)


def _event_order_task(folder: Path):
    """Ulysses2 T2AV, one step: the order of block 0's communication and attention events, recorded through the
    collectives' starts and finishes and pre-hooks on modules that open an attention."""
    from k6serve.request_resolution import resolve_generate
    from k6serve.parallel import sequence_attention
    from k6serve.parallel.parallelize import parallelize_generation_models
    from k6serve.pipelines.text_to_video import TextToVideoPipeline
    from k6serve.request import SamplingParams

    groups = first_replica_groups(ULYSSES2)
    if groups is None:
        return None
    models = _fresh_generation_models(folder)
    parallelize_generation_models(models, groups, encoder_parallel="replicate", device_type="cpu")
    events: list[str] = []
    originals = {name: getattr(sequence_attention, name)
                 for name in ("start_gather_sequence", "start_ulysses", "finish_ulysses")}

    def start_gather(*args, **kwargs):
        events.append("gather started")
        finish = originals["start_gather_sequence"](*args, **kwargs)
        return lambda: events.append("gather awaited") or finish()

    sequence_attention.start_gather_sequence = start_gather
    sequence_attention.start_ulysses = (
        lambda *a, **k: events.append("exchange posted") or originals["start_ulysses"](*a, **k))
    sequence_attention.finish_ulysses = (
        lambda *a, **k: events.append("exchange finished") or originals["finish_ulysses"](*a, **k))
    block = models.transformer.visual_transformer_blocks[0]
    handles = [
        block.video_dec_block.cross_attention.register_forward_pre_hook(
            lambda module, args: events.append("video text attention")),
        # The norm opens the audio self-attention (the attention module's own methods run without its hooks).
        block.audio_dec_block.self_attention_norm.register_forward_pre_hook(
            lambda module, args: events.append("audio self-attention")),
    ]
    try:
        request, _ = resolve_generate(SamplingParams(height=HEIGHT, width=WIDTH, **REQUESTS["t2av"]),
                                      models.variant)
        TextToVideoPipeline(models)(dataclasses.replace(request, num_inference_steps=1))
    finally:
        for name, function in originals.items():
            setattr(sequence_attention, name, function)
        for handle in handles:
            handle.remove()
    return events


@pytest.fixture(scope="module")
def ulysses_events(pool, checkpoint) -> list[list[str]]:
    """`_event_order_task`'s events on each rank of the first Ulysses2 replica (both tests below read them)."""
    return first_replica_results(pool.run(_event_order_task, checkpoint), ULYSSES2)


def test_audio_from_video_kv_gather_runs_beside_the_text_cross_attention(ulysses_events):
    for events in ulysses_events:
        # Per block: started before the text cross-attention, awaited after it (at the audio-from-video
        # attention); block 0's hook marks where each forward's first text cross-attention falls.
        first = events.index("video text attention")
        assert events[first - 1] == "gather started" and events[first + 1] == "gather awaited", events[:6]
        assert events.count("gather started") == events.count("gather awaited") > 0


def _compiled_ulysses_task(folder: Path):
    """Ulysses2 T2AV with the DiT blocks compiled by dynamo (eager backend: the same kernels, so the same bits):
    the frames of an uncompiled run, of the first compiled request and of a second one that may not recompile."""
    import torch._dynamo

    from k6serve.models.kandinsky6.plan import kandinsky6_plan
    from k6serve.request_resolution import resolve_generate
    from k6serve.parallel.parallelize import parallelize_generation_models
    from k6serve.pipelines.text_to_video import TextToVideoPipeline
    from k6serve.request import SamplingParams
    from k6serve.speed.regional_compile import apply_regional_compile

    groups = first_replica_groups(ULYSSES2)
    if groups is None:
        return None
    models = _fresh_generation_models(folder)
    parallelize_generation_models(models, groups, encoder_parallel="replicate", device_type="cpu")
    request, _ = resolve_generate(SamplingParams(height=HEIGHT, width=WIDTH, **REQUESTS["t2av"]), models.variant)
    frames = [TextToVideoPipeline(models)(request).video.frames_float_THWC]
    apply_regional_compile(models.transformer, kandinsky6_plan(models.transformer.config), backend="eager")
    try:
        for error_on_recompile in (False, True):
            with torch._dynamo.config.patch(error_on_recompile=error_on_recompile):
                frames.append(TextToVideoPipeline(models)(request).video.frames_float_THWC)
    finally:
        torch._dynamo.reset()
    return frames


def test_compiled_blocks_carry_the_prepared_kv_across_graph_breaks(pool, checkpoint):
    # The asynchronous K/V gather returns a handle from a compiler-disabled method and takes it back in another:
    # a compiled block must pass it through its graph breaks without recompiling on the next request.
    for eager, compiled, compiled_again in first_replica_results(pool.run(_compiled_ulysses_task, checkpoint),
                                                                 ULYSSES2):
        assert torch.equal(eager, compiled) and torch.equal(eager, compiled_again)


def test_audio_self_attention_runs_beside_the_video_qkv_exchange(ulysses_events):
    for events in ulysses_events:
        first = events.index("audio self-attention")
        assert events[first - 1 : first + 2] == ["exchange posted", "audio self-attention", "exchange finished"]
        assert events.count("exchange posted") == events.count("exchange finished") > 0


# Cache-DiT: 6 steps, distance threshold 0.05. On this checkpoint the 1-process distances run 0.010, 0.017, 0.033
# then 0.060 (positive) and 0.013, 0.019, 0.037, 0.066 (negative): no decision sits near the threshold, so rounding
# in the sums cannot flip one, and some steps cache and some compute.
CACHED_REQUEST = {**REQUESTS["t2av"], "num_inference_steps": 6, "enable_cache_dit": True,
                  "cache_dit_params": {"max_warmup_steps": 1, "residual_diff_threshold": 0.05,
                                       "max_continuous_cached_steps": -1}}


def _cached_generate_task(folder: Path, layout: ParallelLayout | None):
    """A Cache-DiT request under `layout`: frames, waveform and how many DiT calls used the cache."""
    from k6serve.request_resolution import resolve_generate
    from k6serve.parallel.parallelize import parallelize_generation_models
    from k6serve.pipelines.text_to_video import TextToVideoPipeline
    from k6serve.request import SamplingParams

    if layout is None and dist.get_rank() != 0:
        return None
    models = _fresh_generation_models(folder)
    if layout is not None:
        parallelize_generation_models(models, _groups(layout), encoder_parallel="replicate", device_type="cpu")
    request, _ = resolve_generate(SamplingParams(height=HEIGHT, width=WIDTH, **CACHED_REQUEST), models.variant)
    output = TextToVideoPipeline(models)(request)
    # "... (positive: steps 1, 2, 3; negative: steps 1, 2; ...)": the cached steps of each branch.
    branches = dict(re.findall(r"(positive|negative): steps ([0-9, ]+|none)", output.notes[-1]))
    return output.video.frames_float_THWC.numpy(), output.audio.waveform, branches


@pytest.mark.parametrize("layout_name", ["ulysses4", "cfg2", "ring2", "tp2_ulysses2"])
def test_cached_generation_decides_as_one_process(pool, checkpoint, layout_name):
    """Every rank takes the 1-process decisions: the distance is summed over the real tokens of every shard (45
    tokens on 4 ranks: the last shard holds 3 padding tokens) and all-reduced; the CFG branches decide apart."""
    layout, _, tolerance = GENERATION_LAYOUTS[layout_name]
    reference_frames, reference_audio, reference_cached = pool.run(_cached_generate_task, checkpoint, None)[0]
    assert reference_cached.keys() == {"positive", "negative"}
    assert all(steps not in ("none", "1, 2, 3, 4, 5") for steps in reference_cached.values())
    for frames, audio, cached in pool.run(_cached_generate_task, checkpoint, layout):
        # CFG-parallel: each rank runs (and caches) one branch, and the note names both (it named the rank's own).
        assert cached == reference_cached
        _assert_matches(frames, reference_frames, tolerance)
        _assert_matches(audio, reference_audio, tolerance, bound=WAVEFORM_BOUND)


def _cache_switch_task(folder: Path, layout: ParallelLayout | None):
    """On one set of models (a server's): uncached, cached, then uncached again; frames, waveform and cached
    steps of each."""
    from k6serve.request_resolution import resolve_generate
    from k6serve.parallel.parallelize import parallelize_generation_models
    from k6serve.pipelines.text_to_video import TextToVideoPipeline
    from k6serve.request import SamplingParams

    if layout is None and dist.get_rank() != 0:
        return None
    if layout is not None and first_replica_groups(layout) is None:
        return None
    models = _fresh_generation_models(folder)
    if layout is not None:
        parallelize_generation_models(models, _groups(layout), encoder_parallel="replicate", device_type="cpu")
    pipeline = TextToVideoPipeline(models)
    results = []
    for cached in (False, True, False):
        kwargs = CACHED_REQUEST if cached else {k: v for k, v in CACHED_REQUEST.items() if "cache_dit" not in k}
        request, _ = resolve_generate(SamplingParams(height=HEIGHT, width=WIDTH, **kwargs), models.variant)
        output = pipeline(request)
        steps = dict(re.findall(r"(positive|negative): steps ([0-9, ]+|none)", " ".join(output.notes)))
        results.append((output.video.frames_float_THWC.numpy(), output.audio.waveform, steps))
    return results


def test_cache_dit_switches_per_request_under_fsdp_ulysses(pool, checkpoint):
    """The seed: request-level Cache-DiT switching is tested with FSDP. Under FSDP x Ulysses2 every rank takes the
    1-process decisions, the cached request equals the 1-process cached one, and the uncached requests before and
    after it equal the 1-process uncached one bit for bit."""
    reference = pool.run(_cache_switch_task, checkpoint, None)[0]
    (base_frames, base_audio, base_steps), (cached_frames, cached_audio, cached_steps), _ = reference
    assert base_steps == {} and cached_steps.keys() == {"positive", "negative"}
    assert not np.array_equal(cached_frames, base_frames)  # caching changed the output
    layout = ParallelLayout(dp=2, ulysses=2, fsdp=True)
    for results in first_replica_results(pool.run(_cache_switch_task, checkpoint, layout), layout):
        for (frames, audio, steps), (ref_frames, ref_audio, ref_steps) in zip(results, reference, strict=True):
            assert steps == ref_steps
            _assert_matches(frames, ref_frames, EXACT)
            _assert_matches(audio, ref_audio, EXACT, bound=WAVEFORM_BOUND)


# LoRA on sharded weights: column-parallel (the video FFN's input, a self-attention key, colwise under TP),
# row-parallel (the audio FFN's output, an attention output) and replicated (a time embedding) Linears.
LORA_MODULES = (
    "visual_transformer_blocks.0.video_dec_block.feed_forward.net.0.proj",
    "visual_transformer_blocks.1.audio_dec_block.feed_forward.net.2",
    "visual_transformer_blocks.0.video_dec_block.self_attention.to_key",
    "visual_transformer_blocks.1.video_dec_block.self_attention.out_layer",
    "video_time_embeddings.timestep_embedder.linear_1",
)
LORA_LAYOUTS = {  # name -> (layout, merge modes to run, tolerance)
    "tp2": (ParallelLayout(dp=2, tp=2), ("merge", "dynamic"), CLOSE),
    "fsdp_cfg2": (ParallelLayout(dp=2, cfg=2, fsdp=True), ("dynamic",), EXACT),
    "fsdp_ulysses2": (ParallelLayout(dp=2, ulysses=2, fsdp=True), ("dynamic",), EXACT),
    # The seed: Ring2 serving covers dynamic and merged LoRA restoration (each rank holds whole weights).
    "ring2": (ParallelLayout(dp=2, ring=2), ("merge", "dynamic"), CLOSE),
}


@pytest.fixture(scope="module")
def lora_adapter(checkpoint, tmp_path_factory) -> Path:
    from safetensors.torch import save_file

    models = _fresh_generation_models(checkpoint)
    generator = torch.Generator().manual_seed(3)
    tensors = {}
    for path in LORA_MODULES:
        out_features, in_features = models.transformer.get_submodule(path).weight.shape
        tensors[f"transformer.{path}.lora_A.weight"] = 0.5 * torch.randn(4, in_features, generator=generator)
        tensors[f"transformer.{path}.lora_B.weight"] = 0.5 * torch.randn(out_features, 4, generator=generator)
    file = tmp_path_factory.mktemp("lora") / "adapter.safetensors"
    save_file(tensors, str(file))
    return file


def _lora_setup(folder: Path, layout: ParallelLayout | None):
    """The tiny models parallelised as `layout` (None: one process, on rank 0 only; None elsewhere), the t2av
    request, its pipeline and a LoraManager on the DiT: what the LoRA and DoRA tasks start from."""
    from k6serve.lora.manager import LoraManager
    from k6serve.request_resolution import resolve_generate
    from k6serve.parallel.parallelize import parallelize_generation_models
    from k6serve.pipelines.text_to_video import TextToVideoPipeline
    from k6serve.request import SamplingParams

    if layout is None and dist.get_rank() != 0:
        return None
    if layout is not None and first_replica_groups(layout) is None:
        return None
    models = _fresh_generation_models(folder)
    if layout is not None:
        parallelize_generation_models(models, _groups(layout), encoder_parallel="replicate", device_type="cpu")
    request, _ = resolve_generate(SamplingParams(height=HEIGHT, width=WIDTH, **REQUESTS["t2av"]), models.variant)
    return models, request, TextToVideoPipeline(models), LoraManager(models.transformer,
                                                                     fsdp=layout is not None and layout.fsdp)


def _lora_task(folder: Path, layout: ParallelLayout | None, adapter: Path, mode: str):
    """Frames and waveform with the adapter applied as `mode` under `layout`, and whether unmerging gave the
    un-adapted output back bit for bit (None: the 1-process reference, on rank 0 only; the first replica only)."""
    from k6serve.lora.sharding import ShardedWeight
    from k6serve.lora.spec import LoraSpec

    setup = _lora_setup(folder, layout)
    if setup is None:
        return None
    models, request, pipeline, manager = setup
    base = pipeline(request)
    manager.set([LoraSpec(nickname="a", path=str(adapter))], mode)
    # How the targeted weights are sharded between requests: dimension -> count (None: whole).
    layouts = collections.Counter(ShardedWeight.of(models.transformer.get_submodule(path)
                                                   if not hasattr(models.transformer.get_submodule(path), "base")
                                                   else models.transformer.get_submodule(path).base).dim
                                  for path in LORA_MODULES)
    adapted = pipeline(request)
    manager.unmerge()
    restored = pipeline(request)
    unchanged = bool(torch.equal(restored.video.frames_float_THWC, base.video.frames_float_THWC))
    return adapted.video.frames_float_THWC.numpy(), adapted.audio.waveform, (unchanged, dict(layouts))


@pytest.mark.parametrize(("layout_name", "mode"), [(name, mode) for name, (_, modes, _) in LORA_LAYOUTS.items()
                                                   for mode in modes])
def test_lora_on_sharded_weights_matches_one_process(pool, checkpoint, lora_adapter, layout_name, mode):
    """Tensor parallelism merges each rank's block of B @ A into its shard, or adds the update to its output rows
    (column-parallel) or all-reduces the first GEMM of its input columns (row-parallel); FSDP adds it to the
    gathered weight's output. Unmerging restores the sharded weights bit for bit."""
    layout, _, tolerance = LORA_LAYOUTS[layout_name]
    reference_frames, reference_audio, (reference_restored, whole) = pool.run(_lora_task, checkpoint, None,
                                                                              lora_adapter, mode)[0]
    assert reference_restored and whole == {None: len(LORA_MODULES)}
    baseline_frames, _, _ = pool.run(_generate_task, checkpoint, None, "replicate", REQUESTS["t2av"])[0]
    assert not np.array_equal(reference_frames, baseline_frames)  # the adapter changes the output
    # TP: two column-parallel and two row-parallel targets, the time embedding whole. FSDP: the block weights are
    # row shards between requests; the root unit (the time embedding) keeps its gathered weights after a forward,
    # which is why merging into FSDP shards is refused.
    # Ring: every weight whole.
    expected = ({0: 2, 1: 2, None: 1} if layout.tp > 1 else {0: 4, None: 1} if layout.fsdp
                else {None: len(LORA_MODULES)})
    for frames, audio, (restored, layouts) in first_replica_results(
            pool.run(_lora_task, checkpoint, layout, lora_adapter, mode), layout):
        _assert_matches(frames, reference_frames, tolerance)
        _assert_matches(audio, reference_audio, tolerance, bound=WAVEFORM_BOUND)
        assert restored and layouts == expected


@pytest.fixture(scope="module")
def dora_adapter(checkpoint, lora_adapter, tmp_path_factory) -> Path:
    """`lora_adapter` with PEFT's DoRA magnitudes (`lora_magnitude_vector`): the row norms of W + B A, where PEFT
    starts them (at strength 1 DoRA is then the LoRA), scaled by U(0.5, 1.5) per row as training moves them."""
    from safetensors.torch import load_file, save_file

    transformer = _fresh_generation_models(checkpoint).transformer
    tensors = load_file(str(lora_adapter))
    generator = torch.Generator().manual_seed(4)
    for path in LORA_MODULES:
        update = tensors[f"transformer.{path}.lora_B.weight"] @ tensors[f"transformer.{path}.lora_A.weight"]
        norms = torch.linalg.norm(transformer.get_submodule(path).weight.detach().float() + update, dim=1)
        tensors[f"transformer.{path}.lora_magnitude_vector"] = norms * (0.5 + torch.rand(norms.shape,
                                                                                         generator=generator))
    file = tmp_path_factory.mktemp("dora") / "adapter.safetensors"
    save_file(tensors, str(file))
    return file


def _dora_task(folder: Path, layout: ParallelLayout | None, adapter: Path, modes: tuple[str, ...]):
    """(frames, waveform) with the DoRA adapter applied as each of `modes` in turn under `layout`; whether each
    unmerge of a merge gave this rank's targeted weights back bit for bit; how many targeted layers the dynamic
    path gave DoRA's row factors (None: the 1-process reference, on rank 0 only)."""
    from k6serve.lora.sharding import local_tensor
    from k6serve.lora.spec import LoraSpec

    setup = _lora_setup(folder, layout)
    if setup is None:
        return None
    models, request, pipeline, manager = setup
    weights = [local_tensor(models.transformer.get_submodule(path).weight).clone() for path in LORA_MODULES]
    outputs, restored, dora_layers = [], True, None
    for mode in modes:
        manager.set([LoraSpec(nickname="a", path=str(adapter))], mode)
        if mode == "dynamic":
            dora_layers = sum(delta.factor is not None for _, wrapper in manager.wrappers for delta in wrapper.deltas)
        output = pipeline(request)
        outputs.append((output.video.frames_float_THWC.numpy(), output.audio.waveform))
        manager.unmerge()
        if mode == "merge":  # (never under FSDP, whose root unit keeps its weights gathered after a forward)
            restored &= all(torch.equal(local_tensor(models.transformer.get_submodule(path).weight), weight)
                            for path, weight in zip(LORA_MODULES, weights))
    return outputs, restored, dora_layers


@pytest.mark.parametrize("layout_name", ["tp2", "fsdp_cfg2"])
def test_lora_dora_on_sharded_weights_matches_one_process(pool, checkpoint, dora_adapter, layout_name):
    """DoRA's m / ||W + s B A|| per output row, with the norm taken on the shards: local on column-parallel rows and
    FSDP's row shards, all-reduced over the group on row-parallel columns (k6serve/lora/dora.py). Tensor parallelism
    merges, then adds dynamically; FSDP adds dynamically (merge is refused there). One process call per side runs
    every mode in turn on the same models (merge, unmerge, dynamic), as a server switching modes would."""
    layout, modes, tolerance = LORA_LAYOUTS[layout_name]
    reference, reference_restored, reference_dora = pool.run(_dora_task, checkpoint, None, dora_adapter, modes)[0]
    assert reference_restored and reference_dora == len(LORA_MODULES)
    if len(modes) > 1:  # merged and dynamic DoRA are the same adapter
        for (frames, audio), (merged_frames, merged_audio) in zip(reference[1:], reference):
            _assert_matches(frames, merged_frames, CLOSE)
            _assert_matches(audio, merged_audio, CLOSE, bound=WAVEFORM_BOUND)
    for outputs, restored, dora_layers in first_replica_results(
            pool.run(_dora_task, checkpoint, layout, dora_adapter, modes), layout):
        for (frames, audio), (reference_frames, reference_audio) in zip(outputs, reference, strict=True):
            _assert_matches(frames, reference_frames, tolerance)
            _assert_matches(audio, reference_audio, tolerance, bound=WAVEFORM_BOUND)
        assert restored and dora_layers == len(LORA_MODULES)


def _fsdp_merge_task(folder: Path, adapter: Path):
    from k6serve.lora.manager import LoraManager
    from k6serve.lora.spec import LoraSpec
    from k6serve.parallel.parallelize import parallelize_generation_models

    models = _fresh_generation_models(folder)
    parallelize_generation_models(models, _groups(ParallelLayout(dp=2, cfg=2, fsdp=True)), encoder_parallel="replicate",
                                  device_type="cpu")
    manager = LoraManager(models.transformer, fsdp=True)
    try:
        manager.set([LoraSpec(nickname="a", path=str(adapter))], "merge")
    except ValueError as exc:
        refused = str(exc)
    manager.set([LoraSpec(nickname="a", path=str(adapter))], "auto")
    return refused, manager.state()[0]["merge_mode"]


def test_fsdp_refuses_merge_and_auto_is_dynamic(pool, checkpoint, lora_adapter):
    for refused, auto_mode in pool.run(_fsdp_merge_task, checkpoint, lora_adapter):
        assert "merge_mode 'merge' cannot be used with --use-fsdp-inference" in refused and auto_mode == "dynamic"


def _expand_task(folder: Path, layout: ParallelLayout | None, encoder_parallel: str, prompt: str):
    """expand_prompts' rewrite under `layout` (the text encoder folded, or replicated), 1 process for None."""
    from k6serve.pipelines.expand_prompt import expand_prompt

    models = _laid_out_models(folder, layout, encoder_parallel)
    if models is None:
        return None
    return expand_prompt(prompt, tokenizer=models.tokenizer, text_encoder=models.text_encoder,
                         device=torch.device("cpu"), seed=3, max_new_tokens=16)


@pytest.mark.parametrize("layout_name", ["ulysses2", "fold_ulysses2"])
def test_expand_prompts_rewrites_as_one_process(pool, checkpoint, layout_name):
    # generate through a folded (tensor-parallel) Qwen2.5-VL: each layer's output is all-reduced, so every rank
    # decodes the same greedy tokens as one process (the tiny config is greedy; its sums are reordered, not its
    # argmax on random weights, asserted here).
    layout, encoder_parallel, _ = GENERATION_LAYOUTS[layout_name]
    (reference,) = [text for text in pool.run(_expand_task, checkpoint, None, "replicate", "a red fox runs")
                    if text is not None]
    rewrites = pool.run(_expand_task, checkpoint, layout, encoder_parallel, "a red fox runs")
    assert reference.strip() and rewrites == [reference] * len(rewrites)
