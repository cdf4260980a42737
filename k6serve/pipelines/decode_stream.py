"""Stage: the video VAE decode as a stream of final uint8 frame chunks, so the MP4 encoder can start early.

diffusers' `AutoencoderKLHunyuanVideo._temporal_tiled_decode` decodes overlapping temporal tiles (4 + 1 latent
frames, stride 3), blends each tile's first frames into the tail of the previous one and keeps the first
`tile_sample_stride_num_frames` frames of each tile (12 + 1 for the first). A tile is only ever blended with the
previous, already final tile, and the blend writes into the new tile, so the frames a tile keeps are final as
soon as that tile is decoded and blended. `decode_video_chunks` runs the same per-tile calls, blend and crop and
quantises like `decode.decode_video`, so the concatenated chunks equal `decode_video(...).frames_THWC` bitwise.

Cancellation: the pipelines' `on_step(step, total)` (where the engine raises `RequestCancelled`) is called again
with the final step, `on_step(total, total)`, after each tile of the decode (`final_step_check`). In a
multi-process replica that call is a collective, so every rank must make the same checks: the ranks that do not
stream an MP4 therefore decode through these same tiles too (`decode_video_frames`).

Legend: B batch (1), C channels, T frames, H height, W width.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Generator, Iterator
from fractions import Fraction

import numpy as np
import torch

from k6serve.pipelines.decode import decode_video, float_frames, quantise
from k6serve.pipelines.state import DecodedAudio

# The class whose `_decode` / `_temporal_tiled_decode` this file mirrors (diffusers 0.42.1).
_MIRRORED_VAE_CLASS = "AutoencoderKLHunyuanVideo"


# Called between the chunks of a decode; it stops the request by raising (the engine's RequestCancelled).
ChunkCheck = Callable[[], None]


def final_step_check(on_step: Callable[[int, int], object] | None, total: int) -> ChunkCheck | None:
    """The decode's cancellation point: the final step `total` reported again through `on_step`.

    A repeat of the final step rather than a new callback, so the engine, the multi-process relay (one Progress
    message and one broadcast per call) and progress displays (which stay at total/total) work unchanged.
    """
    if on_step is None:
        return None

    def check() -> None:
        on_step(total, total)

    return check


@torch.inference_mode()
def decode_video_chunks(vae, video_BTHWC: torch.Tensor, *,
                        between_chunks: ChunkCheck | None = None) -> Iterator[np.ndarray]:
    """Latents -> uint8 frame chunks (T_i, H, W, 3) on the host, in order, each as soon as it is final.

    Without temporal tiling (a short clip, or a VAE this file does not mirror) there is one chunk, from
    `decode_video`, and `between_chunks()` runs once after it: a cancel that came after the last step was not
    looked at again, and the audio decode and the MP4 went on (a cancelled short request kept its file). Chunk i is
    handed out after tile i + 1 is queued, so on a GPU the device-to-host copy of
    chunk i and the caller's work on it overlap the decode of the next tile. `between_chunks()` runs after each
    temporal tile is decoded (the last one included: what follows is only the caller's work on the frames); the
    number of calls depends on the latents' shape and the VAE alone, the same on every rank.
    """
    latents_BCTHW = video_BTHWC.permute(0, 4, 1, 2, 3).to(vae.dtype) / vae.config.scaling_factor
    if not _uses_temporal_tiles(vae, latents_BCTHW):
        frames_THWC = decode_video(vae, video_BTHWC, keep_float=False).frames_THWC
        if between_chunks is not None:
            between_chunks()
        yield frames_THWC
        return
    pending: Callable[[], np.ndarray] | None = None
    for pixels_BCTHW in _temporal_tiles(vae, latents_BCTHW):
        started = start_host_copy(quantise(float_frames(pixels_BCTHW)))
        if between_chunks is not None:
            between_chunks()
        if pending is not None:
            yield pending()
        pending = started
    assert pending is not None  # temporal tiling means at least two tiles
    yield pending()


def decode_video_frames(vae, video_BTHWC: torch.Tensor, *,
                        between_chunks: ChunkCheck | None = None) -> np.ndarray:
    """`decode_video(vae, video_BTHWC, keep_float=False).frames_THWC` (bitwise), through the chunks of
    `decode_video_chunks`, so a caller without a sink passes the same `between_chunks` points as one with."""
    chunks = list(decode_video_chunks(vae, video_BTHWC, between_chunks=between_chunks))
    return chunks[0] if len(chunks) == 1 else np.concatenate(chunks)


def _uses_temporal_tiles(vae, latents_BCTHW: torch.Tensor) -> bool:
    """Whether diffusers' `vae.decode` would take `_temporal_tiled_decode` (the path mirrored here)."""
    if type(vae).__name__ != _MIRRORED_VAE_CLASS or hasattr(vae, "_hf_hook"):
        return False  # another VAE, or an accelerate offload hook that `vae.decode` would run first
    if latents_BCTHW.shape[0] != 1:
        return False  # decode_video decodes one clip; `use_slicing` would split a batch first
    tile_latent_min_num_frames = vae.tile_sample_min_num_frames // vae.temporal_compression_ratio
    return vae.use_framewise_decoding and latents_BCTHW.shape[2] > tile_latent_min_num_frames


def _temporal_tiles(vae, latents_BCTHW: torch.Tensor) -> Iterator[torch.Tensor]:
    """The kept, blended, cropped frames of each temporal tile, as `_temporal_tiled_decode` computes them."""
    num_frames = latents_BCTHW.shape[2]
    num_sample_frames = (num_frames - 1) * vae.temporal_compression_ratio + 1
    tile_latent_min_height = vae.tile_sample_min_height // vae.spatial_compression_ratio
    tile_latent_min_width = vae.tile_sample_min_width // vae.spatial_compression_ratio
    tile_latent_min_num_frames = vae.tile_sample_min_num_frames // vae.temporal_compression_ratio
    tile_latent_stride_num_frames = vae.tile_sample_stride_num_frames // vae.temporal_compression_ratio
    blend_num_frames = vae.tile_sample_min_num_frames - vae.tile_sample_stride_num_frames
    stride_num_frames = vae.tile_sample_stride_num_frames
    previous_BCTHW = None
    num_emitted = 0
    for start in range(0, num_frames, tile_latent_stride_num_frames):
        tile_BCTHW = latents_BCTHW[:, :, start : start + tile_latent_min_num_frames + 1]
        if start > 0 and tile_BCTHW.shape[2] == 1:
            # One latent frame decodes to one frame, which diffusers drops as the overlap frame: the tile
            # adds nothing (121 frames = 31 latents end on such a tile), so its decoder call is skipped.
            continue
        if vae.use_tiling and (tile_BCTHW.shape[-1] > tile_latent_min_width
                               or tile_BCTHW.shape[-2] > tile_latent_min_height):
            decoded_BCTHW = vae.tiled_decode(tile_BCTHW, return_dict=True).sample
        else:
            decoded_BCTHW = vae.decoder(vae.post_quant_conv(tile_BCTHW))
        if start > 0:
            # blend_t writes into its second argument, as in diffusers; the next tile blends with the result.
            decoded_BCTHW = vae.blend_t(previous_BCTHW, decoded_BCTHW[:, :, 1:], blend_num_frames)
            kept_BCTHW = decoded_BCTHW[:, :, :stride_num_frames]
        else:
            kept_BCTHW = decoded_BCTHW[:, :, : stride_num_frames + 1]
        kept_BCTHW = kept_BCTHW[:, :, : num_sample_frames - num_emitted]
        previous_BCTHW = decoded_BCTHW
        if kept_BCTHW.shape[2] > 0:
            num_emitted += kept_BCTHW.shape[2]
            yield kept_BCTHW
    assert num_emitted == num_sample_frames, (num_emitted, num_sample_frames)


def start_host_copy(frames_THWC: torch.Tensor) -> Callable[[], np.ndarray]:
    """Queue the copy of device frames to the host; the returned function waits for it and gives the array."""
    if frames_THWC.device.type != "cuda":
        host_array_THWC = frames_THWC.cpu().numpy()
        return lambda: host_array_THWC
    # Pinned memory lets the copy run asynchronously behind the next tile's kernels on the same stream.
    host_THWC = torch.empty(frames_THWC.shape, dtype=frames_THWC.dtype, pin_memory=True)
    host_THWC.copy_(frames_THWC, non_blocking=True)
    copied = torch.cuda.Event()
    copied.record()

    def wait() -> np.ndarray:
        copied.synchronize()
        return host_THWC.numpy()

    return wait


# Consumes the uint8 frame chunks (T_i, H, W, 3) while the VAE decodes them, given the decoded audio and the fps
# first (e.g. a streaming MP4 writer); it must consume every chunk before it returns.
# (frame chunks, audio, fps); a sink of super-resolution output also takes the keyword `sample_aspect_ratio`
# (`feed_video_sink`), given where the source's pixels are not square.
VideoSink = Callable[..., None]


def feed_video_sink(video_sink: VideoSink, chunks: Iterator[np.ndarray], audio: DecodedAudio | None, fps: float,
                    timings: dict[str, float], decode_key: str, *, started_at: float | None = None,
                    sample_aspect_ratio: Fraction | None = None) -> np.ndarray:
    """Hand `chunks` to `video_sink` and keep them; returns the concatenated uint8 frames (T, H, W, 3).
    A `sample_aspect_ratio` (an SR source's non-square pixels) is passed on as the sink's keyword of that name.

    timings[decode_key]: from the start (`started_at`, for a decode that began before it was handed over, or now)
    until the sink asked for a chunk after the last one, so the decode's wall
    time, including any wait for a sink that fell behind; timings["video_sink"]: how long the sink still ran after
    that (for the MP4 writer: the frames still queued and the encoder's flush).
    """
    kept: list[np.ndarray] = []
    decode_end: list[float] = []

    def produce() -> Generator[np.ndarray, None, None]:
        for chunk_THWC in chunks:
            kept.append(chunk_THWC)
            yield chunk_THWC
        decode_end.append(time.perf_counter())

    start = time.perf_counter() if started_at is None else started_at
    producer = produce()
    try:
        if sample_aspect_ratio is None:
            video_sink(producer, audio, fps)
        else:
            video_sink(producer, audio, fps, sample_aspect_ratio=sample_aspect_ratio)
    finally:
        # A sink that failed may leave its exception (and through its traceback this frame) alive in a reference
        # cycle: close both generators now, so the decode state they hold (SR: every tile's causal caches on the
        # GPU) is freed at once, not at the next garbage collection.
        producer.close()
        close = getattr(chunks, "close", None)
        if close is not None:
            close()
    if not decode_end:
        raise RuntimeError("the video_sink returned before it consumed every frame chunk")
    timings[decode_key] = decode_end[0] - start
    timings["video_sink"] = time.perf_counter() - decode_end[0]
    return kept[0] if len(kept) == 1 else np.concatenate(kept)
