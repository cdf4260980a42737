"""k6serve's LoRA support against diffusers 0.42.1's own LoRA loading (PEFT) on the same adapter file and weights.

The tiny Pro checkpoint's DiT (`tiny_pro_dir`) is loaded twice: by diffusers (`Kandinsky6Transformer3DModel.
from_pretrained`) and by us (`load_transformer`, the serving path). diffusers 0.42.1 has no LoRA loader mixin for
`Kandinsky6TI2VAPipeline` (no `load_lora_weights`), but the model is a `PeftAdapterMixin`: `load_lora_adapter`,
`set_adapters(name, strength)`, `fuse_lora` / `unfuse_lora`, which is what a mixin would call. Compared:

* fused (`fuse_lora`, PEFT's merge) against our merge mode, unfused (PEFT's LoraLayer forward) against our dynamic
  mode, on an adapter on every Linear of the DiT (106, the keep-fp32 modulations and time embeddings included);
* the alpha from nowhere (scale 1), from `<module>.alpha` keys (which diffusers' model API ignores: a mixin such as
  Flux's pops them into `network_alphas`, done here by hand), from the safetensors header diffusers' own
  `save_lora_weights` / `save_lora_adapter` write (`lora_adapter_metadata`; we ignored it before, and applied such an
  adapter at scale 1 where diffusers applies lora_alpha / rank), and our `lora_alpha` override;
* per-module ranks (diffusers' rank_pattern), kohya's layout (diffusers 0.42.1 cannot read it for this model, so ours
  is compared with diffusers reading the same tensors in its own layout), and an adapter on to_query / to_key /
  to_value against speed mode's fused Q/K/V (ours fused vs diffusers unfused);
* PEFT's variants, in files written by diffusers' own `save_lora_adapter` from a PEFT `LoraConfig` with random
  weights: DoRA (`use_dora`; also at strength 0, and stacked with a plain adapter in either order), a lora_B bias
  (`lora_bias`; also where diffusers' `fuse_lora` refuses it, a Linear without a bias), and LoRA / DoRA on the DiT's
  nn.Embedding (with TI2AV's token type ids), each merged and dynamic, with unmerge restoring the weights bit for
  bit; and a module the model lacks, which diffusers skips with a warning and we refuse.

fp32: merge is bitwise (W + (s * alpha / r) * (B @ A), the same ops; DoRA's and the bias's merges too, but after a
plain adapter, where PEFT unmerges and re-merges it first); dynamic is within 1e-5 of the output's largest value and
bitwise at scale 1 (we fold the scale into B before the second GEMM, PEFT multiplies its output: a rounding
apart otherwise); fused Q/K/V within 1e-5 (one GEMM instead of three). bf16: the merged weights are compared with the
correctly rounded W + s * alpha / r * B A, where ours rounds once and PEFT rounds A and B to bf16, then the delta, then
the sum. Run with -s to see the measured differences.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

peft = pytest.importorskip("peft", reason="the LoRA parity tests compare against diffusers' LoRA loading, which needs "
                                          "peft (pip install peft)")
from diffusers import Kandinsky6Transformer3DModel  # noqa: E402
from peft.tuners.tuners_utils import BaseTunerLayer  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

from k6serve.lora.adapter import read_adapter  # noqa: E402
from k6serve.lora.manager import LoraManager  # noqa: E402
from k6serve.lora.peft_config import LORA_METADATA_KEY  # noqa: E402
from k6serve.lora.spec import LoraSpec  # noqa: E402
from k6serve.models.kandinsky6.checkpoint import load_transformer  # noqa: E402
from k6serve.speed import apply_fused_projections  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")

RANK, STRENGTH = 4, 0.7
SELF = "visual_transformer_blocks.0.video_dec_block.self_attention"
CROSS = "visual_transformer_blocks.1.audio_dec_block.cross_attention"
TEXT = "video_text_transformer_blocks.1.attn"
FFN = "visual_transformer_blocks.0.video_dec_block.feed_forward.net.0.proj"
BATCH, FRAMES, HEIGHT, WIDTH, TEXT_TOKENS, AUDIO_TOKENS = 2, 3, 4, 6, 10, 7


# ---- models, inputs, adapter files ----


def _reference(checkpoint: Path, dtype=torch.float32) -> Kandinsky6Transformer3DModel:
    model = Kandinsky6Transformer3DModel.from_pretrained(checkpoint / "transformer", torch_dtype=dtype).eval()
    with torch.no_grad():  # fresh aligned storage, as our loader's (CPU GEMMs round differently on mmapped views)
        for tensor in [*model.parameters(), *model.buffers()]:
            tensor.data = tensor.data.clone()
    return model.requires_grad_(False)


def _ours(checkpoint: Path, dtype=torch.float32, *, fused: bool = False):
    model = load_transformer(checkpoint / "transformer", device=torch.device("cpu"), dtype=dtype)
    if fused:
        apply_fused_projections(model)  # --performance-mode speed's Q/K/V (self) and K/V (cross) fusion
    return model


def _inputs(dtype=torch.float32, *, token_types: bool = False) -> dict:
    """`token_types`: with the TI2AV pipeline's visual_token_type_ids (1 on the reference frame), which the DiT's
    nn.Embedding reads."""
    generator = torch.Generator().manual_seed(1)
    mask = torch.ones(BATCH, TEXT_TOKENS, dtype=torch.bool)
    mask[1, 6:] = False
    inputs = {
        "hidden_states": torch.randn(BATCH, FRAMES, HEIGHT, WIDTH, 33, generator=generator).to(dtype),
        "encoder_hidden_states": torch.randn(BATCH, TEXT_TOKENS, 32, generator=generator).to(dtype),
        "pooled_projections": torch.randn(BATCH, 32, generator=generator).to(dtype),
        "timestep": torch.tensor([1000.0, 437.5]),
        "audio_hidden_states": torch.randn(BATCH, AUDIO_TOKENS, 8, generator=generator).to(dtype),
        "encoder_attention_mask": mask,
    }
    if token_types:
        inputs["visual_token_type_ids"] = torch.tensor([[0] * (FRAMES - 1) + [1], [0] + [1] * (FRAMES - 1)])
    return inputs


def _run_reference(model, dtype=torch.float32, *, token_types: bool = False):
    with torch.no_grad():
        return tuple(model(**_inputs(dtype, token_types=token_types), return_dict=False))


def _run_ours(model, dtype=torch.float32, *, token_types: bool = False):
    with torch.inference_mode():
        return tuple(model(**_inputs(dtype, token_types=token_types)))


def _relative(actual, expected) -> list[float]:
    return [float((got.double() - want.double()).abs().max() / want.double().abs().max())
            for got, want in zip(actual, expected, strict=True)]


def _report(label: str, actual, expected) -> list[float]:
    errors = _relative(actual, expected)
    bitwise = all(torch.equal(got, want) for got, want in zip(actual, expected, strict=True))
    print(f"{label}: max|diff| / max|ref| video {errors[0]:.3g}, audio {errors[1]:.3g}, bitwise {bitwise}")
    return errors


def _linears(model) -> dict[str, tuple[int, int]]:
    return {name: tuple(module.weight.shape) for name, module in model.named_modules()
            if isinstance(module, torch.nn.Linear)}


def _factors(shapes: dict[str, tuple[int, int]], *, ranks: dict[str, int] | None = None, seed: int = 0,
             amplitude: float = 0.1) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """path -> (lora_A (r, in), lora_B (out, r)), N(0, amplitude^2), fp32."""
    generator = torch.Generator().manual_seed(seed)
    factors = {}
    for path, (out_features, in_features) in shapes.items():
        rank = (ranks or {}).get(path, RANK)
        factors[path] = (amplitude * torch.randn(rank, in_features, generator=generator),
                         amplitude * torch.randn(out_features, rank, generator=generator))
    return factors


def _diffusers_keys(factors, *, alphas: dict[str, float] | None = None) -> dict[str, torch.Tensor]:
    tensors = {}
    for path, (down, up) in factors.items():
        tensors[f"transformer.{path}.lora_A.weight"] = down
        tensors[f"transformer.{path}.lora_B.weight"] = up
        if path in (alphas or {}):
            tensors[f"transformer.{path}.alpha"] = torch.tensor(alphas[path])
    return tensors


def _kohya_keys(factors, *, alphas: dict[str, float] | None = None) -> dict[str, torch.Tensor]:
    tensors = {}
    for path, (down, up) in factors.items():
        flat = "lora_unet_" + path.replace(".", "_")
        tensors[f"{flat}.lora_down.weight"] = down
        tensors[f"{flat}.lora_up.weight"] = up
        if path in (alphas or {}):
            tensors[f"{flat}.alpha"] = torch.tensor(alphas[path])
    return tensors


def _save(file: Path, tensors: dict[str, torch.Tensor], header: dict | None = None) -> Path:
    """`header`: a PEFT LoraConfig's fields, stored as diffusers' pipeline `save_lora_weights` does (JSON under
    `lora_adapter_metadata`, each field prefixed `transformer.`)."""
    metadata = {"format": "pt"}
    if header is not None:
        metadata[LORA_METADATA_KEY] = json.dumps({f"transformer.{key}": value for key, value in header.items()})
    save_file(tensors, str(file), metadata=metadata)
    return file


def _load_into_diffusers(model, file: Path, *, alpha_keys_as_network_alphas: bool = True, strength=STRENGTH,
                         network_alphas: dict[str, float] | None = None, prefix: str | None = "transformer"):
    """What diffusers does with `file`: `load_lora_adapter` reads the header's LoraConfig itself; `<module>.alpha`
    keys it ignores, so (as Flux's / SD's `lora_state_dict` do) they are popped into `network_alphas`. `prefix`:
    None for a file from a model's own `save_lora_adapter`, whose keys have no `transformer.`."""
    if network_alphas is not None or (alpha_keys_as_network_alphas and any(
            key.endswith(".alpha") for key in load_file(str(file)))):
        tensors = load_file(str(file))
        alphas = {key: float(tensors.pop(key)) for key in list(tensors) if key.endswith(".alpha")}
        model.load_lora_adapter(tensors, network_alphas=network_alphas or alphas, adapter_name="a")
    else:
        model.load_lora_adapter(str(file.parent), weight_name=file.name, adapter_name="a", prefix=prefix)
    model.set_adapters("a", strength)
    return model


