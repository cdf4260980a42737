"""The ComfyUI nodes (integrations/comfyui/k6serve_nodes), imported by path as ComfyUI does, against real servers:
the demo checkpoint for K6Serve Generate, the tiny VSR checkpoint for K6Serve Upscale, the fake worker for the
rest. ComfyUI itself is replaced by stub `comfy.*` / `folder_paths` modules in `sys.modules`."""

from __future__ import annotations

import importlib.util
import inspect
import io
import json
import socket
import subprocess
import sys
import tempfile
import threading
import time
import types
import urllib.error
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from k6serve.engine_arguments import build_engine_config
from k6serve.runtime.engine import Engine

NODES_DIR = Path(__file__).parents[2] / "integrations" / "comfyui" / "k6serve_nodes"
HARNESS = Path(__file__).parents[1] / "server" / "harness.py"
TINY = {"prompt": "A cat plays the piano", "width": 64, "height": 48, "num_frames": 5, "steps": 2,
        "guidance_scale": 0.0, "seed": 7}


def _import_by_path(name: str, path: Path, *, package: bool = False) -> types.ModuleType:
    """What ComfyUI does for custom_nodes/<folder>: spec from <folder>/__init__.py, registered under the name."""
    if name in sys.modules:
        return sys.modules[name]
    locations = [str(path.parent)] if package else None
    spec = importlib.util.spec_from_file_location(name, path, submodule_search_locations=locations)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


nodes_package = _import_by_path("k6serve_nodes", NODES_DIR / "__init__.py", package=True)
harness = _import_by_path("harness", HARNESS)  # the same module tests/server imports as `harness`
K6ServeError = sys.modules["k6serve_nodes.client"].K6ServeError
Generate = nodes_package.NODE_CLASS_MAPPINGS["K6ServeGenerate"]
Upscale = nodes_package.NODE_CLASS_MAPPINGS["K6ServeUpscale"]


class InterruptProcessingException(Exception):
    """Stands in for comfy.model_management.InterruptProcessingException."""


class ComfyStub:
    """Stub ComfyUI modules: a progress bar that records, an interrupt flag, an output folder."""

    def __init__(self, output_dir: Path) -> None:
        self.output_dir = output_dir
        self.progress: list[int] = []
        self.interrupt_when_running = False
        self.interrupted = threading.Event()

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        stub = self

        class ProgressBar:
            def __init__(self, total: int) -> None:
                assert total == 100

            def update_absolute(self, value: int, total: int | None = None) -> None:
                stub.progress.append(value)

        def throw_exception_if_processing_interrupted() -> None:
            if stub.interrupt_when_running and any(value > 0 for value in stub.progress):
                stub.interrupted.set()
                raise InterruptProcessingException()

        comfy = types.ModuleType("comfy")
        utils = types.ModuleType("comfy.utils")
        utils.ProgressBar = ProgressBar
        model_management = types.ModuleType("comfy.model_management")
        model_management.throw_exception_if_processing_interrupted = throw_exception_if_processing_interrupted
        model_management.InterruptProcessingException = InterruptProcessingException
        comfy.utils, comfy.model_management = utils, model_management
        folder_paths = types.ModuleType("folder_paths")
        folder_paths.get_output_directory = lambda: str(stub.output_dir)
        for name, module in (("comfy", comfy), ("comfy.utils", utils), ("comfy.model_management", model_management),
                             ("folder_paths", folder_paths)):
            monkeypatch.setitem(sys.modules, name, module)


@pytest.fixture
def comfy(monkeypatch, tmp_path) -> ComfyStub:
    stub = ComfyStub(tmp_path / "comfy_output")
    stub.install(monkeypatch)
    return stub


@pytest.fixture(scope="module")
def generation_server(_demo_cache_dir, tmp_path_factory):
    from k6serve.testing.tiny_checkpoints import ensure_demo_checkpoint

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("K6SERVE_CACHE", str(_demo_cache_dir))
        demo = ensure_demo_checkpoint()
    engine = Engine(build_engine_config(str(demo), device="cpu"))
    server = harness.start_server(tmp_path_factory.mktemp("comfyui_generation"), engine=engine)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def upscale_server(tiny_sr_dir, tmp_path_factory):
    engine = Engine(build_engine_config(str(tiny_sr_dir), device="cpu"))
    server = harness.start_server(tmp_path_factory.mktemp("comfyui_upscale"), engine=engine)
    yield server
    server.stop()


@pytest.fixture
def fake_server(tmp_path):
    server = harness.start_server(tmp_path / "fake", api_key="secret-key")
    yield server
    server.worker.release.set()
    server.stop()


