"""HDR and wide-gamut SR sources brought into BT.709 SDR (k6serve/media/color.py): the standards' curves at their
published points, FFmpeg's own colour management where the two must agree, and the reader's frames and notes."""

from __future__ import annotations

import fractions

import av
import numpy as np
import pytest
import torch

from k6serve.media import color
from k6serve.media.video import SRSourceReader, read_sr_source
from k6serve.testing.clips import make_clip

PQ, HLG = color.TRC_PQ, color.TRC_HLG


def _pq_code(nits: float) -> int:
    return round(float(color.nits_to_pq(torch.tensor(nits, dtype=torch.float64))) * 65535)


def _rgb48_frame(rgb16, transfer: int, primaries: int) -> av.VideoFrame:
    """A 16x16 frame of one 16-bit R'G'B' colour, tagged with `transfer` and `primaries`."""
    frame = av.VideoFrame.from_ndarray(np.broadcast_to(np.array(rgb16, np.uint16), (16, 16, 3)).copy(),
                                       format="rgb48le")
    frame.color_trc, frame.color_primaries = transfer, primaries
    frame.pts, frame.time_base = 0, fractions.Fraction(1, 24)
    return frame


def _ffmpeg_sdr(frame: av.VideoFrame, intent: str) -> np.ndarray:
    """FFmpeg's colour management (swscale, FFmpeg >= 7.1) taking `frame` to 8-bit BT.709 SDR at `intent`."""
    graph = av.filter.Graph()
    source = graph.add("buffer", video_size=f"{frame.width}x{frame.height}", pix_fmt=frame.format.name,
                       time_base=str(frame.time_base), pixel_aspect="1/1", colorspace="0", range="2")
    try:
        scale = graph.add("scale", f"out_transfer=bt709:out_primaries=bt709:intent={intent}")
    except (av.error.OptionNotFoundError, ValueError):
        pytest.skip("this PyAV's FFmpeg has no colour management in its scale filter (FFmpeg < 7.1)")
    rgb, sink = graph.add("format", "rgb24"), graph.add("buffersink")
    source.link_to(scale)
    scale.link_to(rgb)
    rgb.link_to(sink)
    graph.configure()
    graph.push(frame)
    return graph.pull().to_ndarray()[0, 0].astype(int)


def test_the_curves_meet_the_standards_published_points():
    assert color.nits_to_pq(torch.tensor(100.0)).item() == pytest.approx(0.5081, abs=1e-4)  # ST 2084 table
    assert color.nits_to_pq(torch.tensor(1000.0)).item() == pytest.approx(0.7518, abs=1e-4)
    assert color.nits_to_pq(torch.tensor(10000.0)).item() == pytest.approx(1.0)
    nits = torch.tensor([0.01, 1.0, 50.0, 203.0, 1000.0, 4000.0], dtype=torch.float64)
    torch.testing.assert_close(color.pq_to_nits(color.nits_to_pq(nits)), nits, rtol=1e-9, atol=0)
    assert color.hlg_to_scene_light(torch.tensor(0.5)).item() == pytest.approx(1 / 12)
    assert color.hlg_to_scene_light(torch.tensor(1.0)).item() == pytest.approx(1.0, abs=1e-6)
    # BT.2408: HLG's reference white, 75% signal, is 203 cd/m^2 on the nominal 1000 cd/m^2 display.
    assert 1000 * color.hlg_to_scene_light(torch.tensor(0.75)).item() ** 1.2 == pytest.approx(203, abs=0.5)
    # ITU-R BT.2087's BT.2020-to-BT.709 matrix.
    torch.testing.assert_close(color.primaries_matrix(color.PRIMARIES_BT2020), torch.tensor(
        [[1.6605, -0.5876, -0.0728], [-0.1246, 1.1329, -0.0083], [-0.0182, -0.1006, 1.1187]]), atol=1e-4, rtol=0)
    torch.testing.assert_close(color.luminance_weights(color.PRIMARIES_BT709),
                               torch.tensor([0.2126, 0.7152, 0.0722]), atol=1e-4, rtol=0)


