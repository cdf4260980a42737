"""A job's own `loras` checked at creation: a nickname the worker will not hold when the job runs is a 400, judged
against the adapters held now plus those the LoRA operations queued before the job will load (they run first); so is
a job with its own `loras` ({} included) while the server's adapters will be merged then.

The real worker on the tiny distilled checkpoint runs the jobs (a job whose adapter is missing fails when it starts,
so one that completes ran with it); a prompt with "hold" waits for `release` before running, to keep a job running
while LoRA operations queue behind it. The strength bound's 400s use the fast fake worker.
"""

from __future__ import annotations

import io
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from harness import FakeWorker, start_server, wait_for, wait_until
from PIL import Image

from k6serve.engine_arguments import build_engine_config
from k6serve.lora.spec import ReplicasDisagree
from k6serve.models.variants import VARIANTS
from k6serve.runtime.engine import Engine
from k6serve.runtime.worker import ModelWorker
from k6serve.testing.lora_adapters import module_shapes, write_lora_adapter

pytestmark = pytest.mark.usefixtures("one_torch_thread")

JOB = {"prompt": "a fox in the snow", "size": "32x32", "num_frames": 5, "num_inference_steps": 2, "seed": 7}
TARGETS = ("visual_transformer_blocks.0.video_dec_block.self_attention.to_key",
           "visual_transformer_blocks.0.video_dec_block.feed_forward.net.0.proj")


class HeldWorker(ModelWorker):
    """The real worker; a prompt with "hold" waits for `release` first. `log`: request starts and LoRA operations."""

    def __init__(self, config) -> None:
        super().__init__(config)
        self.release = threading.Event()
        self.log: list[str] = []

    def run(self, params, output, on_step=None):
        self.log.append(f"start {params.prompt}")
        if "hold" in (params.prompt or ""):
            self.release.wait(60)
        return super().run(params, output, on_step)

    def apply_lora_operation(self, operation) -> dict:
        result = super().apply_lora_operation(operation)
        self.log.append(type(operation).__name__)
        return result


def _adapter(folder: Path, transformer: torch.nn.Module, seed: int, amplitude: float = 0.5) -> str:
    """A rank-2 diffusers-style adapter on `TARGETS` of the tiny DiT (amplitude 1e10: it overflows at strength 100)."""
    return str(write_lora_adapter(folder / f"adapter_{seed}.safetensors", module_shapes(transformer, TARGETS),
                                  seed=seed, amplitude=amplitude))


def _start(server_distill_dir: Path, root: Path, db_path: Path | None = None):
    worker = HeldWorker(build_engine_config(str(server_distill_dir), device="cpu", attention_backend="sdpa"))
    server = start_server(root, engine=Engine(worker.config, worker=worker), db_path=db_path)
    return server, worker


@pytest.fixture
def real_server(server_distill_dir, tmp_path):
    server, worker = _start(server_distill_dir, tmp_path / "server")
    yield server, worker
    worker.release.set()
    server.stop()


def _set_lora(client, nickname: str, path: str | None) -> None:
    body = {"lora_nickname": nickname, "lora_path": path, "merge_mode": "dynamic"}
    response = client.post("/v1/set_lora", json=body)
    assert response.status_code == 200, response.text


def _not_loaded(response) -> str:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["code"], error["param"], error["type"]) == ("lora_not_loaded", "loras", "invalid_request_error")
    return error["message"]


def _png() -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(np.linspace(0, 255, 32 * 32 * 3).reshape(32, 32, 3).astype(np.uint8)).save(buffer, "PNG")
    return buffer.getvalue()


