"""k6serve.media on synthetic clips: MP4 writing, the SR 24 fps rule, source audio, probe, images."""

from __future__ import annotations

import errno
import hashlib
import io
import logging
import re
import subprocess
import sys
import warnings
from fractions import Fraction
from pathlib import Path

import av
import numpy as np
import PIL.Image
import PIL.features
import pytest

from k6serve import media
from k6serve.media import mux
from k6serve.media.video import SRSourceReader, floor_frame_count, plan_frame_rate, sr_source_indices
from k6serve.testing.clips import add_cover_art, make_audio_only_file, make_clip, moving_pattern

AAC_FRAME_SIZE = 1024


@pytest.fixture(scope="module")
def clips(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("clips")
    size = {"width": 64, "height": 48}
    return {
        "30fps_stereo": make_clip(
            folder / "a30.mp4", **size, num_frames=40, fps=30, audio="stereo_tone"
        ),
        "24fps_silent": make_clip(folder / "a24.mp4", **size, num_frames=40, fps=24),
        "23.976_mono": make_clip(
            folder / "a23.mp4", **size, num_frames=40, fps=Fraction(24000, 1001), audio="mono_tone"
        ),
        "25fps_mkv": make_clip(folder / "a25.mkv", **size, num_frames=40, fps=25),
        "12fps_mkv_stereo": make_clip(
            folder / "a12.mkv", **size, num_frames=20, fps=12, audio="stereo_tone"
        ),
    }


def _psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2)
    return 10 * np.log10(255.0**2 / mse)


# ---- write_mp4 ----


def test_round_trip_keeps_size_count_fps_and_pixels(tmp_path: Path) -> None:
    frames = moving_pattern(96, 64, 17)
    path = media.write_mp4(tmp_path / "out.mp4", frames, 24)
    assert path == tmp_path / "out.mp4"
    info = media.probe(path)
    assert (info.width, info.height, info.num_frames, info.fps) == (96, 64, 17, 24.0)
    assert info.video_codec == "h264" and not info.has_audio and info.audio_num_samples is None
    decoded = media.read_video(path)
    assert decoded.frames.shape == frames.shape and decoded.frames.dtype == np.uint8
    assert decoded.fps == 24.0
    assert _psnr(decoded.frames, frames) > 35.0  # crf 18 on a smooth pattern


def test_flat_colors_survive_the_yuv_round_trip(tmp_path: Path) -> None:
    # A BT.601/BT.709 mix-up between writing and reading shifts saturated colors by 10+ levels.
    colors = np.array([[200, 30, 60], [20, 180, 90], [40, 60, 220], [128, 128, 128]], np.uint8)
    frames = np.repeat(colors[:, None, None, :], 32, axis=1).repeat(32, axis=2)
    decoded = media.read_video(media.write_mp4(tmp_path / "flat.mp4", frames, 24)).frames
    centers = decoded[:, 8:24, 8:24].reshape(4, -1, 3).mean(axis=1)
    np.testing.assert_allclose(centers, colors, atol=2.5)


@pytest.mark.parametrize(
    ("fps", "expected"),
    [(23.976, 23.976), (Fraction(24000, 1001), 24000 / 1001), (29.97, 29.97), (12.5, 12.5)],
)
def test_fractional_fps_is_stored_exactly(tmp_path: Path, fps, expected: float) -> None:
    path = media.write_mp4(tmp_path / "f.mp4", moving_pattern(32, 32, 5), fps)
    assert media.probe(path).fps == pytest.approx(expected, rel=1e-12)
    assert mux.fps_fraction(23.976) == Fraction(2997, 125)
    assert mux.fps_fraction(24000 / 1001) == Fraction(24000, 1001)


def test_audio_track_is_aac_mono_44k_and_as_long_as_the_waveform(tmp_path: Path) -> None:
    num_samples = 30_000
    time_s = np.arange(num_samples) / 44100
    waveform = (0.6 * np.sin(2 * np.pi * 440 * time_s)).astype(np.float32)
    path = media.write_mp4(tmp_path / "av.mp4", moving_pattern(64, 48, 17), 24, waveform)
    info = media.probe(path)
    assert (info.audio_codec, info.audio_channels, info.audio_sample_rate) == ("aac", 1, 44100)
    # The AAC encoder prepends 1,024 priming samples and pads the last frame to 1,024. The MP4 edit
    # list marks the priming, which FFmpeg's decoder drops; the padding of the last frame is still
    # decoded. So the decoded length is the waveform length rounded up to whole AAC frames.
    assert 0 <= info.audio_num_samples - num_samples < AAC_FRAME_SIZE
    decoded = media.read_source_audio(path, num_samples=num_samples)
    assert decoded.shape == (num_samples,)
    # Aligned in time (priming removed) and faithful away from the encoder's start transient.
    np.testing.assert_allclose(decoded[2048:-2048], waveform[2048:-2048], atol=0.02)


def test_audio_over_full_scale_is_scaled_into_unit_range(tmp_path: Path) -> None:
    # A soundtrack that decodes above 1 is scaled as a whole to a peak of 1 (media/audio.py), not clipped.
    time_s = np.arange(20_000) / 44100
    loud = (2.0 * np.sin(2 * np.pi * 220 * time_s)).astype(np.float32)
    path = media.write_mp4(tmp_path / "loud.mp4", moving_pattern(32, 32, 10), 24, loud)
    decoded = media.read_source_audio(path, num_samples=None)
    assert np.abs(decoded).max() == 1.0 and 0.8 < np.abs(decoded[2048:-2048]).max() <= 1.0


def test_same_input_gives_identical_bytes(tmp_path: Path) -> None:
    frames = moving_pattern(320, 240, 17)  # a size where x264's AVX-512 path varied run to run
    waveform = (0.3 * np.sin(np.arange(30_000) / 44100 * 2 * np.pi * 330)).astype(np.float32)
    digests = set()
    for attempt in range(3):
        # Fill freed heap memory with garbage so reads of unwritten memory would show up.
        garbage = [np.random.default_rng(attempt).bytes(1 << 20) for _ in range(8)]
        del garbage
        path = media.write_mp4(tmp_path / f"d{attempt}.mp4", frames, 24, waveform)
        digests.add(hashlib.sha256(path.read_bytes()).hexdigest())
    code = (
        "import sys, numpy as np; from k6serve import media; "
        "from k6serve.testing.clips import moving_pattern; "
        "w = (0.3 * np.sin(np.arange(30_000) / 44100 * 2 * np.pi * 330)).astype(np.float32); "
        "media.write_mp4(sys.argv[1], moving_pattern(320, 240, 17), 24, w)"
    )
    subprocess.run([sys.executable, "-c", code, str(tmp_path / "sub.mp4")], check=True)
    digests.add(hashlib.sha256((tmp_path / "sub.mp4").read_bytes()).hexdigest())
    assert len(digests) == 1
    assert b"Lavf" not in (tmp_path / "sub.mp4").read_bytes()  # no library version string


@pytest.mark.parametrize(
    ("parse", "variable", "default", "good", "bads", "message"),
    [
        (mux._x264_threads, "K6SERVE_X264_THREADS", 16, "8", ("0", "auto", "-2", "100"),
         "K6SERVE_X264_THREADS must be a whole number from 1 to 64"),
        (mux._x264_rc_lookahead, "K6SERVE_X264_RC_LOOKAHEAD", 20, "10", ("-1", "auto", "251", "4.5"),
         "K6SERVE_X264_RC_LOOKAHEAD must be a whole number from 0 to 250"),
    ],
)
def test_x264_settings_are_fixed_numbers_unless_set(monkeypatch: pytest.MonkeyPatch, parse, variable, default,
                                                    good, bads, message) -> None:
    """The thread count and the rc-lookahead decide x264's bytes, so each is a fixed number (16, 20), or its
    variable, checked."""
    monkeypatch.delenv(variable, raising=False)
    assert parse() == default
    monkeypatch.setenv(variable, good)
    assert parse() == int(good)
    for bad in bads:
        monkeypatch.setenv(variable, bad)
        with pytest.raises(ValueError, match=message):
            parse()


