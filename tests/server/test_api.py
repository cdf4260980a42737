"""The documented routes against a fake engine: job objects, defaults, listing, content with Range, delete."""

from __future__ import annotations

import io
import itertools
import json
import re
import socket
import sys
import time
from pathlib import Path

import av
import numpy as np
import PIL.Image
import pytest
from harness import FakeWorker, start_server, wait_for, wait_until

from k6serve.models.variants import VARIANTS
from k6serve.serve.video_create_body import VideoCreateBody

DOCS = Path(__file__).resolve().parents[2] / "docs" / "http-api.md"


def test_json_create_completes_with_every_job_field(fake_client):
    created = fake_client.post("/v1/videos", json={"prompt": "a red fox", "size": "96x64", "seconds": "2",
                                                   "num_inference_steps": 4})
    assert created.status_code == 200, created.text
    job = created.json()
    assert job["object"] == "video" and job["status"] == "queued" and job["progress"] == 0
    assert job["id"].startswith("video_")
    # size is width first; 2 s at 24 fps = 48 frames -> 49 by the (n // 4) * 4 + 1 rule -> 2.04167 s.
    assert job["size"] == "96x64" and job["seconds"] == "2.04167"
    assert job["seed"] == 42  # the default, so the user can run the same video again
    # Said, as a num_frames off the rule is said (it was silent: the client sent no frame count to see it in).
    assert job["warnings"] == ["seconds 2 at 24 fps is 48 frames, not of the form 4k+1; using 49 (2.04167 s; "
                               "n // 4 * 4 + 1 frames, as the reference)."]
    exact = fake_client.post("/v1/videos", json={"prompt": "a red fox", "size": "96x64", "seconds": 0.375}).json()
    assert exact["seconds"] == "0.375" and exact["warnings"] == []  # 9 frames: 4k+1 already
    # Under half a frame rounds to 0 frames and runs as 1: it was clamped with no warning.
    for sent, fps, words in ((0.001, 24, "seconds 0.001 at 24 fps is 0 frames, fewer than one; using 1 (0.0416667 s"),
                             ("0.5", 1, "seconds 0.5 at 1 fps is 0 frames, fewer than one; using 1 (1 s")):
        short = fake_client.post("/v1/videos", json={"prompt": "a red fox", "size": "96x64", "seconds": sent,
                                                      "fps": fps})
        assert short.status_code == 200, short.text
        assert short.json()["warnings"] == [f"{words}; a video has at least 1 frame)."]
    done = wait_for(fake_client, job["id"])
    assert done["status"] == "completed" and done["progress"] == 100
    assert done["model"] == "kandinskylab/Kandinsky-6.0-Pro-distill-5s-Diffusers"
    assert done["completed_at"] >= done["created_at"]
    assert done["expires_at"] == done["completed_at"] + 86400
    assert done["inference_time_s"] == pytest.approx(0.01) and done["peak_memory_mb"] == 12.5
    assert done["error"] is None and done["url"] == f"/v1/videos/{job['id']}/content"


def test_absent_fields_take_the_variant_defaults(tmp_path):
    for variant, expected in (("pro-distill", (10, 1.0, 42)), ("pro", (50, 5.0, 42))):
        worker = FakeWorker(VARIANTS[variant])
        server = start_server(tmp_path / variant, worker=worker)
        try:
            with server.client() as client:
                job = client.post("/v1/videos", json={"prompt": "defaults", "size": "32x32", "num_frames": 5}).json()
                assert wait_for(client, job["id"])["status"] == "completed"
                request = worker.requests[0]
                assert (request.num_inference_steps, request.guidance_scale, request.seed) == expected
                assert (request.height, request.width, request.num_frames) == (32, 32, 5)
                job = client.post("/v1/videos", json={"prompt": "all defaults"}).json()
                assert job["size"] == "768x512" and job["seconds"] == "5.04167"  # 121 frames @ 24 fps
        finally:
            worker.release.set()
            server.stop()


def test_vsr_defaults_and_sr_fields(tmp_path):
    from k6serve.testing.clips import make_clip

    worker = FakeWorker(VARIANTS["vsr-distilled2steps"])
    server = start_server(tmp_path, worker=worker)
    # 192 px: x4 makes 768, so an exact "hd" target (720 a side for a square) is a downscale the server accepts.
    clip = make_clip(tmp_path / "inputs" / "clip.mp4", width=192, height=192, num_frames=9, fps=24)
    try:
        with server.client() as client:
            job = client.post("/v1/videos", json={"video_path": str(clip)}).json()
            assert wait_for(client, job["id"])["status"] == "completed"
            assert worker.requests[-1].seed == 42 and worker.requests[-1].scale == 2.25
            fields = {"video_path": str(clip), "sr_resolution_scale": 4, "sr_tiles_batch_size": 2,
                      "sr_tile_min_overlap": 0.3, "sr_target_resolution": "hd", "sr_target_resize_mode": "exact",
                      "seed": 7}
            job = client.post("/v1/videos", json=fields).json()
            assert job["seed"] == 7 and wait_for(client, job["id"])["seed"] == 7
            assert wait_for(client, job["id"])["status"] == "completed"
            request = worker.requests[-1]
            assert (request.scale, request.tiles_batch_size, request.tile_min_overlap, request.target_resolution,
                    request.target_resize_mode, request.seed) == (4.0, 2, 0.3, "hd", "exact", 7)
            refused = client.post("/v1/videos", json={"video_path": str(clip), "size": "64x64"})
            assert refused.status_code == 400 and refused.json()["error"]["param"] == "size"
    finally:
        server.stop()


