"""Writing the output MP4: H.264 video plus an optional AAC mono soundtrack, atomically.

Video: libx264, yuv420p, CRF 18, pts = frame index in time base 1/fps (k6-super-resolution.md §2.13); x264's "medium"
preset with a 20-frame rc-lookahead (`_x264_rc_lookahead`). Audio: AAC, mono, 192 kb/s. The same inputs give
byte-identical files: x264 runs with a fixed thread count (its output depends on the count, not on timing) and without
its AVX-512 code (see `x264_cpu_flags`), and the muxer writes no library version string (x264 writes its version and
settings into the video stream and FFmpeg's AAC encoder its libavcodec version into the audio, so another PyAV's FFmpeg
or x264 gives other bytes); MP4 creation times stay 0 because no metadata is set. `write_mp4_stream` takes the frames as
chunks and encodes them in a background thread while the caller produces the next ones (a GPU decode); `write_mp4` is
that path with one chunk, so both give the same bytes.
"""

from __future__ import annotations

import errno
import functools
import itertools
import logging
import math
import numbers
import os
import platform
import queue
import threading
from collections.abc import Iterable, Iterator
from fractions import Fraction
from pathlib import Path

import av
import av.container
import numpy as np

from k6serve.media.output_names import partial_file_path

logger = logging.getLogger(__name__)

X264_THREADS_ENVIRONMENT_VARIABLE = "K6SERVE_X264_THREADS"


def _whole_number_setting(variable: str, default: int, low: int, high: int) -> int:
    """$variable as a whole number in [low, high], `default` when unset; a ValueError saying the range otherwise."""
    value = os.environ.get(variable, "").strip()
    if not value:
        return default
    if not value.isdigit() or not low <= int(value) <= high:
        raise ValueError(f"${variable} must be a whole number from {low} to {high} (default {default}), got {value!r}")
    return int(value)


def _x264_threads() -> int:
    """x264's thread count: 16 unless $K6SERVE_X264_THREADS says otherwise. Fixed, not the machine's core count,
    because x264's output bytes depend on it (the same count gives the same bytes on any machine). Measured on the
    H200 host's 16 cores (docs/benchmarks.md, sixth session): a VSR x2 request of 768x512x121, where x264 shares the
    cores with the GPU decode, spent 2.41 s encoding after the last frame with 16 threads against 3.78 s with 8
    (44.02 -> 42.52 s in all); alone, 121 noise frames of 1536x1024 encode in 9.8 s against 13.3 s. More threads
    than cores cost little (x264's own default is 1.5 per core)."""
    return _whole_number_setting(X264_THREADS_ENVIRONMENT_VARIABLE, 16, 1, 64)


X264_THREADS = _x264_threads()
RC_LOOKAHEAD_ENVIRONMENT_VARIABLE = "K6SERVE_X264_RC_LOOKAHEAD"


def _x264_rc_lookahead() -> int:
    """x264's rc-lookahead in frames: 20 unless $K6SERVE_X264_RC_LOOKAHEAD says otherwise (0-250).

    Why not x264's own 40 (its "medium" preset, whose other settings we keep): x264 encodes a frame only once the
    frames of its lookahead have arrived, so after the last frame of a streamed decode it still has about lookahead
    + thread-count frames to encode, and that tail is on the request's critical path. Measured on the H200 host
    (seventh session, `gpu_profile.py mux`, 121 frames of 1536x1024 arriving in the VSR decode's segments and
    pace, 16 threads): the tail after the last segment is 3.52 s with 40, 2.30 s with 20, 1.44 s with 10 on noise
    frames (0.51 / 0.38 / 0.28 s on smooth ones), at the same file size. On a textured, panning 384x256 clip
    (CPU) 20 keeps the PSNR of 40 (38.133 against 38.128 dB, 0.288 against 0.289 MB), 10 loses 0.08 dB at 1.4%
    less: so 20, x264's own value for
    its "faster" preset (`scripts/x264_lookahead_quality.py` repeats the PSNR comparison). Like the thread count it
    decides the bytes, so it is a fixed number."""
    return _whole_number_setting(RC_LOOKAHEAD_ENVIRONMENT_VARIABLE, 20, 0, 250)


