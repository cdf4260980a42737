"""The Python API's errors name the keywords its caller passes (`num_gpus=4`), where the same checks on the CLI name
its flags (`--num-gpus 4`): the real refusals of the config, the launch and the engine, reached both ways, and the
rewording rules (`k6serve/api_errors.py`) one by one."""

from __future__ import annotations

import pytest

from k6serve.api import DiffGenerator
from k6serve.api_errors import flags_as_keywords
from k6serve.cli.main import main
from k6serve.engine_arguments import build_engine_config
from k6serve.lora.arguments import LoraArgumentError
from k6serve.models.variants import VARIANTS
from k6serve.runtime.engine import Engine

# (API keywords, CLI flags, the API's message, the CLI's message): one refusal of the config each.
REFUSED_BOTH_WAYS = {
    "gpu layout": (
        {"num_gpus": 2, "ulysses_degree": 4}, ["--num-gpus", "2", "--ulysses-degree", "4"],
        "world size must equal dp x cfg x tp x ulysses x ring = 1 x 1 x 1 x 4 x 1 = 4, but num_gpus is 2. Pass "
        "num_gpus=4 for this layout, or keep 2 GPU(s) with ulysses_degree=2.",
        "world size must equal dp x cfg x tp x ulysses x ring = 1 x 1 x 1 x 4 x 1 = 4, but --num-gpus is 2. Pass "
        "--num-gpus 4 for this layout, or keep 2 GPU(s) with --ulysses-degree 2."),
    "fsdp with cfg parallel": (
        {"num_gpus": 2, "enable_cfg_parallel": True, "use_fsdp_inference": True, "cache_dit_config": {}},
        ["--num-gpus", "2", "--enable-cfg-parallel", "--use-fsdp-inference", "true", "--cache-dit-config", "{}"],
        "cache_dit_config cannot be used with use_fsdp_inference=True with enable_cfg_parallel=True: each guidance "
        "branch decides on its own which DiT blocks to skip, but FSDP gathers every block's weights on both ranks "
        "together. Drop one of the two options to use Cache-DiT.",
        "--cache-dit-config cannot be used with --use-fsdp-inference with --enable-cfg-parallel: each guidance "
        "branch decides on its own which DiT blocks to skip, but FSDP gathers every block's weights on both ranks "
        "together. Drop one of the two flags to use Cache-DiT."),
    "lora option without lora_path": (
        {"lora_scale": 0.5}, ["--lora-scale", "0.5"],
        "lora_scale describes the lora_path adapter, but no lora_path was given; add lora_path, or drop it "
        "(adapters can also come later, through set_lora).",
        "--lora-scale describes the --lora-path adapter, but no --lora-path was given; add --lora-path, or drop it "
        "(adapters can also come later, through set_lora)."),
    "offload with tensor parallel": (
        {"num_gpus": 2, "tp_size": 2, "performance_mode": "balanced"},
        ["--num-gpus", "2", "--tp-size", "2", "--performance-mode", "balanced"],
        "performance_mode='balanced' offloads the weights to host memory, which cannot work with weights sharded "
        "across GPUs (tp_size=2): use performance_mode='speed' to keep tp_size=2, or drop tp_size=2 to offload.",
        "--performance-mode balanced offloads the weights to host memory, which cannot work with weights sharded "
        "across GPUs (--tp-size 2): use --performance-mode speed to keep --tp-size 2, or drop --tp-size 2 to offload."),
    "block streaming without streamed blocks": (
        {"offload_prefetch_blocks": 2, "cpu_offload_components": ["text_encoders", "vae"]},
        ["--offload-prefetch-blocks", "2", "--cpu-offload-components", "text_encoders", "vae"],
        "offload_prefetch_blocks=2 applies only when blocks are streamed between host and GPU, and "
        "`performance_mode='speed', cpu_offload_components=['text_encoders', 'vae']` streams none. Stream the DiT "
        "(performance_mode='memory', layerwise_offload_components=['transformer'] or "
        "component_residency={'transformer': 'layerwise_offload'}, with no other option keeping it whole or "
        "resident), or drop it.",
        "--offload-prefetch-blocks 2 applies only when blocks are streamed between host and GPU, and "
        "`--performance-mode speed --cpu-offload-components text_encoders vae` streams none. Stream the DiT "
        "(--performance-mode memory, --layerwise-offload-components transformer or "
        "--component-residency transformer=layerwise_offload, with no other flag keeping it whole or resident), or "
        "drop it."),
}


