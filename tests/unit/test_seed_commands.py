"""Every command line of the seed documents, flag for flag, as `k6serve` reads it: each spelling is accepted, reaches
the option it names, and the layouts pass the checks made before anything loads (released checkpoints are known by
name, without a download). The runs themselves are tested elsewhere (test_generate_cli_api.py, test_sr_cli_api.py,
tests/parity/test_parallel_models.py)."""

from __future__ import annotations

import pytest

from k6serve.cli.config_file import merged_options
from k6serve.cli.flags import build_parser, split_options
from k6serve.parallel.mesh import ParallelLayout
from k6serve.parallel.preflight import check_layout_before_loading
from k6serve.parallel.tile_decode import SPATIAL_SHARD, WHOLE_TILE, sr_decode_mode

PRO_DISTILL = "kandinskylab/Kandinsky-6.0-Pro-distill-5s-Diffusers"
PRO = "kandinskylab/Kandinsky-6.0-Pro-5s-Diffusers"
VSR = "kandinskylab/Kandinsky-6.0-VSR-distilled2steps-5s-Diffusers"
PROMPT = "A woman chops vegetables in a sunlit kitchen, with soft jazz playing."


def _read(*argv: str):
    """(engine config, request options) of `k6serve <argv>`, the layout checked as before loading."""
    from k6serve.engine_arguments import build_engine_config

    parser = build_parser()
    engine, request = split_options(merged_options(parser.parse_args(list(argv)), parser))
    config = build_engine_config(engine.pop("model_path"), **engine)
    check_layout_before_loading(config)
    return config, request


def test_offline_generation(hub_offline):
    config, request = _read("generate", "--model-path", PRO_DISTILL, "--performance-mode", "speed",
                            "--attention-backend", "fa", "--warmup-mode", "off", "--prompt", PROMPT, "--seed", "42",
                            "--save-output")
    assert (config.runtime.performance_mode, config.runtime.attention_backend, config.runtime.warmup_mode) == (
        "speed", "fa", "off")
    assert request == {"prompt": PROMPT, "seed": 42, "save_output": True}


@pytest.mark.parametrize(("model", "flags", "degrees"), [
    # Ulysses on two B200s / four GB300s.
    (PRO_DISTILL, ["--num-gpus", "2", "--ulysses-degree", "2"], {"ulysses_degree": 2}),
    (PRO_DISTILL, ["--num-gpus", "4", "--ulysses-degree", "4"], {"ulysses_degree": 4}),
    # "Pro can distribute its conditional and unconditional branches with --num-gpus 2 --ulysses-degree 1
    # --enable-cfg-parallel."
    (PRO, ["--num-gpus", "2", "--ulysses-degree", "1", "--enable-cfg-parallel"], {"enable_cfg_parallel": True}),
    # "Use --num-gpus 2 --ulysses-degree 1 --ring-degree 2 to select Ring2"; Ring4; TP2 x Ring2.
    (PRO_DISTILL, ["--num-gpus", "2", "--ulysses-degree", "1", "--ring-degree", "2"], {"ring_degree": 2}),
    (PRO_DISTILL, ["--num-gpus", "4", "--ring-degree", "4"], {"ring_degree": 4}),
    (PRO_DISTILL, ["--num-gpus", "4", "--tp-size", "2", "--ring-degree", "2"], {"tp_size": 2, "ring_degree": 2}),
    # TP2 x Ulysses2 on four GB300s.
    (PRO_DISTILL, ["--num-gpus", "4", "--tp-size", "2", "--ulysses-degree", "2"], {"tp_size": 2, "ulysses_degree": 2}),
    # "add --use-fsdp-inference true" to Ulysses4.
    (PRO_DISTILL, ["--num-gpus", "4", "--ulysses-degree", "4", "--use-fsdp-inference", "true"],
     {"ulysses_degree": 4, "use_fsdp_inference": True}),
    # "--encoder-parallel fold shards Reason1 and CLIP across the DiT replica, including a Ulysses-only replica."
    (PRO_DISTILL, ["--num-gpus", "4", "--ulysses-degree", "4", "--encoder-parallel", "fold"],
     {"ulysses_degree": 4, "encoder_parallel": "fold"}),
    # SR: "--num-gpus 4 --tp-size 1 --ulysses-degree 4", "--num-gpus 4 --tp-size 2 --ulysses-degree 2", and eight
    # GPUs as Ulysses4 x Ring2.
    (VSR, ["--num-gpus", "4", "--tp-size", "1", "--ulysses-degree", "4"], {"tp_size": 1, "ulysses_degree": 4}),
    (VSR, ["--num-gpus", "4", "--tp-size", "2", "--ulysses-degree", "2"], {"tp_size": 2, "ulysses_degree": 2}),
    (VSR, ["--num-gpus", "8", "--ulysses-degree", "4", "--ring-degree", "2"], {"ulysses_degree": 4, "ring_degree": 2}),
])
def test_parallel_layouts(hub_offline, model, flags, degrees):
    config, _ = _read("serve", "--model-path", model, *flags)
    for name, value in degrees.items():
        assert getattr(config.parallel, name) == value, name


