"""The LoRA routes against a fake engine: bodies, validation errors, worker errors, and order with the stored jobs."""

from __future__ import annotations

import threading

import pytest
import torch
from harness import FakeWorker, start_server, wait_for, wait_until
from safetensors.torch import save_file

from k6serve.bench.tiny import TINY_TRANSFORMER_CONFIG
from k6serve.lora.adapter import read_adapter
from k6serve.lora.spec import ListLoras, LoraSpec, MergeLora, SetLora, UnloadLora, UnmergeLora
from k6serve.lora.targets import resolve_targets
from k6serve.models.kandinsky6.checkpoint import build_dummy_transformer
from k6serve.models.variants import VARIANTS


class LoraFakeWorker(FakeWorker):
    """FakeWorker plus `apply_lora_operation`: nickname "missing" raises ValueError, "crash" a RuntimeError, "real"
    reads its adapter and matches it against the tiny DiT as the real worker does; `log` holds request starts and
    ends and the operations, in order."""

    def __init__(self) -> None:
        super().__init__(VARIANTS["pro-distill"])
        self.operations: list[object] = []
        self.log: list[str] = []

    def run(self, params, output, on_step=None):
        self.log.append(f"start {params.prompt}")
        try:
            return super().run(params, output, on_step)
        finally:
            self.log.append(f"end {params.prompt}")

    def apply_lora_operation(self, operation) -> dict:
        names = [spec.nickname for spec in getattr(operation, "specs", ())]
        for spec in getattr(operation, "specs", ()):
            if spec.nickname == "real":  # the real worker's first steps, with their real errors
                dit = build_dummy_transformer(TINY_TRANSFORMER_CONFIG, device=torch.device("meta"), dtype=torch.float32)
                resolve_targets(dit, read_adapter(spec.path).modules, source=spec.path)
        if "missing" in names:
            raise ValueError("lora_path '/nope.safetensors' does not exist")
        if "crash" in names:
            # As a rank's error arrives: its traceback as text, which the client does not get.
            raise RuntimeError("CUDA error: device-side assert triggered\nTraceback (most recent call last):\n"
                               '  File "/srv/k6serve/lora/adapter.py", line 416, in _header_config\n')
        self.operations.append(operation)
        self.log.append(type(operation).__name__)
        loras = [{"nickname": name, "merged": False} for name in names]
        if isinstance(operation, ListLoras):
            return {"loras": loras}
        return {"status": "ok", "message": f"{type(operation).__name__} done", "loras": loras}


@pytest.fixture
def lora_server(tmp_path):
    server = start_server(tmp_path, worker=LoraFakeWorker())
    yield server
    server.worker.release.set()
    server.stop()


@pytest.fixture
def client(lora_server):
    with lora_server.client() as client:
        yield client


def _error(response, status: int, *, param: str | None = None, code: str | None = None) -> str:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    if param is not None:
        assert error["param"] == param, error
    if code is not None:
        assert error["code"] == code, error
    return error["message"]


def test_the_four_routes_reach_the_worker(client, lora_server):
    body = {"lora_nickname": "kandinsky6", "lora_path": "/path/to/adapter.safetensors", "target": "transformer",
            "strength": 1.0, "merge_mode": "dynamic"}
    response = client.post("/v1/set_lora", json=body)
    assert response.status_code == 200, response.text
    assert response.json() == {"status": "ok", "message": "SetLora done",
                               "loras": [{"nickname": "kandinsky6", "merged": False}]}
    many = {"lora_nickname": ["style", "hero"], "lora_path": ["/a.safetensors", None], "strength": [0.5, 2],
            "lora_alpha": 4}
    assert client.post("/v1/set_lora", json=many).status_code == 200
    assert client.post("/v1/merge_lora_weights", json={"strength": 0.5}).status_code == 200
    assert client.post("/v1/merge_lora_weights").status_code == 200  # an empty body takes the defaults
    assert client.post("/v1/unmerge_lora_weights", json={"target": "all"}).status_code == 200
    assert client.get("/v1/list_loras").json() == {"loras": []}
    assert lora_server.worker.operations == [
        SetLora(specs=(LoraSpec(nickname="kandinsky6", path="/path/to/adapter.safetensors"),),
                merge_mode="dynamic", target="transformer"),
        SetLora(specs=(LoraSpec(nickname="style", path="/a.safetensors", strength=0.5, alpha=4.0),
                       LoraSpec(nickname="hero", strength=2.0, alpha=4.0))),
        MergeLora(strength=0.5),
        MergeLora(),
        UnmergeLora(),
        ListLoras(),
    ]


