"""`--performance-mode speed` with components offloaded whole (`--cpu-offload-components`): they keep speed mode's
transforms; components whose blocks are streamed (`--layerwise-offload-components`) stay eager.

The decision is checked as data for each residency plan (`speed_transform_targets`) and on CPU modules told they are
on CUDA (`apply_performance_mode` runs no forward there). The mechanics run on the CPU, offloading forced on as in
test_offload.py (the offload and compute devices both the CPU, every stage's copy a real copy into fresh storage):
the fused projections are what the offload packs (no unfused weight kept alive or copied), compiled blocks
(dynamo with a counting `aot_eager` backend, which takes the parameters as graph inputs as inductor does) compile
once and read each stage's copy, and a worker's requests, LoRA adapters included, give the same bits with the
transformed DiT offloaded whole as with it resident. The GPU test repeats that on CUDA with inductor and pinned
memory; scripts/gpu_speed_offload.py measures it at full size.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import gc
import json
import weakref

import numpy as np
import pytest
import torch
from test_speed_transforms import _HunyuanLikeVae  # a VAE with a decoder, as speed/vae.py finds one
from torch._dynamo.testing import CompileCounterWithBackend

from k6serve.bench.dit import dit_inputs
from k6serve.bench.geometry import generation_geometry
from k6serve.bench.tiny import TINY_TRANSFORMER_CONFIG
from k6serve.engine_arguments import build_engine_config
from k6serve.lora.spec import LoraSpec, SetLora, UnmergeLora
from k6serve.models.kandinsky6.checkpoint import build_dummy_transformer
from k6serve.models.kandinsky6.config import Kandinsky6TransformerConfig
from k6serve.models.kandinsky6.plan import kandinsky6_plan
from k6serve.offload import ComponentOffload, apply_offload
from k6serve.offload.residency import resolve_residency
from k6serve.request import OutputOptions, SamplingParams
from k6serve.runtime.worker import ModelWorker
from k6serve.speed import apply_fused_projections, apply_performance_mode, apply_regional_compile, is_compiled
from k6serve.speed import performance_mode
from k6serve.speed.performance_mode import speed_transform_targets
from k6serve.testing.lora_adapters import module_shapes, write_lora_adapter

pytestmark = pytest.mark.usefixtures("one_torch_thread")

CONFIG = Kandinsky6TransformerConfig.from_json_dict(TINY_TRANSFORMER_CONFIG)
GEOMETRY = generation_geometry(64, 96, 9, num_text_tokens=10)
CPU = torch.device("cpu")
NO_FILE = OutputOptions(save_output=False, return_frames=True)
GENERATION = ("text_encoder", "text_encoder_2", "transformer", "vae", "audio_vae", "vocoder")
BOTH = frozenset({"transformer", "vae"})


def _plan(mode="speed", *, cpu=(), layerwise=(), settings=()):
    return resolve_residency(mode, super_resolution=False, present=GENERATION, cpu_offload=cpu, layerwise=layerwise,
                             settings=settings)


@pytest.mark.parametrize(("mode", "flags", "device", "expected"), [
    ("speed", {}, "cuda", BOTH),  # all resident
    ("speed", {"cpu": ("transformer",)}, "cuda", BOTH),  # the DiT offloaded whole keeps fused + compiled blocks
    ("speed", {"cpu": ("dit", "vae")}, "cuda", BOTH),  # and the VAE its decode speed-ups
    ("speed", {"settings": (("transformer", "component"),)}, "cuda", BOTH),
    ("speed", {"cpu": ("all",)}, "cuda", BOTH),
    ("speed", {"layerwise": ("transformer",)}, "cuda", frozenset({"vae"})),  # streamed blocks stay eager
    ("speed", {"layerwise": ("all",)}, "cuda", frozenset({"vae"})),  # the VAE is offloaded whole there
    ("speed", {"settings": (("all", "layerwise"),)}, "cuda", frozenset({"vae"})),
    ("balanced", {}, "cuda", frozenset()),  # eager, the same bits as without offloading
    ("memory", {}, "cuda", frozenset()),
    ("memory", {"settings": (("vae", "resident"),)}, "cuda", frozenset()),
    ("speed", {"cpu": ("transformer",)}, "cpu", frozenset()),  # CPU: identical to the reference
])
def test_which_components_keep_speed_modes_transforms(mode, flags, device, expected):
    plan = _plan(mode, **flags)
    assert speed_transform_targets(mode, device, streamed=plan.streamed) == expected
    assert plan.offloaded_whole | plan.streamed == plan.offloaded
    assert not plan.offloaded_whole & plan.streamed


@dataclasses.dataclass
class _Models:
    transformer: torch.nn.Module
    vae: torch.nn.Module | None = None


def _model(dtype=torch.float32):
    return build_dummy_transformer(TINY_TRANSFORMER_CONFIG, device=CPU, dtype=dtype, seed=3)


def test_speed_mode_on_cuda_transforms_what_is_offloaded_whole_and_not_what_is_streamed(monkeypatch):
    """The composition on CPU modules named as CUDA (no forward runs): offloaded whole, the DiT is fused and compiled
    and the VAE gets its speed-ups (`--compile-vae true` included); streamed, the DiT stays eager."""
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", False)
    model, vae = _model(), _HunyuanLikeVae()
    report = apply_performance_mode(_Models(transformer=model, vae=vae), "speed", "cuda", compile_vae_decoder=True,
                                    offloaded_whole=BOTH)
    assert (report.num_fused_attentions, report.num_compiled_blocks) == (16, 6)
    assert report.vae == ("folded_upsample", "compile_decoder") and is_compiled(vae.decoder)
    assert report.notes[:2] == (
        "the DiT is offloaded whole: its fused, compiled blocks run on the copy moved to the GPU for its stage",
        "the video VAE is offloaded whole: its decode speed-ups run on the copy moved to the GPU for its stage")
    torch._dynamo.reset()

    model, vae = _model(), _HunyuanLikeVae()
    before = {name for name, _ in model.named_modules()}
    report = apply_performance_mode(_Models(transformer=model, vae=vae), "speed", "cuda",
                                    offloaded_whole=frozenset({"vae"}), streamed=frozenset({"transformer"}))
    assert (report.num_fused_attentions, report.num_compiled_blocks) == (0, 0)
    assert {name for name, _ in model.named_modules()} == before
    assert report.vae == ()
    assert report.notes == (
        "the DiT's blocks are streamed: they run eager (no fused projections, no compiled blocks)",
        "the video VAE is offloaded whole: its decode speed-ups run on the copy moved to the GPU for its stage")
    # The other modes stay eager whatever is offloaded (their outputs are the same bits offloaded or not).
    model = _model()
    report = apply_performance_mode(_Models(transformer=model), "balanced", "cuda", offloaded_whole=BOTH)
    assert not report.applied and not any(is_compiled(block) for block in model.visual_transformer_blocks)
    torch._dynamo.reset()


def _tensor_bytes(tensors) -> int:
    return sum(tensor.numel() * tensor.element_size() for tensor in tensors)


def test_fused_projections_are_what_the_offload_packs():
    """Fused on the host, then offloaded whole: the host copy holds exactly the fused model's parameters and buffers
    (the fused Q/K/V and K/V, never the unfused projections, which nothing keeps alive), and the offloaded model
    computes what it computed resident, within the fused projections' tolerance of the unfused model."""
    reference = _model()
    model = copy.deepcopy(reference)
    attention = model.visual_transformer_blocks[0].video_dec_block.self_attention
    unfused = [weakref.ref(linear.weight) for linear in (attention.to_query, attention.to_key, attention.to_value)]
    del attention
    assert apply_fused_projections(model) == 16
    inputs = dit_inputs(CONFIG, GEOMETRY, device=CPU, dtype=torch.float32, seed=4)
    with torch.inference_mode():
        resident_video, resident_audio = model(**inputs)
        expected_video, _ = reference(**inputs)
    stages = ComponentOffload({"transformer": model}, compute_device=CPU, offload_device=CPU, pin=False)
    gc.collect()
    assert all(ref() is None for ref in unfused)
    weights = stages.weights["transformer"]
    tensors = [*model.parameters(), *model.buffers()]
    assert {id(slot.tensor) for slot in weights.slots} == {id(tensor) for tensor in tensors}
    names = {name for name, _ in model.named_parameters()}
    assert any(name.endswith("to_query_key_value.weight") for name in names)
    assert not any(name.endswith(("to_key.weight", "to_value.weight")) for name in names)
    # As many bytes as the unfused model (concatenating copies nothing twice), each tensor packed at a 512-byte
    # boundary: at most that much padding per tensor on top.
    host_bytes = _tensor_bytes(slot.host for slot in weights.slots)
    assert host_bytes == _tensor_bytes(tensors) == _tensor_bytes([*reference.parameters(), *reference.buffers()])
    assert host_bytes <= weights.num_bytes <= host_bytes + 512 * len(weights.slots)
    assert weights.attached_to_host()
    with stages.stage("transformer"), torch.inference_mode():
        assert not weights.attached_to_host()
        # Inductor assumes a parameter aligned at compile time stays aligned (no check at run time): each copy is.
        assert all(tensor.data_ptr() % 16 == 0 for tensor in tensors)
        video, audio = model(**inputs)
    assert torch.equal(video, resident_video) and torch.equal(audio, resident_audio)
    scale = expected_video.abs().max()
    assert (video - expected_video).abs().max() <= 1e-5 * scale


