"""Tiny Qwen2 and CLIP tokenizers trained offline, for random-weight Kandinsky 6 test checkpoints.

The real tokenizers cannot be downloaded here, so we train byte-level BPEs on the K6 prompt template
and wrap them in the real transformers classes. They keep what the pipeline depends on
(k6-generation.md §7.2): the Qwen template prefix is exactly `QWEN_CROP_START` (129) tokens, the
Qwen special tokens exist, padding is on the right with `<|endoftext|>`, and the CLIP vocab ends
with `<|startoftext|>`, `<|endoftext|>`.
"""

import itertools
import re
from collections import Counter
from pathlib import Path
from typing import Any, cast

from tokenizers import Tokenizer, pre_tokenizers
from transformers import AutoTokenizer, CLIPTokenizer, Qwen2_5_VLProcessor, Qwen2Tokenizer

# The pipeline's own template, so the tokenizers are trained on exactly what it sends.
from k6serve.pipelines.encode_text import PROMPT_TEMPLATE, QWEN_CROP_START

QWEN_SPECIAL_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
)
CLIP_BOS_TOKEN = "<|startoftext|>"
CLIP_EOS_TOKEN = "<|endoftext|>"
CLIP_MAX_LENGTH = 77

# Trained on whole words, every template word would be one token and the prefix 125 tokens long.
# Training on these four words only in pieces makes each tokenize as two tokens: 125 + 4 = 129, the
# real crop boundary.
# The real tokenizer's splits are unknown; only the count matters to the pipeline.
_QWEN_PRESPLIT_WORDS = {
    "promt": ("prom", "t"),
    "scren": ("scr", "en"),
    "dynamism": ("dynam", "ism"),
    "postprocessing": ("post", "processing"),
}
# A few ordinary prompts, so user text does not fall apart into single bytes.
_EXTRA_CORPUS = (
    "A red fox runs through a snowy forest at dawn, cinematic lighting, slow camera pan.",
    "A cat and a dog baking a cake together in a kitchen.",
    "Waves crash on a rocky shore while seagulls cry; the sound of wind and water.",
    "A person speaks to the camera and says hello. Music plays softly in the background.",
    (
        "Static, 2D cartoon, cartoon, 2d animation, paintings, images, "
        "worst quality, low quality, ugly, deformed, walking backwards"
    ),
    "0 1 2 3 4 5 6 7 8 9",
)
_MAX_MERGES = 4096

# A reduced Qwen2.5-VL chat template: enough for `expand_prompts` (text, and one image placeholder).
QWEN_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    "{% endif %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'text' %}{{ content['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _learn_merges(
    trainer_tokenizer: Tokenizer, corpus: list[str], end_of_word_suffix: str
) -> list[tuple[str, str]]:
    """Learn BPE merges on `corpus`, pre-tokenized as `trainer_tokenizer` does, in rank order.

    `tokenizers.trainers.BpeTrainer` breaks count ties in a hash order that changes from run to run,
    so the merge loop is done here: most frequent pair first, ties broken by the pair itself. The
    corpus is a few hundred words, so this takes ~0.1 s.
    """
    word_counts: Counter[tuple[str, ...]] = Counter()
    for text in corpus:
        normalized = trainer_tokenizer.normalizer.normalize_str(text)
        for word, _ in trainer_tokenizer.pre_tokenizer.pre_tokenize_str(normalized):
            characters = list(word)
            characters[-1] += end_of_word_suffix
            word_counts[tuple(characters)] += 1

    merges: list[tuple[str, str]] = []
    while len(merges) < _MAX_MERGES:
        pair_counts: Counter[tuple[str, str]] = Counter()
        for symbols, count in word_counts.items():
            for pair in itertools.pairwise(symbols):
                pair_counts[pair] += count
        if not pair_counts:
            break
        best = min(pair_counts, key=lambda pair: (-pair_counts[pair], pair))
        merges.append(best)
        word_counts = Counter(
            {_merge_pair(symbols, best): count for symbols, count in word_counts.items()}
        )
    return merges


