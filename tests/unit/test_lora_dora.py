"""DoRA beyond one whole weight: on tensor-parallel and FSDP shards (two gloo ranks against one process), the dynamic
path's cache of row factors, LyCORIS's `dora_scale` (kohya files) read as PEFT's magnitudes, and what `list_loras`
says about an adapter's variants. DoRA's numerics against diffusers' own loading are in
tests/parity/test_lora_parity.py.

Before, DoRA on a sharded weight was refused, every request naming a DoRA adapter passed over its targeted weights
twice (its adapters in, the engine's back), and a `dora_scale` key made the file "not LoRA keys".
"""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from k6serve.lora.adapter import read_adapter
from k6serve.lora.adapter_file import names_adapter_file
from k6serve.lora.manager import LoraManager
from k6serve.lora.peft_config import LORA_METADATA_KEY
from k6serve.lora.spec import LoraSpec
from k6serve.testing.gloo_ranks import run_on_gloo_ranks

pytestmark = pytest.mark.usefixtures("one_torch_thread")

RANK = 2
# (out, in) of the toy's layers. FSDP's shards of proj_out's 5 rows and of the embedding's 5 ids are uneven (3 + 2);
# tensor parallelism needs even ones (RowwiseParallel rebuilds its input from equal local blocks).
SHAPES = {"embed": (8, 5), "block.proj_in": (14, 8), "block.proj_out": (5, 14)}
IDS = torch.tensor([[0, 3, 4, 1], [2, 2, 0, 4]])


class _Block(nn.Module):
    """Column-parallel in, row-parallel out under tensor parallelism; one FSDP unit."""

    def __init__(self) -> None:
        super().__init__()
        self.proj_in = nn.Linear(8, 14)
        self.proj_out = nn.Linear(14, 5)

    def forward(self, x):
        return self.proj_out(torch.relu(self.proj_in(x)))


class _Toy(nn.Module):
    """An Embedding (FSDP's root unit shards its table by ids: the Linear view's input columns) and a block."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(5, 8)
        self.block = _Block()

    def forward(self, ids):
        return self.block(self.embed(ids))


def _toy() -> _Toy:
    torch.manual_seed(0)
    return _Toy()


def _save(folder: Path, tensors: dict[str, torch.Tensor], header: dict | None = None) -> str:
    folder.mkdir(parents=True, exist_ok=True)
    metadata = None if header is None else {LORA_METADATA_KEY: json.dumps(header)}
    save_file(tensors, str(folder / "adapter.safetensors"), metadata=metadata)
    return str(folder / "adapter.safetensors")


def _dora_tensors(paths, *, seed: int = 1) -> dict[str, torch.Tensor]:
    """PEFT DoRA keys for `paths` (lora_embedding_A / _B for the embedding), magnitudes away from the row norms."""
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for path in paths:
        out_features, in_features = SHAPES[path]
        kind = "lora_embedding_" if path == "embed" else "lora_"
        suffix = "" if path == "embed" else ".weight"
        tensors[f"{path}.{kind}A{suffix}"] = 0.5 * torch.randn(RANK, in_features, generator=generator)
        tensors[f"{path}.{kind}B{suffix}"] = 0.5 * torch.randn(out_features, RANK, generator=generator)
        tensors[f"{path}.lora_magnitude_vector"] = 1 + 2 * torch.rand(out_features, generator=generator)
    return tensors


def _files(folder: Path) -> dict[str, str]:
    generator = torch.Generator().manual_seed(2)
    bias = {}
    for path in ("block.proj_in", "block.proj_out"):
        out_features, in_features = SHAPES[path]
        bias[f"{path}.lora_A.weight"] = torch.randn(RANK, in_features, generator=generator)
        bias[f"{path}.lora_B.weight"] = torch.randn(out_features, RANK, generator=generator)
        bias[f"{path}.lora_B.bias"] = torch.randn(out_features, generator=generator)
    return {"bias": _save(folder / "bias", bias),
            "dora": _save(folder / "dora", _dora_tensors(SHAPES)),
            "dora_linears": _save(folder / "dora_linears", _dora_tensors(["block.proj_in", "block.proj_out"]))}


# ---- tensor parallelism and FSDP, two gloo ranks ----


def _sharded(layout: str) -> _Toy:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    model = _toy()
    mesh = init_device_mesh("cpu", (2,))
    if layout == "tp":
        parallelize_module(model, mesh, {"block.proj_in": ColwiseParallel(), "block.proj_out": RowwiseParallel()})
    else:
        fully_shard(model.block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    return model


def _compare(sharded: torch.Tensor, whole: torch.Tensor) -> tuple[bool, float]:
    """(bit for bit, largest error relative to the largest value)."""
    return torch.equal(sharded, whole), float((sharded - whole).abs().max() / whole.abs().max())


def _local(tensor: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    tensor = tensor.detach()
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _factors_task(files: dict[str, str]) -> dict:
    """Each DoRA module's row factors on the sharded layers against the whole ones, at an odd scale."""
    from k6serve.lora.dora import dora_factor
    from k6serve.lora.sharding import ShardedWeight

    modules = read_adapter(files["dora"]).modules
    whole, result = _toy(), {}
    for layout in ("tp", "fsdp"):
        model = _sharded(layout)
        result[f"{layout} layouts"] = {path: ShardedWeight.of(model.get_submodule(path)).dim for path in SHAPES}
        for path, module in modules.items():
            rows = slice(0, SHAPES[path][0])
            expected = dora_factor(whole.get_submodule(path), rows, module, 0.37)
            result[f"{layout} factor {path}"] = _compare(dora_factor(model.get_submodule(path), rows, module, 0.37),
                                                         expected)
    return result


