"""Shared fixtures: tiny random-weight checkpoints in the real Diffusers layout, built once.

Builders are imported inside the fixtures, so tests that do not use them skip importing diffusers.
"""

import importlib.util
import os
import signal
from pathlib import Path

import pytest
import torch

# Python 3.14's argparse and tracebacks colour their text under FORCE_COLOR (or in a terminal): the tests compare
# help and errors as plain text, in this process and in the commands it starts.
os.environ["PYTHON_COLORS"] = "0"

if os.environ.get("PYTEST_XDIST_WORKER"):
    # Under `pytest -n 2` (the README's command) two workers share the machine's cores: one torch thread each, and
    # one for every process they start (ranks, servers, CLI runs read OMP_NUM_THREADS at their start), or OpenMP's
    # spinning workers make each other's calls many times slower. A value set by the user wins.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if os.environ["OMP_NUM_THREADS"].isdigit() and int(os.environ["OMP_NUM_THREADS"]) > 0:
        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    # Started with Ctrl-C ignored (a background job of a shell without job control, `nohup`): Python then installs
    # no KeyboardInterrupt handler, and every process the tests start inherits the ignored signal, so the Ctrl-C
    # tests (`_thread.interrupt_main`, SIGINT sent to a CLI run or a rank) failed with "DID NOT RAISE". The
    # terminal's default is restored for the tests and their children (a Python handler is reset at exec).
    signal.signal(signal.SIGINT, signal.default_int_handler)

# ---- Kandinsky 6 generation (T2AV / TI2AV) ----


@pytest.fixture(scope="session")
def tiny_pro_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Pro-style checkpoint: FlowMatch Euler scheduler, video + audio, seed 0."""
    from k6serve.testing.tiny_checkpoints import build_generation_checkpoint

    return build_generation_checkpoint(tmp_path_factory.mktemp("tiny_pro"), "pro", seed=0)


@pytest.fixture(scope="session")
def tiny_pro_foldable_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`tiny_pro_dir` with 2 key/value heads in Qwen, so that 2 ranks can fold the text encoders (TP works too)."""
    from k6serve.testing.tiny_checkpoints import build_foldable_generation_checkpoint

    return build_foldable_generation_checkpoint(tmp_path_factory.mktemp("tiny_pro_foldable"))


@pytest.fixture(scope="session")
def tiny_distill_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Pro-distill-style checkpoint: PiFlow scheduler, 10x heads, with audio, seed 0."""
    from k6serve.testing.tiny_checkpoints import build_generation_checkpoint

    return build_generation_checkpoint(tmp_path_factory.mktemp("tiny_distill"), "distill", seed=0)


@pytest.fixture(scope="session")
def _demo_cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from k6serve.testing.tiny_checkpoints import ensure_demo_checkpoint

    cache_dir = tmp_path_factory.mktemp("k6serve_cache")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("K6SERVE_CACHE", str(cache_dir))
        ensure_demo_checkpoint()
    return cache_dir


@pytest.fixture
def demo_dir(_demo_cache_dir: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The demo checkpoint; K6SERVE_CACHE points at this session's cache while the test runs."""
    from k6serve.testing.tiny_checkpoints import ensure_demo_checkpoint

    monkeypatch.setenv("K6SERVE_CACHE", str(_demo_cache_dir))
    return ensure_demo_checkpoint()


@pytest.fixture
def no_ranks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Starting the rank processes (which load the checkpoint) fails the test: for refusals that must come before
    the load."""
    import k6serve.runtime.process_group_worker as process_group_worker
    import k6serve.runtime.rank_process as rank_process

    def refuse(*args, **kwargs):
        raise AssertionError("the ranks were started")

    monkeypatch.setattr(process_group_worker.MultiProcessWorker, "__init__", refuse)
    monkeypatch.setattr(rank_process, "serve_worker_ranks", refuse)


@pytest.fixture
def in_process_worker(monkeypatch: pytest.MonkeyPatch) -> list:
    """Engines built while the test runs load their model in the test's process (`ModelWorker`), not in a spawned
    rank process: for tests of what the CLI and the API do around a request (names, messages, config files), whose
    worker process adds seconds of interpreter start-up and proves nothing there. The list gathers the workers.
    The rank processes themselves are tested in test_multi_process_engine.py, test_launch.py and the main job's
    tests."""
    from k6serve.runtime import process_group_worker
    from k6serve.runtime.worker import ModelWorker

    workers: list = []

    def in_process(config):
        workers.append(ModelWorker(config))
        return workers[-1]

    monkeypatch.setattr(process_group_worker, "MultiProcessWorker", in_process)
    return workers


# ---- Kandinsky 6 super-resolution ----


@pytest.fixture(scope="session")
def tiny_sr_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny VSR-distilled-style checkpoint (PiFlow nfe 2, 80 = 10 x 8 wide head, vendor configs), seed 0.

    Geometry: K-VAE cell 8 px (4 levels), HR tiles 64x64 / 64x128 / 128x64, so x2 input tiles are 32x32 / 32x64 /
    64x32 and x4 input tiles 16x16 / 16x32 / 32x16.
    """
    from k6serve.testing.tiny_sr_checkpoint import build_sr_checkpoint

    return build_sr_checkpoint(
        tmp_path_factory.mktemp("tiny_sr") / "tiny_vsr", head="distilled", seed=0
    )


