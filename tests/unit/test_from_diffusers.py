"""Moving working diffusers code over: diffusers' argument names are refused with what to use instead (difflib
guessed look-alikes: output_type -> output_path wrote an MP4 into a folder named np), its value types are taken
where they mean the same (dtype=torch.bfloat16), and its inputs (PIL frames, float arrays, a step callback) are
refused before anything runs, with a fix that works on them."""

from __future__ import annotations

import numpy as np
import PIL.Image
import pytest
import torch

from k6serve.api import DiffGenerator
from k6serve.cli.main import main
from k6serve.engine_arguments import build_engine_config
from k6serve.request_arguments import split_kwargs
from k6serve.serve.errors import ApiError
from k6serve.serve.video_create_body import parse_create_body


@pytest.mark.parametrize(("name", "value", "fix"), [
    ("frame_rate", 24.0, "diffusers' argument; k6serve calls it fps (1 to 240, default 24), e.g. fps=24"),
    ("output_type", "np", "return_frames=True) returns result.frames, uint8"),
    ("generator", 1, "pass seed=N: the generation noise comes from a CPU torch.Generator"),
    ("num_videos_per_prompt", 2, "one video per call: call generate() again with another seed"),
    ("callback_on_step_end", print, "on_progress=fn) calls fn(step, total)"),
    ("prompt_embeds", None, "k6serve encodes the prompt itself: pass the text as prompt and negative_prompt"),
    ("image", "x.png", "save it, e.g. image.save('first.png'), and pass image_path='first.png'"),
    ("video", "x.mp4", "export_to_video(frames, 'source.mp4', fps=24)"),
    ("resolution_scale", 2, "k6serve calls it sr_resolution_scale"),
    ("lq_noise_scale", 0.7, "sr_params.lq_noise_scale, 0.7 as released"),
])
def test_the_python_api_says_what_a_diffusers_argument_is_here(name, value, fix):
    with pytest.raises(ValueError) as raised:
        split_kwargs({"prompt": "p", name: value})
    assert fix in str(raised.value) and "did you mean" not in str(raised.value)


@pytest.mark.parametrize(("flag", "fix"), [
    ("--frame-rate", "k6serve calls it --fps (1 to 240, default 24), e.g. --fps 24"),
    ("--num-videos-per-prompt", "run again with another --seed"),
    ("--lq-noise-scale", "there is none to set per request"),
    ("--torch-dtype", "k6serve calls it --dtype"),
])
def test_the_command_line_says_what_a_diffusers_argument_is_here(flag, fix, capsys):
    assert main(["generate", "--model-path", "demo", "--prompt", "p", flag, "2"]) == 2
    err = capsys.readouterr().err
    assert "diffusers' argument; " in err and fix in err and "did you mean" not in err


def test_an_http_body_with_diffusers_names_gets_the_field_to_send():
    with pytest.raises(ApiError) as raised:
        parse_create_body({"prompt": "x", "frame_rate": 24})
    assert "diffusers' argument; k6serve calls it fps" in raised.value.message


def test_from_pretrained_takes_torch_dtypes_and_devices_and_names_diffusers_loading_arguments():
    config = build_engine_config("demo", dtype=torch.bfloat16, device=torch.device("cpu"))
    assert (config.model.dtype, config.runtime.device) == ("bfloat16", "cpu")
    with pytest.raises(ValueError, match=r"device takes 'cuda', not 'cuda:1': choose the GPU with the "
                                         r"environment, CUDA_VISIBLE_DEVICES=1"):
        build_engine_config("demo", device=torch.device("cuda", 1))
    with pytest.raises(ValueError, match=r"--dtype must be one of .*got 'float16'"):
        build_engine_config("demo", dtype=torch.float16)
    for name, fix in (("torch_dtype", "k6serve calls it dtype"), ("device_map", "performance_mode='balanced'"),
                      ("variant", "safetensors weights"), ("low_cpu_mem_usage", "straight into place")):
        with pytest.raises(ValueError, match=f"diffusers' argument; .*{fix}"):
            build_engine_config("demo", **{name: "x"})


def test_a_torch_generator_as_the_seed_says_which_seed_gives_its_noise():
    with pytest.raises(ValueError, match=r"seed takes an integer, not a torch\.Generator: .*seed=42 for "
                                         r"torch\.Generator\('cpu'\)\.manual_seed\(42\)"):
        split_kwargs({"prompt": "p", "seed": torch.Generator().manual_seed(42)})


def test_frames_given_as_the_source_video_are_refused_in_one_line():
    frames = [PIL.Image.new("RGB", (64, 48))] * 121  # diffusers' SR input: pipe(...).frames[0]
    for source in (frames, [np.zeros((48, 64, 3), np.uint8)] * 9):
        with pytest.raises(ValueError) as raised:
            split_kwargs({"video_path": source})
        message = str(raised.value)
        assert len(message) < 400 and "export_to_video(frames, 'source.mp4', fps=24)" in message
    with pytest.raises(ValueError, match="not a list of 3 PIL images: save the first frame"):
        split_kwargs({"prompt": "p", "image_path": frames[:3]})


@pytest.mark.parametrize("pixels", [
    np.full((8, 12, 3), 200, np.uint8),
    np.full((8, 12, 3), 0.5, np.float32),  # diffusers' 'np' images: floats in [0, 1]
    torch.full((3, 8, 12), 0.5),  # diffusers' 'pt' images: channels first
    torch.full((8, 12, 3), 200, dtype=torch.uint8),
])
def test_the_save_example_for_an_image_array_works_on_it(pixels, tmp_path, monkeypatch):
    # The example was PIL.Image.fromarray(pixels) for every array: a float array or a (C, H, W) tensor failed in it.
    with pytest.raises(ValueError) as raised:
        split_kwargs({"prompt": "p", "image_path": pixels})
    example = str(raised.value).split("e.g. ", 1)[1].split(", and pass", 1)[0]
    monkeypatch.chdir(tmp_path)
    exec(example, {"PIL": PIL, "pixels": pixels})  # noqa: S102 - the message's own code, on the array it was for
    assert PIL.Image.open(tmp_path / "first.png").size == (12, 8)


def test_a_diffusers_step_callback_is_refused_before_the_request_runs(tiny_distill_dir):
    generator = DiffGenerator.from_pretrained(str(tiny_distill_dir), device="cpu")
    try:
        with pytest.raises(ValueError, match=r"on_progress is called as on_progress\(step, total\).*not as "
                                             r"diffusers' callback_on_step_end"):
            generator.generate({"prompt": "p", "height": 32, "width": 32, "num_frames": 5, "save_output": False},
                               on_progress=lambda pipe, i, t, kwargs: kwargs)
        steps = []
        generator.generate({"prompt": "p", "height": 32, "width": 32, "num_frames": 5, "num_inference_steps": 2,
                            "save_output": False}, on_progress=lambda step, total, *rest: steps.append(step))
        assert steps[:2] == [1, 2]
    finally:
        generator.shutdown()
