"""Request value types shared by the CLI, the Python API and the HTTP server.

`SamplingParams` is the one definition of every user-facing request parameter: the CLI builds its flags from
its fields, the HTTP schema its JSON fields, the API takes it as keyword arguments. Fields left as `None` take
the model variant's defaults when `resolve_*` turns them into a fully specified, frozen `GenerateRequest` or
`UpscaleRequest` (typed, no optional knobs left), so nothing downstream guesses.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import math
import numbers
import os
import sys
import types
import typing
import unicodedata
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

import numpy as np

from k6serve.caching.params import CacheDitParams

if typing.TYPE_CHECKING:
    from _typeshed import DataclassInstance

SR_SCALES = (2.0, 4.0, 2.25)
SR_TARGET_TIERS = ("hd", "fullhd", "2k")
SR_RESIZE_MODES = ("fit", "exact")


_PATH_FIELDS = ("image_path", "video_path", "output_path", "output_file_name")


def _check_type(name: str, value: Any, hint: Any) -> None:
    """Raise ValueError when `value` does not fit the field's type; numpy scalars count as numbers."""
    kinds = [a for a in typing.get_args(hint) if a is not type(None)] if isinstance(hint, types.UnionType) else [hint]
    kind = kinds[0]
    if kind is bool:
        ok, wanted = isinstance(value, bool), "true or false"
    elif kind is int:
        ok, wanted = isinstance(value, numbers.Integral) and not isinstance(value, bool), "an integer"
    elif kind is float:
        ok, wanted = isinstance(value, numbers.Real) and not isinstance(value, bool), "a number"
    elif kind is dict:
        ok, wanted = isinstance(value, dict), "a JSON object"
    else:
        ok, wanted = isinstance(value, kind), "a string"
    if not ok:
        raise ValueError(f"{name} must be {wanted}, got {value!r} ({type(value).__name__}).")


@functools.cache
def _type_hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _check_field_types(instance: DataclassInstance) -> None:
    hints = _type_hints(type(instance))
    for item in dataclasses.fields(instance):
        value = getattr(instance, item.name)
        if value is not None:
            _check_type(item.name, value, hints[item.name])


def _param(help_text: str, *, cli: bool = True, http: bool = True, default: Any = None) -> Any:
    return field(default=default, metadata={"help": help_text, "cli": cli, "http": http})


