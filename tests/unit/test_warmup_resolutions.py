"""`--warmup-resolutions`: the shapes `--warmup-mode server` warms at start-up (tiny checkpoints, CPU).

The sizes parse from the CLI, a --config file and the Python API into the frozen config; a size the model could not
take is refused at start naming the flag and the item, before the weights load where the model is known; the
worker warms each listed shape in order (generation: a 2-step request; SR: one upscale of a synthetic source clip),
on every rank of a replica, and reports each one's cost (the worker, the engine, GET /health).
"""

from __future__ import annotations

import dataclasses
import json

import pytest

import k6serve.runtime.worker as worker_module
import k6serve.runtime.worker_preflight as worker_preflight
from k6serve import DiffGenerator
from k6serve.cli.config_file import merged_options
from k6serve.cli.flags import build_parser, split_options
from k6serve.cli.main import main
from k6serve.config import RuntimeConfig, WarmupSize
from k6serve.engine_arguments import build_engine_config
from k6serve.request import OutputOptions, SamplingParams
from k6serve.runtime.engine import Engine, check_before_loading
from k6serve.runtime.worker import ModelWorker

pytestmark = pytest.mark.usefixtures("one_torch_thread")
NO_OUTPUT = OutputOptions(save_output=False, return_frames=False)


def server(**runtime) -> RuntimeConfig:
    return RuntimeConfig(warmup_mode="server", **runtime)


def test_sizes_parse_width_first_with_an_optional_frame_count():
    expected = (WarmupSize(1280, 720), WarmupSize(768, 512, 61))
    assert server(warmup_resolutions=["1280x720", "768x512x61"]).warmup_resolutions == expected
    # The API (and a --config file) may give one string; "X" as a shell user may type it.
    assert server(warmup_resolutions="1280X720, 768x512x61").warmup_resolutions == expected
    assert server(warmup_resolutions=expected).warmup_resolutions == expected
    assert str(WarmupSize(768, 512, 61)) == "768x512x61" and str(WarmupSize(1280, 720)) == "1280x720"
    assert RuntimeConfig().warmup_resolutions == ()


@pytest.mark.parametrize(("value", "message"), [
    (["1280*720"], "--warmup-resolutions '1280*720' is not a size: write WxH, or WxHxF with a frame count, in "
                   "positive whole pixels and frames, width first as in the HTTP API's size (e.g. 1280x720 or "
                   "768x512x61)."),
    (["0x720"], "--warmup-resolutions '0x720' is not a size"),
    (["768x512x0"], "--warmup-resolutions '768x512x0' is not a size"),
    (["1280x720x61x2"], "--warmup-resolutions '1280x720x61x2' is not a size"),
    ([1280], "--warmup-resolutions 1280 is not a size"),
    (5, "--warmup-resolutions takes sizes WxH or WxHxF (e.g. 1280x720 768x512x61), got 5"),
    (["768x512", "1280x720", "768x512"], "--warmup-resolutions lists 768x512 more than once; each size is warmed "
                                         "once: drop the repeat."),
])
def test_a_size_that_does_not_parse_is_refused_naming_the_flag_and_the_item(value, message):
    with pytest.raises(ValueError) as error:
        server(warmup_resolutions=value)
    assert str(error.value).startswith(message)


@pytest.mark.parametrize(("mode", "says"), [
    ("off", "--warmup-mode off (the default) warms nothing"),
    ("request", "--warmup-mode request warms only the first request's own shape, right before it runs"),
])
def test_sizes_need_warmup_mode_server(mode, says):
    with pytest.raises(ValueError) as error:
        RuntimeConfig(warmup_mode=mode, warmup_resolutions=["1280x720"])
    assert str(error.value) == (f"--warmup-resolutions lists sizes to warm at start-up, which --warmup-mode server "
                                f"does; {says}. Add --warmup-mode server, or drop --warmup-resolutions.")


def _config_of(argv: list[str]):
    parser = build_parser()
    engine, _ = split_options(merged_options(parser.parse_args(argv), parser))
    return build_engine_config(engine.pop("model_path"), **engine)


