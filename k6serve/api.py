"""The Python API: `DiffGenerator`, compatible with the seed documents' example.

    with DiffGenerator.from_pretrained(model_path="...", num_gpus=1) as generator:
        result = generator.generate(sampling_params_kwargs={"prompt": "...", "seed": 42})
        print(result.output_file_path)

LoRA adapters (`set_lora`, `merge_lora_weights`, `unmerge_lora_weights`, `list_loras`) are changed between requests,
in order with them, on every rank of every replica.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import logging
import math
import os
import tempfile
import threading
import typing
import unicodedata
import weakref
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Unpack

from k6serve.api_errors import flags_as_keywords, reworded_errors
from k6serve.config import EngineConfig, EngineOptions, ModelConfig, ParallelConfig, RuntimeConfig
from k6serve.dependencies import MissingPackage, require_package
from k6serve.lora.spec import (
    LORA_MERGE_MODES,
    LORA_TARGETS,
    ListLoras,
    LoraSpec,
    MergeLora,
    SetLora,
    UnloadLora,
    UnmergeLora,
    check_lora_alpha,
    check_lora_strength,
    odd_nickname,
)
from k6serve.lora.preflight import check_start_adapter
from k6serve.models.checkpoint_files import ignored_revision_note
from k6serve.models.variants import GENERATION, MissingPrompt, MissingSourceVideo, Variant
from k6serve.reference_names import unknown_names_hint
from k6serve.request import (
    FlagWorded,
    FlagWordedNote,
    GenerateKwargs,
    OutputOptions,
    PromptListOptions,
    PromptListRequest,
    RequestOptions,
    SamplingParams,
    VideoResult,
    did_you_mean,
    drawn_seed,
    fspath_values,
    plain_scalars,
)
from k6serve.prompt_lists import Listed, run_side_by_side, stopped_list
from k6serve.runtime.engine import Engine, ProgressCallback
from k6serve.media.image import looks_like_url
from k6serve.media.output_names import MAX_FILE_NAME_BYTES, is_name_character, numbered_file_names, sanitize_file_name

logger = logging.getLogger(__name__)
# The generators not yet shut down. A notebook cell that runs `generator = DiffGenerator.from_pretrained(...)` again
# loads the new model while the name still holds the old one, so both are in memory until the load ends: a second
# load beside a running generator is warned about before it starts.
_RUNNING: "weakref.WeakSet[DiffGenerator]" = weakref.WeakSet()

_OUTPUT_KEYS = {"save_output", "output_path", "output_file_name", "return_frames", "return_file_paths_only"}
_ENGINE_SECTIONS = (ModelConfig, ParallelConfig, RuntimeConfig)
_REQUEST_KEYS = {item.name for item in dataclasses.fields(SamplingParams)}
# A `DiffGenerator` method's decorators keep its signature for type checkers and IDEs (`Callable -> Callable` made
# set_lora and the other LoRA and memory methods `(*Any, **Any) -> Any`: no keyword or type was checked).
_Method = typing.TypeVar("_Method", bound=Callable[..., Any])


def build_engine_config(model_path: str, **kwargs: Any) -> EngineConfig:
    """Split flat keyword arguments (the CLI's and the seed's names) into the typed config sections. Its errors name
    the flags, as for the CLI and the server, which build their config here too; `DiffGenerator` rewords them."""
    sections: dict[type, dict[str, Any]] = {cls: {} for cls in _ENGINE_SECTIONS}
    # pathlib paths are accepted where a path goes, as for the request's paths; the typed config holds strings.
    model_path = os.fspath(model_path) if isinstance(model_path, os.PathLike) else model_path
    kwargs = {k: os.fspath(v) if k == "lora_path" and isinstance(v, os.PathLike) else v
              for k, v in plain_scalars(kwargs).items()}
    kwargs = {k: _torch_name(k, v) for k, v in kwargs.items()}
    for key, value in kwargs.items():
        for cls in sections:
            if key in cls.__dataclass_fields__:
                sections[cls][key] = value
                break
        else:
            if key in _REQUEST_KEYS:
                raise ValueError(f"{key} is a request parameter: pass it to generate(), not to from_pretrained().")
            valid = sorted(k for cls in sections for k in cls.__dataclass_fields__ if k != "model_path")
            # SGLang's names (enable_torch_compile) get what to use instead, not a guess at a look-alike.
            hint = unknown_names_hint([key], valid, surface="api")
            raise ValueError(f"Unknown engine option {key!r}{hint}. Valid options: {valid}")
    return EngineConfig(
        model=ModelConfig(model_path=model_path, **sections[ModelConfig]),
        parallel=ParallelConfig(**sections[ParallelConfig]),
        runtime=RuntimeConfig(**sections[RuntimeConfig]),
    )


def _torch_name(key: str, value: Any) -> Any:
    """`dtype=torch.bfloat16` and `device=torch.device("cuda")`, as diffusers' and torch's own code spell them, as
    the names the typed config holds ("bfloat16", "cuda"); they were refused as "must be a string". Anything else
    is left for the config's own checks."""
    module = type(value).__module__.partition(".")[0]
    if module != "torch":
        return value
    import torch

    if key == "dtype" and isinstance(value, torch.dtype):
        return str(value).removeprefix("torch.")  # float16 stays refused by the config, with its choices
    if key == "device" and isinstance(value, torch.device):
        return value.type if value.index is None else f"{value.type}:{value.index}"
    return value


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


def _from_here(path: Any, *, existing_only: bool) -> Any:
    """A relative `path` made absolute from this process's folder (`DiffGenerator._from_callers_folder`); with
    `existing_only`, only one that exists here (a LoRA path may be a hub id). A URL or data URI is left as it is,
    for its own refusal (k6serve fetches no URLs), as are empty and non-path values."""
    if not isinstance(path, (str, os.PathLike)):
        return path
    text = os.path.expanduser(os.fspath(path))
    if not text.strip() or looks_like_url(text) or (existing_only and not os.path.exists(text)):
        return path
    return os.path.abspath(text)


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


def require_media_package(params: SamplingParams, output: OutputOptions) -> None:
    """PyAV, which k6serve.media needs to write the MP4 and to read a source video, imported in the caller's
    process: missing, the request failed in the worker only after the model had loaded and run. A conditioning
    image is read with Pillow alone (k6serve/media/__init__.py)."""
    if output.save_output:
        require_package("av", "to write the MP4")
    elif params.video_path is not None:
        require_package("av", "to read the source video")


def _warn_without_media_package() -> None:
    """Said before the load (minutes for a real checkpoint), which cannot know whether the requests will write an
    MP4 (save_output, the default): `generate` refuses those, and the frames-only ones still run."""
    try:
        require_package("av", "to write the MP4")
    except MissingPackage as exc:
        logger.warning(f"{exc} Until then generate() runs only requests with save_output=False and no source video.")


