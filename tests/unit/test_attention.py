"""`k6serve.ops.attention`: SDPA and LSE paths against a plain math reference, backend resolution errors."""

import functools
import math
import re

import pytest
import torch

from k6serve.models.common.inner_attention import InnerAttention
from k6serve.ops import attention as attention_ops
from k6serve.ops.attention import attention, attention_with_lse, resolve_attention_backend


def _math_reference(query_BLHD, key_BSHD, value_BSHD, key_mask_BS=None):
    """Float64 softmax attention: returns (out (B, L, H, D), lse (B, H, L))."""
    scale = 1.0 / math.sqrt(query_BLHD.shape[-1])
    query, key, value = (x.double().permute(0, 2, 1, 3) for x in (query_BLHD, key_BSHD, value_BSHD))
    scores_BHLS = query @ key.transpose(-1, -2) * scale
    if key_mask_BS is not None:
        scores_BHLS = scores_BHLS.masked_fill(~key_mask_BS[:, None, None, :], float("-inf"))
    lse_BHL = torch.logsumexp(scores_BHLS, dim=-1)
    out = torch.softmax(scores_BHLS, dim=-1) @ value
    return out.permute(0, 2, 1, 3), lse_BHL


def _inputs(batch=2, length=7, keys=9, heads=3, head_dim=16):
    generator = torch.Generator().manual_seed(0)
    query = torch.randn(batch, length, heads, head_dim, generator=generator)
    key = torch.randn(batch, keys, heads, head_dim, generator=generator)
    value = torch.randn(batch, keys, heads, head_dim, generator=generator)
    key_mask = torch.ones(batch, keys, dtype=torch.bool)
    key_mask[1, 5:] = False
    key_mask[0, 2] = False
    return query, key, value, key_mask


@pytest.mark.parametrize("backend", ["torch_sdpa", "sdpa", "fa"])
@pytest.mark.parametrize("masked", [False, True])
def test_attention_matches_math_reference(backend, masked):
    # "fa" on a CPU tensor runs SDPA: FA3 needs CUDA (resolve_attention_backend refuses it on CPU).
    query, key, value, key_mask = _inputs()
    key_mask = key_mask if masked else None
    out = attention(query, key, value, key_mask_BL=key_mask, backend=backend)
    expected, _ = _math_reference(query, key, value, key_mask)
    assert out.shape == query.shape and out.dtype == query.dtype
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)


def test_key_mask_equals_dropping_the_masked_keys():
    query, key, value, key_mask = _inputs()
    out = attention(query, key, value, key_mask_BL=key_mask, backend="torch_sdpa")
    for batch in range(query.shape[0]):
        kept = key_mask[batch]
        alone = attention(
            query[batch : batch + 1],
            key[batch : batch + 1, kept],
            value[batch : batch + 1, kept],
            backend="sdpa",
        )
        torch.testing.assert_close(out[batch : batch + 1], alone, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("masked", [False, True])
def test_attention_with_lse_matches_logsumexp_of_scores(masked):
    query, key, value, key_mask = _inputs()
    key_mask = key_mask if masked else None
    out, lse = attention_with_lse(query, key, value, key_mask_BL=key_mask, backend="torch_sdpa")
    expected_out, expected_lse = _math_reference(query, key, value, key_mask)
    assert lse.dtype == torch.float32 and lse.shape == (
        query.shape[0],
        query.shape[2],
        query.shape[1],
    )
    torch.testing.assert_close(lse.double(), expected_lse, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.double(), expected_out, atol=1e-5, rtol=1e-5)


def test_attention_with_lse_keeps_input_dtype():
    query, key, value, _ = _inputs()
    out, lse = attention_with_lse(
        query.bfloat16(), key.bfloat16(), value.bfloat16(), backend="torch_sdpa"
    )
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32


def test_non_bool_key_mask_is_rejected():
    query, key, value, key_mask = _inputs()
    with pytest.raises(ValueError, match="bool"):
        attention(query, key, value, key_mask_BL=key_mask.float(), backend="torch_sdpa")


def test_unknown_backend_lists_the_valid_ones():
    with pytest.raises(
        ValueError, match=r"unknown attention backend 'sage'.*'fa'.*'torch_sdpa'.*'sdpa'"
    ):
        resolve_attention_backend("sage", "cpu")
    query, key, value, _ = _inputs()
    with pytest.raises(ValueError, match="unknown attention backend 'flash'"):
        attention(query, key, value, backend="flash")


def test_fa_on_cpu_says_why_and_what_to_use():
    with pytest.raises(ValueError) as error:
        resolve_attention_backend("fa", "cpu")
    message = str(error.value)
    assert (
        "'fa'" in message and "CUDA GPU" in message and "--attention-backend torch_sdpa" in message
    )


def test_fa_without_the_wheel_names_the_import_failure(monkeypatch):
    # Pretend to be on a Hopper GPU whose fa3-fwd import fails.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(
        attention_ops, "_load_fa3", lambda: (None, "the fa3-fwd wheel could not be imported (x)")
    )
    # On Hopper the missing piece is the wheel: the refusal says how to install it (it said only "use sdpa")
    with pytest.raises(
        ValueError, match=r"fa3-fwd wheel could not be imported \(x\)\. Install it with `pip install fa3-fwd` \(it "
                          r"needs a CUDA 13 build of torch\), or use --attention-backend torch_sdpa\.$"
    ):
        resolve_attention_backend("fa", "cuda")
    with pytest.raises(ValueError, match=r"Install it with `pip install fa3-fwd` .*, or use --attention-backend "
                                         r"torch_sdpa\.$"):
        resolve_attention_backend("fa_fp8", "cuda")
    assert resolve_attention_backend(None, "cuda") == "torch_sdpa"