def _outputs(result: dict) -> tuple:
    assert set(result) == {"ui", "result"}
    return result["result"]


def _newest_job(server) -> dict:
    with server.client() as client:
        return client.get("/v1/videos", params={"limit": 1}).json()["data"][0]


def test_the_package_imports_by_folder_without_k6serve_or_heavy_packages():
    # A fresh interpreter where k6serve and the server's packages cannot be imported, as in ComfyUI's env.
    script = f"""
import importlib.abc, importlib.util, json, sys
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] in {{'k6serve', 'fastapi', 'httpx', 'pydantic', 'PIL', 'av', 'requests', 'uvicorn'}}:
            raise ImportError('blocked: ' + name)
sys.meta_path.insert(0, Block())
folder = {str(NODES_DIR)!r}
spec = importlib.util.spec_from_file_location('k6serve_nodes', folder + '/__init__.py',
                                              submodule_search_locations=[folder])
module = importlib.util.module_from_spec(spec)
sys.modules['k6serve_nodes'] = module
spec.loader.exec_module(module)
print(json.dumps([sorted(module.NODE_CLASS_MAPPINGS), sorted(module.NODE_DISPLAY_NAME_MAPPINGS)]))
"""
    completed = subprocess.run([sys.executable, "-c", script], check=False, capture_output=True, text=True,
                               timeout=120, cwd=tempfile.gettempdir())
    assert completed.returncode == 0, completed.stderr
    assert json.loads(completed.stdout) == [["K6ServeGenerate", "K6ServeUpscale"]] * 2


@pytest.mark.parametrize("node", [Generate, Upscale])
def test_node_classes_follow_comfyui_conventions(node):
    inputs = node.INPUT_TYPES()
    assert set(inputs) == {"required", "optional"}
    parameters = list(inspect.signature(getattr(node, node.FUNCTION)).parameters)[1:]  # after self
    assert set(inputs["required"]) | set(inputs["optional"]) == set(parameters)
    for name, (kind, options) in {**inputs["required"], **inputs["optional"]}.items():
        assert isinstance(kind, (str, list)) and isinstance(options, dict), name
        assert options.get("tooltip"), name
    assert node.RETURN_TYPES == ("IMAGE", "AUDIO", "STRING", "FLOAT")
    assert node.RETURN_NAMES == ("frames", "audio", "video_path", "fps")
    assert node.CATEGORY == "k6serve" and node.OUTPUT_NODE
    assert inputs["required"]["seed"][1]["max"] == 2**63 - 1  # the server's seed range
    assert "width first" in Generate.INPUT_TYPES()["required"]["width"][1]["tooltip"]


def test_inputs_added_later_come_last_so_saved_workflows_keep_their_values():
    # ComfyUI saves widget values as a list in input order: an input put before api_key shifted the saved key into
    # it and the filename prefix into api_key. The inputs of the first release keep their places.
    first_release = ["server_url", "prompt", "width", "height", "num_frames", "steps", "guidance_scale", "seed",
                     "negative_prompt", "image", "fps", "loras", "enable_cache_dit", "api_key", "filename_prefix",
                     "timeout_s"]
    inputs = Generate.INPUT_TYPES()
    order = [*inputs["required"], *inputs["optional"]]
    assert order[:len(first_release)] == first_release
    assert order[len(first_release):] == ["expand_prompts", "sample_audio"]
    parameters = list(inspect.signature(Generate.generate).parameters)[1:]
    assert parameters[-2:] == ["expand_prompts", "sample_audio"]


def test_num_frames_widget_stays_within_what_the_server_takes():
    # Before: max 14401 (the server refuses > 509), and "rounded down" where the server makes 20 frames 21.
    from k6serve.models.variants import VARIANTS
    from k6serve.request_resolution import resolve_generate
    from k6serve.request import SamplingParams

    options = Generate.INPUT_TYPES()["required"]["num_frames"][1]
    largest = options["max"]
    assert resolve_generate(SamplingParams(prompt="p", num_frames=largest), VARIANTS["pro-distill"])[0].num_frames \
        == largest
    with pytest.raises(ValueError, match="more than 128 latent frames"):
        resolve_generate(SamplingParams(prompt="p", num_frames=largest + options["step"]), VARIANTS["pro-distill"])
    assert "rounded down" not in options["tooltip"] and "20 -> 21" in options["tooltip"]


