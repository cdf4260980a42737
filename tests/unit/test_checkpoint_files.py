"""Checkpoint resolution and weight checks: errors name the repo or parameters and say how to fix them."""

import json
import re

import pytest
import torch
from safetensors.torch import save_file

from k6serve.config import ModelConfig, ParallelConfig
from k6serve.models.checkpoint_files import (
    CheckpointError,
    check_state_dict,
    load_state_dict,
    require_components,
    resolve_checkpoint,
    safetensors_files,
)


def test_offline_hub_id_gives_one_clear_error(monkeypatch, tmp_path, hub_offline):
    from huggingface_hub import constants

    # An empty cache: huggingface_hub reads HF_HOME at import, so the variable alone would leave a real cache in use.
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf" / "hub"))
    with pytest.raises(CheckpointError) as info:
        resolve_checkpoint("kandinskylab/Kandinsky-6.0-Pro-distill-5s-Diffusers")
    message = str(info.value)
    assert "kandinskylab/Kandinsky-6.0-Pro-distill-5s-Diffusers" in message
    assert "hf download kandinskylab/Kandinsky-6.0-Pro-distill-5s-Diffusers [--revision REV]`" in message
    assert "--model-path" in message
    with pytest.raises(CheckpointError) as info:  # the revision asked for is the one to download
        resolve_checkpoint("kandinskylab/Kandinsky-6.0-Pro-distill-5s-Diffusers", "v2")
    assert "`hf download kandinskylab/Kandinsky-6.0-Pro-distill-5s-Diffusers --revision v2`" in str(info.value)


def test_an_id_cached_in_other_letter_case_is_named_when_the_hub_is_unreachable(monkeypatch, tmp_path, hub_offline):
    """The Hub takes ids in any case, the cache only as downloaded: a lower-case id found no copy offline, and the
    error said there was none."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    (tmp_path / "hub" / "models--kandinskylab--Kandinsky-6.0-Pro-distill-5s-Diffusers").mkdir(parents=True)
    with pytest.raises(CheckpointError, match=r"no complete copy is in the local cache\. .* The cache does hold "
                                              r"kandinskylab/Kandinsky-6\.0-Pro-distill-5s-Diffusers, in other letter "
                                              r"case .*: pass --model-path "
                                              r"'kandinskylab/Kandinsky-6\.0-Pro-distill-5s-Diffusers'\.$"):
        resolve_checkpoint("kandinskylab/kandinsky-6.0-pro-distill-5s-diffusers")
    with pytest.raises(CheckpointError, match=r"with --model-path\.$"):  # the id as cached: nothing more to say
        resolve_checkpoint("kandinskylab/Kandinsky-6.0-Pro-distill-5s-Diffusers")


def test_snapshots_cached_under_no_ref_of_the_revision_are_named_when_the_hub_is_unreachable(monkeypatch, tmp_path,
                                                                                               hub_offline):
    """A download by commit (`hf download ID --revision SHA`) leaves no ref for main: offline, the error said no
    copy was cached."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    snapshot = tmp_path / "hub" / "models--org--name" / "snapshots" / "0123abc"
    snapshot.mkdir(parents=True)
    (snapshot / "model_index.json").write_text(json.dumps({"_class_name": "Kandinsky6TI2VAPipeline"}))
    for revision in (None, "v1.0"):
        with pytest.raises(CheckpointError, match=r"The cache holds its snapshot\(s\) 0123abc, none known as "
                                                  rf"'{revision or 'main'}': to run a cached one offline, pass "
                                                  r"--revision 0123abc\.$"):
            resolve_checkpoint("org/name", revision, model_id="Kandinsky-6.0-Pro-distill-5s-Diffusers")


def test_the_snapshot_of_the_revisions_own_ref_is_not_told_as_another_revisions(monkeypatch, tmp_path):
    """A download cut off midway (its model_index.json fetched first, refs/main written) left main's snapshot
    incomplete: the error said none was known as 'main' and to pass --revision with main's own commit, which runs
    that incomplete copy."""
    import huggingface_hub
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    repo = tmp_path / "hub" / "models--org--name"
    (repo / "snapshots" / "0123abc").mkdir(parents=True)
    (repo / "snapshots" / "0123abc" / "model_index.json").write_text(json.dumps({"_class_name": "x"}))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0123abc")

    def cut_off(*args, **kwargs):
        raise ConnectionError(104, "Connection reset by peer")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", cut_off)
    with pytest.raises(CheckpointError, match=r"no complete copy is in the local cache\. .* with --model-path\.$"):
        resolve_checkpoint("org/name", model_id="Kandinsky-6.0-Pro-distill-5s-Diffusers")