@dataclass(frozen=True, kw_only=True, slots=True)
class SamplingParams:
    """Every request parameter, as a user gives it. `None` means "the model variant's default"."""

    prompt: str | None = _param("Text prompt (generation models; SR takes none).")
    negative_prompt: str | None = _param(
        "Negative prompt for CFG (Pro/Lite). Default (also for an empty one): the model's built-in negative prompt."
    )
    image_path: str | None = _param("Conditioning image for text+image-to-video+audio (TI2AV).")
    video_path: str | None = _param("Source video for super-resolution (VSR models).")
    seed: int | None = _param("Random seed, 0 to 2**63 - 1 (default 42); -1 draws one, which the result reports.")
    height: int | None = _param("Output height in pixels, a multiple of 16 up to 2048 (default 512; demo 64).")
    width: int | None = _param("Output width in pixels, a multiple of 16 up to 2048 (default 768; demo 96).")
    num_frames: int | None = _param("Number of frames, of the form 4k+1 (default 121; demo 17).")
    fps: float | None = _param("Frame rate of the output, 1 to 240; sets the audio length (default 24).")
    num_inference_steps: int | None = _param(
        "Denoising steps, 1 to 1000 (Pro/Lite 50, distilled 10; VSR always runs its 2 PiFlow steps)."
    )
    guidance_scale: float | None = _param(
        "Classifier-free guidance scale (Pro/Lite 5.0; distilled models require exactly 1.0)."
    )
    sr_resolution_scale: float | None = _param("VSR upscale factor: 2, 4 or 2.25 (default 2.25).")
    sr_tiles_batch_size: int | None = _param(
        "VSR tiles per DiT call (default 1). Each chunk is seeded by its first tile index, so this changes the noise."
    )
    sr_tile_min_overlap: float | None = _param("VSR minimum tile overlap in [0, 1) (default 0.2).")
    sr_target_resolution: str | None = _param(
        "VSR delivery size, downscale only: hd (1280x720), fullhd (1920x1080), 2k (2560x1440; each also square and "
        "portrait, the one closest in aspect taken) or WxH with even sides of at least 16 (default: none)."
    )
    sr_target_resize_mode: str | None = _param(
        "VSR target resize mode, with sr_target_resolution (--sr-target-resolution): fit (default) or exact.")
    enable_cache_dit: bool | None = _param(
        "Cache-DiT step caching (generation models): on steps whose first DiT blocks barely changed the output, "
        "skip the middle blocks and reuse their last residual. Faster, lossy, meant for the 50-step Pro/Lite. "
        "Default: on exactly when the engine has --cache-dit-config; cache_dit_params alone also turns it on."
    )
    cache_dit_params: dict | None = _param(
        "Cache-DiT settings for this request, over the engine's (a JSON object with cache-dit's names, e.g. "
        '{"Fn_compute_blocks": 1, "residual_diff_threshold": 0.24, "scm_preset": "medium"}; docs/cli.md lists '
        "them)."
    )
    loras: dict | None = _param(
        "LoRA adapters for this request only (generation models): a JSON object {nickname: strength} of adapters "
        "already loaded on the engine (--lora-path or set_lora), each strength from -100 to 100 (adapters are used "
        "at about -2 to 2); {} runs the base model. Added dynamically; the engine's active adapters return after "
        "the request. Needs them unmerged (dynamic or none)."
    )
    sample_audio: bool | None = _param(
        "Generate the soundtrack (default on). Off: a silent video, its DiT run on the video tokens alone, as "
        "diffusers' sample_audio=False (the picture differs from the one made with sound, which it attends to; no "
        "audio decode, and no fps floor for long clips). Generation models."
    )
    max_sequence_length: int | None = _param(
        "Prompt tokens (Qwen2.5-VL) the model reads, 1 to 1024 (default 1024, as diffusers'); a longer prompt is cut, "
        "with a note. With expand_prompts also the most tokens the rewrite writes. Generation models."
    )
    expand_prompts: bool | None = _param(
        "Rewrite the prompt with the Qwen2.5-VL text encoder before encoding it, as diffusers' expand_prompts does "
        "(a \"prompt beautifier\" instruction; with image_path the image grounds the rewrite): a short prompt "
        "becomes a detailed video+audio description. Generation models; seeded by the request's seed; the "
        "rewritten prompt comes back in the result. Default off."
    )
    save_output: bool = _param(
        "Write the MP4 file (default). --no-save-output runs the request for its timings only: the video is "
        "discarded.", default=True, http=False
    )
    output_path: str = _param(
        "Folder for output files (default outputs; created if missing).", default="outputs", http=False
    )
    output_file_name: str | None = _param(
        "Output file name, without folders; .mp4 is added, and characters other than letters and digits (of any "
        "script), '.', '_' and '-' become '_' (with a warning). An existing file is an error, never overwritten "
        "(default: derived from the prompt and seed, or the SR source, and the time, with _1, _2... when taken).",
        http=False,
    )
    # Python API only: a command line has nowhere to put the arrays.
    return_frames: bool = _param(
        "Return decoded frames and the waveform in the result (default: only with save_output=False, where they are "
        "the result).", default=False, cli=False, http=False
    )
    return_file_paths_only: bool = _param(
        "Return only the output file path (no frames).", default=True, cli=False, http=False
    )

    def __post_init__(self) -> None:
        # A wrong type would otherwise surface as a TypeError deep in a worker process, or worse, run: the string
        # "no" is a true save_output.
        if isinstance(self.prompt, (list, tuple)) and all(isinstance(item, str) for item in self.prompt):
            # generate() takes such a list, one request per prompt; one SamplingParams is one request.
            raise ValueError(f"prompt must be a string, got a list of {len(self.prompt)}: a SamplingParams is one "
                             "request; pass the list to generate(prompt=[...]), which runs one request per prompt.")
        _check_field_types(self)

    @classmethod
    def from_kwargs(cls, kwargs: dict[str, Any]) -> "SamplingParams":
        """Build from a dict, rejecting unknown keys with the list of valid ones; `pathlib.Path` values of the
        *_path keys become strings."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            # SGLang's names (guidance_rescale) get what to use instead; it imports this module, hence here.
            from k6serve.reference_names import unknown_names_hint

            raise ValueError(
                f"Unknown sampling parameter(s) {unknown}{unknown_names_hint(unknown, names, surface='api')}. "
                f"Valid parameters: {sorted(names)}."
            )
        return cls(**fspath_values(plain_scalars(kwargs)))


_Path = str | os.PathLike[str]


class RequestOptions(typing.TypedDict, total=False):
    """`upscale`'s keyword arguments, for type checkers and IDEs: the `SamplingParams` fields but `prompt` and
    `video_path` (its own argument), as `generate` takes them (paths as `pathlib.Path` too; None for any of them
    means its default). tests/unit/test_api_types.py keeps the keys and types in step with `SamplingParams`."""

    negative_prompt: str | None
    image_path: _Path | None
    seed: int | None
    height: int | None
    width: int | None
    num_frames: int | None
    fps: float | None
    num_inference_steps: int | None
    guidance_scale: float | None
    sr_resolution_scale: float | None
    sr_tiles_batch_size: int | None
    sr_tile_min_overlap: float | None
    sr_target_resolution: str | None
    sr_target_resize_mode: str | None
    enable_cache_dit: bool | None
    cache_dit_params: dict[str, Any] | None
    loras: dict[str, Any] | None
    sample_audio: bool | None
    max_sequence_length: int | None
    expand_prompts: bool | None
    save_output: bool | None
    output_path: _Path | None
    output_file_name: _Path | None
    return_frames: bool | None
    return_file_paths_only: bool | None


class PromptListOptions(RequestOptions, total=False):
    """`generate`'s keyword arguments beside a list of prompts: `RequestOptions` and `video_path`."""

    video_path: _Path | None


