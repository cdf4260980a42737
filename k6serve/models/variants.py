"""Known Kandinsky 6 checkpoints: recognition by id or model_index.json, and per-variant request defaults.

Recognition follows the reference serving system: the id is normalised (lower case, '-', '_', '.' and '/'
removed) and matched against the released names. A folder (local, or a hub id's download) is what its
`model_index.json` and configs say (pipeline class, scheduler class, transformer width), the name only choosing
among releases with the same files; `--model-id` names a renamed folder's release.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import re
import unicodedata
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from k6serve.caching.params import CacheDitParams, StepMaskMismatch
from k6serve.lora.spec import is_finite_number, lora_strength_refusal, odd_nickname
from k6serve.request import (
    FIELD_NAMES,
    SR_RESIZE_MODES,
    SR_SCALES,
    SR_TARGET_TIERS,
    FieldNames,
    FlagWorded,
    FlagWordedNote,
    GenerateRequest,
    SamplingParams,
    UpscaleRequest,
    has_visible_text,
)
from k6serve.testing.demo_location import DEMO_MODEL_PATHS

logger = logging.getLogger(__name__)

GENERATION = "generation"
SUPER_RESOLUTION = "super_resolution"

DEFAULT_NEGATIVE_PROMPT = (
    "Static, 2D cartoon, cartoon, 2d animation, paintings, images, "
    "worst quality, low quality, ugly, deformed, walking backwards"
)
DEMO_MARKER = "k6serve_demo.json"


DEFAULT_SEED = 42  # every variant's: a request without a seed runs with it


@dataclass(frozen=True, kw_only=True, slots=True)
class Variant:
    name: str  # e.g. "pro-distill"
    family: str  # GENERATION | SUPER_RESOLUTION
    hub_id: str | None
    size: str  # "pro" | "lite" | "sr" | "demo"
    distilled: bool
    num_inference_steps: int
    guidance_scale: float
    height: int = 512
    width: int = 768
    num_frames: int = 121
    fps: float = 24.0
    seed: int = DEFAULT_SEED
    is_demo: bool = False


def _gen(name: str, size: str, distilled: bool) -> Variant:
    title = name[0].upper() + name[1:]  # released ids: Pro-distill, Pro-sft, Lite-pretrain
    return Variant(
        name=name,
        family=GENERATION,
        hub_id=f"kandinskylab/Kandinsky-6.0-{title}-5s-Diffusers",
        size=size,
        distilled=distilled,
        num_inference_steps=10 if distilled else 50,
        guidance_scale=1.0 if distilled else 5.0,
    )


VARIANTS: dict[str, Variant] = {
    v.name: v
    for v in (
        _gen("pro", "pro", False),
        _gen("pro-sft", "pro", False),
        _gen("pro-pretrain", "pro", False),
        _gen("pro-distill", "pro", True),
        _gen("lite", "lite", False),
        _gen("lite-pretrain", "lite", False),
        _gen("lite-distill", "lite", True),
        Variant(
            name="vsr-distilled2steps",
            family=SUPER_RESOLUTION,
            hub_id="kandinskylab/Kandinsky-6.0-VSR-distilled2steps-5s-Diffusers",
            size="sr",
            distilled=True,
            num_inference_steps=2,
            guidance_scale=1.0,
        ),
        Variant(
            name="vsr",
            family=SUPER_RESOLUTION,
            hub_id="kandinskylab/Kandinsky-6.0-VSR-5s-Diffusers",
            size="sr",
            distilled=False,
            num_inference_steps=2,
            guidance_scale=1.0,
        ),
    )
}

# About how many parameters the released checkpoints' models hold, by `Variant.size`: the generation DiTs' as built
# on the meta device (tests/unit/test_dummy_load.py checks them), the SR model's and the text encoders' (Qwen2.5-VL
# 7B and CLIP, which every generation model loads) as counted once on the meta device from their released configs.
# For a refusal's "about N GiB" (runtime/device_fit.py), not for planning memory.
RELEASED_NUM_PARAMETERS = {"pro": 30.1e9, "lite": 3.2e9, "sr": 6.8e9}
TEXT_ENCODERS_NUM_PARAMETERS = 8.3e9


def normalise_id(model_id: str) -> str:
    return re.sub(r"[-_./\s]", "", model_id.lower())


def variant_from_id(model_id: str) -> Variant | None:
    """Match a hub id or folder name against the released checkpoints; None if it names none of them."""
    norm = normalise_id(Path(model_id).name if "/" not in model_id.strip("/") else model_id)
    if "kandinsky6" not in norm and "kandinsky60" not in norm:
        return None
    # "distil" (the British spelling, or "distill" mistyped) is matched too: `Pro-distil` was read as non-distilled
    # Pro, which --load-format dummy built and ran with CFG and 50 steps without a word.
    if re.search(r"kandinsky6(0)?(vsr|sr|superres)", norm):
        return VARIANTS["vsr-distilled2steps" if "distil" in norm else "vsr"]
    size = "lite" if "lite" in norm else "pro" if "pro" in norm else None
    if size is None:
        return None
    if "distil" in norm:
        return VARIANTS[f"{size}-distill"]
    if "pretrain" in norm:
        return VARIANTS[f"{size}-pretrain"]
    if "sft" in norm and size == "pro":
        return VARIANTS["pro-sft"]
    return VARIANTS[size]


def variant_from_folder(folder: Path) -> Variant:
    """Route a local Diffusers folder by what its files say."""
    from k6serve.models.checkpoint_files import index_class, model_index_nearby, read_json_file  # imports torch

    marker = folder / DEMO_MARKER
    if marker.is_file():
        return demo_variant(read_json_file(marker))
    index_path = folder / "model_index.json"
    if not index_path.is_file():
        raise ValueError(
            f"{folder} has no model_index.json, so it is not a Diffusers-format Kandinsky 6 checkpoint."
            + (model_index_nearby(folder) or " Pass the folder that holds model_index.json (e.g. a download of "
               "kandinskylab/Kandinsky-6.0-Pro-distill-5s-Diffusers).")
        )
    index = read_json_file(index_path)
    pipeline_class = index.get("_class_name", "")
    scheduler_class = index_class(index, "scheduler", index_path)
    if pipeline_class == "Kandinsky6SRPipeline":
        return VARIANTS["vsr-distilled2steps" if scheduler_class == "PiflowScheduler" else "vsr"]
    if pipeline_class != "Kandinsky6TI2VAPipeline":
        raise ValueError(
            f"{index_path} names pipeline {pipeline_class!r}; k6serve serves Kandinsky6TI2VAPipeline "
            "(generation) and Kandinsky6SRPipeline (super-resolution) checkpoints. If this is a renamed "
            "Kandinsky 6 folder, pass --model-id with the original name."
        )
    distilled = scheduler_class == "PiflowScheduler"
    config_path = folder / "transformer" / "config.json"
    model_dim = read_json_file(config_path).get("model_dim") if config_path.is_file() else None
    size = "lite" if model_dim == 1792 else "pro"
    return VARIANTS[f"{size}-distill" if distilled else size]


def demo_variant(marker: dict) -> Variant:
    if marker.get("variant") == "sr":  # `demo-sr`: the distilled VSR's defaults (x2.25, 2 steps per tile)
        return dataclasses.replace(VARIANTS["vsr-distilled2steps"], name="demo-sr", hub_id=None, is_demo=True)
    defaults = marker.get("defaults", {})
    distilled = marker.get("variant", "distill") == "distill"
    return Variant(
        name=f"demo-{marker.get('variant', 'distill')}",
        family=GENERATION,
        hub_id=None,
        size="demo",
        distilled=distilled,
        num_inference_steps=10 if distilled else 50,
        guidance_scale=1.0 if distilled else 5.0,
        height=int(defaults.get("height", 64)),
        width=int(defaults.get("width", 96)),
        num_frames=int(defaults.get("num_frames", 17)),
        fps=float(defaults.get("fps", 24)),
        is_demo=True,
    )


def recognise(model_path: str, model_id: str | None, local_folder: Path | None) -> Variant:
    """Pick the variant: --model-id wins; then a folder's own files (a local folder, or a hub id's download), with
    the path's name choosing among the releases the files cannot tell apart (Pro, Pro-sft, Pro-pretrain); then, with
    no folder to read (--load-format dummy) or none that names its pipeline, the path's name alone."""
    if model_id:
        variant = variant_from_id(model_id)
        if variant is None:
            raise ValueError(
                f"--model-id {model_id!r} names no known Kandinsky 6 checkpoint. Known ids: "
                + ", ".join(v.hub_id for v in VARIANTS.values() if v.hub_id)
            )
        if local_folder is not None:
            _check_model_id_fits_folder(model_id, variant, local_folder)
        return variant
    if local_folder is not None and (local_folder / DEMO_MARKER).is_file():
        return variant_from_folder(local_folder)
    if local_folder is None and model_path in DEMO_MODEL_PATHS:
        # Only --load-format dummy leaves the demo's folder unread; it was told to pass --model-id, as an unknown
        # name is, where the fix is to drop the flag.
        raise ValueError(f"--load-format dummy builds a released model at its full size with random weights, and "
                         f"{model_path!r} names none: it is a tiny random-weight checkpoint already. Drop "
                         "--load-format dummy (or, for a released model's size, pass --model-id with its name).")
    named = variant_from_id(model_path)
    if local_folder is None or (named is not None and not (local_folder / "model_index.json").is_file()):
        if named is not None:
            return named
        raise ValueError(
            f"Cannot tell which Kandinsky 6 model {model_path!r} is. Pass --model-id with the released name, "
            "e.g. --model-id Kandinsky-6.0-Pro-distill-5s-Diffusers."
        )
    try:
        found = variant_from_folder(local_folder)
    except ValueError:
        if named is None:
            raise
        return named  # its files name no Kandinsky 6 pipeline: the name routes it, as --model-id would
    if named is None or _kind(named, local_folder) == _kind(found, local_folder):
        return named or found
    # The name is matched anywhere in the path, parent folders included (a hub cache's snapshot folder is named by
    # its commit; its repo's name is two levels up): "/data/projects/kandinsky6/run1" read as Pro, and a distilled
    # checkpoint in a folder named "...-Pro-5s-Diffusers (copy)" ran CFG and 50 steps, 5x the work, with no word.
    # The files say what the checkpoint is; the name only labels it. Said when the folder's own name is a release's
    # (a word of a parent folder, "projects", is no claim), once per process: each check of the request recognises.
    own_name = variant_from_id(local_folder.name)
    if own_name is not None and _kind(own_name, local_folder) != _kind(found, local_folder) \
            and str(local_folder) not in _WARNED_NAMES:
        _WARNED_NAMES.add(str(local_folder))
        logger.warning("%s is named as %s, but its model_index.json and transformer config say %s; serving it as "
                       "%s (pass --model-id to name the checkpoint explicitly).", local_folder.name, own_name.name,
                       found.name, found.name)
    return found


