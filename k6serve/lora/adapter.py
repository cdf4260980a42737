"""Reading a LoRA adapter: where the file is (a path, a folder, a hub id) and what its keys mean.

Two layouts are read:
* diffusers / PEFT: `<module>.lora_A[.<adapter name>].weight` (rank x in) and `<module>.lora_B[.<adapter
  name>].weight` (out x rank), optionally `<module>.alpha`, under a `transformer.`, `base_model.model.`,
  `diffusion_model.` (ComfyUI) or no prefix; ComfyUI's own LoRA save / extract / training nodes name the same pair
  `<module>.lora_down.weight` / `.lora_up.weight` (kohya's factor names after a dotted path), alpha as kohya's.
  The alpha may instead be in the adapter's PEFT `LoraConfig`: in the file's header, where diffusers'
  `save_lora_weights` / `save_lora_adapter` put it, or in the `adapter_config.json` beside the file, where PEFT's
  `save_pretrained` does (`_config_alphas`). Also PEFT's
  variants that diffusers' `load_lora_adapter` applies to this DiT: DoRA (`use_dora`: `<module>.lora_magnitude_vector`,
  one magnitude per output feature), a lora_B bias (`lora_bias`: `<module>.lora_B.bias`) and LoRA on an
  nn.Embedding (`<module>.lora_embedding_A` (rank x num_embeddings) / `.lora_embedding_B` (embedding_dim x rank),
  read as the down / up of the Linear whose weight is the embedding table transposed);
* kohya (sd-scripts, musubi-tuner, and what ComfyUI exports from them): `lora_unet_<module with "_" for
  ".">.lora_down.weight` / `.lora_up.weight` / `.alpha` (also `lora_transformer_`). The flattened name cannot be
  split back into a path without the model: `targets.py` matches it against the model's flattened Linear names.
  LyCORIS's DoRA (`weight_decompose`, trained through sd-scripts) adds `.dora_scale`, also after a dotted
  `<module>` in ComfyUI's exports: read as PEFT's magnitudes where it means the same (`_dora_scale_magnitudes`).
Our DiT keeps diffusers' module names, so `<module>` is a path in `Kandinsky6Transformer.named_modules()`; whether it
names a Linear there is checked by `targets.py`, which has the model. Tensors stay on the CPU in the file's dtype:
merging and the dynamic path cast them where they are used.
"""

from __future__ import annotations

import json
import math
import re
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from k6serve.lora.spec import check_lora_alpha
from k6serve.request import unencodable_path

# diffusers' `save_lora_weights` / `save_lora_adapter` write this name. Preferred when a folder holds several files.
PREFERRED_FILE = "pytorch_lora_weights.safetensors"
# PEFT's `save_pretrained` writes the weights as PEFT_WEIGHTS_FILE and the `LoraConfig` beside them as
# PEFT_CONFIG_FILE, with no alpha in the weights: the scale (lora_alpha / r, per module with alpha_pattern /
# rank_pattern) is only in the JSON. Reading the weights alone applied `LoraConfig(r=4, lora_alpha=16)` at a quarter.
PEFT_WEIGHTS_FILE = "adapter_model.safetensors"
PEFT_DEFAULT_LORA_ALPHA = 8  # `peft.LoraConfig`'s default lora_alpha
PEFT_CONFIG_FILE = "adapter_config.json"
_PREFIXES = ("base_model.model.", "diffusion_model.", "transformer.")
_WEIGHT_KEY = re.compile(r"^(?P<module>.+)\.lora_(?P<kind>[AB])(?:\.(?P<adapter>[^.]+))?\.(?P<param>weight|bias)$")
_EMBEDDING_KEY = re.compile(r"^(?P<module>.+)\.lora_embedding_(?P<kind>[AB])(?:\.(?P<adapter>[^.]+))?$")
# PEFT's `get_peft_model_state_dict` (so diffusers' `save_lora_adapter`) writes `<module>.lora_magnitude_vector`; a raw
# PEFT state dict has `.lora_magnitude_vector[.<adapter name>].weight`.
_MAGNITUDE_KEY = re.compile(r"^(?P<module>.+)\.lora_magnitude_vector(?:\.(?P<adapter>[^.]+)\.weight|\.weight)?$")
_ALPHA_KEY = re.compile(r"^(?P<module>.+)\.alpha$")
# kohya: the module path flattened with "_" (resolved against the model in targets.py); down = A, up = B.
_KOHYA_KEY = re.compile(r"^lora_(?:unet|transformer)_(?P<module>[^.]+)\.(?:lora_(?P<kind>down|up)\.weight|"
                        r"(?P<extra>alpha|dora_scale))$")
