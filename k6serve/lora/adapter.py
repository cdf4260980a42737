"""Reading a LoRA adapter: where the file is (a path, a folder, a hub id) and what its keys mean.

Two layouts are read:
* diffusers / PEFT: `<module>.lora_A[.<adapter name>].weight` (rank x in) and `<module>.lora_B[.<adapter
  name>].weight` (out x rank), optionally `<module>.alpha`, under a `transformer.`, `base_model.model.`,
  `diffusion_model.` (ComfyUI) or no prefix; the alpha may instead be in the file's header, where diffusers'
  `save_lora_weights` / `save_lora_adapter` put the adapter's PEFT config (`_metadata_alphas`). Also PEFT's
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

# PEFT writes this name; diffusers' `save_lora_weights` too. Preferred when a folder holds several files.
PREFERRED_FILE = "pytorch_lora_weights.safetensors"
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

    def unchanged(self) -> bool:
        """Whether `file` is still the one read (same inode, size and modification time): a set_lora naming the
        same path again reuses this adapter only then. An adapter retrained and saved over its file was otherwise
        kept from the first read, silently serving the old weights under the new file's name."""
        return self.stamp is not None and file_stamp(self.file) == self.stamp

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
    files = sorted(folder.glob("*.safetensors"))
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
    """Fetch the adapter file of hub repo `repo_id`: `PREFERRED_FILE`, else the repo's only .safetensors."""
    from huggingface_hub import hf_hub_download, list_repo_files, snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    try:
        # snapshot_download first: where the hub cannot be reached it fails at once (or serves a cached copy of the
        # repo), where hf_hub_download and the repo listing each retry the connection with back-off (49 s on a host
        # without network before the same error).
        try:
            folder = Path(snapshot_download(repo_id, allow_patterns=[PREFERRED_FILE]))
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


def _strip_prefix(key: str) -> str:
    for prefix in _PREFIXES:  # in order: PEFT's "base_model.model." may wrap a "transformer."
        key = key.removeprefix(prefix)
    return key


def parse_lora_state_dict(tensors: dict[str, torch.Tensor], *, source: str,
                          metadata: dict[str, str] | None = None) -> dict[str, LoraModule]:
    """Group a diffusers / PEFT LoRA state dict by module; `source` names the file in errors, `metadata` is the
    file's safetensors header (its `LORA_METADATA_KEY` entry may hold the alphas)."""
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
        name = _strip_prefix(key)
        if match := _KOHYA_KEY.match(name):
            if match["extra"] == "alpha":
                alphas[match["module"]] = _alpha(tensor, key, source)
            elif match["extra"] == "dora_scale":
                dora_scales[match["module"]] = (key, tensor)
            else:
                (downs if match["kind"] == "down" else ups)[match["module"]] = tensor
            continue
        if match := _DORA_SCALE_KEY.match(name):
            dora_scales[match["module"]] = (key, tensor)
            continue
        if match := _EMBEDDING_KEY.match(name):
            (downs if match["kind"] == "A" else ups)[match["module"]] = tensor
            embeddings.add(match["module"])
        elif (match := _WEIGHT_KEY.match(name)) and not (match["kind"] == "A" and match["param"] == "bias"):
            if match["param"] == "bias":
                biases[match["module"]] = tensor
            else:
                (downs if match["kind"] == "A" else ups)[match["module"]] = tensor
                linears.add(match["module"])
        elif match := _MAGNITUDE_KEY.match(name):
            magnitudes[match["module"]] = tensor
        elif match := _ALPHA_KEY.match(name):
            alphas[match["module"]] = _alpha(tensor, key, source)
            continue
        else:
            unknown.append(key)
            continue
        if match["adapter"]:
            adapter_names.add(match["adapter"])
    if unknown:
        raise ValueError(f"LoRA file {source!r}: {len(unknown)} key(s) are not diffusers/PEFT LoRA keys "
                         f"(<module>.lora_A.weight, <module>.lora_B.weight, <module>.alpha, and PEFT's "
                         f"<module>.lora_B.bias, <module>.lora_magnitude_vector (DoRA), <module>.lora_embedding_A / "
                         f"_B) nor kohya ones (lora_unet_<module>.lora_down.weight / .lora_up.weight / .alpha, and "
                         f"LyCORIS's DoRA .dora_scale), e.g. {unknown[:_SHOWN]}")
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
    config = _header_config(metadata, source)
    _check_header_variants(config, magnitudes, biases, source)
    header_alphas = _metadata_alphas(config, downs, source)
    for module, alpha in header_alphas.items():
        # Both in one file have no agreed meaning (diffusers refuses `network_alphas` together with a header): a
        # disagreement is refused rather than one of them picked.
        if alphas.setdefault(module, alpha) != alpha:
            raise ValueError(f"LoRA file {source!r}: module {module!r} has alpha {alphas[module]:g} in its .alpha key "
                             f"but {alpha:g} in the {LORA_METADATA_KEY} header; keep one of them")
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
    except json.JSONDecodeError as exc:
        raise ValueError(f"LoRA file {source!r}: its {LORA_METADATA_KEY} header is not valid JSON ({exc})") from None
    if not isinstance(config, dict):
        raise ValueError(f"LoRA file {source!r}: its {LORA_METADATA_KEY} header is not a JSON object")
    # A pipeline's `save_lora_weights` prefixes each field with the component (`transformer.lora_alpha`); a
    # model's `save_lora_adapter` does not. Other components' fields (a text encoder's) do not concern the DiT.
    prefixed = {key.removeprefix("transformer."): value for key, value in config.items()
                if key.startswith("transformer.")}
    return prefixed or config


