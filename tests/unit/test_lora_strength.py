"""LoRA strengths and alphas: the bounds every surface checks (`MAX_LORA_STRENGTH`, `MAX_LORA_ALPHA`), and latents
that overflow anyway (an adapter file with extreme values, at an allowed strength), whose error names the adapters and
strengths the DiT ran with, and after which the engine's adapters and weights are as before (tiny distilled
checkpoint, CPU, fp32)."""

from __future__ import annotations

import pickle
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from k6serve.api import DiffGenerator
from k6serve.cli.main import main
from k6serve.config import EngineConfig, ModelConfig
from k6serve.engine_arguments import build_engine_config
from k6serve.lora.adapter import read_adapter
from k6serve.lora.preflight import check_start_adapter
from k6serve.lora.spec import ListLoras, LoraSpec, MergeLora, SetLora, UnmergeLora
from k6serve.models.variants import VARIANTS
from k6serve.pipelines.text_to_video import non_finite_latents
from k6serve.request import OutputOptions, SamplingParams
from k6serve.request_resolution import resolve_generate
from k6serve.runtime.engine import Engine
from k6serve.runtime.worker import ModelWorker
from k6serve.testing.lora_adapters import module_shapes, write_lora_adapter

pytestmark = pytest.mark.usefixtures("one_torch_thread")

NO_FILE = OutputOptions(save_output=False, return_frames=True)
TARGETS = ("visual_transformer_blocks.0.video_dec_block.self_attention.to_key",
           "visual_transformer_blocks.0.video_dec_block.feed_forward.net.0.proj")
OVERFLOWED = "the denoised latents hold NaN or infinite values, so no video or audio can be decoded from them; "


def _adapter(folder: Path, transformer: torch.nn.Module, *, amplitude: float, seed: int = 0) -> str:
    """A rank-2 diffusers-style adapter on `TARGETS`. An amplitude of 1e10 makes its update overflow at strength 50
    and more, 1e18 at strength 1 (a broken file: the values are finite, so reading it succeeds)."""
    return str(write_lora_adapter(folder / f"adapter_{seed}.safetensors", module_shapes(transformer, TARGETS),
                                  seed=seed, amplitude=amplitude))


@pytest.fixture(scope="module")
def worker(tiny_distill_dir):
    return ModelWorker(build_engine_config(str(tiny_distill_dir), device="cpu", attention_backend="sdpa"))


@pytest.fixture(scope="module")
def adapters(worker, tmp_path_factory):
    folder = tmp_path_factory.mktemp("adapters")
    transformer = worker.pipeline.models.transformer
    return {"fox": _adapter(folder, transformer, amplitude=0.5),
            "huge": _adapter(folder, transformer, amplitude=1e10, seed=1),
            "broken": _adapter(folder, transformer, amplitude=1e18, seed=2)}


def _generate(worker: ModelWorker, **kwargs):
    params = SamplingParams(prompt="a fox in the snow", seed=7, height=32, width=32, num_frames=5,
                            num_inference_steps=2, **kwargs)
    return worker.run(params, NO_FILE)


def _same(result, other) -> bool:
    return np.array_equal(result.frames, other.frames) and np.array_equal(result.audio, other.audio)


@pytest.mark.parametrize("strength", [1e30, 100.5, -101])
def test_a_request_strength_past_the_bound_is_refused(strength):
    params = SamplingParams(prompt="x", loras={"style": strength})
    shown = re.escape(repr(strength))
    with pytest.raises(ValueError, match=(
            rf"^loras\['style'\] must be a finite number from -100 to 100, got {shown}; adapters are used at about "
            r"-2 to 2 \(1\.0 is the strength they were trained at\), and far past that the update swamps the "
            r"model's weights and the latents overflow to NaN\.$")):
        resolve_generate(params, VARIANTS["pro-distill"])
    for allowed in (100, -100.0, 0):
        request, _ = resolve_generate(SamplingParams(prompt="x", loras={"style": allowed}), VARIANTS["pro-distill"])
        assert request.loras == (("style", float(allowed)),)