_DORA_SCALE_KEY = re.compile(r"^(?P<module>.+)\.dora_scale$")  # LyCORIS's DoRA magnitudes after a dotted path
# ComfyUI's LoRA save / extract / training nodes: kohya's factor names after a dotted module path.
_DOTTED_KOHYA_KEY = re.compile(r"^(?P<module>.+)\.lora_(?P<kind>down|up)\.weight$")
_SHOWN = 5  # how many offending keys an error lists
# diffusers' `save_lora_weights` (its training scripts) and `save_lora_adapter` write no `<module>.alpha` keys: the
# adapter's PEFT `LoraConfig` goes into the safetensors header as JSON under this key (`lora_alpha`, `alpha_pattern`,
# `use_rslora`, ...; each field prefixed `transformer.` when saved from a pipeline), and diffusers'
# `load_lora_adapter` scales the adapter by it. Reading the tensors alone applied such an adapter at alpha = rank
# (scale 1) instead of lora_alpha / rank (tests/parity/test_lora_parity.py).
LORA_METADATA_KEY = "lora_adapter_metadata"


@dataclass(frozen=True, kw_only=True, slots=True)
class LoraModule:
    """One targeted layer's low-rank pair: the update is (alpha / rank) * up @ down, in the layer's Linear view (an
    Embedding's table transposed: out = embedding_dim, in = num_embeddings)."""

    down: torch.Tensor  # lora_A, (rank, in_features)
    up: torch.Tensor  # lora_B, (out_features, rank)
    alpha: float | None  # from the file; None: rank (scale 1)
    magnitude: torch.Tensor | None = None  # DoRA's lora_magnitude_vector, (out_features,)
    bias: torch.Tensor | None = None  # lora_B.bias (PEFT's lora_bias), (out_features,); added scaled like up
    embedding: bool = False  # lora_embedding_A / _B: the target is an nn.Embedding

    @property
    def rank(self) -> int:
        return self.down.shape[0]


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
    names = ", ".join(file.name for file in files[:_SHOWN])
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
                             f".safetensors files ({', '.join(files[:_SHOWN])}); exactly one is needed")
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


def _key_kind(key: str) -> tuple[str, re.Match | None]:
    """What a state-dict key is, by its name alone: ("kohya" | "dotted_kohya" | "dora_scale" | "embedding" |
    "weight" | "magnitude" | "alpha", its match), or ("unknown", None). `parse_lora_state_dict` reads the tensors by
    it; `read_adapter` checks a file's header names with it before reading any tensor."""
    name = _strip_prefix(key)
    for kind, pattern in (("kohya", _KOHYA_KEY), ("dotted_kohya", _DOTTED_KOHYA_KEY), ("dora_scale", _DORA_SCALE_KEY),
                          ("embedding", _EMBEDDING_KEY)):
        if match := pattern.match(name):
            return kind, match
    if (match := _WEIGHT_KEY.match(name)) and not (match["kind"] == "A" and match["param"] == "bias"):
        return "weight", match
    for kind, pattern in (("magnitude", _MAGNITUDE_KEY), ("alpha", _ALPHA_KEY)):
        if match := pattern.match(name):
            return kind, match
    return "unknown", None


def _unknown_keys_error(unknown: list[str], source: str) -> ValueError:
    return ValueError(f"LoRA file {source!r}: {len(unknown)} key(s) are not diffusers/PEFT LoRA keys "
                      f"(<module>.lora_A.weight, <module>.lora_B.weight, <module>.alpha, and PEFT's "
                      f"<module>.lora_B.bias, <module>.lora_magnitude_vector (DoRA), <module>.lora_embedding_A / "
                      f"_B), ComfyUI ones (<module>.lora_down.weight / .lora_up.weight / .alpha, under "
                      f"diffusion_model.) nor kohya ones (lora_unet_<module>.lora_down.weight / .lora_up.weight / "
                      f".alpha, and LyCORIS's DoRA .dora_scale), e.g. {unknown[:_SHOWN]}")


def _strip_prefix(key: str) -> str:
    for prefix in _PREFIXES:  # in order: PEFT's "base_model.model." may wrap a "transformer."
        key = key.removeprefix(prefix)
    return key