def test_an_adapter_not_loaded_is_a_400_that_creates_nothing(real_server, tmp_path):
    server, worker = real_server
    with server.client() as client:
        held = client.post("/v1/videos", json={**JOB, "prompt": "hold on"}).json()
        wait_until(lambda: "start hold on" in worker.log)
        queued = client.post("/v1/videos", json=JOB).json()
        before = client.get("/v1/videos").json()["data"]
        message = _not_loaded(client.post("/v1/videos", json={**JOB, "loras": {"ghost": 1.0}},
                                          headers={**server.headers, "Idempotency-Key": "ghost-job"}))
        assert message == (
            "loras names LoRA adapter(s) ['ghost'] that this server will not have loaded when the job runs (no "
            'adapter is loaded). Load one first with POST /v1/set_lora {"lora_nickname": "ghost", "lora_path": '
            '"/path/to/adapter.safetensors", "merge_mode": "dynamic"}, or start the server with --lora-path FILE '
            "--lora-nickname ghost --lora-merge-mode dynamic (dynamic: a job's own adapters need the server's "
            "unmerged); the job was not created.")
        form = {**{key: str(value) for key, value in JOB.items()}, "loras": '{"ghost": 1}'}
        _not_loaded(client.post("/v1/videos", data=form, files={"input_reference": ("first.png", _png(), "image/png")}))
        # Nothing created, the queue as it was, the upload removed, the Idempotency-Key still free.
        assert client.get("/v1/videos").json()["data"] == before
        assert server.store.queued_ids() == [queued["id"]]
        assert list(server.artifacts.upload_dir.iterdir()) == []
        worker.release.set()
        for job in (held, queued):
            assert wait_for(client, job["id"], timeout=120)["status"] == "completed"

        _set_lora(client, "style", _adapter(tmp_path, worker.pipeline.models.transformer, seed=1))
        message = _not_loaded(client.post("/v1/videos", json={**JOB, "loras": {"style": 0.5, "ghost": 1.0}}))
        assert message.startswith("loras names LoRA adapter(s) ['ghost'] that this server will not have loaded when "
                                  "the job runs (loaded: 'style'). Load one first")
        created = client.post("/v1/videos", json={**JOB, "loras": {"style": 0.5}},
                              headers={**server.headers, "Idempotency-Key": "ghost-job"})
        assert created.status_code == 200 and "Idempotent-Replayed" not in created.headers, created.text
        assert wait_for(client, created.json()["id"], timeout=120)["status"] == "completed"


def test_an_adapter_a_queued_set_lora_loads_counts_and_the_job_runs_with_it(real_server, tmp_path):
    server, worker = real_server
    transformer = worker.pipeline.models.transformer
    style, other = _adapter(tmp_path, transformer, seed=1), _adapter(tmp_path, transformer, seed=2)
    runner = server.app.state.ctx.runner
    answers: dict[str, object] = {}

    def set_lora(nickname: str, path: str) -> None:
        with server.client() as own:
            answers[nickname] = own.post("/v1/set_lora", json={"lora_nickname": nickname, "lora_path": path,
                                                               "merge_mode": "dynamic"})

    with server.client() as client:
        base = client.post("/v1/videos", json={**JOB, "prompt": "hold the base"}).json()
        wait_until(lambda: "start hold the base" in worker.log)
        # Nothing queued: the dispatcher takes the set_lora at once, and it waits in the engine for the running job.
        threads = [threading.Thread(target=set_lora, args=("style", style))]
        threads[0].start()
        wait_until(lambda: runner._applying_lora is not None)
        with_style = client.post("/v1/videos", json={**JOB, "loras": {"style": 0.8}})
        assert with_style.status_code == 200, with_style.text
        # Behind that job, the next set_lora stays in the runner's queue.
        threads.append(threading.Thread(target=set_lora, args=("other", other)))
        threads[1].start()
        wait_until(lambda: runner._pending_loras)
        with_both = client.post("/v1/videos", json={**JOB, "loras": {"style": 0.8, "other": 0.5}})
        assert with_both.status_code == 200, with_both.text
        message = _not_loaded(client.post("/v1/videos", json={**JOB, "loras": {"ghost": 1.0}}))
        assert "(no adapter is loaded; set_lora requests queued before this job load 'other', 'style')" in message
        assert "SetLora" not in worker.log
        worker.release.set()
        for thread in threads:
            thread.join(120)
        assert all(answers[name].status_code == 200 for name in ("style", "other")), answers
        done = [wait_for(client, job["id"], timeout=120) for job in (base, with_style.json(), with_both.json())]
        assert [job["status"] for job in done] == ["completed"] * 3, done
        contents = {client.get(f"/v1/videos/{job['id']}/content").content for job in done}
        assert len(contents) == 3  # each ran with its own adapters
    assert worker.log == ["start hold the base", "SetLora", "start a fox in the snow", "SetLora",
                          "start a fox in the snow"]


