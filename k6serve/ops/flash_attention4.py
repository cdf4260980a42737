"""FlashAttention-4 (`flash-attn-4`, CuTe-DSL kernels, JIT-compiled on first use) in place of FA3 where it is faster.

Why: on the H200 FA4's SM90 forward kernel beats FA3 with 64-wide heads (Lite's and the SR DiT's 28 x 64 video
self-attention: 29.8 ms, 545 TFLOP/s, against 30.7 ms, 529) and loses with 128-wide ones (Pro's 32 x 128: 663
against 691 TFLOP/s; sixth session, docs/benchmarks.md). In the Lite-distill DiT that is 1.355 -> 1.320 s per
forward, in the SR DiT 1.201 -> 1.178 s per call. So `K6SERVE_FA4` (read at import) chooses:

* unset or "auto" (default): a call that would run FA3 (backend "fa", no key mask, CUDA bf16) runs FA4 when its
  head dim is one where FA4 measured faster (`FASTER_HEAD_DIMS`) and flash-attn-4 imported and passed a small
  probe call when the backend was resolved (`prepare()`); otherwise FA3. Without flash-attn-4 installed, or with
  one that fails the probe (logged as a warning), nothing changes.
* "1": every call that would run FA3 runs FA4 (a clear error at backend resolution if it cannot be imported or
  fails the probe): for benchmarks.
* "0": never FA4.

The same math (softmax attention, scale 1/sqrt(D)); only the kernel, and so the rounding, differs (max 0.00024
from FA3 on unit-normal inputs, like FA3 from cuDNN). FA4 JIT-compiles a kernel per compile key (dtype, head dims,
tile: no sequence length or head count, read from FA4's source); `prepare()`'s probe runs at model load, when the
backend is resolved, and by that key compiles the kernels of the head dims FA4 will take, so requests should not
wait for them (`probe`; not yet timed on the GPU).

On datacenter Blackwell (sm_100 B200/GB200, sm_103 B300/GB300) FA3 cannot run (fa3-fwd ships sm_90a kernels only),
so there FA4 is the "fa" backend's kernel: `prepare(device, every_call=True)` (ops/attention.py decides) makes it take
every call FA3 would take on Hopper, of every head dim, and Ring attention's (out, lse) calls too
(`fa4_attention_with_lse`); a failure there is returned to the resolution, which falls back to SDPA (default) or
refuses "fa" (explicit), since no FA3 stands behind it. That path is CPU-tested dispatch only (no Blackwell GPU was
available): the probe at load is what guards the kernels.

The call goes through the custom op `k6serve::fa4_attention`, so a compiled block keeps one graph around it
(dynamo does not trace into FA4's Python launcher or its JIT), and `wanted()` reads module state only: the import
happens eagerly in `prepare()`, never while dynamo traces (see `_FA3_FUNCTION` in ops/attention.py for what an
import traced by dynamo costs).
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

logger = logging.getLogger(__name__)

ENVIRONMENT_VARIABLE = "K6SERVE_FA4"
MODES = ("auto", "1", "0")
MODE = os.environ.get(ENVIRONMENT_VARIABLE, "").strip() or "auto"
if MODE not in MODES:
    raise ValueError(f"${ENVIRONMENT_VARIABLE} must be one of {MODES} (unset means 'auto'), got {MODE!r}")
# Head dims where FA4 measured faster than FA3 on the H200 (64: 545 vs 529 TFLOP/s; 128: 663 vs 691).
FASTER_HEAD_DIMS = (64,)
# Optional FA4 tile per head dim ("128:128x176,64:192x192:ol"): FA4 picks its SM90 forward tile by head dim alone
# (128 x 128 for 128-wide heads, where FA3's C++ picks 128 x 176), and `scripts/gpu_attention.py --fa4-tiles`
# times others (rows named "fa4 MxN rs ol"). A head dim listed here runs FA4 with that tile (also in "auto" mode),
# through FA4's private `_flash_attn_fwd(tile_mn=..., mma_pv_is_rs=..., intra_wg_overlap=...)`: the public
# `flash_attn_func` takes no tile. Flags after a second colon, joined by "+": "rs" (P@V from registers), "ol"
# (intra-warpgroup overlap), "none"; without them both are on (FA4's default). For measuring; unset by default.
TILES_ENVIRONMENT_VARIABLE = "K6SERVE_FA4_TILES"
_TILE_FLAGS = {"rs+ol": (True, True), "ol+rs": (True, True), "rs": (True, False), "ol": (False, True),
               "none": (False, False)}


def parse_tiles(text: str) -> dict[int, tuple[int, int, bool, bool]]:
    """"HEAD_DIM:MxN[:FLAGS][,...]" -> {head_dim: (tile_m, tile_n, mma_pv_is_rs, intra_wg_overlap)}; a ValueError
    saying the format if malformed."""
    tiles: dict[int, tuple[int, int, bool, bool]] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        head_dim, _, rest = item.partition(":")
        tile, _, flags = rest.partition(":")
        tile_m, _, tile_n = tile.partition("x")
        numbers_ok = all(value.strip().isdigit() and int(value) > 0 for value in (head_dim, tile_m, tile_n))
        if not numbers_ok or (flags or "rs+ol") not in _TILE_FLAGS:
            raise ValueError(
                f"${TILES_ENVIRONMENT_VARIABLE} takes HEAD_DIM:MxN[:FLAGS] items separated by commas, FLAGS one of "
                f"{sorted(_TILE_FLAGS)} (default rs+ol), e.g. '128:128x176,64:192x192:ol'; got {item!r} in {text!r}"
            )
        tiles[int(head_dim)] = (int(tile_m), int(tile_n), *_TILE_FLAGS[flags or "rs+ol"])
    return tiles


TILES = parse_tiles(os.environ.get(TILES_ENVIRONMENT_VARIABLE, ""))
# True once `prepare()` imported FA4 and its probe passed on the device; read by `wanted()` (module state only, so
# compiled regions never trace the import).
_READY = False
# True once `prepare(every_call=True)` succeeded (datacenter Blackwell): FA4 then replaces FA3 in every call.
_EVERY_CALL = False
# What to install, in the errors and warnings that ask for FA4 (the version k6serve was written against, performance.md
# §6; its JIT needs the CUDA 13 cutlass-dsl libraries).
INSTALL_COMMAND = 'pip install flash-attn-4==4.0.0b36 "nvidia-cutlass-dsl[cu13]"'


# Any: the kernel wheels have no type information; their functions return a tensor or a tuple of them.
@functools.cache
def load() -> tuple[Callable[..., Any] | None, str]:
    """FA4's `flash_attn_func` once; (function, "") or (None, why it could not be imported)."""
    try:
        from flash_attn.cute.interface import flash_attn_func
    except Exception as error:  # noqa: BLE001 - any import failure (missing wheel, CUDA libs) is reported alike
        return None, f"flash-attn-4 could not be imported ({type(error).__name__}: {error})"
    return flash_attn_func, ""