_WARNED_NAMES: set[str] = set()


def _kind(variant: Variant, folder: Path | None = None) -> tuple:
    """What a checkpoint's files tell (family, distilled, Pro or Lite), to compare a name's guess with them; the
    size only where the folder has a transformer config to read it from (`variant_from_folder` guesses Pro)."""
    if folder is not None and not (folder / "transformer" / "config.json").is_file():
        return variant.family, variant.distilled
    return variant.family, variant.distilled, variant.size


def _check_model_id_fits_folder(model_id: str, variant: Variant, folder: Path) -> None:
    """--model-id routes a renamed folder and wins over the guess from its transformer's width (Pro or Lite), but
    not over what its model_index.json states: a super-resolution pipeline is not a generation one, and a PiFlow
    scheduler marks a distilled checkpoint. A contradiction would fail later as a missing component ("re-download
    the repository") or, distilled against not, run CFG and 50 steps on a 10-step model without a word."""
    try:
        found = variant_from_folder(folder)
    except ValueError:
        return  # the folder's files name no Kandinsky 6 pipeline: --model-id is what routes it
    if (found.family, found.distilled) == (variant.family, variant.distilled):
        return

    def kind(v: Variant) -> str:
        if v.family == SUPER_RESOLUTION:
            return "a super-resolution checkpoint"
        return f"a {'distilled ' if v.distilled else 'non-distilled '}generation checkpoint"

    raise ValueError(
        f"--model-id {model_id!r} names {variant.name}, {kind(variant)}, but {folder} is {kind(found)} by its "
        f"model_index.json (recognised as {found.name}); drop --model-id, or pass the name of the checkpoint "
        "this folder holds."
    )


