"""`--load-format dummy`: every generation variant builds at its released size (checked on the meta device)."""

import pytest
import torch

from k6serve.models.kandinsky6.checkpoint import build_dummy_transformer, count_parameters, released_transformer_config
from k6serve.models.variants import VARIANTS, GENERATION

EXPECTED_BILLIONS = {"pro": 30.14, "lite": 3.18}


@pytest.mark.parametrize("name", [n for n, v in VARIANTS.items() if v.family == GENERATION])
def test_dummy_transformer_has_the_released_size_and_dtypes(name):
    variant = VARIANTS[name]
    model = build_dummy_transformer(released_transformer_config(variant), device=torch.device("meta"),
                                    dtype=torch.bfloat16)
    count = count_parameters(model)
    assert round(count / 1e9, 2) == EXPECTED_BILLIONS[variant.size]
    fp32 = {n for n, p in model.named_parameters() if p.dtype == torch.float32}
    assert fp32 and all(n.startswith(("out_layer.modulation.", "audio_out_layer.modulation.")) for n in fp32)
    assert model.dtype == torch.bfloat16
    heads = model.config.out_visual_dim
    assert heads == (160 if variant.distilled else 16)


def test_dummy_rejects_non_generation_variants():
    with pytest.raises(ValueError, match="no built-in transformer config"):
        released_transformer_config(VARIANTS["vsr"])