@functools.cache
def load_tiled() -> Callable[..., Any]:
    """FA4's private `_flash_attn_fwd`, which takes `tile_mn` (for `TILES`); a ValueError if this FA4 lacks it."""
    try:
        from flash_attn.cute.interface import _flash_attn_fwd
    except Exception as error:
        raise ValueError(
            f"${TILES_ENVIRONMENT_VARIABLE} needs flash-attn-4's _flash_attn_fwd(tile_mn=...) "
            f"({type(error).__name__}: {error}); unset {TILES_ENVIRONMENT_VARIABLE}"
        ) from error
    return _flash_attn_fwd


def prepare(device: torch.device | str | None = None, *, every_call: bool = False) -> str | None:
    """Import FA4 now (eagerly) if `MODE` may use it, and on a CUDA `device` run `probe` for each head dim it will
    take; called where the "fa" backend is resolved. Returns why FA4 will not run, or None when it will. In "auto"
    mode a failure only logs a warning and FA3 keeps every call: an installed but broken FA4 (its JIT needs the
    CUDA 13 cutlass-dsl libraries and a matching driver) must not fail requests that FA3 would serve. With
    $K6SERVE_FA4=1 it raises instead.

    `every_call=True` (datacenter Blackwell, where FA3 cannot run): FA4 takes every call FA3 would take, so every head
    dim is probed, and a failure is returned without the warning: the caller falls back to SDPA or refuses "fa"."""
    global _READY, _EVERY_CALL
    _READY = _EVERY_CALL = False
    if MODE == "0":
        return f"${ENVIRONMENT_VARIABLE}=0"
    function, reason = load()
    if function is None:
        if MODE == "1":  # asked for explicitly: fail when the backend is resolved, not in the first request
            raise ValueError(_missing_message(reason))
        return reason
    if device is not None and torch.device(device).type == "cuda":
        every_head_dim = MODE == "1" or every_call
        head_dims = sorted({64, 128, *TILES}) if every_head_dim else sorted({*FASTER_HEAD_DIMS, *TILES})
        try:
            for head_dim in head_dims:
                # On Blackwell Ring attention's (out, lse) calls run FA4 too: probed as well, so a broken lse path
                # is found at load, not in a request.
                probe(torch.device(device), head_dim, with_lse=every_call)
        except Exception as error:
            reason = f"flash-attn-4 imported but failed its probe ({type(error).__name__}: {error})"
            if MODE == "1":
                raise ValueError(_missing_message(reason)) from error
            if not every_call:
                logger.warning("%s; FA3 keeps every attention call", reason)
            return reason
    _READY, _EVERY_CALL = True, every_call
    logger.info(
        "FlashAttention-4 ready: it runs the FA3 calls %s ($%s=%s)",
        "of every head dim" if MODE == "1" or every_call else f"with head dims {sorted({*FASTER_HEAD_DIMS, *TILES})}",
        ENVIRONMENT_VARIABLE, MODE,
    )
    if TILES:
        logger.info("FlashAttention-4 tiles from $%s: %s", TILES_ENVIRONMENT_VARIABLE, TILES)
    return None