def test_fields_leave_zero_to_the_model_default():
    generation_fields = sys.modules["k6serve_nodes.nodes"].generation_fields
    fields = generation_fields(prompt="p", width=768, height=512, num_frames=121, steps=0, guidance_scale=0.0,
                               seed=1, negative_prompt=" ", fps=0.0, loras="", enable_cache_dit="server default")
    assert fields == {"prompt": "p", "size": "768x512", "num_frames": 121, "seed": 1}
    fields = generation_fields(prompt="p", width=64, height=48, num_frames=5, steps=3, guidance_scale=5.0, seed=1,
                               negative_prompt="blurry", fps=12.0, loras='{"style": 0.5}', enable_cache_dit="off")
    assert fields["num_inference_steps"] == 3 and fields["guidance_scale"] == 5.0 and fields["fps"] == 12.0
    assert fields["loras"] == {"style": 0.5} and fields["enable_cache_dit"] is False
    assert "expand_prompts" not in fields and "sample_audio" not in fields
    assert generation_fields(prompt="p", width=64, height=48, num_frames=5, steps=0, guidance_scale=0.0, seed=1,
                             negative_prompt="", fps=0.0, loras="", enable_cache_dit="server default",
                             sample_audio=False)["sample_audio"] is False
    assert generation_fields(prompt="p", width=64, height=48, num_frames=5, steps=0, guidance_scale=0.0, seed=1,
                             negative_prompt="", fps=0.0, loras="", enable_cache_dit="server default",
                             expand_prompts=True)["expand_prompts"] is True
    with pytest.raises(K6ServeError, match="loras must be a JSON object"):
        generation_fields(prompt="p", width=64, height=48, num_frames=5, steps=0, guidance_scale=0.0, seed=1,
                          negative_prompt="", fps=0.0, loras="style", enable_cache_dit="on")
    upscale_fields = sys.modules["k6serve_nodes.nodes"].upscale_fields
    assert upscale_fields(scale="4", seed=3, tiles_batch_size=0, tile_min_overlap=-1.0, target_resolution="",
                          target_resize_mode="fit") == {"sr_resolution_scale": 4.0, "seed": 3}


@pytest.mark.slow
def test_generate_text_to_video_and_audio(generation_server, comfy):
    frames, audio, path, fps = _outputs(Generate().generate(generation_server.base_url, **TINY))
    assert frames.dtype == torch.float32 and frames.shape == (5, 48, 64, 3)
    assert 0.0 <= frames.min() and frames.max() <= 1.0 and frames.std() > 0.01
    assert audio["sample_rate"] == 44100
    waveform = audio["waveform"]
    assert waveform.dtype == torch.float32 and waveform.ndim == 3 and waveform.shape[:2] == (1, 1)
    assert waveform.shape[2] > 0 and torch.isfinite(waveform).all()
    assert fps == 24.0
    assert Path(path).is_file() and Path(path).parent == comfy.output_dir / "k6serve"
    assert comfy.progress[-1] == 100


@pytest.mark.slow
def test_generate_with_expand_prompts_shows_the_rewrite(generation_server, comfy):
    result = Generate().generate(generation_server.base_url, **TINY, expand_prompts=True)
    path, rewrite = result["ui"]["text"]
    assert Path(path).is_file() and rewrite.startswith("expanded prompt: ") and len(rewrite) > 20
    assert _newest_job(generation_server)["expanded_prompt"] == rewrite.removeprefix("expanded prompt: ")


@pytest.mark.slow
def test_generate_with_an_image_uploads_it_as_input_reference(generation_server, comfy, monkeypatch):
    received = []
    submit = generation_server.engine.submit

    def recording_submit(params, *args, **kwargs):
        received.append(Path(params.image_path).read_bytes() if params.image_path else None)
        return submit(params, *args, **kwargs)

    monkeypatch.setattr(generation_server.engine, "submit", recording_submit)
    image = torch.linspace(0, 1, 40 * 56 * 3).reshape(1, 40, 56, 3)
    frames, _, path, _ = _outputs(Generate().generate(generation_server.base_url, **TINY, image=image))
    assert frames.shape == (5, 48, 64, 3) and Path(path).is_file()
    assert len(received) == 1 and received[0] is not None
    uploaded = np.asarray(Image.open(io.BytesIO(received[0])))
    assert np.array_equal(uploaded, (image[0] * 255).round().to(torch.uint8).numpy())


@pytest.mark.slow
def test_interrupt_during_polling_cancels_the_job_on_the_server(generation_server, comfy):
    comfy.interrupt_when_running = True
    with pytest.raises(InterruptProcessingException):
        Generate().generate(generation_server.base_url, **{**TINY, "steps": 1000})
    assert comfy.interrupted.is_set()
    job = _newest_job(generation_server)
    if job["status"] == "in_progress":  # the cancel waited 10 s for a step boundary: let it arrive
        with generation_server.client() as client:
            job = harness.wait_for(client, job["id"], timeout=60)
    assert job["status"] == "cancelled" and 0 < job["progress"] < 100


