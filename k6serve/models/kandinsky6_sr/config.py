"""Typed configs of the Kandinsky 6 SR components, read from the vendor config.json formats on the Hub.

The Hub configs do not use diffusers' constructor keys (k6-super-resolution.md §1.2-1.5): the transformer uses
"native" keys with `attention_params` / `sr_params`, the VAE nests `encoder_config` / `decoder_config` (older
revisions use flat `encoder_ch`, `decoder_ch_mult`, ... fields), and the latent upscaler is a `models` list. Every
value that changes the computation is read from those keys here; nothing falls back to class defaults.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from k6serve.models.checkpoint_files import MAX_POLICY_SUBSTEPS, config_count, read_json_file

# R `constants.py::RESOLUTIONS`: the HR tile sizes (height, width) the DiT was trained on, per `visual_size`.
RESOLUTIONS: dict[int, tuple[tuple[int, int], ...]] = {512: ((512, 512), (512, 768), (768, 512))}

# k6serve test-only extension key of transformer/config.json: explicit HR tile sizes [[h, w], ...] replacing
# RESOLUTIONS[visual_size], so tiny test checkpoints can use small tiles. Released checkpoints never carry it.
TILE_SIZES_OVERRIDE_KEY = "k6serve_tile_sizes"

# Keys of the released transformer config; k6serve refuses others (a new key may change the computation).
_TRANSFORMER_KEYS = frozenset(
    {
        "in_visual_dim", "out_visual_dim", "time_dim", "patch_size", "model_dim", "ff_dim",
        "num_visual_blocks", "axes_dims", "in_text_dim", "in_text_dim2", "num_text_blocks", "use_text",
        "visual_cond", "instruct_type", "attribute_overrides", "attention_params", "sr_params",
        TILE_SIZES_OVERRIDE_KEY,
    }
)  # fmt: skip
_SR_PARAMS_KEYS = frozenset(
    {
        "visual_size", "scale_factor", "scheduler_scale", "lq_noise_scale", "lq_noise_type",
        "lq_channel_noise_scale", "cap_noise_timestep", "fps",
    }
)  # fmt: skip


def read_json(path: str | Path) -> dict[str, Any]:
    """Read one component config file; a damaged one is a CheckpointError naming it, with the fix."""
    return read_json_file(Path(path))


def _reject_unknown(raw: dict[str, Any], known: frozenset[str], where: str) -> None:
    unknown = sorted(key for key in raw if key not in known and not key.startswith("_"))
    if unknown:
        raise ValueError(
            f"{where} has keys k6serve does not understand: {unknown}. They may change the computation; "
            "use a supported revision of kandinskylab/Kandinsky-6.0-VSR-distilled2steps-5s-Diffusers."
        )


@dataclass(frozen=True, kw_only=True, slots=True)
class SRTransformerConfig:
    """The SR DiT and the SR parameters stored next to it (transformer/config.json)."""

    in_visual_dim: int
    out_visual_dim: int
    time_dim: int
    patch_size: tuple[int, int, int]
    model_dim: int
    ff_dim: int
    num_visual_blocks: int
    axes_dims: tuple[int, int, int]
    rope_scale: tuple[float, float, float]  # sr_params.scale_factor[str(visual_size)]
    visual_cond: bool
    instruct_type: str
    visual_size: int
    tile_sizes: tuple[tuple[int, int], ...]  # HR (height, width) tiles
    scheduler_scale: float
    lq_noise_scale: float
    lq_noise_type: str
    fps: int
    # The checkpoint's sparse attention request; k6serve runs dense attention (§0) and keeps these for reference.
    checkpoint_attention_type: str
    nabla_threshold: float | None
    nabla_window: tuple[int, int, int] | None

    @property
    def head_dim(self) -> int:
        return sum(self.axes_dims)

    @property
    def num_heads(self) -> int:
        return self.model_dim // self.head_dim

    @property
    def in_channels(self) -> int:
        """DiT input width: noisy latent, anchor latent and anchor mask."""
        return 2 * self.in_visual_dim + 1

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> SRTransformerConfig:
        _reject_unknown(raw, _TRANSFORMER_KEYS, "transformer/config.json")
        if raw.get("use_text", False):
            raise ValueError(
                "transformer/config.json has use_text=true; the k6serve SR DiT is text-free like the released "
                "checkpoints. Use kandinskylab/Kandinsky-6.0-VSR-distilled2steps-5s-Diffusers."
            )
        if raw.get("attribute_overrides", {}):
            raise ValueError(
                f"transformer/config.json has attribute_overrides {raw['attribute_overrides']}, which k6serve "
                "does not apply; use a checkpoint without overrides."
            )
        sr_params = raw["sr_params"]
        _reject_unknown(sr_params, _SR_PARAMS_KEYS, "transformer/config.json sr_params")
        _check_supported_noise(sr_params)
        visual_sizes = list(sr_params["visual_size"])
        if len(visual_sizes) != 1:
            raise ValueError(
                f"sr_params.visual_size {visual_sizes} lists several sizes; k6serve supports one (e.g. [512])."
            )
        where = "transformer/config.json"
        visual_size = config_count(visual_sizes[0], "sr_params.visual_size", where)
        model_dim, axes_dims = config_count(raw["model_dim"], "model_dim", where), _int_triple(raw["axes_dims"])
        if model_dim % sum(axes_dims):
            raise ValueError(
                f"model_dim {model_dim} is not divisible by the head dim sum(axes_dims)={sum(axes_dims)}"
            )
        attention_type, nabla_threshold, nabla_window = _parse_attention_params(raw, visual_size)
        if str(visual_size) not in sr_params["scale_factor"]:
            raise ValueError(f"sr_params.scale_factor has no entry for visual_size {visual_size}")
        tile_sizes = _tile_sizes(raw, visual_size)
        return cls(
            in_visual_dim=config_count(raw["in_visual_dim"], "in_visual_dim", where),
            out_visual_dim=config_count(raw["out_visual_dim"], "out_visual_dim", where),
            time_dim=config_count(raw["time_dim"], "time_dim", where),
            patch_size=_int_triple(raw["patch_size"]),
            model_dim=model_dim,
            ff_dim=config_count(raw["ff_dim"], "ff_dim", where),
            num_visual_blocks=config_count(raw["num_visual_blocks"], "num_visual_blocks", where),
            axes_dims=axes_dims,
            rope_scale=_rope_scale(sr_params["scale_factor"][str(visual_size)], visual_size),
            visual_cond=bool(raw["visual_cond"]),
            instruct_type=str(raw["instruct_type"]),
            visual_size=visual_size,
            tile_sizes=tile_sizes,
            scheduler_scale=float(sr_params["scheduler_scale"]),
            lq_noise_scale=float(sr_params["lq_noise_scale"]),
            lq_noise_type=str(sr_params["lq_noise_type"]),
            fps=config_count(sr_params["fps"], "sr_params.fps", where, high=240),
            checkpoint_attention_type=attention_type,
            nabla_threshold=nabla_threshold,
            nabla_window=nabla_window,
        )

    @classmethod
    def from_json_file(cls, path: str | Path) -> SRTransformerConfig:
        return cls.from_dict(read_json(path))


def _check_supported_noise(sr_params: dict[str, Any]) -> None:
    if sr_params["lq_noise_type"] != "ddpm":
        raise ValueError(
            f"sr_params.lq_noise_type {sr_params['lq_noise_type']!r} is not supported; k6serve implements the "
            "released 'ddpm' mix x = sqrt(1 - s^2) * lq + s * eps."
        )
    if float(sr_params.get("lq_channel_noise_scale", 0.0)) != 0.0 or sr_params.get(
        "cap_noise_timestep", False
    ):
        raise ValueError(
            "sr_params.lq_channel_noise_scale must be 0 and cap_noise_timestep false (as released); "
            "k6serve does not implement per-channel LQ noise or timestep capping."
        )


def _parse_attention_params(
    raw: dict[str, Any], visual_size: int
) -> tuple[str, float | None, tuple[int, int, int] | None]:
    params = raw.get("attention_params", {}).get(str(visual_size), {"type": "flash"})
    if params["type"] != "nabla":
        return str(params["type"]), None, None
    window = (int(params["wT"]), int(params["wH"]), int(params["wW"]))
    return "nabla", float(params["P"]), window


def _tile_sizes(raw: dict[str, Any], visual_size: int) -> tuple[tuple[int, int], ...]:
    if TILE_SIZES_OVERRIDE_KEY in raw:
        return tuple(_int_pair(size) for size in raw[TILE_SIZES_OVERRIDE_KEY])
    if visual_size not in RESOLUTIONS:
        raise ValueError(
            f"sr_params.visual_size {visual_size} has no known tile table (known: {sorted(RESOLUTIONS)})."
        )
    return RESOLUTIONS[visual_size]


def _rope_scale(values: Any, visual_size: int) -> tuple[float, float, float]:
    """sr_params.scale_factor's entry: one divisor per RoPE axis (t, h, w)."""
    scale = tuple(float(v) for v in values)
    if len(scale) != 3:
        raise ValueError(f"transformer/config.json sr_params.scale_factor[{str(visual_size)!r}] must hold 3 numbers "
                         f"(the t, h and w RoPE divisors), got {list(values)}")
    return scale[0], scale[1], scale[2]