def test_deactivated_adapters_stay_loaded_across_a_restart(server_distill_dir, tmp_path):
    """Deactivating (unmerge, or set_lora with no adapter) keeps an adapter loaded, so a job may still name it; a
    restart loads every adapter again (it rebuilt only the last set_lora's, and a job queued before it naming an
    earlier one failed when it started), with only the last set_lora's active."""
    db = tmp_path / "jobs.sqlite3"
    server, worker = _start(server_distill_dir, tmp_path / "one", db_path=db)
    try:
        with server.client() as client:
            transformer = worker.pipeline.models.transformer
            _set_lora(client, "old", _adapter(tmp_path, transformer, seed=1))
            _set_lora(client, "style", _adapter(tmp_path, transformer, seed=2))
            assert client.post("/v1/unmerge_lora_weights").status_code == 200
            assert client.post("/v1/set_lora", json={"lora_nickname": []}).status_code == 200
            job = client.post("/v1/videos", json={**JOB, "loras": {"old": 1.0, "style": 1.0}})
            assert job.status_code == 200, job.text
            assert wait_for(client, job.json()["id"], timeout=120)["status"] == "completed"
            _set_lora(client, "style", None)  # active after the restart: this set_lora's adapter
    finally:
        server.stop()
    server, worker = _start(server_distill_dir, tmp_path / "two", db_path=db)
    try:
        with server.client() as client:
            rows = {row["nickname"]: row["active"] for row in client.get("/v1/list_loras").json()["loras"]}
            assert rows == {"style": True, "old": False}
            job = client.post("/v1/videos", json={**JOB, "loras": {"old": 1.0}})
            assert job.status_code == 200, job.text
            assert wait_for(client, job.json()["id"], timeout=120)["status"] == "completed"
    finally:
        server.stop()


def test_a_job_whose_adapter_overflows_the_latents_fails_naming_its_strength(real_server, tmp_path):
    server, worker = real_server
    with server.client() as client:
        _set_lora(client, "huge", _adapter(tmp_path, worker.pipeline.models.transformer, seed=3, amplitude=1e10))
        assert client.post("/v1/unmerge_lora_weights").status_code == 200  # loaded, not active
        plain = client.post("/v1/videos", json=JOB).json()
        overflowed = client.post("/v1/videos", json={**JOB, "loras": {"huge": 100}}).json()
        again = client.post("/v1/videos", json=JOB).json()
        failed = wait_for(client, overflowed["id"], timeout=120)
        assert failed["status"] == "failed" and failed["error"] == {
            "code": "invalid_request",
            "message": "the denoised latents hold NaN or infinite values, so no video or audio can be decoded from "
                       "them; the likely cause is the LoRA strength ('huge' at strength 100; adapters are used at "
                       "about -2 to 2): lower it in this request's loras, or leave the adapter out."}, failed
        # The next job runs on the weights as before: the same video as the one before the failure.
        assert [wait_for(client, job["id"], timeout=120)["status"] for job in (plain, again)] == ["completed"] * 2
        contents = [client.get(f"/v1/videos/{job['id']}/content").content for job in (plain, again)]
        assert contents[0] == contents[1]


class DisagreeingWorker(FakeWorker):
    """A fake dp server: set_lora of "split" succeeds on some replicas only."""

    def __init__(self) -> None:
        super().__init__(VARIANTS["pro-distill"])

    def apply_lora_operation(self, operation) -> dict:
        if any(spec.nickname == "split" for spec in getattr(operation, "specs", ())):
            raise ReplicasDisagree("SetLora succeeded on replica(s) [0] but failed on replica(s) [1], ...")
        return {"status": "ok", "message": "done", "loras": []}