def _frames_rule(num_frames: int) -> int:
    if num_frames < 1:
        raise FlagWorded.naming(lambda name: f"{name('num_frames')} must be >= 1, got {num_frames}")
    # The VAE compresses time 4x: other counts become n // 4 * 4 + 1 exactly as the reference (120 -> 121).
    return num_frames // 4 * 4 + 1 if num_frames % 4 != 1 else num_frames


def seconds_to_num_frames(seconds: float, fps: float) -> int:
    """Map a duration onto the model's frame rule: round(seconds*fps) frames, then n // 4 * 4 + 1."""
    if seconds <= 0:
        raise ValueError(f"seconds must be > 0, got {seconds}")
    return _frames_rule(max(1, round(seconds * fps)))


# Far above what the text encoder keeps (1,024 Qwen2.5-VL tokens: 3-6 thousand characters of English, about 1,000
# of Chinese), so no prompt it could use is refused.
MAX_PROMPT_CHARACTERS = 32_768


def _check_prompt_texts(params: SamplingParams) -> None:
    """Refuse a prompt or negative prompt over MAX_PROMPT_CHARACTERS (whatever the model: an SR model ignores them,
    but the HTTP job stores them), or one that is not text: a lone surrogate or a control character."""
    for field in ("prompt", "negative_prompt"):
        text = getattr(params, field)
        if text is not None and prompt_text_refusal(field, text):
            raise FlagWorded.naming(lambda name: prompt_text_refusal(name(field), text))


def prompt_text_refusal(name: str, text: str) -> str | None:
    """Why `text`, called `name`, is refused as a prompt (`_check_prompt_texts`), or None. `name` is the caller's:
    the request's field or flag, or a --prompt-file-path line (cli/generate.py), whose prompt no --prompt gave."""
    if len(text) > MAX_PROMPT_CHARACTERS:
        # The text encoder keeps its first 1,024 tokens, a few thousand characters: the rest was read, stored
        # with the job (the HTTP job store grew by a megabyte a job) and dropped.
        return (f"{name} has {len(text):,} characters; at most {MAX_PROMPT_CHARACTERS:,} are taken (the text encoder "
                "keeps its first 1,024 tokens, a few thousand characters): shorten it.")
    return _not_text_refusal(name, text)


def _not_text_refusal(name: str, text: str) -> str | None:
    """What a wrong encoding leaves of a prompt, refused with the way to send it right: a lone surrogate (a
    non-ASCII command line under a non-UTF-8 locale: the worker's tokenizer failed on it as "a bug in k6serve"), or
    a control character other than tab and line ends (a UTF-16 file or form field read as UTF-8 put U+0004 beside
    each Cyrillic letter and reached the text encoder as garbage; UTF-8 read as Latin-1 gives C1 controls)."""
    for index, char in enumerate(text):
        if "\ud800" <= char <= "\udfff":
            return (f"{name} is not valid Unicode text: character {index + 1} is a lone surrogate "
                    f"(U+{ord(char):04X}), what a command line or file read under a non-UTF-8 locale leaves of "
                    "non-ASCII text; use a UTF-8 locale (e.g. export LANG=C.UTF-8) or put the prompt in a UTF-8 file "
                    "(--prompt-file-path).")
        if unicodedata.category(char) == "Cc" and char not in "\t\n\r":
            return (f"{name} holds the control character U+{ord(char):04X} at character {index + 1}: text read in "
                    "the wrong encoding (a UTF-16 file read as UTF-8 has a control character beside every letter) or "
                    "a pasted terminal escape; send the prompt as UTF-8 text without control characters.")
    return None


class MissingPrompt(ValueError):
    """A generation request without a prompt. The message shows the CLI flag; the Python API and the HTTP server
    catch this type and word their own answer (the `prompt=` keyword, the `prompt` body field), adding `detail`."""

    FLAG_WORDING = "prompt is required for Kandinsky 6 generation (e.g. --prompt 'A cat plays piano')."

    def __init__(self, message: str, *, detail: str = "") -> None:
        # The message is the one positional argument, as in any ValueError (copy and pickle rebuild it from `args`).
        super().__init__(message + detail)
        self.detail = detail

    @classmethod
    def for_prompt(cls, prompt: str | None) -> MissingPrompt:
        detail = ""
        if prompt and prompt.strip():
            shown = ascii(prompt if len(prompt) <= 24 else prompt[:24] + "...")
            detail = (f" The prompt given, {shown}, has no visible character: only spaces and zero-width, format, "
                      "control or blank characters (a byte-order mark U+FEFF, U+200B, U+3164).")
        return cls(cls.FLAG_WORDING, detail=detail)


