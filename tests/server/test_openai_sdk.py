"""The official OpenAI Python SDK (`pip install openai`) drives the server as it drives OpenAI's video API.

Most tests run the SDK against the fast fake worker; one runs the built-in `demo` checkpoint end to end. Every
response is checked through the SDK's own models (`model_dump()`), which is what an SDK user reads.
"""

from __future__ import annotations

import io
import json
import time
from pathlib import Path

import av
import numpy as np
import PIL.Image
import pytest
from harness import FakeWorker, start_server
from PIL import Image

from k6serve.models.variants import VARIANTS

openai = pytest.importorskip("openai")

# The SDK marks its video methods deprecated (OpenAI's Sora service ends in 2026); the calls themselves still work.
pytestmark = pytest.mark.filterwarnings("ignore:The Sora API:DeprecationWarning")
API_KEY = "sdk-test-key"
GENERATION_MODEL = VARIANTS["pro-distill"].hub_id


def _png(width: int = 48, height: int = 32) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(np.linspace(0, 255, width * height * 3).reshape(height, width, 3).astype(np.uint8)).save(
        buffer, format="PNG")
    return buffer.getvalue()


def _client(server, api_key: str = API_KEY):
    # No retries: a test must see the first answer (the SDK's default retries would hide a 5xx behind a delay).
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=api_key, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def sdk_server(tmp_path_factory):
    server = start_server(tmp_path_factory.mktemp("sdk"), api_key=API_KEY)
    yield server
    server.worker.release.set()
    server.stop()


@pytest.fixture
def client(sdk_server):
    with _client(sdk_server) as client:
        yield client


def test_create_poll_download_delete(sdk_server, client, tmp_path):
    created = client.videos.create(prompt="A cat plays the piano", size="96x64", seconds="1")
    fields = created.model_dump()
    assert fields["object"] == "video" and fields["status"] in ("queued", "in_progress")
    assert fields["id"].startswith("video_") and fields["model"] == GENERATION_MODEL
    assert fields["prompt"] == "A cat plays the piano"  # OpenAI's Video.prompt; it read None before
    assert isinstance(fields["created_at"], int) and abs(fields["created_at"] - time.time()) < 60
    # OpenAI's size is width first; one second at 24 fps is 24 frames, rounded to the model's 4k+1: 25 frames.
    assert fields["size"] == "96x64" and fields["seconds"] == f"{25 / 24:g}"
    assert fields["completed_at"] is None and fields["expires_at"] is None and fields["error"] is None

    done = client.videos.poll(created.id, poll_interval_ms=20).model_dump()
    assert done["status"] == "completed" and done["progress"] == 100 and done["error"] is None
    assert isinstance(done["completed_at"], int) and done["completed_at"] >= done["created_at"]
    assert done["expires_at"] == done["completed_at"] + int(sdk_server.settings.output_ttl_s)
    request = sdk_server.worker.requests[-1]
    assert (request.width, request.height, request.num_frames) == (96, 64, 25)

    content = client.videos.download_content(created.id, variant="video")
    assert content.content[4:8] == b"ftyp"
    content.write_to_file(tmp_path / "out.mp4")
    with av.open(str(tmp_path / "out.mp4")) as container:
        assert container.streams.video[0].codec_context.name == "h264"
    assert client.videos.download_content(created.id).content == content.content  # variant defaults to video
    # The SDK's two other variants: a WebP of the middle frame and a JPEG of up to 16 frames in rows of 4 (the fake
    # worker's MP4 is 5 frames of 16x16).
    thumbnail = PIL.Image.open(io.BytesIO(client.videos.download_content(created.id, variant="thumbnail").content))
    assert (thumbnail.format, thumbnail.size) == ("WEBP", (16, 16))
    sheet = PIL.Image.open(io.BytesIO(client.videos.download_content(created.id, variant="spritesheet").content))
    assert (sheet.format, sheet.size) == ("JPEG", (4 * 16, 2 * 16))

    deleted = client.videos.delete(created.id)
    assert deleted.model_dump() == {"id": created.id, "deleted": True, "object": "video.deleted"}
    with pytest.raises(openai.NotFoundError) as missing:
        client.videos.retrieve(created.id)
    assert missing.value.status_code == 404 and missing.value.code == "video_not_found"
    # The SDK's message is "Error code: 404 - " + ours; the body holds ours as sent.
    assert missing.value.message == f"Error code: 404 - Video {created.id!r} not found."