def _int_tuple(values: Any, length: int) -> tuple[int, ...]:
    result = tuple(config_count(v, "a size", "transformer/config.json") for v in values)
    if len(result) != length:
        raise ValueError(f"expected {length} integers, got {list(values)}")
    return result


def _int_pair(values: Any) -> tuple[int, int]:
    first, second = _int_tuple(values, 2)
    return first, second


def _int_triple(values: Any) -> tuple[int, int, int]:
    first, second, third = _int_tuple(values, 3)
    return first, second, third


@dataclass(frozen=True, kw_only=True, slots=True)
class SRVAEConfig:
    """The causal K-VAE (vae/config.json), in the terms of diffusers' `Kandinsky6SRVAE` constructor."""

    in_channels: int
    out_channels: int
    latent_channels: int
    encoder_block_out_channels: tuple[int, ...]
    decoder_block_out_channels: tuple[int, ...]
    layers_per_block: int
    temporal_compression_ratio: int
    temporal_compression_start_level: int
    scaling_factor: float

    @property
    def spatial_compression_ratio(self) -> int:
        return 2 ** (len(self.encoder_block_out_channels) - 1)

    def to_diffusers_kwargs(self) -> dict[str, Any]:
        return {
            "in_channels": self.in_channels,
            "out_channels": self.out_channels,
            "latent_channels": self.latent_channels,
            "encoder_block_out_channels": self.encoder_block_out_channels,
            "decoder_block_out_channels": self.decoder_block_out_channels,
            "layers_per_block": self.layers_per_block,
            "temporal_compression_ratio": self.temporal_compression_ratio,
            "temporal_compression_start_level": self.temporal_compression_start_level,
            "scaling_factor": self.scaling_factor,
        }

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> SRVAEConfig:
        if "encoder_config" in raw:
            encoder, decoder = raw["encoder_config"], raw["decoder_config"]
        elif "encoder_ch" in raw:
            # Flat variant of older revisions (R `diffusers_bundle.py::flat_kvae_architecture`): `decoder_ch`, ...
            encoder = {
                k.removeprefix("encoder_"): v for k, v in raw.items() if k.startswith("encoder_")
            }
            decoder = {
                k.removeprefix("decoder_"): v for k, v in raw.items() if k.startswith("decoder_")
            }
        else:
            raise ValueError(
                "vae/config.json has neither nested encoder_config/decoder_config nor flat encoder_ch/decoder_ch "
                "fields; it is not a Kandinsky 6 K-VAE config."
            )
        _check_kvae_variant(encoder, "encoder")
        _check_kvae_variant(decoder, "decoder")
        for key in (
            "temporal_compress_times",
            "temporal_compress_start_level",
            "num_res_blocks",
            "z_channels",
        ):
            if key in decoder and decoder[key] != encoder[key]:
                raise ValueError(
                    f"vae/config.json: encoder and decoder disagree on {key}; k6serve needs one value."
                )
        config = cls(
            in_channels=int(encoder.get("in_channels", 3)),
            out_channels=int(decoder.get("out_ch", 3)),
            latent_channels=int(encoder["z_channels"]),
            encoder_block_out_channels=_widths(encoder),
            decoder_block_out_channels=_widths(decoder),
            layers_per_block=int(encoder["num_res_blocks"]),
            temporal_compression_ratio=int(encoder["temporal_compress_times"]),
            temporal_compression_start_level=int(encoder["temporal_compress_start_level"]),
            scaling_factor=float(raw["scaling_factor"]),
        )
        if (
            "spatial_factor" in raw
            and int(raw["spatial_factor"]) != config.spatial_compression_ratio
        ):
            raise ValueError(
                f"vae/config.json spatial_factor {raw['spatial_factor']} does not match the "
                f"{len(config.encoder_block_out_channels)} encoder levels (= {config.spatial_compression_ratio})."
            )
        return config

    @classmethod
    def from_json_file(cls, path: str | Path) -> SRVAEConfig:
        return cls.from_dict(read_json(path))