def test_compiled_blocks_read_each_stages_copy_and_compile_once():
    """Blocks compiled, then offloaded whole: every stage attaches a fresh copy (new storage, the same Parameter
    objects), which passes the graphs' guards (no recompilation) and is what they read: a change to the host copy
    (what a LoRA merge into offloaded weights does) shows in the next stage's output, so no graph holds the weights
    of an earlier stage."""
    torch._dynamo.reset()
    reference = _model()
    model = copy.deepcopy(reference)
    apply_fused_projections(model)
    fused_eager = copy.deepcopy(model)
    counter = CompileCounterWithBackend("aot_eager")
    assert apply_regional_compile(model, kandinsky6_plan(CONFIG), backend=counter) == 6
    stages = ComponentOffload({"transformer": model}, compute_device=CPU, offload_device=CPU, pin=False)
    inputs = dit_inputs(CONFIG, GEOMETRY, device=CPU, dtype=torch.float32, seed=4)
    weights = stages.weights["transformer"]
    outputs, counts = [], []
    for _ in range(3):
        # As the pipelines do: the stage is entered outside inference mode (its copies are ordinary tensors, as the
        # resident weights are; copies made inside it would be inference tensors, another guard, one more compile).
        with stages.stage("transformer"):
            assert not weights.attached_to_host()  # the stage's own copy
            with torch.inference_mode():
                outputs.append(model(**inputs))
        counts.append(counter.frame_count)
    assert counts[0] > 0 and counts == [counts[0]] * 3
    with torch.inference_mode():
        expected_video, expected_audio = fused_eager(**inputs)
    assert all(torch.equal(video, expected_video) and torch.equal(audio, expected_audio) for video, audio in outputs)
    host = next(slot.host for slot in weights.slots
                if slot.tensor is model.visual_transformer_blocks[0].video_dec_block.self_attention
                .to_query_key_value.weight)
    host.mul_(2)
    fused_eager.visual_transformer_blocks[0].video_dec_block.self_attention.to_query_key_value.weight.data.mul_(2)
    with stages.stage("transformer"), torch.inference_mode():
        video, audio = model(**inputs)
    with torch.inference_mode():
        expected_video, expected_audio = fused_eager(**inputs)
    assert torch.equal(video, expected_video) and torch.equal(audio, expected_audio)
    assert not torch.equal(video, outputs[0][0]) and counter.frame_count == counts[0]
    torch._dynamo.reset()