def test_the_bt2390_roll_off_keeps_the_shadows_and_lands_the_peak():
    nits = torch.linspace(0, 1200, 2401, dtype=torch.float64)
    mapped = color.bt2390_eetf(nits, 1000.0, 203.0)
    below_knee = nits < 80
    torch.testing.assert_close(mapped[below_knee], nits[below_knee], rtol=1e-9, atol=1e-9)
    assert (mapped.diff() >= -1e-9).all()  # never darker for a brighter input
    assert mapped[nits == 1000].item() == pytest.approx(203.0, rel=1e-6)
    assert mapped[-1].item() == pytest.approx(203.0, rel=1e-6)  # above the source's peak: the target's
    assert 150 < color.bt2390_eetf(torch.tensor(203.0), 1000.0, 203.0).item() < 190
    # A source no brighter than the target is only clipped at it.
    torch.testing.assert_close(color.bt2390_eetf(nits, 150.0, 203.0), nits.clamp(max=203.0))


@pytest.mark.parametrize("peak", [250.0, 1000.0, 4000.0])
def test_the_roll_off_table_is_the_formula_to_a_fiftieth_of_a_code_level(peak):
    light = torch.cat([torch.linspace(0, 10000 / 203, 100001), torch.logspace(-6, 1.69, 10001)]).double()
    exact = color.bt2390_eetf(light * 203, peak, 203) / 203
    table = color._roll_off(light.float().unsqueeze(-1).repeat(1, 3), color._roll_off_ratios(peak / 203))

    def code(linear):
        return 255 * linear.double().clamp(0, 1) ** (1 / 2.4)

    assert (code(table[:, 0]) - code(exact)).abs().max() < 0.02
    torch.testing.assert_close(table[:, 1], table[:, 0])  # every channel scaled alike


@pytest.mark.parametrize("nits", [1, 5, 20, 50, 80])
def test_pq_grey_below_the_knee_is_ffmpegs_relative_colorimetric_mapping(nits):
    frame = _rgb48_frame((_pq_code(nits),) * 3, PQ, color.PRIMARIES_BT2020)
    ours = color.SdrFrames().rgb(frame)[0, 0].astype(int)
    np.testing.assert_allclose(ours, _ffmpeg_sdr(frame, "relative_colorimetric"), atol=1)


@pytest.mark.parametrize("rgb709", [(60, 160, 90), (200, 120, 80), (90, 100, 200), (230, 200, 180)])
def test_bt709_colours_held_in_bt2020_come_back(rgb709):
    """A BT.709 colour written into a BT.2020 container (SDR, or PQ below the knee) comes back as itself, and as
    FFmpeg's colour management gives it."""
    linear_709 = (np.array(rgb709) / 255) ** 2.4
    linear_2020 = np.linalg.solve(color._rgb_to_xyz(color.PRIMARIES_BT2020),
                                  color._rgb_to_xyz(color.PRIMARIES_BT709)) @ linear_709
    sdr = _rgb48_frame(tuple(round(v * 65535) for v in linear_2020 ** (1 / 2.4)), 1, color.PRIMARIES_BT2020)
    ours = color.SdrFrames().rgb(sdr)[0, 0].astype(int)
    np.testing.assert_allclose(ours, rgb709, atol=1)
    np.testing.assert_allclose(ours, _ffmpeg_sdr(sdr, "relative_colorimetric"), atol=1)
    # In PQ at 60 cd/m^2 for SDR's 255 (below the knee): the same colour, 60/203 as bright in linear light.
    pq = tuple(_pq_code(60 * v) for v in linear_2020)
    hdr = _rgb48_frame(pq, PQ, color.PRIMARIES_BT2020)
    expected = np.round(255 * (linear_709 * 60 / 203) ** (1 / 2.4))
    np.testing.assert_allclose(color.SdrFrames().rgb(hdr)[0, 0].astype(int), expected, atol=1)
    np.testing.assert_allclose(color.SdrFrames().rgb(hdr)[0, 0].astype(int), _ffmpeg_sdr(hdr, "relative_colorimetric"),
                               atol=2)


