"""seed -1: a seed drawn for the request where it enters (the API's generate, the server's job creation), reported
by the result, the job and the file name, so the video can be made again; any other negative seed is refused."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from k6serve.api import DiffGenerator
from k6serve.models.variants import VARIANTS
from k6serve.request import OutputOptions, SamplingParams, drawn_seed
from k6serve.request_resolution import resolve_generate

SMALL = {"prompt": "a fox", "height": 32, "width": 32, "num_frames": 5, "num_inference_steps": 1}


def test_minus_one_is_drawn_once_below_two_to_the_32():
    params, note = drawn_seed(SamplingParams(prompt="p", seed=-1))
    assert 0 <= params.seed < 2**32 and note == (f"seed -1 drew seed {params.seed}: pass seed {params.seed} to make "
                                                 "this video again.")
    assert note.flag_wording == (f"--seed -1 drew seed {params.seed}: pass --seed {params.seed} to make this video "
                                 "again.")
    assert drawn_seed(SamplingParams(prompt="p", seed=7)) == (SamplingParams(prompt="p", seed=7), None)
    assert drawn_seed(SamplingParams(prompt="p"))[1] is None
    with pytest.raises(ValueError, match=r"seed must be an integer in \[0, 2\*\*63\), or -1 for a seed drawn for "
                                         r"the request, got -2"):
        resolve_generate(SamplingParams(prompt="p", seed=-2), VARIANTS["pro"])


def test_the_api_reports_the_seed_drawn_and_it_makes_the_same_video(tiny_distill_dir, tmp_path):
    generator = DiffGenerator.from_pretrained(str(tiny_distill_dir), device="cpu")
    try:
        drawn = generator.generate({**SMALL, "seed": -1, "output_path": str(tmp_path)}, return_frames=True)
        assert 0 <= drawn.seed < 2**32 and f"seed -1 drew seed {drawn.seed}" in drawn.notes[0]
        assert f"seed{drawn.seed}" in Path(drawn.output_file_path).name
        again = generator.generate({**SMALL, "seed": drawn.seed, "save_output": False})
        assert (again.frames == drawn.frames).all()
        other = generator.generate({**SMALL, "seed": -1, "save_output": False})
        assert other.seed != drawn.seed  # 1 in 2**32 to fail
        # Given to the engine directly (no note), it is still drawn once, for every rank alike.
        # (Saved under tmp_path: the default output folder is the working directory's outputs/, a checkout's.)
        direct = generator.engine.generate(SamplingParams(**SMALL, seed=-1), OutputOptions(output_path=str(tmp_path)))
        assert 0 <= direct.seed < 2**32
    finally:
        generator.shutdown()


def test_the_server_shows_the_seed_drawn_from_the_jobs_creation(tmp_path):
    sys.path.insert(0, str(Path(__file__).parents[1] / "server"))
    from harness import start_server, wait_for

    server = start_server(tmp_path)
    try:
        with server.client() as client:
            created = client.post("/v1/videos", json={"prompt": "x", "size": "32x32", "num_frames": 5, "seed": -1})
            assert created.status_code == 200, created.text
            job = created.json()
            assert 0 <= job["seed"] < 2**32 and any(f"seed -1 drew seed {job['seed']}" in w for w in job["warnings"])
            server.worker.release.set()
            done = wait_for(client, job["id"])
            assert done["seed"] == job["seed"]
            refused = client.post("/v1/videos", json={"prompt": "x", "seed": -2})
            assert refused.status_code == 400 and refused.json()["error"]["param"] == "seed"
    finally:
        server.stop()
