"""Fetching a checkpoint from the Hugging Face Hub, and what to say where its cache falls short: another model's
repository, an unreachable Hub with the copy cached under another name, revision or folder, unfinished downloads.

`checkpoint_files.resolve_checkpoint` calls it for a hub id; the file layouts are checkpoint_files.py's.
"""

from __future__ import annotations

import errno
import logging
import os
from pathlib import Path

from k6serve.models.checkpoint_files import CheckpointError, folder_listing
from k6serve.rank_logging import ONCE

logger = logging.getLogger(__name__)

# What a generation or SR download needs; skips e.g. the native-format bundles some repos also carry.
_ALLOW_PATTERNS = ["model_index.json", "sr_config.json", "*/*.json", "*/*.safetensors", "*/*.txt", "*/*.model",
                   "*/*.jinja"]


def download(repo_id: str, revision: str | None, model_id: str | None = None) -> Path:
    """`repo_id` at `revision` from the Hub, or from the local cache where the Hub is unreachable; a
    CheckpointError saying what went wrong and how to fix it."""
    from huggingface_hub import snapshot_download
    from huggingface_hub import errors as hub_errors

    from k6serve.models.variants import variant_from_id

    token_hint = (
        "Authenticate with `hf auth login` or set HF_TOKEN to a token of an account that has accepted the "
        f"model's terms at https://huggingface.co/{repo_id}."
    )
    try:
        if model_id is None and variant_from_id(repo_id) is None:
            # A name that is no release's may be another model's repository: its model_index.json alone tells,
            # before the snapshot. An SDXL id downloaded every weight the patterns match (tens of GB) and only
            # then was refused as another pipeline. A snapshot of the one file, not hf_hub_download: that retries
            # an unreachable Hub with back-off (23 s) where snapshot_download fails at once.
            _check_hub_pipeline(repo_id, Path(snapshot_download(repo_id, revision=revision,
                                                                allow_patterns=["model_index.json"])))
        folder = snapshot_download(repo_id, revision=revision, allow_patterns=_ALLOW_PATTERNS)
    except hub_errors.GatedRepoError as exc:
        raise CheckpointError(f"{repo_id} is gated and this machine is not authorised. {token_hint}") from exc
    except hub_errors.RepositoryNotFoundError as exc:
        raise CheckpointError(
            f"{repo_id} was not found on the Hub, or it is private and needs authentication. {token_hint}"
        ) from exc
    except hub_errors.RevisionNotFoundError as exc:
        raise CheckpointError(f"{repo_id} has no revision {revision!r}.") from exc
    except hub_errors.HfHubHTTPError as exc:
        status = getattr(getattr(exc, "response", None), "status_code", None)
        if status in (401, 403):
            raise CheckpointError(f"The Hub refused access to {repo_id} (HTTP {status}). {token_hint}") from exc
        raise CheckpointError(f"Downloading {repo_id} failed: {exc}") from exc
    except OSError as exc:
        if isinstance(exc, (hub_errors.LocalEntryNotFoundError, hub_errors.OfflineModeIsEnabled)) or \
                exc.errno not in _CACHE_WRITE_ERRNOS:
            # The revision asked for, where one was: `[--revision REV]` left the user to retype theirs.
            raise CheckpointError(_UNREACHABLE.format(
                repo_id=repo_id, revision=f"--revision {revision}" if revision else "[--revision REV]")
                + _cached_in_other_case(repo_id) + _cached_at_other_revisions(repo_id, revision)
                + _cached_one_level_up(repo_id)) from exc
        # The cache could not be written (read-only, not ours, full): it was told as "the Hub is unreachable".
        from huggingface_hub import constants

        reason = "the disk is full" if exc.errno in (errno.ENOSPC, errno.EDQUOT) else os.strerror(exc.errno).lower()
        raise CheckpointError(
            f"Cannot download {repo_id} into the Hugging Face cache {constants.HF_HUB_CACHE!r}: {reason} "
            f"({exc.filename or exc}). Set HF_HOME (or HF_HUB_CACHE) to a writable folder with room for the "
            "checkpoint, or download it elsewhere and pass the folder with --model-path."
        ) from exc
    return Path(folder)


def _check_hub_pipeline(repo_id: str, snapshot: Path) -> None:
    """A CheckpointError where the hub repository's model_index.json (in `snapshot`, downloaded alone) is missing
    or names no Kandinsky 6 pipeline, as `variants.variant_from_folder` refuses it once downloaded."""
    from k6serve.models.variants import variant_from_folder

    if not (snapshot / "model_index.json").is_file():
        raise CheckpointError(f"{repo_id} has no model_index.json, so it is not a Diffusers-format Kandinsky 6 "
                              "checkpoint (nothing was downloaded). Pass a Kandinsky 6 Diffusers repository, e.g. "
                              "kandinskylab/Kandinsky-6.0-Pro-distill-5s-Diffusers.")
    try:
        variant_from_folder(snapshot)
    except ValueError as exc:
        raise CheckpointError(f"{repo_id} is not a Kandinsky 6 checkpoint (only its model_index.json was "
                              f"downloaded): {exc}") from None


def _cache_folder_name(repo_id: str) -> str:
    """The Hub cache's folder of a model repository ("models--org--name"), as huggingface_hub names it."""
    from huggingface_hub.file_download import repo_folder_name

    return repo_folder_name(repo_id=repo_id, repo_type="model")


