"""Kandinsky 6 SR configs: vendor formats, released sizes on the meta device, plan and the head check."""

from __future__ import annotations

import copy

import pytest
import torch

from k6serve.models.kandinsky6_sr import released_configs as released
from k6serve.models.kandinsky6_sr.checks import (
    HEAD_WEIGHT,
    INPUT_WEIGHT,
    check_head_fits_scheduler,
    check_sr_checkpoint,
)
from k6serve.models.kandinsky6_sr.config import (
    RESOLUTIONS,
    SRSchedulerConfig,
    SRTransformerConfig,
    SRUpscalerConfig,
    SRVAEConfig,
)
from k6serve.models.kandinsky6_sr.plan import sr_plan
from k6serve.models.kandinsky6_sr.transformer import SRTransformer
from k6serve.testing.tiny_sr_checkpoint import build_sr_checkpoint


def test_released_transformer_config_reads_vendor_keys():
    config = SRTransformerConfig.from_dict(released.TRANSFORMER_CONFIG)
    assert (config.num_heads, config.head_dim, config.in_channels) == (28, 64, 129)
    assert config.out_visual_dim == 640
    assert config.rope_scale == (1.0, 2.0, 2.0)
    assert config.tile_sizes == RESOLUTIONS[512] == ((512, 512), (512, 768), (768, 512))
    assert (config.nabla_threshold, config.nabla_window) == (0.8, (11, 7, 7))
    assert (config.scheduler_scale, config.lq_noise_scale, config.lq_noise_type, config.fps) == (
        3.5,
        0.7,
        "ddpm",
        24,
    )
    flow = SRTransformerConfig.from_dict(released.FLOW_TRANSFORMER_CONFIG)
    assert (flow.out_visual_dim, flow.scheduler_scale) == (64, 5.0)


def test_rope_scale_and_tiles_come_from_the_config_not_defaults():
    raw = copy.deepcopy(released.TRANSFORMER_CONFIG)
    raw["sr_params"]["scale_factor"]["512"] = [1.0, 3.0, 4.0]
    raw["k6serve_tile_sizes"] = [[64, 64], [64, 128]]
    config = SRTransformerConfig.from_dict(raw)
    assert config.rope_scale == (1.0, 3.0, 4.0)
    assert config.tile_sizes == ((64, 64), (64, 128))


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda raw: raw.update(new_flag=True), "does not understand: \\['new_flag'\\]"),
        (lambda raw: raw.update(use_text=True), "use_text=true"),
        (lambda raw: raw["sr_params"].update(lq_noise_type="flow"), "lq_noise_type 'flow'"),
        (lambda raw: raw["sr_params"].update(visual_size=[1024]), "no entry for visual_size 1024"),
        (
            lambda raw: (
                raw["sr_params"]["scale_factor"].update({"1024": [1, 2, 2]})
                or raw["sr_params"].update(visual_size=[1024])
            ),
            "no known tile table",
        ),
        # The RoPE divides three axes (t, h, w): two scales failed only at the DiT's first forward, after the
        # load; a fourth was dropped without a word.
        (lambda raw: raw["sr_params"]["scale_factor"].update({"512": [1.0, 2.0]}), "scale_factor.*3 numbers"),
        (lambda raw: raw["sr_params"]["scale_factor"].update({"512": [1.0, 2.0, 2.0, 2.0]}),
         "scale_factor.*3 numbers"),
    ],
)
def test_transformer_config_rejects_what_k6serve_does_not_implement(mutate, message):
    raw = copy.deepcopy(released.TRANSFORMER_CONFIG)
    mutate(raw)
    with pytest.raises(ValueError, match=message):
        SRTransformerConfig.from_dict(raw)


def test_vae_config_nested_and_flat_variants_agree():
    nested = SRVAEConfig.from_dict(released.VAE_CONFIG)
    assert nested.encoder_block_out_channels == (16, 128, 256, 512, 1024)
    assert nested.decoder_block_out_channels == (16, 256, 512, 1024, 2048)
    assert (nested.layers_per_block, nested.temporal_compression_ratio, nested.latent_channels) == (
        2,
        4,
        64,
    )
    assert nested.spatial_compression_ratio == 16
    flat = {f"encoder_{k}": v for k, v in released.VAE_CONFIG["encoder_config"].items()}
    flat |= {f"decoder_{k}": v for k, v in released.VAE_CONFIG["decoder_config"].items()}
    flat["scaling_factor"] = released.VAE_CONFIG["scaling_factor"]
    assert SRVAEConfig.from_dict(flat) == nested
    bad = copy.deepcopy(released.VAE_CONFIG)
    bad["encoder_config"]["norm_type"] = "group_norm"
    with pytest.raises(ValueError, match="norm_type"):
        SRVAEConfig.from_dict(bad)


def test_upscaler_config_orders_x2_first_and_rejects_temporal_mix():
    config = SRUpscalerConfig.from_dict(released.LATENT_UPSCALER_CONFIG)
    assert config.scales == (2, 4)  # list order is 4x, 2x
    assert config.stage_channels == (2048, 1024, 512)
    assert (config.num_pre_blocks, config.num_mid_blocks, config.num_post_blocks) == (5, 3, 3)
    assert config.num_x2_adapter_blocks == 2
    bad = copy.deepcopy(released.LATENT_UPSCALER_CONFIG)
    bad["models"][0]["model"]["temporal_mix"] = True
    with pytest.raises(ValueError, match="temporal_mix"):
        SRUpscalerConfig.from_dict(bad)