def test_the_worker_tells_the_speed_transforms_what_is_offloaded_whole_and_what_is_streamed(tiny_distill_dir,
                                                                                             monkeypatch):
    from k6serve.runtime import worker as worker_module

    monkeypatch.setattr(ModelWorker, "offloads", property(lambda self: self.residency_plan.offloads))
    seen = []

    def record(*args, **kwargs):
        seen.append((kwargs["offloaded_whole"], kwargs["streamed"]))
        return apply_performance_mode(*args, **kwargs)

    monkeypatch.setattr(worker_module, "apply_performance_mode", record)
    for options in ({"cpu_offload_components": "dit vae"}, {"layerwise_offload_components": "dit"}, {}):
        ModelWorker(build_engine_config(str(tiny_distill_dir), device="cpu", attention_backend="sdpa", **options))
    assert seen == [(frozenset({"transformer", "vae"}), frozenset()),
                    (frozenset(), frozenset({"transformer"})),
                    (frozenset(), frozenset())]


def _speed_transformed_worker(folder, *, offloaded_whole=frozenset()) -> ModelWorker:
    """A CPU worker given speed mode's CUDA transforms (fused projections; blocks compiled by the module's counting
    backend, patched in by the caller), then, as the worker orders it, `offloaded_whole` offloaded whole."""
    worker = ModelWorker(build_engine_config(str(folder), device="cpu", attention_backend="sdpa"))
    report = apply_performance_mode(worker.pipeline.models, "speed", "cuda", offloaded_whole=offloaded_whole)
    assert report.num_fused_attentions > 0 and report.num_compiled_blocks > 0
    if offloaded_whole:
        components = worker.pipeline.components()
        plan = resolve_residency("speed", super_resolution="latent_upscaler" in components, present=components,
                                 cpu_offload=tuple(offloaded_whole))
        apply_offload(worker.pipeline, "speed", residency=plan, compute_device="cpu")
    return worker


