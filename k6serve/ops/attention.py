"""The single attention dispatch point: every attention in k6serve models ends in `attention()`.

Semantics: non-causal softmax attention with scale 1/sqrt(head_dim). A boolean key mask (True = attend)
masks keys only, exactly like diffusers' native dispatch ((B, Lk) viewed as (B, 1, 1, Lk)). Every row
must keep at least one key.

Backends (the names the seeds and `--attention-backend` use):
* "torch_sdpa" (alias "sdpa"): `F.scaled_dot_product_attention`. On CUDA it prefers cuDNN attention
  (fastest torch kernel on Hopper, performance.md §2.2), then flash, efficient, math. On CPU it is the
  exact call diffusers makes, so CPU outputs are bitwise equal to diffusers.
* "fa" (aliases "fa3", "fa4": the reference's spellings, names only; $K6SERVE_FA4 chooses the kernel): on Hopper,
  FlashAttention-3 forward from the `fa3-fwd` wheel (sm_90 kernels, bf16; the wheel is built without fp16); with
  64-wide heads FlashAttention-4 instead when `flash-attn-4` is installed, where it measured faster
  (ops/flash_attention4.py). On datacenter Blackwell (sm_100 B200/GB200, sm_103 B300/GB300), where fa3-fwd's sm_90a
  kernels cannot run, FlashAttention-4 takes every one of those calls, Ring attention's (out, lse) ones included
  (CPU-tested dispatch only: no Blackwell GPU was available; FA4's probe at load guards the kernels). FA3 and FA4
  take no mask, so a call with a key mask, or with a dtype they cannot take, runs on "torch_sdpa" instead: the math
  is the same, only the kernel differs. In Kandinsky 6 that is the text self/cross-attentions with a padding mask;
  the large unmasked video self-attention stays on FlashAttention.
* "fa_fp8" (opt-in, lossy): "fa", except that the unmasked calls with at least 4,096 keys (the video
  self-attentions) run FA3's e4m3 kernel on per-head-scaled FP8 copies of Q, K and V (ops/fp8_attention.py).
  No performance mode picks it: its rounding is far coarser than bf16's. Hopper only (FA3's FP8 kernel).

Shape legend: B batch, L query length, S key length, H heads, D head dim.
"""

from __future__ import annotations

import functools
import logging
import math
import os
import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention import SDPBackend, sdpa_kernel

from k6serve.ops import flash_attention4, fp8_attention

logger = logging.getLogger(__name__)

FLASH_ATTENTION = "fa"
FLASH_ATTENTION_FP8 = "fa_fp8"
TORCH_SDPA = "torch_sdpa"
BACKENDS = (FLASH_ATTENTION, FLASH_ATTENTION_FP8, TORCH_SDPA)
_FLASH_BACKENDS = (FLASH_ATTENTION, FLASH_ATTENTION_FP8)
# "fa3" / "fa4" are the reference's spellings of "fa" (serving-reference.md), plain aliases as there: they do not pick
# a kernel (the GPU and $K6SERVE_FA4 do), so "fa3" on a B200 runs FA4 and "fa4" on an H200 runs FA3 for 128-wide heads.
_ALIASES = {"sdpa": TORCH_SDPA, "fa3": FLASH_ATTENTION, "fa4": FLASH_ATTENTION}

# The fa3-fwd 0.0.3 wheel ships sm_90a kernels only (performance.md §6); elsewhere it imports but cannot run.
_FA3_CAPABILITIES = ((9, 0),)
# Datacenter Blackwell, compute capability 10.x: sm_100 (B200, GB200) and sm_103 (B300, GB300). There "fa" runs FA4,
# which has SM100 kernels. Not sm_120 (RTX Blackwell): the reference maps FA to SDPA there, and flash-attn-4's SM120
# path is a different, smaller kernel that crashed in vLLM-Omni (performance.md §6).
_DATACENTER_BLACKWELL_MAJOR = 10
_FA3_DTYPES = (torch.bfloat16,)
# What to do where FlashAttention-3 is what the GPU runs but its wheel does not import (README, "FlashAttention").
FA3_INSTALL_FIX = "Install it with `pip install fa3-fwd` (it needs a CUDA 13 build of torch)"
_CUDA_SDPA_PRIORITY = [
    SDPBackend.CUDNN_ATTENTION,
    SDPBackend.FLASH_ATTENTION,
    SDPBackend.EFFICIENT_ATTENTION,
    SDPBackend.MATH,
]