def test_an_upscale_job_reports_the_pipelines_size_and_seconds_from_creation(tmp_path):
    """What the SR pipeline makes of each source (its reader's frames, count and fps; `plan_upscale`'s delivery
    size) is the job's `size` and `seconds` as created: rotated, subsampled, capped, slow and Matroska sources."""
    from fractions import Fraction

    from k6serve.media.video import read_sr_source
    from k6serve.pipelines.sr_plan import plan_upscale
    from k6serve.testing.clips import make_clip
    from k6serve.testing.tiny_sr_checkpoint import TINY_TILE_SIZES

    worker = FakeWorker(VARIANTS["vsr-distilled2steps"])
    server = start_server(tmp_path, worker=worker)
    inputs = tmp_path / "inputs"
    clips = [
        make_clip(inputs / "portrait.mp4", width=96, height=64, num_frames=17, fps=24, rotation=90),
        make_clip(inputs / "upside_down.mov", width=96, height=64, num_frames=9, fps=24, rotation=180),
        make_clip(inputs / "ntsc.mkv", width=80, height=48, num_frames=50, fps=Fraction(30000, 1001),
                  audio="mono_tone"),  # subsampled to 24 fps; Matroska states no frame count, only a duration
        make_clip(inputs / "long.mp4", width=48, height=48, num_frames=130, fps=25),  # capped at 121 frames
        make_clip(inputs / "slow.mp4", width=64, height=48, num_frames=20, fps=15),  # kept at 15 fps
    ]
    scales = [{}, {"sr_resolution_scale": 2}, {"sr_resolution_scale": 4, "sr_target_resolution": "320x240"}]
    try:
        with server.client() as client:
            for clip, fields in itertools.product(clips, scales):
                created = client.post("/v1/videos", json={"video_path": str(clip), **fields})
                assert created.status_code == 200, created.text
                done = wait_for(client, created.json()["id"])
                source = read_sr_source(clip)
                plan = plan_upscale(source.frames.shape[1:3], worker.requests[-1], tile_sizes=TINY_TILE_SIZES,
                                    snap=8)
                height, width = plan.delivery_size
                expected = (f"{width}x{height}", f"{source.num_frames / source.fps:g}")
                assert (created.json()["size"], created.json()["seconds"]) == expected, (clip.name, fields)
                # The fake worker's MP4 is 16x16 with 5 frames: the finished job reports what was made.
                assert (done["size"], done["seconds"]) == ("16x16", f"{5 / 24:g}")
            portrait = client.post("/v1/videos", json={"video_path": str(clips[0])}).json()
            assert portrait["size"] == "128x224"  # 64x96 upright, x1.125 snapped to 64x112, x2
    finally:
        server.stop()


def test_an_upscale_whose_size_cannot_be_made_is_refused_at_creation(tmp_path):
    """An `exact` target larger than the upscaled result used to be accepted, then failed by the worker after the
    job waited its turn; the size is now planned at creation, so the 400 comes at once and no job is stored."""
    from k6serve.testing.clips import make_clip

    worker = FakeWorker(VARIANTS["vsr-distilled2steps"])
    server = start_server(tmp_path, worker=worker)
    clip = make_clip(tmp_path / "inputs" / "small.mp4", width=32, height=32, num_frames=9, fps=24)
    try:
        with server.client() as client:
            refused = client.post("/v1/videos", json={"video_path": str(clip), "sr_resolution_scale": 4,
                                                      "sr_target_resolution": "hd", "sr_target_resize_mode": "exact"})
            assert refused.status_code == 400, refused.text
            error = refused.json()["error"]
            assert error["param"] == "sr_target_resolution"
            assert "upscaled result, and target resolutions only downscale" in error["message"]
            assert client.get("/v1/videos").json()["data"] == [] and worker.requests == []
            stretched = client.post("/v1/videos", json={"video_path": str(clip), "sr_resolution_scale": 4,
                                                        "sr_target_resolution": "64x32", "sr_target_resize_mode": "exact"})
            assert stretched.status_code == 200, stretched.text
            note = ("sr_target_resolution '64x32' with the 'exact' resize mode stretches the 128x128 upscaled result "
                    "to 64x32, changing its aspect ratio; use sr_target_resize_mode 'fit' to keep it.")
            assert note in stretched.json()["warnings"]  # known, and shown, before the job runs
            # Over H.264's largest level: the scale is what to change, a target would not help (`param` says so).
            uhd = make_clip(tmp_path / "inputs" / "uhd.mp4", width=3840, height=2160, num_frames=1, fps=24)
            stored = [job["id"] for job in client.get("/v1/videos").json()["data"]]
            too_large = client.post("/v1/videos", json={"video_path": str(uhd), "sr_target_resolution": "hd"})
            assert too_large.status_code == 400, too_large.text
            error = too_large.json()["error"]
            assert error["param"] == "sr_resolution_scale" and error["message"].startswith(
                "the x2.25 upscale of this 3840x2160 source would be 8640x4864 (164,160 macroblocks")
            assert error["message"].endswith("use sr_resolution_scale 2, or a smaller source.")
            assert [job["id"] for job in client.get("/v1/videos").json()["data"]] == stored  # none stored
    finally:
        server.stop()


def test_input_reference_follows_the_served_model(tmp_path, fake_server, fake_client):
    import io

    from PIL import Image

    from k6serve.testing.clips import make_clip

    gif = io.BytesIO()
    Image.new("RGB", (24, 16), (10, 200, 30)).save(gif, format="GIF")
    # A generation model: a GIF is the conditioning image, by name or by type (it was taken as a video before).
    for name, content_type in (("still.gif", "image/gif"), ("still.gif", "application/octet-stream"),
                               ("still", "image/gif")):
        job = fake_client.post("/v1/videos", data={"prompt": "x", "size": "32x32", "num_frames": "5"},
                               files={"input_reference": (name, gif.getvalue(), content_type)})
        assert job.status_code == 200, job.text
        assert wait_for(fake_client, job.json()["id"])["status"] == "completed"
        assert fake_server.worker.requests[-1].image_path is not None
    # The super-resolution model: always the source video, even unnamed and untyped.
    clip = make_clip(tmp_path / "clip.mp4", width=32, height=32, num_frames=9, fps=24)
    worker = FakeWorker(VARIANTS["vsr-distilled2steps"])
    server = start_server(tmp_path / "sr", worker=worker)
    try:
        with server.client() as client:
            job = client.post("/v1/videos", files={"input_reference": ("clip", clip.read_bytes(),
                                                                       "application/octet-stream")})
            assert job.status_code == 200, job.text
            assert wait_for(client, job.json()["id"])["status"] == "completed"
            assert worker.requests[-1].video_path.endswith("_input_reference")  # the upload, as the source
    finally:
        server.stop()


