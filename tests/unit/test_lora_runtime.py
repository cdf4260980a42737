"""LoRA operations through the engine and the Python API: between requests, in submission order, on every replica.

The in-process tests use a fake worker; the `multiprocess` ones a fake rank worker on gloo whose operation does an
all-reduce over its replica, so it only completes when every rank of the replica runs it.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
from test_launch import TIMEOUT_S, FakeRankWorker, make_config, note
from typed_dicts import mismatches

from k6serve.api import DiffGenerator
from k6serve.config import EngineConfig, ModelConfig
from k6serve.lora.arguments import LoraArgumentError
from k6serve.lora.spec import ListLoras, LoraChange, LoraListing, LoraSpec, MergeLora, SetLora, UnmergeLora
from k6serve.models.variants import VARIANTS
from k6serve.request import OutputOptions, SamplingParams, VideoResult
from k6serve.runtime.engine import Engine
from k6serve.runtime.process_group_worker import MultiProcessWorker

NO_OUTPUT = OutputOptions(save_output=False)


class FakeLoraWorker:
    """An in-process worker: `run` holds while the prompt says "hold" and `release` is unset; every start, end and
    LoRA operation is appended to `log`."""

    def __init__(self, num_replicas: int = 1) -> None:
        self.variant = VARIANTS["pro"]
        self.num_replicas = num_replicas
        self.release = threading.Event()
        self.log: list[str] = []
        self.operations: list[object] = []
        self.lock = threading.Lock()

    def _note(self, text: str) -> None:
        with self.lock:
            self.log.append(text)

    def run(self, params: SamplingParams, output: OutputOptions, on_step=None) -> str:
        self._note(f"start {params.prompt}")
        if "hold" in params.prompt:
            assert self.release.wait(TIMEOUT_S)
        time.sleep(0.05)
        self._note(f"end {params.prompt}")
        return params.prompt

    def apply_lora_operation(self, operation) -> dict:
        if isinstance(operation, SetLora) and any(s.nickname == "bad" for s in operation.specs):
            raise ValueError("no adapter file for 'bad'")
        self.operations.append(operation)
        self._note(type(operation).__name__)
        if isinstance(operation, ListLoras):
            return {"loras": []}
        return {"status": "ok", "message": type(operation).__name__, "loras": []}


def engine_with(worker) -> Engine:
    return Engine(EngineConfig(model=ModelConfig(model_path="fake")), worker=worker)


def wait_until(predicate, timeout: float = TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.01)


@pytest.mark.parametrize("num_replicas", [1, 2])
def test_an_operation_runs_after_the_requests_before_it_and_before_those_after(num_replicas):
    worker = FakeLoraWorker(num_replicas)
    engine = engine_with(worker)
    try:
        before = [engine.submit(SamplingParams(prompt=f"hold {i}")) for i in range(num_replicas)]
        wait_until(lambda: len(worker.log) == num_replicas)  # every replica busy
        operation = engine.submit_lora(SetLora(specs=(LoraSpec(nickname="a", path="a.safetensors"),)))
        after = engine.submit(SamplingParams(prompt="after"))
        time.sleep(0.2)
        assert not operation.done() and not after.future.done()
        worker.release.set()
        assert operation.result(TIMEOUT_S)["status"] == "ok"
        assert after.future.result(TIMEOUT_S) == "after"
        assert all(job.future.result(TIMEOUT_S) for job in before)
        lora_at = worker.log.index("SetLora")
        assert all(entry.startswith("end hold") for entry in worker.log[num_replicas:lora_at])
        assert worker.log[lora_at + 1:] == ["start after", "end after"]
    finally:
        worker.release.set()
        engine.shutdown()


def test_a_worker_value_error_comes_back_as_value_error_and_the_engine_keeps_serving():
    worker = FakeLoraWorker()
    engine = engine_with(worker)
    try:
        with pytest.raises(ValueError, match="no adapter file for 'bad'"):
            engine.lora(SetLora(specs=(LoraSpec(nickname="bad"),)))
        assert engine.generate(SamplingParams(prompt="fine")) == "fine"
        assert engine.lora(ListLoras()) == {"loras": []}
    finally:
        engine.shutdown()
    with pytest.raises(RuntimeError, match="shut down"):
        engine.lora(ListLoras())


def test_the_api_builds_the_operations():
    worker = FakeLoraWorker()
    generator = DiffGenerator(engine_with(worker))
    try:
        assert generator.set_lora("style", "/adapters/style.safetensors")["status"] == "ok"
        generator.set_lora(["style", "hero"], [None, Path("/adapters/hero")], 0.5, merge_mode="dynamic",
                           target="transformer", lora_alpha=8)
        generator.set_lora(["style", "hero"], strength=[1, 0.25])
        generator.merge_lora_weights(strength=0.75)
        generator.unmerge_lora_weights()
        assert generator.list_loras() == {"loras": []}
    finally:
        generator.shutdown()
    assert worker.operations == [
        SetLora(specs=(LoraSpec(nickname="style", path="/adapters/style.safetensors"),)),
        SetLora(specs=(LoraSpec(nickname="style", strength=0.5, alpha=8.0),
                       LoraSpec(nickname="hero", path="/adapters/hero", strength=0.5, alpha=8.0)),
                merge_mode="dynamic", target="transformer"),
        SetLora(specs=(LoraSpec(nickname="style", strength=1.0), LoraSpec(nickname="hero", strength=0.25))),
        MergeLora(strength=0.75),
        UnmergeLora(),
        ListLoras(),
    ]


@pytest.mark.parametrize(("call", "argument", "message"), [
    (lambda g: g.set_lora(""), "nickname", "non-empty string"),
    (lambda g: g.set_lora(3), "nickname", "non-empty string"),
    (lambda g: g.set_lora(["a", "a"]), "nickname", "more than once"),
    # Accepted before: a request's `loras` had to repeat the space, and the newline split every log line naming it.
    (lambda g: g.set_lora("my style\n"), "nickname", r"nickname 'my style\\n' starts or ends with spaces or holds "
                                                     r"control characters .*e\.g\. 'my style'"),
    (lambda g: g.set_lora(["a", " b"]), "nickname", "starts or ends with spaces"),
    # The example was the refused name again where the control character is no whitespace (a NUL, an escape).
    (lambda g: g.set_lora("my\x00style"), "nickname", r"^nickname 'my\\x00style' starts .* use plain text, "
                                                       r"e\.g\. 'my style'\.$"),
    (lambda g: g.set_lora("\x1b[31m"), "nickname", r"^nickname '\\x1b\[31m' .* use plain text, e\.g\. '\[31m'\.$"),
    (lambda g: g.set_lora("\x00"), "nickname", r"^nickname '\\x00' starts .* control characters \(a newline, a "
                                                r"tab\); use plain text\.$"),
    (lambda g: g.set_lora("a", ["x", "y"]), "path", "path is a list but nickname is one name"),
    (lambda g: g.set_lora(["a", "b"], "x"), "path", "must be a list as long as nickname"),
    (lambda g: g.set_lora(["a", "b"], ["x"]), "path", "has 1 entries but nickname has 2"),
    (lambda g: g.set_lora("a", 5), "path", "non-empty string"),
    (lambda g: g.set_lora("a", strength=True), "strength", "finite number"),
    (lambda g: g.set_lora("a", strength=float("nan")), "strength", "finite number"),
    (lambda g: g.set_lora("a", strength=[1.0]), "strength", "strength is a list"),
    (lambda g: g.set_lora(["a", "b"], strength=[1.0, "x"]), "strength", "finite number"),
    (lambda g: g.set_lora("a", merge_mode="fuse"), "merge_mode", "'auto', 'merge', 'dynamic'"),
    (lambda g: g.set_lora("a", target="transformer_2"), "target", "'all', 'transformer'"),
    (lambda g: g.set_lora("a", lora_alpha="4"), "lora_alpha", "finite number"),
    (lambda g: g.merge_lora_weights(strength="1"), "strength", "finite number"),
    (lambda g: g.merge_lora_weights(target=None), "target", "must be one of"),
    (lambda g: g.unmerge_lora_weights(target="critic"), "target", "must be one of"),
])
def test_the_api_checks_its_arguments_before_queueing(call, argument, message):
    worker = FakeLoraWorker()
    generator = DiffGenerator(engine_with(worker))
    try:
        with pytest.raises(LoraArgumentError, match=message) as caught:
            call(generator)
        assert caught.value.argument == argument
        assert worker.operations == []
    finally:
        generator.shutdown()


# ---- multi-process (gloo) ----


class LoraRankWorker(FakeRankWorker):
    """`FakeRankWorker` holding a list of active adapter names; "bad" fails on every rank, "bad-on-replica-N" on
    the ranks of replica N only. Requests report the adapters they ran with."""

    def __init__(self, config, context):
        super().__init__(config, context)
        self.adapters: list[str] = []

    def apply_lora_operation(self, operation) -> dict:
        replica = self.context.groups.replica
        if isinstance(operation, SetLora):
            names = [spec.nickname for spec in operation.specs]
            if "bad" in names or f"bad-on-replica-{replica}" in names:
                raise ValueError(f"replica {replica} refuses {names}")
            if f"die-on-replica-{replica}" in names:
                os.kill(os.getpid(), signal.SIGKILL)
            self.adapters = names
        elif isinstance(operation, UnmergeLora):
            self.adapters = []
        ranks = torch.tensor([float(self.context.spec.rank)])
        dist.all_reduce(ranks, group=self.context.groups.replica_group)  # completes only if every rank runs it
        return {"status": "ok", "message": f"replica {replica}, rank sum {ranks.item():g}",
                "loras": [{"nickname": name} for name in self.adapters]}

    def run(self, params: SamplingParams, output: OutputOptions, on_step=None) -> VideoResult:
        result = super().run(params, output, on_step)
        return dataclasses.replace(result, notes=[*result.notes, f"adapters={','.join(self.adapters)}"])


@pytest.mark.multiprocess
def test_two_ranks_of_a_replica_apply_the_operation_in_order_with_requests():
    worker = MultiProcessWorker(make_config(num_gpus=2, ulysses_degree=2), build_rank_worker=LoraRankWorker)
    engine = Engine(worker.config, worker=worker)
    try:
        first = engine.submit(SamplingParams(prompt="slow", num_inference_steps=3), NO_OUTPUT)
        operation = engine.submit_lora(SetLora(specs=(LoraSpec(nickname="a"), LoraSpec(nickname="b"))))
        second = engine.submit(SamplingParams(prompt="cat", num_inference_steps=1), NO_OUTPUT)
        assert operation.result(TIMEOUT_S) == {"status": "ok", "message": "replica 0, rank sum 1",
                                               "loras": [{"nickname": "a"}, {"nickname": "b"}]}
        assert note(first.future.result(TIMEOUT_S), "adapters") == ""
        assert note(second.future.result(TIMEOUT_S), "adapters") == "a,b"
        with pytest.raises(ValueError, match=r"replica 0 refuses \['bad'\]"):
            engine.lora(SetLora(specs=(LoraSpec(nickname="bad"),)))
        assert engine.lora(ListLoras())["loras"] == [{"nickname": "a"}, {"nickname": "b"}]  # unchanged
    finally:
        engine.shutdown()
        worker.close()


@pytest.mark.multiprocess
def test_every_dp_replica_applies_the_operation_and_a_partial_failure_says_so(tmp_path: Path):
    worker = MultiProcessWorker(make_config(num_gpus=2, dp_size=2), build_rank_worker=LoraRankWorker)
    engine = Engine(worker.config, worker=worker)
    try:
        assert engine.lora(SetLora(specs=(LoraSpec(nickname="a"),)))["message"] == "replica 0, rank sum 0"
        # Two requests at once, one per replica (the first waits for the second to start): both see the adapter.
        marker = tmp_path / "second-started"
        first = engine.submit(SamplingParams(prompt=f"wait-for:{marker}", num_inference_steps=1), NO_OUTPUT)
        time.sleep(0.2)
        second = engine.submit(SamplingParams(prompt=f"touch:{marker}", num_inference_steps=1), NO_OUTPUT)
        results = [job.future.result(TIMEOUT_S) for job in (first, second)]
        assert {note(r, "replica") for r in results} == {"0", "1"}
        assert [note(r, "adapters") for r in results] == ["a", "a"]
        with pytest.raises(RuntimeError, match=r"SetLora succeeded on replica\(s\) \[0\] but failed on "
                                               r"replica\(s\) \[1\].*hold different LoRA adapters"):
            engine.lora(SetLora(specs=(LoraSpec(nickname="bad-on-replica-1"),)))
        with pytest.raises(ValueError, match="refuses"):  # failed on both: a plain ValueError
            engine.lora(SetLora(specs=(LoraSpec(nickname="bad"),)))
        assert engine.lora(UnmergeLora())["loras"] == []
    finally:
        engine.shutdown()
        worker.close()


@pytest.mark.multiprocess
def test_a_replica_dying_during_an_operation_leaves_the_serving_ones_agreeing():
    """The replicas still serving all applied it: it succeeds, not `ReplicasDisagree` (which made the server record
    the adapters as varying and drop the change from what it restores at its restart)."""
    worker = MultiProcessWorker(make_config(num_gpus=2, dp_size=2), build_rank_worker=LoraRankWorker)
    engine = Engine(worker.config, worker=worker)
    try:
        result = engine.lora(SetLora(specs=(LoraSpec(nickname="die-on-replica-1"),)))
        assert result["loras"] == [{"nickname": "die-on-replica-1"}]
        assert len(engine.dead_replicas()) == 1
        ran = engine.generate(SamplingParams(prompt="cat", num_inference_steps=1), NO_OUTPUT)
        assert note(ran, "adapters") == "die-on-replica-1"
    finally:
        engine.shutdown()


# ---- end to end: the real worker on the built-in demo checkpoint, through the default multi-process engine ----


@pytest.mark.multiprocess
@pytest.mark.slow
def test_the_api_changes_and_restores_the_demo_model_through_the_rank_process(demo_dir, tmp_path):
    from safetensors import safe_open

    from k6serve.runtime.worker import ModelWorker

    if not hasattr(ModelWorker, "apply_lora_operation"):
        pytest.skip("the LoRA core (ModelWorker.apply_lora_operation) is not here yet")
    test_lora = pytest.importorskip("test_lora", reason="tests/unit/test_lora.py (write_adapter) is not here yet")
    VIDEO_FFN, write_adapter = test_lora.VIDEO_FFN, test_lora.write_adapter

    with safe_open(str(demo_dir / "transformer" / "diffusion_pytorch_model.safetensors"), "pt") as weights:
        shape = tuple(weights.get_slice(f"{VIDEO_FFN}.weight").get_shape())
    adapter = write_adapter(tmp_path, {VIDEO_FFN: shape}, amplitude=0.5)
    params = {"prompt": "a fox in the snow", "seed": 7, "height": 32, "width": 48, "num_frames": 5,
              "num_inference_steps": 2, "save_output": False, "return_frames": True}
    with DiffGenerator.from_pretrained("demo", device="cpu", attention_backend="sdpa") as generator:
        baseline = generator.generate(params)
        reply = generator.set_lora("fox", str(adapter), merge_mode="merge")
        assert reply["status"] == "ok" and [lora["nickname"] for lora in reply["loras"]] == ["fox"]
        # The replies' types (and the OpenAPI document's answers, made from them) name every key, and no other.
        assert mismatches(reply, LoraChange) == [] and reply["loras"][0]["merge_mode"] == "merge"
        adapted = generator.generate(params)
        assert not np.array_equal(adapted.frames, baseline.frames)
        with pytest.raises(ValueError):
            generator.set_lora("ghost", str(tmp_path / "missing.safetensors"))
        listing = generator.list_loras()
        assert [lora["nickname"] for lora in listing["loras"]] == ["fox"] and mismatches(listing, LoraListing) == []
        # The memory replies of a rank process: each rank's report says where it ran.
        from k6serve.runtime.memory import MemoryReply

        released = generator.release_memory()
        assert mismatches(released, MemoryReply) == [] and {"rank", "replica"} <= released["ranks"][0].keys()
        assert mismatches(generator.resume_memory(), MemoryReply) == []
        assert generator.unmerge_lora_weights()["status"] == "ok"
        restored = generator.generate(params)
        assert np.array_equal(restored.frames, baseline.frames) and np.array_equal(restored.audio, baseline.audio)
        # Inactive now: it can be forgotten, and then it cannot be reused by nickname.
        with pytest.raises(ValueError, match=r"no LoRA adapter is loaded under the nickname\(s\) 'ghost'"):
            generator.unload_lora("ghost")
        assert generator.unload_lora("fox")["loras"] == [] and generator.list_loras() == {"loras": []}
        with pytest.raises(ValueError, match="no LoRA adapter is loaded under the nickname 'fox'"):
            generator.set_lora("fox")
