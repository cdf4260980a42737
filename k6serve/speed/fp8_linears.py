"""`apply_fp8_linears`: the generation DiT's video-token GEMMs in e4m3 (`ops/fp8_linear.py`); lossy, opt-in.

Only the linears whose input rows are the video tokens are converted: they are nearly all of the DiT's GEMM FLOPs
(47,616 rows at 512x768x121), while the audio (218 rows) and text (1,024 rows) GEMMs are launch-bound and would
gain nothing. Two scopes, to measure the trade-off between speed and the velocity's distance to bf16:

* "ffn": the video feed-forward's two GEMMs (`net.0.proj`, `net.2`), 60% of the GEMM FLOPs;
* "video": those plus every other video-token projection: self-attention Q/K/V (fused or not) and output, the text
  cross-attention's query and output, video_from_audio's query and output, and audio_from_video's key/value
  (computed from the video tokens).

Apply after `apply_fused_projections` (it converts the fused Q/K/V Linear as it finds it) and before regional
compile (or recompile): the block's code is unchanged, only its Linear modules are swapped.

The engine's `--quantization fp8` converts the "video" scope minus `--quantization-ignored-layers`
(`apply_quantization`, called by `apply_performance_mode` between the fused projections and the compile).
"""

from __future__ import annotations

import fnmatch
from typing import cast

from torch import nn

from k6serve.config import QUANTIZATIONS, EngineConfig
from k6serve.ops.fp8_linear import Fp8Linear

FP8_LINEAR_SCOPES = ("ffn", "video")

_FEED_FORWARD = ("video_dec_block.feed_forward.net.0.proj", "video_dec_block.feed_forward.net.2")
_ATTENTIONS = (
    ("video_dec_block.self_attention", ("to_query_key_value", "to_query", "to_key", "to_value", "out_layer")),
    ("video_dec_block.cross_attention", ("to_query", "out_layer")),
    ("va_cross_attention", ("to_query", "out_layer")),
    ("av_cross_attention", ("to_key_value", "to_key", "to_value")),
)


def fp8_linear_paths(scope: str) -> tuple[str, ...]:
    """The linears' paths inside one fused block that `scope` converts (those a block lacks are skipped)."""
    if scope not in FP8_LINEAR_SCOPES:
        raise ValueError(f"FP8 linear scope must be one of {', '.join(FP8_LINEAR_SCOPES)}, got {scope!r}.")
    paths = list(_FEED_FORWARD)
    if scope == "video":
        paths += [f"{attention}.{name}" for attention, names in _ATTENTIONS for name in names]
    return tuple(paths)


# Linears that speed mode on CUDA fuses into one GEMM (speed/fused_projections.py), by their fused name: the unit a
# pattern keeps in bf16, so that --quantization-ignored-layers selects the same GEMMs fused or not.
_FUSED_GROUPS = {"video_dec_block.self_attention": ("to_query_key_value", "to_query", "to_key", "to_value"),
                 "av_cross_attention": ("to_key_value", "to_key", "to_value")}
# cuBLASLt's e4m3 GEMM takes widths in multiples of 16 (the released models' all are).
_FP8_ALIGNMENT = 16


def _linears(model: nn.Module, scope: str) -> list[tuple[str, nn.Module, str, nn.Linear]]:
    """(full module name, parent, attribute, Linear) of each plain `nn.Linear` that `scope` converts; a linear whose
    widths are not multiples of 16 stays in bf16 (a custom checkpoint's; cuBLASLt refuses them)."""
    found = []
    # `model` is the generation DiT (Kandinsky6Transformer), whose fused blocks are a ModuleList.
    for index, block in enumerate(cast(nn.ModuleList, model.visual_transformer_blocks)):
        for path in fp8_linear_paths(scope):
            parent_path, _, name = path.rpartition(".")
            parent = block.get_submodule(parent_path)
            linear = getattr(parent, name, None)
            if type(linear) is nn.Linear and not (linear.in_features % _FP8_ALIGNMENT
                                                  or linear.out_features % _FP8_ALIGNMENT):
                # (not a TP shard or an already converted one)
                found.append((f"visual_transformer_blocks.{index}.{path}", parent, name, linear))
    return found


def apply_fp8_linears(model: nn.Module, scope: str, *, fast_accumulation: bool = False,
                      ignored_layers: tuple[str, ...] = ()) -> int:
    """Swap the fused blocks' video-token `nn.Linear`s named by `scope` for `Fp8Linear`s, except those matching
    `ignored_layers` (`is_ignored`); returns how many were swapped."""
    converted = 0
    for full_name, parent, name, linear in _linears(model, scope):
        if not is_ignored(full_name, ignored_layers):
            setattr(parent, name, Fp8Linear.from_linear(linear, fast_accumulation=fast_accumulation))
            converted += 1
    return converted