class MissingSourceVideo(ValueError):
    """A super-resolution request without a source video; worded for the CLI like `MissingPrompt`, and reworded by
    the Python API (the `video_path=` keyword)."""

    FLAG_WORDING = ("Super-resolution needs exactly one source video: pass --video-path /path/to/input.mp4 "
                    "(over HTTP: upload video_reference or give a server-side video_path).")


class DistilledGuidance(FlagWorded):
    """guidance_scale other than 1.0 for a distilled checkpoint, worded for both surfaces (an HTTP client was told of
    `--guidance-scale`, which it never typed)."""

    @classmethod
    def for_variant(cls, variant_name: str, shown: object) -> DistilledGuidance:
        # "requires guidance_scale exactly 1.0" names the setting, not the flag, in both wordings.
        return cls.naming(lambda name: f"{variant_name} is a distilled (PiFlow) checkpoint and requires guidance_scale "
                                       f"exactly 1.0 (got {shown}); leave {name('guidance_scale')} out, or use a "
                                       "Pro/Lite checkpoint for CFG.")


def resolve_generate(params: SamplingParams, variant: Variant, *, engine_cache_dit: CacheDitParams | None = None,
                     cache_dit_unavailable: str | None = None,
                     num_dit_blocks: int | None = None, has_audio: bool = True,
                     streams_text_encoder: bool = False) -> tuple[GenerateRequest, list[str]]:
    """Fill defaults from the variant and validate; returns the request and warnings for the user.

    `engine_cache_dit` is the engine's `--cache-dit-config` (caching on by default), `cache_dit_unavailable` why
    this engine cannot cache (a request that turns caching on is then refused with it), `num_dit_blocks` the DiT's
    fused block count where it is known (Cache-DiT settings must leave one to cache; None: the pipeline checks)."""
    if variant.family != GENERATION:
        raise ValueError(f"{variant.name} is a super-resolution model: pass video_path, not a prompt.")
    notes: list[str] = []
    if params.video_path is not None:
        raise FlagWorded.naming(lambda name: f"{name('video_path')} is for the super-resolution model; {variant.name} "
                                             f"generates from a prompt (use {name('image_path')} for image "
                                             "conditioning).")
    if params.image_path is not None and not params.image_path.strip():
        # Path("") is ".": the message was "cannot read conditioning image '.': it is a directory".
        raise FlagWorded.naming(lambda name: f"{name('image_path')} is empty: pass an image file's path, or leave it "
                                             "out to generate from the prompt alone.")
    if not params.prompt or not has_visible_text(params.prompt):
        raise MissingPrompt.for_prompt(params.prompt)
    _check_prompt_texts(params)
    height = params.height if params.height is not None else variant.height
    width = params.width if params.width is not None else variant.width
    for field, value in (("height", height), ("width", width)):
        if value <= 0 or value % 16:
            raise FlagWorded.naming(lambda name: f"{name(field)} must be a positive multiple of 16 (VAE 8x times "
                                                 f"patch 2), got {value}.")
        if value > 2048:
            raise FlagWorded.naming(lambda name: f"{name(field)} must be at most 2048 (the DiT's 128 RoPE positions "
                                                 f"x 16 px), got {value}.")
    num_frames = params.num_frames if params.num_frames is not None else variant.num_frames
    rounded = _frames_rule(num_frames)
    if rounded != num_frames:
        notes.append(FlagWordedNote.naming(lambda name: f"{name('num_frames')} {num_frames} is not of the form 4k+1; "
                                                        f"using {rounded} (n // 4 * 4 + 1, as the reference)."))
    if (rounded - 1) // 4 + 1 > 128:
        raise FlagWorded.naming(lambda name: f"{name('num_frames')} {num_frames} gives more than 128 latent frames; "
                                             "use at most 509.")
    fps = params.fps if params.fps is not None else variant.fps
    fps = float(fps) if is_finite_number(fps) else math.inf  # 10**400: refused below, not an OverflowError
    # The model has no fps input: fps only sets the soundtrack's length, num_frames / fps seconds (1e-9 fps asked
    # for 23 TB of audio noise). 1 is the floor of a frame rate; the audio length itself is bounded just below.
    if not (1 <= fps <= 240) or not math.isfinite(fps):
        raise FlagWorded.naming(lambda name: f"{name('fps')} must be between 1 and 240 (it sets the audio length, "
                                             f"{name('num_frames')} / {name('fps')} seconds), got {params.fps}")
    max_sequence_length = 1024 if params.max_sequence_length is None else params.max_sequence_length
    if not 1 <= max_sequence_length <= 1024:
        # The released DiT was trained on at most 1024 prompt tokens (diffusers' default and its pipeline's padding).
        raise FlagWorded.naming(lambda name: f"{name('max_sequence_length')} must be between 1 and 1024 (prompt "
                                             f"tokens the model reads), got {max_sequence_length}")
    if params.sample_audio is True and not has_audio:
        raise no_audio_parts()
    if params.expand_prompts and streams_text_encoder:
        raise streamed_text_encoder()
    with_audio = params.sample_audio is not False
    if with_audio:  # a silent video has no soundtrack to fit the DiT's audio positions
        _check_audio_length(rounded, fps)
    steps = params.num_inference_steps if params.num_inference_steps is not None else variant.num_inference_steps
    if steps < 1 or steps > 1000:
        raise FlagWorded.naming(lambda name: f"{name('num_inference_steps')} must be between 1 and 1000, got {steps}")
    guidance, negative = _resolve_guidance(params, variant, notes)
    seed = params.seed if params.seed is not None else variant.seed
    _check_seed(seed)
    _refuse_super_resolution_fields(params, variant)
    cache_dit = resolve_cache_dit(params, engine_cache_dit, num_steps=steps, unavailable=cache_dit_unavailable)
    if cache_dit is not None and num_dit_blocks is not None:
        with _cache_dit_params_worded():
            cache_dit.check_blocks(num_dit_blocks)
    if cache_dit is not None and variant.distilled:
        notes.append(f"Cache-DiT on {variant.name}, a {variant.num_inference_steps}-step distilled checkpoint: each "
                     "step moves the latents far, so there is little to skip and skipping costs quality; it is "
                     "meant for the 50-step Pro / Lite.")
    loras = _resolve_loras(params.loras)
    request = GenerateRequest(
        prompt=params.prompt,
        negative_prompt=negative,
        image_path=params.image_path,
        seed=seed,
        height=height,
        width=width,
        num_frames=rounded,
        fps=fps,
        num_inference_steps=steps,
        guidance_scale=guidance,
        cache_dit=cache_dit,
        loras=loras,
        expand_prompts=bool(params.expand_prompts),
        max_sequence_length=max_sequence_length,
        with_audio=with_audio,
        sample_audio_asked=params.sample_audio is True,
    )
    return request, notes