def test_a_copy_in_the_folder_above_the_cache_is_named_when_the_hub_is_unreachable(monkeypatch, tmp_path,
                                                                                     hub_offline):
    """HF_HOME set to the hub cache itself (~/.cache/huggingface/hub) looks in hub/hub: the error said no copy was
    cached."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub" / "hub"))
    (tmp_path / "hub" / "models--org--name" / "snapshots").mkdir(parents=True)
    with pytest.raises(CheckpointError, match=rf"{re.escape(repr(str(tmp_path / 'hub')))} holds it, the folder above "
                                              rf"the cache .*: set HF_HUB_CACHE={re.escape(str(tmp_path / 'hub'))}\.$"):
        resolve_checkpoint("org/name", model_id="Kandinsky-6.0-Pro-distill-5s-Diffusers")


def test_gated_repo_error_says_how_to_authenticate(monkeypatch):
    import huggingface_hub
    from huggingface_hub import errors

    class FakeResponse:
        status_code = 401
        headers = {}
        url = "https://huggingface.co"
        request = None

    def fake_download(*args, **kwargs):
        raise errors.GatedRepoError("gated", response=FakeResponse())

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_download)
    with pytest.raises(CheckpointError, match="hf auth login.*HF_TOKEN"):
        resolve_checkpoint("kandinskylab/Kandinsky-6.0-Pro-5s-Diffusers")


@pytest.mark.parametrize(("error", "reason"), [
    (OSError(30, "Read-only file system", "/cache/hub/models--x/blobs/abc.incomplete"), "read-only file system"),
    (PermissionError(13, "Permission denied", "/cache/hub/.locks"), "permission denied"),
    (OSError(28, "No space left on device", "/cache/hub/models--x/blobs/abc.incomplete"), "the disk is full"),
])
def test_a_hub_cache_that_cannot_be_written_is_told_as_such(monkeypatch, error, reason):
    # A container's read-only or full HF cache was told as "the Hub is unreachable", sending the user to the network.
    import huggingface_hub
    from huggingface_hub import constants

    def fake_download(*args, **kwargs):
        raise error

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_download)
    with pytest.raises(CheckpointError) as refused:
        resolve_checkpoint("kandinskylab/Kandinsky-6.0-Pro-5s-Diffusers")
    message = str(refused.value)
    assert message.startswith("Cannot download kandinskylab/Kandinsky-6.0-Pro-5s-Diffusers into the Hugging Face "
                              f"cache {constants.HF_HUB_CACHE!r}: {reason} ({error.filename}).")
    assert "Set HF_HOME (or HF_HUB_CACHE) to a writable folder" in message and "unreachable" not in message


def test_a_network_failure_is_still_told_as_the_hub_unreachable(monkeypatch):
    import huggingface_hub

    def fake_download(*args, **kwargs):
        raise ConnectionError(101, "Network is unreachable")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_download)
    with pytest.raises(CheckpointError, match="the Hub is unreachable"):
        resolve_checkpoint("kandinskylab/Kandinsky-6.0-Pro-5s-Diffusers")


def _fetch_only(monkeypatch, index: dict | None, tmp_path):
    """huggingface_hub as a Hub whose repository holds `index` as model_index.json (None: no such file); a snapshot
    of more than that file fails the test."""
    import huggingface_hub

    def snapshot(repo_id, revision=None, allow_patterns=None):
        assert allow_patterns == ["model_index.json"], "the whole repository was downloaded"
        (tmp_path / "snapshot").mkdir(parents=True, exist_ok=True)
        if index is not None:
            (tmp_path / "snapshot" / "model_index.json").write_text(json.dumps(index))
        return str(tmp_path / "snapshot")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot)


def test_another_models_hub_id_is_refused_from_its_model_index_before_the_weights_download(monkeypatch, tmp_path):
    """An SDXL id downloaded every weight file the patterns match, tens of GB, before its model_index.json was read
    and refused as another pipeline."""
    _fetch_only(monkeypatch, {"_class_name": "StableDiffusionXLPipeline", "unet": ["diffusers", "UNet2DCondition"]},
                tmp_path)
    with pytest.raises(CheckpointError, match=r"^stabilityai/stable-diffusion-xl-base-1\.0 is not a Kandinsky 6 "
                                              r"checkpoint \(only its model_index\.json was downloaded\): .* names "
                                              r"pipeline 'StableDiffusionXLPipeline'; k6serve serves"):
        resolve_checkpoint("stabilityai/stable-diffusion-xl-base-1.0")
    _fetch_only(monkeypatch, None, tmp_path / "other")
    with pytest.raises(CheckpointError, match=r"^org/not-diffusers has no model_index\.json, so it is not a "
                                              r"Diffusers-format Kandinsky 6 checkpoint \(nothing was downloaded"):
        resolve_checkpoint("org/not-diffusers")


def test_a_hub_id_named_as_a_release_or_routed_by_model_id_is_downloaded_without_the_index_check(monkeypatch,
                                                                                                  tmp_path):
    """The name, or --model-id, routes such a repository whatever its model_index.json names (`recognise`)."""
    import huggingface_hub

    patterns = []

    def snapshot(repo_id, revision=None, allow_patterns=None):
        patterns.append(allow_patterns)
        (tmp_path / "model_index.json").write_text(json.dumps({"_class_name": "SomethingElse"}))
        return str(tmp_path)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot)
    assert resolve_checkpoint("me/Kandinsky-6.0-Pro-distill-5s-Diffusers") == tmp_path
    assert resolve_checkpoint("me/k6-copy", model_id="Kandinsky-6.0-Pro-distill-5s-Diffusers") == tmp_path
    assert ["model_index.json"] not in patterns and len(patterns) == 2


def test_a_hub_cache_snapshot_of_an_interrupted_download_is_warned_of(tmp_path, caplog):
    """Served offline as it is, such a snapshot failed on its first missing file ("transformer holds no .safetensors
    weights") with no word of the download."""
    repo = tmp_path / "hub" / "models--kandinskylab--Kandinsky-6.0-Pro-distill-5s-Diffusers"
    snapshot = repo / "snapshots" / "0123abcd"
    (snapshot / "transformer").mkdir(parents=True)
    (repo / "blobs").mkdir()
    (repo / "blobs" / "5d41402abc4b2a76b9719d911017c592.incomplete").write_bytes(b"\0" * 10)
    with caplog.at_level("WARNING", logger="k6serve.models.hub_download"):
        assert resolve_checkpoint(str(snapshot)) == snapshot
        resolve_checkpoint(str(snapshot))  # each check before the load resolves it again: one warning
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and "holds 1 unfinished download(s) (5d41402abc4b2a76b9719d911017c592.incomplete)" \
        in warnings[0] and "run `hf download kandinskylab/Kandinsky-6.0-Pro-distill-5s-Diffusers` again" in warnings[0]
    (repo / "blobs" / "5d41402abc4b2a76b9719d911017c592.incomplete").unlink()
    caplog.clear()
    other = repo / "snapshots" / "4567"
    other.mkdir()
    resolve_checkpoint(str(other))  # a finished download: nothing to say
    assert not caplog.records
    local = tmp_path / "k6-local"  # `hf download ID --local-dir k6-local`, interrupted
    (local / ".cache" / "huggingface" / "download" / "transformer").mkdir(parents=True)
    (local / ".cache" / "huggingface" / "download" / "transformer" / "Xb1.5d41402a.incomplete").write_bytes(b"\0")
    with caplog.at_level("WARNING", logger="k6serve.models.hub_download"):
        resolve_checkpoint(str(local))
    assert len(caplog.records) == 1 and "is an `hf download --local-dir` folder" in caplog.records[0].getMessage() \
        and f"run `hf download ID --local-dir {local}` again" in caplog.records[0].getMessage()
    with pytest.raises(CheckpointError, match=r"transformer holds no \.safetensors weights \(neither "
                                              r"diffusion_pytorch_model\.safetensors nor a shard index naming its "
                                              r"shards\): the copy or download is incomplete; copy or download"):
        safetensors_files(snapshot / "transformer")


def test_a_folder_beside_the_checkpoint_names_the_checkpoint_folder(tmp_path):
    """Its transformer/ subfolder, the folder holding checkpoints, or a hub cache's repository folder: each was told
    only that it is no Diffusers checkpoint, with an example hub id, not the folder to pass."""
    from k6serve.models.checkpoint_files import read_model_index
    from k6serve.models.variants import variant_from_folder

    checkpoint = tmp_path / "models" / "k6-distill"
    _checkpoint_with_weights(checkpoint)
    with pytest.raises(ValueError, match=rf"It is the 'transformer' component of the checkpoint "
                                         rf"{re.escape(str(checkpoint))}: pass that folder"):
        variant_from_folder(checkpoint / "transformer")
    with pytest.raises(ValueError, match=rf"It holds the checkpoint folder\(s\) k6-distill: pass one of them, e\.g\. "
                                         rf"{re.escape(str(checkpoint))}\.$"):
        variant_from_folder(checkpoint.parent)
    repo = tmp_path / "hub" / "models--kandinskylab--Kandinsky-6.0-Pro-distill-5s-Diffusers"
    (repo / "snapshots").mkdir(parents=True)
    with pytest.raises(CheckpointError, match=r"without a complete snapshot: run `hf download "
                                              r"kandinskylab/Kandinsky-6\.0-Pro-distill-5s-Diffusers`\.$"):
        read_model_index(repo)
    _checkpoint_with_weights(repo / "snapshots" / "abc123")
    with pytest.raises(CheckpointError, match=r"It is a Hugging Face cache folder: pass the hub id kandinskylab/"
                                              r"Kandinsky-6\.0-Pro-distill-5s-Diffusers \(with HF_HUB_CACHE set to "
                                              rf"{re.escape(str(tmp_path / 'hub'))} .*, or its snapshot folder "
                                              rf"{re.escape(str(repo / 'snapshots' / 'abc123'))}\.$"):
        read_model_index(repo)


def test_not_a_folder_nor_hub_id():
    with pytest.raises(CheckpointError, match="neither an existing folder nor a hub id"):
        resolve_checkpoint("/definitely/not/here")


def test_missing_components_are_named(tmp_path):
    (tmp_path / "transformer").mkdir()
    with pytest.raises(CheckpointError, match=r"lacks component\(s\) \['vae'\]"):
        require_components(tmp_path, {"transformer": [], "vae": []}, ["transformer", "vae"])


def test_sharded_safetensors_with_index(tmp_path):
    save_file({"a": torch.ones(2)}, str(tmp_path / "model-00001-of-00002.safetensors"))
    save_file({"b": torch.zeros(3)}, str(tmp_path / "model-00002-of-00002.safetensors"))
    (tmp_path / "diffusion_pytorch_model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}))
    state = load_state_dict(tmp_path)
    assert sorted(state) == ["a", "b"] and state["b"].shape == (3,)
    (tmp_path / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"missing shard\(s\) \['model-00002-of-00002\.safetensors'\] "
                                              r"named in diffusion_pytorch_model\.safetensors\.index\.json: the copy "
                                              r"or download is incomplete; copy or download the checkpoint again\.$"):
        load_state_dict(tmp_path)


def _weights(path, **tensors):
    save_file({name: torch.full((2,), value) for name, value in tensors.items()}, str(path))


def test_the_weights_are_diffusers_file_not_every_safetensors_in_the_folder(tmp_path):
    """Every *.safetensors was read and merged, the last in name order winning: the fp16 variant beside the weights
    was read too (Pro: 56 GiB more I/O), a stray copy could replace them."""
    _weights(tmp_path / "diffusion_pytorch_model.safetensors", w=1.0)
    _weights(tmp_path / "diffusion_pytorch_model.fp16.safetensors", w=2.0)
    _weights(tmp_path / "zz (1).safetensors", w=3.0)
    assert load_state_dict(tmp_path)["w"].tolist() == [1.0, 1.0]
    assert safetensors_files(tmp_path) == [tmp_path / "diffusion_pytorch_model.safetensors"]


def test_a_folder_with_only_a_variants_weights_is_refused_as_diffusers_refuses_it(tmp_path):
    _weights(tmp_path / "diffusion_pytorch_model.fp16.safetensors", w=2.0)
    with pytest.raises(CheckpointError, match=r"holds only variant weights \['diffusion_pytorch_model.fp16.safetensors'"
                                              r"\], not diffusion_pytorch_model.safetensors.*without a variant"):
        safetensors_files(tmp_path)


def test_one_weight_file_of_another_name_loads_and_several_are_refused(tmp_path):
    _weights(tmp_path / "transformer_v1.0.safetensors", w=1.0)  # dotted, but no diffusers variant
    assert safetensors_files(tmp_path) == [tmp_path / "transformer_v1.0.safetensors"]
    (tmp_path / "transformer_v1.0.safetensors").rename(tmp_path / "model.safetensors")
    assert safetensors_files(tmp_path) == [tmp_path / "model.safetensors"]
    _weights(tmp_path / "model (1).safetensors", w=3.0)
    with pytest.raises(CheckpointError, match=r"holds 2 weight files .* no diffusion_pytorch_model.safetensors: keep"):
        safetensors_files(tmp_path)


def test_shards_without_their_index_are_refused_naming_the_index(tmp_path):
    _weights(tmp_path / "diffusion_pytorch_model-00001-of-00002.safetensors", a=1.0)
    _weights(tmp_path / "diffusion_pytorch_model-00002-of-00002.safetensors", b=1.0)
    with pytest.raises(CheckpointError, match=r"holds 2 weight files .* no shard index"):
        safetensors_files(tmp_path)


def test_the_standard_index_wins_over_another(tmp_path):
    _weights(tmp_path / "a.safetensors", a=1.0)
    _weights(tmp_path / "b.safetensors", a=2.0)
    (tmp_path / "diffusion_pytorch_model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"a": "a.safetensors"}}))
    (tmp_path / "other.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": "b.safetensors"}}))
    assert load_state_dict(tmp_path)["a"].tolist() == [1.0, 1.0]
    (tmp_path / "diffusion_pytorch_model.safetensors.index.json").rename(tmp_path / "third.safetensors.index.json")
    with pytest.raises(CheckpointError, match="several shard indexes"):
        safetensors_files(tmp_path)


