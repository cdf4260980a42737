"""The PEFT `LoraConfig` that may come with a LoRA adapter's weights: in the safetensors header, where diffusers'
`save_lora_weights` / `save_lora_adapter` put it, or in the `adapter_config.json` beside the file, where PEFT's
`save_pretrained` does. Its options are checked (only plain LoRA, rsLoRA, DoRA and lora_bias are applied), its
`alpha_pattern` / `rank_pattern` keys are checked for cost before they are matched, and each module's alpha is
resolved from it as PEFT does (`config_alphas`). `state_dict.py` calls these while it parses the weights.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from k6serve.lora.adapter_file import PEFT_CONFIG_FILE, PEFT_WEIGHTS_FILE, SHOWN
from k6serve.lora.spec import check_lora_alpha

PEFT_DEFAULT_LORA_ALPHA = 8  # `peft.LoraConfig`'s default lora_alpha
# diffusers' `save_lora_weights` (its training scripts) and `save_lora_adapter` write no `<module>.alpha` keys: the
# adapter's PEFT `LoraConfig` goes into the safetensors header as JSON under this key (`lora_alpha`, `alpha_pattern`,
# `use_rslora`, ...; each field prefixed `transformer.` when saved from a pipeline), and diffusers'
# `load_lora_adapter` scales the adapter by it. Reading the tensors alone applied such an adapter at alpha = rank
# (scale 1) instead of lora_alpha / rank (tests/parity/test_lora_parity.py).
LORA_METADATA_KEY = "lora_adapter_metadata"


def header_config(metadata: dict[str, str] | None, source: str) -> dict | None:
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
class LoraConfig:
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


def check_config_options(config: LoraConfig, source: str) -> None:
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


def check_config_variants(config: LoraConfig, magnitudes: dict[str, torch.Tensor], biases: dict[str, torch.Tensor],
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
    (`config_alphas` has checked each pattern's cost, once, before the first module)."""
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


def config_alphas(config: LoraConfig, downs: dict[str, torch.Tensor], source: str) -> dict[str, float]:
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


def peft_folder_config(file: Path) -> dict | None:
    """The PEFT `LoraConfig` that `save_pretrained` wrote beside `file` as PEFT_CONFIG_FILE (None without one)."""
    config_file = file.parent / PEFT_CONFIG_FILE
    if not config_file.is_file():
        return None
    where = f"LoRA file {str(file)!r}: the {PEFT_CONFIG_FILE} beside it"
    others = sorted(other.name for other in file.parent.glob("*.safetensors") if other.name != file.name)
    if file.name != PEFT_WEIGHTS_FILE and others:
        # PEFT's config belongs to its own PEFT_WEIGHTS_FILE; next to several other files it may be any one's.
        raise ValueError(f"{where} (a PEFT adapter's config, which sets its scale) may belong to another of the "
                         f"folder's .safetensors files ({', '.join(others[:SHOWN])}); put the adapter in a folder "
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
