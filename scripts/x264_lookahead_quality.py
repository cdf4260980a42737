"""What x264's rc-lookahead costs in quality: PSNR and size of one clip encoded at each lookahead (CPU only).

k6serve encodes with a 20-frame lookahead instead of the "medium" preset's 40 because the lookahead is the
encoder's tail after a streamed decode (k6serve/media/mux.py, `_x264_rc_lookahead`). This encodes a textured,
panning clip (smooth waves plus a fixed random texture that moves one pixel per frame, roughly what upscaled video
looks like to the encoder) through `k6serve.media.mux.write_mp4` at each lookahead, decodes it and reports the
file size and the PSNR of the decoded RGB frames against the source (seventh session, 384x256x121:
40 -> 38.128 dB / 0.289 MB, 30 -> 38.135 / 0.289, 20 -> 38.133 / 0.288, 10 -> 38.048 / 0.285).

    python scripts/x264_lookahead_quality.py [--width 384 --height 256 --frames 121] [--out DIR]

Results: <out>/x264_lookahead_quality.json.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path

import av
import numpy as np

from k6serve.media import mux

LOOKAHEADS = (40, 30, 20, 10)


def textured_clip(width: int, height: int, frames: int, seed: int = 0) -> np.ndarray:
    """uint8 (T, H, W, 3): moving waves plus a random texture panning one pixel per frame."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    texture = rng.integers(0, 64, (height, width + frames)).astype(np.float32)
    clip = []
    for t in range(frames):
        base = (np.sin(x / 23 + t / 9) + np.cos(y / 17 - t / 11)) * 50 + 110
        luma = np.clip(base + 0.6 * texture[:, t:t + width], 0, 255)
        clip.append(np.stack([luma, 0.9 * luma, 0.8 * luma], -1).astype(np.uint8))
    return np.stack(clip)


def psnr(decoded: np.ndarray, source: np.ndarray) -> float:
    mse = np.mean((decoded.astype(np.float64) - source.astype(np.float64)) ** 2)
    return float(10 * np.log10(255**2 / mse))


def measure(clip: np.ndarray, lookaheads=LOOKAHEADS) -> list[dict]:
    rows = []
    default = mux.X264_RC_LOOKAHEAD
    try:
        with tempfile.TemporaryDirectory() as folder:
            for lookahead in lookaheads:
                mux.X264_RC_LOOKAHEAD = lookahead
                path = mux.write_mp4(Path(folder) / f"{lookahead}.mp4", clip, 24.0)
                with av.open(str(path)) as container:
                    decoded = np.stack([frame.to_ndarray(format="rgb24") for frame in container.decode(video=0)])
                rows.append({"rc_lookahead": lookahead, "megabytes": path.stat().st_size / 1e6,
                             "psnr_db": psnr(decoded, clip)})
                print(f"rc-lookahead {lookahead}: {rows[-1]['megabytes']:.3f} MB, {rows[-1]['psnr_db']:.3f} dB",
                      flush=True)
    finally:
        mux.X264_RC_LOOKAHEAD = default
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--width", type=int, default=384)
    parser.add_argument("--height", type=int, default=256)
    parser.add_argument("--frames", type=int, default=121)
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    args = parser.parse_args(argv)
    rows = measure(textured_clip(args.width, args.height, args.frames))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "x264_lookahead_quality.json").write_text(json.dumps({"arguments": vars(args), "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
