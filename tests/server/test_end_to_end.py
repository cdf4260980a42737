"""End to end with the tiny random-weight checkpoints: a real uvicorn server in front of the real engine."""

from __future__ import annotations

import io
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import av
import httpx
import numpy as np
import pytest
from harness import start_server, wait_for
from PIL import Image
from test_lifecycle import run_seed_script

from k6serve.engine_arguments import build_engine_config
from k6serve.runtime.engine import Engine

pytestmark = pytest.mark.slow
REQUEST = {"prompt": "A cat plays the piano", "size": "96x64", "num_frames": 5, "num_inference_steps": 2,
           "seed": 42}


def _decode(data: bytes, tmp_path: Path, name: str) -> tuple[np.ndarray, np.ndarray | None]:
    path = tmp_path / name
    path.write_bytes(data)
    with av.open(str(path)) as container:
        frames = np.stack([f.to_ndarray(format="rgb24") for f in container.decode(video=0)])
    with av.open(str(path)) as container:
        audio = None
        if container.streams.audio:
            audio = np.concatenate([f.to_ndarray().reshape(-1) for f in container.decode(audio=0)])
    return frames, audio


def _png() -> bytes:
    buffer = io.BytesIO()
    gradient = np.linspace(0, 255, 48 * 32 * 3).reshape(32, 48, 3).astype(np.uint8)
    Image.fromarray(gradient).save(buffer, format="PNG")
    return buffer.getvalue()


def _module_server(checkpoint, root):
    """A server over the real engine on `checkpoint`, shared by a module's tests: its worker process starts once
    (about 5 s on 2 cores)."""
    server = start_server(root, engine=Engine(build_engine_config(str(checkpoint), device="cpu")))
    yield server
    server.stop()


@pytest.fixture(scope="module")
def generation_server(server_distill_dir, tmp_path_factory):
    yield from _module_server(server_distill_dir, tmp_path_factory.mktemp("e2e_generation"))


@pytest.fixture(scope="module")
def vsr_server(server_vsr_dir, tmp_path_factory):
    yield from _module_server(server_vsr_dir, tmp_path_factory.mktemp("e2e_vsr"))


def test_t2av_json_and_the_seed_script(generation_server, tmp_path):
    with generation_server.client() as client:
        job = client.post("/v1/videos", json=REQUEST).json()
        done = wait_for(client, job["id"], timeout=120)
        assert done["status"] == "completed", done
        assert done["size"] == "96x64" and done["progress"] == 100 and done["inference_time_s"] > 0
        content = client.get(f"/v1/videos/{job['id']}/content").content
        frames, audio = _decode(content, tmp_path, "t2av.mp4")
        assert frames.shape == (5, 64, 96, 3) and frames.std() > 1
        assert audio is not None and audio.size > 0 and np.isfinite(audio).all()
        assert run_seed_script(generation_server.base_url, job["id"], tmp_path) == content
        repeat = client.post("/v1/videos", json=REQUEST).json()
        assert wait_for(client, repeat["id"], timeout=120)["status"] == "completed"
        assert client.get(f"/v1/videos/{repeat['id']}/content").content == content  # deterministic
        assert client.delete(f"/v1/videos/{job['id']}").json()["deleted"] is True


def test_a_truncated_prompt_is_a_job_warning(generation_server):
    with generation_server.client() as client:
        job = client.post("/v1/videos", json={**REQUEST, "prompt": "A cat plays piano. " * 110}).json()
        done = wait_for(client, job["id"], timeout=120)
        assert done["status"] == "completed", done
        assert any("kept its first 1024 of 1100 tokens" in warning for warning in done["warnings"]), done