@pytest.mark.slow
def test_server_errors_name_the_node_the_input_and_the_fix(generation_server, comfy):
    with pytest.raises(K6ServeError) as refused:
        Generate().generate(generation_server.base_url, **{**TINY, "guidance_scale": 2.0})
    message = str(refused.value)
    assert message.startswith("K6Serve Generate: the server refused the input 'guidance_scale'")
    assert "requires guidance_scale exactly 1.0" in message
    size_error = r"refused the input 'width/height'.*width must be a positive multiple of 16"
    with pytest.raises(K6ServeError, match=size_error):
        Generate().generate(generation_server.base_url, **{**TINY, "width": 72})
    with pytest.raises(K6ServeError, match="serves .*generation.*Use K6Serve Generate"):
        Upscale().upscale(generation_server.base_url, video_path=__file__, scale="2", seed=1)


def test_connection_refused_says_to_start_the_server(comfy):
    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    with pytest.raises(K6ServeError) as refused:
        Generate().generate(url, **TINY)
    message = str(refused.value)
    assert f"no k6serve server is listening at {url} (connection refused)" in message
    assert f"k6serve serve --model-path <checkpoint> --port {port}" in message


def test_api_key_from_the_environment_and_a_silent_video(fake_server, monkeypatch, tmp_path):
    # No ComfyUI stubs: the MP4 goes to the temp folder. The fake worker writes a 16x16 video without audio.
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.delenv("K6SERVE_API_KEY", raising=False)
    with pytest.raises(K6ServeError, match="needs an API key.*K6SERVE_API_KEY"):
        Generate().generate(fake_server.base_url, **TINY)
    monkeypatch.setenv("K6SERVE_API_KEY", "secret-key")
    frames, audio, path, fps = _outputs(Generate().generate(fake_server.base_url, **TINY))
    assert frames.shape == (5, 16, 16, 3) and fps == 24.0
    assert Path(path).parent == tmp_path / "k6serve_comfyui" / "k6serve"
    assert audio["sample_rate"] == 44100 and audio["waveform"].shape == (1, 1, round(5 / 24 * 44100))
    assert not audio["waveform"].any()


def test_timeout_cancels_the_job(fake_server, comfy):
    started = time.monotonic()
    with pytest.raises(K6ServeError, match="did not finish within timeout_s=1 s.*asked the server to cancel it"):
        Generate().generate(fake_server.base_url, **{**TINY, "prompt": "hold"}, api_key="secret-key", timeout_s=1)
    assert time.monotonic() - started < 10
    assert _newest_job(fake_server)["status"] == "cancelled"


def test_a_failed_job_raises_its_error(fake_server, comfy):
    with pytest.raises(K6ServeError, match=r"failed on the server \(generation_failed\).*fake worker failure"):
        Generate().generate(fake_server.base_url, **{**TINY, "prompt": "fail"}, api_key="secret-key")


def test_filename_prefix_stays_inside_the_output_folder(fake_server, comfy):
    with pytest.raises(K6ServeError, match="points outside the output folder"):
        Generate().generate(fake_server.base_url, **TINY, api_key="secret-key", filename_prefix="../../escape")
    with fake_server.client() as client:
        assert client.get("/v1/videos").json()["data"] == []  # refused before any job was created


@pytest.mark.slow
def test_upscale_a_file_and_connected_frames(upscale_server, comfy, tmp_path):
    from k6serve.testing.clips import make_clip

    clip = make_clip(tmp_path / "source.mp4", width=32, height=32, num_frames=9, fps=24, audio="mono_tone")
    frames, audio, path, fps = _outputs(Upscale().upscale(upscale_server.base_url, video_path=str(clip), scale="2",
                                                          seed=1, tiles_batch_size=4))
    assert frames.dtype == torch.float32 and frames.shape == (9, 64, 64, 3) and fps == 24.0
    assert 0.0 <= frames.min() and frames.max() <= 1.0
    assert audio["sample_rate"] == 44100 and audio["waveform"].abs().max() > 0.01  # the source's tone
    assert Path(path).is_file() and comfy.progress[-1] == 100
    # The decoded source fed back as IMAGE + AUDIO: encoded, uploaded, upscaled.
    source = sys.modules["k6serve_nodes.media"].decode_video(clip)
    again, again_audio, _, _ = _outputs(Upscale().upscale(
        upscale_server.base_url, video_path="", scale="2", seed=1, frames=source.frames, audio=source.audio,
        tiles_batch_size=4))
    assert again.shape == (9, 64, 64, 3) and again_audio["waveform"].abs().max() > 0.01
    with pytest.raises(K6ServeError, match="both frames and video_path"):
        Upscale().upscale(upscale_server.base_url, video_path=str(clip), scale="2", seed=1, frames=source.frames)
    with pytest.raises(K6ServeError, match="serves .*super_resolution.*Use K6Serve Upscale"):
        Generate().generate(upscale_server.base_url, **TINY)