def test_pickled_weights_are_refused_saying_how_to_convert(tmp_path):
    torch.save({"w": torch.ones(2)}, tmp_path / "diffusion_pytorch_model.bin")
    with pytest.raises(CheckpointError, match=r"only \['diffusion_pytorch_model.bin'\]: k6serve reads weights from "
                                              r"safetensors files only.*save_pretrained"):
        safetensors_files(tmp_path)


def test_an_integer_tensor_for_a_float_parameter_is_named():
    """It failed inside load_state_dict ("Only Tensors of floating point ... can require gradients"), reported as
    an internal error of k6serve."""
    expected = {"w": torch.Size([2]), "steps": torch.Size([2])}
    state = {"w": torch.zeros(2, dtype=torch.int32), "steps": torch.zeros(2, dtype=torch.int64)}
    with pytest.raises(CheckpointError, match=r"not floating point: w: int32\)"):
        check_state_dict(expected, state, "transformer", floating=["w"])
    check_state_dict(expected, {"w": torch.zeros(2), "steps": state["steps"]}, "transformer", floating=["w"])


def test_a_mistyped_local_path_read_as_a_hub_id_says_what_the_folder_holds(tmp_path, monkeypatch):
    """"ckpt/distil" (for ckpt/distill) is a valid hub id, so it was only "cannot fetch ckpt/distil: the Hub is
    unreachable"; the local folder it nearly names went unmentioned."""
    from k6serve.models import hub_download

    def unreachable(repo_id, revision, model_id):
        raise CheckpointError(f"Cannot fetch {repo_id}: the Hub is unreachable.")

    monkeypatch.setattr(hub_download, "download", unreachable)
    (tmp_path / "ckpt" / "distill").mkdir(parents=True)
    (tmp_path / "ckpt" / "lite").mkdir()
    monkeypatch.chdir(tmp_path)
    with pytest.raises(CheckpointError, match=r"Cannot fetch ckpt/distil: the Hub is unreachable\. If 'ckpt/distil' "
                                              r"is meant as a local folder: there is none, though 'ckpt' exists and "
                                              r"holds the folders distill, lite\.$"):
        resolve_checkpoint("ckpt/distil")
    with pytest.raises(CheckpointError, match=r"unreachable\.$"):  # an org name that is no local folder: as before
        resolve_checkpoint("kandinskylab/Kandinsky-6.0-Pro-distill-5s-Diffusers")


