"""`generate`'s request arguments: the request dict (or `SamplingParams`) and keyword arguments as one dict
(`request_options`), split into the `SamplingParams` and the `OutputOptions` (`split_kwargs`); a PIL image or an
array of pixels where a path goes is refused saying what to pass instead."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from typing import Any

from k6serve.engine_arguments import ENGINE_SECTIONS, REQUEST_KEYS
from k6serve.request import OutputOptions, SamplingParams, fspath_values, plain_scalars

_OUTPUT_KEYS = {"save_output", "output_path", "output_file_name", "return_frames", "return_file_paths_only"}


def split_kwargs(kwargs: dict[str, Any]) -> tuple[SamplingParams, OutputOptions]:
    kwargs = fspath_values(plain_scalars(kwargs))
    if type(kwargs.get("seed")).__name__ == "Generator" and type(kwargs["seed"]).__module__.startswith("torch"):
        # diffusers takes generator=torch.Generator().manual_seed(42); here the seed itself is the request's.
        raise ValueError("seed takes an integer, not a torch.Generator: pass the generator's seed, e.g. seed=42 for "
                         "torch.Generator('cpu').manual_seed(42) (k6serve draws the noise from such a CPU generator), "
                         "or seed=generator.initial_seed().")
    _refuse_image_objects(kwargs.get("image_path"))
    _refuse_pixel_arrays(kwargs)
    for key in ("image_path", "video_path", "output_path"):
        if isinstance(kwargs.get(key), str) and kwargs[key].startswith("~"):
            # A shell expands ~ on the command line; in Python (or a --config file) it reached mkdir as a folder
            # literally named "~", or an input as "does not exist". --model-path expands it too.
            kwargs[key] = os.path.expanduser(kwargs[key])
    # None is "the default" here as in every other key: save_output=None wrote no file (the video was lost), and
    # output_path=None failed deep in os.fspath.
    output = {k: kwargs.pop(k) for k in list(kwargs) if k in _OUTPUT_KEYS}
    output = {k: v for k, v in output.items() if v is not None}
    return_paths_only = output.pop("return_file_paths_only", None)
    params = SamplingParams.from_kwargs(kwargs)
    return_frames = output.pop("return_frames", None)
    if return_paths_only is not None and not isinstance(return_paths_only, bool):
        raise ValueError(f"return_file_paths_only must be true or false, got {return_paths_only!r}.")
    if return_frames is None:
        # save_output=False with neither return flag given returned neither a file nor frames: the request ran (minutes
        # on a GPU) and its video was lost. Without a file the frames are the result, unless the caller says
        # return_frames=False (timing runs: the CLI's --no-save-output, which has nowhere to put them).
        unsaved = output.get("save_output") is False
        return_frames = return_paths_only is False or (return_paths_only is None and unsaved)
    elif return_paths_only is not None and return_frames == return_paths_only:
        raise ValueError(
            f"return_file_paths_only={return_paths_only} and return_frames={return_frames} contradict each other; "
            "pass only one of them."
        )
    return params, OutputOptions(return_frames=return_frames, **output)


def _refuse_image_objects(image: Any) -> None:
    """image_path is a path: the request goes to the worker processes (and over HTTP, into a job store) as plain
    values, and the workers open the file, as for the CLI and the server. A PIL image was refused only as "must be
    a string"; this says what to do with one."""
    if image is None or isinstance(image, str):
        return
    import PIL.Image

    if isinstance(image, PIL.Image.Image):
        raise ValueError("image_path takes the path of an image file (a str or pathlib.Path), not a PIL image: save "
                         "it first, e.g. image.save('first_frame.png'), and pass that path.")