def test_cli_flag_and_config_file_reach_the_config(tmp_path):
    config = _config_of(["serve", "--model-path", "demo", "--warmup-mode", "server",
                         "--warmup-resolutions", "96x64", "128x64x9"])
    assert config.runtime.warmup_resolutions == (WarmupSize(96, 64), WarmupSize(128, 64, 9))
    path = tmp_path / "serve.yaml"
    path.write_text("model-path: demo\nwarmup-mode: server\nwarmup-resolutions: [96x64, 128x64x9]\n")
    assert _config_of(["serve", "--config", str(path)]).runtime.warmup_resolutions == config.runtime.warmup_resolutions
    path.write_text("model-path: demo\nwarmup-mode: server\nwarmup-resolutions: 96x64\n")
    assert _config_of(["generate", "--config", str(path)]).runtime.warmup_resolutions == (WarmupSize(96, 64),)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps({"model-path": "demo", "warmup-mode": "server", "warmup-resolutions": [1280]}))
    with pytest.raises(ValueError, match=r"--config .*bad\.json: --warmup-resolutions: takes sizes WxH or WxHxF"):
        _config_of(["serve", "--config", str(path)])


def test_cli_refuses_sizes_without_server_mode_before_loading(capsys, monkeypatch):
    monkeypatch.setattr(worker_module.ModelWorker, "__init__", lambda *args: pytest.fail("the model loaded"))
    assert main(["serve", "--model-path", "demo", "--warmup-resolutions", "96x64"]) == 2
    assert capsys.readouterr().err.strip() == (
        "error: --warmup-resolutions lists sizes to warm at start-up, which --warmup-mode server does; --warmup-mode "
        "off (the default) warms nothing. Add --warmup-mode server, or drop --warmup-resolutions.")


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.parametrize("command", ["generate", "serve"])
def test_a_size_the_model_cannot_take_is_refused_before_any_worker_starts(command, demo_dir, capsys, monkeypatch,
                                                                          tmp_path):
    import k6serve.runtime.process_group_worker as process_group_worker

    monkeypatch.setattr(process_group_worker.MultiProcessWorker, "__init__",
                        lambda *args, **kwargs: pytest.fail("a worker started"))
    request = ["--prompt", "x"] if command == "generate" else ["--port", str(_free_port())]
    argv = [command, "--model-path", "demo", "--device", "cpu", "--warmup-mode", "server", "--warmup-resolutions",
            "96x64", "100x64", *request, "--output-path", str(tmp_path)]
    assert main(argv) == 2
    assert capsys.readouterr().err.strip() == (
        "error: --warmup-resolutions 100x64: width must be a positive multiple of 16 (VAE 8x times patch 2), got 100 "
        "(the nearest are 96 and 112).")


@pytest.mark.parametrize(("sizes", "message"), [
    (["96x64x600"], "--warmup-resolutions 96x64x600: num_frames 600 gives more than 128 latent frames; use at most "
                    "509."),
    (["4096x64"], "--warmup-resolutions 4096x64: width must be at most 2048"),
    # The demo's default is 17 frames, and 18 rounds to 17 as a request's count does.
    (["96x64", "96x64x17"], "--warmup-resolutions 96x64 and 96x64x17 warm the same shape on demo "
                            "(96x64x17); drop one of them."),
    (["96x64x18", "96x64"], "--warmup-resolutions 96x64x18 and 96x64 warm the same shape on demo (96x64x17)"),
])
def test_generation_sizes_follow_the_request_rules(demo_dir, sizes, message):
    with pytest.raises(ValueError) as error:
        check_before_loading(build_engine_config("demo", warmup_mode="server", warmup_resolutions=sizes))
    assert str(error.value).startswith(message)


def test_the_python_api_names_its_keywords(demo_dir):
    with pytest.raises(ValueError) as error:
        DiffGenerator.from_pretrained("demo", device="cpu", warmup_resolutions="96x64")
    assert str(error.value).startswith("warmup_resolutions lists sizes to warm at start-up, which "
                                       "warmup_mode='server' does; warmup_mode='off' (the default) warms nothing.")
    with pytest.raises(ValueError, match=r"^warmup_resolutions 100x64: width must be a positive multiple of 16"):
        DiffGenerator.from_pretrained("demo", device="cpu", warmup_mode="server", warmup_resolutions=["100x64"])


