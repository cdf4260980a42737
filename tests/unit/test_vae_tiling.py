"""`--vae-tiling {auto,on,off}`: how "auto" resolves, the flag reaching the worker from the CLI, the config and the API,
the demo worker's VAE really decoding in spatial tiles when on, and the SR refusal. CPU only: "auto" is resolved for
a CUDA device by passing the device, never by running on one.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from k6serve.engine_arguments import build_engine_config
from k6serve.models.variants import GENERATION, SUPER_RESOLUTION
from k6serve.request import OutputOptions, SamplingParams
from k6serve.runtime.worker import ModelWorker
from k6serve.speed.vae_tiling import resolve_vae_tiling

pytestmark = pytest.mark.usefixtures("one_torch_thread")

NO_FILE = OutputOptions(save_output=False, return_frames=True)
CUDA, CPU = torch.device("cuda"), torch.device("cpu")


@pytest.mark.parametrize(("setting", "mode", "device", "tiled"), [
    ("auto", "memory", CUDA, True),
    ("auto", "memory", CPU, False),
    ("auto", "speed", CUDA, False),
    ("auto", "balanced", CUDA, False),
    ("auto", "balanced", CPU, False),
    ("on", "speed", CUDA, True),
    ("on", "balanced", CPU, True),
    ("off", "memory", CUDA, False),
    ("off", "speed", CPU, False),
])
def test_generation_resolution(setting, mode, device, tiled):
    assert resolve_vae_tiling(setting, mode, device, GENERATION) is tiled


def test_super_resolution_is_never_tiled_and_refuses_on():
    assert resolve_vae_tiling("auto", "memory", CUDA, SUPER_RESOLUTION) is False
    assert resolve_vae_tiling("off", "memory", CUDA, SUPER_RESOLUTION) is False
    with pytest.raises(ValueError, match=r"super-resolution pipeline already decodes its K-VAE tile by tile .*"
                                         r"drop --vae-tiling"):
        resolve_vae_tiling("on", "speed", CUDA, SUPER_RESOLUTION)


def test_config_cli_and_api_carry_the_flag():
    from k6serve.cli.flags import build_parser

    assert build_engine_config("demo").runtime.vae_tiling == "auto"
    assert build_engine_config("demo", vae_tiling="on").runtime.vae_tiling == "on"
    with pytest.raises(ValueError, match=r"--vae-tiling must be one of \('auto', 'on', 'off'\), got 'yes'"):
        build_engine_config("demo", vae_tiling="yes")
    for command in ("generate", "serve"):
        args = build_parser().parse_args([command, "--model-path", "demo", "--vae-tiling", "on"])
        assert args.vae_tiling == "on"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "--model-path", "demo", "--vae-tiling", "always"])


def test_config_file_value_reaches_the_engine_options(tmp_path):
    from k6serve.cli.config_file import merged_options
    from k6serve.cli.flags import build_parser, split_options

    config = tmp_path / "engine.yaml"
    config.write_text("vae-tiling: \"on\"\n")
    parser = build_parser()
    args = parser.parse_args(["generate", "--config", str(config), "--model-path", "demo"])
    engine, _ = split_options(merged_options(args, parser))
    assert engine["vae_tiling"] == "on"


def _worker(**options) -> ModelWorker:
    return ModelWorker(build_engine_config("demo", device="cpu", attention_backend="sdpa", **options))


def test_demo_worker_tiles_when_on_and_not_by_default_on_cpu(demo_dir):
    assert _worker(vae_tiling="on").pipeline.models.vae.use_tiling is True
    default = _worker(performance_mode="memory")  # auto: memory mode, but on the CPU
    assert default.vae_tiling is False and default.pipeline.models.vae.use_tiling is False


def test_tiled_generation_decodes_spatial_tiles(demo_dir, monkeypatch):
    worker = _worker(vae_tiling="on")
    vae = worker.pipeline.models.vae
    # The demo's 64x96 frames fit in one default 256 px tile: shrink the tiles so the decode splits them.
    for name, value in [("tile_sample_min_height", 32), ("tile_sample_min_width", 32),
                        ("tile_sample_stride_height", 24), ("tile_sample_stride_width", 24)]:
        monkeypatch.setattr(vae, name, value)
    calls = [0]
    tiled_decode = vae.tiled_decode

    def counted(*args, **kwargs):
        calls[0] += 1
        return tiled_decode(*args, **kwargs)

    monkeypatch.setattr(vae, "tiled_decode", counted)
    decoder_calls = [0]
    vae.decoder.register_forward_pre_hook(lambda *_: decoder_calls.__setitem__(0, decoder_calls[0] + 1))
    result = worker.run(SamplingParams(prompt="a fox in the snow", seed=7, num_frames=17), NO_FILE)
    # 17 frames = 5 latent frames: two temporal tiles, each an 8 x 12 latent grid decoded as 3 x 4 spatial tiles
    # (4 x 4 latents, stride 3).
    assert calls[0] == 2 and decoder_calls[0] == 2 * 3 * 4
    assert result.frames.shape == (17, 64, 96, 3) and result.frames.dtype == np.uint8


def test_super_resolution_worker_refuses_on_before_loading(tiny_sr_dir, monkeypatch):
    def no_load(*_):
        raise AssertionError("the pipeline was built before --vae-tiling on was refused")

    monkeypatch.setattr(ModelWorker, "_build_pipeline", no_load)
    with pytest.raises(ValueError, match="drop --vae-tiling"):
        ModelWorker(build_engine_config(str(tiny_sr_dir), device="cpu", vae_tiling="on"))