def test_create_and_poll_and_our_extensions_through_extra_body(sdk_server, client):
    video = client.videos.create_and_poll(
        prompt="A dog runs", model=GENERATION_MODEL, size="64x32", seconds="0.2", poll_interval_ms=20,
        extra_body={"seed": 7, "num_inference_steps": 3, "request_id": "sdk-extras-1"},
        extra_headers={"Idempotency-Key": "sdk-extras-key"})
    assert video.model_dump()["status"] == "completed" and video.id == "sdk-extras-1"
    assert video.size == "64x32" and video.seconds == f"{5 / 24:g}"
    # Fields beyond OpenAI's reach the user through the SDK's model too.
    assert video.model_extra["warnings"] == [] and video.model_extra["url"] == "/v1/videos/sdk-extras-1/content"
    request = sdk_server.worker.requests[-1]
    assert (request.seed, request.num_inference_steps, request.width, request.height) == (7, 3, 64, 32)
    replay = client.videos.with_raw_response.create(
        prompt="A dog runs", model=GENERATION_MODEL, size="64x32", seconds="0.2",
        extra_body={"seed": 7, "num_inference_steps": 3, "request_id": "sdk-extras-1"},
        extra_headers={"Idempotency-Key": "sdk-extras-key"})
    assert replay.headers["Idempotent-Replayed"] == "true" and replay.parse().id == "sdk-extras-1"


def test_list_pages_through_the_sdk_auto_paging_iterator(client):
    ids = [client.videos.create(prompt=f"page {i}", size="32x32", seconds="0.2",
                                extra_body={"request_id": f"sdk-page-{i}"}).id for i in range(5)]
    for video_id in ids:
        client.videos.poll(video_id, poll_interval_ms=20)
    first = client.videos.list(limit=2, order="asc", after=ids[0])
    assert [video.id for video in first.data] == ids[1:3]
    assert first.has_more is True and first.last_id == ids[2] and first.has_next_page()
    assert all(video.object == "video" and video.status == "completed" for video in first.data)
    # The iterator follows `last_id` as `after` with the same limit and order, until has_more is false.
    listed = [video.id for video in client.videos.list(limit=2, order="asc")]
    assert [video_id for video_id in listed if video_id in ids] == ids
    newest_first = [video.id for video in client.videos.list(limit=2)]
    assert newest_first == listed[::-1]
    last = client.videos.list(limit=2, order="asc", after=ids[3])
    assert [video.id for video in last.data] == ids[4:] and last.has_more is False and not last.has_next_page()


def test_errors_are_the_sdks_exceptions_with_our_messages(sdk_server, client):
    with pytest.raises(openai.NotFoundError) as unknown:
        client.videos.retrieve("video_nope")
    assert unknown.value.body == {"message": "Video 'video_nope' not found.", "type": "not_found_error",
                                  "param": "video_id", "code": "video_not_found"}

    with pytest.raises(openai.BadRequestError) as bad_size:
        client.videos.create(prompt="x", size="100x64")
    assert bad_size.value.param == "size" and bad_size.value.code == "invalid_parameter"
    assert "width must be a positive multiple of 16" in bad_size.value.message
    assert "size '100x64' (width x height)" in bad_size.value.message

    with pytest.raises(openai.BadRequestError) as sora_model:
        client.videos.create(prompt="x", model="sora-2")
    assert sora_model.value.code == "model_not_found"
    assert f"use {GENERATION_MODEL!r} or omit model" in sora_model.value.message  # the listed id, in its case

    with pytest.raises(openai.NotFoundError) as thumbnail:  # a job's thumbnail is looked up as its video is
        client.videos.download_content("video_nope", variant="thumbnail")
    assert thumbnail.value.code == "video_not_found"

    with _client(sdk_server, api_key="wrong-key") as stranger, pytest.raises(openai.AuthenticationError) as auth:
        stranger.videos.list()
    assert auth.value.code == "invalid_api_key" and "--api-key" in auth.value.message


