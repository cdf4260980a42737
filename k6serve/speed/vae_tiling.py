"""`--vae-tiling {auto,on,off}`: spatial tiles for the generation models' HunyuanVideo VAE decode.

"on" is diffusers' `vae.enable_tiling()` with its default tiles (256 px, stride 192, the 64 px overlaps blended).
`pipelines/decode_stream.py` mirrors diffusers' `_temporal_tiled_decode` including its `tiled_decode` branch, so
each 17-frame temporal tile is then decoded as overlapping spatial tiles: the frames equal diffusers' decode with
`enable_tiling()`. They differ from the untiled decode everywhere, not only at the seams: each tile's convolutions
and mid-block attention see that tile alone. Measured on an H200 with the released VAE's shape and random bf16
weights (which amplify differences), the 512x768x121 decode's activations peaked at 3.6 GiB tiled against 21.3
untiled, the decode took 10.4 s against 6.3-7.2, and the uint8 frames differed by 3.6 levels on average (at most
102). With `enable_tiling()` the VAE's encode is tiled too, as in diffusers: a TI2AV conditioning image wider or
taller than 256 px is encoded in blended tiles.

Why "auto" means on only for `--performance-mode memory` on a GPU: that mode promises the lowest peak, and its
peak was the untiled decode (Pro-distill 512x768x121 on an H200: 21.7 GiB). Elsewhere the untiled frames are
kept: the CPU and the speed / balanced modes give the same bits as before the flag existed.
"""

from __future__ import annotations

import torch

from k6serve.models.variants import GENERATION


def resolve_vae_tiling(setting: str, performance_mode: str, device: torch.device | str, family: str) -> bool:
    """Whether the video VAE decode runs in spatial tiles: `setting` (a `VAE_TILING` value) for this engine."""
    if family != GENERATION:
        if setting == "on":
            raise ValueError(
                "--vae-tiling on applies to the generation models' HunyuanVideo VAE; the super-resolution pipeline "
                "already decodes its K-VAE tile by tile (there is no whole-frame decode to tile): drop --vae-tiling."
            )
        return False
    if setting == "auto":
        return performance_mode == "memory" and torch.device(device).type == "cuda"
    return setting == "on"
