"""ICC colour profiles of the conditioning image (k6serve/media/icc.py, via `load_conditioning_image`): a Display P3,
Adobe RGB, gray or CMYK image is converted to sRGB; an sRGB or unprofiled one loads bit for bit as diffusers'
`load_image` reads it; a profile that cannot be used changes nothing but says so. No profile file ships with the
machine and none can be downloaded: sRGB is littleCMS's own (`ImageCms.createProfile`), the others are ICC v2
profiles written here byte by byte (`_icc`). Expected colours come from the standards' published matrices and
curves, not from littleCMS.
"""

from __future__ import annotations

import io
import logging
import struct
from pathlib import Path

import numpy as np
import PIL.Image
import PIL.ImageCms
import pytest

from k6serve.media.image import load_conditioning_image

LOGGER = "k6serve.media.icc"

# ---- ICC v2 profiles, byte by byte (ICC.1:2001-04) ----

_D50 = (0.9642, 1.0, 0.8249)  # the profile connection space's white
_D65_XY = (0.3127, 0.3290)
_SRGB_XY = ((0.640, 0.330), (0.300, 0.600), (0.150, 0.060))
_P3_XY = ((0.680, 0.320), (0.265, 0.690), (0.150, 0.060))
_ADOBE_XY = ((0.640, 0.330), (0.210, 0.710), (0.150, 0.060))
_ADOBE_GAMMA = 563 / 256  # Adobe RGB (1998)'s 2.19921875
_BRADFORD = np.array([[0.8951, 0.2664, -0.1614], [-0.7502, 1.7135, 0.0367], [0.0389, -0.0685, 1.0296]])

# Published linear-light matrices into sRGB (BT.709 primaries), both D65: SMPTE EG 432-1 for Display P3, Adobe RGB
# (1998)'s specification; the profiles below are built from the primaries instead.
_P3_TO_SRGB = np.array([[1.2249, -0.2247, 0.0], [-0.0420, 1.0419, 0.0], [-0.0197, -0.0786, 1.0979]])
_ADOBE_TO_SRGB = np.array([[1.3982, -0.3982, 0.0], [0.0, 1.0, 0.0], [0.0, -0.0429, 1.0429]])


def _xyz(x: float, y: float) -> np.ndarray:
    return np.array([x / y, 1.0, (1 - x - y) / y])


def _colorants(primaries) -> np.ndarray:
    """Columns: XYZ of each primary at full drive, D65 white, Bradford-adapted to D50 as ICC profiles hold them."""
    columns = np.stack([_xyz(*xy) for xy in primaries], axis=1)
    rgb_to_xyz = columns * np.linalg.solve(columns, _xyz(*_D65_XY))
    cone_scale = np.diag((_BRADFORD @ np.array(_D50)) / (_BRADFORD @ _xyz(*_D65_XY)))
    return np.linalg.inv(_BRADFORD) @ cone_scale @ _BRADFORD @ rgb_to_xyz


def _s15(value: float) -> bytes:
    return struct.pack(">i", round(value * 65536))


def _xyz_tag(xyz) -> bytes:
    return b"XYZ " + bytes(4) + b"".join(_s15(v) for v in xyz)


def _desc_tag(text: str) -> bytes:  # textDescriptionType: ASCII, then empty Unicode and ScriptCode parts
    ascii_text = text.encode("ascii") + b"\0"
    return b"desc" + bytes(4) + struct.pack(">I", len(ascii_text)) + ascii_text + bytes(8) + bytes(3) + bytes(67)


def _gamma_curve(gamma: float) -> bytes:
    return b"curv" + bytes(4) + struct.pack(">IH", 1, round(gamma * 256))


def _table_curve(values) -> bytes:
    return b"curv" + bytes(4) + struct.pack(">I", len(values)) + b"".join(struct.pack(">H", round(v * 65535))
                                                                          for v in values)