def _cached_in_other_case(repo_id: str) -> str:
    """Where the Hub cache holds `repo_id` in other letter case, what to pass instead (" ..."), else "": the Hub
    takes ids in any case, the cache only as downloaded, so an id typed in lower case found no copy offline, and
    the error said there was none."""
    from huggingface_hub import constants

    wanted = _cache_folder_name(repo_id)
    held = [name for name in folder_listing(Path(constants.HF_HUB_CACHE))
            if name.lower() == wanted.lower() and name != wanted]
    if not held:
        return ""
    cached = "/".join(held[0].split("--")[1:])
    return (f" The cache does hold {cached}, in other letter case (the cache's names are case-sensitive): pass "
            f"--model-path {cached!r}.")


def _cached_one_level_up(repo_id: str) -> str:
    """Where the copy is in the folder above the cache (" ..."), else "": HF_HOME set to the hub cache itself
    (`~/.cache/huggingface/hub`, not `~/.cache/huggingface`) looks in `hub/hub`, and the error said no copy was
    cached."""
    from huggingface_hub import constants

    cache = Path(constants.HF_HUB_CACHE)
    if not (cache.parent / _cache_folder_name(repo_id)).is_dir():
        return ""
    return (f" {str(cache.parent)!r} holds it, the folder above the cache {str(cache)!r} (HF_HOME names the folder "
            f"holding hub/, HF_HUB_CACHE the hub folder itself): set HF_HUB_CACHE={cache.parent}.")


def _cached_at_other_revisions(repo_id: str, revision: str | None) -> str:
    """Where the Hub cache holds snapshots of `repo_id` but none for `revision` (None: main), which to pass (" ...")
    else "": a download by commit (`hf download ID --revision SHA`) leaves no ref for main, and offline the error
    said that no copy was cached."""
    from huggingface_hub import constants

    snapshots = Path(constants.HF_HUB_CACHE) / _cache_folder_name(repo_id) / "snapshots"
    held = [name for name in folder_listing(snapshots) if (snapshots / name / "model_index.json").is_file()]
    # The revision's own ref naming a held snapshot: that copy is known but incomplete (a download cut off after
    # its model_index.json), and passing its commit would run it as it is.
    ref = snapshots.parent / "refs" / (revision or "main")
    try:
        known = ref.read_text(encoding="utf-8").strip()
    except (OSError, ValueError):
        known = None
    if not held or (revision is not None and revision in held) or known in held:
        return ""
    shown = ", ".join(held[:4]) + (f" and {len(held) - 4} more" if len(held) > 4 else "")
    return (f" The cache holds its snapshot(s) {shown}, none known as {revision or 'main'!r}: to run a cached one "
            f"offline, pass --revision {held[0]}.")


# A write into the Hub cache refused or failed, as opposed to a network failure.
_CACHE_WRITE_ERRNOS = frozenset({errno.EROFS, errno.EACCES, errno.EPERM, errno.ENOSPC, errno.EDQUOT})
_UNREACHABLE = (
    "Cannot fetch {repo_id}: the Hub is unreachable (or HF_HUB_OFFLINE is set) and no complete copy is in the local "
    "cache. On a machine with access run `hf download {repo_id} {revision}` and pass the downloaded folder "
    "with --model-path."
)


_WARNED_UNFINISHED: set[Path] = set()


def warn_of_unfinished_downloads(folder: Path) -> None:
    """Warn where `folder` holds unfinished Hugging Face downloads: a cache snapshot whose repository has
    `blobs/*.incomplete`, or an `hf download --local-dir` folder with `.cache/huggingface/download/**/*.incomplete`.
    Their files that never finished are missing from the folder (huggingface_hub serves a cached snapshot as it is
    when the Hub is unreachable or HF_HUB_OFFLINE is set), and the load failed on the first one ("transformer holds
    no .safetensors weights") with no word of the download. A warning, not a refusal: an unfinished cache blob may
    be another revision's, which this snapshot does not need (once per folder, as the checks before the load
    resolve the checkpoint more than once)."""
    if folder in _WARNED_UNFINISHED:
        return
    if folder.parent.name == "snapshots" and (folder.parent.parent / "blobs").is_dir():
        where = folder.parent.parent / "blobs"
        unfinished = sorted(path.name for path in where.glob("*.incomplete"))
        repo = folder.parent.parent.name  # models--org--name
        rerun = f"hf download {'/'.join(repo.split('--')[1:]) if repo.startswith('models--') else 'ID'}"
        kind = "a Hugging Face cache snapshot"
    else:
        where = folder / ".cache" / "huggingface" / "download"
        unfinished = sorted(str(path.relative_to(where)) for path in where.glob("**/*.incomplete"))
        rerun = f"hf download ID --local-dir {folder}"
        kind = "an `hf download --local-dir` folder"
    if not unfinished:
        return
    _WARNED_UNFINISHED.add(folder)
    logger.warning("%s is %s, and %s holds %d unfinished download(s) (%s): a download was interrupted, or is still "
                   "running in another process, and files it had not finished are missing from the folder. If the "
                   "load fails on a missing file, let that download finish, or run `%s` again where the Hub is "
                   "reachable.", folder, kind, where, len(unfinished),
                   ", ".join(unfinished[:3]) + (" ..." if len(unfinished) > 3 else ""), rerun, extra=ONCE)
