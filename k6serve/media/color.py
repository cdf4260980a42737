"""Mapping an HDR or wide-gamut video source into BT.709 SDR, the colours the upscaled MP4 is tagged with.

A phone's HDR video (HLG), an HDR10 download (PQ) or a BT.2020 / Display P3 SDR file decoded as plain RGB gives code
values of another transfer curve and other primaries: written as BT.709 they play washed out, with flat contrast and
weak colours. The SR model was trained on SDR video, so each frame is brought into BT.709 SDR before it is upscaled
(the output stays SDR; the source's HDR is not kept):

1. decode to 16-bit R'G'B' with the frame's own YUV matrix and range (swscale, as every other source);
2. to linear display light: PQ's EOTF (SMPTE ST 2084) in cd/m^2; HLG's inverse OETF and the OOTF of its nominal
   1000 cd/m^2 display (system gamma 1.2, ITU-R BT.2100); an SDR curve as BT.1886's 2.4 power, the display model
   FFmpeg's colour management and players use for BT.709;
3. to BT.709 primaries (3x3 in linear light, both D65); a colour outside BT.709 is desaturated toward its own
   luminance until no channel is negative (clipping channels would shift the hue), and an SDR one still brighter
   than BT.709's white allows is scaled down whole;
4. HDR only: scaled so HDR reference white (203 cd/m^2, ITU-R BT.2408) would be SDR white, with ITU-R BT.2390's
   EETF rolling everything between about 90 cd/m^2 and the source's peak (the file's MaxCLL, else its mastering
   display's peak, else 1000 cd/m^2) off into the rest of SDR's range (reference white itself ends near 90% of
   SDR white for a 1000 cd/m^2 peak, about 82% for 4000): on the largest channel, the others scaled with it, which
   keeps hue and saturation;
5. BT.1886's inverse (the 1/2.4 power) to 8 bits.

The curves run as tables: each 16-bit code's linear light, and the roll-off's ratio at 4,096 points interpolated
(a fiftieth of a code level from the formula): 0.2-0.3 s a 1080p frame on one core.

Below the knee (about 90 cd/m^2) and inside BT.709 this is exactly FFmpeg's colour management at its
relative-colorimetric intent (`scale=out_transfer=bt709:out_primaries=bt709`); FFmpeg clips the highlights there,
and its perceptual intent maps the whole range into SDR (10,000 cd/m^2 when a file states no peak), which darkens
everything: reference white came out at 61% (tests/unit/test_color.py checks both). A BT.709 (or BT.601, or
untagged) SDR source is not touched: its frames are bit for bit what they were before this module existed.
"""

from __future__ import annotations

import functools
import struct
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import av
import numpy as np
import torch

if TYPE_CHECKING:
    from av.sidedata.sidedata import SideDataContainer

# FFmpeg's AVCOL_TRC_* and AVCOL_PRI_* codes.
TRC_PQ = 16
TRC_HLG = 18
HDR_TRANSFERS = {TRC_PQ: "PQ, SMPTE ST 2084", TRC_HLG: "HLG, ARIB STD-B67"}
PRIMARIES_BT709 = 1
PRIMARIES_BT2020 = 9
PRIMARIES_P3_D65 = 12
# Chromaticities (x, y) of red, green and blue; all three use D65 white.
_PRIMARIES_XY = {
    PRIMARIES_BT709: ((0.640, 0.330), (0.300, 0.600), (0.150, 0.060)),
    PRIMARIES_BT2020: ((0.708, 0.292), (0.170, 0.797), (0.131, 0.046)),
    PRIMARIES_P3_D65: ((0.680, 0.320), (0.265, 0.690), (0.150, 0.060)),
}
WIDE_GAMUTS = {PRIMARIES_BT2020: "BT.2020", PRIMARIES_P3_D65: "Display P3"}
_BT709_CLASS_PRIMARIES = (PRIMARIES_BT709, 5, 6)  # BT.709, BT.470BG (PAL), SMPTE 170M (NTSC)
_D65_XY = (0.3127, 0.3290)

# ITU-R BT.2408: HDR reference (diffuse) white, which SDR white stands for.
REFERENCE_WHITE_NITS = 203.0
# BT.2100's nominal HLG display peak (its OOTF's L_W); also the PQ peak assumed when a file states none, the most
# common HDR10 mastering peak.
DEFAULT_PEAK_NITS = 1000.0
_HLG_SYSTEM_GAMMA = 1.2  # BT.2100 at L_W = 1000 cd/m^2
_SDR_GAMMA = 2.4  # BT.1886

