"""Reading the source soundtrack of an SR request (k6-super-resolution.md §2.13).

The soundtrack is kept, converted to mono 44.1 kHz float32 and trimmed to the processed video
duration, round(num_frames / fps * 44100) samples. As in the reference it is only trimmed, never
padded at the end: a soundtrack shorter than the processed video stays shorter, and the output file
then has audio that ends before the video does.

Two recorded departures from the reference (SG `extract_source_audio`), each only where its output is damaged:
- Sync: the reference starts the output's audio at the soundtrack's first sample, wherever that lies against the
  video. A soundtrack that starts after the first frame (0.23 s later in a camera file or a stream-copy cut) then
  played that much early, one that starts before it that much late. Here the audio is aligned to the first video
  frame's time: silence before a late start, the samples before the first frame dropped. Files whose tracks start
  together (nearly all, FFmpeg's decoders already dropping the AAC encoder's priming) give the same samples.
- Level: FFmpeg's downmix to mono adds correlated channels at 0.707 each (+3 dB for a centred stereo mix, more for
  5.1), and the reference clips the sum to [-1, 1]: a master louder than -3 dBFS came out hard-clipped (4%
  distortion at -2 dBFS). A soundtrack whose mono mix would clip is scaled down as a whole to a peak of 1 instead;
  one that does not is unchanged.

And where the reference fails or joins what it should not: each decoded frame is placed by its timestamp (a gap of up
to GAP_LIMIT_S filled with silence, an overlap of up to OVERLAP_LIMIT_S dropped; larger jumps are discontinuities,
joined end to end), and a change of channel layout or sample rate part-way gets a new resampler (the reference's one
resampler raises "Frame does not match AudioResampler setup").
"""

from __future__ import annotations

import logging
import os

import av
import av.audio.stream
import av.container
import numpy as np

from k6serve.media.container import open_input

logger = logging.getLogger(__name__)

OUTPUT_SAMPLE_RATE = 44100
# How far a decoded frame's time may be from where the frame before it ends before a gap is filled or an overlap
# dropped: above a VBR packet's timing error where the times come from byte counts (an AVI's MP3, up to ~40 ms a
# packet) and Matroska's millisecond rounding; a dropout shorter than this is joined end to end, as before.
TIMESTAMP_SLACK_S = 0.06
# A jump forward in the timestamps longer than this is a discontinuity, not a dropout; one back longer than this,
# not an overlap (an edit's or a splice's repeat is a few packets).
GAP_LIMIT_S = 2.0
OVERLAP_LIMIT_S = 0.5


def processed_num_samples(
    num_frames: int, fps: float, sample_rate: int = OUTPUT_SAMPLE_RATE
) -> int:
    """Audio samples covering `num_frames` video frames at `fps` (Python round, half-to-even)."""
    if num_frames < 1 or not fps > 0:
        raise ValueError(f"need num_frames >= 1 and fps > 0, got {num_frames} frames at {fps} fps")
    return round(num_frames / fps * sample_rate)


