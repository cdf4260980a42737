"""What a request resolves to on a recognised variant (`models/variants.py`): `resolve_generate` and
`resolve_upscale` fill the variant's defaults and check every field (prompts, sizes, frames, fps and the audio
length, guidance, seeds, Cache-DiT settings, LoRA strengths, the super-resolution options), refusing with the
wording of the surface that asked (`FlagWorded`); the refusals callers catch by type are in `request_refusals.py`.
Torch-free: the CLI, the API and the server check a request with it before anything loads.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import re
import unicodedata
from collections.abc import Callable, Iterator
from typing import cast

from k6serve.caching.params import CacheDitParams, StepMaskMismatch
from k6serve.lora.spec import is_finite_number, lora_strength_refusal, odd_nickname
from k6serve.models.variants import GENERATION, SUPER_RESOLUTION, Variant
from k6serve.request import (
    SR_RESIZE_MODES,
    SR_SCALES,
    SR_TARGET_TIERS,
    FlagWorded,
    FlagWordedNote,
    GenerateRequest,
    SamplingParams,
    UpscaleRequest,
    has_visible_text,
)
from k6serve.request_refusals import (
    AudioTooLong,
    DistilledGuidance,
    MissingPrompt,
    MissingSourceVideo,
    no_audio_parts,
    streamed_text_encoder,
)

DEFAULT_NEGATIVE_PROMPT = (
    "Static, 2D cartoon, cartoon, 2d animation, paintings, images, "
    "worst quality, low quality, ugly, deformed, walking backwards"
)


def _nearest_multiples_of_16(value: int) -> str:
    """What to give instead of a height or width that is not a positive multiple of 16: the two around it."""
    below = value // 16 * 16
    return " (16 is the smallest)" if below <= 0 else f" (the nearest are {below} and {below + 16})"


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
            # refused just above; the name only words the refusal, so it is never None here
            raise FlagWorded.naming(lambda name: cast(str, prompt_text_refusal(name(field), text)))


def prompt_text_refusal(name: str, text: str) -> str | None:
    """Why `text`, called `name`, is refused as a prompt (`_check_prompt_texts`), or None. `name` is the caller's:
    the request's field or flag, or a --prompt-file-path line (cli/prompt_file.py), whose prompt no --prompt gave."""
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
        if value > 2048:  # first, so that 3000 is not answered with 2992 and 3008, which fail here next
            raise FlagWorded.naming(lambda name: f"{name(field)} must be at most 2048 (the DiT's 128 RoPE positions "
                                                 f"x 16 px), got {value}.")
        if value <= 0 or value % 16:
            raise FlagWorded.naming(lambda name: f"{name(field)} must be a positive multiple of 16 (VAE 8x times "
                                                 f"patch 2), got {value}{_nearest_multiples_of_16(value)}.")
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
    shown: str | float
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


# The audio stream of every released checkpoint (and the demo): MMAudio at 44.1 kHz, one latent per 2 x 512 samples
# (k6-generation.md §3.4), and a 1-D RoPE table of 2048 positions (models/common/rope.py MAX_SEQUENCE_POSITIONS).
# Kept here as numbers so validation needs neither torch nor the weights; test_variants checks they agree.
AUDIO_SAMPLE_RATE = 44100
AUDIO_LATENT_HOP_LENGTH = 1024
AUDIO_MAX_POSITIONS = 2048


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
            # refused just above; the name only words the refusal, so it is never None here
            raise FlagWorded.naming(
                lambda name: cast(str, lora_strength_refusal(strength, name.entry("loras", nickname))))
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
