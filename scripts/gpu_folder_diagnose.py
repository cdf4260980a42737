"""Where a full-size folder's load and the dummy build part ways, when `gpu_folder_checkpoint.py`'s MP4s differ.

    python3 scripts/gpu_folder_diagnose.py --out $OUT/diagnose [--variant lite-distill]

Writes the folder as `gpu_folder_checkpoint.py` does, then, in this process: loads its components
(`load_generation_models`, as a request's worker does) and builds the dummy ones (`--load-format dummy`), both on the
GPU in bf16, and compares them component by component (parameters and buffers: names, dtypes, shapes, values;
configs; the tokenizers' ids for the request's prompt). Then runs the request once on a worker that loaded the folder
and once on a dummy one (`pair`), hashing each watched module's inputs and outputs: the first call whose inputs or
outputs differ says where the two part ways (inputs apart: what feeds that module; inputs equal and outputs apart: the
module's own code path). `--repeat` also runs the dummy request four times on one worker, to tell the weights apart
from a run that is not repeatable (and where). Results: <out>/gpu_folder_diagnose.json.

    python3 scripts/gpu_folder_diagnose.py --out $OUT/trace --trace-only a   # in one process
    python3 scripts/gpu_folder_diagnose.py --out $OUT/trace --trace-only b   # in another
    python3 scripts/gpu_folder_diagnose.py --out $OUT/trace --compare a b

`--trace-only NAME` runs the dummy request once, traced, and writes its calls to <out>/trace_NAME.json (no folder);
`--compare A B` prints where two such traces, made in two processes, part ways.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

import torch

from gpu_folder_checkpoint import HUB_IDS, VARIANT_KEYS, _sha256, write_folder

PROMPT = "A red fox runs through fresh snow at dawn."
COMPONENTS = ("transformer", "text_encoder", "text_encoder_2", "vae", "audio_vae", "vocoder")


def _tensors(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    # Buffers too, persistent or not (rotary tables, position ids): a buffer a load leaves behind changes outputs.
    return {**dict(module.named_parameters()), **dict(module.named_buffers())}


def compare_modules(loaded: torch.nn.Module, built: torch.nn.Module) -> dict:
    a, b = _tensors(loaded), _tensors(built)
    report: dict = {"only_loaded": sorted(set(a) - set(b))[:20], "only_built": sorted(set(b) - set(a))[:20],
                    "dtype": [], "shape": [], "values": [], "tensors": len(a)}
    differing = 0
    for name in sorted(set(a) & set(b)):
        x, y = a[name], b[name]
        if x.dtype != y.dtype:
            report["dtype"].append([name, str(x.dtype), str(y.dtype)])
        if x.shape != y.shape:
            report["shape"].append([name, list(x.shape), list(y.shape)])
            continue
        if x.device != y.device:
            y = y.to(x.device)
        if x.is_floating_point() or y.is_floating_point():
            diff = (x.float() - y.float()).abs().max().item() if x.numel() else 0.0
        else:
            diff = float((x != y).sum().item())
        if diff:
            differing += 1
            if len(report["values"]) < 20:
                report["values"].append([name, diff, str(x.dtype), str(y.dtype)])
    report["differing_tensors"] = differing
    report["dtype"] = report["dtype"][:20]
    report["shape"] = report["shape"][:20]
    return report


def _config(module) -> dict:
    config = module.config
    if dataclasses.is_dataclass(config) and not isinstance(config, type):  # our DiT's typed config
        config = dataclasses.asdict(config)
    config = config.to_dict() if hasattr(config, "to_dict") else dict(config)
    return json.loads(json.dumps(config, default=str))  # tuples as lists: a saved config reads back lists


def compare_configs(loaded, built) -> dict:
    a, b = _config(loaded), _config(built)
    skip = {"_name_or_path", "transformers_version", "_diffusers_version", "_use_default_values", "_commit_hash"}
    keys = sorted((set(a) | set(b)) - skip)
    return {key: [repr(a.get(key, "<absent>")), repr(b.get(key, "<absent>"))]
            for key in keys if a.get(key, "<absent>") != b.get(key, "<absent>")}


def compare_tokenizers(loaded, built) -> dict:
    return {"classes": [type(loaded).__name__, type(built).__name__], "lengths": [len(loaded), len(built)],
            "ids_equal": loaded(PROMPT)["input_ids"] == built(PROMPT)["input_ids"],
            "max_length": [loaded.model_max_length, built.model_max_length],
            "padding_side": [loaded.padding_side, built.padding_side]}


def main() -> None:
    from k6serve.models.kandinsky6.checkpoint import load_generation_models
    from k6serve.models.variants import VARIANTS

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--variant", choices=list(VARIANT_KEYS), default="lite-distill")
    parser.add_argument("--folder", type=Path, default=Path("/tmp/k6serve-folder"))
    parser.add_argument("--repeat", action="store_true", help="also run the dummy request four times")
    parser.add_argument("--trace-only", metavar="NAME", help="only trace the dummy request into trace_NAME.json")
    parser.add_argument("--compare", nargs=2, metavar=("A", "B"), help="compare trace_A.json with trace_B.json")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.compare:
        print("compare", json.dumps(compare_traces(*(args.out / f"trace_{name}.json" for name in args.compare))))
        return
    if args.trace_only:
        trace = traced_run(HUB_IDS[args.variant], args.out / f"run_{args.trace_only}", load_format="dummy")
        (args.out / f"trace_{args.trace_only}.json").write_text(json.dumps(trace))
        return
    report: dict = {"commit": os.environ.get("K6SERVE_COMMIT"), "torch": torch.__version__,
                    "device": torch.cuda.get_device_name(), "variant": args.variant}

    def save() -> None:
        (args.out / "gpu_folder_diagnose.json").write_text(json.dumps(report, indent=2, default=str))

    start = time.perf_counter()
    write_folder(args.variant, args.folder)
    report["write_s"] = round(time.perf_counter() - start, 1)
    cuda = torch.device("cuda")
    variant = VARIANTS[args.variant]
    loaded = load_generation_models(args.folder, variant, device=cuda, dtype=torch.bfloat16, load_format="auto")
    built = load_generation_models(None, variant, device=cuda, dtype=torch.bfloat16, load_format="dummy")
    for component in COMPONENTS:
        a, b = getattr(loaded, component), getattr(built, component)
        report[component] = {"tensors": compare_modules(a, b), "config": compare_configs(a, b)}
        print(component, json.dumps(report[component])[:1500], flush=True)
        save()
    report["attention"] = {name: [_attention_implementation(getattr(loaded, name)),
                                  _attention_implementation(getattr(built, name))]
                           for name in ("text_encoder", "text_encoder_2")}
    print("attention", report["attention"], flush=True)
    for component in ("tokenizer", "tokenizer_2"):
        report[component] = compare_tokenizers(getattr(loaded, component), getattr(built, component))
        print(component, report[component], flush=True)
    report["scheduler"] = {"classes": [loaded.scheduler_class, built.scheduler_class],
                           "configs": [loaded.scheduler_config, built.scheduler_config]}
    print("scheduler", report["scheduler"], flush=True)
    save()
    del loaded, built
    torch.cuda.empty_cache()

    folder_calls = traced_run(str(args.folder), args.out / "folder")
    shutil.rmtree(args.folder, ignore_errors=True)
    dummy_calls = traced_run(HUB_IDS[args.variant], args.out / "dummy", load_format="dummy")
    report["pair"] = pair_report(folder_calls, dummy_calls)
    print("pair", json.dumps(report["pair"]), flush=True)
    save()
    if args.repeat:
        report["repeat"] = repeat_runs(HUB_IDS[args.variant], args.out, load_format="dummy")
        save()


def _attention_implementation(module) -> str | None:
    return getattr(getattr(module, "config", None), "_attn_implementation", None)


def _digests(value) -> list[str]:
    """sha256 of every tensor in a call's inputs or outputs (tensors, tuples, lists, dicts, transformers'
    ModelOutput), with its dtype, device and strides: equal values in another layout or dtype can take another
    kernel, whose rounding then differs."""
    if isinstance(value, torch.Tensor):
        digest = hashlib.sha256(f"{value.dtype} {value.device} {tuple(value.stride())}".encode())
        digest.update(value.detach().float().cpu().contiguous().numpy().tobytes())
        return [digest.hexdigest()[:16]]
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (tuple, list)):
        return [digest for item in value for digest in _digests(item)]
    return []


# Where a request's data flows, in order; a name a model lacks is skipped. The text encoder's first and last layers
# tell an embedding or rotary difference from an attention kernel's.
WATCHED = ("text_encoder.model.language_model.embed_tokens", "text_encoder.model.language_model.layers.0",
           "text_encoder.model.language_model.layers.27", "text_encoder.model", "text_encoder_2",
           "transformer.video_text_transformer_blocks.0", "transformer.visual_transformer_blocks.0",
           "transformer.visual_transformer_blocks.1", "transformer", "vae.decoder", "vocoder")


def _watch(models, calls: list) -> None:
    """Hooks on the WATCHED modules appending (name, "in" | "out", digests) to `calls` at each call."""
    for name in WATCHED:
        component, _, path = name.partition(".")
        module = getattr(models, component, None)
        try:
            module = module.get_submodule(path) if path and module is not None else module
        except AttributeError:
            module = None
        if module is None:
            continue
        module.register_forward_pre_hook(
            lambda _m, args, kwargs, name=name: calls.append((name, "in", _digests([args, kwargs]))), with_kwargs=True)
        if sum(t.numel() * t.element_size() for t in _tensors(module).values()) < 2**30:
            # The module's tensors as the call finds them (values, dtypes, devices, strides): a transform after
            # the load that changed them shows here, though the loaded models compared equal.
            module.register_forward_pre_hook(lambda m, _a, name=name: calls.append((name, "state", _state(m))))
        module.register_forward_hook(lambda _m, _i, output, name=name: calls.append((name, "out", _digests(output))))


def _state(module: torch.nn.Module) -> list[str]:
    digest = hashlib.sha256()
    for key, tensor in sorted(_tensors(module).items()):
        digest.update(f"{key} {tensor.dtype} {tensor.device} {tuple(tensor.stride())} {type(tensor).__name__}".encode())
        digest.update(tensor.detach().float().cpu().contiguous().numpy().tobytes())
    return [digest.hexdigest()[:16], type(module).__name__, str(next(iter(_tensors(module).values())).dtype)]


REQUEST = {"prompt": PROMPT, "seed": 7, "height": 256, "width": 384, "num_frames": 17, "num_inference_steps": 2,
           "save_output": True}


def _traced_generator(model_path: str, calls: list, **options):
    """A generator on an in-process worker whose watched modules append to `calls` (`_watch`)."""
    from k6serve import DiffGenerator
    from k6serve.engine_arguments import build_engine_config
    from k6serve.runtime.engine import Engine
    from k6serve.runtime.worker import ModelWorker

    config = build_engine_config(model_path, **options)
    worker = ModelWorker(config)
    _watch(worker.pipeline.models, calls)
    return DiffGenerator(Engine(config, worker=worker))


def traced_run(model_path: str, out: Path, **options) -> dict:
    """One request on an in-process worker, each watched module's inputs and outputs hashed."""
    calls: list = []
    generator = _traced_generator(model_path, calls, **options)
    try:
        result = generator.generate({**REQUEST, "output_path": str(out)})
    finally:
        generator.shutdown()
    print("traced", model_path, _sha256(result.output_file_path), len(calls), flush=True)
    return {"mp4": _sha256(result.output_file_path), "calls": calls}


