"""How a component's weights travel from its safetensors files to the device (`load_state_dict`, `_Staging`):
each tensor in the dtype it runs in, in fresh storage, the same bits as safetensors' own reader then a cast, and
never the whole component copied on the host on its way to a GPU."""

import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from k6serve.models.checkpoint_files import _Staging, load_state_dict


def _checkpoint(folder: Path) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    tensors = {
        "linear.weight": torch.randn(37, 53, generator=generator),  # fp32 file, bf16 wanted
        "modulation.weight": torch.randn(11, 7, generator=generator),  # fp32 file, kept fp32
        "stored_half": torch.randn(5, 3, generator=generator).half(),  # no wanted dtype: as stored
        "positions": torch.arange(9, dtype=torch.int64).reshape(3, 3),  # integer: never cast
        "scalar": torch.tensor(2.5),
        "empty": torch.zeros(0, 4),
    }
    save_file(tensors, str(folder / "diffusion_pytorch_model.safetensors"))
    return tensors


DTYPES = {"linear.weight": torch.bfloat16, "modulation.weight": torch.float32, "positions": torch.float16,
          "scalar": torch.bfloat16, "empty": torch.bfloat16}


def _expected(folder: Path) -> dict[str, torch.Tensor]:
    """safetensors' reader, then each floating tensor cast as asked: what the loaders did before."""
    stored = load_file(str(folder / "diffusion_pytorch_model.safetensors"))
    return {name: tensor.to(DTYPES.get(name, tensor.dtype)) if tensor.is_floating_point() else tensor
            for name, tensor in stored.items()}


