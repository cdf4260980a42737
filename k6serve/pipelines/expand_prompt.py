"""Stage (optional): rewrite the prompt with Qwen2.5-VL before it is encoded, as diffusers' `expand_prompts` does.

k6-generation.md §3.2 (P:412-485): the T2VA or I2VA "prompt beautifier" instruction around the user's prompt, in a
one-turn chat (with the reference image first for image-to-video), `generate` up to `max_sequence_length` new tokens
with the text encoder's own generation config (the checkpoint's `generation_config.json`), the global RNG seeded
with the request's seed first; the decoded answer replaces the prompt. The released Qwen2.5-VL samples with top_k 1,
so the rewrite is its greedy answer whatever the seed.

Where we depart from the reference's code, not its result: the Qwen2.5-VL processor is not built (its class needs
torchvision, which the CPU torch wheel cannot sit beside; k6-generation.md §7.3): the tokenizer applies the chat
template and the image processor `from_pretrained` picks (torchvision's where it is installed, PIL's elsewhere, as
for diffusers' processor) makes the image's patches, and the image placeholder is widened to one token per merged
patch exactly as `Qwen2_5_VLProcessor.__call__` widens it. The RNG is seeded inside `fork_rng`, so the engine's
global RNG is left as it was (diffusers reseeds it for good). A caller may pass `on_tokens`, called every
`TOKENS_PER_CHECK` tokens: a cancellation point (it raises), which changes nothing the rewrite computes.

With `--compile-prompt-rewrite true` (`StaticRewriteCache`) `generate` keeps its keys and values in one static cache
of a bucketed length, and on CUDA transformers compiles its decoding step: faster, but the compiled step rounds
differently, so the ids may leave the eager ones (diffusers') after some tokens. `apply_rewrite_compile_config` has
that compile made in inductor's deterministic mode, as the DiT's blocks and the VAE decoders are, so the compiled
rewrite is the same in every process. Eager or compiled, the rewrite's attention keeps off SDPA's cuDNN kernel
(`REWRITE_ATTENTION_BACKENDS`), whose one-query decoding steps did not repeat.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import PIL.Image
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from k6serve.pipelines.encode_text import MAX_SEQUENCE_LENGTH
from k6serve.request import FlagWorded
from k6serve.speed.regional_compile import inductor_options

if TYPE_CHECKING:
    from transformers import StaticCache  # at run time, imported where a cache is made

# diffusers 0.42.1 pipeline_kandinsky6_ti2va.py, verbatim.
T2VA_INSTRUCTION = (
    "You are a prompt beautifier that transforms short user video+audio descriptions into rich, detailed English "
    "prompts specifically optimized for video+audio generation models. Preserve any direct speech between <S> "
    "and <E> exactly as written. If the prompt asks for speech without exact words, add suitable direct speech "
    "between those tags. Put general audio descriptions between <AUDCAP> and <ENDAUDCAP>. Describe the scene, "
    "actions, camera motion, visual style, and audio in detail. Make the prompt dynamic. Answer only with the "
    "expanded prompt.\n\n"
    "Rewrite Prompt: {}"
)
I2VA_INSTRUCTION = (
    "You are a prompt beautifier that transforms a short user video+audio description and a provided reference "
    "image into a rich, detailed English prompt optimized for video+audio generation. The reference image is the "
    "ground truth for the initial scene. Keep every visible fact that you mention consistent with it. Do not mainly "
    "describe the image: focus on the requested actions, motion, interactions, camera changes, speech, and audio, "
    "explaining the changes relative to the initial image. Add only details compatible with the reference image; "
    "never invent conflicting objects, identities, colors, locations, or actions. Preserve direct speech between "
    "<S> and <E> exactly. Put general audio descriptions between <AUDCAP> and <ENDAUDCAP>. Make the prompt dynamic "
    "and describe how the scene evolves from the provided image. Answer only with the expanded prompt.\n\n"
    "Rewrite Prompt: {}"
)
IMAGE_TOKEN = "<|image_pad|>"
VIDEO_TOKEN = "<|video_pad|>"
# How often a rewrite calls its `on_tokens` (a request's cancellation point): at most 256 tokens took 5.5-7.8 s of
# eager generate on an H100 (forty-fourth session; the count went unrecorded), so 16 about 0.4 s, where a rewrite of
# 1,024 ran 26 s or more with no point to stop at.
TOKENS_PER_CHECK = 16
# The smallest static cache: the instruction with a prompt, or with a 768x512 image (486 tokens after merging),
# plus the default 1,024 new tokens fit, so usual requests share one compiled step. Its unused positions cost little:
# each token's attention reads the whole cache, 117 MB for Qwen2.5-VL-7B at 2,048, beside the 15 GB of weights.
MIN_STATIC_CACHE_TOKENS = 2048


class _EveryTokens:
    """A stopping criterion that never stops: it calls `callback` every `every` tokens, and whatever the callback
    raises (a cancellation) ends `generate`. Its answer is made on the ids' device, so it adds no host sync."""

    def __init__(self, callback: Callable[[], object], every: int) -> None:
        self.callback, self.every, self.calls = callback, every, 0

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs) -> torch.Tensor:
        self.calls += 1
        if self.calls % self.every == 0:
            self.callback()
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