def _pair(checkpoint: Path, file: Path, mode: str, *, dtype=torch.float32, fused: bool = False, alpha=None,
          strength=STRENGTH, **diffusers_kwargs):
    """(ours, diffusers) outputs of `file` at `strength`: merge vs fuse_lora, or dynamic vs PEFT's unfused forward;
    `alpha` is our override (diffusers gets `network_alphas` for it)."""
    reference = _load_into_diffusers(_reference(checkpoint, dtype), file, strength=strength, **diffusers_kwargs)
    if mode == "merge":
        reference.fuse_lora()
    ours = _ours(checkpoint, dtype, fused=fused)
    LoraManager(ours).set([LoraSpec(nickname="a", path=str(file), strength=strength, alpha=alpha)], mode)
    return _run_ours(ours, dtype), _run_reference(reference, dtype)


@pytest.fixture(scope="module")
def shapes(tiny_pro_dir) -> dict[str, tuple[int, int]]:
    return _linears(_reference(tiny_pro_dir))


@pytest.fixture(scope="module")
def base_outputs(tiny_pro_dir):
    return _run_reference(_reference(tiny_pro_dir))


# ---- fp32: every Linear, each source of alpha ----

ALPHA_SOURCES = ["none", "keys", "header", "override"]


@pytest.mark.parametrize("mode", ["merge", "dynamic"])
@pytest.mark.parametrize("source", ALPHA_SOURCES)
def test_every_linear_matches_diffusers_in_fp32(tiny_pro_dir, tmp_path, shapes, base_outputs, mode, source):
    """rank 4; alpha 8 (scale 2 x strength), or none (scale 1); override: our lora_alpha=1 against diffusers given
    network_alphas 1 (scale 1/4) on a file whose keys say 8."""
    factors = _factors(shapes)
    alphas = dict.fromkeys(shapes, 8.0) if source in ("keys", "override") else None
    header = {"r": RANK, "lora_alpha": 8.0, "target_modules": sorted(shapes)} if source == "header" else None
    file = _save(tmp_path / "pytorch_lora_weights.safetensors", _diffusers_keys(factors, alphas=alphas), header)
    if source == "override":
        ours, reference = _pair(tiny_pro_dir, file, mode, alpha=1.0,
                                network_alphas={f"transformer.{path}.alpha": 1.0 for path in shapes})
    else:
        ours, reference = _pair(tiny_pro_dir, file, mode)
    errors = _report(f"fp32 {mode}, alpha {source}", ours, reference)
    assert max(_relative(reference, base_outputs)) > 0.05  # the adapter changes the output
    if mode == "merge":  # the same ops: W + (s * alpha / r) * (B @ A), rounded once to fp32
        assert all(torch.equal(got, want) for got, want in zip(ours, reference))
    else:
        assert max(errors) <= 1e-5