def read_source_audio(
    path: str | os.PathLike[str],
    *,
    sample_rate: int = OUTPUT_SAMPLE_RATE,
    num_samples: int | None,
    video_start: float | None = None,
    notes: list[str] | None = None,
) -> np.ndarray | None:
    """The soundtrack (`soundtrack_stream`) as mono float32 in [-1, 1] at `sample_rate`, cut to `num_samples`.

    Returns None when the file has no audio stream, or one that decodes to no samples (the output
    is then video-only). `num_samples=None` keeps the whole soundtrack. `video_start` (seconds, the
    first kept video frame's time) aligns the soundtrack to it (module docstring); None takes its
    first sample as the start. A mix that would clip is scaled to a peak of 1 (module docstring).
    A soundtrack damaged or cut short part-way is kept up to the damage. What the user should know (another
    audio stream dropped, the damage) is appended to `notes`, one sentence each, and logged.
    """
    if num_samples is not None and num_samples < 1:
        raise ValueError(f"num_samples must be >= 1 or None, got {num_samples}")
    notes = [] if notes is None else notes
    with open_input(path) as container:
        if not container.streams.audio:
            return None
        stream = soundtrack_stream(container, path, notes)
        resampler = None
        source_format = None  # (sample format, layout, rate) the resampler was made for
        chunks: list[np.ndarray] = []
        num_decoded = num_kept = 0
        lead = None  # samples to add (> 0) or drop (< 0) at the start, from the first frame's time
        skip = 0  # of the samples still to come, how many to drop: never held, however early the soundtrack starts
        # where the next frame starts if the sound goes on without a jump (seconds); set before `stand_in`, which
        # updates it
        expected_time: float | None = None

        def keep(samples: np.ndarray) -> None:
            nonlocal num_decoded, num_kept, skip
            num_decoded += samples.shape[0]
            dropped = min(skip, samples.shape[0])
            skip -= dropped
            if dropped < samples.shape[0]:
                chunks.append(samples[dropped:])
                num_kept += samples.shape[0] - dropped

        # Packet by packet, as FFmpeg's own tools decode: a packet that does not decode (a damaged block, the last
        # one of a cut download) is replaced by its length of silence, so what follows stays in sync, instead of
        # failing the whole request; only a soundtrack of which nothing decodes is refused.
        damaged: list[tuple[float, str]] = []  # (where, FFmpeg's error) of each damaged packet
        silence = 0  # samples of silence standing in for those after the first decoded frame
        lost = 0.0  # seconds of the soundtrack lost in them, of which `silence` was put in
        skipped_at_start = 0  # damaged packets before the first decoded frame, whose time aligns the soundtrack
        ended_in_damage = False  # the container itself stops at damage (a cut file)

        def stand_in(packet: av.Packet, error: BaseException) -> None:
            nonlocal silence, lost, skipped_at_start, expected_time
            damaged.append((num_decoded / sample_rate, str(error)))
            if lead is None:
                skipped_at_start += 1
                return
            # The codec's samples per packet (AAC: 1,024) where it has a fixed count: Matroska's millisecond
            # packet durations would put 1 ms less per AAC packet, the rest out of sync by that much.
            frame_size, rate = stream.codec_context.frame_size, stream.codec_context.sample_rate
            if frame_size and rate:
                lost += frame_size / rate
            elif packet.duration is not None and packet.time_base is not None:
                lost += float(packet.duration * packet.time_base)
            gap = round(lost * sample_rate) - silence
            silence += gap
            keep(np.zeros(gap, dtype=np.float32))
            if expected_time is not None:  # the packet's time is filled: not a gap again at the next frame
                expected_time += gap / sample_rate

        def decoded_frames():
            packets = container.demux(stream)
            while True:
                try:
                    packet = next(packets)
                except StopIteration:
                    return
                except av.error.FFmpegError as exc:  # the container itself ends in damage: stop there
                    nonlocal ended_in_damage
                    ended_in_damage = True
                    damaged.append((num_decoded / sample_rate, str(exc)))
                    return
                try:
                    frames = packet.decode()
                except av.error.FFmpegError as exc:
                    stand_in(packet, exc)
                    continue
                yield from frames

        gaps: list[tuple[float, int]] = []  # (where, samples of silence put in) for each jump in the timestamps
        overlaps: list[tuple[float, int]] = []  # (where, samples dropped) for each step back in them

        for frame in decoded_frames():
            if lead is None:
                lead = _lead_samples(frame.time, video_start, sample_rate)
                if num_samples is not None and lead >= num_samples:
                    _tell(path, notes, f"the soundtrack starts {lead / sample_rate:.2f} s after the first video frame, "
                          "after the processed video ends: the output has no audio")
                    return None
                if lead:
                    logger.info("%s: the soundtrack starts %.3f s %s the first video frame; %s to keep them in "
                                "sync", path, abs(lead) / sample_rate, "after" if lead > 0 else "before",
                                "silence put before it" if lead > 0 else "what comes before the frame dropped")
                skip = max(-lead, 0)
            elif expected_time is not None and frame.time is not None:
                # Samples were joined end to end: a stretch of the stream with no audio packets (a capture's
                # dropout, an edit) moved every later sound earlier by its length, out of sync with the picture.
                # A jump between one frame's end and the next one's time is made good (silence in a gap, the
                # repeated part of an overlap dropped); the timestamps' slow wander is not followed (an AVI's VBR
                # MP3 timed by its bytes wanders by a few hundred ms and back, though its sound is continuous),
                # nor a jump under TIMESTAMP_SLACK_S (a VBR packet's timing error, Matroska's rounding).
                jump = round((frame.time - expected_time) * sample_rate)
                if jump > GAP_LIMIT_S * sample_rate or -jump > OVERLAP_LIMIT_S * sample_rate:
                    # A discontinuity (`cat a.ts b.ts`, whose second part's timestamps start again; a broadcast
                    # recording's clock jump): no overlap, and hardly a dropout, is that long, and dropping or
                    # silencing that much would lose the rest of the sound, while the picture, read frame by
                    # frame, goes straight on. Joined end to end, as before.
                    logger.info("%s: the soundtrack's timestamps jump by %+.2f s at %.2f s; its sound is joined "
                                "across the jump", path, jump / sample_rate, num_decoded / sample_rate)
                elif jump > TIMESTAMP_SLACK_S * sample_rate:
                    gaps.append((num_decoded / sample_rate, jump))  # where in the soundtrack
                    keep(np.zeros(jump, dtype=np.float32))
                elif -jump > TIMESTAMP_SLACK_S * sample_rate:
                    overlaps.append((num_decoded / sample_rate, -jump))
                    num_decoded += jump  # back to this frame's place: its first -jump samples are dropped
                    skip += -jump
            if frame.time is not None:
                expected_time = frame.time + frame.samples / frame.sample_rate
            elif expected_time is not None:
                expected_time += frame.samples / frame.sample_rate
            layout = (frame.format.name, frame.layout.name, frame.sample_rate)
            if layout != source_format:
                # A broadcast recording switches stereo <-> 5.1 (or its rate) between programmes; PyAV's resampler
                # takes one input format only ("Frame does not match AudioResampler setup"): the old one is
                # flushed and a new one made.
                if resampler is not None:
                    for resampled in resampler.resample(None):
                        keep(resampled.to_ndarray()[0])
                resampler = av.AudioResampler(format="fltp", layout="mono", rate=sample_rate)
                source_format = layout
            assert resampler is not None  # made at the first frame, whose layout is never source_format's None
            for resampled in resampler.resample(frame):
                keep(resampled.to_ndarray()[0])
            if num_samples is not None and max(lead, 0) + num_kept >= num_samples:
                break
        else:
            for resampled in resampler.resample(None) if resampler is not None else ():
                keep(resampled.to_ndarray()[0])
        if gaps or overlaps:
            _tell(path, notes, _timestamps_note(gaps, overlaps, sample_rate))
        if damaged and num_decoded == silence:
            raise ValueError(
                f"cannot decode the audio of {str(path)!r} ({damaged[0][1]}): its soundtrack is damaged. To upscale "
                "the picture alone, copy the file without its audio (FFmpeg: ffmpeg -i IN -c copy -an OUT) and pass "
                "that; or repair the soundtrack (re-encode it: ffmpeg -i IN -c:v copy -c:a aac OUT)."
            )
        if damaged:
            _tell(path, notes, _damage_note(damaged, silence / sample_rate, skipped_at_start=skipped_at_start > 0,
                                            ended_in_damage=ended_in_damage))
    if num_kept == 0:
        _tell(path, notes, "the soundtrack ends before the first video frame: the output has no audio" if num_decoded
              else "the audio stream has no samples: the output has no audio")
        return None
    return _joined_waveform(chunks, lead, num_samples, path)


