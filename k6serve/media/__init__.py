"""Video and audio files: reading sources, probing, and writing the output MP4 (PyAV), and the conditioning image
(Pillow only).

The names below are imported on first use (PEP 562), so that reading a conditioning image does not need PyAV: a
frames-only text-and-image request (`save_output=False`) and the server warm-up's image pass run where PyAV is
missing. `probe` is the exception, imported with the package where PyAV imports (see below).
"""

from __future__ import annotations

import importlib

_HOMES = {
    "processed_num_samples": "audio", "read_source_audio": "audio",
    "cover_resize_center_crop": "image", "load_conditioning_image": "image",
    "write_mp4": "mux",
    "MediaInfo": "probe", "probe": "probe",
    "DecodedVideo": "video", "SourceClip": "video", "read_sr_source": "video", "read_video": "video",
}

__all__ = ["DecodedVideo", "MediaInfo", "SourceClip", "cover_resize_center_crop", "load_conditioning_image", "probe",
           "processed_num_samples", "read_source_audio", "read_sr_source", "read_video", "write_mp4"]

try:
    # `probe` is also the name of its module: the first import of `k6serve.media.probe` anywhere binds the package's
    # `probe` to that module, and `__getattr__` below is then never asked (in CI, `media.probe(...)` called the
    # module). Bound here, before any such import, it stays the function, as when this file imported everything.
    from k6serve.media.probe import MediaInfo, probe
except ImportError:  # no PyAV: then neither the module nor the function can be imported, so nothing can rebind it
    pass


def __getattr__(name: str):
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_HOMES[name]}"), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_HOMES))
