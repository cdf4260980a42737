"""`k6serve bench --tiny`: the CPU smoke mode produces the table and JSON fields (not speed), and the
work formula reproduces k6-generation.md §2.11."""

import json
import re

import pytest
import torch

from k6serve.bench.__main__ import main
from k6serve.bench.flags import build_parser
from k6serve.bench.flops import kandinsky6_forward_flops
from k6serve.bench.geometry import generation_geometry
from k6serve.bench.report import COLUMNS, BenchRow, format_table
from k6serve.bench.stage_runners import run_stages
from k6serve.models.kandinsky6.checkpoint import released_transformer_config
from k6serve.models.kandinsky6.config import Kandinsky6TransformerConfig
from k6serve.models.variants import VARIANTS


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.mark.parametrize(
    ("variant", "height", "width", "expected_tflop"),
    [
        ("pro-distill", 512, 768, 3931),
        ("lite-distill", 512, 768, 702),
        ("pro", 480, 864, 4274),
        ("lite", 480, 864, 771),
    ],
)
def test_forward_flops_match_the_documented_full_count(variant, height, width, expected_tflop):
    geometry = generation_geometry(height, width, 121)
    config = Kandinsky6TransformerConfig.from_json_dict(
        released_transformer_config(VARIANTS[variant])
    )
    tflop = 1e-12 * kandinsky6_forward_flops(
        config,
        num_video_tokens=geometry.num_video_tokens,
        num_audio_tokens=geometry.num_audio_tokens,
        num_text_tokens=1024,
    )
    assert abs(tflop - expected_tflop) <= 1.0


def test_sr_dit_flops_match_the_documented_count():
    """k6-super-resolution.md §5: one SR DiT call on a 31 x 32 x 48 tile is 637.6 TFLOP (117.4 linear + 520.1
    attention; its 0.13 of embeddings and head are not counted here)."""
    from k6serve.bench.flops import sr_dit_forward_flops
    from k6serve.models.kandinsky6_sr.config_before_loading import released_sr_configs

    from k6serve.models.variants import VARIANTS

    config = released_sr_configs(VARIANTS["vsr-distilled2steps"]).transformer
    assert 1e-12 * sr_dit_forward_flops(config, num_tokens=31 * 32 * 48) == pytest.approx(637.5, abs=0.1)


def test_geometry_token_counts_and_errors():
    geometry = generation_geometry(512, 768, 121)
    assert (geometry.num_latent_frames, geometry.num_video_tokens, geometry.num_audio_tokens) == (
        31,
        47616,
        218,
    )
    with pytest.raises(ValueError, match="4k\\+1"):
        generation_geometry(512, 768, 120)
    with pytest.raises(ValueError, match="multiples of 16"):
        generation_geometry(500, 768, 121)


def test_row_derived_numbers_and_table():
    row = BenchRow(
        stage="dit", name="ours", config="pro", seconds=5.0, tflop=3931.0, reference_seconds=8.46
    )
    assert row.tflops == pytest.approx(786.2)
    assert row.percent_of_floor == pytest.approx(99.5, abs=0.1)
    assert row.speedup == pytest.approx(1.692)
    table = format_table([row, BenchRow(stage="vae", name="x", config="-", error="boom | bad")])
    lines = table.splitlines()
    assert lines[0] == "| " + " | ".join(COLUMNS).replace("max|diff|", "max\\|diff\\|") + " |"
    assert "| 786 | 99.5 | 1.69 |" in lines[2]
    # A markdown table needs as many header cells as delimiter cells (an unescaped "max|diff|" made it no table).
    assert [len(re.split(r"(?<!\\)\|", line)) for line in lines] == [len(COLUMNS) + 2] * 4
    assert "ERROR: boom / bad" in lines[3]


def refusal(argv: list[str], capsys) -> str:
    """The message of a flag `main` refuses before any stage runs: exit 2 (a failed row is 1) and one error line."""
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    captured = capsys.readouterr()
    assert exit_info.value.code == 2 and "[bench] stage" not in captured.out
    (line,) = captured.err.splitlines()
    assert line.startswith("k6serve bench: error: ")
    return line.removeprefix("k6serve bench: error: ")


def test_parser_defaults_and_choices():
    args = build_parser().parse_args([])
    assert args.stage is None and args.variant == "pro-distill" and args.repeats == 3
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--stage", "everything"])


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """The DiT and text stages in bf16 (the GPU's dtype: our velocities against diffusers' in it); the VAE and
    audio stages in fp32, whose fields are the same: bf16 convolutions on the CPU took 5 s per tiny decode (32 s of
    this fixture), fp32 ones a tenth of that. Rows in the order dit, text, vae, audio."""
    folder = tmp_path_factory.mktemp("bench")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    codes, rows = [], []
    # --norm-rope-kernel: on the CPU the kernel falls back to the model's ops, and the row's code path runs;
    # --compile-vae-decoder: a no-op on the CPU that keeps the compiled row's code path in the smoke run.
    runs = (("bf16", ["dit", "text"], ["--norm-rope-kernel"]),
            ("fp32", ["vae", "audio"], ["--dtype", "float32", "--compile-vae-decoder"]))
    try:
        for name, stages, extra in runs:
            path = folder / f"{name}.json"
            codes.append(main(["--",  # `k6serve bench -- ARGS` forwards the separator
                               "--tiny", *(arg for stage in stages for arg in ("--stage", stage)), *extra,
                               "--repeats", "2", "--warmup", "0", "--json", str(path)]))
            payload = json.loads(path.read_text())
            rows.extend(payload["rows"])
    finally:
        torch.set_num_threads(threads)
    return max(codes), {**payload, "rows": rows}  # the environment and arguments: the fp32 run's


def test_tiny_smoke_json_fields(tiny_run):
    code, payload = tiny_run
    assert code == 0
    environment = payload["environment"]
    assert {"date", "commit", "tree_modified", "k6serve", "torch", "cuda", "diffusers", "triton", "fa3-fwd"} \
        <= set(environment)
    assert environment["k6serve"] and environment["tree_modified"] in (True, False, None)
    assert environment["gpu"] is None  # a CPU run names no GPU, whatever the machine has
    assert payload["arguments"]["tiny"] is True
    rows = payload["rows"]
    assert all(row["error"] is None for row in rows), [row["error"] for row in rows]
    expected_fields = {
        "stage",
        "name",
        "config",
        "seconds",
        "times_s",
        "tflops",
        "percent_of_floor",
        "speedup",
        "peak_memory_gib",
        "cosine_video",
        "cosine_audio",
        "max_abs_diff",
        "breakdown_s",
    }
    assert all(expected_fields <= set(row) for row in rows)
    assert [row["stage"] for row in rows] == ["dit"] * 4 + ["text"] * 4 + ["vae"] * 4 + ["audio"]
    assert all(len(row["times_s"]) == 2 and row["seconds"] > 0 for row in rows)


def test_tiny_dit_rows_compare_with_diffusers(tiny_run):
    dit = [row for row in tiny_run[1]["rows"] if row["stage"] == "dit"]
    assert [row["name"] for row in dit] == [
        "diffusers eager",
        "ours torch_sdpa eager",
        "ours torch_sdpa fused+compiled",
        "ours torch_sdpa fused+compiled+norm_rope",
    ]
    assert all(row["tflops"] > 0 for row in dit)
    # Same weights, same inputs, bf16: our velocities agree with diffusers' (bitwise for the eager model).
    assert dit[1]["cosine_video"] == pytest.approx(1.0, abs=1e-6)
    assert all(row["cosine_video"] >= 0.999 and row["cosine_audio"] >= 0.999 for row in dit[1:])
    assert dit[0]["speedup"] == 1.0 and all(row["speedup"] > 0 for row in dit)
    assert "16 fused attentions, 6 compiled blocks" in dit[2]["note"]
    assert "Triton RMSNorm + RoPE (tokens kernel) on 16 attentions" in dit[3]["note"]  # tiny: 64-wide heads or less
    assert dit[3]["cosine_video"] == dit[2]["cosine_video"]  # CPU: the same ops ran


def test_tiny_vae_and_text_rows(tiny_run):
    rows = tiny_run[1]["rows"]
    vae = [row for row in rows if row["stage"] == "vae"]
    assert [row["name"] for row in vae] == ["diffusers default decode", "diffusers default decode, uint8 to host",
                                            "ours speed mode", "ours +compiled decoder"]
    assert all(row["max_abs_diff"] == 0 for row in vae[1:])
    # Each row's frames' digest, to compare processes byte for byte: equal frames here (CPU, nothing applied).
    assert all(len(row["output_sha256"]) == 1 and len(row["output_sha256"][0]) == 64 for row in vae)
    assert len({row["output_sha256"][0] for row in vae}) == 1
    assert vae[0]["speedup"] == 1.0 and all(row["speedup"] > 0 for row in vae[1:])
    # The speed-ups' own ratio too, against the baseline doing our host work (the float copy left out).
    assert all(re.search(r"; x\d+\.\d\d against the same host work$", row["note"]) for row in vae[2:])
    ours_text = next(row for row in rows if row["name"] == "ours trunk only")
    assert ours_text["cosine_video"] == pytest.approx(1.0, abs=1e-6)
    rewrite = next(row for row in rows if row["name"] == "ours expand_prompts")
    assert rewrite["seconds"] > 0
    written = re.search(r"^(\d+) tokens written, [\d.]+ ms a token \([\d.]+ tokens/s\)", rewrite["note"])
    # The ids generate wrote (up to 256), not its decoded text re-tokenized (random weights write unprintable ones).
    assert written is not None and 1 <= int(written.group(1)) <= 256
    # The static-cache experiment (compiled on CUDA) says whether its ids are the eager rewrite's.
    static = next(row for row in rows if row["name"] == "ours expand_prompts, static cache")
    assert static["error"] is None and static["speedup"] > 0
    assert re.search(r"first call [\d.]+ s \(compiles on CUDA\); (the same ids as|ids differ from) the eager rewrite",
                     static["note"])


