"""Reading a LoRA adapter: `read_adapter` finds its file (`adapter_file.py`), reads the key names from the header
before any tensor, then the whole file, and parses its state dict (`state_dict.py`) with the PEFT config that came
with it (`peft_config.py`). Tensors stay on the CPU in the file's dtype: merging and the dynamic path cast them
where they are used.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path

from k6serve.lora.adapter_file import PEFT_CONFIG_FILE, file_stamp, resolve_adapter_file
from k6serve.lora.peft_config import LORA_METADATA_KEY, peft_folder_config
from k6serve.lora.state_dict import LoraModule, key_kind, parse_lora_state_dict, unknown_keys_error


@dataclass(frozen=True, kw_only=True, slots=True)
class LoraAdapter:
    """An adapter as read from `path` (`file` is the .safetensors actually read): module path -> `LoraModule`."""

    path: str
    file: Path
    modules: dict[str, LoraModule]
    stamp: tuple[int, int, int] | None = None  # `file_stamp(file)` when it was read
    # `file_stamp` of the PEFT_CONFIG_FILE beside `file` when it was read (None: there was none); its alphas count.
    config_stamp: tuple[int, int, int] | None = None

    def unchanged(self) -> bool:
        """Whether `file` is still the one read (same inode, size and modification time), and the PEFT config beside
        it too: a set_lora naming the same path again reuses this adapter only then. An adapter retrained and saved
        over its file was otherwise kept from the first read, silently serving the old weights under the new file's
        name."""
        return (self.stamp is not None and file_stamp(self.file) == self.stamp
                and file_stamp(self.file.parent / PEFT_CONFIG_FILE) == self.config_stamp)

    @property
    def rank(self) -> int:
        return max(module.rank for module in self.modules.values())

    @property
    def file_alpha(self) -> float | None:
        """The file's alpha when every module has the same one (what `state()` reports), else None."""
        alphas = {module.alpha for module in self.modules.values()}
        return alphas.pop() if len(alphas) == 1 else None


def _header_metadata(data: bytes) -> dict[str, str] | None:
    """The `__metadata__` of a safetensors file's JSON header (`safe_open(...).metadata()`), from its bytes, which
    `safetensors.torch.load` has checked."""
    (length,) = struct.unpack("<Q", data[:8])
    metadata = json.loads(data[8:8 + length]).get("__metadata__")
    return metadata if isinstance(metadata, dict) else None


def read_adapter(path: str) -> LoraAdapter:
    """Read the adapter named by `path` (a .safetensors file, a folder holding one, or a hub id) onto the CPU."""
    import safetensors
    import safetensors.torch
    from safetensors import SafetensorError

    file = resolve_adapter_file(path)
    stamp = file_stamp(file)  # before reading: a file rewritten meanwhile is read again next time
    config_stamp = file_stamp(file.parent / PEFT_CONFIG_FILE)
    try:
        # The key names first, from the header (no tensor read): a file that is no LoRA (a model's 1 GiB of weights
        # named by mistake) was read whole, and copied into tensors, before its keys refused it.
        with safetensors.safe_open(str(file), framework="pt") as handle:
            unknown = [key for key in handle.keys() if key_kind(key)[0] == "unknown"]
            with_config = LORA_METADATA_KEY in (handle.metadata() or {})
        # Not where a PEFT config comes with it: its options (modules_to_save, bias="all") add keys of their own, and
        # the parse says which option, not only which keys.
        if unknown and not with_config and not (file.parent / PEFT_CONFIG_FILE).is_file():
            raise unknown_keys_error(unknown, str(file))
        # The file's bytes, read whole into memory, not mapped: `safe_open(...).get_tensor` gives CPU tensors that
        # share the file's mapping, so a loaded adapter was the bytes on disk now. A file copied over in place (cp,
        # shutil.copy: the same inode) changed the next request with no LoRA call, and a shorter one killed the
        # worker with SIGBUS at the adapter's next use, the server's every replica with it.
        data = file.read_bytes()
        # In key order, as safe_open lists them: load's own order varies from process to process (a hash map), and
        # the ranks of a sharded DiT apply the modules in this order, each with its collectives.
        tensors = dict(sorted(safetensors.torch.load(data).items()))
        metadata = _header_metadata(data)  # diffusers keeps the alphas there
    except (SafetensorError, OSError) as exc:
        # Not a ValueError of its own: it reached the CLI as an internal error and the HTTP client as a 500 with a
        # traceback, for a truncated download or a file renamed to .safetensors.
        raise ValueError(f"LoRA file {str(file)!r} cannot be read as safetensors ({exc}); it may be damaged or "
                         "cut short (download or copy it again), or not a safetensors file") from None
    modules = parse_lora_state_dict(tensors, source=str(file), metadata=metadata,
                                    peft_config=peft_folder_config(file))
    return LoraAdapter(path=path, file=file, modules=modules, stamp=stamp, config_stamp=config_stamp)
