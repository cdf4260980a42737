"""Embedded ICC colour profiles of conditioning images: converted to sRGB, the video's colours (littleCMS, through
Pillow's ImageCms). An image with no profile, or an sRGB one, is left as it is, so its pixels stay diffusers'.
"""

from __future__ import annotations

import functools
import io
import logging
from typing import TYPE_CHECKING

import numpy as np
import PIL.Image

if TYPE_CHECKING:
    from PIL.ImageCms import ImageCmsTransform

logger = logging.getLogger(__name__)

# Image modes by colour space; 16-bit, 32-bit and float grayscale are "L" by the time profiles are read.
_GRAY_MODES = frozenset({"L", "LA", "La", "1"})
_RGB_MODES = frozenset({"RGB", "RGBA", "RGBX", "RGBa", "P", "PA", "YCbCr"})
# The colour space of an ICC profile (its header's, as littleCMS names it, stripped), in words, with the image modes
# it describes and the mode littleCMS converts those in: the one convert("RGB") passes them through (alpha dropped as
# it drops it, a palette looked up). A grayscale image may carry an RGB profile (tools that make a photo gray keep
# its sRGB profile; PIL writes whatever profile it is given): its levels are R = G = B in that space, as convert("RGB")
# reads them, so an sRGB one leaves it as it is.
_PROFILE_SPACES = {
    "RGB": ("RGB", "RGB", _RGB_MODES | _GRAY_MODES),
    "GRAY": ("grayscale", "L", _GRAY_MODES),
    "CMYK": ("CMYK", "CMYK", frozenset({"CMYK"})),
}
# ICC device classes that describe an image's colours: display, input (camera, scanner), output (printer, press) and
# colour space profiles. A device link, abstract or named colour profile describes no image.
_IMAGE_PROFILE_CLASSES = frozenset({"mntr", "scnr", "prtr", "spac"})
_OTHER_PROFILE_CLASSES = {"link": "device link", "abst": "abstract", "nmcl": "named colour"}
# A profile whose colorimetric conversion to sRGB moves no channel of `_srgb_test_pixels` by more than this many
# 8-bit levels is sRGB, and its image is left as it is: the sRGB profiles of different makers (ICC v2 or v4, a
# 1024-entry or a parametric curve, colorants rounded differently) come within one level of each other.
_SRGB_TOLERANCE = 1


def to_srgb(image: PIL.Image.Image, icc_profile: object, source: str, notes: list[str] | None, *,
            log: bool = True) -> PIL.Image.Image:
    """`image` (8-bit, as `_grayscale_to_8_bit` leaves it) converted from its embedded ICC profile `icc_profile` to
    sRGB, in mode "RGB"; `image` itself, untouched, when it has no profile or an sRGB one (`_is_srgb`, which looks
    at what the profile does to colours, not at its name), so its pixels stay diffusers'. A conversion is logged
    and told in `notes`; `log=False` for a check ahead of the load that will say it (the CLI's preflight), so the
    log does not say it twice.

    A profile that cannot be used (one littleCMS cannot parse, or one for other colours than the image's, such as
    a CMYK profile left on an image converted to RGB) does not fail the request: the image is read as sRGB, as it
    was before profiles were read, with a warning, logged and in `notes`.
    """
    if not icc_profile:
        return image
    try:
        from PIL import ImageCms
    except ImportError:  # a Pillow built without littleCMS; the wheels ship it
        return _profile_not_used(image, source, notes, log, "this Pillow was built without littleCMS (PIL.ImageCms)")
    try:
        profile = ImageCms.ImageCmsProfile(io.BytesIO(icc_profile))  # type: ignore[arg-type]
        name = _profile_name(profile.profile.profile_description)
        space, device_class = profile.profile.xcolor_space.strip(), profile.profile.device_class
    except Exception as exc:  # noqa: BLE001 - littleCMS and PIL raise several types for a damaged profile
        return _profile_not_used(image, source, notes, log, "littleCMS cannot read it", exc)
    if image.mode == "LAB" and space == "Lab":
        # CIELAB pixels with a Lab profile: Pillow's convert("LAB") tags its output with its built-in Lab identity,
        # an abstract-class profile. It says what the mode says, and the caller's convert("RGB") converts CIELAB
        # (D50) to sRGB with littleCMS, as for a Lab image with no profile: the colours come out right, nothing to tell.
        return image
    if device_class not in _IMAGE_PROFILE_CLASSES:
        kind = _OTHER_PROFILE_CLASSES.get(device_class, f"{device_class!r} class")
        article = "an" if kind[0] in "aeiou" else "a"
        return _profile_not_used(image, source, notes, log,
                                 f"it is {article} {kind} profile ({name}), which describes no image")
    space_words, mode, image_modes = _PROFILE_SPACES.get(space, (f"{space!r}", None, frozenset()))
    if image.mode not in image_modes or mode is None:  # mode is None only with no image_modes: an unknown space
        image_words = ("grayscale" if image.mode in _GRAY_MODES else "RGB" if image.mode in _RGB_MODES
                       else "CMYK" if image.mode == "CMYK" else "CIELAB" if image.mode == "LAB"
                       else f"of PIL mode {image.mode}")
        return _profile_not_used(image, source, notes, log,
                                 f"it is for {space_words} colours ({name}), but the image is {image_words}")
    working = image if image.mode == mode else image.convert(mode)
    try:
        srgb = ImageCms.ImageCmsProfile(ImageCms.createProfile("sRGB"))
        if space != "CMYK" and _is_srgb(ImageCms.buildTransform(
                profile, srgb, mode, "RGB", renderingIntent=ImageCms.Intent.RELATIVE_COLORIMETRIC), mode):
            return image
        # Perceptual intent. For the matrix-and-curves profiles photos carry (Display P3, Adobe RGB, ProPhoto, gray
        # gamma profiles) littleCMS computes every intent from the same matrix and curves: perceptual and relative
        # colorimetric give the same pixels, colours outside sRGB clipped to its edge. They differ for profiles
        # built of lookup tables (CMYK press profiles, some camera and scanner ones): there the perceptual table is
        # the profile maker's own mapping of that gamut, its paper white and its ink black into a display's range,
        # the intent the ICC recommends for photographs and the one colour-managed viewers commonly use, with
        # black point compensation built in (littleCMS forces it for ICC v4 profiles). Relative colorimetric would
        # clip instead, and crush a print profile's shadows unless black point compensation were added to it.
        converted = ImageCms.buildTransform(profile, srgb, mode, "RGB",
                                            renderingIntent=ImageCms.Intent.PERCEPTUAL).apply(working)
    except Exception as exc:  # noqa: BLE001 - as above: a profile littleCMS read but cannot convert with
        return _profile_not_used(image, source, notes, log, f"littleCMS cannot convert with it ({name})", exc)
    # ImageCms tags `converted` with its sRGB profile: true, and a second load leaves it as it is.
    note = (f"the conditioning image carries an ICC colour profile ({name}), not sRGB: its colours were converted "
            "to sRGB, the video's colours, as colour-managed viewers show them (perceptual intent; colours sRGB "
            "cannot show brought inside it)")
    if log:
        logger.info("%s: %s", source, note)
    if notes is not None:
        notes.append(note)
    return converted