def probe(device: torch.device, head_dim: int, tokens: int = 384, heads: int = 2, *, with_lse: bool = False) -> None:
    """One small FA4 call at `head_dim`, checked against SDPA; raises if it fails or is wrong. It also JIT-compiles
    the kernel the requests use: FA4's compile key (flash_attn/cute/interface.py) holds the dtype, head dims, the
    Q-per-KV head ratio, tile and split-KV choice, but no sequence length or head count, and `flash_attn_func` never
    splits KV (num_splits=1), so a 384-token, 2-head call should compile the same kernel as a 47,616-token one
    (read from the source; the next GPU run's first-call times will show it)."""
    generator = torch.Generator(device=device).manual_seed(0)
    query, key, value = (
        torch.randn(1, tokens, heads, head_dim, device=device, dtype=torch.bfloat16, generator=generator)
        for _ in range(3)
    )
    with torch.inference_mode():
        out = fa4_attention(query, key, value)
        expected = torch.nn.functional.scaled_dot_product_attention(
            query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)
        ).transpose(1, 2)
    difference = (out.float() - expected.float()).abs().max().item()
    # bf16 outputs of unit-normal inputs: honest kernels differ by at most ~0.002 (head dim 64) / 0.004 (128) here
    # (a CPU simulation with P rounded to bf16); 0.01 still fails a 5% error in a share of the exponentials.
    logger.info("FlashAttention-4 probe at head dim %d: max difference from SDPA %.3g", head_dim, difference)
    if not difference <= 0.01:
        raise RuntimeError(f"its output differs from SDPA's by {difference:.3g} at head dim {head_dim}")
    if with_lse:
        with torch.inference_mode():
            out_lse, lse_BHL = fa4_attention_with_lse(query, key, value)
            scores_BHLS = torch.einsum("blhd,bshd->bhls", query.float(), key.float()) / head_dim**0.5
            expected_lse = torch.logsumexp(scores_BHLS, dim=-1)
        lse_difference = (lse_BHL.float() - expected_lse).abs().max().item()
        out_difference = (out_lse.float() - expected.float()).abs().max().item()
        # fp32 log-sum-exps of bf16 scores: an honest kernel is within ~1e-3 of the fp32 math here.
        if not (lse_difference <= 0.01 and out_difference <= 0.01):
            raise RuntimeError(f"its (out, lse) call differs from the math by {out_difference:.3g} / "
                               f"{lse_difference:.3g} at head dim {head_dim}")


