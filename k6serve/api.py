"""The Python API: `DiffGenerator`, compatible with the seed documents' example.

    with DiffGenerator.from_pretrained(model_path="...", num_gpus=1) as generator:
        result = generator.generate(sampling_params_kwargs={"prompt": "...", "seed": 42})
        print(result.output_file_path)
"""

from __future__ import annotations

import logging
from typing import Any

from k6serve.config import EngineConfig, ModelConfig, ParallelConfig, RuntimeConfig
from k6serve.request import OutputOptions, SamplingParams, VideoResult
from k6serve.runtime.engine import Engine, ProgressCallback

logger = logging.getLogger(__name__)

_OUTPUT_KEYS = {"save_output", "output_path", "output_file_name", "return_frames", "return_file_paths_only"}


def build_engine_config(model_path: str, **kwargs: Any) -> EngineConfig:
    """Split flat keyword arguments (the CLI's and the seed's names) into the typed config sections."""
    sections: dict[type, dict[str, Any]] = {ModelConfig: {}, ParallelConfig: {}, RuntimeConfig: {}}
    for key, value in kwargs.items():
        for cls in sections:
            if key in cls.__dataclass_fields__:
                sections[cls][key] = value
                break
        else:
            valid = sorted(k for cls in sections for k in cls.__dataclass_fields__ if k != "model_path")
            raise ValueError(f"Unknown engine option {key!r}. Valid options: {valid}")
    return EngineConfig(
        model=ModelConfig(model_path=model_path, **sections[ModelConfig]),
        parallel=ParallelConfig(**sections[ParallelConfig]),
        runtime=RuntimeConfig(**sections[RuntimeConfig]),
    )


def split_kwargs(kwargs: dict[str, Any]) -> tuple[SamplingParams, OutputOptions]:
    kwargs = dict(kwargs)
    output = {k: kwargs.pop(k) for k in list(kwargs) if k in _OUTPUT_KEYS}
    return_paths_only = output.pop("return_file_paths_only", None)
    params = SamplingParams.from_kwargs(kwargs)
    return_frames = output.pop("return_frames", None)
    if return_frames is None:
        return_frames = return_paths_only is False
    return params, OutputOptions(return_frames=bool(return_frames), **output)


class DiffGenerator:
    """Loads a Kandinsky 6 checkpoint once and generates (or upscales) videos with it."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    @classmethod
    def from_pretrained(cls, model_path: str, **kwargs: Any) -> "DiffGenerator":
        return cls(Engine(build_engine_config(model_path, **kwargs)))

    @property
    def variant(self):
        return self.engine.variant

    def generate(self, sampling_params_kwargs: dict[str, Any] | None = None, *,
                 on_progress: ProgressCallback | None = None, **kwargs: Any) -> VideoResult:
        """Run one request. Keys: every SamplingParams field plus save_output, output_path, output_file_name,
        return_frames and return_file_paths_only (the seed's names)."""
        params, output = split_kwargs({**(sampling_params_kwargs or {}), **kwargs})
        return self.engine.generate(params, output, on_progress=on_progress)

    def upscale(self, video_path: str, **kwargs: Any) -> VideoResult:
        """Super-resolution convenience: `generate(video_path=...)`."""
        return self.generate({"video_path": video_path, **kwargs})

    def shutdown(self) -> None:
        self.engine.shutdown()

    def __enter__(self) -> "DiffGenerator":
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
