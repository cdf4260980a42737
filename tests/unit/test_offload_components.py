"""Per component offloading, the seed's flags: `--cpu-offload-components` and `--layerwise-offload-components`.

The plan (offload/residency.py) is checked as data: the seed's recipes, groups, priorities and the refusals' text.
The worker is checked on the CPU as test_offload.py does (offloading forced on; every move a real copy): outputs
bitwise equal to the resident run, only the named components offloaded, the others never moved, and the speed
transforms kept for a resident DiT or one offloaded whole and left out for a streamed one (test_speed_offload.py).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from k6serve.engine_arguments import build_engine_config
from k6serve.offload.residency import resolve_residency
from k6serve.request import OutputOptions, SamplingParams
from k6serve.runtime.worker import ModelWorker
from k6serve.speed import apply_performance_mode
from k6serve.testing.clips import make_clip

NO_FILE = OutputOptions(save_output=False, return_frames=True)
GENERATION = ("text_encoder", "text_encoder_2", "transformer", "vae", "audio_vae", "vocoder")
SR = ("transformer", "vae", "latent_upscaler")


def _plan(mode="speed", *, sr=False, cpu=(), layerwise=(), settings=()):
    return resolve_residency(mode, super_resolution=sr, present=SR if sr else GENERATION, cpu_offload=cpu,
                             layerwise=layerwise, settings=settings)


def test_the_seeds_recipes():
    # "--cpu-offload-components transformer text_encoder vae": those three whole, the rest resident (speed).
    plan = _plan(cpu=("transformer", "text_encoder", "vae"))
    assert plan.named("component") == ("text_encoder", "transformer", "vae")
    assert plan.named("resident") == ("text_encoder_2", "audio_vae", "vocoder") and not plan.notes
    # "--layerwise-offload-components all": the DiT and the text encoders streamed, the rest whole, and said so.
    plan = _plan(layerwise=("all",))
    assert plan.named("layerwise") == ("text_encoder", "text_encoder_2", "transformer")
    assert plan.named("component") == ("vae", "audio_vae", "vocoder") and plan.named("resident") == ()
    assert plan.notes == ("layerwise offload: vae, audio_vae, vocoder offloaded whole for their stage "
                          "(no repeated blocks worth streaming: their weights are small next to their activations)",)
    # SR's "vae latent_upscaler": both whole, the DiT resident.
    plan = _plan(sr=True, layerwise=("vae", "latent_upscaler"))
    assert plan.residency == {"transformer": "resident", "vae": "component", "latent_upscaler": "component"}


def test_modes_give_the_defaults_and_the_flags_override_them():
    assert set(_plan("speed").residency.values()) == {"resident"}
    assert set(_plan("balanced").residency.values()) == {"component"}
    assert _plan("memory").named("layerwise") == ("text_encoder", "text_encoder_2", "transformer")
    # none keeps resident what the mode would offload whole, and stops what it would stream.
    assert _plan("balanced", cpu=("none",)).named("component") == ()
    assert _plan("memory", cpu=("none",)).named("component") == ()
    assert _plan("memory", layerwise=("none",)).named("layerwise") == ()
    # layerwise has the last word, also over "all"; groups expand to their members.
    plan = _plan(cpu=("all",), layerwise=("dit",))
    assert plan.named("layerwise") == ("transformer",) and "transformer" not in plan.named("component")
    assert _plan(cpu=("text_encoders", "audio")).named("component") == ("text_encoder", "text_encoder_2",
                                                                         "audio_vae", "vocoder")
    # A component the checkpoint lacks (the optional audio ones) is left out of the plan.
    plan = resolve_residency("speed", super_resolution=False, present=GENERATION[:4], cpu_offload=("audio",))
    assert "audio_vae" not in plan.residency and not plan.offloads


@pytest.mark.parametrize(("kwargs", "message"), [
    (dict(cpu=("vae",), layerwise=("vae",)),
     r"^vae named by both --cpu-offload-components and --layerwise-offload-components; name each component in one "
     r"of them\.$"),
    (dict(sr=True, cpu=("audio_vae",)),
     r"^--cpu-offload-components audio_vae: the super-resolution model has no such component\. Its components: "
     r"transformer, vae, latent_upscaler \(also: all, none, dit, default\)\.$"),
    (dict(layerwise=("latent_upscaler",)),
     r"^--layerwise-offload-components latent_upscaler: the generation model has no such component\. Its "
     r"components: text_encoder, text_encoder_2, transformer, vae, audio_vae, vocoder \(also: all, none, dit, "
     r"text_encoders, audio, default\)\.$"),
])
def test_plan_refusals_say_what_to_do(kwargs, message):
    with pytest.raises(ValueError, match=message):
        _plan(**kwargs)


@pytest.mark.parametrize(("options", "message"), [
    ({"cpu_offload_components": "vae text_encoderz"},
     r"^--cpu-offload-components: unknown component 'text_encoderz'\. Known: all, none, text_encoder, "),
    ({"layerwise_offload_components": ["none", "vae"]},
     r"^--layerwise-offload-components none cannot be combined with other names \(none vae\)"),
    ({"cpu_offload_components": 3}, r"^--cpu-offload-components takes component names \(e\.g\. "),
    ({"num_gpus": 2, "tp_size": 2, "cpu_offload_components": "vae"},
     r"^--cpu-offload-components vae offloads the weights to host memory, which cannot work with weights sharded "
     r"across GPUs \(--tp-size 2\): drop --cpu-offload-components vae to keep --tp-size 2, or drop --tp-size 2 "
     r"to offload\.$"),
    ({"num_gpus": 2, "tp_size": 2, "performance_mode": "balanced", "component_residency": "vae=component_offload"},
     r"^--performance-mode balanced --component-residency vae=component offloads the weights .*: use "
     r"--performance-mode speed and drop --component-residency vae=component to keep --tp-size 2"),
    ({"cpu_offload_components": ""}, r"^--cpu-offload-components was given no component name \(got ''\)"),
    ({"component_residency": [" "]}, r"^--component-residency was given no NAME=MODE item"),
    ({"component_residency": "dit=resident transformer=layerwise_offload"},
     r"^--component-residency names transformer twice, with different residencies"),
])
def test_config_refusals(options, message):
    with pytest.raises(ValueError, match=message):
        build_engine_config("demo", **options)


def test_config_accepts_strings_lists_and_block_streaming_with_a_streamed_dit():
    runtime = build_engine_config("demo", cpu_offload_components="Text_Encoder, vae vae",
                                  layerwise_offload_components=["dit"], offload_prefetch_blocks=2).runtime
    assert runtime.cpu_offload_components == ("text_encoder", "vae")
    # dit is read as transformer (the two are one setting), and kept as typed, for the messages
    assert runtime.layerwise_offload_components == ("dit",) and runtime.streams_dit and runtime.offloads
    runtime = build_engine_config("demo", cpu_offload_components=["none"]).runtime
    assert not runtime.offloads and not runtime.streams_dit  # speed with nothing offloaded
    # The sharded layouts stay available when the flags offload nothing.
    build_engine_config("demo", num_gpus=2, tp_size=2, cpu_offload_components="none")


def test_messages_echo_dit_as_the_user_typed_it():
    """`dit` is another name of `transformer`: read as one setting, but echoed back as typed, not renamed."""
    with pytest.raises(ValueError, match=r"^--cpu-offload-components dit offloads the weights to host memory, which "
                                         r"cannot work with weights sharded across GPUs \(--tp-size 2\): drop "
                                         r"--cpu-offload-components dit to keep --tp-size 2, or drop --tp-size 2 "
                                         r"to offload\.$"):
        build_engine_config("demo", num_gpus=2, tp_size=2, cpu_offload_components="dit")
    with pytest.raises(ValueError, match=r"^--component-residency dit=component offloads"):
        build_engine_config("demo", num_gpus=2, tp_size=2, component_residency="dit=component_offload")
    runtime = build_engine_config("demo", cpu_offload_components="dit transformer vae").runtime
    assert runtime.cpu_offload_components == ("dit", "vae")  # one setting, the first spelling kept
    assert runtime.offload_flags == "--cpu-offload-components dit vae"
    assert runtime.residency_plan(super_resolution=False).named("component") == ("transformer", "vae")
    assert runtime.residency_plan(super_resolution=True).named("component") == ("transformer", "vae")


@pytest.mark.parametrize("command", ["generate", "serve"])
def test_flags_reach_the_runtime_config(command, tmp_path, engine_config_from_cli):
    extra = ["--prompt", "x"] if command == "generate" else []
    runtime = engine_config_from_cli(command, "--model-path", "demo", "--cpu-offload-components", "transformer",
                                     "text_encoder", "vae", "--layerwise-offload-components", "text_encoder_2",
                                     *extra).runtime
    assert runtime.cpu_offload_components == ("transformer", "text_encoder", "vae")
    assert runtime.layerwise_offload_components == ("text_encoder_2",)
    config_file = tmp_path / "engine.yaml"
    config_file.write_text("cpu-offload-components: [vae, audio]\nlayerwise-offload-components: all\n")
    runtime = engine_config_from_cli(command, "--model-path", "demo", "--config", str(config_file), *extra).runtime
    assert (runtime.cpu_offload_components, runtime.layerwise_offload_components) == (("vae", "audio"), ("all",))


def test_component_residency_has_the_last_word():
    # Keep the VAE on the GPU under memory mode (the seed's "component-specific residency settings").
    plan = _plan("memory", settings=(("vae", "resident"),))
    assert plan.residency["vae"] == "resident" and plan.residency["transformer"] == "layerwise"
    # Groups first, whatever the order given: everything whole but a resident DiT.
    plan = _plan("speed", settings=(("transformer", "resident"), ("all", "component")))
    assert plan.named("resident") == ("transformer",) and len(plan.named("component")) == 5
    # Over both flags; layerwise for a component without blocks to stream is whole, and said so.
    plan = _plan(cpu=("vae",), layerwise=("dit",), settings=(("vae", "layerwise"), ("dit", "component")))
    assert plan.residency["vae"] == plan.residency["transformer"] == "component"
    assert plan.notes == ("layerwise offload: vae offloaded whole for their stage (no repeated blocks worth "
                          "streaming: their weights are small next to their activations)",)


@pytest.mark.parametrize(("value", "expected"), [
    ("vae=resident, dit=layerwise-offload", (("vae", "resident"), ("dit", "layerwise"))),
    ([("vae", "resident")], (("vae", "resident"),)),  # pairs: the API, or a config that is built again
    (["VAE=Component_Offload"], (("vae", "component"),)),
    ({"audio": "resident", "text_encoders": "component"}, (("audio", "resident"), ("text_encoders", "component"))),
])
def test_component_residency_forms(value, expected):
    assert build_engine_config("demo", component_residency=value).runtime.component_residency == expected


@pytest.mark.parametrize(("value", "message"), [
    ("vae", r"^--component-residency: 'vae' is not NAME=MODE \(e\.g\. vae=resident\)\.$"),
    ("vae=fast", r"^--component-residency vae=fast: the residency must be one of resident, component_offload, "
                 r"component, layerwise_offload, layerwise\.$"),
    ("vea=resident", r"^--component-residency: unknown component 'vea'\. Known: all, text_encoder, "),
    ("vae=resident vae=component", r"^--component-residency names vae twice, with different residencies"),
    (7, r"^--component-residency takes NAME=MODE items"),
])
def test_component_residency_refusals(value, message):
    with pytest.raises(ValueError, match=message):
        build_engine_config("demo", component_residency=value)


def test_component_residency_in_the_config_rules(tmp_path, engine_config_from_cli):
    # Everything resident again: balanced offloads nothing, so a sharded layout is allowed.
    runtime = build_engine_config("demo", performance_mode="balanced", component_residency="all=resident",
                                  num_gpus=2, tp_size=2).runtime
    assert not runtime.offloads
    # A streamed DiT by this flag alone takes the block-streaming knobs.
    runtime = build_engine_config("demo", component_residency="transformer=layerwise_offload",
                                  offload_resident_blocks=3).runtime
    assert runtime.streams_dit and runtime.offloads
    with pytest.raises(ValueError, match=r"`--performance-mode memory --component-residency dit=component` "
                                         r"streams only text encoders"):
        build_engine_config("demo", performance_mode="memory", component_residency="dit=component",
                            offload_resident_blocks=2)
    # ... while copying the text encoders' blocks further ahead is theirs to take.
    build_engine_config("demo", performance_mode="memory", component_residency="dit=component",
                        offload_prefetch_blocks=2)
    with pytest.raises(ValueError, match=r"^--offload-prefetch-blocks 2 applies only when blocks are streamed"):
        build_engine_config("demo", performance_mode="memory", layerwise_offload_components="none",
                            component_residency="dit=component", offload_prefetch_blocks=2)
    runtime = engine_config_from_cli("serve", "--model-path", "demo", "--performance-mode", "memory",
                                     "--component-residency", "vae=resident", "audio=resident").runtime
    assert runtime.component_residency == (("vae", "resident"), ("audio", "resident"))
    config_file = tmp_path / "engine.yaml"
    config_file.write_text("performance-mode: memory\ncomponent-residency: {vae: resident, dit: component_offload}\n")
    runtime = engine_config_from_cli("serve", "--model-path", "demo", "--config", str(config_file)).runtime
    assert runtime.component_residency == (("vae", "resident"), ("dit", "component"))
    assert not runtime.streams_dit


def _forced_worker(monkeypatch, folder, **options) -> ModelWorker:
    """A CPU worker that offloads as a GPU worker would (test_offload.py: a CPU "device" copy is a real copy)."""
    monkeypatch.setattr(ModelWorker, "offloads", property(lambda self: self.residency_plan.offloads))
    return ModelWorker(build_engine_config(str(folder), device="cpu", attention_backend="sdpa", **options))


def _watch(worker: ModelWorker) -> dict[str, list[bool]]:
    """Per component, at every call into it: whether its weights were the host copy (False = moved for a stage)."""
    residency = worker.pipeline.residency
    seen: dict[str, list[bool]] = {}

    def hook(name):
        def check(module, args):
            weights = residency.weights.get(name)
            seen.setdefault(name, []).append(weights is not None and weights.attached_to_host())

        return check

    for name, component in worker.pipeline.components().items():
        for module in component.modules():  # the pipelines call submodules (e.g. `vae.decode`), not forward
            module.register_forward_pre_hook(hook(name))
    return seen


def test_generation_with_some_components_offloaded_is_bitwise_equal(tiny_distill_dir, monkeypatch):
    torch.set_num_threads(1)
    params = SamplingParams(prompt="a fox in the snow", seed=7, height=32, width=48, num_frames=5)
    resident = ModelWorker(build_engine_config(str(tiny_distill_dir), device="cpu", attention_backend="sdpa")
                           ).run(params, NO_FILE)
    worker = _forced_worker(monkeypatch, tiny_distill_dir, cpu_offload_components=("text_encoders", "vae"),
                            layerwise_offload_components=("dit",))
    residency = worker.pipeline.residency
    assert set(residency.weights) == {"text_encoder", "text_encoder_2", "vae", "transformer"}
    assert set(residency.streamers) == {"transformer"}  # the text encoders offloaded whole, not streamed
    assert residency.resident == {"audio_vae", "vocoder"}
    vocoder_params = [p.data_ptr() for p in worker.pipeline.models.vocoder.parameters()]
    seen = _watch(worker)
    offloaded = worker.run(params, NO_FILE)
    assert np.array_equal(offloaded.frames, resident.frames) and np.array_equal(offloaded.audio, resident.audio)
    assert {"text_encoder", "vae", "audio_vae", "vocoder"} <= set(seen)
    # Offloaded components were on their stage's copy when called, and are back on the host after it.
    assert not any(seen["text_encoder"]) and not any(seen["vae"])
    assert all(weights.attached_to_host() for weights in residency.weights.values())
    # The resident ones were never moved.
    assert [p.data_ptr() for p in worker.pipeline.models.vocoder.parameters()] == vocoder_params
    report = worker.offload_report
    assert report.mode == "speed" and report.residency == (
        "resident audio_vae, vocoder; component text_encoder, text_encoder_2, vae; layerwise transformer")
    assert report.streamed_blocks == {"transformer": report.streamed_blocks["transformer"]} and \
        report.streamed_blocks["transformer"] > 0
    assert "speed (resident audio_vae, vocoder; component" in report.describe()


def test_super_resolution_layerwise_vae_and_upscaler_are_offloaded_whole(tiny_sr_dir, tmp_path, monkeypatch,
                                                                          caplog):
    torch.set_num_threads(1)
    clip = make_clip(tmp_path / "clip.mp4", width=64, height=32, num_frames=9, fps=24)
    params = SamplingParams(video_path=str(clip), sr_resolution_scale=2, num_inference_steps=2, seed=3)
    resident = ModelWorker(build_engine_config(str(tiny_sr_dir), device="cpu")).run(params, NO_FILE)
    with caplog.at_level("INFO", logger="k6serve.runtime.worker"):
        worker = _forced_worker(monkeypatch, tiny_sr_dir, layerwise_offload_components="vae latent_upscaler")
    assert "vae, latent_upscaler offloaded whole for their stage" in caplog.text
    residency = worker.pipeline.residency
    # The bank is one copy per upscaler (it has no weights outside them), so a request moves only its scale's.
    assert set(residency.weights) == {"vae", "latent_upscaler[x2]", "latent_upscaler[x4]"}
    assert residency.resident == {"transformer"} and not residency.streamers
    seen = _watch(worker)
    upscaler = worker.pipeline.models.upscaler
    on_host = []
    for scale in (2, 4):
        upscaler.model(scale).register_forward_pre_hook(lambda module, args, scale=scale: on_host.append(
            (scale, residency.weights["latent_upscaler[x2]"].attached_to_host(),
             residency.weights["latent_upscaler[x4]"].attached_to_host())))
    assert np.array_equal(worker.run(params, NO_FILE).frames, resident.frames)
    assert seen["vae"] and not any(seen["vae"])
    # x2 ran on its device copy while x4 stayed on the host; then x4 alone, for an x4 request.
    assert on_host and set(on_host) == {(2, False, True)}
    on_host.clear()
    x4 = SamplingParams(video_path=str(clip), sr_resolution_scale=4, num_inference_steps=2, seed=3)
    assert np.array_equal(worker.run(x4, NO_FILE).frames,
                          ModelWorker(build_engine_config(str(tiny_sr_dir), device="cpu")).run(x4, NO_FILE).frames)
    assert on_host and set(on_host) == {(4, True, False)}
    assert all(weights.attached_to_host() for weights in residency.weights.values())


def test_a_name_of_the_other_family_is_refused_before_the_weights_load(tiny_sr_dir, monkeypatch):
    from k6serve.runtime import worker as worker_module

    monkeypatch.setattr(worker_module.ModelWorker, "_build_pipeline",
                        lambda self, folder: pytest.fail("loaded the weights before refusing the flag"))
    with pytest.raises(ValueError, match=r"--cpu-offload-components text_encoder: the super-resolution model has no "
                                         r"such component"):
        ModelWorker(build_engine_config(str(tiny_sr_dir), device="cpu", cpu_offload_components="text_encoder"))
    # Beside sharded weights too: the name is what is wrong (an SR model offloads nothing here), not the layout.
    sharded = build_engine_config(str(tiny_sr_dir), device="cpu", num_gpus=2, tp_size=2,
                                  cpu_offload_components="text_encoder")
    with pytest.raises(ValueError, match=r"--cpu-offload-components text_encoder: the super-resolution model has no "
                                         r"such component"):
        ModelWorker(sharded)
    # A name of one family only that offloads is refused with the layout by the worker, which knows the family
    # (names of both families, e.g. vae, already by the config: test_config_refusals).
    with pytest.raises(ValueError, match=r"^--cpu-offload-components latent_upscaler offloads the weights to host "
                                         r"memory, which cannot work with weights sharded across GPUs \(--tp-size 2\)"):
        ModelWorker(build_engine_config(str(tiny_sr_dir), device="cpu", num_gpus=2, tp_size=2,
                                        cpu_offload_components="latent_upscaler"))
    # Names that offload in both families' readings are refused by the config, before any worker starts.
    with pytest.raises(ValueError, match=r"offloads the weights to host memory, which cannot work with weights "
                                         r"sharded across GPUs \(--tp-size 2\)"):
        build_engine_config(str(tiny_sr_dir), device="cpu", num_gpus=2, tp_size=2,
                            cpu_offload_components="text_encoder latent_upscaler")


@pytest.mark.parametrize(("options", "streams"), [
    # memory mode with the DiT offloaded whole streams the generation model's text encoders: the config accepts
    # the prefetch count, but an SR model has no text encoders and streams nothing
    ({"performance_mode": "memory", "cpu_offload_components": "transformer", "offload_prefetch_blocks": 2},
     r"`--performance-mode memory --cpu-offload-components transformer` streams none for the super-resolution model"),
    # the reference's "default" layerwise set streams the text encoders; for an SR model it is its VAE, whole
    ({"performance_mode": "balanced", "layerwise_offload_components": "default", "offload_prefetch_blocks": 3},
     r"`--performance-mode balanced --layerwise-offload-components default` streams none for the "
     r"super-resolution model"),
])
def test_block_streaming_flags_an_sr_plan_cannot_use_are_refused_before_the_weights_load(tiny_sr_dir, monkeypatch,
                                                                                       options, streams):
    from k6serve.runtime import worker as worker_module

    config = build_engine_config(str(tiny_sr_dir), device="cpu", **options)  # the generation plan streams blocks
    monkeypatch.setattr(worker_module.ModelWorker, "_build_pipeline",
                        lambda self, folder: pytest.fail("loaded the weights before refusing the flag"))
    with pytest.raises(ValueError, match=rf"^--offload-prefetch-blocks \d applies only when blocks are streamed "
                                         rf"between host and GPU, and {streams}\. Stream the DiT \(--performance-mode "
                                         r"memory, .*\), or drop it\.$"):
        ModelWorker(config)


def test_block_streaming_flags_an_sr_plan_uses_are_accepted(tiny_sr_dir, monkeypatch):
    """Memory mode streams the SR model's DiT too: resident and prefetched blocks apply (on the CPU nothing moves)."""
    worker = ModelWorker(build_engine_config(str(tiny_sr_dir), device="cpu", performance_mode="memory",
                                             offload_prefetch_blocks=2, offload_resident_blocks=1))
    assert worker.residency_plan.residency["transformer"] == "layerwise"


