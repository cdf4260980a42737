"""The ComfyUI nodes: K6Serve Generate (T2AV / TI2AV) and K6Serve Upscale (video super-resolution).

Both send one job to a running `k6serve serve`, follow it (progress bar; Cancel sends POST /v1/videos/{id}/cancel),
save the MP4 in ComfyUI's output folder and return it decoded: frames (IMAGE), audio (AUDIO), the file's path and
its fps.
"""

from __future__ import annotations

import json
import logging
import mimetypes
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar

import torch

from . import comfy_runtime
from .client import Deadline, K6ServeClient, K6ServeError, Upload, new_request_id
from .media import decode_video, encode_png, encode_video, image_to_uint8, require_av

logger = logging.getLogger(__name__)

CATEGORY = "k6serve"
DEFAULT_SERVER_URL = "http://127.0.0.1:30000"
MAX_SEED = 2**63 - 1  # the server takes 0 <= seed < 2^63
MAX_FRAMES = 509  # the server's largest num_frames (4k+1)
RETURN_TYPES = ("IMAGE", "AUDIO", "STRING", "FLOAT")
RETURN_NAMES = ("frames", "audio", "video_path", "fps")
OUTPUT_TOOLTIPS = (
    "Every frame of the video, float [N, H, W, 3] in 0..1.",
    "The video's audio track (44.1 kHz mono from k6serve); silence of the video's length if it has none.",
    "The saved MP4 (in ComfyUI's output folder).",
    "The video's frame rate.",
)
ENABLE_CACHE_DIT_CHOICES = ("server default", "on", "off")
SR_SCALES = ("2", "2.25", "4")


def _shared_inputs() -> dict[str, dict[str, tuple]]:
    required = {
        "server_url": ("STRING", {"default": DEFAULT_SERVER_URL, "tooltip": "Where `k6serve serve` listens."}),
    }
    optional = {
        "api_key": ("STRING", {"default": "", "tooltip": "The server's --api-key, sent as a Bearer token. "
                               "Empty: the K6SERVE_API_KEY environment variable, if set. A key typed here is saved "
                               "in the workflow; prefer the environment variable."}),
        "filename_prefix": ("STRING", {"default": "k6serve/K6Serve", "tooltip": "Saved as <output folder>/"
                                       "<prefix>_<job id>.mp4; may include subfolders."}),
        "timeout_s": ("INT", {"default": 0, "min": 0, "max": 7 * 24 * 3600, "tooltip": "Stop the node this many "
                              "seconds after it started, cancelling its job if that has not finished (waiting for a "
                              "loading server, the upload, queue time, the video's download and decode included); "
                              "0 = no limit."}),
    }
    return {"required": required, "optional": optional}


def _seed_input() -> tuple:
    return ("INT", {"default": 42, "min": 0, "max": MAX_SEED, "control_after_generate": True,
                    "tooltip": "Random seed; the same inputs and seed give the same video."})


class _K6ServeNode:
    """What both nodes declare alike to ComfyUI: their category and their outputs (`run_job`'s)."""

    CATEGORY = CATEGORY
    OUTPUT_NODE = True
    RETURN_TYPES = RETURN_TYPES
    RETURN_NAMES = RETURN_NAMES
    OUTPUT_TOOLTIPS = OUTPUT_TOOLTIPS