def _same(result, other) -> bool:
    return np.array_equal(result.frames, other.frames) and np.array_equal(result.audio, other.audio)


def test_speed_mode_with_the_dit_offloaded_whole_gives_the_resident_bits(tiny_distill_dir, tmp_path, monkeypatch):
    """Through the worker: speed mode's fused, compiled DiT offloaded whole (with the VAE) gives the frames and audio
    of the same transforms resident, bit for bit; its second request compiles nothing; its weights are back on the
    host after each request; and LoRA adapters on it (merged into the host copy, or dynamic, on a fused K
    projection's rows too) give the resident adapted bits, and unmerging restores the base ones."""
    torch._dynamo.reset()
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", False)
    counter = CompileCounterWithBackend("aot_eager")
    monkeypatch.setattr(performance_mode, "apply_regional_compile",
                        functools.partial(apply_regional_compile, backend=counter))
    params = SamplingParams(prompt="a fox in the snow", seed=7, height=32, width=48, num_frames=5,
                            num_inference_steps=2)
    resident = _speed_transformed_worker(tiny_distill_dir)
    offloaded = _speed_transformed_worker(tiny_distill_dir, offloaded_whole=BOTH)
    residency = offloaded.pipeline.residency
    assert set(residency.weights) == {"transformer", "vae"}
    transformer = offloaded.pipeline.models.transformer
    assert {id(slot.tensor) for slot in residency.weights["transformer"].slots} == {
        id(tensor) for tensor in (*transformer.parameters(), *transformer.buffers())}
    expected = resident.run(params, NO_FILE)
    assert counter.frame_count > 0  # the blocks ran compiled
    first = offloaded.run(params, NO_FILE)
    compiled_after_first = counter.frame_count
    second = offloaded.run(params, NO_FILE)
    assert _same(first, expected) and _same(second, expected)
    assert second.timings["graphs_compiled"] == 0 and counter.frame_count == compiled_after_first
    assert all(weights.attached_to_host() for weights in residency.weights.values())

    key = "visual_transformer_blocks.0.video_dec_block.self_attention.to_key"  # rows of a fused Q/K/V
    ffn = "visual_transformer_blocks.0.video_dec_block.feed_forward.net.0.proj"
    shapes = module_shapes(ModelWorker(build_engine_config(str(tiny_distill_dir), device="cpu")
                                       ).pipeline.models.transformer, (key, ffn))
    adapter = write_lora_adapter(tmp_path / "adapter.safetensors", shapes, rank=2, seed=0, amplitude=0.5)
    host = {slot.tensor: slot.host.clone() for slot in residency.weights["transformer"].slots}
    for merge_mode in ("merge", "dynamic"):
        operation = SetLora(specs=(LoraSpec(nickname="fox", path=str(adapter)),), merge_mode=merge_mode)
        for worker in (resident, offloaded):
            worker.apply_lora_operation(operation)
        adapted = offloaded.run(params, NO_FILE)
        assert _same(adapted, resident.run(params, NO_FILE)) and not _same(adapted, expected)
        for worker in (resident, offloaded):
            worker.apply_lora_operation(UnmergeLora())
        assert all(torch.equal(slot.host, host[slot.tensor]) for slot in residency.weights["transformer"].slots)
        assert _same(offloaded.run(params, NO_FILE), expected)
    torch._dynamo.reset()


