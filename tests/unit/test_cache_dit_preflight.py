"""Cache-DiT settings that leave no DiT block to cache are refused before the model loads, where the block count
needs no download (the demo, a local folder, a released checkpoint's built-in config), and when a request is
resolved (the server's job creation), not when it runs."""

from __future__ import annotations

import pytest

from k6serve import DiffGenerator
from k6serve.caching.preflight import check_cache_dit_config_before_loading
from k6serve.cli.main import main
from k6serve.engine_arguments import build_engine_config
from k6serve.models.kandinsky6.config_before_loading import dit_blocks_before_loading
from k6serve.request import SamplingParams

PRO = "kandinskylab/Kandinsky-6.0-Pro-5s-Diffusers"
VSR = "kandinskylab/Kandinsky-6.0-VSR-distilled2steps-5s-Diffusers"
TOO_MANY = '{"Fn_compute_blocks": 2, "Bn_compute_blocks": 1}'  # the demo DiT has 2 fused blocks
REFUSAL = (r"Fn_compute_blocks \(2\) \+ Bn_compute_blocks \(1\) must leave at least one of the DiT's 2 fused "
           r"blocks to cache; lower them to a sum of at most 1\.")


def test_the_cli_refuses_before_loading(demo_dir, no_ranks, capsys):
    # Before: the weights loaded, then the request failed.
    assert main(["generate", "--model-path", "demo", "--prompt", "x", "--cache-dit-params", TOO_MANY,
                 "--no-save-output"]) == 2
    # The flag typed, not the field of the API and the server (`cache_dit_params: ...`).
    assert "error: --cache-dit-params: Fn_compute_blocks (2) + Bn_compute_blocks (1)" in capsys.readouterr().err
    assert main(["generate", "--model-path", "demo", "--prompt", "x", "--cache-dit-config", TOO_MANY,
                 "--no-save-output"]) == 2
    assert "error: --cache-dit-config: Fn_compute_blocks (2)" in capsys.readouterr().err
    # A server would have started and failed every generation job.
    assert main(["serve", "--model-path", "demo", "--cache-dit-config", TOO_MANY]) == 2
    assert "error: --cache-dit-config: Fn_compute_blocks (2)" in capsys.readouterr().err


@pytest.mark.parametrize("settings, refusal", [
    ('{"bogus": 1}', "error: Unknown --cache-dit-params key(s) ['bogus']."),
    ('{"scm_preset": "fast"}', "error: scm_preset in --cache-dit-params needs 4, 6 or at least 8 steps, the request "
                               "has 3; drop scm_preset or give scm_compute_bins / scm_cache_bins."),
    ('{"residual_diff_threshold": -1}', "error: residual_diff_threshold in --cache-dit-params must be a finite number "
                                        ">= 0, got -1"),
])
def test_the_cli_names_its_flag_in_a_refusal_of_the_settings(demo_dir, no_ranks, capsys, settings, refusal):
    # Each read `cache_dit_params`, the API's and the server's field, to a user who typed --cache-dit-params.
    assert main(["generate", "--model-path", "demo", "--prompt", "x", "--cache-dit-params", settings,
                 "--num-inference-steps", "3", "--no-save-output"]) == 2
    err = capsys.readouterr().err
    assert refusal in err and "cache_dit_params" not in err


def test_the_request_fields_keep_their_names_for_the_api_and_the_server():
    from k6serve.models.variants import VARIANTS
    from k6serve.request_resolution import resolve_generate

    with pytest.raises(ValueError, match=r"^cache_dit_params\.scm_preset needs 4, 6 or at least 8 steps"):
        resolve_generate(SamplingParams(prompt="x", num_inference_steps=3, cache_dit_params={"scm_preset": "fast"}),
                         VARIANTS["pro"])
    with pytest.raises(ValueError, match=r"^Unknown cache_dit_params key\(s\) \['bogus'\]"):
        resolve_generate(SamplingParams(prompt="x", cache_dit_params={"bogus": 1}), VARIANTS["pro"])