def test_input_reference_is_the_image_on_a_generation_model_whatever_its_name_or_type(tmp_path, fake_client):
    from k6serve.testing.clips import make_clip

    clip = make_clip(tmp_path / "clip.mp4", width=32, height=32, num_frames=9, fps=24).read_bytes()
    # A video is named as such, whatever the upload says: it was routed to video_path by its name or type and
    # refused as "video_path is for the super-resolution model", a field the client never sent.
    for name, content_type in (("clip.mp4", "video/mp4"), ("clip", "application/octet-stream"),
                               ("still.png", "image/png")):
        response = fake_client.post("/v1/videos", data={"prompt": "x"},
                                    files={"input_reference": (name, clip, content_type)})
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert (error["code"], error["param"]) == ("invalid_upload", "input_reference")
        assert "is a video, not an image" in error["message"] and "super-resolution" in error["message"]
        assert "video_path" not in error["message"]
    response = fake_client.post("/v1/videos", data={"prompt": "x"},
                                files={"input_reference": ("a.mp4", b"neither image nor video", "video/mp4")})
    assert response.status_code == 400
    assert "is not a readable image" in response.json()["error"]["message"]


def test_sr_fields_are_refused_by_a_generation_model(fake_client):
    response = fake_client.post("/v1/videos", json={"prompt": "x", "sr_resolution_scale": 2})
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "sr_resolution_scale"
    assert "super-resolution" in response.json()["error"]["message"]


def test_list_pagination(fake_client):
    ids = [fake_client.post("/v1/videos", json={"prompt": f"p{i}", "size": "32x32", "num_frames": 5}).json()["id"]
           for i in range(5)]
    page = fake_client.get("/v1/videos", params={"limit": 2, "order": "asc"}).json()
    assert page["object"] == "list" and [j["id"] for j in page["data"]] == ids[:2] and page["has_more"]
    assert page["first_id"] == ids[0] and page["last_id"] == ids[1]
    page = fake_client.get("/v1/videos", params={"limit": 2, "order": "asc", "after": ids[1]}).json()
    assert [j["id"] for j in page["data"]] == ids[2:4] and page["has_more"]
    page = fake_client.get("/v1/videos", params={"limit": 2, "order": "asc", "after": ids[3]}).json()
    assert [j["id"] for j in page["data"]] == ids[4:] and not page["has_more"]
    newest_first = fake_client.get("/v1/videos").json()
    assert [j["id"] for j in newest_first["data"]] == ids[::-1] and not newest_first["has_more"]
    for params, param in (({"limit": 0}, "limit"), ({"limit": 101}, "limit"), ({"order": "up"}, "order"),
                          ({"after": "video_nope"}, "after")):
        response = fake_client.get("/v1/videos", params=params)
        assert response.status_code == 400, params
        assert response.json()["error"]["param"] == param


def test_unknown_ids_and_unfinished_content_are_404(fake_server, fake_client):
    for path in ("/v1/videos/video_nope", "/v1/videos/video_nope/content"):
        response = fake_client.get(path)
        assert response.status_code == 404
        assert response.json()["error"]["code"] == "video_not_found"
    assert fake_client.delete("/v1/videos/video_nope").status_code == 404
    job = fake_client.post("/v1/videos", json={"prompt": "hold", "size": "32x32", "num_frames": 5}).json()
    response = fake_client.get(f"/v1/videos/{job['id']}/content")
    assert response.status_code == 404 and response.json()["error"]["code"] == "video_not_ready"
    fake_server.worker.release.set()
    wait_for(fake_client, job["id"])


def test_a_trailing_slash_reaches_the_same_route_not_a_bodiless_redirect(fake_server, fake_client):
    """Starlette answered /v1/videos/ with a 307 and no body: curl without -L printed nothing."""
    created = fake_client.post("/v1/videos/", json={"prompt": "slash", "size": "32x32", "num_frames": 5})
    assert created.status_code == 200, created.text
    job_id = created.json()["id"]
    assert fake_client.get(f"/v1/videos/{job_id}/").json()["id"] == job_id
    assert job_id in [job["id"] for job in fake_client.get("/v1/videos//").json()["data"]]
    missing = fake_client.get("/v1/nothing/")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "not_found"
    wait_for(fake_client, job_id)


def _raw_get(base_url: str, target: str) -> tuple[int, bytes]:
    """GET `target` exactly as written on the request line: (status, body)."""
    host, port = base_url.removeprefix("http://").split(":")
    received = b""
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(f"GET {target} HTTP/1.1\r\nHost: {host}:{port}\r\nConnection: close\r\n\r\n".encode())
        while chunk := sock.recv(65536):
            received += chunk
    head, _, body = received.partition(b"\r\n\r\n")
    return int(head.split()[1]), body


def test_an_absolute_form_target_reaches_its_route(fake_server, fake_client):
    """RFC 9112 3.2.2: a server MUST accept `GET http://host/path` (what clients send through a forwarding proxy);
    uvicorn put the whole URL in the path, a 404 "no route GET /http://..."."""
    job = fake_client.post("/v1/videos", json={"prompt": "absolute", "size": "32x32", "num_frames": 5}).json()
    base = fake_server.base_url
    status, body = _raw_get(base, f"{base}/v1/videos/{job['id']}")
    assert status == 200 and json.loads(body)["id"] == job["id"]
    status, body = _raw_get(base, f"HTTPS{base[4:]}/v1/videos/?limit=1")  # any case, either scheme
    assert status == 200 and len(json.loads(body)["data"]) == 1
    status, body = _raw_get(base, "http://another.name:1/v1/models")  # one site, whatever name reaches it
    assert status == 200 and json.loads(body)["data"]
    status, body = _raw_get(base, "https://x/v1/nothing%2Fhere")
    assert status == 404 and "GET /v1/nothing/here " in json.loads(body)["error"]["message"]
    assert _raw_get(base, "http://x")[0] == 404  # the bare authority is "/", which has no route
    status, body = _raw_get(base, "/v1/http://x/v1/models")  # only a target that starts with a scheme is absolute
    assert status == 404
    wait_for(fake_client, job["id"])


def test_content_is_an_mp4_with_range_support(fake_client, tmp_path):
    job = fake_client.post("/v1/videos", json={"prompt": "range", "size": "32x32", "num_frames": 5}).json()
    wait_for(fake_client, job["id"])
    full = fake_client.get(f"/v1/videos/{job['id']}/content")
    assert full.status_code == 200 and full.headers["content-type"] == "video/mp4"
    assert full.headers["accept-ranges"] == "bytes"
    (tmp_path / "got.mp4").write_bytes(full.content)
    with av.open(str(tmp_path / "got.mp4")) as container:
        assert container.streams.video[0].frames == 5
    part = fake_client.get(f"/v1/videos/{job['id']}/content", headers={"Range": "bytes=10-19"})
    assert part.status_code == 206 and part.content == full.content[10:20]
    assert part.headers["content-range"] == f"bytes 10-19/{len(full.content)}"
    tail = fake_client.get(f"/v1/videos/{job['id']}/content", headers={"Range": "bytes=-7"})
    assert tail.status_code == 206 and tail.content == full.content[-7:]
    beyond = fake_client.get(f"/v1/videos/{job['id']}/content", headers={"Range": f"bytes={len(full.content)}-"})
    assert beyond.status_code == 416