def test_fa_for_a_model_not_in_bf16_is_refused_and_auto_takes_sdpa(monkeypatch):
    """FlashAttention takes bf16 only: with --dtype float32 an explicit `fa` was accepted and every call ran on
    torch SDPA, silently."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(attention_ops, "_load_fa3", lambda: (lambda *args, **kwargs: None, None))
    for requested in ("fa", "fa3", "fa_fp8"):
        with pytest.raises(ValueError, match=rf"^attention backend '{requested}' \(FlashAttention\) runs bf16 only, "
                                             r"and the model runs in float32 \(--dtype\): every call would run on "
                                             r"torch SDPA\. Use --dtype bfloat16, or --attention-backend torch_sdpa\.$"):
            resolve_attention_backend(requested, "cuda", torch.float32)
        assert resolve_attention_backend(requested, "cuda", torch.bfloat16) in ("fa", "fa_fp8")
    assert resolve_attention_backend(None, "cuda", torch.float32) == "torch_sdpa"
    assert resolve_attention_backend(None, "cuda", torch.bfloat16) == "fa"


@pytest.mark.parametrize(("capability", "architecture"), [((8, 9), "sm_89"), ((12, 0), r"sm_120 \(RTX Blackwell\)")])
def test_fa_on_a_gpu_without_flash_attention_names_the_architecture(monkeypatch, caplog, capability, architecture):
    """Ada and RTX Blackwell (sm_120, where the reference maps FA to SDPA too): an explicit "fa" (or its alias "fa4")
    says which GPUs have FlashAttention and what to use; the default is SDPA, quietly (nothing to install there)."""
    import logging

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    for name in ("fa", "fa4"):
        with pytest.raises(ValueError, match=rf"{name}'.*cannot run here: .*Hopper \(sm_90: FlashAttention-3 .* "
                                             rf"datacenter Blackwell \(sm_100, sm_103: FlashAttention-4\) only, and "
                                             rf"this GPU is {architecture}. Use --attention-backend torch_sdpa"):
            resolve_attention_backend(name, "cuda")
    with caplog.at_level(logging.WARNING):
        assert resolve_attention_backend(None, "cuda") == "torch_sdpa"
    assert [record for record in caplog.records if record.name.startswith("k6serve")] == []


def test_default_and_alias_resolution_on_cpu():
    assert resolve_attention_backend(None, "cpu") == "torch_sdpa"
    assert resolve_attention_backend("sdpa", torch.device("cpu")) == "torch_sdpa"
    assert resolve_attention_backend("torch_sdpa", "cpu") == "torch_sdpa"


def test_inner_attention_carries_role_and_backend():
    module = InnerAttention("video_self", backend="sdpa")
    assert module.role == "video_self" and module.backend == "torch_sdpa"
    assert "role=video_self" in repr(module)
    query, key, value, key_mask = _inputs()
    torch.testing.assert_close(
        module(query, key, value, key_mask),
        attention(query, key, value, key_mask_BL=key_mask, backend="sdpa"),
    )


def _fa3_runs() -> bool:
    return torch.cuda.is_available() and attention_ops.fa3_unavailable_reason("cuda") is None


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
needs_fa3 = pytest.mark.skipif(not _fa3_runs(), reason="needs FlashAttention-3 (fa3-fwd) on Hopper")
CUDA_BACKENDS = ["torch_sdpa", pytest.param("fa", marks=needs_fa3)]


def _cuda_bf16_inputs():
    query, key, value, key_mask = _inputs(length=300, keys=260, heads=4, head_dim=64)
    return (*(x.cuda().bfloat16() for x in (query, key, value)), key_mask.cuda())


@needs_cuda
@pytest.mark.parametrize("backend", CUDA_BACKENDS)
@pytest.mark.parametrize("masked", [False, True])
def test_cuda_bf16_attention_matches_math_reference(backend, masked):
    query, key, value, key_mask = _cuda_bf16_inputs()
    key_mask = key_mask if masked else None
    out = attention(query, key, value, key_mask_BL=key_mask, backend=backend)
    expected, _ = _math_reference(query, key, value, key_mask)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), expected, atol=2e-2, rtol=2e-2)


@needs_cuda
@pytest.mark.parametrize("backend", CUDA_BACKENDS)
@pytest.mark.parametrize("masked", [False, True])
def test_cuda_attention_with_lse_matches_math_reference(backend, masked):
    query, key, value, key_mask = _cuda_bf16_inputs()
    key_mask = key_mask if masked else None
    out, lse = attention_with_lse(query, key, value, key_mask_BL=key_mask, backend=backend)
    expected_out, expected_lse = _math_reference(query, key, value, key_mask)
    assert lse.dtype == torch.float32 and lse.shape == expected_lse.shape
    torch.testing.assert_close(lse.double(), expected_lse, atol=1e-2, rtol=1e-3)
    torch.testing.assert_close(out.double(), expected_out, atol=2e-2, rtol=2e-2)


@needs_fa3
@pytest.mark.parametrize("compiled", [False, True])
def test_fa3_short_query_split_matches_the_math_reference_on_the_gpu(monkeypatch, compiled):
    """FA3 with its keys split (the default for few queries on many keys) on the real kernel, eager and inside
    torch.compile (which refuses FA3's own split heuristic): the same answer as the math reference and as the
    unsplit call, to bf16 rounding."""
    generator = torch.Generator().manual_seed(3)
    query, key, value = (torch.randn(1, length, 4, 128, generator=generator).cuda().bfloat16()
                         for length in (218, 8_192, 8_192))
    assert attention_ops.fa3_num_splits(218, 8_192) == attention_ops.DEFAULT_FA3_SHORT_QUERY_SPLITS > 1
    call = functools.partial(attention, backend="fa")
    if compiled:
        torch._dynamo.reset()
        call = torch.compile(call, fullgraph=True)
    split = call(query, key, value)
    monkeypatch.setattr(attention_ops, "FA3_SHORT_QUERY_SPLITS", 1)
    torch._dynamo.reset()
    unsplit = attention(query, key, value, backend="fa")
    expected, _ = _math_reference(query, key, value, None)
    torch.testing.assert_close(split.double(), expected, atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(split, unsplit, atol=4e-3, rtol=0)


@needs_fa3
def test_default_backend_on_hopper_with_fa3_is_fa():
    assert resolve_attention_backend(None, "cuda") == "fa"


def test_compiled_fa3_call_survives_new_imports(monkeypatch):
    """A compiled region calling FA3 must not recompile when a module is imported after it was compiled.

    Dynamo traced the import logic of the loader and guarded on `sys.modules`: on the H200 the first request after
    the compiling one recompiled every block (one Pro-distill step 10.2 s instead of 5.9). Here FA3 is a stand-in
    module (SDPA underneath) and the FA3 branch is forced on for CPU tensors.
    """
    import sys
    import types

    import torch.nn.functional as F
    from torch._dynamo.utils import counters

    def flash_attn_func(query_BLHD, key_BSHD, value_BSHD):
        return F.scaled_dot_product_attention(*(x.transpose(1, 2) for x in (query_BLHD, key_BSHD, value_BSHD))
                                              ).transpose(1, 2)

    interface = types.ModuleType("fa3_fwd_interface")
    interface.flash_attn_func = flash_attn_func
    monkeypatch.setitem(sys.modules, "fa3_fwd_config", types.ModuleType("fa3_fwd_config"))
    monkeypatch.setitem(sys.modules, "fa3_fwd_interface", interface)
    monkeypatch.setattr(attention_ops, "_uses_fa3", lambda backend, query, mask: backend == "fa")
    monkeypatch.setattr(attention_ops, "_FA3_FUNCTION", None)
    attention_ops._load_fa3.cache_clear()
    try:
        assert resolve_attention_backend(None, "cpu") == "torch_sdpa"  # CPU: the default never picks FA3 ...
        assert attention_ops._load_fa3()[0] is flash_attn_func  # ... but the loader now finds the stand-in
        torch._dynamo.reset()

        @torch.compile(backend="eager")
        def block(x):
            return attention(x * 2, x, x, backend="fa") + 1

        x = torch.randn(1, 8, 2, 16)
        expected = flash_attn_func(x * 2, x, x) + 1
        assert torch.allclose(block(x), expected)
        graphs = counters["stats"]["unique_graphs"]
        monkeypatch.setitem(sys.modules, "k6serve_test_new_module", types.ModuleType("k6serve_test_new_module"))
        assert torch.allclose(block(x), expected)
        assert counters["stats"]["unique_graphs"] == graphs  # no recompilation
    finally:
        attention_ops._load_fa3.cache_clear()
        torch._dynamo.reset()


def test_fa4_switch_routes_fa3_calls_through_its_op_without_graph_breaks(monkeypatch):
    """$K6SERVE_FA4=1 sends every call that would run FA3 to FlashAttention-4's op (a stand-in here: SDPA), inside a
    compiled region without a graph break; an FA4 that cannot be imported fails with how to fix it."""
    import torch.nn.functional as F

    from k6serve.ops import flash_attention4

    calls = []

    def stand_in(query_BLHD, key_BSHD, value_BSHD):
        calls.append(query_BLHD.shape)
        out = F.scaled_dot_product_attention(*(x.transpose(1, 2) for x in (query_BLHD, key_BSHD, value_BSHD)))
        return out.transpose(1, 2), None  # FA4 returns (out, lse)

    monkeypatch.setattr(attention_ops, "_uses_fa3", lambda backend, query, mask: backend == "fa")
    monkeypatch.setattr(flash_attention4, "MODE", "1")
    monkeypatch.setattr(flash_attention4, "load", lambda: (stand_in, ""))
    query, key, value, _ = _inputs()
    expected = attention(query, key, value, backend="torch_sdpa")
    torch._dynamo.reset()
    compiled = torch.compile(lambda q, k, v: attention(q, k, v, backend="fa"), backend="eager", fullgraph=True)
    assert torch.allclose(compiled(query, key, value), expected, atol=1e-6)
    assert calls  # the stand-in ran (through the op), not FA3
    torch._dynamo.reset()  # inductor too: it lowers the op as a fallback kernel (argument names matter there)
    compiled = torch.compile(lambda q, k, v: attention(q, k, v, backend="fa"), backend="inductor", fullgraph=True)
    with torch.inference_mode():
        assert torch.allclose(compiled(query, key, value), expected, atol=1e-6)
    monkeypatch.setattr(flash_attention4, "load", lambda: (None, "flash-attn-4 could not be imported (x)"))
    with pytest.raises(ValueError, match="K6SERVE_FA4=1 asks for FlashAttention-4 but .* unset K6SERVE_FA4"):
        attention(query, key, value, backend="fa")
    torch._dynamo.reset()


def test_fa4_auto_mode_takes_the_head_dims_where_it_measured_faster(monkeypatch):
    """Default ($K6SERVE_FA4 unset = "auto"): FA4 runs the FA3 calls with 64-wide heads once the backend resolution
    imported it, FA3 the 128-wide ones; nothing changes when FA4 is missing or $K6SERVE_FA4=0; "1" without FA4
    fails when the backend is resolved, with how to fix it."""
    import torch.nn.functional as F

    from k6serve.ops import flash_attention4

    calls = []

    def stand_in(name):
        def run(query_BLHD, key_BSHD, value_BSHD):
            calls.append((name, query_BLHD.shape[-1]))
            out = F.scaled_dot_product_attention(*(x.transpose(1, 2) for x in (query_BLHD, key_BSHD, value_BSHD)))
            return out.transpose(1, 2), None

        return run

    monkeypatch.setattr(attention_ops, "_uses_fa3", lambda backend, query, mask: backend == "fa")
    monkeypatch.setattr(attention_ops, "_FA3_FUNCTION", lambda q, k, v: stand_in("fa3")(q, k, v)[0])
    monkeypatch.setattr(attention_ops, "fa3_unavailable_reason", lambda device: None)
    monkeypatch.setattr(flash_attention4, "MODE", "auto")
    monkeypatch.setattr(flash_attention4, "_READY", False)

    def run(head_dim):
        calls.clear()
        query, key, value, _ = _inputs(head_dim=head_dim)
        out = attention(query, key, value, backend="fa")
        assert torch.allclose(out, attention(query, key, value, backend="torch_sdpa"), atol=1e-6)
        return [name for name, _ in calls]

    assert run(64) == ["fa3"]  # FA4 not imported (the backend was never resolved): FA3
    monkeypatch.setattr(flash_attention4, "load", lambda: (None, "flash-attn-4 could not be imported (x)"))
    assert attention_ops.resolve_attention_backend("fa", "cpu") == "fa"  # missing FA4 in auto mode: no error
    assert run(64) == ["fa3"]

    monkeypatch.setattr(flash_attention4, "load", lambda: (stand_in("fa4"), ""))
    assert attention_ops.resolve_attention_backend(None, "cpu") == "fa"  # imports FA4 eagerly (no probe off CUDA)
    assert flash_attention4._READY
    assert run(64) == ["fa4"]
    assert run(128) == ["fa3"]
    monkeypatch.setattr(flash_attention4, "MODE", "0")
    assert run(64) == ["fa3"]
    assert flash_attention4.prepare() == "$K6SERVE_FA4=0"
    monkeypatch.setattr(flash_attention4, "MODE", "1")
    assert run(128) == ["fa4"]
    monkeypatch.setattr(flash_attention4, "load", lambda: (None, "flash-attn-4 could not be imported (x)"))
    with pytest.raises(ValueError, match="K6SERVE_FA4=1 asks for FlashAttention-4 but .* could not be imported"):
        attention_ops.resolve_attention_backend("fa", "cpu")


def test_fa4_environment_variable_is_validated():
    import os
    import subprocess
    import sys

    result = subprocess.run(
        [sys.executable, "-c", "import k6serve.ops.flash_attention4"],
        env={**os.environ, "K6SERVE_FA4": "yes"}, capture_output=True, text=True, check=False,
    )
    assert result.returncode != 0
    assert "K6SERVE_FA4 must be one of ('auto', '1', '0') (unset means 'auto'), got 'yes'" in result.stderr


def test_fa4_tiles_variable_picks_the_tile_and_the_head_dims(monkeypatch):
    """$K6SERVE_FA4_TILES ("HEAD_DIM:MxN[:FLAGS],..."): a listed head dim runs FA4 (also in "auto" mode) through
    FA4's `_flash_attn_fwd(tile_mn=..., mma_pv_is_rs=..., intra_wg_overlap=...)` with that tile and those flags; other head dims keep the public function; a malformed value says
    the format."""
    import torch.nn.functional as F

    from k6serve.ops import flash_attention4

    assert flash_attention4.parse_tiles("") == {}
    assert flash_attention4.parse_tiles("128:128x176, 64:192x192:ol,32:128x128:none") == {
        128: (128, 176, True, True), 64: (192, 192, False, True), 32: (128, 128, False, False)
    }
    for bad in ("128", "128:128", "128:128x", "x:1x2", "128:0x176", "128:128x176;64:192x192", "128:128x176:fast"):
        with pytest.raises(ValueError, match=r"K6SERVE_FA4_TILES takes HEAD_DIM:MxN\[:FLAGS\] items separated"):
            flash_attention4.parse_tiles(bad)

    calls = []

    def attend(query_BLHD, key_BSHD, value_BSHD):
        out = F.scaled_dot_product_attention(*(x.transpose(1, 2) for x in (query_BLHD, key_BSHD, value_BSHD)))
        return out.transpose(1, 2)

    def public(query_BLHD, key_BSHD, value_BSHD):
        calls.append(("public", None))
        return attend(query_BLHD, key_BSHD, value_BSHD), None

    def tiled(query_BLHD, key_BSHD, value_BSHD, *, tile_mn, mma_pv_is_rs, intra_wg_overlap):
        calls.append(("tiled", (*tile_mn, mma_pv_is_rs, intra_wg_overlap)))
        return attend(query_BLHD, key_BSHD, value_BSHD), None, None, None, None

    monkeypatch.setattr(attention_ops, "_uses_fa3", lambda backend, query, mask: backend == "fa")
    monkeypatch.setattr(attention_ops, "_FA3_FUNCTION", lambda q, k, v: calls.append(("fa3", None)) or attend(q, k, v))
    monkeypatch.setattr(flash_attention4, "load", lambda: (public, ""))
    monkeypatch.setattr(flash_attention4, "load_tiled", lambda: tiled)
    monkeypatch.setattr(flash_attention4, "MODE", "auto")
    monkeypatch.setattr(flash_attention4, "_READY", True)
    monkeypatch.setattr(flash_attention4, "TILES", flash_attention4.parse_tiles("128:128x176:rs"))
    for head_dim, expected in ((128, ("tiled", (128, 176, True, False))), (64, ("public", None)), (32, ("fa3", None))):
        calls.clear()
        query, key, value, _ = _inputs(head_dim=head_dim)
        out = attention(query, key, value, backend="fa")
        assert torch.allclose(out, attention(query, key, value, backend="torch_sdpa"), atol=1e-6)
        assert calls == [expected], head_dim


def test_fa4_probe_checks_the_lse_call_where_ring_attention_uses_it(monkeypatch):
    """On Blackwell Ring attention's (out, lse) calls run FA4 too, so its probe checks them: a kernel whose lse is
    wrong is found at load."""
    import torch.nn.functional as F

    from k6serve.ops import flash_attention4

    def kernel(lse_offset):
        def flash_attn_func(query_BLHD, key_BSHD, value_BSHD, return_lse=False):
            q, k, v = (x.transpose(1, 2) for x in (query_BLHD, key_BSHD, value_BSHD))
            out = F.scaled_dot_product_attention(q, k, v).transpose(1, 2)
            lse = torch.logsumexp((q.float() @ k.float().transpose(-1, -2)) / q.shape[-1] ** 0.5, dim=-1)
            return out, (lse + lse_offset if return_lse else None)
        return flash_attn_func

    monkeypatch.setattr(flash_attention4, "TILES", {})
    monkeypatch.setattr(flash_attention4, "load", lambda: (kernel(0.0), ""))
    flash_attention4.probe(torch.device("cpu"), 128, tokens=16, with_lse=True)
    monkeypatch.setattr(flash_attention4, "load", lambda: (kernel(0.5), ""))  # ln vs log2, say
    flash_attention4.probe(torch.device("cpu"), 128, tokens=16)  # the plain call is right
    with pytest.raises(RuntimeError, match=r"its \(out, lse\) call differs from the math by .* / 0.5 at head dim 128"):
        flash_attention4.probe(torch.device("cpu"), 128, tokens=16, with_lse=True)


def test_fa4_probe_keeps_fa3_when_an_installed_fa4_fails(monkeypatch, caplog):
    """On a CUDA device `prepare()` runs one small FA4 call per head dim it will take, checked against SDPA: in
    "auto" mode a failing or wrong kernel logs a warning and FA3 keeps every call (an installed but broken FA4 must
    not fail requests); with $K6SERVE_FA4=1 it raises at backend resolution."""
    import logging

    import torch.nn.functional as F

    from k6serve.ops import flash_attention4

    def right(query_BLHD, key_BSHD, value_BSHD):
        out = F.scaled_dot_product_attention(*(x.transpose(1, 2) for x in (query_BLHD, key_BSHD, value_BSHD)))
        return out.transpose(1, 2), None

    def wrong(query_BLHD, key_BSHD, value_BSHD):
        return torch.zeros_like(query_BLHD), None

    monkeypatch.setattr(flash_attention4, "TILES", {})
    monkeypatch.setattr(flash_attention4, "_READY", False)  # restored after the test, whatever prepare() sets
    monkeypatch.setattr(flash_attention4, "load", lambda: (right, ""))
    flash_attention4.probe(torch.device("cpu"), 64, tokens=16)  # the probe itself, on CPU with a stand-in
    monkeypatch.setattr(flash_attention4, "load", lambda: (wrong, ""))
    with pytest.raises(RuntimeError, match="differs from SDPA's by .* at head dim 64"):
        flash_attention4.probe(torch.device("cpu"), 64, tokens=16)

    probed = []

    def failing_probe(device, head_dim, **options):
        probed.append((device.type, head_dim))
        raise RuntimeError("cutlass JIT: no kernel image")

    monkeypatch.setattr(flash_attention4, "probe", failing_probe)
    monkeypatch.setattr(flash_attention4, "MODE", "auto")
    with caplog.at_level(logging.WARNING, logger="k6serve.ops.flash_attention4"):
        reason = flash_attention4.prepare(torch.device("cuda"))
    assert probed == [("cuda", 64)]
    assert "failed its probe (RuntimeError: cutlass JIT: no kernel image)" in reason
    assert "FA3 keeps every attention call" in caplog.text
    assert not flash_attention4._READY and not flash_attention4.wanted(64)
    monkeypatch.setattr(flash_attention4, "MODE", "1")
    with pytest.raises(ValueError, match="K6SERVE_FA4=1 asks for FlashAttention-4 but .* failed its probe"):
        flash_attention4.prepare(torch.device("cuda"))
    monkeypatch.setattr(flash_attention4, "probe", lambda device, head_dim, with_lse=False: None)
    monkeypatch.setattr(flash_attention4, "MODE", "auto")
    assert flash_attention4.prepare(torch.device("cuda")) is None
    assert flash_attention4._READY and flash_attention4.wanted(64) and not flash_attention4.wanted(128)


def test_fa3_split_rule_splits_only_short_queries_on_long_keys(monkeypatch):
    """Only few queries on many keys (the audio-from-video cross-attention, 218 on 47,616) get the fixed split count;
    the video self-attention, the text attentions and small calls keep FA3's single pass."""
    monkeypatch.setattr(attention_ops, "FA3_SHORT_QUERY_SPLITS", 4)
    assert attention_ops.fa3_num_splits(218, 47_616) == 4  # Pro / Lite audio-from-video
    assert attention_ops.fa3_num_splits(47_616, 47_616) == 1  # video self-attention
    assert attention_ops.fa3_num_splits(47_616, 218) == 1  # video-from-audio
    assert attention_ops.fa3_num_splits(218, 1_024) == 1  # too few keys to be worth a combine pass
    assert attention_ops.fa3_num_splits(1_024, 8_192) == 1  # keys only 8x the queries


@pytest.mark.parametrize("text", ["0", "-2", "two", "65", "1.5"])
def test_fa3_splits_environment_variable_is_checked(text):
    with pytest.raises(ValueError, match=r"K6SERVE_FA3_SPLITS must be a whole number from 1 to 64.*unset it"):
        attention_ops._parse_splits(text)
    assert attention_ops._parse_splits(" 8 ") == 8
    assert attention_ops._parse_splits("") == attention_ops.DEFAULT_FA3_SHORT_QUERY_SPLITS


def test_fa3_split_count_reaches_the_kernel_inside_a_compiled_region(monkeypatch):
    """The count is a plain int chosen from static shapes, so the compiled block passes it to FA3 (a stand-in that
    records it) and a long-query call in the same region stays unsplit (FA3's default call, no keyword)."""
    import torch.nn.functional as F

    seen = []

    def flash_attn_func(query_BLHD, key_BSHD, value_BSHD, **options):
        seen.append((query_BLHD.shape[1], options.get("num_splits", "default")))
        return F.scaled_dot_product_attention(*(x.transpose(1, 2) for x in (query_BLHD, key_BSHD, value_BSHD))
                                              ).transpose(1, 2)

    monkeypatch.setattr(attention_ops, "_uses_fa3", lambda backend, query, mask: backend == "fa")
    monkeypatch.setattr(attention_ops, "_FA3_FUNCTION", flash_attn_func)
    monkeypatch.setattr(attention_ops, "FA3_SHORT_QUERY_SPLITS", 4)
    monkeypatch.setattr(attention_ops, "SHORT_QUERY_MIN_KEYS", 64)
    torch._dynamo.reset()
    try:
        @torch.compile(backend="eager")
        def block(audio, video):
            return attention(audio, video, video, backend="fa"), attention(video, video, video, backend="fa")

        audio, video = torch.randn(1, 3, 2, 16), torch.randn(1, 64, 2, 16)
        audio_out, video_out = block(audio, video)
        assert seen == [(3, 4), (64, "default")]
        reference = F.scaled_dot_product_attention(audio.transpose(1, 2), video.transpose(1, 2), video.transpose(1, 2))
        assert torch.allclose(audio_out, reference.transpose(1, 2), atol=1e-6)
    finally:
        torch._dynamo.reset()


_REAL_CUDA_IS_AVAILABLE = torch.cuda.is_available


class _StandInFA4:
    """flash-attn-4's `flash_attn_func` on the CPU: SDPA in fp32, returning (out, lse) as FA4 does (lse (B, H, L) fp32
    in natural log when return_lse=True, else None; flash_attn/cute/interface.py, 4.0.0b36)."""

    def __init__(self):
        self.calls = []

    def __call__(self, query_BLHD, key_BSHD, value_BSHD, return_lse=False):
        self.calls.append((query_BLHD.shape[-1], return_lse))
        out, lse = _math_reference(query_BLHD, key_BSHD, value_BSHD)
        return out.to(query_BLHD.dtype), (lse.float() if return_lse else None)


def _no_fa3(*args, **kwargs):
    raise AssertionError("FA3 was called: its sm_90a kernels cannot run on Blackwell")


def _fa4_stand_in(monkeypatch, fa4, probe) -> None:
    """FA4 importable as the stand-in `fa4`, its probe `probe`, its module state fresh ("auto", no tiles, not ready)."""
    from k6serve.ops import flash_attention4

    for name, value in (("MODE", "auto"), ("TILES", {}), ("_READY", False), ("_EVERY_CALL", False),
                        ("load", lambda: (fa4, "")), ("probe", probe)):
        monkeypatch.setattr(flash_attention4, name, value)


@pytest.fixture
def blackwell(monkeypatch):
    """A datacenter Blackwell GPU (sm_100) with FA4 a stand-in and no FA3; `_uses_fa3` is the real rule with "the
    tensor is on CUDA" taken as true, so CPU bf16 tensors take the FlashAttention path as CUDA ones would."""
    fa4 = _StandInFA4()
    probed = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (10, 0))
    monkeypatch.setattr(attention_ops, "_load_fa3", _no_fa3)
    monkeypatch.setattr(attention_ops, "_FA3_FUNCTION", _no_fa3)
    monkeypatch.setattr(attention_ops, "_uses_fa3", lambda backend, query, mask: (
        backend in ("fa", "fa_fp8") and mask is None and query.dtype == torch.bfloat16))
    _fa4_stand_in(monkeypatch, fa4, lambda device, head_dim, with_lse=False: probed.append(
        (device.type, head_dim, with_lse)))
    fa4.probed = probed
    return fa4


