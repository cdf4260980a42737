"""The OpenAPI document as client generators read it: operation ids, tags, the request fields' ranges (in the
document only: the server keeps its own 400s), and a document that validates."""

from __future__ import annotations

import re
import typing
from pathlib import Path

import pytest
from harness import FakeWorker, start_server

from k6serve.lora.arguments import set_lora_operation
from k6serve.lora.spec import LORA_MERGE_MODES, LORA_TARGETS
from k6serve.models.variants import VARIANTS
from k6serve.request import SR_RESIZE_MODES, SamplingParams
from k6serve.request_resolution import resolve_upscale
from k6serve.serve.video_create_body import VideoCreateBody

# OpenAI's ids where its API has the route (its SDK's videos.create / list / retrieve / delete / download_content,
# models.list / retrieve), camelCase like them for the others.
OPERATIONS = {
    ("post", "/v1/videos"): ("createVideo", "videos"),
    ("get", "/v1/videos"): ("listVideos", "videos"),
    ("get", "/v1/videos/{video_id}"): ("retrieveVideo", "videos"),
    ("delete", "/v1/videos/{video_id}"): ("deleteVideo", "videos"),
    ("get", "/v1/videos/{video_id}/content"): ("retrieveVideoContent", "videos"),
    ("post", "/v1/videos/{video_id}/cancel"): ("cancelVideo", "videos"),
    ("post", "/v1/videos/{video_id}/remix"): ("remixVideo", "videos"),
    ("post", "/v1/set_lora"): ("setLora", "lora"),
    ("post", "/v1/merge_lora_weights"): ("mergeLoraWeights", "lora"),
    ("post", "/v1/unmerge_lora_weights"): ("unmergeLoraWeights", "lora"),
    ("post", "/v1/unload_lora"): ("unloadLora", "lora"),
    ("get", "/v1/list_loras"): ("listLoras", "lora"),
    ("post", "/release_memory_occupation"): ("releaseMemoryOccupation", "memory"),
    ("post", "/resume_memory_occupation"): ("resumeMemoryOccupation", "memory"),
    ("get", "/v1/models"): ("listModels", "models"),
    ("get", "/v1/models/{model}"): ("retrieveModel", "models"),
    ("get", "/health"): ("getHealth", "operations"),
    ("get", "/metrics"): ("getMetrics", "operations"),
}
REQUEST_BODIES = ("VideoCreateBody", "VideoCreateForm", "SetLoraBody", "MergeLoraBody", "UnmergeLoraBody",
                  "UnloadLoraBody", "MemoryOccupationBody")


@pytest.fixture
def document(fake_client):
    return fake_client.get("/openapi.json").json()


def _branch(schema: dict, *kinds: str) -> dict:
    """The branch of a property's schema of a JSON type of `kinds` (the property itself when it has one type)."""
    return next(option for option in schema.get("anyOf", [schema]) if option.get("type") in kinds)


def _numeric(schema: dict) -> dict:
    return _branch(schema, "integer", "number")


def test_every_route_has_its_operation_id_and_one_tag(document):
    """FastAPI's ids (`create_video_v1_videos_post`) were the generated clients' method names."""
    served = {(method, path): (operation.get("operationId"), operation.get("tags"))
              for path, item in document["paths"].items() for method, operation in item.items()}
    assert served == {key: (operation_id, [tag]) for key, (operation_id, tag) in OPERATIONS.items()}
    ids = [operation_id for operation_id, _ in served.values()]
    assert len(ids) == len(set(ids))
    described = {tag["name"]: tag.get("description") for tag in document["tags"]}
    assert set(described) == {tag for _, tag in OPERATIONS.values()} and all(described.values())


def test_the_http_reference_names_every_operation_id():
    """docs/http-api.md lists the ids for client generators; a route added without it (remixVideo) went unlisted."""
    reference = (Path(__file__).parents[2] / "docs" / "http-api.md").read_text()
    start = reference.index("each route has an `operationId`")
    listed = reference[start:reference.index(" for the rest;", start)]
    assert {operation_id for operation_id, _ in OPERATIONS.values()} == set(re.findall(r"`(\w+)`", listed)) - {
        "operationId"}