def test_dynamic_is_bitwise_at_scale_one(tiny_pro_dir, tmp_path, shapes):
    """With strength x alpha / rank = 1 our dynamic path is PEFT's forward op for op: base(x) + B(A(x))."""
    file = _save(tmp_path / "a.safetensors", _diffusers_keys(_factors(shapes)))
    ours, reference = _pair(tiny_pro_dir, file, "dynamic", strength=1.0)
    _report("fp32 dynamic, scale 1", ours, reference)
    assert all(torch.equal(got, want) for got, want in zip(ours, reference))


def test_alpha_keys_are_what_diffusers_network_alphas_mean(tiny_pro_dir, tmp_path, shapes):
    """diffusers' model-level `load_lora_adapter` ignores `<module>.alpha` keys (scale 1, silently); the mixins that
    read them (Flux's, SD's) pass them as `network_alphas`, which is what we do with them. Both are shown: ours with
    the file's alpha is diffusers with network_alphas, ours with lora_alpha = rank is diffusers' bare load."""
    paths = [f"{SELF}.to_key", FFN, f"{TEXT}.out_layer"]
    file = _save(tmp_path / "a.safetensors",
                 _diffusers_keys(_factors({path: shapes[path] for path in paths}, amplitude=0.3),
                                 alphas=dict.fromkeys(paths, 8.0)))
    ours, reference = _pair(tiny_pro_dir, file, "merge")
    assert all(torch.equal(got, want) for got, want in zip(ours, reference))
    bare, _ = _pair(tiny_pro_dir, file, "merge", alpha=float(RANK))
    _, bare_reference = _pair(tiny_pro_dir, file, "merge", alpha_keys_as_network_alphas=False)
    assert all(torch.equal(got, want) for got, want in zip(bare, bare_reference))
    assert not torch.equal(bare[0], ours[0])


def test_a_module_without_alpha_among_modules_with_one(tiny_pro_dir, tmp_path, shapes):
    """A file with `.alpha` keys for some modules only: kohya's sd-scripts ("support old LoRA without alpha"),
    ComfyUI and we take such a module's alpha as its rank (scale 1). diffusers' `network_alphas` instead give it the
    most common alpha of the others (its `lora_alpha` default), a documented difference: ours equals diffusers given
    the missing alpha as the rank."""
    paths = [f"{SELF}.to_key", FFN, f"{TEXT}.out_layer"]
    alphas = {f"{SELF}.to_key": 8.0, FFN: 8.0}  # none for the text block's out_layer
    file = _save(tmp_path / "a.safetensors",
                 _diffusers_keys(_factors({path: shapes[path] for path in paths}, amplitude=0.3), alphas=alphas))
    ours, diffusers_default = _pair(tiny_pro_dir, file, "merge")
    assert not torch.equal(ours[0], diffusers_default[0])
    completed = {f"transformer.{path}.alpha": alphas.get(path, float(RANK)) for path in paths}
    _, reference = _pair(tiny_pro_dir, file, "merge", network_alphas=completed)
    assert all(torch.equal(got, want) for got, want in zip(ours, reference))