class K6ServeGenerate(_K6ServeNode):
    """Text (and optionally a first image) to video + audio on a k6serve server."""

    DESCRIPTION = ("Generate a video with audio with Kandinsky 6 on a running `k6serve serve` (a generation "
                   "checkpoint). Connect an image for image+text to video. Cancel stops the job on the server.")
    FUNCTION = "generate"
    # Server field -> the input to change, for the server's 400 messages.
    INPUT_NAMES: ClassVar[dict[str, str]] = {
        "size": "width/height", "height": "height", "width": "width", "num_inference_steps": "steps",
        "image_path": "image", "input_reference": "image", "cache_dit_params": "enable_cache_dit"}

    @classmethod
    def INPUT_TYPES(cls) -> dict[str, dict[str, tuple]]:
        shared = _shared_inputs()
        required = {
            **shared["required"],
            "prompt": ("STRING", {"multiline": True, "default": "", "tooltip": "What happens and what is heard."}),
            "width": ("INT", {"default": 768, "min": 16, "max": 2048, "step": 16, "tooltip": "Video width in "
                              "pixels, a multiple of 16. Sent with height as the OpenAI size \"WxH\", width first "
                              "(768 x 512 -> size \"768x512\")."}),
            "height": ("INT", {"default": 512, "min": 16, "max": 2048, "step": 16, "tooltip": "Video height in "
                               "pixels, a multiple of 16 (the second number of size \"WxH\")."}),
            "num_frames": ("INT", {"default": 121, "min": 1, "max": MAX_FRAMES, "step": 4, "tooltip": "Frames, of "
                                   f"the form 4k+1, at most {MAX_FRAMES} (121 = 5 s at 24 fps); the server makes "
                                   "others (n // 4) * 4 + 1 (20 -> 21, 23 -> 21), with a warning in the log."}),
            "steps": ("INT", {"default": 0, "min": 0, "max": 1000, "tooltip": "Denoising steps; 0 = the model's "
                              "default (distilled 10, Pro/Lite 50)."}),
            "guidance_scale": ("FLOAT", {"default": 0.0, "min": 0.0, "max": 100.0, "step": 0.1, "tooltip": "CFG "
                                         "scale; 0 = the model's default (Pro/Lite 5.0, distilled 1.0). Otherwise "
                                         "at least 1; distilled checkpoints take exactly 1."}),
            "seed": _seed_input(),
        }
        optional = {
            "negative_prompt": ("STRING", {"multiline": True, "default": "", "tooltip": "For CFG (Pro/Lite); "
                                           "empty = the model's built-in negative prompt."}),
            "image": ("IMAGE", {"tooltip": "Optional first frame (image+text to video): the first image of the "
                                "batch is uploaded as PNG; the server cover-resizes and centre-crops it to "
                                "width x height."}),
            "fps": ("FLOAT", {"default": 0.0, "min": 0.0, "max": 240.0, "step": 1.0, "tooltip": "Frame rate of the "
                              "output (sets the audio length); 0 = 24."}),
            "loras": ("STRING", {"default": "", "tooltip": "This job's LoRA adapters as JSON {nickname: strength}, "
                                 "of adapters already loaded on the server (e.g. {\"style\": 0.8}); {} = the base "
                                 "model; empty = the server's active adapters."}),
            "enable_cache_dit": (list(ENABLE_CACHE_DIT_CHOICES), {"default": "server default", "tooltip": "Cache-"
                                 "DiT step caching for this job (faster, lossy; for the 50-step Pro/Lite)."}),
            **shared["optional"],
            # Inputs added later go last: a saved workflow keeps its widgets' values as a list in order, so one put
            # before api_key moved every later value (the key into expand_prompts, the prefix into api_key).
            "expand_prompts": ("BOOLEAN", {"default": False, "tooltip": "Let the model's Qwen2.5-VL rewrite the "
                               "prompt into a detailed video+audio description first (diffusers' expand_prompts; "
                               "with an image, grounded on it). The rewrite is shown on the node."}),
            "sample_audio": ("BOOLEAN", {"default": True, "tooltip": "Generate the soundtrack. Off: a silent video "
                             "(the DiT on the video tokens alone; the picture differs from the one made with "
                             "sound); the audio output is then silence."}),
        }
        return {"required": required, "optional": optional}

    def generate(self, server_url: str, prompt: str, width: int, height: int, num_frames: int, steps: int,
                 guidance_scale: float, seed: int, negative_prompt: str = "", image: torch.Tensor | None = None,
                 fps: float = 0.0, loras: str = "", enable_cache_dit: str = "server default", api_key: str = "",
                 filename_prefix: str = "k6serve/K6Serve", timeout_s: int = 0, expand_prompts: bool = False,
                 sample_audio: bool = True) -> dict[str, Any]:
        deadline = Deadline.after(timeout_s)
        client = K6ServeClient(server_url, api_key, node_name="K6Serve Generate", input_names=self.INPUT_NAMES)
        fields = generation_fields(prompt=prompt, width=width, height=height, num_frames=num_frames, steps=steps,
                                   guidance_scale=guidance_scale, seed=seed, negative_prompt=negative_prompt,
                                   fps=fps, loras=loras, enable_cache_dit=enable_cache_dit,
                                   expand_prompts=expand_prompts, sample_audio=sample_audio)
        uploads = []
        if image is not None:
            uploads.append(Upload("input_reference", "first_frame.png", "image/png",
                                  encode_png(image_to_uint8(image))))
        _require_family(client, "generation", "K6Serve Upscale", deadline)
        return run_job(client, fields, uploads, filename_prefix=filename_prefix, deadline=deadline)