def test_failing_stage_is_an_error_row_and_exit_code_one(capsys):
    code = main(
        [
            "--",  # `k6serve bench -- ARGS` forwards the separator
            "--tiny",
            "--stage",
            "dit",
            "--backends",
            "flash9",
            "--skip-reference",
            "--skip-speed",
            "--repeats",
            "1",
            "--warmup",
            "0",
        ]
    )
    assert code == 1
    assert "ERROR: ValueError: unknown attention backend 'flash9'" in capsys.readouterr().out


def test_tiny_generate_through_diffgenerator():
    args = build_parser().parse_args(
        ["--tiny", "--stage", "generate", "--repeats", "1", "--num-inference-steps", "2"]
    )
    rows = run_stages(args, log=lambda text: None)
    assert [row.name for row in rows] == ["ours cold (first request)", "ours warm"], rows[0].error
    warm = rows[1]
    assert {"encode", "denoise", "decode_video", "decode_audio", "mux", "total"} <= set(
        warm.breakdown_s
    )
    assert warm.seconds == pytest.approx(warm.breakdown_s["total"])
    assert len(warm.breakdowns_s) == 1 and warm.breakdowns_s[0]["total"] == warm.breakdown_s["total"]
    # Each request's MP4 digest (the warm request wrote a numbered file beside the first): the same seed, the same bytes.
    assert len(rows[0].output_sha256) == 1 and rows[0].output_sha256 == warm.output_sha256


def test_tiny_generate_adds_the_cache_dit_row_of_the_same_run():
    args = build_parser().parse_args(
        ["--tiny", "--stage", "generate", "--repeats", "1", "--num-inference-steps", "3", "--cache-dit-params",
         '{"max_warmup_steps": 1, "residual_diff_threshold": 1.0}']
    )
    rows = run_stages(args, log=lambda text: None)
    assert [row.name for row in rows] == ["ours cold (first request)", "ours warm", "ours warm, Cache-DiT"]
    cached = rows[2]
    assert cached.breakdown_s["cache_dit_cached_calls"] == 2 and "cache_dit_cached_calls" not in rows[1].breakdown_s
    assert "skipped the middle 1 of 2 DiT blocks on 2 of 3 calls" in cached.note
    assert "against uncached; frames differ from uncached by" in cached.note
    with pytest.raises(SystemExit, match="--cache-dit-params must be a JSON object"):
        run_stages(build_parser().parse_args(["--tiny", "--stage", "generate", "--cache-dit-params", "[]"]),
                   log=lambda text: None)


def test_tiny_generate_adds_the_silent_rows_of_the_same_run():
    args = build_parser().parse_args(
        ["--tiny", "--stage", "generate", "--repeats", "1", "--num-inference-steps", "2", "--silent-request"]
    )
    rows = run_stages(args, log=lambda text: None)
    assert [row.name for row in rows] == ["ours cold (first request)", "ours warm", "ours silent, first",
                                          "ours silent, warm"], rows[-1].error
    for row in rows[2:]:
        # Its step is compared with the audio request's of this run.
        assert {"denoise_step_median", "decode_video", "total"} <= set(row.breakdown_s)
        assert row.note.startswith("sample_audio=False; ") and "against the request with audio" in row.note


@pytest.mark.parametrize("compiled", [False, True])
def test_tiny_generate_adds_the_expand_prompts_rows_of_the_same_run(compiled):
    argv = ["--tiny", "--stage", "generate", "--repeats", "1", "--num-inference-steps", "1", "--expand-prompts-request"]
    args = build_parser().parse_args(argv + (["--compile-prompt-rewrite"] if compiled else []))
    rows = run_stages(args, log=lambda text: None)
    assert [row.name for row in rows] == ["ours cold (first request)", "ours warm", "ours expand_prompts, first",
                                          "ours expand_prompts, warm"], rows[-1].error
    mode = "compiled, static cache" if compiled else "eager"
    for row in rows[2:]:
        # The rewrite's own seconds, and the whole request's cost against the plain one of this run.
        assert row.breakdown_s["expand_prompt"] > 0 and {"encode", "total"} <= set(row.breakdown_s)
        assert row.note.startswith(f"expand_prompts=True, rewrite {mode} ")
        assert "against the request without it" in row.note


def test_warm_breakdown_is_the_median_of_every_run():
    from types import SimpleNamespace

    from k6serve.bench.end_to_end import _rows_from_results

    def result(total, denoise):
        return SimpleNamespace(timings={"denoise": denoise, "total": total}, peak_memory_mb=1024.0,
                               output_file_path=None)

    warm = [result(67.7, 58.4), result(62.4, 58.5), result(62.5, 58.6)]
    _, row = _rows_from_results("generate", "pro-distill", result(155.0, 86.0), warm, 1.0, "speed")
    assert row.seconds == 62.5 and row.times_s == (67.7, 62.4, 62.5)
    assert row.breakdown_s == {"denoise": 58.5, "total": 62.5}
    assert [run["total"] for run in row.breakdowns_s] == [67.7, 62.4, 62.5]
    assert row.note.startswith("each stage's median (over the runs, so they need not add up to the median total) "
                               "denoise=58.50")


def test_gpu_single_parts_for_each_subcommand(load_script):
    script = load_script("gpu_single")
    parse = script.build_parser().parse_args
    dit = script.parts(parse(["dit", "--reference-compiled"]))
    assert [name for name, _ in dit] == ["dit pro-distill", "dit lite-distill"]
    assert dit[0][1] == [
        "--stage",
        "dit",
        "--device",
        "cuda",
        "--height",
        "512",
        "--width",
        "768",
        "--num-frames",
        "121",
        "--repeats",
        "3",
        "--variant",
        "pro-distill",
        "--backends",
        "fa,torch_sdpa",
        "--reference-compiled",
    ]
    generate = script.parts(parse(["generate", "--models", "lite-distill"]))
    assert generate[0][0] == "generate lite-distill" and "--attention-backend" in generate[0][1]
    assert [name for name, _ in script.parts(parse(["decoders"]))] == ["vae", "audio", "text"]
    assert script.parts(parse(["sr"]))[0][1][:2] == ["--stage", "sr"]
    assert script.parts(parse(["env"])) == []
    for subcommand in ("dit", "generate", "decoders", "sr"):  # every part parses as bench arguments
        for _, argv in script.parts(parse([subcommand])) + script.parts(
            parse([subcommand, "--tiny"])
        ):
            build_parser().parse_args(argv)
    with pytest.raises(SystemExit):
        parse(["everything"])


def test_gpu_single_tiny_dit_keeps_going_after_a_failed_part(tmp_path, load_script):
    script = load_script("gpu_single")
    code = script.main(
        [
            "dit",
            "--tiny",
            "--out",
            str(tmp_path),
            "--models",
            "not-a-model,lite-distill",
            "--repeats",
            "1",
            "--norm-rope-kernel",  # passed through to `k6serve bench`: the fourth row
            "--fp8-attention",  # and the fifth, which on the CPU records why "fa_fp8" cannot run
        ]
    )
    assert code == 1
    payload = json.loads((tmp_path / "dit.json").read_text())
    assert [error["part"] for error in payload["errors"]] == ["dit not-a-model"]
    # argparse's message, not its "SystemExit: 2" (the message went to stderr only).
    assert "argument --variant: invalid choice: 'not-a-model'" in payload["errors"][0]["error"]
    assert [row["name"] for row in payload["rows"]] == [
        "diffusers eager",
        "ours torch_sdpa eager",
        "ours torch_sdpa fused+compiled",
        "ours torch_sdpa fused+compiled+norm_rope",
        "ours fa_fp8 fused+compiled+norm_rope",
    ]
    assert "'fa_fp8' (FlashAttention-3) cannot run here: it needs a CUDA GPU" in payload["rows"][-1]["error"]
    assert payload["device_status"]["cuda_available"] is torch.cuda.is_available()  # the host's, recorded
    assert "| dit | ours torch_sdpa eager | tiny 64x96x17 |" in (tmp_path / "dit.md").read_text()


def test_compile_mode_reaches_the_dit_options_and_needs_inductor(monkeypatch, load_script):
    """`--compile-mode` (k6serve bench, gpu_single.py dit) is passed to our blocks' torch.compile; with a
    backend other than inductor (the --tiny default) it is refused before any setup."""
    from k6serve.bench import stage_runners as bench

    captured = {}
    monkeypatch.setattr(bench, "run_dit", lambda options: captured.setdefault("options", options) and [])
    args = build_parser().parse_args(["--tiny", "--compile-backend", "inductor", "--compile-mode",
                                      "max-autotune-no-cudagraphs"])
    runners = bench.stage_runners(args)
    runners["dit"]()
    assert captured["options"].compile_mode == "max-autotune-no-cudagraphs"
    assert captured["options"].compile_backend == "inductor"
    with pytest.raises(SystemExit, match="--compile-mode needs the inductor backend"):
        bench.stage_runners(build_parser().parse_args(["--tiny", "--compile-mode", "max-autotune"]))
    with pytest.raises(SystemExit):  # argparse: not one of the modes
        build_parser().parse_args(["--compile-mode", "fastest"])
    with pytest.raises(SystemExit, match="--fp8-attention times the fused \\+ compiled DiT.*drop --skip-speed"):
        bench.stage_runners(build_parser().parse_args(["--tiny", "--fp8-attention", "--skip-speed"]))
    script = load_script("gpu_single")
    parts = script.parts(script.build_parser().parse_args(["dit", "--models", "lite-distill", "--skip-eager",
                                                           "--compile-mode", "max-autotune-no-cudagraphs"]))
    assert parts[0][1][-3:] == ["--skip-eager", "--compile-mode", "max-autotune-no-cudagraphs"]


