"""How far bf16 HunyuanVideo VAE decodes are from an fp32 decode, eager and compiled, on random weights.

Issue 5 asks the compiled decoder for uint8 frames within 1/255 of diffusers' eager bf16 decode. With random
weights every bf16 rounding difference is amplified through the decoder, so this measures the question behind
it: is the compiled decode further from the exact (fp32) result than the eager bf16 decode is? It runs a small
random `AutoencoderKLHunyuanVideo` (diffusers' class, fewer channels) on the CPU, or the released size on CUDA:

    python scripts/vae_rounding.py                      # CPU, ~2 minutes (three compilations)
    python scripts/vae_rounding.py --device cuda --full # released size on one GPU

Rows: eager bf16; the decoder compiled (`decoder.compile(dynamic=False)`, as `--compile-vae true` does); and
compiled with inductor's `emulate_precision_casts` (rounds to bf16 where eager does). Each against fp32 and
against eager bf16: the largest uint8 difference and the share of values more than one level off. Results:
$OUT/vae_rounding.json and .md.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

import torch


def _quantise(frames: torch.Tensor) -> torch.Tensor:
    return ((frames.float().clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8)


def _difference(frames: torch.Tensor, reference: torch.Tensor) -> dict:
    levels = (frames.int() - reference.int()).abs()
    return {"max": int(levels.max()), "share_over_1": float((levels > 1).float().mean())}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--full", action="store_true", help="released VAE size and 512x768x121 (GPU)")
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    args = parser.parse_args(argv)

    # From its own module: diffusers' top-level name is, to mypy, the placeholder class for installs without torch.
    from diffusers.models.autoencoders.autoencoder_kl_hunyuan_video import AutoencoderKLHunyuanVideo

    device = torch.device(args.device)
    torch.manual_seed(0)
    if args.full:
        kwargs, latent_shape = {}, (1, 16, 31, 64, 96)
    else:
        kwargs = {"block_out_channels": (32, 64, 64, 64), "layers_per_block": 1, "norm_num_groups": 8}
        latent_shape = (1, 16, 4, 16, 24)
    with torch.device(device):
        vae = AutoencoderKLHunyuanVideo(**kwargs).eval().requires_grad_(False)
        latents = torch.randn(latent_shape)
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False

    def decode(dtype: torch.dtype) -> torch.Tensor:
        with torch.inference_mode():
            return _quantise(vae.decode(latents.to(dtype)).sample).cpu()

    exact = decode(torch.float32)
    vae.to(torch.bfloat16)  # fp32 -> bf16 once; every bf16 row below uses these weights
    eager = decode(torch.bfloat16)
    rows = {"eager bf16": eager}
    plain_forward = vae.decoder.forward
    # The options typed as torch.compile takes them: an inferred dict[str, bool] is refused (a dict is invariant).
    compiles: tuple[tuple[str, dict[str, Any] | None], ...] = (
        ("compiled", None), ("compiled, emulate_precision_casts", {"emulate_precision_casts": True}))
    for name, options in compiles:
        torch._dynamo.reset()
        vae.decoder.forward = torch.compile(plain_forward, dynamic=False, options=options)
        rows[name] = decode(torch.bfloat16)
        vae.decoder.forward = plain_forward

    report = {"device": str(device), "full": args.full, "latents": list(latent_shape), "torch": torch.__version__,
              "rows": {name: {"vs_fp32": _difference(frames, exact), "vs_eager_bf16": _difference(frames, eager)}
                       for name, frames in rows.items()}}
    lines = [(f"### vae_rounding ({'released size' if args.full else 'small random VAE'}, {device}, latents "
             f"{list(latent_shape)})"), "",
             "| decode | max vs fp32 | share > 1 vs fp32 | max vs eager bf16 | share > 1 vs eager bf16 |",
             "|---|---|---|---|---|"]
    for name, row in report["rows"].items():
        lines.append(f"| {name} | {row['vs_fp32']['max']} | {row['vs_fp32']['share_over_1']:.1%} | "
                     f"{row['vs_eager_bf16']['max']} | {row['vs_eager_bf16']['share_over_1']:.1%} |")
    text = "\n".join(lines) + "\n"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "vae_rounding.json").write_text(json.dumps(report, indent=2))
    (out / "vae_rounding.md").write_text(text)
    print(text, flush=True)


if __name__ == "__main__":
    main()
