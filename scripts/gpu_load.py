"""Reading a DiT's safetensors files onto the GPU, at full size: k6serve's loader against the one it replaced and
diffusers' `from_pretrained`, from a cold page cache and a warm one.

    python3 scripts/gpu_load.py --out $OUT/load [--pro-blocks 20] [--budget-s 520] [--stage dit|text-encoder|all]

Writes the checkpoints first, with random weights as the released files store them (bf16, the modulations and
time embeddings in fp32; 10 GB shards and their index), under `--folder` (default /tmp/k6serve-load): Lite-distill's
DiT whole (3.18 B parameters), and Pro-distill's with its first `--pro-blocks` fused blocks of 60 (the host's disk
does not hold all 56 GiB). Then, per checkpoint, each way of loading it, cold (the files' pages dropped from the
page cache with posix_fadvise, the page cache's size before and after recorded as the evidence) and warm (right
after): seconds, GB/s, the host's anonymous memory at its peak above where it started (sampled every 2 ms), and the
GPU's peak. The ways:
- `k6serve`: `load_transformer` (each tensor through two pinned 64 MiB buffers, cast on the GPU);
- `previous`: the loader before it (safetensors' `load_file` of every shard, a host copy of each tensor, the model
  cast on the host, then `.to(cuda)`);
- `pageable`: each tensor copied to the GPU straight from the file's mapping (`tensor.to(cuda)`), then cast;
- `diffusers`: `Kandinsky6Transformer3DModel.from_pretrained(torch_dtype=bfloat16).to(cuda)`.
k6serve's weights are compared with the previous loader's, bit for bit. `--stage text-encoder` does the same for the
Qwen2.5-VL-7B text encoder (random bf16 weights, transformers' `save_pretrained`): k6serve's loader (transformers'
`from_pretrained` on the host, then `.to(cuda)`) against `from_pretrained(device_map={"": cuda})`. Cases stop being
started once `--budget-s`
has passed (the device's commands end at 10 minutes); what ran is in the JSON, written after every case.

Results: <out>/gpu_load.json and gpu_load.md.
"""

from __future__ import annotations

import argparse
import json
import os
import threading
import time
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from k6serve.models.checkpoint_files import safetensors_files
from k6serve.models.kandinsky6.checkpoint import build_dummy_transformer, load_transformer
from k6serve.models.kandinsky6.config import Kandinsky6TransformerConfig
from k6serve.models.kandinsky6.released_configs import RELEASED_TRANSFORMER_CONFIGS
from k6serve.models.kandinsky6.transformer import Kandinsky6Transformer, cast_for_inference
from k6serve.models.plan import keeps_fp32

SHARD_BYTES = 10 * 10**9
STORED_FP32 = ("time_embeddings", "modulation")  # kept in fp32 in the released files


def _meminfo(key: str) -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    return -1


def _anonymous() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    return -1


def write_checkpoint(folder: Path, config: dict) -> int:
    """Random bf16 weights built on the GPU, written in diffusers' layout; the bytes written."""
    model = build_dummy_transformer(config, device=torch.device("cuda"), dtype=torch.bfloat16)
    total = write_dit(model, config, folder)
    del model
    torch.cuda.empty_cache()
    os.sync()
    return total


