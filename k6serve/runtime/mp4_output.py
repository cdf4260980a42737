"""Where a worker's MP4 goes, and the pipeline run that writes it while the VAE decodes."""

from __future__ import annotations

from pathlib import Path

from k6serve.media.output_names import default_file_name, sanitize_file_name
from k6serve.request import GenerateRequest, OutputOptions, ProgressCallback, UpscaleRequest


def output_file(request: GenerateRequest | UpscaleRequest, output: OutputOptions) -> tuple[Path, bool]:
    """The MP4's path, and whether it is a derived name (True) or one the caller chose (False). Either moves on
    to _1, _2... when it is taken by the time the video is written; for a chosen one a note says so."""
    folder = Path(output.output_path)
    folder.mkdir(parents=True, exist_ok=True)
    if output.output_file_name:
        return folder / sanitize_file_name(output.output_file_name), False
    return folder / default_file_name(request), True


def generate_into_mp4(pipeline, request: GenerateRequest | UpscaleRequest, target: Path,
                      on_step: ProgressCallback | None, *, number_if_taken: bool = False):
    """Run the pipeline with the MP4 writer as its video sink: x264 encodes on the CPU while the GPU decodes.
    Returns the pipeline's result and the path written (`target`, or its first free numbered name).

    Timings: "decode_video" (SR: "decode", with the blend) is the decode's wall time (the encoder runs beside
    it), "mux" the time the MP4 write added after the decode finished (the encoder's backlog and flush, fsync
    and link into place).
    """
    from k6serve.media.mux import write_mp4_stream

    written: list[Path] = []

    def save(frame_chunks, audio, fps, sample_aspect_ratio=None) -> None:
        waveform = audio.waveform if audio is not None else None
        sample_rate = audio.sample_rate if audio is not None else 44100
        try:
            # A chosen name is numbered too when it was taken while the request ran (the caller's check found
            # it free): the finished video is kept under the next free name, and a note says so (run).
            written.append(write_mp4_stream(target, frame_chunks, fps, waveform, sample_rate,
                                            number_if_taken=True, sample_aspect_ratio=sample_aspect_ratio))
        except OSError as exc:
            if not exc.errno:
                raise
            # Named after the file asked for, not the hidden partial file the error was raised on.
            raise OSError(exc.errno, f"writing the MP4 failed: {exc.strerror}", str(target)) from exc

    result = pipeline(request, on_step=on_step, video_sink=save)
    result.timings["mux"] = result.timings.pop("video_sink")
    if not number_if_taken and written[0] != target:
        # The API refuses a taken name before the request runs, so something took it while this one ran. The
        # request's result was thrown away then ("was not saved"): minutes of GPU time for a name.
        # Names, not paths: the server shows notes to its clients as the job's warnings.
        result.notes.append(f"{target.name!r} was created in the output folder while this request ran and was "
                            f"left as it is; this video was saved as {written[0].name!r} instead.")
    return result, written[0]
