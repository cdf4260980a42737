"""Kandinsky 6 DiT config, released configs, parameter counts on meta, and the plan's consistency."""

import dataclasses
import fnmatch
import inspect

import pytest
import torch
from torch import nn

from k6serve.models.common.inner_attention import InnerAttention
from k6serve.models.kandinsky6.config import Kandinsky6TransformerConfig
from k6serve.models.kandinsky6.plan import ATTENTION_ROLES, kandinsky6_plan
from k6serve.models.kandinsky6.released_configs import RELEASED_TRANSFORMER_CONFIGS
from k6serve.models.kandinsky6.transformer import Kandinsky6FusedBlock, Kandinsky6Transformer
from k6serve.models.plan import keeps_fp32
from k6serve.testing.tiny_configs import tiny_transformer_config

TINY = tiny_transformer_config()


def _released(name):
    return Kandinsky6TransformerConfig.from_json_dict(RELEASED_TRANSFORMER_CONFIGS[name])


def test_released_configs_parse_with_derived_sizes():
    pro, lite = _released("pro"), _released("lite")
    assert (pro.video_head_dim, pro.num_video_heads, pro.audio_head_dim, pro.num_audio_heads) == (
        128,
        32,
        128,
        16,
    )
    assert (
        lite.video_head_dim,
        lite.num_video_heads,
        lite.audio_head_dim,
        lite.num_audio_heads,
    ) == (64, 28, 64, 14)
    assert pro.visual_in_channels == 33 and pro.patch_volume == 4
    assert pro.scale_factor == (1.0, 2.0, 2.0) and pro.patch_size == (1, 2, 2)
    assert (
        _released("pro_distill").out_visual_dim == 160
        and _released("lite_distill").out_audio_dim == 400
    )


def test_unknown_keys_are_ignored_and_audio_dims_fall_back():
    config = Kandinsky6TransformerConfig.from_json_dict(
        {
            "_diffusers_version": "0.42.1",
            "magcache": {"x": 1},
            "is_multimodal": True,
            "model_dim": 256,
        }
    )
    assert config.model_dim == 256 and config.audio_model_dim == 256
    assert config.audio_time_dim == config.time_dim and config.audio_axes_dims == config.axes_dims


@pytest.mark.parametrize(
    "key, value, message",
    [
        ("model_dim", "4096", "expected an integer"),
        ("model_dim", True, "expected an integer"),
        ("ca_rope", 1, "expected true or false"),
        ("axes_dims", [32, 48], "expected a list of 3"),
        ("audio_freqs_scaling", "0.144", "expected a number"),
        ("model_dim", 4000, "not divisible by the head dim 128"),
        ("axes_dims", [32, 48, 47], "must be even"),
    ],
)
def test_bad_values_name_the_key(key, value, message):
    with pytest.raises(ValueError, match=rf"'{key}'.*{message}"):
        Kandinsky6TransformerConfig.from_json_dict(
            {**RELEASED_TRANSFORMER_CONFIGS["pro"], key: value}
        )


def test_config_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        _released("pro").model_dim = 1


def _meta_parameter_count(name):
    with torch.device("meta"):
        model = Kandinsky6Transformer(_released(name))
    return sum(parameter.numel() for parameter in model.parameters())


def test_parameter_counts_on_meta():
    pro, lite = _meta_parameter_count("pro"), _meta_parameter_count("lite")
    print(f"Pro {pro:,} parameters, Lite {lite:,} parameters")
    assert round(pro / 1e9, 2) == 30.14 and str(pro).startswith("30136")
    assert round(lite / 1e9, 3) == 3.177
    # Distilled heads: 4 * (160 - 16) more video outputs and 400 - 40 more audio outputs, each + bias.
    extra_head_parameters = 4 * (160 - 16) * (4096 + 1) + (400 - 40) * (2048 + 1)
    assert _meta_parameter_count("pro_distill") - pro == extra_head_parameters


def test_keep_fp32_rule_matches_whole_path_components():
    keep = ("time_embeddings", "modulation")
    assert keeps_fp32("out_layer.modulation.out_layer.weight", keep)
    assert keeps_fp32("audio_out_layer.modulation.out_layer.bias", keep)
    assert not keeps_fp32("video_time_embeddings.timestep_embedder.linear_1.weight", keep)
    assert not keeps_fp32("visual_transformer_blocks.0.va_modulation.out_layer.weight", keep)


@pytest.fixture(scope="module")
def tiny_model():
    return Kandinsky6Transformer(Kandinsky6TransformerConfig(**TINY))


def test_every_attention_has_a_known_role(tiny_model):
    roles = {module.role for module in tiny_model.modules() if isinstance(module, InnerAttention)}
    assert roles == set(ATTENTION_ROLES)


def test_tp_plan_covers_every_attention_and_feed_forward_linear(tiny_model):
    plan = kandinsky6_plan(tiny_model.config)
    linears = {name for name, module in tiny_model.named_modules() if isinstance(module, nn.Linear)}
    planned = {name for name in linears if any(fnmatch.fnmatchcase(name, glob) for glob in plan.tp)}
    for glob in plan.tp:
        assert any(fnmatch.fnmatchcase(name, glob) for name in linears), f"{glob} matches no linear"
    block_prefixes = tuple(f"{blocks}." for blocks in plan.blocks)
    in_blocks = {name for name in linears if name.startswith(block_prefixes)}
    # Inside the blocks only the modulation projections stay replicated.
    assert in_blocks - planned == {name for name in in_blocks if "modulation" in name}


def test_attention_sites_and_sp_roles_are_consistent(tiny_model):
    config = tiny_model.config
    plan = kandinsky6_plan(config)
    for site in plan.attention:
        modules = [m for n, m in tiny_model.named_modules() if fnmatch.fnmatchcase(n, site.module)]
        assert modules, site.module
        for module in modules:
            assert module.inner_attention.role == site.role
            assert (module.num_heads, module.head_dim) == (site.num_heads, site.head_dim)
    sp = plan.sp
    role_groups = (sp.sharded_roles, sp.gather_kv_roles, sp.local_roles, sp.replicated_roles)
    assert sorted(role for group in role_groups for role in group) == sorted(ATTENTION_ROLES)
    block_arguments = inspect.signature(Kandinsky6FusedBlock.forward).parameters
    module_names = dict(tiny_model.named_modules())
    for point in (*sp.split_inputs, *sp.gather_outputs):
        assert point.module in module_names
        assert point.argument is None or point.argument in block_arguments
    assert plan.capabilities.tp and plan.capabilities.ulysses and plan.capabilities.ring