def test_diffusers_header_alphas_and_rslora(tiny_pro_dir, tmp_path, shapes):
    """The header of a file saved by diffusers holds the LoraConfig: lora_alpha for all, alpha_pattern per module
    (a regex matched against the path's end, as PEFT does) and use_rslora (scale alpha / sqrt(rank)). Before the
    fix ours read none of it and applied every module at scale 1."""
    paths = [f"{SELF}.to_key", f"{SELF}.to_value", FFN, f"{CROSS}.to_query"]
    factors = _factors({path: shapes[path] for path in paths}, amplitude=0.3)
    for use_rslora in (False, True):
        header = {"r": RANK, "lora_alpha": 8, "alpha_pattern": {r"self_attention\.to_value": 2.0, FFN: 16.0},
                  "use_rslora": use_rslora, "target_modules": paths}
        file = _save(tmp_path / f"rslora_{use_rslora}.safetensors", _diffusers_keys(factors), header)
        for mode in ("merge", "dynamic"):
            ours, reference = _pair(tiny_pro_dir, file, mode)
            errors = _report(f"fp32 {mode}, header alpha_pattern, rslora {use_rslora}", ours, reference)
            assert max(errors) <= 1e-5
            if mode == "merge":
                assert all(torch.equal(got, want) for got, want in zip(ours, reference))
    # A header without lora_alpha: diffusers builds LoraConfig(**header), whose default lora_alpha is 8 (not the
    # rank, which ours applied: scale 1 where diffusers' is 2).
    no_alpha = _save(tmp_path / "no_alpha.safetensors", _diffusers_keys(factors), {"r": RANK, "target_modules": paths})
    ours, reference = _pair(tiny_pro_dir, no_alpha, "merge")
    assert all(torch.equal(got, want) for got, want in zip(ours, reference))
    # A model's own `save_lora_adapter` writes the fields unprefixed, with unprefixed keys.
    model = _load_into_diffusers(_reference(tiny_pro_dir), file)
    model.save_lora_adapter(str(tmp_path / "saved"), adapter_name="a")
    saved = read_adapter(str(tmp_path / "saved"))
    assert {path: module.alpha for path, module in saved.modules.items()} == {
        f"{SELF}.to_key": 16.0, f"{SELF}.to_value": 4.0, FFN: 32.0, f"{CROSS}.to_query": 16.0}  # alpha * sqrt(4)


def test_per_module_ranks_without_alpha(tiny_pro_dir, tmp_path, shapes):
    """Ranks 2, 4 and 8 in one file, no alpha: diffusers mirrors each rank into its alpha (rank_pattern /
    alpha_pattern), so every module is at scale 1, as ours."""
    paths = [f"{SELF}.to_query", FFN, f"{TEXT}.to_value"]
    ranks = dict(zip(paths, (2, 4, 8)))
    file = _save(tmp_path / "a.safetensors", _diffusers_keys(_factors({p: shapes[p] for p in paths}, ranks=ranks,
                                                                      amplitude=0.3)))
    for mode in ("merge", "dynamic"):
        ours, reference = _pair(tiny_pro_dir, file, mode)
        assert max(_report(f"fp32 {mode}, ranks 2/4/8", ours, reference)) <= 1e-5


# ---- layouts and modules only one side reads ----


def test_kohya_layout(tiny_pro_dir, tmp_path, shapes):
    """diffusers 0.42.1 cannot read kohya keys for this model (no converter: `load_lora_adapter` ends in an
    IndexError, or loads nothing under the default prefix), so ours on the kohya file is compared with diffusers on
    the same tensors in its own layout (what a converter would produce), alphas as network_alphas."""
    paths = [f"{SELF}.to_key", FFN, "out_layer.modulation.out_layer"]
    factors = _factors({path: shapes[path] for path in paths}, amplitude=0.3)
    alphas = {f"{SELF}.to_key": 1.0, FFN: 8.0, "out_layer.modulation.out_layer": 4.0}  # kohya's alpha 1 is common
    kohya = _save(tmp_path / "kohya.safetensors", _kohya_keys(factors, alphas=alphas))
    with pytest.raises(IndexError):
        _reference(tiny_pro_dir).load_lora_adapter(str(tmp_path), weight_name=kohya.name, prefix=None)
    (tmp_path / "diffusers").mkdir()
    diffusers_layout = _save(tmp_path / "diffusers" / "a.safetensors", _diffusers_keys(factors, alphas=alphas))
    for mode in ("merge", "dynamic"):
        reference = _load_into_diffusers(_reference(tiny_pro_dir), diffusers_layout)
        if mode == "merge":
            reference.fuse_lora()
        ours = _ours(tiny_pro_dir)
        LoraManager(ours).set([LoraSpec(nickname="a", path=str(kohya), strength=STRENGTH)], mode)
        errors = _report(f"fp32 {mode}, kohya layout", _run_ours(ours), _run_reference(reference))
        assert max(errors) <= 1e-5


