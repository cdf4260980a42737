"""`--load-format dummy`: every generation variant builds at its released size (checked on the meta device)."""

import pytest
import torch

from k6serve.models.kandinsky6.checkpoint import build_dummy_transformer, count_parameters, released_transformer_config
from k6serve.models.variants import GENERATION, RELEASED_NUM_PARAMETERS, VARIANTS

EXPECTED_BILLIONS = {"pro": 30.14, "lite": 3.18}


@pytest.mark.parametrize("name", [n for n, v in VARIANTS.items() if v.family == GENERATION])
def test_dummy_transformer_has_the_released_size_and_dtypes(name):
    variant = VARIANTS[name]
    model = build_dummy_transformer(released_transformer_config(variant), device=torch.device("meta"),
                                    dtype=torch.bfloat16)
    count = count_parameters(model)
    assert round(count / 1e9, 2) == EXPECTED_BILLIONS[variant.size]
    # The CPU refusal's size (runtime/device_fit.py) is this count, not a guess.
    assert abs(RELEASED_NUM_PARAMETERS[variant.size] - count) / count < 0.01
    fp32 = {n for n, p in model.named_parameters() if p.dtype == torch.float32}
    assert fp32 and all(n.startswith(("out_layer.modulation.", "audio_out_layer.modulation.")) for n in fp32)
    assert model.dtype == torch.bfloat16
    heads = model.config.out_visual_dim
    assert heads == (160 if variant.distilled else 16)


def test_dummy_rejects_non_generation_variants():
    with pytest.raises(ValueError, match="no built-in transformer config"):
        released_transformer_config(VARIANTS["vsr"])


def test_dummy_weights_drawn_elsewhere_equal_the_resident_build(tiny_sr_configs):
    """Offloading builds dummy weights in host memory but draws them on the GPU (one CPU generator takes minutes
    at the released sizes): drawn on another device and copied, the weights equal the in-place build's. On a
    CPU-only machine "cpu:0" stands in for that other device (another torch.device, the same generator)."""
    from k6serve.models.kandinsky6_sr.checkpoint import build_dummy_sr_models
    from k6serve.models.variants import VARIANTS as ALL
    from k6serve.testing.tiny_configs import tiny_transformer_config

    cpu, elsewhere = torch.device("cpu"), torch.device("cpu", 0)
    config = tiny_transformer_config(distilled=True)
    resident = build_dummy_transformer(config, device=cpu, dtype=torch.float32, seed=4)
    drawn = build_dummy_transformer(config, device=cpu, dtype=torch.float32, seed=4, random_device=elsewhere)
    for (name, a), (_, b) in zip(resident.named_parameters(), drawn.named_parameters(), strict=True):
        assert torch.equal(a, b), name

    from k6serve.models.kandinsky6_sr import checkpoint as sr_checkpoint

    draws = []
    original = sr_checkpoint.init_dummy_weights_

    def recording(module, seed, random_device=None):
        draws.append(random_device)
        return original(module, seed, random_device=elsewhere)

    vsr = ALL["vsr-distilled2steps"]
    expected = build_dummy_sr_models(tiny_sr_configs, vsr, device=cpu, dtype=torch.float32, seed=2)
    sr_checkpoint.init_dummy_weights_ = recording
    try:
        got = build_dummy_sr_models(tiny_sr_configs, vsr, device=cpu, dtype=torch.float32, seed=2)
    finally:
        sr_checkpoint.init_dummy_weights_ = original
    assert draws == [cpu, cpu, cpu]  # no GPU here: drawn where the weights live
    for a, b in ((expected.transformer, got.transformer), (expected.vae.model, got.vae.model)):
        for (name, x), (_, y) in zip(a.named_parameters(), b.named_parameters(), strict=True):
            assert torch.equal(x, y), name


def test_moving_a_gpu_built_component_to_the_host_keeps_values_ties_and_dtypes():
    """`_move_to_host` replaces `.to("cpu")` for the dummy build's GPU-built components (faulting the host pages in
    on torch's threads first): the same values, dtypes and buffers, fresh storage, tied weights still one tensor."""
    from k6serve.models.kandinsky6.checkpoint import _move_to_host

    torch.manual_seed(0)
    embedding = torch.nn.Embedding(10, 6)
    module = torch.nn.ModuleDict({"embed": embedding, "head": torch.nn.Linear(6, 10, bias=False),
                                  "norm": torch.nn.BatchNorm1d(6).to(torch.bfloat16)})
    module["head"].weight = embedding.weight  # tied, as a language model's head
    before = {name: tensor.clone() for name, tensor in module.state_dict().items()}
    # The old tensors stay referenced, so their memory cannot be handed to the copies. (On the GPU host the tied
    # weight, then copied twice, got its second copy in the original's freed block: "fresh storage" looked like
    # the same pointer. `_move_to_host` now copies a tied parameter once.)
    originals = module.state_dict()
    assert _move_to_host(module) is module
    after = module.state_dict()
    assert all(torch.equal(after[name], value) and after[name].dtype == value.dtype for name, value in before.items())
    assert all(after[name].data_ptr() != originals[name].data_ptr() for name in ("embed.weight", "norm.running_mean"))
    assert module["head"].weight is module["embed"].weight