def parse_lora_state_dict(tensors: dict[str, torch.Tensor], *, source: str, metadata: dict[str, str] | None = None,
                          peft_config: dict | None = None) -> dict[str, LoraModule]:
    """Group a diffusers / PEFT LoRA state dict by module; `source` names the file in errors, `metadata` is the
    file's safetensors header (its `LORA_METADATA_KEY` entry may hold the alphas), `peft_config` the PEFT_CONFIG_FILE
    found beside the file (`_peft_folder_config`)."""
    # diffusers builds `LoraConfig(**header)`: a header without lora_alpha gets PEFT's default (8), not the rank.
    configs = [_LoraConfig(fields={"lora_alpha": PEFT_DEFAULT_LORA_ALPHA, **fields},
                           name=f"the {LORA_METADATA_KEY} header", short="header", reader="diffusers")
               for fields in [_header_config(metadata, source)] if fields is not None]
    if peft_config is not None:
        configs.append(_LoraConfig(fields=peft_config, name=f"the {PEFT_CONFIG_FILE} beside it",
                                   short=PEFT_CONFIG_FILE, reader="PEFT"))
    for config in configs:  # first: an option like modules_to_save or bias="all" also explains the keys it adds
        _check_config_options(config, source)
    factor_keys: dict[tuple[str, str], str] = {}  # (module, "down" / "up") -> the key read for it
    downs: dict[str, torch.Tensor] = {}
    ups: dict[str, torch.Tensor] = {}
    alphas: dict[str, float] = {}
    magnitudes: dict[str, torch.Tensor] = {}
    biases: dict[str, torch.Tensor] = {}
    dora_scales: dict[str, tuple[str, torch.Tensor]] = {}  # module -> (its dora_scale key, the tensor)
    embeddings: set[str] = set()  # modules with lora_embedding_A / _B keys
    linears: set[str] = set()  # modules with lora_A / lora_B keys
    adapter_names: set[str] = set()
    unknown: list[str] = []
    for key, tensor in tensors.items():
        kind, match = _key_kind(key)
        if kind == "kohya":
            if match["extra"] == "alpha":
                alphas[match["module"]] = _alpha(tensor, key, source)
            elif match["extra"] == "dora_scale":
                dora_scales[match["module"]] = (key, tensor)
            else:
                _add_factor(downs, ups, factor_keys, match["module"], match["kind"], key, tensor, source)
            continue
        if kind == "dotted_kohya":
            _add_factor(downs, ups, factor_keys, match["module"], match["kind"], key, tensor, source)
            linears.add(match["module"])
            continue
        if kind == "dora_scale":
            dora_scales[match["module"]] = (key, tensor)
            continue
        if kind == "embedding":
            _add_factor(downs, ups, factor_keys, match["module"], "down" if match["kind"] == "A" else "up", key,
                        tensor, source)
            embeddings.add(match["module"])
        elif kind == "weight":
            if match["param"] == "bias":
                biases[match["module"]] = tensor
            else:
                _add_factor(downs, ups, factor_keys, match["module"], "down" if match["kind"] == "A" else "up", key,
                            tensor, source)
                linears.add(match["module"])
        elif kind == "magnitude":
            magnitudes[match["module"]] = tensor
        elif kind == "alpha":
            alphas[match["module"]] = _alpha(tensor, key, source)
            continue
        else:
            unknown.append(key)
            continue
        if match["adapter"]:
            adapter_names.add(match["adapter"])
    if unknown:
        raise _unknown_keys_error(unknown, source)
    if len(adapter_names) > 1:
        raise ValueError(f"LoRA file {source!r} holds several PEFT adapters ({sorted(adapter_names)}); save one "
                         "adapter per file")
    if not downs and not ups:
        raise ValueError(f"LoRA file {source!r} holds no lora_A / lora_B weights")
    unpaired = sorted(set(downs) ^ set(ups))
    if unpaired:
        raise ValueError(f"LoRA file {source!r}: module(s) with only one of lora_A / lora_B: {unpaired[:_SHOWN]}")
    magnitude_keys = _dora_scale_magnitudes(dora_scales, downs, ups, magnitudes, source)
    _check_variants(downs, magnitudes, biases, embeddings, linears, source)
    origins = dict.fromkeys(alphas, "its .alpha key")
    for config in configs:
        _check_config_variants(config, magnitudes, biases, source)
        for module, alpha in _config_alphas(config, downs, source).items():
            # No precedence: diffusers reads only the header (and refuses `network_alphas` together with it), PEFT
            # only its JSON, and the .alpha keys are kohya's. Each is the whole adapter's scale to the tool that
            # wrote it, so a disagreement means two adapters' parts in one place: refused rather than one picked.
            if alphas.setdefault(module, alpha) != alpha:
                raise ValueError(f"LoRA file {source!r}: module {module!r} has alpha {alphas[module]:g} in "
                                 f"{origins[module]} but {alpha:g} in {config.name}; keep one of them")
            origins.setdefault(module, config.name)
    modules = {}
    for module, down in downs.items():
        up = ups[module]
        if down.dim() != 2 or up.dim() != 2 or down.shape[0] != up.shape[1] or down.shape[0] == 0:
            raise ValueError(f"LoRA file {source!r}: module {module!r} has lora_A {tuple(down.shape)} and lora_B "
                             f"{tuple(up.shape)}; expected lora_A (rank, in_features) and lora_B (out_features, rank), "
                             "rank >= 1")
        extras = {magnitude_keys.get(module, "lora_magnitude_vector"): magnitudes.get(module),
                  "lora_B.bias": biases.get(module)}
        for kind, tensor in extras.items():
            if tensor is not None and tuple(tensor.shape) != (up.shape[0],):
                raise ValueError(f"LoRA file {source!r}: module {module!r} has {kind} {tuple(tensor.shape)}, but its "
                                 f"lora_B {tuple(up.shape)} gives {up.shape[0]} output features; expected "
                                 f"({up.shape[0]},)")
        for kind, tensor in (("lora_A", down), ("lora_B", up), *extras.items()):
            if tensor is not None:
                _check_values(tensor, kind, module, source)
        modules[module] = LoraModule(down=down, up=up, alpha=alphas.get(module), magnitude=magnitudes.get(module),
                                     bias=biases.get(module), embedding=module in embeddings)
    return modules