def test_an_adapter_only_some_replicas_loaded_is_left_to_the_job_start(tmp_path):
    server = start_server(tmp_path, worker=DisagreeingWorker())
    try:
        with server.client() as client:
            split = client.post("/v1/set_lora", json={"lora_nickname": "split", "lora_path": "/a.safetensors"})
            assert split.status_code == 500 and split.json()["error"]["code"] == "lora_failed", split.text
            job = client.post("/v1/videos", json={**JOB, "loras": {"split": 1.0}})
            assert job.status_code == 200, job.text
            _not_loaded(client.post("/v1/videos", json={**JOB, "loras": {"other": 1.0}}))
    finally:
        server.stop()


@pytest.mark.parametrize(("route", "body", "param", "shown"), [
    ("/v1/videos", {**JOB, "loras": {"style": 1e30}}, "loras", "loras['style'] must be a finite number from -100 "
                                                              "to 100, got 1e+30; adapters are used at about -2 to 2"),
    ("/v1/videos", {**JOB, "loras": {"style": -100.5}}, "loras", "got -100.5"),
    # A nickname no adapter can have: the "not loaded" 400 repeated it, NUL and all, in the --lora-nickname it
    # suggests; refused at once, escaped, with a name that can be loaded.
    ("/v1/videos", {**JOB, "loras": {"st\x00yle": 1.0}}, "loras",
     "loras key 'st\\x00yle' starts or ends with spaces or holds control characters (a newline, a tab); use plain "
     "text, e.g. 'st yle'. No adapter can be loaded under such a nickname."),
    ("/v1/set_lora", {"lora_nickname": "a", "lora_path": "/a.safetensors", "strength": 1e30}, "strength",
     "strength must be a finite number from -100 to 100, got 1e+30"),
    ("/v1/set_lora", {"lora_nickname": ["a", "b"], "strength": [1.0, 250]}, "strength", "got 250.0"),
    ("/v1/merge_lora_weights", {"strength": -1000}, "strength", "got -1000.0"),
    ("/v1/set_lora", {"lora_nickname": "a", "lora_path": "/a.safetensors", "lora_alpha": 1e30}, "lora_alpha",
     "lora_alpha must be a finite number from -10000 to 10000, got 1e+30; an adapter's alpha is its rank or a small "
     "multiple of it"),
    ("/v1/set_lora", {"lora_nickname": "a", "lora_alpha": -20000}, "lora_alpha", "got -20000.0"),
    # A JSON integer past float's range: loras' values are not typed by the schema, and math.isfinite raised
    # OverflowError on it (a 500).
    ("/v1/videos", {**JOB, "loras": {"style": 10**400}}, "loras", "loras['style'] must be a finite number"),
    ("/v1/set_lora", {"lora_nickname": "a", "lora_path": "/a.safetensors", "strength": -10**400}, "strength",
     "strength: Input should be a valid number"),  # a float field: pydantic refuses it
])
def test_an_absurd_strength_or_alpha_is_a_400_before_anything_queues(fake_server, fake_client, route, body, param,
                                                                     shown):
    response = fake_client.post(route, json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["code"], error["param"]) == ("invalid_parameter", param) and shown in error["message"], error
    # Nothing queued or run; the fake worker has no LoRA operations, so reaching it would have been a 500.
    assert fake_server.store.queued_ids() == [] and fake_server.worker.started == []


class LoraFakeWorker(FakeWorker):
    """The fast fake worker, whose LoRA operations all succeed (the merge state is the runner's to predict)."""

    def __init__(self) -> None:
        super().__init__(VARIANTS["pro-distill"])
        self.operations: list[object] = []

    def apply_lora_operation(self, operation) -> dict:
        self.operations.append(operation)
        return {"status": "ok", "message": "done", "loras": []}


def _fake_server(root: Path, db_path: Path | None = None, **options):
    config = build_engine_config("fake-k6-model", **options)
    worker = LoraFakeWorker()
    return start_server(root, engine=Engine(config, worker=worker), db_path=db_path), worker


def _num_jobs(client) -> int:
    return len(client.get("/v1/videos").json()["data"])