def _check_kvae_variant(section: dict[str, Any], name: str) -> None:
    # diffusers' Kandinsky6SRVAE implements exactly this variant; anything else would load but compute wrongly.
    expected = {
        "norm_type": "rms_norm",
        "padding_mode": "zeros",
        "double_z": True,
        "downsample_version": 2,
    }
    for key, value in expected.items():
        if key in section and section[key] != value:
            raise ValueError(
                f"vae/config.json {name} {key}={section[key]!r} is not supported (k6serve implements {value!r})."
            )


def _widths(section: dict[str, Any]) -> tuple[int, ...]:
    widths = tuple(section["ch"] * mult for mult in section["ch_mult"])
    if any(not float(w).is_integer() for w in widths):
        raise ValueError(
            f"vae/config.json ch {section['ch']} x ch_mult {section['ch_mult']} is not integral"
        )
    return tuple(int(w) for w in widths)


# Released latent-upscaler architecture; the diffusers bank implements exactly this (L:28-248). Public so a
# writer of vendor configs (the tiny test checkpoint) states the same fixed fields.
UPSCALER_FIXED = {
    "architecture": "multi_scale",
    "expand_ratio": 1,
    "bare_stem": True,
    "input_skip": False,
    "modulated_norm": True,
    "modulated_output_proj": True,
    "upsample_mode": "pxs_v2",
    "upsample_padding_mode": "zeros",
    "temporal_padding": "replicate",
    # True would add temporal mixing ("motion attention", natten or SDPA in SG), absent from the released weights.
    "temporal_mix": False,
}
UPSCALER_X2_FIXED = {
    "enable_x2_entry": True,
    "x2_finisher": "pxs_residual",
    "x2_tail_mode": "private_full",
}
_UPSCALER_SHARED = (
    "in_channels",
    "stage_channels",
    "num_pre_blocks",
    "num_mid_blocks",
    "num_post_blocks",
)