def test_the_sdks_models_calls(client):
    (listed,) = client.models.list().data
    assert listed.id == GENERATION_MODEL
    # retrieve() answered 404 "unknown route"; the SDK sends the hub id's slash as it is.
    assert client.models.retrieve(GENERATION_MODEL).id == GENERATION_MODEL
    assert client.models.retrieve(GENERATION_MODEL.split("/")[-1]).id == GENERATION_MODEL
    with pytest.raises(openai.NotFoundError) as missing:
        client.models.retrieve("sora-2")
    assert missing.value.code == "model_not_found"


def test_the_sdks_remix_and_the_calls_the_server_does_not_serve(client):
    video = client.videos.create(prompt="remix me", size="32x32", seconds="0.2", extra_body={"seed": 9})
    with pytest.raises(openai.ConflictError) as early:  # OpenAI's remix takes a completed video
        client.videos.remix(video.id, prompt="again")
    assert early.value.code == "video_not_ready" and "poll GET /v1/videos/" in early.value.message
    video = client.videos.poll(video.id, poll_interval_ms=20)
    remix = client.videos.remix(video.id, prompt="again")
    assert remix.remixed_from_video_id == video.id and remix.prompt == "again" and remix.id != video.id
    assert (remix.size, remix.seconds, remix.model_extra["seed"]) == ("32x32", video.seconds, 9)
    assert client.videos.poll(remix.id, poll_interval_ms=20).status == "completed"
    with pytest.raises(openai.NotFoundError) as missing:
        client.videos.remix("video_nope", prompt="again")
    assert missing.value.code == "video_not_found"
    # POST /v1/videos/edits (extensions, characters) matches the job route's path: it was a 405 "does not take
    # POST", for which the SDK has no error class; a 404 is its NotFoundError.
    clip = ("clip.mp4", b"\0", "video/mp4")
    for name, call in (("edits", lambda: client.videos.edit(prompt="again", video=clip)),
                       ("extensions", lambda: client.videos.extend(prompt="on", seconds="4", video=clip)),
                       ("characters", lambda: client.videos.create_character(name="cat", video=clip))):
        with pytest.raises(openai.NotFoundError) as unserved:
            call()
        assert unserved.value.code == "not_found"
        assert f"There is no route POST /v1/videos/{name} on this server" in unserved.value.message
        assert "delete and remix, not edits, extensions or characters" in unserved.value.message


def test_a_conflict_is_not_retried(sdk_server):
    # The SDK retries a 409 unless the server says not to; ours (request_id, Idempotency-Key) never resolve.
    with openai.OpenAI(base_url=f"{sdk_server.base_url}/v1", api_key=API_KEY, max_retries=2) as retrying:
        retrying.videos.create(prompt="first", size="32x32", seconds="0.2", extra_body={"request_id": "sdk-409"})
        with pytest.raises(openai.ConflictError) as conflict:
            retrying.videos.create(prompt="second", size="32x32", seconds="0.2",
                                   extra_body={"request_id": "sdk-409"})
    assert conflict.value.code == "request_id_conflict" and conflict.value.param == "request_id"
    # The request that raised was the first try: a retried call raises from its last, whose count is 1 or 2 (the
    # count, not a time limit: under `pytest -n 2` one request alone can take longer than the SDK's 0.5 s backoff).
    assert conflict.value.request.headers["x-stainless-retry-count"] == "0"


def test_delete_cancels_a_running_job_then_deletes_it(sdk_server, client):
    held = client.videos.create(prompt="hold on", size="32x32", seconds="0.2")
    deadline = time.monotonic() + 10
    while client.videos.retrieve(held.id).status != "in_progress":
        assert time.monotonic() < deadline
        time.sleep(0.02)
    # Cancelled, then deleted once stopped: one call, as Sora cleanup code expects (it took a second delete()).
    deleted = client.videos.delete(held.id)
    assert deleted.model_dump() == {"id": held.id, "deleted": True, "object": "video.deleted"}
    with pytest.raises(openai.NotFoundError):
        client.videos.retrieve(held.id)
    # Cancel-only is our own route; "cancelled" is not among the SDK's statuses: poll returns it rather than
    # waiting forever.
    kept = client.videos.create(prompt="hold on", size="32x32", seconds="0.2")
    assert client.post(f"/videos/{kept.id}/cancel", cast_to=object)["status"] == "cancelled"
    polled = client.videos.poll(kept.id, poll_interval_ms=20)
    assert polled.status == "cancelled" and polled.error.code == "cancelled"
    assert client.videos.delete(kept.id).deleted is True


