"""The HTTP routes, one module per resource, gathered here into the one router that `app.build_app` includes:
`video_routes.py` (OpenAI-style async video jobs), `lora_routes.py` (LoRA adapters), `memory_routes.py` (sleep and
wake) and `status_routes.py` (models, health and metrics).

Handlers only translate: HTTP in (validated by `video_create_body` and `control_bodies`), `SamplingParams` to the
engine through the `JobRunner`, job records out (`response_models`). Nothing in them runs model code, so the event
loop never waits on the GPU.
"""

from __future__ import annotations

from typing import cast

from fastapi import APIRouter
from fastapi.routing import APIRoute

from k6serve.serve import lora_routes, memory_routes, status_routes, video_routes

# The OpenAPI document's groups, which name a generated client's modules (openapi-python-client's
# `api/videos/create_video.py`); each route has a tag and an operationId, OpenAI's where it has the route
# (createVideo, listVideos, retrieveVideo, deleteVideo, retrieveVideoContent, listModels, retrieveModel), since
# generators name methods after it (FastAPI's default made `create_video_v1_videos_post`).
OPENAPI_TAGS = [
    {"name": "videos", "description": "OpenAI-style asynchronous video jobs: create, poll, download, cancel, delete."},
    {"name": "lora", "description": "LoRA adapters of the generation DiT: set, merge, unmerge, unload, list."},
    {"name": "memory", "description": "Release and resume the GPU memory (sleep and wake)."},
    {"name": "models", "description": "The served model, as OpenAI's /v1/models."},
    {"name": "operations", "description": "Health and Prometheus metrics, for supervisors and monitoring."},
]

# The resources' routers, in the order of the OpenAPI document's paths (and of docs/http-api.md's tables).
RESOURCE_ROUTERS = (video_routes.router, lora_routes.router, memory_routes.router, status_routes.router)
router = APIRouter()
for _resource_router in RESOURCE_ROUTERS:
    router.include_router(_resource_router)


def _head_wherever_get() -> None:
    """HEAD on every GET route, answered as the GET without its body, as RFC 9110 (9.1) asks of every server. It
    answered 405 but on two paths: a load balancer probing /health with HEAD never saw the server come up (the
    loading responder answers HEAD /health), and curl -I or a download manager sizing a ranged download of
    /content got no size; HEAD /v1/videos/{id} and the rest answered 405 too. Kept out of the schema, which lists
    the documented GETs. Added after every resource's routes, as they were when one router held them all."""
    for resource_router in RESOURCE_ROUTERS:
        # Starlette types them as any route; a resource router holds only the APIRoutes its decorators made.
        for route in cast(list[APIRoute], list(resource_router.routes)):
            if route.methods is None:  # a method decorator's route always has its methods
                raise TypeError(f"route {route.path} was not made by a method decorator")
            if "GET" in route.methods:
                router.head(route.path, include_in_schema=False)(route.endpoint)


_head_wherever_get()