def first_difference(a: dict, b: dict):
    """The first call whose name, direction or digests differ between two traced runs (None: none)."""
    for position, (x, y) in enumerate(zip(a["calls"], b["calls"])):
        if x != y:
            return {"call": position, "module": x[0], "kind": x[1], "other": list(y[:2]), "digests": [x[2], y[2]]}
    if len(a["calls"]) != len(b["calls"]):
        return {"call": min(len(a["calls"]), len(b["calls"])), "module": None, "kind": "count"}
    return None


def pair_report(first: dict, second: dict) -> dict:
    """Where two traced runs part: the MP4s' hashes, the call counts, the first differing call and every differing
    call (where the two made the same calls: the video decoder runs after the vocoder, so the first difference alone
    hides whether the frames differ too)."""
    return {"calls": [len(first["calls"]), len(second["calls"])], "mp4": [first["mp4"], second["mp4"]],
            "first_difference": first_difference(first, second),
            "differences": [[position, x[0], x[1]] for position, (x, y)
                            in enumerate(zip(first["calls"], second["calls"])) if x != y]}


def compare_traces(a: Path, b: Path) -> dict:
    """`pair_report` of two traced runs written to files by two processes (`--trace-only`)."""
    first, second = json.loads(a.read_text()), json.loads(b.read_text())
    # JSON made the calls' tuples lists; compared as tuples, as `first_difference` compares one process's.
    for trace in (first, second):
        trace["calls"] = [tuple(call) for call in trace["calls"]]
    return pair_report(first, second)