# SMPTE ST 2084 constants.
_PQ_M1 = 2610 / 16384
_PQ_M2 = 2523 / 4096 * 128
_PQ_C1 = 3424 / 4096
_PQ_C2 = 2413 / 4096 * 32
_PQ_C3 = 2392 / 4096 * 32
_PQ_PEAK_NITS = 10000.0
# ARIB STD-B67 (HLG) constants.
_HLG_A = 0.17883277
_HLG_B = 1 - 4 * _HLG_A
_HLG_C = 0.5 - _HLG_A * np.log(4 * _HLG_A)


def pq_to_nits(signal: torch.Tensor) -> torch.Tensor:
    """SMPTE ST 2084's EOTF: PQ signal in [0, 1] to cd/m^2."""
    power = signal.clamp(0, 1) ** (1 / _PQ_M2)
    return _PQ_PEAK_NITS * ((power - _PQ_C1).clamp(min=0) / (_PQ_C2 - _PQ_C3 * power)) ** (1 / _PQ_M1)


def nits_to_pq(nits: torch.Tensor) -> torch.Tensor:
    """SMPTE ST 2084's inverse EOTF: cd/m^2 to PQ signal in [0, 1]."""
    power = (nits / _PQ_PEAK_NITS).clamp(0, 1) ** _PQ_M1
    return ((_PQ_C1 + _PQ_C2 * power) / (1 + _PQ_C3 * power)) ** _PQ_M2


def hlg_to_scene_light(signal: torch.Tensor) -> torch.Tensor:
    """ARIB STD-B67's inverse OETF: HLG signal in [0, 1] to scene linear light in [0, 1]."""
    signal = signal.clamp(0, 1)
    return torch.where(signal <= 0.5, signal**2 / 3, (torch.exp((signal - _HLG_C) / _HLG_A) + _HLG_B) / 12)


@functools.cache
def primaries_matrix(source: int, target: int = PRIMARIES_BT709) -> torch.Tensor:
    """3x3 from linear RGB of `source` primaries to linear RGB of `target` primaries (same white). Cached: asked for
    every frame; callers only read it."""
    return torch.from_numpy(np.linalg.solve(_rgb_to_xyz(target), _rgb_to_xyz(source))).float()


def _rgb_to_xyz(primaries: int) -> np.ndarray:
    xy = np.array(_PRIMARIES_XY[primaries], dtype=np.float64)
    columns = np.stack([xy[:, 0] / xy[:, 1], np.ones(3), (1 - xy[:, 0] - xy[:, 1]) / xy[:, 1]])
    white = np.array([_D65_XY[0] / _D65_XY[1], 1.0, (1 - _D65_XY[0] - _D65_XY[1]) / _D65_XY[1]])
    return columns * np.linalg.solve(columns, white)


@functools.cache
def luminance_weights(primaries: int) -> torch.Tensor:
    """Y of linear RGB in these primaries (the XYZ matrix's middle row: 0.2126, 0.7152, 0.0722 for BT.709)."""
    return torch.from_numpy(_rgb_to_xyz(primaries)[1]).float()


def bt2390_eetf(nits: torch.Tensor, source_peak: float, target_peak: float) -> torch.Tensor:
    """ITU-R BT.2390's EETF (black level 0): identity below the knee (about 90 cd/m^2 for 1000 into 203), a Hermite
    roll-off from there that takes `source_peak` to `target_peak`, in PQ space; above the source's peak, the
    target's."""
    if source_peak <= target_peak:
        return nits.clamp(max=target_peak)
    source_pq = float(nits_to_pq(torch.tensor(source_peak, dtype=torch.float64)))
    max_lum = float(nits_to_pq(torch.tensor(target_peak, dtype=torch.float64))) / source_pq
    knee = 1.5 * max_lum - 0.5
    signal = (nits_to_pq(nits) / source_pq).clamp(max=1)
    t = ((signal - knee) / (1 - knee)).clamp(min=0)
    t2, t3 = t * t, t * t * t
    rolled = (2 * t3 - 3 * t2 + 1) * knee + (t3 - 2 * t2 + t) * (1 - knee) + (-2 * t3 + 3 * t2) * max_lum
    return pq_to_nits(torch.where(signal < knee, signal, rolled) * source_pq)