def _tell(path: str | os.PathLike[str], notes: list[str], note: str) -> None:
    """A note the user should read: logged, and added to the request's `notes`."""
    logger.warning("%s: %s", path, note)
    notes.append(note)


def _timestamps_note(gaps: list[tuple[float, int]], overlaps: list[tuple[float, int]], sample_rate: int) -> str:
    """The note of the gaps filled and overlaps dropped, each (where in seconds, samples)."""
    told = [f"{len(gaps)} gap(s) in its timestamps (the first at {gaps[0][0]:.2f} s) filled with "
            f"{sum(size for _, size in gaps) / sample_rate:.3f} s of silence" if gaps else "",
            f"{len(overlaps)} overlap(s) (the first at {overlaps[0][0]:.2f} s) whose "
            f"{sum(size for _, size in overlaps) / sample_rate:.3f} s of repeated sound were dropped"
            if overlaps else ""]
    return (f"the soundtrack has {' and '.join(part for part in told if part)}, so that the sound after them stays "
            "in sync with the picture")


def _damage_note(damaged: list[tuple[float, str]], silence_s: float, *, skipped_at_start: bool,
                 ended_in_damage: bool) -> str:
    """The note of the packets that did not decode, each (where in seconds, FFmpeg's error), and what became of
    them: `silence_s` of silence in their place, a start at the first part that decodes, an end at the damage."""
    where, error = damaged[0]
    effects = [
        *([f"{silence_s:.3f} s of silence stand in for them, keeping the rest in sync"] if silence_s else []),
        *(["the sound starts at its first part that decodes, at that part's time"] if skipped_at_start else []),
        *(["the sound ends there"] if ended_in_damage else []),
    ]
    return (f"{len(damaged)} part(s) of the soundtrack do not decode, the first at {where:.2f} s ({error}): the file "
            f"may be damaged or cut short (a partial download?); {', and '.join(effects)}; copy or download the file "
            "again, or repair its soundtrack (FFmpeg: ffmpeg -i IN -c:v copy -c:a aac OUT)")