def test_upscale_is_changed_follows_the_file(tmp_path, monkeypatch):
    clip = tmp_path / "clip.mp4"
    clip.write_bytes(b"one")
    first = Upscale.IS_CHANGED(video_path=str(clip), scale="2")
    clip.write_bytes(b"three")
    assert Upscale.IS_CHANGED(video_path=str(clip), scale="2") != first
    assert Upscale.IS_CHANGED(video_path="") == ""
    # Before: "~/clip.mp4" was not expanded (the upload expands it), so a changed file kept the cached result.
    monkeypatch.setenv("HOME", str(tmp_path))
    first = Upscale.IS_CHANGED(video_path="~/clip.mp4", scale="2")
    clip.write_bytes(b"three more")
    assert first and Upscale.IS_CHANGED(video_path="~/clip.mp4", scale="2") != first


@pytest.mark.parametrize("node", [Generate, Upscale])
def test_the_doc_lists_every_input_of_each_node(node):
    doc = (Path(__file__).parents[2] / "docs" / "comfyui.md").read_text()
    title = "## K6Serve Generate" if node is Generate else "## K6Serve Upscale"
    table = doc.split(title, 1)[1].split("\n## ", 1)[0]
    inputs = node.INPUT_TYPES()
    for name in [*inputs["required"], *inputs["optional"]]:
        assert f"`{name}`" in table, f"docs/comfyui.md {title[3:]} does not list `{name}`"


def test_png_encoder_round_trips():
    pixels = np.random.default_rng(0).integers(0, 256, (7, 5, 3), dtype=np.uint8)
    png = sys.modules["k6serve_nodes.media"].encode_png(pixels)
    assert np.array_equal(np.asarray(Image.open(io.BytesIO(png))), pixels)


@pytest.mark.parametrize(("channels", "kept"), [(1, 1), (2, 2), (6, 6), (8, 8), (10, 1)])
def test_frames_with_surround_sound_upload_every_channel(tmp_path, channels, kept):
    """A 5.1 AUDIO input kept its first two channels only: the centre, where a film's dialogue is, was dropped
    before the server's downmix to mono. Every channel goes now (in FFmpeg's layout for its count); more than 8
    have no layout and go as their mono average."""
    media = sys.modules["k6serve_nodes.media"]
    waveform = torch.zeros(1, channels, 44100)
    centre = min(2, channels - 1)
    waveform[0, centre] = 0.5 * torch.sin(torch.arange(44100) * 2 * np.pi * 440 / 44100)
    path = media.encode_video(tmp_path / "up.mp4", torch.rand(9, 32, 32, 3), 24.0,
                              {"waveform": waveform, "sample_rate": 44100})
    decoded = media.decode_video(path).audio["waveform"][0]
    assert decoded.shape[0] == kept
    level = 0.5 / channels if kept == 1 else 0.5
    assert abs(float(decoded[min(centre, kept - 1), 4000:40000].abs().max()) - level) < 0.05 * level + 0.005


@pytest.fixture
def other_web_server():
    """A web server that is not k6serve; `answers[path]` is (status, content type, body)."""
    import http.server

    answers: dict[str, tuple[int, str, bytes]] = {}

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            status, content_type, body = answers.get(self.path, (404, "text/html", b"<h1>Not Found</h1>"))
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        do_POST = do_GET

        def log_message(self, *args) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}", answers
    server.shutdown()
    server.server_close()