def test_scheduler_configs():
    piflow = SRSchedulerConfig.from_dict(released.SCHEDULER_CONFIG)
    assert (piflow.is_piflow, piflow.nfe, piflow.n_grid, piflow.shift, piflow.eps) == (
        True,
        2,
        10,
        3.5,
        1e-6,
    )
    flow = SRSchedulerConfig.from_dict(released.FLOW_SCHEDULER_CONFIG)
    assert (flow.is_piflow, flow.shift) == (False, 5.0)
    with pytest.raises(ValueError, match="PiflowScheduler"):
        SRSchedulerConfig.from_dict({"_class_name": "DDIMScheduler"})


def test_released_parameter_counts_on_meta_device():
    from diffusers import Kandinsky6SRTransformer3DModel

    from k6serve.models.kandinsky6_sr.upscaler import build_upscaler
    from k6serve.models.kandinsky6_sr.vae import build_vae

    with torch.device("meta"):
        transformer = SRTransformer(SRTransformerConfig.from_dict(released.TRANSFORMER_CONFIG))
        reference = Kandinsky6SRTransformer3DModel()
        vae = build_vae(SRVAEConfig.from_dict(released.VAE_CONFIG))
        upscaler = build_upscaler(SRUpscalerConfig.from_dict(released.LATENT_UPSCALER_CONFIG))
    counts = {
        name: sum(p.numel() for p in module.parameters())
        for name, module in (
            ("transformer", transformer),
            ("vae", vae),
            ("latent_upscaler", upscaler),
        )
    }
    assert (
        counts
        == released.NUM_PARAMETERS
        == {
            "transformer": 1_414_263_936,
            "vae": 1_738_878_243,
            "latent_upscaler": 3_654_021_952,
        }
    )
    assert set(transformer.state_dict()) == set(reference.state_dict())  # diffusers keys, unchanged
    assert len(transformer.state_dict()) == released.NUM_TENSORS["transformer"]
    upscaler_keys = list(upscaler.state_dict())
    assert sum(k.startswith("_models.0.") for k in upscaler_keys) == 311  # x2
    assert sum(k.startswith("_models.1.") for k in upscaler_keys) == 178  # x4
    assert any(k.startswith("_models.0.x2_branch.") for k in upscaler_keys)


def test_plan_names_existing_modules_and_fp32_modulation():
    config = SRTransformerConfig.from_dict(released.TRANSFORMER_CONFIG)
    plan = sr_plan(config)
    with torch.device("meta"):
        model = SRTransformer(config)
    module_names = set(dict(model.named_modules()))
    for glob in plan.tp:
        assert glob.replace("*", "0") in module_names
    assert plan.attention[0].num_heads == 28
    from k6serve.models.plan import keeps_fp32

    fp32_params = sum(
        p.numel() for n, p in model.named_parameters() if keeps_fp32(n, plan.keep_fp32)
    )
    assert fp32_params == 179_524_608  # §1.1: time embeddings, pooled bias, every modulation


def _shapes(out_rows: int, in_cols: int = 129) -> dict[str, tuple[int, int]]:
    return {HEAD_WEIGHT: (out_rows, 1792), INPUT_WEIGHT: (1792, in_cols)}


def test_head_check_rejects_both_bad_pairs_with_a_clear_message():
    distilled = SRTransformerConfig.from_dict(released.TRANSFORMER_CONFIG)
    piflow = SRSchedulerConfig.from_dict(released.SCHEDULER_CONFIG)
    flow = SRSchedulerConfig.from_dict(released.FLOW_SCHEDULER_CONFIG)
    check_head_fits_scheduler(distilled, piflow, _shapes(640))
    check_head_fits_scheduler(
        SRTransformerConfig.from_dict(released.FLOW_TRANSFORMER_CONFIG), flow, _shapes(64)
    )
    with pytest.raises(ValueError, match="different repositories or revisions") as flow_with_640:
        check_head_fits_scheduler(distilled, flow, _shapes(640))
    assert "Kandinsky-6.0-VSR-distilled2steps-5s-Diffusers" in str(flow_with_640.value)
    plain = SRTransformerConfig.from_dict(released.FLOW_TRANSFORMER_CONFIG)
    with pytest.raises(
        ValueError, match="PiflowScheduler with n_grid 10 needs n_grid \\* in_visual_dim = 640"
    ):
        check_head_fits_scheduler(plain, piflow, _shapes(64))
    with pytest.raises(ValueError, match="has 640 rows but config.json says out_visual_dim 64"):
        check_head_fits_scheduler(plain, flow, _shapes(640))
    with pytest.raises(ValueError, match="takes 128 channels"):
        check_head_fits_scheduler(distilled, piflow, _shapes(640, in_cols=128))


@pytest.mark.parametrize(
    "head, message",
    [
        (None, None),
        ("flow640", "FlowMatchEulerDiscreteScheduler needs a plain head of in_visual_dim = 8"),
        ("plain64", "PiflowScheduler with n_grid 10 needs n_grid \\* in_visual_dim = 80"),
    ],
)
def test_head_check_on_tiny_checkpoints_reads_headers_only(tmp_path, head, message):
    path = build_sr_checkpoint(tmp_path / "ckpt", head=head or "distilled")
    if message is None:
        transformer, scheduler = check_sr_checkpoint(path)
        assert (transformer.out_visual_dim, scheduler.nfe, transformer.tile_sizes[0]) == (
            80,
            2,
            (64, 64),
        )
        return
    with pytest.raises(ValueError, match=message) as error:
        check_sr_checkpoint(path)
    assert "different repositories or revisions" in str(error.value)