def _merged(response) -> str:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["code"], error["param"], error["type"]) == ("lora_merged", "loras", "invalid_request_error")
    return error["message"]


@pytest.mark.parametrize(("options", "merged"), [
    ({}, True),  # --lora-merge-mode auto: merge
    ({"lora_merge_mode": "merge"}, True),
    ({"lora_merge_mode": "dynamic"}, False),
    ({"num_gpus": 2, "ulysses_degree": 2, "use_fsdp_inference": True}, False),  # auto under FSDP: dynamic
])
def test_a_job_with_its_own_loras_is_a_400_while_the_lora_path_adapter_is_merged(tmp_path, options, merged):
    server, worker = _fake_server(tmp_path, lora_path="/adapters/style.safetensors", lora_nickname="style",
                                  lora_scale=0.8, **options)
    try:
        with server.client() as client:
            for loras in ({"style": 0.5}, {}):
                response = client.post("/v1/videos", json={**JOB, "loras": loras},
                                       headers={**server.headers, "Idempotency-Key": f"key-{len(loras)}"})
                if merged:
                    _merged(response)
                else:
                    assert response.status_code == 200, response.text
            plain = client.post("/v1/videos", json=JOB)
            assert plain.status_code == 200, plain.text
            # Refused: nothing created, the Idempotency-Key still free.
            assert _num_jobs(client) == (1 if merged else 3)
            if merged:
                again = client.post("/v1/videos", json={**JOB, "loras": {}},
                                    headers={**server.headers, "Idempotency-Key": "key-0"})
                assert "Idempotent-Replayed" not in again.headers
                _merged(again)
    finally:
        server.stop()


def test_the_merged_400_says_what_is_merged_and_how_to_switch(tmp_path):
    server, _ = _fake_server(tmp_path, lora_path="/adapters/style.safetensors", lora_nickname="style",
                             lora_scale=0.8, lora_alpha=16)
    try:
        with server.client() as client:
            assert _merged(client.post("/v1/videos", json={**JOB, "loras": {"style": 0.5}})) == (
                "loras chooses this job's own LoRA adapters (the adapter(s) ['style']), but the server's adapter(s) "
                "'style' at strength 0.8 are merged into the weights; a job's own adapters are added dynamically, and "
                "taking merged adapters out of the weights and back in around every job would copy each adapted "
                "weight twice per job. Make the server's adapters dynamic first: POST /v1/unmerge_lora_weights, then "
                'POST /v1/set_lora {"lora_nickname": "style", "lora_path": null, "strength": 0.8, "lora_alpha": 16, '
                '"merge_mode": "dynamic"} to make them active again (merge_mode "dynamic": "auto" means the '
                "server's --lora-merge-mode, which merges unless it is dynamic), or start the server with "
                "--lora-merge-mode dynamic; the job was not created.")
            assert _merged(client.post("/v1/videos", json={**JOB, "loras": {}})).startswith(
                "loras chooses this job's own LoRA adapters (none: {} runs the base model), but the server's ")
            # The fix the message gives lets the job in.
            assert client.post("/v1/unmerge_lora_weights").status_code == 200
            body = {"lora_nickname": "style", "lora_path": None, "strength": 0.8, "lora_alpha": 16.0,
                    "merge_mode": "dynamic"}
            assert client.post("/v1/set_lora", json=body).status_code == 200
            created = client.post("/v1/videos", json={**JOB, "loras": {"style": 0.5}})
            assert created.status_code == 200, created.text
            assert wait_for(client, created.json()["id"])["status"] == "completed"
    finally:
        server.stop()


