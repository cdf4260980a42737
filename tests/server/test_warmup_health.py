"""GET /health says what `--warmup-mode server` warmed at start-up: each shape's cost and the total."""

from __future__ import annotations

import pytest
from harness import start_server

from k6serve.api import build_engine_config
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