def _resolve_guidance(params: SamplingParams, variant: Variant, notes: list[str]) -> tuple[float, str | None]:
    """The request's guidance scale and negative prompt (None without CFG), checked against the variant; a note
    for a negative prompt that is blank or ignored."""
    guidance = params.guidance_scale if params.guidance_scale is not None else variant.guidance_scale
    # The messages show the value as given (nan read "got inf", what the comparisons below take it for), but an
    # integer past a float's range as words, not its 400 digits.
    if isinstance(guidance, int) and not is_finite_number(guidance):
        shown = "an integer too large for a float"
    else:
        shown = guidance
    guidance = float(guidance) if is_finite_number(guidance) else math.inf  # 10**400: refused below
    if variant.distilled and guidance != 1.0:
        raise DistilledGuidance.for_variant(variant.name, shown)
    if not math.isfinite(guidance):
        raise FlagWorded.naming(lambda name: f"{name('guidance_scale')} must be a finite number >= 1.0 (1.0 "
                                             f"disables CFG), got {shown}")
    if guidance < 1.0:
        raise FlagWorded.naming(lambda name: f"{name('guidance_scale')} must be >= 1.0 (1.0 disables CFG), got "
                                             f"{guidance}")
    negative = None
    if guidance > 1.0:
        # An empty negative prompt takes the built-in one, as the reference's `negative_prompt or default` does (a
        # form's or UI's blank field sends ""); encoding "" instead changed every CFG step's unconditional branch.
        negative = params.negative_prompt or DEFAULT_NEGATIVE_PROMPT
        if params.negative_prompt and not has_visible_text(params.negative_prompt):
            # Encoded as written, as the reference does: the way to guide against an almost empty negative branch.
            # A blank form field that sends spaces means the built-in one, hence the note.
            notes.append(FlagWordedNote.naming(lambda name: (
                f"{name('negative_prompt')} {ascii(negative[:24])} has no visible character and is encoded as "
                "written; send an empty one, or leave it out, for the model's built-in negative prompt.")))
    elif params.negative_prompt:
        notes.append(FlagWordedNote.naming(lambda name: f"{name('negative_prompt')} is ignored: "
                                                        f"{name('guidance_scale')} is 1.0, so no unconditional "
                                                        "branch runs."))
    return guidance, negative


def _refuse_super_resolution_fields(params: SamplingParams, variant: Variant) -> None:
    """Refuse, on a generation model, the fields only an upscale takes."""
    for field in ("sr_resolution_scale", "sr_tiles_batch_size", "sr_tile_min_overlap", "sr_target_resolution",
                  "sr_target_resize_mode"):
        if getattr(params, field) is not None:
            raise FlagWorded.naming(lambda name: f"{name(field)} applies to the super-resolution model only, not to "
                                                 f"{variant.name}; drop it, or load "
                                                 "kandinskylab/Kandinsky-6.0-VSR-distilled2steps-5s-Diffusers to "
                                                 "upscale a video.")


# The refusals of a request the loaded engine cannot run (`resolve_generate`'s has_audio / streams_text_encoder), said
# again by the pipeline where it is run without them (the tests' pipelines, a bench). FlagWorded: `k6serve generate`
# reaches them only in the worker, after the load, and prints their flag wording (--sample-audio).
NO_AUDIO_PARTS = ("sample_audio is true, but this checkpoint has no audio_vae and vocoder (its model_index.json lists "
                  "none), so it makes silent videos only; drop sample_audio.")
# Written out, not templated: "--sample-audio is true" is no flag's wording (the flag is given, not set to true).
_NO_AUDIO_PARTS_FLAGS = ("--sample-audio was given, but this checkpoint has no audio_vae and vocoder (its "
                         "model_index.json lists none), so it makes silent videos only; drop --sample-audio.")


# generate runs the whole text encoder once per new token (up to 1024): streamed, each run copies all of its layers
# (15.5 GiB for Qwen2.5-VL-7B) from host memory.
def _streamed_text_encoder_words(name: FieldNames) -> str:
    return (f"{name('expand_prompts')} runs the text encoder once per generated token (up to 1024), and this engine "
            "streams its layers from host memory (--performance-mode memory, or --layerwise-offload-components "
            "text_encoder), which would copy all of them for every token. Offload it whole instead "
            "(--component-residency text_encoder=component_offload: it visits the GPU for the rewrite and the "
            f"encoding, about 16 GB there), or drop {name('expand_prompts')}.")