def _recording_warmups(monkeypatch) -> list:
    """The requests the worker's server warm-up runs, in order (the worker's own `warmup` still runs them)."""
    seen = []
    original = worker_module.warmup

    def recording(pipeline, request, mode, **options):
        seen.append(request)
        return original(pipeline, request, mode, **options)

    monkeypatch.setattr(worker_module, "warmup", recording)
    return seen


def test_server_warmup_runs_each_listed_shape_in_order(tiny_distill_dir, monkeypatch, caplog):
    seen = _recording_warmups(monkeypatch)
    config = build_engine_config(str(tiny_distill_dir), device="cpu", warmup_mode="server",
                                 warmup_resolutions=["48x32x5", "32x32x6"])
    with caplog.at_level("INFO"):
        worker = ModelWorker(config)
    # Width first; 6 frames round to 5 as a request's would; 2 steps each, not the variant's 10.
    assert [(r.width, r.height, r.num_frames) for r in seen] == [(48, 32, 5), (32, 32, 5)]
    assert [report.size for report in worker.server_warmups] == ["48x32x5", "32x32x5"]
    assert [report.num_inference_steps for report in worker.server_warmups] == [2, 2]
    assert all(report.seconds > 0 and report.mode == "server" for report in worker.server_warmups)
    assert worker.server_warmup_s == sum(report.seconds for report in worker.server_warmups)
    assert "--warmup-resolutions 32x32x6: 6 frames is not of the form 4k+1; warming 5" in caplog.text
    assert "warm-up (server) of 2 shapes took" in caplog.text
    # Warmed at start: a request runs without warming again.
    result = worker.run(SamplingParams(prompt="x", height=32, width=48, num_frames=5), NO_OUTPUT)
    assert "warmup" not in result.timings and len(seen) == 2
    engine = Engine(config, worker=worker)
    try:
        assert engine.startup_warmups == worker.server_warmups
    finally:
        engine.shutdown()


def test_server_warmup_without_sizes_still_warms_the_default_shape(tiny_distill_dir, monkeypatch):
    seen = _recording_warmups(monkeypatch)
    monkeypatch.setattr(ModelWorker, "variant_warmup_params", lambda self: SamplingParams(
        prompt="warm-up", height=32, width=32, num_frames=5))  # the variant's 512x768x121 is slow on a CPU
    worker = ModelWorker(build_engine_config(str(tiny_distill_dir), device="cpu", warmup_mode="server"))
    assert [(r.width, r.height, r.num_frames) for r in seen] == [(32, 32, 5)]
    assert [report.size for report in worker.server_warmups] == ["32x32x5"]


def _recording_sources(monkeypatch) -> list:
    """(width, height, frames) of each SR warm-up source clip, in order."""
    from k6serve.media.probe import probe

    sources = []
    original = worker_module.generate_into_mp4

    def recording(pipeline, request, target, on_step):
        info = probe(request.video_path)
        sources.append((info.width, info.height, info.num_frames))
        return original(pipeline, request, target, on_step)

    monkeypatch.setattr(worker_module, "generate_into_mp4", recording)
    return sources


def test_super_resolution_sizes_are_source_clips(tiny_sr_dir, monkeypatch, tmp_path):
    import tempfile

    monkeypatch.setattr(worker_module, "SR_WARMUP_CLIP", (96, 32, 9, 24))  # frames for sizes that give none
    monkeypatch.setattr(worker_preflight, "SR_WARMUP_CLIP", (96, 32, 9, 24))  # the same frames for the size check
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    sources = _recording_sources(monkeypatch)
    worker = ModelWorker(build_engine_config(str(tiny_sr_dir), device="cpu", warmup_mode="server",
                                             warmup_resolutions=["64x32x17", "32x32"]))
    assert sources == [(64, 32, 17), (32, 32, 9)]
    assert [report.size for report in worker.server_warmups] == ["64x32x17", "32x32x9"]
    assert worker.server_warmup_s == sum(report.seconds for report in worker.server_warmups) > 0
    assert list(tmp_path.iterdir()) == []  # the temporary clips and MP4s are gone


