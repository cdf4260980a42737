"""Interlaced sources made progressive before they are upscaled (FFmpeg's bwdif through PyAV's filter graph)."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import cast

import av
import av.filter
import av.video.stream


class Deinterlacer:
    """An interlaced source's frames made progressive before they are upscaled: DVDs (480i, 576i), broadcast and
    camcorder 1080i store two fields of different instants in each frame, which decoded as they are show combing
    on everything that moves, and the upscale sharpens the comb. FFmpeg's bwdif (Bob Weaver, motion adaptive) makes
    one progressive frame of each (send_frame: the frame rate, and so the 24 fps rule, stay the source's), the
    field order taken from the frames. Decided on the first frame; a progressive source passes untouched."""

    def __init__(self) -> None:
        self.field_order: str | None = None  # set when the source is deinterlaced: "top field first", ...

    def frames(self, decoded: Iterator[av.VideoFrame],
               stream: av.video.stream.VideoStream) -> Iterator[av.VideoFrame]:
        decoded = iter(decoded)
        first = next(decoded, None)
        if first is None:
            return
        if not first.interlaced_frame:
            yield first
            yield from decoded
            return
        self.field_order = _FIELD_ORDERS.get(stream.codec_context.field_order, "field order not stated")
        graph = av.filter.Graph()
        source = graph.add_buffer(template=stream)
        # deint=interlaced: a frame flagged progressive in a mixed clip (a film cadence, an edit) passes untouched.
        bwdif = graph.add("bwdif", "mode=send_frame:parity=auto:deint=interlaced")
        sink = graph.add("buffersink")
        source.link_to(bwdif)
        bwdif.link_to(sink)
        graph.configure()
        # bwdif holds each frame until the next arrives (it needs both neighbours): output k follows input k + 1,
        # and the end of the input releases the last.
        for frame in itertools.chain([first], decoded):
            graph.push(frame)
            yield from _pulled(graph)
        graph.push(None)
        yield from _pulled(graph)


# AVFieldOrder by the field shown first: TT (2) and BT (5, bottom coded first, top shown first) show the top field
# first, BB (3) and TB (4) the bottom one (1 is progressive; 0 unknown).
_FIELD_ORDERS = {2: "top field first", 5: "top field first", 3: "bottom field first", 4: "bottom field first"}


def _pulled(graph: av.filter.Graph) -> Iterator[av.VideoFrame]:
    """The frames `graph` has ready."""
    while True:
        try:
            yield cast(av.VideoFrame, graph.pull())  # a video graph: PyAV types its output as any frame
        except (BlockingIOError, av.error.EOFError):
            return