def _compiled_through(op_name, function, backend):
    """`function` compiled in one graph (fullgraph), checked to call the custom op `op_name` (not to trace into it)."""
    def check(graph_module, example_inputs):
        assert op_name in str(graph_module.graph), graph_module.graph
        return graph_module.forward

    torch._dynamo.reset()
    return torch.compile(functools.partial(function, backend=backend), backend=check, fullgraph=True)


@pytest.mark.parametrize("capability", [(10, 0), (10, 3)])  # B200 / GB200, B300 / GB300
def test_fa_on_datacenter_blackwell_runs_fa4_for_every_call_fa3_would_run(blackwell, monkeypatch, capability):
    """On sm_100 / sm_103 the default is "fa" once FA4 imports and passes its probe (both Kandinsky 6 head dims), and
    every unmasked bf16 call of "fa" (or its aliases) runs FA4 through its custom op, inside compile without a graph
    break, 128-wide heads included; Ring attention's lse call takes FA4's (out, lse). FA3 is never called; masked or
    fp32 calls run SDPA as on Hopper."""
    from k6serve.ops import flash_attention4

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    assert resolve_attention_backend(None, "cuda") == "fa"
    assert blackwell.probed == [("cuda", 64, True), ("cuda", 128, True)]  # with the (out, lse) call
    assert flash_attention4.replaces_fa3()
    # The dispatch reads module state only (no device query inside compiled regions); dynamo itself must see the
    # CPU-only torch again, or it tries to initialise CUDA.
    monkeypatch.setattr(torch.cuda, "is_available", _REAL_CUDA_IS_AVAILABLE)
    for head_dim in (128, 64):
        query, key, value, key_mask = (x.bfloat16() if x.is_floating_point() else x
                                       for x in _inputs(head_dim=head_dim))
        expected, expected_lse = _math_reference(query, key, value)
        for name in ("fa", "fa3", "fa4"):
            blackwell.calls.clear()
            out = _compiled_through("k6serve.fa4_attention.default", attention, name)(query, key, value)
            assert blackwell.calls == [(head_dim, False)], name
            torch.testing.assert_close(out.double(), expected, atol=1e-2, rtol=1e-2)
        blackwell.calls.clear()
        out, lse = _compiled_through("k6serve.fa4_attention_with_lse.default", attention_with_lse, "fa")(
            query, key, value)
        assert blackwell.calls == [(head_dim, True)]
        assert lse.dtype == torch.float32 and lse.shape == expected_lse.shape
        torch.testing.assert_close(lse.double(), expected_lse, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(out.double(), expected, atol=1e-2, rtol=1e-2)
        blackwell.calls.clear()
        attention(query, key, value, key_mask_BL=key_mask, backend="fa")  # masked: SDPA
        attention(query.float(), key.float(), value.float(), backend="fa")  # not bf16: SDPA
        attention_with_lse(query, key, value, key_mask_BL=key_mask, backend="fa")
        assert blackwell.calls == []
    torch._dynamo.reset()


def test_fa4_with_lse_op_traces_with_its_fake(blackwell):
    """The (out, lse) op has a fake implementation, so a compiled Ring step sees FA4's shapes: out (B, L, H, D) in the
    query dtype, lse (B, H, L) fp32."""
    from k6serve.ops import flash_attention4

    query, key, value = (x.bfloat16() for x in _inputs(length=5, keys=11, heads=2, head_dim=64)[:3])
    with torch._subclasses.fake_tensor.FakeTensorMode() as mode:
        out, lse = flash_attention4.fa4_attention_with_lse(*(mode.from_tensor(x) for x in (query, key, value)))
    assert out.shape == (2, 5, 2, 64) and out.dtype == torch.bfloat16
    assert lse.shape == (2, 2, 5) and lse.dtype == torch.float32


INSTALL = re.escape('pip install flash-attn-4==4.0.0b36 "nvidia-cutlass-dsl[cu13]"')


def test_blackwell_without_fa4_defaults_to_sdpa_and_refuses_fa_saying_how_to_install(blackwell, monkeypatch, caplog):
    """A B200 without flash-attn-4: the default warns how to install it and runs SDPA; an explicit "fa" (or "fa4")
    is refused with the pip command or torch_sdpa; nothing is routed to FA4 (or FA3) afterwards."""
    import logging

    from k6serve.ops import flash_attention4

    monkeypatch.setattr(flash_attention4, "load", lambda: (None, "flash-attn-4 could not be imported (x)"))
    with caplog.at_level(logging.WARNING, logger="k6serve.ops.attention"):
        assert resolve_attention_backend(None, "cuda") == "torch_sdpa"
    assert re.search(rf"sm_100 \(datacenter Blackwell\), it runs FlashAttention-4 .*could not be imported \(x\).*"
                     rf"runs on torch_sdpa.*{INSTALL}", caplog.text)
    for name, said in (("fa", "'fa'"), ("fa4", r"'fa4' \(an alias of 'fa'\)")):
        with pytest.raises(ValueError, match=rf"attention backend {said} \(FlashAttention\) cannot run here: on this "
                                             rf"GPU, sm_100 \(datacenter Blackwell\), it runs FlashAttention-4.*could "
                                             rf"not be imported \(x\). Install it with `{INSTALL}`, or use "
                                             rf"--attention-backend torch_sdpa."):
            resolve_attention_backend(name, "cuda")
    assert not flash_attention4.replaces_fa3() and not flash_attention4.wanted(128)
    assert blackwell.probed == []


def test_blackwell_fa4_switched_off_or_failing_its_probe_says_what_to_do(blackwell, monkeypatch, caplog):
    """$K6SERVE_FA4=0 on Blackwell leaves no FlashAttention kernel: "fa" says to unset it. An installed FA4 that fails
    its probe: SDPA by default, and "fa" names the failure; no "FA3 keeps every call" warning, there is no FA3."""
    import logging

    from k6serve.ops import flash_attention4

    monkeypatch.setattr(flash_attention4, "MODE", "0")
    with pytest.raises(ValueError, match=r"K6SERVE_FA4=0 turns FlashAttention-4 off. Unset K6SERVE_FA4, or use "
                                         r"--attention-backend torch_sdpa."):
        resolve_attention_backend("fa", "cuda")
    assert resolve_attention_backend(None, "cuda") == "torch_sdpa"

    def failing_probe(device, head_dim, **options):
        raise RuntimeError("cutlass JIT: no kernel image")

    monkeypatch.setattr(flash_attention4, "MODE", "auto")
    monkeypatch.setattr(flash_attention4, "probe", failing_probe)
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        assert resolve_attention_backend(None, "cuda") == "torch_sdpa"
    assert "failed its probe (RuntimeError: cutlass JIT: no kernel image)" in caplog.text
    assert "FA3 keeps every attention call" not in caplog.text
    with pytest.raises(ValueError, match=r"failed its probe .*Check the flash-attn-4 install"):
        resolve_attention_backend("fa", "cuda")
    assert not flash_attention4.replaces_fa3()


def test_fa_fp8_on_blackwell_says_it_is_hopper_only_and_offers_fa(blackwell):
    with pytest.raises(ValueError, match=r"'fa_fp8' \(FlashAttention-3\) cannot run here: the fa3-fwd kernels are "
                                         r"built for Hopper \(sm_90\) only and this GPU is sm_100. Use "
                                         r"--attention-backend fa \(FlashAttention-4 on this GPU\) or torch_sdpa."):
        resolve_attention_backend("fa_fp8", "cuda")


def test_hopper_keeps_fa3_for_128_wide_heads_and_for_ring_attention(monkeypatch):
    """Blackwell support changes nothing on Hopper: FA4 (installed, probed) takes only the 64-wide plain calls, FA3
    the 128-wide ones and every lse call."""
    from k6serve.ops import flash_attention4

    fa4, fa3_calls, probed = _StandInFA4(), [], []

    def fa3(query_BLHD, key_BSHD, value_BSHD, return_attn_probs=False):
        fa3_calls.append((query_BLHD.shape[-1], return_attn_probs))
        out, lse = _math_reference(query_BLHD, key_BSHD, value_BSHD)
        return (out.to(query_BLHD.dtype), lse.float()) if return_attn_probs else out.to(query_BLHD.dtype)

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(attention_ops, "_load_fa3", lambda: (fa3, ""))
    monkeypatch.setattr(attention_ops, "_FA3_FUNCTION", fa3)
    monkeypatch.setattr(attention_ops, "_uses_fa3", lambda backend, query, mask: backend == "fa" and mask is None)
    _fa4_stand_in(monkeypatch, fa4, lambda device, head_dim, with_lse=False: probed.append((head_dim, with_lse)))
    assert resolve_attention_backend(None, "cuda") == "fa"
    assert probed == [(64, False)] and not flash_attention4.replaces_fa3()
    for head_dim, plain in ((64, "fa4"), (128, "fa3")):
        fa4.calls.clear()
        fa3_calls.clear()
        query, key, value, _ = _inputs(head_dim=head_dim)
        attention(query, key, value, backend="fa4")  # the alias picks no kernel
        attention_with_lse(query, key, value, backend="fa")
        assert (fa4.calls, fa3_calls) == (([(64, False)], [(64, True)]) if plain == "fa4"
                                          else ([], [(128, False), (128, True)]))


def test_fa3_and_fa4_are_aliases_of_fa_everywhere_a_backend_is_named():
    """The reference's spellings: the ops, InnerAttention, the config (Python API) and both CLI commands accept them,
    as the name "fa"; the unknown-backend error lists them."""
    from k6serve.cli.config_file import merged_options
    from k6serve.cli.flags import build_parser, split_options
    from k6serve.config import ATTENTION_BACKENDS, RuntimeConfig
    from k6serve.engine_arguments import build_engine_config

    assert {"fa3", "fa4"} <= set(ATTENTION_BACKENDS)
    for name in ("fa3", "fa4"):
        assert attention_ops.canonical_backend_name(name) == "fa"
        assert InnerAttention("video_self", backend=name).backend == "fa"
        assert RuntimeConfig(attention_backend=name).attention_backend == name
        assert build_engine_config("demo", device="cpu", attention_backend=name).runtime.attention_backend == name
        for command in ("generate", "serve"):
            parser = build_parser()
            args = parser.parse_args([command, "--model-path", "demo", "--attention-backend", name])
            engine, _ = split_options(merged_options(args, parser))
            assert engine["attention_backend"] == name
        with pytest.raises(ValueError, match=rf"'{name}' \(an alias of 'fa'\) \(FlashAttention\) cannot run here: "
                                             r"it needs a CUDA GPU"):
            resolve_attention_backend(name, "cpu")
    with pytest.raises(ValueError, match=r"unknown attention backend 'fa5'.*aliases 'fa3', 'fa4'"):
        attention_ops.canonical_backend_name("fa5")