X264_RC_LOOKAHEAD = _x264_rc_lookahead()
# Chunks waiting for the encoder thread (write_mp4_stream): 3 x 12 frames at 512x768 is ~42 MB.
QUEUED_CHUNKS = 3
AAC_BIT_RATE = 192_000
AAC_FRAME_SIZE = 1024  # samples per AAC frame
AAC_SAMPLE_RATES = (8000, 11025, 12000, 16000, 22050, 24000, 32000, 44100, 48000, 64000, 88200)
# A bound on numbered_names, so a folder already holding that many copies of one name fails instead of searching on.
MAX_NUMBERED_NAMES = 10_000
# libx264 refuses to open for a wider or taller frame (avcodec_open2 fails), whatever the level.
MAX_FRAME_SIDE = 16384
# H.264's largest level (6.2) allows frames of at most 139,264 16x16 macroblocks (8192x4320; 8K UHD 7680x4320 is
# 129,600). libx264 encodes a larger frame anyway and labels the stream level 6.2 (checked with PyAV 18: a 9000x4400
# frame), a file that conforming and hardware decoders may refuse.
MAX_FRAME_MACROBLOCKS = 139_264
# Frame rates are stored as fractions; 10^4 keeps NTSC rates exact (24000/1001, 30000/1001).
FPS_MAX_DENOMINATOR = 10_000