# FA3 with few queries on many keys (Kandinsky 6's audio-from-video cross-attention: 218 audio queries on the
# 47,616 video keys) runs B x H x ceil(L / 128) CTAs, 32 for Pro's 16 audio heads on the H200's 132 SMs, unless the
# keys are split. FA3's own split heuristic (`num_splits=0`) is refused inside torch.compile, so the count is fixed
# here, from `scripts/gpu_splits.sh` (twentieth session, docs/benchmarks.md): at 218 x 47,616 four splits took
# 0.163 ms against 0.508 (Pro, 16 x 128) and 0.154 against 0.541 (Lite, 14 x 64), eight no better. In a whole Pro
# forward the gain is only 2-7 ms, though the kernel profile showed 38 ms saved: most likely the unsplit 32-CTA
# kernel shares the GPU with its neighbours (programmatic dependent launch), which the profiler's kernel
# serialisation prevents.
# $K6SERVE_FA3_SPLITS overrides it (1 = never split). Long-query calls always run unsplit.
FA3_SPLITS_ENVIRONMENT_VARIABLE = "K6SERVE_FA3_SPLITS"
DEFAULT_FA3_SHORT_QUERY_SPLITS = 4
# A call is "short-query" when its keys are at least this many times its queries and number at least
# SHORT_QUERY_MIN_KEYS: the split's combine pass is then negligible next to the keys' work.
SHORT_QUERY_KEY_RATIO = 16
SHORT_QUERY_MIN_KEYS = 4096


def _parse_splits(text: str) -> int:
    text = text.strip()
    if not text:
        return DEFAULT_FA3_SHORT_QUERY_SPLITS
    if not text.isdigit() or not 1 <= int(text) <= 64:
        raise ValueError(
            f"${FA3_SPLITS_ENVIRONMENT_VARIABLE} must be a whole number from 1 to 64 (FA3's key splits for "
            f"short-query attention; 1 = no split), got {text!r}; unset it for the measured default"
        )
    return int(text)


FA3_SHORT_QUERY_SPLITS = _parse_splits(os.environ.get(FA3_SPLITS_ENVIRONMENT_VARIABLE, ""))


def fa3_num_splits(query_length: int, key_length: int) -> int:
    """FA3's `num_splits` for a call: the fixed short-query count, else 1. Plain ints: safe inside compile."""
    if key_length >= SHORT_QUERY_MIN_KEYS and key_length >= SHORT_QUERY_KEY_RATIO * query_length:
        return FA3_SHORT_QUERY_SPLITS
    return 1


# FA3's `flash_attn_func` once imported. Compiled blocks read this global (dynamo guards on its identity, which
# never changes once set) instead of tracing `_load_fa3`: dynamo ignores the cache wrapper and traces the import
# statements and the `sys.modules` access inside, and the guards this installs on `sys.modules` fail as soon as
# any new module is imported. On the H200 that recompiled every block once in the first request after the
# compiling one (the cold request's decode and MP4 stages import modules): one Pro-distill step took 10.2 s
# instead of 5.9 (fourth session; reproduced on CPU in tests/unit/test_attention.py).
# Any: the kernel wheels have no type information; their functions return a tensor or a tuple of them.
_FA3_FUNCTION: Callable[..., Any] | None = None