@pytest.fixture(scope="session")
def tiny_sr_configs(tiny_sr_dir: Path):
    """The `SRConfigs` of `tiny_sr_dir`."""
    from k6serve.models.kandinsky6_sr.config_before_loading import read_sr_configs

    return read_sr_configs(tiny_sr_dir)


@pytest.fixture
def build_tiny_kvae(tiny_sr_configs):
    """dtype -> a fresh SR K-VAE wrapper of `tiny_sr_configs` with random weights on the CPU."""
    from k6serve.models.kandinsky6_sr.checkpoint import build_dummy_sr_models
    from k6serve.models.variants import VARIANTS

    def build(dtype: torch.dtype):
        variant = VARIANTS["vsr-distilled2steps"]
        return build_dummy_sr_models(tiny_sr_configs, variant, device=torch.device("cpu"), dtype=dtype).vae

    return build


@pytest.fixture(scope="session")
def tiny_sr_flow640_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The known-bad pairing: flow-matching Euler scheduler next to a 640-style (n_grid x C) head."""
    from k6serve.testing.tiny_sr_checkpoint import build_sr_checkpoint

    return build_sr_checkpoint(
        tmp_path_factory.mktemp("tiny_sr_flow640") / "tiny_vsr", head="flow640"
    )


@pytest.fixture(scope="session")
def tiny_sr_plain64_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The other bad pairing: PiFlow scheduler next to a plain C-wide head."""
    from k6serve.testing.tiny_sr_checkpoint import build_sr_checkpoint

    return build_sr_checkpoint(
        tmp_path_factory.mktemp("tiny_sr_plain64") / "tiny_vsr", head="plain64"
    )


@pytest.fixture
def one_torch_thread():
    """Run a test on one torch thread: tiny models gain nothing from a second one, and OpenMP workers spinning
    against other processes on a busy 2-core machine make each call 10-50x slower."""
    num_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(num_threads)


@pytest.fixture
def hub_offline(monkeypatch: pytest.MonkeyPatch) -> None:
    """huggingface_hub in offline mode for this test. It reads HF_HUB_OFFLINE once, at import, so once an earlier test
    has imported it the variable alone does nothing and a hub lookup waits on the unreachable network (46 s for one
    LoRA test in the full suite): the module's constant is set too."""
    from huggingface_hub import constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)


# ---- the repository's scripts ----

SCRIPTS = Path(__file__).parents[1] / "scripts"


@pytest.fixture(scope="session")
def load_script():
    """name -> scripts/<name>.py imported as a fresh module: the scripts are files to run, not a package, and each
    test gets its own module so that a monkeypatched attribute does not leak into the next."""

    def load(name: str):
        spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module

    return load


# ---- the CLI as it reads the engine options ----


@pytest.fixture
def engine_config_from_cli():
    """`k6serve <argv>` as the CLI reads it (flags over --config values), its engine options built into the
    `EngineConfig` the worker would get: `engine_config_from_cli("serve", "--model-path", "demo", ...)`."""
    from k6serve.cli.config_file import merged_options
    from k6serve.cli.flags import build_parser, split_options
    from k6serve.engine_arguments import build_engine_config

    parser = build_parser()

    def build(*argv: str):
        engine, _ = split_options(merged_options(parser.parse_args(list(argv)), parser))
        return build_engine_config(engine.pop("model_path"), **engine)

    return build


@pytest.fixture
def no_model_load(monkeypatch: pytest.MonkeyPatch) -> None:
    """`k6serve generate` failing the test if it loads the model: what a run refuses must be refused before it."""
    import k6serve.cli.generate as generate_module

    def from_cli_options(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(generate_module.DiffGenerator, "from_cli_options", staticmethod(from_cli_options))