def test_x264_rc_lookahead_reaches_x264(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The module's rc-lookahead (20 by default) is the one x264 encodes with: another lookahead, other bytes, the
    same frame count."""
    assert mux.X264_RC_LOOKAHEAD == 20
    y, x = np.mgrid[0:64, 0:96]
    frames = np.stack([((np.sin(x / 7 + t / 2) + np.cos(y / 5 - t / 3)) * 60 + 128).astype(np.uint8)[..., None]
                       .repeat(3, -1) for t in range(48)])
    digests = {}
    for lookahead in (20, 40):
        monkeypatch.setattr(mux, "X264_RC_LOOKAHEAD", lookahead)
        path = mux.write_mp4(tmp_path / f"{lookahead}.mp4", frames, 24.0)
        digests[lookahead] = hashlib.sha256(path.read_bytes()).hexdigest()
        with av.open(str(path)) as container:
            assert sum(1 for _ in container.decode(video=0)) == 48
    assert digests[20] != digests[40]


def test_lookahead_quality_script_reports_size_and_psnr(tmp_path: Path, load_script) -> None:
    """scripts/x264_lookahead_quality.py at toy size: one row per lookahead, a real PSNR, the default restored."""
    script = load_script("x264_lookahead_quality")
    script.main(["--width", "96", "--height", "64", "--frames", "24", "--out", str(tmp_path)])
    import json

    rows = json.loads((tmp_path / "x264_lookahead_quality.json").read_text())["rows"]
    assert [row["rc_lookahead"] for row in rows] == list(script.LOOKAHEADS)
    assert all(20 < row["psnr_db"] < 80 and row["megabytes"] > 0 for row in rows)
    assert mux.X264_RC_LOOKAHEAD == 20


def test_failure_mid_write_leaves_no_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real_video_frame = mux._video_frame
    listing_at_failure: list[str] = []

    def failing_video_frame(frame_HWC: np.ndarray, index: int):
        if index == 30:
            listing_at_failure.extend(p.name for p in tmp_path.iterdir())
            raise RuntimeError("encoder exploded")
        return real_video_frame(frame_HWC, index)

    monkeypatch.setattr(mux, "_video_frame", failing_video_frame)
    waveform = np.zeros(44100, np.float32)
    with pytest.raises(RuntimeError, match="encoder exploded"):
        media.write_mp4(tmp_path / "out.mp4", moving_pattern(64, 48, 40), 24, waveform)
    # The partial file existed, hidden, while writing; afterwards nothing is left.
    assert len(listing_at_failure) == 1 and listing_at_failure[0].startswith(".out.mp4.")
    assert list(tmp_path.iterdir()) == []


def test_failure_after_encoding_keeps_the_previous_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    target = tmp_path / "out.mp4"
    target.write_bytes(b"previous result")

    def failing_fsync(path: Path) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(mux, "_fsync", failing_fsync)
    with pytest.raises(OSError, match="disk full"):
        media.write_mp4(target, moving_pattern(32, 32, 3), 24)
    assert [p.name for p in tmp_path.iterdir()] == ["out.mp4"]
    assert target.read_bytes() == b"previous result"


def test_success_leaves_only_the_final_file(tmp_path: Path) -> None:
    media.write_mp4(tmp_path / "out.mp4", moving_pattern(32, 32, 3), 24, np.zeros(5000, np.float32))
    assert [p.name for p in tmp_path.iterdir()] == ["out.mp4"]


@pytest.mark.parametrize(
    ("frames", "kwargs", "message"),
    [
        (np.zeros((3, 64, 97, 3), np.uint8), {}, "97x64"),
        (np.zeros((3, 63, 96, 3), np.uint8), {}, "96x63"),
        (np.zeros((3, 64, 96, 3), np.float32), {}, "uint8"),
        (np.zeros((3, 64, 96), np.uint8), {}, "shape"),
        (np.zeros((0, 64, 96, 3), np.uint8), {}, "T >= 1"),
        (np.zeros((3, 64, 96, 3), np.uint8), {"fps": 0}, "fps must be > 0"),
        (np.zeros((3, 64, 96, 3), np.uint8), {"audio": np.zeros((2, 100), np.float32)}, "mono"),
        (np.zeros((3, 64, 96, 3), np.uint8), {"audio": np.zeros(0, np.float32)}, "non-empty"),
        (np.zeros((3, 64, 96, 3), np.uint8), {"audio": np.full(9, np.nan, np.float32)}, "NaN"),
        (
            np.zeros((3, 64, 96, 3), np.uint8),
            {"audio": np.zeros(9, np.float32), "sample_rate": 44000},
            "not an AAC rate",
        ),
        (np.zeros((3, 64, 96, 3), np.uint8), {"crf": 60}, "crf"),
    ],
)
def test_write_mp4_rejects_bad_input(tmp_path: Path, frames, kwargs, message: str) -> None:
    fps = kwargs.pop("fps", 24)
    with pytest.raises(ValueError, match=message):
        media.write_mp4(tmp_path / "bad.mp4", frames, fps, **kwargs)
    assert list(tmp_path.iterdir()) == []


def test_write_mp4_names_a_missing_folder(tmp_path: Path) -> None:
    # An OSError (ENOENT), which the CLI answers with exit code 1: the folder was checked before the request ran,
    # so it went missing while it ran (a ValueError read as "request refused", exit code 2, after the whole run).
    from k6serve.cli.main import describe_os_error

    with pytest.raises(FileNotFoundError) as missing:
        media.write_mp4(tmp_path / "missing" / "x.mp4", moving_pattern(32, 32, 2), 24)
    assert missing.value.errno == errno.ENOENT and missing.value.filename == str(tmp_path / "missing" / "x.mp4")
    assert missing.value.strerror == (f"folder {str(tmp_path / 'missing')!r} does not exist (removed while the "
                                      "request ran?); create it and run again")
    assert describe_os_error(missing.value, str(tmp_path)).startswith(missing.value.strerror)
    assert list(tmp_path.iterdir()) == []


def test_a_file_size_limit_is_told_with_its_fix(tmp_path: Path) -> None:
    """`ulimit -f` (RLIMIT_FSIZE) makes the write fail with EFBIG: "File too large" had no fix, where a full disk
    and a permission did."""
    from k6serve.cli.main import describe_os_error

    error = OSError(errno.EFBIG, "writing the MP4 failed: File too large", str(tmp_path / "clip.mp4"))
    assert describe_os_error(error, str(tmp_path)) == (
        f"writing the MP4 failed: File too large: {str(tmp_path / 'clip.mp4')!r}; the file is larger than this "
        "process may write (`ulimit -f`) or than the file system takes (FAT32: 4 GiB); raise the limit, or pass "
        "--output-path on another disk")


# ---- the SR 24 fps rule ----


def test_frame_rate_plans() -> None:
    fast = plan_frame_rate(30.0)
    assert (fast.output_fps, fast.step) == (24, 1.25)
    for near_fps, output_fps in ((25.0, 25), (24000 / 1001, 24), (24.0, 24)):
        near = plan_frame_rate(near_fps)
        assert (near.output_fps, near.step, near.note) == (output_fps, None, None)
    assert plan_frame_rate(22.6).output_fps == 23  # within 1.5 of 24
    low = plan_frame_rate(12.0)
    assert (low.output_fps, low.step) == (12, None) and "no frame interpolation" in low.note
    assert plan_frame_rate(22.5).output_fps == 22  # |22.5 - 24| is not < 1.5; round(22.5) is 22
    with pytest.raises(ValueError, match="fps must be > 0"):
        plan_frame_rate(0.0)
    # Kept at a whole-number rate (the reference's round), a fractional one plays at another speed than its
    # soundtrack: said when it drifts more than a frame over 121 frames (23.976 -> 24 drifts 0.12 of one).
    slow = plan_frame_rate(7.5)
    assert slow.output_fps == 8 and slow.note == (
        "source is 7.5 fps, below 24 fps: kept every frame at 8 fps; no frame interpolation is done; at 8 fps the "
        "picture plays 6.7% faster than the source's 7.5 fps, and its soundtrack keeps its speed, so the picture "
        "runs ahead of the sound by 0.07 s each second; to keep them together, convert the source to a whole frame "
        "rate first (FFmpeg: -r 8)")
    assert "4.0% slower" in plan_frame_rate(12.5).note and "behind the sound by 0.04 s" in plan_frame_rate(12.5).note
    assert "1.8% faster" in plan_frame_rate(22.6).note  # kept within 1.5 of 24, at 23 fps


def test_subsample_indices_use_half_to_even_rounding() -> None:
    plan = plan_frame_rate(30.0)
    # i * 1.25 = 2.5 -> 2, 7.5 -> 8, 12.5 -> 12, 17.5 -> 18 (Python round).
    assert sr_source_indices(20, plan) == [0, 1, 2, 4, 5, 6, 8, 9, 10, 11, 12, 14, 15, 16, 18, 19]
    # i < int(11 / 1.25) = 8: index 10 (i = 8) is < 11 but not kept.
    assert sr_source_indices(11, plan) == [0, 1, 2, 4, 5, 6, 8, 9]
    assert sr_source_indices(1000, plan)[-1] == round(120 * 1.25)
    assert len(sr_source_indices(1000, plan)) == 121


def test_floor_to_one_plus_eight_k() -> None:
    expected = {121: 121, 120: 113, 114: 113, 113: 113, 112: 105, 10: 9, 9: 9, 8: 1, 2: 1, 1: 1}
    assert {n: floor_frame_count(n) for n in expected} == expected


def test_30fps_source_is_subsampled_to_24(clips: dict[str, Path]) -> None:
    source = media.read_sr_source(clips["30fps_stereo"])
    expected = [round(i * 1.25) for i in range(int(40 / 1.25))][:25]  # 32 kept -> floor 25
    assert (source.fps, source.source_fps) == (24, 30.0)
    assert list(source.source_indices) == expected
    all_frames = media.read_video(clips["30fps_stereo"]).frames
    np.testing.assert_array_equal(source.frames, all_frames[expected])
    assert any("subsampled 30 fps to 24 fps" in note for note in source.notes)


def test_tail_of_a_short_fast_source_follows_the_int_bound(tmp_path: Path) -> None:
    # 11 frames at 30 fps: the rule keeps 8 indices (not 9), which floors to 1 frame.
    path = make_clip(tmp_path / "short.mp4", width=32, height=32, num_frames=11, fps=30)
    source = media.read_sr_source(path)
    assert source.source_indices == (0,) and source.num_frames == 1


@pytest.mark.parametrize(
    ("name", "fps", "source_fps"),
    [("25fps_mkv", 25, 25.0), ("23.976_mono", 24, 24000 / 1001), ("24fps_silent", 24, 24.0)],
)
def test_near_24fps_sources_keep_every_frame(clips, name: str, fps: int, source_fps: float) -> None:
    source = media.read_sr_source(clips[name])
    assert source.fps == fps and source.source_fps == pytest.approx(source_fps, rel=1e-12)
    assert source.source_indices == tuple(range(33))  # 40 frames floored to 1 + 8k
    np.testing.assert_array_equal(source.frames, media.read_video(clips[name]).frames[:33])


def test_slow_source_keeps_its_rate_with_a_warning(clips, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="k6serve.media.video"):
        source = media.read_sr_source(clips["12fps_mkv_stereo"])
    assert (source.fps, source.num_frames, source.source_indices) == (12, 17, tuple(range(17)))
    assert "no frame interpolation" in caplog.text


@pytest.mark.parametrize("rotation", [90, -90, 180])
def test_a_rotated_phone_video_is_read_upright(tmp_path: Path, rotation: int) -> None:
    # H.264 frames with a display-matrix rotation: players show them turned, and so must the SR source be, or the
    # upscaled MP4 (which stores no rotation) plays sideways. The frames as stored come from the same file (two
    # encodes of the same frames can differ: libx264 here is not bit-reproducible from run to run).
    rotated = make_clip(tmp_path / "rotated.mp4", width=64, height=32, num_frames=9, fps=24, rotation=rotation)
    with av.open(str(rotated)) as container:
        stored = np.stack([frame.to_ndarray(format="rgb24") for frame in container.decode(video=0)])
    assert stored.shape == (9, 32, 64, 3)
    expected = np.rot90(stored, rotation // 90, axes=(1, 2))
    source = media.read_sr_source(rotated)
    assert source.frames.shape == expected.shape
    np.testing.assert_array_equal(source.frames, expected)
    np.testing.assert_array_equal(media.read_video(rotated).frames, expected)


def _with_track_matrix(path: Path, a: int, b: int, c: int, d: int) -> Path:
    """`path` with its (first) track header's display matrix set to [a b; c d] (in 16.16, translations left 0): what
    QuickTime's "Flip Horizontal" edit, or a phone's mirrored selfie camera, writes."""
    data = bytearray(path.read_bytes())
    matrix = data.find(b"tkhd") - 4 + 48  # a version-0 tkhd: its matrix follows 40 bytes of fields
    assert data[matrix - 40] == 0
    for offset, value in zip((0, 4, 12, 16), (a, b, c, d)):
        data[matrix + offset:matrix + offset + 4] = (value * 0x10000).to_bytes(4, "big", signed=True)
    path.write_bytes(bytes(data))
    return path


@pytest.mark.parametrize("matrix, shown", [
    ((-1, 0, 0, 1), lambda stored: stored[:, :, ::-1]),  # flipped left to right
    ((1, 0, 0, -1), lambda stored: stored[:, ::-1]),  # upside down
    ((0, 1, 1, 0), lambda stored: np.swapaxes(stored, 1, 2)),  # FFmpeg's transpose=cclock_flip
    ((0, -1, -1, 0), lambda stored: np.rot90(stored, -1, axes=(1, 2))[:, ::-1]),  # transpose=clock_flip
])
def test_a_mirrored_video_is_read_as_ffmpeg_shows_it(tmp_path: Path, matrix, shown) -> None:
    # PyAV's frame.rotation gives a mirror's angle alone: a left-right flip read as a half turn came out upside down.
    clip = make_clip(tmp_path / "clip.mp4", width=64, height=32, num_frames=9, fps=24)
    with av.open(str(clip)) as container:
        stored = np.stack([frame.to_ndarray(format="rgb24") for frame in container.decode(video=0)])
    mirrored = _with_track_matrix(clip, *matrix)
    expected = shown(stored)
    np.testing.assert_array_equal(media.read_sr_source(mirrored).frames, expected)
    np.testing.assert_array_equal(media.read_video(mirrored).frames, expected)


def test_a_source_whose_rate_rounds_to_0_fps_is_refused_with_the_fix(tmp_path: Path) -> None:
    # A slideshow-like clip (a GIF with 2 s frames reads the same): its kept rate round(0.5) = 0 fps cannot be written.
    path = make_clip(tmp_path / "slow.mp4", width=32, height=32, num_frames=9, fps=Fraction(1, 2))
    with pytest.raises(ValueError, match=r"slow\.mp4' is 0\.5 fps.*rounds to 0 fps.*re-encode it at 1 fps or more"):
        media.read_sr_source(path)
    assert media.read_sr_source(make_clip(tmp_path / "one.mp4", width=32, height=32, num_frames=9, fps=1)).fps == 1


def test_a_cut_download_that_decodes_short_without_an_error_gets_a_note(tmp_path: Path, caplog) -> None:
    # An MP4 with its index at the front (web downloads), cut at 60% of its bytes: FFmpeg decodes the frames that
    # are there and stops without an error, so only the declared count shows that 31 of 40 frames are missing.
    whole = make_clip(tmp_path / "whole.mp4", width=64, height=48, num_frames=40, fps=24, faststart=True)
    cut = tmp_path / "cut.mp4"
    cut.write_bytes(whole.read_bytes()[: int(whole.stat().st_size * 0.6)])
    with caplog.at_level(logging.WARNING, logger="k6serve.media.video"):
        source = media.read_sr_source(cut)
    assert source.num_decoded_frames < 36 and source.num_frames >= 1
    [note] = [note for note in source.notes if "declares" in note]
    assert note.startswith(f"decoded only {source.num_decoded_frames} of the 40 frames the file declares")
    assert "download the file again" in note and "cut.mp4" in caplog.text
    assert not any("declares" in note for note in media.read_sr_source(whole).notes)  # the whole file: none
    with SRSourceReader(whole) as reader:
        assert reader.declared_frames == 40
    # Matroska states no frame count, but its muxer tags each track with its duration: a cut one is told too (it was
    # not), in seconds of the video track's.
    mkv = make_clip(tmp_path / "clip.mkv", width=64, height=48, num_frames=40, fps=24)
    with SRSourceReader(mkv) as reader:
        assert reader.declared_frames is None
    assert not any("declares" in note for note in media.read_sr_source(mkv).notes)
    cut_mkv = tmp_path / "cut.mkv"
    cut_mkv.write_bytes(mkv.read_bytes()[: int(mkv.stat().st_size * 0.4)])
    cut_source = media.read_sr_source(cut_mkv)
    assert cut_source.num_decoded_frames < 36
    [note] = [note for note in cut_source.notes if "declares" in note]
    decoded = cut_source.num_decoded_frames / 24
    assert note.startswith(f"decoded only {decoded:.2f} s of the 1.67 s of video the file declares: it may be "
                           "damaged or cut short")


def test_a_whole_matroska_file_with_a_longer_soundtrack_or_a_variable_frame_rate_gets_no_cut_short_note(tmp_path):
    # The container's duration is the longest track's and a count from it assumes one frame rate: a first try at
    # the Matroska note, counting from it, called both of these files cut short.
    longer_audio = tmp_path / "longer_audio.mkv"
    with av.open(str(longer_audio), mode="w", format="matroska") as container:
        video = container.add_stream("libx264", rate=24)
        video.width, video.height, video.pix_fmt = 64, 48, "yuv420p"
        audio = container.add_stream("aac", rate=44100)
        audio.layout = "mono"
        for index, frame in enumerate(moving_pattern(64, 48, 48)):
            picture = av.VideoFrame.from_ndarray(frame, format="rgb24")
            picture.pts = index
            container.mux(video.encode(picture))
        container.mux(video.encode())
        samples = np.zeros((1, 1024), dtype=np.float32)
        for index in range(4 * 44100 // 1024):  # 4 s against the video's 2
            chunk = av.AudioFrame.from_ndarray(samples, format="fltp", layout="mono")
            chunk.sample_rate, chunk.pts = 44100, index * 1024
            container.mux(audio.encode(chunk))
        container.mux(audio.encode())
    variable = tmp_path / "variable.mkv"
    with av.open(str(variable), mode="w", format="matroska") as container:
        video = container.add_stream("libx264", rate=30)
        video.width, video.height, video.pix_fmt = 64, 48, "yuv420p"
        video.codec_context.time_base = Fraction(1, 30)
        # 30 fps for a second, then 10 fps for three: 60 frames over 4 s.
        times = [index for index in range(30)] + [30 + 3 * index for index in range(30)]
        for pts, frame in zip(times, moving_pattern(64, 48, 60)):
            picture = av.VideoFrame.from_ndarray(frame, format="rgb24")
            picture.pts, picture.time_base = pts, Fraction(1, 30)
            container.mux(video.encode(picture))
        container.mux(video.encode())
    for path in (longer_audio, variable):
        source = media.read_sr_source(path)
        assert not any("declares" in note for note in source.notes), (path.name, source.notes)
    # The preview a job's `seconds` is told at creation counts from the video track's tagged duration too: from the
    # container's (the soundtrack's 4 s), it was 89 frames, where the whole read keeps 41.
    with SRSourceReader(longer_audio) as reader:
        assert reader.preview().num_frames == media.read_sr_source(longer_audio).num_frames == 41


def test_long_source_is_capped_at_121_and_decoding_stops_early(tmp_path: Path) -> None:
    path = make_clip(tmp_path / "long24.mp4", width=32, height=32, num_frames=130, fps=24)
    source = media.read_sr_source(path)
    assert source.num_frames == 121 and source.source_indices == tuple(range(121))
    assert source.num_decoded_frames == 121
    assert any("limit 121" in note for note in source.notes)
    # 30 fps: i < int(N / 1.25) reaches 121 once N = 152 frames are seen, out of 160.
    path = make_clip(tmp_path / "long30.mp4", width=32, height=32, num_frames=160, fps=30)
    source = media.read_sr_source(path)
    assert source.num_frames == 121 and source.num_decoded_frames == 152
    assert list(source.source_indices) == [round(i * 1.25) for i in range(121)]
    # A smaller cap still floors to 1 + 8k.
    assert media.read_sr_source(path, max_frames=50).num_frames == 49


def test_read_errors_name_the_file(tmp_path: Path) -> None:
    audio_only = make_audio_only_file(tmp_path / "sound.mp4", seconds=0.5)
    junk = tmp_path / "junk.mp4"
    junk.write_bytes(b"not a video" * 50)
    empty = tmp_path / "empty.mp4"
    empty.write_bytes(b"")
    # An MP4 cut before its index (at the end of a file not written for the web): FFmpeg says only "Invalid data".
    whole = make_clip(tmp_path / "whole.mp4", width=32, height=32, num_frames=9, fps=24)
    cut = tmp_path / "cut.mp4"
    cut.write_bytes(whole.read_bytes()[: whole.stat().st_size // 2])
    cases = [
        (audio_only, r"sound\.mp4'.*no video stream \(found: audio \(aac\)\)"),
        (tmp_path / "missing.mp4", r"missing\.mp4'.*does not exist"),
        (tmp_path, "is a directory"),
        # The HTTP server's wording (input_paths.check_readable), so the CLI and the API say as much.
        (junk, r"junk\.mp4': it is not a readable video \(FFmpeg: Invalid data found when processing input\): it "
               r"may be damaged or cut short \(an incomplete download or copy\?\); pass a video file such as"),
        (cut, r"cut\.mp4': it is not a readable video .*: it may be damaged or cut short"),
        (empty, r"empty\.mp4': it is empty \(0 bytes\); pass a video file such as an MP4"),
    ]
    for path, message in cases:
        with pytest.raises(ValueError, match=message):
            media.read_sr_source(path)
        with pytest.raises(ValueError, match=message):
            media.read_video(path)


@pytest.mark.skipif(not PIL.features.check("avif"), reason="Pillow without AVIF")
def test_an_avif_photo_is_a_still_image_and_an_animated_avif_is_read_as_its_animation(tmp_path: Path) -> None:
    # FFmpeg's mov demuxer lists a HEIF file's image item as a one-frame 1 fps video stream: an AVIF (or HEIC)
    # photo was upscaled as a one-frame clip, and an animated AVIF, which lists its still picture first, as that
    # picture alone.
    frames = [PIL.Image.fromarray(frame) for frame in moving_pattern(64, 32, 9)]
    photo = tmp_path / "photo.avif"
    frames[0].save(photo)
    with pytest.raises(ValueError, match=r"photo\.avif' is a still image \(FFmpeg reads it with its mov \(an AVIF or "
                                         r"HEIC image\) demuxer\), not a video"):
        media.read_sr_source(photo)
    animated = tmp_path / "animated.avif"
    frames[0].save(animated, save_all=True, append_images=frames[1:], duration=40)
    source = media.read_sr_source(animated)
    assert (source.num_frames, source.fps) == (9, 25)


def test_a_video_this_user_may_not_read_is_told_so(tmp_path: Path, monkeypatch) -> None:
    # FFmpeg's EACCES was told as "not a readable video (FFmpeg: Permission denied): it may be damaged or cut short
    # (an incomplete download or copy?)". Tests run as root, who reads any file: the open is made to fail as
    # FFmpeg fails it for another user.
    import errno

    from k6serve.media import container

    clip = make_clip(tmp_path / "private.mp4", width=32, height=32, num_frames=9, fps=24)

    def denied(path):
        raise av.error.PermissionError(errno.EACCES, "Permission denied", str(path))

    monkeypatch.setattr(container, "open_media", denied)
    with pytest.raises(ValueError, match=r"^cannot read media file '.*private\.mp4': it cannot be opened: permission "
                                         r"denied \(the user k6serve runs as may not read it; give it read access, "
                                         r"e\.g\. chmod a\+r on the file\); pass a video file") as refused:
        media.read_sr_source(clip)
    assert "damaged" not in str(refused.value)


def _timed_clip(path: Path, frame_times_ms: list[int], *, cover_art_first: bool = False,
                audio_streams: tuple[dict, ...] = ()) -> Path:
    """H.264 frames at the given times (a variable frame rate), optionally after an attached cover picture, and AAC
    streams of a 1 kHz beep each (dicts: `beep_at` seconds, `default` flag, `title`)."""
    with av.open(str(path), "w", format="matroska" if path.suffix == ".mkv" else "mp4") as container:
        write_cover = add_cover_art(container) if cover_art_first else None
        video = container.add_stream("libx264", rate=24)
        video.width, video.height, video.pix_fmt = 32, 32, "yuv420p"
        video.time_base = video.codec_context.time_base = Fraction(1, 1000)
        sounds = []
        for spec in audio_streams:
            sound = container.add_stream("aac", rate=44100)
            sound.layout = "mono"
            sound.disposition = av.stream.Disposition.default if spec.get("default") else 0
            if spec.get("title"):
                sound.metadata["title"] = spec["title"]
            sounds.append((sound, spec))
        if write_cover is not None:
            write_cover()
        for index, time_ms in enumerate(frame_times_ms):
            frame = av.VideoFrame.from_ndarray(moving_pattern(32, 32, 1, first_frame=index)[0], format="rgb24")
            frame.pts, frame.time_base = time_ms, Fraction(1, 1000)
            container.mux(video.encode(frame))
        container.mux(video.encode(None))
        seconds = frame_times_ms[-1] / 1000 + 0.1
        for sound, spec in sounds:
            t = np.arange(round(seconds * 44100)) / 44100
            beep = np.where((t >= spec["beep_at"]) & (t < spec["beep_at"] + 0.05), 0.8 * np.sin(2 * np.pi * 1000 * t),
                            0.0).astype(np.float32)[None]
            for start in range(0, beep.shape[1], 1024):
                frame = av.AudioFrame.from_ndarray(np.ascontiguousarray(beep[:, start:start + 1024]), format="fltp",
                                                   layout="mono")
                frame.sample_rate, frame.pts = 44100, start
                container.mux(sound.encode(frame))
            container.mux(sound.encode(None))
    return path


def test_a_variable_frame_rate_that_parts_picture_and_sound_gets_a_note(tmp_path: Path, caplog) -> None:
    """Frames are kept by index at the average rate (the reference's rule); 60 frames at 30 fps then 15 at 5 fps
    average 16.7 fps, so frame 60 (shown at 2.0 s) plays at 3.5 s: the note said the drift was 0.02 s a second."""
    strong = _timed_clip(tmp_path / "vfr.mp4", [round(i * 1000 / 30) for i in range(60)]
                         + [2000 + 200 * i for i in range(15)])
    with caplog.at_level("WARNING", logger="k6serve.media.video"):
        source = media.read_sr_source(strong)
    (note,) = [note for note in source.notes if "not evenly spaced" in note]
    offset = float(re.search(r"a kept frame plays (\d+\.\d+) s earlier in it than its average", note).group(1))
    assert 1.4 < offset < 1.7 and note in caplog.text
    assert note.endswith("convert the source to a constant frame rate first (FFmpeg: ffmpeg -i IN -vf fps=17 -c:a "
                         "copy OUT)")
    # A phone's jitter (frames 20 and 60 ms apart, 25 fps on average) is not worth a note.
    mild = _timed_clip(tmp_path / "jitter.mp4", [int(t) for t in np.cumsum([0] + [20, 60] * 8)])
    assert not [note for note in media.read_sr_source(mild).notes if "evenly" in note]


def test_cover_art_is_not_the_video(tmp_path: Path) -> None:
    """FFmpeg lists a music file's cover (an attached picture) as a video stream at 90,000 fps: a song was read as
    a one-frame clip ("1 decoded frame(s) at 90000 fps"), and a video whose cover came first was upscaled as its
    cover."""
    song = make_audio_only_file(tmp_path / "song.mp4", seconds=1.0, cover_art=True)
    with pytest.raises(ValueError, match=r"song\.mp4' has no video stream \(found: audio \(aac\), attached "
                                         r"picture \(mjpeg\)\); pass a file that contains video"):
        media.read_sr_source(song)
    covered = _timed_clip(tmp_path / "covered.mp4", [round(i * 1000 / 24) for i in range(9)], cover_art_first=True)
    source = media.read_sr_source(covered)
    assert source.num_frames == 9 and source.frames.shape[1:3] == (32, 32)
    np.testing.assert_allclose(source.frames[4].astype(float), moving_pattern(32, 32, 1, first_frame=4)[0], atol=40)


def test_the_soundtrack_flagged_default_is_kept_and_a_note_names_it(tmp_path: Path) -> None:
    times = [round(i * 1000 / 24) for i in range(9)]
    two = _timed_clip(tmp_path / "two.mkv", times, audio_streams=(
        dict(beep_at=0.1, title="commentary"), dict(beep_at=0.2, default=True, title="main")))
    notes: list[str] = []
    audio = media.read_source_audio(two, num_samples=None, notes=notes)
    assert 0.19 < np.argmax(np.abs(audio) > 0.3) / 44100 < 0.21  # the main track's beep, not the commentary's
    assert notes == ["the source has 2 audio streams; the output keeps audio stream 1 (flagged default, 'main') and "
                     "drops the others; to keep another, make a copy with it first (FFmpeg: ffmpeg -i IN -map 0:v:0 "
                     "-map 0:a:N -c copy OUT, N counting from 0)"]
    # Neither flagged (or the first one flagged): the first, as the reference keeps.
    first = _timed_clip(tmp_path / "first.mkv", times, audio_streams=(dict(beep_at=0.1), dict(beep_at=0.2)))
    notes.clear()
    audio = media.read_source_audio(first, num_samples=None, notes=notes)
    assert 0.09 < np.argmax(np.abs(audio) > 0.3) / 44100 < 0.11
    assert notes[0].startswith("the source has 2 audio streams; the output keeps audio stream 0 (the first) and")


# ---- source audio ----


def test_processed_num_samples_uses_python_round() -> None:
    assert media.processed_num_samples(121, 24) == 222338  # 222337.5 -> even
    assert media.processed_num_samples(25, 24) == 45938  # 45937.5 -> even
    assert media.processed_num_samples(113, 25) == 199332


def test_source_audio_is_mono_44k_trimmed_to_the_processed_clip(clips) -> None:
    source = media.read_sr_source(clips["30fps_stereo"])
    num_samples = media.processed_num_samples(source.num_frames, source.fps)
    audio = media.read_source_audio(clips["30fps_stereo"], num_samples=num_samples)
    assert audio.dtype == np.float32 and audio.shape == (num_samples,)
    assert np.abs(audio).max() <= 1.0 and np.sqrt(np.mean(audio[4096:] ** 2)) > 0.1


def test_source_audio_full_length_after_resampling(clips) -> None:
    audio = media.read_source_audio(clips["30fps_stereo"], num_samples=None)
    # 40 frames at 30 fps of 48 kHz audio, resampled to 44.1 kHz; AAC decodes up to one more frame.
    expected = 40 / 30 * 44100
    assert 0 <= audio.shape[0] - expected < AAC_FRAME_SIZE * 44100 / 48000 + 64


def test_short_soundtrack_is_not_padded(clips) -> None:
    full = media.read_source_audio(clips["12fps_mkv_stereo"], num_samples=None)
    longer = media.read_source_audio(clips["12fps_mkv_stereo"], num_samples=full.shape[0] + 5000)
    np.testing.assert_array_equal(longer, full)


def test_silent_source_gives_no_audio(clips) -> None:
    assert media.read_source_audio(clips["24fps_silent"], num_samples=1000) is None
    assert media.read_source_audio(clips["25fps_mkv"], num_samples=None) is None


def _first_times(path: Path) -> tuple[float, float]:
    with av.open(str(path)) as container:
        video_time = next(container.decode(video=0)).time
    with av.open(str(path)) as container:
        audio_time = next(container.decode(audio=0)).time
    return video_time, audio_time


@pytest.mark.parametrize("suffix", [".mp4", ".mkv"])
def test_a_soundtrack_that_starts_after_the_first_frame_keeps_its_place(tmp_path: Path, suffix: str) -> None:
    # A camera file or a stream-copy cut whose audio starts 0.25 s into the video: the reference (and k6serve before)
    # started the output's audio at its first sample, so the sound played 0.23 s early.
    path = make_clip(tmp_path / f"late{suffix}", width=32, height=32, num_frames=17, fps=24, audio="mono_tone",
                     audio_delay=0.25)
    video_start, audio_start = _first_times(path)
    assert video_start == 0 and 0.2 < audio_start <= 0.25
    num_samples = media.processed_num_samples(17, 24)
    unaligned = media.read_source_audio(path, num_samples=None)
    aligned = media.read_source_audio(path, num_samples=num_samples, video_start=video_start)
    lead = round(audio_start * 44100)
    assert aligned.shape == (num_samples,)
    assert not np.any(aligned[:lead])
    np.testing.assert_array_equal(aligned[lead:], unaligned[: num_samples - lead])
    # Through the SR source stream that feeds the pipeline: the first frame's time comes from the video reader.
    with SRSourceReader(path) as reader:
        list(reader.frames())
        assert reader.summary().start_time == video_start
    # Starting after the processed clip ends: no soundtrack rather than a file of silence, and a note says so (it
    # was in the log only: a client saw a video without its sound and no word of why).
    notes: list[str] = []
    assert media.read_source_audio(path, num_samples=lead - 10, video_start=video_start, notes=notes) is None
    assert notes == [f"the soundtrack starts {lead / 44100:.2f} s after the first video frame, after the processed "
                     "video ends: the output has no audio"]


def test_a_soundtrack_that_starts_before_the_first_frame_loses_what_comes_before_it(tmp_path: Path) -> None:
    path = make_clip(tmp_path / "early.mp4", width=32, height=32, num_frames=17, fps=24, audio="mono_tone",
                     audio_delay=-0.25)
    video_start, audio_start = _first_times(path)
    assert abs(video_start - 0.25) < 0.01 and audio_start == 0
    unaligned = media.read_source_audio(path, num_samples=None)
    aligned = media.read_source_audio(path, num_samples=5000, video_start=video_start)
    drop = round(video_start * 44100)
    np.testing.assert_array_equal(aligned, unaligned[drop: drop + 5000])
    # A soundtrack that ends before the first frame: none, not what was decoded (the skipped samples are not kept).
    notes: list[str] = []
    assert media.read_source_audio(path, num_samples=5000, video_start=100.0, notes=notes) is None
    assert notes == ["the soundtrack ends before the first video frame: the output has no audio"]
    # Tracks that start together read as before, with or without the video's start.
    together = make_clip(tmp_path / "together.mp4", width=32, height=32, num_frames=17, fps=24, audio="stereo_tone")
    np.testing.assert_array_equal(media.read_source_audio(together, num_samples=9000, video_start=0.0),
                                  media.read_source_audio(together, num_samples=9000))


def test_a_loud_stereo_mix_is_scaled_to_full_scale_not_clipped(tmp_path: Path) -> None:
    # L = R at a 0.8 peak (-2 dBFS): FFmpeg's mono downmix adds them at 0.707 each, a 1.13 peak, which the reference
    # clipped to 1 (a third of the samples, 4% distortion). Scaled as a whole instead: the same waveform, peak 1.
    path = tmp_path / "loud.mp4"
    rate = 48000
    time_s = np.arange(rate // 2) / rate
    channel = (0.8 * np.sin(2 * np.pi * 440 * time_s)).astype(np.float32)
    with av.open(str(path), mode="w") as container:
        stream = container.add_stream("aac", rate=rate)
        stream.layout = "stereo"
        for start in range(0, channel.shape[0], 1024):
            chunk = np.ascontiguousarray(np.stack([channel[start:start + 1024]] * 2))
            frame = av.AudioFrame.from_ndarray(chunk, format="fltp", layout="stereo")
            frame.sample_rate, frame.pts = rate, start
            container.mux(stream.encode(frame))
        container.mux(stream.encode(None))
    audio = media.read_source_audio(path, num_samples=None)
    assert np.abs(audio).max() == 1.0
    assert np.mean(np.abs(audio) >= 0.999) < 0.02  # a sine spends ~2% of its time within 0.1% of its peak
    middle = audio[2000:20000]
    expected = np.sin(2 * np.pi * 440 * (np.arange(middle.shape[0]) + 2000) / 44100)
    fit = float(np.dot(middle, expected) / np.dot(expected, expected))
    assert 0.95 < fit <= 1.0 and np.abs(middle - fit * expected).max() < 0.05  # a sine (AAC's noise), not clipped


def _damage_audio_packets(path: Path, out: Path, which: slice) -> None:
    """A copy of `path` with the second half of each audio packet in `which` overwritten (the block headers stay
    readable, so the demuxer reads on and the decoder refuses those packets)."""
    data = bytearray(path.read_bytes())
    with av.open(str(path)) as container:
        packets = [(packet.pos, packet.size) for packet in container.demux(audio=0) if packet.size]
    generator = np.random.default_rng(3)
    for position, size in packets[which]:
        data[position + size // 2:position + size] = generator.integers(0, 256, size - size // 2,
                                                                        dtype=np.uint8).tobytes()
    out.write_bytes(bytes(data))


def test_damaged_audio_packets_become_silence_that_keeps_the_rest_in_sync(tmp_path: Path, caplog) -> None:
    """A damaged block (or a cut download's last, part-written packet) failed the whole request; FFmpeg's own tools
    decode on past it. Its length of silence stands in for it, so the sound after it stays in sync; a note says so."""
    path = make_clip(tmp_path / "clip.mkv", width=32, height=32, num_frames=17, fps=24, audio="mono_tone")
    _damage_audio_packets(path, tmp_path / "damaged.mkv", slice(3, 6))
    whole = media.read_source_audio(path, num_samples=None)
    notes: list[str] = []
    with caplog.at_level("WARNING", logger="k6serve.media.audio"):
        kept = media.read_source_audio(tmp_path / "damaged.mkv", num_samples=None, notes=notes)
    # Three AAC packets of 1,024 samples at 48 kHz: 0.064 s of silence in their place, within the resampler's
    # rounding of 3,072 samples at 48 kHz to 2,822.4 at 44.1 kHz.
    assert abs(kept.shape[0] - whole.shape[0]) <= 1
    assert len(notes) == 1 and notes[0].startswith("3 part(s) of the soundtrack do not decode, the first at 0.0")
    assert "0.064 s of silence stand in for them, keeping the rest in sync" in notes[0] and notes[0] in caplog.text
    first_damage = round(3 * 1024 / 48000 * 44100)
    np.testing.assert_array_equal(kept[: first_damage - 2048], whole[: first_damage - 2048])
    gap = slice(first_damage + 1024, round(6 * 1024 / 48000 * 44100) - 1024)
    assert np.abs(kept[gap]).max() < 1e-3 < np.abs(whole[gap]).max()
    # The tone goes on after the gap at the same phase: the samples after it line up with the whole decode's.
    after = slice(round(8 * 1024 / 48000 * 44100), min(kept.shape[0], whole.shape[0]) - 2048)  # not the tail
    assert np.abs(kept[after] - whole[after]).max() < 0.05
    # Damage before anything decodes: the soundtrack starts at its first packet that does, aligned by its time.
    _damage_audio_packets(path, tmp_path / "start.mkv", slice(0, 2))
    notes.clear()
    late = media.read_source_audio(tmp_path / "start.mkv", num_samples=None, notes=notes, video_start=0.0)
    assert notes[0].startswith("2 part(s) of the soundtrack do not decode, the first at 0.00 s")
    assert "the sound starts at its first part that decodes, at that part's time; copy or download" in notes[0]
    assert abs(late.shape[0] - whole.shape[0]) <= 1024 and np.abs(late[:1500]).max() < 1e-3  # silence in place


def _write_tone(path: Path, *, layout: str = "mono", rate: int = 48000, seconds: float = 1.0, freq: float = 440.0,
                skip: tuple[float, float] | None = None, click: float | None = None, fmt: str | None = None) -> None:
    """An AAC soundtrack alone: a tone, a full-scale click at `click` s, no packets from skip[0] to skip[1] s (the
    timestamps jump over them, as in a capture's dropout)."""
    from fractions import Fraction

    total = int(seconds * rate)
    tone = (0.3 * np.sin(2 * np.pi * freq * np.arange(total) / rate)).astype(np.float32)
    if click is not None:
        tone[int(click * rate):int(click * rate) + 64] = 0.9
    with av.open(str(path), mode="w", format=fmt) as container:
        stream = container.add_stream("aac", rate=rate)
        stream.layout = layout
        channels = len(av.AudioLayout(layout).channels)
        for start in range(0, total - 1023, 1024):
            if skip is not None and skip[0] <= start / rate < skip[1]:
                continue
            frame = av.AudioFrame.from_ndarray(np.ascontiguousarray(np.stack([tone[start:start + 1024]] * channels)),
                                               format="fltp", layout=layout)
            frame.sample_rate, frame.pts, frame.time_base = rate, start, Fraction(1, rate)
            container.mux(stream.encode(frame))
        container.mux(stream.encode(None))


def test_a_gap_in_the_soundtracks_timestamps_is_silence_that_keeps_the_sound_after_it_in_place(tmp_path: Path) -> None:
    """Samples were joined end to end: 0.2 s without audio packets (a dropout) moved the click at 1.0 s to 0.8 s,
    out of sync with its picture, and the soundtrack ended early; nothing was said."""
    _write_tone(tmp_path / "whole.mkv", seconds=1.5, click=1.0)
    _write_tone(tmp_path / "gap.mkv", seconds=1.5, click=1.0, skip=(0.5, 0.7))
    notes: list[str] = []
    whole = media.read_source_audio(tmp_path / "whole.mkv", num_samples=None)
    gapped = media.read_source_audio(tmp_path / "gap.mkv", num_samples=None, notes=notes)
    assert abs(int(np.argmax(gapped)) - int(np.argmax(whole))) < 0.005 * 44100  # the click stays at 1.0 s
    assert abs(gapped.shape[0] - whole.shape[0]) < 0.005 * 44100
    assert np.abs(gapped[round(0.53 * 44100):round(0.68 * 44100)]).max() < 1e-3  # silence in the gap
    assert notes == ["the soundtrack has 1 gap(s) in its timestamps (the first at 0.51 s) filled with 0.192 s of "
                     "silence, so that the sound after them stays in sync with the picture"]


@pytest.mark.parametrize(("second_layout", "second_rate"), [("5.1", 48000), ("stereo", 44100)])
def test_a_soundtrack_that_changes_layout_or_rate_part_way_is_read_across_the_change(tmp_path: Path, second_layout,
                                                                                     second_rate) -> None:
    """`cat a.ts b.ts` of a stereo and a 5.1 (or 44.1 kHz) recording, as a broadcast switches between programmes:
    it failed with "Frame does not match AudioResampler setup". The second part's timestamps start again: a
    discontinuity, joined end to end (not an overlap of a second to drop)."""
    _write_tone(tmp_path / "a.ts", layout="stereo", freq=440.0, fmt="mpegts")
    _write_tone(tmp_path / "b.ts", layout=second_layout, rate=second_rate, freq=660.0, fmt="mpegts")
    joined = tmp_path / "joined.ts"
    joined.write_bytes((tmp_path / "a.ts").read_bytes() + (tmp_path / "b.ts").read_bytes())
    notes: list[str] = []
    audio = media.read_source_audio(joined, num_samples=None, notes=notes)
    assert notes == [] and abs(audio.shape[0] - 2 * 44100) < 0.05 * 44100

    def frequency(part: np.ndarray) -> float:
        return float(np.argmax(np.abs(np.fft.rfft(part))) * 44100 / part.shape[0])

    assert abs(frequency(audio[4410:39690]) - 440) < 3 and abs(frequency(audio[48510:83790]) - 660) < 3


def test_a_short_step_back_in_the_timestamps_drops_the_repeated_sound(tmp_path: Path) -> None:
    """A second part whose timestamps start 0.3 s back (within OVERLAP_LIMIT_S): its first 0.3 s overlap what was
    kept and are dropped, so the sound after them plays at its time; the total is the timeline's length."""
    _write_tone(tmp_path / "a.ts", seconds=0.3, freq=440.0, fmt="mpegts")
    _write_tone(tmp_path / "b.ts", seconds=1.0, freq=660.0, fmt="mpegts")
    joined = tmp_path / "joined.ts"
    joined.write_bytes((tmp_path / "a.ts").read_bytes() + (tmp_path / "b.ts").read_bytes())
    notes: list[str] = []
    audio = media.read_source_audio(joined, num_samples=None, notes=notes)
    assert len(notes) == 1 and notes[0].startswith("the soundtrack has 1 overlap(s) (the first at 0.32 s) whose 0.3")
    assert abs(audio.shape[0] - 44100) < 0.05 * 44100  # b's second, not 1.3 s


def test_a_soundtrack_of_which_nothing_decodes_says_how_to_upscale_the_picture_alone(tmp_path: Path) -> None:
    path = make_clip(tmp_path / "clip.mkv", width=32, height=32, num_frames=17, fps=24, audio="mono_tone")
    _damage_audio_packets(path, tmp_path / "damaged.mkv", slice(None))
    with pytest.raises(ValueError, match=r"cannot decode the audio of .*damaged\.mkv.*its soundtrack is damaged\. "
                                         r"To upscale the picture alone.*ffmpeg -i IN -c copy -an OUT"):
        media.read_source_audio(tmp_path / "damaged.mkv", num_samples=None)


def test_sr_output_round_trip_with_source_audio(clips, tmp_path: Path) -> None:
    source = media.read_sr_source(clips["23.976_mono"])
    num_samples = media.processed_num_samples(source.num_frames, source.fps)
    audio = media.read_source_audio(clips["23.976_mono"], num_samples=num_samples)
    path = media.write_mp4(tmp_path / "sr.mp4", source.frames, source.fps, audio)
    info = media.probe(path)
    assert (info.num_frames, info.fps, info.audio_channels) == (33, 24.0, 1)
    assert 0 <= info.audio_num_samples - num_samples < AAC_FRAME_SIZE


# ---- probe ----


def test_probe_reports_source_streams(clips) -> None:
    info = media.probe(clips["12fps_mkv_stereo"])
    assert (info.width, info.height, info.num_frames, info.fps) == (64, 48, 20, 12.0)
    assert (info.video_codec, info.audio_codec) == ("h264", "aac")
    assert (info.audio_sample_rate, info.audio_channels) == (48000, 2)
    assert info.audio_num_samples >= 20 / 12 * 48000


# ---- conditioning image ----


def test_load_conditioning_image_converts_to_rgb(tmp_path: Path) -> None:
    rgba = PIL.Image.new("RGBA", (40, 30), (10, 20, 30, 128))
    rgba.save(tmp_path / "a.png")
    loaded = media.load_conditioning_image(tmp_path / "a.png", 64, 96)
    assert loaded.mode == "RGB" and loaded.size == (40, 30)
    assert loaded.getpixel((0, 0)) == (10, 20, 30)
    assert media.load_conditioning_image(PIL.Image.new("L", (5, 5), 7), 64, 96).mode == "RGB"


def test_a_16_bit_grayscale_image_keeps_its_levels(tmp_path: Path) -> None:
    # PIL's convert("RGB") clips 16-bit values at 255: a mid-gray 16-bit PNG conditioned the video on a white frame.
    levels = np.array([[0, 0x00FF, 0x8000], [0x80FF, 0xC000, 0xFFFF]], dtype=np.uint16)
    PIL.Image.fromarray(levels).save(tmp_path / "gray16.png")
    assert PIL.Image.open(tmp_path / "gray16.png").mode == "I;16"
    loaded = media.load_conditioning_image(tmp_path / "gray16.png", 64, 96)
    assert loaded.mode == "RGB"
    assert np.array_equal(np.asarray(loaded)[..., 0], [[0, 0, 128], [128, 192, 255]])
    assert np.array_equal(np.asarray(loaded)[..., 0], np.asarray(loaded)[..., 2])


def _mark_tiff_unsigned(path: Path) -> None:
    """Set SampleFormat to unsigned in a little-endian TIFF PIL wrote: PIL writes mode "I" as signed 32-bit always,
    where a camera or microscope writes unsigned."""
    data = bytearray(path.read_bytes())
    ifd = int.from_bytes(data[4:8], "little")
    for index in range(int.from_bytes(data[ifd:ifd + 2], "little")):
        entry = ifd + 2 + 12 * index
        if int.from_bytes(data[entry:entry + 2], "little") == 339:  # SampleFormat, one SHORT held in the entry
            data[entry + 8:entry + 10] = (1).to_bytes(2, "little")
    path.write_bytes(data)


def test_32_bit_integer_and_float_grayscale_images_keep_their_levels(tmp_path: Path) -> None:
    # PIL's convert("RGB") clips mode "I" at 255 (a mid-gray 32-bit TIFF came out white) and truncates mode "F" (a
    # mid-gray 0..1 float TIFF came out black).
    signed = np.array([[0, 2**30, 2**31 - 1]], dtype=np.int32)
    PIL.Image.fromarray(signed).save(tmp_path / "int32.tif")
    unsigned = np.array([[0, 2**31, 2**32 - 1]], dtype=np.uint32)
    PIL.Image.fromarray(unsigned.view(np.int32)).save(tmp_path / "uint32.tif")
    _mark_tiff_unsigned(tmp_path / "uint32.tif")
    PIL.Image.fromarray(np.array([[0.0, 0.5, 1.0]], dtype=np.float32)).save(tmp_path / "float.tif")
    # A mode "I" file that is not a TIFF is 16-bit: PIL opens 16-bit PGMs (and 16-bit PNGs in older Pillows) so.
    PIL.Image.fromarray(np.array([[0, 0x8000, 0xFFFF]], dtype=np.uint16)).convert("I").save(tmp_path / "gray16.pgm")
    for name, mode, sample_format in (("int32.tif", "I", (2,)), ("uint32.tif", "I", (1,)), ("float.tif", "F", (3,)),
                                      ("gray16.pgm", "I", None)):
        with PIL.Image.open(tmp_path / name) as opened:  # the files are the kinds this test means
            assert (opened.mode, getattr(opened, "tag_v2", {}).get(339)) == (mode, sample_format)
        loaded = media.load_conditioning_image(tmp_path / name, 64, 96)
        assert loaded.mode == "RGB"
        assert np.array_equal(np.asarray(loaded), np.repeat([[[0], [128], [255]]], 3, axis=2)), name
    # A PIL image passed in: its TIFF tags when it comes from Image.open, else mode "I" is 16-bit as above.
    with PIL.Image.open(tmp_path / "uint32.tif") as opened:
        assert media.load_conditioning_image(opened, 64, 96).getpixel((1, 0)) == (128, 128, 128)
    mid_gray_16 = PIL.Image.fromarray(np.full((2, 2), 0x8000, dtype=np.int32))
    assert media.load_conditioning_image(mid_gray_16, 64, 96).getpixel((0, 0)) == (128, 128, 128)


def test_grayscale_levels_outside_their_range_are_refused(tmp_path: Path) -> None:
    PIL.Image.fromarray(np.array([[0.0, np.nan, np.inf]], dtype=np.float32)).save(tmp_path / "nan.tif")
    with pytest.raises(ValueError, match=r"nan\.tif' is a float image with 2 NaN or infinite pixel values; replace "
                                         r"them with values from 0\.0 \(black\) to 1\.0 \(white\)"):
        media.load_conditioning_image(tmp_path / "nan.tif", 64, 96)
    # A 0..255 float image would be all white read as 0..1; PIL's convert had read it as 0..255.
    PIL.Image.fromarray(np.array([[0.0, 128.0, 255.0]], dtype=np.float32)).save(tmp_path / "float255.tif")
    with pytest.raises(ValueError, match=r"values from 0 to 255; float images are read as 0\.0 \(black\) to 1\.0 "
                                         r"\(white\): rescale it to 0\.\.1 \(divide 0\.\.255 values by 255\)"):
        media.load_conditioning_image(tmp_path / "float255.tif", 64, 96)
    PIL.Image.fromarray(np.array([[-0.5, 0.5]], dtype=np.float32)).save(tmp_path / "signed_float.tif")
    with pytest.raises(ValueError, match=r"values from -0\.5 to 0\.5"):
        media.load_conditioning_image(tmp_path / "signed_float.tif", 64, 96)
    # Round-off within half an 8-bit level of 0..1 is no reason to refuse.
    PIL.Image.fromarray(np.array([[-0.001, 1.001]], dtype=np.float32)).save(tmp_path / "round_off.tif")
    assert media.load_conditioning_image(tmp_path / "round_off.tif", 64, 96).getpixel((1, 0)) == (255, 255, 255)
    PIL.Image.fromarray(np.array([[-5, 2**30]], dtype=np.int32)).save(tmp_path / "negative.tif")
    with pytest.raises(ValueError, match=r"negative\.tif' is a 32-bit signed integer TIFF with values from -5 to "
                                         r"1,073,741,824, outside its range of 0 \(black\) to 2,147,483,647 "
                                         r"\(white\); rescale it"):
        media.load_conditioning_image(tmp_path / "negative.tif", 64, 96)
    with pytest.raises(ValueError, match=r"the given PIL image is a 32-bit integer image \(PIL mode I\) not from a "
                                         r"TIFF, so read as 16-bit, with values from 0 to 65,536"):
        media.load_conditioning_image(PIL.Image.fromarray(np.array([[0, 65536]], dtype=np.int32)), 64, 96)


def test_load_conditioning_image_applies_exif_orientation(tmp_path: Path) -> None:
    image = PIL.Image.new("RGB", (40, 30), (200, 10, 10))
    exif = PIL.Image.Exif()
    exif[0x0112] = 6  # rotate 90 degrees
    image.save(tmp_path / "r.jpg", exif=exif)
    assert media.load_conditioning_image(tmp_path / "r.jpg", 64, 64).size == (30, 40)


def test_load_conditioning_image_errors(tmp_path: Path) -> None:
    (tmp_path / "text.png").write_text("hello")
    with pytest.raises(ValueError, match=r"text\.png'.*not a readable image"):
        media.load_conditioning_image(tmp_path / "text.png", 64, 64)
    with pytest.raises(ValueError, match="does not exist"):
        media.load_conditioning_image(tmp_path / "none.png", 64, 64)
    with pytest.raises(ValueError, match="height must be a positive integer"):
        media.load_conditioning_image(PIL.Image.new("RGB", (4, 4)), 0, 64)


def test_an_image_over_pils_pixel_limit_is_too_large_not_unreadable(tmp_path: Path, monkeypatch) -> None:
    # PIL's DecompressionBombError is not an OSError: it was an internal error (exit 70) before.
    PIL.Image.new("RGB", (64, 64)).save(tmp_path / "big.png")
    monkeypatch.setattr(PIL.Image, "MAX_IMAGE_PIXELS", 1000)  # 4,096 pixels is over twice the limit
    with pytest.raises(ValueError, match=r"big\.png' is too large \(4,096 pixels, limit 2,000\); downscale it"):
        media.load_conditioning_image(tmp_path / "big.png", 64, 64)
    from k6serve.serve.errors import ApiError
    from k6serve.serve.input_paths import check_readable

    with pytest.raises(ApiError, match=r"too large \(over 2,000 pixels\); downscale it"):
        check_readable("image", str(tmp_path / "big.png"), param="input_reference", uploaded=True)


def _png_bytes(size: tuple[int, int] = (64, 48)) -> bytes:
    buffer = io.BytesIO()
    PIL.Image.fromarray(np.random.default_rng(0).integers(0, 256, (*size[::-1], 3), dtype=np.uint8)).save(
        buffer, format="PNG")
    return buffer.getvalue()


def _pdf_bytes() -> bytes:
    # PIL writes each page as a JPEG inside the PDF, which FFmpeg's mjpeg demuxer reads as video frames: two pages,
    # two frames, as a clip's would be.
    buffer = io.BytesIO()
    PIL.Image.new("RGB", (64, 48), (200, 10, 10)).save(buffer, format="PDF", save_all=True,
                                                       append_images=[PIL.Image.new("RGB", (64, 48), (9, 9, 9))])
    return buffer.getvalue()


ACCEPTED = r"use a PNG, JPEG, WebP, TIFF or GIF image \(a GIF gives its first frame\)"
DAMAGED = (r"it starts as a {} file but its data is damaged, cut short or of a kind k6serve cannot decode; export "
           r"or copy it again, as an 8-bit PNG or JPEG if it still fails")


@pytest.mark.parametrize(("content", "reason"), [
    (b"hello", rf"its contents are in no image format k6serve reads; {ACCEPTED}"),
    (b"", rf"the file is empty \(0 bytes\); {ACCEPTED}"),
    # PIL says "cannot identify image file" for a PNG cut inside its header, as for a text file.
    (_png_bytes()[:30], DAMAGED.format("PNG")),
    (_png_bytes()[:2000], DAMAGED.format("PNG")),  # cut inside the pixel data: PIL opens it, then fails
    (b"\x00\x00\x00\x18ftypheic\x00\x00\x00\x00mif1heic" + bytes(64),
     r"it is a HEIC/HEIF photo, which k6serve cannot read; convert it to JPEG or PNG"),
    # The server called it "a video, not an image" (FFmpeg's probe found the page's JPEG as a one-frame stream).
    (_pdf_bytes(), r"it is a PDF document, not an image; export the page as a PNG or JPEG"),
], ids=["text", "empty", "png_cut_in_header", "png_cut_in_pixels", "heic", "pdf"])
def test_an_unreadable_image_is_explained_the_same_way_for_the_cli_and_the_server(tmp_path: Path, content,
                                                                                     reason) -> None:
    # The server's 400 showed only PIL's exception class ("UnidentifiedImageError"), the CLI PIL's message.
    from k6serve.serve.errors import ApiError
    from k6serve.serve.input_paths import check_readable

    path = tmp_path / "first.png"
    path.write_bytes(content)
    with pytest.raises(ValueError) as cli_error:
        media.load_conditioning_image(path, 64, 96)
    assert re.fullmatch(rf"conditioning image '{re.escape(str(path))}' is not a readable image: {reason}",
                        str(cli_error.value))
    with pytest.raises(ApiError) as server_error:
        check_readable("image", str(path), param="image_path", uploaded=False)
    assert re.fullmatch(rf"image_path '{re.escape(str(path))}' is not a readable image: {reason}\.",
                        server_error.value.message)
    assert "Error" not in server_error.value.message and "Error" not in str(cli_error.value)


def test_a_pdf_is_no_video_for_super_resolution_either(tmp_path: Path) -> None:
    # It passed the server's check as a video (FFmpeg found an MJPEG stream) and was upscaled as a two-frame clip.
    from k6serve.serve.errors import ApiError
    from k6serve.serve.input_paths import check_readable

    path = tmp_path / "scan.pdf"
    path.write_bytes(_pdf_bytes())
    with pytest.raises(ValueError, match=r"scan\.pdf': it is a PDF document, not a video; pass a video file"):
        media.read_sr_source(path)
    with pytest.raises(ApiError) as refused:
        check_readable("video", str(path), param="video_path", uploaded=False)
    assert refused.value.message == (f"video_path {str(path)!r} is a PDF document, not a video; send a video file "
                                     "such as an MP4, MKV, MOV or WebM.")


def test_an_image_over_pils_warning_threshold_prints_no_python_warning(tmp_path: Path, monkeypatch, caplog) -> None:
    # PIL warns ("could be decompression bomb DOS attack") from MAX_IMAGE_PIXELS to twice that, and raises beyond.
    monkeypatch.setattr(PIL.Image, "MAX_IMAGE_PIXELS", 1000)
    PIL.Image.new("RGB", (40, 40), (10, 20, 30)).save(tmp_path / "large.png")  # 1,600 pixels
    PIL.Image.new("RGB", (1, 1500)).save(tmp_path / "strip.png")
    with pytest.warns(PIL.Image.DecompressionBombWarning):  # what the user saw on stderr
        PIL.Image.open(tmp_path / "large.png").close()
    from k6serve.serve.errors import ApiError
    from k6serve.serve.input_paths import check_readable

    filters_before = list(warnings.filters)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # any warning fails the test
        with caplog.at_level(logging.INFO, logger="k6serve.media.image"):
            loaded = media.load_conditioning_image(tmp_path / "large.png", 64, 96)
            check_readable("image", str(tmp_path / "large.png"), param="input_reference", uploaded=True,
                           video_size=(64, 96))
        assert loaded.size == (40, 40) and loaded.getpixel((0, 0)) == (10, 20, 30)
        assert [record.getMessage() for record in caplog.records] == [
            f"conditioning image {str(tmp_path / 'large.png')!r} is 40x40 (1,600 pixels, more than PIL's "
            "decompression-bomb threshold of 1,000): decoded in full before the resize to 96x64"]
        # One too far from the video's aspect ratio gets the project's own refusal, and nothing else.
        caplog.clear()
        with pytest.raises(ValueError, match="is 1x1500, too far from the video's 768x512 aspect ratio"):
            media.load_conditioning_image(tmp_path / "strip.png", 512, 768)
        with pytest.raises(ApiError, match="is 1x1500, too far from the video's 768x512 aspect ratio"):
            check_readable("image", str(tmp_path / "strip.png"), param="input_reference", uploaded=True,
                           video_size=(512, 768))
        assert caplog.records == []
    assert warnings.filters == filters_before and PIL.Image.MAX_IMAGE_PIXELS == 1000


def test_an_image_far_from_the_videos_aspect_ratio_is_refused_before_the_resize(tmp_path: Path) -> None:
    # Covering 768x512 with a 1x400 strip resized it to 768x307,200 first: 1.35 GB and 2 s for a 70-byte PNG,
    # and 1x4000 (10 GB) or 40000x1 took the machine's memory.
    PIL.Image.new("RGB", (1, 400)).save(tmp_path / "strip.png")
    with pytest.raises(ValueError, match=r"conditioning image '.*strip\.png' is 1x400, too far from the video's "
                                         r"768x512 aspect ratio: .* resize it to 768x307200 \(235,929,600 pixels, "
                                         r"limit 89,478,485\) .*crop the image closer to 768:512"):
        media.load_conditioning_image(tmp_path / "strip.png", 512, 768)
    # The same strip covers a small video within the limit, and a photo of any usual shape covers any video.
    assert media.load_conditioning_image(tmp_path / "strip.png", 64, 96).size == (1, 400)
    assert media.cover_resize_center_crop(PIL.Image.new("RGB", (12000, 1000)), 2048, 16).size == (16, 2048)
    from k6serve.serve.errors import ApiError
    from k6serve.serve.input_paths import check_readable

    with pytest.raises(ApiError, match=r"^The uploaded input_reference is 1x400, too far from the video's 768x512"):
        check_readable("image", str(tmp_path / "strip.png"), param="input_reference", uploaded=True,
                       video_size=(512, 768))
    # An EXIF rotation is applied before the resize: 400x1 stored, shown as 1x400.
    exif = PIL.Image.Exif()
    exif[0x0112] = 6
    PIL.Image.new("RGB", (400, 1)).save(tmp_path / "turned.jpg", exif=exif)
    with pytest.raises(ApiError, match=r"image_path '.*turned\.jpg' is 1x400, too far"):
        check_readable("image", str(tmp_path / "turned.jpg"), param="image_path", uploaded=False,
                       video_size=(512, 768))
    check_readable("image", str(tmp_path / "turned.jpg"), param="image_path", uploaded=False, video_size=(64, 96))


@pytest.mark.parametrize("source_size", [(200, 90), (90, 200), (160, 96), (37, 23), (640, 383)])
@pytest.mark.parametrize("target", [(64, 96), (96, 64), (48, 48)])
def test_cover_resize_center_crop_matches_diffusers(source_size, target) -> None:
    torch = pytest.importorskip("torch")
    VideoProcessor = pytest.importorskip("diffusers.video_processor").VideoProcessor

    height, width = target
    rng = np.random.default_rng(sum(source_size))
    pixels = rng.integers(0, 256, (source_size[1], source_size[0], 3), dtype=np.uint8)
    image = PIL.Image.fromarray(pixels)
    reference = VideoProcessor(vae_scale_factor=16).preprocess(
        image, height=height, width=width, resize_mode="crop"
    )
    ours = media.cover_resize_center_crop(image, height, width)
    assert ours.size == (width, height)
    ours_tensor = torch.from_numpy(np.array(ours).astype(np.float32) / 255.0).permute(2, 0, 1)
    assert torch.equal(reference[0], ours_tensor * 2.0 - 1.0)


def test_write_mp4_never_replaces_an_existing_file(tmp_path: Path) -> None:
    target = tmp_path / "out.mp4"
    target.write_bytes(b"previous result")
    with pytest.raises(FileExistsError):
        media.write_mp4(target, moving_pattern(32, 32, 3), 24)
    assert target.read_bytes() == b"previous result" and [p.name for p in tmp_path.iterdir()] == ["out.mp4"]
    (tmp_path / "out_1.mp4").write_bytes(b"another")
    written = media.write_mp4(target, moving_pattern(32, 32, 3), 24, number_if_taken=True)
    assert written == tmp_path / "out_2.mp4" and media.probe(written).num_frames == 3
    assert target.read_bytes() == b"previous result" and (tmp_path / "out_1.mp4").read_bytes() == b"another"


def test_write_mp4_without_hard_links_still_never_replaces(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def no_hard_links(source, target):
        raise OSError(errno.EPERM, "Operation not permitted")

    monkeypatch.setattr(mux.os, "link", no_hard_links)
    (tmp_path / "out.mp4").write_bytes(b"previous result")
    written = media.write_mp4(tmp_path / "out.mp4", moving_pattern(32, 32, 3), 24, number_if_taken=True)
    assert written == tmp_path / "out_1.mp4" and media.probe(written).num_frames == 3
    assert (tmp_path / "out.mp4").read_bytes() == b"previous result"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.mp4", "out_1.mp4"]


def test_the_bomb_warning_guard_lets_one_thread_swap_the_filters_at_a_time() -> None:
    # catch_warnings saves and restores the process-wide filter list: two threads inside it at once could restore
    # each other's lists (the server checks uploads in threads) and leave the filter changed for good.
    import threading

    from k6serve.media.image import no_decompression_bomb_warning

    filters_before = list(warnings.filters)
    first_inside, release_first, second_inside = threading.Event(), threading.Event(), threading.Event()

    def first() -> None:
        with no_decompression_bomb_warning():
            first_inside.set()
            release_first.wait(10)

    def second() -> None:
        first_inside.wait(10)
        with no_decompression_bomb_warning():
            second_inside.set()

    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    for thread in threads:
        thread.start()
    assert first_inside.wait(10)
    assert not second_inside.wait(0.3)  # held off while the first thread's filter list is in place
    release_first.set()
    for thread in threads:
        thread.join(10)
    assert second_inside.is_set()
    assert warnings.filters == filters_before
    with no_decompression_bomb_warning(), no_decompression_bomb_warning():  # re-entrant: a nested use returns
        pass
    assert warnings.filters == filters_before


def test_media_probe_stays_the_function_whichever_module_is_imported_first():
    """k6serve.media imports its modules on first use; `probe` is also its module's name, and when a test imported
    `k6serve.media.probe` first the package's `probe` was that module ("'module' object is not callable", ten tests
    in CI). Fresh interpreters, each import order."""
    for code in ("import k6serve.media.probe; from k6serve import media; assert callable(media.probe)",
                 "from k6serve.media.probe import probe; from k6serve import media; assert media.probe is probe",
                 "from k6serve import media; import k6serve.media.probe; assert callable(media.probe)",
                 "from k6serve import media; media.write_mp4; import k6serve.media.probe; assert callable(media.probe)"):
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
        assert done.returncode == 0, (code, done.stderr)


def test_media_all_lists_every_lazy_name():
    assert sorted(media.__all__) == sorted(media._HOMES)
    assert all(callable(getattr(media, name)) for name in media.__all__)


@pytest.mark.parametrize("kind", ["hls", "concat"])
def test_a_playlist_naming_another_file_is_refused_not_read(tmp_path: Path, kind: str) -> None:
    """FFmpeg's playlist readers open the files a playlist names: an uploaded .m3u8 read a video outside the allowed
    input folders, and the SR job upscaled its frames for download. The reader is held to video demuxers."""
    from k6serve.media.container import open_input

    private = make_clip(tmp_path / "private.mp4", width=64, height=32, num_frames=9, fps=24)
    if kind == "hls":
        playlist = tmp_path / "clip.m3u8"
        playlist.write_text(f"#EXTM3U\n#EXT-X-TARGETDURATION:2\n#EXTINF:2.0,\n{private}\n#EXT-X-ENDLIST\n")
        with av.open(str(playlist)) as container:  # FFmpeg alone reads the private clip through it
            assert container.format.name == "hls" and container.streams.video[0].width == 64
    else:
        playlist = tmp_path / "clip.ffconcat"
        playlist.write_text(f"ffconcat version 1.0\nfile '{private}'\n")
    with pytest.raises(ValueError, match=r"FFmpeg reads it as a format k6serve does not open \(a playlist such as "
                                         r"HLS \.m3u8, a concat list"):
        open_input(playlist)
    with pytest.raises(ValueError, match="as a format k6serve does not open"):
        SRSourceReader(playlist)
    open_input(private).close()  # a video itself opens as before


@pytest.mark.parametrize(("suffix", "container_format", "codec"), [
    (".mkv", "matroska", "libx264"), (".webm", "webm", "libvpx"), (".avi", "avi", "mpeg4"), (".ts", "mpegts", "libx264"),
    (".flv", "flv", "flv"), (".rm", "rm", "rv20"), (".nut", "nut", "mpeg4"), (".y4m", "yuv4mpegpipe", "rawvideo"),
])
def test_the_demuxer_allowlist_still_opens_the_video_formats_users_send(tmp_path: Path, suffix: str,
                                                                       container_format: str, codec: str) -> None:
    from k6serve.media.container import open_input

    path = tmp_path / f"clip{suffix}"
    with av.open(str(path), mode="w", format=container_format) as container:
        stream = container.add_stream(codec, rate=24)
        stream.width, stream.height = 64, 32
        stream.pix_fmt = "yuv420p"
        for frame in moving_pattern(64, 32, 5):
            container.mux(stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
        container.mux(stream.encode(None))
    with open_input(path) as container:
        assert container.streams.video[0].width == 64
