"""Where a LoRA adapter's file is: the .safetensors a path names, the one a folder holds, or a hub repo's download
(with the PEFT config beside it); and each error about that file starts with a prefix the HTTP server recognises.
`adapter.py` reads the file found here.
"""

from __future__ import annotations

from pathlib import Path

from k6serve.request import unencodable_path

# diffusers' `save_lora_weights` / `save_lora_adapter` write this name. Preferred when a folder holds several files.
PREFERRED_FILE = "pytorch_lora_weights.safetensors"
# PEFT's `save_pretrained` writes the weights as PEFT_WEIGHTS_FILE and the `LoraConfig` beside them as
# PEFT_CONFIG_FILE, with no alpha in the weights: the scale (lora_alpha / r, per module with alpha_pattern /
# rank_pattern) is only in the JSON. Reading the weights alone applied `LoraConfig(r=4, lora_alpha=16)` at a quarter.
PEFT_WEIGHTS_FILE = "adapter_model.safetensors"
PEFT_CONFIG_FILE = "adapter_config.json"
SHOWN = 5  # how many offending keys an error lists


# Every error about the adapter file a LoRA path names (no such file or folder, a failed download, a file that holds
# no usable adapter) starts with one of these. The message is all that crosses a worker process boundary, so the HTTP
# server reads it to name its `lora_path` field (`names_adapter_file`).
PATH_ERROR_PREFIXES = ("LoRA path ", "LoRA file ", "LoRA folder ", "LoRA hub repo ")


def names_adapter_file(message: str) -> bool:
    """Whether a ValueError message from loading an adapter is about the file its path names."""
    return message.startswith(PATH_ERROR_PREFIXES)


def _single_file_in(folder: Path) -> Path:
    # Regular files only (links to them followed): a `*.safetensors` link to /dev/zero was read until the host ran out
    # of memory, and a FIFO hung the worker; a path naming such a file directly is refused by `is_file` already.
    files = sorted(file for file in folder.glob("*.safetensors") if file.is_file())
    if not files:
        raise ValueError(f"LoRA folder {str(folder)!r} holds no .safetensors file")
    if len(files) == 1:
        return files[0]
    preferred = folder / PREFERRED_FILE
    if preferred in files:
        return preferred
    names = ", ".join(file.name for file in files[:SHOWN])
    raise ValueError(f"LoRA folder {str(folder)!r} holds {len(files)} .safetensors files ({names}) and none is "
                     f"{PREFERRED_FILE}: pass the file's path instead")


def _download(repo_id: str) -> Path:
    """Fetch the adapter file of hub repo `repo_id`: `PREFERRED_FILE`, else the repo's only .safetensors; a PEFT
    repo's PEFT_CONFIG_FILE comes with it, into the same snapshot folder, where `read_adapter` finds it."""
    from huggingface_hub import hf_hub_download, list_repo_files, snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    try:
        # snapshot_download first: where the hub cannot be reached it fails at once (or serves a cached copy of the
        # repo), where hf_hub_download and the repo listing each retry the connection with back-off (49 s on a host
        # without network before the same error).
        try:
            # One snapshot for a PEFT repo's weights and config: the two from one revision, without a listing.
            folder = Path(snapshot_download(repo_id, allow_patterns=[PREFERRED_FILE, PEFT_WEIGHTS_FILE,
                                                                     PEFT_CONFIG_FILE]))
        except LocalEntryNotFoundError as exc:  # also a hub that answered with a server error, so its words go too
            cause = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise ValueError(
                f"LoRA path {repo_id!r} is not a local file or folder, and the Hugging Face hub is unreachable (or "
                f"HF_HUB_OFFLINE is set) with no copy of {repo_id} in the local cache ({cause}); check the path, or "
                f"run `hf download {repo_id}` where the hub is reachable and pass the downloaded folder"
            ) from None
        if (folder / PREFERRED_FILE).is_file():
            return folder / PREFERRED_FILE
        if any(folder.glob("*.safetensors")):  # an earlier download of this repo, e.g. served from the cache offline
            return _single_file_in(folder)
        files = [name for name in list_repo_files(repo_id) if name.endswith(".safetensors")]
        if len(files) != 1:
            raise ValueError(f"LoRA hub repo {repo_id!r} has no {PREFERRED_FILE} and {len(files)} other "
                             f".safetensors files ({', '.join(files[:SHOWN])}); exactly one is needed")
        return Path(hf_hub_download(repo_id, files[0]))
    except HFValidationError:  # a ValueError subclass: it must come before `except ValueError`
        raise ValueError(f"LoRA path {repo_id!r} is neither an existing file or folder nor a valid hub id") from None
    except ValueError:
        raise
    except Exception as exc:  # noqa: BLE001 - not found, gated, network: all end the same way for the user
        raise ValueError(f"LoRA path {repo_id!r} is not a local file or folder, and fetching it from the Hugging Face "
                         f"hub failed ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}); check "
                         "the path, or the network / HF_HUB_OFFLINE / HF_TOKEN for a hub id") from None


def resolve_adapter_file(path: str) -> Path:
    """The .safetensors to read for `path`: the file itself, a folder's single (or preferred) file, or a download."""
    if (reason := unencodable_path(path)) is not None:
        raise ValueError(f"LoRA file {reason}")
    local = Path(path).expanduser()
    if local.is_file():
        if local.suffix != ".safetensors":
            raise ValueError(f"LoRA file {path!r} is not a .safetensors file; only safetensors adapters are read "
                             "(convert a PyTorch .bin/.pt one with safetensors.torch.save_file)")
        return local
    if local.is_dir():
        return _single_file_in(local)
    if local.suffix == ".safetensors":
        # A file name, not a hub id ("loras/style.safetensors" is a valid one): a typo here was answered with
        # hub words and an `hf download loras/style.safetensors` to run.
        where = "" if local.is_absolute() else f", looked for in {Path.cwd()}"
        raise ValueError(f"LoRA file {path!r} does not exist{where}; check the path")
    return _download(path)


def file_stamp(file: Path) -> tuple[int, int, int] | None:
    """(inode, size, mtime in ns) of `file` (symlinks followed, as the hub cache's are), or None if it is gone."""
    try:
        stat = file.stat()
    except OSError:
        return None
    return stat.st_ino, stat.st_size, stat.st_mtime_ns