@dataclass(frozen=True, kw_only=True, slots=True)
class SRUpscalerConfig:
    """The latent-upscaler bank (latent_upscaler/config.json), in diffusers' bank constructor terms."""

    in_channels: int
    stage_channels: tuple[int, int, int]
    num_pre_blocks: int
    num_mid_blocks: int
    num_post_blocks: int
    num_x2_adapter_blocks: int
    # Ascending: the weights hold x2 under `_models.0.` and x4 under `_models.1.`, whatever the list order.
    scales: tuple[int, ...]
    scaling_factor: float

    def to_diffusers_kwargs(self) -> dict[str, Any]:
        return {
            "in_channels": self.in_channels,
            "stage_channels": self.stage_channels,
            "num_pre_blocks": self.num_pre_blocks,
            "num_mid_blocks": self.num_mid_blocks,
            "num_post_blocks": self.num_post_blocks,
            "num_x2_adapter_blocks": self.num_x2_adapter_blocks,
            "scales": self.scales,
            "scaling_factor": self.scaling_factor,
        }

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> SRUpscalerConfig:
        entries = {
            _parse_target_scale(entry["target_scale"]): entry["model"] for entry in raw["models"]
        }
        if not entries or set(entries) - {2, 4}:
            raise ValueError(
                f"latent_upscaler/config.json target scales {sorted(entries)}; k6serve supports 2x, 4x"
            )
        for scale, model in entries.items():
            fixed = UPSCALER_FIXED | (UPSCALER_X2_FIXED if scale == 2 else {})
            for key, value in fixed.items():
                if model.get(key, value) != value:
                    raise ValueError(
                        f"latent_upscaler/config.json {scale}x entry has {key}={model[key]!r}; k6serve implements "
                        f"the released {value!r} only."
                    )
            if "hidden" in model and model["hidden"] != model["stage_channels"][0]:
                raise ValueError("latent_upscaler/config.json: hidden must equal stage_channels[0]")
        first = next(iter(entries.values()))
        for key in _UPSCALER_SHARED:
            if any(model[key] != first[key] for model in entries.values()):
                raise ValueError(
                    f"latent_upscaler/config.json entries disagree on {key}; k6serve needs one value."
                )
        return cls(
            in_channels=int(first["in_channels"]),
            stage_channels=_int_triple(first["stage_channels"]),
            num_pre_blocks=int(first["num_pre_blocks"]),
            num_mid_blocks=int(first["num_mid_blocks"]),
            num_post_blocks=int(first["num_post_blocks"]),
            num_x2_adapter_blocks=int(entries[2]["x2_adapter_blocks"]) if 2 in entries else 0,
            scales=tuple(sorted(entries)),
            scaling_factor=float(raw["scaling_factor"]),
        )

    @classmethod
    def from_json_file(cls, path: str | Path) -> SRUpscalerConfig:
        return cls.from_dict(read_json(path))


