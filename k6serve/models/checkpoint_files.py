"""Finding and reading Diffusers-format checkpoint files: local folders, hub ids, safetensors shards.

This module knows file layouts, not weight names: each model family's loader maps names (style.md:
`checkpoint.py` is the only place that knows original weight names). Every failure names the repository or
folder and says what to do.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from k6serve.testing.demo_location import DEMO_MODEL_PATHS

logger = logging.getLogger(__name__)

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


_WEIGHTS_NAME = "diffusion_pytorch_model.safetensors"  # what diffusers' save_pretrained writes, and loads
# diffusers' variant files: diffusion_pytorch_model.fp16.safetensors, diffusion_pytorch_model.fp16-00001-of-00002...
# (a dotted name of another stem, "transformer_v1.0.safetensors", is no variant)
_VARIANT_FILE = re.compile(r"^diffusion_pytorch_model\.[A-Za-z0-9_]+(-\d+-of-\d+)?\.safetensors$")
_SHARD_FILE = re.compile(r"-\d+-of-\d+\.safetensors$")


class CheckpointError(ValueError):
    """A checkpoint could not be found, fetched or read; the message says how to fix it."""


def variant_before_loading(model_path: str, model_id: str | None, load_format: str | None):
    """(the variant the worker will recognise, its local folder or None) where that needs no download (a local
    folder, the demo, a released hub id, --model-id, --load-format dummy); the variant is None when it cannot be
    told now (the engine then reports it while loading). A local folder with a damaged file (a truncated weight
    file or config) raises CheckpointError here, before the workers start."""
    from k6serve.models.variants import recognise

    folder = None
    # Path("") is the working folder: an empty --model-path (`--model-path "$UNSET"`) was read as that folder, and
    # any broken .json there was reported as a damaged checkpoint instead of the missing --model-path.
    if model_path and load_format != "dummy" and (model_path in DEMO_MODEL_PATHS
                                                  or Path(model_path).expanduser().exists()):
        folder = resolve_checkpoint(model_path)
    try:
        return recognise(model_path, model_id, folder), folder
    except ValueError:
        return None, folder


def resolve_checkpoint(model_path: str, revision: str | None = None, model_id: str | None = None) -> Path:
    """A local folder, or a hub id fetched (or found in the local cache) through huggingface_hub; `model_id`
    (--model-id) routes a hub id whose name is no release's, which is otherwise checked for a Kandinsky 6 pipeline
    before its weights are fetched."""
    from k6serve.models.hub_download import download, warn_of_unfinished_downloads

    if model_path in DEMO_MODEL_PATHS:
        from k6serve.testing.demo_location import built_demo_checkpoint

        built = built_demo_checkpoint(DEMO_MODEL_PATHS[model_path])
        if built is not None:  # the usual case; the builder imports diffusers and transformers (seconds)
            return built
        from k6serve.testing.tiny_checkpoints import ensure_demo_checkpoint

        return ensure_demo_checkpoint(DEMO_MODEL_PATHS[model_path])
    local = Path(model_path).expanduser()
    if local.exists():
        if not local.is_dir():
            raise CheckpointError(f"--model-path {model_path!r} is a file; pass the checkpoint folder that holds "
                                  "model_index.json." + _folder_of_file(local))
        folder, fix = local.resolve(), "copy or download it again"
    elif not _HUB_ID.match(model_path):
        raise CheckpointError(
            f"--model-path {model_path!r} is neither an existing folder nor a hub id like "
            "'kandinskylab/Kandinsky-6.0-Pro-distill-5s-Diffusers'." + _near_miss(model_path)
        )
    else:
        try:
            folder = download(model_path, revision, model_id)
        except CheckpointError as exc:
            near = _local_folder_near(model_path)
            if near is None:
                raise
            raise CheckpointError(f"{exc} {near}") from exc.__cause__
        pinned = f" --revision {revision}" if revision else ""
        fix = f"download it again: hf download {model_path}{pinned} --force-download"
    warn_of_unfinished_downloads(folder)
    check_checkpoint_files(folder, fix)
    return folder


def _folder_of_file(path: Path) -> str:
    """For a file given as the checkpoint, the folder to pass (" ..."), or "": the checkpoint holding it (its
    model_index.json, a component's file), or why a lone weight file is no checkpoint (a single-file release)."""
    for folder in (path.parent, path.parent.parent):
        if (folder / "model_index.json").is_file():
            return f" It is in the checkpoint {str(folder)!r}: pass that folder."
    if path.suffix in (".safetensors", ".ckpt", ".pt", ".bin", ".gguf"):
        return (" A single weight file is no Diffusers checkpoint: k6serve loads the folder of a Diffusers-format "
                "download (model_index.json and a folder per component), e.g. of "
                "kandinskylab/Kandinsky-6.0-Pro-distill-5s-Diffusers.")
    return ""


def _near_miss(model_path: str) -> str:
    """What a path that names nothing nearly names: itself without surrounding spaces (a pasted or quoted path;
    the spaces hide in the message's quotes), a built-in checkpoint in other letter case ("Demo"), or a hub id
    written as a Hub URL, with a trailing slash or an `@revision`, or a release's name without its organisation."""
    from k6serve.models.variants import normalise_id, variant_from_id

    stripped = model_path.strip()
    # Not a blank path: Path("") is the working folder, and '' was given as the path to pass.
    if stripped and stripped != model_path and (stripped in DEMO_MODEL_PATHS or Path(stripped).expanduser().exists()):
        return f" Without its surrounding spaces it names {stripped!r}, which exists: pass that."
    if stripped.lower() in DEMO_MODEL_PATHS:
        return f" The built-in checkpoint is {stripped.lower()!r}, in lower case."
    if url := re.match(r"^(?:https?://(?:www\.)?(?:huggingface\.co|hf\.co)/|hf://)([^/?#]+/[^/?#@]+)", stripped):
        if url[1].split("/")[0] in ("spaces", "datasets"):  # "spaces/ORG" was given as the hub id to pass
            return f" It is the address of a Hub {url[1].split('/')[0][:-1]}, not of a model repository."
        return f" It is a Hub address; pass the hub id alone: --model-path {url[1]!r}."
    if _HUB_ID.match(hub_id := stripped.rstrip("/")):  # "ckpt/distil/": a mistyped folder, where ckpt/ is one
        near = _local_folder_near(hub_id)
        # What kept it from being a hub id: " org/name" was told to drop a trailing slash it did not have.
        dropped = " and ".join(what for what, cut in (("its surrounding spaces", stripped != model_path),
                                                      ("the trailing slash", hub_id != stripped)) if cut)
        return f" {near}" if near else f" Without {dropped} it is the hub id {hub_id!r}."
    if "@" in stripped and _HUB_ID.match(stripped.split("@")[0]):
        repo_id, revision = stripped.split("@", 1)
        return f" Pass the revision apart: --model-path {repo_id!r} --revision {revision!r}."
    variant = variant_from_id(stripped) if "/" not in stripped else None
    if variant is not None and variant.hub_id is not None and \
            normalise_id(stripped) == normalise_id(variant.hub_id.split("/")[1]):
        return f" A hub id names its organisation too: the release's is {variant.hub_id!r}."
    return ""


def _local_folder_near(model_path: str) -> str | None:
    """For a hub id that could not be fetched, whose first part is a local folder ("ckpt/distil" where ckpt/
    exists): most likely a mistyped local path, which was reported as a hub id only."""
    parent = Path(model_path).parent
    if not parent.is_dir():
        return None
    names = [name for name in folder_listing(parent) if (parent / name).is_dir()]
    shown = ", ".join(names[:12]) + (f" and {len(names) - 12} more" if len(names) > 12 else "")
    return (f"If {model_path!r} is meant as a local folder: there is none, though {str(parent)!r} exists and holds "
            f"{'the folders ' + shown if names else 'no folders'}.")


def folder_listing(directory: Path) -> list[str]:
    """The names in `directory`, for an error about it; [] when it is missing or unreadable (the error stands)."""
    try:
        return sorted(p.name for p in directory.iterdir())
    except OSError:
        return []


def check_checkpoint_files(folder: Path, fix: str) -> None:
    """Every .safetensors file's header parses and its tensors' bytes are all there, and every .json file parses;
    else a CheckpointError naming the file, with `fix`.

    An interrupted copy or download leaves a truncated file, which safetensors (and diffusers / transformers
    through it) would only report deep inside a worker's load, as an internal error, and a truncated config as a
    bare JSON message naming no file. Reading the headers and the configs costs a few MiB at most (the tokenizers'
    JSON), so the check runs before anything loads.

    Only where the loaders read, the places a hub download fills (`hub_download._ALLOW_PATTERNS`): the folder's own
    .json files and its components' (one level down). The whole tree was walked: `--model-path ~` read every JSON
    file of the home folder (9 s and 534 MB) before saying it holds no model_index.json, and a bad one anywhere was
    "damaged".
    Only regular files (links to them followed): a FIFO named *.safetensors blocked the open. Only the weight files
    the load reads (`safetensors_files`), where it can tell them: a cut-short stray copy beside the weights (a
    variant's, "... (1).safetensors") was "damaged; download it again", though nothing reads it."""
    paths = [*folder.glob("*.json"), *folder.glob("*/*.json"), *folder.glob("*/*.safetensors")]
    read = _weight_files_read(folder)
    for path in sorted(paths):
        # A library's own weights file is checked whatever was chosen: transformers takes model.safetensors before
        # a shard index, where safetensors_files (diffusers' order) takes the index.
        if path.suffix == ".safetensors" and path.parent in read and path not in read[path.parent] \
                and path.name not in ("model.safetensors", _WEIGHTS_NAME):
            continue
        problem: str | None
        if path.is_symlink() and not path.exists():
            problem = "a link to a file that is gone, e.g. a cleaned Hugging Face cache blob"  # stat() would raise
        elif not path.is_file():
            continue
        elif path.suffix == ".safetensors":
            problem = _safetensors_problem(path)
        else:
            problem = _json_problem(path)
        if problem is not None:
            raise CheckpointError(f"{path} is damaged ({problem}), e.g. by an interrupted download; {fix}.")


def _weight_files_read(folder: Path) -> dict[Path, set[Path]]:
    """Each component folder's weight files as the load chooses them; a folder whose choice fails (no weights,
    several, a damaged index) is left out, so all its files are checked, and the load names the problem."""
    read = {}
    for component_dir in {path.parent for path in folder.glob("*/*.safetensors")}:
        try:
            read[component_dir] = set(safetensors_files(component_dir))
        except CheckpointError:
            pass
    return read


# safetensors refuses a longer header (its MAX_HEADER_SIZE).
_MAX_HEADER_BYTES = 100_000_000


def _json_problem(path: Path) -> str | None:
    try:
        json.loads(path.read_bytes())
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as exc:
        return f"not valid JSON: {exc}"
    return None


def _safetensors_problem(path: Path) -> str | None:
    size = path.stat().st_size
    with path.open("rb") as file:
        head = file.read(8)
        if len(head) < 8:
            return f"{size} bytes, shorter than a header"
        header_bytes = int.from_bytes(head, "little")
        if 8 + header_bytes > size:
            return f"its header claims {header_bytes} bytes but the file has {size}"
        if header_bytes > _MAX_HEADER_BYTES:  # read whole below: a stray 3 GB file cost 4.2 GB of memory
            return f"its header claims {header_bytes} bytes, more than safetensors reads ({_MAX_HEADER_BYTES})"
        try:
            header = json.loads(file.read(header_bytes))
        except (json.JSONDecodeError, UnicodeDecodeError, RecursionError):
            return "its header is not valid JSON"
    if not isinstance(header, dict):
        return "its header is not a JSON object"
    try:
        data_end = max((int(entry["data_offsets"][1]) for name, entry in header.items() if name != "__metadata__"),
                       default=0)
    except (TypeError, KeyError, IndexError, ValueError):
        return "its header lacks tensor offsets"
    if 8 + header_bytes + data_end > size:
        return f"it holds {size} bytes, its tensors need {8 + header_bytes + data_end}"
    return None


def ignored_revision_note(model_path: str, revision: str | None, load_format: str = "auto") -> str | None:
    """Why `revision` is ignored (it only picks what a hub id downloads), or None where it applies or none was
    given: `resolve_checkpoint` drops it without a word for a local folder or the demo, and a dummy load never
    calls it."""
    if revision is None:
        return None
    if load_format == "dummy":
        where = "--load-format dummy builds random weights and downloads nothing"
    elif model_path in DEMO_MODEL_PATHS:
        where = f"{model_path!r} is a built-in tiny checkpoint"
    elif Path(model_path).expanduser().exists():
        where = f"{model_path!r} is a local folder, used as it is"
    else:
        return None
    return f"revision {revision!r} is ignored: it only picks the revision a hub id downloads, and {where}."


def read_model_index(folder: Path) -> dict:
    path = folder / "model_index.json"
    if not path.is_file():
        raise CheckpointError(f"{folder} has no model_index.json; it is not a Diffusers-format checkpoint."
                              + model_index_nearby(folder))
    return read_json_file(path)


def model_index_nearby(folder: Path) -> str:
    """For a folder without model_index.json, the checkpoint folder it most likely stands for (" Pass ..."), or "":
    a component of one (`transformer/`), the folder holding some, or a hub cache's repository folder (its checkpoints
    are under snapshots/). Each was told only that it is no Diffusers checkpoint, with an example hub id."""
    if (folder.parent / "model_index.json").is_file():
        return (f" It is the {folder.name!r} component of the checkpoint {folder.parent}: pass that folder (a "
                "checkpoint is loaded whole).")
    if (folder / "snapshots").is_dir() and folder.name.startswith("models--"):
        snapshots = [folder / "snapshots" / name for name in folder_listing(folder / "snapshots")
                     if (folder / "snapshots" / name / "model_index.json").is_file()]
        hub_id = "/".join(folder.name.split("--")[1:])
        if snapshots:
            return (f" It is a Hugging Face cache folder: pass the hub id {hub_id} (with HF_HUB_CACHE set to "
                    f"{folder.parent} if that is not the default cache), or its snapshot folder {snapshots[-1]}"
                    + (f" (one of {len(snapshots)})." if len(snapshots) > 1 else "."))
        return f" It is a Hugging Face cache folder without a complete snapshot: run `hf download {hub_id}`."
    held = [name for name in folder_listing(folder) if (folder / name / "model_index.json").is_file()]
    if held:
        shown = ", ".join(held[:6]) + (f" and {len(held) - 6} more" if len(held) > 6 else "")
        return f" It holds the checkpoint folder(s) {shown}: pass one of them, e.g. {folder / held[0]}."
    return ""


def index_class(index: dict, component: str, path: Path) -> str | None:
    """The class model_index.json names for `component` (its `[library, class]` pair), None where it lists none (or
    `[null, null]`); a CheckpointError naming the file for any other form (`"scheduler": "PiflowScheduler"` was
    read as the class "i", `["diffusers"]` failed as an internal error)."""
    entry = index.get(component)
    if entry is None or entry == [None, None]:
        return None
    if not (isinstance(entry, list) and len(entry) == 2 and all(isinstance(item, str) for item in entry)):
        raise CheckpointError(f"{path}: {component!r} must be a [library, class] pair such as [\"diffusers\", "
                              f"\"PiflowScheduler\"], got {json.dumps(entry)}; restore it from the checkpoint's "
                              "source (copy or download the checkpoint again).")
    return entry[1]


# PiFlow's policy substeps per DiT call (the released checkpoints: 128): the loop runs on the host for each of them,
# so a config asking for millions held a request for hours with nothing failing.
MAX_POLICY_SUBSTEPS = 4096


def config_count(value: object, key: str, where: str, *, low: int = 1, high: int | None = None) -> int:
    """A config value that counts something (blocks, channels, steps) as an int, or a ValueError naming `where` (the
    file) and `key`: int() truncated 2.7 blocks to 2 and read "3" or true as counts, and a count past `high` held a
    request (or the host's memory) until it was killed."""
    if isinstance(value, bool) or not isinstance(value, int):
        if isinstance(value, float) and value.is_integer():
            value = int(value)  # 128.0, as a JSON writer may write an integer
        else:
            raise ValueError(f"{where}: {key} must be a whole number, got {json.dumps(value)}; copy or download the "
                             "checkpoint again.")
    if value < low or (high is not None and value > high):
        bounds = f">= {low}" if high is None else f"from {low} to {high}"
        raise ValueError(f"{where}: {key} must be {bounds}, got {value}; copy or download the checkpoint again.")
    return value


def read_json_file(path: Path) -> dict:
    """A checkpoint's JSON file (model_index.json, a component's config); a damaged one is a CheckpointError that
    names it."""
    try:
        value = json.loads(path.read_text(encoding="utf-8"))  # JSON is UTF-8 (RFC 8259), whatever the locale
    except FileNotFoundError:
        # A component's config.json missing (a partial copy) reached the user as an internal error, "a bug".
        raise CheckpointError(f"{path} is missing: the copy or download is incomplete; copy or download the "
                              "checkpoint again.") from None
    except OSError as exc:  # a folder of that name, a file it may not read
        raise CheckpointError(f"{path} cannot be read ({exc.strerror or exc}).") from None
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as exc:
        raise CheckpointError(f"{path} is not valid JSON ({exc}); restore it from the checkpoint's source "
                              "(copy or download the checkpoint again).") from exc
    if not isinstance(value, dict):
        raise CheckpointError(f"{path} should hold a JSON object, not {type(value).__name__}; restore it from the "
                              "checkpoint's source (copy or download the checkpoint again).")
    return value


def read_component_config(folder: Path, component: str, filename: str = "config.json") -> dict:
    path = folder / component / filename
    if not path.is_file():
        raise CheckpointError(f"{folder} is missing {component}/{filename}: the copy or download is incomplete; copy "
                              "or download the checkpoint again.")
    return read_json_file(path)


def require_components(folder: Path, index: dict, components: list[str]) -> None:
    missing = [c for c in components if c not in index or not (folder / c).is_dir()]
    if missing:
        raise CheckpointError(
            f"Checkpoint {folder} lacks component(s) {missing} (model_index.json lists "
            f"{sorted(k for k in index if not k.startswith('_'))}). Re-download the full repository."
        )


def safetensors_files(component_dir: Path) -> list[Path]:
    """The weight files of one component, chosen as diffusers' `from_pretrained` (no variant) chooses them (the
    shards its index names, else `diffusion_pytorch_model.safetensors`), or else the folder's one weight file of
    another name. Every `*.safetensors` used to be read and
    merged, the last in name order winning: a folder with the fp16 variant beside the weights read both (twice the
    I/O for Pro's 56 GiB), one with only the variant ran it with no word (diffusers refuses it without
    variant="fp16"), and a stray copy ("... (1).safetensors") could replace the weights."""
    indexes = sorted(component_dir.glob("*.safetensors.index.json"))  # a variant's index is *.index.fp16.json
    if indexes:
        standard = component_dir / (_WEIGHTS_NAME + ".index.json")
        if standard in indexes:
            index = standard
        elif len(indexes) == 1:
            index = indexes[0]
        else:
            raise CheckpointError(f"{component_dir} holds several shard indexes {[i.name for i in indexes]} and "
                                  f"no {standard.name}; keep the one of the checkpoint's weights.")
        weight_map = read_json_file(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{index} has no weight_map object naming the shards; restore it from the "
                                  "checkpoint's source (copy or download the checkpoint again).")
        files = sorted({component_dir / name for name in weight_map.values()})
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise CheckpointError(f"{component_dir} is missing shard(s) {missing} named in {index.name}: the copy or "
                                  "download is incomplete; copy or download the checkpoint again.")
        return files
    if (component_dir / _WEIGHTS_NAME).is_file():
        return [component_dir / _WEIGHTS_NAME]
    found = sorted(component_dir.glob("*.safetensors"))
    plain = [f for f in found if not _VARIANT_FILE.search(f.name)]
    if len(plain) == 1:
        return plain  # a component saved under another name, alone in its folder
    if len(plain) > 1:
        shards = all(_SHARD_FILE.search(f.name) for f in plain)
        raise CheckpointError(
            f"{component_dir} holds {len(plain)} weight files {[f.name for f in plain][:6]} and "
            + ("no shard index (*.safetensors.index.json) naming them; copy or download the component again."
               if shards else f"no {_WEIGHTS_NAME}: keep only the checkpoint's weights in the folder.")
        )
    if found:
        raise CheckpointError(
            f"{component_dir} holds only variant weights {[f.name for f in found][:6]}, not {_WEIGHTS_NAME}. "
            "diffusers loads those only when asked for the variant, and k6serve loads the released weights: "
            "download the repository without a variant (or, to run the variant's weights, rename its file to "
            f"{_WEIGHTS_NAME})."
        )
    other = sorted(f.name for f in component_dir.glob("*.bin")) + sorted(f.name for f in component_dir.glob("*.pt"))
    if other:
        raise CheckpointError(f"{component_dir} holds no .safetensors weights, only {other[:4]}: k6serve reads "
                              "weights from safetensors files only (the released checkpoints' format, which cannot "
                              "run code when loaded); convert them, e.g. load the component with diffusers and "
                              "save_pretrained it (safe_serialization is the default).")
    raise CheckpointError(f"{component_dir} holds no .safetensors weights (neither {_WEIGHTS_NAME} nor a shard "
                          "index naming its shards): the copy or download is incomplete; copy or download the "
                          "checkpoint again.")


def check_block_counts(component_dir: Path, counts: dict[str, tuple[str, int]]) -> None:
    """Each `counts[list name] = (config key, count)` against the blocks the weights hold (`<list name>.<i>.`),
    read from the safetensors headers (names only, no tensor data), before the model is built from the config: a
    config.json saying num_visual_blocks 1000000 grew the host's memory by gigabytes for minutes, building blocks
    on the meta device, before the weights were compared with it."""
    held: dict[str, int] = {}
    pattern = re.compile(r"^(" + "|".join(re.escape(name) for name in counts) + r")\.(\d+)\.")
    for path in safetensors_files(component_dir):
        with safe_open(str(path), framework="pt") as handle:
            for key in handle.keys():
                if (match := pattern.match(key)) is not None:
                    held[match[1]] = max(held.get(match[1], 0), int(match[2]) + 1)
    for name, (key, count) in counts.items():
        if held.get(name, 0) != count:
            raise CheckpointError(
                f"{component_dir / 'config.json'} says {key} {count}, but the weights hold "
                f"{held.get(name, 0)} {name} (the config and the weights come from different repositories or "
                "revisions, or the config was edited); copy or download the checkpoint again.")


_SAFETENSORS_DTYPES = {"BOOL": torch.bool, "U8": torch.uint8, "I8": torch.int8, "I16": torch.int16,
                       "I32": torch.int32, "I64": torch.int64, "F16": torch.float16, "BF16": torch.bfloat16,
                       "F32": torch.float32, "F64": torch.float64}


def header_state_dict(component_dir: Path) -> dict[str, torch.Tensor]:
    """The component's weights as meta tensors (names, shapes and dtypes from the safetensors headers; no data), for
    `check_state_dict` before the read: a config from another release (Lite's beside Pro's weights) was found out
    only after every weight was read and copied, minutes and twice the weights' size in host memory for Pro. A
    dtype not in the table (fp8) is taken as float32: the shapes are checked now, the dtypes again once read."""
    state = {}
    for path in safetensors_files(component_dir):
        with safe_open(str(path), framework="pt") as handle:
            for key in handle.keys():
                tensor = handle.get_slice(key)
                state[key] = torch.empty(tensor.get_shape(), device="meta",
                                         dtype=_SAFETENSORS_DTYPES.get(tensor.get_dtype(), torch.float32))
    return state


def load_state_dict(component_dir: Path, device: str | torch.device = "cpu", *,
                    dtypes: Mapping[str, torch.dtype] | None = None) -> dict[str, torch.Tensor]:
    """The component's weights on `device`, each floating tensor named in `dtypes` cast to that dtype (the others
    as stored), read one tensor at a time into fresh storage.

    Not safetensors' `load_file` for the whole component, then a cast and a move: its tensors are views of the
    files' mappings, so the loaders copied every one on the host (fresh storage: CPU GEMMs round differently on
    unaligned views), cast them, then moved the model: the whole DiT in host memory beside the page cache (Pro's
    56 GiB, on every rank of a multi-GPU host at once) and a second pass over it for the move. Now a tensor for
    the host is copied from the mapping into fresh storage in its dtype; one for a GPU goes through two pinned
    buffers (`_Staging`) and is cast there. Host memory beyond the page cache: the weights themselves for the host,
    128 MiB for a GPU. The values are the same bits either way: a cast is one rounding wherever it runs.
    """
    device = torch.device(device)
    dtypes = {} if dtypes is None else dtypes
    staging = None if device.type == "cpu" else _Staging(device)
    state: dict[str, torch.Tensor] = {}
    try:
        for path in safetensors_files(component_dir):
            try:
                with safe_open(str(path), framework="pt", device="cpu") as handle:
                    for name in handle.keys():
                        stored = handle.get_tensor(name)
                        dtype = dtypes.get(name, stored.dtype) if stored.is_floating_point() else stored.dtype
                        if staging is None:
                            state[name] = stored.to(dtype=dtype, copy=True)
                        else:
                            state[name] = staging.copy(stored).to(dtype)
            except SafetensorError as exc:  # damaged after resolve_checkpoint's header check, or in a way it misses
                raise CheckpointError(f"{path} cannot be read ({exc}); copy or download the checkpoint "
                                      "again.") from exc
    finally:
        if staging is not None:
            staging.finish()  # on an error too: a buffer is unlocked only once no copy reads it
    return state


class _Staging:
    """The way from a file's mapping to a device: two host buffers of `chunk_bytes` (page-locked for a GPU); while
    one is copied to the device, the next piece of the file is read into the other.

    The read is a host copy on torch's threads, which fault the file's pages in in parallel; a device copy straight
    from the mapping is a pageable copy that faults them in one at a time. The buffers are `PinnedBuffer`s, unlocked
    and freed with the staging: torch's pinned allocator (`pin_memory=True`) would keep them for the process's life.
    """

    def __init__(self, device: torch.device, chunk_bytes: int = 64 << 20) -> None:
        self.device = device
        self.chunk_bytes = chunk_bytes
        self._asynchronous = False
        self._pinned: list[Any] = []
        if device.type == "cuda":
            from k6serve.offload.host_weights import PinnedBuffer

            try:
                with torch.cuda.device(device):
                    self._pinned = [PinnedBuffer(chunk_bytes) for _ in range(2)]
                self._asynchronous = True
            except RuntimeError as exc:  # a host that cannot page-lock memory still loads, copying synchronously
                logger.warning("reading the weights without page-locked staging buffers, more slowly: %s", exc)
            # The stream a copy to `device` runs on, whichever GPU is this thread's current one (a rank's may not be
            # set): the events that free a buffer must follow the copies out of it.
            self._stream = torch.cuda.current_stream(device)
        if self._asynchronous:
            self._buffers = [buffer.view(torch.uint8) for buffer in self._pinned]
        else:
            self._buffers = [torch.empty(chunk_bytes, dtype=torch.uint8) for _ in range(2)]
        self._copied: list[Any] = [None, None]  # each buffer's last device copy (a CUDA event), to wait for
        self._turn = 0

    def copy(self, stored: torch.Tensor) -> torch.Tensor:
        """A copy of `stored` (contiguous, on the host) on the device, in its dtype."""
        copied = torch.empty(stored.shape, dtype=stored.dtype, device=self.device)
        source, target = _bytes(stored), _bytes(copied)
        for start in range(0, source.numel(), self.chunk_bytes):
            piece = source[start:start + self.chunk_bytes]
            if self._copied[self._turn] is not None:
                self._copied[self._turn].synchronize()  # the buffer's previous piece has reached the device
            buffer = self._buffers[self._turn][:piece.numel()]
            buffer.copy_(piece)
            target[start:start + piece.numel()].copy_(buffer, non_blocking=self._asynchronous)
            if self._asynchronous:
                self._copied[self._turn] = torch.cuda.Event()
                self._copied[self._turn].record(self._stream)
            self._turn ^= 1
        return copied

    def finish(self) -> None:
        """Wait for the last copies, so that the weights are complete, then free the buffers."""
        for event in self._copied:
            if event is not None:
                event.synchronize()
        self._copied = [None, None]
        self._buffers = []
        self._pinned = []


def _bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's storage as a flat uint8 tensor (a view)."""
    return tensor.reshape(-1).view(torch.uint8)


def check_state_dict(
    expected: dict[str, torch.Size], state: dict[str, torch.Tensor], component: str, floating: Collection[str] = ()
) -> None:
    """Fail at load time, naming the parameters, when the file and the config disagree; `floating` names the
    parameters that must be floating point (an integer tensor there failed inside load_state_dict, reported as an
    internal error)."""
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    mismatched = sorted(
        f"{k}: file {tuple(state[k].shape)} vs config {tuple(expected[k])}"
        for k in set(expected) & set(state)
        if tuple(state[k].shape) != tuple(expected[k])
    )
    not_floating = sorted(f"{k}: {str(state[k].dtype).removeprefix('torch.')}" for k in set(floating) & set(state)
                          if not state[k].is_floating_point())
    if missing or unexpected or mismatched or not_floating:
        parts = []
        for label, items in (("missing", missing), ("unexpected", unexpected), ("shape mismatch", mismatched),
                             ("not floating point", not_floating)):
            if items:
                shown = ", ".join(items[:8]) + (f" (+{len(items) - 8} more)" if len(items) > 8 else "")
                parts.append(f"{label}: {shown}")
        raise CheckpointError(
            f"{component} weights do not match its config.json ({'; '.join(parts)}). The config and weights "
            "come from different repositories or revisions; re-download the component."
        )
