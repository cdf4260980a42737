"""Time the SR reader's colour mapping (`k6serve/media/color.py`) of one 1080p frame on the host it runs on.

The mapping runs on the CPU in the reader, beside the GPU upscale, so what matters is its cost a frame against the
upscale's. Prints a table and writes JSON: median of 5 runs per source kind (PQ with a 1000 cd/m^2 peak, HLG, a
BT.2020 SDR source), with torch on 1 thread and on every core.

    python3 scripts/gpu_color_timing.py --out $OUT/color
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from k6serve.media.color import PRIMARIES_BT2020, TRC_HLG, TRC_PQ, SdrMapping


def _time(mapping: SdrMapping, frame: np.ndarray, runs: int = 5) -> float:
    mapping.to_sdr(frame)  # builds the tables once, as the first frame of a clip does
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        mapping.to_sdr(frame)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--height", type=int, default=1080)
    parser.add_argument("--width", type=int, default=1920)
    args = parser.parse_args()
    # Smooth gradients with noise: every code range used, some of it outside BT.709 once mapped.
    generator = np.random.default_rng(0)
    frame = generator.integers(0, 65536, size=(args.height, args.width, 3), dtype=np.uint16)
    kinds = {
        "PQ, BT.2020, 1000 cd/m^2": SdrMapping(TRC_PQ, PRIMARIES_BT2020, 1000.0, "timing"),
        "HLG, BT.2020": SdrMapping(TRC_HLG, PRIMARIES_BT2020, 1000.0, "timing"),
        "SDR, BT.2020": SdrMapping(None, PRIMARIES_BT2020, 1000.0, "timing"),
    }
    cores = os.cpu_count() or 1
    rows = []
    for name, mapping in kinds.items():
        row = {"source": name, "height": args.height, "width": args.width}
        for threads in (1, cores):
            torch.set_num_threads(threads)
            row[f"seconds_{threads}_threads"] = round(_time(mapping, frame), 4)
        rows.append(row)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "color.json").write_text(json.dumps({"cores": cores, "torch": torch.__version__, "rows": rows},
                                                    indent=2))
    print(f"| source | 1 thread (s) | {cores} threads (s) |\n|---|---|---|")
    for row in rows:
        print(f"| {row['source']} | {row[f'seconds_1_threads']:.3f} | {row[f'seconds_{cores}_threads']:.3f} |")


if __name__ == "__main__":
    main()