def _merged_weights_task(files: dict[str, str]) -> dict:
    """A lora_B-bias adapter and a DoRA one stacked on the same layers, merged under tensor parallelism: each rank's
    block of every weight and bias against the same block of the merge in one process."""
    from k6serve.lora.sharding import ShardedWeight

    specs = [LoraSpec(nickname="b", path=files["bias"], strength=0.7),
             LoraSpec(nickname="d", path=files["dora"], strength=1.3)]
    reference = _toy()
    LoraManager(reference).set(specs, "merge")
    model = _sharded("tp")
    before = {name: _local(tensor).clone() for name, tensor in model.state_dict().items()}
    manager = LoraManager(model)
    manager.set(specs, "merge")
    result = {}
    for path in SHAPES:
        layer, expected = model.get_submodule(path), reference.get_submodule(path)
        shard = ShardedWeight.of(layer)
        weight = _local(layer.weight)
        expected_weight = expected.weight.detach()
        if shard.dim is not None:  # Linears here: the view is the weight
            expected_weight = expected_weight.narrow(shard.dim, shard.start, shard.length)
        result[f"tp merged {path}"] = _compare(weight, expected_weight)
        if getattr(layer, "bias", None) is not None:
            result[f"tp merged bias {path}"] = _compare(_local(layer.bias), shard.slice_rows(expected.bias.detach()))
    manager.unmerge()
    result["tp merged restored"] = all(torch.equal(_local(tensor), before[name])
                                       for name, tensor in model.state_dict().items())
    return result


def _outputs_task(files: dict[str, str]) -> dict:
    """The stacked adapters' output under TP (merge, dynamic) and FSDP (dynamic) against one process; under FSDP
    also the Linear-only DoRA adapter, whose factors are bit for bit and whose layers run whole in the forward."""
    stacked = [LoraSpec(nickname="b", path=files["bias"], strength=0.7),
               LoraSpec(nickname="d", path=files["dora"], strength=1.3)]
    linears = [LoraSpec(nickname="l", path=files["dora_linears"], strength=0.6)]
    result = {}
    for layout, mode, name, specs in (("tp", "merge", "stacked", stacked), ("tp", "dynamic", "stacked", stacked),
                                      ("fsdp", "dynamic", "stacked", stacked), ("fsdp", "dynamic", "linears", linears)):
        reference = _toy()
        LoraManager(reference).set(specs, mode)
        with torch.no_grad():
            expected = reference(IDS)
        model = _sharded(layout)
        before = {key: _local(tensor).clone() for key, tensor in model.state_dict().items()}
        manager = LoraManager(model, fsdp=layout == "fsdp")
        manager.set(specs, mode)
        with torch.no_grad():
            output = model(IDS)
        manager.unmerge()
        restored = all(torch.equal(_local(tensor), before[key]) for key, tensor in model.state_dict().items())
        result[f"{layout} {mode} {name}"] = (*_compare(output, expected), restored)
    return result