def test_expand_prompts_over_json_and_form_reports_the_rewrite(generation_server):
    with generation_server.client() as client:
        plain = client.post("/v1/videos", json=REQUEST).json()
        created = client.post("/v1/videos", json={**REQUEST, "expand_prompts": True})
        assert created.status_code == 200, created.text
        assert created.json()["expanded_prompt"] is None  # known once the job has run
        form = client.post("/v1/videos", data={**{k: str(v) for k, v in REQUEST.items()}, "expand_prompts": "true"},
                           files={"input_reference": ("first.png", _png(), "image/png")})
        assert form.status_code == 200, form.text
        done = [wait_for(client, job["id"], timeout=120) for job in (plain, created.json(), form.json())]
        assert [job["status"] for job in done] == ["completed"] * 3, done
        assert done[0]["expanded_prompt"] is None and done[0]["prompt"] == REQUEST["prompt"]
        # The tiny random Qwen2.5-VL writes noise, but it is the rewrite: not the prompt, and the same each time.
        assert done[1]["expanded_prompt"] and done[1]["expanded_prompt"] != REQUEST["prompt"]
        assert done[1]["prompt"] == REQUEST["prompt"]  # the prompt as sent stays
        assert done[2]["expanded_prompt"] and done[2]["expanded_prompt"] != done[1]["expanded_prompt"]  # the image
        assert client.get(f"/v1/videos/{done[1]['id']}").json()["expanded_prompt"] == done[1]["expanded_prompt"]
        refused = client.post("/v1/videos", json={**REQUEST, "expand_prompts": "yes"})
        assert refused.status_code == 400 and "expand_prompts" in refused.text


def test_ti2av_multipart_upload(generation_server, tmp_path):
    with generation_server.client() as client:
        form = {k: str(v) for k, v in REQUEST.items()}
        conditioned = client.post("/v1/videos", data=form,
                                  files={"input_reference": ("first.png", _png(), "image/png")})
        assert conditioned.status_code == 200, conditioned.text
        plain = client.post("/v1/videos", json=REQUEST).json()
        assert wait_for(client, conditioned.json()["id"], timeout=120)["status"] == "completed"
        assert wait_for(client, plain["id"], timeout=120)["status"] == "completed"
        with_image = client.get(f"/v1/videos/{conditioned.json()['id']}/content").content
        frames, _ = _decode(with_image, tmp_path, "ti2av.mp4")
        assert frames.shape == (5, 64, 96, 3)
        assert with_image != client.get(f"/v1/videos/{plain['id']}/content").content
        # The completed job keeps its uploaded image (one file of this upload's id), so a remix runs with it: the
        # same prompt remixed is the same video, byte for byte, from the remix's own copy of the image.
        kept = sorted(generation_server.artifacts.upload_dir.glob(f"{conditioned.json()['id']}_*"))
        assert [path.name for path in kept] == [f"{conditioned.json()['id']}_input_reference.png"]
        remix = client.post(f"/v1/videos/{conditioned.json()['id']}/remix", json={"prompt": REQUEST["prompt"]})
        assert remix.status_code == 200, remix.text
        assert client.delete(f"/v1/videos/{conditioned.json()['id']}").status_code == 200  # the source's goes
        assert not kept[0].exists()
        assert wait_for(client, remix.json()["id"], timeout=120)["status"] == "completed"
        assert client.get(f"/v1/videos/{remix.json()['id']}/content").content == with_image
        assert client.delete(f"/v1/videos/{remix.json()['id']}").status_code == 200
        assert not list(generation_server.artifacts.upload_dir.glob(f"{remix.json()['id']}_*"))


def test_cancel_a_running_generation(generation_server):
    with generation_server.client() as client:
        long = client.post("/v1/videos", json={**REQUEST, "num_inference_steps": 1000}).json()
        deadline = time.monotonic() + 60
        while client.get(f"/v1/videos/{long['id']}").json()["progress"] == 0:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        after = client.post("/v1/videos", json=REQUEST).json()
        cancelled = client.post(f"/v1/videos/{long['id']}/cancel").json()
        assert cancelled["status"] == "cancelled" and 0 < cancelled["progress"] < 100
        assert wait_for(client, after["id"], timeout=120)["status"] == "completed"