def _icc(space: bytes, device_class: bytes, tags: dict[str, bytes]) -> bytes:
    """A profile: 128-byte header, tag table, tags 4-byte aligned (equal tags share their data, as rTRC/gTRC/bTRC
    usually do)."""
    data, table, placed = b"", [], {}
    start = 128 + 4 + 12 * len(tags)
    for signature, body in tags.items():
        if body not in placed:
            data += bytes(-len(data) % 4)
            placed[body] = start + len(data)
            data += body
        table.append(signature.encode() + struct.pack(">II", placed[body], len(body)))
    body = struct.pack(">I", len(tags)) + b"".join(table) + data
    header = (struct.pack(">I4sI4s4s4s", 128 + len(body), bytes(4), 0x02100000, device_class, space, b"XYZ ")
              + bytes(12) + b"acsp" + bytes(28) + b"".join(_s15(v) for v in _D50) + bytes(48))
    assert len(header) == 128
    return header + body


def _common_tags(name: str) -> dict[str, bytes]:
    return {"desc": _desc_tag(name), "cprt": b"text" + bytes(4) + b"No copyright, use freely\0"}


def _rgb_profile(name: str, primaries, curve: bytes) -> bytes:
    """A display (matrix and curves) profile, as Display P3 and Adobe RGB are."""
    colorants = _colorants(primaries)
    return _icc(b"RGB ", b"mntr", {**_common_tags(name), "wtpt": _xyz_tag(_xyz(*_D65_XY)),
                                   "rXYZ": _xyz_tag(colorants[:, 0]), "gXYZ": _xyz_tag(colorants[:, 1]),
                                   "bXYZ": _xyz_tag(colorants[:, 2]), "rTRC": curve, "gTRC": curve, "bTRC": curve})


def _gray_profile(name: str, gamma: float) -> bytes:
    return _icc(b"GRAY", b"mntr", {**_common_tags(name), "wtpt": _xyz_tag(_D50), "kTRC": _gamma_curve(gamma)})


def _cmyk_profile(name: str) -> bytes:
    """An input profile whose A2B0 table (lut16, 2 grid points a channel) gives the linear-light sRGB colour
    R = 1 - (C + K) / 2, G = 1 - (M + K) / 2, B = 1 - (Y + K) / 2 as PCS XYZ: affine, so littleCMS's interpolation
    gives it exactly between the grid points (a real press profile is a 9 to 33 point table of measurements)."""
    colorants = _colorants(_SRGB_XY)
    grid = b""
    for c, m, y, k in np.ndindex(2, 2, 2, 2):  # the first channel varies slowest
        linear = 1 - np.array([c + k, m + k, y + k]) / 2
        grid += b"".join(struct.pack(">H", round(v * 32768)) for v in colorants @ linear)  # lut16 XYZ: 1.0 = 0x8000
    identity = struct.pack(">HH", 0, 65535)
    lut = (b"mft2" + bytes(4) + bytes([4, 3, 2, 0]) + b"".join(_s15(v) for v in np.eye(3).ravel())
           + struct.pack(">HH", 2, 2) + identity * 4 + grid + identity * 3)
    return _icc(b"CMYK", b"scnr", {**_common_tags(name), "wtpt": _xyz_tag(_D50), "A2B0": lut})


def _srgb_decode(levels) -> np.ndarray:
    v = np.asarray(levels, dtype=np.float64) / 255
    return np.where(v <= 0.04045, v / 12.92, ((v + 0.055) / 1.055) ** 2.4)


def _srgb_encode(linear) -> np.ndarray:
    v = np.clip(linear, 0, 1)
    return 255 * np.where(v <= 0.0031308, v * 12.92, 1.055 * v ** (1 / 2.4) - 0.055)


SRGB_CURVE = _table_curve(_srgb_decode(np.linspace(0, 255, 1024)))  # 1024 entries, as HP's sRGB profile has
LCMS_SRGB = PIL.ImageCms.ImageCmsProfile(PIL.ImageCms.createProfile("sRGB")).tobytes()  # ICC v4, parametric curve
HP_STYLE_SRGB = _rgb_profile("sRGB IEC61966-2.1", _SRGB_XY, SRGB_CURVE)
DISPLAY_P3 = _rgb_profile("Display P3", _P3_XY, SRGB_CURVE)
ADOBE_RGB = _rgb_profile("Adobe RGB (1998)", _ADOBE_XY, _gamma_curve(_ADOBE_GAMMA))