def _group(name: str) -> tuple[str, ...]:
    """`name` and the names of the linears that form one GEMM with it in either layout: self-attention's Q, K, V and
    their fused `to_query_key_value`; audio_from_video's K, V and `to_key_value`."""
    parent, _, leaf = name.rpartition(".")
    for attention, members in _FUSED_GROUPS.items():
        if parent.endswith(attention) and leaf in members:
            return tuple(f"{parent}.{member}" for member in members)
    return (name,)


def _matches(name: str, pattern: str) -> bool:
    """A glob over the whole name, or a run of whole dot-separated parts (each part may be a glob, or a range of
    block indices N-M): `feed_forward`, `self_attention.out_layer`, `visual_transformer_blocks.1` (block 1, not
    10-19), `visual_transformer_blocks.0-29` (the first 30 blocks)."""
    if fnmatch.fnmatchcase(name, pattern):
        return True
    parts, wanted = name.split("."), pattern.strip(".").split(".")
    return any(all(_part_matches(part, want) for part, want in zip(parts[start:], wanted))
               for start in range(len(parts) - len(wanted) + 1))


def _part_matches(part: str, wanted: str) -> bool:
    # A range, because keeping whole runs of blocks in bf16 is the usual choice (the first blocks are the most
    # sensitive to e4m3: docs/benchmarks.md, twenty-third session) and globs spell "0-29" as two patterns.
    first, dash, last = wanted.partition("-")
    if dash and first.isdigit() and last.isdigit():
        return part.isdigit() and int(first) <= int(part) <= int(last)
    return fnmatch.fnmatchcase(part, wanted)


def is_ignored(name: str, patterns: tuple[str, ...]) -> bool:
    """Whether the linear named `name` (`visual_transformer_blocks.3.video_dec_block.feed_forward.net.2`) stays in
    bf16: one of `patterns` matches it (`_matches`), or another linear of its GEMM group (`_group`: naming
    `to_query` keeps Q, K and V, which speed mode runs as one GEMM, so both layouts keep the same GEMMs)."""
    return any(_matches(member, pattern) for member in _group(name) for pattern in patterns)


def apply_quantization(model: nn.Module, quantization: str, ignored_layers: tuple[str, ...] = ()) -> int:
    """`--quantization`: "fp8" converts every video-token linear of the generation DiT but the ignored ones; returns
    how many. A pattern that matches none of those linears is refused (a typo would otherwise quantize everything
    it meant to keep), naming some of them."""
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"--quantization must be one of {', '.join(QUANTIZATIONS)}, got {quantization!r}")
    if quantization == "none":
        return 0
    check_ignored_layers(ignored_layers, [full_name for full_name, *_ in _linears(model, "video")])
    converted = apply_fp8_linears(model, "video", ignored_layers=ignored_layers)
    if not converted:
        raise ValueError(f"--quantization-ignored-layers {' '.join(ignored_layers)} keeps every quantizable linear of "
                         f"the DiT in bf16, so --quantization {quantization} would change nothing; narrow the "
                         "patterns, or drop both flags.")
    return converted


def check_ignored_layers(patterns: tuple[str, ...], names: list[str]) -> None:
    """Refuse a pattern that matches none of `names` (the quantizable linears), naming some of them."""
    unmatched = [pattern for pattern in patterns if not any(is_ignored(name, (pattern,)) for name in names)]
    if unmatched:
        examples = ", ".join(names[:2] + names[-1:]) if names else "none"
        raise ValueError(f"--quantization-ignored-layers {' '.join(map(repr, unmatched))} matches none of the DiT's "
                         f"quantizable linears (e.g. {examples}); give a part of their names (e.g. feed_forward, "
                         "self_attention, visual_transformer_blocks.0-29) or a glob.")


def check_quantization_before_loading(config: EngineConfig) -> None:
    """Refuse, before any rank process starts, a --quantization-ignored-layers pattern that matches none of the
    DiT's quantizable linears, where the DiT's block count needs no download (`dit_blocks_before_loading`); the
    worker checks it again (`worker_preflight.check_quantization`), with the GPU's own checks."""
    model = config.model
    if model.quantization == "none" or not model.quantization_ignored_layers:
        return
    from k6serve.models.kandinsky6.config_before_loading import dit_blocks_before_loading

    num_blocks = dit_blocks_before_loading(model)
    if num_blocks is not None:
        check_ignored_layers(model.quantization_ignored_layers, possible_linear_names(num_blocks))


def possible_linear_names(num_blocks: int) -> list[str]:
    """The names the quantizable linears can have in a DiT of `num_blocks` fused blocks, fused projections or not:
    what the worker checks --quantization-ignored-layers against before the weights load (`apply_quantization`
    checks again against the model's own, after)."""
    return [f"visual_transformer_blocks.{index}.{path}" for index in range(num_blocks)
            for path in fp8_linear_paths("video")]


def set_fast_accumulation(model: nn.Module, enabled: bool) -> int:
    """Turn cuBLASLt's FP8 fast accumulation on or off for every `Fp8Linear` of `model`; returns how many."""
    layers = [module for module in model.modules() if isinstance(module, Fp8Linear)]
    for layer in layers:
        layer.fast_accumulation = enabled
    return len(layers)