# The API's and the HTTP server's wording, as its tests and clients match it.
STREAMED_TEXT_ENCODER = _streamed_text_encoder_words(FIELD_NAMES)


def no_audio_parts() -> FlagWorded:
    return FlagWorded(NO_AUDIO_PARTS, flag_wording=_NO_AUDIO_PARTS_FLAGS)


def streamed_text_encoder() -> FlagWorded:
    return FlagWorded.naming(_streamed_text_encoder_words)


# The audio stream of every released checkpoint (and the demo): MMAudio at 44.1 kHz, one latent per 2 x 512 samples
# (k6-generation.md §3.4), and a 1-D RoPE table of 2048 positions (models/common/rope.py MAX_SEQUENCE_POSITIONS).
# Kept here as numbers so validation needs neither torch nor the weights; test_variants checks they agree.
AUDIO_SAMPLE_RATE = 44100
AUDIO_LATENT_HOP_LENGTH = 1024
AUDIO_MAX_POSITIONS = 2048


class AudioTooLong(FlagWorded):
    """A soundtrack longer than the DiT's audio positions (`_check_audio_length`). `too_long` says by how much
    ("50.1 s of audio, longer than ..."), `max_frames` is the most frames that fit at the request's fps: the HTTP
    server words the refusal of a `seconds` request with them, since a higher fps does not shorten a duration."""

    too_long: str
    max_frames: int


def _check_audio_length(num_frames: int, fps: float) -> None:
    """The soundtrack, num_frames / fps seconds, must fit the DiT's audio positions (47.55 s), as the video fits its
    128 latent frames. Past them the transformer refuses the request, but only in the worker, after the text
    encoders ran; here it is refused with the request, and says which fps or frame count fits."""
    latents = math.ceil(num_frames / fps * AUDIO_SAMPLE_RATE / AUDIO_LATENT_HOP_LENGTH)  # prepare_latents' length
    if latents <= AUDIO_MAX_POSITIONS:
        return
    max_seconds = AUDIO_MAX_POSITIONS * AUDIO_LATENT_HOP_LENGTH / AUDIO_SAMPLE_RATE
    min_fps = math.ceil(num_frames / max_seconds * 100) / 100
    max_frames = (math.floor(max_seconds * fps) - 1) // 4 * 4 + 1
    # As many decimals as tell the two lengths apart: 509 frames at 10.7 fps read "47.6 s ... (47.6 s: ...)".
    seconds = num_frames / fps
    decimals = next((d for d in range(1, 4) if round(seconds, d) != round(max_seconds, d)), 4)
    too_long = (f"{seconds:.{decimals}f} s of audio, longer than the model's audio positions allow "
                f"({max_seconds:.{decimals}f} s: {AUDIO_MAX_POSITIONS} latents, this clip needs {latents})")
    refusal = AudioTooLong.naming(lambda name: (
        f"{name('num_frames')} {num_frames} at {name('fps')} {fps:g} is {too_long}; raise {name('fps')} to at least "
        f"{min_fps:g}, lower {name('num_frames')} to at most {max_frames}, or make a silent video "
        f"({name.set_to('sample_audio', False)})."))
    refusal.too_long, refusal.max_frames = too_long, max_frames
    raise refusal


def _resolve_loras(loras: dict | None) -> tuple[tuple[str, float], ...] | None:
    """{nickname: strength} -> ((nickname, strength), ...) in the given order, checked."""
    if loras is None:
        return None
    resolved = []
    for nickname, strength in loras.items():
        if not isinstance(nickname, str) or not nickname:
            raise FlagWorded.naming(lambda name: f"{name('loras')} keys must be adapter nicknames, got {nickname!r}")
        if odd := odd_nickname(nickname):
            # No adapter can be loaded under such a name (set_lora and --lora-nickname refuse it), and the "not
            # loaded" 400 repeated it unescaped in the --lora-nickname it suggests.
            raise FlagWorded.naming(lambda name: f"{name('loras')} key {odd} No adapter can be loaded under such a "
                                                 "nickname.")
        if isinstance(strength, bool) or not isinstance(strength, (int, float)):
            raise FlagWorded.naming(lambda name: f"{name.entry('loras', nickname)} must be a finite number (the "
                                                 f"adapter's strength), got {strength!r}")
        if lora_strength_refusal(strength, "loras"):  # not finite, or past the bound
            raise FlagWorded.naming(lambda name: lora_strength_refusal(strength, name.entry("loras", nickname)))
        resolved.append((nickname, float(strength)))
    return tuple(resolved)


# The cache_dit_params keys that choose the step mask (scm_policy only says how a masked step is used).
_MASK_KEYS = frozenset({"scm_preset", "scm_compute_bins", "scm_cache_bins"})


