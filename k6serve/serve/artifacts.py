"""Where finished videos and uploaded inputs live: a local folder, files named by job id.

Outputs are `<root>/<job id>.mp4` for the server's own ids and `<root>/request_<digest>.mp4` for a client's
`request_id` (`output_file_name`), written atomically by the worker (`media.mux.write_mp4` links a finished hidden
`.part` file into place, never replacing a file), so a reader never sees half a video; a job re-run after a restart
first removes the video its interrupted attempt may have left (`serve.runner`). Uploads go to `<root>/uploads/`.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import shutil
import tempfile
from collections.abc import Iterable
from pathlib import Path

from k6serve.request import OutputOptions
from k6serve.serve.errors import write_refused

logger = logging.getLogger(__name__)

_SAFE_NAME = re.compile(r"[^A-Za-z0-9._-]+")
_SERVER_JOB_ID = re.compile(r"video_[0-9a-f]{32}")  # `video_creation.create_video_job`'s own ids


def output_file_name(job_id: str) -> str:
    """The MP4's name for a job. The server's ids name their own file; a client's `request_id` is digested: the
    runner clears a job's file before a re-run, so a chosen name could delete a file the client picked (the folder
    is also `k6serve generate`'s default), and two ids that differ only in case would share a file on a
    case-insensitive disk."""
    if _SERVER_JOB_ID.fullmatch(job_id):
        return f"{job_id}.mp4"
    return f"request_{hashlib.sha256(job_id.encode()).hexdigest()[:32]}.mp4"


class ArtifactStore:
    def __init__(self, root: str | Path) -> None:
        self.root = Path(root).resolve()
        self.upload_dir = self.root / "uploads"
        for folder in (self.root, self.upload_dir):
            # Proved now, before the model loads: a folder the server cannot write made every upload a 500 and every
            # job fail at its MP4 write, after its whole run. Its creation too: a folder that could not be made
            # (under a read-only parent, or an `uploads` that is a file) was a raw OSError, exit 1, not exit 2.
            try:
                folder.mkdir(parents=True, exist_ok=True)
                with tempfile.TemporaryFile(dir=folder):
                    pass
            except OSError as exc:
                raise ValueError(f"cannot write to {str(folder)!r} ({exc.strerror or exc}); pass a writable folder "
                                 "with --output-path.") from None

    def unwritable_folder(self, *, uploads: bool) -> Path | None:
        """The output folder (or, with `uploads`, the upload folder) if no file can be created in it now for want of
        permission or on a read-only mount (`errors.write_refused`: made so after the start), else None. Any other
        error (a full disk) is left to the write itself. Probed with an unnamed file (O_TMPFILE): nothing is left."""
        for folder in (self.root, self.upload_dir) if uploads else (self.root,):
            try:
                with tempfile.TemporaryFile(dir=folder):
                    pass
            except OSError as exc:
                if write_refused(exc):
                    return folder
        return None

    def output_options(self, job_id: str) -> OutputOptions:
        """What the engine is told: write `<root>/<output_file_name(job_id)>`."""
        return OutputOptions(save_output=True, output_path=str(self.root), output_file_name=output_file_name(job_id))

    def output_path(self, file_name: str) -> Path:
        path = (self.root / Path(file_name).name).resolve()
        assert path.parent == self.root, f"output {file_name!r} escapes {self.root}"
        return path

    def upload_path(self, job_id: str, field_name: str, client_file_name: str | None) -> Path:
        """A fresh path for an uploaded file; the client's name is reduced to a safe suffix."""
        suffix = Path(client_file_name or "").suffix.lower()
        suffix = _SAFE_NAME.sub("", suffix)[:12] if suffix.startswith(".") else ""
        return self.upload_dir / f"{job_id}_{field_name}{suffix}"

    def copy_upload(self, path: str | Path, job_id: str, field_name: str) -> Path:
        """Another job's own copy of an upload (a remix's of its source's reference image), named as an upload of
        `job_id` is: a hard link where the file system makes one (no bytes copied; each job deletes only its own
        name), else a copy written beside it as a hidden `.part` file and renamed into place, which a server killed
        meanwhile leaves to `remove_partial_files`. FileNotFoundError: the source file is gone (its job deleted)."""
        source = Path(path)
        target = self.upload_path(job_id, field_name, source.name)
        try:
            os.link(source, target)
            return target
        except FileNotFoundError:
            raise
        except OSError:  # no hard links here (some network and FUSE file systems, FAT)
            pass
        partial = target.with_name(f".{target.name}.part")
        try:
            shutil.copyfile(source, partial)
            os.replace(partial, target)
        except BaseException:
            self.remove([partial])
            raise
        return target

    def remove(self, paths: Iterable[str | Path]) -> None:
        for path in paths:
            try:
                Path(path).unlink(missing_ok=True)
            except OSError as exc:  # a file we cannot remove must not fail the request that owns it
                logger.warning("could not remove %s: %s", path, exc)

    def remove_orphan_uploads(self, owned: set[str]) -> int:
        """Delete the upload folder's files that no stored job owns (start-up only, under the folder's lock): an
        upload is moved there before its job is stored, so a server killed between the two left it behind, up to
        --max-upload-mb each, and nothing deleted it later (the TTL sweep deletes stored jobs' files)."""
        owned = {str(Path(path).resolve()) for path in owned}
        orphans = [path for path in self.upload_dir.iterdir()
                   if path.is_file() and not path.name.startswith(".") and str(path.resolve()) not in owned]
        if orphans:
            logger.warning("deleting %d uploaded file(s) no job owns (left by a server that stopped while creating "
                           "their jobs)", len(orphans))
        self.remove(orphans)
        return len(orphans)

    def remove_partial_files(self) -> int:
        """Delete `.part` files left by a process that died mid-write (start-up only)."""
        stale = [*self.root.glob(".*.part"), *self.upload_dir.glob(".*.part")]
        self.remove(stale)
        return len(stale)