def test_a_module_the_model_lacks_is_refused_where_diffusers_skips_it(tiny_pro_dir, tmp_path, shapes):
    """diffusers loads an adapter naming a module the model lacks with only a warning and applies the rest. We
    refuse the whole file with an error naming the module and saying why (an adapter applied in part, say with a
    typo'd or renamed module, changes the output without anything failing), and change nothing."""
    tensors = _diffusers_keys(_factors({FFN: shapes[FFN]}))
    tensors["transformer.text_encoder.q_proj.lora_A.weight"] = torch.randn(RANK, 8)
    tensors["transformer.text_encoder.q_proj.lora_B.weight"] = torch.randn(8, RANK)
    file = _save(tmp_path / "a.safetensors", tensors)
    reference = _load_into_diffusers(_reference(tiny_pro_dir), file)
    adapted = {name for name, module in reference.named_modules() if isinstance(module, BaseTunerLayer)}
    assert adapted == {FFN}  # diffusers applied the rest
    ours = _ours(tiny_pro_dir)
    before = {name: tensor.clone() for name, tensor in ours.state_dict().items()}
    message = (r"1 of its 2 module\(s\) are not Linear layers.*text_encoder\.q_proj.*The whole adapter is refused "
               r"rather than applied without them \(diffusers' load_lora_adapter would skip them with a warning\).*"
               r"remove those modules' keys from the file to apply the rest")
    for mode in ("merge", "dynamic"):
        with pytest.raises(ValueError, match=message):
            LoraManager(ours).set([LoraSpec(nickname="a", path=str(file))], mode)
    assert all(torch.equal(tensor, before[name]) for name, tensor in ours.state_dict().items())


# ---- PEFT's variants: DoRA, lora_B bias, Embedding (files written by diffusers' own save_lora_adapter) ----

EMBEDDING = "visual_token_type_embeddings"


def _peft_file(checkpoint: Path, folder: Path, targets, *, seed: int = 0, **config) -> Path:
    """The adapter file diffusers' `save_lora_adapter` writes for a PEFT `LoraConfig(**config)` on `targets`
    (rank 4, alpha 8): keys without `transformer.`, the config in the header. Every adapter tensor is random
    (N(0, 0.1^2)); DoRA's magnitudes start as PEFT sets them, the row norms of W + B A, and are then scaled by
    U(0.5, 1.5) per row, as training would move them (at their start values DoRA at strength 1 equals LoRA)."""
    from peft import LoraConfig

    model = _reference(checkpoint)
    model.add_adapter(LoraConfig(r=RANK, lora_alpha=8, target_modules=sorted(targets), init_lora_weights=False,
                                 **config), adapter_name="a")
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_magnitude_vector" in name:
                parameter.mul_(0.5 + torch.rand(parameter.shape, generator=generator))
            elif ".lora_" in name:
                parameter.copy_(0.1 * torch.randn(parameter.shape, generator=generator))
    model.save_lora_adapter(str(folder), adapter_name="a")
    return folder / "pytorch_lora_weights.safetensors"


def _peft_outputs(checkpoint: Path, adapters: list[tuple[Path, float]], mode: str, *, fused: bool = False,
                  token_types: bool = False):
    """(ours, diffusers, whether unmerging gave the base weights back bit for bit) for `adapters` ((file,
    strength), applied in order: diffusers' `set_adapters` order) as `mode`: merge vs `fuse_lora`, dynamic vs
    PEFT's unfused forward."""
    reference = _reference(checkpoint)
    names = [f"a{index}" for index in range(len(adapters))]
    for name, (file, _) in zip(names, adapters):
        reference.load_lora_adapter(str(file.parent), weight_name=file.name, adapter_name=name, prefix=None)
    reference.set_adapters(names, [strength for _, strength in adapters])
    if mode == "merge":
        reference.fuse_lora()
    ours = _ours(checkpoint, fused=fused)
    base = {name: tensor.clone() for name, tensor in ours.state_dict().items()}
    manager = LoraManager(ours)
    manager.set([LoraSpec(nickname=name, path=str(file), strength=strength)
                 for name, (file, strength) in zip(names, adapters)], mode)
    outputs = _run_ours(ours, token_types=token_types)
    manager.unmerge()
    restored = all(torch.equal(tensor, base[name]) for name, tensor in ours.state_dict().items())
    return outputs, _run_reference(reference, token_types=token_types), restored


def _check_variant(label: str, tiny_pro_dir, file, base_outputs, mode: str, fused: bool) -> None:
    """A PEFT variant's file at STRENGTH against diffusers: it changes the output, unmerge restores the weights, the
    unfused merge is PEFT's op for op (bitwise), and every mode is within 1e-5."""
    ours, reference, restored = _peft_outputs(tiny_pro_dir, [(file, STRENGTH)], mode, fused=fused)
    errors = _report(f"fp32 {label} {mode}{', fused Q/K/V' if fused else ''}", ours, reference)
    assert max(_relative(reference, base_outputs)) > 0.05 and restored
    if mode == "merge" and not fused:
        assert all(torch.equal(got, want) for got, want in zip(ours, reference))
    assert max(errors) <= 1e-5


