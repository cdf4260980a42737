"""`DiffGenerator.from_pretrained`'s arguments as the typed engine config: the flat keyword arguments (the CLI's
and the seed's names) split into the config sections (`build_engine_config`, which the CLI and the server build their
config with too), and SGLang's `server_args` dict, model path and `local_mode` taken as it defines them."""

from __future__ import annotations

import dataclasses
import os
import typing
from collections.abc import Mapping, Sequence
from typing import Any

from k6serve.caching.params import CacheDitParams
from k6serve.config import EngineConfig, ModelConfig, ParallelConfig, RuntimeConfig, WarmupSize
from k6serve.reference_names import unknown_names_hint
from k6serve.request import SamplingParams, plain_scalars

# Both also tell a misplaced key apart in `generate`'s request (request_arguments.request_options), which imports
# them from here: an engine option is refused there, a request parameter here.
ENGINE_SECTIONS = (ModelConfig, ParallelConfig, RuntimeConfig)
REQUEST_KEYS = {item.name for item in dataclasses.fields(SamplingParams)}

if typing.TYPE_CHECKING:
    from _typeshed import DataclassInstance

    import torch  # `EngineOptions` only; building the config stays torch-free at run time
else:
    class _TorchOnDemand:
        """`typing.get_type_hints(EngineOptions)` (as documentation tools and run-time type checkers call it)
        evaluates its `torch.dtype` / `torch.device` annotations in this module's namespace: torch is imported then,
        on the first attribute asked for, so that the annotations resolve and building a config imports no torch."""

        def __getattr__(self, name: str) -> Any:
            import torch

            return getattr(torch, name)

    torch = _TorchOnDemand()


def build_engine_config(model_path: str | os.PathLike[str], **kwargs: Any) -> EngineConfig:
    """Split flat keyword arguments (the CLI's and the seed's names) into the typed config sections. Its errors name
    the flags, as for the CLI and the server, which build their config here too; `DiffGenerator` rewords them."""
    sections: dict[type[DataclassInstance], dict[str, Any]] = {cls: {} for cls in ENGINE_SECTIONS}
    # pathlib paths are accepted where a path goes, as for the request's paths; the typed config holds strings.
    model_path = os.fspath(model_path) if isinstance(model_path, os.PathLike) else model_path
    kwargs = {k: os.fspath(v) if k == "lora_path" and isinstance(v, os.PathLike) else v
              for k, v in plain_scalars(kwargs).items()}
    kwargs = {k: _torch_name(k, v) for k, v in kwargs.items()}
    for key, value in kwargs.items():
        for cls in sections:
            if key in cls.__dataclass_fields__:
                sections[cls][key] = value
                break
        else:
            if key in REQUEST_KEYS:
                raise ValueError(f"{key} is a request parameter: pass it to generate(), not to from_pretrained().")
            valid = sorted(k for cls in sections for k in cls.__dataclass_fields__ if k != "model_path")
            # SGLang's names (enable_torch_compile) get what to use instead, not a guess at a look-alike.
            hint = unknown_names_hint([key], valid, surface="api")
            raise ValueError(f"Unknown engine option {key!r}{hint}. Valid options: {valid}")
    return EngineConfig(
        model=ModelConfig(model_path=model_path, **sections[ModelConfig]),
        parallel=ParallelConfig(**sections[ParallelConfig]),
        runtime=RuntimeConfig(**sections[RuntimeConfig]),
    )


def _torch_name(key: str, value: Any) -> Any:
    """`dtype=torch.bfloat16` and `device=torch.device("cuda")`, as diffusers' and torch's own code spell them, as
    the names the typed config holds ("bfloat16", "cuda"); they were refused as "must be a string". Anything else
    is left for the config's own checks."""
    module = type(value).__module__.partition(".")[0]
    if module != "torch":
        return value
    import torch

    if key == "dtype" and isinstance(value, torch.dtype):
        return str(value).removeprefix("torch.")  # float16 stays refused by the config, with its choices
    if key == "device" and isinstance(value, torch.device):
        return value.type if value.index is None else f"{value.type}:{value.index}"
    return value


