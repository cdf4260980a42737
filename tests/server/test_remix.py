"""POST /v1/videos/{video_id}/remix: a completed generation job's request again with a new prompt (its settings and
seed kept), as OpenAI's `client.videos.remix` asks (tests/server/test_openai_sdk.py drives it through the SDK)."""

from __future__ import annotations

import errno
import io
import os
from pathlib import Path

import PIL.Image
import pytest
from harness import FakeWorker, start_server, wait_for

from k6serve.models.variants import VARIANTS
from k6serve.serve.artifacts import ArtifactStore
from k6serve.serve.jobs import SqliteJobStore

# HTTP size is OpenAI's "WxH", width first.
SOURCE = {"prompt": "a fox in the snow", "size": "48x32", "seconds": "0.2", "seed": 5, "num_inference_steps": 3,
          "fps": 25}


def _completed(client, body=None, **kwargs) -> dict:
    job = client.post("/v1/videos", json=body or SOURCE, **kwargs).json()
    return wait_for(client, job["id"])


def test_a_remix_runs_the_source_request_with_the_new_prompt(fake_server, fake_client):
    source = _completed(fake_client)
    answer = fake_client.post(f"/v1/videos/{source['id']}/remix", json={"prompt": "a wolf in the snow"})
    assert answer.status_code == 200, answer.text
    remix = answer.json()
    assert remix["id"] != source["id"] and remix["remixed_from_video_id"] == source["id"]
    assert remix["status"] == "queued" and remix["prompt"] == "a wolf in the snow"
    assert (remix["size"], remix["seconds"], remix["seed"]) == ("48x32", source["seconds"], 5)
    assert wait_for(fake_client, remix["id"])["status"] == "completed"
    first, second = fake_server.worker.requests
    assert second.prompt == "a wolf in the snow"
    assert (second.height, second.width) == (32, 48)
    for name in ("seed", "num_frames", "fps", "num_inference_steps", "guidance_scale", "negative_prompt",
                 "max_sequence_length", "expand_prompts"):
        assert getattr(second, name) == getattr(first, name), name
    # the source is as it was, and both are listed
    again = fake_client.get(f"/v1/videos/{source['id']}").json()
    assert again["remixed_from_video_id"] is None and again["prompt"] == SOURCE["prompt"]
    listed = {job["id"]: job["remixed_from_video_id"] for job in fake_client.get("/v1/videos").json()["data"]}
    assert listed == {source["id"]: None, remix["id"]: source["id"]}
    # a remix of a remix keeps the chain's settings; it names its own source
    third = fake_client.post(f"/v1/videos/{remix['id']}/remix", json={"prompt": "a bear"}).json()
    assert third["remixed_from_video_id"] == remix["id"] and third["seed"] == 5


def test_a_drawn_seed_is_the_one_the_remix_runs_with(fake_server, fake_client):
    source = _completed(fake_client, {**SOURCE, "seed": -1})
    remix = fake_client.post(f"/v1/videos/{source['id']}/remix", json={"prompt": "a wolf"}).json()
    assert remix["seed"] == source["seed"] != -1
    wait_for(fake_client, remix["id"])
    assert fake_server.worker.requests[1].seed == fake_server.worker.requests[0].seed == source["seed"]


def test_the_refusals_say_what_to_send(fake_server, fake_client):
    missing = fake_client.post("/v1/videos/video_nope/remix", json={"prompt": "x"})
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "video_not_found"
    held = fake_client.post("/v1/videos", json={**SOURCE, "prompt": "hold"}).json()
    early = fake_client.post(f"/v1/videos/{held['id']}/remix", json={"prompt": "x"})
    assert early.status_code == 409
    error = early.json()["error"]
    assert error["code"] == "video_not_ready" and "a remix takes a completed video" in error["message"]
    fake_server.worker.release.set()
    source = _completed(fake_client)
    url = f"/v1/videos/{source['id']}/remix"
    cases = [
        ({"json": {"prompt": "x", "seed": 3}}, 400, "seed", "A remix takes only prompt, not seed"),
        ({"json": {"prompt": ""}}, 400, "prompt", "prompt is empty"),
        ({"json": {"prompt": "   "}}, 400, "prompt", "prompt is empty"),
        ({"json": {"prompt": 7}}, 400, "prompt", "prompt"),
        ({"json": {}}, 400, "prompt", "prompt"),
        ({"json": ["x"]}, 400, None, "must be a JSON object"),
        ({"json": {"prompt": "x" * 40_000}}, 400, "prompt", "at most 32,768"),
        ({"content": b""}, 400, None, '{"prompt": "The same scene at night, in the rain"}'),
        ({"data": {"prompt": "x"}}, 415, "Content-Type", "remixes take application/json"),
        # over 1 MiB: the prompt's limit, not the create route's "upload files with multipart" (a 415 here)
        ({"json": {"prompt": "x" * (2**20 + 1)}}, 413, None,
         "limited to 1 MiB; a remix's one field, prompt, takes at most 32,768 characters."),
    ]
    for kwargs, status, param, words in cases:
        answer = fake_client.post(url, **kwargs)
        assert answer.status_code == status, (kwargs, answer.text)
        error = answer.json()["error"]
        assert error["param"] == param and words in error["message"], (kwargs, error)
    key = {"Idempotency-Key": "has space"}
    assert fake_client.post(url, json={"prompt": "x"}, headers=key).json()["error"]["code"] == \
        "invalid_idempotency_key"
    # nothing was queued by any of them
    assert len(fake_client.get("/v1/videos").json()["data"]) == 2
    # a failed or cancelled source will never complete: not "poll it" but what to create instead
    failed = _completed(fake_client, {**SOURCE, "prompt": "fail", "seed": 11})
    fake_server.worker.release.clear()
    fake_client.post("/v1/videos", json={**SOURCE, "prompt": "hold"})  # holds the worker: the next one waits
    cancelled = fake_client.post("/v1/videos", json=SOURCE).json()
    assert fake_client.post(f"/v1/videos/{cancelled['id']}/cancel").status_code == 200
    fake_server.worker.release.set()
    for job, status in ((failed, "failed"), (cancelled, "cancelled")):
        assert wait_for(fake_client, job["id"])["status"] == status
        refused = fake_client.post(f"/v1/videos/{job['id']}/remix", json={"prompt": "x"})
        assert refused.status_code == 409
        error = refused.json()["error"]
        assert (error["code"], error["param"]) == ("video_not_ready", "video_id")
        seed = 11 if status == "failed" else 5
        assert error["message"] == (
            f"Video {job['id']!r} is {status} and will never be completed, so there is nothing to remix: create a "
            f"new job with POST /v1/videos with the new prompt, seed {seed} and the source's other settings.")


