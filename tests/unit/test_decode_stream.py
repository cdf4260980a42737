"""The streamed video decode and MP4 write: same frames and same bytes as the one-shot path, clean failures.

CPU, fp32, a tiny HunyuanVideo VAE (8 channels, the real 4x temporal / 8x spatial compression and default
temporal tiles of 4 + 1 latent frames, stride 3).
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from k6serve.media import mux
from k6serve.pipelines.decode import decode_video
from k6serve.pipelines.decode_stream import decode_video_chunks
from k6serve.testing.clips import moving_pattern

ENCODER_THREAD = "k6serve-mp4-encoder"


@pytest.fixture(scope="module")
def vae():
    from diffusers import AutoencoderKLHunyuanVideo

    torch.manual_seed(0)
    return AutoencoderKLHunyuanVideo(block_out_channels=(8, 8, 8, 8), layers_per_block=1,
                                     norm_num_groups=4).eval()


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _latents(num_latent_frames: int, height: int = 4, width: int = 6, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(1, num_latent_frames, height, width, 16, generator=generator)


def _count_calls(monkeypatch, owner, name: str) -> list[int]:
    calls = [0]
    original = getattr(owner, name)

    def counted(*args, **kwargs):
        calls[0] += 1
        return original(*args, **kwargs)

    monkeypatch.setattr(owner, name, counted)
    return calls


def _count_forwards(module: torch.nn.Module) -> list[int]:
    calls = [0]

    def count(*_) -> None:
        calls[0] += 1

    module.register_forward_pre_hook(count)  # the module fixture is shared: the hook only counts
    return calls


def _encoder_threads() -> list[threading.Thread]:
    return [thread for thread in threading.enumerate() if thread.name == ENCODER_THREAD]


# ---- decode_video_chunks ----


@pytest.mark.parametrize(("num_latent_frames", "chunk_sizes", "num_decoder_calls"), [
    (9, [13, 12, 8], 3),
    # 10 latents: diffusers' last tile holds one latent frame, which it decodes and drops; we skip it.
    (10, [13, 12, 12], 3),
    (11, [13, 12, 12, 4], 4),
])
def test_chunks_equal_decode_video_over_several_temporal_tiles(vae, monkeypatch, num_latent_frames, chunk_sizes,
                                                               num_decoder_calls):
    latents = _latents(num_latent_frames)
    tiled = _count_calls(monkeypatch, vae, "_temporal_tiled_decode")
    reference = decode_video(vae, latents).frames_THWC
    assert tiled[0] == 1  # diffusers really takes the temporal tiles
    decoder_calls = _count_forwards(vae.decoder)
    chunks = list(decode_video_chunks(vae, latents))
    assert [chunk.shape[0] for chunk in chunks] == chunk_sizes
    assert all(chunk.dtype == np.uint8 and chunk.shape[1:] == (32, 48, 3) for chunk in chunks)
    assert np.array_equal(np.concatenate(chunks), reference)
    assert decoder_calls[0] == num_decoder_calls


def test_bf16_chunks_equal_diffusers_tiled_decode_and_pil_postprocess(vae):
    """The default bf16 VAE over several temporal tiles (11 latent frames: 4 tiles): the streamed chunks equal
    diffusers' own `vae.decode` + `postprocess_video(output_type="pil")` bit for bit (blend and denormalisation in
    bf16, then round(x * 255))."""
    import copy

    from diffusers.video_processor import VideoProcessor

    bf16_vae = copy.deepcopy(vae).to(torch.bfloat16)
    latents = _latents(11).to(torch.bfloat16)
    chunks = np.concatenate(list(decode_video_chunks(bf16_vae, latents)))
    with torch.inference_mode():
        pixels = bf16_vae.decode(latents.permute(0, 4, 1, 2, 3) / bf16_vae.config.scaling_factor).sample
    pil = VideoProcessor(vae_scale_factor=8).postprocess_video(pixels, output_type="pil")[0]
    expected = np.stack([np.asarray(frame) for frame in pil])
    assert chunks.shape == expected.shape == (41, 32, 48, 3)
    assert np.array_equal(chunks, expected)
    assert np.array_equal(chunks, decode_video(bf16_vae, latents).frames_THWC)


def test_chunks_come_out_one_tile_behind_the_decode(vae, monkeypatch):
    decoder_calls = _count_forwards(vae.decoder)
    stream = decode_video_chunks(vae, _latents(11))
    seen = []
    for chunk in stream:
        seen.append((chunk.shape[0], decoder_calls[0]))
    # Chunk i is handed out once tile i + 1 is decoded (queued, on a GPU); the last one after the loop.
    assert seen == [(13, 2), (12, 3), (12, 4), (4, 4)]


def test_short_clip_and_framewise_off_give_one_chunk(vae, monkeypatch):
    short = _latents(4)  # 4 latent frames: diffusers decodes them in one call
    chunks = list(decode_video_chunks(vae, short))
    assert len(chunks) == 1 and np.array_equal(chunks[0], decode_video(vae, short).frames_THWC)
    monkeypatch.setattr(vae, "use_framewise_decoding", False)
    long = _latents(9)
    chunks = list(decode_video_chunks(vae, long))
    assert len(chunks) == 1 and chunks[0].shape[0] == 33
    assert np.array_equal(chunks[0], decode_video(vae, long).frames_THWC)


def test_spatial_tiles_inside_temporal_tiles_match(vae, monkeypatch):
    # Smaller tiles in both directions: 2 + 1 latent frames, stride 1, blend 4 frames; 32 px spatial tiles.
    for name, value in [("use_tiling", True), ("tile_sample_min_height", 32), ("tile_sample_min_width", 32),
                        ("tile_sample_stride_height", 24), ("tile_sample_stride_width", 24),
                        ("tile_sample_min_num_frames", 8), ("tile_sample_stride_num_frames", 4)]:
        monkeypatch.setattr(vae, name, value)
    latents = _latents(4, height=6, width=8)
    spatial = _count_calls(monkeypatch, vae, "tiled_decode")
    reference = decode_video(vae, latents).frames_THWC
    assert spatial[0] > 0
    chunks = list(decode_video_chunks(vae, latents))
    assert [chunk.shape[0] for chunk in chunks] == [5, 4, 4]
    assert np.array_equal(np.concatenate(chunks), reference)


# ---- write_mp4_stream ----


@pytest.mark.parametrize("with_audio", [False, True])
def test_streamed_mp4_has_the_same_bytes_as_write_mp4(tmp_path: Path, with_audio: bool):
    frames = moving_pattern(96, 64, 41)
    audio = (0.3 * np.sin(np.arange(70_000) / 44100 * 2 * np.pi * 330)).astype(np.float32) if with_audio else None
    reference = mux.write_mp4(tmp_path / "one.mp4", frames, 24, audio).read_bytes()
    chunks = [frames[:13], frames[13:25], frames[25:25], frames[25:40], frames[40:]]
    path = mux.write_mp4_stream(tmp_path / "stream.mp4", iter(chunks), 24, audio)
    assert path == tmp_path / "stream.mp4"
    assert path.read_bytes() == reference
    assert not _encoder_threads()


def test_producer_error_mid_stream_leaves_no_file_and_no_thread(tmp_path: Path):
    listing_during: list[str] = []

    def chunks():
        yield moving_pattern(64, 48, 12)
        yield moving_pattern(64, 48, 12)
        for _ in range(500):  # the encoder thread creates the partial file once it has the first chunk
            if any(tmp_path.iterdir()):
                break
            time.sleep(0.01)
        listing_during.extend(path.name for path in tmp_path.iterdir())
        raise RuntimeError("decode exploded")

    with pytest.raises(RuntimeError, match="decode exploded"):
        mux.write_mp4_stream(tmp_path / "out.mp4", chunks(), 24, np.zeros(44100, np.float32))
    assert len(listing_during) == 1 and listing_during[0].startswith(".out.mp4.")
    assert list(tmp_path.iterdir()) == []
    assert not _encoder_threads()


def test_encoder_error_stops_the_producer(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    real_video_frame = mux._video_frame

    def failing_video_frame(frame_HWC: np.ndarray, index: int):
        if index == 5:
            raise RuntimeError("encoder exploded")
        return real_video_frame(frame_HWC, index)

    monkeypatch.setattr(mux, "_video_frame", failing_video_frame)
    produced = [0]

    def chunks():
        for _ in range(50):
            produced[0] += 1
            yield moving_pattern(32, 32, 4)

    with pytest.raises(RuntimeError, match="encoder exploded"):
        mux.write_mp4_stream(tmp_path / "out.mp4", chunks(), 24)
    assert produced[0] < 50
    assert list(tmp_path.iterdir()) == [] and not _encoder_threads()


@pytest.mark.parametrize(("chunks", "message"), [
    ([np.zeros((2, 32, 32, 3), np.uint8), np.zeros((2, 32, 48, 3), np.uint8)], r"\(T, 32, 32, 3\) like the first"),
    ([np.zeros((2, 32, 32, 3), np.uint8), np.zeros((2, 32, 32, 3), np.float32)], "uint8"),
    ([np.zeros((2, 32, 33, 3), np.uint8)], "not even"),
    ([], "no frames"),
])
def test_bad_chunks_are_rejected_without_a_file(tmp_path: Path, chunks, message: str):
    with pytest.raises(ValueError, match=message):
        mux.write_mp4_stream(tmp_path / "bad.mp4", chunks, 24)
    assert list(tmp_path.iterdir()) == [] and not _encoder_threads()


# ---- the worker ----


def test_worker_streams_the_decode_into_the_same_mp4(tiny_distill_dir, tmp_path: Path, monkeypatch):
    from k6serve.engine_arguments import build_engine_config
    from k6serve.request_arguments import split_kwargs
    from k6serve.runtime.worker import ModelWorker

    worker = ModelWorker(build_engine_config(str(tiny_distill_dir), device="cpu", warmup_mode="off"))
    streamed = _count_calls(monkeypatch, mux, "write_mp4_stream")
    params, output = split_kwargs({"prompt": "a fox", "seed": 5, "height": 32, "width": 32, "num_frames": 33,
                                   "output_path": str(tmp_path), "output_file_name": "clip.mp4",
                                   "return_frames": True})
    result = worker.run(params, output)
    assert streamed[0] == 1
    assert result.frames.shape == (33, 32, 32, 3) and result.audio is not None
    assert {"decode_video", "mux"} <= result.timings.keys() and "video_sink" not in result.timings
    # The frames of the one-shot decode, and the file write_mp4 makes from them.
    request, _ = worker.resolve(params)
    assert np.array_equal(worker.pipeline(request).video.frames_THWC, result.frames)
    reference = mux.write_mp4(tmp_path / "reference.mp4", result.frames, result.fps, result.audio,
                              result.audio_sample_rate)
    assert Path(result.output_file_path).read_bytes() == reference.read_bytes()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the pinned, asynchronous host copy needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunks_equal_decode_video_on_the_gpu(vae, dtype):
    gpu_vae = vae.to("cuda", dtype)
    try:
        latents = _latents(11).to("cuda")
        chunks = list(decode_video_chunks(gpu_vae, latents))
        assert np.array_equal(np.concatenate(chunks), decode_video(gpu_vae, latents).frames_THWC)
    finally:
        vae.to("cpu", torch.float32)