@pytest.mark.parametrize("fused", [False, True], ids=["unfused", "fused_qkv"])
@pytest.mark.parametrize("mode", ["merge", "dynamic"])
def test_dora_matches_diffusers(tiny_pro_dir, tmp_path, shapes, base_outputs, mode, fused):
    """DoRA (`use_dora`, `lora_magnitude_vector` keys) on every Linear at strength 0.7: W' = m / ||W + s B A|| *
    (W + s B A), the norm per output row, s = strength * alpha / rank in both places. Merged it is PEFT's merge
    op for op (bitwise); dynamic scales the output rows (within 1e-5 of PEFT's forward); with speed mode's fused
    Q/K/V ours applies it to the fused projection's rows (within 1e-5). Refused before: not LoRA keys."""
    file = _peft_file(tiny_pro_dir, tmp_path, shapes, use_dora=True)
    _check_variant("DoRA", tiny_pro_dir, file, base_outputs, mode, fused)


@pytest.mark.parametrize("mode", ["merge", "dynamic"])
def test_dora_at_strength_zero_still_applies_its_magnitudes(tiny_pro_dir, tmp_path, shapes, base_outputs, mode):
    """PEFT scales DoRA's norm with the strength too: at 0 the weight is m / ||W|| * W, not W. Ours does the same."""
    paths = [f"{SELF}.to_key", FFN, f"{TEXT}.out_layer", f"{CROSS}.to_query"]
    file = _peft_file(tiny_pro_dir, tmp_path, paths, use_dora=True)
    ours, reference, restored = _peft_outputs(tiny_pro_dir, [(file, 0.0)], mode)
    assert max(_report(f"fp32 DoRA {mode}, strength 0", ours, reference)) <= 1e-5 and restored
    assert max(_relative(reference, base_outputs)) > 1e-3


@pytest.mark.parametrize("fused", [False, True], ids=["unfused", "fused_qkv"])
@pytest.mark.parametrize("mode", ["merge", "dynamic"])
def test_lora_bias_matches_diffusers(tiny_pro_dir, tmp_path, shapes, base_outputs, mode, fused):
    """A lora_B bias (`lora_bias`): the update is s * (B A x + b). Merged into the layer's bias (so only on layers
    with one: every Linear with a bias here) it is PEFT's merge op for op; dynamic adds it to the output, on every
    Linear (the FFNs have no bias), within 1e-5; also on the fused Q/K/V's rows. Refused before: not LoRA keys."""
    model = _reference(tiny_pro_dir)
    targets = [path for path in shapes if mode == "dynamic" or model.get_submodule(path).bias is not None]
    assert FFN in targets if mode == "dynamic" else FFN not in targets
    file = _peft_file(tiny_pro_dir, tmp_path, targets, lora_bias=True)
    _check_variant("lora_bias", tiny_pro_dir, file, base_outputs, mode, fused)


def test_lora_bias_on_a_layer_without_bias_is_not_merged_as_in_diffusers(tiny_pro_dir, tmp_path):
    """PEFT cannot merge a lora_B bias into a Linear without a bias (diffusers' `fuse_lora` raises); ours refuses
    the merge before changing anything, saying to use dynamic mode."""
    file = _peft_file(tiny_pro_dir, tmp_path, [FFN, f"{SELF}.to_key"], lora_bias=True)
    reference = _reference(tiny_pro_dir)
    reference.load_lora_adapter(str(tmp_path), weight_name=file.name, adapter_name="a", prefix=None)
    with pytest.raises(RuntimeError, match="Impossible to merge LoRA with `lora_bias=True`"):
        reference.fuse_lora()
    ours = _ours(tiny_pro_dir)
    before = {name: tensor.clone() for name, tensor in ours.state_dict().items()}
    manager = LoraManager(ours)
    with pytest.raises(ValueError, match=rf"1 module\(s\) have a lora_B\.bias .*no bias to merge it into, e\.g\. "
                                         rf"\['{FFN}'\].*use merge_mode 'dynamic'"):
        manager.set([LoraSpec(nickname="a", path=str(file))], "merge")
    assert all(torch.equal(tensor, before[name]) for name, tensor in ours.state_dict().items())
    assert manager.state() == []


@pytest.mark.parametrize("dora", [False, True], ids=["lora", "dora"])
@pytest.mark.parametrize("mode", ["merge", "dynamic"])
def test_embedding_lora_matches_diffusers(tiny_pro_dir, tmp_path, mode, dora):
    """diffusers' `load_lora_adapter` applies PEFT's LoRA to the DiT's nn.Embedding (visual_token_type_embeddings,
    read for TI2AV; `lora_embedding_A` (r, num_embeddings) / `lora_embedding_B` (dim, r)): E' = E + s (B A)^T, and
    with DoRA m / ||.|| per embedding feature. Ours, merged and dynamic, with the TI2AV token type ids. Refused
    before: not LoRA keys."""
    file = _peft_file(tiny_pro_dir, tmp_path, [EMBEDDING, FFN], use_dora=dora)
    assert any("lora_embedding_A" in key for key in load_file(str(file)))
    reference = _load_into_diffusers(_reference(tiny_pro_dir), file, prefix=None)
    assert isinstance(reference.get_submodule(EMBEDDING), BaseTunerLayer)  # diffusers adapts the embedding
    base = _run_reference(_reference(tiny_pro_dir), token_types=True)
    ours, reference, restored = _peft_outputs(tiny_pro_dir, [(file, STRENGTH)], mode, token_types=True)
    errors = _report(f"fp32 embedding {'DoRA' if dora else 'LoRA'} {mode}", ours, reference)
    assert max(_relative(reference, base)) > 0.05 and restored
    if mode == "merge":
        assert all(torch.equal(got, want) for got, want in zip(ours, reference))
    assert max(errors) <= 1e-5


