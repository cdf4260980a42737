"""The opt-in "fa_fp8" attention backend (ops/fp8_attention.py) on the CPU: the per-head e4m3 quantization, which
calls take FA3's FP8 kernel and with what arguments (a stand-in FA3 records them), and the errors and config."""

from __future__ import annotations

import pytest
import torch

from k6serve.config import RuntimeConfig
from k6serve.ops import attention as attention_ops
from k6serve.ops import flash_attention4, fp8_attention
from k6serve.ops.attention import (
    attention,
    attention_with_lse,
    canonical_backend_name,
    resolve_attention_backend,
)


def _qkv(tokens: int, heads: int = 2, head_dim: int = 64, seed: int = 0, scale: float = 1.0):
    generator = torch.Generator().manual_seed(seed)
    return [scale * torch.randn(1, tokens, heads, head_dim, generator=generator) for _ in range(3)]


def test_quantize_per_head_maps_each_heads_max_to_448_and_rounds_to_e4m3():
    x = torch.randn(2, 50, 3, 64, generator=torch.Generator().manual_seed(1))
    x[1, :, 2] *= 1000.0  # one head far larger: its own scale, the others unaffected
    x8, descale = fp8_attention.quantize_per_head(x)
    assert x8.dtype == torch.float8_e4m3fn and x8.shape == x.shape
    assert descale.dtype == torch.float32 and descale.shape == (2, 3) and descale.is_contiguous()
    amax = x.abs().amax(dim=(1, 3))
    torch.testing.assert_close(descale, amax / 448.0)
    assert torch.equal(x8.float().abs().amax(dim=(1, 3)), torch.full((2, 3), 448.0))  # the max is exact
    restored = x8.float() * descale[:, None, :, None]
    # Round to nearest with 3 mantissa bits: at most half a step, 2^-4 of the value, for normal e4m3 numbers
    # (above 2^-6 after scaling); below that the absolute step of the subnormals, 2^-10 scaled back.
    error = (restored - x).abs()
    bound = torch.maximum(x.abs() * 2.0**-4, descale[:, None, :, None] * 2.0**-10)
    assert bool((error <= bound * (1 + 1e-6)).all())
    assert error.max() > 0  # it really rounds


def test_quantize_per_head_of_a_zero_head_is_zero_not_nan():
    x = torch.zeros(1, 8, 2, 64)
    x[:, :, 1] = 1.0
    x8, descale = fp8_attention.quantize_per_head(x)
    assert torch.equal(x8.float()[:, :, 0], torch.zeros(1, 8, 64)) and bool(torch.isfinite(descale).all())


def test_applies_to_long_calls_with_fa3_fp8_head_dims_only():
    long = torch.empty(1, fp8_attention.MIN_KEYS, 2, 128)
    assert fp8_attention.applies(long, long)
    short = torch.empty(1, fp8_attention.MIN_KEYS - 1, 2, 128)
    assert not fp8_attention.applies(long, short)  # the keys decide: a short query against long keys still applies
    assert fp8_attention.applies(short, long)
    odd = torch.empty(1, fp8_attention.MIN_KEYS, 2, 80)
    assert not fp8_attention.applies(odd, odd)
    grouped = torch.empty(1, fp8_attention.MIN_KEYS, 1, 128)  # fewer K/V heads: Q's per-head descale would not fit
    assert not fp8_attention.applies(long, grouped)


def test_reference_fp8_attention_is_close_to_exact_attention_but_not_equal():
    query, key, value = _qkv(300)
    exact = attention(query, key, value, backend="torch_sdpa")
    emulated = fp8_attention.reference_fp8_attention(query, key, value)
    relative = ((emulated - exact).norm() / exact.norm()).item()
    assert 0.001 < relative < 0.08