def write_dit(model: torch.nn.Module, config: dict, folder: Path) -> int:
    """`model`'s weights in diffusers' layout under `folder`, as the released files store them (bf16, the modulations
    and time embeddings in fp32, `SHARD_BYTES` shards and their index), with `config` as its config.json; the bytes
    written. Also used by scripts/gpu_folder_checkpoint.py."""
    folder.mkdir(parents=True, exist_ok=True)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = total = 0
    for name, tensor in model.state_dict().items():
        stored = tensor.float() if keeps_fp32(name, STORED_FP32) else tensor
        nbytes = stored.numel() * stored.element_size()
        if size and size + nbytes > SHARD_BYTES:
            shards.append({})
            size = 0
        shards[-1][name] = stored.cpu()
        size += nbytes
        total += nbytes
    weight_map = {}
    for index, shard in enumerate(shards, 1):
        name = f"diffusion_pytorch_model-{index:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(folder / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, name))
    (folder / "diffusion_pytorch_model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))
    (folder / "config.json").write_text(json.dumps(
        {"_class_name": "Kandinsky6Transformer3DModel", "_diffusers_version": "0.42.1", **config}))
    return total


def drop_cache(folder: Path) -> dict:
    before = _meminfo("Cached")
    for path in sorted(folder.glob("*.safetensors")):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return {"page_cache_before_gib": round(before / 2**30, 2),
            "page_cache_after_gib": round(_meminfo("Cached") / 2**30, 2)}


def load_k6serve(folder: Path) -> torch.nn.Module:
    return load_transformer(folder, device=torch.device("cuda"), dtype=torch.bfloat16)


def load_previous(folder: Path) -> torch.nn.Module:
    config = Kandinsky6TransformerConfig.from_json_dict(json.loads((folder / "config.json").read_text()))
    with torch.device("meta"):
        model = Kandinsky6Transformer(config)
    state = {}
    for path in safetensors_files(folder):
        state.update(load_file(str(path)))
    state = {name: tensor.clone() for name, tensor in state.items()}
    model.load_state_dict(state, strict=True, assign=True)
    del state
    cast_for_inference(model, torch.bfloat16)
    return model.to("cuda")


def load_pageable(folder: Path) -> torch.nn.Module:
    config = Kandinsky6TransformerConfig.from_json_dict(json.loads((folder / "config.json").read_text()))
    with torch.device("meta"):
        model = cast_for_inference(Kandinsky6Transformer(config), torch.bfloat16)
    dtypes = {name: parameter.dtype for name, parameter in model.named_parameters()}
    state = {}
    for path in safetensors_files(folder):
        with safe_open(str(path), framework="pt") as handle:
            for name in handle.keys():
                stored = handle.get_tensor(name)
                state[name] = stored.to("cuda").to(dtypes.get(name, stored.dtype))
    model.load_state_dict(state, strict=True, assign=True)
    return model


def load_diffusers(folder: Path) -> torch.nn.Module:
    from diffusers import Kandinsky6Transformer3DModel

    return Kandinsky6Transformer3DModel.from_pretrained(str(folder), torch_dtype=torch.bfloat16).to("cuda")


LOADERS = {"k6serve": load_k6serve, "previous": load_previous, "pageable": load_pageable,
           "diffusers": load_diffusers}


def write_text_encoder(folder: Path) -> int:
    import transformers

    from k6serve.models.kandinsky6.checkpoint import dummy_qwen_config
    from k6serve.testing.tokenizers import train_qwen_tokenizer

    with torch.device("cuda"):
        model = transformers.Qwen2_5_VLForConditionalGeneration._from_config(
            dummy_qwen_config(train_qwen_tokenizer()), dtype=torch.bfloat16)
    nbytes = sum(tensor.numel() * tensor.element_size() for tensor in model.state_dict().values())
    model.save_pretrained(str(folder))
    del model
    torch.cuda.empty_cache()
    os.sync()
    return nbytes


def text_encoder_files(folder: Path) -> list[Path]:
    return sorted(folder.glob("*.safetensors"))


def load_text_encoder_k6serve(folder: Path) -> torch.nn.Module:
    from k6serve.models.kandinsky6.checkpoint import _load_transformers

    return _load_transformers(folder.parent, folder.name, "Qwen2_5_VLForConditionalGeneration",
                              torch.device("cuda"), torch.bfloat16)


def load_text_encoder_device_map(folder: Path) -> torch.nn.Module:
    import transformers

    return transformers.Qwen2_5_VLForConditionalGeneration.from_pretrained(
        str(folder), dtype=torch.bfloat16, use_safetensors=True, device_map={"": torch.device("cuda")})


TEXT_ENCODER_LOADERS = {"k6serve": load_text_encoder_k6serve, "device_map": load_text_encoder_device_map}


def measure(loader, folder: Path) -> tuple[torch.nn.Module, dict]:
    baseline, peak, running = _anonymous(), [0], [True]

    def sample() -> None:
        while running[0]:
            peak[0] = max(peak[0], _anonymous())
            time.sleep(0.002)

    sampler = threading.Thread(target=sample, daemon=True)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    sampler.start()
    start = time.perf_counter()
    try:
        model = loader(folder)
        torch.cuda.synchronize()
        seconds = time.perf_counter() - start
    finally:
        running[0] = False
        sampler.join()
    return model, {"seconds": round(seconds, 2), "host_anonymous_peak_gib": round((peak[0] - baseline) / 2**30, 2),
                   "gpu_peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2)}


def same_weights(first: torch.nn.Module, second: torch.nn.Module) -> bool:
    one, two = first.state_dict(), second.state_dict()
    return one.keys() == two.keys() and all(
        one[name].dtype == two[name].dtype and torch.equal(one[name], two[name]) for name in one)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--folder", type=Path, default=Path("/tmp/k6serve-load"))
    parser.add_argument("--pro-blocks", type=int, default=20)
    parser.add_argument("--budget-s", type=float, default=520.0)
    parser.add_argument("--loaders", nargs="+", default=list(LOADERS), choices=list(LOADERS))
    parser.add_argument("--stage", choices=["dit", "text-encoder", "all"], default="all")
    args = parser.parse_args()
    start = time.perf_counter()
    args.out.mkdir(parents=True, exist_ok=True)
    pro = dict(RELEASED_TRANSFORMER_CONFIGS["pro_distill"], num_visual_blocks=args.pro_blocks)
    checkpoints = {"lite-distill": RELEASED_TRANSFORMER_CONFIGS["lite_distill"],
                   f"pro-distill-{args.pro_blocks}-blocks": pro}
    report: dict = {"commit": os.environ.get("K6SERVE_COMMIT"), "torch": torch.__version__,
                    "cuda": torch.version.cuda, "device": torch.cuda.get_device_name(),
                    "host_memory_gib": round(_meminfo("MemTotal") / 2**30, 1), "threads": torch.get_num_threads(),
                    "checkpoints": {}, "cases": []}

    def save() -> None:
        (args.out / "gpu_load.json").write_text(json.dumps(report, indent=2))
        rows = ["| checkpoint | loader | cache | seconds | GB/s | host anon peak GiB | GPU peak GiB | note |",
                "|---|---|---|---|---|---|---|---|"]
        for case in report["cases"]:
            rows.append(f"| {case['checkpoint']} | {case['loader']} | {case['cache']} | {case.get('seconds', '-')} | "
                        f"{case.get('gb_per_s', '-')} | {case.get('host_anonymous_peak_gib', '-')} | "
                        f"{case.get('gpu_peak_gib', '-')} | {case.get('error', '')} |")
        (args.out / "gpu_load.md").write_text("\n".join(rows) + "\n")

    if args.stage in ("text-encoder", "all"):
        if not text_encoder_stage(args, report, save, start):
            return
    if args.stage == "text-encoder":
        save()
        return
    for label, config in checkpoints.items():
        folder = args.folder / label
        written = time.perf_counter()
        nbytes = write_checkpoint(folder, config)
        report["checkpoints"][label] = {"bytes": nbytes, "write_s": round(time.perf_counter() - written, 1),
                                        "shards": len(safetensors_files(folder))}
        print(label, report["checkpoints"][label], flush=True)
        if not run_cases(args, report, save, start, label, {name: LOADERS[name] for name in args.loaders}, folder,
                         nbytes):
            return
        if time.perf_counter() - start < args.budget_s:  # untimed: both models resident, compared on the GPU
            ours, before = load_k6serve(folder), load_previous(folder)
            report["checkpoints"][label]["same_bits_as_previous"] = same_weights(ours, before)
            report["checkpoints"][label]["dtypes"] = sorted({str(t.dtype) for t in ours.state_dict().values()})
            del ours, before
            torch.cuda.empty_cache()
            print(label, report["checkpoints"][label], flush=True)
            save()
        for path in folder.iterdir():
            path.unlink()
    save()


def run_cases(args: argparse.Namespace, report: dict, save, start: float, label: str, loaders: dict, folder: Path,
              nbytes: int) -> bool:
    """Each of `loaders` on `folder`, cold then warm, each case recorded as it ends; False once the budget is spent."""
    for loader, load in loaders.items():
        for cache in ("cold", "warm"):
            if time.perf_counter() - start > args.budget_s:
                report["stopped"] = f"budget of {args.budget_s} s spent"
                save()
                return False
            case = {"checkpoint": label, "loader": loader, "cache": cache}
            if cache == "cold":
                case.update(drop_cache(folder))
            try:
                model, figures = measure(load, folder)
                del model
                case.update(figures, gb_per_s=round(nbytes / 1e9 / figures["seconds"], 2))
            except Exception as exc:  # noqa: BLE001 - recorded, the other cases go on
                case["error"] = f"{type(exc).__name__}: {exc}"[:300]
            torch.cuda.empty_cache()
            report["cases"].append(case)
            print(case, flush=True)
            save()
    return True


def text_encoder_stage(args: argparse.Namespace, report: dict, save, start: float) -> bool:
    """The text encoder's cases; False once the budget is spent."""
    folder = args.folder / "text_encoder"
    written = time.perf_counter()
    nbytes = write_text_encoder(folder)
    label = "qwen2.5-vl-7b"
    report["checkpoints"][label] = {"bytes": nbytes, "write_s": round(time.perf_counter() - written, 1),
                                    "shards": len(text_encoder_files(folder))}
    print(label, report["checkpoints"][label], flush=True)
    if not run_cases(args, report, save, start, label, TEXT_ENCODER_LOADERS, folder, nbytes):
        return False
    try:
        ours, mapped = load_text_encoder_k6serve(folder), load_text_encoder_device_map(folder)
        report["checkpoints"][label]["same_bits_device_map"] = same_weights(ours, mapped)
        del ours, mapped
    except Exception as exc:  # noqa: BLE001
        report["checkpoints"][label]["same_bits_device_map"] = f"{type(exc).__name__}: {exc}"[:300]
    torch.cuda.empty_cache()
    for path in folder.iterdir():
        path.unlink()
    save()
    return True


if __name__ == "__main__":
    main()