# Colours inside both P3 and sRGB once converted (the P3 red, green and yellow of a phone photo lie outside sRGB).
COLOURS = np.array([[200, 120, 80], [100, 150, 200], [128, 128, 128], [60, 180, 90], [230, 200, 170],
                    [40, 60, 120], [0, 0, 0], [255, 255, 255]], dtype=np.uint8)


def _patches(colours: np.ndarray) -> np.ndarray:
    """One 16x16 patch a colour, in a row: flat 8x8 blocks, so JPEG keeps each near its colour."""
    return np.repeat(np.repeat(colours[None], 16, axis=0), 16, axis=1)


def _centres(pixels: np.ndarray) -> np.ndarray:
    return np.asarray(pixels)[8, 8::16]


@pytest.fixture(scope="module")
def diffusers_load_image():
    """diffusers' `load_image`, the parity reference: EXIF orientation applied, `convert("RGB")`, profile ignored."""
    return pytest.importorskip("diffusers.utils").load_image


def _save(path: Path, pixels: np.ndarray | PIL.Image.Image, icc_profile: bytes | None, **options) -> Path:
    image = pixels if isinstance(pixels, PIL.Image.Image) else PIL.Image.fromarray(pixels)
    if icc_profile is not None:
        options["icc_profile"] = icc_profile
    if path.suffix == ".jpg":
        options.setdefault("quality", 95)
    image.save(path, **options)
    with PIL.Image.open(path) as saved:  # the file holds the profile this test means
        assert saved.info.get("icc_profile") == icc_profile
    return path


def _decoded(path: Path) -> np.ndarray:
    """The file's pixels as PIL decodes them, no colour management (a JPEG's are not quite what was saved)."""
    with PIL.Image.open(path) as image:
        return np.asarray(image)


def test_the_hand_written_profiles_are_read_by_littlecms_as_written() -> None:
    srgb = PIL.ImageCms.ImageCmsProfile(io.BytesIO(LCMS_SRGB))
    for data, name, space in ((HP_STYLE_SRGB, "sRGB IEC61966-2.1", "RGB"), (DISPLAY_P3, "Display P3", "RGB"),
                              (ADOBE_RGB, "Adobe RGB (1998)", "RGB"), (_gray_profile("Gray", 1.8), "Gray", "GRAY"),
                              (_cmyk_profile("CMYK"), "CMYK", "CMYK")):
        profile = PIL.ImageCms.ImageCmsProfile(io.BytesIO(data))
        assert (profile.profile.profile_description, profile.profile.xcolor_space.strip()) == (name, space)
    # P3's red is outside sRGB: clipped to sRGB's red, its green and blue negative in sRGB.
    p3 = PIL.ImageCms.ImageCmsProfile(io.BytesIO(DISPLAY_P3))
    red = PIL.ImageCms.profileToProfile(PIL.Image.new("RGB", (1, 1), (255, 0, 0)), p3, srgb, outputMode="RGB")
    assert red.getpixel((0, 0)) == (255, 0, 0)


@pytest.mark.parametrize("icc_profile", [None, LCMS_SRGB, HP_STYLE_SRGB, _rgb_profile("Display P3", _SRGB_XY,
                                                                                     SRGB_CURVE)],
                         ids=["no profile", "littleCMS sRGB v4", "sRGB v2 1024-entry curve",
                              "sRGB colours named Display P3"])
@pytest.mark.parametrize("mode, suffix", [("RGB", ".png"), ("RGB", ".jpg"), ("L", ".png"), ("L", ".jpg"),
                                          ("RGBA", ".png"), ("P", ".png")])
