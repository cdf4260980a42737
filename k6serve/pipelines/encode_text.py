"""Stage: encode prompts with Qwen2.5-VL (token features) and CLIP (pooled vector), as the reference does.

k6-generation.md §3.2: the chat template, right padding to 1024 + 129 tokens, hidden states after the final
RMSNorm with the 129 template tokens cropped, CLIP pooled at the EOT token. We run the Qwen trunk only
(`text_encoder.model`): its last hidden state is exactly `hidden_states[-1]` of the full forward, and it skips
the lm_head logits (1153 x 152064) that the reference computes and throws away.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from k6serve.pipelines.state import TextEmbeddings
from k6serve.request import FieldNames, FlagWordedNote

PROMPT_TEMPLATE = "\n".join(
    [
        "<|im_start|>system\nYou are a promt engineer. Describe the video in detail.",
        "Describe how the camera moves or shakes, describe the zoom and view angle, whether it follows the objects.",
        "Describe the location of the video, main characters or objects and their action.",
        "Describe the dynamism of the video and presented actions.",
        "Name the visual style of the video: whether it is a professional footage, user generated content, "
        "some kind of animation, video game or scren content.",
        "Describe the visual effects, postprocessing and transitions if they are presented in the video.",
        "Pay attention to the order of key actions shown in the scene.<|im_end|>",
        "<|im_start|>user\n{}<|im_end|>",
    ]
)
QWEN_CROP_START = 129  # template tokens before the user prompt (real Qwen2 tokenizer)
CLIP_MAX_LENGTH = 77
MAX_SEQUENCE_LENGTH = 1024


@torch.inference_mode()
def encode_prompt(
    prompt: str,
    *,
    tokenizer,
    text_encoder,
    tokenizer_2,
    text_encoder_2,
    device: torch.device,
    dtype: torch.dtype,
    max_sequence_length: int = MAX_SEQUENCE_LENGTH,
) -> TextEmbeddings:
    inputs = tokenizer(
        [PROMPT_TEMPLATE.format(prompt)],
        max_length=max_sequence_length + QWEN_CROP_START,
        truncation=True,
        padding="max_length",
        return_tensors="pt",
    ).to(device)
    trunk = text_encoder.model
    hidden = trunk(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"], return_dict=True)
    tokens = hidden.last_hidden_state[:, QWEN_CROP_START:]
    mask = inputs["attention_mask"][:, QWEN_CROP_START:].to(torch.bool)
    clip_inputs = tokenizer_2(
        [prompt],
        max_length=CLIP_MAX_LENGTH,
        truncation=True,
        add_special_tokens=True,
        padding="max_length",
        return_tensors="pt",
    ).to(device)
    pooled = text_encoder_2(**clip_inputs)["pooler_output"]
    return TextEmbeddings(
        tokens_BLD=tokens.to(dtype),
        pooled_BD=pooled.to(dtype),
        mask_BL=None if bool(mask.all()) else mask,
    )


def _shorten_or_raise(num_tokens: int, max_sequence_length: int) -> Callable[[FieldNames], str]:
    """The fix of a prompt cut at `max_sequence_length`: shorten it, or, below the encoder's most, read more of it."""
    if max_sequence_length >= MAX_SEQUENCE_LENGTH:
        return lambda name: "Shorten it to use all of it."
    if num_tokens <= MAX_SEQUENCE_LENGTH:
        return lambda name: f"Raise {name('max_sequence_length')} to {num_tokens}, or shorten it, to use all of it."
    return lambda name: (f"Shorten it, and raise {name('max_sequence_length')} to {MAX_SEQUENCE_LENGTH} (its most), "
                         "to use all of it.")


def truncation_note(name: Callable[[FieldNames], str], prompt: str, *, tokenizer,
                    max_sequence_length: int = MAX_SEQUENCE_LENGTH,
                    fix: Callable[[FieldNames], str] | None = None) -> FlagWordedNote | None:
    """A warning for the user when `encode_prompt` keeps only part of `prompt`, ending with `fix`, else None. `name`
    and `fix` write the prompt's name ("prompt", `negative_prompt`) and the fix with the names they are handed, the
    fields' or the CLI's flags' (`FlagWordedNote`); the default fix is to shorten the prompt, or to raise a
    max_sequence_length set below the encoder's 1024 tokens. It tokenizes the prompt once more, untruncated, only
    to count: what is encoded does not change.

    Only the Qwen2.5-VL token features are counted: they are what the DiT attends to. CLIP's pooled vector reads the
    first 75 tokens of every prompt, as in the reference; that summary is cut for most detailed prompts, and warning
    about it would bury this warning."""
    # `verbose=False`: the untruncated count may exceed the tokenizer's model_max_length, which it would log.
    num_tokens = len(tokenizer(prompt, add_special_tokens=False, verbose=False)["input_ids"])
    if num_tokens <= max_sequence_length:
        return None
    fix = fix or _shorten_or_raise(num_tokens, max_sequence_length)
    return FlagWordedNote.naming(lambda names: (
        f"{name(names)} was truncated: the text encoder (Qwen2.5-VL) kept its first {max_sequence_length} of "
        f"{num_tokens} tokens; the rest does not reach the model. {fix(names)}"))


def trim_text_padding(text: TextEmbeddings) -> TextEmbeddings:
    """Drop trailing padding tokens that every prompt in the batch has (a speed transform).

    The key mask is the only way padding reaches the DiT: padded tokens are never attended to, and their own
    (unused) outputs never feed anything else, so cutting them changes only the rounding of the kernels (shorter
    sequences) and lets unmasked kernels (FA3) run the text attentions. Positions of the kept tokens are unchanged.
    """
    if text.mask_BL is None:
        return text
    valid_L = text.mask_BL.any(dim=0)
    length = int(valid_L.nonzero().max()) + 1 if bool(valid_L.any()) else 1
    mask = text.mask_BL[:, :length]
    return TextEmbeddings(
        tokens_BLD=text.tokens_BLD[:, :length],
        pooled_BD=text.pooled_BD,
        mask_BL=None if bool(mask.all()) else mask,
    )