class GenerateKwargs(PromptListOptions, total=False):
    """`generate`'s and `agenerate`'s keyword arguments: every `SamplingParams` field, as `RequestOptions`
    describes them; e.g. `options: GenerateKwargs = {"prompt": "A cat", "seed": 7}; generator.generate(**options)`.
    Also the type of a request dict of one prompt written in the call, `generator.generate({"prompt": "A cat"})`,
    typed as returning one `VideoResult` (a variable of this type is best unpacked, `generate(**options)`: passed
    whole, mypy takes the `Any` in its values as a reason to answer `Any`). An untyped dict of mixed values (inferred
    `dict[str, object]`) goes in whole too, `generator.generate(options)`, but its prompt may be a list, so the
    checker's result is `VideoResult | list[VideoResult]`."""

    prompt: str | None


class PromptListRequest(PromptListOptions, total=False):
    """A request dict whose prompt is a list of prompts (`generate({"prompt": ["A cat", "A dog"], "seed": 7})`),
    which `generate` runs as one request per prompt and answers with a list: the dict type its overload reads."""

    prompt: typing.Required[list[str] | tuple[str, ...]]


class FlagWorded(ValueError):
    """A refused request whose message names the request's fields, as the Python API and the HTTP server take them
    (`enable_cache_dit false`), with `flag_wording`, the same refusal in `k6serve generate`'s flags
    (`--no-enable-cache-dit`): the CLI catches this type and prints that, so neither surface reads the other's
    names. The worker's process boundary keeps the type (`rank_process._classify`, then
    `replica_failures.failure_error`)."""

    def __init__(self, message: str, *, flag_wording: str | None = None) -> None:
        # The message is the one positional argument, as in any ValueError: copy and pickle rebuild it from `args`
        # (and `flag_wording` from the instance's __dict__).
        super().__init__(message)
        self.flag_wording = flag_wording or message

    @classmethod
    def naming(cls, words: typing.Callable[[FieldNames], str]) -> typing.Self:
        """The refusal that `words` writes with the names it is handed: the fields' (`FIELD_NAMES`) for the message,
        the flags' (`FLAG_NAMES`) for `flag_wording`. One template, so the two wordings differ only in the names and
        cannot drift apart."""
        return cls(words(FIELD_NAMES), flag_wording=words(FLAG_NAMES))


class FieldNames:
    """How a refusal names a request field: as the Python API and the HTTP server take it (`sample_audio`,
    `sample_audio false`); `FLAG_NAMES` names it as `k6serve generate`'s flag instead."""

    def __call__(self, field: str, given: bool | None = None) -> str:
        """`field` itself; `given`, a boolean field's value, picks the flag that was typed (`--no-sample-audio`)."""
        return field

    def set_to(self, field: str, value: bool) -> str:
        """A boolean field set to `value`: `enable_cache_dit false`, `--no-enable-cache-dit`."""
        return f"{field} {str(value).lower()}"

    def entry(self, field: str, key: str) -> str:
        """One key of an object field: `loras['style']`, `'style' in --loras`."""
        return f"{field}[{key!r}]"