@functools.cache
def _load_fa3() -> tuple[Callable[..., Any] | None, str]:
    """Import FA3's `flash_attn_func` once; returns (function, "") or (None, why it failed)."""
    global _FA3_FUNCTION
    try:
        import fa3_fwd_config

        # The wheel's interface imports `flash_attn_config` but ships it as `fa3_fwd_config`.
        sys.modules.setdefault("flash_attn_config", fa3_fwd_config)
        from fa3_fwd_interface import flash_attn_func
    except (ImportError, OSError) as error:
        return None, f"the fa3-fwd wheel could not be imported ({error})"
    _FA3_FUNCTION = flash_attn_func
    return flash_attn_func, ""


@torch.compiler.disable  # the import runs eagerly; normally done already when the backend was resolved
def _load_fa3_eagerly() -> tuple[Callable[..., Any] | None, str]:
    return _load_fa3()


def fa3_unavailable_reason(device: torch.device | str) -> str | None:
    """Why FlashAttention-3 cannot run on `device`, or None when it can."""
    device = torch.device(device)
    if device.type != "cuda":
        return f"it needs a CUDA GPU and the device is {device}"
    if not torch.cuda.is_available():
        return "CUDA is not available in this torch build"
    capability = torch.cuda.get_device_capability(device)
    if capability not in _FA3_CAPABILITIES:
        return (
            f"the fa3-fwd kernels are built for Hopper (sm_90) only and this GPU is "
            f"sm_{capability[0]}{capability[1]}"
        )
    flash_attn_func, reason = _load_fa3()
    return None if flash_attn_func is not None else reason


def _is_datacenter_blackwell(device: torch.device) -> bool:
    return (
        device.type == "cuda"
        and torch.cuda.is_available()
        and torch.cuda.get_device_capability(device)[0] == _DATACENTER_BLACKWELL_MAJOR
    )


def _architecture(device: torch.device) -> str:
    major, minor = torch.cuda.get_device_capability(device)
    name = {10: " (datacenter Blackwell)", 12: " (RTX Blackwell)"}.get(major, "")
    return f"sm_{major}{minor}{name}"


def prepare_flash_attention(device: torch.device | str) -> tuple[str, str] | None:
    """Get backend "fa" ready on `device`: None when it can run, else (why not, the fix other than SDPA, or "").

    Hopper: FA3 when fa3-fwd imports, plus FA4 for the head dims where it is faster if installed. Datacenter Blackwell:
    FA4 for every call, imported and probed here. Anywhere else no FlashAttention kernel k6serve uses can run."""
    device = torch.device(device)
    if _is_datacenter_blackwell(device):
        reason = flash_attention4.prepare(device, every_call=True)
        if reason is None:
            return None
        why = f"on this GPU, {_architecture(device)}, it runs FlashAttention-4 (fa3-fwd's kernels are Hopper only)"
        variable = flash_attention4.ENVIRONMENT_VARIABLE
        if reason == f"${variable}=0":
            return f"{why}, and ${variable}=0 turns FlashAttention-4 off", f"Unset {variable}"
        if flash_attention4.load()[0] is None:
            return f"{why}, but {reason}", f"Install it with `{flash_attention4.INSTALL_COMMAND}`"
        return f"{why}, but {reason}", (
            f"Check the flash-attn-4 install (`{flash_attention4.INSTALL_COMMAND}`; its JIT needs the CUDA 13 "
            f"cutlass-dsl libraries and a matching driver)"
        )
    if (
        device.type == "cuda"
        and torch.cuda.is_available()
        and torch.cuda.get_device_capability(device) not in _FA3_CAPABILITIES
    ):
        why = (
            f"k6serve's FlashAttention kernels run on Hopper (sm_90: FlashAttention-3 from fa3-fwd) and datacenter "
            f"Blackwell (sm_100, sm_103: FlashAttention-4) only, and this GPU is {_architecture(device)}"
        )
        return why, ""
    reason = fa3_unavailable_reason(device)
    if reason is not None:
        # On Hopper what is missing is the wheel: say how to get it.
        return reason, FA3_INSTALL_FIX if _hopper(device) else ""
    flash_attention4.prepare(device)
    return None