def test_the_layouts_the_seed_rules_out_are_refused_with_the_valid_one(hub_offline):
    # "28 heads are not divisible by 8": eight GPUs are Ulysses4 x Ring2, not Ulysses8.
    with pytest.raises(ValueError, match="Fix: --ulysses-degree 4 --ring-degree 2"):
        _read("serve", "--model-path", VSR, "--num-gpus", "8", "--ulysses-degree", "8")
    # "TP times Ulysses must divide the checkpoint's 28 attention heads."
    with pytest.raises(ValueError, match="Ulysses must divide the TP-local heads"):
        _read("serve", "--model-path", VSR, "--num-gpus", "8", "--tp-size", "2", "--ulysses-degree", "4")
    # "FSDP requires multiple GPUs."
    with pytest.raises(ValueError, match="one GPU"):
        _read("serve", "--model-path", PRO_DISTILL, "--use-fsdp-inference", "true")


def test_encoder_fold_shards_both_released_encoders_over_four_gpus(hub_offline):
    """The seed's four-GPU fold: Reason1 (28 heads, 4 key/value heads, MLP 18944) and CLIP (12 heads, MLP 3072) both
    divide by 4, so the fold is taken, not refused."""
    from k6serve.models.checkpoint_files import variant_before_loading
    from k6serve.parallel.encoder_folding import should_fold
    from k6serve.parallel.preflight import _text_encoder_configs

    config, _ = _read("serve", "--model-path", PRO_DISTILL, "--num-gpus", "4", "--ulysses-degree", "4",
                      "--encoder-parallel", "fold")
    _, folder = variant_before_loading(PRO_DISTILL, None, "auto")
    assert should_fold("fold", ParallelLayout.from_config(config.parallel), _text_encoder_configs(folder))


def test_offload_recipes():
    config, _ = _read("serve", "--model-path", PRO_DISTILL, "--cpu-offload-components", "transformer",
                      "text_encoder", "vae")
    plan = config.runtime.residency_plan(super_resolution=False)
    assert plan.named("component") == ("text_encoder", "transformer", "vae")
    config, _ = _read("serve", "--model-path", PRO_DISTILL, "--layerwise-offload-components", "all")
    plan = config.runtime.residency_plan(super_resolution=False)
    assert plan.named("layerwise") == ("text_encoder", "text_encoder_2", "transformer")  # the DiT's text towers too
    assert plan.named("resident") == ()
    # SR: "--layerwise-offload-components all, or select vae latent_upscaler instead".
    for names in (["all"], ["vae", "latent_upscaler"]):
        config, _ = _read("serve", "--model-path", VSR, "--layerwise-offload-components", *names)
        residency = config.runtime.residency_plan(super_resolution=True).residency
        assert residency["vae"] != "resident" and residency["latent_upscaler"] != "resident"
    # "Use component-specific residency settings to keep selected components resident."
    config, _ = _read("serve", "--model-path", PRO_DISTILL, "--layerwise-offload-components", "all",
                      "--component-residency", "vae=resident")
    assert config.runtime.residency_plan(super_resolution=False).residency["vae"] == "resident"


def test_super_resolution_offline_command(hub_offline):
    config, request = _read("generate", "--model-path", VSR, "--video-path", "/path/to/input.mp4",
                            "--sr-resolution-scale", "2", "--num-inference-steps", "2", "--seed", "42",
                            "--save-output", "--output-path", "./sr_outputs", "--output-file-name", "clip.mp4")
    assert request == {"video_path": "/path/to/input.mp4", "sr_resolution_scale": 2.0, "num_inference_steps": 2,
                       "seed": 42, "save_output": True, "output_path": "./sr_outputs", "output_file_name": "clip.mp4"}
    # A renamed local checkpoint keeps SR routing with --model-id (tests/unit/test_variants.py routes the folder).
    config, _ = _read("serve", "--model-path", VSR, "--model-id", "Kandinsky-6.0-VSR-distilled2steps-5s-Diffusers")
    assert config.model.model_id == "Kandinsky-6.0-VSR-distilled2steps-5s-Diffusers"


def test_super_resolution_decode_flags(hub_offline):
    four = ["--num-gpus", "4", "--ulysses-degree", "4"]
    config, _ = _read("serve", "--model-path", VSR, *four, "--vae-config.use-parallel-tiling", "true")
    assert sr_decode_mode(config.runtime, replica_size=4, super_resolution=True) == WHOLE_TILE
    spatial = ["--vae-config.use-parallel-decode", "true", "--vae-config.parallel-decode-mode", "spatial_shard"]
    config, _ = _read("serve", "--model-path", VSR, *four, *spatial)
    assert sr_decode_mode(config.runtime, replica_size=4, super_resolution=True) == SPATIAL_SHARD
    # "If both flags are enabled, spatial sharding takes precedence."
    config, _ = _read("serve", "--model-path", VSR, *four, "--vae-config.use-parallel-tiling", "true", *spatial)
    assert sr_decode_mode(config.runtime, replica_size=4, super_resolution=True) == SPATIAL_SHARD