def test_delete_finished_job_removes_record_and_file(fake_server, fake_client):
    job = fake_client.post("/v1/videos", json={"prompt": "bye", "size": "32x32", "num_frames": 5}).json()
    wait_for(fake_client, job["id"])
    path = fake_server.artifacts.root / f"{job['id']}.mp4"
    assert path.is_file()
    response = fake_client.delete(f"/v1/videos/{job['id']}")
    assert response.status_code == 200
    assert response.json() == {"id": job["id"], "object": "video.deleted", "deleted": True}
    assert not path.exists()
    assert fake_client.get(f"/v1/videos/{job['id']}").status_code == 404
    assert fake_client.delete(f"/v1/videos/{job['id']}").status_code == 404


def test_failed_job_reports_error_and_others_still_complete(fake_client):
    bad = fake_client.post("/v1/videos", json={"prompt": "fail please", "size": "32x32", "num_frames": 5}).json()
    good = fake_client.post("/v1/videos", json={"prompt": "fine", "size": "32x32", "num_frames": 5}).json()
    failed = wait_for(fake_client, bad["id"])
    assert failed["status"] == "failed"
    assert failed["error"] == {"code": "generation_failed", "message": "RuntimeError: fake worker failure"}
    content = fake_client.get(f"/v1/videos/{bad['id']}/content")
    assert content.status_code == 404 and "fake worker failure" in content.json()["error"]["message"]
    assert wait_for(fake_client, good["id"])["status"] == "completed"


def test_out_of_memory_job_says_the_request_was_too_big_not_that_it_broke(fake_client, caplog):
    job = fake_client.post("/v1/videos", json={"prompt": "exhaust memory", "size": "32x32", "num_frames": 5}).json()
    with caplog.at_level("WARNING", logger="k6serve.serve.runner"):
        failed = wait_for(fake_client, job["id"])
    # The client is told what its request can change; the operator's log, what the server's flags can.
    assert f"job {job['id']} ran out of GPU memory; for such requests, keep speed mode" in caplog.text
    assert "--cpu-offload-components all" in caplog.text
    assert failed["status"] == "failed"
    assert failed["error"] == {
        "code": "out_of_memory",
        "message": "The GPU ran out of memory for this request (CUDA out of memory. Tried to allocate 9.00 GiB.); "
                   "retry with a smaller size or fewer seconds.",
    }
    later = fake_client.post("/v1/videos", json={"prompt": "fine", "size": "32x32", "num_frames": 5}).json()
    assert wait_for(fake_client, later["id"])["status"] == "completed"


def test_host_memory_running_out_and_an_unexpected_failure_in_the_clients_words(fake_client, caplog):
    # The host's RAM running out was a generation_failed with the worker's whole traceback (4,800 characters, the
    # server's file paths), as was any unexpected failure; the log keeps the traceback.
    host = fake_client.post("/v1/videos", json={"prompt": "exhaust host memory", "size": "32x32",
                                                "num_frames": 5}).json()
    broken = fake_client.post("/v1/videos", json={"prompt": "break with a traceback", "size": "32x32",
                                                  "num_frames": 5}).json()
    with caplog.at_level("WARNING", logger="k6serve.serve.runner"):
        failed_host, failed_broken = wait_for(fake_client, host["id"]), wait_for(fake_client, broken["id"])
    assert f"job {host['id']} ran out of host memory; for such requests, free host memory" in caplog.text
    assert failed_host["error"] == {
        "code": "out_of_memory",
        "message": "The server's host ran out of memory for this request (DefaultCPUAllocator: can't allocate "
                   "memory: you tried to allocate 3221225472 bytes. Error code 12 (Cannot allocate memory)); retry "
                   "with a smaller size or fewer seconds.",
    }
    assert failed_broken["error"] == {"code": "generation_failed", "message": "RuntimeError: request 1 failed on "
                                      "replica 0: rank 0: KeyError: 'x'"}
    assert "secret_path.py" in caplog.text  # the operator's log has it all


def test_a_job_whose_worker_was_killed_says_so_in_the_clients_words(fake_client, caplog):
    """It failed as generation_failed with the engine's text ("WorkerKilled: ... replica 0 (ranks [0]) ... free host
    memory, or use fewer GPUs per host"): the operator's advice, shown to the client."""
    job = fake_client.post("/v1/videos", json={"prompt": "kill the worker", "size": "32x32", "num_frames": 5}).json()
    with caplog.at_level("ERROR", logger="k6serve.serve.runner"):
        failed = wait_for(fake_client, job["id"])
    assert failed["status"] == "failed" and failed["error"]["code"] == "worker_died"
    assert failed["error"]["message"].startswith("The server's worker process running this job was killed")
    assert "ranks" not in failed["error"]["message"] and "free host memory" not in failed["error"]["message"]
    assert f"job {job['id']} failed: request 1 failed: worker replica 0 (ranks [0]) died" in caplog.text


def test_a_job_whose_video_meets_a_full_disk_says_so_without_the_servers_paths(fake_client):
    job = fake_client.post("/v1/videos", json={"prompt": "fill the disk", "size": "32x32", "num_frames": 5}).json()
    failed = wait_for(fake_client, job["id"])
    assert failed["status"] == "failed" and failed["error"]["code"] == "insufficient_storage"
    assert "disk was full" in failed["error"]["message"] and "/srv/k6" not in failed["error"]["message"]
    later = fake_client.post("/v1/videos", json={"prompt": "fine", "size": "32x32", "num_frames": 5}).json()
    assert wait_for(fake_client, later["id"])["status"] == "completed"