def test_state_dict_mismatch_names_parameters():
    expected = {"w": torch.Size([2, 2]), "b": torch.Size([2])}
    with pytest.raises(CheckpointError, match=r"missing: b.*unexpected: extra.*shape mismatch: w: file \(3, 2\)"):
        check_state_dict(expected, {"w": torch.zeros(3, 2), "extra": torch.zeros(1)}, "transformer")


def test_config_validation_messages():
    with pytest.raises(ValueError, match="--load-format must be one of"):
        ModelConfig(model_path="x", load_format="fast")
    with pytest.raises(ValueError, match="world size must equal dp x cfg x tp x ulysses x ring.*"
                                         "keep 2 GPU\\(s\\) with --ulysses-degree 2"):
        ParallelConfig(num_gpus=2)
    # A parallel flag without --num-gpus: the fix is the GPU count (it said "For 1 GPUs try --ulysses-degree 1").
    with pytest.raises(ValueError, match="Pass --num-gpus 2 for this layout, or drop the parallel flags"):
        ParallelConfig(enable_cfg_parallel=True)
    with pytest.raises(ValueError, match="Pass --num-gpus 3 for this layout\\.$"):
        ParallelConfig(num_gpus=4, tp_size=3)


def _checkpoint_with_weights(folder):
    (folder / "transformer").mkdir(parents=True)
    (folder / "model_index.json").write_text(json.dumps({"_class_name": "Kandinsky6TI2VAPipeline"}))
    path = folder / "transformer" / "diffusion_pytorch_model.safetensors"
    save_file({"w": torch.arange(64, dtype=torch.float32)}, str(path))
    return path


def test_a_truncated_weight_file_is_named_before_anything_loads(tmp_path):
    path = _checkpoint_with_weights(tmp_path / "ok")
    assert resolve_checkpoint(str(tmp_path / "ok")) == (tmp_path / "ok").resolve()
    data = path.read_bytes()
    for cut, says in ((len(data) - 4, "its tensors need"), (1000 if len(data) > 1000 else 20, "header claims"),
                      (5, "shorter than a header")):
        path.write_bytes(data[:cut])
        with pytest.raises(CheckpointError, match="interrupted download; copy or download it again") as error:
            resolve_checkpoint(str(tmp_path / "ok"))
        assert str(path) in str(error.value) and says in str(error.value)
    # The loader's own read says the same kind of thing where a file is damaged in a way the header check misses.
    path.write_bytes(data[:8] + b"{" * (len(data) - 8))
    with pytest.raises(CheckpointError, match="header is not valid JSON"):
        resolve_checkpoint(str(tmp_path / "ok"))
    with pytest.raises(CheckpointError, match="cannot be read .*download the checkpoint again"):
        load_state_dict(path.parent)


def test_a_damaged_weight_file_the_load_does_not_read_is_no_refusal(tmp_path):
    """A cut-short variant or stray copy beside the weights was refused as damaged ("download it again"), though
    the load reads only the weights; where the load cannot choose, every file is still checked."""
    path = _checkpoint_with_weights(tmp_path)
    for stray in ("diffusion_pytorch_model.fp16.safetensors", "diffusion_pytorch_model (1).safetensors"):
        (path.parent / stray).write_bytes(path.read_bytes()[:100])
    assert resolve_checkpoint(str(tmp_path)) == tmp_path.resolve()
    path.unlink()  # the stray copy is now the folder's one weight file, which the load reads: checked
    with pytest.raises(CheckpointError, match=r"diffusion_pytorch_model \(1\)\.safetensors is damaged"):
        resolve_checkpoint(str(tmp_path))
    (path.parent / "diffusion_pytorch_model (1).safetensors").unlink()
    # transformers reads model.safetensors before a shard index (the order safetensors_files takes is diffusers'):
    # a cut-short one is checked beside an index whatever that index names.
    encoder = tmp_path / "text_encoder"
    encoder.mkdir()
    save_file({"w": torch.ones(2)}, str(encoder / "model-00001-of-00001.safetensors"))
    (encoder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
        "w": "model-00001-of-00001.safetensors"}}))
    (encoder / "model.safetensors").write_bytes(b"\0" * 4)
    with pytest.raises(CheckpointError, match=r"text_encoder/model\.safetensors is damaged"):
        resolve_checkpoint(str(tmp_path))


def test_the_file_check_reads_only_where_the_loaders_read(tmp_path):
    """It walked the whole tree (`--model-path ~` read every JSON file of the home folder before saying it holds no
    model_index.json), opened a FIFO named *.safetensors (blocked forever) and read any header length a file
    claimed (a stray 3 GB file: 4.2 GB of memory)."""
    import os

    folder = tmp_path / "ckpt"
    path = _checkpoint_with_weights(folder)
    (folder / "notes" / "deep").mkdir(parents=True)
    (folder / "notes" / "deep" / "draft.json").write_text("{not json")  # not a component's: never read
    os.mkfifo(folder / "transformer" / "pipe.safetensors")
    assert resolve_checkpoint(str(folder)) == folder.resolve()
    (folder / "transformer" / "pipe.safetensors").unlink()
    with open(path, "r+b") as file:  # a header claiming 200 MB in a file that long
        file.write((200_000_000).to_bytes(8, "little"))
        file.truncate(200_000_100)
    with pytest.raises(CheckpointError, match=r"its header claims 200000000 bytes, more than safetensors reads "
                                              r"\(100000000\)"):
        resolve_checkpoint(str(folder))


