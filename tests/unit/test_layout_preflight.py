"""A parallel layout the ranks would refuse after loading the checkpoint is refused before any rank starts."""

from __future__ import annotations

import pytest

from k6serve import DiffGenerator
from k6serve.cli.main import main
from k6serve.engine_arguments import build_engine_config
from k6serve.parallel.preflight import check_layout_before_loading

PRO_DISTILL = "kandinskylab/Kandinsky-6.0-Pro-distill-5s-Diffusers"
PRO = "kandinskylab/Kandinsky-6.0-Pro-5s-Diffusers"
VSR = "kandinskylab/Kandinsky-6.0-VSR-distilled2steps-5s-Diffusers"


@pytest.mark.parametrize(("options", "message"), [
    ({"num_gpus": 2, "enable_cfg_parallel": True},
     r"^demo has no classifier-free guidance branch .* Fix: drop enable_cfg_parallel=True and use "
     r"ulysses_degree=2 for the same GPUs\.$"),
    ({"num_gpus": 8, "ulysses_degree": 8},  # the demo DiT has 4 video heads
     r"^demo: Ulysses must divide .* 'video_self' has 4 heads .* Fix: ulysses_degree=4, ring_degree=2 "),
    ({"num_gpus": 4, "tp_size": 4},  # and 2 audio heads
     r"^demo: tensor parallelism must divide .* 'text_self' has 2 heads and tp_size is 4 "),
    ({"use_fsdp_inference": True},
     r"^use_fsdp_inference=True shards the DiT .* this replica has one GPU\. Fix: drop use_fsdp_inference=True, or "
     r"give each replica more GPUs \(e\.g\. num_gpus=2, ulysses_degree=2\)\.$"),
    ({"num_gpus": 2, "dp_size": 2, "use_fsdp_inference": True},
     r"\(e\.g\. num_gpus=4, ulysses_degree=2; or, on the same 2 GPUs, one replica: dp_size=1, ulysses_degree=2\)"),
    ({"num_gpus": 2, "tp_size": 2, "use_fsdp_inference": True},
     r"^use_fsdp_inference=True shards whole parameters .* cannot also shard them with tp_size=2\."),
    ({"encoder_parallel": "fold"},
     r"^encoder_parallel='fold' shards the text encoders over the ranks of a replica, and this replica has one GPU"),
    ({"num_gpus": 2, "ulysses_degree": 2, "encoder_parallel": "fold"},  # the demo's Qwen has 1 key/value head
     r"^encoder_parallel='fold' over 2 ranks is impossible: Qwen2_5_VLForConditionalGeneration has 1 key/value "
     r"heads, not divisible by 2\."),
])
def test_the_api_refuses_a_layout_before_the_ranks_start(demo_dir, no_ranks, options, message):
    with pytest.raises(ValueError, match=message):
        DiffGenerator.from_pretrained("demo", device="cpu", **options)


def test_the_cli_refuses_a_layout_before_the_ranks_start(demo_dir, no_ranks, capsys):
    assert main(["generate", "--model-path", "demo", "--prompt", "x", "--num-gpus", "2",
                 "--enable-cfg-parallel", "--no-save-output"]) == 2
    err = capsys.readouterr().err
    assert ("error: demo has no classifier-free guidance branch (it runs one forward per step), so "
            "--enable-cfg-parallel would leave half the GPUs idle. Fix: drop --enable-cfg-parallel and use "
            "--ulysses-degree 2 for the same GPUs.") in err
    # A host that runs only worker ranks (--node-rank > 0) refuses it too, rather than wait for the engine's host.
    assert main(["serve", "--model-path", "demo", "--num-gpus", "2", "--enable-cfg-parallel", "--nnodes", "2",
                 "--node-rank", "1"]) == 2
    assert "has no classifier-free guidance branch" in capsys.readouterr().err