class K6ServeUpscale(_K6ServeNode):
    """Video super-resolution (x2, x2.25, x4) on a k6serve server serving a VSR checkpoint."""

    DESCRIPTION = ("Upscale a video with Kandinsky 6 VSR on a running `k6serve serve` (a VSR checkpoint). Give a "
                   "video file (e.g. K6Serve Generate's video_path) or connect frames (and audio). The source "
                   "audio is kept. Cancel stops the job on the server.")
    FUNCTION = "upscale"
    INPUT_NAMES: ClassVar[dict[str, str]] = {
        "video_path": "video_path", "video_reference": "video_path", "sr_resolution_scale": "scale",
        "sr_tiles_batch_size": "tiles_batch_size", "sr_tile_min_overlap": "tile_min_overlap",
        "sr_target_resolution": "target_resolution", "sr_target_resize_mode": "target_resize_mode"}

    @classmethod
    def INPUT_TYPES(cls) -> dict[str, dict[str, tuple]]:
        shared = _shared_inputs()
        required = {
            **shared["required"],
            "video_path": ("STRING", {"default": "", "tooltip": "A video file on this machine, uploaded to the "
                                      "server; leave empty when frames are connected. The server reads up to 121 "
                                      "frames at 24 fps (faster sources are subsampled)."}),
            "scale": (list(SR_SCALES), {"default": "2.25", "tooltip": "Upscale factor."}),
            "seed": _seed_input(),
        }
        optional = {
            "frames": ("IMAGE", {"tooltip": "Frames to upscale instead of video_path; encoded to a near-lossless "
                                 "MP4 (H.264 4:4:4, CRF 10) and uploaded."}),
            "audio": ("AUDIO", {"tooltip": "Audio to keep with the connected frames."}),
            "frames_fps": ("FLOAT", {"default": 24.0, "min": 1.0, "max": 240.0, "step": 1.0, "tooltip": "Frame "
                                     "rate of the connected frames."}),
            "video_path_on_server": ("BOOLEAN", {"default": False, "tooltip": "Send video_path as a path on the "
                                                 "server's machine instead of uploading the file (it must be "
                                                 "inside the server's --allowed-input-dir)."}),
            "tiles_batch_size": ("INT", {"default": 0, "min": 0, "max": 64, "tooltip": "Tiles per DiT call; 0 = "
                                         "the server's default (1). Changes the noise, not only the speed."}),
            "tile_min_overlap": ("FLOAT", {"default": -1.0, "min": -1.0, "max": 0.95, "step": 0.05, "tooltip":
                                           "Minimum tile overlap in [0, 1); negative = the server's default "
                                           "(0.2)."}),
            "target_resolution": ("STRING", {"default": "", "tooltip": "Downscale-only delivery size: hd, fullhd, "
                                             "2k or WxH with even sides; empty = none."}),
            "target_resize_mode": (["fit", "exact"], {"default": "fit", "tooltip": "With target_resolution: fit "
                                                      "inside it, or exactly its size."}),
            **shared["optional"],
        }
        return {"required": required, "optional": optional}

    @classmethod
    def IS_CHANGED(cls, video_path: str = "", video_path_on_server: bool = False, **kwargs: Any) -> str:
        """Re-run when the source file changes on disk, not only when the inputs do. The path is the one
        `_video_upload` reads (`~` expanded), so a change to that file is seen."""
        path = Path(video_path.strip()).expanduser() if video_path and video_path.strip() else None
        if path is None or video_path_on_server or not path.is_file():
            return ""
        stat = path.stat()
        return f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}"

    def upscale(self, server_url: str, video_path: str, scale: str, seed: int, frames: torch.Tensor | None = None,
                audio: dict | None = None, frames_fps: float = 24.0, video_path_on_server: bool = False,
                tiles_batch_size: int = 0, tile_min_overlap: float = -1.0, target_resolution: str = "",
                target_resize_mode: str = "fit", api_key: str = "", filename_prefix: str = "k6serve/K6Serve",
                timeout_s: int = 0) -> dict[str, Any]:
        deadline = Deadline.after(timeout_s)
        client = K6ServeClient(server_url, api_key, node_name="K6Serve Upscale", input_names=self.INPUT_NAMES)
        fields = upscale_fields(scale=scale, seed=seed, tiles_batch_size=tiles_batch_size,
                                tile_min_overlap=tile_min_overlap, target_resolution=target_resolution,
                                target_resize_mode=target_resize_mode)
        source = video_path.strip()
        if frames is not None and source:
            raise K6ServeError("K6Serve Upscale: both frames and video_path are given; connect frames or set "
                               "video_path, not both.")
        if frames is None and not source:
            raise K6ServeError("K6Serve Upscale: no source video; set video_path (e.g. from K6Serve Generate) or "
                               "connect frames.")
        uploads = []
        if frames is None and video_path_on_server:
            fields["video_path"] = source
        elif frames is None:
            uploads.append(_video_upload(source))
        _require_family(client, "super_resolution", "K6Serve Generate", deadline)
        if frames is not None:
            with tempfile.TemporaryDirectory(prefix="k6serve_comfyui_") as scratch:
                stop = _stop_check(client.node_name, deadline, "the connected frames were encoded for the upload "
                                   "(no job was sent)")
                clip = encode_video(Path(scratch) / "frames.mp4", frames, frames_fps, audio, check=stop)
                uploads = [Upload("video_reference", "frames.mp4", "video/mp4", clip.read_bytes())]
        return run_job(client, fields, uploads, filename_prefix=filename_prefix, deadline=deadline)