def _add_factor(downs: dict[str, torch.Tensor], ups: dict[str, torch.Tensor], factor_keys: dict[tuple[str, str], str],
                module: str, kind: str, key: str, tensor: torch.Tensor, source: str) -> None:
    """Record `tensor` as `module`'s down (lora_A) or up (lora_B) factor (`kind`), refusing a second key for it (a
    lora_A and a lora_down, or the same name under two prefixes): one of them would be dropped silently."""
    if (module, kind) in factor_keys:
        raise ValueError(f"LoRA file {source!r}: {factor_keys[module, kind]!r} and {key!r} are both the "
                         f"{'lora_A (down)' if kind == 'down' else 'lora_B (up)'} factor of module {module!r}; "
                         "a module has one pair, so the file mixes two adapters (save one adapter per file)")
    factor_keys[module, kind] = key
    (downs if kind == "down" else ups)[module] = tensor


def _dora_scale_magnitudes(dora_scales: dict[str, tuple[str, torch.Tensor]], downs: dict[str, torch.Tensor],
                           ups: dict[str, torch.Tensor], magnitudes: dict[str, torch.Tensor],
                           source: str) -> dict[str, str]:
    """Add LyCORIS's DoRA magnitudes (`dora_scale`) to `magnitudes` as PEFT's; returns module -> the name to give
    the tensor in errors ("dora_scale").

    LyCORIS's `weight_decompose` (lycoris/modules/locon.py) keeps a Linear's magnitudes as `dora_scale`: with
    `wd_on_out=True` of shape (out, 1), the norm of each output row over the input features, and the weight becomes
    dora_scale / ||W + (alpha / rank) B A|| * (W + (alpha / rank) B A), PEFT's DoRA (`lora_magnitude_vector`, (out,))
    at strength 1. (LyCORIS adds fp32's eps, 1.2e-7, to each norm, which PEFT and this reading do not: a relative
    1.2e-7 / ||row|| on the rows.) With `wd_on_out=False` it is (1, in), the norm of each input column over the
    output features: a different decomposition, which no per-row magnitude reproduces, so it is refused. At a
    strength s other than 1 the manager applies PEFT's rule, m / ||W + s dW|| * (W + s dW); LyCORIS and ComfyUI
    scale such a module by interpolating between the base weight and the strength-1 one instead (a convention of
    those tools about strength, not a property of the file)."""
    names = {}
    for module, (key, tensor) in dora_scales.items():
        if module not in downs or module not in ups:
            raise ValueError(f"LoRA file {source!r}: {key!r} (LyCORIS's DoRA magnitudes) belongs to no module with "
                             "lora_down / lora_up (lora_A / lora_B) weights")
        if module in magnitudes:
            raise ValueError(f"LoRA file {source!r}: module {module!r} has both a lora_magnitude_vector and a "
                             f"dora_scale ({key!r}); a DoRA module has one set of magnitudes")
        if downs[module].dim() != 2 or ups[module].dim() != 2:
            continue  # refused below, with the lora_A / lora_B shapes
        out_features, in_features = ups[module].shape[0], downs[module].shape[1]
        shape = tuple(tensor.shape)
        if shape == (out_features, 1):
            magnitudes[module] = tensor.reshape(out_features)
            names[module] = "dora_scale"
        elif shape == (1, in_features):
            raise ValueError(
                f"LoRA file {source!r}: {key!r} has shape {shape}: LyCORIS's DoRA with wd_on_out=False, whose "
                f"magnitudes are the norms of the weight's {in_features} input columns (over the output features). "
                "PEFT's DoRA, which k6serve applies, normalises each output row (over the input features), and "
                "neither decomposition can be expressed in the other, so the adapter is refused rather than applied "
                f"otherwise than it was trained: retrain it with wd_on_out=True (dora_scale of shape "
                f"({out_features}, 1)), or use a PEFT DoRA adapter (use_dora=True).")
        else:
            raise ValueError(f"LoRA file {source!r}: {key!r} has shape {shape}, but its lora_down / lora_up give a "
                             f"{in_features} -> {out_features} layer; expected ({out_features}, 1) (LyCORIS's DoRA "
                             "magnitudes of the output rows)")
    return names