def test_a_server_url_that_is_not_k6serve_says_so(other_web_server, comfy):
    # Before: a raw JSONDecodeError / IndexError, or "serves 'gpt-4' (None) ... Use K6Serve Upscale with it".
    url, answers = other_web_server
    not_k6serve = "is not a k6serve server.*without a path such as /v1"
    with pytest.raises(K6ServeError, match=not_k6serve):  # 404: ComfyUI's own port, say
        Generate().generate(url, **TINY)
    for body in ({"object": "list", "data": []}, {"data": [{"id": "gpt-4", "object": "model"}]}):
        answers["/v1/models"] = (200, "application/json", json.dumps(body).encode())
        with pytest.raises(K6ServeError, match=not_k6serve):
            Upscale().upscale(url, video_path=__file__, scale="2", seed=1)
    answers["/v1/models"] = (200, "text/html", b"<html>a web page</html>")
    with pytest.raises(K6ServeError, match="answered with something other than JSON.*server_url"):
        Generate().generate(url, **TINY)


def test_a_missing_pyav_is_refused_before_the_job(fake_server, comfy, monkeypatch):
    # Before: the job ran (minutes on a GPU) and only the decode of its MP4 said PyAV is missing.
    monkeypatch.setitem(sys.modules, "av", None)  # `import av` raises ImportError
    with pytest.raises(ImportError, match=r"need PyAV .*pip install av"):
        Generate().generate(fake_server.base_url, **TINY, api_key="secret-key")
    with fake_server.client() as client:
        assert client.get("/v1/videos").json()["data"] == []


def test_cancel_is_heard_while_the_server_is_unreachable(monkeypatch):
    # Before: a poll that could not reach the server retried for 30 s without looking at ComfyUI's Cancel.
    client_module = sys.modules["k6serve_nodes.client"]
    client = client_module.K6ServeClient("http://127.0.0.1:9", node_name="K6Serve Generate")
    unreachable = client._connection_error(urllib.error.URLError(ConnectionRefusedError()))
    unreachable.__cause__ = urllib.error.URLError(ConnectionRefusedError())
    checks = []

    def get_job(job_id):
        raise unreachable

    cancelled = []
    monkeypatch.setattr(client, "get_job", get_job)
    monkeypatch.setattr(client, "cancel_job", lambda job_id: cancelled.append(job_id) or {"status": "cancelled"})
    real_sleep = time.sleep
    monkeypatch.setattr(client_module.time, "sleep", lambda seconds: real_sleep(0.01))
    monkeypatch.setattr(client_module, "POLL_OUTAGE_S", 3.0)  # before the fix: gave up after it, not at Cancel

    def check_interrupt():
        checks.append(time.monotonic())
        if len(checks) > 2:
            raise InterruptProcessingException()

    started = time.monotonic()
    with pytest.raises(InterruptProcessingException):
        client.wait({"id": "video_1", "status": "in_progress", "progress": 5}, check_interrupt=check_interrupt)
    assert time.monotonic() - started < 2 and cancelled == ["video_1"]


def test_timeout_is_heard_while_the_server_is_unreachable(monkeypatch):
    """timeout_s was not looked at while a poll rode out an outage (up to 30 s past it); now it ends the wait, and
    the message promises only that the node asked for the cancel."""
    client_module = sys.modules["k6serve_nodes.client"]
    client = client_module.K6ServeClient("http://127.0.0.1:9", node_name="K6Serve Generate")
    unreachable = client._connection_error(urllib.error.URLError(ConnectionRefusedError()))
    unreachable.__cause__ = urllib.error.URLError(ConnectionRefusedError())
    calls = []
    started = time.monotonic()

    def get_job(job_id):
        calls.append(job_id)
        raise unreachable

    cancelled = []
    monkeypatch.setattr(client, "get_job", get_job)
    monkeypatch.setattr(client, "cancel_job", lambda job_id: cancelled.append(job_id) or {"status": "cancelled"})
    real_sleep = time.sleep
    monkeypatch.setattr(client_module.time, "sleep", lambda seconds: real_sleep(min(seconds, 0.05)))
    with pytest.raises(K6ServeError, match=r"did not finish within timeout_s=0.3 s \(last seen in_progress, "
                                           r"progress 5%\); the node asked the server to cancel it"):
        client.wait({"id": "video_1", "status": "in_progress", "progress": 5}, timeout_s=0.3)
    assert time.monotonic() - started < 2 and len(calls) > 1 and cancelled == ["video_1"]


