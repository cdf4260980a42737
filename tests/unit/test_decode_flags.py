"""The seed's `--vae-config.*` SR decode flags: on a multi-GPU SR replica they choose whole tiles decoded in parallel
(the default, bitwise equal to serial) or each tile's height split across the GPUs (spatial_shard); elsewhere (one
GPU, a generation model) they choose nothing; every GPU decoding every tile, the reference's choice, has the same
frames and is decoded as whole tiles, with a warning."""

from __future__ import annotations

import pytest

from k6serve.engine_arguments import build_engine_config
from k6serve.parallel.tile_decode import sr_decode_mode
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


def test_the_decode_each_choice_selects():
    from k6serve.parallel.tile_decode import SERIAL, SPATIAL_SHARD, WHOLE_TILE

    def mode(replica_size=2, super_resolution=True, **options):
        return sr_decode_mode(_runtime(**options), replica_size=replica_size, super_resolution=super_resolution)

    assert mode() == WHOLE_TILE  # a multi-GPU SR replica's default, bitwise equal to serial
    assert mode(vae_parallel_tiling=True, vae_parallel_decode=True, vae_parallel_decode_mode="whole_tile") == WHOLE_TILE
    assert mode(vae_parallel_decode=True, vae_parallel_decode_mode="spatial_shard") == SPATIAL_SHARD
    # As in the reference, spatial_shard takes precedence over use-parallel-tiling, true or false.
    assert mode(vae_parallel_tiling=False, vae_parallel_decode=True,
                vae_parallel_decode_mode="spatial_shard") == SPATIAL_SHARD
    assert mode(vae_parallel_tiling=True, vae_parallel_decode=True,
                vae_parallel_decode_mode="spatial_shard", replica_size=4) == SPATIAL_SHARD
    # As in the reference, use-parallel-decode false keeps whole tiles (bitwise equal to serial); named alone it is
    # refused with the fix (the reference would decode whole tiles without a word; taken, it would change the
    # rounding without the flag that says so).
    assert mode(vae_parallel_decode=False, vae_parallel_decode_mode="spatial_shard") == WHOLE_TILE
    with pytest.raises(ValueError, match=r"^--vae-config.parallel-decode-mode spatial_shard is selected together "
                                         r"with --vae-config.use-parallel-decode true \(.*\)\. Add that flag, or "
                                         r"drop the mode to decode whole tiles in parallel, bitwise equal to serial\.$"):
        mode(vae_parallel_decode_mode="spatial_shard")
    assert mode(replica_size=1, vae_parallel_decode_mode="spatial_shard") == SERIAL  # one GPU: nothing to choose
    # One GPU or the generation VAE: nothing to choose.
    assert mode(replica_size=1, vae_parallel_decode=True, vae_parallel_decode_mode="spatial_shard") == SERIAL
    assert mode(super_resolution=False, vae_parallel_decode_mode="spatial_shard") == SERIAL
    assert mode(replica_size=1, vae_parallel_tiling=False) == SERIAL


def test_every_gpu_decoding_every_tile_is_decoded_as_whole_tiles_with_a_warning(caplog):
    """The reference's --vae-config.use-parallel-tiling false was refused, so its command lines failed here. Its
    frames are the whole-tile decode's bit for bit (tests/parity/test_parallel_models.py: whole-tile equals serial),
    so it is accepted and said to be decoded that way."""
    from k6serve.parallel.tile_decode import SPATIAL_SHARD, WHOLE_TILE

    runtime = _runtime(vae_parallel_tiling=False)
    with caplog.at_level("WARNING", logger="k6serve.parallel.tile_decode"):
        assert sr_decode_mode(runtime, replica_size=4, super_resolution=True) == WHOLE_TILE
    assert [record.getMessage() for record in caplog.records] == [
        "--vae-config.use-parallel-tiling false (every GPU decoding every tile) is taken as the parallel whole-tile "
        "decode: the same frames bit for bit, in about 1/4 of the decode time across this replica's GPUs."]
    assert caplog.records[0].k6serve_same_on_every_rank  # written by rank 0 only (rank_logging.py)
    spatial = _runtime(vae_parallel_tiling=False, vae_parallel_decode=True, vae_parallel_decode_mode="spatial_shard")
    assert sr_decode_mode(spatial, replica_size=2, super_resolution=True) == SPATIAL_SHARD


@pytest.mark.parametrize(("replica_size", "super_resolution", "where"), [
    (1, True, "one GPU per replica"), (2, False, "a generation model"), (1, False, "a generation model")])
def test_decode_flags_that_choose_nothing_are_said_to_be_ignored(replica_size, super_resolution, where, caplog):
    """They did nothing there without a word: a flag typed for the run that does nothing is warned about."""
    runtime = _runtime(vae_parallel_tiling=False, vae_parallel_decode_mode="spatial_shard")
    with caplog.at_level("WARNING", logger="k6serve.parallel.tile_decode"):
        assert sr_decode_mode(runtime, replica_size=replica_size, super_resolution=super_resolution) == "serial"
    assert [record.getMessage() for record in caplog.records] == [
        "--vae-config.use-parallel-tiling false and --vae-config.parallel-decode-mode spatial_shard only choose how "
        f"super-resolution tiles are decoded across a replica's GPUs; with {where} they do nothing (ignored)."]
    assert caplog.records[0].k6serve_same_on_every_rank
    caplog.clear()
    sr_decode_mode(_runtime(), replica_size=replica_size, super_resolution=super_resolution)
    assert caplog.records == []


def test_the_worker_refuses_before_loading_the_weights(tiny_sr_dir, monkeypatch):
    monkeypatch.setattr(ModelWorker, "_build_pipeline",
                        lambda self, folder: pytest.fail("loaded the weights before refusing the flag"))
    config = build_engine_config(str(tiny_sr_dir), device="cpu", num_gpus=2, ulysses_degree=2,
                                 vae_parallel_decode_mode="spatial_shard")
    with pytest.raises(ValueError, match="is selected together with --vae-config.use-parallel-decode true"):
        ModelWorker(config)