def test_kernel_profile_counts_kernels_once_and_groups_them():
    from types import SimpleNamespace

    from k6serve.bench.kernel_profile import format_summary, kernel_category, summarize

    cpu, cuda = torch.autograd.DeviceType.CPU, torch.autograd.DeviceType.CUDA
    events = [
        # The operator carries its kernel's device time too: it must not be counted a second time.
        SimpleNamespace(key="aten::mm", count=3, self_device_time_total=900.0, device_type=cpu),
        SimpleNamespace(key="nvjet_sm90_tst_256x128_64x4", count=3, self_device_time_total=900.0, device_type=cuda),
        SimpleNamespace(key="void flash::FlashAttnFwdSm90<...>", count=1, self_device_time_total=2000.0,
                        device_type=cuda),
        SimpleNamespace(key="triton_poi_fused_gelu_3", count=2, self_device_time_total=100.0, device_type=cuda),
        SimpleNamespace(key="ncclDevKernel_AllToAll", count=1, self_device_time_total=0.0, device_type=cuda),
        # Ranges mirrored on the device timeline carry the time of the kernels inside them: not kernels.
        SimpleNamespace(key="nccl:all_to_all", count=1, self_device_time_total=500.0, device_type=cuda),
        SimpleNamespace(key="fa3_fwd::fwd", count=1, self_device_time_total=2000.0, device_type=cuda),
        SimpleNamespace(key="my_range", count=1, self_device_time_total=2000.0, device_type=cuda,
                        is_user_annotation=True),
        SimpleNamespace(key="Command Buffer Full", count=4, self_device_time_total=70.0, device_type=cuda),
    ]
    summary = summarize(events, wall_s=0.004)
    assert summary["busy_ms"] == pytest.approx(3.0)
    assert summary["idle_ms"] == pytest.approx(1.0)
    assert summary["categories_ms"] == {"attention": 2.0, "gemm": 0.9, "triton": 0.1}
    assert [row["name"] for row in summary["top"]][0].startswith("void flash")
    assert kernel_category("ncclDevKernel_AllToAll") == "communication"
    assert kernel_category("sm90_xmma_fprop_implicit_gemm_bf16") == "convolution"
    assert "| attention | 2.0 | 66.7% |" in format_summary("t", summary)


def test_gpu_profile_script_runs_at_toy_size(tmp_path, load_script):
    script = load_script("gpu_profile")
    for subcommand in ("dit", "mux"):
        assert script.main([subcommand, "--tiny", "--out", str(tmp_path), "--models", "pro-distill"]) == 0
    report = json.loads((tmp_path / "profile_dit.json").read_text())
    part = report["parts"]["dit pro-distill"]
    assert part["median_s"] > 0 and part["profile"]["top"]
    mux = json.loads((tmp_path / "profile_mux.json").read_text())["parts"]
    assert mux["mux noise threads=8"]["megabytes"] > mux["mux smooth threads=8"]["megabytes"] > 0
    tails = {key: part for key, part in mux.items() if key.startswith("mux tail")}
    assert set(tails) == {f"mux tail {content} rc_lookahead={lookahead}" for content in ("smooth", "noise")
                          for lookahead in (40, 20, 10)}
    assert all(0 < part["tail_seconds"] < part["write_seconds"] for part in tails.values()), tails
    # The SR DiT on one tile: the three variants the engine can run, each compared with eager.
    assert script.main(["srdit", "--tiny", "--out", str(tmp_path)]) == 0
    srdit = json.loads((tmp_path / "profile_srdit.json").read_text())["parts"]["srdit"]
    assert srdit["fused_attentions"] == srdit["norm_rope_attentions"] > 0 and srdit["tflop"] > 0
    for name in ("eager", "fused+compiled", "fused+compiled+norm_rope"):
        assert srdit[name]["seconds"] > 0 and srdit[name]["cosine"] > 0.99999, (name, srdit[name])
    # The K-VAE tile decode with channels-last conv weights: the same uint8 frames as NCDHW (CPU, eager).
    assert script.main(["kvae", "--tiny", "--channels-last", "--commuted-norms", "--subpixel-upsample",
                        "--out", str(tmp_path)]) == 0
    kvae = json.loads((tmp_path / "profile_kvae.json").read_text())["parts"]["kvae"]
    assert kvae["channels_last_convs"] > 0 and kvae["channels_last_max_uint8_diff"] == 0
    assert kvae["commuted_norms"] > 0 and kvae["commuted_norms_max_uint8_diff"] == 0
    # Sub-pixel upsampler convolutions: the same values up to fp32 rounding, so at most one uint8 level.
    assert kvae["subpixel_upsamplers"] > 0 and kvae["subpixel_max_uint8_diff"] <= 1
    assert 0 < kvae["subpixel_tflop"] < kvae["tflop"]  # the compiled rate is of what the rewritten decode computes
    assert kvae["tflop"] > 0 and kvae["eager_tflops"] == pytest.approx(kvae["tflop"] / kvae["eager_s"])
    # HunyuanVideo's folded upsamplers (CPU, eager): the same frames up to fp32 rounding, at most one uint8 level.
    assert script.main(["vae", "--tiny", "--folded-upsample", "--out", str(tmp_path)]) == 0
    folded = json.loads((tmp_path / "profile_vae.json").read_text())["parts"]["vae folded upsample"]
    assert folded["folded_upsamplers"] == 3 and folded["eager_vs_unfolded"]["max"] <= 1


def test_environment_commit_can_be_pinned_for_copied_trees(monkeypatch):
    from k6serve.bench.report import environment

    monkeypatch.setenv("K6SERVE_COMMIT", "abc1234")
    assert environment()["commit"] == "abc1234"
    monkeypatch.delenv("K6SERVE_COMMIT")
    assert environment()["commit"] != "abc1234"


def test_fa4_note_names_the_head_dim_that_ran_it(monkeypatch):
    """The row note says FA4 ran with the model's own video head dim: with $K6SERVE_FA4=1 (or a
    $K6SERVE_FA4_TILES entry) Pro's 128-wide heads run FA4 too, and the note once said "64-wide" for them."""
    from types import SimpleNamespace

    from k6serve.bench import dit
    from k6serve.ops import flash_attention4

    monkeypatch.setattr(dit, "resolve_attention_backend", lambda backend, device: "fa")
    monkeypatch.setattr(flash_attention4, "MODE", "1")
    options = dit.DitOptions(label="pro-distill", transformer_config={}, geometry=generation_geometry(64, 64, 5),
                             device=torch.device("cpu"), dtype=torch.float32, backends=("fa",), repeats=1,
                             warmup=0)

    class Model(SimpleNamespace):
        def __call__(self, **inputs):
            return torch.ones(2), None

    ours = Model(config=SimpleNamespace(video_head_dim=128), set_attention_backend=lambda backend: None)
    (row,) = dit._run_ours(ours, {}, options, 1.0, dit._Compared(), "eager", compiled=False)
    assert row.error is None
    assert row.note == "FlashAttention-4 (128-wide video heads: ops/flash_attention4.py)"


def test_environment_records_the_k6serve_switches_but_not_the_servers_secrets(monkeypatch):
    """The K6SERVE_* variables change what a row measures (FA4, kernels, VAE layouts, x264 threads), so the JSON
    records them, and torch's TORCHINDUCTOR_* ones; the server's API key and webhook signing key are never written
    (the webhook key was, into files meant to be shared)."""
    from k6serve.bench.report import SECRET_ENVIRONMENT_VARIABLES, environment
    from k6serve.serve.settings import API_KEY_ENV, WEBHOOK_SECRET_ENV

    assert SECRET_ENVIRONMENT_VARIABLES == {API_KEY_ENV, WEBHOOK_SECRET_ENV}  # the server's names, kept in step
    monkeypatch.setenv("K6SERVE_FA4", "1")
    monkeypatch.setenv("K6SERVE_X264_THREADS", "8")
    monkeypatch.setenv("K6SERVE_API_KEY", "secret")
    monkeypatch.setenv("K6SERVE_WEBHOOK_SECRET", "signing-secret")
    monkeypatch.setenv("TORCHINDUCTOR_DETERMINISTIC", "1")
    recorded = environment()
    assert recorded["k6serve_environment"]["K6SERVE_FA4"] == "1"
    assert recorded["k6serve_environment"]["K6SERVE_X264_THREADS"] == "8"
    assert recorded["torch_environment"]["TORCHINDUCTOR_DETERMINISTIC"] == "1"
    assert "secret" not in json.dumps(recorded)