def test_unprofiled_and_srgb_images_load_bit_for_bit_as_diffusers(tmp_path: Path, suffix: str, icc_profile, mode,
                                                                  diffusers_load_image, caplog) -> None:
    # sRGB is told by what the profile does to colours: a name of "Display P3" on sRGB's colours changes nothing.
    # A grayscale photo keeping its sRGB profile is common, and left alone as well.
    rng = np.random.default_rng(0)
    channels = 4 if mode == "RGBA" else 3
    image = PIL.Image.fromarray(rng.integers(0, 256, (24, 40, channels), dtype=np.uint8)).convert(mode)
    path = _save(tmp_path / f"image{suffix}", image, icc_profile)
    caplog.set_level(logging.INFO, logger=LOGGER)
    notes: list[str] = []
    loaded = load_conditioning_image(path, 64, 96, notes=notes)
    assert loaded.mode == "RGB"
    assert np.array_equal(np.asarray(loaded), np.asarray(diffusers_load_image(str(path))))
    assert notes == [] and not caplog.records


def test_a_16_bit_grayscale_image_with_srgb_colours_keeps_its_levels(tmp_path: Path, caplog) -> None:
    # As test_media's 16-bit test: the top 8 bits, which diffusers does not keep (it clips at 255).
    levels = np.array([[0, 0x00FF, 0x8000], [0x80FF, 0xC000, 0xFFFF]], dtype=np.uint16)
    path = _save(tmp_path / "gray16.png", PIL.Image.fromarray(levels), LCMS_SRGB)
    caplog.set_level(logging.INFO, logger=LOGGER)
    loaded = load_conditioning_image(path, 64, 96)
    assert np.array_equal(np.asarray(loaded), np.repeat([[[0], [0], [128]], [[128], [192], [255]]], 3, axis=2))
    assert not caplog.records


@pytest.mark.parametrize("name", ["Display P3", "sRGB IEC61966-2.1"])
@pytest.mark.parametrize("suffix", [".png", ".jpg"])
def test_a_display_p3_image_is_converted_to_srgb(tmp_path: Path, suffix: str, name: str, diffusers_load_image,
                                                 caplog) -> None:
    # An iPhone photo. The name does not count: P3's colours under sRGB's name are converted all the same. The JPEG
    # is rotated by its EXIF orientation as before.
    options = {}
    if suffix == ".jpg":
        exif = PIL.Image.Exif()
        exif[0x0112] = 3  # rotated 180 degrees
        options["exif"] = exif
    path = _save(tmp_path / f"p3{suffix}", _patches(COLOURS), _rgb_profile(name, _P3_XY, SRGB_CURVE), **options)
    caplog.set_level(logging.INFO, logger=LOGGER)
    notes: list[str] = []
    loaded = np.asarray(load_conditioning_image(path, 64, 96, notes=notes))
    stored = _centres(_decoded(path))
    if suffix == ".jpg":
        loaded = loaded[::-1, ::-1]  # back to the stored orientation, to compare patch by patch
    expected = _srgb_encode(_srgb_decode(stored) @ _P3_TO_SRGB.T)
    assert np.abs(_centres(loaded) - expected).max() <= 2
    # Not what was there before: the saturated colours move by many levels (P3 read as sRGB looks dull).
    unmanaged = _centres(np.asarray(diffusers_load_image(str(path)))[::-1, ::-1] if suffix == ".jpg"
                         else np.asarray(diffusers_load_image(str(path))))
    assert np.abs(_centres(loaded).astype(int) - unmanaged).max() >= 10
    assert len(notes) == 1 and f"ICC colour profile ('{name}'), not sRGB" in notes[0]
    assert "converted to sRGB" in notes[0] and str(path) not in notes[0]  # the server shows notes: no paths
    assert [(r.levelno, r.getMessage()) for r in caplog.records] == [(logging.INFO, f"conditioning image "
                                                                                    f"{str(path)!r}: {notes[0]}")]