def test_an_operation_runs_after_the_jobs_created_before_it_and_before_later_ones(lora_server, client):
    worker = lora_server.worker
    held = client.post("/v1/videos", json={"prompt": "hold on", "size": "32x32", "num_frames": 5}).json()
    wait_until(lambda: "start hold on" in worker.log)
    queued = client.post("/v1/videos", json={"prompt": "queued", "size": "32x32", "num_frames": 5}).json()
    answers = {}

    def set_lora() -> None:
        with lora_server.client() as other:
            answers["set"] = other.post("/v1/set_lora", json={"lora_nickname": "a", "lora_path": "/a.safetensors"})

    thread = threading.Thread(target=set_lora)
    thread.start()
    wait_until(lambda: lora_server.app.state.ctx.runner._pending_loras)
    later = client.post("/v1/videos", json={"prompt": "later", "size": "32x32", "num_frames": 5}).json()
    assert "set" not in answers
    worker.release.set()
    thread.join(30)
    assert answers["set"].status_code == 200, answers["set"].text
    for job in (held, queued, later):
        assert wait_for(client, job["id"])["status"] == "completed"
    assert worker.log == ["start hold on", "end hold on", "start queued", "end queued", "SetLora",
                          "start later", "end later"]


def test_a_value_error_is_a_400_and_any_other_failure_a_500_with_its_message(client):
    missing = client.post("/v1/set_lora", json={"lora_nickname": "missing", "lora_path": "/nope.safetensors"})
    assert "/nope.safetensors' does not exist" in _error(missing, 400, param="lora_path", code="invalid_lora")
    crash = client.post("/v1/set_lora", json={"lora_nickname": "crash"})
    message = _error(crash, 500, code="lora_failed")
    assert message == "RuntimeError: CUDA error: device-side assert triggered"
    assert crash.json()["error"]["type"] == "server_error"
    assert client.get("/v1/list_loras").status_code == 200  # still serving


def test_an_adapter_file_that_cannot_be_found_names_lora_path(client, lora_server, tmp_path, monkeypatch):
    # The adapter's own errors say "LoRA path ...", not the field name, so they were answered with param null.
    missing = client.post("/v1/set_lora", json={"lora_nickname": "real",
                                                 "lora_path": str(tmp_path / "none.safetensors")})
    assert "none.safetensors' does not exist" in _error(missing, 400, param="lora_path", code="invalid_lora")
    import huggingface_hub

    def offline(*args, **kwargs):
        raise ConnectionError("no network")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", offline)
    unreachable = client.post("/v1/set_lora", json={"lora_nickname": "real", "lora_path": "someone/an-adapter"})
    assert "fetching it from the Hugging Face hub" in _error(unreachable, 400, param="lora_path", code="invalid_lora")
    empty_folder = client.post("/v1/set_lora", json={"lora_nickname": "real", "lora_path": str(tmp_path)})
    assert "holds no .safetensors file" in _error(empty_folder, 400, param="lora_path", code="invalid_lora")
    assert lora_server.worker.operations == []


