"""PEFT's LoRA variants (DoRA, a lora_B bias, LoRA on an nn.Embedding): the files' checks and their error texts, the
refusals (a bias merged into a layer without one, a module the model lacks), the start-up preflight, and tensor
parallelism / FSDP on two gloo ranks against one process (DoRA's there: test_lora_dora.py). Their numerics against
diffusers' own LoRA loading are in tests/parity/test_lora_parity.py.

Before these variants were read, every file here was refused as holding keys that are not LoRA keys.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from k6serve.api import DiffGenerator
from k6serve.lora.adapter import read_adapter
from k6serve.lora.adapter_file import names_adapter_file
from k6serve.lora.manager import LoraManager
from k6serve.lora.peft_config import LORA_METADATA_KEY
from k6serve.lora.spec import LoraSpec
from k6serve.models.kandinsky6.checkpoint import build_dummy_transformer
from k6serve.testing.gloo_ranks import run_on_gloo_ranks
from k6serve.testing.tiny_configs import TINY_TRANSFORMER_CONFIG

pytestmark = pytest.mark.usefixtures("one_torch_thread")

RANK = 2
VIDEO_FFN = "visual_transformer_blocks.0.video_dec_block.feed_forward.net.0.proj"  # 64 -> 128, no bias
SELF_KEY = "visual_transformer_blocks.0.video_dec_block.self_attention.to_key"  # 64 -> 64, with a bias
EMBEDDING = "visual_token_type_embeddings"  # 2 ids -> 64 features


def _dit(**config):
    return build_dummy_transformer({**TINY_TRANSFORMER_CONFIG, **config}, device=torch.device("cpu"),
                                   dtype=torch.float32, seed=3)


def _pair(out_features: int, in_features: int, module: str, *, seed: int = 0) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {f"{module}.lora_A.weight": 0.3 * torch.randn(RANK, in_features, generator=generator),
            f"{module}.lora_B.weight": 0.3 * torch.randn(out_features, RANK, generator=generator)}


def _save(folder: Path, tensors: dict[str, torch.Tensor], header: dict | None = None,
          name: str = "adapter.safetensors") -> str:
    metadata = None if header is None else {LORA_METADATA_KEY: json.dumps(header)}
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / name), metadata=metadata)
    return str(folder / name)


def _weights(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}


def _forward(model, *, token_types: bool = False):
    from k6serve.bench.dit import dit_inputs
    from k6serve.bench.geometry import generation_geometry
    from k6serve.models.kandinsky6.config import Kandinsky6TransformerConfig

    config = Kandinsky6TransformerConfig.from_json_dict(TINY_TRANSFORMER_CONFIG)
    inputs = dit_inputs(config, generation_geometry(64, 96, 9, num_text_tokens=10), device=torch.device("cpu"),
                        dtype=torch.float32, seed=4)
    if token_types:
        frames = inputs["hidden_states"].shape[1]
        inputs["visual_token_type_ids"] = torch.tensor([[0] * (frames - 1) + [1]] * inputs["hidden_states"].shape[0])
    with torch.inference_mode():
        return model(**inputs)


# ---- the file ----


def test_peft_variant_keys_are_read_in_both_spellings(tmp_path):
    """What `save_lora_adapter` writes (`lora_magnitude_vector`, `lora_embedding_A`) and a raw PEFT state dict
    (`lora_magnitude_vector.default.weight`, `lora_embedding_A.default`, `lora_B.default.bias`)."""
    dora = {**_pair(128, 64, VIDEO_FFN), f"{VIDEO_FFN}.lora_magnitude_vector": torch.rand(128) + 0.5}
    raw = {f"base_model.model.{SELF_KEY}.lora_A.default.weight": torch.randn(RANK, 64),
           f"base_model.model.{SELF_KEY}.lora_B.default.weight": torch.randn(64, RANK),
           f"base_model.model.{SELF_KEY}.lora_B.default.bias": torch.randn(64),
           f"base_model.model.{EMBEDDING}.lora_embedding_A.default": torch.randn(RANK, 2),
           f"base_model.model.{EMBEDDING}.lora_embedding_B.default": torch.randn(64, RANK),
           f"base_model.model.{VIDEO_FFN}.lora_A.default.weight": torch.randn(RANK, 64),
           f"base_model.model.{VIDEO_FFN}.lora_B.default.weight": torch.randn(128, RANK),
           f"base_model.model.{VIDEO_FFN}.lora_magnitude_vector.default.weight": torch.rand(128)}
    saved = read_adapter(_save(tmp_path / "saved", dora))
    assert saved.modules[VIDEO_FFN].magnitude.shape == (128,)
    modules = read_adapter(_save(tmp_path / "raw", raw)).modules
    assert modules[SELF_KEY].bias.shape == (64,) and modules[SELF_KEY].magnitude is None
    assert modules[EMBEDDING].embedding and tuple(modules[EMBEDDING].down.shape) == (RANK, 2)
    assert modules[VIDEO_FFN].magnitude is not None and not modules[VIDEO_FFN].embedding


def _bad_file(folder: Path, kind: str) -> str:
    pair = _pair(128, 64, VIDEO_FFN)
    magnitude = {f"{VIDEO_FFN}.lora_magnitude_vector": torch.rand(128)}
    if kind == "dora_and_bias":
        return _save(folder, {**pair, **magnitude, f"{VIDEO_FFN}.lora_B.bias": torch.randn(128)})
    if kind == "magnitude_shape":
        return _save(folder, {**pair, f"{VIDEO_FFN}.lora_magnitude_vector": torch.rand(64)})
    if kind == "bias_shape":
        return _save(folder, {**pair, f"{VIDEO_FFN}.lora_B.bias": torch.rand(128, 1)})
    if kind == "stray_magnitude":
        return _save(folder, {**pair, f"{SELF_KEY}.lora_magnitude_vector": torch.rand(64)})
    if kind == "magnitude_nan":
        return _save(folder, {**pair, f"{VIDEO_FFN}.lora_magnitude_vector": torch.full((128,), float("nan"))})
    if kind == "mixed_kinds":
        return _save(folder, {f"{EMBEDDING}.lora_embedding_A": torch.randn(RANK, 2),
                              f"{EMBEDDING}.lora_B.weight": torch.randn(64, RANK)})
    if kind == "lora_a_bias":
        return _save(folder, {**pair, f"{VIDEO_FFN}.lora_A.bias": torch.randn(RANK)})
    if kind == "header_dora_without_magnitudes":
        return _save(folder, pair, {"r": RANK, "lora_alpha": RANK, "use_dora": True})
    if kind == "magnitudes_header_not_dora":
        return _save(folder, {**pair, **magnitude}, {"transformer.r": RANK, "transformer.use_dora": False})
    assert kind == "bias_header_without_lora_bias"
    return _save(folder, {**pair, f"{VIDEO_FFN}.lora_B.bias": torch.randn(128)}, {"lora_bias": False})


@pytest.mark.parametrize(("kind", "message"), [
    ("dora_and_bias", r"have both a lora_magnitude_vector \(DoRA\) and a lora_B\.bias; PEFT does not combine the "
                      r"two \(LoraConfig refuses lora_bias with use_dora\)"),
    ("magnitude_shape", r"has lora_magnitude_vector \(64,\), but its lora_B \(128, 2\) gives 128 output features; "
                        r"expected \(128,\)"),
    ("bias_shape", r"has lora_B\.bias \(128, 1\), but its lora_B \(128, 2\) gives 128 output features"),
    ("stray_magnitude", rf"module\(s\) with a lora_magnitude_vector or lora_B\.bias but no lora_A / lora_B: "
                        rf"\['{SELF_KEY}'\]"),
    ("magnitude_nan", "lora_magnitude_vector holds NaN or infinite values"),
    ("mixed_kinds", r"have lora_embedding_A / _B keys \(an Embedding's LoRA\) and lora_A / lora_B ones"),
    ("lora_a_bias", r"not diffusers/PEFT LoRA keys .*lora_magnitude_vector \(DoRA\).*lora_A\.bias"),
    ("header_dora_without_magnitudes", r"header says use_dora=True, but the file holds no lora_magnitude_vector "
                                       r"keys; the header and the weights come from different adapters"),
    ("magnitudes_header_not_dora", r"header says use_dora=False, but the file holds 1 lora_magnitude_vector keys"),
    ("bias_header_without_lora_bias", r"header says lora_bias=False, but the file holds 1 lora_B\.bias keys, which "
                                      r"diffusers would skip"),
])
def test_a_variant_file_peft_would_not_write_is_an_error_about_the_file(tmp_path, kind, message):
    file = _bad_file(tmp_path, kind)
    with pytest.raises(ValueError, match=message) as raised:
        read_adapter(file)
    assert str(raised.value).startswith(f"LoRA file {file!r}") and names_adapter_file(str(raised.value))


# ---- the model ----


def test_embedding_keys_must_name_an_embedding(tmp_path):
    """lora_embedding_A / _B on a Linear, or on a DiT whose config has no token type embeddings: named as such."""
    on_linear = _save(tmp_path / "linear", {f"{SELF_KEY}.lora_embedding_A": torch.randn(RANK, 64),
                                            f"{SELF_KEY}.lora_embedding_B": torch.randn(64, RANK)})
    with pytest.raises(ValueError, match=rf"1 of its 1 module\(s\) have lora_embedding_A / _B keys but are not "
                                         rf"Embedding layers of the Kandinsky6Transformer \(all of them.*"
                                         rf"\['{SELF_KEY}'\]; the model's Embedding layers are \['{EMBEDDING}'\]"):
        LoraManager(_dit()).set([LoraSpec(nickname="a", path=on_linear)])
    embedding = _save(tmp_path / "embedding", {f"{EMBEDDING}.lora_embedding_A": torch.randn(RANK, 2),
                                               f"{EMBEDDING}.lora_embedding_B": torch.randn(64, RANK),
                                               **_pair(128, 64, VIDEO_FFN)})
    with pytest.raises(ValueError, match=r"1 of its 2 module\(s\) have lora_embedding_A / _B keys but are not "
                                         r"Embedding layers.*Embedding layers are none \(the "
                                         r"visual_token_type_embeddings exist only where"):
        LoraManager(_dit(visual_token_type_num_embeddings=0)).set([LoraSpec(nickname="a", path=embedding)])
    wrong_size = _save(tmp_path / "size", {f"{EMBEDDING}.lora_embedding_A": torch.randn(RANK, 3),
                                           f"{EMBEDDING}.lora_embedding_B": torch.randn(64, RANK)})
    with pytest.raises(ValueError, match=r"has lora_embedding_A \(2, 3\) and lora_embedding_B \(64, 2\), but the "
                                         r"model's embedding maps 2 ids -> 64 features"):
        LoraManager(_dit()).set([LoraSpec(nickname="a", path=wrong_size)])


def test_a_module_the_model_lacks_refuses_the_whole_adapter(tmp_path):
    """diffusers would apply the rest with a warning; a typo'd module applying nothing is refused instead, saying
    how to apply the rest on purpose, and nothing is cached or applied."""
    file = _save(tmp_path, {**_pair(128, 64, VIDEO_FFN), **_pair(64, 64, SELF_KEY.replace("to_key", "to_kye"))})
    model = _dit()
    before, manager = _weights(model), LoraManager(model)
    with pytest.raises(ValueError, match=r"1 of its 2 module\(s\) are not Linear layers .*to_kye.*The whole adapter "
                                         r"is refused rather than applied without them \(diffusers' load_lora_adapter "
                                         r"would skip them with a warning\): check that the adapter is for this "
                                         r"model, or remove those modules' keys from the file to apply the rest\."):
        manager.set([LoraSpec(nickname="a", path=file)], "dynamic")
    assert manager.state() == [] and all(torch.equal(tensor, before[name])
                                         for name, tensor in model.state_dict().items())


def test_a_bias_on_a_layer_without_one_is_dynamic_only(tmp_path):
    """Merging it has nowhere to go (PEFT's merge refuses it too): refused for set (merge and auto) and for merge
    from dynamic, with the mode that works, leaving the adapters as they were; dynamic adds it at run time."""
    file = _save(tmp_path, {**_pair(128, 64, VIDEO_FFN), f"{VIDEO_FFN}.lora_B.bias": torch.randn(128),
                            **_pair(64, 64, SELF_KEY), f"{SELF_KEY}.lora_B.bias": torch.randn(64)})
    model = _dit()
    before, base = _weights(model), _forward(model)
    manager = LoraManager(model)
    message = (rf"^LoRA adapter '.*adapter.safetensors': 1 module\(s\) have a lora_B\.bias \(PEFT's lora_bias\), "
               rf"but the model's layer has no bias to merge it into, e\.g\. \['{VIDEO_FFN}'\] \(diffusers' fuse_lora "
               rf"refuses these too\); use merge_mode 'dynamic'")
    for mode in ("merge", "auto"):
        with pytest.raises(ValueError, match=message) as raised:
            manager.set([LoraSpec(nickname="a", path=file)], mode)
        assert not names_adapter_file(str(raised.value))  # the fix is the mode, not the file
    assert manager.state() == []
    manager.set([LoraSpec(nickname="a", path=file)], "dynamic")
    adapted = _forward(model)
    assert not torch.equal(adapted[0], base[0])
    # merge_lora_weights has no merge_mode to change: its fix is to leave them dynamic
    with pytest.raises(ValueError, match=message.replace("use merge_mode 'dynamic'", "they stay dynamic")
                       + r" \(which adds the bias at run time\), as they are; nothing changed\.$"):
        manager.merge()
    assert manager.state()[0]["merge_mode"] == "dynamic" and torch.equal(_forward(model)[0], adapted[0])
    fsdp = LoraManager(_dit(), fsdp=True)
    fsdp.set([LoraSpec(nickname="a", path=file)], "auto")
    with pytest.raises(ValueError, match=r"^the LoRA adapters cannot be merged with --use-fsdp-inference: .* The "
                                         r"active adapters stay dynamic, as they are; nothing changed\.$"):
        fsdp.merge()
    manager.unmerge()
    assert all(torch.equal(tensor, before[name]) for name, tensor in model.state_dict().items())


def test_bias_dora_and_embedding_merge_and_dynamic_agree_and_unmerge_is_exact(tmp_path):
    """The tiny DiT with a lora_B bias (on a Linear with a bias), DoRA on two Linears and the embedding, each at
    its own strength: merged and dynamic within 1e-5, unmerge and unset bit for bit, nothing left wrapped."""
    generator = torch.Generator().manual_seed(5)
    bias_file = _save(tmp_path / "bias", {**_pair(64, 64, SELF_KEY, seed=1),
                                          f"{SELF_KEY}.lora_B.bias": torch.randn(64, generator=generator)})
    dora_file = _save(tmp_path / "dora", {
        **_pair(128, 64, VIDEO_FFN, seed=2),
        f"{VIDEO_FFN}.lora_magnitude_vector": 3 + torch.rand(128, generator=generator),
        **_pair(64, 64, SELF_KEY, seed=3),
        f"{SELF_KEY}.lora_magnitude_vector": 3 + torch.rand(64, generator=generator),
        f"{EMBEDDING}.lora_embedding_A": torch.randn(RANK, 2, generator=generator),
        f"{EMBEDDING}.lora_embedding_B": torch.randn(64, RANK, generator=generator),
        f"{EMBEDDING}.lora_magnitude_vector": 1 + torch.rand(64, generator=generator)})
    specs = [LoraSpec(nickname="bias", path=bias_file, strength=0.8),
             LoraSpec(nickname="dora", path=dora_file, strength=1.2)]
    model = _dit()
    before, base = _weights(model), _forward(model, token_types=True)
    manager = LoraManager(model)
    outputs = {}
    for mode in ("merge", "dynamic"):
        manager.set(specs, mode)
        outputs[mode] = _forward(model, token_types=True)
        manager.unmerge()
        assert all(torch.equal(tensor, before[name]) for name, tensor in model.state_dict().items())
        assert not any(type(module).__name__.startswith("Lora") for module in model.modules())
    for merged, dynamic in zip(outputs["merge"], outputs["dynamic"], strict=True):
        assert float((merged - dynamic).abs().max() / merged.abs().max()) <= 1e-5
    # the adapted layers are the video stream's (the audio output moves through the cross-attention only)
    assert float((outputs["merge"][0] - base[0]).abs().max() / base[0].abs().max()) > 0.05


@pytest.mark.skipif(not torch.cuda.is_available(), reason="speed mode's fused, compiled blocks and pinned offloading "
                    "need CUDA")
@pytest.mark.parametrize("mode", ["speed", "memory"])
def test_cuda_dora_and_bias_change_the_output_alike_and_unmerge_restores_it(demo_dir, tmp_path, mode):
    """test_lora's CUDA check with DoRA (on a fused Q/K/V block's rows in speed mode, an FFN and a keep-fp32 time
    embedding) and a lora_B bias (on a fused K/V block's rows): compiled blocks, pinned offloading and streamed
    blocks; merged and dynamic change the output alike, unmerge restores it bit for bit."""
    from safetensors.torch import load_file
    from test_lora import (
        BF16_AMPLITUDE,
        CROSS_VALUE,
        MODULES,
        TIME,
        _assert_bf16_adapter_outputs,
        _merged_dynamic_unmerged,
        _shapes,
        write_adapter,
    )

    from k6serve.engine_arguments import build_engine_config
    from k6serve.runtime.worker import ModelWorker

    worker = ModelWorker(build_engine_config(str(demo_dir), device="cuda", performance_mode=mode,
                                             attention_backend="sdpa"))
    unfused = ModelWorker(build_engine_config(str(demo_dir), device="cpu", attention_backend="sdpa"))
    dit = unfused.pipeline.models.transformer
    file = write_adapter(tmp_path, _shapes(dit, [*MODULES, CROSS_VALUE]), amplitude=BF16_AMPLITUDE)
    tensors = load_file(str(file))
    generator = torch.Generator().manual_seed(6)
    for path in (VIDEO_FFN, SELF_KEY, TIME):
        weight = dit.get_submodule(path).weight.detach().float()
        delta = tensors[f"transformer.{path}.lora_B.weight"] @ tensors[f"transformer.{path}.lora_A.weight"]
        norms = torch.linalg.norm(weight + delta, dim=1)
        tensors[f"transformer.{path}.lora_magnitude_vector"] = norms * (0.5 + torch.rand(norms.shape,
                                                                                          generator=generator))
    assert dit.get_submodule(CROSS_VALUE).bias is not None
    tensors[f"transformer.{CROSS_VALUE}.lora_B.bias"] = BF16_AMPLITUDE * torch.randn(
        dit.get_submodule(CROSS_VALUE).out_features, generator=generator)
    save_file(tensors, str(file))
    _assert_bf16_adapter_outputs(*_merged_dynamic_unmerged(worker, file))


# ---- start-up preflight ----


def test_the_start_adapter_with_a_bias_on_a_layer_without_one_is_refused_before_loading_unless_dynamic(
        demo_dir, tmp_path, monkeypatch):
    import k6serve.api as api

    class Loaded(BaseException):
        pass

    def engine(config):
        raise Loaded

    monkeypatch.setattr(api, "Engine", engine)
    file = _save(tmp_path, {**_pair(128, 64, VIDEO_FFN), f"{VIDEO_FFN}.lora_B.bias": torch.randn(128)})
    with pytest.raises(ValueError, match=r"no bias to merge it into.*use merge_mode 'dynamic' "
                                         r"\(lora_merge_mode='dynamic'\)"):
        DiffGenerator.from_pretrained("demo", device="cpu", lora_path=file)
    with pytest.raises(Loaded):
        DiffGenerator.from_pretrained("demo", device="cpu", lora_path=file, lora_merge_mode="dynamic")


# ---- tensor parallelism and FSDP, two gloo ranks ----


class _Block(nn.Module):
    """A feed-forward with biases: column-parallel in, row-parallel out under tensor parallelism."""

    def __init__(self) -> None:
        super().__init__()
        self.proj_in = nn.Linear(8, 12)
        self.proj_out = nn.Linear(12, 6)

    def forward(self, x):
        return self.proj_out(torch.relu(self.proj_in(x)))


class _Toy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block = _Block()

    def forward(self, x):
        return self.block(x)


def _sharded(layout: str) -> _Toy:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    torch.manual_seed(0)
    model = _Toy()
    mesh = init_device_mesh("cpu", (2,))
    if layout == "tp":
        parallelize_module(model, mesh, {"block.proj_in": ColwiseParallel(), "block.proj_out": RowwiseParallel()})
    else:
        fully_shard(model.block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    return model


def _sharded_task(bias_file: str) -> dict:
    """On each rank: the bias adapter under TP (merge, dynamic) and FSDP (dynamic) against one process, and whether
    unmerging restored the sharded weights."""
    from torch.distributed.tensor import DTensor

    from k6serve.lora.sharding import ShardedWeight

    torch.manual_seed(0)
    whole = _Toy()
    x = torch.randn(5, 8, generator=torch.Generator().manual_seed(1))
    result = {}
    for layout, mode in (("tp", "merge"), ("tp", "dynamic"), ("fsdp", "dynamic")):
        reference = copy.deepcopy(whole)
        LoraManager(reference).set([LoraSpec(nickname="b", path=bias_file, strength=0.7)], mode)
        with torch.no_grad():
            expected = reference(x)
        model = _sharded(layout)
        layouts = tuple(ShardedWeight.of(linear).dim for linear in (model.block.proj_in, model.block.proj_out))
        before = {name: (tensor.to_local() if isinstance(tensor, DTensor) else tensor).clone()
                  for name, tensor in model.state_dict().items()}
        manager = LoraManager(model, fsdp=layout == "fsdp")
        manager.set([LoraSpec(nickname="b", path=bias_file, strength=0.7)], mode)
        with torch.no_grad():
            output = model(x)
        output = output.full_tensor() if isinstance(output, DTensor) else output
        manager.unmerge()
        restored = all(torch.equal(tensor.to_local() if isinstance(tensor, DTensor) else tensor, before[name])
                       for name, tensor in model.state_dict().items())
        error = float((output - expected).abs().max() / expected.abs().max())
        result[f"{layout} {mode}"] = (error, restored, layouts)
    return result


def test_a_bias_under_tensor_parallelism_and_fsdp_matches_one_process(tmp_path):
    """The lora_B bias on a column-parallel Linear (its rows of the bias on each rank) and a row-parallel one (its
    bias replicated, added once after the reduction), merged and dynamic; under FSDP dynamic. Within 1e-5 of one
    process (TP reorders sums), unmerge exact."""
    generator = torch.Generator().manual_seed(2)
    tensors = {}
    for module, (out_features, in_features) in {"block.proj_in": (12, 8), "block.proj_out": (6, 12)}.items():
        tensors[f"{module}.lora_A.weight"] = torch.randn(RANK, in_features, generator=generator)
        tensors[f"{module}.lora_B.weight"] = torch.randn(out_features, RANK, generator=generator)
        tensors[f"{module}.lora_B.bias"] = torch.randn(out_features, generator=generator)
    bias_file = _save(tmp_path / "bias", tensors)
    for result in run_on_gloo_ranks(_sharded_task, bias_file):
        for case, expected_layouts in (("tp merge", (0, 1)), ("tp dynamic", (0, 1)), ("fsdp dynamic", (0, 0))):
            error, restored, layouts = result[case]
            assert error <= 1e-5 and restored and layouts == expected_layouts, (case, error, restored, layouts)