@pytest.mark.parametrize(("size", "message"), [
    ("63x32", "--warmup-resolutions 63x32: the warm-up writes its source clip in H.264 (4:2:0), which needs even "
              "sides; use 64x32."),
    # x2 tiles of the tiny checkpoint take at least 32 px a side.
    ("16x16", "--warmup-resolutions 16x16: a source of this size cannot be upscaled at the warm-up's x2: the source "
              "frame is 16x16"),
    ("9000x32", "--warmup-resolutions 9000x32: a source of this size cannot be upscaled at the warm-up's x2: the x2 "
                "upscale of this 9000x32 source would be 18000x64, but H.264 frames are at most 16384"),
    ("64x32x17 64x32x20", "--warmup-resolutions 64x32x17 and 64x32x20 warm the same shape on vsr-distilled2steps "
                          "(64x32x17)"),
])
def test_super_resolution_sizes_are_checked_before_loading(tiny_sr_dir, size, message):
    with pytest.raises(ValueError) as error:
        check_before_loading(build_engine_config(str(tiny_sr_dir), device="cpu", warmup_mode="server",
                                                 warmup_resolutions=size))
    assert str(error.value).startswith(message)


def test_a_source_too_small_for_the_loaded_tiles_is_refused_by_the_worker(tiny_sr_dir, monkeypatch):
    # When the tiles cannot be read before the load (a hub id), the worker plans the source once loaded, before it
    # writes the clip.
    import k6serve.models.kandinsky6_sr.config_before_loading as sr_configs

    monkeypatch.setattr(sr_configs, "sr_tiling_before_loading", lambda *args: None)
    config = build_engine_config(str(tiny_sr_dir), device="cpu", warmup_mode="server", warmup_resolutions=["16x16"])
    check_before_loading(config)
    monkeypatch.setattr("k6serve.testing.clips.make_clip", lambda *args, **kwargs: pytest.fail("clip written"))
    with pytest.raises(ValueError, match=r"^--warmup-resolutions 16x16: a source of this size cannot be upscaled"):
        ModelWorker(config)


def test_generate_with_sizes_keeps_server_mode(tiny_distill_dir, monkeypatch, tmp_path, caplog):
    # Without sizes, generate warms its own request (test_cli_edge_cases); listed sizes are warmed as asked.
    import k6serve.cli.generate as generate_module

    seen = _recording_warmups(monkeypatch)

    def from_cli_options(model_path, **options):
        config = build_engine_config(model_path, **options)
        return DiffGenerator(Engine(config, worker=ModelWorker(config)), wording=str)

    monkeypatch.setattr(generate_module.DiffGenerator, "from_cli_options", staticmethod(from_cli_options))
    with caplog.at_level("INFO"):
        assert main(["generate", "--model-path", str(tiny_distill_dir), "--device", "cpu", "--prompt", "x",
                     "--height", "32", "--width", "32", "--num-frames", "5", "--warmup-mode", "server",
                     "--warmup-resolutions", "48x32x5", "--output-path", str(tmp_path)]) == 0
    assert [(r.width, r.height, r.num_frames) for r in seen] == [(48, 32, 5)]
    assert "warm-up (server, 48x32x5) took" in caplog.text and "warm-up (request)" not in caplog.text


@pytest.mark.multiprocess
def test_every_rank_of_a_replica_warms_the_listed_shapes(tiny_pro_dir):
    """Ulysses over 2 ranks: both ranks warm both shapes together (one rank alone would wait in the first
    all-to-all until the collective timeout), the leader's costs reach the engine, and a request still runs."""
    from k6serve.config import EngineConfig, ModelConfig, ParallelConfig

    config = EngineConfig(model=ModelConfig(model_path=str(tiny_pro_dir)),
                          parallel=ParallelConfig(num_gpus=2, ulysses_degree=2, dist_timeout_s=60.0),
                          runtime=RuntimeConfig(device="cpu", warmup_mode="server",
                                                warmup_resolutions=("48x32x5", "32x32x5")))
    engine = Engine(config)
    try:
        assert [report.size for report in engine.startup_warmups] == ["48x32x5", "32x32x5"]
        assert all(report.seconds > 0 for report in engine.startup_warmups)
        result = engine.generate(SamplingParams(prompt="x", height=32, width=48, num_frames=5,
                                                num_inference_steps=2), NO_OUTPUT)
        assert "warmup" not in result.timings
    finally:
        engine.shutdown()