def _check_values(tensor: torch.Tensor, kind: str, module: str, source: str) -> None:
    # An integer (quantised) tensor has no scale to go with it here; a NaN or inf would only surface as a request
    # failing on NaN latents, with the adapter merged.
    if not tensor.is_floating_point():
        dtype = str(tensor.dtype).removeprefix("torch.")
        raise ValueError(f"LoRA file {source!r}: module {module!r}: {kind} is {dtype}; LoRA weights must be "
                         "float32, float16 or bfloat16 (save the adapter unquantised)")
    if not torch.isfinite(tensor).all():
        raise ValueError(f"LoRA file {source!r}: module {module!r}: {kind} holds NaN or infinite values, "
                         "so the adapter is damaged (e.g. a diverged training run); use another checkpoint")


def _check_variants(downs: dict[str, torch.Tensor], magnitudes: dict[str, torch.Tensor],
                    biases: dict[str, torch.Tensor], embeddings: set[str], linears: set[str], source: str) -> None:
    """The DoRA magnitudes, lora_B biases and embedding pairs belong to modules with a low-rank pair, in the
    combinations PEFT can build."""
    stray = sorted((set(magnitudes) | set(biases)) - set(downs))
    if stray:
        raise ValueError(f"LoRA file {source!r}: module(s) with a lora_magnitude_vector or lora_B.bias but no "
                         f"lora_A / lora_B: {stray[:_SHOWN]}")
    both = sorted(set(magnitudes) & set(biases))
    if both:
        # PEFT's LoraConfig refuses lora_bias=True with use_dora=True, so neither it nor diffusers has a meaning
        # for the pair.
        raise ValueError(f"LoRA file {source!r}: module(s) {both[:_SHOWN]} have both a lora_magnitude_vector (DoRA) "
                         "and a lora_B.bias; PEFT does not combine the two (LoraConfig refuses lora_bias with "
                         "use_dora), so the file was not written by it")
    mixed = sorted(embeddings & (linears | set(biases)))
    if mixed:
        raise ValueError(f"LoRA file {source!r}: module(s) {mixed[:_SHOWN]} have lora_embedding_A / _B keys (an "
                         "Embedding's LoRA) and lora_A / lora_B ones (a Linear's); PEFT writes one kind per module")


def _header_config(metadata: dict[str, str] | None, source: str) -> dict | None:
    """The PEFT `LoraConfig` fields diffusers stores in the header for the DiT (None without one)."""
    raw = (metadata or {}).get(LORA_METADATA_KEY)
    if not raw:
        return None
    try:
        config = json.loads(raw)
    except (json.JSONDecodeError, RecursionError) as exc:  # nested 50,000 deep: a RecursionError, a 500 with a trace
        raise ValueError(f"LoRA file {source!r}: its {LORA_METADATA_KEY} header is not valid JSON ({exc})") from None
    if not isinstance(config, dict):
        raise ValueError(f"LoRA file {source!r}: its {LORA_METADATA_KEY} header is not a JSON object")
    # A pipeline's `save_lora_weights` prefixes each field with the component (`transformer.lora_alpha`); a
    # model's `save_lora_adapter` does not. Other components' fields (a text encoder's) do not concern the DiT.
    prefixed = {key.removeprefix("transformer."): value for key, value in config.items()
                if key.startswith("transformer.")}
    return prefixed or config


@dataclass(frozen=True, kw_only=True, slots=True)
class _LoraConfig:
    """A PEFT `LoraConfig` that came with the weights (diffusers' header or PEFT's JSON), and how errors name it."""

    fields: dict
    name: str  # "the lora_adapter_metadata header", "the adapter_config.json beside it"
    short: str  # "header", "adapter_config.json"
    reader: str  # the library that applies the adapter from it: "diffusers" or "PEFT"


# LoraConfig fields that change nothing in the update a saved adapter makes on this DiT.
_INERT_FIELDS = frozenset({
    "peft_version", "auto_mapping", "base_model_name_or_path", "revision", "task_type", "inference_mode",
    "runtime_config",  # bookkeeping
    "target_modules", "exclude_modules", "layers_to_transform", "layers_pattern",  # what was adapted: the keys say it
    "lora_dropout",  # training only
    "fan_in_fan_out",  # PEFT sets it back to False on an nn.Linear and an nn.Embedding ignores it: the DiT's targets
    "megatron_config", "megatron_core",  # Megatron's parallel layers only
    "qalora_group_size", "loftq_config", "eva_config", "corda_config", "lora_ga_config",  # read with their switch only
    "ensure_weight_tying",  # tied layers (an LLM's embedding and head); the DiT has none
    "velora_config",  # VeLoRA changes the backward pass only; its merge is plain LoRA's
})
_READ_FIELDS = frozenset({"r", "lora_alpha", "rank_pattern", "alpha_pattern", "use_rslora", "use_dora", "lora_bias"})
# init_lora_weights values that leave the base weights as they were. PiSSA, OLoRA, CorDA, LoftQ and LoRA-GA rewrite
# them (W - the initial B A, or a quantised W), so their adapter fits only the base saved with it.
_PLAIN_INITS = ("gaussian", "eva", "orthogonal", "mica")