def _parse_target_scale(text: str) -> int:
    if not text.endswith("x") or not text[:-1].isdigit():
        raise ValueError(
            f"latent_upscaler/config.json target_scale {text!r} is not of the form '2x'"
        )
    return int(text[:-1])


@dataclass(frozen=True, kw_only=True, slots=True)
class SRSchedulerConfig:
    """scheduler/scheduler_config.json: π-Flow (distilled) or flow-matching Euler (teacher)."""

    class_name: str  # "PiflowScheduler" or "FlowMatchEulerDiscreteScheduler"
    shift: float
    num_train_timesteps: int
    nfe: int | None  # π-Flow only: DiT calls per tile, whatever the request's num_inference_steps
    n_grid: int | None  # π-Flow only: predictions per channel in the widened head
    final_step_size_scale: float | None
    num_policy_substeps: int | None
    eps: float | None

    @property
    def is_piflow(self) -> bool:
        return self.class_name == "PiflowScheduler"

    def to_diffusers_kwargs(self) -> dict[str, Any]:
        """Constructor kwargs of diffusers' PiflowScheduler (which has no `nfe` argument)."""
        assert self.is_piflow
        return {
            "num_train_timesteps": self.num_train_timesteps,
            "shift": self.shift,
            "n_grid": self.n_grid,
            "eps": self.eps,
            "final_step_size_scale": self.final_step_size_scale,
            "num_policy_substeps": self.num_policy_substeps,
        }

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> SRSchedulerConfig:
        class_name = raw.get("_class_name")
        where = "scheduler/scheduler_config.json"
        if class_name == "PiflowScheduler":
            return cls(
                class_name=class_name,
                shift=float(raw["shift"]),
                num_train_timesteps=config_count(raw.get("num_train_timesteps", 1000), "num_train_timesteps", where),
                nfe=config_count(raw["nfe"], "nfe", where, high=1000),
                n_grid=config_count(raw["n_grid"], "n_grid", where),
                final_step_size_scale=float(raw["final_step_size_scale"]),
                num_policy_substeps=config_count(raw["num_policy_substeps"], "num_policy_substeps", where,
                                                 high=MAX_POLICY_SUBSTEPS),
                eps=float(raw["eps"]),
            )
        if class_name == "FlowMatchEulerDiscreteScheduler":
            if raw.get("use_dynamic_shifting", False):
                raise ValueError(
                    "scheduler_config.json enables dynamic shifting, which the SR models never use"
                )
            return cls(
                class_name=class_name,
                shift=float(raw["shift"]),
                num_train_timesteps=int(raw.get("num_train_timesteps", 1000)),
                nfe=None,
                n_grid=None,
                final_step_size_scale=None,
                num_policy_substeps=None,
                eps=None,
            )
        raise ValueError(
            f"scheduler/scheduler_config.json names {class_name!r}; Kandinsky 6 SR checkpoints use PiflowScheduler "
            "(distilled) or FlowMatchEulerDiscreteScheduler."
        )

    @classmethod
    def from_json_file(cls, path: str | Path) -> SRSchedulerConfig:
        return cls.from_dict(read_json(path))