def test_sr_vae_tile_decode_flops_counts_the_real_decode(tiny_sr_configs, build_tiny_kvae):
    """The meta-device count equals the count of a real decode (tiny K-VAE on CPU, the same segment and cache
    logic), and the released K-VAE's 512x768x121 tile is 837.6 TFLOP of convolutions."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    from k6serve.bench.flops import sr_vae_tile_decode_flops
    from k6serve.models.kandinsky6_sr.config_before_loading import released_sr_configs
    from k6serve.models.variants import VARIANTS

    variant = VARIANTS["vsr-distilled2steps"]
    configs = tiny_sr_configs
    latent = torch.randn(1, configs.vae.latent_channels, 5, 4, 6)
    with torch.inference_mode(), FlopCounterMode(display=False) as counter:
        build_tiny_kvae(torch.float32).decode_tile(latent)
    assert counter.get_total_flops() > 0
    assert sr_vae_tile_decode_flops(configs, 5, 4, 6) == counter.get_total_flops()
    assert sr_vae_tile_decode_flops(released_sr_configs(variant), 31, 32, 48) / 1e12 == pytest.approx(837.6, abs=0.05)
    # With the upsamplers folded into one 2x2 phase convolution (speed/kvae_upsample.py): their 3x3 convolutions
    # (154.9 TFLOP) and full-resolution 1x1x1 `linear`s become 4 taps per output pixel on the low-resolution grid.
    subpixel = sr_vae_tile_decode_flops(released_sr_configs(variant), 31, 32, 48, subpixel_upsample=True) / 1e12
    assert subpixel == pytest.approx(735.5, abs=0.05)


def test_tiny_runs_on_the_cpu_unless_cuda_is_named(monkeypatch):
    # --tiny is the CPU smoke mode: on a GPU host `auto` still picks the CPU, whose rows the tests above know.
    from k6serve.bench.flag_checks import bench_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert bench_device("auto", tiny=True) == torch.device("cpu")
    assert bench_device("auto") == torch.device("cuda")
    assert bench_device("cuda", tiny=True) == torch.device("cuda")


def test_the_released_sizes_on_a_host_without_a_gpu_are_refused_unless_the_cpu_is_named(monkeypatch, capsys):
    # `k6serve bench` with no flag on a laptop built the released Pro DiT on the CPU and ran it for hours.
    from k6serve.bench.flag_checks import bench_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit) as exit_info:
        main(["--stage", "vae"])
    captured = capsys.readouterr()
    assert exit_info.value.code == 2 and "[bench] stage" not in captured.out
    assert captured.err.endswith("k6serve bench: error: no CUDA GPU is visible, and the released sizes on the CPU take "
                                 "hours and tens of GiB of memory a stage; add --tiny for the CPU smoke mode, or "
                                 "--device cpu to run them anyway.\n")
    assert bench_device("auto", tiny=True) == bench_device("cpu") == torch.device("cpu")


def test_generate_takes_the_engines_offload_flags(monkeypatch):
    """`--cpu-offload-components`, `--layerwise-offload-components` and `--component-residency` reach the engine
    config of the generate / sr stages (on the CPU they offload nothing; the worker logs that)."""
    from k6serve.bench import end_to_end
    from k6serve.engine_arguments import build_engine_config

    opened = []
    real_open = end_to_end._open_generator

    def spy(model_path, options):
        opened.append(build_engine_config(model_path, **end_to_end._engine_kwargs(options)).runtime)
        return real_open(model_path, options)

    monkeypatch.setattr(end_to_end, "_open_generator", spy)
    args = build_parser().parse_args(["--tiny", "--stage", "generate", "--repeats", "1", "--num-inference-steps",
                                      "1", "--cpu-offload-components", "vae", "audio", "--layerwise-offload-components",
                                      "dit", "--component-residency", "vocoder=resident"])
    rows = run_stages(args, log=lambda text: None)
    assert not any(row.error for row in rows), rows
    (runtime,) = opened
    assert runtime.cpu_offload_components == ("vae", "audio")
    assert runtime.layerwise_offload_components == ("dit",)  # kept as typed; the plan reads it as transformer
    assert runtime.residency_plan(super_resolution=False).residency["transformer"] == "layerwise"
    assert runtime.component_residency == (("vocoder", "resident"),)


def test_gpu_spatial_shard_script_runs_at_toy_size(tmp_path, load_script):
    """One rank's share of the spatial-shard decode (zeros for the halo rows): every slab decodes, its rows are the
    rank's rows of the tile, and the table and JSON have their fields."""
    script = load_script("gpu_spatial_shard")
    assert script.main(["--tiny", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "spatial_shard.json").read_text())
    assert report["hooked_modules"] > 0 and report["latent"][3:] == [8, 6]
    rows = [(row["decoder"], row["slab"], row["latent_rows"]) for row in report["rows"]]
    assert rows == [("eager", "whole tile", 8), ("eager", "rank 0 of 2", 4), ("eager", "rank 1 of 4", 2)]
    assert all(row["warm_s"] > 0 and row["first_s"] > 0 for row in report["rows"])
    assert report["rows"][0]["x_whole"] == 1.0
    assert (tmp_path / "spatial_shard.md").read_text().count("\n| eager |") == 3


@pytest.mark.multiprocess
def test_gpu_sr_decode_script_runs_at_toy_size(tmp_path, monkeypatch, load_script):
    """The two-GPU whole-tile / spatial-shard comparison, on two gloo ranks with the tiny checkpoint: a cold and a
    warm request per decode, and the frame distance between the two decodes."""
    from k6serve.testing import clips

    # The script's --tiny clip is 96x64 (12 x2 tiles, four requests of about 5 s each on 2 cores); 80x32 gives two
    # overlapping tiles (a blend), each one still split in rows for the spatial-shard decode, with the same 17 frames.
    make_clip = clips.make_clip
    monkeypatch.setattr(clips, "make_clip", lambda path, **kwargs: make_clip(path, **{**kwargs, "width": 80,
                                                                                     "height": 32}))
    script = load_script("gpu_sr_decode")
    assert script.main(["--tiny", "--out", str(tmp_path)]) == 0
    rows = [json.loads(line) for line in (tmp_path / "sr_decode.jsonl").read_text().splitlines()]
    assert [(row["sr_decode"], row["request"]) for row in rows] == [
        ("whole_tile", 0), ("whole_tile", 1), ("spatial_shard", 0), ("spatial_shard", 1)]
    assert all(row["total"] > 0 and "decode" in row for row in rows)
    # The spatial-shard decode streams segment-major, the blend inside its decode: no "blend" stage.
    assert all(("blend" in row) == (row["sr_decode"] == "whole_tile") for row in rows)
    summary = json.loads((tmp_path / "sr_decode.json").read_text())
    assert summary["shape"] == [17, 64, 160, 3] and summary["max_uint8_diff"] <= 2
    assert set(summary["warm_total_s"]) == {"whole_tile", "spatial_shard"}


def test_dit_stage_runs_a_checkpoints_own_weights(tiny_distill_dir, tmp_path, capsys):
    """--transformer-path: the DiT rows run a folder's weights (a checkpoint root or its transformer/), against
    diffusers on the same weights, instead of random ones; the inputs stay random."""
    from k6serve.bench.__main__ import main

    for path in (tiny_distill_dir, tiny_distill_dir / "transformer"):
        out = tmp_path / f"{path.name}.json"
        assert main(["--tiny", "--stage", "dit", "--transformer-path", str(path), "--skip-eager", "--repeats", "1",
                     "--fp8-linears", "ffn", "--json", str(out)]) == 0
        rows = json.loads(out.read_text())["rows"]
        assert [row["name"] for row in rows] == ["diffusers eager", "ours torch_sdpa fused+compiled",
                                                 "ours torch_sdpa fused+compiled+fp8 ffn"]
        assert all(row["error"] is None for row in rows) and str(tiny_distill_dir) in rows[0]["config"]
        assert rows[1]["cosine_video"] > 0.99999  # fp32 weights of the folder, the same in both models
    capsys.readouterr()
    assert "neither it nor its transformer/ holds a config.json with safetensors" in refusal(
        ["--tiny", "--stage", "dit", "--transformer-path", str(tmp_path)], capsys)


def test_blas_library_rows_time_the_fast_dit_per_library_and_put_it_back(monkeypatch, tmp_path):
    """--blas-libraries: the fused + compiled DiT once more per library, in order, nothing recompiled, and torch's
    preferred library put back after (on the CPU, where torch refuses cuBLASLt, the setter is faked)."""
    import dataclasses

    from k6serve.bench import stage_runners as bench
    from k6serve.bench import dit

    calls = []

    def preferred(library=None):
        if library is not None:
            calls.append(library)
        return calls[-1] if calls else "cublas-default"

    captured = {}
    monkeypatch.setattr(bench, "run_dit", lambda options: captured.setdefault("options", options) and [])
    bench.stage_runners(build_parser().parse_args(["--tiny", "--skip-reference", "--skip-eager", "--repeats",
                                                   "1"]))["dit"]()
    monkeypatch.setattr(torch.backends.cuda, "preferred_blas_library", preferred)
    rows = dit.run_dit(dataclasses.replace(captured["options"], blas_libraries=("cublaslt", "cublas")))
    assert [row.name for row in rows] == ["ours torch_sdpa fused+compiled", "ours torch_sdpa fused+compiled+cublaslt",
                                          "ours torch_sdpa fused+compiled+cublas"]
    assert all(row.error is None for row in rows)
    assert "preferred_blas_library('cublaslt')" in rows[1].note
    assert calls == ["cublaslt", "cublas", "cublas-default"]  # each row's library, then the one before
    with pytest.raises(SystemExit, match="--blas-libraries picks among cuBLAS's kernels: it needs a CUDA device"):
        bench.stage_runners(build_parser().parse_args(["--tiny", "--blas-libraries", "cublaslt"]))
    with pytest.raises(SystemExit, match="--blas-libraries times the fused \\+ compiled DiT.*drop --skip-speed"):
        bench.stage_runners(build_parser().parse_args(["--tiny", "--blas-libraries", "cublas", "--skip-speed"]))


def test_vae_rows_after_a_failed_baseline_show_no_ratio_and_a_failed_speed_up_restores_cudnn(monkeypatch):
    """A failed baseline made our rows "x diffusers 1.00" (their own time as the reference); a speed-up that raised
    left cudnn.benchmark on for the later stages of the process."""
    from k6serve.bench import vae as vae_stage
    from k6serve.bench.geometry import generation_geometry

    options = vae_stage.VaeOptions(geometry=generation_geometry(32, 32, 5), device=torch.device("cpu"),
                                   dtype=torch.float32, tiny=True, repeats=1, warmup=0)
    decode = vae_stage.decode_video

    def baseline_fails(vae, latents, keep_float):
        if keep_float:
            raise RuntimeError("the baseline broke")
        return decode(vae, latents, keep_float=keep_float)

    monkeypatch.setattr(vae_stage, "decode_video", baseline_fails)
    rows = vae_stage.run_vae(options)
    assert rows[0].error == "RuntimeError: the baseline broke"
    assert all(row.seconds > 0 and row.reference_seconds is None and row.speedup is None for row in rows[1:])

    monkeypatch.setattr(vae_stage, "decode_video", decode)

    def speed_up_fails(vae, device, compile_decoder):
        torch.backends.cudnn.benchmark = True  # as the real one sets it before compiling
        raise RuntimeError("inductor failed")

    monkeypatch.setattr(vae_stage, "apply_vae_speedups", speed_up_fails)
    previous = torch.backends.cudnn.benchmark
    rows = vae_stage.run_vae(options)
    assert torch.backends.cudnn.benchmark == previous
    assert rows[-1].name == "ours speed mode" and rows[-1].error == "RuntimeError: inductor failed"