def wanted(head_dim: int) -> bool:
    """Whether a call that would run FA3 runs FA4 instead. Module state only: safe inside compiled regions."""
    if MODE == "1":
        return True
    return MODE == "auto" and _READY and (_EVERY_CALL or head_dim in FASTER_HEAD_DIMS or head_dim in TILES)


def replaces_fa3() -> bool:
    """Whether FA4 runs every call FA3 would run, Ring attention's (out, lse) ones included: on datacenter Blackwell
    once `prepare(every_call=True)` succeeded. On Hopper FA3 keeps the lse calls. Module state only."""
    return _READY and _EVERY_CALL


def _missing_message(reason: str) -> str:
    return (
        f"{ENVIRONMENT_VARIABLE}=1 asks for FlashAttention-4 but {reason}; install it with `{INSTALL_COMMAND}`, "
        f"or unset {ENVIRONMENT_VARIABLE} (on Hopper FA3 then runs where FA4 is missing)"
    )


@torch.library.custom_op("k6serve::fa4_attention", mutates_args=())
def fa4_attention(query_BLHD: Tensor, key_BSHD: Tensor, value_BSHD: Tensor) -> Tensor:
    """Softmax attention with scale 1/sqrt(D) by FA4; (B, L, H, D) in, (B, L, H, D) out."""
    function, reason = load()
    if function is None:
        raise ValueError(_missing_message(reason))
    tile = TILES.get(query_BLHD.shape[-1])
    if tile is not None:
        tile_m, tile_n, mma_pv_is_rs, intra_wg_overlap = tile
        out = load_tiled()(  # (out, lse, ...); scale 1/sqrt(D) as in flash_attn_func
            query_BLHD, key_BSHD, value_BSHD, tile_mn=(tile_m, tile_n), mma_pv_is_rs=mma_pv_is_rs,
            intra_wg_overlap=intra_wg_overlap,
        )
    else:
        out = function(query_BLHD, key_BSHD, value_BSHD)
    return (out[0] if isinstance(out, tuple) else out).contiguous()  # FA4 returns (out, lse)


@fa4_attention.register_fake
def _(query_BLHD: Tensor, key_BSHD: Tensor, value_BSHD: Tensor) -> Tensor:
    return query_BLHD.new_empty((*query_BLHD.shape[:-1], value_BSHD.shape[-1]))


@torch.library.custom_op("k6serve::fa4_attention_with_lse", mutates_args=())
def fa4_attention_with_lse(query_BLHD: Tensor, key_BSHD: Tensor, value_BSHD: Tensor) -> tuple[Tensor, Tensor]:
    """`fa4_attention` that also returns the fp32 log-sum-exp of the scaled scores, (B, H, L), for Ring attention.

    FA4's `flash_attn_func(..., return_lse=True)` returns (out, lse) with lse (B, H, L) float32 in natural log
    (flash_attn/cute/interface.py, 4.0.0b36: `lse_shape = (batch_size, num_head, seqlen_q)`; the kernels multiply
    the log2 sum by ln 2), the layout and base of FA3's. $K6SERVE_FA4_TILES is not applied here: it is for timing
    the plain forward."""
    function, reason = load()
    if function is None:
        raise ValueError(_missing_message(reason))
    out_BLHD, lse_BHL = function(query_BLHD, key_BSHD, value_BSHD, return_lse=True)[:2]
    return out_BLHD.contiguous(), lse_BHL.float().contiguous()


@fa4_attention_with_lse.register_fake
def _(query_BLHD: Tensor, key_BSHD: Tensor, value_BSHD: Tensor) -> tuple[Tensor, Tensor]:
    batch, length, num_heads, _ = query_BLHD.shape
    return (query_BLHD.new_empty((batch, length, num_heads, value_BSHD.shape[-1])),
            query_BLHD.new_empty((batch, num_heads, length), dtype=torch.float32))
