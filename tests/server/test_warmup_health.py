"""GET /health says what `--warmup-mode server` warmed at start-up: each shape's cost and the total."""

from __future__ import annotations

import pytest
from harness import start_server

from k6serve.engine_arguments import build_engine_config
from k6serve.runtime.engine import Engine
from k6serve.runtime.worker import ModelWorker

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_health_reports_each_warmed_shape(server_distill_dir, tmp_path, fake_client):
    config = build_engine_config(str(server_distill_dir), device="cpu", warmup_mode="server",
                                 warmup_resolutions=["48x32x5", "32x32x5"])
    worker = ModelWorker(config)
    server = start_server(tmp_path / "warmed", engine=Engine(config, worker=worker))
    try:
        with server.client() as client:
            body = client.get("/health").json()
    finally:
        server.stop()
    reports = worker.server_warmups
    assert body == {"status": "ok", "memory_released": False,
                    "warmup": {"seconds": round(sum(report.seconds for report in reports), 3),
                               "shapes": [{"size": "48x32x5", "seconds": round(reports[0].seconds, 3)},
                                          {"size": "32x32x5", "seconds": round(reports[1].seconds, 3)}]}}
    assert body["warmup"]["seconds"] > 0
    # Without a server warm-up the body stays as it was.
    assert fake_client.get("/health").json() == {"status": "ok", "memory_released": False}


def test_the_job_that_paid_for_a_request_warm_up_says_so(tmp_path):
    """--warmup-mode request: the first job runs the warm-up before its own run; its inference_time_s leaves the
    warm-up out, and nothing over HTTP said what it cost."""
    import dataclasses

    from harness import FakeWorker, wait_for

    from k6serve.models.variants import VARIANTS

    class WarmingWorker(FakeWorker):
        def run(self, params, output, on_step=None):
            result = super().run(params, output, on_step)
            first = len(self.started) == 1
            return dataclasses.replace(result, timings={**result.timings, **({"warmup": 3.25} if first else {})})

    server = start_server(tmp_path, worker=WarmingWorker(VARIANTS["pro-distill"]))
    try:
        with server.client() as client:
            body = {"prompt": "warm", "size": "32x32", "seconds": 0.2}
            first = wait_for(client, client.post("/v1/videos", json=body).json()["id"])
            second = wait_for(client, client.post("/v1/videos", json=body).json()["id"])
        assert first["warnings"] == ["this job ran the server's warm-up first (--warmup-mode request): 3.25 s before "
                                     "its own run, not in inference_time_s"]
        assert first["inference_time_s"] == 0.01 and second["warnings"] == []
    finally:
        server.stop()