class _FlagNames(FieldNames):
    # The CLI builds each request field's flag as --field-name (cli/flags.py add_request_flags), a boolean's as
    # --x / --no-x (argparse's BooleanOptionalAction).
    def __call__(self, field: str, given: bool | None = None) -> str:
        return ("--no-" if given is False else "--") + field.replace("_", "-")

    def set_to(self, field: str, value: bool) -> str:
        return self(field, value)

    def entry(self, field: str, key: str) -> str:
        # The flag takes the whole object as JSON (--loras '{"style": 0.8}'): `--loras['style']` is nothing typed.
        return f"{key!r} in {self(field)}"


FIELD_NAMES, FLAG_NAMES = FieldNames(), _FlagNames()


def error_type_name(error: BaseException) -> str:
    """The type name a message shows for `error`: a `FlagWorded` refusal (AudioTooLong, ...) is the ValueError the
    API documents and callers catch; its own class name read as an internal type in a bench row ("FlagWorded: ...")."""
    return "ValueError" if isinstance(error, FlagWorded) else type(error).__name__


class FlagWordedNote(str):
    """A note (a warning in a result's `notes`, not a refusal) that names request fields as `FlagWorded` does: the
    string itself in the fields' names, for the Python API and the HTTP server, and `flag_wording` in `k6serve
    generate`'s flags, which the CLI prints (`note_for_cli`). A str, so every other reader (JSON, the jobs' store,
    comparisons) takes it as any note; pickle keeps `flag_wording` across the ranks' process boundary (str's
    `__getnewargs__` rebuilds the text, the instance's __dict__ the rest)."""

    flag_wording: str

    @classmethod
    def naming(cls, words: typing.Callable[[FieldNames], str]) -> typing.Self:
        """The note that `words` writes with the fields' names and, as `flag_wording`, with the flags'."""
        note = cls(words(FIELD_NAMES))
        note.flag_wording = words(FLAG_NAMES)
        return note


def note_for_cli(note: str) -> str:
    """How `k6serve generate` words `note`: its flags' wording where it names request fields, else as it is."""
    return getattr(note, "flag_wording", note)


# seed -1: the request runs with a seed drawn for it (the convention of ComfyUI's and A1111's UIs, fal's API); the
# result, the job and the file name carry the seed drawn, so the video can be made again.
RANDOM_SEED = -1


def drawn_seed(params: SamplingParams) -> tuple[SamplingParams, str | None]:
    """`params` with seed -1 replaced by a seed drawn for this request (below 2**32, all of which torch's CPU
    generator keeps), and a note saying which; as given otherwise. Drawn once where a request enters (the API's
    generate, the server's job creation), so every rank and every later resolve run the same seed."""
    if params.seed != RANDOM_SEED:
        return params, None
    import secrets

    seed = secrets.randbelow(2**32)
    note = FlagWordedNote.naming(lambda name: f"{name('seed')} -1 drew seed {seed}: pass {name('seed')} {seed} to "
                                              "make this video again.")
    return dataclasses.replace(params, seed=seed), note


def plain_scalars(kwargs: dict[str, Any]) -> dict[str, Any]:
    """numpy scalars as the Python values they stand for: a seed from np.random, a size from an array's shape or a
    flag from a comparison are not int or bool, and the type checks refused np.int64(3) and np.True_."""
    return {k: v.item() if isinstance(v, np.generic) else v for k, v in kwargs.items()}


def did_you_mean(unknown: list[str], names: typing.Iterable[str], *, name_each: bool = False) -> str:
    """' (did you mean ...?)' for the unknown names that resemble a known one (a typo), else ''; `name_each` says
    which name each guess is for also when there is one (the message lists other unknown names)."""
    matches = {name: difflib.get_close_matches(name, sorted(names), n=1) for name in unknown}
    guesses = {name: close[0] for name, close in matches.items() if close}
    if not guesses:
        return ""
    if len(unknown) == 1 and not name_each:
        return f" (did you mean {next(iter(guesses.values()))!r}?)"
    return " (did you mean " + ", ".join(f"{close!r} for {name!r}" for name, close in guesses.items()) + "?)"


def fspath_values(kwargs: dict[str, Any]) -> dict[str, Any]:
    """`os.PathLike` values of the path keys as strings (the typed fields hold `str`)."""
    return {k: os.fspath(v) if k in _PATH_FIELDS and isinstance(v, os.PathLike) else v for k, v in kwargs.items()}