@pytest.mark.parametrize(("server_merge_mode", "auto_merges"), [("auto", True), ("dynamic", False)])
def test_set_lora_auto_takes_the_servers_lora_merge_mode(tmp_path, server_merge_mode, auto_merges):
    server, _ = _fake_server(tmp_path, lora_merge_mode=server_merge_mode)
    job = {**JOB, "loras": {"style": 1.0}}
    try:
        with server.client() as client:
            assert client.post("/v1/set_lora", json={"lora_nickname": "style", "lora_path": "/a.safetensors"}
                               ).status_code == 200
            response = client.post("/v1/videos", json=job)
            if auto_merges:
                assert "'style' at strength 1 are merged into the weights" in _merged(response)
            else:
                assert response.status_code == 200, response.text
            for route, body in (("/v1/set_lora", {"lora_nickname": "style", "merge_mode": "merge"}),
                                ("/v1/merge_lora_weights", {})):
                assert client.post(route, json=body).status_code == 200
                _merged(client.post("/v1/videos", json=job))
            # Deactivated, or active again dynamically: the job's own adapters run.
            for route, body in (("/v1/unmerge_lora_weights", {}),
                                ("/v1/set_lora", {"lora_nickname": "style", "merge_mode": "dynamic"}),
                                ("/v1/set_lora", {"lora_nickname": []})):
                assert client.post(route, json=body).status_code == 200
                response = client.post("/v1/videos", json=job)
                assert response.status_code == 200, response.text
    finally:
        server.stop()


def test_lora_operations_queued_before_the_job_decide_whether_its_adapters_are_merged(tmp_path):
    server, worker = _fake_server(tmp_path, lora_path="/adapters/style.safetensors", lora_nickname="style",
                                  lora_merge_mode="dynamic")
    runner = server.app.state.ctx.runner
    answers: list[object] = []
    threads: list[threading.Thread] = []

    def queue(route: str, body: dict) -> None:
        """Send a LoRA request that waits behind the held job, once the runner has it."""
        thread = threading.Thread(target=lambda: answers.append(_post_json(server, route, body)))
        thread.start()
        threads.append(thread)
        wait_until(lambda: len(runner._pending_loras) + (runner._applying_lora is not None) == len(threads))

    job = {**JOB, "loras": {"style": 0.5}}
    try:
        with server.client() as client:
            held = client.post("/v1/videos", json={**JOB, "prompt": "hold on"}).json()
            wait_until(lambda: "hold on" in worker.started)
            assert client.post("/v1/videos", json=job).status_code == 200  # dynamic now
            queue("/v1/merge_lora_weights", {})
            message = _merged(client.post("/v1/videos", json=job))
            assert ("but the server's adapter(s) 'style' at strength 1 will be merged into the weights when the job "
                    "runs (by a LoRA request queued before it);") in message
            queue("/v1/set_lora", {"lora_nickname": "style", "strength": 0.7, "merge_mode": "dynamic"})
            assert client.post("/v1/videos", json=job).status_code == 200
            queue("/v1/set_lora", {"lora_nickname": "other", "lora_path": "/other.safetensors"})  # auto: dynamic
            assert client.post("/v1/videos", json={**job, "loras": {"other": 1.0, "style": 1.0}}).status_code == 200
            queue("/v1/merge_lora_weights", {"strength": 2.0})
            assert "'other' at strength 2 will be merged" in _merged(client.post("/v1/videos", json={**JOB, "loras": {}}))
            queue("/v1/unmerge_lora_weights", {})
            assert client.post("/v1/videos", json=job).status_code == 200
            assert worker.operations == []  # all still waiting for the held job
            worker.release.set()
            for thread in threads:
                thread.join(30)
            assert [answer.status_code for answer in answers] == [200] * 5, answers
            ids = [job["id"] for job in client.get("/v1/videos").json()["data"]]
            assert len(ids) == 5 and held["id"] in ids
            assert [wait_for(client, job_id)["status"] for job_id in ids] == ["completed"] * 5
    finally:
        worker.release.set()
        server.stop()


def _post_json(server, route: str, body: dict):
    with server.client() as own:
        return own.post(route, json=body)