def test_an_unfinished_job_carries_the_poll_hint_the_sdk_reads(sdk_server, client):
    held = client.videos.create(prompt="hold on", size="32x32", seconds="0.2")
    raw = client.videos.with_raw_response.retrieve(held.id)
    # The SDK's poll() sleeps this long between retrieves (it read no header and slept 1 s).
    assert 500 <= int(raw.headers["openai-poll-after-ms"]) <= 10_000
    client.post(f"/videos/{held.id}/cancel", cast_to=object)
    assert "openai-poll-after-ms" not in client.videos.with_raw_response.retrieve(held.id).headers
    client.videos.delete(held.id)


def test_the_poll_hint_follows_the_recent_jobs_time():
    from k6serve.serve.job_outcomes import JobOutcomes
    from k6serve.serve.runner import JobRunner

    runner = JobRunner.__new__(JobRunner)  # only the durations are read
    runner.outcomes = JobOutcomes.__new__(JobOutcomes)
    runner.outcomes.recent_durations = []
    assert runner.poll_after_ms() == 1000  # nothing finished yet: the SDK's own default
    runner.outcomes.recent_durations = [60.0, 64.0]
    assert runner.poll_after_ms() == 3100  # a twentieth of about a minute
    runner.outcomes.recent_durations = [0.2]
    assert runner.poll_after_ms() == 500
    runner.outcomes.recent_durations = [1800.0]
    assert runner.poll_after_ms() == 10_000


def test_objects_in_extra_body_arrive_folded_from_the_sdks_bracketed_fields(sdk_server, client):
    # The SDK sends a create as multipart and flattens an object: cache_dit_params[Fn_compute_blocks]=2. Each was a
    # 400 "Unknown field 'cache_dit_params[Fn_compute_blocks]'".
    video = client.videos.create(prompt="cached", size="32x32", seconds="0.2", extra_body={"cache_dit_params": {
        "Fn_compute_blocks": 2, "scm_preset": "fast", "enable_taylorseer": True, "residual_diff_threshold": 0.1}})
    client.videos.poll(video.id, poll_interval_ms=20)
    cache = sdk_server.worker.requests[-1].cache_dit
    assert (cache.Fn_compute_blocks, cache.scm_preset, cache.enable_taylorseer, cache.residual_diff_threshold) == (
        2, "fast", True, 0.1)
    # loras[ghost]=1.0 is read as loras: the answer is about the adapter, not an unknown field.
    with pytest.raises(openai.BadRequestError) as ghost:
        client.videos.create(prompt="styled", size="32x32", seconds="0.2", extra_body={"loras": {"ghost": 1.0}})
    assert ghost.value.param == "loras" and "ghost" in ghost.value.message
    assert ghost.value.code in ("lora_not_loaded", "invalid_parameter")
    # A list inside is repeated fields the server does not read: the answer says to send JSON text, which works.
    bins = {"scm_compute_bins": [4, 2, 2], "scm_cache_bins": [1, 2]}
    with pytest.raises(openai.BadRequestError) as listed:
        client.videos.create(prompt="x", size="32x32", seconds="0.2", extra_body={"cache_dit_params": bins})
    assert listed.value.param == "cache_dit_params"
    assert 'extra_body={"cache_dit_params": json.dumps({...})}' in listed.value.message
    video = client.videos.create(prompt="binned", size="32x32", seconds="0.2",
                                 extra_body={"cache_dit_params": json.dumps(bins)})
    client.videos.poll(video.id, poll_interval_ms=20)
    assert sdk_server.worker.requests[-1].cache_dit is not None


def test_a_failed_job_carries_the_sdks_error_object(client):
    failed = client.videos.create_and_poll(prompt="fail please", size="32x32", seconds="0.2", poll_interval_ms=20)
    assert failed.status == "failed" and failed.completed_at is not None
    assert failed.error.model_dump(exclude_none=True) == {"code": "generation_failed",
                                                          "message": "RuntimeError: fake worker failure"}
    with pytest.raises(openai.NotFoundError) as no_content:
        client.videos.download_content(failed.id)
    assert no_content.value.code == "video_not_ready" and "create a new job" in no_content.value.message