def test_a_job_that_meets_a_missing_package_names_it_and_leaves_the_pip_command_to_the_log(fake_client, caplog):
    # It read "ModuleNotFoundError: No module named 'av'", as if the request had broken something.
    with caplog.at_level("ERROR", logger="k6serve.serve.runner"):
        job = fake_client.post("/v1/videos", json={"prompt": "lack a package", "size": "32x32", "num_frames": 5})
        failed = wait_for(fake_client, job.json()["id"])
    assert failed["status"] == "failed" and failed["error"]["code"] == "generation_failed"
    message = failed["error"]["message"]
    assert message.startswith("The server cannot run this job: the Python package that provides 'av' is not "
                              "installed in its environment. The server's operator must install it")
    assert sys.executable not in message  # the server's own paths stay in its log
    assert f"{sys.executable} -m pip install \"av" in caplog.text
    later = fake_client.post("/v1/videos", json={"prompt": "fine", "size": "32x32", "num_frames": 5}).json()
    assert wait_for(fake_client, later["id"])["status"] == "completed"


def test_a_local_folder_is_named_by_the_released_checkpoint_it_is_for_both_families(server_distill_dir, server_vsr_dir,
                                                                                     tmp_path):
    # The audit saw the local SR folder listed as the hub id and took it for a slip, next to the demo's "demo". The
    # rule is one for both families: a folder recognised as a released checkpoint is listed by that release's id
    # (`root` keeps the path, and the folder's name is accepted as `model`); only the built-in demo, which is no
    # release, goes by its own name.
    from k6serve.engine_arguments import build_engine_config
    from k6serve.models.variants import recognise
    from k6serve.runtime.engine import Engine

    for folder, hub_id in ((server_distill_dir, "kandinskylab/Kandinsky-6.0-Pro-distill-5s-Diffusers"),
                           (server_vsr_dir, "kandinskylab/Kandinsky-6.0-VSR-distilled2steps-5s-Diffusers")):
        variant = recognise(str(folder), None, folder)
        engine = Engine(build_engine_config(str(folder), device="cpu"), worker=FakeWorker(variant))
        server = start_server(tmp_path / variant.name, engine=engine)
        try:
            with server.client() as client:
                [card] = client.get("/v1/models").json()["data"]
                assert (card["id"], card["root"]) == (hub_id, str(folder))
                body = ({"prompt": "x", "size": "32x32", "num_frames": 5} if variant.family == "generation"
                        else {"video_path": "missing.mp4"})
                answer = client.post("/v1/videos", json={**body, "model": folder.name})
                assert (answer.json().get("error") or {}).get("param") != "model", answer.text
        finally:
            server.stop()


def test_served_model_name_is_the_listed_id_and_the_checkpoints_names_stay_accepted(tmp_path):
    server = start_server(tmp_path, served_model_name="K6-Pro-Distill")
    try:
        with server.client() as client:
            [card] = client.get("/v1/models").json()["data"]
            assert card["id"] == "K6-Pro-Distill"
            for name in ("K6-Pro-Distill", "k6-pro-distill", "kandinskylab/Kandinsky-6.0-Pro-distill-5s-Diffusers"):
                job = client.post("/v1/videos", json={"prompt": "m", "size": "32x32", "num_frames": 5,
                                                      "model": name}).json()
                assert job["model"] == "K6-Pro-Distill", job
                assert wait_for(client, job["id"])["status"] == "completed"
            refused = client.post("/v1/videos", json={"prompt": "m", "model": "other"})
            assert refused.status_code == 400
            assert "model 'other' is not served here; use 'K6-Pro-Distill'" in refused.json()["error"]["message"]
    finally:
        server.stop()


def test_models_health_metrics(fake_client):
    models = fake_client.get("/v1/models").json()
    assert models["object"] == "list"
    (card,) = models["data"]
    assert card["id"] == "kandinskylab/Kandinsky-6.0-Pro-distill-5s-Diffusers" and card["object"] == "model"
    assert card["default_num_inference_steps"] == 10 and card["default_guidance_scale"] == 1.0
    assert card["quantization"] == "none"
    assert fake_client.get("/health").json() == {"status": "ok", "memory_released": False}
    job = fake_client.post("/v1/videos", json={"prompt": "m", "size": "32x32", "num_frames": 5,
                                               "model": "Kandinsky-6.0-Pro-distill-5s-Diffusers"}).json()
    wait_for(fake_client, job["id"])
    text = fake_client.get("/metrics")
    assert text.headers["content-type"].startswith("text/plain")
    body = text.text
    assert "k6serve_queue_depth 0" in body
    assert 'k6serve_jobs{status="completed"} 1' in body
    # 10 steps of the distilled default; the first, timed from dispatch (text encoding and all), is left out
    assert re.search(r"^k6serve_step_latency_seconds_count 9$", body, re.MULTILINE)
    assert re.search(r"^k6serve_job_latency_seconds_count 1$", body, re.MULTILINE)
    assert "k6serve_peak_gpu_memory_mb 12.5" in body
    for line in body.splitlines():  # every sample line is "name{labels} number"
        assert line.startswith("#") or re.fullmatch(r'[a-z0-9_]+(\{[a-z]+="[^"]*"(,[a-z]+="[^"]*")*\})? [0-9.e+-]+',
                                                    line), line
    # The job's stages, one series each in the order a request runs them; none for a stage it did not run
    assert re.findall(r'^k6serve_stage_seconds_count\{stage="([a-z_]+)"\} 1$', body, re.MULTILINE) == [
        "encode", "denoise", "decode_video", "mux"]
    assert 'k6serve_stage_seconds_bucket{stage="denoise",le="0.01"} 1' in body
    assert 'k6serve_stage_seconds_bucket{stage="denoise",le="+Inf"} 1' in body
    assert 'k6serve_stage_seconds_sum{stage="denoise"} 0.006000' in body
    assert "graphs_compiled" not in body and 'stage="total"' not in body


_SGLANG_CARD_FIELDS = ("id", "object", "created", "owned_by", "root", "parent", "num_gpus", "dit_precision",
                       "vae_precision")


