"""Video and audio files: reading sources, probing, and writing the output MP4 (PyAV only)."""

from k6serve.media.audio import processed_num_samples, read_source_audio
from k6serve.media.image import cover_resize_center_crop, load_conditioning_image
from k6serve.media.mux import write_mp4
from k6serve.media.probe import MediaInfo, probe
from k6serve.media.video import DecodedVideo, SourceClip, read_sr_source, read_video

__all__ = [
    "DecodedVideo",
    "MediaInfo",
    "SourceClip",
    "cover_resize_center_crop",
    "load_conditioning_image",
    "probe",
    "processed_num_samples",
    "read_source_audio",
    "read_sr_source",
    "read_video",
    "write_mp4",
]