def test_gpu_warmup_sizes_script_runs_at_toy_size(tmp_path, load_script):
    """scripts/gpu_warmup_sizes.py on the demo checkpoint (CPU: nothing compiles): the warm-up per listed shape, then
    a request per listed shape and a cold and a warm one of the unlisted shape, in the JSON and the exit code."""
    script = load_script("gpu_warmup_sizes")
    assert script.main(["--tiny", "--out", str(tmp_path), "--sizes", "48x32x5", "32x32x5", "--unlisted", "64x32x5",
                        "--steps", "2"]) == 0
    report = json.loads((tmp_path / "warmup_sizes.json").read_text())
    assert [warm["size"] for warm in report["warmups"]] == ["48x32x5", "32x32x5"]
    assert [(row["request"], row["frames"]) for row in report["requests"]] == [
        ("listed", "48x32x5"), ("listed", "32x32x5"), ("unlisted cold", "64x32x5"), ("unlisted warm", "64x32x5")]
    assert all(row["graphs_compiled"] == 0 and row["denoise_s"] > 0 for row in report["requests"])


def _counted_speed_worker(checkpoint, monkeypatch) -> ModelWorker:
    """A CPU worker with speed mode's CUDA transforms, its blocks compiled by dynamo's counting `aot_eager` backend
    (so `graphs_compiled` counts what a GPU would compile); the report is what the worker decides its extra warm-up
    passes from."""
    import functools

    import torch
    from torch._dynamo.testing import CompileCounterWithBackend

    from k6serve.speed import apply_performance_mode, performance_mode
    from k6serve.speed.regional_compile import apply_regional_compile

    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    monkeypatch.setattr(performance_mode, "apply_regional_compile",
                        functools.partial(apply_regional_compile, backend=counter))
    worker = ModelWorker(build_engine_config(str(checkpoint), device="cpu", attention_backend="sdpa"))
    worker.performance_report = apply_performance_mode(worker.pipeline.models, "speed", "cuda")
    worker.pipeline.trim_text_padding = True  # as the worker sets it in speed mode
    return worker


@pytest.mark.parametrize("mode", ["request", "server"])
def test_a_compiled_warm_up_also_warms_other_lengths_and_the_image(tiny_distill_dir, tmp_path, monkeypatch, mode):
    """Speed mode trims the text padding, so the compiled blocks see each prompt's token count (and the soundtrack's
    length, from the fps; and an image request takes another graph): dynamo compiles them static on the first and
    dynamic on the second. The warm-up's first shape also runs one DiT step with the prompt twice at another fps and
    with an image (stopped before the decode), so the first real request of any prompt, fps or image compiles
    nothing; on the H200 it had compiled 3 graphs (10.7 s) after a server warm-up. Counted with dynamo's CPU
    `aot_eager` backend."""

    import torch
    from PIL import Image

    worker = _counted_speed_worker(tiny_distill_dir, monkeypatch)
    calls = []
    pipeline = worker.pipeline
    monkeypatch.setattr(worker, "pipeline", lambda request, **kwargs: (calls.append(request), pipeline(request,
                                                                                                      **kwargs))[1])
    shape = dict(height=32, width=48, num_frames=5)
    if mode == "request":
        worker._warmup(SamplingParams(prompt="warm-up", **shape))
    else:
        runtime = dataclasses.replace(worker.config.runtime, warmup_mode="server",
                                      warmup_resolutions=(WarmupSize(48, 32, 5), WarmupSize(32, 32, 5)))
        worker.config = dataclasses.replace(worker.config, runtime=runtime)
        worker._server_warmup()
    expected = [("warm-up", 24.0, 2, False, True), ("warm-up warm-up", 30.0, 1, True, True),
                ("warm-up", 24.0, 1, False, False)]  # the request, the other lengths' step, a silent step
    if mode == "server":
        expected.append(("warm-up", 24.0, 2, False, True))  # the second shape: the other lengths are dynamic already
    assert [(request.prompt, request.fps, request.num_inference_steps, request.image_path is not None,
             request.with_audio) for request in calls] == expected
    image = tmp_path / "image.png"
    Image.new("RGB", (48, 32), (10, 200, 30)).save(image)
    # Another prompt length, another soundtrack length (5 frames at 20 fps: 11 audio tokens, 9 at 24), an image.
    # And a silent request (no audio tokens: a graph of its own, 4.1 s of compile in the H200's first silent
    # Pro-distill request, forty-fifth session).
    for prompt, fps, image_path, audio in (("a fox runs through the deep snow of a pine forest at dawn", 24.0, None,
                                            None), ("cat", 20.0, None, None), ("a dog", 24.0, str(image), None),
                                           ("a quiet owl", 24.0, None, False)):
        result = worker.run(SamplingParams(prompt=prompt, fps=fps, image_path=image_path, num_inference_steps=2,
                                           sample_audio=audio, **shape), NO_OUTPUT)
        assert result.timings["graphs_compiled"] == 0, (prompt, fps, image_path, audio)
        assert result.has_audio is (audio is None)
    # The image's latent frame made the video's token count dynamic too: a shape never warmed compiles nothing.
    result = worker.run(SamplingParams(prompt="an owl", height=48, width=64, num_frames=9, num_inference_steps=2),
                        NO_OUTPUT)
    assert result.timings["graphs_compiled"] == 0
    torch._dynamo.reset()