def _profile_not_used(image: PIL.Image.Image, source: str, notes: list[str] | None, log: bool, reason: str,
                      error: BaseException | None = None) -> PIL.Image.Image:
    """`image` unchanged, read as sRGB as it was before profiles were read, after a warning that its profile could
    not be used because of `reason` (in words; `error`, littleCMS's, goes to the log only). A Lab image is read as
    CIELAB whatever its profile (the caller's convert("RGB") converts it to sRGB), and the warning says so."""
    read_as = ("CIELAB (D50), as its PIL mode says, and converted to sRGB" if image.mode == "LAB"
               else "sRGB, which shifts them if they are not")
    note = (f"the conditioning image's ICC colour profile was not used ({reason}): its colours were read as "
            f"{read_as}; to be sure of them, save the image as sRGB (most editors convert to sRGB on export)")
    detail = "" if error is None else f" [{type(error).__name__}: {error}]"
    if log:
        logger.warning("%s: %s%s", source, note, detail)
    if notes is not None:
        notes.append(note)
    return image


def _profile_name(description: object) -> str:
    """A profile's description, as littleCMS reads it, quoted for a message (its start only, printable characters
    only: it comes from the file); "no name given" when it has none."""
    text = "".join(char for char in str(description or "") if char.isprintable()).strip()
    if not text:
        return "no name given"
    return repr(text if len(text) <= 60 else text[:57] + "...")


def _is_srgb(colorimetric: ImageCmsTransform, mode: str) -> bool:
    """Whether `colorimetric` (a relative colorimetric transform from an RGB or gray profile to sRGB, for `mode`
    "RGB" or "L") leaves `_srgb_test_pixels` where they are, within _SRGB_TOLERANCE levels: the profile is sRGB
    (for gray, sRGB's curve), whatever its name says; another profile's primaries, white point or curve move some."""
    pixels = _srgb_test_pixels(mode)
    mapped = np.asarray(colorimetric.apply(PIL.Image.fromarray(pixels)), dtype=np.int16)
    expected = pixels if mode == "RGB" else np.repeat(pixels[..., None], 3, axis=-1)
    return int(np.abs(mapped - expected).max()) <= _SRGB_TOLERANCE


@functools.cache
def _srgb_test_pixels(mode: str) -> np.ndarray:
    """One row of pixels for `_is_srgb`: for "RGB", all 256 levels of red, green, blue and gray alone (the curves,
    each primary) and an 8x8x8 grid of colours (mixtures); for "L", the 256 levels. Read-only (cached)."""
    levels = np.arange(256, dtype=np.uint8)
    if mode == "L":
        pixels = levels[None]
    else:
        ramps = [np.zeros((256, 3), dtype=np.uint8) for _ in range(3)]
        for channel, ramp in enumerate(ramps):
            ramp[:, channel] = levels
        grid = np.linspace(0, 255, 8).round().astype(np.uint8)
        mixtures = np.stack(np.meshgrid(grid, grid, grid, indexing="ij"), axis=-1).reshape(-1, 3)
        pixels = np.concatenate([*ramps, np.repeat(levels[:, None], 3, axis=1), mixtures])[None]
    pixels.setflags(write=False)
    return pixels