def resolve_cache_dit(params: SamplingParams, engine_default: CacheDitParams | None, *, num_steps: int,
                      unavailable: str | None) -> CacheDitParams | None:
    """The request's Cache-DiT settings: the engine's, or the defaults, with its `cache_dit_params` over them;
    None when caching is off. Turned on by `enable_cache_dit`, by `cache_dit_params`, or by the engine's config."""
    enabled = params.enable_cache_dit
    if enabled is False and params.cache_dit_params is not None:
        raise FlagWorded("cache_dit_params was given with enable_cache_dit false; drop one of them (the params "
                         "alone turn caching on).",
                         flag_wording="--cache-dit-params was given with --no-enable-cache-dit; drop one of them "
                                      "(--cache-dit-params alone turns caching on).")
    if enabled is None:
        enabled = params.cache_dit_params is not None or engine_default is not None
    if not enabled:
        return None
    if unavailable is not None:
        raise ValueError(f"Cache-DiT is not available on this engine: {unavailable}")
    base = engine_default
    if base is not None and _MASK_KEYS & set(params.cache_dit_params or {}):
        # The request's step mask replaces the engine's whole (as the reference's request bins win over the server's
        # preset): keys merged one by one, a request's bins beside the engine's preset were refused as "both define
        # the step mask", though the client gave one.
        base = dataclasses.replace(base, scm_preset="none", scm_compute_bins=None, scm_cache_bins=None)
    with _cache_dit_params_worded():
        cache_dit = CacheDitParams.from_mapping(params.cache_dit_params or {}, base=base)
    try:
        cache_dit.steps_mask(num_steps)  # a mask that cannot cover the steps is refused now, not mid-request
    except StepMaskMismatch as exc:
        if engine_default is None or _MASK_KEYS & set(params.cache_dit_params or {}):
            with _cache_dit_params_worded():
                raise
        # The mask is the engine's: the refusal told the client to drop a cache_dit_params key it never sent.
        mismatch = f"{num_steps} does not fit the engine's Cache-DiT step mask (--cache-dit-config: its {exc.what})"
        raise FlagWorded(f"num_inference_steps {mismatch}; use steps it covers, or turn caching off for this request "
                         "with enable_cache_dit false.",
                         flag_wording=f"--num-inference-steps {mismatch}; use steps it covers, or turn caching off "
                                      "with --no-enable-cache-dit.") from None
    return cache_dit


@contextlib.contextmanager
def _cache_dit_params_worded() -> Iterator[None]:
    """The request's Cache-DiT settings refused (caching/params.py names them as the field, `cache_dit_params`,
    and a key as `cache_dit_params.scm_preset`) as a `FlagWorded`, whose flag wording `k6serve generate` prints:
    `--cache-dit-params`, and a key as `scm_preset in --cache-dit-params`."""
    try:
        yield
    except FlagWorded:
        raise
    except ValueError as exc:
        message = str(exc)
        flags = re.sub(r"\bcache_dit_params\.(\w+)", r"\1 in --cache-dit-params", message)
        raise FlagWorded(message, flag_wording=re.sub(r"\bcache_dit_params\b", "--cache-dit-params", flags)) from None


def _check_seed(seed: int) -> None:
    # -1 (RANDOM_SEED) is drawn where the request enters (`request.drawn_seed`); checked before that, it is valid.
    if not isinstance(seed, int) or isinstance(seed, bool) or not (0 <= seed < 2**63 or seed == -1):
        raise FlagWorded.naming(lambda name: f"{name('seed')} must be an integer in [0, 2**63), or -1 for a seed "
                                             f"drawn for the request, got {seed!r}")


def parse_target_resolution(value: str) -> str:
    value = value.strip().lower()
    if value in SR_TARGET_TIERS:
        return value
    match = re.fullmatch(r"([0-9]+)x([0-9]+)", value)  # ASCII digits, as `size` takes (\d also matches "６")
    if not match or int(match[1]) < 16 or int(match[2]) < 16:
        raise FlagWorded.naming(lambda name: f"{name('sr_target_resolution')} must be one of "
                                             f"{', '.join(SR_TARGET_TIERS)} or 'WxH' (width first, each side at least "
                                             f"16, e.g. 1280x720), got {value!r}")
    width, height = int(match[1]), int(match[2])
    # Refused with the request (before the model loads, at a job's creation): the H.264 writer would reject the
    # odd frame only after the whole upscale, and "fit" clamps to this target's sides, so it lands on them too.
    if width % 2 or height % 2:
        raise FlagWorded.naming(lambda name: f"{name('sr_target_resolution')} {value!r} has an odd side; H.264 needs "
                                             f"even width and height: use {width + width % 2}x{height + height % 2} "
                                             f"or {width - width % 2}x{height - height % 2}.")
    return value


def sr_source_field_refusal(field: str, name: Callable[[str], str] = str) -> str:
    """The refusal of `field` (height, width, num_frames, fps; over HTTP size, seconds) in a super-resolution
    request, with the way to get what it asked for. Every one was told to use the scale and the target "to choose the
    output size", which a length or a frame rate is not."""
    taken = f"{name(field)} is taken from the source video in super-resolution; "
    if field in ("num_frames", "seconds"):
        # media/video.py: the first 121 frames the 24 fps rule keeps, floored to 1 + 8k.
        return (taken + "the upscale takes up to 121 frames from the source's start (5 s at 24 fps), at the rate "
                "the 24 fps rule sets, floored to 1 + 8k. For another part or a shorter clip, cut the source first "
                f"(FFmpeg: ffmpeg -ss START -i IN -t SECONDS OUT), and drop {name(field)}.")
    if field == "fps":
        return (taken + "the output keeps the source's frame rate rounded to a whole number, and a source of 25.5 "
                "fps or more is subsampled to 24 fps. For another rate, convert the source first (FFmpeg: ffmpeg "
                f"-i IN -vf fps=N -c:a copy OUT), and drop {name(field)}.")
    return (taken + f"use {name('sr_resolution_scale')} and {name('sr_target_resolution')} to choose the output "
            "size.")