def test_an_adapter_file_that_is_damaged_or_for_another_model_is_a_400_naming_lora_path(client, lora_server,
                                                                                       tmp_path):
    # A damaged file was a 500 `lora_failed` whose message was a worker traceback; an adapter for another model
    # (module names or shapes) a 400 with param null.
    damaged = tmp_path / "damaged.safetensors"
    damaged.write_bytes(b"<html>404 Not Found</html>")  # a download that saved an error page
    response = client.post("/v1/set_lora", json={"lora_nickname": "real", "lora_path": str(damaged)})
    message = _error(response, 400, param="lora_path", code="invalid_lora")
    assert "cannot be read as safetensors" in message and "Traceback" not in message
    other = tmp_path / "other.safetensors"
    save_file({"transformer_blocks.0.attn.to_q.lora_A.weight": torch.ones(2, 64),
               "transformer_blocks.0.attn.to_q.lora_B.weight": torch.ones(64, 2)}, str(other))
    response = client.post("/v1/set_lora", json={"lora_nickname": "real", "lora_path": str(other)})
    assert "an adapter for another model?" in _error(response, 400, param="lora_path", code="invalid_lora")
    assert lora_server.worker.operations == []
    assert client.get("/v1/list_loras").status_code == 200  # still serving


@pytest.mark.parametrize(("route", "body", "param", "message"), [
    ("/v1/set_lora", {}, "lora_nickname", "lora_nickname is required."),
    ("/v1/set_lora", {"lora_nickname": "a", "lora_scale": 1}, "lora_scale", "Unknown field 'lora_scale'"),
    ("/v1/set_lora", {"lora_nickname": 5}, "lora_nickname", "lora_nickname"),
    ("/v1/set_lora", {"lora_nickname": ""}, "lora_nickname", "non-empty string"),
    ("/v1/set_lora", {"lora_nickname": "style\t"}, "lora_nickname", "holds control characters"),
    ("/v1/set_lora", {"lora_nickname": ["a", "a"]}, "lora_nickname", "more than once"),
    ("/v1/set_lora", {"lora_nickname": True}, "lora_nickname", "lora_nickname must be a string"),
    ("/v1/set_lora", {"lora_nickname": "a", "strength": True}, "strength", "strength must be a number"),
    ("/v1/set_lora", {"lora_nickname": ["a", "b"], "strength": [1, False]}, "strength", "must be a number"),
    ("/v1/set_lora", {"lora_nickname": "a", "strength": "strong"}, "strength", "strength"),
    ("/v1/set_lora", {"lora_nickname": "a", "strength": [1]}, "strength", "strength is a list"),
    ("/v1/set_lora", {"lora_nickname": ["a", "b"], "strength": [1]}, "strength", "has 1 entries"),
    ("/v1/set_lora", {"lora_nickname": ["a", "b"], "lora_path": "/x"}, "lora_path", "must be a list as long as"),
    ("/v1/set_lora", {"lora_nickname": "a", "lora_path": ["/x"]}, "lora_path",
     "lora_path is a list but lora_nickname is one name"),
    ("/v1/set_lora", {"lora_nickname": "a", "target": "transformer_2"}, "target", "'all', 'transformer'"),
    ("/v1/set_lora", {"lora_nickname": "a", "merge_mode": "fuse"}, "merge_mode", "'auto', 'merge', 'dynamic'"),
    ("/v1/set_lora", {"lora_nickname": "a", "lora_alpha": "x"}, "lora_alpha", "lora_alpha"),
    ("/v1/merge_lora_weights", {"strength": True}, "strength", "strength must be a number"),
    ("/v1/merge_lora_weights", {"target": "critic"}, "target", "must be one of"),
    ("/v1/unmerge_lora_weights", {"strength": 1}, "strength", "Unknown field 'strength'. Valid fields: target."),
    ("/v1/unload_lora", {"lora_nickname": []}, "lora_nickname", "must be a non-empty string or a non-empty list"),
    ("/v1/unload_lora", {"lora_nickname": ["a", "a"]}, "lora_nickname", "names an adapter more than once"),
    ("/v1/unload_lora", {"lora_nickname": "a", "strength": 1}, "strength", "Valid fields: lora_nickname."),
])
def test_bad_bodies_are_400s_naming_the_field(client, lora_server, route, body, param, message):
    response = client.post(route, json=body)
    assert message in _error(response, 400, param=param, code="invalid_parameter")
    assert lora_server.worker.operations == []