def _refuse_pixel_arrays(kwargs: Mapping[str, Any]) -> None:
    """A numpy array or torch tensor of pixels as image_path / video_path (frames from OpenCV, decord, a previous
    result's `frames`): the type check refused it as "must be a string, got array([[[0, 0, 0], ..." with some 50
    lines of pixels and no fix. Said in one line, with its shape, and what to pass instead."""
    for key, saved_as in (("image_path", "an image file"), ("video_path", "a video file (MP4, MKV, MOV or WebM)")):
        value = kwargs.get(key)
        if value is None or isinstance(value, str):
            continue
        if isinstance(value, (list, tuple)) and value and _is_picture(value[0]):
            # diffusers' SR pipeline takes a list of PIL frames (`pipe(...).frames[0]`): the type check printed all
            # 121 of them (8,000 characters) and said nothing of what to do.
            if key == "video_path":
                raise ValueError(f"video_path takes the path of {saved_as} (a str or pathlib.Path), not a list of "
                                 f"{len(value)} frames: save them as a video first, e.g. diffusers.utils."
                                 "export_to_video(frames, 'source.mp4', fps=24), or pass a finished generation's "
                                 "result.output_file_path.")
            pil = type(value[0]).__module__.partition(".")[0] == "PIL"
            example = ("frames[0].save('first.png')" if pil
                       else _array_save_example(value[0]).replace("pixels", "frames[0]"))
            raise ValueError(f"image_path takes the path of one image file (a str or pathlib.Path), not a list of "
                             f"{len(value)} {'PIL images' if pil else 'arrays'}: save the first frame, e.g. "
                             f"{example}, and pass that path.")
        if isinstance(value, (list, tuple)) and value and all(isinstance(item, (str, os.PathLike)) for item in value):
            # SGLang takes a list of one source video; here the field is the one path, and said so, not "must be a
            # string, got [...] (list)".
            one = os.fspath(value[0])
            fix = (f"pass the path itself: {key}={one!r}" if len(value) == 1 else
                   "upscale one source a call" if key == "video_path" else "a request takes one conditioning image")
            raise ValueError(f"{key} takes one path (a str or pathlib.Path), not a list of {len(value)}; {fix}.")
        package = type(value).__module__.partition(".")[0]
        if package not in ("numpy", "torch") or not hasattr(value, "shape"):
            continue
        fix = f", e.g. {_array_save_example(value)}," if key == "image_path" else ""
        raise ValueError(f"{key} takes the path of {saved_as} (a str or pathlib.Path), not a {package}."
                         f"{type(value).__name__} of shape {tuple(value.shape)}: save it first{fix} and pass that "
                         "path.")


def _is_picture(value: Any) -> bool:
    """A PIL image, or a numpy array / torch tensor (of pixels)."""
    package = type(value).__module__.partition(".")[0]
    return package == "PIL" or (package in ("numpy", "torch") and hasattr(value, "shape"))


def _array_save_example(value: Any) -> str:
    """How to save this array or tensor as a PNG, for its layout and values: diffusers' images are floats in [0, 1],
    a tensor channels first (C, H, W), where PIL.Image.fromarray takes uint8 (H, W, C) and failed on the others."""
    pixels = "pixels"
    if type(value).__module__.partition(".")[0] == "torch":
        pixels += ".permute(1, 2, 0)" if value.ndim == 3 and value.shape[0] in (1, 3, 4) else ""
        pixels += ".cpu().numpy()"
    if str(getattr(value, "dtype", "")).removeprefix("torch.") not in ("uint8",):
        pixels = f"({pixels} * 255).round().clip(0, 255).astype('uint8')"
    return f"PIL.Image.fromarray({pixels}).save('first.png')"


def request_options(request: Mapping[str, Any] | SamplingParams | None, kwargs: dict[str, Any]) -> dict[str, Any]:
    """`generate`'s request (a dict, a SamplingParams or None) and keyword arguments as one dict, keywords winning;
    a request of another type, or an engine option in it, raises ValueError saying where it goes."""
    if isinstance(request, SamplingParams):
        # Its unset fields are defaults, not choices: passing them on would, e.g., contradict return_frames.
        request = {item.name: getattr(request, item.name) for item in dataclasses.fields(request)
                   if getattr(request, item.name) != item.default}
    elif request is not None and not isinstance(request, Mapping):
        example = f"generate(prompt={request!r})" if isinstance(request, str) else "generate(prompt='A cat')"
        raise ValueError(f"generate() takes the request as a dict (or a SamplingParams) or as keyword arguments, got "
                         f"{request!r} ({type(request).__name__}); e.g. {example} or generate({{'prompt': ...}}).")
    options = {**(request or {}), **kwargs}
    not_names = [key for key in options if not isinstance(key, str)]
    if not_names:
        # Failed inside difflib's "did you mean" as "'int' object is not iterable".
        raise ValueError(f"generate()'s request keys are parameter names (strings, e.g. 'prompt'), got "
                         f"{not_names[0]!r} ({type(not_names[0]).__name__}).")
    misplaced = sorted(key for key in options if key not in REQUEST_KEYS
                       and any(key in cls.__dataclass_fields__ for cls in ENGINE_SECTIONS))
    if misplaced:
        what, it = ("is an engine option", "it") if len(misplaced) == 1 else ("are engine options", "them")
        raise ValueError(f"{', '.join(misplaced)} {what}, fixed when the model loads: pass {it} to "
                         "DiffGenerator.from_pretrained(), not to generate().")
    return options


def check_progress_bar(progress_bar: object) -> None:
    if not isinstance(progress_bar, bool):
        raise ValueError(f"progress_bar must be True or False, got {progress_bar!r}.")
