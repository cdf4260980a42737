"""Tiny K6 generation checkpoints: Diffusers layout, tokenizers, reload bit-identity, the demo."""

import json
from pathlib import Path

import pytest
import torch
from diffusers.pipelines.kandinsky6 import pipeline_kandinsky6_ti2va as reference_pipeline_module
from transformers import AutoTokenizer, CLIPTokenizer, Qwen2Tokenizer

from k6serve.pipelines.encode_text import PROMPT_TEMPLATE, QWEN_CROP_START
from k6serve.testing import tiny_checkpoints
from k6serve.testing.tiny_checkpoints import (
    DEMO_MARKER_NAME,
    build_generation_checkpoint,
    build_generation_pipeline,
    ensure_demo_checkpoint,
    load_reference_pipeline,
)
from k6serve.testing.tokenizers import (
    QWEN_SPECIAL_TOKENS,
    train_clip_tokenizer,
    train_qwen_tokenizer,
)

# k6-generation.md §1.1
EXPECTED_COMPONENTS = {
    "transformer": ["diffusers", "Kandinsky6Transformer3DModel"],
    "vae": ["diffusers", "AutoencoderKLHunyuanVideo"],
    "text_encoder": ["transformers", "Qwen2_5_VLForConditionalGeneration"],
    "tokenizer": ["transformers", "Qwen2_5_VLProcessor"],
    "text_encoder_2": ["transformers", "CLIPTextModel"],
    "tokenizer_2": ["transformers", "CLIPTokenizer"],
    "audio_vae": ["diffusers", "MMAudioVAE"],
    "vocoder": ["diffusers", "MMAudioVocoder"],
}
WEIGHT_FILES = {
    "transformer": "diffusion_pytorch_model.safetensors",
    "vae": "diffusion_pytorch_model.safetensors",
    "audio_vae": "diffusion_pytorch_model.safetensors",
    "vocoder": "diffusion_pytorch_model.safetensors",
    "text_encoder": "model.safetensors",
    "text_encoder_2": "model.safetensors",
}


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _model_index(ckpt_dir: Path) -> dict:
    return json.loads((ckpt_dir / "model_index.json").read_text())


def _t2av(pipeline, guidance_scale: float):
    pipeline.set_progress_bar_config(disable=True)
    return pipeline(
        prompt="A red fox runs through the snow",
        height=64,
        width=96,
        num_frames=9,
        num_inference_steps=2,
        guidance_scale=guidance_scale,
        max_sequence_length=32,
        generator=torch.Generator().manual_seed(0),
        output_type="pt",
    )


@pytest.mark.parametrize(
    ("fixture_name", "scheduler_class"),
    [("tiny_pro_dir", "FlowMatchEulerDiscreteScheduler"), ("tiny_distill_dir", "PiflowScheduler")],
)
def test_layout_matches_the_released_diffusers_checkpoints(request, fixture_name, scheduler_class):
    ckpt_dir = request.getfixturevalue(fixture_name)
    index = _model_index(ckpt_dir)
    assert index.pop("_class_name") == "Kandinsky6TI2VAPipeline"
    assert index.pop("_diffusers_version") == "0.42.1"
    assert index == {**EXPECTED_COMPONENTS, "scheduler": ["diffusers", scheduler_class]}
    for component, weight_file in WEIGHT_FILES.items():
        assert (ckpt_dir / component / "config.json").is_file()
        assert (ckpt_dir / component / weight_file).is_file()
    assert not list(ckpt_dir.rglob("*.bin"))
    assert (ckpt_dir / "scheduler" / "scheduler_config.json").is_file()
    # The Qwen folder holds processor files next to the tokenizer, as in the real repo.
    for name in (
        "tokenizer.json",
        "tokenizer_config.json",
        "processor_config.json",
        "chat_template.jinja",
    ):
        assert (ckpt_dir / "tokenizer" / name).is_file()
    assert (ckpt_dir / "tokenizer_2" / "tokenizer.json").is_file()