def test_the_dummy_text_encoder_finds_the_trained_tokenizers_image_placeholders():
    """--load-format dummy pairs the released Qwen2.5-VL-7B config with the project's trained tokenizer: the config's
    vision token ids must be the tokenizer's, or the encoder counts no `<|image_pad|>` in a rewrite with an image (the
    compiled rewrite's warm-up stopped a dummy server's start on an H100: "tokens: 0, features: 486")."""
    import PIL.Image

    from k6serve.models.kandinsky6.checkpoint import dummy_qwen_config
    from k6serve.models.kandinsky6.encoder_configs import QWEN25_VL_7B
    from k6serve.pipelines.expand_prompt import expansion_inputs, load_image_processor
    from k6serve.testing.tokenizers import train_qwen_tokenizer

    tokenizer = train_qwen_tokenizer()
    config = dummy_qwen_config(tokenizer)
    image_processor = load_image_processor("dummy")
    inputs = expansion_inputs("a fox", tokenizer=tokenizer, image_processor=image_processor,
                              image=PIL.Image.new("RGB", (768, 512), (128, 128, 128)))
    features = int(inputs["image_grid_thw"][0].prod()) // image_processor.merge_size ** 2
    assert features == 486 and int((inputs["input_ids"] == config.image_token_id).sum()) == features
    assert int((inputs["input_ids"] == config.vision_start_token_id).sum()) == 1
    assert int((inputs["input_ids"] == QWEN25_VL_7B["image_token_id"]).sum()) == 0  # the released id: none
    # The rest of the released config stands.
    assert config.text_config.hidden_size == 3584 and config.vision_config.depth == 32


def test_every_dummy_build_has_the_same_weights_and_leaves_the_random_state_alone(monkeypatch, capfd):
    """The encoders' and VAEs' initialisers draw from torch's global generator: before they were seeded, a second
    build in one process (the full-size folder written from one build and compared with another, on an H200) had
    other weights, so its MP4 differed in every pixel. Small stand-ins for the released modules here."""
    import diffusers

    from k6serve.models.kandinsky6 import checkpoint
    from k6serve.testing import tiny_checkpoints as tiny

    monkeypatch.setattr(checkpoint, "build_dummy_transformer", lambda *args, **kwargs: None)  # its own generator
    tiny_qwen = tiny._build_qwen_text_encoder(tiny.train_qwen_tokenizer()).config
    monkeypatch.setattr(checkpoint, "dummy_qwen_config", lambda tokenizer: tiny_qwen)
    clip = tiny._build_clip_text_encoder(tiny.train_clip_tokenizer()).config.to_dict()
    monkeypatch.setattr(checkpoint.encoder_configs, "CLIP_VIT_L14_TEXT", clip)
    monkeypatch.setattr(diffusers, "AutoencoderKLHunyuanVideo", tiny._build_vae)
    monkeypatch.setattr(diffusers, "MMAudioVAE", lambda: tiny._build_audio_vae("distill"))
    monkeypatch.setattr(diffusers, "MMAudioVocoder", tiny._build_vocoder)
    cpu = torch.device("cpu")

    def build():
        return checkpoint._build_dummy(VARIANTS["lite-distill"], device=cpu, dtype=torch.bfloat16,
                                       where=lambda component: cpu)

    torch.manual_seed(123)
    first = build()
    after_first = torch.rand(3)  # the caller's generator goes on as if no build had drawn from it
    torch.manual_seed(123)
    assert torch.equal(torch.rand(3), after_first)
    torch.rand(1000)  # what the process drew in between
    second = build()
    for component in ("text_encoder", "text_encoder_2", "vae", "audio_vae", "vocoder"):
        a, b = getattr(first, component).state_dict(), getattr(second, component).state_dict()
        assert a.keys() == b.keys() and all(torch.equal(a[name], b[name]) for name in a), component
    # diffusers' `.to(dtype)` warned for every VAE and the vocoder ("should be kept in float32: []").
    assert "kept in float32" not in capfd.readouterr().err
    # The cast itself still happens (diffusers builds these modules in fp32).
    for component in ("vae", "audio_vae", "vocoder"):
        assert {p.dtype for p in getattr(first, component).parameters()} == {torch.bfloat16}, component
    # Different seeds for different components (two modules of one shape would otherwise start alike).
    assert len(set(checkpoint.DUMMY_COMPONENT_SEEDS.values())) == len(checkpoint.DUMMY_COMPONENT_SEEDS)


