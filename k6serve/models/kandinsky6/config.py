"""Typed, frozen configuration of the Kandinsky 6 generation transformer.

Field names and defaults are the init arguments of diffusers' `Kandinsky6Transformer3DModel` (0.42.1),
i.e. the keys of a checkpoint's `transformer/config.json`; derived sizes are properties.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from collections.abc import Mapping
from typing import Any


# The diffusers schedulers Kandinsky 6 generation runs (model_index.json's "scheduler"): flow matching (Pro, Lite)
# and PiFlow (the distilled ones).
SCHEDULER_CLASSES = ("FlowMatchEulerDiscreteScheduler", "PiflowScheduler")


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Kandinsky6TransformerConfig:
    """Init arguments of the K6 DiT; `*_a` audio sizes default to the video ones when None."""

    in_visual_dim: int = 16
    out_visual_dim: int = 16
    in_text_dim: int = 3584
    in_text_dim2: int = 768
    time_dim: int = 1024
    patch_size: tuple[int, int, int] = (1, 2, 2)
    model_dim: int = 4096
    ff_dim: int = 16384
    num_text_blocks: int = 4
    num_visual_blocks: int = 60
    axes_dims: tuple[int, int, int] = (32, 48, 48)
    visual_cond: bool = True
    in_audio_dim: int = 20
    out_audio_dim: int = 20
    model_dim_a: int | None = None
    time_dim_a: int | None = None
    ff_dim_a: int | None = None
    axes_dims_a: tuple[int, int, int] | None = None
    audio_freqs_scaling: float = 1.0
    scale_factor: tuple[float, float, float] = (1.0, 2.0, 2.0)
    text_token_padding: bool = False
    ca_rope: bool = False
    cross_gates: bool = False
    fix_modulation: bool = False
    visual_token_type_num_embeddings: int = 0

    def __post_init__(self) -> None:
        for key in ("in_visual_dim", "out_visual_dim", "in_text_dim", "in_text_dim2", "time_dim", "model_dim",
                    "ff_dim", "in_audio_dim", "out_audio_dim", "model_dim_a", "time_dim_a", "ff_dim_a"):
            value = getattr(self, key)
            if value is not None and value <= 0:  # ff_dim -128 failed deep in the build, as "a bug in k6serve"
                raise ValueError(f"transformer config key {key!r}: must be > 0, got {value}")
        for key in ("num_text_blocks", "num_visual_blocks"):
            if getattr(self, key) < 0:
                raise ValueError(f"transformer config key {key!r}: must be >= 0, got {getattr(self, key)}")
        for key, dims in (("axes_dims", self.axes_dims), ("axes_dims_a", self.audio_axes_dims)):
            if any(dim <= 0 or dim % 2 for dim in dims):
                raise ValueError(
                    f"transformer config key {key!r}: every RoPE axis dim must be even and > 0, got {dims}"
                )
        for key, model_dim, head_dim in (
            ("model_dim", self.model_dim, self.video_head_dim),
            ("model_dim_a", self.audio_model_dim, self.audio_head_dim),
        ):
            if model_dim % head_dim:
                raise ValueError(
                    f"transformer config key {key!r}: {model_dim} is not divisible by the head dim {head_dim} "
                    f"(the sum of the RoPE axes dims)"
                )
            if model_dim % 2:
                raise ValueError(f"transformer config key {key!r}: must be even, got {model_dim}")
        if any(size <= 0 for size in self.patch_size):
            raise ValueError(
                f"transformer config key 'patch_size': sizes must be > 0, got {self.patch_size}"
            )
        if self.ca_rope and self.video_head_dim != self.audio_head_dim:
            raise ValueError(
                f"transformer config key 'ca_rope': cross-modal RoPE needs equal video and audio head dims, "
                f"got {self.video_head_dim} and {self.audio_head_dim}"
            )
        if not self.fix_modulation and self.time_dim != self.audio_time_dim:
            raise ValueError(
                "transformer config key 'fix_modulation': false feeds each cross-modal modulation the other "
                f"stream's time embedding, which needs time_dim == time_dim_a (got {self.time_dim} and "
                f"{self.audio_time_dim})"
            )
        if self.visual_token_type_num_embeddings < 0:
            raise ValueError(
                "transformer config key 'visual_token_type_num_embeddings': must be >= 0"
            )

    @classmethod
    def from_json_dict(cls, config: Mapping[str, Any]) -> Kandinsky6TransformerConfig:
        """Build from a diffusers `transformer/config.json` dict; unknown keys are ignored.

        Known keys are type-checked (JSON lists become tuples); a bad value raises ValueError naming the key.
        """
        hints = typing.get_type_hints(cls)
        values = {
            field.name: _parse_value(field.name, config[field.name], hints[field.name])
            for field in dataclasses.fields(cls)
            if field.name in config
        }
        return cls(**values)

    @property
    def audio_model_dim(self) -> int:
        return self.model_dim_a or self.model_dim

    @property
    def audio_time_dim(self) -> int:
        return self.time_dim_a or self.time_dim

    @property
    def audio_ff_dim(self) -> int:
        return self.ff_dim_a or self.ff_dim

    @property
    def audio_axes_dims(self) -> tuple[int, int, int]:
        return self.axes_dims_a or self.axes_dims

    @property
    def video_head_dim(self) -> int:
        return sum(self.axes_dims)

    @property
    def audio_head_dim(self) -> int:
        return sum(self.audio_axes_dims)

    @property
    def num_video_heads(self) -> int:
        return self.model_dim // self.video_head_dim

    @property
    def num_audio_heads(self) -> int:
        return self.audio_model_dim // self.audio_head_dim

    @property
    def visual_in_channels(self) -> int:
        """Channels of the DiT's video input: latent, conditioning latent and mask when `visual_cond`."""
        return 2 * self.in_visual_dim + 1 if self.visual_cond else self.in_visual_dim

    @property
    def patch_volume(self) -> int:
        return math.prod(self.patch_size)


def _parse_value(key: str, value: Any, annotation: Any) -> Any:
    """Check one JSON value against a field annotation (int, float, bool, fixed tuples, X | None)."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        if value is None:
            return None
        (annotation,) = [arg for arg in typing.get_args(annotation) if arg is not type(None)]
        origin = typing.get_origin(annotation)
    if origin is tuple:
        element_types = typing.get_args(annotation)
        if not isinstance(value, (list, tuple)) or len(value) != len(element_types):
            raise ValueError(
                f"transformer config key {key!r}: expected a list of {len(element_types)} numbers, got {value!r}"
            )
        return tuple(
            _parse_value(key, item, item_type) for item, item_type in zip(value, element_types)
        )
    if annotation is bool:
        if not isinstance(value, bool):
            raise ValueError(
                f"transformer config key {key!r}: expected true or false, got {value!r}"
            )
        return value
    if annotation is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"transformer config key {key!r}: expected an integer, got {value!r}")
        return value
    if annotation is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"transformer config key {key!r}: expected a number, got {value!r}")
        return float(value)
    raise AssertionError(f"unhandled annotation {annotation!r} for {key!r}")
