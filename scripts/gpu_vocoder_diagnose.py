"""Why the vocoder of a saved-and-loaded folder gives other samples than the dummy build it was saved from, on the
same input (`gpu_folder_diagnose.py`'s traced pair, fifty-seventh session: every earlier module's inputs and outputs
equal, the vocoder's inputs equal, its outputs apart).

    python3 scripts/gpu_vocoder_diagnose.py --out $OUT/vocoder

Builds the vocoder as `--load-format dummy` does (seeded, on the GPU, bf16), saves it, loads it back as a folder's
load does, and runs both (and a second dummy build) on one random mel under cudnn.benchmark on and off and
cudnn.deterministic: which settings make the outputs equal, and the parameters' layouts (strides, pointer
alignment). Results: <out>/gpu_vocoder_diagnose.json.

Answered in the fifty-eighth session (`gpu_cudnn_autotune.py`): cuDNN's autotuner, whose choices torch keeps per
thread; each engine of the pair ran on its own thread, this script's calls on one. Speed mode leaves it off since.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch


def _layout(module: torch.nn.Module) -> dict:
    params = dict(module.named_parameters())
    return {"noncontiguous": [n for n, p in params.items() if not p.is_contiguous()][:10],
            "alignments": sorted({min(p.data_ptr() % 1024, 1024) for p in params.values()})[:10],
            "strides_sample": {n: list(p.stride()) for n, p in list(params.items())[:3]}}


def main() -> None:
    # From its own module: diffusers' top-level name is, to mypy, the placeholder class for installs without torch.
    from diffusers.models.autoencoders.mmaudio_vocoder import MMAudioVocoder

    from k6serve.models.kandinsky6.checkpoint import DUMMY_COMPONENT_SEEDS, _load_diffusers, cast_without_warning

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--frames", type=int, default=64)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    cuda = torch.device("cuda")

    def build():
        with torch.random.fork_rng(devices=[0]), torch.device(cuda):
            torch.random.default_generator.manual_seed(DUMMY_COMPONENT_SEEDS["vocoder"])
            torch.cuda.manual_seed(DUMMY_COMPONENT_SEEDS["vocoder"])
            return cast_without_warning(MMAudioVocoder(), torch.bfloat16).eval().requires_grad_(False)

    built = build()
    again = build()
    folder = Path(tempfile.mkdtemp())
    built.save_pretrained(str(folder / "vocoder"), safe_serialization=True)
    loaded = _load_diffusers(folder, "vocoder", "MMAudioVocoder", cuda, torch.bfloat16)
    generator = torch.Generator(device=cuda).manual_seed(0)
    mel = torch.randn(1, 128, args.frames, generator=generator, device=cuda, dtype=torch.bfloat16)
    report: dict = {"torch": torch.__version__, "cudnn": torch.backends.cudnn.version(),
                    "device": torch.cuda.get_device_name(),
                    "layout": {"built": _layout(built), "again": _layout(again), "loaded": _layout(loaded)},
                    "params_equal": all(torch.equal(a, b) for a, b in zip(built.parameters(), loaded.parameters())),
                    "buffers_equal": all(torch.equal(a, b) for a, b in zip(built.buffers(), loaded.buffers()))}
    settings = {"benchmark_on": (True, False), "benchmark_off": (False, False), "deterministic": (False, True)}
    for name, (benchmark, deterministic) in settings.items():
        torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic = benchmark, deterministic
        with torch.inference_mode():
            outputs = {key: model(mel).sample.float() for key, model in
                       (("built", built), ("again", again), ("loaded", loaded), ("built2", built))}
        report[name] = {f"{a}_vs_{b}": (outputs[a] - outputs[b]).abs().max().item()
                        for a, b in (("built", "loaded"), ("built", "again"), ("built", "built2"))}
        print(name, report[name], flush=True)
    # Only the loaded copy's tensors moved to fresh contiguous storage: equal then says layout, not values.
    torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic = True, False
    with torch.no_grad():
        for parameter in loaded.parameters():
            parameter.data = parameter.data.clone()
    with torch.inference_mode():
        report["loaded_cloned_vs_built"] = (loaded(mel).sample.float() - built(mel).sample.float()).abs().max().item()
    print("layout", json.dumps(report["layout"]), "cloned", report["loaded_cloned_vs_built"], flush=True)
    (args.out / "gpu_vocoder_diagnose.json").write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
