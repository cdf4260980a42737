"""SGLang's (the reference server's) option names on every surface: the renames are accepted, the others refused with
what k6serve does instead, and the table cannot name an option k6serve lacks or shadow one it has."""

from __future__ import annotations

import dataclasses
import re

import pytest

from k6serve.api import DiffGenerator
from k6serve.cli.config_file import merged_options
from k6serve.cli.flags import build_parser, split_options
from k6serve.cli.main import main
from k6serve.config import OPTION_CHOICES, ModelConfig, ParallelConfig, RuntimeConfig
from k6serve.engine_arguments import build_engine_config
from k6serve.models.variants import VARIANTS
from k6serve.request_arguments import split_kwargs
from k6serve.reference_names import (
    ENGINE,
    REFERENCE_NAMES,
    REFERENCE_VALUES,
    REQUEST,
    SURFACES,
    _OWN_NAMES,
    aliases,
    reference_note,
    unknown_names_hint,
)
from k6serve.request import SamplingParams
from k6serve.runtime.engine import Engine
from k6serve.serve.errors import ApiError
from k6serve.serve.video_create_body import HTTP_FIELD_NAMES, VideoCreateBody, parse_create_body

COMPILE_FIX = ("k6serve compiles the DiT's repeated blocks on CUDA under --performance-mode speed, the default; "
               "--compile-vae true compiles the VAE decoder too")
# The fixes shared by the rarer names (serving-reference.md §2.1, §2.2, §2.4), in command-line words.
NO_IMAGE_ENCODER_FIX = "Kandinsky 6 has no image encoder, as the video VAE encodes a TI2AV image: drop it"
PIPELINE_FIX = ("k6serve picks the pipeline by the model's name or its model_index.json, and --model-id names the "
                "model of a renamed folder, e.g. --model-id Kandinsky-6.0-Pro-distill-5s-Diffusers")
PIPELINE_CONFIG_FIX = ("k6serve has no pipeline config: its settings are flags, e.g. --vae-tiling on, which a --config "
                       "FILE can hold too")
COMPONENT_PATHS_FIX = ("k6serve loads every component from the --model-path folder: to swap one, copy the folder, "
                       "replace that component's subfolder, e.g. vae, and pass the copy as --model-path")
WHOLE_VAE_FIX = ("k6serve loads the video VAE whole, as it decodes every video and encodes a TI2AV image or a "
                 "super-resolution source: drop it")
SPATIAL_TILES_FIX = ("k6serve's spatial VAE tiles, with --vae-tiling on, are 256 pixels with a stride of 192, SGLang's "
                     "defaults too; there is no tile size to set")
TEMPORAL_TILES_FIX = ("k6serve's generation VAE decodes in temporal tiles of 16 frames with a stride of 12, blended "
                      "over 4, SGLang's defaults too; there is no switch or size to set")
INTERPOLATION_FIX = ("k6serve adds no interpolated frames: the video holds the --num-frames frames the model makes, "
                     "played at --fps")
SR_CHECKPOINT = "kandinskylab/Kandinsky-6.0-VSR-distilled2steps-5s-Diffusers"
UPSCALING_FIX = ("k6serve upscales with the Kandinsky 6 super-resolution model, loaded on its own: run `k6serve "
                 f"generate` of {SR_CHECKPOINT} with the finished video as --video-path and --sr-resolution-scale 2, 4 "
                 "or 2.25")
NVTX_FIX = ("k6serve adds no NVTX ranges; `k6serve generate` prints each stage's seconds after the run, e.g. encode, "
            "denoise per step and decode; `k6serve bench` times the stages against diffusers")
OTHER_RESOLUTION = "a pipeline resolution is a setting of other models, not of Kandinsky 6; "
SIZE_FIX = (OTHER_RESOLUTION + "k6serve takes the size as --height and --width in pixels, multiples of 16 up to 2048, "
            "default height 512, width 768, e.g. --height 720 --width 1280; super-resolution's output size is "
            "--sr-target-resolution, e.g. fullhd")
SIZE_HTTP_FIX = (OTHER_RESOLUTION + "k6serve takes the size as height and width in pixels, multiples of 16 up to "
                 "2048, default height 512, width 768, or as size, width first, e.g. \"1280x720\"; super-resolution's "
                 "output size is sr_target_resolution, e.g. \"fullhd\"")
ENGINE_FIELDS = {item.name for section in (ModelConfig, ParallelConfig, RuntimeConfig)
                 for item in dataclasses.fields(section)}
REQUEST_FIELDS = {item.name for item in dataclasses.fields(SamplingParams)}
# Names the Python API takes that the command line does not: SGLang's CLI flag of the same name is in the table.
API_ONLY_NAMES = {"return_frames"}


def _subparser(command: str):
    return build_parser()._subparsers._group_actions[0].choices[command]


def _option_strings(command: str) -> dict[str, str]:
    """Every flag of `k6serve <command>` (and the top-level ones) -> its dest."""
    parsers = (build_parser(), _subparser(command))
    return {flag: action.dest for parser in parsers for action in parser._actions for flag in action.option_strings}


def _options(argv: list[str]) -> dict:
    parser = build_parser()
    return merged_options(parser.parse_args(argv), parser)


def _config(tmp_path, text: str) -> str:
    path = tmp_path / "run.yaml"
    path.write_text(text)
    return str(path)


# ---- the command line ----


@pytest.mark.parametrize("command", ["generate", "serve"])
def test_sglang_flag_is_refused_with_the_fix_exit_2(command, capsys, monkeypatch):
    import k6serve.cli.generate as generate_module

    monkeypatch.setattr(generate_module.DiffGenerator, "from_cli_options",
                        staticmethod(lambda *args, **kwargs: pytest.fail("the model loaded")))
    request = ["--prompt", "x"] if command == "generate" else []
    assert main([command, "--model-path", "demo", *request, "--enable-torch-compile"]) == 2
    err = capsys.readouterr().err
    assert err == f"error: unrecognized arguments: --enable-torch-compile (SGLang's flag; {COMPILE_FIX})\n"