def test_a_broken_json_file_is_named_with_the_fix(tmp_path):
    from k6serve.models.variants import variant_from_folder

    _checkpoint_with_weights(tmp_path)
    (tmp_path / "model_index.json").write_text("{bad json")
    with pytest.raises(CheckpointError, match=r"model_index.json is not valid JSON .*download the checkpoint again"):
        variant_from_folder(tmp_path)
    (tmp_path / "model_index.json").write_text("[1, 2]")
    with pytest.raises(CheckpointError, match="should hold a JSON object, not list"):
        variant_from_folder(tmp_path)


def test_a_truncated_config_is_named_when_the_checkpoint_is_resolved(tmp_path):
    # A config cut short by an interrupted copy: only the loader that read it failed, later, and for configs read by
    # diffusers / transformers (or k6serve's own transformer and SR readers) without naming the file.
    _checkpoint_with_weights(tmp_path)
    config = tmp_path / "text_encoder" / "config.json"
    config.parent.mkdir()
    config.write_text('{"hidden_size": 3584, "num_hidden')
    with pytest.raises(CheckpointError, match=r"text_encoder/config\.json is damaged \(not valid JSON: .*\), e\.g\. "
                                              r"by an interrupted download; copy or download it again"):
        resolve_checkpoint(str(tmp_path))
    # A weight file whose cache blob was deleted: stat() raised FileNotFoundError, a "system error" (exit 1).
    config.write_text("{}")
    weights = tmp_path / "text_encoder" / "model.safetensors"
    weights.symlink_to(tmp_path / "blobs" / "gone")
    with pytest.raises(CheckpointError, match=r"model\.safetensors is damaged \(a link to a file that is gone"):
        resolve_checkpoint(str(tmp_path))


def test_a_hub_checkpoints_fix_is_the_forced_download_of_its_revision(tmp_path, monkeypatch):
    from k6serve.models import hub_download

    path = _checkpoint_with_weights(tmp_path)
    path.write_bytes(path.read_bytes()[:-4])
    monkeypatch.setattr(hub_download, "download", lambda repo_id, revision, model_id: tmp_path)
    with pytest.raises(CheckpointError, match="hf download org/repo --revision v2 --force-download"):
        resolve_checkpoint("org/repo", "v2")


def test_every_reader_of_a_checkpoints_json_names_the_file(tmp_path):
    from k6serve.models.kandinsky6.checkpoint import load_transformer
    from k6serve.models.kandinsky6_sr.checks import read_tensor_shapes
    from k6serve.models.kandinsky6_sr.config import SRTransformerConfig

    (tmp_path / "config.json").write_text("{bad")
    with pytest.raises(CheckpointError, match=r"config\.json is not valid JSON"):
        load_transformer(tmp_path, device=torch.device("cpu"), dtype=torch.float32)
    with pytest.raises(CheckpointError, match=r"config\.json is not valid JSON .*download the checkpoint again"):
        SRTransformerConfig.from_json_file(tmp_path / "config.json")
    # A shard index without its weight_map was a KeyError: an internal error (exit 70).
    index = tmp_path / "diffusion_pytorch_model.safetensors.index.json"
    index.write_text('{"metadata": {}}')
    with pytest.raises(CheckpointError, match="has no weight_map object naming the shards"):
        load_state_dict(tmp_path)
    with pytest.raises(CheckpointError, match="has no weight_map object naming the shards"):
        read_tensor_shapes(tmp_path, ["w"])


def test_the_sr_head_check_reads_the_files_the_load_reads(tmp_path):
    """It opened diffusion_pytorch_model.safetensors by name: a transformer/ the load takes (one file of another
    name) failed there with a bare FileNotFoundError, an internal error."""
    from k6serve.models.kandinsky6_sr.checks import read_tensor_shapes

    save_file({"w": torch.zeros(3, 2), "b": torch.zeros(3)}, str(tmp_path / "model.safetensors"))
    assert read_tensor_shapes(tmp_path, ["w", "b"]) == {"w": (3, 2), "b": (3,)}
    with pytest.raises(CheckpointError, match=r"weights hold no tensor \['x'\]; copy or download"):
        read_tensor_shapes(tmp_path, ["w", "x"])


def _load_copy(tiny_dir, tmp_path, damage):
    """load_generation_models on a copy of the tiny distilled checkpoint after `damage(folder)`."""
    import shutil

    from k6serve.models.kandinsky6.checkpoint import load_generation_models
    from k6serve.models.variants import VARIANTS

    folder = tmp_path / "ckpt"
    shutil.copytree(tiny_dir, folder)
    damage(folder)
    return load_generation_models(folder, VARIANTS["pro-distill"], device=torch.device("cpu"), dtype=torch.float32,
                                  load_format="auto")


@pytest.mark.parametrize("component, held", [("tokenizer", "['chat_template.jinja', 'processor_config.json', "
                                                           "'tokenizer_config.json']"),
                                             ("tokenizer_2", "['tokenizer_config.json']")])
def test_a_tokenizer_without_its_vocabulary_is_refused(tiny_distill_dir, tmp_path, component, held):
    """transformers builds a tokenizer from tokenizer_config.json alone, with no error: 8 special tokens for Qwen,
    which encoded every prompt as nothing, 2 for CLIP (every word unknown), so each video had no prompt."""
    with pytest.raises(CheckpointError, match=rf"The tokenizer in .*{component} has no vocabulary: it needs "
                                              rf"tokenizer.json \(or vocab.json and merges.txt\) and holds "
                                              rf"{re.escape(held)}.*download the checkpoint again"):
        _load_copy(tiny_distill_dir, tmp_path, lambda folder: (folder / component / "tokenizer.json").unlink())