def test_a_silent_request_warm_up_also_warms_requests_with_sound(tiny_distill_dir, monkeypatch):
    """--warmup-mode request whose first request is silent: the warm-up ran without a soundtrack, and the first two
    requests with one each compiled a graph (the second one dynamic in the audio length). Two more steps with sound,
    at two soundtrack lengths, compile them in the warm-up. Counted with dynamo's CPU `aot_eager` backend."""

    import torch

    worker = _counted_speed_worker(tiny_distill_dir, monkeypatch)
    shape = dict(height=32, width=48, num_frames=5)
    worker._warmup(SamplingParams(prompt="warm-up", sample_audio=False, **shape))
    for prompt, fps, audio in (("a fox", 24.0, None), ("a fox runs through the deep snow of a pine forest", 20.0, None),
                               ("cat", 30.0, None), ("a quiet owl in the dark", 12.0, False)):
        result = worker.run(SamplingParams(prompt=prompt, fps=fps, num_inference_steps=2, sample_audio=audio, **shape),
                            NO_OUTPUT)
        assert result.timings["graphs_compiled"] == 0, (prompt, fps, audio)
        assert result.has_audio is (audio is None)
    torch._dynamo.reset()


def test_the_silent_step_runs_where_a_request_could_have_sound():
    from types import SimpleNamespace

    from k6serve.request import GenerateRequest
    from k6serve.speed.warmup import warm_other_lengths

    class Pipeline:
        def __init__(self, has_audio):
            self.models, self.calls = SimpleNamespace(has_audio=has_audio), []

        def __call__(self, request, on_step):
            self.calls.append((request.num_inference_steps, request.with_audio))
            on_step(0, 1)
            on_step(1, 1)  # the warm-up stops each pass here, before a decode
            raise AssertionError("not stopped after its step")

    request = GenerateRequest(prompt="p", negative_prompt=None, image_path=None, seed=1, height=32, width=48,
                              num_frames=5, fps=24.0, num_inference_steps=2, guidance_scale=1.0)
    # A silent warm-up on a checkpoint with sound: two steps with sound, at two soundtrack lengths (the first two
    # requests with sound compiled a graph each after it)
    for has_audio, with_audio, expected in ((True, True, [(1, True), (1, False)]), (False, True, [(1, True)]),
                                            (True, False, [(1, False), (1, True), (1, True)]),
                                            (False, False, [(1, False)])):
        pipeline = Pipeline(has_audio)
        warm_other_lengths(pipeline, dataclasses.replace(request, with_audio=with_audio))
        assert pipeline.calls == expected, (has_audio, with_audio)


def test_the_other_lengths_request_changes_the_negative_prompt_and_toggles_the_image():
    from k6serve.request import GenerateRequest
    from k6serve.speed.warmup import other_lengths_request

    request = GenerateRequest(prompt="p", negative_prompt="static", image_path=None, seed=1, height=32, width=48,
                              num_frames=5, fps=240.0, num_inference_steps=2, guidance_scale=5.0)
    other = other_lengths_request(request, "/tmp/image.png")
    assert (other.prompt, other.negative_prompt, other.fps, other.image_path, other.num_inference_steps) == (
        "p p", "static static", 192.0, "/tmp/image.png", 1)
    with_image = other_lengths_request(dataclasses.replace(request, image_path="/x.png", negative_prompt=None), "y")
    assert (with_image.image_path, with_image.negative_prompt, with_image.fps) == (None, None, 192.0)
    assert other_lengths_request(dataclasses.replace(request, prompt="x" * 1000), "y").prompt == "a"


