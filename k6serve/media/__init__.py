"""Video and audio files: reading sources, probing, and writing the output MP4 (PyAV), and the conditioning image
(Pillow only).

The names below are imported on first use (PEP 562), not with the package: `k6serve.media.image` needs no PyAV, so a
text-and-image request whose frames are kept in memory (`save_output=False`), and the server warm-up's image pass,
run where PyAV is missing (the GPU host has none; it failed the warm-up there when this file imported every module).
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

__all__ = sorted(_HOMES)


def __getattr__(name: str):
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_HOMES[name]}"), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_HOMES))