def _cancel_scenario(monkeypatch, answers):
    """A client (interrupted before its first poll) whose cancel attempts meet `answers` in turn: an exception the
    cancel raises, or the cancel route's answer; returns the client and the list of attempts. No GET goes first: the
    cancel route decides on the server whether the job still runs."""
    client_module = sys.modules["k6serve_nodes.client"]
    client = client_module.K6ServeClient("http://127.0.0.1:9", node_name="K6Serve Generate")
    unreachable = client._connection_error(urllib.error.URLError(ConnectionRefusedError()))
    unreachable.__cause__ = urllib.error.URLError(ConnectionRefusedError())
    attempts = []

    def cancel_job(job_id):
        attempts.append(job_id)
        answer = answers[min(len(attempts), len(answers)) - 1]
        if answer == "unreachable":
            raise unreachable
        if isinstance(answer, Exception):
            raise answer
        return answer

    monkeypatch.setattr(client, "get_job", lambda job_id: pytest.fail("the cancel needs no GET"))
    monkeypatch.setattr(client, "cancel_job", cancel_job)
    monkeypatch.setattr(client_module, "CANCEL_RETRY_S", 0.01)
    return client, attempts


def _interrupt_after(count):
    checks = []

    def check_interrupt():
        checks.append(1)
        if len(checks) > count:
            raise InterruptProcessingException()

    return check_interrupt


def test_a_cancel_lost_with_the_server_is_retried_until_it_answers(monkeypatch, caplog):
    """The cancel was tried once: lost while the server restarted, the job was requeued from SQLite and ran again.
    Now it is retried beside ComfyUI, which gets the interrupt at once."""
    caplog.set_level("INFO")
    client, attempts = _cancel_scenario(monkeypatch, ["unreachable", "unreachable", {"status": "cancelled"}])
    started = time.monotonic()
    with pytest.raises(InterruptProcessingException):
        client.wait({"id": "video_1", "status": "in_progress", "progress": 5}, check_interrupt=_interrupt_after(0))
    assert time.monotonic() - started < 1 and attempts == ["video_1"]  # the node did not wait for the retries
    client.cancel_retry.join(timeout=10)
    assert attempts == ["video_1"] * 3
    assert "cancelled job video_1 on the server once it answered again" in caplog.text


def test_a_cancel_waits_out_a_restarted_server_loading_its_model(monkeypatch, caplog):
    caplog.set_level("INFO")
    client_module = sys.modules["k6serve_nodes.client"]
    loading = client_module.K6ServeError("loading", status=503, code="model_loading")
    answers = ["unreachable", "unreachable"] + [loading] * 30 + [{"status": "cancelled"}]
    client, attempts = _cancel_scenario(monkeypatch, answers)
    monkeypatch.setattr(client_module, "POLL_OUTAGE_S", 0.05)  # far shorter than the 30 loading answers
    with pytest.raises(InterruptProcessingException):
        client.wait({"id": "video_1", "status": "in_progress", "progress": 5}, check_interrupt=_interrupt_after(0))
    client.cancel_retry.join(timeout=10)
    assert len(attempts) == len(answers) and "once it answered again" in caplog.text


def test_a_cancel_the_server_refuses_is_not_retried_and_an_outage_is_given_up(monkeypatch, caplog):
    caplog.set_level("INFO")
    client_module = sys.modules["k6serve_nodes.client"]
    client, attempts = _cancel_scenario(monkeypatch, [client_module.K6ServeError("broken", status=500)])
    with pytest.raises(InterruptProcessingException):
        client.wait({"id": "video_1", "status": "in_progress", "progress": 5}, check_interrupt=_interrupt_after(0))
    assert client.cancel_retry is None and attempts == ["video_1"] and "could not cancel job video_1" in caplog.text
    caplog.clear()
    client, attempts = _cancel_scenario(monkeypatch, ["unreachable"])
    monkeypatch.setattr(client_module, "POLL_OUTAGE_S", 0.2)
    with pytest.raises(InterruptProcessingException):
        client.wait({"id": "video_2", "status": "in_progress", "progress": 5}, check_interrupt=_interrupt_after(0))
    client.cancel_retry.join(timeout=10)
    assert not client.cancel_retry.is_alive() and len(attempts) > 2
    assert "gave up cancelling job video_2" in caplog.text
    assert "POST /v1/videos/video_2/cancel cancels it" in caplog.text


@pytest.fixture
def loading_server():
    """`k6serve serve`'s answers while its model loads (the real responder, on a listening socket)."""
    import socket

    from k6serve.serve.loading import LoadingResponder

    sock = socket.create_server(("127.0.0.1", 0))
    responder = LoadingResponder(sock)
    responder.start()
    yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    responder.stop()
    sock.close()


def test_a_server_still_loading_is_waited_for_within_timeout_s(loading_server, comfy, monkeypatch):
    # Before: the node failed at once with "GET .../v1/models answered HTTP 503, model_loading: ...".
    monkeypatch.setattr(sys.modules["k6serve_nodes.client"], "LOADING_POLL_S", 0.05)
    started = time.monotonic()
    with pytest.raises(K6ServeError, match=r"K6Serve Generate: the server at http://127\.0\.0\.1:\d+ was still loading "
                                           r"its model after 1 s\. Raise timeout_s, or set it to 0") as raised:
        Generate().generate(loading_server, **TINY, timeout_s=1)
    assert 1 <= time.monotonic() - started < 5 and raised.value.code == "model_loading"