def _check_config_options(config: _LoraConfig, source: str) -> None:
    """Refuse a config whose options change the math in ways k6serve does not apply (anything but plain LoRA,
    rsLoRA, DoRA and lora_bias), rather than apply the adapter otherwise than PEFT would."""
    where = f"LoRA file {source!r}: {config.name}"
    for field, value in config.fields.items():
        if field in _INERT_FIELDS or field in _READ_FIELDS:
            continue
        if field == "peft_type":
            if value != "LORA":
                raise ValueError(f"{where} says peft_type={value!r}: not a LoRA adapter; k6serve reads LoRA (and "
                                 "DoRA) adapters only")
        elif field == "init_lora_weights":
            if not (isinstance(value, bool) or value in _PLAIN_INITS):
                raise ValueError(f"{where} says init_lora_weights={value!r}: that initialisation rewrites the base "
                                 "weights, so the adapter fits only the base saved with it; save it from PEFT again "
                                 "with save_pretrained(..., path_initial_model_for_weight_conversion=<the initial "
                                 "adapter>), which turns it into a plain LoRA of the original weights")
        elif field == "bias":
            if value != "none":
                raise ValueError(f"{where} says bias={value!r}: the adapter also trained the layers' own biases, "
                                 "which k6serve does not load; train it with bias='none' (or lora_bias=True)")
        elif value not in (None, False, "", [], {}):
            # modules_to_save, layer_replication, target_parameters, trainable_token_indices, use_qalora, aLoRA,
            # Arrow, BD-LoRA, KaSA, MonteCLoRA, and fields of PEFT versions after 0.21.
            raise ValueError(f"{where} sets {field}={value!r}, which changes what {config.reader} does with the "
                             "adapter beyond plain LoRA, rsLoRA, DoRA and lora_bias (the options k6serve applies); "
                             f"use an adapter trained without {field}")


def _check_config_variants(config: _LoraConfig, magnitudes: dict[str, torch.Tensor], biases: dict[str, torch.Tensor],
                           source: str) -> None:
    """Refuse a config whose `use_dora` / `lora_bias` contradicts the keys. diffusers and PEFT build the layers from
    the config alone: DoRA layers without magnitudes get them computed from the base weight, and magnitudes or
    biases the config does not ask for are skipped with a warning. Reading the keys alone would apply something
    else than they do, silently."""
    where = f"LoRA file {source!r}: {config.name}"
    fields, mismatch = config.fields, f"the {config.short} and the weights come from different adapters"
    if "use_dora" in fields and bool(fields["use_dora"]) != bool(magnitudes):
        found = (f"{len(magnitudes)} lora_magnitude_vector keys" if magnitudes else "no lora_magnitude_vector keys")
        raise ValueError(f"{where} says use_dora={fields['use_dora']!r}, but the file holds {found}; {mismatch} "
                         f"({config.reader} would apply the {config.short}'s)")
    if "lora_bias" in fields and not fields["lora_bias"] and biases:
        raise ValueError(f"{where} says lora_bias={fields['lora_bias']!r}, but the file holds {len(biases)} "
                         f"lora_B.bias keys, which {config.reader} would skip; {mismatch}")


def _pattern_key(patterns: dict, module: str, where: str) -> str | None:
    """The first of `patterns` that matches the end of `module`'s path, as peft's `get_pattern_key` finds it
    (`_config_alphas` has checked each pattern's cost, once, before the first module)."""
    try:
        return next((key for key in patterns if re.match(rf"(.*\.)?({key})$", module)), None)
    except re.error as exc:
        raise ValueError(f"{where} holds a pattern that is not a regular expression ({exc})") from None


# Open-ended repeats (`*`, `+`, `{n,}`) a pattern may hold: Python's backtracking matcher tries each split of the
# path between them, about len(path) ** count steps for a path that does not match (5 took 0.09 s a module, a
# minute for a DiT's hundreds of modules; peft's own patterns hold one or two `.*`).
_MAX_OPEN_REPEATS = 3
_SHORT_REPEAT = 8  # a repeat of at most this many counts as a few literals, not as open-ended
_MAX_REPEATS = 8  # repeats of any length