def test_vsr_upload_and_video_path_are_bit_identical(vsr_server, tmp_path):
    from k6serve.testing.clips import make_clip

    server = vsr_server
    # 80x32 at x2: two 128x64 output tiles, blended.
    clip = make_clip(server.settings.allowed_input_dirs[0] / "source.mp4", width=80, height=32, num_frames=9,
                     fps=24, audio="mono_tone")
    fields = {"sr_resolution_scale": 2, "sr_tiles_batch_size": 1, "num_inference_steps": 2, "seed": 42}
    with server.client() as client:
        by_path = client.post("/v1/videos", json={"video_path": str(clip), **fields}).json()
        uploaded = client.post("/v1/videos", data={k: str(v) for k, v in fields.items()},
                               files={"video_reference": ("source.mp4", clip.read_bytes(), "video/mp4")})
        assert uploaded.status_code == 200, uploaded.text
        for job_id in (by_path["id"], uploaded.json()["id"]):
            done = wait_for(client, job_id, timeout=300)
            assert done["status"] == "completed", done
        first = client.get(f"/v1/videos/{by_path['id']}/content").content
        assert client.get(f"/v1/videos/{uploaded.json()['id']}/content").content == first
        frames, audio = _decode(first, tmp_path, "sr.mp4")
        assert frames.shape == (9, 64, 160, 3) and frames.std() > 1
        assert audio is not None and np.sqrt(np.mean(audio**2)) > 1e-5
        assert client.get(f"/v1/videos/{by_path['id']}").json()["size"] == "160x64"
        assert client.get(f"/v1/videos/{by_path['id']}").json()["sample_aspect_ratio"] is None  # square pixels


def test_an_anamorphic_upscale_job_reports_its_sample_aspect_ratio(vsr_server):
    # The MP4 keeps a source's non-square pixels (players show its shape) while `size` is the stored frames': the
    # job said so only in a warning's text, which a client cannot read the display shape from.
    from fractions import Fraction

    from k6serve.testing.clips import make_clip

    clip = make_clip(vsr_server.settings.allowed_input_dirs[0] / "anamorphic.mp4", width=64, height=32,
                     num_frames=9, fps=24, sample_aspect_ratio=Fraction(4, 3))
    with vsr_server.client() as client:
        created = client.post("/v1/videos", json={"video_path": str(clip), "sr_resolution_scale": 2,
                                                  "num_inference_steps": 2, "seed": 42}).json()
        assert created["sample_aspect_ratio"] is None  # known once the job has run
        done = wait_for(client, created["id"], timeout=300)
    assert done["status"] == "completed", done
    assert (done["size"], done["sample_aspect_ratio"]) == ("128x64", "4:3")
    assert any(warning.startswith("the output keeps the source's sample aspect ratio 4:3") for warning in
               done["warnings"])


