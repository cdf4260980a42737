"""LoRA file layouts on the tiny Kandinsky 6 DiT (CPU, fp32): a PEFT `save_pretrained` folder, whose scale is only
in its adapter_config.json, and ComfyUI's dotted `lora_down` / `lora_up` names.

Before the fix a PEFT folder was merged at alpha = rank (LoraConfig(r=4, lora_alpha=16) at a quarter of its
update) and ComfyUI's names were refused as unknown keys. PEFT is not needed here: the folder is written as PEFT
0.21.2's `save_pretrained` writes it (the fields below are its `adapter_config.json`); merging real PEFT folders
against PEFT's own `merge_and_unload` (plain, rsLoRA, alpha_pattern + rank_pattern, DoRA) is
tests/parity/test_lora_parity.py::test_a_peft_save_pretrained_folder_merges_as_peft_merges_it. The references are computed independently: W + (alpha / r) * B @ A, in fp32; merging uses the same ops, so
they are compared bit for bit.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from k6serve.bench.tiny import TINY_TRANSFORMER_CONFIG
from k6serve.lora.adapter import read_adapter
from k6serve.lora.adapter_file import names_adapter_file
from k6serve.lora.manager import LoraManager
from k6serve.lora.peft_config import LORA_METADATA_KEY
from k6serve.lora.spec import LoraSpec
from k6serve.models.kandinsky6.checkpoint import build_dummy_transformer
from k6serve.testing.lora_adapters import module_shapes

pytestmark = pytest.mark.usefixtures("one_torch_thread")

VIDEO_FFN = "visual_transformer_blocks.0.video_dec_block.feed_forward.net.0.proj"
AUDIO_FFN = "visual_transformer_blocks.1.audio_dec_block.feed_forward.net.2"
SELF_KEY = "visual_transformer_blocks.0.video_dec_block.self_attention.to_key"
MODULES = (VIDEO_FFN, AUDIO_FFN, SELF_KEY)
# What PEFT 0.21.2's save_pretrained writes for LoraConfig(r=4, lora_alpha=16, target_modules=[...]) (every field).
PEFT_CONFIG = {
    "alora_invocation_tokens": None, "alpha_pattern": {}, "arrow_config": None,
    "auto_mapping": {"base_model_class": "Kandinsky6Transformer", "parent_library": "k6serve"},
    "base_model_name_or_path": None, "bias": "none", "corda_config": None, "ensure_weight_tying": False,
    "eva_config": None, "exclude_modules": None, "fan_in_fan_out": False, "inference_mode": True,
    "init_lora_weights": True, "kasa_config": None, "layer_replication": None, "layers_pattern": None,
    "layers_to_transform": None, "loftq_config": {}, "lora_alpha": 16, "lora_bias": False, "lora_dropout": 0.0,
    "lora_ga_config": None, "megatron_config": None, "megatron_core": "megatron.core", "modules_to_save": None,
    "monteclora_config": None, "peft_type": "LORA", "peft_version": "0.21.2", "qalora_group_size": 16, "r": 4,
    "rank_pattern": {}, "revision": None, "target_modules": ["to_key", "proj", "net.2"], "target_parameters": None,
    "task_type": None, "trainable_token_indices": None, "use_bdlora": None, "use_dora": False, "use_qalora": False,
    "use_rslora": False, "velora_config": None,
}


def _dit():
    return build_dummy_transformer(TINY_TRANSFORMER_CONFIG, device=torch.device("cpu"), dtype=torch.float32, seed=3)


def _factors(shapes: dict[str, tuple[int, int]], ranks: dict[str, int] | None = None,
             seed: int = 0) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """module -> (down (rank, in), up (out, rank)), rank 4 unless `ranks` says otherwise."""
    generator = torch.Generator().manual_seed(seed)
    return {module: (0.3 * torch.randn((ranks or {}).get(module, 4), in_features, generator=generator),
                     0.3 * torch.randn(out_features, (ranks or {}).get(module, 4), generator=generator))
            for module, (out_features, in_features) in shapes.items()}


def _peft_folder(folder: Path, factors, metadata: dict[str, str] | None = None, **config) -> Path:
    """A PEFT save_pretrained folder: adapter_model.safetensors (no alpha) + adapter_config.json."""
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for module, (down, up) in factors.items():
        tensors[f"base_model.model.{module}.lora_A.weight"] = down
        tensors[f"base_model.model.{module}.lora_B.weight"] = up
    save_file(tensors, str(folder / "adapter_model.safetensors"), metadata={"format": "pt", **(metadata or {})})
    (folder / "adapter_config.json").write_text(json.dumps({**PEFT_CONFIG, **config}, indent=2, sort_keys=True))
    return folder


def _merged(path: str) -> dict[str, torch.Tensor]:
    model = _dit()
    LoraManager(model).set([LoraSpec(nickname="a", path=path, strength=1.0)], "merge")
    return {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}


def _expected(factors, scales: dict[str, float]) -> dict[str, torch.Tensor]:
    """W + scale * B @ A for each module, from the base weights and the factors alone."""
    weights = {name: tensor.detach().clone() for name, tensor in _dit().state_dict().items()}
    for module, (down, up) in factors.items():
        weights[f"{module}.weight"] = weights[f"{module}.weight"] + scales[module] * (up @ down)
    return weights


def _assert_weights(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert actual.keys() == expected.keys()
    for name in actual:
        torch.testing.assert_close(actual[name], expected[name], rtol=0, atol=0, msg=name)


# ---- PEFT save_pretrained folders ----


def test_a_peft_folder_is_merged_at_lora_alpha_over_r(tmp_path):
    factors = _factors(module_shapes(_dit(), MODULES))
    folder = _peft_folder(tmp_path / "peft", factors)  # r=4, lora_alpha=16: scale 4, not 1
    expected = _expected(factors, dict.fromkeys(MODULES, 16 / 4))
    _assert_weights(_merged(str(folder)), expected)
    _assert_weights(_merged(str(folder / "adapter_model.safetensors")), expected)  # the file inside, named directly
    assert read_adapter(str(folder)).file_alpha == 16.0


def test_rslora_scales_by_lora_alpha_over_sqrt_r(tmp_path):
    factors = _factors(module_shapes(_dit(), MODULES))
    folder = _peft_folder(tmp_path / "peft", factors, use_rslora=True)
    _assert_weights(_merged(str(folder)), _expected(factors, dict.fromkeys(MODULES, 16 / math.sqrt(4))))


def test_alpha_pattern_and_rank_pattern_match_module_paths_as_peft_does(tmp_path):
    """PEFT's `get_pattern_key`: the first pattern matching the end of the module path (after a "."); a module no
    pattern matches takes r / lora_alpha."""
    factors = _factors(module_shapes(_dit(), MODULES), ranks={SELF_KEY: 2})
    folder = _peft_folder(tmp_path / "peft", factors, rank_pattern={"to_key": 2},
                          alpha_pattern={r"net\.2": 2, r"visual_transformer_blocks\.0\..*to_key": 32})
    scales = {VIDEO_FFN: 16 / 4, AUDIO_FFN: 2 / 4, SELF_KEY: 32 / 2}
    _assert_weights(_merged(str(folder)), _expected(factors, scales))
    with_rslora = _peft_folder(tmp_path / "rslora", factors, use_rslora=True, rank_pattern={"to_key": 2},
                               alpha_pattern={r"net\.2": 2})
    scales = {VIDEO_FFN: 16 / 2, AUDIO_FFN: 2 / 2, SELF_KEY: 16 / math.sqrt(2)}
    alphas = {module: entry.alpha / entry.rank for module, entry in read_adapter(str(with_rslora)).modules.items()}
    assert alphas == pytest.approx(scales, rel=1e-12)


def test_a_hub_peft_repo_fetches_its_config_with_the_weights(tmp_path, monkeypatch):
    import huggingface_hub

    factors = _factors(module_shapes(_dit(), [VIDEO_FFN]))
    snapshot = _peft_folder(tmp_path / "snapshot", factors)
    patterns = []

    def snapshot_download(repo_id, allow_patterns):
        patterns.extend(allow_patterns)
        return str(snapshot)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    adapter = read_adapter("someone/peft-lora")
    assert "adapter_config.json" in patterns and "adapter_model.safetensors" in patterns
    assert adapter.file == snapshot / "adapter_model.safetensors" and adapter.modules[VIDEO_FFN].alpha == 16.0


def test_header_and_json_must_agree(tmp_path):
    """The same LoraConfig in diffusers' header and PEFT's JSON: read when they agree, refused when they do not
    (diffusers would apply the header's, PEFT the JSON's)."""
    factors = _factors(module_shapes(_dit(), [VIDEO_FFN]))
    agree = _peft_folder(tmp_path / "agree", factors, metadata={LORA_METADATA_KEY: json.dumps({"lora_alpha": 16})})
    assert read_adapter(str(agree)).modules[VIDEO_FFN].alpha == 16.0
    disagree = _peft_folder(tmp_path / "disagree", factors, metadata={LORA_METADATA_KEY: json.dumps({"lora_alpha": 8})})
    with pytest.raises(ValueError, match=rf"module '{VIDEO_FFN}' has alpha 8 in the lora_adapter_metadata header but "
                                         r"16 in the adapter_config\.json beside it; keep one of them") as raised:
        read_adapter(str(disagree))
    assert names_adapter_file(str(raised.value))
    # A header nested past Python's recursion limit: a 400's refusal, not a RecursionError (a 500 with a trace).
    # Python 3.14's decoder bounds the C stack instead: 50,000 deep parses there (refused as no JSON object), and an
    # 8 MB stack runs out near 200,000 deep ("Stack overflow").
    deep = _peft_folder(tmp_path / "deep", factors, metadata={LORA_METADATA_KEY: "[" * 1_000_000 + "]" * 1_000_000})
    with pytest.raises(ValueError, match=r"its lora_adapter_metadata header is not (valid JSON \((maximum recursion|"
                                         r"Stack overflow)|a JSON object)"):
        read_adapter(str(deep))


@pytest.mark.parametrize(("config", "message"), [
    ({"init_lora_weights": "pissa"}, r"init_lora_weights='pissa': that initialisation rewrites the base weights.*"
                                     r"path_initial_model_for_weight_conversion"),
    ({"bias": "all"}, r"bias='all': the adapter also trained the layers' own biases"),
    ({"modules_to_save": ["out_layer"]}, r"sets modules_to_save=\['out_layer'\], which changes what PEFT does"),
    ({"layer_replication": [[0, 1]]}, r"sets layer_replication=\[\[0, 1\]\]"),
    ({"peft_type": "LOHA"}, r"peft_type='LOHA': not a LoRA adapter"),
    ({"r": 8}, rf"gives module '{VIDEO_FFN}' rank 8 \(r\), but its lora_A has rank 4; the adapter_config\.json and "
               r"the weights come from different adapters"),
    ({"use_dora": True}, r"adapter_config\.json beside it says use_dora=True, but the file holds no "
                         r"lora_magnitude_vector keys"),
    ({"alpha_pattern": [16]}, r"alpha_pattern must be an object"),
    # Patterns whose matching would not end (the loader, and the server's set_lora, hung at 100% CPU).
    ({"alpha_pattern": {"([a-z_.0-9]+)+X": 3}}, r"alpha_pattern holds the pattern '\(\[a-z_\.0-9\]\+\)\+X', "
                                               r"with a repeat or an alternation inside a repeat"),
    ({"rank_pattern": {".*.*.*.*Z": 4}}, r"rank_pattern holds the pattern '\.\*\.\*\.\*\.\*Z', with 4 "
                                         r"open-ended repeats"),
    ({"alpha_pattern": {"[": 3}}, r"alpha_pattern holds a pattern that is not a regular expression"),
    # Inside an atomic group or a conditional, and bounded repeats that split a path as many ways.
    ({"alpha_pattern": {"(?>([a-z_.0-9]+)+X)": 3}}, r"with a repeat or an alternation inside a repeat"),
    ({"alpha_pattern": {"(a)?(?(1)([a-z_.0-9]+)+X|c)": 3}}, r"with a repeat or an alternation inside a repeat"),
    ({"alpha_pattern": {".{0,60}" * 7 + "X": 3}}, r"with 7 open-ended repeats"),
    ({"alpha_pattern": {".{0,8}" * 30 + "X": 3}}, r"with 30 repeats"),
])
def test_a_config_option_k6serve_cannot_apply_is_refused(tmp_path, config, message):
    folder = _peft_folder(tmp_path / "peft", _factors(module_shapes(_dit(), [VIDEO_FFN])), **config)
    with pytest.raises(ValueError, match=message) as raised:
        read_adapter(str(folder))
    assert str(raised.value).startswith("LoRA file ") and names_adapter_file(str(raised.value))


def test_a_config_without_its_scale_or_beside_other_files_is_refused(tmp_path):
    folder = _peft_folder(tmp_path / "peft", _factors(module_shapes(_dit(), [VIDEO_FFN])))
    config = json.loads((folder / "adapter_config.json").read_text())
    del config["lora_alpha"]
    (folder / "adapter_config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"adapter_config\.json beside it has no lora_alpha, which PEFT's "
                                         "save_pretrained always writes"):
        read_adapter(str(folder))
    (folder / "adapter_config.json").write_text("{oops")
    with pytest.raises(ValueError, match=r"adapter_config\.json beside it cannot be read as JSON"):
        read_adapter(str(folder))
    shared = _peft_folder(tmp_path / "shared", _factors(module_shapes(_dit(), [VIDEO_FFN])))
    other = shared / "style.safetensors"
    other.write_bytes((shared / "adapter_model.safetensors").read_bytes())
    assert read_adapter(str(shared / "adapter_model.safetensors")).modules[VIDEO_FFN].alpha == 16.0
    with pytest.raises(ValueError, match=r"may belong to another of the folder's \.safetensors files "
                                         r"\(adapter_model\.safetensors\); put the adapter in a folder of its own"):
        read_adapter(str(other))


def test_a_changed_config_is_read_again(tmp_path):
    folder = _peft_folder(tmp_path / "peft", _factors(module_shapes(_dit(), [VIDEO_FFN])))
    adapter = read_adapter(str(folder))
    assert adapter.unchanged()
    (folder / "adapter_config.json").write_text(json.dumps({**PEFT_CONFIG, "lora_alpha": 8}))
    assert not adapter.unchanged() and read_adapter(str(folder)).modules[VIDEO_FFN].alpha == 8.0


# ---- ComfyUI's dotted lora_down / lora_up ----


def _save(file: Path, tensors: dict[str, torch.Tensor]) -> str:
    save_file(tensors, str(file))
    return str(file)


@pytest.mark.parametrize("alphas", [{}, {VIDEO_FFN: 1.0, AUDIO_FFN: 8.0, SELF_KEY: 4.0}])
def test_comfyui_dotted_names_merge_as_the_diffusers_file_does(tmp_path, alphas):
    """ComfyUI's LoRA save / extract / training nodes write diffusion_model.<dotted module>.lora_down.weight /
    .lora_up.weight (+ .alpha, scale alpha / rank as kohya's; none: scale 1)."""
    factors = _factors(module_shapes(_dit(), MODULES))
    comfy, diffusers = {}, {}
    for module, (down, up) in factors.items():
        comfy |= {f"diffusion_model.{module}.lora_down.weight": down, f"diffusion_model.{module}.lora_up.weight": up}
        diffusers |= {f"transformer.{module}.lora_A.weight": down, f"transformer.{module}.lora_B.weight": up}
        if module in alphas:
            comfy[f"diffusion_model.{module}.alpha"] = diffusers[f"transformer.{module}.alpha"] = (
                torch.tensor(alphas[module]))
    comfy_weights = _merged(_save(tmp_path / "comfy.safetensors", comfy))
    _assert_weights(comfy_weights, _merged(_save(tmp_path / "diffusers.safetensors", diffusers)))
    _assert_weights(comfy_weights, _expected(factors, {m: alphas.get(m, 4) / 4 for m in MODULES}))


def test_two_keys_for_one_factor_are_refused(tmp_path):
    down, up = _factors(module_shapes(_dit(), [VIDEO_FFN]))[VIDEO_FFN]
    file = _save(tmp_path / "both.safetensors", {
        f"diffusion_model.{VIDEO_FFN}.lora_down.weight": down, f"diffusion_model.{VIDEO_FFN}.lora_up.weight": up,
        f"diffusion_model.{VIDEO_FFN}.lora_A.weight": 2 * down})
    with pytest.raises(ValueError, match=r"are both the lora_A \(down\) factor of module"):
        read_adapter(file)


def test_unknown_keys_name_the_comfyui_layout(tmp_path):
    down, up = _factors(module_shapes(_dit(), [VIDEO_FFN]))[VIDEO_FFN]
    file = _save(tmp_path / "diff.safetensors", {f"diffusion_model.{VIDEO_FFN}.lora_down.weight": down,
                                                 f"diffusion_model.{VIDEO_FFN}.lora_up.weight": up,
                                                 f"diffusion_model.{VIDEO_FFN}.diff_b": torch.zeros(128)})
    with pytest.raises(ValueError, match=r"ComfyUI ones \(<module>\.lora_down\.weight / \.lora_up\.weight / "
                                         r"\.alpha, under diffusion_model\.\)"):
        read_adapter(file)
