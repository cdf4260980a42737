"""The names of output files: a user-given name kept inside the output folder, and the default name of a request's
video. Its own module so that the API and the CLI check a name in the engine's process without importing the
worker (which imports the models)."""

from __future__ import annotations

import os
import secrets
import unicodedata
from datetime import datetime
from pathlib import Path

from k6serve.request import GenerateRequest, UpscaleRequest


def is_name_character(char: str) -> bool:
    """Letters, combining marks and digits of any script: what a file is named by. A Russian, Chinese or Arabic
    prompt's words name its video as an English one's do (an ASCII-only rule named every one `video_seed42_...`,
    and two at the same second collided); spaces, punctuation, symbols, emoji, control and format characters (a
    right-to-left override would show the name reversed) are not."""
    category = unicodedata.category(char)
    return category[0] in "LM" or category == "Nd"


def numbered_file_names(name: str, count: int) -> list[str]:
    """A given output file name for each of `count` prompts (a --prompt-file-path, a list of prompts in the API):
    clip.mp4 -> clip_1.mp4 ... clip_N.mp4 (zero-padded to N's width, so they sort in the prompts' order); the name
    itself for one."""
    if count == 1:
        return [name]
    stem = name[:-4] if name.lower().endswith(".mp4") else name
    width = len(str(count))
    return [f"{stem}_{index:0{width}d}.mp4" for index in range(1, count + 1)]


def name_characters(text: str, keep: str = "") -> str:
    """`text` in NFC (macOS and Linux give the same bytes for an accented letter typed either way) with each run of
    characters that are not `is_name_character` or in `keep` as one '_'."""
    parts: list[object] = []  # characters, and _GAP for each run of others
    for char in unicodedata.normalize("NFC", text):
        if is_name_character(char) or char in keep:
            parts.append(char)
        elif not parts or parts[-1] is not _GAP:
            parts.append(_GAP)
    return "".join(part if isinstance(part, str) else "_" for part in parts)


_GAP = object()  # a run of other characters, in `name_characters`


def _slug(text: str, limit: int = 48) -> str:
    slug = name_characters(text).strip("_")[:limit].strip("_")
    return slug or "video"


# Filesystems take names of up to 255 bytes. The MP4 writer first writes ".<name>.<12 hex>.part" (19 bytes more), and
# a derived name already taken becomes <stem>_<n> (up to 5 more): a longer name would fail only once the video is done.
MAX_FILE_NAME_BYTES = 255 - 19 - 5


def partial_file_path(path: Path) -> Path:
    """The hidden file the MP4 writer writes before linking it to `path`: ".<name>.<12 hex>.part", the writer's pid in
    the first 6 hex digits (`remove_partial_files`), 6 random ones after it."""
    return path.parent / f".{path.name}.{os.getpid() & 0xFFFFFF:06x}{secrets.token_hex(3)}.part"


def remove_partial_files(folder: str | Path, pid: int) -> list[Path]:
    """Remove the partial MP4s that process `pid`, now known dead, left in `folder` (a rank killed mid-write: the
    out-of-memory killer, kill -9) and return them. Only a dead writer's: another process's file there may be one
    it is writing."""
    tag = f"{pid & 0xFFFFFF:06x}"
    removed = []
    for path in Path(folder).glob(f".*.{tag}{'[0-9a-f]' * 6}.part"):
        path.unlink(missing_ok=True)
        removed.append(path)
    return removed


def sanitize_file_name(name: str) -> str:
    """Keep a user-given output name inside the output folder and ending in .mp4: letters, marks and digits of any
    script, '.', '_' and '-' (`name_characters`), no leading dot."""
    base = Path(name).name
    base = name_characters(base, keep="._-").lstrip(".") or "video"
    return base if base.lower().endswith(".mp4") else base + ".mp4"


def default_file_name(request: GenerateRequest | UpscaleRequest, now: datetime | None = None) -> str:
    stamp = (now or datetime.now()).strftime("%Y%m%d-%H%M%S")
    if isinstance(request, UpscaleRequest):
        suffix = f"_sr{request.scale:g}x_{stamp}.mp4"
        # A source named by a long title (or in a script of 2-4 bytes a character) would give a name the
        # filesystem refuses only at the write, after the whole upscale: its stem is cut to fit, at a character.
        # A hidden source (".clip.mp4") gave a hidden output (".clip_sr2x_...mp4") that `ls` and file browsers do
        # not show; a given name loses its leading dot too (sanitize_file_name).
        # pathlib's stem as Python 3.11-3.13 cut it ("..mp4" -> "."): 3.14 keeps a name of dots and one suffix
        # whole ("..mp4"), which named the output "mp4_sr2x_...".
        name = Path(request.video_path).name
        dot = name.rfind(".")
        stem = (name[:dot] if 0 < dot < len(name) - 1 else name).lstrip(".") or "video"
        # The source's own name, spaces and punctuation kept, but not its control and format characters: a newline
        # split the CLI's `saved PATH` line (the result's line on stdout) in two, and a right-to-left override showed
        # the name reversed.
        stem = "".join("_" if unicodedata.category(char) in ("Cc", "Cf") else char for char in stem)
        stem_bytes = stem.encode("utf-8", "surrogateescape")
        if len(stem_bytes) > MAX_FILE_NAME_BYTES - len(suffix):
            stem = stem_bytes[: MAX_FILE_NAME_BYTES - len(suffix)].decode("utf-8", "ignore")
        return f"{stem}{suffix}"
    return f"{_slug(request.prompt)}_seed{request.seed}_{stamp}.mp4"