def generation_fields(*, prompt: str, width: int, height: int, num_frames: int, steps: int, guidance_scale: float,
                      seed: int, negative_prompt: str, fps: float, loras: str,
                      enable_cache_dit: str, expand_prompts: bool = False,
                      sample_audio: bool = True) -> dict[str, Any]:
    """The POST /v1/videos fields of a generation job; 0 (or empty) leaves a field to the model's default."""
    fields: dict[str, Any] = {"prompt": prompt, "size": f"{width}x{height}", "num_frames": num_frames, "seed": seed}
    if steps > 0:
        fields["num_inference_steps"] = steps
    if guidance_scale > 0:
        fields["guidance_scale"] = guidance_scale
    if negative_prompt.strip():
        fields["negative_prompt"] = negative_prompt
    if fps > 0:
        fields["fps"] = fps
    if loras.strip():
        fields["loras"] = _parse_loras(loras)
    if enable_cache_dit != "server default":
        fields["enable_cache_dit"] = enable_cache_dit == "on"
    if expand_prompts:
        fields["expand_prompts"] = True
    if not sample_audio:
        fields["sample_audio"] = False
    return fields


def upscale_fields(*, scale: str, seed: int, tiles_batch_size: int, tile_min_overlap: float,
                   target_resolution: str, target_resize_mode: str) -> dict[str, Any]:
    """The POST /v1/videos fields of a super-resolution job (the source is added by the caller)."""
    fields: dict[str, Any] = {"sr_resolution_scale": float(scale), "seed": seed}
    if tiles_batch_size > 0:
        fields["sr_tiles_batch_size"] = tiles_batch_size
    if tile_min_overlap >= 0:
        fields["sr_tile_min_overlap"] = tile_min_overlap
    if target_resolution.strip():
        fields["sr_target_resolution"] = target_resolution.strip()
        fields["sr_target_resize_mode"] = target_resize_mode
    return fields