def check_output_folder(output: OutputOptions) -> None:
    """Create the output folder and prove it writable now: a bad --output-path must fail before the model loads
    and the request runs, not at the MP4 write after the whole denoise."""
    if not output.save_output:
        return
    if not str(output.output_path).strip():
        # SGLang's empty output path means "keep no file"; said as the flag the CLI took it from, and the API's
        # rewording names the keywords (it said output_path on the command line and --output-path in Python).
        raise ValueError("--output-path is empty; pass the folder for the MP4 (e.g. --output-path 'outputs'), or "
                         "--no-save-output to write no file (SGLang's empty output path).")
    folder = Path(output.output_path)
    if folder.exists() and not folder.is_dir():
        # mkdir would only say "File exists", which reads as if the folder were fine.
        raise ValueError(
            f"output_path {str(folder)!r} is a file, not a folder; pass a folder for the MP4 with --output-path "
            "(it is created if missing), or put the file name in --output-file-name."
        )
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as exc:
        raise ValueError(
            f"cannot write to output_path {str(folder)!r} ({exc.strerror or exc}); pass a writable folder with "
            "--output-path, or --no-save-output to skip the file."
        ) from None


def final_file_name(name: str) -> tuple[str, str | None]:
    """The file name a given output_file_name is written under (`media/output_names.sanitize_file_name`, as the
    worker writes it), and a warning when that differs from it by more than the added .mp4. A name with no letter or
    digit before its .mp4 ('..', '???') would be written as 'video.mp4' or '_.mp4', a name the caller never chose,
    so it is refused."""
    # FlagWorded: `k6serve generate` names --output-file-name (cli/generate.py); "--output-path" is rewritten for
    # the API's caller by reworded_errors, as before.
    if not name.strip():
        raise FlagWorded.naming(lambda field: f"{field('output_file_name')} is empty; pass a name such as clip.mp4, "
                                              "or leave it out for a name derived from the request.")
    stem = name[:-4] if name.lower().endswith(".mp4") else name
    if not any(is_name_character(char) for char in stem):
        raise FlagWorded.naming(lambda field: f"{field('output_file_name')} {name!r} has no letter or digit to name "
                                              "the file by; pass a name such as clip.mp4 (letters and digits of any "
                                              "script, '.', '_' and '-').")
    if Path(name).name != name:
        raise FlagWorded.naming(lambda field: f"{field('output_file_name')} {name!r} must be a file name without "
                                              "folders; put the folder in --output-path.")
    final = sanitize_file_name(name)
    if len(final.encode()) > MAX_FILE_NAME_BYTES:  # filesystems count bytes: 2 a Cyrillic letter, 3 a Chinese one
        raise FlagWorded.naming(lambda field: f"{field('output_file_name')} is {len(final.encode())} bytes long with "
                                              f".mp4 in UTF-8, more than the {MAX_FILE_NAME_BYTES} an output file may "
                                              "have; pass a shorter name.")
    if final in (name, name + ".mp4"):
        return final, None
    nfc = unicodedata.normalize("NFC", name)
    normalised = ("its Unicode was normalised (NFC), so that it has the same bytes however its accents were typed "
                  "(an 'e' and a combining accent become one 'é')")
    if final in (nfc, nfc + ".mp4"):
        # Only NFC changed it: the two names print alike ('é.mp4' is written as 'é.mp4'), so show their escapes.
        return final, FlagWordedNote.naming(lambda field: f"{field('output_file_name')} {ascii(name)} is written as "
                                                          f"{ascii(final)}: {normalised}.")
    kept = ("file names keep only letters and digits (of any script), '.', '_' and '-' (others become '_'), and no "
            "leading dot")
    return final, FlagWordedNote.naming(lambda field: f"{field('output_file_name')} {name!r} is written as {final!r}: "
                                                      f"{kept}" + (f"; and {normalised}." if nfc != name else "."))


def check_output(output: OutputOptions) -> tuple[OutputOptions, list[str]]:
    """Check the output before the request runs: an unusable folder, an unusable name, a name with folders, or a
    given name that already exists fails now, not after the whole denoise. Returns the options with a given name
    as it will be written, and warnings for the user (a name changed on the way). A derived name is left to the
    worker, which writes without replacing and moves a taken one (the same prompt, seed and second; an SR of the
    same source) on to _1, _2..."""
    if not output.save_output or output.output_file_name is None:
        check_output_folder(output)
        return output, []
    name, warning = final_file_name(output.output_file_name)  # before the folder is created for it
    check_output_folder(output)
    target = Path(output.output_path) / name
    if os.path.lexists(target):  # exists() follows a link: a dangling one passed, and the result was lost at the end
        raise ValueError(
            f"{str(target)!r} already exists and was left as it is; delete it or pass another "
            "--output-file-name."
        )
    return dataclasses.replace(output, output_file_name=name), [warning] if warning else []


def unsaved_output_keys(options: Mapping[str, Any]) -> list[str]:
    """The output_path / output_file_name given with save_output false: no file is written for them to name. The
    caller warns in its own words (flags or keywords)."""
    if options.get("save_output", True) is not False:
        return []
    return [key for key in ("output_file_name", "output_path") if options.get(key) is not None]


class LoraArgumentError(ValueError):
    """A bad LoRA argument; `argument` is its name as the caller spelled it (the HTTP field, or the keyword)."""

    def __init__(self, argument: str, message: str) -> None:
        super().__init__(message)
        self.argument = argument