@pytest.mark.parametrize("with_audio", [True, False])
def test_forward_flops_are_what_the_tiny_dit_computes(with_audio):
    """The formula against torch's FlopCounterMode on the tiny DiT (math attention), with and without audio: the
    video-only count had the skipped audio cross-attention's projections in it (Pro: +5.3%). The counter also sees
    the timestep and modulation GEMVs (one vector each), which the formula leaves out: well under 1% here."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    from k6serve.bench.dit import dit_inputs
    from k6serve.bench.tiny import TINY_TRANSFORMER_CONFIG
    from k6serve.models.kandinsky6.checkpoint import build_dummy_transformer

    config = Kandinsky6TransformerConfig.from_json_dict(TINY_TRANSFORMER_CONFIG)
    geometry = generation_geometry(64, 96, 17, num_text_tokens=16)
    model = build_dummy_transformer(TINY_TRANSFORMER_CONFIG, device="cpu", dtype=torch.float32)
    inputs = dit_inputs(config, geometry, device=torch.device("cpu"), dtype=torch.float32, seed=1)
    if not with_audio:
        inputs.pop("audio_hidden_states")
    with torch.inference_mode(), FlopCounterMode(display=False) as counter, sdpa_kernel([SDPBackend.MATH]):
        model(**inputs)
    formula = kandinsky6_forward_flops(config, num_video_tokens=geometry.num_video_tokens,
                                       num_audio_tokens=geometry.num_audio_tokens if with_audio else 0,
                                       num_text_tokens=16)
    measured = counter.get_total_flops()
    assert 0 <= measured - formula < 0.01 * measured, (measured, formula)


def test_the_environment_names_the_gpu_only_for_rows_that_ran_on_one(monkeypatch):
    """`--device auto --tiny` runs on the CPU; on a GPU host its JSON named the GPU, its driver and clocks."""
    from k6serve.bench import report

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=0: "NVIDIA H200")
    monkeypatch.setattr(report, "_gpu_facts", lambda: {"driver": "580.159.04"})
    assert report.environment(torch.device("cpu"))["gpu"] is None
    assert "driver" not in report.environment(torch.device("cpu"))
    on_gpu = report.environment(torch.device("cuda", 0))
    assert (on_gpu["gpu"], on_gpu["driver"]) == ("NVIDIA H200", "580.159.04")


def test_an_installed_copy_reports_no_commit_even_inside_another_git_repository(tmp_path, monkeypatch):
    """git run beside an installed k6serve (a virtual environment inside the user's project) named the project's
    commit as k6serve's. Only a k6serve source tree asks git."""
    import subprocess

    from k6serve.bench import report

    project = tmp_path / "project"
    installed = project / ".venv" / "lib" / "site-packages" / "k6serve" / "bench"
    installed.mkdir(parents=True)
    (project / "pyproject.toml").write_text('[project]\nname = "their-app"\n')
    subprocess.run(["git", "init", "-q", str(project)], check=True)
    subprocess.run(["git", "-C", str(project), "-c", "user.email=a@b", "-c", "user.name=a", "commit", "-q",
                    "--allow-empty", "-m", "theirs"], check=True)
    monkeypatch.delenv(report.COMMIT_ENVIRONMENT_VARIABLE, raising=False)
    monkeypatch.setattr(report, "__file__", str(installed / "report.py"))
    assert report._git_commit() is None and report._tree_modified() is None
    # This checkout's own code still names its commit.
    monkeypatch.undo()
    monkeypatch.delenv(report.COMMIT_ENVIRONMENT_VARIABLE, raising=False)
    assert report._source_tree() is not None and report._git_commit()


def test_a_size_the_dit_cannot_run_is_refused_before_the_model_is_built(capsys):
    # --height 4096 made every dit row an error ("256 positions exceed the model's RoPE table of 128") after the
    # model was built; the vae stage alone decodes any size.
    assert refusal(["--tiny", "--stage", "dit", "--height", "4096", "--num-frames", "1"], capsys) == (
        "--height / --width / --num-frames: the DiT's video token grid 1x256x6 exceeds its RoPE table of 128 "
        "positions an axis (at most 2048 pixels a side, 509 frames)")
    from k6serve.bench import stage_runners as bench

    bench.stage_runners(build_parser().parse_args(["--tiny", "--stage", "vae", "--height", "4096", "--num-frames",
                                                   "1"]))
    bench.stage_runners(build_parser().parse_args(["--tiny", "--height", "2048", "--num-frames", "509"]))


@pytest.mark.parametrize(("flags", "message"), [
    (["--height", "30"], "height and width must be positive multiples of 16, got 30x96"),
    (["--width", "0"], "height and width must be positive multiples of 16, got 64x0"),
    (["--num-frames", "0"], "num_frames must be 4k\\+1 \\(e.g. 121\\), got 0"),
    (["--num-frames", "-3"], "num_frames must be 4k\\+1 \\(e.g. 121\\), got -3"),
])
def test_a_size_no_stage_can_run_is_refused_with_the_flag(flags, message, capsys):
    # --height 30 ended in a traceback; --num-frames 0 and --width 0 ran the default size or failed inside a stage.
    assert re.search(f"^--height / --width / --num-frames: {message}$",
                     refusal(["--tiny", "--stage", "vae", *flags], capsys))


@pytest.mark.parametrize(("flags", "message"), [
    (["--repeats", "0"], "--repeats must be >= 1 \\(the median of the timed runs is reported\\), got 0"),
    (["--warmup", "-1"], "--warmup must be >= 0, got -1"),
])
def test_a_timing_count_no_stage_can_use_is_refused_once_up_front(flags, message, capsys):
    # --repeats 0 became one "ERROR: ValueError" row per stage; --warmup -1 was taken silently as no warm-up.
    assert re.search(f"^{message}$", refusal(["--tiny", "--stage", "vae", "--stage", "audio", *flags], capsys))


@pytest.mark.parametrize(("flags", "message"), [
    (["--skip-reference", "--reference-compiled"], "--reference-compiled times diffusers' DiT .*drop --skip-reference"),
    (["--skip-speed", "--norm-rope-kernel"], "--norm-rope-kernel times the fused \\+ compiled DiT .*drop --skip-speed"),
    (["--skip-speed", "--compile-backend", "inductor", "--compile-mode", "max-autotune"],
     "--compile-mode sets how the fused \\+ compiled DiT compiles: drop --skip-speed"),
    (["--skip-reference", "--skip-eager", "--skip-speed"], "together leave the dit stage no row to time"),
])
def test_a_dit_flag_whose_rows_a_skip_flag_removes_is_refused(flags, message, capsys):
    # Each ran to exit 0 without the row the flag asked for (the three skips: an empty table).
    assert re.search(message, refusal(["--tiny", "--stage", "dit", "--repeats", "1", "--warmup", "0", *flags], capsys))
    # The skips alone stay fine where no dit stage runs.
    if flags == ["--skip-reference", "--skip-eager", "--skip-speed"]:
        from k6serve.bench import stage_runners as bench

        bench.stage_runners(build_parser().parse_args(["--tiny", "--stage", "vae", *flags]))


def test_every_bench_flag_says_what_it_does_and_the_stages_that_ignore_it_are_named():
    # --variant and --dtype had no help, and --warmup / --dtype / --compile-backend read as if every stage used them:
    # generate/sr run the engine's dtype and no warm-up call, and only dit compiles with --compile-backend.
    actions = {action.dest: action for action in build_parser()._actions if action.dest != "help"}
    assert [name for name, action in actions.items() if not action.help] == []
    assert actions["warmup"].help.startswith("dit/vae/audio/text:") and "generate/sr:" in actions["warmup"].help
    assert actions["dtype"].help.startswith("dit/vae/audio/text:") and "generate/sr:" in actions["dtype"].help
    assert actions["compile_backend"].help.startswith("dit:")


def test_a_failing_extra_generate_request_keeps_the_rows_measured_before_it(monkeypatch):
    # Unknown cache_dit_params (refused by the engine at the cached request) made the whole stage one error row:
    # the cold and warm requests, already measured, were lost with it; the silent rows after it still run. (Such
    # params are now refused before the load, below; this is any failure of an extra row's request.)
    from k6serve.bench import stage_runners

    monkeypatch.setattr(stage_runners, "check_before_loading", lambda options, stages: None)
    args = build_parser().parse_args(["--tiny", "--stage", "generate", "--repeats", "1", "--num-inference-steps", "1",
                                      "--cache-dit-params", '{"bogus": 1}', "--silent-request"])
    rows = run_stages(args, log=lambda text: None)
    assert [row.name for row in rows] == ["ours cold (first request)", "ours warm", "ours, Cache-DiT",
                                          "ours silent, first", "ours silent, warm"]
    assert [row.error is None for row in rows] == [True, True, False, True, True]
    assert rows[0].seconds > 0 and rows[1].seconds > 0
    # A FlagWorded (a ValueError that also carries `k6serve generate`'s wording), as the request's other refusals.
    assert rows[2].error.startswith("ValueError: Unknown cache_dit_params key(s) ['bogus']")


def test_the_extra_rows_requests_are_refused_before_the_load(monkeypatch):
    # A --cache-dit-params key of no setting, or --expand-prompts-request under a streamed text encoder (on a GPU),
    # was refused only when its row ran: after the load and the uncached requests, minutes at full size.
    with pytest.raises(SystemExit, match=r"^Unknown --cache-dit-params key\(s\) \['bogus'\]"):
        run_stages(build_parser().parse_args(["--tiny", "--stage", "generate", "--cache-dit-params", '{"bogus": 1}']),
                   log=lambda text: None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # the streamed encoder is CUDA's alone
    with pytest.raises(SystemExit, match=r"^--expand-prompts-request runs the text encoder once per generated token.*"
                                         r"streams its layers from host memory.*or drop --expand-prompts-request\.$"):
        run_stages(build_parser().parse_args(["--tiny", "--stage", "generate", "--device", "cuda",
                                              "--performance-mode", "memory", "--expand-prompts-request"]),
                   log=lambda text: None)


def test_the_engines_refusal_names_the_bench_flag_compile_vae_decoder():
    # The engine's message said "--compile-vae true ... or drop --compile-vae": flags this command does not have.
    with pytest.raises(SystemExit) as caught:
        run_stages(build_parser().parse_args(["--tiny", "--stage", "generate", "--compile-vae-decoder",
                                              "--performance-mode", "balanced"]), log=lambda text: None)
    message = str(caught.value)
    assert message.startswith("--compile-vae-decoder compiles the VAE decoder only under --performance-mode speed")
    assert message.endswith("or drop --compile-vae-decoder.") and "--compile-vae " not in message


def test_the_engines_refusal_names_the_bench_flag_compile_prompt_rewrite_as_written():
    # The bench's --compile-prompt-rewrite takes no value: "--compile-prompt-rewrite true" is no way to write it.
    with pytest.raises(SystemExit) as caught:
        run_stages(build_parser().parse_args(["--tiny", "--stage", "generate", "--compile-prompt-rewrite",
                                              "--performance-mode", "balanced"]), log=lambda text: None)
    assert str(caught.value).startswith("--compile-prompt-rewrite compiles the expand_prompts rewrite only under")


def test_the_json_has_null_where_a_value_is_not_finite(tmp_path):
    """json.dumps wrote a NaN cosine (a diverging fp8 row) as `NaN`, which strict JSON parsers refuse."""
    from k6serve.bench.report import write_json

    row = BenchRow(stage="dit", name="ours fp8", config="tiny", seconds=0.5, times_s=(0.5, float("inf")),
                   cosine_video=float("nan"), cosine_audio=0.99)
    path = tmp_path / "bench.json"
    write_json(path, [row], {"stage": "dit"}, device="cpu")

    def refuse(constant: str):
        raise ValueError(f"{constant} is not JSON")

    written = json.loads(path.read_text(), parse_constant=refuse)["rows"][0]
    assert written["cosine_video"] is None and written["cosine_audio"] == 0.99
    assert written["times_s"] == [0.5, None] and written["seconds"] == 0.5


@pytest.mark.parametrize("value", [",", " , "])
def test_backends_that_name_none_are_refused(value):
    """`--backends ,` left no backend: the dit stage ran diffusers' rows alone, with no row of ours and no word why."""
    from k6serve.bench import stage_runners as bench

    with pytest.raises(SystemExit, match=r"^--backends '.*' names no attention backend; give one or more, "
                                         r"comma-separated \(e\.g\. torch_sdpa\), or leave the flag out$"):
        bench.stage_runners(build_parser().parse_args(["--tiny", "--device", "cpu", "--backends", value]))


@pytest.mark.parametrize("stage", ["generate", "sr"])
def test_a_failing_warm_request_keeps_the_cold_row_and_is_an_error_row_of_its_own(stage, monkeypatch):
    # The warm request raising turned the whole stage into one error row: the cold request, measured, was lost.
    from k6serve.api import DiffGenerator

    generate = DiffGenerator.generate
    calls = []

    def second_fails(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("CUDA out of memory")
        return generate(self, *args, **kwargs)

    monkeypatch.setattr(DiffGenerator, "generate", second_fails)
    args = build_parser().parse_args(["--tiny", "--stage", stage, "--repeats", "2", "--num-inference-steps", "1"])
    rows = run_stages(args, log=lambda text: None)
    assert [(row.name, row.error) for row in rows] == [
        ("ours cold (first request)", None),
        ("ours warm", "warm request 1 of 2: RuntimeError: CUDA out of memory")]
    assert rows[0].seconds > 0 and rows[0].note.startswith("load ") and rows[1].seconds is None
    assert len(calls) == 2  # the warm requests stop at the first failure


def test_a_failing_warm_extra_request_keeps_its_first_row():
    # The same for the --silent-request pair: its warm request raising lost the silent first request's row.
    from k6serve.api import DiffGenerator

    generate = DiffGenerator.generate
    silent_calls = []

    def second_silent_fails(self, params, *args, **kwargs):
        if params.get("sample_audio") is False:
            silent_calls.append(1)
            if len(silent_calls) == 2:
                raise RuntimeError("boom")
        return generate(self, params, *args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(DiffGenerator, "generate", second_silent_fails)
        args = build_parser().parse_args(["--tiny", "--stage", "generate", "--repeats", "1", "--num-inference-steps",
                                          "1", "--silent-request"])
        rows = run_stages(args, log=lambda text: None)
    assert [(row.name, row.error) for row in rows] == [
        ("ours cold (first request)", None), ("ours warm", None), ("ours silent, first", None),
        ("ours silent, warm", "warm request 1 of 1: RuntimeError: boom")]


def test_a_refused_request_is_a_value_error_in_its_row_and_in_every_message_naming_a_type():
    # A refusal raised as FlagWorded (a ValueError that carries the CLI's flag wording) showed in a bench row as
    # "FlagWorded: ...", a type no documentation names; the same in a prompt list's note and an HTTP job's error.
    from k6serve.api import DiffGenerator
    from k6serve.request_refusals import AudioTooLong
    from k6serve.request import FlagWorded, error_type_name
    from k6serve.serve.errors import client_words

    def refused(self, *args, **kwargs):
        raise FlagWorded("sample_audio is true, but ...", flag_wording="--sample-audio was given, but ...")

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(DiffGenerator, "generate", refused)
        args = build_parser().parse_args(["--tiny", "--stage", "generate", "--repeats", "1",
                                          "--num-inference-steps", "1"])
        rows = run_stages(args, log=lambda text: None)
    assert [row.error for row in rows] == ["ValueError: sample_audio is true, but ..."]
    assert error_type_name(AudioTooLong("too long")) == "ValueError"
    assert error_type_name(RuntimeError("x")) == "RuntimeError"
    assert client_words(FlagWorded("bad")) == "ValueError: bad"


def test_the_sr_rows_write_the_source_size_height_first_as_every_other_row():
    # "x2 of 96x64x17" (width first) beside the dit / vae / generate rows' "64x96x17" of the same --height 64
    # --width 96 read as another source. Every config is height x width x frames, as Geometry.label writes it.
    # A 32x48 source: still not square, and a tenth of the 64x96 run's time on 2 cores (23 s).
    args = build_parser().parse_args(["--tiny", "--stage", "sr", "--repeats", "1", "--height", "32", "--width", "48"])
    rows = run_stages(args, log=lambda text: None)
    assert not any(row.error for row in rows), rows
    assert {row.config for row in rows} == {f"x2 of {generation_geometry(32, 48, 17).label}"} == {"x2 of 32x48x17"}
    # The MP4s' digests, taken before the scratch folder that held them went (the rows were made after it).
    assert [len(row.output_sha256) for row in rows] == [1, 1] and rows[0].output_sha256 == rows[1].output_sha256


def test_gpu_single_tiny_records_the_cpu_it_ran_on_not_the_hosts_gpu(tmp_path, monkeypatch, load_script):
    # `gpu_single.py ... --tiny` runs its parts with --device cpu; on a GPU host its environment named the GPU, its
    # driver and clocks, as if the rows had run there. The host's GPU stays in device_status.
    from k6serve.bench import report

    script = load_script("gpu_single")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=0: "NVIDIA H200")
    monkeypatch.setattr(report, "_gpu_facts", lambda: {"driver": "580.159.04"})
    monkeypatch.setattr(script, "device_status", lambda: {"gpu": "NVIDIA H200"})
    for flags, gpu in ((["--tiny"], None), ([], "NVIDIA H200")):
        out = tmp_path / str(gpu)
        assert script.main(["env", "--out", str(out), *flags]) == 0
        payload = json.loads((out / "env.json").read_text())
        assert payload["environment"]["gpu"] == gpu and ("driver" in payload["environment"]) == (gpu is not None)
        assert payload["device_status"]["gpu"] == "NVIDIA H200"


def test_a_flag_of_a_stage_not_run_is_not_checked_and_the_run_says_it_was_ignored(tmp_path, capsys):
    # --transformer-path was refused (a folder without a checkpoint) with --stage audio, which never reads it; a valid
    # one was silently ignored. Now, as the skip flags already were, a dit flag is checked with the dit stage only.
    from k6serve.bench import stage_runners as bench

    out = tmp_path / "bench.json"
    assert main(["--tiny", "--stage", "audio", "--dtype", "float32", "--repeats", "1", "--warmup", "0",
                 "--transformer-path", str(tmp_path), "--fp8-attention", "--skip-speed", "--sr-scale", "4",
                 "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    ignored = ["--transformer-path is read by the dit stage only, not run here (audio): ignored, and not checked",
               "--skip-speed is read by the dit stage only, not run here (audio): ignored, and not checked",
               "--fp8-attention is read by the dit stage only, not run here (audio): ignored, and not checked",
               "--sr-scale is read by the sr stage only, not run here (audio): ignored, and not checked"]
    assert [line.removeprefix("[bench] note: ") for line in printed.splitlines() if "note:" in line] == ignored
    assert json.loads(out.read_text())["notes"] == ignored
    # A flag read by one of the stages run says nothing; --warmup is read by audio, not by generate.
    args = build_parser().parse_args(["--tiny", "--stage", "dit", "--stage", "generate", "--warmup", "0",
                                      "--transformer-path", str(tmp_path), "--num-inference-steps", "1"])
    assert bench.ignored_flags(args) == []
    with pytest.raises(SystemExit, match="neither it nor its transformer/ holds a config.json"):
        bench.stage_runners(args)
    args = build_parser().parse_args(["--tiny", "--stage", "sr", "--warmup", "0", "--dtype", "float32"])
    assert [note.split(" is read")[0] for note in bench.ignored_flags(args)] == ["--warmup", "--dtype"]


def test_each_flag_help_names_the_stages_that_read_it():
    # The table of which stage reads which flag (the ignored-flag notes) and the help's "dit:" / "generate/sr:"
    # prefixes say the same; --backends and the skip flags' help named no stage.
    from k6serve.bench.flags import FLAG_STAGES, STAGES

    stage = "(?:" + "|".join(STAGES) + ")"
    prefix = re.compile(rf"(?:^|; )({stage}(?:/{stage})*): ")
    for action in build_parser()._actions:
        named = {name for match in prefix.findall(action.help) for name in match.split("/")}
        assert named == set(FLAG_STAGES.get(action.dest, ())), (action.dest, action.help)


@pytest.mark.parametrize(("path", "message"), [
    ("", "^--json is empty; give the file to write the rows to"),
    ("-", "^--json - would write a file named '-' \\(stdout carries the table\\); give a file path"),
    (".", "^--json .* is a folder; give the file to write in it \\(e\\.g\\. --json .*bench\\.json\\)$"),
    ("old.json",
     "^--json .*old\\.json already exists, and the bench never replaces a file .*; delete it or give another path$"),
    ("file/bench.json", "^--json .*: .*file is a file, not a folder; give a path in a folder$"),
])
def test_a_json_path_that_cannot_be_written_is_refused_before_any_stage_runs(path, message, tmp_path, capsys):
    # Each ended in a traceback after every stage had run (the JSON lost), or replaced an earlier run's file.
    (tmp_path / "old.json").write_text("{}")
    (tmp_path / "file").write_text("")
    json_path = str(tmp_path / path) if path not in ("", "-") else path
    assert re.search(message, refusal(["--tiny", "--stage", "audio", "--json", json_path], capsys))
    assert (tmp_path / "old.json").read_text() == "{}"  # the earlier run's rows, kept


def test_an_unwritable_json_folder_is_refused_up_front_and_a_failed_write_is_a_message(tmp_path, monkeypatch,
                                                                                         capsys):
    from k6serve.bench import __main__ as bench
    from k6serve.bench import flag_checks

    def refused(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    with monkeypatch.context() as patch:  # root writes anywhere: the probe file is refused instead
        patch.setattr(flag_checks.tempfile, "TemporaryFile", refused)
        message = refusal(["--tiny", "--stage", "audio", "--json", str(tmp_path / "runs" / "bench.json")], capsys)
    assert re.search("^cannot write --json .* \\(Permission denied\\); give a writable folder$", message)
    # Writable then, failing at the end (disk full): a message and exit 1, the rows in the table printed above.
    monkeypatch.setattr(bench, "write_json", disk_full)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert main(["--tiny", "--stage", "audio", "--dtype", "float32", "--repeats", "1", "--warmup", "0",
                 "--json", "~/runs/bench.json"]) == 1
    captured = capsys.readouterr()
    assert "| audio | ours decode_audio |" in captured.out
    assert "[bench] could not write --json ~/runs/bench.json: [Errno 28] No space left on device" in captured.err
    assert (tmp_path / "runs").is_dir()  # `~` is the home folder, as in --transformer-path


def test_gpu_single_writes_null_where_a_value_is_not_finite(tmp_path, load_script):
    # Its own json.dumps wrote a diverging row's NaN cosine as `NaN`, which k6serve bench's JSON no longer has.
    script = load_script("gpu_single")
    row = BenchRow(stage="dit", name="ours fp8", config="tiny", seconds=0.5, cosine_video=float("nan"))
    script.write_results(tmp_path, "dit", [row], [], {}, ["dit"], torch.device("cpu"))

    def refuse(constant: str):
        raise ValueError(f"{constant} is not JSON")

    written = json.loads((tmp_path / "dit.json").read_text(), parse_constant=refuse)
    assert written["rows"][0]["cosine_video"] is None and written["rows"][0]["seconds"] == 0.5


@pytest.mark.parametrize(("flags", "message"), [
    (["--stage", "sr", "--sr-scale", "3"], "^--sr-scale must be 2, 4 or 2.25, got 3$"),
    (["--stage", "generate", "--num-inference-steps", "0"],
     "^--num-inference-steps must be between 1 and 1000, got 0$"),
    (["--stage", "generate", "--height", "4096", "--width", "4096"], "^--height must be at most 2048 "),
    (["--stage", "sr", "--offload-prefetch-blocks", "0"], "^--offload-prefetch-blocks must be an integer >= 1 "),
    (["--stage", "generate", "--output-dir", "{file}"], "^--output-dir .*: .* is a file, not a folder"),
    (["--stage", "sr", "--layerwise-offload-components", "text_encoder"],
     "^--layerwise-offload-components text_encoder: the super-resolution model has no such component"),
    (["--stage", "generate", "--stage", "sr", "--cpu-offload-components", "text_encoder"],
     "^--cpu-offload-components text_encoder: the super-resolution model has no such component.* \\(the sr stage's "
     "engine: the offload flags reach both stages; run sr in a k6serve bench of its own\\)$"),
    (["--stage", "generate", "--layerwise-offload-components", "latent_upscaler"],
     "^--layerwise-offload-components latent_upscaler: .* has no such component"),
    # --tiny runs on the CPU, also on a GPU host
    (["--stage", "sr", "--attention-backend", "fa"], "^attention backend 'fa' \\(FlashAttention\\) cannot run here"),
])
def test_a_generate_or_sr_flag_the_request_would_refuse_is_refused_before_any_stage_runs(flags, message, tmp_path,
                                                                                         capsys):
    # Each was refused by the engine after the model had loaded, and after every stage before it had run (here the
    # vae stage): an error row at the end of the run instead of a refusal at its start.
    (tmp_path / "file").write_text("")
    flags = [flag.format(file=tmp_path / "file") for flag in flags]
    assert re.search(message, refusal(["--tiny", "--stage", "vae", *flags], capsys))


def test_the_sr_stage_runs_without_the_generation_only_engine_flags():
    # --quantization fp8, --vae-tiling on and --compile-prompt-rewrite (help: "generate:") reached the SR engine too,
    # which refuses each: `--stage generate --stage sr --quantization fp8` lost the sr stage to an error row.
    from k6serve.bench import stage_runners as bench
    from k6serve.bench.end_to_end import _engine_kwargs, check_before_loading

    args = build_parser().parse_args(["--tiny", "--stage", "sr", "--stage", "generate", "--quantization", "fp8",
                                      "--quantization-ignored-layers", "feed_forward", "--vae-tiling", "on",
                                      "--compile-prompt-rewrite", "--num-inference-steps", "1"])
    captured = {}
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(bench, "run_super_resolution", lambda options: captured.setdefault("sr", options) and [])
        bench.stage_runners(args)["sr"]()  # the preflight of both stages passes
    kwargs = _engine_kwargs(captured["sr"], super_resolution=True)
    assert not {"quantization", "quantization_ignored_layers", "vae_tiling", "compile_prompt_rewrite"} & set(kwargs)
    assert _engine_kwargs(captured["sr"])["quantization"] == "fp8"  # the generate stage's engine keeps them
    check_before_loading(captured["sr"], ["sr"])
    # The SR engine takes the options that are left: a run of a 32x48 source (the --tiny 64x96 one took 20 s).
    rows = run_stages(build_parser().parse_args(["--tiny", "--stage", "sr", "--repeats", "1", "--vae-tiling", "on",
                                                 "--height", "32", "--width", "48"]), log=lambda text: None)
    assert [row.error for row in rows] == [None, None]


def test_a_variant_that_tiny_or_a_transformer_path_overrides_is_noted(tiny_distill_dir):
    from k6serve.bench.stage_runners import ignored_flags

    def notes(*flags):
        return ignored_flags(build_parser().parse_args(list(flags)))

    assert notes("--tiny", "--variant", "lite-distill") == [
        "--variant lite-distill is not read with --tiny (dit times the toy config, generate runs the demo checkpoint): "
        "ignored"]
    assert notes("--variant", "lite-distill", "--transformer-path", str(tiny_distill_dir)) == [
        "--variant lite-distill is not read by the dit stage with --transformer-path (its config.json sets the "
        "shapes): ignored"]
    # generate still runs --variant's model; the default variant, or one the run reads, says nothing.
    assert notes("--variant", "lite-distill", "--transformer-path", str(tiny_distill_dir), "--stage", "dit",
                 "--stage", "generate") == []
    assert notes("--tiny") == notes("--variant", "lite-distill") == []
    assert notes("--tiny", "--variant", "lite", "--stage", "vae")[0].startswith("--variant is read by the dit/generate")


def test_the_json_keeps_the_stages_that_finished_when_a_later_one_is_killed(tmp_path, monkeypatch, capsys):
    # The JSON was written once, at the end: a run killed in its last stage (out of memory, a timeout, Ctrl-C) lost
    # every row already measured. It is written after each stage, marked incomplete until the end.
    from k6serve.bench import stage_runners as bench

    def interrupted(options):
        raise KeyboardInterrupt

    monkeypatch.setattr(bench, "run_vae", lambda options: [BenchRow(stage="vae", name="ours", config="c", seconds=1.0)])
    monkeypatch.setattr(bench, "run_audio", interrupted)
    out = tmp_path / "bench.json"
    assert main(["--tiny", "--stage", "vae", "--stage", "audio", "--json", str(out)]) == 130
    payload = json.loads(out.read_text())
    assert payload["complete"] is False and [row["stage"] for row in payload["rows"]] == ["vae"]
    assert f"[bench] interrupted; --json {out} holds the stages that finished" in capsys.readouterr().err
    # A whole run: its own file replaced by the last write (no temporary file left), marked complete.
    monkeypatch.setattr(bench, "run_audio", lambda options: [BenchRow(stage="audio", name="ours", config="c")])
    out = tmp_path / "whole.json"
    assert main(["--tiny", "--stage", "vae", "--stage", "audio", "--json", str(out)]) == 0
    payload = json.loads(out.read_text())
    assert payload["complete"] is True and [row["stage"] for row in payload["rows"]] == ["vae", "audio"]
    assert sorted(path.name for path in tmp_path.iterdir()) == ["bench.json", "whole.json"]
    # The rewrite keeps the mode the file was created with (a temporary file's is 0600: unreadable to others).
    assert out.stat().st_mode & 0o777 == (tmp_path / "bench.json").stat().st_mode & 0o777


def test_a_compile_backend_torch_does_not_know_is_refused_before_any_stage_runs(capsys):
    # `--compile-backend inductr` failed every compiled row after the model was built.
    assert refusal(["--tiny", "--compile-backend", "inductr"], capsys) == (
        "--compile-backend 'inductr' is no torch.compile backend; e.g. inductor, eager or aot_eager "
        "(torch._dynamo.list_backends(exclude_tags=()) lists them all)")
    from k6serve.bench import stage_runners as bench

    for backend in ("eager", "aot_eager", "inductor"):
        bench.stage_runners(build_parser().parse_args(["--tiny", "--compile-backend", backend]))


def test_the_sr_source_clip_takes_any_even_size_and_the_text_stage_no_size(capsys):
    # `--stage sr --height 540 --width 960` (a 540p source) was refused as no multiple of 16, and 120 frames as no
    # 4k+1, though the SR pipeline upscales any even size and length; the text stage, which reads no size, was
    # refused for one too.
    from k6serve.bench import stage_runners as bench

    rows = run_stages(build_parser().parse_args(["--tiny", "--stage", "sr", "--repeats", "1", "--height", "42",
                                                 "--width", "70", "--num-frames", "18"]), log=lambda text: None)
    assert [(row.config, row.error) for row in rows] == [("x2 of 42x70x18", None)] * 2
    assert refusal(["--tiny", "--stage", "sr", "--height", "41"], capsys) == (
        "--height / --width / --num-frames: the sr stage's source clip needs even sides and one frame or more, got "
        "41x96x17")
    # A generation stage beside it still needs a generation's size.
    assert "multiples of 16, got 42x70" in refusal(["--tiny", "--stage", "sr", "--stage", "vae", "--height", "42",
                                                    "--width", "70"], capsys)
    args = build_parser().parse_args(["--tiny", "--stage", "text", "--height", "30"])
    bench.stage_runners(args)
    assert bench.ignored_flags(args) == ["--height is read by the dit/vae/audio/generate/sr stages only, not run here "
                                         "(text): ignored, and not checked"]


def test_gpu_single_parts_pass_no_flag_their_stage_ignores(load_script):
    # generate and sr parts passed --warmup 0, and the text part the sizes, which those stages never read.
    from k6serve.bench.stage_runners import ignored_flags

    script = load_script("gpu_single")
    for subcommand in ("dit", "generate", "decoders", "sr"):
        for tiny in ([], ["--tiny"]):
            for _, argv in script.parts(script.build_parser().parse_args([subcommand, *tiny])):
                notes = ignored_flags(build_parser().parse_args(argv))
                # --tiny keeps each model's part (and its --variant, refused when unknown) on the toy config.
                assert [note for note in notes if not (tiny and note.startswith("--variant "))] == [], argv


def test_gpu_single_refuses_repeats_below_one_before_any_part(tmp_path, load_script, capsys):
    # Each part's k6serve bench refused it: a run of failed parts and an error JSON instead of one refusal.
    script = load_script("gpu_single")
    with pytest.raises(SystemExit) as exit_info:
        script.main(["decoders", "--tiny", "--out", str(tmp_path), "--repeats", "0"])
    assert exit_info.value.code == 2 and "--repeats must be >= 1" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("models", ["", ",", " , "])
def test_gpu_single_models_that_name_none_are_refused(models, tmp_path, load_script, capsys):
    # `--models ""` (an unset shell variable) ran no part, wrote a JSON of no rows and exited 0.
    script = load_script("gpu_single")
    with pytest.raises(SystemExit) as exit_info:
        script.main(["dit", "--tiny", "--out", str(tmp_path), "--models", models])
    assert exit_info.value.code == 2 and f"--models {models!r} names no model" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_gpu_single_refuses_an_out_it_cannot_write_before_any_part(tmp_path, load_script, capsys):
    # A --out that is a file failed at the first write, after the first part (minutes on the GPU) had run.
    script = load_script("gpu_single")
    (tmp_path / "file").write_text("")
    with pytest.raises(SystemExit) as exit_info:
        script.main(["decoders", "--tiny", "--out", str(tmp_path / "file")])
    captured = capsys.readouterr()
    assert exit_info.value.code == 2 and "part 'vae' starts" not in captured.out
    assert f"--out {tmp_path / 'file'} is a file, not a folder; give the folder for decoders.json and .md" \
        in captured.err
    with pytest.raises(SystemExit) as exit_info:
        script.main(["decoders", "--tiny", "--out", str(tmp_path / "file" / "sub")])
    assert exit_info.value.code == 2 and "cannot write to --out" in capsys.readouterr().err


def test_every_bench_flag_with_a_default_names_it_in_its_help():
    # --repeats, --warmup, --dtype, --performance-mode, --sr-scale ... said nothing of their defaults (argparse shows
    # none), and --offload-*-blocks said "with --performance-mode memory" where any streamed block takes them.
    for action in build_parser()._actions:
        if action.default is None or action.default is False or action.default in ([], ()) or action.dest == "help":
            continue
        default = f"{action.default:g}" if isinstance(action.default, float) else str(action.default)
        value = re.escape(default)
        assert re.search(rf"\bdefault {value}\b|^{value} \(the default\)", action.help), (action.dest, action.help)
    assert "--layerwise-offload-components" in build_parser()._option_string_actions["--offload-resident-blocks"].help


@pytest.mark.parametrize("flags", [["dit", "--compile-mode", "fastest"], ["generate", "--attention-backend", "flash9"],
                                   ["sr", "--performance-mode", "fast"]])
def test_gpu_single_refuses_a_value_k6serve_bench_would_refuse_up_front(flags, load_script, capsys):
    # Free strings: each failed every part it reached, after the GPU had been set up, instead of the command.
    script = load_script("gpu_single")
    with pytest.raises(SystemExit) as exit_info:
        script.build_parser().parse_args(flags)
    assert exit_info.value.code == 2 and "invalid choice" in capsys.readouterr().err


def test_a_pipe_in_a_rows_config_keeps_the_table_a_table():
    # The dit rows' config is the --transformer-path folder: "ckpt|v2" made its row one cell too many.
    lines = format_table([BenchRow(stage="dit", name="ours", config="/data/ckpt|v2/transformer 64x96x17",
                                   seconds=1.0)]).splitlines()
    assert [len(re.split(r"(?<!\\)\|", line)) for line in lines] == [len(COLUMNS) + 2] * 3
    assert "| /data/ckpt\\|v2/transformer 64x96x17 |" in lines[2]


def test_full_size_components_have_the_same_random_weights_in_every_build(monkeypatch):
    """The full-size VAEs' random weights are the engine's dummy build's (`build_dummy_component`, each from its
    seed): unseeded, two processes timed two different VAEs, so the rows' output digests could not compare them
    (their eager decodes' frames differed on an H100). The caller's random state is left as it was. (Stand-ins for
    diffusers' classes: the real ones are about 1 GB in fp32.)"""
    from types import SimpleNamespace

    from k6serve.bench import components
    from k6serve.models.kandinsky6.checkpoint import build_dummy_component

    def stand_in():
        return torch.nn.Sequential(torch.nn.Conv3d(2, 3, 3), torch.nn.Linear(4, 5))

    monkeypatch.setattr(components, "import_diffusers", lambda: SimpleNamespace(
        AutoencoderKLHunyuanVideo=stand_in, MMAudioVAE=stand_in, MMAudioVocoder=stand_in))
    cpu = torch.device("cpu")
    torch.manual_seed(123)
    before = torch.random.get_rng_state()
    vae = components.build_video_vae(tiny=False, device=cpu, dtype=torch.float32)
    torch.manual_seed(456)  # another state in between: the weights do not depend on it
    again = components.build_video_vae(tiny=False, device=cpu, dtype=torch.float32)
    assert all(torch.equal(a, b) for a, b in zip(vae.state_dict().values(), again.state_dict().values(), strict=True))
    engines = build_dummy_component("vae", stand_in, cpu)  # what an engine's dummy build draws for its VAE
    assert all(torch.equal(a, b) for a, b in zip(vae.state_dict().values(), engines.state_dict().values(), strict=True))
    audio_vae, vocoder = components.build_audio_decoder(tiny=False, device=cpu, dtype=torch.float32)
    assert torch.equal(audio_vae[0].weight, build_dummy_component("audio_vae", stand_in, cpu)[0].weight)
    assert torch.equal(components.build_audio_decoder(tiny=False, device=cpu, dtype=torch.float32)[1][1].bias,
                       vocoder[1].bias)
    torch.manual_seed(123)
    components.build_video_vae(tiny=False, device=cpu, dtype=torch.float32)
    assert torch.equal(torch.random.get_rng_state(), before)  # the caller's generator as it was
    assert not torch.equal(stand_in()[0].weight, vae[0].weight)  # it draws from the global generator