def _joined_waveform(chunks: list[np.ndarray], lead: int | None, num_samples: int | None,
                     path: str | os.PathLike[str]) -> np.ndarray:
    """The kept samples as one waveform: `lead` samples of silence before a late start, cut to `num_samples`,
    scaled to a peak of 1 where the mono mix would clip (module docstring)."""
    waveform = np.concatenate(chunks).astype(np.float32, copy=False)
    if lead and lead > 0:
        waveform = np.concatenate([np.zeros(lead, dtype=np.float32), waveform])
    if num_samples is not None:
        if waveform.shape[0] < num_samples:
            logger.info(
                "%s: soundtrack has %d samples, shorter than the %d of the processed video; "
                "kept as is (audio is trimmed, never padded)",
                path,
                waveform.shape[0],
                num_samples,
            )
        waveform = waveform[:num_samples]
    peak = float(np.max(np.abs(waveform)))
    if peak > 1.0:
        # Scaled rather than clipped (module docstring): the mono mix of a loud stereo or 5.1 master exceeds 1.
        logger.info("%s: the mono mix of the soundtrack peaks at %.3f (+%.1f dB); scaled to a peak of 1 instead of "
                    "clipped", path, peak, 20 * np.log10(peak))
        waveform = waveform / np.float32(peak)
    return waveform


def soundtrack_stream(container: av.container.InputContainer, path: str | os.PathLike[str],
                      notes: list[str]) -> av.audio.stream.AudioStream:
    """The audio stream kept: the first one, as the reference keeps, unless another is flagged default and it is
    not (a film's main track after its commentary); with several, a note says which and how to keep another."""
    streams = list(container.streams.audio)
    default = [stream for stream in streams if stream.disposition & av.stream.Disposition.default]
    chosen = streams[0] if not default or streams[0] in default else default[0]
    if len(streams) > 1:
        position = streams.index(chosen)
        title = chosen.metadata.get("title") or chosen.metadata.get("language")
        kept = (f"the source has {len(streams)} audio streams; the output keeps audio stream {position} "
                f"({'flagged default' if chosen in default and position else 'the first'}"
                f"{f', {title!r}' if title else ''}) and drops the others; to keep another, make a copy with it "
                "first (FFmpeg: ffmpeg -i IN -map 0:v:0 -map 0:a:N -c copy OUT, N counting from 0)")
        logger.info("%s: %s", path, kept)
        notes.append(kept)
    return chosen


def _lead_samples(audio_start: float | None, video_start: float | None, sample_rate: int) -> int:
    """Samples of silence to put before the soundtrack (> 0), or of it to drop (< 0), so that it starts with the
    first video frame; 0 when either start is unknown."""
    if audio_start is None or video_start is None:
        return 0
    return round((audio_start - video_start) * sample_rate)