class _StandInFA3:
    """Records each call; computes the attention of the dequantized inputs (what the FP8 kernel is asked for)."""

    def __init__(self):
        self.calls = []

    def __call__(self, query, key, value, q_descale=None, k_descale=None, v_descale=None, return_attn_probs=False):
        self.calls.append(dict(dtypes=(query.dtype, key.dtype, value.dtype),
                               descales=None if q_descale is None else (q_descale, k_descale, v_descale)))
        if q_descale is not None:
            query, key, value = (x.float() * d[:, None, :, None] for x, d in
                                 ((query, q_descale), (key, k_descale), (value, v_descale)))
        out, lse = attention_ops._math_attention_with_lse(query, key, value, None)
        out = out.to(torch.bfloat16)
        return (out, lse) if return_attn_probs else out


@pytest.fixture
def stand_in_fa3(monkeypatch):
    fa3 = _StandInFA3()
    # CPU tensors are never "CUDA bf16": route every call of an FA3 backend to the stand-in.
    monkeypatch.setattr(attention_ops, "_uses_fa3", lambda backend, query, mask: backend in ("fa", "fa_fp8")
                        and mask is None)
    monkeypatch.setattr(attention_ops, "_FA3_FUNCTION", fa3)
    monkeypatch.setattr(flash_attention4, "_READY", False)
    return fa3


def test_fa_fp8_sends_long_calls_to_the_fp8_kernel_with_per_head_descales(stand_in_fa3):
    query, key, value = _qkv(fp8_attention.MIN_KEYS, heads=3, head_dim=64)
    out = attention(query, key, value, backend="fa_fp8")
    (call,) = stand_in_fa3.calls
    assert call["dtypes"] == (torch.float8_e4m3fn,) * 3
    for descale, x in zip(call["descales"], (query, key, value)):
        assert descale.shape == (1, 3) and descale.dtype == torch.float32
        torch.testing.assert_close(descale, x.abs().amax(dim=(1, 3)) / 448.0)
    torch.testing.assert_close(out.float(), fp8_attention.reference_fp8_attention(query, key, value),
                               atol=1e-2, rtol=0)  # the stand-in's bf16 output
    out_lse, lse = attention_with_lse(query, key, value, backend="fa_fp8")  # Ring attention's call
    assert stand_in_fa3.calls[-1]["dtypes"] == (torch.float8_e4m3fn,) * 3 and lse.shape == (1, 3, query.shape[1])
    assert torch.equal(out_lse, out)


def test_fa_fp8_keeps_bf16_fa3_for_short_calls_and_sdpa_for_masked_ones(stand_in_fa3):
    query, key, value = _qkv(64)
    attention(query, key, value, backend="fa_fp8")
    assert stand_in_fa3.calls[-1] == dict(dtypes=(torch.float32,) * 3, descales=None)
    mask = torch.ones(1, 64, dtype=torch.bool)
    masked = attention(query, key, value, key_mask_BL=mask, backend="fa_fp8")
    assert len(stand_in_fa3.calls) == 1  # the masked call never reached FA3
    torch.testing.assert_close(masked, attention(query, key, value, backend="torch_sdpa"))
    long = _qkv(fp8_attention.MIN_KEYS)
    attention(*long, backend="fa")
    assert stand_in_fa3.calls[-1]["descales"] is None  # plain "fa" never quantizes


def test_fa_fp8_names_and_errors():
    assert canonical_backend_name("fa_fp8") == "fa_fp8"
    with pytest.raises(ValueError, match="'fa_fp8' \\(FlashAttention-3 in FP8"):
        canonical_backend_name("fp8")
    with pytest.raises(ValueError, match="'fa_fp8' \\(FlashAttention-3\\) cannot run here: it needs a CUDA GPU.*"
                                         "--attention-backend torch_sdpa"):
        resolve_attention_backend("fa_fp8", "cpu")
    assert RuntimeConfig(attention_backend="fa_fp8").attention_backend == "fa_fp8"
    with pytest.raises(ValueError, match="one of auto, fa, fa_fp8, torch_sdpa"):
        RuntimeConfig(attention_backend="fp8")