def _check_pattern_cost(key: str, where: str) -> None:
    """Refuse an alpha_pattern / rank_pattern key whose matching would not end in any useful time: a repeat or an
    alternation inside a repeat (`([a-z_.]+)+X` hung the loader, the server's set_lora among them, at 100% CPU, as a
    28-character path took 8 s), more than `_MAX_OPEN_REPEATS` open-ended repeats, or more than `_MAX_REPEATS`
    repeats of any length. The file comes from someone else; its patterns are checked before they are matched."""
    import re._parser as parser  # the stdlib's parser of the patterns re compiles (Python >= 3.11)

    if not isinstance(key, str):
        raise ValueError(f"{where} holds the key {key!r}, which is not a pattern (a string)")
    try:
        parsed = parser.parse(key)
    except re.error as exc:
        raise ValueError(f"{where} holds a pattern that is not a regular expression ({exc})") from None
    repeats = (parser.MAX_REPEAT, parser.MIN_REPEAT, getattr(parser, "POSSESSIVE_REPEAT", parser.MAX_REPEAT))
    open_ended = any_repeats = 0

    def nested() -> ValueError:
        return ValueError(f"{where} holds the pattern {key!r}, with a repeat or an alternation inside a repeat, whose "
                          "matching can take hours on a path it does not match; peft's patterns name the end of a "
                          "module path (e.g. 'blocks\\.0\\.attn' or '.*to_q'), so write it without nesting them")

    def walk(items, inside_repeat: bool) -> None:
        nonlocal open_ended, any_repeats
        for op, value in items:
            if op in repeats:
                low, high, body = value
                repeats_body = high > 1  # `?` (at most once) tries one split, not one per length
                if inside_repeat and repeats_body:
                    raise nested()
                # `.{0,60}` splits a path as many ways as `.*` does on a module path's length; many short ones
                # (`.{0,8}` thirty times) multiply as much.
                open_ended += high > _SHORT_REPEAT
                any_repeats += repeats_body
                walk(body, inside_repeat or repeats_body)
            elif op == parser.SUBPATTERN:
                walk(value[-1], inside_repeat)
            elif op == parser.BRANCH:
                if inside_repeat:  # `(.|\w)+`: each character matched two ways, 2 ** len(path) tries
                    raise nested()
                for branch in value[1]:
                    walk(branch, inside_repeat)
            elif op in (parser.ASSERT, parser.ASSERT_NOT):
                walk(value[1], inside_repeat)
            elif op == getattr(parser, "ATOMIC_GROUP", None):  # (?>...): its inside backtracks as any other
                walk(value, inside_repeat)
            elif op == parser.GROUPREF_EXISTS:  # (?(1)yes|no)
                for branch in value[1:]:
                    if branch:
                        walk(branch, inside_repeat)

    walk(parsed, False)
    if any_repeats > _MAX_REPEATS:
        raise ValueError(f"{where} holds the pattern {key!r}, with {any_repeats} repeats, whose matching can take "
                         f"minutes on a path it does not match; use at most {_MAX_REPEATS} (peft's patterns hold one "
                         "or two)")
    if open_ended > _MAX_OPEN_REPEATS:
        raise ValueError(f"{where} holds the pattern {key!r}, with {open_ended} open-ended repeats (*, +, {{n,}}, "
                         f"{{0,{_SHORT_REPEAT + 1}}} and longer), "
                         f"whose matching can take minutes on a path it does not match; use at most "
                         f"{_MAX_OPEN_REPEATS} (peft's patterns hold one or two '.*')")


def _config_alphas(config: _LoraConfig, downs: dict[str, torch.Tensor], source: str) -> dict[str, float]:
    """Each module's alpha from a PEFT `LoraConfig` (empty without `lora_alpha`), as PEFT's `_create_and_replace`
    resolves it: `alpha_pattern`'s first pattern that matches the module path's end (`_pattern_key`), else
    `lora_alpha`; rank likewise from `rank_pattern` / `r`, which must be the weights' (PEFT would fail to load them
    otherwise). An rsLoRA adapter (`use_rslora`) is scaled by alpha / sqrt(rank) there: as our alpha / rank, that is
    an alpha of alpha * sqrt(rank)."""
    fields, where = config.fields, f"LoRA file {source!r}: {config.name}"
    patterns = {}
    for field in ("alpha_pattern", "rank_pattern"):
        patterns[field] = fields.get(field) or {}
        if not isinstance(patterns[field], dict):
            raise ValueError(f"{where}'s {field} must be an object (pattern -> value), got {patterns[field]!r}")
        for key in patterns[field]:  # before any is matched, and once, not for each of the DiT's modules
            _check_pattern_cost(key, f"{where}'s {field}")
    alphas = {}
    for module, down in downs.items():
        rank_key = _pattern_key(patterns["rank_pattern"], module, f"{where}'s rank_pattern")
        rank = fields.get("r") if rank_key is None else patterns["rank_pattern"][rank_key]
        if rank is not None and (isinstance(rank, bool) or rank != down.shape[0]):
            field = "r" if rank_key is None else f"rank_pattern[{rank_key!r}]"
            raise ValueError(f"{where} gives module {module!r} rank {rank!r} ({field}), but its lora_A has rank "
                             f"{down.shape[0]}; the {config.short} and the weights come from different adapters")
        if "lora_alpha" not in fields:
            continue
        alpha_key = _pattern_key(patterns["alpha_pattern"], module, f"{where}'s alpha_pattern")
        alpha = (_header_alpha(fields["lora_alpha"], f"{where}'s lora_alpha") if alpha_key is None else
                 _header_alpha(patterns["alpha_pattern"][alpha_key], f"{where}'s alpha_pattern[{alpha_key!r}]"))
        if fields.get("use_rslora"):
            alpha *= math.sqrt(down.shape[0])
        check_lora_alpha(alpha, f"{where} (module {module!r}'s alpha)")
        alphas[module] = alpha
    return alphas


