"""The Python API: `DiffGenerator`, compatible with the seed documents' example.

    with DiffGenerator.from_pretrained(model_path="...", num_gpus=1) as generator:
        result = generator.generate(sampling_params_kwargs={"prompt": "...", "seed": 42})
        print(result.output_file_path)
"""

from __future__ import annotations

import dataclasses
import logging
import tempfile
from pathlib import Path
from typing import Any

from k6serve.config import EngineConfig, ModelConfig, ParallelConfig, RuntimeConfig
from k6serve.request import OutputOptions, SamplingParams, VideoResult, fspath_values
from k6serve.runtime.engine import Engine, ProgressCallback
from k6serve.runtime.worker import sanitize_file_name

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
    output = fspath_values({k: kwargs.pop(k) for k in list(kwargs) if k in _OUTPUT_KEYS})
    return_paths_only = output.pop("return_file_paths_only", None)
    params = SamplingParams.from_kwargs(kwargs)
    return_frames = output.pop("return_frames", None)
    if return_paths_only is not None and not isinstance(return_paths_only, bool):
        raise ValueError(f"return_file_paths_only must be true or false, got {return_paths_only!r}.")
    if return_frames is None:
        return_frames = return_paths_only is False
    elif return_paths_only is not None and return_frames == return_paths_only:
        raise ValueError(
            f"return_file_paths_only={return_paths_only} and return_frames={return_frames} contradict each other; "
            "pass only one of them."
        )
    return params, OutputOptions(return_frames=return_frames, **output)


def check_output_folder(output: OutputOptions) -> None:
    """Create the output folder and prove it writable now: a bad --output-path must fail before the model loads
    and the request runs, not at the MP4 write after the whole denoise."""
    if not output.save_output:
        return
    if not str(output.output_path).strip():
        raise ValueError("output_path is empty; pass the folder for the MP4 (e.g. --output-path outputs).")
    folder = Path(output.output_path)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as exc:
        raise ValueError(
            f"cannot write to output_path {str(folder)!r} ({exc.strerror or exc}); pass a writable folder with "
            "--output-path, or --no-save-output to skip the file."
        ) from None


def check_output(output: OutputOptions) -> None:
    """Check the output before the request runs: an unusable folder, a name with folders, or a given name that
    already exists fails now, not after the whole denoise. A derived name is left to the worker, which writes
    without replacing and moves a taken one (the same prompt, seed and second; an SR of the same source) on to
    _1, _2..."""
    if not output.save_output:
        return
    check_output_folder(output)
    if output.output_file_name:
        if Path(output.output_file_name).name != output.output_file_name:
            raise ValueError(
                f"output_file_name {output.output_file_name!r} must be a file name without folders; put the "
                "folder in --output-path."
            )
        target = Path(output.output_path) / sanitize_file_name(output.output_file_name)
        if target.exists():
            raise ValueError(
                f"{str(target)!r} already exists and was left as it is; delete it or pass another "
                "--output-file-name."
            )


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

    def generate(self, sampling_params_kwargs: dict[str, Any] | SamplingParams | None = None, *,
                 on_progress: ProgressCallback | None = None, **kwargs: Any) -> VideoResult:
        """Run one request. Keys: every SamplingParams field plus save_output, output_path, output_file_name,
        return_frames and return_file_paths_only (the seed's names). A `SamplingParams` object (the class is
        exported) stands for the fields it sets away from their defaults; keyword arguments still win.

        `on_progress(step, total)` runs after every denoising step (SR: every DiT call), then again with
        `(total, total)` after each chunk of the video decode; raising from it stops the request there."""
        if isinstance(sampling_params_kwargs, SamplingParams):
            # Its unset fields are defaults, not choices: passing them on would, e.g., contradict return_frames.
            sampling_params_kwargs = {
                item.name: getattr(sampling_params_kwargs, item.name)
                for item in dataclasses.fields(sampling_params_kwargs)
                if getattr(sampling_params_kwargs, item.name) != item.default
            }
        params, output = split_kwargs({**(sampling_params_kwargs or {}), **kwargs})
        check_output(output)
        return self.engine.generate(params, output, on_progress=on_progress)

    def upscale(self, video_path: str, *, on_progress: ProgressCallback | None = None, **kwargs: Any) -> VideoResult:
        """Super-resolution convenience: `generate(video_path=...)`, with the same progress callback."""
        return self.generate({"video_path": video_path, **kwargs}, on_progress=on_progress)

    def shutdown(self) -> None:
        self.engine.shutdown()

    def __enter__(self) -> "DiffGenerator":
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