def test_an_idempotency_key_replays_the_remix(fake_client):
    source = _completed(fake_client)
    url = f"/v1/videos/{source['id']}/remix"
    key = {"Idempotency-Key": "remix-1"}
    first = fake_client.post(url, json={"prompt": "a wolf"}, headers=key)
    replay = fake_client.post(url, json={"prompt": "a wolf"}, headers=key)
    assert replay.json()["id"] == first.json()["id"] and replay.headers["Idempotent-Replayed"] == "true"
    conflict = fake_client.post(url, json={"prompt": "a bear"}, headers=key)
    assert conflict.status_code == 409 and conflict.json()["error"]["code"] == "idempotency_conflict"
    assert len(fake_client.get("/v1/videos").json()["data"]) == 2
    # a retry after the source was deleted still gets its remix (whose answer it lost)
    wait_for(fake_client, first.json()["id"])
    assert fake_client.delete(f"/v1/videos/{source['id']}").status_code == 200
    late = fake_client.post(url, json={"prompt": "a wolf"}, headers=key)
    assert late.status_code == 200 and late.json()["id"] == first.json()["id"]
    assert fake_client.post(url, json={"prompt": "a wolf"}).status_code == 404  # without the key: no source


def _png() -> bytes:
    buffer = io.BytesIO()
    PIL.Image.new("RGB", (48, 32), (200, 40, 10)).save(buffer, format="PNG")
    return buffer.getvalue()


def test_a_job_made_from_an_uploaded_image_remixes_with_its_own_copy_of_the_image(fake_server, fake_client):
    """A completed job keeps its uploaded reference image until it is deleted; the remix runs with a hard link of
    it (its own upload), so deleting the source while the remix waits leaves the remix its image."""
    fields = {k: str(v) for k, v in SOURCE.items()}
    created = fake_client.post("/v1/videos", data=fields, files={"input_reference": ("first.png", _png(),
                                                                                     "image/png")}).json()
    source = wait_for(fake_client, created["id"])
    assert source["status"] == "completed"
    kept = Path(fake_server.worker.requests[-1].image_path)
    assert kept.read_bytes() == _png() and kept.parent == fake_server.artifacts.upload_dir
    fake_server.worker.release.clear()
    fake_client.post("/v1/videos", json={**SOURCE, "prompt": "hold"})  # holds the worker: the remix waits
    answer = fake_client.post(f"/v1/videos/{source['id']}/remix", json={"prompt": "a wolf"})
    assert answer.status_code == 200, answer.text
    remix = answer.json()
    own = fake_server.artifacts.upload_dir / f"{remix['id']}_input_reference.png"
    assert own.read_bytes() == _png() and os.path.samefile(own, kept)  # a link: no bytes copied
    assert fake_client.delete(f"/v1/videos/{source['id']}").status_code == 200
    assert not kept.exists() and own.exists()
    assert fake_client.get(f"/v1/videos/{remix['id']}").json()["status"] == "queued"  # deleted while it waited
    fake_server.worker.release.set()
    assert wait_for(fake_client, remix["id"])["status"] == "completed"
    ran = fake_server.worker.requests[-1]
    assert (ran.prompt, ran.image_path, ran.seed) == ("a wolf", str(own), 5)
    # a remix of the remix, then the remix deleted: each job's file goes with it
    again = fake_client.post(f"/v1/videos/{remix['id']}/remix", json={"prompt": "a bear"}).json()
    assert wait_for(fake_client, again["id"])["status"] == "completed"
    assert fake_client.delete(f"/v1/videos/{remix['id']}").status_code == 200
    assert sorted(path.name for path in fake_server.artifacts.upload_dir.iterdir()) == [
        f"{again['id']}_input_reference.png"]
    assert fake_server.worker.requests[-1].image_path.endswith(f"{again['id']}_input_reference.png")