def _merge_pair(symbols: tuple[str, ...], pair: tuple[str, str]) -> tuple[str, ...]:
    merged: list[str] = []
    index = 0
    while index < len(symbols):
        if index + 1 < len(symbols) and (symbols[index], symbols[index + 1]) == pair:
            merged.append(symbols[index] + symbols[index + 1])
            index += 2
        else:
            merged.append(symbols[index])
            index += 1
    return tuple(merged)


def _split_special_tokens(text: str) -> list[str]:
    # Special tokens are matched before BPE runs, so only the text between them is trained on.
    return re.split("|".join(re.escape(special) for special in QWEN_SPECIAL_TOKENS), text)


def _byte_alphabet() -> list[str]:
    # Sorted so that ids never depend on set iteration order.
    return sorted(pre_tokenizers.ByteLevel.alphabet())


def train_qwen_tokenizer() -> Qwen2Tokenizer:
    """Train the tiny Qwen2 byte-level BPE; the K6 template prefix is `QWEN_CROP_START` tokens."""
    template = PROMPT_TEMPLATE.format("")
    for word, pieces in _QWEN_PRESPLIT_WORDS.items():
        template = template.replace(word, pieces[0])
    # Each later piece is its own corpus line so that it is learnt without a leading space.
    tail_pieces = [piece for pieces in _QWEN_PRESPLIT_WORDS.values() for piece in pieces[1:]]

    # An empty Qwen2Tokenizer carries the real normalizer and pre-tokenizer to train with.
    trainer_tokenizer = Qwen2Tokenizer().backend_tokenizer
    merges = _learn_merges(
        trainer_tokenizer,
        [*_split_special_tokens(template), *tail_pieces, *_EXTRA_CORPUS],
        end_of_word_suffix="",
    )

    # Id layout of the real Qwen2 vocab: bytes, merged tokens in rank order, then special tokens.
    vocab = {token: index for index, token in enumerate(_byte_alphabet())}
    for left, right in merges:
        vocab.setdefault(left + right, len(vocab))
    for special in QWEN_SPECIAL_TOKENS:
        vocab[special] = len(vocab)

    tokenizer = Qwen2Tokenizer(
        vocab=vocab,
        merges=merges,  # type: ignore[arg-type]  # transformers types merges as strings; it takes pairs too
        extra_special_tokens=list(QWEN_SPECIAL_TOKENS[1:]),
        model_max_length=32768,
        padding_side="right",
        chat_template=QWEN_CHAT_TEMPLATE,
    )
    prefix_ids = tokenizer(PROMPT_TEMPLATE.split("{}")[0])["input_ids"]
    assert len(prefix_ids) == QWEN_CROP_START, f"template prefix is {len(prefix_ids)} tokens"
    return tokenizer


def qwen_vision_token_ids(tokenizer: Qwen2Tokenizer) -> dict[str, int]:
    """The Qwen2.5-VL config's vision token ids as `tokenizer` has them: a text encoder built for a trained tokenizer
    (tiny checkpoints, the full-size dummy) must count its `<|image_pad|>` placeholders by the trained id, not the
    released vocabulary's 151655, or a rewrite with an image finds none of them ("Image features and image tokens
    do not match, tokens: 0")."""
    # one token gives one id; transformers types the result for a list of tokens too
    return {name: cast(int, tokenizer.convert_tokens_to_ids(token)) for name, token in (
        ("image_token_id", "<|image_pad|>"), ("video_token_id", "<|video_pad|>"),
        ("vision_start_token_id", "<|vision_start|>"), ("vision_end_token_id", "<|vision_end|>"))}


