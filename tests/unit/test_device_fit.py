"""A full-size model on a machine without a CUDA GPU is refused before anything loads, unless --device cpu asks for
the CPU: it grew the host's memory for minutes with no word of why, until the out-of-memory killer ended it."""

from __future__ import annotations

import pytest
import torch

from k6serve import DiffGenerator
from k6serve.cli.main import main
from k6serve.engine_arguments import build_engine_config
from k6serve.runtime import device_fit
from k6serve.runtime.device_fit import check_device_fits

PRO_DISTILL = "kandinskylab/Kandinsky-6.0-Pro-distill-5s-Diffusers"
pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without CUDA")


def test_a_full_size_model_is_refused_on_the_cpu_with_the_fixes(capsys):
    assert main(["generate", "--model-path", PRO_DISTILL, "--load-format", "dummy", "--prompt", "x"]) == 2
    err = capsys.readouterr().err
    assert f"error: '{PRO_DISTILL}' (pro-distill) is a full-size model, about 143 GiB of weights in float32" in err
    assert "Run it on a CUDA GPU (install a CUDA build of torch), try the built-in demo (--model-path demo" in err
    assert "or pass --device cpu to run it on the CPU all the same." in err
    with pytest.raises(ValueError, match="is a full-size model"):  # the API and the server run the same check
        DiffGenerator.from_pretrained(PRO_DISTILL, load_format="dummy")


def test_a_mac_is_not_told_to_install_a_cuda_build(monkeypatch):
    monkeypatch.setattr(device_fit.sys, "platform", "darwin")
    with pytest.raises(ValueError, match=r"Run it on a Linux host with a CUDA GPU \(k6serve does not run on Apple's "
                                         r"GPUs, MPS\), try the built-in demo"):
        check_device_fits(build_engine_config(PRO_DISTILL, load_format="dummy"))


@pytest.mark.parametrize(("model", "expected_gib"), [
    ("kandinskylab/Kandinsky-6.0-Lite-distill-5s-Diffusers", 43),
    ("kandinskylab/Kandinsky-6.0-VSR-distilled2steps-5s-Diffusers", 25),
])
def test_a_released_hub_id_is_refused_before_its_download(model, expected_gib):
    with pytest.raises(ValueError, match=rf"about {expected_gib} GiB of weights in float32"):
        check_device_fits(build_engine_config(model))


def test_the_demos_small_checkpoints_and_an_explicit_cpu_run(tiny_distill_dir, monkeypatch):
    check_device_fits(build_engine_config("demo"))
    check_device_fits(build_engine_config(str(tiny_distill_dir)))
    check_device_fits(build_engine_config(PRO_DISTILL, load_format="dummy", device="cpu"))  # asked for
    monkeypatch.setattr(device_fit, "CPU_DEFAULT_LIMIT_BYTES", 1)  # a local folder counts its safetensors files
    with pytest.raises(ValueError, match=f"'{tiny_distill_dir}' is a full-size model"):
        check_device_fits(build_engine_config(str(tiny_distill_dir)))