def _qwen_with_released_rotary_sizes():
    """A small Qwen2.5-VL whose rotary tables have the released sizes (text head_dim 128 split (16, 24, 24), vision
    head_dim 80), where the GPU's and the host's `pow` part ways."""
    from transformers import Qwen2_5_VLConfig

    from k6serve.testing import tiny_checkpoints as tiny

    config = tiny._build_qwen_text_encoder(tiny.train_qwen_tokenizer()).config.to_dict()
    config["text_config"].update(hidden_size=256, num_attention_heads=2, num_key_value_heads=1, intermediate_size=64)
    config["text_config"]["rope_parameters"]["mrope_section"] = [16, 24, 24]
    config["vision_config"].update(hidden_size=160, num_heads=2, out_hidden_size=256)
    return Qwen2_5_VLConfig(**config)


def test_the_dummy_text_encoders_rotary_tables_are_computed_as_a_load_computes_them():
    """transformers computes the non-persistent rotary frequencies on the host at a load; the dummy build made them
    on the GPU, 1 ulp apart, so a folder written from a dummy build gave another MP4 (H200). `_buffers_computed_on_host`
    puts the host's values back and touches nothing else (stored tensors, the caller's random state)."""
    import transformers

    from k6serve.models.kandinsky6.checkpoint import _buffers_computed_on_host

    config = _qwen_with_released_rotary_sizes()

    def make():
        return transformers.Qwen2_5_VLForConditionalGeneration._from_config(config, dtype=torch.bfloat16)

    module = make()
    expected = {name: tensor.clone() for name, tensor in module.named_buffers()}
    stored = {name: tensor.clone() for name, tensor in module.state_dict().items()}
    non_persistent = [name for name in expected if name not in stored]
    assert sorted(non_persistent) == ["model.language_model.rotary_emb.inv_freq",
                                      "model.language_model.rotary_emb.original_inv_freq",
                                      "model.visual.rotary_pos_emb.inv_freq",
                                      "model.visual.rotary_pos_emb.original_inv_freq"]
    for name in non_persistent:  # as the GPU computed them: a last-place difference
        module.get_buffer(name).mul_(1 + 2 ** -20)
    torch.manual_seed(5)
    _buffers_computed_on_host(module, make)
    after = torch.rand(2)
    torch.manual_seed(5)
    assert torch.equal(torch.rand(2), after)
    assert all(torch.equal(module.get_buffer(name), expected[name]) for name in non_persistent)
    assert all(torch.equal(tensor, stored[name]) for name, tensor in module.state_dict().items())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: the GPU's rotary frequencies are the point")
def test_a_folder_written_from_a_gpu_dummy_build_loads_back_every_tensor(monkeypatch, tmp_path):
    """The GPU dummy build's text encoder, saved and loaded as a released folder is: every tensor equal, buffers
    included (before, the rotary frequencies differed: the full-size folder's MP4 was not the dummy's)."""
    from k6serve.models.kandinsky6 import checkpoint

    config = _qwen_with_released_rotary_sizes()
    monkeypatch.setattr(checkpoint, "build_dummy_transformer", lambda *args, **kwargs: None)
    monkeypatch.setattr(checkpoint, "dummy_qwen_config", lambda tokenizer: config)
    cuda = torch.device("cuda")
    built = checkpoint._build_dummy(VARIANTS["lite-distill"], device=cuda, dtype=torch.bfloat16,
                                    where=lambda component: cuda).text_encoder
    built.save_pretrained(str(tmp_path / "text_encoder"), safe_serialization=True)
    loaded = checkpoint._load_transformers(tmp_path, "text_encoder", "Qwen2_5_VLForConditionalGeneration", cuda,
                                           torch.bfloat16)
    a, b = dict(built.named_buffers()), dict(loaded.named_buffers())
    assert a.keys() == b.keys() and all(torch.equal(a[name], b[name]) for name in a)
    a, b = built.state_dict(), loaded.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[name], b[name]) for name in a)
