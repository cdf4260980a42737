"""What a LoRA adapter's state-dict keys mean, and the checks of their tensors.

Two layouts are read:
* diffusers / PEFT: `<module>.lora_A[.<adapter name>].weight` (rank x in) and `<module>.lora_B[.<adapter
  name>].weight` (out x rank), optionally `<module>.alpha`, under a `transformer.`, `base_model.model.`,
  `diffusion_model.` (ComfyUI) or no prefix; ComfyUI's own LoRA save / extract / training nodes name the same pair
  `<module>.lora_down.weight` / `.lora_up.weight` (kohya's factor names after a dotted path), alpha as kohya's.
  The alpha may instead be in the adapter's PEFT `LoraConfig`: in the file's header, where diffusers'
  `save_lora_weights` / `save_lora_adapter` put it, or in the `adapter_config.json` beside the file, where PEFT's
  `save_pretrained` does (`config_alphas`). Also PEFT's
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

import math
import re
from dataclasses import dataclass

import torch

from k6serve.lora.adapter_file import PEFT_CONFIG_FILE, SHOWN
from k6serve.lora.peft_config import (
    LORA_METADATA_KEY,
    PEFT_DEFAULT_LORA_ALPHA,
    LoraConfig,
    check_config_options,
    check_config_variants,
    config_alphas,
    header_config,
)
from k6serve.lora.spec import check_lora_alpha

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


def key_kind(key: str) -> tuple[str, re.Match | None]:
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


def unknown_keys_error(unknown: list[str], source: str) -> ValueError:
    return ValueError(f"LoRA file {source!r}: {len(unknown)} key(s) are not diffusers/PEFT LoRA keys "
                      f"(<module>.lora_A.weight, <module>.lora_B.weight, <module>.alpha, and PEFT's "
                      f"<module>.lora_B.bias, <module>.lora_magnitude_vector (DoRA), <module>.lora_embedding_A / "
                      f"_B), ComfyUI ones (<module>.lora_down.weight / .lora_up.weight / .alpha, under "
                      f"diffusion_model.) nor kohya ones (lora_unet_<module>.lora_down.weight / .lora_up.weight / "
                      f".alpha, and LyCORIS's DoRA .dora_scale), e.g. {unknown[:SHOWN]}")


def _strip_prefix(key: str) -> str:
    for prefix in _PREFIXES:  # in order: PEFT's "base_model.model." may wrap a "transformer."
        key = key.removeprefix(prefix)
    return key


def parse_lora_state_dict(tensors: dict[str, torch.Tensor], *, source: str, metadata: dict[str, str] | None = None,
                          peft_config: dict | None = None) -> dict[str, LoraModule]:
    """Group a diffusers / PEFT LoRA state dict by module; `source` names the file in errors, `metadata` is the
    file's safetensors header (its `LORA_METADATA_KEY` entry may hold the alphas), `peft_config` the PEFT_CONFIG_FILE
    found beside the file (`peft_folder_config`)."""
    # diffusers builds `LoraConfig(**header)`: a header without lora_alpha gets PEFT's default (8), not the rank.
    configs = [LoraConfig(fields={"lora_alpha": PEFT_DEFAULT_LORA_ALPHA, **fields},
                           name=f"the {LORA_METADATA_KEY} header", short="header", reader="diffusers")
               for fields in [header_config(metadata, source)] if fields is not None]
    if peft_config is not None:
        configs.append(LoraConfig(fields=peft_config, name=f"the {PEFT_CONFIG_FILE} beside it",
                                   short=PEFT_CONFIG_FILE, reader="PEFT"))
    for config in configs:  # first: an option like modules_to_save or bias="all" also explains the keys it adds
        check_config_options(config, source)
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
        kind, match = key_kind(key)
        if match is None:  # "unknown": no pattern matched it
            unknown.append(key)
            continue
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
        raise unknown_keys_error(unknown, source)
    if len(adapter_names) > 1:
        raise ValueError(f"LoRA file {source!r} holds several PEFT adapters ({sorted(adapter_names)}); save one "
                         "adapter per file")
    if not downs and not ups:
        raise ValueError(f"LoRA file {source!r} holds no lora_A / lora_B weights")
    unpaired = sorted(set(downs) ^ set(ups))
    if unpaired:
        raise ValueError(f"LoRA file {source!r}: module(s) with only one of lora_A / lora_B: {unpaired[:SHOWN]}")
    magnitude_keys = _dora_scale_magnitudes(dora_scales, downs, ups, magnitudes, source)
    _check_variants(downs, magnitudes, biases, embeddings, linears, source)
    origins = dict.fromkeys(alphas, "its .alpha key")
    for config in configs:
        check_config_variants(config, magnitudes, biases, source)
        for module, alpha in config_alphas(config, downs, source).items():
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
        for kind, extra in extras.items():
            if extra is not None and tuple(extra.shape) != (up.shape[0],):
                raise ValueError(f"LoRA file {source!r}: module {module!r} has {kind} {tuple(extra.shape)}, but its "
                                 f"lora_B {tuple(up.shape)} gives {up.shape[0]} output features; expected "
                                 f"({up.shape[0]},)")
        for kind, extra in (("lora_A", down), ("lora_B", up), *extras.items()):
            if extra is not None:
                _check_values(extra, kind, module, source)
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
                         f"lora_A / lora_B: {stray[:SHOWN]}")
    both = sorted(set(magnitudes) & set(biases))
    if both:
        # PEFT's LoraConfig refuses lora_bias=True with use_dora=True, so neither it nor diffusers has a meaning
        # for the pair.
        raise ValueError(f"LoRA file {source!r}: module(s) {both[:SHOWN]} have both a lora_magnitude_vector (DoRA) "
                         "and a lora_B.bias; PEFT does not combine the two (LoraConfig refuses lora_bias with "
                         "use_dora), so the file was not written by it")
    mixed = sorted(embeddings & (linears | set(biases)))
    if mixed:
        raise ValueError(f"LoRA file {source!r}: module(s) {mixed[:SHOWN]} have lora_embedding_A / _B keys (an "
                         "Embedding's LoRA) and lora_A / lora_B ones (a Linear's); PEFT writes one kind per module")


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