def test_body_encoding_errors_follow_the_video_routes(client, lora_server):
    json_header = {"Content-Type": "application/json"}
    duplicate = client.post("/v1/set_lora", content=b'{"lora_nickname": "a", "lora_nickname": "b"}',
                            headers=json_header)
    _error(duplicate, 400, param="lora_nickname", code="invalid_json")
    not_finite = client.post("/v1/set_lora", content=b'{"lora_nickname": "a", "strength": NaN}', headers=json_header)
    _error(not_finite, 400, param="strength", code="invalid_parameter")
    empty = _error(client.post("/v1/set_lora", content=b"", headers=json_header), 400, code="invalid_json")
    assert "lora_nickname" in empty and "prompt" not in empty  # set_lora's example, not the video route's
    _error(client.post("/v1/set_lora", json=["a"]), 400, code="invalid_request")
    form = client.post("/v1/set_lora", data={"lora_nickname": "a"})
    assert "application/json" in _error(form, 415, param="Content-Type", code="unsupported_content_type")
    # over 1 MiB: not the create route's "upload files with multipart/form-data", which these routes refuse
    large = client.post("/v1/set_lora", content=b'{"lora_nickname": "' + b"a" * 2**20 + b'"}', headers=json_header)
    assert _error(large, 413, code="payload_too_large") == (
        "JSON and url-encoded bodies are limited to 1 MiB; no field of the LoRA routes needs that much.")
    assert lora_server.worker.operations == []


def test_a_jobs_own_adapters_run_in_the_order_given(lora_server):
    """Stacked adapters are applied in the order of `loras` (a DoRA adapter rescales the ones before it): the job
    store kept the params as sorted JSON, so a job ran its adapters alphabetically, not as the Python API and the CLI
    run the same request. An idempotent retry in another order is another request."""
    with lora_server.client() as client:
        response = client.post("/v1/set_lora", json={"lora_nickname": ["z_plain", "a_dora"],
                                                     "lora_path": ["/z.safetensors", "/a.safetensors"],
                                                     "merge_mode": "dynamic"})
        assert response.status_code == 200, response.text
        body = {"prompt": "ordered", "size": "32x32", "seconds": 0.2, "loras": {"z_plain": 1.0, "a_dora": 0.5}}
        job = client.post("/v1/videos", json=body, headers={"Idempotency-Key": "order-1"})
        assert job.status_code == 200, job.text
        assert wait_for(client, job.json()["id"])["status"] == "completed"
        assert lora_server.worker.requests[-1].loras == (("z_plain", 1.0), ("a_dora", 0.5))
        reordered = client.post("/v1/videos", json={**body, "loras": {"a_dora": 0.5, "z_plain": 1.0}},
                                headers={"Idempotency-Key": "order-1"})
        assert reordered.status_code == 409 and reordered.json()["error"]["code"] == "idempotency_conflict"


class MergeRefusingWorker(LoraFakeWorker):
    def apply_lora_operation(self, operation) -> dict:
        if isinstance(operation, (MergeLora, SetLora)):
            raise ValueError("LoRA adapter '/a.safetensors': 1 module(s) have a lora_B.bias (PEFT's lora_bias), but "
                             "the model's layer has no bias to merge it into; use merge_mode 'dynamic' (set_lora)")
        return super().apply_lora_operation(operation)


def test_a_refusal_names_only_a_field_of_the_route_that_got_it(tmp_path):
    """merge_lora_weights takes no merge_mode: a refusal naming one was answered with param "merge_mode"."""
    server = start_server(tmp_path, worker=MergeRefusingWorker())
    try:
        with server.client() as client:
            merge = client.post("/v1/merge_lora_weights", json={}).json()["error"]
            assert (merge["code"], merge["param"]) == ("invalid_lora", None)
            set_lora = client.post("/v1/set_lora", json={"lora_nickname": "a", "lora_path": "/a.safetensors",
                                                         "merge_mode": "merge"}).json()["error"]
            assert (set_lora["code"], set_lora["param"]) == ("invalid_lora", "merge_mode")
    finally:
        server.stop()