def frame_macroblocks(height: int, width: int) -> int:
    """16x16 macroblocks of an H.264 frame of `height` x `width` pixels."""
    return -(-height // 16) * -(-width // 16)


def write_mp4(
    path: str | os.PathLike[str],
    frames_THWC: np.ndarray,
    fps: float | Fraction,
    audio: np.ndarray | None = None,
    sample_rate: int = 44100,
    *,
    crf: int = 18,
    number_if_taken: bool = False,
) -> Path:
    """Encode RGB uint8 frames (T, H, W, 3) and an optional mono waveform to an MP4 at `path`.

    `audio` is float32 mono in [-1, 1] (clipped) at `sample_rate`; None writes video only. The file
    appears at `path` only when complete: it is written to a hidden temporary file in the same
    folder, synced and linked into place. An existing file is never replaced: a taken `path` raises
    FileExistsError, or with `number_if_taken` the file gets the first free name of
    `numbered_names(path)`; the path written is returned. On any error the temporary file is
    removed and existing files are untouched.
    """
    _check_frames(frames_THWC)
    return write_mp4_stream(path, [frames_THWC], fps, audio, sample_rate, crf=crf, number_if_taken=number_if_taken)


def write_mp4_stream(
    path: str | os.PathLike[str],
    frame_chunks: Iterable[np.ndarray],
    fps: float | Fraction,
    audio: np.ndarray | None = None,
    sample_rate: int = 44100,
    *,
    crf: int = 18,
    number_if_taken: bool = False,
    sample_aspect_ratio: Fraction | None = None,
) -> Path:
    """`write_mp4` of the concatenated chunks (same bytes), encoding while `frame_chunks` runs.

    `sample_aspect_ratio` (pixel width over height; None: square) tags the stream, so that players show frames of
    non-square pixels (an anamorphic SR source's, upscaled as stored) in their shape.

    `frame_chunks` is iterated in the calling thread (e.g. a GPU decode) while a background thread
    encodes the chunks already produced; at most `QUEUED_CHUNKS` wait in between. Every chunk is
    uint8 (T_i, H, W, 3) with the first chunk's H and W. An error on either side stops both,
    removes the temporary file and is raised here; the encoder thread has ended by then. An error
    of the producer (e.g. a request cancelled between decode chunks) drops the chunks still queued
    unencoded, so the encoder stops after the chunk it is on.
    """
    rate = fps_fraction(fps)
    waveform = None if audio is None else _check_audio(audio, sample_rate)
    if not (isinstance(crf, int) and 0 <= crf <= 51):
        raise ValueError(f"crf must be an integer in [0, 51], got {crf!r}")
    if sample_aspect_ratio is not None and not (isinstance(sample_aspect_ratio, Fraction) and sample_aspect_ratio > 0):
        raise ValueError(f"sample_aspect_ratio must be a positive Fraction or None, got {sample_aspect_ratio!r}")
    path = Path(path)
    if not path.parent.is_dir():
        # An OSError, not a ValueError: the callers check the folder before a request runs, so here it was removed
        # while it ran, and the CLI answered exit code 2 ("refused, nothing written") after the whole run.
        raise FileNotFoundError(errno.ENOENT, f"folder {str(path.parent)!r} does not exist (removed while the "
                                              "request ran?); create it and run again", str(path))
    # A leading dot keeps the partial file out of listings and artifact scans.
    temporary_path = partial_file_path(path)
    try:
        _encode_in_background(temporary_path, frame_chunks, rate, waveform, sample_rate, crf, sample_aspect_ratio)
        _fsync(temporary_path)
        path = _move_into_place(temporary_path, path, number_if_taken)
    except BaseException:
        temporary_path.unlink(missing_ok=True)
        raise
    try:
        _fsync(path.parent)  # makes the new name itself durable
    except OSError as exc:
        logger.debug("could not fsync folder %s: %s", path.parent, exc)
    return path


def numbered_names(path: Path) -> Iterator[Path]:
    """`path`, then `<stem>_1<suffix>`, `<stem>_2<suffix>`, ... in the same folder."""
    yield path
    for index in range(1, MAX_NUMBERED_NAMES):
        yield path.with_name(f"{path.stem}_{index}{path.suffix}")


def _move_into_place(temporary_path: Path, path: Path, number_if_taken: bool) -> Path:
    """Give the finished file the first free name, never replacing a file: two requests that derived the same
    name (replicas or threads, the same prompt and second) both keep their output. Returns the name taken."""
    for candidate in numbered_names(path) if number_if_taken else (path,):
        try:
            _link_without_replacing(temporary_path, candidate)
        except FileExistsError:
            continue
        temporary_path.unlink(missing_ok=True)
        return candidate
    raise FileExistsError(errno.EEXIST, "the file already exists and was left as it is", str(path))


def _link_without_replacing(source: Path, target: Path) -> None:
    """Make `target` name the file `source` names; FileExistsError when `target` exists."""
    try:
        os.link(source, target)
    except FileExistsError:
        raise
    except OSError as exc:
        if exc.errno not in (errno.EPERM, errno.EOPNOTSUPP, errno.ENOTSUP, errno.ENOSYS):
            raise
        # A filesystem without hard links (FAT, some network mounts): claim the name with an exclusive create,
        # then rename onto that empty file, which is ours, so no one else's file is ever replaced.
        os.close(os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
        os.replace(source, target)


def fps_fraction(fps: float | Fraction) -> Fraction:
    """Exact frame rate for the container time base (23.976 -> 2997/125, 24000/1001 stays)."""
    if isinstance(fps, Fraction):
        rate = fps
    elif isinstance(fps, numbers.Real) and math.isfinite(fps):
        rate = Fraction(float(fps)).limit_denominator(FPS_MAX_DENOMINATOR)
    else:
        raise ValueError(f"fps must be a finite number or a Fraction, got {fps!r}")
    if rate <= 0:
        raise ValueError(f"fps must be > 0, got {fps!r}")
    return rate


# Everything x264 uses on an AVX-512 machine except AVX-512 itself (all these CPUs have them).
_X264_AVX2_FLAGS = "MMX2,SSE,SSE2,SSE3,SSSE3,SSE4.1,SSE4.2,AVX,FMA3,BMI1,BMI2,AVX2,LZCNT"


@functools.cache
def x264_cpu_flags() -> str | None:
    """x264 `asm` flags that keep its output repeatable, or None to let x264 detect the CPU.

    x264's AVX-512 macroblock-tree code reads memory it did not write: with it, the same frames
    encode to different bytes from run to run (measured with PyAV 18.1's libx264 on an AMD EPYC).
    Limiting x264 to AVX2 makes the output repeatable at the same speed. Other CPUs keep x264's
    own detection, since forcing flags a CPU lacks would crash it.
    """
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return None
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text()
    except OSError:
        return None
    flag_lines = [line for line in cpuinfo.splitlines() if line.startswith("flags")]
    flags = flag_lines[0].split(":", 1)[1].split() if flag_lines else []
    return _X264_AVX2_FLAGS if "avx512f" in flags else None


def _check_frames(frames_THWC: np.ndarray) -> None:
    if not isinstance(frames_THWC, np.ndarray) or frames_THWC.dtype != np.uint8:
        kind = getattr(frames_THWC, "dtype", type(frames_THWC).__name__)
        raise ValueError(f"frames must be a uint8 numpy array (T, H, W, 3), got {kind}")
    if frames_THWC.ndim != 4 or frames_THWC.shape[-1] != 3 or frames_THWC.shape[0] == 0:
        raise ValueError(
            f"frames must have shape (T, H, W, 3) with T >= 1, got {tuple(frames_THWC.shape)}"
        )
    height, width = frames_THWC.shape[1:3]
    if height % 2 or width % 2 or height == 0 or width == 0:
        raise ValueError(
            f"frame size {width}x{height} (WxH) is not even; H.264 yuv420p needs even width and "
            "height: crop or pad the frames by one pixel"
        )


def _check_audio(audio: np.ndarray, sample_rate: int) -> np.ndarray:
    waveform = np.asarray(audio, dtype=np.float32)
    if waveform.ndim != 1 or waveform.shape[0] == 0:
        raise ValueError(
            f"audio must be a non-empty mono waveform of shape (num_samples,), got shape "
            f"{waveform.shape}; pass None for a video-only file"
        )
    if not np.isfinite(waveform).all():
        raise ValueError("audio contains NaN or infinite samples; fix the waveform before muxing")
    if sample_rate not in AAC_SAMPLE_RATES:
        raise ValueError(
            f"sample_rate {sample_rate} is not an AAC rate; use one of {AAC_SAMPLE_RATES}"
        )
    return np.clip(waveform, -1.0, 1.0)


def _check_next_chunk(chunk_THWC: np.ndarray, first_shape_HWC: tuple[int, ...]) -> None:
    if (
        not isinstance(chunk_THWC, np.ndarray)
        or chunk_THWC.dtype != np.uint8
        or chunk_THWC.shape[1:] != first_shape_HWC
    ):
        got = (
            (chunk_THWC.dtype, chunk_THWC.shape)
            if isinstance(chunk_THWC, np.ndarray)
            else chunk_THWC
        )
        height, width, _ = first_shape_HWC
        raise ValueError(
            f"every frame chunk must be a uint8 numpy array (T, {height}, {width}, 3) like the "
            f"first chunk, got {got!r}"
        )


class _ProducerFailed(Exception):
    """Tells the encoder thread that the chunk producer raised; the producer's error is reported."""


_END = object()
_ABORT = object()


# PyAV (18.1) releases the GIL inside avcodec_send_frame / avcodec_receive_packet, sws_scale_frame
# and av_interleaved_write_frame, and x264 encodes in its own threads, so this thread runs beside
# the decode. Measured on 2 CPU cores (48 frames 512x384, one x264 thread): 0.46 s alone,
# 0.46-0.49 s beside a thread looping torch convolutions (torch ops release the GIL too), but 1.9 s
# beside a pure-Python loop, which kept its full speed: each return from a GIL-free call then waits
# for the 5 ms switch interval. A GPU decode loop launches torch ops and waits in CUDA calls.
def _encode_in_background(
    path: Path,
    frame_chunks: Iterable[np.ndarray],
    rate: Fraction,
    waveform: np.ndarray | None,
    sample_rate: int,
    crf: int,
    sample_aspect_ratio: Fraction | None = None,
) -> None:
    """Iterate `frame_chunks` here, encode them to `path` in a thread; raise either side's error."""
    queued: queue.Queue = queue.Queue(maxsize=QUEUED_CHUNKS)
    failures: list[BaseException] = []
    aborted = threading.Event()

    def encode() -> None:
        try:
            _encode(path, _take_queued(queued, aborted), rate, waveform, sample_rate, crf, sample_aspect_ratio)
        except _ProducerFailed:
            pass
        except BaseException as exc:  # noqa: BLE001 (raised in the calling thread after the join)
            failures.append(exc)

    encoder = threading.Thread(target=encode, name="k6serve-mp4-encoder", daemon=True)
    encoder.start()
    try:
        _feed(queued, frame_chunks, encoder, failures)
    except BaseException:
        aborted.set()
        _put(queued, _ABORT, encoder, failures)
        encoder.join()
        raise
    encoder.join()
    if failures:
        raise failures[0]


def _feed(
    queued: queue.Queue,
    frame_chunks: Iterable[np.ndarray],
    encoder: threading.Thread,
    failures: list[BaseException],
) -> None:
    """Validate and queue each chunk, then the end marker; stop early when the encoder failed."""
    first_shape_HWC = None
    for chunk_THWC in frame_chunks:
        if first_shape_HWC is None:
            _check_frames(chunk_THWC)
            first_shape_HWC = chunk_THWC.shape[1:]
        else:
            _check_next_chunk(chunk_THWC, first_shape_HWC)
        if not _put(queued, chunk_THWC, encoder, failures):
            return  # the encoder's error is raised after the join
    if first_shape_HWC is None:
        raise ValueError("frame_chunks yielded no frames; an MP4 needs at least one frame")
    _put(queued, _END, encoder, failures)


def _put(
    queued: queue.Queue, item, encoder: threading.Thread, failures: list[BaseException]
) -> bool:
    """Queue `item` for the encoder, waiting while the queue is full; False once it stopped."""
    while not failures and encoder.is_alive():
        try:
            queued.put(item, timeout=0.05)
            return True
        except queue.Full:
            continue
    return False


def _take_queued(queued: queue.Queue, aborted: threading.Event) -> Iterator[np.ndarray]:
    while (item := queued.get()) is not _END:
        # Up to QUEUED_CHUNKS may wait ahead of _ABORT: encoding them would only delay a cancelled request.
        if item is _ABORT or aborted.is_set():
            raise _ProducerFailed
        yield item


def _encode(
    path: Path,
    frame_chunks: Iterator[np.ndarray],
    rate: Fraction,
    waveform: np.ndarray | None,
    sample_rate: int,
    crf: int,
    sample_aspect_ratio: Fraction | None = None,
) -> None:
    first_chunk_THWC = next(frame_chunks)  # the file is created once there is something to write
    container_options = {"movflags": "+faststart", "fflags": "+bitexact"}
    with av.open(str(path), mode="w", format="mp4", options=container_options) as container:
        height, width = first_chunk_THWC.shape[1:3]
        video_stream = _add_video_stream(container, rate, width, height, crf)
        if sample_aspect_ratio is not None:
            # x264 writes it into the stream's VUI and the MP4 muxer a 'pasp' box: players scale the width by it.
            video_stream.codec_context.sample_aspect_ratio = sample_aspect_ratio
        audio_stream = None
        if waveform is not None:
            audio_stream = _add_audio_stream(container, sample_rate)
        num_frames = 0
        next_audio_start = 0
        for chunk_THWC in itertools.chain([first_chunk_THWC], frame_chunks):
            for frame_HWC in chunk_THWC:
                container.mux(video_stream.encode(_video_frame(frame_HWC, num_frames)))
                num_frames += 1
                if audio_stream is not None and waveform is not None:  # one is made for the other
                    # Feed audio up to the end of this video frame so the file interleaves by time.
                    audio_end = min(waveform.shape[0], math.ceil(num_frames / rate * sample_rate))
                    next_audio_start = _mux_audio(
                        container, audio_stream, waveform, next_audio_start, audio_end, sample_rate
                    )
        container.mux(video_stream.encode(None))
        if audio_stream is not None and waveform is not None:
            _mux_audio(
                container, audio_stream, waveform, next_audio_start, waveform.shape[0], sample_rate
            )
            container.mux(audio_stream.encode(None))


def _add_video_stream(
    container: av.container.OutputContainer, rate: Fraction, width: int, height: int, crf: int
):
    stream = container.add_stream("libx264", rate=rate)
    stream.width = width
    stream.height = height
    stream.pix_fmt = "yuv420p"
    stream.time_base = 1 / rate  # pts = frame index
    stream.codec_context.time_base = 1 / rate
    # Frames are converted with the BT.709 matrix (_video_frame) and tagged so, which is what
    # players assume for HD; untagged files get guessed per resolution.
    x264_params = ([f"asm={x264_cpu_flags()}"] if x264_cpu_flags() else []) + [f"rc-lookahead={X264_RC_LOOKAHEAD}"]
    stream.codec_context.options = {
        "crf": str(crf),
        "threads": str(X264_THREADS),
        "x264-params": ":".join(x264_params),
        "colorspace": "bt709",
        "color_primaries": "bt709",
        "color_trc": "bt709",
        "color_range": "tv",
    }
    return stream


def _add_audio_stream(container: av.container.OutputContainer, sample_rate: int):
    stream = container.add_stream("aac", rate=sample_rate)
    stream.layout = "mono"
    stream.bit_rate = AAC_BIT_RATE
    stream.time_base = Fraction(1, sample_rate)
    stream.codec_context.time_base = Fraction(1, sample_rate)
    return stream


def _video_frame(frame_HWC: np.ndarray, index: int) -> av.VideoFrame:
    frame = av.VideoFrame.from_ndarray(np.ascontiguousarray(frame_HWC), format="rgb24")
    frame = frame.reformat(format="yuv420p", dst_colorspace="ITU709")
    frame.pts = index
    return frame


def _mux_audio(
    container: av.container.OutputContainer,
    stream,
    waveform: np.ndarray,
    start: int,
    end: int,
    sample_rate: int,
) -> int:
    """Encode whole AAC frames of waveform[start:end] (a short last one only at the very end)."""
    while start < end and (end - start >= AAC_FRAME_SIZE or end == waveform.shape[0]):
        chunk = waveform[start : start + AAC_FRAME_SIZE]
        frame = av.AudioFrame.from_ndarray(chunk[None, :].copy(), format="fltp", layout="mono")
        frame.sample_rate = sample_rate
        frame.time_base = Fraction(1, sample_rate)
        frame.pts = start
        container.mux(stream.encode(frame))
        start += chunk.shape[0]
    return start


def _fsync(path: Path) -> None:
    """Flush `path` (the written file, or its folder) to disk. The file is opened for writing: Windows' fsync
    (FlushFileBuffers) refuses a read-only handle, and every MP4 failed there once written; Windows has no fsync of
    a folder, which is skipped (its caller tolerates a failure anyway)."""
    if path.is_dir():
        if os.name == "nt":
            return
        flags = os.O_RDONLY
    else:
        flags = os.O_RDWR | getattr(os, "O_BINARY", 0)
    descriptor = os.open(path, flags)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)