def test_image_input_reference_is_the_ti2av_image(sdk_server, client, tmp_path):
    image = tmp_path / "first_frame.png"
    image.write_bytes(_png())
    for reference in (image, ("first.png", _png(), "image/png")):  # a path, or (name, bytes, type)
        video = client.videos.create_and_poll(prompt="It comes alive", size="48x32", seconds="0.2",
                                              input_reference=reference, poll_interval_ms=20)
        assert video.status == "completed"
        # The upload became the conditioning image (kept with the completed job, for a remix).
        assert sdk_server.worker.requests[-1].image_path.endswith("_input_reference.png")
    with pytest.raises(openai.BadRequestError) as not_an_image:
        client.videos.create(prompt="x", input_reference=("clip.mp4", b"not a picture", "video/mp4"))
    assert not_an_image.value.param == "input_reference"


def test_super_resolution_takes_the_video_as_input_reference(tmp_path):
    from k6serve.testing.clips import make_clip

    server = start_server(tmp_path, worker=FakeWorker(VARIANTS["vsr-distilled2steps"]))
    clip = make_clip(tmp_path / "source.mp4", width=96, height=64, num_frames=9, fps=24)
    try:
        with _client(server, api_key="any key: the server has none") as client:
            # The SDK requires a prompt; super-resolution ignores it. The scale is ours, through extra_body.
            video = client.videos.create_and_poll(prompt="", input_reference=clip, poll_interval_ms=20,
                                                  extra_body={"sr_resolution_scale": 2})
            assert video.status == "completed" and video.model == VARIANTS["vsr-distilled2steps"].hub_id
            assert video.prompt is None
            # A prompt sent all the same is ignored (a note says so), and not shown as the job's.
            told = client.videos.create_and_poll(prompt="make it sharp", input_reference=clip, poll_interval_ms=20,
                                                 extra_body={"sr_resolution_scale": 2})
            assert told.status == "completed" and told.prompt is None
            assert any("takes no prompt" in note for note in told.model_extra["warnings"])
            request = server.worker.requests[-1]
            assert request.scale == 2
            assert Path(request.video_path).name.endswith("_input_reference.mp4")
            with pytest.raises(openai.BadRequestError) as sized:
                client.videos.create(prompt="", input_reference=clip, size="192x128")
            assert sized.value.param == "size" and "sr_resolution_scale" in sized.value.message
            # No source: the answer named the CLI's --video-path first, not the SDK's input_reference.
            with pytest.raises(openai.BadRequestError) as sourceless:
                client.videos.create(prompt="upscale")
            assert sourceless.value.param == "video_path" and "--video-path" not in sourceless.value.message
            assert sourceless.value.message.endswith(
                "Super-resolution needs a source video: upload it as input_reference (OpenAI's SDK: "
                'input_reference=Path("input.mp4")) or video_reference in multipart/form-data, or give a '
                "server-side video_path inside --allowed-input-dir.")
    finally:
        server.stop()


@pytest.mark.slow
def test_demo_checkpoint_end_to_end(tmp_path):
    """The real engine on the built-in demo checkpoint: the SDK's MP4 has the requested width x height."""
    from k6serve.engine_arguments import build_engine_config
    from k6serve.runtime.engine import Engine

    server = start_server(tmp_path, engine=Engine(build_engine_config("demo", device="cpu")), api_key=API_KEY)
    try:
        with _client(server) as client:
            video = client.videos.create_and_poll(prompt="A woman chops vegetables", size="64x48", seconds="0.2",
                                                  poll_interval_ms=50, timeout=120)
            assert video.model_dump(include={"status", "progress", "size", "seconds", "model"}) == {
                "status": "completed", "progress": 100, "size": "64x48", "seconds": f"{5 / 24:g}", "model": "demo"}
            path = tmp_path / "demo.mp4"
            client.videos.download_content(video.id).write_to_file(path)
            with av.open(str(path)) as container:
                frames = np.stack([frame.to_ndarray(format="rgb24") for frame in container.decode(video=0)])
                assert container.streams.audio, "the demo generates audio too"
            assert frames.shape == (5, 48, 64, 3)  # (frames, height, width, RGB): size is width first
            assert client.videos.delete(video.id).deleted is True
    finally:
        server.stop()