def test_speed_transforms_skip_streamed_components_and_keep_those_offloaded_whole(tiny_distill_dir, monkeypatch):
    """The GPU-only branch, on CPU modules: the plan's streamed DiT keeps its eager modules (no fused projections, no
    compiled blocks), the VAE offloaded whole keeps its decode speed-ups (--compile-vae true included), and the report
    says so (test_speed_offload.py has the rest)."""
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", False)
    worker = ModelWorker(build_engine_config(str(tiny_distill_dir), device="cpu", attention_backend="sdpa"))
    models = worker.pipeline.models
    before = {name for name, _ in models.transformer.named_modules()}
    vae_weight = next(p for p in models.vae.parameters() if p.dim() == 5)
    report = apply_performance_mode(models, "speed", "cuda", compile_vae_decoder=True,
                                    streamed=frozenset({"transformer"}), offloaded_whole=frozenset({"vae"}))
    assert (report.num_fused_attentions, report.num_compiled_blocks) == (0, 0)
    assert report.vae == ("folded_upsample", "compile_decoder")
    assert report.notes == ("the DiT's blocks are streamed: they run eager (no fused projections, no compiled blocks)",
                            "the video VAE is offloaded whole: its decode speed-ups run on the copy moved to the GPU "
                            "for its stage")
    assert {name for name, _ in models.transformer.named_modules()} == before
    assert vae_weight.is_contiguous()  # HunyuanVideo's decoder stays NCDHW (speed/vae.py)
    torch._dynamo.reset()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="pinned memory and the speed mode's compile need CUDA")