def test_a_checkpoints_own_python_code_is_never_run(tiny_distill_dir, tmp_path, monkeypatch):
    """A tokenizer_config.json (or a text encoder's config.json) whose `auto_map` names code in the folder made
    transformers ask on the terminal whether to run it, and ran it on "y"."""
    ran = tmp_path / "ran"
    code = f"import pathlib\npathlib.Path({str(ran)!r}).touch()\nfrom transformers import CLIPTokenizer\n" \
           "class EvilTokenizer(CLIPTokenizer):\n    pass\n"
    monkeypatch.setattr("builtins.input", lambda *args: "y")  # the answer a user might give

    def own_tokenizer_code(folder):
        path = folder / "tokenizer_2" / "tokenizer_config.json"
        config = json.loads(path.read_text())
        config.update(auto_map={"AutoTokenizer": ["evil.EvilTokenizer", None]}, tokenizer_class="EvilTokenizer")
        path.write_text(json.dumps(config))
        (folder / "tokenizer_2" / "evil.py").write_text(code)

    with pytest.raises(CheckpointError, match=r"The tokenizer in .*tokenizer_2 needs its own Python code \('auto_map' "
                                              r"in tokenizer_config.json.*k6serve runs no code from a checkpoint"):
        _load_copy(tiny_distill_dir, tmp_path, own_tokenizer_code)
    assert not ran.exists()

    from k6serve.parallel.preflight import _text_encoder_configs

    folder = tmp_path / "ckpt"
    path = folder / "text_encoder" / "config.json"
    config = json.loads(path.read_text())
    config.update(auto_map={"AutoConfig": "evil.EvilConfig"}, model_type="evil")
    path.write_text(json.dumps(config))
    (folder / "text_encoder" / "evil.py").write_text(code.replace("EvilTokenizer(CLIPTokenizer)", "EvilConfig"))
    assert [type(config).__name__ for _, config in _text_encoder_configs(folder)] == ["Qwen2_5_VLConfig",
                                                                                    "CLIPTextConfig"]
    assert not ran.exists()


def _edit_config(folder, component, name="config.json", **values):
    path = folder / component / name
    path.write_text(json.dumps({**json.loads(path.read_text()), **values}))


@pytest.mark.parametrize(("component", "values", "message"), [
    # Built block by block on the meta device before the weights were compared: gigabytes for minutes.
    ("transformer", {"num_visual_blocks": 1_000_000}, r"transformer/config\.json says num_visual_blocks 1000000, but "
                                                      r"the weights hold 2 visual_transformer_blocks"),
    ("transformer", {"ff_dim": -128}, r"transformer/config\.json: transformer config key 'ff_dim': must be > 0, got "
                                      r"-128; copy or download"),
    ("transformer", {"num_visual_blocks": "2"}, r"transformer/config\.json: transformer config key "
                                                r"'num_visual_blocks': expected an integer, got '2'"),
    # Internal errors before ("a bug in k6serve"), or advice to pass flags k6serve does not have.
    ("vae", {"block_out_channels": [8, 8, 8, 16]}, r"vae's weights in .*vae do not fit its config\.json \(.* expected "
                                                   r"shape .*\)\. The config and weights come from different"),
    ("text_encoder_2", {"intermediate_size": 100}, r"text_encoder_2's weights in .*text_encoder_2 do not fit its "
                                                   r"config\.json \(a weight's shape differs"),
])
def test_a_config_that_does_not_fit_its_weights_is_named_before_it_costs_memory(tiny_distill_dir, tmp_path, component,
                                                                                values, message):
    with pytest.raises(CheckpointError, match=message):
        _load_copy(tiny_distill_dir, tmp_path, lambda folder: _edit_config(folder, component, **values))


def test_a_dit_config_of_another_size_is_refused_from_the_weights_headers_before_they_are_read(tiny_distill_dir,
                                                                                                tmp_path, monkeypatch):
    """Lite's config beside Pro's weights was found out only after every weight was read and copied: minutes, and
    twice the weights' size in host memory, for Pro."""
    from k6serve.models import checkpoint_files
    from k6serve.models.kandinsky6 import checkpoint

    def refuse(*args, **kwargs):
        raise AssertionError("the weights were read")

    monkeypatch.setattr(checkpoint, "load_state_dict", refuse)
    with pytest.raises(CheckpointError, match=r"transformer \(.*\) weights do not match its config\.json \(shape "
                                              r"mismatch: .*: file \(64,\) vs config \(96,\)"):
        _load_copy(tiny_distill_dir, tmp_path, lambda folder: _edit_config(folder, "transformer", model_dim=96))
    held = checkpoint_files.header_state_dict(tiny_distill_dir / "transformer")
    read = checkpoint_files.load_state_dict(tiny_distill_dir / "transformer")
    assert {k: (t.shape, t.dtype) for k, t in held.items()} == {k: (t.shape, t.dtype) for k, t in read.items()}


def _edit_index(folder, **values):
    path = folder / "model_index.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **values}))


@pytest.mark.parametrize(("damage", "message"), [
    # `index["scheduler"][1]` of these: the class "i", an IndexError ("a bug in k6serve").
    (lambda folder: _edit_index(folder, scheduler="PiflowScheduler"),
     r"model_index\.json: 'scheduler' must be a \[library, class\] pair such as \[\"diffusers\", "
     r"\"PiflowScheduler\"\], got \"PiflowScheduler\""),
    (lambda folder: _edit_index(folder, scheduler=["diffusers"]), r"'scheduler' must be a \[library, class\] pair"),
    # Loaded, then every request failed "Unsupported scheduler".
    (lambda folder: _edit_index(folder, scheduler=["diffusers", "DDIMScheduler"]),
     r"model_index\.json names the scheduler 'DDIMScheduler'; Kandinsky 6 generation runs "
     r"FlowMatchEulerDiscreteScheduler or PiflowScheduler"),
    (lambda folder: _edit_config(folder, "scheduler", n_grid=None, name="scheduler_config.json"),
     r"scheduler_config\.json: n_grid must be a whole number > 0, got null"),
    # PiFlow's host-side loop ran each of them per DiT call: a request held for hours, nothing failing.
    (lambda folder: _edit_config(folder, "scheduler", num_policy_substeps=10**7, name="scheduler_config.json"),
     r"scheduler_config\.json: num_policy_substeps must be from 1 to 4096, got 10000000; copy or download"),
])
def test_a_damaged_scheduler_entry_is_named_with_its_file(tiny_distill_dir, tmp_path, damage, message):
    with pytest.raises(CheckpointError, match=message):
        _load_copy(tiny_distill_dir, tmp_path, damage)


def test_a_config_asking_for_more_than_the_host_has_is_told_as_the_configs(tmp_path, monkeypatch):
    from k6serve.models.kandinsky6 import checkpoint

    monkeypatch.setattr(checkpoint, "_host_memory_bytes", lambda: 64 * 2**30)
    with pytest.raises(CheckpointError, match=r"vae/config\.json asks for a tensor of 805 GiB, more than this host's "
                                              r"memory: the config is damaged or edited"):
        with checkpoint._component_load_errors(tmp_path, "vae"):
            raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 864000000000 bytes.")
    with pytest.raises(RuntimeError, match="tried to allocate 8000000000 bytes"):  # the host's size: a real shortage
        with checkpoint._component_load_errors(tmp_path, "vae"):
            raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 8000000000 bytes.")