def parameter_fields(*, surface: str) -> list[dataclasses.Field]:
    """The SamplingParams fields exposed on one surface ("cli" or "http")."""
    return [f for f in dataclasses.fields(SamplingParams) if f.metadata.get(surface, False)]


@dataclass(frozen=True, kw_only=True, slots=True)
class GenerateRequest:
    """A fully resolved T2AV / TI2AV request."""

    prompt: str
    negative_prompt: str | None  # None exactly when guidance is off (no negative branch is encoded)
    image_path: str | None
    seed: int
    height: int
    width: int
    num_frames: int
    fps: float
    num_inference_steps: int
    guidance_scale: float
    with_audio: bool = True  # sample_audio: the soundtrack is generated (where the checkpoint has its audio parts)
    sample_audio_asked: bool = False  # sample_audio=True given: a checkpoint without audio parts is refused
    cache_dit: CacheDitParams | None = None  # Cache-DiT settings, or None for an uncached request
    loras: tuple[tuple[str, float], ...] | None = None  # this request's adapters, or None: the engine's active ones
    expand_prompts: bool = False  # rewrite the prompt with Qwen2.5-VL first (pipelines/expand_prompt.py)
    max_sequence_length: int = 1024  # Qwen2.5-VL prompt tokens read (and the rewrite's most new tokens)

    @property
    def do_cfg(self) -> bool:
        return self.guidance_scale > 1.0

    @property
    def num_latent_frames(self) -> int:
        return (self.num_frames - 1) // 4 + 1


@dataclass(frozen=True, kw_only=True, slots=True)
class UpscaleRequest:
    """A fully resolved video super-resolution request."""

    video_path: str
    scale: float
    tiles_batch_size: int
    tile_min_overlap: float
    target_resolution: str | None
    target_resize_mode: str
    seed: int
    requested_steps: int | None  # what the user asked for; the checkpoint's PiFlow nfe is what runs


@dataclass(frozen=True, kw_only=True, slots=True)
class OutputOptions:
    """Where and whether to write the result."""

    save_output: bool = True
    output_path: str = "outputs"
    output_file_name: str | None = None
    return_frames: bool = False

    def __post_init__(self) -> None:
        _check_field_types(self)


# Called with (steps done, steps in all) after each denoising step (and decode chunk), by every layer that passes it
# down: the API, the engine, the workers, the pipelines. What it returns is ignored: a checker takes a callback that
# returns something (`lambda s, t: bar.update(1)`).
ProgressCallback = typing.Callable[[int, int], object]


# The entries of `VideoResult.timings` that are counts, not seconds: printed as whole numbers (the CLI's table, the
# bench's notes).
TIMING_COUNTS = ("graphs_compiled", "cache_dit_cached_calls")


