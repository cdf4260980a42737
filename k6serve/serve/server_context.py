"""What every route handler reads: the `ServerContext` that `app.build_app` stores on the app, and the refusal that
every route taking work answers once no worker replica is left."""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request

from k6serve.models.kandinsky6_sr.config_before_loading import SRTiling
from k6serve.models.variants import Variant
from k6serve.runtime.engine import Engine
from k6serve.serve.artifacts import ArtifactStore
from k6serve.serve.errors import ApiError
from k6serve.serve.input_paths import InputPathPolicy, LoraPathPolicy
from k6serve.serve.jobs import Job, JobStore
from k6serve.serve.metrics import ServerMetrics
from k6serve.serve.response_models import job_view
from k6serve.serve.runner import JobRunner
from k6serve.serve.settings import ServerSettings
from k6serve.serve.uploads import drain


@dataclass(kw_only=True)
class ServerContext:
    engine: Engine
    store: JobStore
    artifacts: ArtifactStore
    settings: ServerSettings
    metrics: ServerMetrics
    runner: JobRunner
    inputs: InputPathPolicy
    lora_paths: LoraPathPolicy
    model_name: str
    served_names: tuple[str, ...]
    started_at: float
    sr_tiling: SRTiling | None = None  # an SR checkpoint's tiles, to refuse a too small source at creation
    # Held by the one TTL sweep running (`sweep_expired`): each listing ran its own, and after a backlog (jobs that
    # expired while the server was down) eight listings filled the thread pool for seconds, /health with it.
    sweep_lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def variant(self) -> Variant:
        return self.engine.variant

    def view(self, job: Job) -> dict[str, Any]:
        return job_view(job, output_ttl_s=self.settings.output_ttl_s, memory_released=self.runner.holds_queue(),
                        root_path=self.settings.root_path).model_dump(mode="json")


def server_context(request: Request) -> ServerContext:
    return request.app.state.ctx


NO_REPLICA = "Every worker replica of this server has died; restart the server (its log says why they died)."


async def refuse_without_replicas(request: Request, ctx: ServerContext) -> None:
    """A 503 before the body is used when no replica can run anything: the job would only fail once queued."""
    if len(await asyncio.to_thread(ctx.engine.dead_replicas)) >= ctx.engine.num_replicas:
        await drain(request)
        raise ApiError(503, NO_REPLICA, code="engine_unavailable")