def canonical_backend_name(name: str) -> str:
    """Map an alias to its backend name; raise ValueError listing the valid names otherwise."""
    canonical = _ALIASES.get(name, name)
    if canonical not in BACKENDS:
        raise ValueError(
            f"unknown attention backend {name!r}; valid backends are 'fa' (FlashAttention: FA3 on Hopper, FA4 on "
            f"datacenter Blackwell; aliases 'fa3', 'fa4'), 'fa_fp8' (FlashAttention-3 in FP8 for the long "
            f"attentions, lossy, Hopper only) and 'torch_sdpa' (alias 'sdpa')"
        )
    return canonical


def _default_backend(device: torch.device) -> str:
    unavailable = prepare_flash_attention(device)
    if unavailable is None:
        return FLASH_ATTENTION
    if _is_datacenter_blackwell(device):  # the GPU FlashAttention is meant for here: say what is missing
        why, fix = unavailable
        logger.warning(
            "attention backend 'fa' cannot run: %s. Attention runs on torch_sdpa instead, slower. %s to run "
            "FlashAttention.", why, fix,
        )
    return TORCH_SDPA


def resolve_attention_backend(requested: str | None, device: torch.device | str,
                              dtype: torch.dtype | None = None) -> str:
    """The backend to use on `device` for a model in `dtype`: the requested one if it can run, else a ValueError
    saying why.

    None (or "auto") picks the default: "fa" on Hopper when fa3-fwd imports and on datacenter Blackwell when
    FlashAttention-4 imports and passes its probe (else a warning saying how to install it), "torch_sdpa" elsewhere
    (never the lossy "fa_fp8"), and for a model not in bf16, whose every call FlashAttention would hand to torch
    SDPA. When the result is "fa" or "fa_fp8", FlashAttention-4 is imported here too if installed, so the calls it
    takes use it (on Hopper the head dims where it is faster; with "fa_fp8", in the calls the FP8 kernel does not
    take; ops/flash_attention4.py).
    """
    device = torch.device(device)
    runs_flash = dtype is None or dtype in _FA3_DTYPES
    if requested is None or requested == "auto":
        return _default_backend(device) if runs_flash else TORCH_SDPA
    backend = canonical_backend_name(requested)
    if backend == FLASH_ATTENTION:
        unavailable = prepare_flash_attention(device)
        if unavailable is not None:
            why, fix = unavailable
            name = repr(requested) if requested == backend else f"{requested!r} (an alias of 'fa')"
            fix = f"{fix}, or use" if fix else "Use"
            raise ValueError(
                f"attention backend {name} (FlashAttention) cannot run here: {why}. "
                f"{fix} --attention-backend torch_sdpa."
            )
    elif backend == FLASH_ATTENTION_FP8:
        reason = fa3_unavailable_reason(device)
        if reason is not None:
            other = "fa (FlashAttention-4 on this GPU) or " if _is_datacenter_blackwell(device) else ""
            raise ValueError(
                f"attention backend {backend!r} (FlashAttention-3) cannot run here: {reason}. "
                f"{FA3_INSTALL_FIX + ', or use' if _hopper(device) else 'Use'} --attention-backend {other}torch_sdpa."
            )
        flash_attention4.prepare(device)
    if backend in _FLASH_BACKENDS and not runs_flash:
        # Accepted, every call took torch SDPA (`_uses_fa3` checks the dtype), silently: the flag did nothing.
        raise ValueError(
            f"attention backend {requested!r} (FlashAttention) runs bf16 only, and the model runs in "
            f"{str(dtype).removeprefix('torch.')} (--dtype): every call would run on torch SDPA. Use --dtype bfloat16, "
            f"or --attention-backend torch_sdpa."
        )
    return backend