def test_transformer_config_has_the_tiny_sizes_and_released_flags(tiny_pro_dir, tiny_distill_dir):
    pro = json.loads((tiny_pro_dir / "transformer" / "config.json").read_text())
    distill = json.loads((tiny_distill_dir / "transformer" / "config.json").read_text())
    expected = {
        "model_dim": 64, "model_dim_a": 32, "time_dim": 32, "time_dim_a": 32,
        "ff_dim": 128, "ff_dim_a": 64, "num_text_blocks": 2, "num_visual_blocks": 2,
        "axes_dims": [4, 6, 6], "axes_dims_a": [4, 6, 6],
        "in_text_dim": 32, "in_text_dim2": 32, "in_visual_dim": 16, "in_audio_dim": 8,
        "ca_rope": True, "cross_gates": True, "fix_modulation": True, "text_token_padding": True,
        "visual_cond": True, "visual_token_type_num_embeddings": 2, "audio_freqs_scaling": 0.144,
        "scale_factor": [1.0, 2.0, 2.0],
    }  # fmt: skip
    assert {key: pro[key] for key in expected} == expected
    assert {key: distill[key] for key in expected} == expected
    assert (pro["out_visual_dim"], pro["out_audio_dim"]) == (16, 8)
    assert (distill["out_visual_dim"], distill["out_audio_dim"]) == (160, 80)

    piflow = json.loads((tiny_distill_dir / "scheduler" / "scheduler_config.json").read_text())
    assert {key: piflow[key] for key in ("shift", "n_grid", "eps", "final_step_size_scale")} == {
        "shift": 5.0, "n_grid": 10, "eps": 1e-6, "final_step_size_scale": 0.5
    }  # fmt: skip
    assert piflow["num_policy_substeps"] == 128
    flow_match = json.loads((tiny_pro_dir / "scheduler" / "scheduler_config.json").read_text())
    assert flow_match["shift"] == 5.0

    audio_vae = json.loads((tiny_pro_dir / "audio_vae" / "config.json").read_text())
    assert (audio_vae["sample_rate"], audio_vae["n_fft"], audio_vae["hop_length"]) == (
        44100,
        2048,
        512,
    )
    assert (audio_vae["mel_bins"], audio_vae["latent_channels"]) == (16, 8)
    vocoder = json.loads((tiny_pro_dir / "vocoder" / "config.json").read_text())
    assert vocoder["upsample_rates"] == [8, 4, 2, 2, 2, 2]
    clip = json.loads((tiny_pro_dir / "text_encoder_2" / "config.json").read_text())
    assert clip["eos_token_id"] == 2


def test_without_audio_leaves_the_optional_components_empty(tmp_path):
    ckpt_dir = build_generation_checkpoint(tmp_path / "ckpt", "lite", seed=1, with_audio=False)
    index = _model_index(ckpt_dir)
    assert index["audio_vae"] == [None, None] and index["vocoder"] == [None, None]
    assert not (ckpt_dir / "audio_vae").exists()
    assert index["scheduler"] == ["diffusers", "FlowMatchEulerDiscreteScheduler"]


def test_unknown_variant_is_refused(tmp_path):
    with pytest.raises(ValueError, match="pro, distill, lite"):
        build_generation_checkpoint(tmp_path, "ultra")


def test_template_is_the_diffusers_one():
    assert PROMPT_TEMPLATE == reference_pipeline_module._PROMPT_TEMPLATE
    assert QWEN_CROP_START == reference_pipeline_module._QWEN_CROP_START


def test_saved_qwen_tokenizer_loads_with_autotokenizer_and_crops_at_129(tiny_pro_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_pro_dir / "tokenizer")
    assert isinstance(tokenizer, Qwen2Tokenizer)
    assert tokenizer.padding_side == "right" and tokenizer.pad_token == "<|endoftext|>"
    for special in QWEN_SPECIAL_TOKENS:
        assert len(tokenizer(special)["input_ids"]) == 1

    prefix_ids = tokenizer(PROMPT_TEMPLATE.split("{}")[0])["input_ids"]
    prompt_ids = tokenizer("Foxes run")["input_ids"]
    full_ids = tokenizer(PROMPT_TEMPLATE.format("Foxes run"))["input_ids"]
    assert len(prefix_ids) == QWEN_CROP_START
    assert full_ids[:QWEN_CROP_START] == prefix_ids
    assert full_ids[QWEN_CROP_START:] == prompt_ids + [
        tokenizer.convert_tokens_to_ids("<|im_end|>")
    ]

    padded = tokenizer(PROMPT_TEMPLATE.format("Foxes run"), max_length=160, padding="max_length")
    assert padded["input_ids"][len(full_ids) :] == [tokenizer.pad_token_id] * (160 - len(full_ids))


