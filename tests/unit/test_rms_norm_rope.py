"""The fused per-head RMSNorm + RoPE op (`k6serve.ops.rms_norm_rope`): the CPU path is the model's own code, the
Triton kernel (run by Triton's interpreter on the CPU) matches it to bf16 rounding, and the speed transform that
routes the generation DiT's Q/K through it falls back to the model's ops wherever the kernel does not apply."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn

from k6serve.models.common.rope import RotaryEmbedding3D, apply_rotary
from k6serve.ops import rms_norm_rope as op
from k6serve.ops.rms_norm_rope import default_eps, rms_norm_rope, supports


def _inputs(batch=2, grid=(2, 3, 5), heads=3, head_dim=16, axes=(4, 6, 6), seed=0):
    """Q as the query slice of a fused QKV output (strided), an RMSNorm with a random weight, a 3-D RoPE table."""
    generator = torch.Generator().manual_seed(seed)
    tokens = grid[0] * grid[1] * grid[2]
    qkv = torch.randn(batch, tokens, 3 * heads * head_dim, generator=generator).to(torch.bfloat16)
    query = qkv[..., : heads * head_dim].unflatten(-1, (heads, head_dim))
    norm = nn.RMSNorm(head_dim).to(torch.bfloat16)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(head_dim, generator=generator) + 0.5)
    rope = RotaryEmbedding3D(axes)(tuple(torch.arange(n) for n in grid), (1.0, 2.0, 2.0)).flatten(0, 2)
    return query, norm, rope


def test_cpu_op_is_the_models_norm_then_rotation_bit_for_bit():
    query, norm, rope = _inputs()
    expected = apply_rotary(norm(query), rope)
    out = rms_norm_rope(query, norm.weight, default_eps(norm.eps, query.dtype), rope, torch.bfloat16)
    assert out.is_contiguous() and torch.equal(out, expected)
    assert not supports(query, norm.weight, rope)  # CPU tensors: the kernel is CUDA-only


def test_op_compiles_without_graph_breaks():
    query, norm, rope = _inputs()

    @torch.compile(backend="eager", fullgraph=True)
    def heads(q):
        return rms_norm_rope(q * 1, norm.weight, 2.0**-7, rope, torch.bfloat16)

    assert torch.equal(heads(query), rms_norm_rope(query, norm.weight, 2.0**-7, rope, torch.bfloat16))


@pytest.mark.parametrize("variant", ["", "rows", "tokens"])
def test_op_lowers_through_inductor(variant):
    """What the compiled DiT blocks do with the op: inductor (not only dynamo) lowers it as a fallback kernel. An op
    argument named `kernel` once collided with `FallbackKernel.create(kernel, ...)` and failed every compiled graph
    on the GPU; the CPU lowering goes through the same code."""
    query, norm, rope = _inputs()

    @torch.compile(backend="inductor", fullgraph=True)
    def heads(q):
        return rms_norm_rope(q * 1, norm.weight, 2.0**-7, rope, torch.bfloat16, variant)

    with torch.inference_mode():
        assert torch.equal(heads(query), rms_norm_rope(query, norm.weight, 2.0**-7, rope, torch.bfloat16))
    torch._dynamo.reset()


_INTERPRETED = textwrap.dedent('''
    import torch
    from torch import nn
    from k6serve.models.common.rope import RotaryEmbedding3D
    from k6serve.ops.rms_norm_rope import launch, rms_norm_rope_reference

    # Head counts below and above a power of two, so the "tokens" kernel's head mask is exercised; 20 x 128 takes
    # two of its head blocks per token (16 heads each), the second one partly masked.
    for batch, grid, heads, head_dim, axes in ((1, (2, 3, 5), 3, 16, (4, 6, 6)), (2, (3, 2, 4), 5, 64, (16, 24, 24)),
                                               (1, (1, 2, 3), 2, 128, (32, 48, 48)),
                                               (2, (1, 2, 2), 20, 128, (32, 48, 48))):
        generator = torch.Generator().manual_seed(head_dim)
        tokens = grid[0] * grid[1] * grid[2]
        qkv = torch.randn(batch, tokens, 3 * heads * head_dim, generator=generator).to(torch.bfloat16)
        query = qkv[..., : heads * head_dim].unflatten(-1, (heads, head_dim))
        weight = (torch.rand(head_dim, generator=generator) + 0.5).to(torch.bfloat16)
        rope = RotaryEmbedding3D(axes)(tuple(torch.arange(n) for n in grid), (1.0, 2.0, 2.0)).flatten(0, 2)
        eps = 2.0 ** -7
        # bf16: the generation DiT's norm; fp32: the SR DiT's (its norm runs on the fp32 cast of x).
        for norm_dtype in (torch.bfloat16, torch.float32):
            expected = rms_norm_rope_reference(query, weight, eps, rope, norm_dtype).float()
            for kernel in ("rows", "tokens"):
                out = launch(query, weight, eps, rope, kernel).float()
                assert out.shape == expected.shape, (out.shape, expected.shape)
                difference = (out - expected).abs()
                # bf16 keeps 8 significant bits: a different fp32 summation order may flip the last one.
                assert (difference <= expected.abs() * 2.0 ** -7 + 1e-6).all(), (kernel, difference.max())
                assert not out.isnan().any()
                print(kernel, head_dim, norm_dtype, "equal share", (difference == 0).float().mean().item())
''')


def test_triton_kernel_matches_the_reference_in_the_interpreter():
    pytest.importorskip("triton")
    completed = subprocess.run([sys.executable, "-c", _INTERPRETED], check=False, capture_output=True, text=True,
                               timeout=300, env=os.environ | {"TRITON_INTERPRET": "1"})
    assert completed.returncode == 0, completed.stderr[-3000:]
    shares = [float(line.split()[-1]) for line in completed.stdout.splitlines() if "equal share" in line]
    # Nearly every value bit for bit, for both kernels and both norm dtypes.
    assert len(shares) == 16 and min(shares) > 0.99, completed.stdout


def test_speed_transform_falls_back_off_cuda():
    from k6serve.models.kandinsky6.attention import Kandinsky6Attention
    from k6serve.speed.fused_projections import apply_fused_norm_rope, apply_fused_projections

    torch.manual_seed(0)
    holder = nn.Module()
    holder.attention = Kandinsky6Attention(48, 16, role="video_self").to(torch.bfloat16)
    _, _, rope = _inputs(heads=3, head_dim=16)
    x = torch.randn(2, rope.shape[0], 48).to(torch.bfloat16)
    with torch.no_grad():
        expected = holder.attention(x, query_rope=rope, key_rope=rope)
        assert apply_fused_projections(holder) == 1
        unfused_kernel = holder.attention(x, query_rope=rope, key_rope=rope)
        assert apply_fused_norm_rope(holder) == 1 and holder.attention.fused_norm_rope
        fused_kernel = holder.attention(x, query_rope=rope, key_rope=rope)
    assert torch.equal(fused_kernel, unfused_kernel)  # CPU: the model's own ops ran
    assert (fused_kernel.float() - expected.float()).abs().max() < 0.05  # fused GEMM rounding only


def test_sr_attention_fp32_norm_path_is_the_ops_reference_and_falls_back_off_cuda():
    from k6serve.models.kandinsky6_sr.transformer import SelfAttention
    from k6serve.ops.rms_norm_rope import rms_norm_rope_reference
    from k6serve.speed.fused_projections import apply_fused_norm_rope, apply_fused_projections

    torch.manual_seed(1)
    holder = nn.Module()
    holder.attention = SelfAttention(64, 16).to(torch.bfloat16)
    query, _, rope = _inputs(heads=4, head_dim=16)
    norm = holder.attention.query_norm
    # The SR DiT normalises fp32 heads (eps: fp32's epsilon) and rounds back before the rotation.
    expected = holder.attention.normed_rotated_heads(query.flatten(-2), norm, rope)
    reference = rms_norm_rope_reference(query, norm.weight, default_eps(norm.eps, torch.float32), rope, torch.float32)
    assert torch.equal(reference, expected)
    x = torch.randn(2, rope.shape[0], 64).to(torch.bfloat16)
    with torch.no_grad():
        assert apply_fused_projections(holder) == 1
        unfused_kernel = holder.attention(x, rope)
        assert apply_fused_norm_rope(holder) == 1 and holder.attention.fused_norm_rope
        assert torch.equal(holder.attention(x, rope), unfused_kernel)  # CPU: the model's own ops ran


@pytest.mark.parametrize("head_dim", [64, 128])
def test_triton_kernel_compiles_for_hopper_with_vector_loads_and_no_spills(head_dim, monkeypatch):
    """The interpreter checks the kernel's values; this checks what only the GPU compiler sees: the kernel
    compiles to an sm_90 cubin (no GPU needed), with 16-byte-aligned arguments (as Triton specialises real launches
    whose pointers and strides divide by 16) its global loads and stores are vectorised, and nothing spills."""
    import re

    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    monkeypatch.setenv("TRITON_DEFAULT_FP_FUSION", "1")
    signature = {"x_ptr": "*bf16", "weight_ptr": "*bf16", "rope_ptr": "*fp32", "out_ptr": "*bf16", "rows": "i32",
                 "length": "i32", "num_heads": "i32", "x_batch_stride": "i64", "x_token_stride": "i64",
                 "eps": "fp32", "HEAD_DIM": "constexpr", "ROWS": "constexpr"}
    aligned = {(index,): [["tt.divisibility", 16]] for index in (0, 1, 2, 3, 7, 8)}
    source = ASTSource(fn=op._rms_norm_rope_kernel, signature=signature, attrs=aligned,
                       constexprs={"HEAD_DIM": head_dim, "ROWS": op._rows_per_program(head_dim)})
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
    ptx = compiled.asm["ptx"]
    assert compiled.asm["cubin"]
    assert re.search(r"ld\.global(\.\w+)*\.v4", ptx) and re.search(r"st\.global(\.\w+)*\.v\d", ptx)
    # At most the weight row (HEAD_DIM values shared by all rows) comes in scalar bf16 loads; x never does.
    assert len(re.findall(r"ld\.global(?:\.\w+)*\.b16 ", ptx)) <= 1
    assert ".local" not in ptx  # no register spills


@pytest.mark.parametrize("head_dim,num_heads", [(64, 28), (128, 32)])
def test_tokens_kernel_compiles_for_hopper_without_shared_memory_round_trips(head_dim, num_heads, monkeypatch):
    """The token-major kernel at the Lite (28 x 64) and Pro (32 x 128) head shapes: an sm_90 cubin whose x loads
    and stores are 16-byte vectors, with no shared-memory layout conversion (no barrier) and no spill (with
    64-wide heads it measured faster than the "rows" kernel, with 128-wide ones slower: `kernel_for`)."""
    import re

    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    monkeypatch.setenv("TRITON_DEFAULT_FP_FUSION", "1")
    signature = {"x_ptr": "*bf16", "weight_ptr": "*bf16", "rope_ptr": "*fp32", "out_ptr": "*bf16", "length": "i32",
                 "num_heads": "i32", "x_batch_stride": "i64", "x_token_stride": "i64", "eps": "fp32",
                 "HEAD_DIM": "constexpr", "HEADS": "constexpr"}
    aligned = {(index,): [["tt.divisibility", 16]] for index in (0, 1, 2, 3, 6, 7)}
    heads = op._heads_per_program(head_dim, num_heads)
    source = ASTSource(fn=op._rms_norm_rope_tokens_kernel, signature=signature, attrs=aligned,
                       constexprs={"HEAD_DIM": head_dim, "HEADS": heads})
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 8})
    ptx = compiled.asm["ptx"]
    assert compiled.asm["cubin"] and heads * head_dim == 2048
    assert re.search(r"ld\.global(\.\w+)*\.v4", ptx) and re.search(r"st\.global(\.\w+)*\.v4", ptx)
    assert "bar.sync" not in ptx and "st.shared" not in ptx
    assert ".local" not in ptx


def test_unknown_kernel_name_is_refused():
    pytest.importorskip("triton")
    from k6serve.ops.rms_norm_rope import launch

    query, norm, rope = _inputs()
    with pytest.raises(ValueError, match="kernel must be one of"):
        launch(query, norm.weight, 1e-6, rope, "columns")


def test_kernel_choice_follows_the_head_dim_unless_forced(monkeypatch):
    """Default "auto": the token-major kernel up to 64-wide heads (Lite, SR DiT), row blocks above (Pro), as
    measured on the H200; an explicit variant or $K6SERVE_NORM_ROPE_KERNEL forces one; a bad name says the valid
    ones."""
    monkeypatch.setattr(op, "KERNEL", "auto")
    assert [op.kernel_for(d) for d in (32, 64, 128)] == ["tokens", "tokens", "rows"]
    assert op.kernel_for(64, "rows") == "rows" and op.kernel_for(128, "tokens") == "tokens"
    monkeypatch.setattr(op, "KERNEL", "rows")
    assert op.kernel_for(64) == "rows"
    assert op.kernel_for(64, "auto") == "tokens"
    with pytest.raises(ValueError, match=r"kernel must be one of \('auto', 'rows', 'tokens'\), got 'row'"):
        op.kernel_for(64, "row")
