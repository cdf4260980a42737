"""k6serve: the fastest, most faithful way to run the Kandinsky 6 model family."""

import typing

from k6serve.engine_arguments import EngineOptions
from k6serve.request import GenerateKwargs, GenerateRequest, SamplingParams, UpscaleRequest, VideoResult

if typing.TYPE_CHECKING:
    # Imported lazily at run time (below); a type checker reads the class from here: through the module's
    # __getattr__ alone, `DiffGenerator` and everything a generator returns were `Any` to mypy and pyright.
    from k6serve.api import DiffGenerator

__all__ = ["DiffGenerator", "EngineOptions", "GenerateKwargs", "GenerateRequest", "SamplingParams", "UpscaleRequest",
           "VideoResult"]
__version__ = "0.1.0"


if not typing.TYPE_CHECKING:  # hidden from type checkers, which would otherwise take any attribute as valid
    def __getattr__(name: str):
        # DiffGenerator pulls in torch, the models and the runtime (about 2 s); imported on first use, so that the
        # CLI's --help and its flag errors, which need none of it, answer at once.
        if name == "DiffGenerator":
            from k6serve.api import DiffGenerator

            return DiffGenerator
        raise AttributeError(f"module 'k6serve' has no attribute {name!r}")
