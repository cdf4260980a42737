"""scripts/gpu_folder_diagnose.py's comparisons on CPU: what it reports is what differs between a folder's load and
the dummy build (on the H200 it found the text encoder's rotary tables, the only tensors apart)."""

import dataclasses
import sys
from pathlib import Path

import torch

sys.path.append(str(Path(__file__).parents[2] / "scripts"))  # appended: no script shadows a module
import gpu_folder_diagnose as diagnose  # noqa: E402 (the scripts folder first)


class _Rotary(torch.nn.Module):
    def __init__(self, base: float = 10000.0) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)
        self.register_buffer("inv_freq", 1.0 / base ** (torch.arange(0, 8, 2) / 8), persistent=False)


def test_the_comparison_names_each_kind_of_difference():
    torch.manual_seed(0)
    loaded, built = _Rotary(), _Rotary()
    built.load_state_dict(loaded.state_dict())
    assert diagnose.compare_modules(loaded, built)["differing_tensors"] == 0
    built.inv_freq.mul_(1 + 2 ** -20)  # a buffer no checkpoint stores counts too
    report = diagnose.compare_modules(loaded, built)
    assert report["differing_tensors"] == 1 and report["values"][0][0] == "inv_freq"
    built.linear.bias.data = built.linear.bias.data.double()
    built.extra = torch.nn.Linear(1, 1)
    report = diagnose.compare_modules(loaded, built)
    assert report["dtype"] == [["linear.bias", "torch.float32", "torch.float64"]]
    assert report["only_built"] == ["extra.bias", "extra.weight"] and report["only_loaded"] == []


def test_configs_compare_as_saved_files_read_back():
    @dataclasses.dataclass
    class Config:
        sizes: tuple = (8, 8)
        heads: int = 2

    class Module:
        def __init__(self, config) -> None:
            self.config = config

    # A saved config reads back lists where the built one holds tuples: no difference.
    assert diagnose.compare_configs(Module({"sizes": [8, 8]}), Module({"sizes": (8, 8)})) == {}
    assert diagnose.compare_configs(Module(Config()), Module(Config(heads=3))) == {"heads": ["2", "3"]}
    assert diagnose.compare_configs(Module({"a": 1}), Module({})) == {"a": ["1", "'<absent>'"]}


def test_module_outputs_are_hashed_through_nested_containers():
    tensor = torch.arange(6.0).reshape(2, 3)
    digests = diagnose._digests({"hidden": (tensor, [tensor * 2]), "count": 3})
    assert len(digests) == 2 and digests[0] != digests[1]
    assert diagnose._digests(tensor.clone()) == diagnose._digests(tensor)[:1]
    # Equal values in another dtype or layout may take another kernel: they hash apart.
    assert diagnose._digests(tensor.to(torch.bfloat16)) != diagnose._digests(tensor)[:1]
    transposed = tensor.t().contiguous().t()
    assert torch.equal(transposed, tensor) and diagnose._digests(transposed) != diagnose._digests(tensor)[:1]
    assert diagnose._digests(None) == []


def test_the_watch_records_inputs_state_and_outputs_and_the_pair_names_where_runs_part():
    from types import SimpleNamespace

    def run(weight_scale: float, input_scale: float = 1.0) -> dict:
        torch.manual_seed(0)
        vocoder = torch.nn.Linear(4, 4)
        with torch.no_grad():
            vocoder.weight.mul_(weight_scale)
        calls: list = []
        diagnose._watch(SimpleNamespace(vocoder=vocoder, text_encoder=None), calls)  # an absent component: skipped
        vocoder(torch.ones(2, 4) * input_scale)
        return {"calls": calls}

    same = run(1.0)
    assert [call[:2] for call in same["calls"]] == [("vocoder", "in"), ("vocoder", "state"), ("vocoder", "out")]
    assert diagnose.first_difference(same, run(1.0)) is None
    # Other weights: the state differs before the output does; another input: the inputs do.
    assert diagnose.first_difference(same, run(2.0))["kind"] == "state"
    assert diagnose.first_difference(same, run(1.0, 3.0))["kind"] == "in"
    assert diagnose.first_difference(same, {"calls": same["calls"][:1]}) == {"call": 1, "module": None,
                                                                            "kind": "count"}


def test_two_processes_traces_compare_through_their_json_files(tmp_path):
    """`--compare`: traces written by two processes (their calls' tuples become JSON lists) part where they differ."""
    import json

    calls = [("transformer", "in", ["a"]), ("transformer", "out", ["b"]), ("vocoder", "out", ["c"])]
    (tmp_path / "trace_a.json").write_text(json.dumps({"mp4": "x", "calls": calls}))
    (tmp_path / "trace_b.json").write_text(json.dumps({"mp4": "x", "calls": calls}))
    same = diagnose.compare_traces(tmp_path / "trace_a.json", tmp_path / "trace_b.json")
    assert same["first_difference"] is None and same["differences"] == [] and same["calls"] == [3, 3]
    other = calls[:1] + [("transformer", "out", ["B"]), calls[2]]
    (tmp_path / "trace_b.json").write_text(json.dumps({"mp4": "y", "calls": other}))
    apart = diagnose.compare_traces(tmp_path / "trace_a.json", tmp_path / "trace_b.json")
    assert apart["first_difference"]["module"] == "transformer" and apart["first_difference"]["kind"] == "out"
    assert apart["differences"] == [[1, "transformer", "out"]] and apart["mp4"] == ["x", "y"]