def test_an_eager_warm_up_runs_one_pass(tiny_distill_dir, monkeypatch):
    """The DiT's blocks not compiled (eager modes, the CPU): no second pass, the warm-up is one short request."""
    worker = ModelWorker(build_engine_config(str(tiny_distill_dir), device="cpu"))
    calls = []
    pipeline = worker.pipeline
    monkeypatch.setattr(worker, "pipeline", lambda request, **kwargs: (calls.append(request), pipeline(request,
                                                                                                      **kwargs))[1])
    worker._warmup(SamplingParams(prompt="warm-up", height=32, width=48, num_frames=5))
    assert [request.prompt for request in calls] == ["warm-up"]


def test_gpu_dynamic_dims_script_runs_at_toy_size(tmp_path, load_script):
    """scripts/gpu_dynamic_dims.py on the demo checkpoint (CPU: nothing compiles): its seven requests in the JSON."""
    script = load_script("gpu_dynamic_dims")
    assert script.main(["--tiny", "--out", str(tmp_path), "--steps", "2"]) == 0
    report = json.loads((tmp_path / "dynamic_dims.json").read_text())
    assert [row["request"][:1] for row in report["requests"]] == ["1", "2", "3", "4", "5", "6", "7"]
    assert all(row["step_median_s"] > 0 and row["graphs_compiled"] == 0 for row in report["requests"])


def test_a_failed_request_warm_up_is_logged_and_the_request_runs(tiny_distill_dir, monkeypatch, caplog):
    """--warmup-mode request: a warm-up that failed (say, out of memory while compiling) failed the user's first
    request with an error that did not say it was the warm-up. As the reference's server does, the failure is
    logged and the request runs; the warm-up is not tried again."""
    calls = []

    def failing(pipeline, request, mode, **kwargs):
        calls.append(mode)
        raise RuntimeError("CUDA out of memory (simulated, during warm-up)")

    monkeypatch.setattr(worker_module, "warmup", failing)
    worker = ModelWorker(build_engine_config(str(tiny_distill_dir), device="cpu", warmup_mode="request"))
    params = SamplingParams(prompt="a fox", seed=1, height=32, width=48, num_frames=5)
    no_file = OutputOptions(save_output=False, return_frames=True)
    with caplog.at_level("WARNING", logger="k6serve.runtime.worker"):
        result = worker.run(params, no_file)
    assert result.frames.shape[0] == 5 and "warmup" in result.timings
    assert ("warm-up (request) failed after" in caplog.text
            and "(RuntimeError: CUDA out of memory (simulated, during warm-up)); running the request without it"
            in caplog.text)
    assert "warmup" not in worker.run(params, no_file).timings and calls == ["request"]


def test_a_cancel_during_the_request_warm_up_stops_it_and_the_next_request_warms(tiny_distill_dir):
    """The request's cancellation point reaches its warm-up (a minute of compiling on a GPU went on after a cancel),
    with its progress held at 0; a cancelled warm-up is done again by the next request."""
    from k6serve.runtime.engine import RequestCancelled

    worker = ModelWorker(build_engine_config(str(tiny_distill_dir), device="cpu", warmup_mode="request"))
    params = SamplingParams(prompt="a fox", seed=1, height=32, width=48, num_frames=5, num_inference_steps=3)
    reported = []

    def cancel(step, total):
        reported.append((step, total))
        raise RequestCancelled("request 1 was cancelled at step 0/3")

    runs = []
    pipeline = worker.pipeline
    worker.pipeline = lambda request, **kwargs: runs.append(request.num_inference_steps) or pipeline(request, **kwargs)
    with pytest.raises(RequestCancelled):
        worker.run(params, OutputOptions(save_output=False), on_step=cancel)
    assert runs == [2] and reported == [(0, 3)]  # the warm-up's first step; the request itself never ran
    assert not worker.warmed_up
    result = worker.run(params, OutputOptions(save_output=False, return_frames=True))
    assert runs == [2, 2, 3] and result.timings["warmup"] > 0