def static_cache_tokens(num_tokens: int) -> int:
    """The static cache length for a rewrite of `num_tokens` (inputs plus most new tokens): the next power of two,
    at least `MIN_STATIC_CACHE_TOKENS`. Each length is a compile of the decoding step (45 s on an H200), so lengths
    are few."""
    return max(MIN_STATIC_CACHE_TOKENS, 1 << (num_tokens - 1).bit_length())


class StaticRewriteCache:
    """The one transformers `StaticCache` a text encoder's rewrites share (--compile-prompt-rewrite true).

    Why our own object: transformers' `cache_implementation="static"` (5.17 and 5.25 alike, `_prepare_static_cache`)
    builds a new `StaticCache` in every `generate`, sized to that call's inputs plus `max_new_tokens` (or the largest
    size before); there is no `self._cache` reuse as in transformers 4. A cache passed to `generate` (5.17's
    `past_key_values`, 5.25's `cache`) is used as it is, and on CUDA its decoding step is compiled all the same
    (`_valid_auto_compile_criteria`: a compileable cache). So one cache is kept here, reset before each rewrite,
    and replaced only by a longer one: the compiled step's shapes, keyed on the cache length, change only when a
    rewrite needs a longer bucket (`static_cache_tokens`), never with the prompt's length."""

    def __init__(self, text_encoder_config) -> None:
        self.config = text_encoder_config
        self.cache: StaticCache | None = None
        self.num_tokens = 0  # the cache's length (0: none yet)

    def prepared(self, num_tokens: int):
        """The cache, emptied, for a rewrite of up to `num_tokens` tokens in all. Called inside inference mode:
        the cache's tensors are made there, and only an inference-mode call may zero them."""
        from transformers import StaticCache

        if num_tokens > self.num_tokens or self.cache is None:
            self.num_tokens = max(self.num_tokens, static_cache_tokens(num_tokens))
            self.cache = StaticCache(config=self.config, max_cache_len=self.num_tokens)
        else:
            self.cache.reset()
        return self.cache

    def release(self) -> None:
        """Drop the cache's tensors (a memory release: they are the only device memory a rewrite keeps between
        requests beside the weights); the next rewrite makes them again, of the same length. A new cache of the same
        length compiles nothing new (dynamo's guards are on its tensors' shapes; CUDA graphs re-record)."""
        self.cache = None


def apply_rewrite_compile_config(text_encoder, device: torch.device) -> None:
    """Have transformers compile the rewrite's decoding step (--compile-prompt-rewrite true, on CUDA) in inductor's
    deterministic mode, as the DiT's blocks and the VAE decoders compile (`speed/regional_compile.py`).

    Why: transformers' own compile (`CompileConfig()`: inductor in its "reduce-overhead" mode) lets inductor time its
    kernels' configurations, and with the rewrite's attention already off cuDNN (the eager rewrite repeating) two
    processes on an H100 that each compiled afresh wrote two different 128-token rewrites of the dummy Qwen2.5-VL-7B
    (random weights, whose greedy answer meets near ties at every token); in the deterministic mode two such
    processes wrote the same ids, at 10.6-11.5 ms a token against 10.4-12.0 (a warm 128-token rewrite's wall time,
    prefill included, over 128; sixty-third session, docs/benchmarks.md). The config is transformers' default with
    that mode's one option, CUDA graphs, written out (torch.compile takes a mode or options, not both). Left as it
    is: a compile config the checkpoint's `generation_config.json` sets, the whole process's choice where
    `TORCHINDUCTOR_DETERMINISTIC` is set, and a text encoder on another device than CUDA, which transformers does
    not compile (a config set there has it warn, at each process's first rewrite, that it will not compile)."""
    from transformers.generation import CompileConfig

    options = inductor_options("inductor", None)
    generation_config = text_encoder.generation_config
    if device.type != "cuda" or options is None or generation_config.compile_config is not None:
        return
    generation_config.compile_config = CompileConfig(
        mode=None,  # type: ignore[arg-type]  # typed str, but torch.compile refuses a mode beside options
        options={"triton.cudagraphs": True, **options})