def test_an_adobe_rgb_image_with_alpha_is_converted_and_its_alpha_dropped_as_before(tmp_path: Path) -> None:
    rgba = np.concatenate([_patches(COLOURS), np.full((16, 16 * len(COLOURS), 1), 77, np.uint8)], axis=2)
    path = _save(tmp_path / "adobe.png", PIL.Image.fromarray(rgba), ADOBE_RGB)
    loaded = np.asarray(load_conditioning_image(path, 64, 96))
    assert loaded.shape == (16, 16 * len(COLOURS), 3)
    expected = _srgb_encode((COLOURS / 255) ** _ADOBE_GAMMA @ _ADOBE_TO_SRGB.T)
    assert np.abs(_centres(loaded) - expected).max() <= 2


def test_an_srgb_colorant_profile_with_another_curve_is_not_srgb(tmp_path: Path) -> None:
    # sRGB's primaries on a plain 2.2 power curve (some "sRGB" exports): its shadows differ from sRGB's curve.
    path = _save(tmp_path / "gamma22.png", _patches(COLOURS), _rgb_profile("sRGB", _SRGB_XY, _gamma_curve(2.2)))
    notes: list[str] = []
    loaded = _centres(np.asarray(load_conditioning_image(path, 64, 96, notes=notes)))
    assert np.abs(loaded - _srgb_encode((COLOURS / 255) ** 2.2)).max() <= 2
    assert len(notes) == 1 and not np.array_equal(loaded, COLOURS)


@pytest.mark.parametrize("suffix, bits", [(".png", 16), (".jpg", 8)])
def test_a_grayscale_image_with_a_gray_profile_is_converted(tmp_path: Path, suffix: str, bits: int) -> None:
    # A linear-light gray profile (gamma 1.0): its 128 is half of white's light, sRGB's 188 (sRGB's own 128 is 22%).
    # The 16-bit PNG is brought to its top 8 bits first, as without a profile.
    levels = np.repeat(np.repeat(np.array([[0, 32, 64, 128, 192, 255]], np.uint8), 16, axis=0), 16, axis=1)
    pixels = levels.astype(np.uint16) * 257 if bits == 16 else levels
    path = _save(tmp_path / f"gray{suffix}", PIL.Image.fromarray(pixels), _gray_profile("Gray Gamma 1.0", 1.0))
    with PIL.Image.open(path) as opened:
        assert opened.mode == ("I;16" if bits == 16 else "L")
    stored = _centres(_decoded(path)) >> (8 if bits == 16 else 0)
    loaded = _centres(np.asarray(load_conditioning_image(path, 64, 96)))
    assert np.abs(loaded - _srgb_encode(stored / 255)[:, None]).max() <= 2
    assert np.abs(loaded[3] - 188).max() <= 2  # not 128, as before


def test_a_cmyk_jpeg_with_a_profile_is_converted_by_it(tmp_path: Path, diffusers_load_image) -> None:
    cmyk = np.array([[0, 0, 0, 0], [128, 0, 0, 0], [0, 128, 255, 64], [0, 0, 0, 255], [64, 64, 64, 64]], np.uint8)
    path = _save(tmp_path / "cmyk.jpg", PIL.Image.fromarray(_patches(cmyk), mode="CMYK"), _cmyk_profile("Test CMYK"))
    stored = _centres(_decoded(path)) / 255
    loaded = _centres(np.asarray(load_conditioning_image(path, 64, 96)))
    expected = _srgb_encode(1 - (stored[:, :3] + stored[:, 3:]) / 2)
    assert np.abs(loaded - expected).max() <= 2
    # PIL's own CMYK conversion (255 - C - K...) made full black ink black; the profile makes it 50% light.
    assert _centres(np.asarray(diffusers_load_image(str(path))))[3].max() <= 2 and loaded[3].min() >= 180