def test_reference_white_lands_near_sdr_white_and_highlights_are_not_clipped():
    """Why the mapping is ours, not FFmpeg's: its relative-colorimetric intent clips everything above reference
    white, and its perceptual intent (no peak in the file) darkens reference white to about 61%."""
    codes = {nits: color.SdrFrames().rgb(_rgb48_frame((_pq_code(nits),) * 3, PQ, 9))[0, 0, 0]
             for nits in (100, 203, 400, 1000)}
    assert 180 <= codes[100] < codes[203] < codes[400] < codes[1000] == 255
    assert codes[203] >= 220
    white = _rgb48_frame((_pq_code(203),) * 3, PQ, 9)
    assert _ffmpeg_sdr(white, "perceptual")[0] < 170
    relative = [_ffmpeg_sdr(_rgb48_frame((_pq_code(nits),) * 3, PQ, 9), "relative_colorimetric")[0]
                for nits in (400, 1000)]
    assert relative == [255, 255]
    hlg_white = color.SdrFrames().rgb(_rgb48_frame((round(0.75 * 65535),) * 3, HLG, 9))[0, 0, 0]
    assert hlg_white == codes[203] or abs(int(hlg_white) - int(codes[203])) <= 1  # both are 203 cd/m^2


def test_a_colour_outside_bt709_keeps_its_hue():
    """BT.2020's pure red is 1.66 of BT.709's red with negative green and blue: desaturated toward its luminance
    alone it would come out pink; it stays red. Display P3's green keeps its luminance (no channel above 1)."""
    red = color.SdrFrames().rgb(_rgb48_frame((65535, 0, 0), 1, color.PRIMARIES_BT2020))[0, 0]
    assert red[0] == 255 and red[1] == 0 and red[2] < 100
    green = color.SdrFrames().rgb(_rgb48_frame((0, 65535, 0), 1, color.PRIMARIES_P3_D65))[0, 0]
    assert green[1] >= 245 and green[0] == 0 and green[2] < 110


def test_an_hdr_curve_on_bt709_primaries_keeps_them():
    """HLG on BT.709 primaries is a camera mode: taken as BT.2020 it came out over-saturated ((227, 0, 70) for
    BT.709's red)."""
    red = color.SdrFrames().rgb(_rgb48_frame((round(0.75 * 65535), 0, 0), HLG, color.PRIMARIES_BT709))[0, 0]
    assert red[1] == 0 and red[2] == 0 and red[0] > 150
    untagged = color.SdrFrames()
    untagged.rgb(_rgb48_frame((round(0.75 * 65535), 0, 0), HLG, 2))
    assert untagged.mapping.primaries == color.PRIMARIES_BT2020  # untagged HDR: BT.2020


@pytest.mark.parametrize("transfer, primaries", [(1, 1), (6, 6), (2, 2), (13, 1), (1, 5)])
def test_sdr_bt709_class_frames_are_decoded_as_before(transfer, primaries):
    rng = np.random.default_rng(0)
    frame = av.VideoFrame.from_ndarray(rng.integers(0, 256, (16, 16, 3), dtype=np.uint8), format="rgb24")
    frame = frame.reformat(format="yuv420p")
    frame.color_trc, frame.color_primaries = transfer, primaries
    colors = color.SdrFrames()
    np.testing.assert_array_equal(colors.rgb(frame), frame.to_ndarray(format="rgb24"))
    assert colors.mapping is None


