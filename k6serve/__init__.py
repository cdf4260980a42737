"""k6serve: the fastest, most faithful way to run the Kandinsky 6 model family."""

from k6serve.request import GenerateRequest, SamplingParams, UpscaleRequest, VideoResult

__all__ = ["DiffGenerator", "GenerateRequest", "SamplingParams", "UpscaleRequest", "VideoResult"]
__version__ = "0.1.0"


def __getattr__(name: str):
    # DiffGenerator pulls in torch, the models and the runtime (about 2 s); imported on first use, so that the CLI's
    # --help and its flag errors, which need none of it, answer at once.
    if name == "DiffGenerator":
        from k6serve.api import DiffGenerator

        return DiffGenerator
    raise AttributeError(f"module 'k6serve' has no attribute {name!r}")