def options_with_server_args(server_args: Any, kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """SGLang's `server_args` dict under the keyword arguments. SGLang's own `ServerArgs` object holds SGLang's whole
    option set, hundreds of options k6serve has no use for, so it is refused, asking for the options that matter."""
    if server_args is None:
        return dict(kwargs)
    if not isinstance(server_args, Mapping):
        raise ValueError(
            f"server_args takes the engine options as a dict of keyword names, e.g. server_args={{'model_path': "
            f"'demo', 'num_gpus': 1}}, got {type(server_args).__name__}; SGLang's ServerArgs object is not "
            "k6serve's: pass the options you set on it as a dict, or as keyword arguments of from_pretrained().")
    not_names = [key for key in server_args if not isinstance(key, str)]
    if not_names:
        raise ValueError(f"server_args's keys are engine option names (strings, e.g. 'num_gpus'), got "
                         f"{not_names[0]!r} ({type(not_names[0]).__name__}).")
    return {**server_args, **kwargs}


def model_path_of(model_path: Any, options: dict[str, Any]) -> Any:
    """The model path given as the argument or among the options (SGLang's `server_args` holds it), taken out of
    `options`; both, naming different models, is an error rather than a guess."""
    in_options = options.pop("model_path", None)
    if model_path is None and in_options is None:
        raise ValueError("from_pretrained() needs the model: model_path='demo' or 'demo-sr' (the built-in tiny "
                         "generation / super-resolution checkpoints), a "
                         "local Diffusers folder or a hub id, e.g. "
                         "'kandinskylab/Kandinsky-6.0-Pro-distill-5s-Diffusers'.")
    if model_path is not None and in_options is not None and os.fspath(model_path) != os.fspath(in_options):
        raise ValueError(f"from_pretrained() got two models: model_path={os.fspath(model_path)!r} and "
                         f"server_args's model_path={os.fspath(in_options)!r}; pass one.")
    return in_options if model_path is None else model_path


def check_local_mode(local_mode: Any) -> None:
    local_mode = plain_scalars({"local_mode": local_mode})["local_mode"]  # np.True_ is True
    if local_mode is True:
        return
    if local_mode is False:
        # SGLang's remote mode talks to a running server's scheduler over ZMQ; k6serve's server is reached over HTTP.
        raise ValueError(
            "local_mode=False (SGLang's client of a running server's scheduler) is not k6serve's: a DiffGenerator "
            "always starts its own workers (local_mode=True, the default). To use a running `k6serve serve`, send "
            "its HTTP API the jobs (docs/http-api.md), e.g. with the OpenAI SDK: OpenAI(base_url='http://HOST:PORT"
            "/v1', api_key='none').videos.create(prompt=...).")
    raise ValueError(f"local_mode must be True or False, got {local_mode!r} ({type(local_mode).__name__}).")


class EngineOptions(typing.TypedDict, total=False):
    """`DiffGenerator.from_pretrained`'s keyword arguments, for type checkers and IDEs: every field of the config
    sections (`ModelConfig`, `ParallelConfig`, `RuntimeConfig`) but `model_path` (its own argument), as the CLI's
    flags with underscores, each with what `build_engine_config` takes for it: the field's own type, plus the
    spellings the config turns into it (a torch dtype or device, a pathlib LoRA path, a list or one string of names,
    a mapping of residencies or Cache-DiT settings). None only where the field is optional (or read as "none given").
    tests/unit/test_api_types.py keeps the keys in step with the sections, so a checker refuses a misspelt or
    mistyped option before the load, as `build_engine_config` does at run time."""

    # ModelConfig
    model_id: str | None
    revision: str | None
    load_format: str
    dtype: str | torch.dtype
    lora_path: str | os.PathLike[str] | None
    lora_nickname: str
    lora_scale: float
    lora_alpha: float | None
    lora_merge_mode: str
    quantization: str
    quantization_ignored_layers: str | Sequence[str] | None
    # ParallelConfig
    num_gpus: int
    tp_size: int
    ulysses_degree: int
    ring_degree: int
    enable_cfg_parallel: bool
    use_fsdp_inference: bool
    encoder_parallel: str
    dp_size: int
    nnodes: int
    node_rank: int
    dist_init_addr: str | None
    dist_timeout_s: float
    # RuntimeConfig
    device: str | torch.device
    performance_mode: str
    attention_backend: str
    warmup_mode: str
    warmup_resolutions: str | WarmupSize | Sequence[str | WarmupSize] | None
    compile_vae: bool
    compile_prompt_rewrite: bool
    vae_tiling: str
    cache_dit_config: CacheDitParams | Mapping[str, Any] | str | None
    offload_prefetch_blocks: int
    offload_resident_blocks: int
    cpu_offload_components: str | Sequence[str] | None
    layerwise_offload_components: str | Sequence[str] | None
    component_residency: Mapping[str, str] | str | Sequence[str] | Sequence[tuple[str, str]] | None
    vae_parallel_tiling: bool | None
    vae_parallel_decode: bool | None
    vae_parallel_decode_mode: str | None