def test_an_upscale_job_reports_its_output_size_and_seconds_from_creation(vsr_server, tmp_path):
    """The size and seconds of a job just created are the finished job's and its MP4's: a portrait phone clip (a
    display rotation) at the default x2.25, and a 30 fps Matroska clip (subsampled; no stated frame count) at x2."""
    from k6serve.testing.clips import make_clip

    server = vsr_server
    inputs = server.settings.allowed_input_dirs[0]
    cases = [
        # 24x64 upright (WxH), x1.125 -> 32x64 (27 rounds up to 32, 72 = 4.5 cells rounds half-to-even to 64), x2;
        # one 64x128 output tile. 9 frames at 24 fps.
        (make_clip(inputs / "portrait.mp4", width=64, height=24, num_frames=9, fps=24, rotation=90,
                   audio="mono_tone"), {}, ("64x128", "0.375")),
        # 14 frames at 30 fps -> 11 at 24 fps -> 9 (1 + 8k, the last 2 dropped); x2 on two 128x64 output tiles.
        (make_clip(inputs / "thirty.mkv", width=80, height=32, num_frames=14, fps=30), {"sr_resolution_scale": 2},
         ("160x64", "0.375")),
    ]
    fields = {"sr_tiles_batch_size": 1, "seed": 42}
    with server.client() as client:
        for clip, scale, expected in cases:
            created = client.post("/v1/videos", json={"video_path": str(clip), **fields, **scale}).json()
            assert (created["size"], created["seconds"]) == expected, created
            done = wait_for(client, created["id"], timeout=300)
            assert done["status"] == "completed", done
            assert (done["size"], done["seconds"]) == expected
            output = tmp_path / f"{clip.stem}_upscaled.mp4"
            output.write_bytes(client.get(f"/v1/videos/{created['id']}/content").content)
            with av.open(str(output)) as container:
                stream = container.streams.video[0]
                num_frames = sum(1 for _ in container.decode(stream))
                made = (f"{stream.codec_context.width}x{stream.codec_context.height}",
                        f"{num_frames / float(stream.average_rate):g}")
            assert made == expected


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_k6serve_serve_command(server_distill_dir, tmp_path):
    port = _free_port()
    # The checkout first, the caller's PYTHONPATH kept: on the GPU host it holds the carried fastapi and PyAV.
    env = {**os.environ, "K6SERVE_API_KEY": "cli-key", "PYTHONPATH": os.pathsep.join(
        filter(None, [str(Path(__file__).resolve().parents[2]), os.environ.get("PYTHONPATH")]))}
    process = subprocess.Popen(
        [sys.executable, "-m", "k6serve.cli.main", "serve", "--model-path", str(server_distill_dir), "--device", "cpu",
         "--host", "127.0.0.1", "--port", str(port), "--output-path", str(tmp_path / "out"),
         "--max-queued-jobs", "4"], cwd=tmp_path, env=env)
    headers = {"Authorization": "Bearer cli-key"}
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30, headers=headers) as client:
            deadline = time.monotonic() + 120
            while True:
                try:
                    if client.get("/health").status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                assert process.poll() is None and time.monotonic() < deadline, "k6serve serve did not start"
                time.sleep(0.2)
            assert client.get("/v1/models", headers={"Authorization": ""}).status_code == 401
            # The command runs the JSON-error h11 protocol too (an unparsable request never reaches the app).
            with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
                sock.sendall(b"POST /v1/videos HTTP/1.1\r\nHost: localhost\r\nContent-Length: abc\r\n\r\n")
                raw = b""
                while chunk := sock.recv(65536):
                    raw += chunk
            assert raw.startswith(b"HTTP/1.1 400 ") and b'"code":"invalid_request"' in raw, raw
            job = client.post("/v1/videos", json=REQUEST).json()
            assert wait_for(client, job["id"], timeout=120)["status"] == "completed"
            assert (tmp_path / "out" / f"{job['id']}.mp4").is_file()
            assert (tmp_path / "out" / "jobs.sqlite3").is_file()
        process.send_signal(signal.SIGINT)
        assert process.wait(60) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(10)


def test_cache_dit_through_the_worker_process(generation_server):
    """A job with Cache-DiT runs through the engine's worker process, says in its warnings which steps were cached
    (and that a distilled checkpoint is not what caching is for), and differs from the uncached job."""
    with generation_server.client() as client:
        cached = client.post("/v1/videos", json={**REQUEST, "num_inference_steps": 4, "cache_dit_params": {
            "max_warmup_steps": 1, "residual_diff_threshold": 1.0}}).json()
        plain = client.post("/v1/videos", json={**REQUEST, "num_inference_steps": 4}).json()
        done = wait_for(client, cached["id"], timeout=120)
        assert done["status"] == "completed", done
        assert any("Cache-DiT skipped the middle 1 of 2 DiT blocks on 3 of 4 calls" in w for w in done["warnings"])
        assert any("distilled checkpoint" in w for w in done["warnings"])
        assert wait_for(client, plain["id"], timeout=120)["status"] == "completed"
        assert client.get(f"/v1/videos/{cached['id']}/content").content != \
            client.get(f"/v1/videos/{plain['id']}/content").content