def test_a_pil_image_passed_in_is_converted_by_its_profile_too(tmp_path: Path) -> None:
    path = _save(tmp_path / "p3.png", _patches(COLOURS), DISPLAY_P3)
    with PIL.Image.open(path) as opened:
        loaded = _centres(np.asarray(load_conditioning_image(opened, 64, 96)))
    assert np.abs(loaded - _srgb_encode(_srgb_decode(COLOURS) @ _P3_TO_SRGB.T)).max() <= 2


_P3_COLORANTS = _colorants(_P3_XY)
# Profiles littleCMS refuses to open, one it opens but cannot convert with, and one that is no image's profile.
_BROKEN = {
    "not a profile": b"this is not an ICC profile",
    "cut short": DISPLAY_P3[:200],
    "no blue colorant": _icc(b"RGB ", b"mntr", {**_common_tags("No blue"), "wtpt": _xyz_tag(_xyz(*_D65_XY)),
                                                "rXYZ": _xyz_tag(_P3_COLORANTS[:, 0]),
                                                "gXYZ": _xyz_tag(_P3_COLORANTS[:, 1]),
                                                "rTRC": SRGB_CURVE, "gTRC": SRGB_CURVE, "bTRC": SRGB_CURVE}),
    "device link": _icc(b"RGB ", b"link", {**_common_tags("A device link"), "wtpt": _xyz_tag(_D50)}),
}


@pytest.mark.parametrize("suffix", [".png", ".jpg"])
@pytest.mark.parametrize("damage", list(_BROKEN))
def test_a_profile_littlecms_cannot_use_loads_as_before_with_a_warning(tmp_path: Path, suffix: str, damage: str,
                                                                       diffusers_load_image, caplog) -> None:
    path = _save(tmp_path / f"broken{suffix}", _patches(COLOURS), _BROKEN[damage])
    caplog.set_level(logging.INFO, logger=LOGGER)
    notes: list[str] = []
    loaded = load_conditioning_image(path, 64, 96, notes=notes)
    assert np.array_equal(np.asarray(loaded), np.asarray(diffusers_load_image(str(path))))
    assert len(notes) == 1 and notes[0].startswith("the conditioning image's ICC colour profile was not used (")
    assert "its colours were read as sRGB" in notes[0] and str(path) not in notes[0]
    assert [r.levelno for r in caplog.records] == [logging.WARNING]
    assert caplog.records[0].getMessage().startswith(f"conditioning image {str(path)!r}: {notes[0]}")


def test_a_profile_for_other_colours_than_the_images_is_not_used(tmp_path: Path, diffusers_load_image,
                                                                  caplog) -> None:
    # A CMYK photo converted to RGB in Python keeps its CMYK profile in `info`; a gray profile fits no RGB image.
    caplog.set_level(logging.WARNING, logger=LOGGER)
    for icc_profile, words in ((_cmyk_profile("Press CMYK"), "it is for CMYK colours ('Press CMYK'), but the image "
                                                              "is RGB"),
                               (_gray_profile("Gray", 1.8), "it is for grayscale colours ('Gray'), but the image is "
                                                             "RGB")):
        image = PIL.Image.fromarray(_patches(COLOURS))
        image.info["icc_profile"] = icc_profile
        notes: list[str] = []
        loaded = load_conditioning_image(image, 64, 96, notes=notes)
        assert np.array_equal(np.asarray(loaded), _patches(COLOURS))
        assert len(notes) == 1 and f"was not used ({words})" in notes[0]
    assert len(caplog.records) == 2


def test_a_lab_tiff_is_converted_from_cielab_with_nothing_said(tmp_path: Path, caplog) -> None:
    # PIL's convert("LAB") tags the image with its Lab identity, an abstract profile: it was refused with a warning
    # that its colours were read as sRGB and shifted, while convert("RGB") converted them from CIELAB, right.
    caplog.set_level(logging.INFO, logger=LOGGER)
    path = tmp_path / "lab.tif"
    PIL.Image.fromarray(_patches(COLOURS)).convert("LAB").save(path)
    with PIL.Image.open(path) as saved:
        assert PIL.ImageCms.getProfileDescription(PIL.ImageCms.ImageCmsProfile(
            io.BytesIO(saved.info["icc_profile"]))).strip() == "Lab identity built-in"
    notes: list[str] = []
    loaded = load_conditioning_image(path, 64, 96, notes=notes)
    assert np.abs(_centres(np.asarray(loaded)).astype(int) - COLOURS).max() <= 3
    assert notes == [] and caplog.records == []