@dataclass(frozen=True)
class SdrMapping:
    """How one source's frames are brought into BT.709 SDR (`sdr_mapping`)."""

    transfer: int | None  # TRC_PQ or TRC_HLG; None for an SDR curve
    primaries: int  # a key of _PRIMARIES_XY
    peak_nits: float  # the highlights' top, for the roll-off (HDR only)
    peak_source: str  # where peak_nits comes from, for the note

    def note(self) -> str:
        gamut = WIDE_GAMUTS.get(self.primaries)
        if self.transfer is None:
            return (f"the source's colours are {gamut} (wide gamut): they were mapped into BT.709, the output's "
                    "(colours outside it desaturated to fit), before upscaling")
        colours = f", {gamut} colours" if gamut else ""
        return (f"the source is HDR ({HDR_TRANSFERS[self.transfer]} transfer{colours}): its frames were "
                f"tone-mapped to SDR BT.709 before upscaling (scaled so HDR reference white, "
                f"{REFERENCE_WHITE_NITS:g} cd/m^2, would be SDR white, and everything from about 90 cd/m^2 up to "
                f"{self.peak_nits:g} cd/m^2 ({self.peak_source}) rolled off into SDR's range by ITU-R BT.2390's "
                "curve), so the output is SDR")

    def to_sdr(self, rgb_HWC: np.ndarray) -> np.ndarray:
        """16-bit R'G'B' (H, W, 3) of the source's curve and primaries to 8-bit BT.709 SDR R'G'B'."""
        light = torch.from_numpy(np.take(self._linear_table, rgb_HWC))
        if self.transfer == TRC_HLG:
            # BT.2100's OOTF: display light = L_W * Y_s^(gamma - 1) * E_s (here in units of reference white).
            scene_luminance = (light @ luminance_weights(self.primaries)).unsqueeze_(-1)
            light *= scene_luminance.clamp_(min=1e-12).pow_(_HLG_SYSTEM_GAMMA - 1).mul_(
                DEFAULT_PEAK_NITS / REFERENCE_WHITE_NITS)
        if self.primaries != PRIMARIES_BT709:
            light = _into_gamut(light @ primaries_matrix(self.primaries).T)
        if self.transfer is not None:
            light = _roll_off(light, self._roll_off_table)
        else:
            # A colour brighter than BT.709 holds (a saturated BT.2020 red: 1.66 of BT.709's red) is scaled down
            # whole, keeping its hue and saturation, rather than clipped or desaturated to white.
            light /= light.amax(dim=-1, keepdim=True).clamp_(min=1)
        return light.clamp_(0, 1).pow_(1 / _SDR_GAMMA).mul_(255).round_().to(torch.uint8).numpy()

    @functools.cached_property
    def _roll_off_table(self) -> torch.Tensor:
        return _roll_off_ratios(self.peak_nits / REFERENCE_WHITE_NITS)

    @functools.cached_property
    def _linear_table(self) -> np.ndarray:
        """Linear light of each 16-bit code, float32: PQ's in units of reference white, HLG's scene light (its OOTF
        needs the pixel's luminance), an SDR curve's relative to its white. A table, not three powers a pixel."""
        signal = torch.arange(65536, dtype=torch.float64) / 65535
        if self.transfer == TRC_PQ:
            light = pq_to_nits(signal) / REFERENCE_WHITE_NITS
        elif self.transfer == TRC_HLG:
            light = hlg_to_scene_light(signal)
        else:
            light = signal**_SDR_GAMMA
        return light.float().numpy()


def _into_gamut(light: torch.Tensor) -> torch.Tensor:
    """Desaturate BT.709 linear RGB with a negative channel toward its luminance until that channel is 0."""
    lowest = light.amin(dim=-1)
    outside = lowest < 0
    if not outside.any():
        return light
    colours = light[outside]
    luminance = (colours @ luminance_weights(PRIMARIES_BT709)).clamp_(min=0).unsqueeze_(-1)
    keep = luminance / (luminance - lowest[outside].unsqueeze(-1)).clamp_(min=1e-12)
    light[outside] = luminance + keep * (colours - luminance)
    return light


def _roll_off(light: torch.Tensor, ratios: torch.Tensor) -> torch.Tensor:
    """BT.2390's EETF on the largest channel (1 = reference white = SDR white), the others scaled by the same
    ratio, read from `ratios` (`_roll_off_ratios`) by linear interpolation."""
    root = light.amax(dim=-1).clamp_(0, _LIGHT_TOP).sqrt_().sqrt_()
    position = root.mul_((len(ratios) - 1) / _LIGHT_TOP**0.25)
    index = position.long().clamp_(max=len(ratios) - 2)
    fraction = position.sub_(index)
    below = ratios[index]
    return light.mul_(torch.lerp(below, ratios[index + 1], fraction).unsqueeze_(-1))


# The brightest PQ light, in units of reference white; the roll-off table spans [0, _LIGHT_TOP] evenly in the
# fourth root of light, fine near black and coarse where the curve is flat.
_LIGHT_TOP = _PQ_PEAK_NITS / REFERENCE_WHITE_NITS
_ROLL_OFF_POINTS = 4096


