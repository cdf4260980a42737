"""The seed's `--vae-config.*` SR decode flags: accepted where they ask for what k6serve does (whole tiles decoded in
parallel on a multi-GPU replica, bitwise equal to serial) or choose nothing (one GPU, a generation model), refused
with the fix where they ask for a decode k6serve does not have."""

from __future__ import annotations

import pytest

from k6serve.api import build_engine_config
from k6serve.parallel.tile_decode import check_decode_flags
from k6serve.runtime.worker import ModelWorker


def _runtime(**options):
    return build_engine_config("demo", **options).runtime


@pytest.mark.parametrize("command", ["generate", "serve"])
def test_the_seeds_spelling_reaches_the_config(command, tmp_path, engine_config_from_cli):
    extra = ["--prompt", "x"] if command == "generate" else []
    runtime = engine_config_from_cli(command, "--model-path", "demo", "--vae-config.use-parallel-tiling", "true",
                                     "--vae-config.use-parallel-decode", "true", "--vae-config.parallel-decode-mode",
                                     "whole_tile", *extra).runtime
    assert (runtime.vae_parallel_tiling, runtime.vae_parallel_decode, runtime.vae_parallel_decode_mode) == (
        True, True, "whole_tile")
    config_file = tmp_path / "engine.yaml"
    config_file.write_text("vae-config.use-parallel-tiling: false\nvae_parallel_decode_mode: spatial_shard\n")
    runtime = engine_config_from_cli(command, "--model-path", "demo", "--config", str(config_file), *extra).runtime
    assert (runtime.vae_parallel_tiling, runtime.vae_parallel_decode_mode) == (False, "spatial_shard")


def test_an_unknown_decode_mode_is_refused():
    with pytest.raises(ValueError, match=r"^--vae-config.parallel-decode-mode must be one of whole_tile, "
                                         r"spatial_shard, got 'halo'$"):
        _runtime(vae_parallel_decode_mode="halo")


@pytest.mark.parametrize(("options", "message"), [
    (dict(vae_parallel_decode=True, vae_parallel_decode_mode="spatial_shard"),
     r"^--vae-config.parallel-decode-mode spatial_shard .* is not available in k6serve\. A multi-GPU replica decodes "
     r"whole tiles in parallel, equal to the serial decode bit for bit: drop --vae-config.parallel-decode-mode \(or "
     r"give it whole_tile\)\.$"),
    (dict(vae_parallel_tiling=False),
     r"^--vae-config.use-parallel-tiling false asks every GPU to decode every tile;.*Drop the flag \(or set it "
     r"true\)\.$"),
])
def test_refused_on_a_multi_gpu_sr_replica_only(options, message):
    runtime = _runtime(**options)
    with pytest.raises(ValueError, match=message):
        check_decode_flags(runtime, replica_size=2, super_resolution=True)
    check_decode_flags(runtime, replica_size=1, super_resolution=True)  # one GPU: nothing to choose
    check_decode_flags(runtime, replica_size=2, super_resolution=False)  # the generation VAE decodes replicated
    # What k6serve does anyway is accepted everywhere.
    check_decode_flags(_runtime(vae_parallel_tiling=True, vae_parallel_decode=True,
                                vae_parallel_decode_mode="whole_tile"), replica_size=4, super_resolution=True)
    # spatial_shard alone is refused too (the reference would need use-parallel-decode true to select it, and
    # without a word decode whole tiles); with use-parallel-decode false it selects nothing.
    with pytest.raises(ValueError, match="spatial_shard"):
        check_decode_flags(_runtime(vae_parallel_decode_mode="spatial_shard"), replica_size=2, super_resolution=True)
    check_decode_flags(_runtime(vae_parallel_decode=False, vae_parallel_decode_mode="spatial_shard"), replica_size=2,
                       super_resolution=True)


def test_the_worker_refuses_before_loading_the_weights(tiny_sr_dir, monkeypatch):
    monkeypatch.setattr(ModelWorker, "_build_pipeline",
                        lambda self, folder: pytest.fail("loaded the weights before refusing the flag"))
    config = build_engine_config(str(tiny_sr_dir), device="cpu", num_gpus=2, ulysses_degree=2,
                                 vae_parallel_decode=True, vae_parallel_decode_mode="spatial_shard")
    with pytest.raises(ValueError, match="spatial_shard"):
        ModelWorker(config)