def test_cancel_is_heard_while_the_server_loads(loading_server, monkeypatch):
    client_module = sys.modules["k6serve_nodes.client"]
    monkeypatch.setattr(client_module, "LOADING_POLL_S", 0.05)
    client = client_module.K6ServeClient(loading_server, node_name="K6Serve Upscale")
    checks = []

    def check_interrupt():
        checks.append(1)
        if len(checks) == 3:
            raise InterruptProcessingException()

    with pytest.raises(InterruptProcessingException):
        client.served_model(check_interrupt=check_interrupt)
    assert len(checks) == 3


def test_the_job_runs_once_the_server_has_loaded(fake_server, comfy, monkeypatch):
    client_module = sys.modules["k6serve_nodes.client"]
    monkeypatch.setattr(client_module, "LOADING_POLL_S", 0.01)
    real_json = client_module.K6ServeClient._json
    loading = [2]  # GET /v1/models answers "loading" twice, then the server serves

    def json_while_loading(self, method, route, **kwargs):
        if route == "/v1/models" and loading[0]:
            loading[0] -= 1
            raise client_module.K6ServeError("loading", status=503, code="model_loading")
        return real_json(self, method, route, **kwargs)

    monkeypatch.setattr(client_module.K6ServeClient, "_json", json_while_loading)
    result = Generate().generate(fake_server.base_url, **TINY, api_key="secret-key")
    assert loading == [0] and Path(result["result"][2]).is_file()


def test_an_answer_cut_off_after_its_headers_counts_as_unreachable():
    """A reset or a short body after the headers raised http.client.IncompleteRead from the node (a traceback, and
    a lost cancel's retry thread died with it); now it is the server being unreachable, like a refused connection."""
    client_module = sys.modules["k6serve_nodes.client"]
    server = socket.create_server(("127.0.0.1", 0))

    def answer_half():
        connection, _ = server.accept()
        connection.recv(65536)
        connection.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"st")
        connection.close()

    thread = threading.Thread(target=answer_half, daemon=True)
    thread.start()
    client = client_module.K6ServeClient(f"http://127.0.0.1:{server.getsockname()[1]}", node_name="K6Serve Generate")
    try:
        with pytest.raises(K6ServeError, match="cannot reach the server") as raised:
            client.get_job("video_1")
    finally:
        thread.join(5)
        server.close()
    assert client_module._unreachable(raised.value)


def test_a_download_cut_off_is_started_again_and_one_that_never_gets_through_says_where_the_video_is(
        tmp_path, monkeypatch):
    """The job was done and its MP4 waited on the server, but a reset mid-download lost it to ComfyUI with a raw
    IncompleteRead. Now the download starts again; given up, the error says where the video still is."""
    client_module = sys.modules["k6serve_nodes.client"]
    server = socket.create_server(("127.0.0.1", 0))
    body = bytes(range(256)) * 64
    answers = ["cut", "whole"]

    def serve():
        for answer in answers:
            connection, _ = server.accept()
            connection.recv(65536)
            head = f"HTTP/1.1 200 OK\r\nContent-Type: video/mp4\r\nContent-Length: {len(body)}\r\n\r\n".encode()
            connection.sendall(head + (body[:1000] if answer == "cut" else body))
            connection.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    monkeypatch.setattr(client_module.time, "sleep", lambda seconds: None)
    client = client_module.K6ServeClient(f"http://127.0.0.1:{server.getsockname()[1]}", node_name="K6Serve Generate")
    target = tmp_path / "out" / "clip.mp4"
    assert client.download_content("video_1", target) == target and target.read_bytes() == body
    thread.join(5)
    assert list(target.parent.iterdir()) == [target]  # no partial file left

    answers[:] = ["cut"] * 3
    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    monkeypatch.setattr(client_module, "POLL_OUTAGE_S", 0.0)  # gives up after the first failure
    with pytest.raises(K6ServeError, match=r"The video of job video_2 is finished and stays on the server until it "
                                           r"expires: GET http://127\.0\.0\.1:\d+/v1/videos/video_2/content"):
        client.download_content("video_2", tmp_path / "out" / "other.mp4")
    server.close()
    assert sorted(p.name for p in target.parent.iterdir()) == ["clip.mp4"]
