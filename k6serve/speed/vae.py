"""Video VAE decode speed-ups (HunyuanVideo VAE; the SR K-VAE too), applied to the module in place.

The decode keeps diffusers' default framewise temporal tiling (5-latent-frame tiles, stride 3, 4-frame
blend): only the kernels change, never the tiling, so the frames stay within rounding of the reference.

* `torch.backends.cudnn.benchmark`: autotune each 3-D convolution shape once (the tiles repeat shapes).
* channels-last 3-D weights: cuDNN's bf16 implicit-GEMM convolutions run on NDHWC; diffusers' default
  NCDHW makes cuDNN transpose around each convolution. Our latents already arrive in that layout
  (`decode_video` permutes a (B, T, H, W, C) tensor).
* optionally `torch.compile` of the decoder: fuses GroupNorm + SiLU and the causal padding copies.

Nothing is applied on a non-CUDA device, so CPU results are unchanged.
"""

from __future__ import annotations

import torch
from torch import nn


def apply_vae_speedups(
    vae: nn.Module,
    device: torch.device,
    *,
    channels_last: bool = False,  # measured on H200: 1.55x slower decode and up to 9/255 off; rank-4 weights break it
    compile_decoder: bool = False,
) -> list[str]:
    """Apply the enabled decode speed-ups on CUDA; returns the names of what was applied."""
    if torch.device(device).type != "cuda":
        return []
    applied = ["cudnn_benchmark"]
    # Process-wide: every convolution in the process autotunes; the DiT has none, the audio VAE gains.
    torch.backends.cudnn.benchmark = True
    if channels_last:
        vae.to(memory_format=torch.channels_last_3d)
        applied.append("channels_last_3d")
    decoder = getattr(vae, "decoder", None)
    if compile_decoder and decoder is not None:
        if getattr(decoder, "_compiled_call_impl", None) is None:
            decoder.compile(dynamic=False)
        applied.append("compile_decoder")
    return applied


def _raise_recompile_limit(limit: int) -> None:
    """The decoder's blocks share one `forward` per class but see many shapes (levels, first/later segment,
    first-segment flag); dynamo's default limit of 8 variants per code object would silently fall back to eager."""
    import torch._dynamo.config as dynamo_config

    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(dynamo_config, name) and getattr(dynamo_config, name) < limit:
            setattr(dynamo_config, name, limit)


def compile_sr_decoder_blocks(model: nn.Module, *, backend: str = "inductor", limit: int = 64) -> int:
    """Compile every resnet block, upsampler and the output norm of the SR K-VAE decoder in place.

    `SRVAE` calls these submodules one by one with their cache dicts (segment-by-segment decoding), so the
    decoder's own forward never runs and compiling it would do nothing; compiling the blocks fuses the fp32
    RMSNorm, the zq modulation, SiLU and the padding copies around each convolution. Returns the count.
    """
    decoder = model.decoder
    _raise_recompile_limit(limit)
    modules = [decoder.mid.block_1, decoder.mid.block_2, decoder.norm_out]
    for up in decoder.up:
        modules += list(up.block)
        if hasattr(up, "upsample"):
            modules.append(up.upsample)
    for module in modules:
        if getattr(module, "_compiled_call_impl", None) is None:
            module.compile(backend=backend, dynamic=False)
    return len(modules)
