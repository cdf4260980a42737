"""The T2AV / TI2AV pipeline: encode text -> prepare latents -> denoise -> decode, read top to bottom."""

from __future__ import annotations

import contextlib
import dataclasses
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import cast

import PIL.Image
import torch

from k6serve.caching.block_cache import block_cache
from k6serve.lora.spec import USUAL_LORA_STRENGTH
from k6serve.offload.components import RESIDENT
from k6serve.pipelines.decode import decode_audio, decode_video
from k6serve.pipelines.decode_stream import (
    ChunkCheck,
    VideoSink,
    decode_video_chunks,
    decode_video_frames,
    feed_video_sink,
    final_step_check,
)
from k6serve.pipelines.denoise import denoise
from k6serve.pipelines.encode_text import encode_prompt, trim_text_padding, truncation_note
from k6serve.pipelines.expand_prompt import (
    StaticRewriteCache,
    expand_prompt,
    expanded_token_ids,
    image_inputs,
    load_image_processor,
)
from k6serve.pipelines.prepare_latents import (
    cpu_seed_note,
    encode_reference_image,
    make_generator,
    prepare_latents,
)
from k6serve.pipelines.schedulers import make_schedulers
from k6serve.pipelines.state import Conditioning, DecodedAudio, DecodedVideo, Latents
from k6serve.request import FlagWorded, FlagWordedNote, GenerateRequest, ProgressCallback, has_visible_text
from k6serve.request_refusals import no_audio_parts, streamed_text_encoder


@dataclass
class GenerationOutput:
    video: DecodedVideo
    audio: DecodedAudio | None
    fps: float
    timings: dict[str, float] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    expanded_prompt: str | None = None  # expand_prompts: the prompt as rewritten and encoded


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class NonFiniteLatents(FlagWorded):
    """The denoised latents hold NaN or infinity (`check_finite_latents`); built by `non_finite_latents`."""


def non_finite_latents(request: GenerateRequest,
                       adapters: Sequence[tuple[str, float, float | None]] | None = None) -> NonFiniteLatents:
    """The error for `request`'s non-finite latents, naming the likely cause. `adapters`: (nickname, strength, alpha
    override or None) of the LoRA adapters the DiT ran with; None means the request's own (`request.loras`), all
    the pipeline knows. The worker, which knows the engine's adapters too, builds it again with them."""
    if adapters is None:
        adapters = [(nickname, strength, None) for nickname, strength in request.loras or ()]
    overflowed = "the denoised latents hold NaN or infinite values, so no video or audio can be decoded from them; "
    return NonFiniteLatents(f"{overflowed}{_non_finite_cause(request, adapters, cli=False)}.",
                            flag_wording=f"{overflowed}{_non_finite_cause(request, adapters, cli=True)}.")


def _non_finite_cause(request: GenerateRequest, adapters: Sequence[tuple[str, float, float | None]], *,
                      cli: bool) -> str:
    """The likely cause and its fix, in the Python API's and the HTTP API's words, or with `cli` in `k6serve
    generate`'s flags: it has no set_lora / unmerge_lora_weights, and its engine adapter is --lora-path's."""
    guidance = "--guidance-scale" if cli else "guidance_scale"
    if request.guidance_scale > 100:
        return f"{guidance} {request.guidance_scale:g} overflowed the latents: use a usual scale (Pro/Lite: 5)"
    if not adapters:
        return f"lower {guidance}, or check the checkpoint's weights"
    listed = ", ".join(f"{nickname!r} at strength {strength:g}" + ("" if alpha is None else f" with alpha {alpha:g}")
                       for nickname, strength, alpha in adapters)
    if request.loras is not None:  # the request's own adapters, else the engine's active ones
        loras = "--loras" if cli else "this request's loras"
        lower, drop = f"lower it in {loras}", "leave the adapter out" + (" of --loras" if cli else "")
    elif cli:
        lower, drop = "lower it with --lora-scale", "drop --lora-path"
    else:
        lower = "lower it with set_lora or merge_lora_weights (--lora-scale for the --lora-path adapter)"
        drop = "deactivate the adapters with unmerge_lora_weights"
    if any(abs(strength) > USUAL_LORA_STRENGTH for _, strength, _ in adapters):
        return (f"the likely cause is the LoRA strength ({listed}; adapters are used at about "
                f"-{USUAL_LORA_STRENGTH:g} to {USUAL_LORA_STRENGTH:g}): {lower}, or {drop}")
    return (f"the likely cause is the LoRA adapter ({listed}, a usual strength, so its file may hold extreme "
            f"values): {drop}, or check the adapter file")