@pytest.mark.parametrize("dora_first", [False, True], ids=["lora_then_dora", "dora_then_lora"])
@pytest.mark.parametrize("mode", ["merge", "dynamic"])
def test_dora_stacked_with_lora_matches_diffusers(tiny_pro_dir, tmp_path, mode, dora_first):
    """Two adapters on the same layers, one DoRA: PEFT applies them in `set_adapters` order, and a DoRA adapter
    scales the rows of the weight (merged) or output (unfused) so far, the earlier adapter's update included; its
    norm is over the base weight alone. Ours in the same order, merged and dynamic, within 1e-5."""
    paths = [f"{SELF}.to_key", FFN, f"{TEXT}.out_layer", f"{CROSS}.to_value"]
    (tmp_path / "lora").mkdir()
    (tmp_path / "dora").mkdir()
    lora = _peft_file(tiny_pro_dir, tmp_path / "lora", paths, seed=1)
    dora = _peft_file(tiny_pro_dir, tmp_path / "dora", paths, seed=2, use_dora=True)
    adapters = [(dora, 1.3), (lora, STRENGTH)] if dora_first else [(lora, STRENGTH), (dora, 1.3)]
    ours, reference, restored = _peft_outputs(tiny_pro_dir, adapters, mode)
    assert max(_report(f"fp32 {mode}, {'DoRA then LoRA' if dora_first else 'LoRA then DoRA'}", ours,
                       reference)) <= 1e-5
    assert restored


# ---- speed mode: to_query / to_key / to_value on the fused projections ----


@pytest.mark.parametrize("mode", ["merge", "dynamic"])
def test_fused_qkv_matches_diffusers_unfused(tiny_pro_dir, tmp_path, shapes, mode):
    """Q, K and V of a self-attention (fused [q; k; v]), K and V of a cross-attention (fused [k; v]; its Q stays
    a Linear) and of a text block, with different alphas: ours with --performance-mode speed's fused projections
    against diffusers' separate Linears."""
    paths = [f"{attention}.{projection}" for attention in (SELF, CROSS, TEXT)
             for projection in ("to_query", "to_key", "to_value")] + [FFN]
    alphas = {path: (1.0, 2.0, 4.0, 8.0)[index % 4] for index, path in enumerate(paths)}  # every module has one
    file = _save(tmp_path / "a.safetensors",
                 _diffusers_keys(_factors({path: shapes[path] for path in paths}, amplitude=0.3), alphas=alphas))
    ours, reference = _pair(tiny_pro_dir, file, mode, fused=True)
    fused = _ours(tiny_pro_dir, fused=True)
    assert hasattr(fused.get_submodule(SELF), "to_query_key_value") and hasattr(fused.get_submodule(CROSS),
                                                                               "to_key_value")
    assert max(_report(f"fp32 {mode}, fused Q/K/V (speed) vs diffusers unfused", ours, reference)) <= 1e-5


# ---- bf16 ----


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _merged_weights(model, paths) -> dict[str, torch.Tensor]:
    weights = {}
    for path in paths:
        module = model.get_submodule(path)
        weights[path] = (module.base_layer if isinstance(module, BaseTunerLayer) else module).weight.detach().clone()
    return weights