def run_job(client: K6ServeClient, fields: dict[str, Any], uploads: list[Upload], *, filename_prefix: str,
            deadline: Deadline) -> dict[str, Any]:
    """Create the job, follow it, save the MP4 and decode it into the node's outputs."""
    output_path(filename_prefix, "video_check", client.node_name)  # a bad prefix fails before the GPU works
    require_av()  # so does a missing PyAV, which only the decode after the job needs
    check_interrupt = comfy_runtime.interrupt_check()
    job = client.create_job(fields, uploads, request_id=new_request_id(), check_interrupt=check_interrupt,
                            deadline=deadline)
    logger.info("%s: job %s queued on %s", client.node_name, job["id"], client.base_url)
    done = client.wait(job, check_interrupt=check_interrupt, on_progress=comfy_runtime.progress_reporter(),
                       deadline=deadline)
    path = client.download_content(done["id"], output_path(filename_prefix, done["id"], client.node_name),
                                   check_interrupt=check_interrupt, deadline=deadline)
    logger.info("%s: job %s done in %s s, saved %s", client.node_name, done["id"], done.get("inference_time_s"),
                path)
    video = decode_video(path, check=_stop_check(client.node_name, deadline, f"the video was decoded; the MP4 is "
                                                 f"saved at {path}"))
    # expand_prompts: the rewrite the video was made from, shown under the path (the outputs stay as they were).
    shown = [str(path)] + ([f"expanded prompt: {done['expanded_prompt']}"] if done.get("expanded_prompt") else [])
    return {"ui": {"text": shown}, "result": (video.frames, video.audio, str(path), video.fps)}


def _stop_check(node_name: str, deadline: Deadline, during: str) -> Callable[[], None]:
    """ComfyUI's Cancel and timeout_s for a step on ComfyUI's machine (an encode, a decode), checked between its
    frames: no request runs there for the client to watch, and a 4x upscale's frames take a while."""
    check_interrupt = comfy_runtime.interrupt_check()

    def check() -> None:
        check_interrupt()
        if deadline.passed():
            raise K6ServeError(f"{node_name}: timeout_s={deadline.timeout_s:g} s ran out while {during}. Raise "
                               "timeout_s, or 0 for no limit.")

    return check


def output_path(filename_prefix: str, job_id: str, node_name: str) -> Path:
    """<output folder>/<prefix>_<job id>.mp4, refusing a prefix that leaves the output folder."""
    root = comfy_runtime.output_directory().resolve()
    prefix = filename_prefix.strip() or "K6Serve"
    path = (root / f"{prefix}_{job_id}.mp4").resolve()
    if not path.is_relative_to(root):
        raise K6ServeError(f"{node_name}: filename_prefix {filename_prefix!r} points outside the output folder "
                           f"{root}; use a relative prefix such as 'k6serve/K6Serve'.")
    return path


def _parse_loras(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        raise K6ServeError(f"K6Serve Generate: loras must be a JSON object such as {{\"style\": 0.8}}, got "
                           f"{text!r} ({error.msg}).") from None
    if not isinstance(value, dict):
        raise K6ServeError(f"K6Serve Generate: loras must be a JSON object such as {{\"style\": 0.8}}, got {text!r}.")
    return value


def _video_upload(video_path: str) -> Upload:
    path = Path(video_path).expanduser()
    if not path.is_file():
        raise K6ServeError(f"K6Serve Upscale: video_path {str(path)!r} is not a file on this machine. For a path "
                           "on the server's machine, turn on video_path_on_server.")
    content_type = mimetypes.guess_type(path.name)[0] or "video/mp4"
    return Upload("video_reference", path.name, content_type, path.read_bytes())


def _require_family(client: K6ServeClient, family: str, other_node: str, deadline: Deadline) -> None:
    # Waits while the server loads its model (Cancel and timeout_s heard meanwhile; the wait counts in timeout_s).
    model = client.served_model(check_interrupt=comfy_runtime.interrupt_check(), deadline=deadline)
    if model.get("family") != family:
        raise K6ServeError(f"{client.node_name}: the server at {client.base_url} serves {model.get('id')!r} "
                           f"({model.get('family')}), not a {family.replace('_', '-')} model. Use {other_node} "
                           "with it, or point server_url at a server started with a "
                           f"{'generation' if family == 'generation' else 'VSR'} checkpoint.")
