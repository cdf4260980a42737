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
"""

from __future__ import annotations

from torch import nn

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


def apply_fp8_linears(model: nn.Module, scope: str, *, fast_accumulation: bool = False) -> int:
    """Swap the fused blocks' video-token `nn.Linear`s named by `scope` for `Fp8Linear`s; returns how many."""
    paths = fp8_linear_paths(scope)
    converted = 0
    for block in model.visual_transformer_blocks:
        for path in paths:
            parent_path, _, name = path.rpartition(".")
            parent = block.get_submodule(parent_path)
            linear = getattr(parent, name, None)
            if type(linear) is nn.Linear:  # not a TP shard or an already converted one
                setattr(parent, name, Fp8Linear.from_linear(linear, fast_accumulation=fast_accumulation))
                converted += 1
    return converted


def set_fast_accumulation(model: nn.Module, enabled: bool) -> int:
    """Turn cuBLASLt's FP8 fast accumulation on or off for every `Fp8Linear` of `model`; returns how many."""
    layers = [module for module in model.modules() if isinstance(module, Fp8Linear)]
    for layer in layers:
        layer.fast_accumulation = enabled
    return len(layers)