def test_the_api_refuses_an_engine_config_before_loading(demo_dir, no_ranks):
    with pytest.raises(ValueError, match="^cache_dit_config: " + REFUSAL):  # the API names its keyword
        DiffGenerator.from_pretrained("demo", device="cpu", cache_dit_config={"Fn_compute_blocks": 2,
                                                                              "Bn_compute_blocks": 1})


def test_block_counts_known_without_a_download(demo_dir, tiny_distill_dir, hub_offline):
    assert dit_blocks_before_loading(build_engine_config("demo").model) == 2
    assert dit_blocks_before_loading(build_engine_config(str(tiny_distill_dir)).model) == 2
    assert dit_blocks_before_loading(build_engine_config(PRO).model) == 60  # the built-in released config
    assert dit_blocks_before_loading(build_engine_config(VSR).model) is None  # super-resolution: no Cache-DiT
    assert dit_blocks_before_loading(build_engine_config("someone/unknown-k6-finetune").model) is None
    with pytest.raises(ValueError, match=r"of the DiT's 60 fused blocks to cache; lower them to a sum of at most 59"):
        check_cache_dit_config_before_loading(build_engine_config(PRO, cache_dit_config={"Fn_compute_blocks": 60}))
    check_cache_dit_config_before_loading(build_engine_config(PRO, cache_dit_config={"Fn_compute_blocks": 59}))


def test_serve_warns_at_start_of_a_mask_that_cannot_run_the_default_steps(demo_dir, caplog):
    # Every job that left num_inference_steps out was refused, with nothing said at start.
    from k6serve.caching.preflight import warn_if_the_default_steps_do_not_fit

    with caplog.at_level("WARNING", logger="k6serve.caching.preflight"):
        warn_if_the_default_steps_do_not_fit(build_engine_config("demo", cache_dit_config={
            "scm_compute_bins": [2], "scm_cache_bins": [1]}))
        assert caplog.messages == [
            "--cache-dit-config: scm_compute_bins and scm_cache_bins cover 3 steps, and demo runs 10 steps by "
            "default: every request that leaves num_inference_steps out will be refused; send steps the mask covers, "
            "or change the mask"]
        caplog.clear()
        for cache_dit in ({"scm_compute_bins": [6], "scm_cache_bins": [4]}, {"scm_preset": "fast"}, {}, None):
            warn_if_the_default_steps_do_not_fit(build_engine_config("demo", cache_dit_config=cache_dit))
        assert caplog.messages == []


@pytest.mark.slow
def test_the_engine_refuses_a_request_when_it_resolves_it(demo_dir):
    # What the server's job creation calls: before, the job was accepted (202) and failed when it ran.
    generator = DiffGenerator.from_pretrained("demo", device="cpu")
    try:
        with pytest.raises(ValueError, match="^cache_dit_params: " + REFUSAL):
            generator.engine.resolve(SamplingParams(prompt="x", cache_dit_params={"Fn_compute_blocks": 2,
                                                                                  "Bn_compute_blocks": 1}))
        request, _ = generator.engine.resolve(SamplingParams(prompt="x", cache_dit_params={"Fn_compute_blocks": 1}))
        assert request.cache_dit.Fn_compute_blocks == 1
    finally:
        generator.shutdown()


def test_serve_tells_a_flags_mistake_before_a_port_in_use(demo_dir, no_ranks, capsys, tmp_path):
    # The port was bound first, so a busy port (CI shared with another server on the default 30000) hid the flag's
    # mistake behind "port ... is already in use"; nor are the output folder and its lock made for a refused run.
    import socket

    with socket.create_server(("127.0.0.1", 0)) as busy:
        port = str(busy.getsockname()[1])
        assert main(["serve", "--model-path", "demo", "--port", port, "--output-path", str(tmp_path / "out"),
                     "--cache-dit-config", TOO_MANY]) == 2
        assert "error: --cache-dit-config: Fn_compute_blocks (2)" in capsys.readouterr().err
        assert main(["serve", "--model-path", "demo", "--port", port, "--output-path", str(tmp_path / "out"),
                     "--num-gpus", "2", "--enable-cfg-parallel"]) == 2
        assert "has no classifier-free guidance branch" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