def _sharded_task(files: dict[str, str]) -> dict:
    return {**_factors_task(files), **_merged_weights_task(files), **_outputs_task(files)}


@pytest.fixture(scope="module")
def sharded_results(tmp_path_factory) -> list[dict]:
    return run_on_gloo_ranks(_sharded_task, _files(tmp_path_factory.mktemp("dora_sharded")))


# Where each rank holds whole rows (column-parallel; FSDP's Linears, split by rows) or the whole weight (the embedding
# under TP), the norms are the unsharded ones bit for bit; where it holds input columns (row-parallel; the embedding's
# table under FSDP, split by ids), the squared sums are all-reduced: within fp32 rounding.
BITWISE = {"tp factor embed", "tp factor block.proj_in", "fsdp factor block.proj_in", "fsdp factor block.proj_out",
           "tp merged embed", "tp merged block.proj_in", "tp merged bias block.proj_in",
           "tp merged bias block.proj_out"}
SUMMED = {"tp factor block.proj_out", "fsdp factor embed", "tp merged block.proj_out"}


def test_dora_row_factors_and_merged_shards_match_one_process(sharded_results):
    for result in sharded_results:
        # which dimension of each layer's Linear view a rank holds a block of (None: whole)
        assert result["tp layouts"] == {"embed": None, "block.proj_in": 0, "block.proj_out": 1}
        assert result["fsdp layouts"] == {"embed": 1, "block.proj_in": 0, "block.proj_out": 0}
        for case in BITWISE:
            assert result[case][0], (case, result[case])
        for case in SUMMED:
            assert result[case][1] <= 1e-6, (case, result[case])
        assert result["tp merged restored"]


def test_dora_outputs_under_tensor_parallelism_and_fsdp_match_one_process(sharded_results):
    """Stacked on a lora_B-bias adapter (so DoRA's shift uses the gathered bias) on the column- and row-parallel
    Linears and the embedding: within 1e-6 of one process (TP also reorders the forward's own sums); FSDP with DoRA on
    the Linears only, whose layers run whole and whose factors are exact, bit for bit. Unmerge restores every shard."""
    for result in sharded_results:
        for case in ("tp merge stacked", "tp dynamic stacked", "fsdp dynamic stacked", "fsdp dynamic linears"):
            bitwise, error, restored = result[case]
            assert error <= 1e-6 and restored, (case, error, restored)
        assert result["fsdp dynamic linears"][0]


# ---- the dynamic path's cache ----