def _lora_number(value: Any, argument: str, check: Callable[[float, str], None]) -> float:
    """`value` as a float, refused unless a number that `check` (`check_lora_strength`, `check_lora_alpha`: finite,
    within the bound) accepts: the HTTP routes build their operations here too, so both refuse it before it queues."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise LoraArgumentError(argument, f"{argument} must be a finite number, got {value!r}.")
    try:
        number = float(value)
    except OverflowError:  # an int past float's range
        number = math.inf if value > 0 else -math.inf
    try:
        check(number, argument)
    except ValueError as exc:
        raise LoraArgumentError(argument, str(exc)) from None
    return number


def _lora_choice(value: Any, argument: str, choices: tuple[str, ...]) -> str:
    if not isinstance(value, str) or value not in choices:
        raise LoraArgumentError(argument, f"{argument} must be one of {', '.join(map(repr, choices))}, got {value!r}.")
    return value


def _lora_list(value: Any, argument: str, length: int, nickname_argument: str) -> list[Any]:
    if not isinstance(value, (list, tuple)):
        raise LoraArgumentError(argument, f"{argument} must be a list as long as {nickname_argument} ({length}) "
                                          f"when {nickname_argument} is a list, got {value!r}.")
    if len(value) != length:
        raise LoraArgumentError(argument, f"{argument} has {len(value)} entries but {nickname_argument} has "
                                          f"{length}; give one per adapter.")
    return list(value)


# `set_lora`'s path: one, or one per nickname (None: the adapter already loaded), pathlib paths too; a Sequence, since
# a list[str] is no list[str | None] to a type checker (lists are invariant), and a tuple is taken as a list.
LoraPaths = str | os.PathLike[str] | Sequence[str | os.PathLike[str] | None] | None

# The HTTP bodies' names of the LoRA calls' arguments (POST /v1/set_lora, /v1/unload_lora), by the Python name.
HTTP_LORA_NAMES = {"nickname": "lora_nickname", "path": "lora_path"}


def set_lora_operation(nickname: str | list[str], path: LoraPaths = None,
                       strength: float | Sequence[float] = 1.0, *, merge_mode: str = "auto",
                       target: str | list[str] = "all",
                       lora_alpha: float | None = None, names: Mapping[str, str] | None = None) -> SetLora:
    """Check `DiffGenerator.set_lora`'s arguments (also the HTTP body's) and build the operation; a bad one raises
    LoraArgumentError naming it as `names` spells it (e.g. {"nickname": "lora_nickname"} for HTTP)."""
    names = {"nickname": "nickname", "path": "path", **(names or {})}
    name_arg, path_arg = names["nickname"], names["path"]
    many = isinstance(nickname, (list, tuple))
    nicknames = list(nickname) if many else [nickname]
    for item in nicknames:
        if not isinstance(item, str) or not item.strip():
            raise LoraArgumentError(name_arg, f"{name_arg} must be a non-empty string or a list of them, got "
                                              f"{nickname!r}.")
        if odd_nickname(item):
            raise LoraArgumentError(name_arg, f"{name_arg} {odd_nickname(item)}")
    if len(set(nicknames)) != len(nicknames):
        raise LoraArgumentError(name_arg, f"{name_arg} names an adapter more than once: {nicknames!r}.")
    if many:
        paths = [None] * len(nicknames) if path is None else _lora_list(path, path_arg, len(nicknames), name_arg)
    elif isinstance(path, (list, tuple)):
        raise LoraArgumentError(path_arg, f"{path_arg} is a list but {name_arg} is one name; give a list of "
                                          f"{name_arg} too.")
    else:
        paths = [path]
    paths = [os.fspath(p) if isinstance(p, os.PathLike) else p for p in paths]
    for item in paths:
        if item is not None and (not isinstance(item, str) or not item.strip()):
            raise LoraArgumentError(path_arg, f"{path_arg} must be a non-empty string (a .safetensors file, a folder "
                                              f"holding one, or a hub id) or None, got {item!r}.")
    if isinstance(strength, (list, tuple)):
        if not many:
            raise LoraArgumentError("strength", f"strength is a list but {name_arg} is one name; give a list of "
                                                f"{name_arg} too.")
        strengths = [_lora_number(s, "strength", check_lora_strength)
                     for s in _lora_list(strength, "strength", len(nicknames), name_arg)]
    else:
        strengths = [_lora_number(strength, "strength", check_lora_strength)] * len(nicknames)
    if isinstance(target, (list, tuple)):
        # SGLang's one target per adapter: Kandinsky 6 has one DiT, which "all" and "transformer" both name, so a
        # list of them is that one target (it was refused as "must be one of 'all', 'transformer'").
        target = [_lora_choice(item, "target", LORA_TARGETS)
                  for item in _lora_list(target, "target", len(nicknames), name_arg)][0]
    alpha = None if lora_alpha is None else _lora_number(lora_alpha, "lora_alpha", check_lora_alpha)
    specs = tuple(LoraSpec(nickname=n, path=p, strength=s, alpha=alpha)
                  for n, p, s in zip(nicknames, paths, strengths))
    return SetLora(specs=specs, merge_mode=_lora_choice(merge_mode, "merge_mode", LORA_MERGE_MODES),
                   target=_lora_choice(target, "target", LORA_TARGETS))


def merge_lora_operation(target: str = "all", strength: float | None = None) -> MergeLora:
    return MergeLora(target=_lora_choice(target, "target", LORA_TARGETS),
                     strength=None if strength is None else _lora_number(strength, "strength", check_lora_strength))


def unmerge_lora_operation(target: str = "all") -> UnmergeLora:
    return UnmergeLora(target=_lora_choice(target, "target", LORA_TARGETS))


def unload_lora_operation(nickname: str | list[str], *, name: str = "nickname") -> UnloadLora:
    """Check `DiffGenerator.unload_lora`'s argument (also the HTTP body's, `name` as it spells it)."""
    nicknames = list(nickname) if isinstance(nickname, (list, tuple)) else [nickname]
    if not nicknames or any(not isinstance(item, str) or not item.strip() for item in nicknames):
        raise LoraArgumentError(name, f"{name} must be a non-empty string or a non-empty list of them, got "
                                      f"{nickname!r}.")
    if len(set(nicknames)) != len(nicknames):
        raise LoraArgumentError(name, f"{name} names an adapter more than once: {nicknames!r}.")
    return UnloadLora(nicknames=tuple(nicknames))


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
    misplaced = sorted(key for key in options if key not in _REQUEST_KEYS
                       and any(key in cls.__dataclass_fields__ for cls in _ENGINE_SECTIONS))
    if misplaced:
        what, it = ("is an engine option", "it") if len(misplaced) == 1 else ("are engine options", "them")
        raise ValueError(f"{', '.join(misplaced)} {what}, fixed when the model loads: pass {it} to "
                         "DiffGenerator.from_pretrained(), not to generate().")
    return options


def _options_with_server_args(server_args: Any, kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """SGLang's `server_args` dict under the keyword arguments. SGLang's own `ServerArgs` object holds SGLang's whole
    option set, hundreds of options k6serve has no use for, so it is refused, asking for the options that matter."""
    if server_args is None:
        return dict(kwargs)
    if not isinstance(server_args, Mapping):
        raise ValueError(
            f"server_args takes the engine options as a dict of keyword names, e.g. server_args={{'model_path': "
            f"'demo', 'num_gpus': 1}}, got {type(server_args).__name__}; SGLang's ServerArgs object is not "
            "k6serve's: pass the options you set on it as a dict, or as keyword arguments of from_pretrained().")
    not_names = [key for key in server_args if not isinstance(key, str)]
    if not_names:
        raise ValueError(f"server_args's keys are engine option names (strings, e.g. 'num_gpus'), got "
                         f"{not_names[0]!r} ({type(not_names[0]).__name__}).")
    return {**server_args, **kwargs}


def _model_path_of(model_path: Any, options: dict[str, Any]) -> Any:
    """The model path given as the argument or among the options (SGLang's `server_args` holds it), taken out of
    `options`; both, naming different models, is an error rather than a guess."""
    in_options = options.pop("model_path", None)
    if model_path is None and in_options is None:
        raise ValueError("from_pretrained() needs the model: model_path='demo' or 'demo-sr' (the built-in tiny "
                         "generation / super-resolution checkpoints), a "
                         "local Diffusers folder or a hub id, e.g. "
                         "'kandinskylab/Kandinsky-6.0-Pro-distill-5s-Diffusers'.")
    if model_path is not None and in_options is not None and os.fspath(model_path) != os.fspath(in_options):
        raise ValueError(f"from_pretrained() got two models: model_path={os.fspath(model_path)!r} and "
                         f"server_args's model_path={os.fspath(in_options)!r}; pass one.")
    return in_options if model_path is None else model_path


def _check_local_mode(local_mode: Any) -> None:
    local_mode = plain_scalars({"local_mode": local_mode})["local_mode"]  # np.True_ is True
    if local_mode is True:
        return
    if local_mode is False:
        # SGLang's remote mode talks to a running server's scheduler over ZMQ; k6serve's server is reached over HTTP.
        raise ValueError(
            "local_mode=False (SGLang's client of a running server's scheduler) is not k6serve's: a DiffGenerator "
            "always starts its own workers (local_mode=True, the default). To use a running `k6serve serve`, send "
            "its HTTP API the jobs (docs/http-api.md), e.g. with the OpenAI SDK: OpenAI(base_url='http://HOST:PORT"
            "/v1', api_key='none').videos.create(prompt=...).")
    raise ValueError(f"local_mode must be True or False, got {local_mode!r} ({type(local_mode).__name__}).")


def _http_names_answered(method: _Method) -> _Method:
    """A `DiffGenerator` LoRA method that answers a keyword it does not take with the argument meant: the HTTP
    body's name (`lora_path`, typed by a caller who moved a working request body over) got Python's bare
    "unexpected keyword argument 'lora_path'", and a typo a `did_you_mean` guess. Still a TypeError, as Python's."""
    signature = inspect.signature(method)
    python_names = {http: name for name, http in HTTP_LORA_NAMES.items() if name in signature.parameters}

    @functools.wraps(method)
    def answered(self: "DiffGenerator", *args: Any, **kwargs: Any) -> Any:
        unknown = [key for key in kwargs if key not in signature.parameters]
        if unknown:
            key = unknown[0]
            if key in python_names:
                hint = (f": {key} is the HTTP API's name (POST /v1/{method.__name__}'s body); the Python argument is "
                        f"{python_names[key]}: {method.__name__}(..., {python_names[key]}=...)")
            else:
                hint = did_you_mean([key], (name for name in signature.parameters if name != "self"))
            raise TypeError(f"{method.__name__}() got an unexpected keyword argument {key!r}{hint}.")
        return method(self, *args, **kwargs)

    return typing.cast(_Method, answered)


def _sglang_order_answered(method: _Method) -> _Method:
    """`DiffGenerator.set_lora` called in SGLang's argument order, (nickname, path, target, strength): its third
    argument, a target, was refused as "strength must be a finite number, got 'transformer'", and a fourth as
    Python's "takes from 2 to 4 positional arguments". Said as the order it is, with the call to make."""
    @functools.wraps(method)
    def ordered(self: "DiffGenerator", *args: Any, **kwargs: Any) -> Any:
        if len(args) >= 3 and isinstance(args[2], str) and args[2] in LORA_TARGETS:
            strength = "" if len(args) < 4 else f", {args[3]!r}"
            raise TypeError(f"{method.__name__}()'s third argument is the strength, got the target {args[2]!r}: "
                            "SGLang's set_lora takes (nickname, path, target, strength), and here target is a "
                            f"keyword: {method.__name__}({args[0]!r}, {args[1]!r}{strength}, target={args[2]!r}).")
        return method(self, *args, **kwargs)

    return typing.cast(_Method, ordered)


def _shown_prompt(prompt: Any) -> str:
    """A list's prompt as an error shows it: its start, or what else it is."""
    if isinstance(prompt, str):
        return repr(prompt if len(prompt) <= 40 else prompt[:40] + "...")
    return f"{prompt!r} ({type(prompt).__name__})"


def _check_progress_bar(progress_bar: object) -> None:
    if not isinstance(progress_bar, bool):
        raise ValueError(f"progress_bar must be True or False, got {progress_bar!r}.")


def _in_callers_words(method: _Method) -> _Method:
    """A `DiffGenerator` method whose ValueErrors are worded for its caller (`DiffGenerator._wording`)."""
    if inspect.iscoroutinefunction(method):
        @functools.wraps(method)
        async def worded_async(self: "DiffGenerator", *args: Any, **kwargs: Any) -> Any:
            with reworded_errors(self._wording):
                return await method(self, *args, **kwargs)

        return typing.cast(_Method, worded_async)

    @functools.wraps(method)
    def worded(self: "DiffGenerator", *args: Any, **kwargs: Any) -> Any:
        with reworded_errors(self._wording):
            return method(self, *args, **kwargs)

    return typing.cast(_Method, worded)


class DiffGenerator:
    """Loads a Kandinsky 6 checkpoint once and generates (or upscales) videos with it.

        with DiffGenerator.from_pretrained(model_path="demo") as generator:
            result = generator.generate(prompt="A cat plays piano", seed=42)

    The model runs in worker processes (one per GPU); `shutdown()`, the end of the `with` block, or dropping the
    last reference to the generator stops them and frees their memory. In a notebook, call `shutdown()` (or use
    `with`): a cell that showed the generator keeps a reference to it in IPython's output history (`Out`, `_`), so
    `del generator` leaves its workers running. Its ValueErrors name the keyword arguments (`num_gpus=4`) where the
    CLI names its flags (`--num-gpus 4`).
    """

    def __init__(self, engine: Engine, *, wording: Callable[[str], str] = flags_as_keywords) -> None:
        self.engine = engine
        # The engine's checks, shared with the CLI and the server, name CLI flags (`--num-gpus 4`); a Python caller
        # reads the keywords it passes (`num_gpus=4`, api_errors.py). `k6serve generate` keeps the flags (`str`).
        self._wording = wording
        # A generator dropped without shutdown() (a notebook cell run again rebinds its name) kept its worker
        # processes, and their GPU memory, until the interpreter exited.
        self._shutdown = weakref.finalize(self, engine.shutdown)
        _RUNNING.add(self)
        # The worker processes keep the folder they started in; a caller that moves (a notebook's %cd) gives its
        # relative paths from where it is (`_from_callers_folder`).
        self._start_folder = os.getcwd()

    @classmethod
    def from_pretrained(cls, model_path: str | os.PathLike[str] | None = None, *, local_mode: bool = True,
                        server_args: Mapping[str, Any] | None = None,
                        **kwargs: Unpack[EngineOptions]) -> "DiffGenerator":
        """Load `model_path` (a local Diffusers folder, a hub id, or "demo" / "demo-sr": the built-in tiny random
        checkpoints) and start its worker processes. `kwargs` are the engine options, the CLI's flags with underscores
        (num_gpus, performance_mode, attention_backend, warmup_mode, device, ...; docs/cli.md lists them), typed
        for checkers by `EngineOptions`. A bad option raises ValueError before anything loads, naming the keywords
        (e.g. `num_gpus=4`); request parameters (prompt, seed, ...) go to `generate`.

        SGLang's two other arguments are taken as it defines them: `server_args`, the engine options as a dict
        (`model_path` may be one of them), under the keyword arguments (a keyword given in both wins, as SGLang's
        doc ranks them); `local_mode=True`, the only mode, as the workers always run here."""
        with reworded_errors(flags_as_keywords):
            _check_local_mode(local_mode)
            options = _options_with_server_args(server_args, kwargs)
            model_path = _model_path_of(model_path, options)
            _warn_without_media_package()
            return cls._load(model_path, options, wording=flags_as_keywords)

    @classmethod
    def from_server_args(cls, server_args: Mapping[str, Any], local_mode: bool = True) -> "DiffGenerator":
        """SGLang's other constructor: `from_pretrained(server_args=server_args)`, the model path among them."""
        return cls.from_pretrained(server_args=server_args, local_mode=local_mode)

    @classmethod
    def from_cli_options(cls, model_path: str, **options: Any) -> "DiffGenerator":
        """`from_pretrained` for `k6serve generate`: the same checks and load, and a generator whose errors and
        warnings name the flags the options came from."""
        return cls._load(model_path, options, wording=str)

    @classmethod
    def _load(cls, model_path: str, options: dict[str, Any], *, wording: Callable[[str], str]) -> "DiffGenerator":
        config = build_engine_config(model_path, **options)
        note = ignored_revision_note(config.model.model_path, config.model.revision, config.model.load_format)
        if note is not None:
            logger.warning(wording(note))  # before the load, which can take minutes
        check_start_adapter(config)  # a bad --lora-path adapter: refused now, not after the load
        # A generator whose every replica died holds no model (its processes are gone): not counted.
        running = sorted(generator.engine.config.model.model_path for generator in list(_RUNNING)
                         if len(generator.engine.dead_replicas()) < generator.engine.num_replicas)
        if running:
            logger.warning(
                f"{len(running)} generator(s) loaded earlier ({', '.join(map(repr, running))}) still hold their "
                "model and its memory until shut down; this one loads beside them. Call shutdown() on one you are "
                "replacing first (or open generators with `with DiffGenerator.from_pretrained(...) as generator:`).")
        return cls(Engine(config), wording=wording)

    @property
    def variant(self) -> Variant:
        """The loaded checkpoint's model variant (its family, defaults and limits)."""
        return self.engine.variant

    if not typing.TYPE_CHECKING:  # hidden from type checkers, which would otherwise take any attribute as valid
        def __getattr__(self, name: str) -> Any:
            # Only for names the instance lacks: SGLang's generate_with_lora got a bare AttributeError.
            if name == "generate_with_lora":
                raise AttributeError(
                    "'DiffGenerator' object has no attribute 'generate_with_lora' (SGLang's method; load the adapter "
                    "with set_lora(nickname, path, merge_mode='dynamic'), then generate(prompt=..., loras={nickname: "
                    "strength}) for that request alone, or generate() with the adapters set_lora made active)",
                    name=name, obj=self)
            raise AttributeError(f"'DiffGenerator' object has no attribute {name!r}", name=name, obj=self)

    def __repr__(self) -> str:
        # A notebook shows this for a bare `generator`: which model, and whether it still holds its workers.
        state = "running" if self._shutdown.alive else "shut down"
        return f"<DiffGenerator {str(self.engine.config.model.model_path)!r}, {state}>"

    def _require_running(self) -> None:
        if not self._shutdown.alive:
            raise RuntimeError("This DiffGenerator has been shut down (shutdown() or the end of its `with` block); "
                               "load a new one with DiffGenerator.from_pretrained(...).")

    @typing.overload
    def generate(self, sampling_params_kwargs: Mapping[str, Any] | SamplingParams | None = None, *,
                 prompt: list[str] | tuple[str, ...], on_progress: ProgressCallback | None = None,
                 progress_bar: bool = False, **kwargs: Unpack[PromptListOptions]) -> list[VideoResult]: ...

    @typing.overload
    def generate(self, sampling_params_kwargs: PromptListRequest, *, on_progress: ProgressCallback | None = None,
                 progress_bar: bool = False, **kwargs: Unpack[PromptListOptions]) -> list[VideoResult]: ...

    @typing.overload
    def generate(self, sampling_params_kwargs: GenerateKwargs | SamplingParams | None = None, *,
                 on_progress: ProgressCallback | None = None, progress_bar: bool = False,
                 **kwargs: Unpack[GenerateKwargs]) -> VideoResult: ...

    @typing.overload
    def generate(self, sampling_params_kwargs: Mapping[str, Any], *, prompt: str | None,
                 on_progress: ProgressCallback | None = None, progress_bar: bool = False,
                 **kwargs: Unpack[PromptListOptions]) -> VideoResult: ...

    # An untyped dict (`dict[str, Any]`, or the `dict[str, object]` a dict of mixed values is inferred as) may hold
    # a list of prompts, which a checker cannot see: one result or a list, as at run time.
    @typing.overload
    def generate(self, sampling_params_kwargs: Mapping[str, Any], *, on_progress: ProgressCallback | None = None,
                 progress_bar: bool = False,
                 **kwargs: Unpack[PromptListOptions]) -> VideoResult | list[VideoResult]: ...

    @_in_callers_words
    def generate(self, sampling_params_kwargs: Mapping[str, Any] | SamplingParams | None = None, *,
                 on_progress: ProgressCallback | None = None, progress_bar: bool = False,
                 **kwargs: Any) -> VideoResult | list[VideoResult]:
        """Run one request and return its `VideoResult`; a list of prompts runs one request per prompt and returns
        their results in a list (`_each_prompt`). The request is a dict (the seed's sampling_params_kwargs),
        keyword arguments, or both (keywords win): every SamplingParams field plus save_output (default True),
        output_path (default "outputs"), output_file_name, return_frames and return_file_paths_only (the seed's
        names); None for any of them means its default. The frames and the waveform are returned with
        return_frames=True or return_file_paths_only=False, and with save_output=False unless return_frames=False
        (without a file they are the result). A `SamplingParams` object (the class is exported)
        stands for the fields it sets away from their defaults.

        The request and the output are checked before it runs: bad input raises ValueError naming the key and the
        fix, and writes nothing. `on_progress(step, total)` runs after every denoising step (SR: every DiT call),
        then again with `(total, total)` after each chunk of the video decode; raising from it (or Ctrl-C) stops
        the request there, with no file left behind. `progress_bar=True` shows the CLI's bar over the steps on
        stderr (in a notebook, under the cell), beside any on_progress. Several threads may call this at once:
        requests run in order (N at a time with dp_size=N). A list of prompts runs N at a time with dp_size=N too:
        on_progress then hears every running prompt's steps, interleaved, and the bar counts finished prompts.
        From asyncio code, `await generator.agenerate(...)`."""
        if (listed := self._each_prompt(sampling_params_kwargs, on_progress, kwargs)) is not None:
            if self.engine.num_replicas > 1 and len(listed) > 1:
                self.engine.check_not_own_thread("a request")  # as Engine.generate: the list waits on its replicas
                return self._side_by_side(listed, on_progress, progress_bar, threading.Event())
            results: list[VideoResult] = []
            for params, output, warnings in listed:
                # The bar first: a bad progress_bar is refused as it is, not as a prompt that stopped the list.
                with self._step_bar(on_progress, progress_bar) as on_step, stopped_list(listed, results):
                    results.append(self.engine.generate(params, output, on_progress=on_step))
                results[-1].notes[:0] = warnings
            return results
        params, output, warnings = self._checked_request(sampling_params_kwargs, on_progress, kwargs)
        with self._step_bar(on_progress, progress_bar) as on_step:
            result = self.engine.generate(params, output, on_progress=on_step)
        result.notes[:0] = warnings
        return result

    @typing.overload
    async def agenerate(self, sampling_params_kwargs: Mapping[str, Any] | SamplingParams | None = None, *,
                        prompt: list[str] | tuple[str, ...], on_progress: ProgressCallback | None = None,
                        progress_bar: bool = False, **kwargs: Unpack[PromptListOptions]) -> list[VideoResult]: ...

    @typing.overload
    async def agenerate(self, sampling_params_kwargs: PromptListRequest, *, on_progress: ProgressCallback | None = None,
                        progress_bar: bool = False, **kwargs: Unpack[PromptListOptions]) -> list[VideoResult]: ...

    @typing.overload
    async def agenerate(self, sampling_params_kwargs: GenerateKwargs | SamplingParams | None = None, *,
                        on_progress: ProgressCallback | None = None, progress_bar: bool = False,
                        **kwargs: Unpack[GenerateKwargs]) -> VideoResult: ...

    @typing.overload
    async def agenerate(self, sampling_params_kwargs: Mapping[str, Any], *, prompt: str | None,
                        on_progress: ProgressCallback | None = None, progress_bar: bool = False,
                        **kwargs: Unpack[PromptListOptions]) -> VideoResult: ...

    # An untyped dict (`dict[str, Any]`, or the `dict[str, object]` a dict of mixed values is inferred as) may hold
    # a list of prompts, which a checker cannot see: one result or a list, as at run time.
    @typing.overload
    async def agenerate(self, sampling_params_kwargs: Mapping[str, Any], *, on_progress: ProgressCallback | None = None,
                        progress_bar: bool = False,
                        **kwargs: Unpack[PromptListOptions]) -> VideoResult | list[VideoResult]: ...

    @_in_callers_words
    async def agenerate(self, sampling_params_kwargs: Mapping[str, Any] | SamplingParams | None = None, *,
                        on_progress: ProgressCallback | None = None, progress_bar: bool = False,
                        **kwargs: Any) -> VideoResult | list[VideoResult]:
        """`generate` for asyncio code (a web app, a notebook's event loop): the same request, checks and result,
        awaited without blocking the loop. Cancelling the awaiting task (asyncio.wait_for's timeout, task.cancel())
        cancels the request at its next step boundary, with no file left behind; several may be awaited at once
        (asyncio.gather), run in order as threads' generate() calls are. Super-resolution: pass video_path=."""
        if (listed := self._each_prompt(sampling_params_kwargs, on_progress, kwargs)) is not None:
            if self.engine.num_replicas > 1 and len(listed) > 1:
                import asyncio

                self.engine.check_not_own_thread("a request")  # as Engine.agenerate: the list waits on its replicas
                stop = threading.Event()
                try:
                    return await asyncio.to_thread(self._side_by_side, listed, on_progress, progress_bar, stop)
                except asyncio.CancelledError:
                    stop.set()  # the thread stops the running prompts at their next step
                    raise
            results: list[VideoResult] = []
            for params, output, warnings in listed:
                # The bar first: a bad progress_bar is refused as it is, not as a prompt that stopped the list.
                with self._step_bar(on_progress, progress_bar) as on_step, stopped_list(listed, results):
                    results.append(await self.engine.agenerate(params, output, on_progress=on_step))
                results[-1].notes[:0] = warnings
            return results
        params, output, warnings = self._checked_request(sampling_params_kwargs, on_progress, kwargs)
        with self._step_bar(on_progress, progress_bar) as on_step:
            result = await self.engine.agenerate(params, output, on_progress=on_step)
        result.notes[:0] = warnings
        return result

    def _side_by_side(self, listed: Listed, on_progress: ProgressCallback | None, progress_bar: bool,
                      stop: threading.Event) -> list[VideoResult]:
        """A list on dp replicas (`prompt_lists.run_side_by_side`); `progress_bar` counts finished prompts, since
        the running prompts' steps would move one bar back and forth."""
        from k6serve.step_bar import StepBar

        with self._step_bar(on_progress, False) as on_step:  # on_progress's step-0 filter, as for one prompt
            _check_progress_bar(progress_bar)
            bar = StepBar("prompts", unit="prompt") if progress_bar else None
            try:
                return run_side_by_side(self.engine, listed, on_step, bar, stop)
            finally:
                if bar is not None:
                    bar.close()

    @contextlib.contextmanager
    def _step_bar(self, on_progress: ProgressCallback | None, progress_bar: bool):
        """`on_progress`, and with `progress_bar` the bar fed first (a callback that raises to stop the request
        leaves the bar at the step it stopped), closed when the request ends however it ends."""
        _check_progress_bar(progress_bar)
        # The engine also reports step 0, as a cancellation point before the first step (a warm-up, the prompt's
        # rewrite every 16 tokens); on_progress's contract is steps counting from 1 (an ETA callback divided by the
        # step). A cancel still reaches those points through the engine's own check.
        user = None if on_progress is None else (
            lambda step, total: on_progress(step, total) if step > 0 else None)
        if not progress_bar:
            yield user
            return
        from k6serve.step_bar import StepBar

        bar = StepBar("denoising" if self.engine.variant.family == GENERATION else "super-resolution")

        def on_step(step: int, total: int) -> None:
            bar.update(step, total)
            if user is not None:
                user(step, total)

        try:
            yield on_step
        finally:
            bar.close()

    def _each_prompt(self, sampling_params_kwargs: Mapping[str, Any] | SamplingParams | None,
                     on_progress: ProgressCallback | None, kwargs: dict[str, Any]
                     ) -> list[tuple[SamplingParams, OutputOptions, list[str]]] | None:
        """A request whose prompt is a list (or tuple) as one checked request per prompt, else None. The seed's
        `generate` takes a list, one request per prompt, run in order (a diffusers batch would draw its own noise,
        which no seed reproduces): every prompt is checked before the first runs, so a bad one raises before any
        work, naming its place in the list; a given output_file_name is numbered per prompt as the CLI's prompt
        file numbers it (clip.mp4 -> clip_1.mp4, clip_2.mp4); the seed (and -1, drawn for each) is every prompt's.
        The seed's generate logs a failing prompt and goes on; here the failure stops the list and raises, with a
        note of what had finished (`prompt_lists.stopped_list`), since a list whose results silently miss one
        misnumbers the rest. The prompts run one at a time; with dp_size=N, N at a time, one per replica
        (`prompt_lists.run_side_by_side`), their results still in the list's order."""
        # A pathlib output_file_name (taken as a str) and np.False_ as save_output are read as they are for one prompt:
        # a Path was not numbered, so the second prompt's video was moved on to clip_1.mp4 beside the first's clip.mp4.
        options = fspath_values(plain_scalars(request_options(sampling_params_kwargs, kwargs)))
        prompts = options.get("prompt")
        if not isinstance(prompts, (list, tuple)):
            return None
        if not prompts:
            raise ValueError("prompt is an empty list: pass one prompt as a string, or a list of at least one.")
        if self.engine.variant.family != GENERATION:
            raise ValueError("prompt is a list, which runs one generation per prompt, and the super-resolution model "
                             "takes no prompt: upscale one video a call (video_path='/path/to/input.mp4').")
        name, name_warning = options.get("output_file_name"), None
        names: list[str | None] = [None] * len(prompts)
        if isinstance(name, str) and options.get("save_output") is not False and len(prompts) > 1:
            final, name_warning = final_file_name(name)  # said once, of the name given, before it is numbered
            names = numbered_file_names(final, len(prompts))
            if name_warning:
                # Logged as one prompt's check logs its warnings; each result's notes keep it too.
                logger.warning(name_warning)
        listed = []
        said: set[str] = set()  # a warning every prompt gets (save_output=False with an output_path) is logged once
        for index, (prompt, numbered) in enumerate(zip(prompts, names)):
            each = {**options, "prompt": prompt, **({"output_file_name": numbered} if numbered else {})}
            try:
                params, output, warnings = self._checked_request(each, on_progress, {}, said=said)
            except ValueError as exc:
                raise ValueError(f"prompt {index} of the list ({_shown_prompt(prompt)}): {exc}") from None
            listed.append((params, output, [name_warning, *warnings] if name_warning else warnings))
        return listed

    def _checked_request(self, sampling_params_kwargs: Mapping[str, Any] | SamplingParams | None,
                         on_progress: ProgressCallback | None, kwargs: dict[str, Any], *, said: set[str] | None = None
                         ) -> tuple[SamplingParams, OutputOptions, list[str]]:
        """`generate`'s request as (params, output, warnings), checked: raises ValueError before anything runs. The
        warnings are logged, except those already in `said` (a list's earlier prompts logged them), which are added
        to it; all of them are returned, for the result's notes."""
        self._require_running()
        if on_progress is not None and not callable(on_progress):
            raise ValueError(f"on_progress must be a function called as on_progress(step, total), got "
                             f"{on_progress!r} ({type(on_progress).__name__}).")
        if inspect.iscoroutinefunction(on_progress) or inspect.iscoroutinefunction(
                getattr(on_progress, "__call__", None)):
            # Called, it only makes a coroutine nobody awaits: no progress, and "never awaited" warnings.
            raise ValueError("on_progress is an async function; it is called on the engine's thread, outside any "
                             "event loop, so pass a plain function (to reach a loop from it, use "
                             "loop.call_soon_threadsafe).")
        if on_progress is not None:
            try:
                inspect.signature(on_progress).bind(1, 1)
            except TypeError:
                # diffusers' callback_on_step_end(pipe, i, t, kwargs) failed only after the encoders and the first
                # step had run (minutes on a real model), as a bare TypeError.
                raise ValueError("on_progress is called as on_progress(step, total) after each denoising step (step "
                                 "counts from 1; raise from it to stop the request), not as diffusers' "
                                 "callback_on_step_end(pipe, i, t, callback_kwargs); pass a function of two "
                                 "arguments.") from None
            except ValueError:
                pass  # no signature to read (some builtins): called as given
        # Paths as str here too: a warning naming a pathlib output_path showed "output_path=PosixPath('out')".
        options = fspath_values(self._from_callers_folder(request_options(sampling_params_kwargs, kwargs)))
        params, output = split_kwargs(options)
        params, seed_note = drawn_seed(params)  # once, here: the result reports the seed drawn
        require_media_package(params, output)
        try:
            self.engine.resolve(params)  # the worker resolves it again; here the two missing inputs get API words
        except MissingPrompt as exc:
            raise MissingPrompt("prompt is required for Kandinsky 6 generation: pass prompt='A cat plays piano'.",
                                detail=exc.detail) from None
        except MissingSourceVideo:
            raise MissingSourceVideo("super-resolution needs one source video: pass video_path='/path/to/input.mp4' "
                                     "(or call generator.upscale('/path/to/input.mp4')).") from None
        output, warnings = check_output(output)
        warnings += [f"{key}={options[key]!r} is ignored: save_output=False writes no file."
                     for key in unsaved_output_keys(options)]
        for warning in warnings:
            if said is None or warning not in said:
                logger.warning(warning)
        if said is not None:
            said.update(warnings)
        if seed_note:
            logger.debug(seed_note)  # news, not a warning: it reaches the caller as a note of the result
            warnings.append(seed_note)
        return params, output, warnings

    def _from_callers_folder(self, options: dict[str, Any]) -> dict[str, Any]:
        """`options` with relative paths made absolute from the caller's folder when it is not the one the workers
        started in: after a chdir, the caller's check created an empty output folder here and the MP4 was written
        there (its returned path a relative one that did not exist from here), and a source here "did not exist".
        Unchanged otherwise, so paths (and the messages naming them) stay as given."""
        if not self._moved():
            return options
        options = dict(options)
        if options.get("output_path") is None and options.get("save_output") is not False:
            options["output_path"] = OutputOptions().output_path
        for key in ("image_path", "video_path", "output_path"):
            if key in options:
                options[key] = _from_here(options[key], existing_only=False)
        return options

    def _moved(self) -> bool:
        """Whether this process is in another folder than the one the workers started in (False when its folder
        was deleted: paths are then left to fail as they are)."""
        try:
            return os.getcwd() != self._start_folder
        except FileNotFoundError:
            return False

    def upscale(self, video_path: str | os.PathLike[str] | None = None, *,
                on_progress: ProgressCallback | None = None, progress_bar: bool = False,
                **kwargs: Unpack[RequestOptions]) -> VideoResult:
        """Super-resolution convenience (the VSR checkpoint): `generate(video_path=..., **kwargs)`, e.g. with
        sr_resolution_scale=2, seed, output_path; the same progress callback and bar."""
        # Without a path the request is generate's to refuse: diffusers' `upscale(video=...)` then gets its note
        # (pass video_path=) instead of Python's "missing 1 required positional argument".
        request: Mapping[str, Any] = kwargs if video_path is None else {"video_path": video_path, **kwargs}
        # One result, as typed: `RequestOptions` holds no prompt, so no list of them (a list prompt slipped in by an
        # untyped caller is refused by the super-resolution model, which upscale is for).
        return typing.cast(VideoResult, self.generate(request, on_progress=on_progress, progress_bar=progress_bar))

    @_in_callers_words
    @_http_names_answered
    @_sglang_order_answered
    def set_lora(self, nickname: str | list[str], path: LoraPaths = None,
                 strength: float | Sequence[float] = 1.0, *, merge_mode: str = "auto", target: str | list[str] = "all",
                 lora_alpha: float | None = None) -> dict[str, Any]:
        """Make `nickname` (or a list of nicknames) the active LoRA adapters, replacing the previous ones.

        `path` is a .safetensors file, a folder holding one, or a hub id, loaded under the nickname; None reuses the
        adapter already loaded under it (a list gives one entry per nickname). `strength` scales each adapter (one
        number for all, or a list; each from -100 to 100, `MAX_LORA_STRENGTH`). `merge_mode`: "merge" adds
        strength * (alpha / rank) * B @ A into the weights (no per-step cost), "dynamic" leaves the weights untouched
        and adds the adapter's output in every forward (cheap to change or stack), "auto" merges unless the weights
        are sharded by FSDP. `lora_alpha` overrides the alpha stored in the file (from -10000 to 10000,
        `MAX_LORA_ALPHA`). `target`: "all" or "transformer" (the one DiT), or one of them per adapter (SGLang's
        list). Runs after the requests already submitted and before later ones, on every replica; returns
        `{"status": "ok", "message": ..., "loras": [...]}`. Bad input raises ValueError and changes nothing."""
        self._require_running()
        if self._moved():  # a relative adapter path from the caller's folder, as a request's; a hub id as it is
            # A tuple too (it is taken as a list): its relative paths were left as given, the workers' folder's.
            path = ([_from_here(item, existing_only=True) for item in path] if isinstance(path, (list, tuple))
                    else _from_here(path, existing_only=True))
        operation = set_lora_operation(nickname, path, strength, merge_mode=merge_mode, target=target,
                                       lora_alpha=lora_alpha)
        return self.engine.lora(operation)

    @_in_callers_words
    def merge_lora_weights(self, target: str = "all", strength: float | None = None) -> dict[str, Any]:
        """Merge the active adapters into the weights (from dynamic mode, or again at a new `strength`, from -100 to
        100). A bad target or strength raises ValueError before anything queues."""
        self._require_running()
        return self.engine.lora(merge_lora_operation(target, strength))

    @_in_callers_words
    def unmerge_lora_weights(self, target: str = "all") -> dict[str, Any]:
        """Deactivate every adapter and restore the base weights bit for bit (merged weights are restored from
        the saved base copy, not by subtracting the delta)."""
        self._require_running()
        return self.engine.lora(unmerge_lora_operation(target))

    @_in_callers_words
    @_http_names_answered
    def unload_lora(self, nickname: str | list[str]) -> dict[str, Any]:
        """Forget loaded adapters that are not active (a nickname or a list): their weights leave memory. An active
        or unknown one raises ValueError and nothing changes; deactivate it first (`set_lora` with the adapters to
        keep, or `unmerge_lora_weights`). Runs after the requests already submitted, as the other LoRA calls."""
        self._require_running()
        return self.engine.lora(unload_lora_operation(nickname))

    @_in_callers_words
    def list_loras(self) -> dict[str, Any]:
        """The loaded adapters and their state: `{"loras": [...]}`."""
        self._require_running()
        return self.engine.lora(ListLoras())

    @_in_callers_words
    def release_memory(self) -> dict[str, Any]:
        """Give the GPU memory back (sleep, e.g. to an RL trainer on the same GPUs): after the requests already
        submitted, every weight moves to host memory on every rank and the allocator caches are freed; requests
        submitted meanwhile wait for `resume_memory`. Returns each rank's report of what moved and what the process
        still holds on its GPU (docs/http-api.md, POST /release_memory_occupation). Releasing twice changes
        nothing and says so ("status": "already_released"); use_fsdp_inference=True raises ValueError."""
        self._require_running()
        return self.engine.release_memory()

    @_in_callers_words
    def resume_memory(self, *, keep_host_copy: bool = False) -> dict[str, Any]:
        """Copy the weights back to the GPUs, bit for bit; the waiting requests then run in order. Resuming while
        not released changes nothing ("status": "not_released"). `keep_host_copy=True` keeps the host copy (host
        memory stays taken), so the next release re-points the weights to it without copying: for a loop of
        releases and resumes. A LoRA change drops it."""
        self._require_running()
        return self.engine.resume_memory(keep_host_copy=keep_host_copy)

    def shutdown(self) -> None:
        """Finish the running requests, then stop the worker processes; later requests raise RuntimeError. Calling
        it again does nothing, unless the first was interrupted (Ctrl-C while it waited): then it finishes the job.
        Requests still running after 30 s are cancelled at their next step (their callers get RequestCancelled
        saying so), and those queued behind them do not start."""
        if self._shutdown.alive:
            # Not the finalizer itself: once called it is spent even if interrupted, and the worker's ranks stayed.
            self.engine.shutdown()
            self._shutdown.detach()
        _RUNNING.discard(self)

    # `close()` is what contextlib.closing and most Python resources call; the seed's name is shutdown().
    close = shutdown

    def __enter__(self) -> "DiffGenerator":
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