@pytest.mark.parametrize("file_dtype", [torch.float32, torch.bfloat16])
def test_bf16_merge_rounds_once_and_is_closer_than_peft_fuse(tiny_pro_dir, tmp_path, shapes, file_dtype):
    """bf16 DiT (the keep-fp32 modulations in fp32), an fp32 or bf16 adapter file, rank 4, alpha 8, strength 0.7,
    every Linear. Our merge computes W + s * alpha / r * B A in fp32 from the file's factors and rounds once; PEFT
    keeps A and B in the layer's dtype (rounded to bf16 at load, for an fp32 file), rounds the delta to bf16 and adds
    in bf16. Against the correctly rounded weight (computed in fp64 from the bf16 W and the file's factors) ours is
    exact but for fp32 rounding; the outputs differ by bf16 rounding only."""
    factors = {path: (down.to(file_dtype), up.to(file_dtype)) for path, (down, up) in _factors(shapes).items()}
    file = _save(tmp_path / "a.safetensors", _diffusers_keys(factors, alphas=dict.fromkeys(shapes, 8.0)))
    scale = STRENGTH * 8.0 / RANK
    base = _merged_weights(_reference(tiny_pro_dir, torch.bfloat16), shapes)
    results, weights = {}, {}
    for mode in ("merge", "dynamic"):
        reference = _load_into_diffusers(_reference(tiny_pro_dir, torch.bfloat16), file)
        if mode == "merge":
            reference.fuse_lora()
            weights["diffusers"] = _merged_weights(reference, shapes)
        ours = _ours(tiny_pro_dir, torch.bfloat16)
        LoraManager(ours).set([LoraSpec(nickname="a", path=str(file), strength=STRENGTH)], mode)
        if mode == "merge":
            weights["ours"] = _merged_weights(ours, shapes)
        results[mode] = (_run_ours(ours, torch.bfloat16), _run_reference(reference, torch.bfloat16))
    # The bf16 model and adapter computed in fp32: the bf16 parameters (as loaded), the exact update, fp32
    # activations.
    exact = _reference(tiny_pro_dir)
    exact.load_state_dict({name: tensor.float() for name, tensor in
                           _reference(tiny_pro_dir, torch.bfloat16).state_dict().items()})
    ideal = {}
    with torch.no_grad():
        for path, (down, up) in factors.items():
            ideal[path] = base[path].double() + scale * (up.double() @ down.double())
            exact.get_submodule(path).weight.copy_(ideal[path])
    inputs = {key: value.float() if value.is_floating_point() else value
              for key, value in _inputs(torch.bfloat16).items()}
    with torch.no_grad():
        fp32 = tuple(exact(**inputs, return_dict=False))
    for mode, (ours, reference) in results.items():
        peft_name = "PEFT fuse" if mode == "merge" else "PEFT unfused"
        ours_error, reference_error = _relative(ours, fp32), _relative(reference, fp32)
        between = _report(f"bf16 {mode}: ours vs {peft_name}", ours, reference)
        print(f"bf16 {mode} ({_name(file_dtype)} file) vs fp32 reference: ours video {ours_error[0]:.3g} audio "
              f"{ours_error[1]:.3g}; {peft_name} video {reference_error[0]:.3g} audio {reference_error[1]:.3g}")
        assert max(between) <= 0.05 and max(ours_error) <= 0.05 and max(reference_error) <= 0.05
    for dtype in (torch.bfloat16, torch.float32):  # the keep-fp32 modulations are merged in fp32 on both sides
        paths = [path for path in shapes if base[path].dtype == dtype]
        total = sum(base[path].numel() for path in paths)
        counts, errors = {}, {}
        for name, merged in weights.items():
            counts[name] = sum(int((merged[path] != ideal[path].to(dtype)).sum()) for path in paths)
            errors[name] = sum(float((merged[path].double() - ideal[path]).pow(2).sum()) for path in paths) ** 0.5
            print(f"{_name(file_dtype)} file, {_name(dtype)} merged weights ({len(paths)} Linears), {name}: "
                  f"{counts[name]} of {total} elements ({100 * counts[name] / total:.3g}%) differ from the "
                  f"correctly rounded W + s alpha / r B A; L2 error {errors[name]:.4g}")
        if dtype == torch.bfloat16:
            # Ours is the correctly rounded weight but where the fp32 update lands within its own rounding of a
            # bf16 tie; PEFT's roundings (A and B at load for an fp32 file, the delta, the sum) miss on 29-45% of
            # the elements.
            assert counts["ours"] <= 1e-3 * total
            assert counts["ours"] < counts["diffusers"] and errors["ours"] < errors["diffusers"]
        else:
            assert counts["ours"] == counts["diffusers"] and errors["ours"] == errors["diffusers"]  # the same fp32 ops


@pytest.mark.parametrize("config", [
    {"r": 4, "lora_alpha": 16},
    {"r": 4, "lora_alpha": 16, "use_rslora": True},
    {"r": 4, "lora_alpha": 16, "alpha_pattern": {"net.2": 2, r"visual_transformer_blocks\.1\..*to_key": 32},
     "rank_pattern": {"to_key": 2}},
    {"r": 4, "lora_alpha": 8, "use_dora": True},
], ids=["plain", "rslora", "patterns", "dora"])
def test_a_peft_save_pretrained_folder_merges_as_peft_merges_it(tmp_path, config):
    """A PEFT folder's scale is only in its adapter_config.json: read without it, LoraConfig(r=4, lora_alpha=16)
    merged at a quarter. Against PEFT's own save_pretrained and merge_and_unload on the tiny DiT (k6serve's model;
    PEFT wraps any nn.Module), bit for bit but for DoRA's norm (within 1e-6)."""
    import copy

    from peft import LoraConfig, get_peft_model

    from k6serve.bench.tiny import TINY_TRANSFORMER_CONFIG
    from k6serve.models.kandinsky6.checkpoint import build_dummy_transformer

    base = build_dummy_transformer(TINY_TRANSFORMER_CONFIG, device=torch.device("cpu"), dtype=torch.float32, seed=3)
    targets = ["video_dec_block.self_attention.to_key", "video_dec_block.feed_forward.net.0.proj",
               "audio_dec_block.feed_forward.net.2"]
    torch.manual_seed(0)
    peft_model = get_peft_model(copy.deepcopy(base), LoraConfig(target_modules=targets, init_lora_weights=False,
                                                                **config))
    if config.get("use_dora"):  # magnitudes away from ||W||, so that DoRA changes something
        for name, parameter in peft_model.named_parameters():
            if "lora_magnitude_vector" in name:
                parameter.data.mul_(1.3)
    peft_model.save_pretrained(tmp_path / "adapter")
    assert (tmp_path / "adapter" / "adapter_config.json").is_file()
    reference = peft_model.merge_and_unload().state_dict()
    ours = copy.deepcopy(base)
    LoraManager(ours).set([LoraSpec(nickname="a", path=str(tmp_path / "adapter"))], "merge")
    changed = [name for name in reference if not torch.equal(reference[name], base.state_dict()[name])]
    assert len(changed) >= 3 * 2  # every targeted layer of both blocks
    tolerance = 1e-6 if config.get("use_dora") else 0.0
    for name in changed:
        assert (ours.state_dict()[name] - reference[name]).abs().max() <= tolerance, name
