"""Section 4 of the seed document ("LoRA adapters"): its two curl bodies, sent as written to a real server over the
tiny distilled checkpoint. set_lora with target "transformer" changes the video, and unmerge_lora_weights with
{"target": "transformer"} gives the base model's MP4 back byte for byte (merge_mode "dynamic" as in the seed, and
"merge", whose unmerge restores the weights from their host snapshot)."""

from __future__ import annotations

import json

import pytest
from harness import wait_for
import test_lora_job_check
from test_lora_job_check import JOB, _adapter

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# The seed's bodies, with its placeholder adapter path replaced (json.dumps quotes it).
SET_LORA = """{
    "lora_nickname": "kandinsky6",
    "lora_path": %s,
    "target": "transformer",
    "strength": 1.0,
    "merge_mode": "%s"
  }"""
UNMERGE = '{"target": "transformer"}'
HEADERS = {"Content-Type": "application/json"}


real_server = test_lora_job_check.real_server  # the same server over the tiny distilled checkpoint


def _content(client) -> bytes:
    job = client.post("/v1/videos", json=JOB)
    assert job.status_code == 200, job.text
    done = wait_for(client, job.json()["id"], timeout=120)
    assert done["status"] == "completed", done
    return client.get(f"/v1/videos/{done['id']}/content").content


@pytest.mark.parametrize("merge_mode", ["dynamic", "merge"])
def test_the_seeds_set_lora_and_unmerge_bodies_change_and_restore_the_output(real_server, tmp_path, merge_mode):
    server, worker = real_server
    path = _adapter(tmp_path, worker.pipeline.models.transformer, seed=1)
    with server.client() as client:
        base = _content(client)
        answer = client.post("/v1/set_lora", content=SET_LORA % (json.dumps(path), merge_mode), headers=HEADERS)
        assert answer.status_code == 200, answer.text
        assert answer.json()["status"] == "ok"
        (lora,) = answer.json()["loras"]
        assert (lora["nickname"], lora["active"], lora["merged"]) == ("kandinsky6", True, merge_mode == "merge")
        adapted = _content(client)
        answer = client.post("/v1/unmerge_lora_weights", content=UNMERGE, headers=HEADERS)
        assert answer.status_code == 200, answer.text
        assert [item["active"] for item in answer.json()["loras"]] == [False]
        restored = _content(client)
    assert adapted != base
    assert restored == base