def _same_bits(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(expected)
    for name, tensor in expected.items():
        assert got[name].dtype == tensor.dtype, name
        assert got[name].shape == tensor.shape, name
        assert torch.equal(got[name].cpu(), tensor), name


def test_host_weights_are_cast_as_asked_in_fresh_aligned_storage(tmp_path):
    _checkpoint(tmp_path)
    state = load_state_dict(tmp_path, dtypes=DTYPES)
    _same_bits(state, _expected(tmp_path))
    assert state["positions"].dtype == torch.int64  # an integer tensor keeps its type whatever `dtypes` says
    for name, tensor in state.items():
        # Not a view of the file's mapping (whose storage is the whole file, at the tensor's offset in it): CPU
        # GEMMs round differently on unaligned data, and a view would pin the file's pages. This holds for the fp32
        # tensor that stays fp32 too (no cast, so a view would be the easy mistake).
        assert tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size(), name
        if tensor.numel():
            assert tensor.data_ptr() % 64 == 0, name


def test_a_device_read_goes_through_the_staging_buffers(tmp_path):
    """The path of a GPU read, on the meta device: every tensor allocated there in the dtype asked for."""
    _checkpoint(tmp_path)
    state = load_state_dict(tmp_path, "meta", dtypes=DTYPES)
    expected = _expected(tmp_path)
    assert sorted(state) == sorted(expected)
    for name, tensor in expected.items():
        assert state[name].device.type == "meta"
        assert (state[name].dtype, state[name].shape) == (tensor.dtype, tensor.shape), name


@pytest.mark.parametrize("chunk_bytes", [1, 3, 64, 1 << 20])
def test_the_staging_copies_every_byte_across_chunk_boundaries(chunk_bytes):
    """A tensor larger than a buffer goes in pieces, the two buffers taking turns: each piece lands where it
    belongs, for sizes that are no multiple of the buffer's and dtypes of every width."""
    generator = torch.Generator().manual_seed(1)
    staging = _Staging(torch.device("cpu"), chunk_bytes=chunk_bytes)
    tensors = [torch.randn(13, 7, generator=generator).to(torch.bfloat16), torch.randn(101, generator=generator),
               torch.randint(0, 255, (3, 5, 7), generator=generator, dtype=torch.uint8), torch.tensor(True),
               torch.randn(4, 4, generator=generator, dtype=torch.float64), torch.zeros(0, 3)]
    for tensor in tensors:
        copied = staging.copy(tensor)
        assert copied.dtype == tensor.dtype and copied.shape == tensor.shape
        assert copied.data_ptr() != tensor.data_ptr() or not tensor.numel()
        assert torch.equal(copied, tensor)
    staging.finish()


def _anonymous_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no RssAnon in /proc/self/status")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="reads onto a GPU")
def test_a_gpu_read_has_the_host_reads_bits_and_never_the_whole_component_on_the_host(tmp_path):
    """Pro's DiT was copied whole on the host before its move to the GPU (56 GiB on every rank of a host). Here
    640 MiB of weights, of which 384 MiB cast from fp32 on the device; the host's anonymous memory may grow by
    the two 64 MiB staging buffers and the allocator's slack, far less than the weights."""
    device = torch.device("cuda")
    torch.empty(1, device=device)  # the CUDA context before the baseline
    generator = torch.Generator().manual_seed(2)
    tensors = {"big": torch.randn(64 << 20, generator=generator).to(torch.bfloat16),  # 128 MiB, two pieces
               "wide": torch.randn(3, 32 << 20, generator=generator),  # 384 MiB fp32, cast to bf16 on the device
               "odd": torch.randn(12345, generator=generator).to(torch.bfloat16),
               "positions": torch.arange(10)}
    save_file(tensors, str(tmp_path / "diffusion_pytorch_model.safetensors"))
    del tensors
    dtypes = {"wide": torch.bfloat16}
    peak, baseline, running = [0], _anonymous_bytes(), [True]

    def sample() -> None:
        while running[0]:
            peak[0] = max(peak[0], _anonymous_bytes())
            time.sleep(0.001)

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        state = load_state_dict(tmp_path, device, dtypes=dtypes)
    finally:
        running[0] = False
        sampler.join()
    assert all(tensor.device.type == "cuda" for tensor in state.values())
    assert peak[0] - baseline < 256 << 20, f"host anonymous memory grew by {(peak[0] - baseline) >> 20} MiB"
    on_host = load_state_dict(tmp_path, dtypes=dtypes)
    for name, tensor in on_host.items():
        assert state[name].dtype == tensor.dtype and torch.equal(state[name].cpu(), tensor), name


def _spy_staging(monkeypatch) -> list[tuple[tuple[int, ...], torch.dtype]]:
    staged = []
    real_copy = _Staging.copy

    def copy(self, stored):
        staged.append((tuple(stored.shape), stored.dtype))
        return real_copy(self, stored)

    monkeypatch.setattr(_Staging, "copy", copy)
    return staged


def test_the_generation_dit_is_read_straight_onto_its_device(tiny_pro_dir, monkeypatch):
    """Every weight of the DiT goes to the device through the staging buffers, none through a host copy of the
    whole model, and lands in the dtype diffusers' bf16 load gives it (the output modulations in fp32)."""
    from k6serve.models.kandinsky6.checkpoint import load_transformer

    staged = _spy_staging(monkeypatch)
    model = load_transformer(tiny_pro_dir / "transformer", device=torch.device("meta"), dtype=torch.bfloat16)
    parameters = dict(model.named_parameters())
    assert len(staged) == len(model.state_dict())
    assert all(parameter.device.type == "meta" for parameter in parameters.values())
    fp32 = sorted(name for name, parameter in parameters.items() if parameter.dtype == torch.float32)
    assert fp32 and all(name.startswith(("out_layer.modulation.", "audio_out_layer.modulation.")) for name in fp32)
    assert {parameter.dtype for parameter in parameters.values()} == {torch.bfloat16, torch.float32}


def test_the_sr_models_are_read_straight_onto_the_weights_device(tiny_sr_dir, monkeypatch):
    from k6serve.models.kandinsky6_sr.checkpoint import load_sr_models
    from k6serve.models.variants import VARIANTS

    staged = _spy_staging(monkeypatch)
    variant = next(v for v in VARIANTS.values() if v.family != "generation")
    models = load_sr_models(tiny_sr_dir, variant, device=torch.device("cpu"), dtype=torch.bfloat16,
                            load_format="auto", weights_device=torch.device("meta"))
    modules = (models.transformer, models.vae.model, models.upscaler.bank)
    count = sum(len(module.state_dict()) for module in modules)
    assert staged and len(staged) == count
    for module in modules:
        assert all(parameter.device.type == "meta" for parameter in module.parameters())


def test_a_damaged_shard_fails_naming_it_and_the_staging_is_finished_first(tmp_path, monkeypatch):
    """An error part-way must not free a pinned buffer that a copy to the GPU still reads: the staging waits for
    its copies (`finish`) on the way out, and the error names the file."""
    import json

    from k6serve.models.checkpoint_files import CheckpointError

    save_file({"a": torch.ones(3)}, str(tmp_path / "diffusion_pytorch_model-00001-of-00002.safetensors"))
    (tmp_path / "diffusion_pytorch_model-00002-of-00002.safetensors").write_bytes(b"\xff" * 64)
    (tmp_path / "diffusion_pytorch_model.safetensors.index.json").write_text(json.dumps({"weight_map": {
        "a": "diffusion_pytorch_model-00001-of-00002.safetensors",
        "b": "diffusion_pytorch_model-00002-of-00002.safetensors"}}))
    finished, copied = [], _spy_staging(monkeypatch)
    real_finish = _Staging.finish
    monkeypatch.setattr(_Staging, "finish", lambda self: (finished.append(len(copied)), real_finish(self)))
    with pytest.raises(CheckpointError, match=r"diffusion_pytorch_model-00002-of-00002\.safetensors cannot be read "
                                              r"\(.*\); copy or download the checkpoint again\."):
        load_state_dict(tmp_path, "meta")
    assert finished == [1]  # after the first shard's tensor was on its way


@pytest.mark.skipif(not torch.cuda.is_available(), reason="loads onto a GPU")
def test_a_checkpoint_loaded_onto_the_gpu_has_the_host_loads_weights_and_no_dispatch_hooks(tiny_pro_dir):
    """Every component straight onto the GPU (the DiT through the staging, the text encoders with transformers'
    single-device `device_map`, which must add no accelerate hooks: the offload and block streaming re-point the
    weights themselves), each weight the same bits as a load onto the host."""
    from k6serve.models.kandinsky6.checkpoint import load_generation_models
    from k6serve.models.variants import VARIANTS

    variant = next(v for v in VARIANTS.values() if v.family == "generation" and v.size == "pro" and not v.distilled)

    def load(device: str):
        return load_generation_models(tiny_pro_dir, variant, device=torch.device(device), dtype=torch.bfloat16,
                                      load_format="auto")

    on_gpu, on_host = load("cuda"), load("cpu")
    for component in ("transformer", "text_encoder", "text_encoder_2", "vae", "audio_vae", "vocoder"):
        gpu_module, host_module = getattr(on_gpu, component), getattr(on_host, component)
        assert not [name for name, module in gpu_module.named_modules() if hasattr(module, "_hf_hook")], component
        gpu_state, host_state = gpu_module.state_dict(), host_module.state_dict()
        assert gpu_state.keys() == host_state.keys(), component
        for name, tensor in gpu_state.items():
            assert tensor.device.type == "cuda", f"{component}.{name}"
            assert tensor.dtype == host_state[name].dtype and torch.equal(tensor.cpu(), host_state[name]), \
                f"{component}.{name}"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="reads onto a GPU")
def test_a_host_that_cannot_page_lock_memory_still_loads_the_same_bits(tmp_path, monkeypatch, caplog):
    """cudaHostRegister can fail (a container's locked-memory limit): the loader, which never needed page-locked
    memory before, copies synchronously through ordinary buffers instead, and says so."""
    from k6serve.offload import host_weights

    def refuse(*args, **kwargs):
        raise RuntimeError("cudaHostRegister of 64 MiB of host memory failed (CUDA error 2)")

    _checkpoint(tmp_path)
    monkeypatch.setattr(host_weights, "PinnedBuffer", refuse)
    with caplog.at_level("WARNING", logger="k6serve.models.checkpoint_files"):
        state = load_state_dict(tmp_path, "cuda", dtypes=DTYPES)
    assert "without page-locked staging buffers" in caplog.text and "CUDA error 2" in caplog.text
    _same_bits(state, _expected(tmp_path))