def test_the_model_card_has_sglangs_fields_with_the_served_values(server_distill_dir, tmp_path):
    # SGLang's diffusion /v1/models card (docs/serving-reference.md) has root, parent, num_gpus and the DiT's and
    # VAE's precisions besides OpenAI's id / object / created / owned_by; ours had OpenAI's and root only. Here a real
    # worker on the CPU: "auto" resolves to float32 there, and the card says what was loaded, not "auto".
    from k6serve.engine_arguments import build_engine_config
    from k6serve.runtime.engine import Engine
    from k6serve.runtime.worker import ModelWorker

    config = build_engine_config(str(server_distill_dir), device="cpu")
    server = start_server(tmp_path, engine=Engine(config, worker=ModelWorker(config)))
    try:
        with server.client() as client:
            [card] = client.get("/v1/models").json()["data"]
    finally:
        server.stop()
    assert set(_SGLANG_CARD_FIELDS) <= set(card)
    assert (card["object"], card["owned_by"], card["root"], card["parent"]) == ("model", "k6serve",
                                                                               str(server_distill_dir), None)
    assert isinstance(card["created"], int) and card["created"] > 0
    assert (card["num_gpus"], card["dit_precision"], card["vae_precision"]) == (1, "float32", "float32")


def test_the_model_card_reports_the_engines_gpus_and_the_workers_precision(tmp_path):
    # num_gpus is the whole engine's (replicas and Ulysses ranks alike); the precision is the dtype the worker
    # reported, whatever --dtype said (a stand-in worker with none reports null).
    from k6serve.engine_arguments import build_engine_config
    from k6serve.runtime.engine import Engine

    worker = FakeWorker(VARIANTS["pro-distill"])
    worker.precision = "bfloat16"
    engine = Engine(build_engine_config("fake-k6-model", num_gpus=4, dp_size=2, ulysses_degree=2), worker=worker)
    server = start_server(tmp_path, engine=engine)
    try:
        with server.client() as client:
            [card] = client.get("/v1/models").json()["data"]
            assert client.get(f"/v1/models/{card['id']}").json() == card
    finally:
        server.stop()
    assert (card["num_gpus"], card["dit_precision"], card["vae_precision"]) == (4, "bfloat16", "bfloat16")


def test_step_latency_leaves_out_the_rewrites_reports_of_step_0(fake_client):
    # The rewrite's cancellation points (step 0, 20 ms apart here) came before the first step: the first step's time
    # was then counted from the last of them, encoding and all; only steps after a step are a step's time.
    job = fake_client.post("/v1/videos", json={"prompt": "rewrite first", "size": "32x32", "num_frames": 5}).json()
    assert wait_for(fake_client, job["id"])["status"] == "completed"
    body = fake_client.get("/metrics").text
    assert re.search(r"^k6serve_step_latency_seconds_count 9$", body, re.MULTILINE)


def test_a_rewrite_is_a_stage_of_its_own_in_metrics(fake_client):
    # An operator tells what expand_prompts costs (up to 1,024 tokens written) from its own series.
    for expand in (True, False, True):
        job = fake_client.post("/v1/videos", json={"prompt": "m", "size": "32x32", "num_frames": 5,
                                                   "expand_prompts": expand}).json()
        assert wait_for(fake_client, job["id"])["status"] == "completed"
        # The job itself says its stages, in run order (JSON keeps it), once completed
        assert list(fake_client.get(f"/v1/videos/{job['id']}").json()["stage_seconds"].items()) == [
            *([("expand_prompt", 0.004)] if expand else []), ("encode", 0.002), ("denoise", 0.006),
            ("decode_video", 0.001), ("mux", 0.001)]
    body = fake_client.get("/metrics").text
    assert re.findall(r'^k6serve_stage_seconds_count\{stage="([a-z_]+)"\} (\d+)$', body, re.MULTILINE) == [
        ("expand_prompt", "2"), ("encode", "3"), ("denoise", "3"), ("decode_video", "3"), ("mux", "3")]
    assert 'k6serve_stage_seconds_sum{stage="expand_prompt"} 0.008000' in body


def test_a_job_has_no_stages_before_it_completes(fake_client):
    job = fake_client.post("/v1/videos", json={"prompt": "m", "size": "32x32", "num_frames": 5}).json()
    assert job["stage_seconds"] == {}
    assert wait_for(fake_client, job["id"])["stage_seconds"]["denoise"] == 0.006


@pytest.mark.parametrize("name", ["kandinskylab/Kandinsky-6.0-Pro-distill-5s-Diffusers",
                                  "Kandinsky-6.0-Pro-distill-5s-Diffusers", "KANDINSKY-6.0-PRO-DISTILL-5S-DIFFUSERS",
                                  "kandinskylab%2FKandinsky-6.0-Pro-distill-5s-Diffusers"])
def test_a_model_is_retrieved_by_any_name_a_job_takes(fake_client, name):
    # OpenAI's GET /v1/models/{model} (the SDK's client.models.retrieve) answered 404 "unknown route".
    card = fake_client.get(f"/v1/models/{name}")
    assert card.status_code == 200 and card.json() == fake_client.get("/v1/models").json()["data"][0]


def test_a_model_not_served_is_404_model_not_found(fake_client):
    response = fake_client.get("/v1/models/sora-2")
    assert response.status_code == 404
    assert response.json()["error"] == {
        "message": "The model 'sora-2' is not served here: this server serves "
                   "'kandinskylab/Kandinsky-6.0-Pro-distill-5s-Diffusers' (GET /v1/models lists it).",
        "type": "not_found_error", "param": "model", "code": "model_not_found"}


def test_wrong_model_name_is_400(fake_client):
    response = fake_client.post("/v1/videos", json={"prompt": "x", "model": "sora-2"})
    assert response.status_code == 400 and response.json()["error"]["param"] == "model"


def test_paging_continues_after_a_deleted_or_expired_cursor(fake_server, fake_client):
    # A job deleted (or expired) between two pages made after=<its id> a 400: a client paging through jobs
    # while they expire got stuck. Its place is remembered, so the next page neither skips nor repeats.
    from k6serve.serve.expiry import sweep_expired_once
    from k6serve.serve.jobs import DELETED_CURSOR_RETENTION_S

    ids = [fake_client.post("/v1/videos", json={"prompt": f"p{i}", "size": "32x32", "num_frames": 5}).json()["id"]
           for i in range(6)]
    for video_id in ids:
        wait_for(fake_client, video_id)

    def page(**params):
        return [j["id"] for j in fake_client.get("/v1/videos", params={"limit": 2, **params}).json()["data"]]

    assert page(order="asc") == ids[:2]
    assert fake_client.delete(f"/v1/videos/{ids[1]}").json()["deleted"] is True
    assert page(order="asc", after=ids[1]) == ids[2:4]
    assert page(order="desc", after=ids[1]) == ids[:1]
    fake_server.store.update(ids[3], completed_at=time.time() - 7200)
    assert sweep_expired_once(fake_server.store, fake_server.artifacts, ttl_s=3600) == 1
    assert page(order="asc", after=ids[3]) == ids[4:6]
    assert page(order="desc", after=ids[3]) == [ids[2], ids[0]]
    fake_server.store.delete(ids[5], now=time.time() - DELETED_CURSOR_RETENTION_S - 1)
    for after, why in ((ids[5], "deleted too long ago"), ("video_" + "0" * 32, "never existed")):
        response = fake_client.get("/v1/videos", params={"after": after})
        assert response.status_code == 400, why
        error = response.json()["error"]
        assert error["param"] == "after" and "nor of one deleted or expired in the last 7 days" in error["message"]