def test_the_document_validates(document):
    validator = pytest.importorskip("openapi_spec_validator")
    validator.validate(document)
    components = document["components"]["schemas"]
    for name in REQUEST_BODIES:  # openapi-typescript made every property with a default required
        assert not [field for field, value in components[name]["properties"].items() if "default" in value], name


def test_a_super_resolution_servers_document_validates(tmp_path):
    validator = pytest.importorskip("openapi_spec_validator")
    server = start_server(tmp_path, worker=FakeWorker(VARIANTS["vsr-distilled2steps"]), api_key="sekret")
    try:
        with server.client() as client:
            validator.validate(client.get("/openapi.json").json())
    finally:
        server.stop()


def test_the_documented_ranges(document):
    components = document["components"]["schemas"]
    body = components["VideoCreateBody"]["properties"]
    assert _branch(body["num_inference_steps"], "integer") == {"type": "integer", "minimum": 1, "maximum": 1000}
    assert _branch(body["fps"], "number") == {"type": "number", "minimum": 1, "maximum": 240}
    assert _branch(body["height"], "integer") == {"type": "integer", "minimum": 16, "maximum": 2048,
                                                  "multipleOf": 16}
    assert _branch(body["seed"], "integer")["maximum"] == 2**63 - 1
    assert _branch(body["seconds"], "number") == {"type": "number", "exclusiveMinimum": 0, "maximum": 600}
    assert _branch(body["sr_tile_min_overlap"], "number")["exclusiveMaximum"] == 1
    assert _branch(body["loras"], "object")["additionalProperties"] == {"type": "number", "minimum": -100,
                                                                        "maximum": 100}
    assert _branch(body["prompt"], "string")["maxLength"] == 32_768
    # The form's fields are the body's without null: the ranges stay.
    assert components["VideoCreateForm"]["properties"]["fps"]["maximum"] == 240
    strength = components["SetLoraBody"]["properties"]["strength"]
    assert _branch(strength, "number")["maximum"] == 100 and _branch(strength, "array")["items"]["minimum"] == -100
    assert _numeric(components["MergeLoraBody"]["properties"]["strength"])["minimum"] == -100
    # One shared enum each, not SetLoraBodyTarget, MergeLoraBodyTarget... in a generated client.
    for body_name in ("MergeLoraBody", "UnmergeLoraBody"):
        assert components[body_name]["properties"]["target"]["$ref"] == "#/components/schemas/LoraTarget"
    # set_lora's target is one, or one per adapter (SGLang's list), each the shared enum.
    assert components["SetLoraBody"]["properties"]["target"]["anyOf"] == [
        {"$ref": "#/components/schemas/LoraTarget"},
        {"type": "array", "items": {"$ref": "#/components/schemas/LoraTarget"}}]
    assert components["LoraTarget"]["enum"] == list(LORA_TARGETS)
    assert components["LoraMergeMode"]["enum"] == list(LORA_MERGE_MODES)
    assert components["SrTargetResizeMode"]["enum"] == list(SR_RESIZE_MODES)
    assert components["VideoCreateForm"]["properties"]["sr_target_resize_mode"]["$ref"].endswith("/SrTargetResizeMode")


def test_the_ranges_are_in_the_document_only():
    """Pydantic checks none of them: the server's own checks answer, in their words."""
    body = VideoCreateBody.model_validate({"num_inference_steps": 5000, "fps": 0.5, "seed": -1, "size": "big",
                                           "seconds": -1, "loras": {"a": 1000}, "sr_target_resize_mode": "crop"})
    assert body.num_inference_steps == 5000 and body.sr_target_resize_mode == "crop"