def test_without_hard_links_the_remix_copies_the_image(fake_server, fake_client, monkeypatch):
    fields = {k: str(v) for k, v in SOURCE.items()}
    created = fake_client.post("/v1/videos", data=fields, files={"input_reference": ("first.png", _png(),
                                                                                     "image/png")}).json()
    source = wait_for(fake_client, created["id"])

    def no_links(*args, **kwargs):
        raise OSError(errno.EPERM, "Operation not permitted")

    kept = Path(fake_server.worker.requests[-1].image_path)
    monkeypatch.setattr(os, "link", no_links)
    remix = fake_client.post(f"/v1/videos/{source['id']}/remix", json={"prompt": "a wolf"}).json()
    own = fake_server.artifacts.upload_dir / f"{remix['id']}_input_reference.png"
    assert own.read_bytes() == kept.read_bytes() == _png() and not os.path.samefile(own, kept)
    assert not list(fake_server.artifacts.upload_dir.glob(".*.part"))
    assert wait_for(fake_client, remix["id"])["status"] == "completed"


def test_a_source_whose_upload_is_gone_is_refused_with_what_to_send(fake_server, fake_client):
    """A job that completed under a server that deleted uploads when their job ended (or whose file was removed):
    the 400 says to upload the image again in a new job, with the seed to give it."""
    fields = {k: str(v) for k, v in SOURCE.items()}
    created = fake_client.post("/v1/videos", data=fields, files={"input_reference": ("first.png", _png(),
                                                                                     "image/png")}).json()
    source = wait_for(fake_client, created["id"])
    assert source["status"] == "completed"
    Path(fake_server.worker.requests[-1].image_path).unlink()
    refused = fake_client.post(f"/v1/videos/{source['id']}/remix", json={"prompt": "a wolf"})
    assert refused.status_code == 400
    error = refused.json()["error"]
    assert (error["code"], error["param"]) == ("invalid_request", "video_id")
    assert "uploaded reference image that the server no longer has" in error["message"]
    assert "uploading the image again (input_reference), with the new prompt, seed 5" in error["message"]
    assert len(fake_client.get("/v1/videos").json()["data"]) == 1
    assert list(fake_server.artifacts.upload_dir.iterdir()) == []


def test_copy_upload_of_a_deleted_file_raises_and_leaves_nothing(tmp_path):
    """The remix answers 404 when the source was deleted between its lookup and the copy (FileNotFoundError)."""
    artifacts = ArtifactStore(tmp_path / "outputs")
    with pytest.raises(FileNotFoundError):
        artifacts.copy_upload(artifacts.upload_dir / "video_gone_input_reference.png", "video_new", "input_reference")
    assert list(artifacts.upload_dir.iterdir()) == []


def test_a_server_side_reference_image_is_checked_again(tmp_path):
    """The path is checked against --allowed-input-dir as the server has it now: a remix on a server restarted
    without the image's folder is refused, naming the source."""
    image = tmp_path / "inputs" / "first.png"
    image.parent.mkdir()
    image.write_bytes(_png())
    server = start_server(tmp_path)
    with server.client() as client:
        source = _completed(client, {**SOURCE, "image_path": str(image)})
        remix = client.post(f"/v1/videos/{source['id']}/remix", json={"prompt": "a wolf"}).json()
        assert wait_for(client, remix["id"])["status"] == "completed"
        assert server.worker.requests[-1].image_path == str(image.resolve())
    server.stop()
    other = tmp_path / "elsewhere"
    other.mkdir()
    server = start_server(tmp_path, allowed_input_dirs=(other,))
    with server.client() as client:
        refused = client.post(f"/v1/videos/{source['id']}/remix", json={"prompt": "a bear"})
        assert refused.status_code == 400
        error = refused.json()["error"]
        assert error["param"] == "video_id" and error["code"] == "path_not_allowed"
        assert error["message"].startswith("The source job's reference image can no longer be read: image_path")
        # the remix made before the restart still names its source
        assert client.get(f"/v1/videos/{remix['id']}").json()["remixed_from_video_id"] == source["id"]
    server.stop()
    store = SqliteJobStore(tmp_path / "jobs.sqlite3")
    assert store.get(remix["id"]).remixed_from_video_id == source["id"]
    store.close()


def test_a_super_resolution_server_has_nothing_to_remix(tmp_path):
    server = start_server(tmp_path, worker=FakeWorker(VARIANTS["vsr-distilled2steps"]))
    with server.client() as client:
        refused = client.post("/v1/videos/video_any/remix", json={"prompt": "x"})
        assert refused.status_code == 400 and "whose jobs read no prompt" in refused.json()["error"]["message"]
    server.worker.release.set()
    server.stop()