def test_each_flag_is_named_not_its_value(capsys):
    # `--dit-cpu-offload true`: argparse left both words unrecognized; `true` is the flag's value, not a flag.
    assert main(["generate", "--model-path", "demo", "--prompt", "x", "--dit-cpu-offload", "true",
                 "--guidance-rescale", "-0.5", "--dit-precision=bf16"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: unrecognized arguments: --dit-cpu-offload --guidance-rescale --dit-precision (")
    assert " true" not in err.split("(")[0] and "-0.5" not in err
    assert ("(--dit-cpu-offload is SGLang's flag; offload the DiT with --cpu-offload-components transformer, or "
            "keep it on the GPU, SGLang's false, with --component-residency transformer=resident)") in err
    assert "(--guidance-rescale is SGLang's flag; Kandinsky 6 uses plain classifier-free guidance" in err
    assert "(--dit-precision is SGLang's flag; k6serve has one --dtype for every component" in err


def test_mode_is_performance_mode():
    flags = ["generate", "--model-path", "demo", "--prompt", "x"]
    assert _options([*flags, "--mode", "speed"]) == _options([*flags, "--performance-mode", "speed"])
    engine, _ = split_options(_options([*flags, "--mode", "memory"]))
    assert engine["performance_mode"] == "memory"
    assert build_engine_config(**engine) == build_engine_config(**split_options(
        _options([*flags, "--performance-mode", "memory"]))[0])


@pytest.mark.parametrize("value", ["auto", "manual"])
@pytest.mark.parametrize("flag", ["--mode", "--performance-mode"])
def test_sglangs_modes_are_refused_with_the_choice_to_make(flag, value, capsys):
    with pytest.raises(SystemExit) as exited:
        main(["generate", "--model-path", "demo", "--prompt", "x", flag, value])
    err = capsys.readouterr().err
    assert exited.value.code == 2
    assert f"error: argument --performance-mode/--mode: '{value}' is SGLang's mode; k6serve " in err
    assert "choose speed (the default" in err and "balanced" in err and "memory" in err


@pytest.mark.parametrize("alias", ["--dp", "--data-parallel-size"])
def test_dp_is_dp_size(alias):
    flags = ["serve", "--model-path", "demo", "--num-gpus", "2"]
    assert _options([*flags, alias, "2"]) == _options([*flags, "--dp-size", "2"])


def test_layerwise_offload_modules_is_layerwise_offload_components():
    flags = ["generate", "--model-path", "demo", "--prompt", "x"]
    assert (_options([*flags, "--layerwise-offload-modules", "transformer"])
            == _options([*flags, "--layerwise-offload-components", "transformer"]))


def test_flags_are_not_abbreviated(capsys):
    """`--compile true` set --compile-vae. An abbreviation is refused with the flags it begins."""
    parser = build_parser()
    assert not parser.allow_abbrev and not _subparser("generate").allow_abbrev and not _subparser("serve").allow_abbrev
    assert main(["generate", "--model-path", "demo", "--prompt", "x", "--compile", "true"]) == 2
    assert capsys.readouterr().err == ("error: unrecognized arguments: --compile (--compile: flags are written whole; "
                                       "did you mean '--compile-prompt-rewrite' or '--compile-vae'?)\n")
    assert main(["generate", "--model-path", "demo", "--prompt", "x", "--compile-v", "true"]) == 2
    assert capsys.readouterr().err == ("error: unrecognized arguments: --compile-v (--compile-v: flags are written "
                                       "whole; did you mean '--compile-vae'?)\n")
    # --neg got difflib's '--nnodes'; the flag it abbreviates comes first.
    assert main(["generate", "--model-path", "demo", "--prompt", "x", "--neg", "y"]) == 2
    assert "did you mean '--negative-prompt'?" in capsys.readouterr().err
    assert main(["serve", "--model-path", "demo", "--ulysses", "2"]) == 2
    assert "unrecognized arguments: --ulysses (--ulysses: flags are written whole; did you mean '--ulysses-degree'?)" \
        in capsys.readouterr().err
    # `k6serve bench` has its own parser: `--rep 1 --compile-b eager` ran as --repeats 1 --compile-backend eager.
    with pytest.raises(SystemExit) as exited:
        main(["bench", "--tiny", "--rep", "1"])
    assert exited.value.code == 2 and "k6serve bench: error: unrecognized arguments: --rep 1" in capsys.readouterr().err


def test_a_typo_gets_the_flag_it_resembles_and_other_arguments_the_plain_message(capsys):
    assert main(["generate", "--model-path", "demo", "--prompt", "x", "--num-framez", "5"]) == 2
    assert capsys.readouterr().err == "error: unrecognized arguments: --num-framez (did you mean '--num-frames'?)\n"
    assert main(["generate", "--model-path", "demo", "--prompt", "x", "--zzzzzz"]) == 2
    assert capsys.readouterr().err == "error: unrecognized arguments: --zzzzzz\n"


POSITIONAL = "k6serve takes no positional arguments ({}): quote a value with spaces, e.g. --prompt \"A cat plays the piano\""


def test_words_that_are_no_flags_value_are_named_as_such(capsys):
    """An unquoted prompt's other words, and what follows `--`, were dropped from the message once it named only
    flags ("--" itself got "did you mean '--dp'?")."""
    assert main(["generate", "--model-path", "demo", "--prompt", "x", "y"]) == 2
    assert capsys.readouterr().err == f"error: unrecognized arguments: y; {POSITIONAL.format('y')}\n"
    assert main(["generate", "--model-path", "demo", "--prompt", "A", "cat", "--enable-torch-compile"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: unrecognized arguments: cat --enable-torch-compile (SGLang's flag; ")
    assert err.endswith(f"; {POSITIONAL.format('cat')}\n")
    assert main(["generate", "--model-path", "demo", "--prompt", "x", "--", "extra"]) == 2
    assert capsys.readouterr().err == f"error: unrecognized arguments: -- extra; {POSITIONAL.format('-- extra')}\n"


def test_a_flag_of_k6serve_itself_after_the_command_is_moved_before_it(capsys):
    assert main(["generate", "--model-path", "demo", "--prompt", "x", "--version"]) == 2
    assert capsys.readouterr().err == ("error: unrecognized arguments: --version (--version goes before the command: "
                                       "k6serve --version)\n")


@pytest.mark.parametrize(("command", "typed", "fix"), [
    ("generate", ["--image-encoder-precision", "bf16"], NO_IMAGE_ENCODER_FIX),
    ("serve", ["--pipeline-class-name", "Kandinsky6TI2VAPipeline"], PIPELINE_FIX),
    ("serve", ["--pipeline", "Kandinsky6TI2VAPipeline"], PIPELINE_FIX),
    ("generate", ["--pipeline-config-path", "pipeline.json"], PIPELINE_CONFIG_FIX),
    ("serve", ["--component-paths.vae", "/models/vae"], COMPONENT_PATHS_FIX),
    ("generate", ["--transformer-path=/models/transformer"], COMPONENT_PATHS_FIX),
    ("generate", ["--vae-config.load-encoder", "false"], WHOLE_VAE_FIX),
    ("serve", ["--vae-config.tile-sample-min-height", "128"], SPATIAL_TILES_FIX),
    ("generate", ["--vae-config.tile-sample-stride-width", "96"], SPATIAL_TILES_FIX),
    ("generate", ["--vae-config.tile-sample-stride-num-frames", "8"], TEMPORAL_TILES_FIX),
    ("serve", ["--vae-config.use-temporal-tiling", "false"], TEMPORAL_TILES_FIX),
    ("generate", ["--enable-frame-interpolation"], INTERPOLATION_FIX),
    ("generate", ["--upscaling-scale", "4"], UPSCALING_FIX),
    ("generate", ["--enable-layerwise-nvtx-marker"], NVTX_FIX),
    ("generate", ["--resolution", "720"], SIZE_FIX),
    ("generate", ["--embedded-cfg-scale", "6"], "Kandinsky 6 has no embedded guidance, a feature of "
                                                "guidance-distilled models such as FLUX: Pro and Lite take "
                                                "--guidance-scale, and the distilled models run without guidance"),
])
def test_sglangs_rarer_flags_are_refused_with_the_fix_exit_2(command, typed, fix, capsys):
    """The rarer flags of serving-reference.md, dotted ones included, once answered with a look-alike (`--vae-path`:
    did you mean '--video-path'?) or nothing; each shared fix once."""
    request = ["--prompt", "x"] if command == "generate" else []
    assert main([command, "--model-path", "demo", *request, *typed]) == 2
    flag = typed[0].split("=", 1)[0]
    assert capsys.readouterr().err == f"error: unrecognized arguments: {flag} (SGLang's flag; {fix})\n"


@pytest.mark.parametrize(("flag", "fix"), [
    ("--resolution", SIZE_HTTP_FIX),
    ("--embedded-cfg-scale", "Kandinsky 6 has no embedded guidance, a feature of guidance-distilled models such as "
                             "FLUX: Pro and Lite take guidance_scale, and the distilled models run without guidance"),
    ("--dmd-denoising-steps", "Kandinsky 6's distilled generation models are PiFlow, not DMD: the checkpoint's "
                              "scheduler spaces the timesteps for num_inference_steps, default 10; there is no list of "
                              "steps to set"),
])
def test_serve_words_the_request_parameters_an_engine_fix_names_as_fields(flag, fix, capsys):
    """`k6serve serve` has no --height or --guidance-scale: a request gives them, as body fields."""
    assert main(["serve", "--model-path", "demo", flag, "1"]) == 2
    assert capsys.readouterr().err == f"error: unrecognized arguments: {flag} (SGLang's flag; {fix})\n"


def test_a_dotted_flag_takes_its_sections_fix_only_for_sglangs_whole_sections():
    """`--dit-config.<field>` and `--component-paths.<component>` are SGLang's flags whatever follows the dot; another
    dotted word is not SGLang's for being dotted (`--mode.x` is nobody's flag)."""
    assert reference_note("--dit-config.num-layers", "cli").startswith("SGLang's flag; k6serve builds the DiT as the "
                                                                        "checkpoint's transformer/config.json says")
    assert reference_note("--component-attention-backends.text-encoder", "cli").startswith(
        "SGLang's flag; k6serve takes one --attention-backend, for the DiT")
    assert reference_note("component_paths.vocoder", "http") == (
        f"SGLang's server flag --component-paths.vocoder, not a request field; {COMPONENT_PATHS_FIX}")
    for name in ("--mode.x", "--debug.x", "--vae-config.bogus", "--model-path.x"):
        assert reference_note(name, "cli") is None, name


def test_every_component_of_the_checkpoints_has_sglangs_path_flag():
    from k6serve.offload.residency import GENERATION_COMPONENTS, SUPER_RESOLUTION_COMPONENTS

    for component in {*GENERATION_COMPONENTS, *SUPER_RESOLUTION_COMPONENTS, "tokenizer", "tokenizer_2", "scheduler"}:
        assert reference_note(f"--{component.replace('_', '-')}-path", "cli") == f"SGLang's flag; {COMPONENT_PATHS_FIX}"


def test_serve_words_request_parameters_as_request_fields(capsys):
    assert main(["serve", "--model-path", "demo", "--num-outputs-per-prompt", "2"]) == 2
    assert capsys.readouterr().err == (
        "error: unrecognized arguments: --num-outputs-per-prompt (SGLang's request field num_outputs_per_prompt, sent "
        "in the POST /v1/videos body; k6serve makes one video per job: send another request with another seed)\n")


# ---- k6serve's own names of another surface ----


@pytest.mark.parametrize(("flag", "note"), [
    # The HTTP API's OpenAI fields were answered with a look-alike: --size "did you mean '--tp-size'?", --seconds
    # "'--seed'?", and another API's --duration "'--quantization'?".
    ("--size", "the HTTP API's field, OpenAI's \"WxH\" with the width first; here the size is --height and --width, "
               "e.g. --height 512 --width 768"),
    ("--seconds", "the HTTP API's field, OpenAI's; here a video's length is --num-frames, of the form 4k+1, at --fps, "
                  "e.g. --num-frames 121 --fps 24 for 5 s"),
    ("--duration", "k6serve sets a video's length with --num-frames, of the form 4k+1, at --fps, e.g. --num-frames "
                   "121 --fps 24 for 5 s"),
    ("--input-reference", "the HTTP API's upload field; here pass the file's path: --image-path FILE to generate "
                          "from an image, --video-path FILE for super-resolution"),
    ("--image-url", "k6serve fetches no URLs: download the file and pass it as --image-path, or --video-path for "
                    "super-resolution"),
])
def test_generate_says_what_to_use_for_the_http_apis_names(flag, note, capsys):
    assert main(["generate", "--model-path", "demo", "--prompt", "x", flag, "4"]) == 2
    assert capsys.readouterr().err == f"error: unrecognized arguments: {flag} ({note})\n"


def test_generate_names_each_of_several_http_names(capsys):
    assert main(["generate", "--model-path", "demo", "--prompt", "x", "--size", "9", "--seconds", "3"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: unrecognized arguments: --size --seconds (--size: the HTTP API's field, ")
    assert " (--seconds: the HTTP API's field, OpenAI's; here " in err
    # A note that is a sentence of its own reads as one after its name ("--image-url is k6serve fetches ...").
    assert main(["generate", "--model-path", "demo", "--prompt", "x", "--image-url", "a", "--duration", "3"]) == 2
    assert "(--image-url: k6serve fetches no URLs: " in capsys.readouterr().err
    # Each note names its flag when another flag of the command line got a note of another kind.
    assert main(["generate", "--model-path", "demo", "--prompt", "x", "--port", "3", "--enable-torch-compile"]) == 2
    assert "(--enable-torch-compile is SGLang's flag; " in capsys.readouterr().err


def test_a_config_file_key_of_the_http_api_gets_the_cli_words(tmp_path, capsys):
    config = tmp_path / "c.json"
    config.write_text('{"size": "96x64", "prompt": "x"}')
    assert main(["generate", "--model-path", "demo", "--config", str(config)]) == 2
    assert "unknown key(s) ['size'] (the HTTP API's field, OpenAI's \"WxH\" with the width first; here the size " \
           "is --height and --width" in capsys.readouterr().err


@pytest.mark.parametrize("flag", ["--seed", "--num-frames", "--size", "--seconds", "--input-reference",
                                  "--no-enable-cache-dit"])
def test_serve_says_a_request_field_is_sent_per_request(flag, capsys):
    # `k6serve serve --seed 3` was answered "did you mean '--dp'?".
    assert main(["serve", "--model-path", "demo", flag, "3"]) == 2
    assert capsys.readouterr().err == (f"error: unrecognized arguments: {flag} (a field of each POST /v1/videos "
                                       "request (docs/http-api.md), not a flag of the server)\n")


def test_a_flag_of_the_other_command_is_named_as_its(tmp_path, capsys):
    # `k6serve generate --port` had no word of `k6serve serve`; a generate --config file's `prompt:` given to serve
    # was "did you mean 'port'?".
    assert main(["generate", "--model-path", "demo", "--prompt", "x", "--port", "3"]) == 2
    assert capsys.readouterr().err == ("error: unrecognized arguments: --port (--port is a flag of `k6serve serve`, "
                                       "which serves requests over HTTP; `k6serve generate` runs its request and "
                                       "exits)\n")
    assert main(["serve", "--model-path", "demo", "--prompt-file-path", "p.txt"]) == 2
    assert capsys.readouterr().err == ("error: unrecognized arguments: --prompt-file-path (--prompt-file-path is a "
                                       "flag of `k6serve generate`; a server's requests come over HTTP, POST "
                                       "/v1/videos (docs/http-api.md))\n")
    config = tmp_path / "c.yaml"
    config.write_text("host: 0.0.0.0\nprompt: hi\n")
    assert main(["generate", "--model-path", "demo", "--config", str(config)]) == 2
    assert "unknown key(s) ['host'] (--host is a flag of `k6serve serve`" in capsys.readouterr().err
    assert main(["serve", "--model-path", "demo", "--config", str(config)]) == 2
    assert ("unknown key(s) ['prompt'] (a field of each POST /v1/videos request (docs/http-api.md), not a flag of the "
            "server)") in capsys.readouterr().err


@pytest.mark.parametrize(("name", "note"), [
    ("size", "the HTTP API's field, OpenAI's \"WxH\" with the width first; here the size is height and width, e.g. "
             "height=512, width=768"),
    ("seconds", "the HTTP API's field, OpenAI's; here a video's length is num_frames, of the form 4k+1, at fps, e.g. "
                "num_frames=121, fps=24 for 5 s"),
    ("input_reference", "the HTTP API's upload field; here pass the file's path: image_path to generate from an "
                        "image, video_path for super-resolution"),
    ("image_url", "k6serve fetches no URLs: download the file and pass it as image_path, or video_path for "
                  "super-resolution"),
])
def test_the_api_says_what_to_use_for_the_http_apis_names(name, note):
    with pytest.raises(ValueError) as raised:
        SamplingParams.from_kwargs({"prompt": "x", name: 1})
    assert str(raised.value).startswith(f"Unknown sampling parameter(s) [{name!r}] ({note}). Valid parameters: ")


@pytest.mark.parametrize(("name", "note"), [
    ("duration", "k6serve takes a video's length as OpenAI's seconds, e.g. \"4\", or as num_frames (4k+1) at fps"),
    ("image_url", "k6serve fetches no URLs: upload the file as input_reference in a multipart request, or name a "
                  "file on the server, in a folder it allows with --allowed-input-dir, as image_path or video_path"),
])
def test_http_body_with_another_apis_name_says_what_to_send(name, note):
    with pytest.raises(ApiError) as raised:
        parse_create_body({"prompt": "x", name: "4"})
    assert (raised.value.status, raised.value.param) == (400, name)
    assert raised.value.message.startswith(f"Unknown field {name!r} ({note}). Valid fields: prompt, ")


def test_prompt_file_path_outside_the_cli_says_how_to_send_several_prompts():
    # SGLang's DiffGenerator takes it (its generate reads the file); here the API guessed 'return_file_paths_only'
    # and the HTTP body had no hint.
    fix = ("`k6serve generate`'s flag; the Python API takes the prompts themselves, one request each: generate(prompt="
           "[...]), e.g. with the file's lines that are not blank")
    with pytest.raises(ValueError) as raised:
        SamplingParams.from_kwargs({"prompt": "x", "prompt_file_path": "p.txt"})
    assert str(raised.value).startswith(f"Unknown sampling parameter(s) ['prompt_file_path'] ({fix}). Valid ")
    with pytest.raises(ValueError) as raised:
        build_engine_config("demo", prompt_file_path="p.txt")
    assert str(raised.value).startswith(f"Unknown engine option 'prompt_file_path' ({fix}). Valid options: ")
    with pytest.raises(ApiError) as raised:
        parse_create_body({"prompt": "x", "prompt_file_path": "p.txt"})
    assert raised.value.message.startswith("Unknown field 'prompt_file_path' (`k6serve generate`'s flag; a job has "
                                           "one prompt: send one POST /v1/videos per prompt). Valid fields: ")


# ---- --config files ----


def test_config_file_takes_sglangs_names_of_k6serve_options(tmp_path):
    path = _config(tmp_path, "mode: speed\ndp: 1\nlayerwise-offload-modules: [transformer]\n")
    options = _options(["generate", "--config", path, "--model-path", "demo", "--prompt", "x"])
    assert options["performance_mode"] == "speed" and options["dp_size"] == 1
    assert options["layerwise_offload_components"] == ["transformer"]
    assert not {"mode", "dp", "layerwise_offload_modules"} & options.keys()


@pytest.mark.parametrize(("text", "message"), [
    ("enable_torch_compile: true\n",
     f"unknown key(s) ['enable_torch_compile'] (SGLang's flag; {COMPILE_FIX})"),
    ("enable-torch-compile: true\nnum_frame: 5\n",
     "unknown key(s) ['enable_torch_compile', 'num_frame'] (did you mean 'num_frames' for 'num_frame'?) "
     f"(enable_torch_compile is SGLang's flag; {COMPILE_FIX})"),
    ("mode: auto\n", "--performance-mode: 'auto' is SGLang's mode; k6serve does not pick a mode from the free GPU "
                     "memory"),
    ("mode: speed\nperformance-mode: memory\n",
     "keys 'mode' and 'performance_mode' both set --performance-mode ('mode' is SGLang's name of it); keep one of "
     "them."),
    ("dp: 1\ndata-parallel-size: 1\n",
     "keys 'dp' and 'data_parallel_size' both set --dp-size (both are SGLang's names of it); keep one of them."),
    # SGLang's sections as nested mappings: `vae-config:` is read as its dotted keys, `dit-config:` is one key.
    ("vae-config:\n  tile-sample-min-height: 128\n  use-parallel-tiling: true\ndit-config:\n  num_layers: 2\n",
     "unknown key(s) ['dit_config', 'vae_config.tile_sample_min_height'] (dit_config is SGLang's flag; k6serve builds "
     "the DiT as the checkpoint's transformer/config.json says, with nothing to override: drop it) "
     f"(vae_config.tile_sample_min_height is SGLang's flag; {SPATIAL_TILES_FIX})"),
    ("vae-config.blend-num-frames: 4\n",
     f"unknown key(s) ['vae_config.blend_num_frames'] (SGLang's flag; {TEMPORAL_TILES_FIX})"),
])
def test_config_file_refuses_sglangs_other_names_with_the_fix(tmp_path, capsys, text, message):
    path = _config(tmp_path, text)
    assert main(["generate", "--config", path, "--model-path", "demo", "--prompt", "x"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: --config {path}: ") and message in err, err


# ---- the Python API ----


class _RefusingWorker:
    variant = VARIANTS["pro-distill"]

    def resolve(self, params):
        pytest.fail("the request got past its keys")

    run = resolve


def test_from_pretrained_names_the_fix_in_keywords_not_a_look_alike():
    with pytest.raises(ValueError) as raised:
        DiffGenerator.from_pretrained(model_path="demo", enable_torch_compile=True)
    assert str(raised.value).startswith(
        "Unknown engine option 'enable_torch_compile' (SGLang's option; k6serve compiles the DiT's repeated blocks on "
        "CUDA under performance_mode='speed', the default; compile_vae=True compiles the VAE decoder too). Valid "
        "options: [")
    assert "did you mean" not in str(raised.value)
    with pytest.raises(ValueError, match=r"^Unknown engine option 'dit_cpu_offload' \(SGLang's option; offload the "
                                         r"DiT with cpu_offload_components=\['transformer'\], or keep it on the GPU, "
                                         r"SGLang's false, with component_residency=\{'transformer': 'resident'\}\)"):
        DiffGenerator.from_pretrained(model_path="demo", dit_cpu_offload=True)
    # The API takes no renames: the message names k6serve's keyword.
    with pytest.raises(ValueError, match=r"^Unknown engine option 'mode' \(SGLang's option; k6serve calls it "
                                         r"performance_mode\)\. Valid options: "):
        build_engine_config("demo", mode="speed")
    with pytest.raises(ValueError, match=r"^Unknown engine option 'num_gpu' \(did you mean 'num_gpus'\?\)\. Valid "):
        build_engine_config("demo", num_gpu=1)  # a typo keeps its guess


def test_generate_names_the_fix_for_sglangs_sampling_parameters():
    config = build_engine_config("fake-k6", load_format="dummy", device="cpu")
    with DiffGenerator(Engine(config, worker=_RefusingWorker())) as generator:
        with pytest.raises(ValueError, match=r"^Unknown sampling parameter\(s\) \['num_outputs_per_prompt'\] "
                                             r"\(SGLang's parameter; k6serve makes one video per request: call "
                                             r"generate\(\) again with another seed\)\. Valid parameters: "):
            generator.generate(sampling_params_kwargs={"prompt": "x", "num_outputs_per_prompt": 2})
        with pytest.raises(ValueError, match=r"\(SGLang's parameter; k6serve's step caching is Cache-DiT: "
                                             r"enable_cache_dit for one request, tuned with cache_dit_params, or the "
                                             r"engine's cache_dit_config for every request\)"):
            generator.generate(prompt="x", enable_teacache=True)
    with pytest.raises(ValueError, match=r"^Unknown sampling parameter\(s\) \['guidance_rescale', 'num_frame'\] "
                                         r"\(did you mean 'num_frames' for 'num_frame'\?\) \(guidance_rescale is "
                                         r"SGLang's parameter; Kandinsky 6 uses plain classifier-free guidance "
                                         r"without rescale: guidance_scale sets its strength"):
        split_kwargs({"prompt": "x", "guidance_rescale": 0.7, "num_frame": 5})


@pytest.mark.parametrize(("options", "fix"), [
    ({"pipeline_config": {"vae_tiling": True}}, "k6serve has no pipeline config: its settings are keywords of "
                                                "from_pretrained(), e.g. vae_tiling='on'"),
    ({"component_paths": {"vae": "/models/vae"}}, "k6serve loads every component from the model_path folder: to swap "
                                                  "one, copy the folder, replace that component's subfolder, e.g. vae, "
                                                  "and pass the copy as model_path"),
    ({"model_subfolder": "k6"}, "k6serve reads model_index.json at the top of model_path: download the repository and "
                                "pass the subfolder that holds it, e.g. model_path='./repo/subfolder'"),
    ({"pipeline_class_name": "Kandinsky6TI2VAPipeline"},
     "k6serve picks the pipeline by the model's name or its model_index.json, and model_id names the model of a "
     "renamed folder, e.g. model_id='Kandinsky-6.0-Pro-distill-5s-Diffusers'"),
    ({"resolution": 720}, "a pipeline resolution is a setting of other models, not of Kandinsky 6; k6serve takes the "
                          "size as height and width in pixels, multiples of 16 up to 2048, default height 512, width "
                          "768, e.g. height=720, width=1280; super-resolution's output size is sr_target_resolution, "
                          "e.g. 'fullhd'"),
    ({"enable_layerwise_nvtx_marker": True}, "k6serve adds no NVTX ranges; the result's timings hold each stage's "
                                             "seconds, e.g. encode, denoise_per_step and decode_video; `k6serve bench` "
                                             "times the stages against diffusers"),
    ({"scheduler_rpc_timeout": 60}, "k6serve puts no time limit on a request: Ctrl-C cancels the request that "
                                    "generate() waits for, at its next step"),
    ({"vae_config.tile_sample_min_height": 128},
     "k6serve's spatial VAE tiles, with vae_tiling='on', are 256 pixels with a stride of 192, SGLang's defaults too; "
     "there is no tile size to set"),
])
def test_the_api_words_the_rarer_engine_fixes_in_keywords(options, fix):
    (name,) = options
    with pytest.raises(ValueError) as raised:
        DiffGenerator.from_pretrained(model_path="demo", **options)
    assert str(raised.value).startswith(f"Unknown engine option {name!r} (SGLang's option; {fix}). Valid options: [")


@pytest.mark.parametrize(("name", "fix"), [
    ("frame_interpolation_exp", "k6serve adds no interpolated frames: the video holds the num_frames frames the model "
                                "makes, played at fps"),
    ("upscaling_scale", "k6serve upscales with the Kandinsky 6 super-resolution model, loaded on its own: pass the "
                        f"finished video to upscale() of a DiffGenerator of {SR_CHECKPOINT}, with "
                        "sr_resolution_scale=2, 4 or 2.25"),
    ("no_override_protected_fields", "k6serve fills only the parameters a request leaves out with the model's "
                                     "defaults, never one it sets: drop it"),
])
def test_the_api_words_the_rarer_request_fixes_in_parameters(name, fix):
    with pytest.raises(ValueError) as raised:
        split_kwargs({"prompt": "x", name: 2})
    assert str(raised.value).startswith(f"Unknown sampling parameter(s) [{name!r}] (SGLang's parameter; {fix}). ")


# ---- the HTTP API ----


@pytest.mark.parametrize("form", [False, True])
def test_http_body_with_an_sglang_field_is_a_400_with_the_fix(form):
    body = {"prompt": "x", "guidance_rescale": "0.7" if form else 0.7}
    with pytest.raises(ApiError) as raised:
        parse_create_body(body, form=form)
    error = raised.value
    assert (error.status, error.code, error.param) == (400, "invalid_parameter", "guidance_rescale")
    assert error.message.startswith(
        "Unknown field 'guidance_rescale' (SGLang's field; Kandinsky 6 uses plain classifier-free guidance without "
        "rescale: guidance_scale sets its strength, and the distilled models run without guidance). Valid fields: "
        "prompt, ")


def test_http_body_with_an_sglang_server_flag_says_it_is_the_servers():
    with pytest.raises(ApiError) as raised:
        parse_create_body({"prompt": "x", "enable_torch_compile": True})
    assert raised.value.message.startswith(
        f"Unknown field 'enable_torch_compile' (SGLang's server flag --enable-torch-compile, not a request field; "
        f"{COMPILE_FIX}). Valid fields: ")
    with pytest.raises(ApiError, match=r"^Unknown field 'num_frame' \(did you mean 'num_frames'\?\)\. Valid fields: "):
        parse_create_body({"prompt": "x", "num_frame": 5})


@pytest.mark.parametrize(("name", "what", "fix"), [
    ("enable_upscaling", "SGLang's field",
     "k6serve upscales with the Kandinsky 6 super-resolution model, loaded on its own: upload the finished video as "
     f"video_reference to a `k6serve serve` of {SR_CHECKPOINT}, with sr_resolution_scale 2, 4 or 2.25"),
    ("frame_interpolation_model_path", "SGLang's field",
     "k6serve adds no interpolated frames: the video holds the num_frames frames the model makes, played at fps"),
    ("resolution", "SGLang's server flag --resolution, not a request field", SIZE_HTTP_FIX),
    ("embedded_cfg_scale", "SGLang's server flag --embedded-cfg-scale, not a request field",
     "Kandinsky 6 has no embedded guidance, a feature of guidance-distilled models such as FLUX: Pro and Lite take "
     "guidance_scale, and the distilled models run without guidance"),
    ("vae_config.tile_sample_min_num_frames",
     "SGLang's server flag --vae-config.tile-sample-min-num-frames, not a request field", TEMPORAL_TILES_FIX),
    ("dit_config.num_layers", "SGLang's server flag --dit-config.num-layers, not a request field",
     "k6serve builds the DiT as the checkpoint's transformer/config.json says, with nothing to override: drop it"),
])
def test_http_body_with_a_rarer_sglang_name_is_a_400_with_the_fix(name, what, fix):
    with pytest.raises(ApiError) as raised:
        parse_create_body({"prompt": "x", name: 1})
    assert (raised.value.status, raised.value.param) == (400, name)
    assert raised.value.message.startswith(f"Unknown field {name!r} ({what}; {fix}). Valid fields: prompt, ")


# ---- the table itself ----


def test_every_alias_is_a_flag_of_the_real_parser_for_its_option():
    for command in ("generate", "serve"):
        flags = _option_strings(command)
        for name, option in aliases().items():
            assert option in ENGINE_FIELDS, name
            assert flags["--" + name.replace("_", "-")] == option, (command, name)


def test_no_table_name_is_a_k6serve_name():
    """A table name that k6serve also takes would be shadowed on one surface and refused on another."""
    taken = set(ENGINE_FIELDS) | set(HTTP_FIELD_NAMES) | (REQUEST_FIELDS - API_ONLY_NAMES)
    for command in ("generate", "serve"):
        taken |= {flag.lstrip("-").replace("-", "_") for flag, dest in _option_strings(command).items()
                  if flag.lstrip("-").replace("-", "_") not in aliases()}
        taken |= {action.dest for action in _subparser(command)._actions}
    assert sorted(set(REFERENCE_NAMES) & taken) == []
    assert API_ONLY_NAMES <= REQUEST_FIELDS and API_ONLY_NAMES <= set(REFERENCE_NAMES)


def test_every_flag_a_fix_names_is_a_k6serve_flag():
    known = set(_option_strings("generate")) | set(_option_strings("serve"))
    sglang = {"--" + name.replace("_", "-") for name in REFERENCE_NAMES}
    for name, entry in REFERENCE_NAMES.items():
        for text in filter(None, (entry.fix, entry.api_fix, entry.http_fix)):
            named = set(re.findall(r"(?<![\w-])--[a-z][a-z0-9.-]*[a-z0-9]", text)) - sglang
            assert named <= known, (name, named - known)
    for (option, value), text in REFERENCE_VALUES.items():
        assert option in OPTION_CHOICES and value not in OPTION_CHOICES[option]
        assert set(re.findall(r"--[a-z][a-z0-9-]*[a-z0-9]", text)) <= known
    for name, notes in _OWN_NAMES.items():
        for surface, text in notes.items():
            assert set(re.findall(r"--[a-z][a-z0-9-]*[a-z0-9]", text)) <= known, (name, surface)
            if surface in ("api", "http"):
                keywords = set(re.findall(r"\b([a-z]+(?:_[a-z]+)+)\b", text))
                assert keywords <= REQUEST_FIELDS | set(HTTP_FIELD_NAMES) | {"input_reference"}, (name, keywords)


def test_each_entry_is_an_alias_or_one_sentence_of_fix():
    for name, entry in REFERENCE_NAMES.items():
        assert entry.kind in (ENGINE, REQUEST)
        assert (entry.alias is None) != (entry.fix is None), name
        for text in filter(None, (entry.fix, entry.api_fix, entry.http_fix)):
            assert not text.endswith(".") and not re.search(r"(?<!e\.g)\.\s", text), (name, text)


@pytest.mark.parametrize("name", sorted(REFERENCE_NAMES))
def test_each_surface_spells_k6serve_options_its_own_way(name):
    """The Python API names keywords, never an engine option's or a request parameter's flag; a request body, and
    `k6serve serve`, name request fields, never a request flag."""
    api = reference_note(name, "api")
    keyword_flags = {"--" + field.replace("_", "-") for field in ENGINE_FIELDS | REQUEST_FIELDS}
    assert not set(re.findall(r"--[a-z][a-z0-9-]*[a-z0-9]", api)) & keyword_flags, api
    request_flags = {"--" + field.replace("_", "-") for field in HTTP_FIELD_NAMES}
    for surface in ("http", "serve"):  # `k6serve serve` takes its requests over HTTP only
        note = reference_note(name, surface)
        assert not set(re.findall(r"--[a-z][a-z0-9-]*[a-z0-9]", note)) & request_flags, (surface, note)
    for surface in SURFACES:
        assert reference_note(name, surface).startswith("SGLang's ")


@pytest.mark.parametrize("mode", ["auto", "manual"])
def test_the_api_refuses_sglangs_modes_with_which_to_pick(mode):
    """`performance_mode='auto'` through the Python API: the config's check adds the same fix as the CLI's, in the
    API's words (no flags)."""
    with pytest.raises(ValueError, match=rf"got '{mode}': '{mode}' is SGLang's mode; k6serve .*speed") as caught:
        DiffGenerator.from_pretrained(model_path="demo", performance_mode=mode)
    assert "--" not in str(caught.value)
    with pytest.raises(ValueError, match=f"'{mode}' is SGLang's mode"):
        build_engine_config("demo", performance_mode=mode)


@pytest.mark.parametrize(("name", "fragment"), [
    ("n", "k6serve makes one video per job: send another request with another seed"),
    ("video_url", "k6serve fetches no URLs: upload the file as input_reference in a multipart request"),
    ("reference_url", "or name a file on the server, in a folder it allows with --allowed-input-dir"),
    ("extra_body", "put its fields in the body itself, as the OpenAI SDK's extra_body does"),
    ("guidance_scale_2", "Kandinsky 6 has one guidance scale, guidance_scale"),
    ("flow_shift", "scheduler/scheduler_config.json"),
    ("output_quality", "crf 18"),
])
def test_sglangs_video_body_fields_say_what_to_send_instead(name, fragment):
    """The reference's POST /v1/videos fields (serving-reference.md §2.3) that k6serve does not take: each refusal
    says what to do (video_url had "did you mean 'video_path'?", a wrong lead: a URL is not a server path)."""
    hint = unknown_names_hint([name], list(VideoCreateBody.model_fields), surface="http")
    assert hint.startswith(" (SGLang's field; ") and fragment in hint and "did you mean" not in hint


def test_no_forms_are_switches_of_the_command_line_only(capsys):
    """`--no-debug` is the false of SGLang's switch; `--no-mode` (an alias's), and no_debug as a JSON field or a
    Python keyword, are nobody's names and were answered as SGLang's."""
    assert reference_note("--no-debug", "cli") is not None
    assert reference_note("--no-mode", "cli") is None
    assert main(["generate", "--model-path", "demo", "--prompt", "x", "--no-mode"]) == 2
    assert "SGLang" not in capsys.readouterr().err
    fields = list(VideoCreateBody.model_fields)
    assert "SGLang" not in unknown_names_hint(["no_debug"], fields, surface="http")
    assert "SGLang" not in unknown_names_hint(["no_profile"], ["prompt"], surface="api")
    assert "SGLang's field" in unknown_names_hint(["debug"], fields, surface="http")


def test_a_serve_config_file_takes_the_aliases(tmp_path):
    path = _config(tmp_path, "mode: memory\ndp: 2\nlayerwise-offload-modules: [transformer]\n")
    options = _options(["serve", "--config", path, "--model-path", "demo", "--num-gpus", "2"])
    assert (options["performance_mode"], options["dp_size"], options["layerwise_offload_components"]) == (
        "memory", 2, ["transformer"])
    assert not {"mode", "dp", "layerwise_offload_modules"} & set(options)


def test_sglangs_list_of_one_source_video_says_to_pass_the_path():
    # SGLang takes video_path=[path] (a list of one source); it was refused as "must be a string, got [...] (list)".
    from pathlib import Path

    with pytest.raises(ValueError, match=r"^video_path takes one path \(a str or pathlib\.Path\), not a list of 1; "
                                         r"pass the path itself: video_path='in\.mp4'\.$"):
        split_kwargs({"video_path": [Path("in.mp4")]})
    with pytest.raises(ValueError, match=r"not a list of 2; upscale one source a call\.$"):
        split_kwargs({"video_path": ["a.mp4", "b.mp4"]})
    with pytest.raises(ValueError, match=r"not a list of 2; a request takes one conditioning image\.$"):
        split_kwargs({"prompt": "p", "image_path": ["a.png", "b.png"]})


@pytest.mark.parametrize(("body", "message"), [
    ({"prompt": "x", "seed": [1, 2]}, "seed: one integer per job (SGLang's list of seeds is one per output; a job "
                                      "makes one video: send a job per seed), got [1, 2]."),
    ({"prompt": ["a", "b"]}, "prompt: one string per job (send a POST /v1/videos per prompt), got [\"a\", \"b\"]."),
    ({"prompt": "x", "video_path": ["/in.mp4"]}, "video_path: one server-side path per job (send SGLang's list of "
                                                 "one source as the path itself), got [\"/in.mp4\"]."),
])
def test_http_lists_sglang_takes_say_a_job_takes_one(body, message):
    # SGLang's body takes a seed list and a list of one source; pydantic answered "Input should be a valid integer".
    with pytest.raises(ApiError) as raised:
        parse_create_body(body)
    assert (raised.value.status, raised.value.message) == (400, message)


def test_sglangs_retired_config_keys_say_what_k6serve_takes(tmp_path, capsys):
    # An old SGLang config file's warmup / server_warmup / decoder_tp: server_warmup had no hint and decoder_tp
    # got "did you mean 'encoder_parallel'?".
    path = _config(tmp_path, "model-path: demo\nprompt: a\nserver_warmup: true\ndecoder_tp: 2\n")
    assert main(["generate", "--config", path]) == 2
    err = capsys.readouterr().err
    assert ("(decoder_tp is SGLang's flag; retired in SGLang too; k6serve does not split the generation VAE's decode "
            "across GPUs, and --vae-tiling on lowers its peak;") in err
    assert ("(server_warmup is SGLang's flag; retired in SGLang too; k6serve warms up with --warmup-mode server (at "
            "start) or --warmup-mode request (before each shape's first request), off by default)") in err
    assert "encoder_parallel" not in err