def test_super_resolution_with_the_dit_and_vae_offloaded_whole_gives_the_resident_bits(tiny_sr_dir, tmp_path,
                                                                                        monkeypatch):
    """The SR model the same way: its fused Q/K/V (`FusedSRSelfAttention`), compiled blocks and K-VAE offloaded whole
    give the resident transformed model's frames, and the second request compiles nothing."""
    from k6serve.testing.clips import make_clip

    torch._dynamo.reset()
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", False)
    counter = CompileCounterWithBackend("aot_eager")
    monkeypatch.setattr(performance_mode, "apply_regional_compile",
                        functools.partial(apply_regional_compile, backend=counter))
    clip = make_clip(tmp_path / "clip.mp4", width=64, height=32, num_frames=9, fps=24)
    params = SamplingParams(video_path=str(clip), sr_resolution_scale=2, num_inference_steps=2, seed=3)
    expected = _speed_transformed_worker(tiny_sr_dir).run(params, NO_FILE)
    assert counter.frame_count > 0
    offloaded = _speed_transformed_worker(tiny_sr_dir, offloaded_whole=BOTH)
    residency = offloaded.pipeline.residency
    assert set(residency.weights) == {"transformer", "vae"} and residency.resident == {"latent_upscaler"}
    first = offloaded.run(params, NO_FILE)
    second = offloaded.run(params, NO_FILE)
    assert np.array_equal(first.frames, expected.frames) and np.array_equal(second.frames, expected.frames)
    assert second.timings["graphs_compiled"] == 0
    assert all(weights.attached_to_host() for weights in residency.weights.values())
    torch._dynamo.reset()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="pinned offloading and speed mode's compile need CUDA")
def test_cuda_speed_mode_with_the_dit_and_vae_offloaded_whole(tiny_distill_dir):
    """On a GPU: `--cpu-offload-components dit vae` with speed keeps the fused projections and compiled blocks (as
    many as resident), packs the fused weights into pinned host memory (nothing else of the DiT's), compiles nothing
    more on the warm request, and gives the resident speed run's frames and audio bit for bit."""
    params = SamplingParams(prompt="a fox in the snow", seed=7, height=32, width=48, num_frames=5)
    base = dict(device="cuda", attention_backend="sdpa")
    resident_worker = ModelWorker(build_engine_config(str(tiny_distill_dir), **base))
    resident = resident_worker.run(params, NO_FILE)
    worker = ModelWorker(build_engine_config(str(tiny_distill_dir), cpu_offload_components="dit vae", **base))
    report, expected = worker.performance_report, resident_worker.performance_report
    assert (report.num_fused_attentions, report.num_compiled_blocks, report.vae) == (
        expected.num_fused_attentions, expected.num_compiled_blocks, expected.vae)
    assert report.num_compiled_blocks > 0 and report.notes[0].startswith("the DiT is offloaded whole")
    transformer = worker.pipeline.models.transformer
    weights = worker.pipeline.residency.weights["transformer"]
    assert weights.pinned and {id(slot.tensor) for slot in weights.slots} == {
        id(tensor) for tensor in (*transformer.parameters(), *transformer.buffers())}
    assert all(p.device.type == "cpu" for p in transformer.parameters())
    first = worker.run(params, NO_FILE)
    second = worker.run(params, NO_FILE)
    assert second.timings["graphs_compiled"] == 0
    assert all(p.device.type == "cpu" for p in transformer.parameters())
    for result in (first, second):
        assert np.array_equal(result.frames, resident.frames) and np.array_equal(result.audio, resident.audio)


def test_gpu_speed_offload_script_runs_at_toy_size(tmp_path, demo_dir, monkeypatch, load_script):
    """The GPU script on the demo checkpoint, offloading forced on the CPU: the offloaded configuration first, a cold
    and a warm request each, and the bit comparison of the two (eager on the CPU, so equal)."""
    monkeypatch.setattr(ModelWorker, "offloads", property(lambda self: self.residency_plan.offloads))
    assert load_script("gpu_speed_offload").main(["--tiny", "--out", str(tmp_path)]) == 0
    rows = [json.loads(line) for line in (tmp_path / "speed_offload.jsonl").read_text().splitlines()]
    assert [(row["configuration"], row["request"]) for row in rows] == [
        ("speed, --cpu-offload-components transformer", 0), ("speed, --cpu-offload-components transformer", 1),
        ("speed, resident", 0), ("speed, resident", 1)]
    assert all(row["total"] > 0 and "denoise_step_median" in row and "graphs_compiled" in row for row in rows)
    summary = json.loads((tmp_path / "speed_offload.json").read_text())
    assert summary["bitwise_equal"] == {"frames": True, "audio": True} and summary["size"] == [32, 48, 5]
    offloaded = summary["configurations"]["speed, --cpu-offload-components transformer"]
    assert "component transformer" in offloaded["offload"]
    assert summary["configurations"]["speed, resident"]["offload"] is None