def test_merged_adapters_only_some_replicas_hold_are_left_to_the_job_start(tmp_path):
    config = build_engine_config("fake-k6-model", lora_path="/adapters/style.safetensors", lora_nickname="style")
    server = start_server(tmp_path, engine=Engine(config, worker=DisagreeingWorker()))
    job = {**JOB, "loras": {"style": 1.0}}
    try:
        with server.client() as client:
            _merged(client.post("/v1/videos", json=job))
            split = client.post("/v1/set_lora", json={"lora_nickname": "split", "lora_path": "/a.safetensors",
                                                      "merge_mode": "dynamic"})
            assert split.status_code == 500 and split.json()["error"]["code"] == "lora_failed", split.text
            assert client.post("/v1/videos", json=job).status_code == 200  # merged on some replicas only, maybe
            # An operation every replica ran makes them agree again.
            assert client.post("/v1/merge_lora_weights", json={}).status_code == 200
            _merged(client.post("/v1/videos", json=job))
    finally:
        server.stop()


def test_the_merge_state_survives_a_restart(tmp_path):
    db = tmp_path / "jobs.sqlite3"
    job = {**JOB, "loras": {"style": 1.0}}
    server, _ = _fake_server(tmp_path / "one", db_path=db, lora_merge_mode="dynamic")
    try:
        with server.client() as client:
            body = {"lora_nickname": "style", "lora_path": "/a.safetensors", "merge_mode": "merge"}
            assert client.post("/v1/set_lora", json=body).status_code == 200
    finally:
        server.stop()
    server, worker = _fake_server(tmp_path / "two", db_path=db, lora_merge_mode="dynamic")
    try:
        assert [operation.merge_mode for operation in worker.operations] == ["merge"]  # replayed
        with server.client() as client:
            _merged(client.post("/v1/videos", json=job))
    finally:
        server.stop()


def test_a_quantized_server_refuses_adapters_at_once(tmp_path):
    """--quantization fp8: the DiT takes no adapters, so a job naming adapters in its own `loras` is a 400
    `lora_quantized` at creation and set_lora / merge / unmerge are 400s before they queue; list_loras still
    answers, and jobs without `loras` or with {} (the base model, all it runs) run."""
    server, worker = _fake_server(tmp_path, quantization="fp8")
    try:
        with server.client() as client:
            response = client.post("/v1/videos", json={**JOB, "loras": {"style": 1.0}})
            assert response.status_code == 400
            error = response.json()["error"]
            assert (error["code"], error["param"]) == ("lora_quantized", "loras")
            assert error["message"] == (
                "loras names LoRA adapters, but this server's DiT is quantized with --quantization fp8 and takes no "
                "LoRA adapters: its linears hold e4m3 weights, and adapters update bf16 ones. Drop loras; the job "
                "was not created.")
            for route, body in (("/v1/set_lora", {"lora_nickname": "style", "lora_path": str(tmp_path / "a")}),
                                ("/v1/merge_lora_weights", {}), ("/v1/unmerge_lora_weights", {})):
                response = client.post(route, json=body)
                assert response.status_code == 400 and response.json()["error"]["code"] == "invalid_lora"
                assert response.json()["error"]["message"] == (
                    "This server's DiT is quantized with --quantization fp8 and takes no LoRA adapters: its linears "
                    "hold e4m3 weights, and adapters update bf16 ones. Restart the server without --quantization to "
                    "use adapters.")
            assert client.get("/v1/list_loras").json()["loras"] == []
            assert [type(operation).__name__ for operation in worker.operations] == ["ListLoras"]  # none queued
            assert client.get("/v1/models").json()["data"][0]["quantization"] == "fp8"  # a client can tell
            assert _num_jobs(client) == 0
            for body in (JOB, {**JOB, "loras": {}}):
                job = client.post("/v1/videos", json=body).json()
                assert wait_for(client, job["id"])["status"] == "completed"
    finally:
        server.stop()


def test_the_not_loaded_hint_quotes_a_nickname_with_a_space_for_the_shell():
    """`--lora-nickname my style` in the hint was two words to a shell; quoted, the line runs as shown."""
    from k6serve.serve.runner_refusals import not_loaded_message

    message = not_loaded_message(["my style"], frozenset(), frozenset())
    assert "--lora-nickname 'my style' --lora-merge-mode dynamic" in message
    assert "--lora-nickname ghost --lora-merge-mode" in not_loaded_message(["ghost"], frozenset(), frozenset())