@dataclass(kw_only=True, repr=False)
class VideoResult:
    """What a finished request returns to the caller.

    `frames` and `audio` are None unless the request asked for them (return_frames=True, or the seed's
    return_file_paths_only=False) or wrote no file (save_output=False, unless return_frames=False);
    `output_file_path` is None with save_output=False. `timings` are seconds:
    generation has "encode", "denoise" (with "denoise_per_step", "denoise_step_median", "denoise_step_max"),
    "decode_audio", "decode_video", with expand_prompts "expand_prompt" (the rewrite), and, with a file, "mux"
    (what the MP4 write added after the decode: the encoder runs beside it); super-resolution has "read",
    "encode", "upscale", "dit", "dit_per_call", "decode" and "mux" (without a file "blend"). "gc_freeze" (a
    collection, part of "total") comes with the first request and the first after a compilation, "warmup" with the
    request that warmed up (warmup_mode="request"; not part of "total"), and "total" is the request's wall time in
    the worker.
    Two entries are counts, not seconds: "graphs_compiled" (torch.compile graphs built during the request) and
    "cache_dit_cached_calls" (with Cache-DiT). `peak_memory_mb`: the request's peak allocated GPU memory (on the
    CPU, the worker process's peak resident memory so far). `notes`: what the user should know (a truncated
    prompt, an ignored value, a renamed output file). `expanded_prompt`: with expand_prompts, the prompt the model
    was given, as Qwen2.5-VL rewrote it.
    """

    output_file_path: str | None
    frames: np.ndarray | None  # uint8 (T, H, W, 3)
    audio: np.ndarray | None  # float32 mono waveform
    audio_sample_rate: int
    fps: float
    seed: int
    timings: dict[str, float]
    peak_memory_mb: float
    num_frames: int
    height: int
    width: int
    has_audio: bool = False
    notes: list[str] = field(default_factory=list)
    # expand_prompts: the prompt the model was given, as Qwen2.5-VL rewrote it; None when not expanded.
    expanded_prompt: str | None = None
    # Super-resolution of a source with non-square pixels: their width over height, kept by the output (the MP4 is
    # tagged with it; scale `frames`' width by it to show them in the source's shape). None: square pixels.
    sample_aspect_ratio: Fraction | None = None
    # The generation's prompt as given (None for super-resolution, which takes none): which prompt of a list this
    # result is, as the seed's result names it.
    prompt: str | None = None

    @property
    def generation_time(self) -> float:
        """`timings["total"]`, in seconds."""
        return self.timings.get("total", math.nan)

    if not typing.TYPE_CHECKING:  # hidden from type checkers, which would otherwise take any attribute as valid
        def __getattr__(self, name: str) -> Any:
            # Only for names the instance lacks: SGLang's result fields (`result.size`) got a bare AttributeError.
            note = _SGLANG_RESULT_FIELDS.get(name)
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}"
                                 + (f" (SGLang's result field; {note})" if note else ""), name=name, obj=self)

    def __repr__(self) -> str:
        # The dataclass repr printed the arrays' values: some 60 lines of pixels in front of the timings.
        def shown(value: Any) -> str:
            return f"<{value.dtype} array {value.shape}>" if isinstance(value, np.ndarray) else repr(value)

        values = ", ".join(f"{item.name}={shown(getattr(self, item.name))}" for item in dataclasses.fields(self))
        return f"VideoResult({values})"


# SGLang's `GenerationResult` fields that `VideoResult` has under another name, or not at all.
_SGLANG_TRAJECTORY = "k6serve returns the finished video only, not the latents or frames of the intermediate steps"
_SGLANG_RESULT_FIELDS = {
    "samples": "k6serve's are frames, uint8 (frames, height, width, 3), with return_frames=True",
    "size": "k6serve's are height, width and num_frames",
    "metrics": "k6serve's are timings, seconds by stage, and peak_memory_mb",
    "prompt_index": "a list of prompts returns its results in the list's order, and each result's prompt is its own",
    "trajectory_latents": _SGLANG_TRAJECTORY,
    "trajectory_decoded": _SGLANG_TRAJECTORY,
    "trajectory_timesteps": _SGLANG_TRAJECTORY,
}


def unencodable_path(path: str) -> str | None:
    """Why `path` cannot name a file in this process, when its filesystem encoding (a non-UTF-8 locale such as
    ru_RU.CP1251, or PYTHONUTF8=0 with LANG=C) cannot hold the path's characters; None when it can. Such a path
    failed inside the library: a 500 at an HTTP image_path, "does not exist" for a LoRA file that does."""
    try:
        os.fsencode(path)
    except UnicodeEncodeError as exc:
        return (f"{path!r} has characters ({exc.object[exc.start:exc.end]!r}) that this process's filesystem "
                f"encoding, {sys.getfilesystemencoding()}, cannot hold; run it under a UTF-8 locale (e.g. "
                "LANG=C.UTF-8) or with PYTHONUTF8=1")
    return None


def has_visible_text(text: str) -> bool:
    """Whether `text` holds a character that shows: not only spaces, zero-width or format characters (U+200B, a
    byte-order mark U+FEFF left where UTF-8 files were joined), control characters or blank fillers (U+3164). A
    prompt of those is as empty as one of spaces, which every surface refuses; it ran as a prompt."""
    return any(not char.isspace() and unicodedata.category(char) not in ("Cf", "Cc") and char not in _BLANK_LETTERS
               for char in text)


# Letters and symbols that are drawn blank (filler characters, the empty braille pattern), used as invisible text.
_BLANK_LETTERS = frozenset("\u115f\u1160\u2800\u3164\uffa0")


def parse_size(size: str) -> tuple[int, int]:
    """OpenAI-style "WxH" (width first) -> (height, width)."""
    parts = size.lower().split("x")
    if len(parts) != 2 or not all(p.strip().isdigit() for p in parts):
        raise ValueError(f"size must be 'WIDTHxHEIGHT' (width first, e.g. '768x512'), got {size!r}")
    width, height = (int(p) for p in parts)
    return height, width