def _cache_keyword(text_encoder) -> str:
    """The `generate` keyword of a cache passed in: transformers 5.17 reads `past_key_values`, 5.25 `cache` (the old
    name still taken with a FutureWarning); the model's forward names the one its version uses."""
    return "cache" if "cache" in inspect.signature(type(text_encoder).forward).parameters else "past_key_values"


def image_inputs(image_processor, image: PIL.Image.Image) -> tuple[dict[str, torch.Tensor], int]:
    """`image`'s pixel_values and image_grid_thw as the Qwen2.5-VL processor makes them, and how many image tokens
    it takes in the text: one placeholder per merged patch, as the processor writes it (one token in the
    template)."""
    made = image_processor(images=[image], return_tensors="pt")
    pixels = {"pixel_values": made["pixel_values"], "image_grid_thw": made["image_grid_thw"]}
    return pixels, int(pixels["image_grid_thw"][0].prod()) // int(image_processor.merge_size) ** 2


def expansion_inputs(prompt: str, *, tokenizer, image_processor=None, image: PIL.Image.Image | None = None,
                     ) -> dict[str, torch.Tensor]:
    """The `generate` inputs `Qwen2_5_VLProcessor` makes for the expansion chat: input_ids, attention_mask and
    mm_token_type_ids, and with an image its pixel_values and image_grid_thw."""
    template = tokenizer.chat_template  # a str, or a dict of named templates
    if template is None or (isinstance(template, str) and not template.strip()):
        # transformers' own error named no file and sent the user to its docs on writing templates; an empty file
        # (a cut-short copy) rendered the chat as nothing, and the rewrite ran on no instruction.
        raise FlagWorded.naming(lambda name: (
            f"{name('expand_prompts')} needs the checkpoint's Qwen2.5-VL chat template (tokenizer/chat_template.jinja, "
            "or chat_template in tokenizer/tokenizer_config.json), which is missing or empty; copy or download the "
            "checkpoint again."))
    instruction = (I2VA_INSTRUCTION if image is not None else T2VA_INSTRUCTION).format(prompt)
    content = ([{"type": "image", "image": image}] if image is not None else []) + [{"type": "text",
                                                                                     "text": instruction}]
    text = tokenizer.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                         add_generation_prompt=True)
    pixels: dict[str, torch.Tensor] = {}
    if image is not None:
        if image_processor is None:
            raise ValueError("expand_prompts with an image needs the checkpoint's Qwen2.5-VL image processor "
                             "(tokenizer/processor_config.json or preprocessor_config.json), which was not found.")
        pixels, count = image_inputs(image_processor, image)
        text = text.replace(IMAGE_TOKEN, IMAGE_TOKEN * count, 1)
    encoded = tokenizer([text], padding=True, return_tensors="pt")
    ids = encoded["input_ids"]
    # The processor's modality of each token (transformers 5.17 and 5.25, `create_mm_token_type_ids`): 1 for an
    # image placeholder, 2 for a video one, 0 for text. Qwen2.5-VL's generate places the image's tokens on its
    # 3-D (time, height, width) rotary grid from it; without it they took text positions, and the rewrite's logits
    # left diffusers' (6e-4 on the tiny encoder), its grounding on the image's layout with them.
    kinds = ((ids == tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)).long()
             + 2 * (ids == tokenizer.convert_tokens_to_ids(VIDEO_TOKEN)).long())
    return {"input_ids": ids, "attention_mask": encoded["attention_mask"], "mm_token_type_ids": kinds, **pixels}


# The rewrite's attention on torch's flash, memory-efficient or math SDPA kernels, never cuDNN's: on Hopper torch
# picks cuDNN for the one-query decoding steps, whose logits differed from one run to the next in one process (torch
# 2.11, the dummy Qwen2.5-VL-7B; measured on an H100, and the ids differed on an H200 as well), so where the two best
# logits were near a tie the greedy rewrite took another token and went on differently (sixty-third session,
# scripts/gpu_rewrite_repeat.py: the logits of the 4th and 11th forwards parted, the ids at tokens 38 and 21 of 64,
# their two best logits 0.03125 and 0 apart; on these kernels all 64 forwards' logits repeated bit for bit, the ids
# those of torch's deterministic mode). The text encoding keeps torch's choice: its one long prefill repeats on cuDNN.
REWRITE_ATTENTION_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