def _write_pq_clip(path, x264_params: str | None) -> None:
    """A 10-bit PQ BT.2020 H.264 clip of flat grey, with HDR10 metadata from `x264_params` (x264's
    mastering-display and cll), as an HDR10 camera or download carries it."""
    with av.open(str(path), "w") as container:
        stream = container.add_stream("libx264", rate=24)
        stream.width = stream.height = 32
        stream.pix_fmt = "yuv420p10le"
        stream.codec_context.color_trc, stream.codec_context.color_primaries = PQ, 9
        stream.codec_context.colorspace = 9
        stream.codec_context.options = {"crf": "10"} | ({"x264-params": x264_params} if x264_params else {})
        for index in range(9):
            frame = av.VideoFrame(32, 32, "yuv420p10le")
            for plane, value in zip(frame.planes, (600, 512, 512)):
                plane.update(np.full(plane.buffer_size // 2, value, np.uint16).tobytes())
            frame.pts, frame.colorspace, frame.color_range = index, 9, 1
            container.mux(stream.encode(frame))
        container.mux(stream.encode(None))


_MASTERING = "mastering-display=G(13250,34500)B(7500,3000)R(34000,16000)WP(15635,16450)L(40000000,50)"


@pytest.mark.parametrize("params, peak, source", [
    (f"{_MASTERING}:cll=1500,400", 1500, "the file's MaxCLL"),
    (f"{_MASTERING}:cll=0,0", 4000, "the file's mastering display peak"),
    (None, 1000, "assumed: the file states no peak"),
])
def test_the_peak_comes_from_the_files_hdr10_metadata(tmp_path, params, peak, source):
    path = tmp_path / "hdr10.mp4"
    _write_pq_clip(path, params)
    clip = read_sr_source(path)
    note = [note for note in clip.notes if "HDR" in note]
    assert note == [f"the source is HDR (PQ, SMPTE ST 2084 transfer, BT.2020 colours): its frames were tone-mapped "
                    f"to SDR BT.709 before upscaling (scaled so HDR reference white, 203 cd/m^2, would be SDR white, "
                    f"and everything from about 90 cd/m^2 up to {peak} cd/m^2 ({source}) rolled off into SDR's range "
                    "by ITU-R BT.2390's curve), so the output is SDR"]
    # 10-bit code 600 is about 250 cd/m^2 (after H.264): above reference white, rolled off, and darker for a
    # brighter peak.
    assert clip.frames.shape == (9, 32, 32, 3)
    assert np.ptp(clip.frames) <= 2
    expected = {1000: 241, 1500: 234, 4000: 221}[peak]
    assert abs(int(clip.frames[0, 0, 0, 0]) - expected) <= 2


@pytest.mark.parametrize("transfer", [PQ, HLG])
def test_an_hdr_camera_file_is_tone_mapped_and_said_so(tmp_path, caplog, transfer):
    """An HDR10 or HLG camera file was re-tagged BT.709 SDR with its code values as they were (washed out)."""
    path = make_clip(tmp_path / "hdr.mp4", width=32, height=32, num_frames=9, fps=24, hdr_transfer=transfer)
    with caplog.at_level("INFO", logger="k6serve.media.video"), SRSourceReader(path) as reader:
        frames = np.stack(list(reader.frames()))
        summary = reader.summary()
    name = color.HDR_TRANSFERS[transfer]
    hdr = [note for note in summary.notes if "HDR" in note]
    assert len(hdr) == 1 and hdr[0].startswith(f"the source is HDR ({name} transfer, BT.2020 colours): its frames "
                                               "were tone-mapped to SDR BT.709")
    assert hdr[0] in caplog.text
    with av.open(str(path)) as container:
        plain = np.stack([frame.to_ndarray(format="rgb24") for frame in container.decode(video=0)])
    assert np.abs(frames.astype(int) - plain).mean() > 5


@pytest.mark.parametrize("primaries, name", [(9, "BT.2020"), (12, "Display P3")])
def test_a_wide_gamut_sdr_file_is_mapped_into_bt709(tmp_path, primaries, name):
    path = make_clip(tmp_path / "wide.mp4", width=32, height=32, num_frames=9, fps=24, color_primaries=primaries)
    clip = read_sr_source(path)
    assert [note for note in clip.notes if "gamut" in note] == [
        f"the source's colours are {name} (wide gamut): they were mapped into BT.709, the output's (colours "
        "outside it desaturated to fit), before upscaling"]
    plain_path = make_clip(tmp_path / "plain.mp4", width=32, height=32, num_frames=9, fps=24)
    plain = read_sr_source(plain_path)
    assert not [note for note in plain.notes if "gamut" in note or "HDR" in note]
    # Wider primaries: the same codes are more saturated colours, so mapped into BT.709 they spread further.
    def saturation(frames):
        return (frames.max(axis=-1).astype(int) - frames.min(axis=-1)).mean()
    assert saturation(clip.frames) > saturation(plain.frames)