def train_clip_tokenizer() -> CLIPTokenizer:
    """Train the tiny CLIP BPE; `<|startoftext|>`, `<|endoftext|>` are the two highest ids."""
    trainer_tokenizer = CLIPTokenizer().backend_tokenizer
    corpus = [*_split_special_tokens(PROMPT_TEMPLATE.format("")), *_EXTRA_CORPUS]
    merges = _learn_merges(trainer_tokenizer, corpus, end_of_word_suffix="</w>")

    # Real CLIP layout: every byte, every byte as a word end, merged tokens, then the specials.
    alphabet = _byte_alphabet()
    vocab = {
        token: index for index, token in enumerate(alphabet + [char + "</w>" for char in alphabet])
    }
    for left, right in merges:
        vocab.setdefault(left + right, len(vocab))
    vocab[CLIP_BOS_TOKEN] = len(vocab)
    vocab[CLIP_EOS_TOKEN] = len(vocab)
    # transformers types merges as strings; it takes pairs too
    return CLIPTokenizer(vocab=vocab, merges=merges, model_max_length=CLIP_MAX_LENGTH)  # type: ignore[arg-type]


def video_processor_base() -> tuple[str, type]:
    """The base class `ProcessorMixin` checks a `video_processor` against, with its name: `VideoProcessorMixin` in
    newer transformers, `BaseVideoProcessor` in older 5.x releases (5.17, the GPU image's). The name comes from
    transformers' own table, so neither release needs a guess."""
    from transformers import processing_utils, video_processing_utils

    # the table's video_processor entry is one class name (other modalities' may be several)
    name = cast(str, processing_utils.MODALITY_TO_BASE_CLASS_MAPPING["video_processor"])
    return name, getattr(video_processing_utils, name)


def register_video_processor_base() -> None:
    """Let transformers build `Qwen2_5_VLProcessor` without torchvision (k6-generation.md §7.3).

    `ProcessorMixin` checks `video_processor` against its base class (`video_processor_base`), which it resolves
    through a transformers module object that hides the class when torchvision is missing.
    """
    from transformers import processing_utils

    name, base = video_processor_base()
    # Where torchvision is missing the module shows a placeholder under that name (transformers 5.17) or nothing
    # (newer releases); either way an isinstance check against it fails for a real subclass.
    if getattr(processing_utils.transformers_module, name, None) is not base:
        setattr(processing_utils.transformers_module, name, base)


def _text_only_video_processor():
    """A video processor placeholder: K6 never feeds video to Qwen, only its config is needed."""
    # Any: the base is looked up by name at run time (it differs between transformers releases).
    VideoProcessorBase: Any = video_processor_base()[1]  # noqa: N806 (a class)

    class Qwen2VLTextOnlyVideoProcessor(VideoProcessorBase):
        merge_size = 2
        temporal_patch_size = 2
        patch_size = 14

        def to_dict(self) -> dict:
            return {
                "video_processor_type": "Qwen2VLVideoProcessor",
                "merge_size": self.merge_size,
                "temporal_patch_size": self.temporal_patch_size,
                "patch_size": self.patch_size,
            }

    return Qwen2VLTextOnlyVideoProcessor()


def build_qwen_processor(tokenizer: Qwen2Tokenizer) -> Qwen2_5_VLProcessor:
    """Wrap the tokenizer in the `Qwen2_5_VLProcessor` that the diffusers pipeline declares."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    register_video_processor_base()
    return Qwen2_5_VLProcessor(
        image_processor=Qwen2VLImageProcessorPil(),
        tokenizer=tokenizer,
        video_processor=_text_only_video_processor(),
        chat_template=QWEN_CHAT_TEMPLATE,
    )


def load_qwen_processor(tokenizer_dir: Path) -> Qwen2_5_VLProcessor:
    """Rebuild the processor from a saved `tokenizer/` folder without torchvision."""
    # the folder holds a saved Qwen2Tokenizer, which AutoTokenizer rebuilds
    return build_qwen_processor(cast(Qwen2Tokenizer, AutoTokenizer.from_pretrained(tokenizer_dir)))