def repeat_runs(model_path: str, out: Path, **options) -> dict:
    """The dummy request four times on one in-process worker (two with cudnn.benchmark on, two with it off), each
    watched module's inputs and outputs hashed: the first call that differs between two runs is where a run stops
    repeating."""
    calls: list = []
    generator = _traced_generator(model_path, calls, **options)
    runs: list[dict[str, Any]] = []
    try:
        for index in range(4):
            # Set here: speed mode no longer turns the autotuner on (K6SERVE_CUDNN_BENCHMARK=1 would).
            torch.backends.cudnn.benchmark = index < 2
            calls.clear()
            result = generator.generate({**REQUEST, "output_path": str(out / f"run{index}")})
            runs.append({"mp4": _sha256(result.output_file_path), "calls": list(calls),
                         "cudnn_benchmark": torch.backends.cudnn.benchmark})
            print("run", index, runs[-1]["mp4"], len(calls), flush=True)
    finally:
        generator.shutdown()
    summary = {"mp4": [run["mp4"] for run in runs], "calls": [len(run["calls"]) for run in runs],
               "benchmark_on_same": runs[0]["mp4"] == runs[1]["mp4"],
               "benchmark_off_same": runs[2]["mp4"] == runs[3]["mp4"],
               "first_difference_on": first_difference(runs[0], runs[1]),
               "first_difference_off": first_difference(runs[2], runs[3]),
               "modules_called": sorted({call[0] for call in runs[0]["calls"]})}
    print("repeat", json.dumps(summary), flush=True)
    return summary


if __name__ == "__main__":
    main()