def test_a_tokenizer_whose_vocabulary_encodes_nothing_is_refused(tiny_distill_dir, tmp_path):
    def empty_vocabulary(folder):
        path = folder / "tokenizer_2" / "tokenizer.json"
        data = json.loads(path.read_text())
        data["model"]["vocab"] = {token: i for token, i in data["model"]["vocab"].items() if token.startswith("<|")}
        data["model"]["merges"] = []
        path.write_text(json.dumps(data))

    with pytest.raises(CheckpointError, match=r"The tokenizer in .*tokenizer_2 \(\d+ tokens\) encodes 'A cat plays "
                                              r"the piano' as \[.*\]: its vocabulary files are damaged"):
        _load_copy(tiny_distill_dir, tmp_path, empty_vocabulary)


@pytest.mark.parametrize("component, remove", [("text_encoder", "model.safetensors"),
                                               ("vae", "diffusion_pytorch_model.safetensors")])
def test_a_component_loaded_by_transformers_or_diffusers_names_its_missing_files(tiny_distill_dir, tmp_path,
                                                                                  component, remove):
    """Their OSError ("Error no file named ...", or "We couldn't connect to 'https://huggingface.co'" for a local
    folder) was reported as an internal error of k6serve."""
    with pytest.raises(CheckpointError, match=rf"Cannot load {component} from .*{component} \(it holds "
                                              r"\['config.json'.*\]\): .*copy or download the checkpoint again"):
        _load_copy(tiny_distill_dir, tmp_path, lambda folder: (folder / component / remove).unlink())


@pytest.mark.parametrize("component, config", [("text_encoder", "config.json"), ("text_encoder_2", "config.json"),
                                               ("tokenizer", "tokenizer_config.json"), ("vocoder", "config.json")])
def test_a_component_without_its_config_is_refused_before_any_weight_loads(tiny_distill_dir, tmp_path, monkeypatch,
                                                                           component, config):
    """transformers built a text encoder without its config.json from Qwen2.5-VL's default config (8192 wide) and
    filled the host's memory until the kernel killed the rank; a tokenizer without tokenizer_config.json loaded with
    no padding token and failed every request ("Asking to pad but the tokenizer does not have a padding token")."""
    from k6serve.models.kandinsky6 import checkpoint

    def refuse(*args, **kwargs):
        raise AssertionError("a weight was loaded")

    monkeypatch.setattr(checkpoint, "load_transformer", refuse)
    with pytest.raises(CheckpointError, match=rf"ckpt is missing {component}/{config}: the copy or download is "
                                              r"incomplete; copy or download the checkpoint again\.$"):
        _load_copy(tiny_distill_dir, tmp_path, lambda folder: (folder / component / config).unlink())


def test_pickled_weights_of_a_component_diffusers_loads_are_refused_too(tiny_distill_dir, tmp_path):
    """diffusers loads a VAE saved as .bin ("Defaulting to unsafe serialization"): refused as the DiT's are."""
    def pickled(folder):
        from safetensors.torch import load_file

        weights = folder / "vae" / "diffusion_pytorch_model.safetensors"
        torch.save(load_file(str(weights)), folder / "vae" / "diffusion_pytorch_model.bin")
        weights.unlink()

    with pytest.raises(CheckpointError, match=r"Cannot load vae from .*'diffusion_pytorch_model.bin'.*pickled .bin "
                                              r"weights \(k6serve reads safetensors only"):
        _load_copy(tiny_distill_dir, tmp_path, pickled)


def test_listed_audio_components_must_be_there_and_unlisted_ones_are_warned_of(tiny_distill_dir, tmp_path, caplog):
    import shutil

    with pytest.raises(CheckpointError, match=r"lacks component\(s\) \['audio_vae'\].*Re-download"):
        _load_copy(tiny_distill_dir, tmp_path / "a", lambda folder: shutil.rmtree(folder / "audio_vae"))

    def unlist(folder):
        index = json.loads((folder / "model_index.json").read_text())
        del index["audio_vae"], index["vocoder"]
        (folder / "model_index.json").write_text(json.dumps(index))

    with caplog.at_level("WARNING", logger="k6serve.models.kandinsky6.checkpoint"):
        models = _load_copy(tiny_distill_dir, tmp_path / "b", unlist)
    assert not models.has_audio
    assert "lists no audio_vae or vocoder, so the videos will have no audio track" in caplog.text


@pytest.mark.parametrize("component", ["transformer", "vae", "latent_upscaler"])
def test_a_super_resolution_component_without_its_config_is_named(tiny_sr_dir, tmp_path, component):
    """Its FileNotFoundError reached the user as an internal error, "a bug in k6serve"."""
    import shutil

    from k6serve.models.kandinsky6_sr.checkpoint import load_sr_models
    from k6serve.models.variants import VARIANTS

    folder = tmp_path / "sr"
    shutil.copytree(tiny_sr_dir, folder)
    (folder / component / "config.json").unlink()
    with pytest.raises(CheckpointError, match=rf"sr/{component}/config\.json is missing: the copy or download is "
                                              r"incomplete; copy or download the checkpoint again\.$"):
        load_sr_models(folder, VARIANTS["vsr-distilled2steps"], device=torch.device("cpu"), dtype=torch.float32,
                       load_format="auto")
    (folder / component / "config.json").mkdir()
    with pytest.raises(CheckpointError, match=rf"sr/{component}/config\.json cannot be read \("):
        load_sr_models(folder, VARIANTS["vsr-distilled2steps"], device=torch.device("cpu"), dtype=torch.float32,
                       load_format="auto")


def test_a_super_resolution_config_with_more_blocks_than_its_weights_is_refused_before_the_build(tiny_sr_dir,
                                                                                                 tmp_path):
    import shutil

    from k6serve.models.kandinsky6_sr.checkpoint import load_sr_models
    from k6serve.models.variants import VARIANTS

    folder = tmp_path / "sr"
    shutil.copytree(tiny_sr_dir, folder)
    _edit_config(folder, "transformer", num_visual_blocks=1_000_000)
    with pytest.raises(CheckpointError, match=r"says num_visual_blocks 1000000, but the weights hold \d+ "
                                              r"visual_transformer_blocks"):
        load_sr_models(folder, VARIANTS["vsr-distilled2steps"], device=torch.device("cpu"), dtype=torch.float32,
                       load_format="auto")