def test_pipeline_prompt_mask_starts_at_the_first_prompt_token(tiny_pro_dir):
    pipeline = load_reference_pipeline(tiny_pro_dir)
    prompt_ids = pipeline.tokenizer.tokenizer("Foxes run")["input_ids"]
    _, _, mask, *_ = pipeline.encode_prompt(
        "Foxes run",
        do_classifier_free_guidance=False,
        max_sequence_length=16,
        device=torch.device("cpu"),
    )
    # The prompt tokens and the closing <|im_end|> survive the crop; the rest is padding.
    assert mask[0].tolist() == [True] * (len(prompt_ids) + 1) + [False] * (15 - len(prompt_ids))


def test_clip_tokenizer_has_special_tokens_as_the_two_highest_ids(tiny_pro_dir):
    tokenizer = CLIPTokenizer.from_pretrained(tiny_pro_dir / "tokenizer_2")
    assert isinstance(AutoTokenizer.from_pretrained(tiny_pro_dir / "tokenizer_2"), CLIPTokenizer)
    vocab_size = len(tokenizer)
    assert tokenizer.convert_tokens_to_ids("<|startoftext|>") == vocab_size - 2
    assert tokenizer.convert_tokens_to_ids("<|endoftext|>") == vocab_size - 1
    ids = tokenizer("A Red FOX!", padding="max_length", max_length=77)["input_ids"]
    assert ids[0] == vocab_size - 2 and len(ids) == 77
    # The pooled-token rule argmax(input_ids) must pick the first <|endoftext|>, after the text.
    assert ids.index(vocab_size - 1) == int(torch.tensor(ids).argmax())


def test_tokenizer_training_is_deterministic():
    assert (
        train_qwen_tokenizer().backend_tokenizer.to_str()
        == train_qwen_tokenizer().backend_tokenizer.to_str()
    )
    assert (
        train_clip_tokenizer().backend_tokenizer.to_str()
        == train_clip_tokenizer().backend_tokenizer.to_str()
    )


def test_weights_are_deterministic_in_the_seed_and_nonzero():
    first, again, other = (build_generation_pipeline("pro", seed) for seed in (3, 3, 4))
    for name in ("transformer", "vae", "text_encoder", "text_encoder_2", "audio_vae", "vocoder"):
        for (key, value), same, different in zip(
            getattr(first, name).named_parameters(),
            getattr(again, name).parameters(),
            getattr(other, name).parameters(),
            strict=True,
        ):
            assert torch.equal(value, same), f"{name}.{key} differs between builds with one seed"
            assert not torch.equal(value, different), f"{name}.{key} ignores the seed"
            assert value.abs().max() > 0, f"{name}.{key} is all zero"


@pytest.mark.parametrize(("variant", "guidance_scale"), [("pro", 5.0), ("distill", 1.0)])
def test_reloaded_pipeline_is_bit_identical_to_the_saved_one(tmp_path, variant, guidance_scale):
    in_memory = build_generation_pipeline(variant, seed=0)
    in_memory.save_pretrained(tmp_path / "ckpt")
    reloaded = load_reference_pipeline(tmp_path / "ckpt")
    expected = _t2av(in_memory, guidance_scale)
    actual = _t2av(reloaded, guidance_scale)
    assert expected.frames.shape == (1, 9, 3, 64, 96)
    assert expected.audio.shape == (1, 17 * 1024)
    assert expected.frames.std() > 0.01 and expected.audio.std() > 0.01
    assert torch.equal(actual.frames, expected.frames)
    assert torch.equal(actual.audio, expected.audio)


def test_demo_fixture_points_at_a_marked_distill_checkpoint(demo_dir, _demo_cache_dir):
    assert demo_dir.parent.parent == _demo_cache_dir
    assert demo_dir.name.startswith("kandinsky6-demo-distill-")
    assert json.loads((demo_dir / DEMO_MARKER_NAME).read_text()) == {
        "demo": True,
        "variant": "distill",
        "defaults": {"height": 64, "width": 96, "num_frames": 17, "fps": 24},
    }
    assert _model_index(demo_dir)["scheduler"] == ["diffusers", "PiflowScheduler"]