def test_unload_lora_forgets_an_inactive_adapter_and_later_jobs_naming_it_are_refused(client, lora_server):
    """Without it a server held every adapter it ever loaded (1.2 MB each for a tiny one; a real adapter is
    hundreds), and reloaded them all at each restart."""
    for nickname in ("old", "new"):
        body = {"lora_nickname": nickname, "lora_path": f"/adapters/{nickname}.safetensors", "merge_mode": "dynamic"}
        assert client.post("/v1/set_lora", json=body).status_code == 200
    response = client.post("/v1/unload_lora", json={"lora_nickname": "old"})
    assert response.status_code == 200 and response.json()["message"] == "UnloadLora done", response.text
    assert lora_server.worker.operations[-1] == UnloadLora(nicknames=("old",))
    assert client.post("/v1/unload_lora", json={"lora_nickname": ["x", "y"]}).status_code == 200  # a list too
    assert lora_server.worker.operations[-1] == UnloadLora(nicknames=("x", "y"))
    refused = client.post("/v1/videos", json={"prompt": "a fox", "loras": {"old": 1.0}})
    assert "old" in _error(refused, 400, code="lora_not_loaded")
    assert client.post("/v1/unload_lora").status_code == 400  # the nickname is required


def test_allowed_lora_dirs_keep_set_lora_inside_them(tmp_path):
    """set_lora read any path the server could read (and downloaded hub ids): with --allowed-lora-dir only what lies
    inside those folders, symlinks resolved, is read."""
    loras = tmp_path / "loras"
    (loras / "style").mkdir(parents=True)
    (loras / "style.safetensors").write_bytes(b"x")
    (tmp_path / "secret.safetensors").write_bytes(b"x")
    (loras / "escape.safetensors").symlink_to(tmp_path / "secret.safetensors")
    server = start_server(tmp_path / "server", worker=LoraFakeWorker(), allowed_lora_dirs=(loras,))
    try:
        with server.client() as client:
            for path in (str(loras / "style.safetensors"), str(loras / "style"), f"{loras}/style/../style.safetensors"):
                assert client.post("/v1/set_lora", json={"lora_nickname": "a", "lora_path": path}).status_code == 200
            named = server.worker.operations[-1].specs[0].path
            assert named == str(loras / "style" / ".." / "style.safetensors")  # absolute, as named
            # A link inside to a file inside is read under its own name (a hub cache's snapshot links to a blob with
            # no suffix; the adapter_config.json beside the link sets the scale).
            (loras / "blobs").mkdir()
            (loras / "blobs" / "3fa9").write_bytes(b"x")
            (loras / "linked.safetensors").symlink_to(loras / "blobs" / "3fa9")
            assert client.post("/v1/set_lora", json={"lora_nickname": "c", "lora_path": str(
                loras / "linked.safetensors")}).status_code == 200
            assert server.worker.operations[-1].specs[0].path == str(loras / "linked.safetensors")
            for path in (str(tmp_path / "secret.safetensors"), str(loras / "escape.safetensors"),
                         f"{loras}/../secret.safetensors", "someone/style-lora"):
                refused = client.post("/v1/set_lora", json={"lora_nickname": "b", "lora_path": path})
                assert "this server loads LoRA adapters only from its --allowed-lora-dir folders" in _error(
                    refused, 400, param="lora_path", code="path_not_allowed")
            missing = client.post("/v1/set_lora", json={"lora_nickname": ["a", "b"],
                                                         "lora_path": [None, str(loras / "nope.safetensors")]})
            assert "is not an existing file or folder" in _error(missing, 400, param="lora_path", code="invalid_path")
    finally:
        server.stop()