@pytest.mark.parametrize(("model_path", "options", "message"), [
    # Known by its released name: refused without downloading it.
    (PRO_DISTILL, {"num_gpus": 2, "enable_cfg_parallel": True}, r"^pro-distill has no classifier-free guidance"),
    (PRO, {"num_gpus": 8, "ulysses_degree": 8, "encoder_parallel": "fold"},
     r"^--encoder-parallel fold over 8 ranks is impossible: Qwen2_5_VLForConditionalGeneration has 28 attention "
     r"heads, not divisible by 8; .* CLIPTextModel has 12 attention heads"),
    (VSR, {"num_gpus": 8, "ulysses_degree": 8}, r"Fix: --ulysses-degree 4 --ring-degree 2 "),
    # The suggestion for the same GPUs is itself valid: SR's 28 heads take Ulysses 4, not 8.
    (VSR, {"num_gpus": 8, "enable_cfg_parallel": True, "ring_degree": 4},
     r"drop --enable-cfg-parallel and use --ulysses-degree 4 --ring-degree 2 for the same GPUs\.$"),
])
def test_released_checkpoints_are_checked_by_name(hub_offline, model_path, options, message):
    with pytest.raises(ValueError, match=message):
        check_layout_before_loading(build_engine_config(model_path, **options))


def test_valid_layouts_pass(demo_dir, tiny_pro_foldable_dir, tiny_sr_dir, hub_offline):
    for model_path, options in [
        ("demo", {"num_gpus": 2, "ulysses_degree": 2, "use_fsdp_inference": True}),
        ("demo", {"num_gpus": 8, "ulysses_degree": 4, "ring_degree": 2}),
        ("demo", {"num_gpus": 4, "dp_size": 2, "tp_size": 2}),
        (str(tiny_pro_foldable_dir), {"num_gpus": 2, "enable_cfg_parallel": True, "encoder_parallel": "fold"}),
        (str(tiny_pro_foldable_dir), {"num_gpus": 4, "enable_cfg_parallel": True, "ulysses_degree": 2}),
        (str(tiny_sr_dir), {"num_gpus": 2, "ring_degree": 2, "encoder_parallel": "fold"}),  # SR has no encoders
        (PRO, {"num_gpus": 4, "tp_size": 4, "encoder_parallel": "fold"}),
        ("someone/renamed-finetune", {"num_gpus": 2, "enable_cfg_parallel": True}),  # told only once downloaded
    ]:
        check_layout_before_loading(build_engine_config(model_path, **options))


@pytest.mark.parametrize("argv", [["--node-rank", "-1"], ["--node-rank", "2", "--nnodes", "2"]])
def test_a_node_rank_outside_the_hosts_is_refused_before_anything_starts(argv, no_ranks, capsys):
    """--node-rank -1 was told it "hosts worker ranks only" and to call serve_worker_ranks(config)."""
    assert main(["generate", "--model-path", PRO_DISTILL, "--load-format", "dummy", "--prompt", "x", *argv]) == 2
    nnodes = 2 if "--nnodes" in argv else 1
    assert (f"error: --node-rank must be in [0, {nnodes - 1}] (this host's index among --nnodes {nnodes}), got "
            f"{argv[1]}") in capsys.readouterr().err
    with pytest.raises(ValueError, match=r"^node_rank must be in \[0, 0\]"):
        DiffGenerator.from_pretrained(PRO_DISTILL, load_format="dummy", node_rank=-1)


@pytest.mark.parametrize(("chunks", "options", "ok"), [
    ("2", {"num_gpus": 4, "ulysses_degree": 4}, False),  # 4 video heads / 4 ranks: 1 head each
    ("2", {"num_gpus": 2, "ulysses_degree": 2}, True),   # 2 heads each
    ("2", {"num_gpus": 2, "ring_degree": 2}, True),      # no Ulysses exchange to chunk
    ("abc", {"num_gpus": 2, "tp_size": 2}, True),        # nor here: a leftover value is not even read
])
def test_ulysses_overlap_chunks_that_cannot_divide_the_heads_are_refused_before_the_ranks_start(
        demo_dir, no_ranks, monkeypatch, chunks, options, ok):
    """$K6SERVE_ULYSSES_CHUNKS was checked by the first request's exchange only, after the whole load."""
    monkeypatch.setenv("K6SERVE_ULYSSES_CHUNKS", chunks)
    if ok:
        check_layout_before_loading(build_engine_config("demo", device="cpu", **options))
        return
    with pytest.raises(ValueError, match=r"^demo: \$K6SERVE_ULYSSES_CHUNKS=2 must divide the heads each "
                                         r"Ulysses rank attends to, but 'video_self' has 4 heads / tp 1 / ulysses 4 "
                                         r"= 1\. Fix: set it to one of \[1\], or unset it\.$"):
        DiffGenerator.from_pretrained("demo", device="cpu", **options)