def test_demo_builder_is_idempotent(tmp_path, monkeypatch):
    monkeypatch.setenv("K6SERVE_CACHE", str(tmp_path))
    first = ensure_demo_checkpoint()
    weights = first / "transformer" / "diffusion_pytorch_model.safetensors"
    built_at = weights.stat().st_mtime_ns

    def must_not_rebuild(*args, **kwargs):
        raise AssertionError("the cached demo checkpoint was rebuilt")

    monkeypatch.setattr(tiny_checkpoints, "build_generation_checkpoint", must_not_rebuild)
    assert ensure_demo_checkpoint() == first
    assert weights.stat().st_mtime_ns == built_at
    assert sorted(path.name for path in (tmp_path / "demo").iterdir()) == [first.name]


def test_a_build_abandoned_long_ago_is_removed_and_a_recent_one_kept(tmp_path, monkeypatch):
    """A build killed outright (SIGKILL skips its cleanup) left a hidden folder that no later run removed."""
    import os
    import time

    monkeypatch.setenv("K6SERVE_CACHE", str(tmp_path))
    final = tiny_checkpoints.demo_checkpoint_dir()
    final.parent.mkdir(parents=True)
    abandoned, running = final.parent / f".{final.name}.abc123", final.parent / f".{final.name}.def456"
    for folder in (abandoned, running):
        (folder / "transformer").mkdir(parents=True)
    old = time.time() - tiny_checkpoints.ABANDONED_BUILD_AGE_S - 60
    os.utime(abandoned, (old, old))
    ensure_demo_checkpoint()
    assert not abandoned.exists() and running.is_dir()  # another process's build in progress: left alone


def test_demo_builder_survives_losing_the_race(tmp_path, monkeypatch):
    monkeypatch.setenv("K6SERVE_CACHE", str(tmp_path))
    real_build = tiny_checkpoints.build_generation_checkpoint

    def build_after_another_process_finished(*args, **kwargs):
        monkeypatch.setattr(tiny_checkpoints, "build_generation_checkpoint", real_build)
        winner = ensure_demo_checkpoint()
        (winner / "winner").touch()
        return real_build(*args, **kwargs)

    monkeypatch.setattr(
        tiny_checkpoints, "build_generation_checkpoint", build_after_another_process_finished
    )
    demo = ensure_demo_checkpoint()
    assert (demo / "winner").is_file()
    # The loser's temporary build folder is gone; only the finished demo remains.
    assert sorted(path.name for path in (tmp_path / "demo").iterdir()) == [demo.name]


def test_unknown_demo_kind_is_refused():
    with pytest.raises(ValueError, match="t2av"):
        ensure_demo_checkpoint("v2v")


def test_qwen_processor_builds_with_either_video_processor_base(monkeypatch):
    """transformers 5.17 (the floor in pyproject, and the GPU image's) checks a Qwen processor's video processor
    against `BaseVideoProcessor`, shown as a torchvision placeholder without torchvision; newer releases against
    `VideoProcessorMixin`. The demo builder read only the newer name, so `--model-path demo` failed on 5.17. Here
    the current release is made to ask for the older name, placeholder included."""
    from transformers import processing_utils, video_processing_utils

    from k6serve.testing.tokenizers import build_qwen_processor, train_qwen_tokenizer

    for name in ("VideoProcessorMixin", "BaseVideoProcessor"):
        if not hasattr(video_processing_utils, name):
            continue
        monkeypatch.setitem(processing_utils.MODALITY_TO_BASE_CLASS_MAPPING, "video_processor", name)
        placeholder = type(name, (), {})  # what transformers shows where torchvision is missing
        monkeypatch.setattr(processing_utils.transformers_module, name, placeholder, raising=False)
        processor = build_qwen_processor(train_qwen_tokenizer())
        assert isinstance(processor.video_processor, getattr(video_processing_utils, name))
        monkeypatch.undo()


def test_an_unusable_k6serve_cache_is_named(tmp_path, monkeypatch):
    (tmp_path / "afile").write_text("not a folder")
    monkeypatch.setenv("K6SERVE_CACHE", str(tmp_path / "afile"))
    with pytest.raises(ValueError, match=r"under \$K6SERVE_CACHE .*set K6SERVE_CACHE to a writable folder"):
        tiny_checkpoints.ensure_demo_checkpoint()
