"""The start-up LoRA flags are refused before the model loads (minutes for a real checkpoint), on the CLI and the
Python API: a bad --lora-path adapter, its --lora-scale / --lora-alpha (not finite, or past their bounds), the
super-resolution model, and generate's --loras. Before, each of these failed only once every weight was loaded (or,
for NaN strengths, after the whole denoise, on NaN latents)."""

from __future__ import annotations

import re

import pytest
import torch
from safetensors.torch import save_file

import k6serve.api as api
import k6serve.cli.serve_flags as serve_flags
from k6serve.api import DiffGenerator
from k6serve.cli.main import main
from k6serve.lora.targets import linear_names
from k6serve.models.checkpoint_files import read_json_file
from k6serve.models.kandinsky6.checkpoint import build_dummy_transformer

VIDEO_FFN = "visual_transformer_blocks.0.video_dec_block.feed_forward.net.0.proj"  # 64 -> 128 in the demo


class Loaded(BaseException):
    """Raised where the model would start loading (a BaseException: the CLI reports any Exception and returns)."""


@pytest.fixture
def no_model_load(monkeypatch):
    def engine(config):
        raise Loaded(config)

    monkeypatch.setattr(api, "Engine", engine)

    def run_serve(engine_options, server_options):
        raise Loaded(engine_options)

    monkeypatch.setattr(serve_flags, "run_serve", run_serve)


def _adapter(folder, out_features: int = 128, in_features: int = 64, module: str = VIDEO_FFN):
    file = folder / "adapter.safetensors"
    save_file({f"{module}.lora_A.weight": torch.ones(2, in_features),
               f"{module}.lora_B.weight": torch.ones(out_features, 2)}, str(file))
    return str(file)


def test_the_demos_linear_names_are_what_the_adapters_below_assume(demo_dir):
    config = read_json_file(demo_dir / "transformer" / "config.json")
    dit = build_dummy_transformer(config, device=torch.device("meta"), dtype=torch.float32)
    assert VIDEO_FFN in linear_names(dit) and tuple(dit.get_submodule(VIDEO_FFN).weight.shape) == (128, 64)


@pytest.mark.parametrize(("kind", "message"), [
    ("missing", "LoRA file '.*missing.safetensors' does not exist; check the path"),
    ("other_model", r"1 of its 1 module\(s\) are not Linear layers of the Kandinsky6Transformer \(all of them"),
    ("other_size", "maps 64 -> 128 features"),
    ("damaged", "cannot be read as safetensors"),
    ("nan_scale", "lora_scale must be a finite number, got nan"),
    ("inf_alpha", "lora_alpha must be a finite number, got inf"),
    ("huge_alpha", r"lora_alpha must be a finite number from -10000 to 10000, got 1e\+30"),
    ("odd_nickname", "lora_nickname=' style' starts or ends with spaces"),
])
def test_the_api_refuses_a_bad_lora_path_before_loading(demo_dir, tmp_path, no_model_load, kind, message):
    options = {"lora_path": _adapter(tmp_path)}
    if kind == "missing":
        options["lora_path"] = str(tmp_path / "missing.safetensors")
    elif kind == "other_model":
        options["lora_path"] = _adapter(tmp_path, module="transformer_blocks.0.attn.to_q")
    elif kind == "other_size":
        options["lora_path"] = _adapter(tmp_path, in_features=4096)
    elif kind == "damaged":
        (tmp_path / "adapter.safetensors").write_bytes(b"not safetensors at all")
    elif kind == "nan_scale":
        options["lora_scale"] = float("nan")
    elif kind == "inf_alpha":
        options["lora_alpha"] = float("inf")
    elif kind == "huge_alpha":
        options["lora_alpha"] = 1e30
    else:
        options["lora_nickname"] = " style"
    with pytest.raises(ValueError, match=message):
        DiffGenerator.from_pretrained("demo", device="cpu", **options)


def test_a_fitting_adapter_goes_on_to_the_load(demo_dir, tmp_path, no_model_load):
    with pytest.raises(Loaded):
        DiffGenerator.from_pretrained("demo", device="cpu", lora_path=_adapter(tmp_path), lora_scale=-0.5)


def test_the_super_resolution_model_refuses_lora_path_before_loading(tiny_sr_dir, tmp_path, no_model_load):
    with pytest.raises(ValueError, match="^lora_path: LoRA adapters apply to the Kandinsky 6 generation DiT; "
                                         "vsr-distilled2steps is a super-resolution model.*Drop lora_path, or pass "
                                         "a generation checkpoint as model_path.$"):
        DiffGenerator.from_pretrained(str(tiny_sr_dir), device="cpu", lora_path=_adapter(tmp_path))


def test_a_dummy_load_checks_the_adapter_against_the_released_config(tmp_path, no_model_load):
    # Without building the Pro DiT's 56 GiB of random weights first.
    with pytest.raises(ValueError, match="maps 4096 -> 16384 features"):
        DiffGenerator.from_pretrained("kandinskylab/Kandinsky-6.0-Pro-distill-5s-Diffusers", load_format="dummy",
                                      lora_path=_adapter(tmp_path))


def test_serve_refuses_a_bad_lora_path_before_loading(demo_dir, tmp_path, no_model_load, capsys):
    bad = _adapter(tmp_path, module="transformer_blocks.0.attn.to_q")
    assert main(["serve", "--model-path", "demo", "--lora-path", bad]) == 2
    assert "are not Linear layers of the Kandinsky6Transformer" in capsys.readouterr().err
    with pytest.raises(Loaded):
        main(["serve", "--model-path", "demo", "--lora-path", _adapter(tmp_path)])


@pytest.mark.parametrize(("flags", "message"), [
    (["--loras", '{"style": 1}'], r"--loras names LoRA adapter\(s\) \['style'\], but this run loads no adapter"),
    (["--lora-path", "ADAPTER", "--loras", '{"style": 1}'],
     r"\['style'\], but this run loads only the --lora-path adapter, named 'default' \(--lora-nickname\)"),
    (["--lora-path", "ADAPTER", "--loras", '{"default": 0.5}'],
     "--loras adds its adapters dynamically.*--lora-merge-mode auto merges.*pass --lora-merge-mode dynamic"),
])
def test_generate_refuses_loras_it_cannot_run_before_loading(demo_dir, tmp_path, no_model_load, capsys, flags,
                                                             message):
    flags = [_adapter(tmp_path) if flag == "ADAPTER" else flag for flag in flags]
    assert main(["generate", "--model-path", "demo", "--prompt", "a fox", "--output-path", str(tmp_path / "out"),
                 *flags]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and re.search(f"error: .*{message}", err), err


def test_generate_runs_loras_naming_the_dynamic_lora_path_adapter(demo_dir, tmp_path, no_model_load):
    with pytest.raises(Loaded):
        main(["generate", "--model-path", "demo", "--prompt", "a fox", "--output-path", str(tmp_path / "out"),
              "--lora-path", _adapter(tmp_path), "--lora-nickname", "style", "--lora-merge-mode", "dynamic",
              "--loras", '{"style": 0.5}'])