def resolve_upscale(params: SamplingParams, variant: Variant) -> tuple[UpscaleRequest, list[str]]:
    if variant.family != SUPER_RESOLUTION:
        raise ValueError(
            f"{variant.name} is a generation model; video_path and sr_* parameters need the VSR model "
            "kandinskylab/Kandinsky-6.0-VSR-distilled2steps-5s-Diffusers."
        )
    notes: list[str] = []
    if params.video_path is not None and not params.video_path.strip():
        # `--video-path "$CLIP"` with CLIP unset was told to pass the --video-path it passed; `upscale("")` likewise.
        raise FlagWorded.naming(lambda name: f"{name('video_path')} is empty: pass the source video file's path "
                                             "(e.g. input.mp4).")
    if not params.video_path:
        raise MissingSourceVideo(MissingSourceVideo.FLAG_WORDING)
    if params.image_path is not None:
        raise FlagWorded.naming(lambda name: f"{name('image_path')} is not used by the super-resolution model; pass "
                                             f"{name('video_path')} only.")
    _check_prompt_texts(params)
    if params.prompt:
        notes.append("The super-resolution model takes no prompt; it was ignored.")
    if params.negative_prompt:  # was dropped without a word
        notes.append(FlagWordedNote.naming(lambda name: f"The super-resolution model takes no "
                                                        f"{name('negative_prompt')}; it was ignored."))
    scale = float(params.sr_resolution_scale if params.sr_resolution_scale is not None else 2.25)
    if scale not in SR_SCALES:
        raise FlagWorded.naming(lambda name: f"{name('sr_resolution_scale')} must be 2, 4 or 2.25, got "
                                             f"{params.sr_resolution_scale}")
    batch = params.sr_tiles_batch_size if params.sr_tiles_batch_size is not None else 1
    if not isinstance(batch, int) or batch < 1 or batch > 64:
        raise FlagWorded.naming(lambda name: f"{name('sr_tiles_batch_size')} must be an integer from 1 to 64, got "
                                             f"{batch!r}")
    overlap = float(params.sr_tile_min_overlap if params.sr_tile_min_overlap is not None else 0.2)
    if not (0.0 <= overlap < 1.0):
        raise FlagWorded.naming(lambda name: f"{name('sr_tile_min_overlap')} must be in [0, 1), got {overlap}")
    target = parse_target_resolution(params.sr_target_resolution) if params.sr_target_resolution else None
    mode = params.sr_target_resize_mode if params.sr_target_resize_mode is not None else "fit"
    if mode not in SR_RESIZE_MODES:
        raise FlagWorded.naming(lambda name: f"{name('sr_target_resize_mode')} must be 'fit' or 'exact', got "
                                             f"{mode!r}")
    if params.sr_target_resize_mode is not None and target is None:
        raise FlagWorded.naming(lambda name: (
            f"{name('sr_target_resize_mode')} only says how to reach {name('sr_target_resolution')}, and none was "
            f"given; pass {name('sr_target_resolution')} (hd, fullhd, 2k or WxH) as well, or drop "
            f"{name('sr_target_resize_mode')}."))
    if params.num_inference_steps is not None and params.num_inference_steps != variant.num_inference_steps:
        # `name=value` was the API's keyword alone; both surfaces read "<name> <value>".
        notes.append(FlagWordedNote.naming(lambda name: (
            f"{name('num_inference_steps')} {params.num_inference_steps} is ignored: this checkpoint's PiFlow "
            f"scheduler always runs {variant.num_inference_steps} DiT calls per tile.")))
    for field in ("height", "width", "num_frames", "fps"):
        if getattr(params, field) is not None:
            raise FlagWorded.naming(lambda name: sr_source_field_refusal(field, name))
    if params.guidance_scale is not None and params.guidance_scale != 1.0:
        raise FlagWorded.naming(lambda name: "The super-resolution model has no guidance; "
                                             f"{name('guidance_scale')} must be 1.0 or unset.")
    if params.loras is not None:
        raise FlagWorded.naming(lambda name: f"{name('loras')} applies to the generation models; the super-resolution "
                                             "model takes no LoRA adapter.")
    if params.max_sequence_length is not None:
        raise FlagWorded.naming(lambda name: f"{name('max_sequence_length')} sets how much of a generation prompt is "
                                             "read; the super-resolution model takes no text. Drop "
                                             f"{name('max_sequence_length')}.")
    if params.sample_audio is not None:
        # --no-sample-audio is refused as typed, not as the --sample-audio it turns off.
        raise FlagWorded.naming(lambda name: (
            f"{name('sample_audio', params.sample_audio)} applies to the generation models; super-resolution keeps "
            "the source video's own soundtrack (a source without one gives a silent video). Drop "
            f"{name('sample_audio', params.sample_audio)}."))
    if params.expand_prompts:
        raise FlagWorded.naming(lambda name: f"{name('expand_prompts')} rewrites a generation prompt; the "
                                             "super-resolution model takes no text. Drop "
                                             f"{name('expand_prompts')}.")
    if params.enable_cache_dit or params.cache_dit_params is not None:
        refusal = ("Cache-DiT applies to the generation models: the super-resolution model runs 2 DiT steps per tile, "
                   "with nothing to skip. Drop ")
        # The CLI names only the flags typed: `--enable-cache-dit / --cache-dit-params` offered one never given.
        flags = [flag for flag, given in (("--enable-cache-dit", params.enable_cache_dit),
                                          ("--cache-dit-params", params.cache_dit_params is not None)) if given]
        raise FlagWorded(refusal + "enable_cache_dit / cache_dit_params.",
                         flag_wording=refusal + " and ".join(flags) + ".")
    seed = params.seed if params.seed is not None else variant.seed
    _check_seed(seed)
    request = UpscaleRequest(
        video_path=params.video_path,
        scale=scale,
        tiles_batch_size=batch,
        tile_min_overlap=overlap,
        target_resolution=target,
        target_resize_mode=mode,
        seed=seed,
        requested_steps=params.num_inference_steps,
    )
    return request, notes
