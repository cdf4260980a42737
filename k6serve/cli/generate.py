"""`k6serve generate`: one request offline, a progress bar over steps, a timing table at the end."""

from __future__ import annotations

import sys
from typing import Any

from tqdm import tqdm

from k6serve.api import DiffGenerator, check_output, split_kwargs


def format_timings(result) -> str:
    rows = [
        ("encode", result.timings.get("encode")),
        ("denoise total", result.timings.get("denoise")),
        ("denoise per step", result.timings.get("denoise_per_step")),
        ("decode video", result.timings.get("decode_video")),
        ("decode audio", result.timings.get("decode_audio")),
        ("mux", result.timings.get("mux")),
        ("total", result.timings.get("total")),
    ]
    counts = {"graphs_compiled"}  # a count among the times: printed below them, not as seconds
    for key in sorted(result.timings):
        if key not in {"encode", "denoise", "denoise_per_step", "decode_video", "decode_audio", "mux", "total",
                       *counts}:
            rows.insert(-1, (key.replace("_", " "), result.timings[key]))
    lines = [f"{'stage':<20} {'seconds':>10}", "-" * 31]
    lines += [f"{name:<20} {value:>10.3f}" for name, value in rows if value is not None]
    lines += [f"{key.replace('_', ' '):<20} {int(result.timings[key]):>10d}" for key in sorted(counts)
              if key in result.timings]
    lines.append(f"{'peak memory (MiB)':<20} {result.peak_memory_mb:>10.1f}")
    return "\n".join(lines)


def run_generate(engine_options: dict[str, Any], request_options: dict[str, Any]) -> int:
    # Checked before the model loads (minutes for a real checkpoint): typos, types, an unusable output folder and
    # a taken --output-file-name.
    _, output = split_kwargs(request_options)
    check_output(output)
    if not output.save_output:
        # Said before the model loads and the request runs, which can take minutes, not after them.
        print("note: --no-save-output: the video is generated and then discarded; only the timings are printed. "
              "Drop --no-save-output to write the MP4.", file=sys.stderr)
    model_path = engine_options.pop("model_path")
    generator = DiffGenerator.from_pretrained(model_path, **engine_options)
    bar = None
    try:
        variant = generator.variant
        if variant.is_demo:
            print("note: using the built-in tiny demo checkpoint: its weights are random, so the video and audio "
                  "are noise. Pass --model-path with a real Kandinsky 6 checkpoint for real output.", file=sys.stderr)

        def on_progress(step: int, total: int) -> None:
            nonlocal bar
            # Opened at the first step, so a request rejected before it runs prints no empty bar above its error.
            if bar is None:
                bar = tqdm(desc="denoising" if variant.family == "generation" else "super-resolution", unit="step")
            bar.total = total
            bar.n = step
            bar.refresh()

        result = generator.generate(request_options, on_progress=on_progress)
    finally:
        if bar is not None:
            bar.close()
        generator.shutdown()
    for note in result.notes:
        print(f"note: {note}", file=sys.stderr)
    print(format_timings(result))
    shape = (f"{result.width}x{result.height}, {result.num_frames} frames, {result.fps:g} fps"
             f"{', with audio' if result.has_audio else ', no audio'}")
    if result.output_file_path:
        print(f"saved {result.output_file_path} ({shape})")
    else:
        print(f"not saved (--no-save-output): {shape}")
    return 0