@torch.inference_mode()
def expanded_token_ids(prompt: str, *, tokenizer, text_encoder, device: torch.device, seed: int,
                       image_processor=None, image: PIL.Image.Image | None = None,
                       max_new_tokens: int = MAX_SEQUENCE_LENGTH,
                       on_tokens: Callable[[], object] | None = None,
                       static_cache: StaticRewriteCache | None = None,
                       num_tokens_written: int | None = None) -> torch.Tensor:
    """The token ids the text encoder writes for `prompt`'s rewrite, (1, n <= max_new_tokens), end token included
    when it stopped on one (diffusers' `Kandinsky6TI2VAPipeline.expand_prompts` for one prompt, `generator` seeded
    with `seed`). `on_tokens` is called every `TOKENS_PER_CHECK` tokens written; what it raises ends the rewrite.
    `static_cache`: generate through it (--compile-prompt-rewrite true) instead of its dynamic cache.
    `num_tokens_written` (a warm-up's): write exactly that many tokens, the cache still sized for `max_new_tokens`,
    so the step compiled is the one a rewrite of `max_new_tokens` uses."""
    from transformers import StoppingCriteriaList

    inputs = {name: value.to(device) for name, value in
              expansion_inputs(prompt, tokenizer=tokenizer, image_processor=image_processor, image=image).items()}
    extra: dict[str, Any] = {} if on_tokens is None else {
        "stopping_criteria": StoppingCriteriaList([_EveryTokens(on_tokens, TOKENS_PER_CHECK)])}
    if static_cache is not None:
        num_tokens = inputs["input_ids"].shape[1] + max_new_tokens
        extra[_cache_keyword(text_encoder)] = static_cache.prepared(num_tokens)
    if num_tokens_written is not None:
        max_new_tokens = num_tokens_written
        extra["min_new_tokens"] = num_tokens_written  # an end token would stop it before the compiled step ran
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices), sdpa_kernel(REWRITE_ATTENTION_BACKENDS):
        torch.manual_seed(seed)
        generated = text_encoder.generate(**inputs, max_new_tokens=max_new_tokens, **extra)
    return generated[:, inputs["input_ids"].shape[1]:]


def expand_prompt(prompt: str, *, tokenizer, text_encoder, device: torch.device, seed: int,
                  image_processor=None, image: PIL.Image.Image | None = None,
                  max_new_tokens: int = MAX_SEQUENCE_LENGTH, on_tokens: Callable[[], object] | None = None,
                  static_cache: StaticRewriteCache | None = None) -> str:
    """`prompt` rewritten by the text encoder: `expanded_token_ids` decoded as diffusers decodes them."""
    answer = expanded_token_ids(prompt, tokenizer=tokenizer, text_encoder=text_encoder, device=device, seed=seed,
                                image_processor=image_processor, image=image, max_new_tokens=max_new_tokens,
                                on_tokens=on_tokens, static_cache=static_cache)
    return tokenizer.batch_decode(answer, skip_special_tokens=True, clean_up_tokenization_spaces=False)[0]


def load_image_processor(source: str):
    """The Qwen2.5-VL image processor of a checkpoint folder's `tokenizer/` (where diffusers' save_pretrained of the
    processor writes its settings), else Qwen2.5-VL's defaults (a `--load-format dummy` model). transformers picks
    its PIL implementation where torchvision is missing (the CPU wheel), the same patches."""
    import transformers

    folder = Path(source) / "tokenizer"
    names = ("processor_config.json", "preprocessor_config.json")
    # transformers' notice that it fell back to PIL, once per load, is no news to a user.
    quiet = logging.getLogger("transformers.models.auto.image_processing_auto")
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        if source != "dummy" and any((folder / name).is_file() for name in names):
            return transformers.AutoImageProcessor.from_pretrained(str(folder), trust_remote_code=False)
        cls = getattr(transformers, "Qwen2VLImageProcessorPil", None) or transformers.Qwen2VLImageProcessor
        return cls()
    finally:
        quiet.setLevel(level)
