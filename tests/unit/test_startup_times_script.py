"""scripts/startup_times.py's logic: the tree it times comes first on the runs' path and the runs start outside any
checkout (`python -m` puts the working directory first: run from the repository, an older `--tree` timed this one, as
happened once by hand); the warm-up run is not counted; the table and the JSON hold the medians. The measures
themselves start real servers and ranks (tens of seconds), so here they are stand-ins; the real runs are in
docs/benchmarks.md."""

from __future__ import annotations

import json
import os
from pathlib import Path

SCRIPT = Path(__file__).parents[2] / "scripts" / "startup_times.py"


def test_the_tree_comes_first_and_runs_start_outside_a_checkout(tmp_path, monkeypatch, load_script):
    script = load_script("startup_times")
    monkeypatch.setenv("PYTHONPATH", "/somewhere/else")
    env = script._env(tmp_path / "old", "/cache")
    assert env["PYTHONPATH"].split(os.pathsep) == [str(tmp_path / "old"), "/somewhere/else"]
    assert env["K6SERVE_CACHE"] == "/cache"
    assert script.folder_parent(str(tmp_path / "scratch" / "run0")) == str(tmp_path / "scratch")


def test_medians_of_the_counted_runs_in_the_table_and_the_json(tmp_path, monkeypatch, capsys, load_script):
    script = load_script("startup_times")
    calls = []

    def stand_in(name, values):
        def measure(env, device, folder, mode):
            assert mode == "balanced"
            calls.append((name, Path(folder).name))
            return {f"{name}_s": values[len([c for c in calls if c[0] == name]) - 1]}
        measure.__name__ = f"time_{name}"
        return measure

    # generate runs once more, first: the warm-up that builds the demo, whose 99 s is not counted.
    monkeypatch.setattr(script, "time_generate", stand_in("generate", [99.0, 3.0, 1.0, 2.0]))
    monkeypatch.setattr(script, "time_serve", stand_in("serve", [5.0, 4.0, 6.0]))
    monkeypatch.setattr(script, "time_engine", stand_in("engine", [0.5, 0.7, 0.6]))
    assert script.main(["--repeats", "3", "--out", str(tmp_path), "--tree", str(tmp_path),
                        "--performance-mode", "balanced"]) == 0
    assert calls[0] == ("generate", "warm")
    payload = json.loads((tmp_path / "startup_times.json").read_text())
    assert payload["median_s"] == {"generate_s": 2.0, "serve_s": 5.0, "engine_s": 0.6}
    assert payload["runs_s"]["generate_s"] == [3.0, 1.0, 2.0] and payload["repeats"] == 3
    table = capsys.readouterr().out
    assert "| generate_s | 2.00 | 3.00, 1.00, 2.00 |" in table and "| engine_s | 0.60 |" in table