def _output(model: nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(IDS)


def _fresh_output(specs: list[LoraSpec], model: nn.Module | None = None) -> torch.Tensor:
    """The output of `specs` applied dynamically by a new manager (no cache) on a copy of `model` (default a toy)."""
    model = copy.deepcopy(model) if model is not None else _toy()
    LoraManager(model).set(specs, "dynamic")
    return _output(model)


def test_dynamic_dora_factors_are_computed_once_per_adapter_scale_and_base_weight(tmp_path, monkeypatch):
    """A request naming the engine's DoRA adapter at its strength, or beside other adapters, computes nothing; a new
    strength or alpha computes its factors once; a changed base weight recomputes that layer's; a file re-read under
    the nickname computes its own and drops the old ones. Every output equals a new manager's (no cache)."""
    from k6serve.lora import dora

    files = _files(tmp_path)
    calls: list[float] = []
    compute = dora.dora_factor

    def counted(layer, rows, module, scale):
        calls.append(scale)
        return compute(layer, rows, module, scale)

    monkeypatch.setattr(dora, "dora_factor", counted)
    model = _toy()
    manager = LoraManager(model)
    engine = [LoraSpec(nickname="b", path=files["bias"], strength=0.7), LoraSpec(nickname="d", path=files["dora"])]
    manager.set(engine, "dynamic")
    assert len(calls) == 3  # the embedding and both Linears
    engine_output = _output(model)
    assert torch.equal(engine_output, _fresh_output(engine))

    def request(loras: tuple[tuple[str, float], ...]) -> tuple[int, torch.Tensor]:
        before = len(calls)
        with manager.for_request(loras):
            output = _output(model)
        assert torch.equal(_output(model), engine_output)  # the engine's adapters are back, from the cache
        return len(calls) - before, output

    computed, output = request((("d", 1.0),))
    assert computed == 0 and torch.equal(output, _fresh_output([LoraSpec(nickname="d", path=files["dora"])]))
    computed, output = request((("d", 0.5),))
    assert computed == 3 and torch.equal(output, _fresh_output([LoraSpec(nickname="d", path=files["dora"],
                                                                          strength=0.5)]))
    computed, again = request((("d", 0.5),))
    assert computed == 0 and torch.equal(again, output)
    computed, output = request((("b", 0.2), ("d", 0.5)))  # the factors do not depend on the other adapters
    assert computed == 0 and torch.equal(output, _fresh_output([LoraSpec(nickname="b", path=files["bias"],
                                                                          strength=0.2),
                                                                 LoraSpec(nickname="d", path=files["dora"],
                                                                          strength=0.5)]))
    before = len(calls)
    manager.set([LoraSpec(nickname="d", alpha=4.0)], "dynamic")  # alpha is part of the scale
    assert len(calls) - before == 3

    with torch.no_grad():  # a new storage for one base weight, as a reload or a memory resume would give it
        model.block.proj_in.weight.data = model.block.proj_in.weight.data * 1.5
    before = len(calls)
    manager.set(engine, "dynamic")
    assert len(calls) - before == 1  # only proj_in's factor
    output = _output(model)
    manager.unmerge()
    assert torch.equal(output, _fresh_output(engine, model))

    copied = tmp_path / "copy"
    copied.mkdir()
    shutil.copy(files["dora"], copied / "adapter.safetensors")
    before = len(calls)
    manager.set([LoraSpec(nickname="d", path=str(copied / "adapter.safetensors"))], "dynamic")
    assert len(calls) - before == 3
    live = {id(module) for module in manager.adapters["d"].modules.values()}
    assert {id(module) for module, _ in manager.dora_rows.entries.values()} <= live


def test_the_cache_drops_the_least_recently_used_rows_past_its_bytes():
    from k6serve.lora.dora import DoraCache
    from k6serve.lora.targets import resolve_targets

    model = _toy()
    parsed = _parse(_dora_tensors(SHAPES))
    targets = {target.path: target for target in resolve_targets(model, parsed, source="test")}
    per_entry = 14 * 4 + 14 * 4  # proj_in: factor and bias, fp32
    cache = DoraCache(max_bytes=2 * per_entry)
    first = cache.rows(targets["block.proj_in"], parsed["block.proj_in"], 1.0)
    cache.rows(targets["block.proj_in"], parsed["block.proj_in"], 0.5)
    assert cache.rows(targets["block.proj_in"], parsed["block.proj_in"], 1.0) is first  # used again: now the newest
    cache.rows(targets["block.proj_in"], parsed["block.proj_in"], 0.25)  # the 0.5 rows go
    assert len(cache.entries) == 2 and cache.num_bytes == 2 * per_entry
    assert cache.rows(targets["block.proj_in"], parsed["block.proj_in"], 1.0) is first


def _parse(tensors: dict[str, torch.Tensor]):
    from k6serve.lora.state_dict import parse_lora_state_dict

    return parse_lora_state_dict(tensors, source="test")


# ---- LyCORIS's dora_scale (kohya files) ----


KOHYA = {"block.proj_in": "lora_unet_block_proj_in", "block.proj_out": "lora_unet_block_proj_out"}
ALPHA = 3.0


def _kohya_dora(folder: Path, *, dora_scale_shape: str = "out", dotted: bool = False) -> tuple[str, dict]:
    """A kohya file with LyCORIS's DoRA on both Linears (alpha 3, rank 2), and its factors by module path."""
    generator = torch.Generator().manual_seed(7)
    tensors, factors = {}, {}
    for path, name in KOHYA.items():
        out_features, in_features = SHAPES[path]
        down = 0.5 * torch.randn(RANK, in_features, generator=generator)
        up = 0.5 * torch.randn(out_features, RANK, generator=generator)
        magnitude = 1 + 2 * torch.rand(out_features, generator=generator)
        factors[path] = (down, up, magnitude)
        prefix = f"diffusion_model.{path}" if dotted else name
        keys = ((".lora_A.weight", ".lora_B.weight") if dotted else (".lora_down.weight", ".lora_up.weight"))
        tensors[prefix + keys[0]], tensors[prefix + keys[1]] = down, up
        tensors[f"{prefix}.alpha"] = torch.tensor(ALPHA)
        tensors[f"{prefix}.dora_scale"] = (magnitude[:, None] if dora_scale_shape == "out" else
                                           torch.rand(1, in_features, generator=generator))
    return _save(folder, tensors), factors


def _hand_dora(weight: torch.Tensor, down: torch.Tensor, up: torch.Tensor, magnitude: torch.Tensor,
               scale: float) -> torch.Tensor:
    """m / ||W + s B A|| * (W + s B A), the norm of each output row over the inputs, in float64."""
    adapted = weight.double() + scale * (up.double() @ down.double())
    return magnitude.double()[:, None] / adapted.pow(2).sum(dim=1, keepdim=True).sqrt() * adapted


@pytest.mark.parametrize("dotted", [False, True], ids=["kohya", "comfyui_dotted"])
def test_lycoris_dora_scale_is_read_as_peft_magnitudes(tmp_path, dotted):
    """A dora_scale of shape (out, 1) (LyCORIS's wd_on_out=True) is the magnitude of each output row: merged, the
    weights are the hand-computed DoRA at strength 0.8 within fp32 rounding, bit for bit those of the same tensors
    as a PEFT file, and LyCORIS's own merge at strength 1 (its eps in the norm) within 1e-6; dynamic output
    within 1e-6 of the hand-computed layers."""
    file, factors = _kohya_dora(tmp_path / "kohya", dotted=dotted)
    modules = read_adapter(file).modules
    key = "block_proj_in" if not dotted else "block.proj_in"
    assert torch.equal(modules[key].magnitude, factors["block.proj_in"][2])
    model = _toy()
    base = {path: model.get_submodule(path).weight.detach().clone() for path in KOHYA}
    manager = LoraManager(model)
    peft = _save(tmp_path / "peft", {tensor_key: tensor for path, (down, up, magnitude) in factors.items()
                                     for tensor_key, tensor in ((f"{path}.lora_A.weight", down),
                                                                (f"{path}.lora_B.weight", up),
                                                                (f"{path}.lora_magnitude_vector", magnitude),
                                                                (f"{path}.alpha", torch.tensor(ALPHA)))})
    for strength in (0.8, 1.0):
        manager.set([LoraSpec(nickname="k", path=file, strength=strength)], "merge")
        merged = {path: model.get_submodule(path).weight.detach().clone() for path in KOHYA}
        manager.set([LoraSpec(nickname="p", path=peft, strength=strength)], "merge")
        for path, (down, up, magnitude) in factors.items():
            expected = _hand_dora(base[path], down, up, magnitude, strength * ALPHA / RANK)
            assert float((merged[path] - expected).abs().max() / expected.abs().max()) <= 1e-6
            assert torch.equal(merged[path], model.get_submodule(path).weight)
            if strength == 1.0:  # lycoris/modules/locon.py, apply_weight_decompose at multiplier 1
                adapted = base[path] + (ALPHA / RANK) * (up @ down)
                lycoris = adapted * (magnitude[:, None] / (adapted.norm(dim=1, keepdim=True)
                                                           + torch.finfo(torch.float32).eps))
                assert float((merged[path] - lycoris).abs().max() / lycoris.abs().max()) <= 1e-6
    manager.set([LoraSpec(nickname="k", strength=0.8)], "dynamic")
    reference = _toy()
    with torch.no_grad():
        for path, (down, up, magnitude) in factors.items():
            reference.get_submodule(path).weight.copy_(_hand_dora(base[path], down, up, magnitude, 0.8 * ALPHA / RANK))
    expected = _output(reference)
    assert float((_output(model) - expected).abs().max() / expected.abs().max()) <= 1e-6


def test_dora_scale_that_is_not_peft_s_decomposition_is_refused_naming_the_key(tmp_path):
    file, _ = _kohya_dora(tmp_path / "input", dora_scale_shape="in")
    with pytest.raises(ValueError, match=r"'lora_unet_block_proj_\w+\.dora_scale' has shape \(1, \d+\): LyCORIS's "
                                         r"DoRA with wd_on_out=False, whose magnitudes are the norms of the weight's "
                                         r"\d+ input columns .*PEFT's DoRA, which k6serve applies, normalises each "
                                         r"output row .*retrain it with wd_on_out=True") as raised:
        read_adapter(file)
    assert names_adapter_file(str(raised.value))
    pair = {"lora_unet_block_proj_in.lora_down.weight": torch.randn(RANK, 8),
            "lora_unet_block_proj_in.lora_up.weight": torch.randn(13, RANK)}
    cases = {
        "shape": ({**pair, "lora_unet_block_proj_in.dora_scale": torch.rand(13)},
                  r"'lora_unet_block_proj_in\.dora_scale' has shape \(13,\), but its lora_down / lora_up give a "
                  r"8 -> 13 layer; expected \(13, 1\)"),
        "stray": ({**pair, "lora_unet_block_proj_out.dora_scale": torch.rand(6, 1)},
                  r"'lora_unet_block_proj_out\.dora_scale' \(LyCORIS's DoRA magnitudes\) belongs to no module"),
        "both": ({"block.proj_in.lora_A.weight": torch.randn(RANK, 8), "block.proj_in.lora_B.weight":
                  torch.randn(13, RANK), "block.proj_in.dora_scale": torch.rand(13, 1),
                  "block.proj_in.lora_magnitude_vector": torch.rand(13)},
                 r"module 'block\.proj_in' has both a lora_magnitude_vector and a dora_scale"),
        "nan": ({**pair, "lora_unet_block_proj_in.dora_scale": torch.full((13, 1), float("nan"))},
                r"module 'block_proj_in': dora_scale holds NaN or infinite values"),
    }
    for name, (tensors, message) in cases.items():
        with pytest.raises(ValueError, match=message):
            read_adapter(_save(tmp_path / name, tensors))


# ---- list_loras ----


def test_list_loras_says_which_adapters_are_dora_or_carry_a_bias_or_an_embedding(tmp_path):
    files = _files(tmp_path)
    kohya, _ = _kohya_dora(tmp_path / "kohya")
    manager = LoraManager(_toy())
    manager.set([LoraSpec(nickname="b", path=files["bias"]), LoraSpec(nickname="d", path=files["dora"]),
                 LoraSpec(nickname="l", path=files["dora_linears"]), LoraSpec(nickname="k", path=kohya)], "dynamic")
    variants = {row["nickname"]: (row["dora"], row["lora_bias"], row["embedding"]) for row in manager.state()}
    assert variants == {"b": (False, True, False), "d": (True, False, True), "l": (True, False, False),
                        "k": (True, False, False)}


# ---- the cache's hits and misses on shards: the same on every rank ----


def _storage_task(files: dict[str, str]) -> dict:
    """Dynamic DoRA under tensor parallelism, set twice; between the two, rank 1 alone gets a new storage for one
    sharded weight, with the same values: a memory resume copies the weights back bit for bit, to addresses the
    allocator picks on each rank (the old one on one rank, another on the next). A miss on a shard runs collectives,
    so a rank that misses alone waits in them for peers that went on."""
    import torch.distributed as dist

    from k6serve.lora import dora
    from k6serve.runtime.memory import local_shard

    calls = []
    compute = dora.dora_factor
    dora.dora_factor = lambda *args: calls.append(1) or compute(*args)
    model = _sharded("tp")
    manager = LoraManager(model)
    specs = [LoraSpec(nickname="l", path=files["dora_linears"], strength=0.6)]
    manager.set(specs, "dynamic")
    expected = _output(model)
    first = len(calls)
    if dist.get_rank() == 1:
        local = local_shard(model.block.proj_in.weight)
        local.data = local.data.clone()
    manager.set(specs, "dynamic")
    return {"computed": (first, len(calls) - first), "same": torch.equal(_output(model), expected)}


def test_a_weight_stored_elsewhere_on_one_rank_does_not_split_the_ranks_hits(tmp_path):
    # A rank left waiting in a collective fails in 20 s, not at the 180 s wait.
    for result in run_on_gloo_ranks(_storage_task, _files(tmp_path), collective_timeout_s=20):
        assert result["computed"] == (2, 0) and result["same"], result
