"""The HTTP server's prediction of the adapters a job will meet (`serve/lora_state.py`), against the worker itself.

`JobRunner._check_loras` refuses at creation a job with its own `loras` ({} included) while the server's adapters will
be merged, since the worker refuses it when it starts (`LoraManager.check_request`). The prediction folds the
`--lora-path` adapter and each LoRA operation with the worker's rules ("auto" is the server's --lora-merge-mode, which
merges unless under FSDP; a refused operation changes nothing); here the real worker on the tiny distilled checkpoint
runs the same operations and must agree after each one. FSDP needs GPUs, so its rules are checked on the fold alone.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from k6serve.engine_arguments import build_engine_config
from k6serve.lora.spec import (
    ListLoras,
    LoraSpec,
    MergeLora,
    SetLora,
    UnloadLora,
    UnmergeLora,
    set_lora_merge_mode,
    start_set_lora,
)
from k6serve.runtime.worker import ModelWorker
from k6serve.serve.lora_state import MODE_VARIES, Adapters, LoraState

pytestmark = pytest.mark.usefixtures("one_torch_thread")

TARGET = "visual_transformer_blocks.0.video_dec_block.self_attention.to_key"


@pytest.fixture(scope="module")
def adapters(tiny_distill_dir, tmp_path_factory) -> dict[str, str]:
    """Two rank-2 adapters on one Linear of the tiny DiT."""
    worker = ModelWorker(build_engine_config(str(tiny_distill_dir), device="cpu", attention_backend="sdpa"))
    out_features, in_features = worker.pipeline.models.transformer.get_submodule(TARGET).weight.shape
    folder = tmp_path_factory.mktemp("adapters")
    files = {}
    for seed, nickname in enumerate(("fox", "hero")):
        generator = torch.Generator().manual_seed(seed)
        files[nickname] = str(folder / f"{nickname}.safetensors")
        save_file({f"transformer.{TARGET}.lora_A.weight": 0.1 * torch.randn(2, in_features, generator=generator),
                   f"transformer.{TARGET}.lora_B.weight": 0.1 * torch.randn(out_features, 2, generator=generator)},
                  files[nickname])
    return files


def _operations(adapters: dict[str, str]) -> list:
    fox, hero = LoraSpec(nickname="fox"), LoraSpec(nickname="hero", path=adapters["hero"], strength=0.5)
    return [
        MergeLora(strength=0.5),
        SetLora(specs=(fox,)),  # auto: the server's --lora-merge-mode
        SetLora(specs=(LoraSpec(nickname="ghost"),), merge_mode="dynamic"),  # refused: not loaded
        SetLora(specs=(hero,), merge_mode="dynamic"),
        MergeLora(),
        ListLoras(),
        UnmergeLora(),
        MergeLora(),  # refused: no adapter active
        SetLora(specs=(fox, LoraSpec(nickname="hero")), merge_mode="merge"),
        SetLora(specs=(), merge_mode="merge"),  # none active, whatever the mode
        SetLora(specs=(LoraSpec(nickname="hero", strength=2.0),), merge_mode="auto"),
        SetLora(specs=(fox,), merge_mode="dynamic"),
        UnloadLora(nicknames=("fox",)),  # refused: active
        UnloadLora(nicknames=("hero", "ghost")),  # refused: ghost is not loaded (and hero stays)
        UnloadLora(nicknames=("hero",)),
        SetLora(specs=(LoraSpec(nickname="hero"),), merge_mode="dynamic"),  # refused: unloaded
    ]


def _worker_adapters(worker: ModelWorker) -> Adapters:
    manager = worker.lora_manager
    active = tuple(LoraSpec(nickname=entry.nickname, strength=entry.strength) for entry in manager.active)
    return Adapters(frozenset(manager.adapters), active, manager.applied_mode)


def _refuses_own_loras(worker: ModelWorker) -> bool:
    try:
        worker.lora_manager.check_request(())  # {}: the base model
    except ValueError as exc:
        assert "the engine's adapters are merged into the weights" in str(exc)
        return True
    return False


@pytest.mark.parametrize("server_merge_mode", ["auto", "merge", "dynamic"])
def test_the_servers_prediction_is_what_the_worker_does(tiny_distill_dir, adapters, server_merge_mode):
    worker = ModelWorker(build_engine_config(str(tiny_distill_dir), device="cpu", attention_backend="sdpa",
                                             lora_path=adapters["fox"], lora_nickname="fox", lora_scale=0.8,
                                             lora_merge_mode=server_merge_mode))
    state = LoraState([], start=start_set_lora(worker.config.model), server_merge_mode=server_merge_mode)
    modes = []
    for operation in [None, *_operations(adapters)]:
        if operation is not None:
            predicted = state.after([operation])
            try:
                worker.apply_lora_operation(operation)
            except ValueError:
                assert predicted == state.now, operation  # a refusal the server foresees changes nothing
            else:
                state.record(operation)
                assert predicted == state.now, operation
        held = _worker_adapters(worker)
        assert (held.loaded, held.mode) == (state.now.loaded, state.now.mode), operation
        assert [(spec.nickname, spec.strength) for spec in held.active] == [
            (spec.nickname, spec.strength) for spec in state.now.active], operation
        assert _refuses_own_loras(worker) == (state.now.mode == "merge"), operation
        modes.append(state.now.mode)
    merged_by_auto = "dynamic" if server_merge_mode == "dynamic" else "merge"
    assert modes == [merged_by_auto, "merge", merged_by_auto, merged_by_auto, "dynamic", "merge", "merge", None,
                     None, "merge", None, merged_by_auto, "dynamic", "dynamic", "dynamic", "dynamic", "dynamic"]
    assert state.now.loaded == {"fox"} and set(worker.lora_manager.adapters) == {"fox"}


def test_under_fsdp_auto_is_dynamic_and_a_merge_is_refused():
    assert set_lora_merge_mode("auto", server_merge_mode="auto", fsdp=True) == "dynamic"
    assert set_lora_merge_mode("auto", server_merge_mode="auto", fsdp=False) == "merge"
    assert set_lora_merge_mode("auto", server_merge_mode="dynamic", fsdp=False) == "dynamic"
    assert set_lora_merge_mode("dynamic", server_merge_mode="merge", fsdp=False) == "dynamic"
    with pytest.raises(ValueError, match="cannot be used with --use-fsdp-inference"):
        set_lora_merge_mode("merge", server_merge_mode="auto", fsdp=True)
    start = SetLora(specs=(LoraSpec(nickname="style", path="/a.safetensors"),))
    state = LoraState([], start=start, fsdp=True)
    assert state.now.mode == "dynamic"
    # Refused by the worker under FSDP, so nothing changes.
    assert state.after([SetLora(specs=(LoraSpec(nickname="style"),), merge_mode="merge"), MergeLora()]) == state.now


def test_replicas_that_disagree_leave_the_merge_to_the_job_start():
    state = LoraState([], start=SetLora(specs=(LoraSpec(nickname="style", path="/a.safetensors"),)))
    assert state.now.mode == "merge"
    state.replicas_disagree()
    assert state.now.mode == MODE_VARIES and state.loaded == {"style"}
    assert state.after([MergeLora()]).mode == "merge"  # every replica merged, if it succeeds
    assert state.after([UnmergeLora()]).mode is None


def test_a_restart_rebuilds_the_merge_state_from_the_start_adapter_and_the_replay_list():
    start = SetLora(specs=(LoraSpec(nickname="style", path="/a.safetensors"),), merge_mode="dynamic")
    stored = [{"type": "SetLora", "merge_mode": "auto", "target": "all",
               "specs": [{"nickname": "hero", "path": "/b.safetensors", "strength": 0.5, "alpha": None}]}]
    assert LoraState.from_json([], start=start).now.mode == "dynamic"
    state = LoraState.from_json(stored, start=start, server_merge_mode="dynamic")
    assert (state.now.mode, state.loaded) == ("dynamic", {"style", "hero"})
    state = LoraState.from_json(stored + [{"type": "MergeLora", "target": "all", "strength": None}], start=start,
                                server_merge_mode="dynamic")
    assert state.now.mode == "merge" and [spec.nickname for spec in state.now.active] == ["hero"]
    assert Path(state.paths["style"]) == Path("/a.safetensors")


def _replayed(state: LoraState, start: SetLora | None) -> LoraState:
    """The state of a server restarted on the same job store: the stored list read back and replayed."""
    stored = json.loads(json.dumps(state.to_json()))
    restarted = LoraState(start=start, server_merge_mode=state.server_merge_mode)
    for operation in LoraState.from_json(stored, start=start, server_merge_mode=state.server_merge_mode).operations:
        restarted.record(operation)
    return restarted


def test_a_deactivated_start_adapter_stays_deactivated_after_a_restart():
    """An unmerge (or an empty set_lora) recorded as an empty list brought the --lora-path adapter back active after
    a restart, though the jobs queued since were created without it."""
    start = SetLora(specs=(LoraSpec(nickname="style", path="/a.safetensors"),))
    for deactivate in (UnmergeLora(), SetLora(specs=())):
        state = LoraState(start=start)
        assert state.operations == []  # nothing changed: the worker's start is the state
        state.record(deactivate)
        assert state.operations == [UnmergeLora()] and state.now.active == ()
        restarted = _replayed(state, start)
        assert (restarted.now.active, restarted.loaded) == ((), {"style"})
    # without a --lora-path adapter there is nothing to deactivate at start
    state = LoraState()
    state.record(SetLora(specs=()))
    assert state.operations == []


def test_adapters_loaded_but_not_active_are_loaded_again_after_a_restart():
    """A job queued before the restart may name any loaded adapter in its own loras: a restart that dropped the ones
    the last set_lora did not name failed those jobs when they started."""
    start = SetLora(specs=(LoraSpec(nickname="style", path="/a.safetensors"),), merge_mode="dynamic")
    state = LoraState(start=start, server_merge_mode="dynamic")
    state.record(SetLora(specs=(LoraSpec(nickname="hero", path="/h.safetensors", alpha=8.0),), merge_mode="dynamic"))
    state.record(SetLora(specs=(LoraSpec(nickname="crowd", path="/c.safetensors", strength=0.5),)))
    assert state.loaded == {"style", "hero", "crowd"}
    assert state.operations == [
        # the start adapter is loaded by the worker itself; hero keeps its alpha override (a job's own loras use it)
        SetLora(specs=(LoraSpec(nickname="hero", path="/h.safetensors", alpha=8.0),), merge_mode="dynamic"),
        UnmergeLora(),
        SetLora(specs=(LoraSpec(nickname="crowd", path="/c.safetensors", strength=0.5),)),
    ]
    restarted = _replayed(state, start)
    assert restarted.loaded == state.loaded and restarted.now == state.now
    assert restarted.operations == state.operations  # replaying the list gives the same list
    # the start adapter loaded again from another file is no longer what the worker loads at start
    state.record(SetLora(specs=(LoraSpec(nickname="style", path="/b.safetensors"),)))
    state.record(UnmergeLora())
    assert state.operations == [SetLora(specs=(LoraSpec(nickname="style", path="/b.safetensors"),
                                               LoraSpec(nickname="hero", path="/h.safetensors", alpha=8.0),
                                               LoraSpec(nickname="crowd", path="/c.safetensors")),
                                        merge_mode="dynamic"), UnmergeLora()]
    assert _replayed(state, start).now == Adapters(frozenset({"style", "hero", "crowd"}))


def test_merges_of_the_start_adapter_replay_as_merges():
    start = SetLora(specs=(LoraSpec(nickname="style", path="/a.safetensors"),), merge_mode="dynamic")
    state = LoraState(start=start, server_merge_mode="dynamic")
    state.record(MergeLora(strength=0.5))
    assert state.operations == [MergeLora(strength=0.5)]  # the start's adapter is the active one: nothing to load
    assert _replayed(state, start).now == state.now


def test_merges_in_a_row_replay_as_one_at_the_last_strength_given():
    start = SetLora(specs=(LoraSpec(nickname="style", path="/a.safetensors"),))
    state = LoraState(start=start, server_merge_mode="dynamic")
    for strength in [*(0.01 * step for step in range(1, 300)), None]:
        state.record(MergeLora(strength=strength))
    assert state.operations == [MergeLora(strength=2.99)]
    assert state.now.active == (LoraSpec(nickname="style", path="/a.safetensors", strength=2.99),)
    # A SetLora or an unmerge in between starts a new run: the merges before it are not folded across it.
    state.record(SetLora(specs=(LoraSpec(nickname="style", strength=0.5),), merge_mode="dynamic"))
    state.record(MergeLora())
    state.record(MergeLora(strength=0.7))
    assert state.operations == [SetLora(specs=(LoraSpec(nickname="style", path="/a.safetensors", strength=0.5),),
                                        merge_mode="dynamic"), MergeLora(strength=0.7)]


def test_one_merge_at_the_last_strength_gives_the_weights_of_the_merges_it_stands_for(tiny_distill_dir, adapters):
    """What the compacted replay list rests on: re-merging rebuilds from the base weights, so merges at 0.3, 0.6,
    then without a strength leave the weights bit for bit as one merge at 0.6 does."""
    worker = ModelWorker(build_engine_config(str(tiny_distill_dir), device="cpu", attention_backend="sdpa"))
    weight = worker.pipeline.models.transformer.get_submodule(TARGET).weight
    fox = SetLora(specs=(LoraSpec(nickname="fox", path=adapters["fox"]),), merge_mode="dynamic")
    merged = []
    for merges in ([MergeLora(strength=0.3), MergeLora(strength=0.6), MergeLora()], [MergeLora(strength=0.6)]):
        for operation in [fox, *merges]:
            worker.apply_lora_operation(operation)
        merged.append(weight.detach().clone())
        worker.apply_lora_operation(UnmergeLora())
    assert torch.equal(merged[0], merged[1])


def test_an_unloaded_adapter_is_not_loaded_again_after_a_restart():
    state = LoraState(server_merge_mode="dynamic")
    for nickname in ("old", "kept", "active"):
        state.record(SetLora(specs=(LoraSpec(nickname=nickname, path=f"/{nickname}.safetensors"),)))
    state.record(UnloadLora(nicknames=("old",)))
    assert state.loaded == {"kept", "active"}
    assert state.operations == [
        SetLora(specs=(LoraSpec(nickname="kept", path="/kept.safetensors"),), merge_mode="dynamic"), UnmergeLora(),
        SetLora(specs=(LoraSpec(nickname="active", path="/active.safetensors"),))]
    # The server's prediction of a refused unload (an active adapter, one not loaded) changes nothing.
    assert state.after([UnloadLora(nicknames=("active",))]) == state.now
    assert state.after([UnloadLora(nicknames=("old",))]) == state.now