def _header_alpha(value: object, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{name} (an alpha) must be a finite number, got {value!r}")
    check_lora_alpha(value, name)
    return float(value)


def _alpha(tensor: torch.Tensor, key: str, source: str) -> float:
    """A module's alpha: one finite number within `MAX_LORA_ALPHA`."""
    if tensor.numel() != 1:
        raise ValueError(f"LoRA file {source!r}: {key!r} must hold one number (the module's alpha), got a tensor of "
                         f"shape {tuple(tensor.shape)}")
    alpha = float(tensor.item())
    if not math.isfinite(alpha):
        raise ValueError(f"LoRA file {source!r}: {key!r} (the module's alpha) is {alpha}; it must be a finite number")
    check_lora_alpha(alpha, f"LoRA file {source!r}: {key!r} (the module's alpha)")
    return alpha


def file_stamp(file: Path) -> tuple[int, int, int] | None:
    """(inode, size, mtime in ns) of `file` (symlinks followed, as the hub cache's are), or None if it is gone."""
    try:
        stat = file.stat()
    except OSError:
        return None
    return stat.st_ino, stat.st_size, stat.st_mtime_ns


def _header_metadata(data: bytes) -> dict[str, str] | None:
    """The `__metadata__` of a safetensors file's JSON header (`safe_open(...).metadata()`), from its bytes, which
    `safetensors.torch.load` has checked."""
    (length,) = struct.unpack("<Q", data[:8])
    metadata = json.loads(data[8:8 + length]).get("__metadata__")
    return metadata if isinstance(metadata, dict) else None


def _peft_folder_config(file: Path) -> dict | None:
    """The PEFT `LoraConfig` that `save_pretrained` wrote beside `file` as PEFT_CONFIG_FILE (None without one)."""
    config_file = file.parent / PEFT_CONFIG_FILE
    if not config_file.is_file():
        return None
    where = f"LoRA file {str(file)!r}: the {PEFT_CONFIG_FILE} beside it"
    others = sorted(other.name for other in file.parent.glob("*.safetensors") if other.name != file.name)
    if file.name != PEFT_WEIGHTS_FILE and others:
        # PEFT's config belongs to its own PEFT_WEIGHTS_FILE; next to several other files it may be any one's.
        raise ValueError(f"{where} (a PEFT adapter's config, which sets its scale) may belong to another of the "
                         f"folder's .safetensors files ({', '.join(others[:_SHOWN])}); put the adapter in a folder "
                         f"of its own, with its {PEFT_CONFIG_FILE} if it is this file's")
    try:
        config = json.loads(config_file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise ValueError(f"{where} cannot be read as JSON ({exc}); save the adapter again with PEFT's "
                         "save_pretrained") from None
    if not isinstance(config, dict):
        raise ValueError(f"{where} is not a JSON object; save the adapter again with PEFT's save_pretrained")
    missing = [field for field in ("r", "lora_alpha") if field not in config]
    if missing:
        # PEFT writes every field; without these it would use its defaults (r=8, lora_alpha=8), which no file states.
        raise ValueError(f"{where} has no {' / '.join(missing)}, which PEFT's save_pretrained always writes and "
                         "which set the adapter's scale (lora_alpha / r); add them as the adapter was trained")
    return config


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
            unknown = [key for key in handle.keys() if _key_kind(key)[0] == "unknown"]
            with_config = LORA_METADATA_KEY in (handle.metadata() or {})
        # Not where a PEFT config comes with it: its options (modules_to_save, bias="all") add keys of their own, and
        # the parse says which option, not only which keys.
        if unknown and not with_config and not (file.parent / PEFT_CONFIG_FILE).is_file():
            raise _unknown_keys_error(unknown, str(file))
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
                                    peft_config=_peft_folder_config(file))
    return LoraAdapter(path=path, file=file, modules=modules, stamp=stamp, config_stamp=config_stamp)