def _hopper(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_available() and (
        torch.cuda.get_device_capability(device) in _FA3_CAPABILITIES)


def _fa3_function() -> Callable[..., Any]:
    if _FA3_FUNCTION is not None:
        return _FA3_FUNCTION
    flash_attn_func, reason = _load_fa3_eagerly()
    if flash_attn_func is None:
        raise ValueError(
            f"attention backend 'fa' or 'fa_fp8' was selected but {reason}; resolve the backend with "
            f"resolve_attention_backend() or use --attention-backend torch_sdpa"
        )
    return flash_attn_func


def _uses_fa3(backend: str, query_BLHD: Tensor, key_mask_BS: Tensor | None) -> bool:
    """Whether the call takes the FlashAttention path: FA3 on Hopper, FA4 where `flash_attention4` says so."""
    return (
        backend in _FLASH_BACKENDS
        and key_mask_BS is None
        and query_BLHD.is_cuda
        and query_BLHD.dtype in _FA3_DTYPES
    )


def _check_key_mask(key_mask_BS: Tensor | None) -> None:
    if key_mask_BS is not None and key_mask_BS.dtype != torch.bool:
        raise ValueError(
            f"key_mask_BL must be a bool tensor (True = attend), got {key_mask_BS.dtype}"
        )


def _sdpa(
    query_BLHD: Tensor, key_BSHD: Tensor, value_BSHD: Tensor, key_mask_BS: Tensor | None
) -> Tensor:
    # Same layout handling as diffusers' native backend: permuted views, mask viewed as (B, 1, 1, S).
    mask_B11S = None if key_mask_BS is None else key_mask_BS[:, None, None, :]
    query_BHLD, key_BHSD, value_BHSD = (
        x.permute(0, 2, 1, 3) for x in (query_BLHD, key_BSHD, value_BSHD)
    )
    if query_BHLD.is_cuda:
        with sdpa_kernel(_CUDA_SDPA_PRIORITY, set_priority=True):
            out_BHLD = F.scaled_dot_product_attention(
                query_BHLD, key_BHSD, value_BHSD, attn_mask=mask_B11S
            )
    else:
        out_BHLD = F.scaled_dot_product_attention(
            query_BHLD, key_BHSD, value_BHSD, attn_mask=mask_B11S
        )
    return out_BHLD.permute(0, 2, 1, 3)


def attention(
    query_BLHD: Tensor,
    key_BLHD: Tensor,
    value_BLHD: Tensor,
    *,
    key_mask_BL: Tensor | None = None,
    backend: str,
) -> Tensor:
    """Softmax attention, scale 1/sqrt(D); `key_mask_BL` (B, S) bool masks keys. Returns (B, L, H, D)."""
    backend = canonical_backend_name(backend)
    _check_key_mask(key_mask_BL)
    if _uses_fa3(backend, query_BLHD, key_mask_BL):
        if backend == FLASH_ATTENTION_FP8 and fp8_attention.applies(query_BLHD, key_BLHD):
            return fp8_attention.fp8_attention(_fa3_function(), query_BLHD, key_BLHD, value_BLHD)
        if flash_attention4.wanted(query_BLHD.shape[-1]):  # FA4 where it is faster (ops/flash_attention4.py)
            return flash_attention4.fa4_attention(query_BLHD, key_BLHD, value_BLHD)
        num_splits = fa3_num_splits(query_BLHD.shape[1], key_BLHD.shape[1])
        if num_splits == 1:  # FA3's default: the call stays exactly what it was before splits existed
            return _fa3_function()(query_BLHD, key_BLHD, value_BLHD)
        return _fa3_function()(query_BLHD, key_BLHD, value_BLHD, num_splits=num_splits)
    return _sdpa(query_BLHD, key_BLHD, value_BLHD, key_mask_BL)


def _math_attention_with_lse(
    query_BLHD: Tensor, key_BSHD: Tensor, value_BSHD: Tensor, key_mask_BS: Tensor | None
) -> tuple[Tensor, Tensor]:
    scale = 1.0 / math.sqrt(query_BLHD.shape[-1])
    query_BHLD, key_BHSD, value_BHSD = (
        x.permute(0, 2, 1, 3).float() for x in (query_BLHD, key_BSHD, value_BSHD)
    )
    scores_BHLS = (query_BHLD @ key_BHSD.transpose(-1, -2)) * scale
    if key_mask_BS is not None:
        scores_BHLS = scores_BHLS.masked_fill(~key_mask_BS[:, None, None, :], float("-inf"))
    lse_BHL = torch.logsumexp(scores_BHLS, dim=-1)
    out_BHLD = torch.exp(scores_BHLS - lse_BHL[..., None]) @ value_BHSD
    return out_BHLD.permute(0, 2, 1, 3).to(query_BLHD.dtype), lse_BHL


def _cudnn_attention_with_lse(
    query_BLHD: Tensor, key_BSHD: Tensor, value_BSHD: Tensor
) -> tuple[Tensor, Tensor]:
    batch, length, num_heads, _ = query_BLHD.shape
    query_BHLD, key_BHSD, value_BHSD = (
        x.permute(0, 2, 1, 3) for x in (query_BLHD, key_BSHD, value_BSHD)
    )
    outputs = torch.ops.aten._scaled_dot_product_cudnn_attention(
        query_BHLD, key_BHSD, value_BHSD, None, True, 0.0, False, False
    )
    out_BHLD, lse = outputs[0], outputs[1]
    # cuDNN stores the softmax stats as (B, H, L, 1) in some torch versions.
    return out_BHLD.permute(0, 2, 1, 3), lse.reshape(batch, num_heads, length).float()


def attention_with_lse(
    query_BLHD: Tensor,
    key_BLHD: Tensor,
    value_BLHD: Tensor,
    *,
    key_mask_BL: Tensor | None = None,
    backend: str,
) -> tuple[Tensor, Tensor]:
    """`attention()` that also returns the fp32 log-sum-exp of the scaled scores, (B, H, L).

    Used to merge partial results (Ring attention). CUDA: FA3 when the backend is "fa" (its FP8 kernel for the
    long calls with "fa_fp8": a ring step's keys are one shard), FA4 instead on datacenter Blackwell, else torch's
    cuDNN op for unmasked bf16/fp16; everything else (CPU, masks, fp32) takes the plain math path.
    """
    backend = canonical_backend_name(backend)
    _check_key_mask(key_mask_BL)
    if _uses_fa3(backend, query_BLHD, key_mask_BL):
        if backend == FLASH_ATTENTION_FP8 and fp8_attention.applies(query_BLHD, key_BLHD):
            out_BLHD, lse_BHL = fp8_attention.fp8_attention(
                _fa3_function(), query_BLHD, key_BLHD, value_BLHD, return_lse=True
            )
            return out_BLHD, lse_BHL
        if flash_attention4.replaces_fa3():  # datacenter Blackwell: FA4's lse has FA3's layout, (B, H, L) fp32
            return flash_attention4.fa4_attention_with_lse(query_BLHD, key_BLHD, value_BLHD)
        out_BLHD, lse_BHL = _fa3_function()(
            query_BLHD, key_BLHD, value_BLHD, return_attn_probs=True
        )
        return out_BLHD, lse_BHL
    if (
        query_BLHD.is_cuda
        and key_mask_BL is None
        and query_BLHD.dtype in (torch.bfloat16, torch.float16)
        and torch.backends.cudnn.is_available()
    ):
        return _cudnn_attention_with_lse(query_BLHD, key_BLHD, value_BLHD)
    return _math_attention_with_lse(query_BLHD, key_BLHD, value_BLHD, key_mask_BL)