def _roll_off_ratios(peak: float) -> torch.Tensor:
    """EETF(v) / v at v = (i / (n - 1))^4 * _LIGHT_TOP (1 at v = 0), for a source peak `peak` (reference white
    units): a table, since four powers a pixel cost seconds a 4K frame on one core (within 0.02 of a code level of
    the formula, tests/unit/test_color.py)."""
    light = (torch.linspace(0, 1, _ROLL_OFF_POINTS, dtype=torch.float64) ** 4) * _LIGHT_TOP
    mapped = bt2390_eetf(light * REFERENCE_WHITE_NITS, peak * REFERENCE_WHITE_NITS,
                         REFERENCE_WHITE_NITS) / REFERENCE_WHITE_NITS
    ratios = torch.where(light > 0, mapped / light.clamp(min=1e-300), torch.ones_like(light))
    return ratios.float()


def sdr_mapping(frame: av.VideoFrame) -> SdrMapping | None:
    """How to bring `frame`'s source into BT.709 SDR, from its tags; None when it is SDR already in BT.709-class
    primaries (BT.709, BT.601's, or untagged), whose frames are decoded as they are."""
    transfer = frame.color_trc if frame.color_trc in HDR_TRANSFERS else None
    primaries = frame.color_primaries
    if primaries not in WIDE_GAMUTS:
        if transfer is None:
            return None
        # An HDR curve on BT.709's primaries (or BT.601's, as near) is a camera mode (HLG on BT.709): kept as BT.709,
        # no matrix; untagged or odd ones are BT.2020, which HDR is in practice.
        primaries = PRIMARIES_BT709 if primaries in _BT709_CLASS_PRIMARIES else PRIMARIES_BT2020
    peak, peak_source = DEFAULT_PEAK_NITS, "assumed: the file states no peak"
    if transfer == TRC_HLG:
        peak_source = "HLG's nominal display peak"
    elif transfer == TRC_PQ:
        peak, peak_source = _stated_peak(frame) or (peak, peak_source)
    return SdrMapping(transfer=transfer, primaries=primaries, peak_nits=peak, peak_source=peak_source)


def _stated_peak(frame: av.VideoFrame) -> tuple[float, str] | None:
    """The brightest cd/m^2 an HDR10 frame's side data states: MaxCLL (the content's), else the mastering
    display's peak; None when it states neither (or nothing above reference white)."""
    found = {}
    # PyAV 18.0's stub types side_data as a TypedDict of motion vectors (it is a mapping of every kind), 18.1's as
    # the SideDataContainer it is: through Any the cast is needed under the one and not redundant under the other.
    untyped: Any = frame.side_data
    side_data = cast("SideDataContainer", untyped)
    for index in range(len(side_data)):
        found[side_data[index].type.name] = bytes(side_data[index])
    content = found.get("CONTENT_LIGHT_LEVEL")
    if content is not None and len(content) >= 4:
        max_cll = struct.unpack_from("<I", content)[0]
        if max_cll > REFERENCE_WHITE_NITS:
            return float(min(max_cll, _PQ_PEAK_NITS)), "the file's MaxCLL"
    mastering = found.get("MASTERING_DISPLAY_METADATA")
    # AVMasteringDisplayMetadata: 8 rationals of primaries and white point, min and max luminance (rationals),
    # has_primaries, has_luminance.
    if mastering is not None and len(mastering) >= 88:
        numerator, denominator = struct.unpack_from("<ii", mastering, 72)
        has_luminance = struct.unpack_from("<i", mastering, 84)[0]
        if has_luminance and denominator > 0 and numerator / denominator > REFERENCE_WHITE_NITS:
            return float(min(numerator / denominator, _PQ_PEAK_NITS)), "the file's mastering display peak"
    return None


class SdrFrames:
    """One source's frames as 8-bit BT.709 SDR RGB. The mapping is read from the first frame converted and held
    for the rest: a clip is tone-mapped with one curve, not one per frame."""

    def __init__(self) -> None:
        self.mapping: SdrMapping | None = None
        self._decided = False

    def rgb(self, frame: av.VideoFrame) -> np.ndarray:
        """`frame` as (H, W, 3) uint8 RGB; a BT.709-class SDR frame exactly as `to_ndarray(format="rgb24")`."""
        if not self._decided:
            self.mapping, self._decided = sdr_mapping(frame), True
        if self.mapping is None:
            return frame.to_ndarray(format="rgb24")
        return self.mapping.to_sdr(frame.to_ndarray(format="rgb48le"))