def _documented_routes() -> set[tuple[str, str]]:
    return {(m, p) for m, p in re.findall(r"^### `(GET|POST|DELETE) (/[^`]*)`", DOCS.read_text(), re.MULTILINE)}


def test_openapi_matches_the_docs(fake_client):
    schema = fake_client.get("/openapi.json").json()
    served = {(method.upper(), path) for path, item in schema["paths"].items() for method in item}
    documented = _documented_routes()
    assert documented, "docs/http-api.md lists no routes"
    assert served == documented
    create = schema["paths"]["/v1/videos"]["post"]["requestBody"]["content"]
    assert set(create) == {"application/json", "multipart/form-data"}
    body_fields = set(schema["components"]["schemas"]["VideoCreateBody"]["properties"])
    assert body_fields == set(VideoCreateBody.model_fields)
    form_fields = set(schema["components"]["schemas"]["VideoCreateForm"]["properties"])
    assert form_fields == body_fields | {"input_reference", "video_reference"}
    docs = DOCS.read_text()
    for name in form_fields:
        assert f"`{name}`" in docs, f"docs/http-api.md does not describe field {name}"
    _check_generator_ready(schema)


def _references(node):
    if isinstance(node, dict):
        for key, value in node.items():
            yield from ([value] if key == "$ref" else _references(value))
    elif isinstance(node, list):
        for value in node:
            yield from _references(value)


def _check_generator_ready(schema: dict) -> None:
    """What client generators need of the document: openapi-typescript refused it for one dangling $ref (the unload
    route's body, which openapi-python-client then left out), the MP4 had no schema (a generated download raised on
    its 200), every route listed a 422 the server never sends, and form fields could be null (sent as "None")."""
    components = schema["components"]["schemas"]
    dangling = {ref for ref in _references(schema) if ref.rsplit("/", 1)[-1] not in components}
    assert not dangling
    operations = [operation for item in schema["paths"].values() for operation in item.values()]
    assert not any("422" in operation["responses"] for operation in operations)
    assert "HTTPValidationError" not in components
    content = schema["paths"]["/v1/videos/{video_id}/content"]["get"]["responses"]
    for status in ("200", "206"):
        assert content[status]["content"]["video/mp4"]["schema"] == {"type": "string", "format": "binary"}
    assert schema["paths"]["/v1/unload_lora"]["post"]["requestBody"]["required"] is True
    assert schema["paths"]["/health"]["get"]["responses"]["503"]
    form = components["VideoCreateForm"]["properties"]
    assert not any({"type": "null"} in value.get("anyOf", ()) for value in form.values())
    assert form["input_reference"]["description"] == "Uploaded file, used as image_path."
    # Always sent, so required (TypeScript typed them `warnings?: string[]`); test_json_create_... reads them all.
    assert {"warnings", "url", "error", "seed", "size"} <= set(components["VideoJob"]["required"])


def test_a_keyed_servers_document_says_so_and_its_docs_open_in_a_browser(tmp_path):
    from harness import start_server

    server = start_server(tmp_path, api_key="sekret")
    try:
        import httpx

        with httpx.Client(base_url=server.base_url) as anonymous:  # a browser opening the page sends no key
            assert anonymous.get("/docs").status_code == 200
            schema = anonymous.get("/openapi.json").json()
            assert anonymous.get("/v1/videos").status_code == 401  # the API itself still needs it
        assert schema["security"] == [{"bearer": []}]
        assert schema["components"]["securitySchemes"]["bearer"]["scheme"] == "bearer"
        assert schema["paths"]["/health"]["get"]["security"] == []
        _check_generator_ready(schema)
    finally:
        server.stop()


def test_an_expired_jobs_id_conflict_counts_from_its_expiry_not_the_sweep(fake_server, fake_client):
    from k6serve.serve.expiry import sweep_expired_once

    body = {"prompt": "old", "size": "32x32", "num_frames": 5, "request_id": "old-1"}
    assert wait_for(fake_client, fake_client.post("/v1/videos", json=body).json()["id"])["status"] == "completed"
    fake_server.store.update("old-1", completed_at=time.time() - 7200)  # expired an hour ago with a 1 h TTL
    assert sweep_expired_once(fake_server.store, fake_server.artifacts, ttl_s=3600) == 1
    response = fake_client.post("/v1/videos", json={**body, "prompt": "new"})
    assert response.status_code == 409
    age = int(re.search(r"deleted \(or expired\) (\d+) s ago", response.json()["error"]["message"])[1])
    assert 3590 <= age <= 3700  # it said "0 s ago": the sweep's time