def check_finite_latents(latents: Latents, request: GenerateRequest) -> None:
    """Refuse denoised latents that hold NaN or infinity (`NonFiniteLatents`): decoded, they became black frames and
    a NaN soundtrack, which the MP4 writer refused as "fix the waveform before muxing", words about nothing the user
    passed. Called once after the denoising loop, never inside it (each check waits for the device)."""
    tensors = [latents.video_BTHWC] + ([latents.audio_BLC] if latents.audio_BLC is not None else [])
    if all(bool(torch.isfinite(tensor).all()) for tensor in tensors):
        return
    raise non_finite_latents(request)


class TextToVideoPipeline:
    def __init__(self, models, *, trim_text_padding: bool = False, keep_float_frames: bool = True) -> None:
        self.models = models
        # Speed mode: cut the common trailing text padding (exact up to kernel rounding; see trim_text_padding).
        self.trim_text_padding = trim_text_padding
        # The float frames are for parity checks; the engine's worker turns them off (see decode_video).
        self.keep_float_frames = keep_float_frames
        # Which components are on the device for each stage: all of them, always, unless `apply_offload` set it.
        self.residency = RESIDENT
        # expand_prompts on several ranks of a replica: every rank's rewrite replaced by its leader's, so all encode
        # the same text (set by the parallel runtime; replicated encoders' rounding may differ between ranks).
        self.agree_on_text: Callable[[str], str] | None = None
        self._image_processor = None  # loaded at the first expand_prompts with an image
        # --compile-prompt-rewrite true (set by the worker): the rewrite generates through this static cache, whose
        # decoding step transformers compiles on CUDA; None: its dynamic cache, eager, diffusers' exact ids.
        self.rewrite_cache: StaticRewriteCache | None = None

    def components(self) -> dict[str, torch.nn.Module]:
        """The modules the stages name in `residency.stage(...)`."""
        m = self.models
        named = {"text_encoder": m.text_encoder, "text_encoder_2": m.text_encoder_2, "transformer": m.transformer,
                 "vae": m.vae, "audio_vae": m.audio_vae, "vocoder": m.vocoder}
        return {name: module for name, module in named.items() if module is not None}

    def check(self, request: GenerateRequest) -> None:
        config = self.models.transformer.config
        # The engine's resolve refuses these with the request; a pipeline run without it checks them here.
        if request.expand_prompts and "text_encoder" in getattr(self.residency, "streamers", {}):
            raise streamed_text_encoder()
        if request.sample_audio_asked and not self.models.has_audio:
            raise no_audio_parts()  # diffusers refuses it too
        if request.cache_dit is not None:
            request.cache_dit.check_against(num_blocks=config.num_visual_blocks, num_steps=request.num_inference_steps)
        if request.image_path is not None and (not config.visual_cond or config.visual_token_type_num_embeddings < 2):
            raise ValueError(
                f"{self.models.variant.name} cannot take a conditioning image: its transformer has no reference-frame "
                "token type (visual_token_type_num_embeddings < 2). Drop --image-path."
            )

    def _expand(self, request: GenerateRequest, image: PIL.Image.Image | None,
                on_step: ProgressCallback | None = None) -> str:
        """`request.prompt` rewritten by Qwen2.5-VL (expand_prompts), grounded on the conditioning `image` if any;
        called inside a stage that holds the text encoder."""
        m = self.models
        if image is not None:
            self._load_image_processor()
        # A cancellation point while the rewrite runs (up to 1,024 tokens, 26 s or more on an H100), reported as step
        # 0. One process only: a replica's ranks call on_step together (a collective), and theirs could stop at
        # different tokens (agree_on_text's reason), leaving one waiting in it.
        on_tokens = (lambda: on_step(0, request.num_inference_steps)) \
            if on_step is not None and self.agree_on_text is None else None
        text = expand_prompt(request.prompt, tokenizer=m.tokenizer, text_encoder=m.text_encoder, device=m.device,
                             seed=request.seed, image_processor=self._image_processor, image=image,
                             max_new_tokens=request.max_sequence_length, on_tokens=on_tokens,
                             static_cache=self.rewrite_cache)
        return self.agree_on_text(text) if self.agree_on_text is not None else text

    def _load_image_processor(self) -> None:
        if self._image_processor is None:
            self._image_processor = load_image_processor(self.models.source)

    def rewrite_image_tokens(self, height: int, width: int) -> int:
        """The image tokens a conditioning image of `height` x `width` (as requests resize theirs) adds to the
        rewrite's inputs, from the checkpoint's own Qwen2.5-VL processor: it rounds each side to a multiple of 28,
        so area does not order them (416x448 gives 240, 432x432 225). Falls back to that rounding alone (each side
        to the nearest multiple of 28, without the processor's pixel bounds) where the processor cannot load
        (transformers 5.17 without torchvision, where a rewrite with an image fails anyway)."""
        import PIL.Image

        try:
            self._load_image_processor()
            return image_inputs(self._image_processor, PIL.Image.new("RGB", (width, height), (128, 128, 128)))[1]
        except ImportError:
            return max(1, round(height / 28)) * max(1, round(width / 28))

    def warm_up_rewrite(self, request: GenerateRequest, num_tokens: int) -> None:
        """A rewrite of `num_tokens` tokens of `request`'s prompt (and image) through `rewrite_cache`, sized as the
        request's own rewrite would size it, so the decoding step it compiles (on CUDA) is the one such requests
        run (`speed/warmup.py`). Its text is not used: no replica agreement, and no cancellation point."""
        image = None
        if request.image_path is not None:
            from k6serve.media.image import load_conditioning_image

            image = load_conditioning_image(request.image_path, request.height, request.width, log=False)
        if image is not None:
            self._load_image_processor()
        m = self.models
        with self.residency.stage("text_encoder"):
            expanded_token_ids(request.prompt, tokenizer=m.tokenizer, text_encoder=m.text_encoder, device=m.device,
                               seed=request.seed, image_processor=self._image_processor, image=image,
                               max_new_tokens=request.max_sequence_length, static_cache=self.rewrite_cache,
                               num_tokens_written=num_tokens)

    def encode(self, request: GenerateRequest) -> Conditioning:
        with self.residency.stage("text_encoder", "text_encoder_2"):
            return self._encode(request)

    def _encode(self, request: GenerateRequest) -> Conditioning:
        """`encode`, inside a stage that holds both text encoders."""
        m = self.models
        kwargs = dict(tokenizer=m.tokenizer, text_encoder=m.text_encoder, tokenizer_2=m.tokenizer_2,
                      text_encoder_2=m.text_encoder_2, device=m.device, dtype=m.dtype,
                      max_sequence_length=request.max_sequence_length)
        positive = encode_prompt(request.prompt, **kwargs)
        # A request with guidance has a negative prompt (GenerateRequest: None exactly when guidance is off).
        negative = encode_prompt(cast(str, request.negative_prompt), **kwargs) if request.do_cfg else None
        if self.trim_text_padding:
            positive = trim_text_padding(positive)
            negative = trim_text_padding(negative) if negative is not None else None
        return Conditioning(positive=positive, negative=negative)

    def truncation_notes(self, request: GenerateRequest, *, expanded: bool = False) -> list[str]:
        """A warning for each prompt `encode` will truncate (see `truncation_note`); `expanded`: `request.prompt` is
        the rewrite, which is not the user's to shorten."""
        limit = request.max_sequence_length
        # Each note in the fields' names and the flags' (FlagWordedNote).
        rewrite_fix = (lambda name: f"{name('expand_prompts')} writes up to {limit} new tokens, as diffusers' does, "
                       f"and the encoder reads {limit} in all.")
        # "prompt", not --prompt: a --prompt-file-path's line is cut alike.
        prompts = [(lambda name: "the expanded prompt" if expanded else "prompt", request.prompt,
                    rewrite_fix if expanded else None)]
        if request.do_cfg:
            prompts.append((lambda name: name("negative_prompt"), cast(str, request.negative_prompt), None))
        notes = [truncation_note(named, text, tokenizer=self.models.tokenizer, max_sequence_length=limit,
                                 **({"fix": fix} if fix else {})) for named, text, fix in prompts]
        return [note for note in notes if note is not None]

    def __call__(self, request: GenerateRequest, *, on_step: ProgressCallback | None = None,
                 video_sink: VideoSink | None = None) -> GenerationOutput:
        """Generate one clip. With `video_sink`, the video is decoded in chunks that the sink consumes as they
        are decoded (see `_decode_into`); the output still holds the uint8 frames, but no float frames.

        `on_step(step, total)` runs after every denoising step, then again as `on_step(total, total)` after each
        temporal tile of the video decode, so a cancel raised from it also stops the decode (and the sink). Only
        the float-frame decode (`keep_float_frames`, for parity checks) is one call with no such point."""
        m = self.models
        self.check(request)
        if video_sink is not None and self.keep_float_frames:
            raise ValueError("a video_sink gets uint8 frames only; build the pipeline with keep_float_frames=False")
        timings: dict[str, float] = {}
        notes: list[str] = []
        image = None
        if request.image_path is not None:
            from k6serve.media.image import load_conditioning_image

            image = load_conditioning_image(request.image_path, request.height, request.width, notes=notes)
        # "encode" counts from here (the copy in of an offloaded encoder, as before), less the rewrite's own
        # "expand_prompt".
        start = time.perf_counter()
        request, expanded, conditioning = self._rewrite_and_encode(request, image, on_step, timings, notes)
        generator = make_generator(request.seed)
        tail = None
        if image is not None:
            with self.residency.stage("vae"):
                tail = encode_reference_image(image, m.vae, height=request.height, width=request.width,
                                              device=m.device, dtype=m.dtype, generator=generator)
        _sync(m.device)
        timings["encode"] = time.perf_counter() - start - timings.get("expand_prompt", 0.0)

        config = m.transformer.config
        with_audio = request.with_audio and m.has_audio
        latents = prepare_latents(
            request,
            in_visual_dim=config.in_visual_dim,
            in_audio_dim=config.in_audio_dim,
            with_audio=with_audio,
            audio_sample_rate=int(m.audio_vae.config.sample_rate) if with_audio else 44100,
            audio_latent_hop_length=int(m.audio_vae.latent_hop_length) if with_audio else 1024,
            device=m.device,
            dtype=m.dtype,
            generator=generator,
            tail_latent_BHWC=tail,
            patch_size=tuple(config.patch_size),
        )
        scheduler, audio_scheduler, timesteps = make_schedulers(
            m.scheduler_class, m.scheduler_config, request.num_inference_steps, m.device, with_audio)
        latents = self._denoise(request, latents, conditioning, scheduler, audio_scheduler, timesteps, on_step,
                                timings, notes)

        # A silent request has no audio stage (nor a 0 s one in the server's stage histogram).
        audio = self._decode_audio(latents, timings) if with_audio else None
        between_chunks = final_step_check(on_step, len(timesteps))  # the total `denoise` reported
        if video_sink is not None:
            video = self._decode_into(video_sink, latents.video_BTHWC, audio, request.fps, timings, between_chunks)
        else:
            video = self._decode_video(latents, between_chunks, timings)
        return GenerationOutput(video=video, audio=audio, fps=request.fps, timings=timings, notes=notes,
                                expanded_prompt=expanded)

    def _rewrite_and_encode(self, request: GenerateRequest, image: PIL.Image.Image | None,
                            on_step: ProgressCallback | None, timings: dict[str, float],
                            notes: list[str]) -> tuple[GenerateRequest, str | None, Conditioning]:
        """The optional rewrite (expand_prompts) and the text encoding, in one stage: an offloaded Qwen2.5-VL
        (15.5 GiB) is copied to the GPU once. Returns the request as encoded (its prompt the rewrite, if any), the
        rewrite, and the conditioning; the truncation and CPU-seed notes go to `notes`."""
        with self.residency.stage("text_encoder", "text_encoder_2"):
            expanded = None
            if request.expand_prompts:
                expand_start = time.perf_counter()
                expanded = self._expand(request, image, on_step)
                timings["expand_prompt"] = time.perf_counter() - expand_start
                if not has_visible_text(expanded):
                    # The DiT would get an empty prompt (a sampled rewrite that ended at once): the user's stands.
                    notes.append(FlagWordedNote.naming(lambda name: (
                        f"{name('expand_prompts')}: the text encoder's rewrite was empty; the prompt was used as "
                        "given.")))
                    expanded = None
                else:
                    request = dataclasses.replace(request, prompt=expanded)
            notes[:0] = self.truncation_notes(request, expanded=expanded is not None)
            if (seed_note := cpu_seed_note(request.seed)) is not None:
                notes.append(seed_note)
            return request, expanded, self._encode(request)

    def _denoise(self, request: GenerateRequest, latents: Latents, conditioning: Conditioning, scheduler,
                 audio_scheduler, timesteps, on_step: ProgressCallback | None, timings: dict[str, float],
                 notes: list[str]) -> Latents:
        """The denoising loop on the DiT, inside the request's Cache-DiT session if any; its timings and the
        session's note."""
        m = self.models
        start = time.perf_counter()
        step_seconds: list[float] = []
        with self.residency.stage("transformer"), self._step_cache(request) as step_cache:
            latents = denoise(m.transformer, latents, conditioning, scheduler=scheduler,
                              audio_scheduler=audio_scheduler, timesteps=timesteps,
                              guidance_scale=request.guidance_scale, visual_cond=m.transformer.config.visual_cond,
                              on_step=on_step, step_seconds=step_seconds, step_cache=step_cache)
            _sync(m.device)
        timings["denoise"] = time.perf_counter() - start
        if step_cache is not None:
            step_cache.share_branches()  # before anything that may raise: a collective over the cfg group
        check_finite_latents(latents, request)
        if step_cache is not None:
            timings["cache_dit_cached_calls"] = float(step_cache.num_cached_calls)
            notes.append(step_cache.describe())
        timings["denoise_per_step"] = timings["denoise"] / request.num_inference_steps
        # The steady-state step and the slowest one: a compilation or a collector pause shows as a gap here.
        if step_seconds:
            timings["denoise_step_median"] = statistics.median(step_seconds)
            timings["denoise_step_max"] = max(step_seconds)
        return latents

    def _decode_audio(self, latents: Latents, timings: dict[str, float]) -> DecodedAudio:
        m = self.models
        start = time.perf_counter()
        with self.residency.stage("audio_vae", "vocoder"):
            # called only for a request with audio, whose latents have it
            audio = decode_audio(m.audio_vae, m.vocoder, cast(torch.Tensor, latents.audio_BLC))
        _sync(m.device)
        timings["decode_audio"] = time.perf_counter() - start
        return audio

    def _decode_video(self, latents: Latents, between_chunks: ChunkCheck | None,
                      timings: dict[str, float]) -> DecodedVideo:
        """The whole video decoded at once (no sink)."""
        m = self.models
        start = time.perf_counter()
        with self.residency.stage("vae"):
            if self.keep_float_frames:
                video = decode_video(m.vae, latents.video_BTHWC)
            else:
                # The chunked decode (same bytes) even without a sink: in a multi-process replica the ranks that
                # save nothing must pass the same cancellation points as the leader's streamed decode.
                video = DecodedVideo(frames_float_THWC=None, frames_THWC=decode_video_frames(
                    m.vae, latents.video_BTHWC, between_chunks=between_chunks))
        timings["decode_video"] = time.perf_counter() - start
        return video

    def _step_cache(self, request: GenerateRequest):
        """The request's Cache-DiT session on the DiT for the denoising loop (k6serve/caching/), or nothing."""
        if request.cache_dit is None:
            return contextlib.nullcontext()
        return block_cache(self.models.transformer, request.cache_dit, num_steps=request.num_inference_steps)

    def _decode_into(self, video_sink: VideoSink, video_BTHWC: torch.Tensor, audio: DecodedAudio | None,
                     fps: float, timings: dict[str, float], between_chunks: ChunkCheck | None) -> DecodedVideo:
        """Stream the decoded chunks into `video_sink` and keep them (timings: see `feed_video_sink`)."""
        with self.residency.stage("vae"):
            chunks = decode_video_chunks(self.models.vae, video_BTHWC, between_chunks=between_chunks)
            frames_THWC = feed_video_sink(video_sink, chunks, audio, fps, timings, "decode_video")
        return DecodedVideo(frames_float_THWC=None, frames_THWC=frames_THWC)