def test_a_port_in_use_or_a_bad_host_fails_before_the_model_loads(tmp_path, monkeypatch):
    from k6serve.serve import server_process

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        with pytest.raises(ValueError, match=f"port {port} on 127.0.0.1 is already in use; pass another --port"):
            server_process.listening_socket("127.0.0.1", port)
        # Through the CLI: exit 2 with the fix, and no Engine (the model load) was ever built.
        monkeypatch.setattr(server_process, "Engine", lambda config: pytest.fail("the model loaded"))
        from k6serve.cli.main import main

        code = main(["serve", "--model-path", "demo", "--device", "cpu", "--host", "127.0.0.1", "--port", str(port),
                     "--output-path", str(tmp_path / "out")])
        assert code == 2
    with pytest.raises(ValueError, match="--host 'no-such-host.invalid' does not resolve"):
        server_process.listening_socket("no-such-host.invalid", 0)
    with pytest.raises(ValueError, match="cannot listen on 192.0.2.1:0 .*pass an address of this machine"):
        server_process.listening_socket("192.0.2.1", 0)  # TEST-NET-1: never this machine's
    sock = server_process.listening_socket("127.0.0.1", 0)  # the one uvicorn then serves on
    try:
        assert sock.getsockname()[1] > 0
    finally:
        sock.close()


def test_a_killed_worker_process_makes_health_503_and_new_work_is_refused(server_distill_dir, tmp_path):
    # The audit's reproduction: kill -9 of the engine's spawned worker. /health said "ok", jobs were accepted with
    # 200 and then failed, the first one blamed on a replica that "died while running it", and the LoRA and memory
    # routes answered 500.
    engine = Engine(build_engine_config(str(server_distill_dir), device="cpu"))
    server = start_server(tmp_path, engine=engine)
    try:
        with server.client() as client:
            assert client.get("/health").json() == {"status": "ok", "memory_released": False}
            before = wait_for(client, client.post("/v1/videos", json=REQUEST).json()["id"], timeout=120)
            assert before["status"] == "completed"
            [pid] = engine.worker.pids.values()
            os.kill(pid, signal.SIGKILL)
            deadline = time.monotonic() + 30
            while (health := client.get("/health")).status_code == 200 and time.monotonic() < deadline:
                time.sleep(0.05)
            assert health.status_code == 503, health.text
            body = health.json()
            assert body["status"] == "unavailable" and "restart the server" in body["message"]
            [note] = body["dead_replicas"]
            assert f"pid {pid}" in note and "code -9" in note and "idle" in note
            for method, path, kwargs in (("POST", "/v1/videos", {"json": REQUEST}),
                                         ("POST", "/v1/set_lora", {"json": {"lora_nickname": "a"}}),
                                         ("GET", "/v1/list_loras", {}),
                                         ("POST", "/release_memory_occupation", {})):
                refused = client.request(method, path, **kwargs)
                assert refused.status_code == 503, (path, refused.text)
                assert refused.json()["error"]["code"] == "engine_unavailable"
            # What ran before the death is still listed and served.
            assert client.get(f"/v1/videos/{before['id']}/content").status_code == 200
            assert [job["id"] for job in client.get("/v1/videos").json()["data"]] == [before["id"]]
    finally:
        server.stop()


def test_a_source_smaller_than_one_tile_is_refused_at_creation(vsr_server):
    # It was accepted, waited in the queue, then failed in the worker's tile plan with invalid_request.
    from k6serve.testing.clips import make_clip

    clip = make_clip(vsr_server.settings.allowed_input_dirs[0] / "tiny.mp4", width=16, height=16, num_frames=9, fps=24)
    with vsr_server.client() as client:
        before = client.get("/v1/videos").json()["data"]
        for fields, files, param in (({"video_path": str(clip)}, None, "video_path"),
                                     ({}, {"video_reference": ("tiny.mp4", clip.read_bytes(), "video/mp4")},
                                      "video_reference")):
            body = {"sr_resolution_scale": "2", **fields}
            answer = client.post("/v1/videos", data=body, files=files) if files else client.post("/v1/videos",
                                                                                                  json=body)
            assert answer.status_code == 400, answer.text
            error = answer.json()["error"]
            assert error["param"] == param and error["code"] == "invalid_parameter", error
            assert error["message"].startswith("the source frame is 16x16 (WxH, after pre-upscale and padding to ")
            assert error["message"].endswith("use a larger input or a higher sr_resolution_scale.")
        assert client.get("/v1/videos").json()["data"] == before  # no job was created