def test_a_profile_that_describes_no_image_is_not_used_and_says_what_it_is(tmp_path: Path) -> None:
    lab_identity = PIL.ImageCms.ImageCmsProfile(PIL.ImageCms.createProfile("LAB")).tobytes()
    image = PIL.Image.fromarray(_patches(COLOURS))
    image.info["icc_profile"] = lab_identity
    notes: list[str] = []
    assert np.array_equal(np.asarray(load_conditioning_image(image, 64, 96, notes=notes)), _patches(COLOURS))
    assert notes[0].startswith("the conditioning image's ICC colour profile was not used (it is an abstract profile "
                               "('Lab identity built-in'), which describes no image): its colours were read as sRGB")
    # A Lab image is read as CIELAB whatever its profile says: the warning must not say sRGB.
    lab = PIL.Image.fromarray(_patches(COLOURS)).convert("LAB")
    lab.info["icc_profile"] = DISPLAY_P3
    notes = []
    loaded = load_conditioning_image(lab, 64, 96, notes=notes)
    assert np.abs(_centres(np.asarray(loaded)).astype(int) - COLOURS).max() <= 3
    assert notes == ["the conditioning image's ICC colour profile was not used (it is for RGB colours ('Display P3'), "
                     "but the image is CIELAB): its colours were read as CIELAB (D50), as its PIL mode says, and "
                     "converted to sRGB; to be sure of them, save the image as sRGB (most editors convert to sRGB on "
                     "export)"]


def test_the_cli_check_before_loading_logs_no_conversion(tmp_path: Path, tiny_distill_dir, caplog) -> None:
    """The CLI checks the image before loading the model (`check_request_before_loading`); the pipeline's load logs
    the conversion. The check logging it too said it twice."""
    from k6serve.cli.preflight import check_request_before_loading
    from k6serve.request import SamplingParams

    path = _save(tmp_path / "p3.png", _patches(COLOURS), _rgb_profile("Display P3", _P3_XY, SRGB_CURVE))
    damaged = _save(tmp_path / "bad.png", _patches(COLOURS), _BROKEN["not a profile"])
    caplog.set_level(logging.INFO, logger=LOGGER)
    for image in (path, damaged):
        check_request_before_loading({"model_path": str(tiny_distill_dir)},
                                     SamplingParams(prompt="x", image_path=str(image), height=32, width=32))
    assert not caplog.records
    load_conditioning_image(path, 32, 32)
    assert len(caplog.records) == 1


def test_the_conversion_note_reaches_a_generation_result(tmp_path: Path, tiny_distill_dir) -> None:
    """The pipeline passes its notes list: the user sees the note on the CLI and in the HTTP job's warnings."""
    from k6serve import DiffGenerator
    from k6serve.engine_arguments import build_engine_config
    from k6serve.runtime.engine import Engine
    from k6serve.runtime.worker import ModelWorker

    path = _save(tmp_path / "p3.png", _patches(COLOURS), _rgb_profile("Display P3", _P3_XY, SRGB_CURVE))
    config = build_engine_config(str(tiny_distill_dir), device="cpu")
    with DiffGenerator(Engine(config, worker=ModelWorker(config))) as generator:
        result = generator.generate({"prompt": "x", "image_path": str(path), "height": 32, "width": 32,
                                     "num_frames": 5, "save_output": False})
    assert [note for note in result.notes if "ICC colour profile" in note] == [
        "the conditioning image carries an ICC colour profile ('Display P3'), not sRGB: its colours were converted to "
        "sRGB, the video's colours, as colour-managed viewers show them (perceptual intent; colours sRGB cannot show "
        "brought inside it)"]
