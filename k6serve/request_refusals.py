"""The refusals of a request that callers catch by type or say again: a generation request without a prompt, an
upscale without a source video, guidance on a distilled checkpoint, a soundtrack longer than the DiT's audio
positions, and what the loaded engine cannot run (no audio parts, a streamed text encoder). Raised by
`request_resolution.py`; each is worded for the CLI's flags and for the API's and the server's fields.
"""

from __future__ import annotations

from k6serve.request import FIELD_NAMES, FieldNames, FlagWorded


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


class AudioTooLong(FlagWorded):
    """A soundtrack longer than the DiT's audio positions (`_check_audio_length`). `too_long` says by how much
    ("50.1 s of audio, longer than ..."), `max_frames` is the most frames that fit at the request's fps: the HTTP
    server words the refusal of a `seconds` request with them, since a higher fps does not shorten a duration."""

    too_long: str
    max_frames: int
