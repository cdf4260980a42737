"""The request's output checked in the caller's process before the request runs (the API's and `k6serve
generate`'s): the output folder, the file name it will be written under, a name already taken, the output keys that
save_output=False ignores, and PyAV where the request needs it."""

from __future__ import annotations

import dataclasses
import logging
import os
import tempfile
import unicodedata
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from k6serve.dependencies import MissingPackage, require_package
from k6serve.media.output_names import MAX_FILE_NAME_BYTES, is_name_character, sanitize_file_name
from k6serve.request import FlagWorded, FlagWordedNote, OutputOptions, SamplingParams

# `warn_without_media_package` is the Python API's warning, logged under its module's name as before it moved here.
_api_logger = logging.getLogger("k6serve.api")


def require_media_package(params: SamplingParams, output: OutputOptions) -> None:
    """PyAV, which k6serve.media needs to write the MP4 and to read a source video, imported in the caller's
    process: missing, the request failed in the worker only after the model had loaded and run. A conditioning
    image is read with Pillow alone (k6serve/media/__init__.py)."""
    if output.save_output:
        require_package("av", "to write the MP4")
    elif params.video_path is not None:
        require_package("av", "to read the source video")


def check_output_folder(output: OutputOptions) -> None:
    """Create the output folder and prove it writable now: a bad --output-path must fail before the model loads
    and the request runs, not at the MP4 write after the whole denoise."""
    if not output.save_output:
        return
    if not str(output.output_path).strip():
        # SGLang's empty output path means "keep no file"; said as the flag the CLI took it from, and the API's
        # rewording names the keywords (it said output_path on the command line and --output-path in Python).
        raise ValueError("--output-path is empty; pass the folder for the MP4 (e.g. --output-path 'outputs'), or "
                         "--no-save-output to write no file (SGLang's empty output path).")
    folder = Path(output.output_path)
    if folder.exists() and not folder.is_dir():
        # mkdir would only say "File exists", which reads as if the folder were fine.
        raise ValueError(
            f"output_path {str(folder)!r} is a file, not a folder; pass a folder for the MP4 with --output-path "
            "(it is created if missing), or put the file name in --output-file-name."
        )
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as exc:
        raise ValueError(
            f"cannot write to output_path {str(folder)!r} ({exc.strerror or exc}); pass a writable folder with "
            "--output-path, or --no-save-output to skip the file."
        ) from None


def final_file_name(name: str) -> tuple[str, str | None]:
    """The file name a given output_file_name is written under (`media/output_names.sanitize_file_name`, as the
    worker writes it), and a warning when that differs from it by more than the added .mp4. A name with no letter or
    digit before its .mp4 ('..', '???') would be written as 'video.mp4' or '_.mp4', a name the caller never chose,
    so it is refused."""
    # FlagWorded: `k6serve generate` names --output-file-name (cli/preflight.py, cli/prompt_file.py); "--output-path"
    # is rewritten for the API's caller by reworded_errors, as before.
    if not name.strip():
        raise FlagWorded.naming(lambda field: f"{field('output_file_name')} is empty; pass a name such as clip.mp4, "
                                              "or leave it out for a name derived from the request.")
    stem = name[:-4] if name.lower().endswith(".mp4") else name
    if not any(is_name_character(char) for char in stem):
        raise FlagWorded.naming(lambda field: f"{field('output_file_name')} {name!r} has no letter or digit to name "
                                              "the file by; pass a name such as clip.mp4 (letters and digits of any "
                                              "script, '.', '_' and '-').")
    if Path(name).name != name:
        raise FlagWorded.naming(lambda field: f"{field('output_file_name')} {name!r} must be a file name without "
                                              "folders; put the folder in --output-path.")
    final = sanitize_file_name(name)
    if len(final.encode()) > MAX_FILE_NAME_BYTES:  # filesystems count bytes: 2 a Cyrillic letter, 3 a Chinese one
        raise FlagWorded.naming(lambda field: f"{field('output_file_name')} is {len(final.encode())} bytes long with "
                                              f".mp4 in UTF-8, more than the {MAX_FILE_NAME_BYTES} an output file may "
                                              "have; pass a shorter name.")
    if final in (name, name + ".mp4"):
        return final, None
    nfc = unicodedata.normalize("NFC", name)
    normalised = ("its Unicode was normalised (NFC), so that it has the same bytes however its accents were typed "
                  "(an 'e' and a combining accent become one 'é')")
    if final in (nfc, nfc + ".mp4"):
        # Only NFC changed it: the two names print alike ('é.mp4' is written as 'é.mp4'), so show their escapes.
        return final, FlagWordedNote.naming(lambda field: f"{field('output_file_name')} {ascii(name)} is written as "
                                                          f"{ascii(final)}: {normalised}.")
    kept = ("file names keep only letters and digits (of any script), '.', '_' and '-' (others become '_'), and no "
            "leading dot")
    return final, FlagWordedNote.naming(lambda field: f"{field('output_file_name')} {name!r} is written as {final!r}: "
                                                      f"{kept}" + (f"; and {normalised}." if nfc != name else "."))


def check_output(output: OutputOptions) -> tuple[OutputOptions, list[str]]:
    """Check the output before the request runs: an unusable folder, an unusable name, a name with folders, or a
    given name that already exists fails now, not after the whole denoise. Returns the options with a given name
    as it will be written, and warnings for the user (a name changed on the way). A derived name is left to the
    worker, which writes without replacing and moves a taken one (the same prompt, seed and second; an SR of the
    same source) on to _1, _2..."""
    if not output.save_output or output.output_file_name is None:
        check_output_folder(output)
        return output, []
    name, warning = final_file_name(output.output_file_name)  # before the folder is created for it
    check_output_folder(output)
    target = Path(output.output_path) / name
    if os.path.lexists(target):  # exists() follows a link: a dangling one passed, and the result was lost at the end
        raise ValueError(
            f"{str(target)!r} already exists and was left as it is; delete it or pass another "
            "--output-file-name."
        )
    return dataclasses.replace(output, output_file_name=name), [warning] if warning else []


def unsaved_output_keys(options: Mapping[str, Any]) -> list[str]:
    """The output_path / output_file_name given with save_output false: no file is written for them to name. The
    caller warns in its own words (flags or keywords)."""
    if options.get("save_output", True) is not False:
        return []
    return [key for key in ("output_file_name", "output_path") if options.get(key) is not None]


def warn_without_media_package() -> None:
    """Said before the load (minutes for a real checkpoint), which cannot know whether the requests will write an
    MP4 (save_output, the default): `generate` refuses those, and the frames-only ones still run."""
    try:
        require_package("av", "to write the MP4")
    except MissingPackage as exc:
        _api_logger.warning(f"{exc} Until then generate() runs only requests with save_output=False and no source "
                            "video.")
