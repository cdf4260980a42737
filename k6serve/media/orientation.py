"""Frames as players show them: a stream's display matrix (rotation, mirroring) applied to decoded frames, and its
pixel aspect ratio turned with them."""

from __future__ import annotations

from fractions import Fraction
from typing import TYPE_CHECKING, Any, cast

import av
import numpy as np

if TYPE_CHECKING:
    from av.sidedata.sidedata import SideDataContainer


def pixel_aspect_ratio(sample_aspect_ratio: Fraction | None, rotation: float) -> Fraction | None:
    """A stream's sample aspect ratio (pixel width over height) for its frames as `upright` turns them: inverted
    by a quarter turn; None for square pixels or none stated (FFmpeg's 0:1)."""
    if sample_aspect_ratio is None or sample_aspect_ratio <= 0 or sample_aspect_ratio == 1:
        return None
    sar = Fraction(sample_aspect_ratio)
    return 1 / sar if quarter_turns(rotation) % 2 else sar


def upright(frame_HWC: np.ndarray, rotation: float, matrix: np.ndarray | None = None) -> np.ndarray:
    """`frame_HWC` as players show it. Phones store portrait video as landscape frames with a display-matrix
    rotation (`rotation`: degrees counter-clockwise) that every player and FFmpeg apply; the upscaled MP4 carries
    no rotation, so frames left as stored would play sideways. Angles between quarter turns (rare) are rounded to
    the nearest quarter turn. A `matrix` (the frame's display matrix, `display_matrix`) that also mirrors the
    picture (a "flip" edit, a mirrored selfie camera) is applied as FFmpeg's own tools apply it (`_mirrored`)."""
    if matrix is not None and np.linalg.det(matrix.reshape(3, 3)[:2, :2].astype(np.float64)) < 0:
        return np.ascontiguousarray(_mirrored(frame_HWC, rotation, matrix))
    turns = quarter_turns(rotation)
    if turns == 0:
        return frame_HWC
    return np.ascontiguousarray(np.rot90(frame_HWC, turns))


def _mirrored(frame_HWC: np.ndarray, rotation: float, matrix: np.ndarray) -> np.ndarray:
    """`frame_HWC` under a display matrix that mirrors it, as FFmpeg's autorotate filters it (fftools,
    ffmpeg_filter.c: transpose, hflip and vflip chosen by the clockwise angle and the matrix's signs). PyAV's
    `rotation` alone reads a horizontal flip as a half turn: the picture came out upside down."""
    clockwise = -round(rotation) % 360
    if clockwise == 90:
        # transpose=cclock_flip (rows become columns) or clock.
        return np.swapaxes(frame_HWC, 0, 1) if matrix[3] > 0 else np.rot90(frame_HWC, -1)
    if clockwise == 270:
        # transpose=clock_flip (the other diagonal) or cclock.
        return np.rot90(frame_HWC, -1)[::-1] if matrix[3] < 0 else np.rot90(frame_HWC, 1)
    if clockwise == 180:
        frame_HWC = frame_HWC[:, ::-1] if matrix[0] < 0 else frame_HWC
        return frame_HWC[::-1] if matrix[4] < 0 else frame_HWC
    if clockwise == 0:
        return frame_HWC[::-1] if matrix[4] < 0 else frame_HWC
    return np.rot90(frame_HWC, quarter_turns(rotation))  # between quarter turns: rounded, as without a mirror


def display_matrix(frame: av.VideoFrame) -> np.ndarray | None:
    """The frame's display matrix (FFmpeg's 3x3 of int32, row by row), or None."""
    # PyAV 18.0's stub types side_data as a TypedDict of motion vectors (it is a mapping of every kind), 18.1's as
    # the SideDataContainer it is: through Any the cast is needed under the one and not redundant under the other.
    untyped: Any = frame.side_data
    side_data = cast("SideDataContainer", untyped).get("DISPLAYMATRIX")
    return None if side_data is None else np.frombuffer(bytes(side_data), dtype=np.int32)


def quarter_turns(rotation: float) -> int:
    """Counter-clockwise quarter turns (0-3) nearest to `rotation` degrees."""
    return round(rotation / 90) % 4