def _cli_error(capsys, flags: list[str], tmp_path) -> str:
    assert main(["generate", "--model-path", "demo", "--prompt", "a fox", "--output-path", str(tmp_path),
                 *flags]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err.strip()


@pytest.mark.parametrize("case", REFUSED_BOTH_WAYS)
def test_a_config_refusal_names_the_keywords_in_the_api_and_the_flags_on_the_cli(case, demo_dir, tmp_path, capsys):
    options, flags, api_message, cli_message = REFUSED_BOTH_WAYS[case]
    with pytest.raises(ValueError) as refused:
        DiffGenerator.from_pretrained("demo", **options)
    assert type(refused.value) is ValueError and str(refused.value) == api_message
    assert _cli_error(capsys, flags, tmp_path) == f"error: {cli_message}"


@pytest.mark.parametrize(("options", "message"), [
    ({"performance_mode": "fast"}, "performance_mode must be one of ('speed', 'balanced', 'memory'), got 'fast'"),
    # The seed's dotted flags (--vae-config.*) are the API's vae_parallel_* keywords.
    ({"vae_parallel_decode_mode": "rows"}, "vae_parallel_decode_mode must be one of whole_tile, spatial_shard, "
                                           "got 'rows'"),
    ({"vae_parallel_tiling": "yes"}, "vae_parallel_tiling must be true or false, got 'yes' (str)"),
    ({"cpu_offload_components": "text_encoders gpu"}, "cpu_offload_components: unknown component 'gpu'. Known: "
     "all, none, text_encoder, text_encoder_2, transformer, vae, audio_vae, vocoder, latent_upscaler, dit, "
     "text_encoders, audio, default."),
])
def test_api_only_refusals_name_the_keywords(options, message):
    # The CLI's argparse refuses these values itself, in its own words.
    with pytest.raises(ValueError) as refused:
        DiffGenerator.from_pretrained("demo", **options)
    assert str(refused.value) == message


def test_a_missing_gpu_names_the_device_keyword(demo_dir, tmp_path, capsys, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # refused in the engine, before any process
    with pytest.raises(ValueError) as refused:
        DiffGenerator.from_pretrained("demo", device="cuda")
    assert str(refused.value) == "device='cuda' was requested but no CUDA GPU is visible; use device='cpu'."
    assert _cli_error(capsys, ["--device", "cuda"], tmp_path) == (
        "error: --device cuda was requested but no CUDA GPU is visible; use --device cpu.")


def test_torchruns_own_flags_stay_in_the_launch_refusal(demo_dir, tmp_path, capsys, monkeypatch):
    for name, value in {"RANK": "0", "WORLD_SIZE": "8", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                        "MASTER_PORT": "29500"}.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ValueError) as refused:
        DiffGenerator.from_pretrained("demo", device="cpu")
    assert str(refused.value) == ("the launcher started WORLD_SIZE=8 processes but the layout needs num_gpus=1; "
                                  "make them equal (num_gpus = torchrun's --nproc-per-node x --nnodes).")
    assert _cli_error(capsys, ["--device", "cpu"], tmp_path) == (
        "error: the launcher started WORLD_SIZE=8 processes but the layout needs --num-gpus 1; make them equal "
        "(--num-gpus = torchrun's --nproc-per-node x --nnodes).")


class FsdpWorker:
    """An in-process stand-in with FSDP's real refusals of a memory release and of a merged adapter."""

    variant = VARIANTS["pro"]

    def __init__(self, config) -> None:
        self.config = config

    def apply_memory_operation(self, operation) -> list[dict]:
        from k6serve.runtime import memory

        return [memory.apply_memory_operation(self, operation)]

    def apply_lora_operation(self, operation) -> dict:
        from k6serve.lora.manager import resolve_merge_mode

        resolve_merge_mode(operation.merge_mode, fsdp=self.config.parallel.use_fsdp_inference)
        return {"loras": []}


@pytest.fixture
def generator():
    """A generator of the demo's engine over the in-process `FsdpWorker`, shut down after the test."""
    config = build_engine_config("demo", device="cpu")
    generator = DiffGenerator(Engine(config, worker=FsdpWorker(config)))
    yield generator
    generator.shutdown()


@pytest.mark.parametrize("wording", ["api", "cli"])
def test_the_generators_later_calls_word_engine_refusals_for_their_caller(wording):
    config = build_engine_config("demo", device="cpu", num_gpus=2, ulysses_degree=2, use_fsdp_inference=True)
    engine = Engine(config, worker=FsdpWorker(config))
    generator = DiffGenerator(engine) if wording == "api" else DiffGenerator(engine, wording=str)
    try:
        with pytest.raises(ValueError) as refused:
            generator.release_memory()
        flag = {"api": "use_fsdp_inference=True", "cli": "--use-fsdp-inference"}[wording]
        assert str(refused.value).startswith(f"A memory release cannot move weights sharded by {flag}: ")
        assert f"Drop {flag} to release memory (" in str(refused.value)
        with pytest.raises(ValueError) as refused:
            generator.set_lora("style", "style.safetensors", merge_mode="merge")
        assert str(refused.value).startswith(f"LoRA merge_mode 'merge' cannot be used with {flag}: the weights ")
        # A ValueError subclass keeps its type and attributes.
        with pytest.raises(LoraArgumentError) as refused:
            generator.set_lora(" ")
        assert refused.value.argument == "nickname"
    finally:
        generator.shutdown()


def test_the_lora_calls_answer_the_http_bodys_names_with_the_python_arguments(generator):
    # set_lora("x", lora_path=...) raised Python's bare "unexpected keyword argument 'lora_path'": the HTTP body's
    # name, which gives no hint that the argument is `path`.
    with pytest.raises(TypeError) as refused:
        generator.set_lora("style", lora_path="style.safetensors")
    assert str(refused.value) == ("set_lora() got an unexpected keyword argument 'lora_path': lora_path is the "
                                  "HTTP API's name (POST /v1/set_lora's body); the Python argument is path: "
                                  "set_lora(..., path=...).")
    with pytest.raises(TypeError) as refused:
        generator.unload_lora(lora_nickname="style")
    assert str(refused.value).endswith("the Python argument is nickname: unload_lora(..., nickname=...).")
    with pytest.raises(TypeError, match=r"^set_lora\(\) got an unexpected keyword argument 'strenght' \(did you "
                                        r"mean 'strength'\?\)\.$"):
        generator.set_lora("style", strenght=0.5)
    assert generator.set_lora("style", path="style.safetensors") == {"loras": []}


def test_sglangs_generate_with_lora_says_how_to_generate_with_an_adapter(generator):
    with pytest.raises(AttributeError, match=r"^'DiffGenerator' object has no attribute 'generate_with_lora' "
                                             r"\(SGLang's method; load the adapter with set_lora\("):
        generator.generate_with_lora(prompt="x", lora_nickname="style")
    with pytest.raises(AttributeError, match=r"^'DiffGenerator' object has no attribute 'genrate'$"):
        generator.genrate


def test_set_lora_in_sglangs_argument_order_says_target_is_a_keyword(generator):
    # SGLang's set_lora(nickname, path, target, strength): the target was refused as "strength must be a finite
    # number", and with the strength after it as Python's "takes from 2 to 4 positional arguments".
    with pytest.raises(TypeError) as refused:
        generator.set_lora("style", "style.safetensors", "transformer", 0.8)
    assert str(refused.value) == (
        "set_lora()'s third argument is the strength, got the target 'transformer': SGLang's set_lora takes "
        "(nickname, path, target, strength), and here target is a keyword: set_lora('style', "
        "'style.safetensors', 0.8, target='transformer').")
    with pytest.raises(TypeError, match=r"keyword: set_lora\('style', None, target='all'\)\.$"):
        generator.set_lora("style", None, "all")
    assert generator.set_lora("style", "style.safetensors", 0.8, target="transformer") == {"loras": []}


@pytest.mark.parametrize(("message", "expected"), [
    # int: a number is its value; anything else is prose about the option.
    ("--num-gpus 4 must be a multiple of --nnodes 3 (every", "num_gpus=4 must be a multiple of nnodes=3 (every"),
    ("but --num-gpus is 2.", "but num_gpus is 2."),
    ("--tp-size > 1 and --node-rank must be in [0, 1]", "tp_size > 1 and node_rank must be in [0, 1]"),
    # a choice: one of its values (quoted or not), else prose.
    ("use --attention-backend torch_sdpa.", "use attention_backend='torch_sdpa'."),
    ("--lora-merge-mode merge cannot", "lora_merge_mode='merge' cannot"),
    ("--performance-mode must be one of", "performance_mode must be one of"),
    ("with --vae-tiling on.", "with vae_tiling='on'."),
    ("--encoder-parallel fold has no plan", "encoder_parallel='fold' has no plan"),
    # a boolean: true / false, else the flag alone turns it on; "must be" names the option itself.
    ("drop --enable-cfg-parallel and use --ulysses-degree 4", "drop enable_cfg_parallel=True and use ulysses_degree=4"),
    ("--vae-config.use-parallel-decode true", "vae_parallel_decode=True"),
    ("--vae-config.use-parallel-tiling false asks", "vae_parallel_tiling=False asks"),
    ("--compile-vae must be true or false", "compile_vae must be true or false"),
    # a number.
    ("--lora-scale 0.5, --lora-alpha 8", "lora_scale=0.5, lora_alpha=8"),
    ("--lora-scale must be a finite number, got nan.", "lora_scale must be a finite number, got nan."),
    # free text: only a quoted string is a value; the model id also by its released name.
    ("--model-path '/x' is neither", "model_path='/x' is neither"),
    ("--model-path /x is a file", "model_path /x is a file"),  # unquoted free text is prose: the messages use !r
    ("e.g. --model-id Kandinsky-6.0-Lite-5s-Diffusers.", "e.g. model_id='Kandinsky-6.0-Lite-5s-Diffusers'."),
    ("Pass --model-id with the released name", "Pass model_id with the released name"),
    ("--dist-init-addr must be HOST:PORT", "dist_init_addr must be HOST:PORT"),
    # component names and NAME=MODE settings: several words, as a list and a dict.
    ("--layerwise-offload-components all streams", "layerwise_offload_components=['all'] streams"),
    ("--component-residency vae=resident all=component_offload keeps", "component_residency={'vae': 'resident', "
     "'all': 'component_offload'} keeps"),
    ("--component-residency names vae twice", "component_residency names vae twice"),
    # flags one after another are one call's arguments.
    ("Fix: --ulysses-degree 2 --ring-degree 2 (Ulysses2)", "Fix: ulysses_degree=2, ring_degree=2 (Ulysses2)"),
    ("--ulysses-degree / --ring-degree.", "ulysses_degree / ring_degree."),
    # other programs' flags, and flags that are no engine option, stay; "flag" becomes "option" only beside ours.
    ("run: hf download org/repo --revision v2 --force-download; or pass --revision v2",
     "run: hf download org/repo --revision v2 --force-download; or pass revision v2"),
    ("rerun with --log-level debug, or --config file and --no-save-output: no --lora-path flag",
     "rerun with --log-level debug, or --config file and save_output=False: no lora_path option"),
    # the output options (generate's checks are the CLI's too); --no-save-output turns save_output off.
    ("pass the folder for the MP4 (e.g. --output-path 'outputs').", "pass the folder for the MP4 (e.g. "
     "output_path='outputs')."),
    ("pass another --output-path, or --no-save-output to skip the file.", "pass another output_path, or "
     "save_output=False to skip the file."),
    ("or put the file name in --output-file-name.", "or put the file name in output_file_name."),
    ("Drop the flag (--lora-path), or leave the flags out.", "Drop the option (lora_path), or leave the options out."),
    ("--lora-paths and --num-gpus-x are not --num-gpus", "--lora-paths and --num-gpus-x are not num_gpus"),
])
def test_flags_as_keywords(message, expected):
    assert flags_as_keywords(message) == expected
    assert flags_as_keywords(expected) == expected  # a reworded message stays as it is


def test_a_file_as_model_path_names_the_keyword_and_its_value_in_the_api(tmp_path):
    """The message prints the path with !r, so the API reads `model_path='...'`, not `model_path /x` (the rewording
    only takes a free-text option's value when it is quoted)."""
    checkpoint = tmp_path / "model.safetensors"
    checkpoint.write_bytes(b"")
    with pytest.raises(ValueError) as refused:
        DiffGenerator.from_pretrained(str(checkpoint), device="cpu")
    assert str(refused.value).startswith(f"model_path={str(checkpoint)!r} is a file; pass the checkpoint folder")


def test_every_choice_of_the_cli_is_known_to_the_rewording():
    from k6serve.cli.flags import build_parser
    from k6serve.config import OPTION_CHOICES

    generate = build_parser()._subparsers._group_actions[0].choices["generate"]
    engine = [group for group in generate._action_groups if group.title == "engine"][0]
    cli_choices = {action.dest: tuple(action.choices) for action in engine._group_actions if action.choices}
    assert cli_choices == OPTION_CHOICES


def test_an_empty_output_path_names_the_flag_or_keyword_and_how_to_keep_no_file(capsys, in_process_worker):
    # SGLang's --output-path "" keeps no file; the CLI said "output_path is empty" and the API "--output-path", and
    # neither named the switch that writes no file.
    assert main(["generate", "--model-path", "demo", "--prompt", "x", "--output-path", ""]) == 2
    assert capsys.readouterr().err.endswith(
        "error: --output-path is empty; pass the folder for the MP4 (e.g. --output-path 'outputs'), or "
        "--no-save-output to write no file (SGLang's empty output path).\n")
    with DiffGenerator.from_pretrained("demo", device="cpu") as generator:
        with pytest.raises(ValueError) as refused:
            generator.generate(prompt="x", output_path="")
    assert str(refused.value) == ("output_path is empty; pass the folder for the MP4 (e.g. output_path='outputs'), or "
                                  "save_output=False to write no file (SGLang's empty output path).")


def test_the_output_checks_name_the_keywords_in_the_api_and_the_flags_on_the_cli(tmp_path, capsys,
                                                                                   in_process_worker):
    """generate()'s output checks are the CLI's: a Python caller read "--output-path" and "--output-file-name"."""
    (tmp_path / "taken").write_text("a file")
    with DiffGenerator.from_pretrained("demo", device="cpu") as generator:
        with pytest.raises(ValueError) as refused:
            generator.generate(prompt="x", output_path=str(tmp_path / "taken"))
    assert str(refused.value) == (f"output_path {str(tmp_path / 'taken')!r} is a file, not a folder; pass a folder for "
                                  "the MP4 with output_path (it is created if missing), or put the file name in "
                                  "output_file_name.")
    assert main(["generate", "--model-path", "demo", "--prompt", "x", "--output-path", str(tmp_path / "taken")]) == 2
    assert ("pass a folder for the MP4 with --output-path (it is created if missing), or put the file name in "
            "--output-file-name." in capsys.readouterr().err)


def test_set_lora_takes_sglangs_list_of_one_target_per_adapter():
    # SGLang's set_lora (and POST /v1/set_lora) take a target per adapter; Kandinsky 6's one DiT is each of them,
    # and the list was refused as "target must be one of 'all', 'transformer'" (over HTTP: "a valid string").
    from k6serve.lora.arguments import LoraArgumentError, set_lora_operation
    from k6serve.serve.control_bodies import SetLoraBody

    body = SetLoraBody(lora_nickname=["a", "b"], lora_path=["a.safetensors", "b.safetensors"],
                       target=["transformer", "all"])
    operation = set_lora_operation(body.lora_nickname, body.lora_path, target=body.target)
    assert operation == set_lora_operation(["a", "b"], ["a.safetensors", "b.safetensors"], target="transformer")
    with pytest.raises(LoraArgumentError, match=r"^target must be one of 'all', 'transformer', got 'critic'\.$"):
        set_lora_operation(["a", "b"], target=["transformer", "critic"])
    with pytest.raises(LoraArgumentError, match=r"^target has 1 entries but nickname has 2; give one per adapter\.$"):
        set_lora_operation(["a", "b"], target=["transformer"])