def test_a_start_strength_past_the_bound_is_refused_before_loading(tmp_path):
    config = build_engine_config("demo", lora_path=str(tmp_path / "style.safetensors"), lora_scale=1e30)
    with pytest.raises(ValueError, match=r"^--lora-scale must be a finite number from -100 to 100, got 1e\+30; "):
        check_start_adapter(config)


class RecordingWorker:
    """An in-process worker that applies nothing and records the LoRA operations that reach it."""

    variant = VARIANTS["pro"]

    def __init__(self) -> None:
        self.operations: list[object] = []

    def apply_lora_operation(self, operation) -> dict:
        self.operations.append(operation)
        return {"status": "ok", "message": "done", "loras": []}


STRENGTH_REFUSAL = r"^strength must be a finite number from -100 to 100, got {}; adapters are used at about -2 to 2 "
ALPHA_REFUSAL = (r"^lora_alpha must be a finite number from -10000 to 10000, got {}; an adapter's alpha is its rank or "
                 r"a small multiple of it \(the update is strength x alpha / rank x B A\), and far past that the update "
                 r"swamps the model's weights and the latents overflow to NaN\.$")


def test_the_python_api_refuses_a_strength_or_alpha_past_the_bound_before_queueing():
    worker = RecordingWorker()
    generator = DiffGenerator(Engine(EngineConfig(model=ModelConfig(model_path="fake")), worker=worker))
    try:
        with pytest.raises(ValueError, match=STRENGTH_REFUSAL.format(r"1e\+30")):
            generator.set_lora("style", "/adapters/style.safetensors", strength=1e30)
        with pytest.raises(ValueError, match=STRENGTH_REFUSAL.format("-250.0")):
            generator.set_lora(["style", "hero"], strength=[1.0, -250])
        with pytest.raises(ValueError, match=STRENGTH_REFUSAL.format("inf")):
            generator.set_lora("style", strength=10 ** 400)  # past float's range: refused, not an OverflowError
        with pytest.raises(ValueError, match=STRENGTH_REFUSAL.format("-500.0")):
            generator.merge_lora_weights(strength=-500)
        with pytest.raises(ValueError, match=ALPHA_REFUSAL.format(r"1e\+30")):
            generator.set_lora("style", "/adapters/style.safetensors", lora_alpha=1e30)
        with pytest.raises(ValueError, match=ALPHA_REFUSAL.format("-10001.0")):
            generator.set_lora("style", lora_alpha=-10001)
        assert worker.operations == []
        generator.set_lora("style", "/adapters/style.safetensors", strength=-100, lora_alpha=1e4)
        generator.merge_lora_weights(strength=100)
        assert worker.operations == [SetLora(specs=(LoraSpec(nickname="style", path="/adapters/style.safetensors",
                                                             strength=-100.0, alpha=1e4),)), MergeLora(strength=100.0)]
    finally:
        generator.shutdown()


def test_a_start_alpha_past_the_bound_is_refused_before_loading(tmp_path, capsys):
    config = build_engine_config("demo", lora_path=str(tmp_path / "style.safetensors"), lora_alpha=-2e4)
    with pytest.raises(ValueError, match=r"^--lora-alpha must be a finite number from -10000 to 10000, got -20000\.0; "):
        check_start_adapter(config)
    assert main(["serve", "--model-path", "demo", "--lora-path", str(tmp_path / "style.safetensors"),
                 "--lora-alpha", "1e30"]) == 2
    assert "error: --lora-alpha must be a finite number from -10000 to 10000, got 1e+30;" in capsys.readouterr().err