@pytest.mark.parametrize(("file", "values", "message"), [
    # int() read 2.7 blocks as 2 and "3" as 3; a policy loop of millions of substeps ran per DiT call.
    ("transformer/config.json", {"num_visual_blocks": 2.7},
     r"transformer/config\.json: num_visual_blocks must be a whole number, got 2\.7"),
    ("transformer/config.json", {"ff_dim": "64"}, r"ff_dim must be a whole number, got \"64\""),
    ("transformer/config.json", {"model_dim": 0}, r"model_dim must be >= 1, got 0"),
    ("scheduler/scheduler_config.json", {"num_policy_substeps": 10**6},
     r"scheduler/scheduler_config\.json: num_policy_substeps must be from 1 to 4096, got 1000000"),
    ("scheduler/scheduler_config.json", {"nfe": True}, r"nfe must be a whole number, got true"),
    ("scheduler/scheduler_config.json", {"n_grid": 10.0}, None),  # a whole number written as a float is one
])
def test_an_sr_config_count_that_is_no_count_is_named_with_its_file(tiny_sr_dir, file, values, message):
    from k6serve.models.kandinsky6_sr.config import SRSchedulerConfig, SRTransformerConfig

    raw = {**json.loads((tiny_sr_dir / file).read_text()), **values}
    build = SRTransformerConfig.from_dict if file.startswith("transformer") else SRSchedulerConfig.from_dict
    if message is None:
        assert build(raw).n_grid == 10
        return
    with pytest.raises(ValueError, match=message):
        build(raw)


def test_a_path_that_nearly_names_a_folder_or_the_demo_says_which(tmp_path, monkeypatch):
    """`--model-path "ckpt "` (a pasted path) and `Demo` were told only that they name no folder nor hub id."""
    (tmp_path / "ckpt").mkdir()
    monkeypatch.chdir(tmp_path)
    with pytest.raises(CheckpointError, match=r"Without its surrounding spaces it names 'ckpt', which exists: pass "
                                              r"that\.$"):
        resolve_checkpoint("ckpt ")
    with pytest.raises(CheckpointError, match=r"The built-in checkpoint is 'demo-sr', in lower case\.$"):
        resolve_checkpoint("Demo-SR")
    with pytest.raises(CheckpointError, match=r"hub id like 'kandinskylab/Kandinsky-6\.0-Pro-distill-5s-Diffusers'\.$"):
        resolve_checkpoint("elsewhere ")
    with pytest.raises(CheckpointError, match=r"hub id like 'kandinskylab/Kandinsky-6\.0-Pro-distill-5s-Diffusers'\.$"):
        resolve_checkpoint("  ")  # told to pass '', which names the working folder


@pytest.mark.parametrize(("model_path", "hint"), [
    ("https://huggingface.co/kandinskylab/Kandinsky-6.0-Lite-5s-Diffusers/tree/main",
     "It is a Hub address; pass the hub id alone: --model-path 'kandinskylab/Kandinsky-6.0-Lite-5s-Diffusers'."),
    ("hf://org/name", "It is a Hub address; pass the hub id alone: --model-path 'org/name'."),
    ("https://huggingface.co/spaces/org/app", "It is the address of a Hub space, not of a model repository."),
    ("hf://datasets/org/data", "It is the address of a Hub dataset, not of a model repository."),
    ("org/name/", "Without the trailing slash it is the hub id 'org/name'."),
    (" org/name", "Without its surrounding spaces it is the hub id 'org/name'."),
    ("org/name/ ", "Without its surrounding spaces and the trailing slash it is the hub id 'org/name'."),
    ("org/name@v2", "Pass the revision apart: --model-path 'org/name' --revision 'v2'."),
    ("Kandinsky-6.0-Pro-distill-5s-Diffusers",
     "A hub id names its organisation too: the release's is 'kandinskylab/Kandinsky-6.0-Pro-distill-5s-Diffusers'."),
])
def test_a_hub_id_written_another_way_is_told_its_id(model_path, hint, tmp_path, monkeypatch):
    """A pasted Hub URL, a trailing slash, an @revision or a release's bare name were told only that they are no
    folder nor hub id."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(CheckpointError, match=re.escape(f"'kandinskylab/Kandinsky-6.0-Pro-distill-5s-Diffusers'. "
                                                        f"{hint}") + "$"):
        resolve_checkpoint(model_path)


def test_a_mistyped_local_folder_with_a_trailing_slash_is_told_what_its_parent_holds(tmp_path, monkeypatch):
    (tmp_path / "ckpt" / "distill").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(CheckpointError, match=r"If 'ckpt/distil' is meant as a local folder: there is none, though "
                                              r"'ckpt' exists and holds the folders distill\.$"):
        resolve_checkpoint("ckpt/distil/")


def test_a_prompt_rewrite_without_the_tokenizers_chat_template_names_the_file(tiny_distill_dir, tmp_path):
    """Each expand_prompts request failed with transformers' "Cannot use chat template functions because
    tokenizer.chat_template is not set", naming no file and pointing at its docs on writing templates."""
    import shutil

    from k6serve.models.kandinsky6.checkpoint import _load_tokenizer
    from k6serve.pipelines.expand_prompt import expansion_inputs
    from k6serve.request import FlagWorded

    shutil.copytree(tiny_distill_dir / "tokenizer", tmp_path / "tokenizer")
    (tmp_path / "tokenizer" / "chat_template.jinja").unlink()
    with pytest.raises(FlagWorded, match=r"^expand_prompts needs the checkpoint's Qwen2\.5-VL chat template "
                                         r"\(tokenizer/chat_template\.jinja") as refused:
        expansion_inputs("a fox", tokenizer=_load_tokenizer(tmp_path / "tokenizer"))
    assert refused.value.flag_wording.startswith("--expand-prompts needs the checkpoint's Qwen2.5-VL chat template")
    (tmp_path / "tokenizer" / "chat_template.jinja").write_text("")  # cut short: the chat rendered as nothing
    with pytest.raises(FlagWorded, match=r"\), which is missing or empty; copy or download the checkpoint again\.$"):
        expansion_inputs("a fox", tokenizer=_load_tokenizer(tmp_path / "tokenizer"))


def test_a_file_given_as_the_checkpoint_names_its_checkpoint_folder(tmp_path, monkeypatch):
    """model_index.json or a component's weight file was told only to pass "the checkpoint folder"."""
    path = _checkpoint_with_weights(tmp_path / "k6")
    monkeypatch.chdir(tmp_path)
    for given in ("k6/model_index.json", "k6/transformer/diffusion_pytorch_model.safetensors"):
        with pytest.raises(CheckpointError, match=r"is a file; pass the checkpoint folder that holds "
                                                  r"model_index\.json\. It is in the checkpoint 'k6': pass that "
                                                  r"folder\.$"):
            resolve_checkpoint(given)
    (tmp_path / "single.safetensors").write_bytes(path.read_bytes())
    with pytest.raises(CheckpointError, match=r"A single weight file is no Diffusers checkpoint"):
        resolve_checkpoint("single.safetensors")