def test_the_thumbnail_and_spritesheet_variants_are_stills_of_the_mp4(fake_client):
    """OpenAI's content variants: `thumbnail`, a WebP of the middle frame, and `spritesheet`, a JPEG of up to 16
    frames in rows of 4; looked up as the MP4 is (the same 404s), cached as it is. (Which frames, and their display
    shape: tests/unit/test_video_stills.py.) The fake worker's MP4 is 5 frames of 16x16 in one grey."""
    job = fake_client.post("/v1/videos", json={"prompt": "stills", "size": "32x32", "num_frames": 5}).json()
    wait_for(fake_client, job["id"])
    video = fake_client.get(f"/v1/videos/{job['id']}/content")
    with av.open(io.BytesIO(video.content)) as container:
        grey = next(container.decode(video=0)).to_ndarray(format="rgb24")
    thumbnail = fake_client.get(f"/v1/videos/{job['id']}/content", params={"variant": "thumbnail"})
    assert thumbnail.status_code == 200 and thumbnail.headers["content-type"] == "image/webp"
    # Cached as the MP4 is: the same directives, max-age the seconds left to the job's expiry, so a second
    # boundary between the two requests takes one off (a CI run met it).
    shown, expected = (re.fullmatch(r"private, max-age=(\d+), immutable", answer.headers["cache-control"])
                       for answer in (thumbnail, video))
    assert shown and expected and 0 <= int(expected[1]) - int(shown[1]) <= 1
    assert thumbnail.headers["content-disposition"] == f'attachment; filename="{job["id"]}_thumbnail.webp"'
    image = PIL.Image.open(io.BytesIO(thumbnail.content))
    assert (image.format, image.size) == ("WEBP", (16, 16))
    assert np.abs(np.asarray(image.convert("RGB"), dtype=np.int16) - grey).max() <= 3  # lossy WebP of the frame
    sheet = fake_client.get(f"/v1/videos/{job['id']}/content", params={"variant": "spritesheet"})
    assert sheet.status_code == 200 and sheet.headers["content-type"] == "image/jpeg"
    assert sheet.headers["content-disposition"] == f'attachment; filename="{job["id"]}_spritesheet.jpg"'
    image = PIL.Image.open(io.BytesIO(sheet.content))
    assert (image.format, image.size) == ("JPEG", (4 * 16, 2 * 16))  # 5 frames: a row of 4 and one more
    tiles = np.asarray(image.convert("RGB"), dtype=np.int16)
    assert np.abs(tiles[16:, :16] - grey).max() <= 3 and tiles[16:, 16:].max() == 0  # the fifth, then black
    head = fake_client.head(f"/v1/videos/{job['id']}/content", params={"variant": "thumbnail"})
    assert head.status_code == 200 and head.content == b""
    missing = fake_client.get("/v1/videos/video_nope/content", params={"variant": "spritesheet"})
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "video_not_found"


def test_a_still_of_a_damaged_mp4_is_a_500_that_says_so(fake_server, fake_client):
    job = fake_client.post("/v1/videos", json={"prompt": "damaged", "size": "32x32", "num_frames": 5}).json()
    wait_for(fake_client, job["id"])
    (fake_server.artifacts.root / f"{job['id']}.mp4").write_bytes(b"not an mp4 at all")
    response = fake_client.get(f"/v1/videos/{job['id']}/content", params={"variant": "thumbnail"})
    assert response.status_code == 500
    error = response.json()["error"]
    assert error["code"] == "content_unreadable" and error["param"] == "variant"
    assert error["message"] == (f"The thumbnail of video {job['id']} could not be made: its MP4 on the server cannot "
                                "be read (damaged on the server's disk?); the server's log has the reader's error.")


def test_an_unknown_variant_names_the_three(fake_client):
    response = fake_client.get("/v1/videos/video_nope/content", params={"variant": "poster"})
    assert response.status_code == 400
    assert response.json()["error"] == {
        "message": "variant: one of 'video' (the MP4, the default), 'thumbnail' (its middle frame, WebP) or "
                   "'spritesheet' (16 of its frames, JPEG), got 'poster'.",
        "type": "invalid_request_error", "param": "variant", "code": "invalid_parameter"}


def test_sglangs_variant_index_is_said_to_be_the_one_video(fake_client):
    """SGLang's /content?variant=N picks one of a job's outputs; its ?variant=0 is told there is one video."""
    response = fake_client.get("/v1/videos/video_nope/content", params={"variant": "0"})
    assert response.status_code == 400
    assert response.json()["error"]["message"] == (
        "variant: '0' is SGLang's index of a job's outputs; a k6serve job makes one video, served without variant "
        "(or with variant=video).")


@pytest.mark.parametrize(("method", "path", "instead"), [
    ("GET", "/health_generate", "k6serve's liveness check is GET /health (503 while the model loads)."),
    ("GET", "/v1/model_info", "GET /v1/models describes the served model."),
    ("POST", "/v1/images/generations", "Kandinsky 6 makes videos, so there is no image API: create a video job with "
                                       "POST /v1/videos."),
])
def test_sglangs_routes_say_what_serves_them_here(fake_client, method, path, instead):
    """A health check or client moved from SGLang's server got only "There is no route"."""
    response = fake_client.request(method, path)
    assert response.status_code == 404
    assert response.json()["error"]["message"] == (
        f"There is no route {method} {path} on this server; GET /openapi.json lists the routes and their methods. "
        f"{path} is SGLang's route; {instead}")


def test_the_cancel_route_cancels_a_running_job_and_leaves_a_finished_one(fake_server, fake_client):
    """DELETE deletes a finished job (record and video): a client retrying a cancel could delete a video that
    completed meanwhile. POST .../cancel only cancels; on a finished job it is a 409 that changes nothing."""
    held = fake_client.post("/v1/videos", json={"prompt": "hold on", "size": "32x32", "num_frames": 5}).json()
    wait_until(lambda: fake_client.get(f"/v1/videos/{held['id']}").json()["status"] == "in_progress")
    cancelled = fake_client.post(f"/v1/videos/{held['id']}/cancel")
    assert cancelled.status_code == 200 and cancelled.json()["status"] == "cancelled"
    assert "deleted" not in cancelled.json()
    done = wait_for(fake_client, fake_client.post("/v1/videos", json={"prompt": "done", "size": "32x32",
                                                                       "num_frames": 5}).json()["id"])
    for job in (done, cancelled.json()):
        again = fake_client.post(f"/v1/videos/{job['id']}/cancel")
        assert again.status_code == 409
        error = again.json()["error"]
        assert (error["code"], error["param"]) == ("video_finished", "video_id")
        assert error["message"].startswith(f"Video {job['id']!r} has already ended ({job['status']}); nothing to "
                                           "cancel.")
        assert fake_client.get(f"/v1/videos/{job['id']}").json()["status"] == job["status"]
    assert fake_client.get(f"/v1/videos/{done['id']}/content").content[4:8] == b"ftyp"
    missing = fake_client.post("/v1/videos/video_nope/cancel")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "video_not_found"


def test_a_super_resolution_servers_form_says_the_upload_is_the_source_video(tmp_path):
    from harness import start_server

    server = start_server(tmp_path, worker=FakeWorker(VARIANTS["vsr-distilled2steps"]))
    try:
        with server.client() as client:
            form = client.get("/openapi.json").json()["components"]["schemas"]["VideoCreateForm"]["properties"]
        assert form["input_reference"]["description"] == "Uploaded file, used as video_path."
    finally:
        server.stop()
