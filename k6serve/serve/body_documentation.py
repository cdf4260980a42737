"""How a request body's model is shown in the OpenAPI document: the ranges a client generator reads
(`documented`), the choices several fields share as one named component (`SHARED_SCHEMAS`, `shared`), and the body as
a component (`request_body_schema`). In the document only: the server's own checks refuse what is out of range, with
their own 400s.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

from pydantic import BaseModel

from k6serve.lora.spec import LORA_MERGE_MODES, LORA_TARGETS
from k6serve.request import SR_RESIZE_MODES


def documented(**by_type: dict[str, Any]) -> Callable[[dict[str, Any]], None]:
    """A field's `json_schema_extra` that writes JSON-schema keywords into the branches of its schema of each JSON type
    (`integer={"minimum": 1}`; an array's items count as its type), the `null` branch left as it is: the OpenAPI
    document shows the ranges to client generators and validators. In the document only: pydantic does not check
    them, the server's own checks do, with their own 400 messages (a pydantic constraint would answer in its words)."""
    def extra(schema: dict[str, Any]) -> None:
        for branch in schema.get("anyOf", [schema]):
            target = branch.get("items", branch) if branch.get("type") == "array" else branch
            keywords = copy.deepcopy(by_type.get(target.get("type"), {}))
            if _SHARED in keywords:  # a shared component (`SHARED_SCHEMAS`) says the type
                del target["type"]
            target.update(keywords)
    return extra


# Choices that several fields share, as named components of the document (`_openapi` adds them): a generated client
# gets one enum, LoraTarget, not SetLoraBodyTarget, MergeLoraBodyTarget and UnmergeLoraBodyTarget.
SHARED_SCHEMAS = {
    "LoraTarget": {"type": "string", "enum": list(LORA_TARGETS), "title": "LoraTarget",
                   "description": "What the LoRA routes change: 'all' or 'transformer' (the one DiT)."},
    "LoraMergeMode": {"type": "string", "enum": list(LORA_MERGE_MODES), "title": "LoraMergeMode",
                      "description": "'auto', 'merge' (into the weights) or 'dynamic' (per forward)."},
    "SrTargetResizeMode": {"type": "string", "enum": list(SR_RESIZE_MODES), "title": "SrTargetResizeMode",
                           "description": "How super-resolution reaches sr_target_resolution: fit or exact."},
}


# Pydantic refuses a $ref to a schema it did not make (KeyError), so `documented` leaves this mark, which
# `request_body_schema` turns into the $ref.
_SHARED = "x-k6serve-shared"


def shared(name: str) -> dict[str, dict[str, str]]:
    return {"string": {_SHARED: name}}


def request_body_schema(model: type[BaseModel]) -> dict[str, Any]:
    """A request body's model as a component of the OpenAPI document: its shared choices as $refs to
    `SHARED_SCHEMAS`, and no `default`s. openapi-typescript makes a component's property with a default required
    (its defaultNonNullable), so a TypeScript client had to send every field of a create, null or not, and
    `target` and `strength` with an empty merge; the descriptions say the defaults that are not null."""
    def refer(node: Any) -> Any:
        if isinstance(node, list):
            return [refer(item) for item in node]
        if not isinstance(node, dict):
            return node
        shared = {"$ref": f"#/components/schemas/{node[_SHARED]}"} if _SHARED in node else {}
        return {**{key: refer(value) for key, value in node.items() if key != _SHARED}, **shared}
    schema = refer(model.model_json_schema(ref_template="#/components/schemas/{model}"))
    for value in schema["properties"].values():
        value.pop("default", None)
    return schema