def test_an_adapter_file_whose_alpha_is_past_the_bound_is_refused(worker, tmp_path):
    out_features, in_features = worker.pipeline.models.transformer.get_submodule(TARGETS[0]).weight.shape
    file = tmp_path / "huge_alpha.safetensors"
    save_file({f"transformer.{TARGETS[0]}.lora_A.weight": torch.ones(2, in_features),
               f"transformer.{TARGETS[0]}.lora_B.weight": torch.ones(out_features, 2),
               f"transformer.{TARGETS[0]}.alpha": torch.tensor(1e30)}, str(file))
    with pytest.raises(ValueError, match=(
            rf"^LoRA file '{re.escape(str(file))}': 'transformer\.{re.escape(TARGETS[0])}\.alpha' \(the module's "
            r"alpha\) must be a finite number from -10000 to 10000, got 1\.0000000150474662e\+30; ")):
        read_adapter(str(file))


def test_the_worker_refuses_an_alpha_past_the_bound_and_changes_nothing(worker, adapters):
    before = worker.apply_lora_operation(ListLoras())
    with pytest.raises(ValueError, match=ALPHA_REFUSAL.format(r"1e\+30")):
        worker.apply_lora_operation(SetLora(specs=(LoraSpec(nickname="fox", path=adapters["fox"], alpha=1e30),)))
    assert worker.apply_lora_operation(ListLoras()) == before


def test_the_worker_refuses_a_strength_past_the_bound_and_changes_nothing(worker, adapters):
    before = worker.apply_lora_operation(ListLoras())
    with pytest.raises(ValueError, match=r"^strength must be a finite number from -100 to 100, got 1e\+30; "):
        worker.apply_lora_operation(SetLora(specs=(LoraSpec(nickname="fox", path=adapters["fox"], strength=1e30),)))
    assert worker.apply_lora_operation(ListLoras()) == before
    worker.apply_lora_operation(SetLora(specs=(LoraSpec(nickname="fox", path=adapters["fox"]),)))
    with pytest.raises(ValueError, match=r"^strength must be a finite number from -100 to 100, got -500\.0; "):
        worker.apply_lora_operation(MergeLora(strength=-500.0))
    worker.apply_lora_operation(UnmergeLora())


def test_latents_overflowed_by_a_request_adapter_name_it_and_the_engine_adapters_come_back(worker, adapters):
    weights = {name: tensor.clone() for name, tensor in worker.pipeline.models.transformer.state_dict().items()}
    # Both loaded, "fox" active on the engine.
    worker.apply_lora_operation(SetLora(specs=(LoraSpec(nickname="huge", path=adapters["huge"]),
                                               LoraSpec(nickname="fox", path=adapters["fox"], strength=0.5)),
                                        merge_mode="dynamic"))
    worker.apply_lora_operation(SetLora(specs=(LoraSpec(nickname="fox", strength=0.5),), merge_mode="dynamic"))
    fox = _generate(worker)
    with pytest.raises(ValueError, match=(
            rf"^{OVERFLOWED}the likely cause is the LoRA strength \('huge' at strength 100; adapters are used at "
            r"about -2 to 2\): lower it in this request's loras, or leave the adapter out\.$")):
        _generate(worker, loras={"huge": 100})
    (active,) = [row for row in worker.apply_lora_operation(ListLoras())["loras"] if row["active"]]
    assert (active["nickname"], active["strength"], active["merge_mode"]) == ("fox", 0.5, "dynamic")
    assert _same(_generate(worker), fox)
    worker.apply_lora_operation(UnmergeLora())
    assert all(torch.equal(tensor, weights[name])
               for name, tensor in worker.pipeline.models.transformer.state_dict().items())