def _numbers(branch: dict) -> tuple[list, list]:
    """Values just outside and at the edges of a numeric branch's documented range."""
    step = 1 if branch["type"] == "integer" else 0.5
    outside, inside = [], []
    if "minimum" in branch:
        outside.append(branch["minimum"] - step)
        inside.append(branch["minimum"])
    if "maximum" in branch:
        outside.append(branch["maximum"] + step)
        inside.append(branch["maximum"])
    if "exclusiveMinimum" in branch:
        outside.append(branch["exclusiveMinimum"])
        inside.append(branch["exclusiveMinimum"] + 0.001)
    if "exclusiveMaximum" in branch:
        outside.append(branch["exclusiveMaximum"])
        inside.append(branch["exclusiveMaximum"] - 0.001)
    if "multipleOf" in branch:
        outside.append(branch["minimum"] + branch["multipleOf"] // 2)
    return outside, inside


GENERATION_FIELDS = ("seed", "height", "width", "num_frames", "fps", "num_inference_steps", "guidance_scale",
                     "max_sequence_length")
SR_FIELDS = ("sr_resolution_scale", "sr_tiles_batch_size", "sr_tile_min_overlap")
SOURCE = {"input_reference": ("in.mp4", b"\x00\x00\x00\x18ftypmp42" + bytes(64), "video/mp4")}


def test_each_documented_bound_is_where_the_server_refuses(fake_server, fake_client, document, tmp_path):
    """Past each bound: the server's 400 for that field; at it, nothing refuses the field (a wrong bound in the
    document would fail here, whichever side it errs on)."""
    body = document["components"]["schemas"]["VideoCreateBody"]["properties"]
    numeric = {name for name, value in body.items() for option in value.get("anyOf", [value])
               if option.get("type") in ("integer", "number") and len(option) > 1}
    assert numeric == {*GENERATION_FIELDS, *SR_FIELDS, "seconds"}
    for name in GENERATION_FIELDS:
        outside, inside = _numbers(_numeric(body[name]))
        for value in outside:
            response = fake_client.post("/v1/videos", json={"prompt": "x", name: value})
            assert (response.status_code, response.json()["error"]["param"]) == (400, name), (name, value)
        for value in inside:  # 17 frames: at 1 fps the soundtrack still fits its 47.55 s
            fake_server.engine.resolve(SamplingParams(prompt="x", **{"num_frames": 17, name: value}))
    outside, inside = _numbers(_numeric(body["seconds"]))
    for value in outside:
        response = fake_client.post("/v1/videos", json={"prompt": "x", "seconds": value})
        assert (response.status_code, response.json()["error"]["param"]) == (400, "seconds"), value
    for value in inside:  # 600 s is past the frames the model holds, but not refused as a duration
        response = fake_client.post("/v1/videos", json={"prompt": "x", "seconds": value, "fps": 1})
        assert "seconds must be" not in (response.json()["error"] or {}).get("message", ""), value
    server = start_server(tmp_path / "sr", worker=FakeWorker(VARIANTS["vsr-distilled2steps"]))
    try:
        with server.client() as client:
            for name in SR_FIELDS:
                outside, inside = _numbers(_numeric(body[name]))
                for value in outside:
                    response = client.post("/v1/videos", data={"prompt": "", name: str(value)}, files=SOURCE)
                    assert (response.status_code, response.json()["error"]["param"]) == (400, name), (name, value)
                for value in inside:
                    resolve_upscale(SamplingParams(video_path="in.mp4", **{name: value}),
                                    VARIANTS["vsr-distilled2steps"])
    finally:
        server.stop()
    strength = _branch(document["components"]["schemas"]["SetLoraBody"]["properties"]["strength"], "number")
    for value in _numbers(strength)[0]:
        response = fake_client.post("/v1/set_lora", json={"lora_nickname": "a", "lora_path": "/a.safetensors",
                                                          "strength": value})
        assert (response.status_code, response.json()["error"]["param"]) == (400, "strength"), value
    for value in _numbers(strength)[1]:
        set_lora_operation("a", "/a.safetensors", value)


STRENGTH_WHY = ("adapters are used at about -2 to 2 (1.0 is the strength they were trained at), and far past that "
                "the update swamps the model's weights and the latents overflow to NaN.")


@pytest.mark.parametrize(("route", "body", "form", "param", "message"), [
    ("/v1/videos", {"prompt": "x", "num_inference_steps": 1001}, False, "num_inference_steps",
     "num_inference_steps must be between 1 and 1000, got 1001"),
    ("/v1/videos", {"prompt": "x", "num_inference_steps": "0"}, True, "num_inference_steps",
     "num_inference_steps must be between 1 and 1000, got 0"),
    ("/v1/videos", {"prompt": "x", "fps": 241}, False, "fps",
     "fps must be between 1 and 240 (it sets the audio length, num_frames / fps seconds), got 241.0"),
    ("/v1/videos", {"prompt": "x", "seconds": 0}, False, "seconds", "seconds must be in (0, 600], got 0.0"),
    ("/v1/videos", {"prompt": "x", "height": 2064}, False, "height",
     "height must be at most 2048 (the DiT's 128 RoPE positions x 16 px), got 2064."),
    ("/v1/videos", {"prompt": "x", "size": "768by512"}, False, "size",
     "size must be 'WIDTHxHEIGHT' in ASCII digits, width first (e.g. '768x512'), got '768by512'"),
    ("/v1/videos", {"prompt": "x", "loras": {"a": 101}}, False, "loras",
     f"loras['a'] must be a finite number from -100 to 100, got 101; {STRENGTH_WHY}"),
    ("/v1/set_lora", {"lora_nickname": "a", "lora_path": "/a.safetensors", "strength": 101}, False, "strength",
     f"strength must be a finite number from -100 to 100, got 101.0; {STRENGTH_WHY}"),
    ("/v1/merge_lora_weights", {"target": "vae"}, False, "target",
     "target must be one of 'all', 'transformer', got 'vae'."),
])
def test_out_of_range_values_keep_the_servers_400(fake_client, route, body, form, param, message):
    """What the server answered before the ranges were documented, word for word (FastAPI would answer 422 with its
    own words for a pydantic constraint)."""
    response = fake_client.post(route, **({"data": body} if form else {"json": body}))
    assert response.status_code == 400
    assert response.json() == {"error": {"message": message, "type": "invalid_request_error", "param": param,
                                         "code": "invalid_parameter"}}


def test_the_lora_and_memory_answers_name_their_fields(document):
    """A generated client typed the adapters and the rank reports as `{[key: string]: unknown}`: their fields now
    come from the replies' own types (`LoraAdapterState`, `MemoryRankReport`), which tests/unit/test_lora_runtime.py
    and test_memory_release.py hold to the replies' keys. Optional keys stay optional: `replica` and `rank` come from
    multi-process engines only, the GPU figures from a GPU."""
    from k6serve.lora.spec import LoraAdapterState
    from k6serve.runtime.memory import MemoryRankReport

    components = document["components"]["schemas"]
    for answer in ("LoraResult", "LoraList"):
        assert components[answer]["properties"]["loras"]["items"] == {"$ref": "#/components/schemas/LoraAdapterState"}
    adapter = components["LoraAdapterState"]
    assert list(adapter["properties"]) == list(LoraAdapterState.__annotations__) == adapter["required"]
    assert adapter["properties"]["merge_mode"]["anyOf"][0]["enum"] == ["merge", "dynamic"]
    ranks = components["MemoryReply"]["properties"]["ranks"]
    assert ranks["items"] == {"$ref": "#/components/schemas/MemoryRankReport"}
    report = components["MemoryRankReport"]
    assert set(report["properties"]) == set(typing.get_type_hints(MemoryRankReport))
    assert set(report["required"]) == set(report["properties"]) - {"replica", "rank"}
    assert report["properties"]["after"] == {"$ref": "#/components/schemas/DeviceMemoryState"}
    assert components["DeviceMemoryState"]["required"] == ["device", "explanation"]
    assert components["LiveStorage"]["required"] == ["bytes", "shape", "dtype"]


def test_the_body_fields_a_type_checker_is_told_of_are_the_models_own():
    # VideoCreateBody is built by pydantic's create_model; type checkers read a hand-written stand-in (under
    # TYPE_CHECKING) naming the fields the code reads by name. Its annotations must stay the model's.
    import ast
    import inspect
    import typing

    from k6serve.serve import video_create_body

    tree = ast.parse(inspect.getsource(video_create_body))
    stand_in = next(node for node in ast.walk(tree) if isinstance(node, ast.ClassDef)
                    and node.name == "VideoCreateBody")
    declared = {item.target.id: ast.unparse(item.annotation) for item in stand_in.body
                if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name)}
    assert declared, "the stand-in declares no field"
    fields = video_create_body.VideoCreateBody.model_fields
    namespace = {"typing": typing}
    for name, annotation in declared.items():
        assert name in fields, f"{name} is no field of the body"
        assert eval(annotation, namespace) == fields[name].annotation, name  # noqa: S307 (the module's own text)
