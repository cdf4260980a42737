"""k6serve: the fastest, most faithful way to run the Kandinsky 6 model family."""

from k6serve.api import DiffGenerator
from k6serve.request import GenerateRequest, SamplingParams, UpscaleRequest, VideoResult

__all__ = ["DiffGenerator", "GenerateRequest", "SamplingParams", "UpscaleRequest", "VideoResult"]
__version__ = "0.1.0"