def _check_header_variants(config: dict | None, magnitudes: dict[str, torch.Tensor], biases: dict[str, torch.Tensor],
                           source: str) -> None:
    """Refuse a header whose `use_dora` / `lora_bias` contradicts the keys. diffusers builds the PEFT layers from
    the header alone: DoRA layers without magnitudes get them computed from the base weight, and magnitudes or
    biases the header does not ask for are skipped with a warning. Reading the keys alone would apply something
    else than diffusers does, silently."""
    if config is None:
        return
    where = f"LoRA file {source!r}: its {LORA_METADATA_KEY} header"
    if "use_dora" in config and bool(config["use_dora"]) != bool(magnitudes):
        found = (f"{len(magnitudes)} lora_magnitude_vector keys" if magnitudes else "no lora_magnitude_vector keys")
        raise ValueError(f"{where} says use_dora={config['use_dora']!r}, but the file holds {found}; the header and "
                         "the weights come from different adapters (diffusers would apply the header's)")
    if "lora_bias" in config and not config["lora_bias"] and biases:
        raise ValueError(f"{where} says lora_bias={config['lora_bias']!r}, but the file holds {len(biases)} "
                         "lora_B.bias keys, which diffusers would skip; the header and the weights come from different "
                         "adapters")


def _metadata_alphas(config: dict | None, downs: dict[str, torch.Tensor], source: str) -> dict[str, float]:
    """Each module's alpha from the header's PEFT `LoraConfig` (`_header_config`; empty without one), as PEFT
    resolves it: `alpha_pattern`'s first pattern that matches the module path's end (peft's `get_pattern_key`),
    else `lora_alpha`. An rsLoRA adapter (`use_rslora`) is scaled by alpha / sqrt(rank) there: as our
    alpha / rank, that is an alpha of alpha * sqrt(rank)."""
    if config is None or "lora_alpha" not in config:
        return {}
    where = f"LoRA file {source!r}: {LORA_METADATA_KEY}"
    default = _header_alpha(config["lora_alpha"], f"{where} lora_alpha")
    patterns = config.get("alpha_pattern") or {}
    if not isinstance(patterns, dict):
        raise ValueError(f"{where} alpha_pattern must be an object (pattern -> alpha), got {patterns!r}")
    alphas = {}
    for module, down in downs.items():
        try:
            pattern = next((key for key in patterns if re.match(rf"(.*\.)?({key})$", module)), None)
        except re.error as exc:
            raise ValueError(f"{where} alpha_pattern holds a pattern that is not a regular expression "
                             f"({exc})") from None
        alpha = default if pattern is None else _header_alpha(patterns[pattern], f"{where} alpha_pattern[{pattern!r}]")
        if config.get("use_rslora"):
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


def read_adapter(path: str) -> LoraAdapter:
    """Read the adapter named by `path` (a .safetensors file, a folder holding one, or a hub id) onto the CPU."""
    import safetensors.torch
    from safetensors import SafetensorError

    file = resolve_adapter_file(path)
    stamp = file_stamp(file)  # before reading: a file rewritten meanwhile is read again next time
    try:
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
    modules = parse_lora_state_dict(tensors, source=str(file), metadata=metadata)
    return LoraAdapter(path=path, file=file, modules=modules, stamp=stamp)