@pytest.mark.parametrize("merge_mode", ["dynamic", "merge"])
def test_latents_overflowed_by_the_engine_adapters_name_them_and_unmerge_restores(worker, adapters, merge_mode):
    weights = {name: tensor.clone() for name, tensor in worker.pipeline.models.transformer.state_dict().items()}
    baseline = _generate(worker)
    worker.apply_lora_operation(SetLora(specs=(LoraSpec(nickname="huge", path=adapters["huge"], strength=50),),
                                        merge_mode=merge_mode))
    with pytest.raises(ValueError, match=(
            rf"^{OVERFLOWED}the likely cause is the LoRA strength \('huge' at strength 50; adapters are used at about "
            r"-2 to 2\): lower it with set_lora or merge_lora_weights \(--lora-scale for the --lora-path adapter\), or "
            r"deactivate the adapters with "
            r"unmerge_lora_weights\.$")):
        _generate(worker)
    worker.apply_lora_operation(SetLora(specs=(LoraSpec(nickname="broken", path=adapters["broken"]),),
                                        merge_mode=merge_mode))
    with pytest.raises(ValueError, match=(
            rf"^{OVERFLOWED}the likely cause is the LoRA adapter \('broken' at strength 1, a usual strength, so its "
            r"file may hold extreme values\): deactivate the adapters with unmerge_lora_weights, or check the "
            r"adapter file\.$")):
        _generate(worker)
    worker.apply_lora_operation(UnmergeLora())
    assert all(torch.equal(tensor, weights[name])
               for name, tensor in worker.pipeline.models.transformer.state_dict().items())
    assert _same(_generate(worker), baseline)


def test_without_an_adapter_the_overflow_message_does_not_blame_one():
    for loras in (None, {}):
        request, _ = resolve_generate(SamplingParams(prompt="x", loras=loras), VARIANTS["pro"])
        assert str(non_finite_latents(request)) == (f"{OVERFLOWED}lower guidance_scale, or check the checkpoint's "
                                                    "weights.")
    request, _ = resolve_generate(SamplingParams(prompt="x", loras={"style": 100}), VARIANTS["pro"])
    assert "the likely cause is the LoRA strength ('style' at strength 100;" in str(non_finite_latents(request))


def test_the_overflow_message_for_the_cli_names_its_flags_and_crosses_the_worker_boundary():
    # `k6serve generate` was told "lower it with set_lora or merge_lora_weights", which it does not have, and to
    # "deactivate the adapters with unmerge_lora_weights"; a rank process's ValueError reached it as a plain one.
    from k6serve.runtime.messages import RunFailed
    from k6serve.runtime.replica_failures import failure_error
    from k6serve.runtime.rank_process import _classify

    engine_request, _ = resolve_generate(SamplingParams(prompt="x"), VARIANTS["pro-distill"])
    error = non_finite_latents(engine_request, [("default", 50.0, None)])
    assert "set_lora or merge_lora_weights" in str(error)  # the Python API's and the HTTP API's words stay
    assert error.flag_wording == (f"{OVERFLOWED}the likely cause is the LoRA strength ('default' at strength 50; "
                                  "adapters are used at about -2 to 2): lower it with --lora-scale, or drop "
                                  "--lora-path.")
    broken = non_finite_latents(engine_request, [("default", 1.0, None)]).flag_wording
    assert broken.endswith("a usual strength, so its file may hold extreme values): drop --lora-path, or check the "
                           "adapter file.")
    request, _ = resolve_generate(SamplingParams(prompt="x", loras={"style": 100}), VARIANTS["pro-distill"])
    assert non_finite_latents(request).flag_wording.endswith(
        "lower it in --loras, or leave the adapter out of --loras.")
    assert non_finite_latents(engine_request).flag_wording == (f"{OVERFLOWED}lower --guidance-scale, or check the "
                                                               "checkpoint's weights.")
    kind, text, sent = _classify(error, rank=0)
    failed = pickle.loads(pickle.dumps(RunFailed(request_id=1, kind=kind, message=text, error=sent)))
    raised = failure_error(failed, request_id=1, replica=0)
    assert (str(raised), raised.flag_wording) == (str(error), error.flag_wording)


def test_a_request_naming_an_adapter_not_loaded_runs_nothing_not_even_the_warm_up(tiny_distill_dir):
    worker = ModelWorker(build_engine_config(str(tiny_distill_dir), device="cpu", attention_backend="sdpa",
                                             warmup_mode="request"))
    with pytest.raises(ValueError, match=r"names LoRA adapter\(s\) \['ghost'\] that are not loaded \(loaded: none\)"):
        _generate(worker, loras={"ghost": 1.0})
    assert not worker.warmed_up
