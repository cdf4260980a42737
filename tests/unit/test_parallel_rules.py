"""Rules decided before any process starts: the --encoder-parallel rule, FSDP x TP, and plan glob matching."""

from __future__ import annotations

import pytest
from torch import nn

from k6serve.models.kandinsky6.checkpoint import released_transformer_config
from k6serve.models.kandinsky6.config import Kandinsky6TransformerConfig
from k6serve.models.kandinsky6.plan import kandinsky6_plan
from k6serve.models.variants import VARIANTS
from k6serve.parallel.encoder_folding import should_fold
from k6serve.parallel.mesh import ParallelLayout, validate_layout
from k6serve.parallel.module_paths import match_modules, parent_list


@pytest.fixture(scope="module")
def encoders():
    """The stock tiny Qwen (2 heads, 1 key/value head) and CLIP (2 heads) text encoders."""
    from k6serve.testing.tiny_checkpoints import _build_clip_text_encoder, _build_qwen_text_encoder
    from k6serve.testing.tokenizers import train_clip_tokenizer, train_qwen_tokenizer

    return [_build_qwen_text_encoder(train_qwen_tokenizer()), _build_clip_text_encoder(train_clip_tokenizer())]


class _Config:
    def __init__(self, **values):
        self.__dict__.update(values)


def test_auto_never_folds_the_released_encoders():
    """The seed: FSDP + Ulysses equals resident Ulysses in every frame and the waveform, and "keep auto for the
    baseline recipes"; folding changes the encoders' reductions. The released Qwen2.5-VL trunk (3,584 wide) and
    CLIP-L (768) are under the reference's 4,096 gate, so auto replicates them at any fold size that divides."""
    qwen = _Config(text_config=_Config(hidden_size=3584, num_attention_heads=28, num_key_value_heads=4,
                                       intermediate_size=18944))
    clip = _Config(hidden_size=768, num_attention_heads=12, intermediate_size=3072)
    released = [("Qwen2_5_VLForConditionalGeneration", qwen), ("CLIPTextModel", clip)]
    for size in (2, 4):
        layout = ParallelLayout(ulysses=size, fsdp=True)
        assert not should_fold("auto", layout, released)
        assert should_fold("fold", layout, released)  # still there when asked for


def test_encoder_parallel_rule(encoders):
    clip_only = encoders[1:]
    fsdp_two = ParallelLayout(ulysses=2, fsdp=True)
    assert not should_fold("replicate", fsdp_two, clip_only)
    assert not should_fold("auto", ParallelLayout(ulysses=2), clip_only)  # auto folds only under FSDP
    # ... and only encoders at least 4096 wide (the reference's gate): the tiny CLIP, as the released ones, is not
    assert not should_fold("auto", fsdp_two, clip_only)
    wide = [("CLIPTextModel", _Config(hidden_size=4096, num_attention_heads=32, intermediate_size=16384))]
    assert should_fold("auto", fsdp_two, wide) and not should_fold("auto", ParallelLayout(ulysses=2), wide)
    assert should_fold("fold", ParallelLayout(ulysses=2), clip_only)
    assert not should_fold("auto", fsdp_two, encoders)  # 1 key/value head cannot be split: auto replicates
    with pytest.raises(ValueError, match=r"1 key/value heads, not divisible by 2.*--encoder-parallel replicate"):
        should_fold("fold", ParallelLayout(ulysses=2), encoders)
    with pytest.raises(ValueError, match="this replica has one GPU"):
        should_fold("fold", ParallelLayout(dp=2), clip_only)


def test_fsdp_and_tp_are_rejected_with_an_alternative():
    plan = kandinsky6_plan(Kandinsky6TransformerConfig.from_json_dict(released_transformer_config(VARIANTS["pro"])))
    with pytest.raises(ValueError, match=r"cannot also shard them with --tp-size 2.*--ulysses-degree 2"):
        validate_layout(ParallelLayout(tp=2, fsdp=True), plan, model_name="pro", has_guidance=True)
    validate_layout(ParallelLayout(ulysses=2, fsdp=True), plan, model_name="pro", has_guidance=True)


def test_plan_globs_match_one_component_per_star():
    model = nn.Module()
    model.blocks = nn.ModuleList([nn.Sequential(nn.Linear(2, 2)) for _ in range(3)])
    assert [name for name, _ in match_modules(model, "blocks.*.0")] == ["blocks.0.0", "blocks.1.0", "blocks.2.0"]
    assert parent_list(model, "blocks.1") == (model.blocks, 1)
    assert parent_list(model, "blocks.1.0") is None
    assert [name for name, _ in match_modules(model, "blocks.*")] == ["blocks.0", "blocks.1", "blocks.2"]
    with pytest.raises(AssertionError, match="no such module"):
        match_modules(model, "blocks.*.1")