def test_cuda_speed_mode_with_the_text_encoders_and_audio_offloaded(tiny_distill_dir):
    """On a GPU, speed with `--cpu-offload-components text_encoders audio`: the DiT stays on the GPU and compiled,
    the offloaded components live in host memory between their stages, and the output equals the resident speed
    run bit for bit (neither the text encoders nor the audio decoders take speed transforms)."""
    params = SamplingParams(prompt="a fox in the snow", seed=7, height=32, width=48, num_frames=5)
    base = dict(device="cuda", attention_backend="sdpa")
    resident_worker = ModelWorker(build_engine_config(str(tiny_distill_dir), **base))
    resident = resident_worker.run(params, NO_FILE)
    worker = ModelWorker(build_engine_config(str(tiny_distill_dir), cpu_offload_components="text_encoders audio",
                                             **base))
    assert worker.offloads and worker.offload_report.pinned
    assert worker.performance_report.num_compiled_blocks == resident_worker.performance_report.num_compiled_blocks > 0
    models = worker.pipeline.models
    assert all(p.device.type == "cuda" for p in models.transformer.parameters())
    assert all(p.device.type == "cuda" for p in models.vae.parameters())
    offloaded = worker.run(params, NO_FILE)
    for module in (models.text_encoder, models.text_encoder_2, models.audio_vae, models.vocoder):
        assert all(p.device.type == "cpu" for p in module.parameters())
    assert np.array_equal(offloaded.frames, resident.frames) and np.array_equal(offloaded.audio, resident.audio)
    assert [stage for stage, _ in worker.pipeline.residency.peak_after] == [
        "text_encoder+text_encoder_2", "transformer", "audio_vae+vocoder", "vae"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the side stream, events and pinned copies need CUDA")
def test_cuda_speed_mode_with_a_streamed_dit_runs_it_eager(tiny_distill_dir):
    """`--layerwise-offload-components dit` with speed: the DiT's blocks stream from host memory and run eager (no
    compiled blocks), the rest stays resident; the output is a video, and no DiT weight is left on the GPU."""
    params = SamplingParams(prompt="a fox in the snow", seed=7, height=32, width=48, num_frames=5)
    worker = ModelWorker(build_engine_config(str(tiny_distill_dir), device="cuda", attention_backend="sdpa",
                                             layerwise_offload_components="dit", offload_prefetch_blocks=2))
    assert worker.performance_report.num_compiled_blocks == 0
    assert worker.performance_report.notes[0].startswith("the DiT's blocks are streamed")
    assert worker.offload_report.streamed_blocks["transformer"] > 0
    result = worker.run(params, NO_FILE)
    assert result.frames.shape[0] == 5 and np.isfinite(result.audio).all()
    streamer = worker.pipeline.residency.streamers["transformer"]
    assert not any(weights.on_device for weights in streamer.weights)
    assert all(p.device.type == "cuda" for p in worker.pipeline.models.vae.parameters())


def test_the_loader_puts_each_component_where_the_plan_says(tiny_distill_dir, monkeypatch):
    """With some components offloaded the resident ones load straight onto the device, not via the host (Pro's DiT
    took 29 s more that way on an H200). Recorded at the loaders' calls, for a checkpoint folder and the dummy build
    (released sizes on the meta device; the small vocoder really allocated on the CPU)."""
    from k6serve.models.kandinsky6 import checkpoint
    from k6serve.models.variants import VARIANTS

    placed: dict[str, str] = {}
    real_transformers, real_diffusers, real_transformer = (checkpoint._load_transformers, checkpoint._load_diffusers,
                                                           checkpoint.load_transformer)

    def component_loader(real):  # (folder, component, class_name, device, dtype): records, then loads on the CPU
        def load(folder, component, class_name, device, dtype):
            placed[component] = str(device)
            return real(folder, component, class_name, torch.device("cpu"), dtype)
        return load

    def transformer_loader(path, *, device, dtype):
        placed["transformer"] = str(device)
        return real_transformer(path, device=torch.device("cpu"), dtype=dtype)

    monkeypatch.setattr(checkpoint, "_load_transformers", component_loader(real_transformers))
    monkeypatch.setattr(checkpoint, "_load_diffusers", component_loader(real_diffusers))
    monkeypatch.setattr(checkpoint, "load_transformer", transformer_loader)
    variant = VARIANTS["pro-distill"]
    checkpoint.load_generation_models(tiny_distill_dir, variant, device=torch.device("cpu"), dtype=torch.float32,
                                      load_format="auto", weights_device=torch.device("meta"),
                                      component_devices={"transformer": torch.device("cpu"),
                                                         "vae": torch.device("cpu")})
    assert placed == {"transformer": "cpu", "vae": "cpu", "text_encoder": "meta", "text_encoder_2": "meta",
                      "audio_vae": "meta", "vocoder": "meta"}
    monkeypatch.undo()
    models = checkpoint.load_generation_models(None, variant, device=torch.device("cpu"), dtype=torch.bfloat16,
                                               load_format="dummy", weights_device=torch.device("meta"),
                                               component_devices={"vocoder": torch.device("cpu")})
    assert next(models.transformer.parameters()).device.type == "meta"
    assert next(models.text_encoder.parameters()).device.type == "meta"
    assert {p.device.type for p in models.vocoder.parameters()} == {"cpu"}


def test_memory_mode_with_the_vae_kept_resident(tiny_distill_dir, monkeypatch):
    torch.set_num_threads(1)
    params = SamplingParams(prompt="a fox in the snow", seed=7, height=32, width=48, num_frames=5)
    # The same mode without offloading (on a CPU nothing is offloaded): speed trims the text padding, memory not.
    resident = ModelWorker(build_engine_config(str(tiny_distill_dir), device="cpu", attention_backend="sdpa",
                                               performance_mode="memory", vae_tiling="off")).run(params, NO_FILE)
    worker = _forced_worker(monkeypatch, tiny_distill_dir, performance_mode="memory", vae_tiling="off",
                            component_residency=["vae=resident"])
    residency = worker.pipeline.residency
    assert residency.resident == {"vae"} and set(residency.streamers) == {"transformer", "text_encoder",
                                                                           "text_encoder_2"}
    vae_params = [p.data_ptr() for p in worker.pipeline.models.vae.parameters()]
    offloaded = worker.run(params, NO_FILE)
    assert np.array_equal(offloaded.frames, resident.frames) and np.array_equal(offloaded.audio, resident.audio)
    assert [p.data_ptr() for p in worker.pipeline.models.vae.parameters()] == vae_params


def test_on_the_cpu_the_flags_offload_nothing_and_say_so(tiny_distill_dir, caplog):
    with caplog.at_level("INFO", logger="k6serve.runtime.worker"):
        worker = ModelWorker(build_engine_config(str(tiny_distill_dir), device="cpu", attention_backend="sdpa",
                                                 cpu_offload_components="vae", component_residency="dit=layerwise"))
    assert not worker.offloads and worker.offload_report is None
    assert ("--cpu-offload-components vae --component-residency dit=layerwise: on the CPU every weight is "
            "in host memory already, so nothing is offloaded") in caplog.text


def test_all_applies_before_groups_before_single_components():
    for settings in ((("audio", "resident"), ("all", "component")), (("all", "component"), ("audio", "resident"))):
        plan = _plan(settings=settings)
        assert plan.named("resident") == ("audio_vae", "vocoder"), settings
    for settings in ((("transformer", "layerwise"), ("all", "resident")), (("dit", "layerwise"), ("all", "resident"))):
        assert _plan(settings=settings).named("layerwise") == ("transformer",), settings
    # default: the reference's layerwise set, the encoders and the VAEs
    assert _plan(layerwise=("default",)).named("resident") == ("transformer",)


def test_a_repeated_flag_adds_to_the_first(engine_config_from_cli):
    runtime = engine_config_from_cli("generate", "--model-path", "demo", "--prompt", "x",
                                     "--cpu-offload-components", "vae", "--cpu-offload-components", "text_encoder",
                                     "--component-residency", "audio=resident", "--component-residency",
                                     "vocoder=component-offload").runtime
    assert runtime.cpu_offload_components == ("vae", "text_encoder")
    assert runtime.component_residency == (("audio", "resident"), ("vocoder", "component"))
    with pytest.raises(ValueError, match="names vae twice, with different residencies"):
        engine_config_from_cli("generate", "--model-path", "demo", "--prompt", "x", "--component-residency",
                               "vae=resident", "--component-residency", "vae=component_offload")


def test_a_config_that_is_built_again_keeps_its_values():
    import dataclasses

    runtime = build_engine_config("demo", component_residency=["vae=resident"], cpu_offload_components="dit").runtime
    again = dataclasses.replace(runtime, performance_mode="memory")
    assert again.component_residency == (("vae", "resident"),) and again.cpu_offload_components == ("dit",)


def test_config_files_name_themselves_in_errors_and_take_a_nested_vae_config(tmp_path, engine_config_from_cli):
    bad = tmp_path / "bad.yaml"
    bad.write_text("component-residency: {transformer: 3}\n")
    with pytest.raises(ValueError, match=rf"^--config {bad}: --component-residency: --component-residency "
                                         r"transformer=3: the residency must be one of"):
        engine_config_from_cli("serve", "--model-path", "demo", "--config", str(bad))
    bad.write_text("cpu-offload-components: [vae, [text_encoder]]\n")
    with pytest.raises(ValueError, match=rf"^--config {bad}: --cpu-offload-components: --cpu-offload-components "
                                         r"takes component names"):
        engine_config_from_cli("serve", "--model-path", "demo", "--config", str(bad))
    nested = tmp_path / "nested.yaml"
    nested.write_text("vae-config:\n  use-parallel-tiling: true\n  parallel-decode-mode: whole_tile\n")
    runtime = engine_config_from_cli("serve", "--model-path", "demo", "--config", str(nested)).runtime
    assert (runtime.vae_parallel_tiling, runtime.vae_parallel_decode_mode) == (True, "whole_tile")


def test_api_type_errors_name_the_seeds_flag():
    with pytest.raises(ValueError, match=r"^--vae-config.use-parallel-tiling must be "):
        build_engine_config("demo", vae_parallel_tiling="yes")


def test_stage_peaks_are_the_last_requests_in_the_order_the_stages_ran(monkeypatch):
    """The peaks the bench prints beside its rows: a stage the next request skipped (no audio) showed the previous
    request's peak, and a second VAE stage (a TI2AV request's image encode, then the decode) kept the first one's
    place, so the peaks read as a running maximum going down. On CUDA only; the counter is stubbed here."""
    from k6serve.offload.components import ComponentOffload

    peaks = iter([3, 21, 21, 21, 21, 3, 8, 8])
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: next(peaks) * 2**30)
    residency = ComponentOffload({}, compute_device=torch.device("cuda"), offload_device=torch.device("cpu"),
                                 pin=False, resident=("text_encoder", "vae", "transformer", "audio_vae"))

    def request(*stages):
        residency.reset_peaks()  # where the worker resets the device's peak counter
        for stage in stages:
            with residency.stage(*stage.split("+")):
                pass
        return residency.describe_peaks()

    assert request("text_encoder", "vae", "transformer", "audio_vae", "vae") == (
        "text_encoder 3.0, vae 21.0, transformer 21.0, audio_vae 21.0, vae 21.0 GiB")
    assert request("text_encoder", "transformer", "vae") == "text_encoder 3.0, transformer 8.0, vae 8.0 GiB"
