"""Stage `text`: prompt encoding, ours (Qwen trunk only, no lm_head) vs the reference's full forward; and the
`expand_prompts` rewrite (Qwen2.5-VL's generate) on its own.

The reference (diffusers' pipeline) runs `Qwen2_5_VLForConditionalGeneration(..., output_hidden_states=True)`,
which also computes 1153 x 152064 logits it throws away; ours runs `text_encoder.model`. Both rows include
the CLIP pooled vector. Cosine compares the token features, which must be identical. The rewrite row times
`EXPAND_TOKENS` new tokens at most (random weights rarely stop early; the note gives the count of ids written and
tokens/s): a request with expand_prompts pays it before encoding, up to 1024 tokens.
"""

from __future__ import annotations

import gc
from dataclasses import dataclass

import torch

from k6serve.bench.components import TextComponents, build_text_components
from k6serve.bench.measure import cosine_similarity, measure
from k6serve.bench.report import BenchRow
from k6serve.pipelines.encode_text import (
    CLIP_MAX_LENGTH,
    MAX_SEQUENCE_LENGTH,
    PROMPT_TEMPLATE,
    QWEN_CROP_START,
    encode_prompt,
)
from k6serve.pipelines.expand_prompt import StaticRewriteCache, apply_rewrite_compile_config, expanded_token_ids
from k6serve.request import error_type_name

PROMPT = "A red fox runs through fresh snow at sunrise, the camera tracking it from the side."
EXPAND_TOKENS = 256  # a detailed rewrite's length; diffusers lets it run to 1024


@dataclass(frozen=True, kw_only=True, slots=True)
class TextOptions:
    device: torch.device
    dtype: torch.dtype
    tiny: bool = False
    repeats: int = 3
    warmup: int = 1


@torch.inference_mode()
def _reference_encode(parts: TextComponents, device: torch.device) -> torch.Tensor:
    inputs = parts.tokenizer(
        [PROMPT_TEMPLATE.format(PROMPT)],
        max_length=MAX_SEQUENCE_LENGTH + QWEN_CROP_START,
        truncation=True,
        padding="max_length",
        return_tensors="pt",
    ).to(device)
    hidden = parts.text_encoder(**inputs, output_hidden_states=True).hidden_states[-1]
    clip_inputs = parts.tokenizer_2(
        [PROMPT],
        max_length=CLIP_MAX_LENGTH,
        truncation=True,
        padding="max_length",
        return_tensors="pt",
    ).to(device)
    parts.text_encoder_2(**clip_inputs)["pooler_output"]
    return hidden[:, QWEN_CROP_START:]


def run_text(options: TextOptions) -> list[BenchRow]:
    config = "1024+129 Qwen tokens, 77 CLIP tokens"
    rows = [BenchRow(stage="text", name="reference full forward", config=config)]
    try:
        parts = build_text_components(tiny=options.tiny, device=options.device, dtype=options.dtype)
        reference = measure(
            lambda: _reference_encode(parts, options.device),
            device=options.device,
            repeats=options.repeats,
            warmup=options.warmup,
        )
        row = rows[0]
        row.record(reference)
        row.reference_seconds = row.seconds
        rows.append(BenchRow(stage="text", name="ours trunk only", config=config))
        ours = measure(
            lambda: encode_prompt(
                PROMPT,
                tokenizer=parts.tokenizer,
                text_encoder=parts.text_encoder,
                tokenizer_2=parts.tokenizer_2,
                text_encoder_2=parts.text_encoder_2,
                device=options.device,
                dtype=options.dtype,
            ),
            device=options.device,
            repeats=options.repeats,
            warmup=options.warmup,
        )
        row = rows[1]
        row.record(ours)
        row.reference_seconds = rows[0].seconds
        row.cosine_video = cosine_similarity(
            ours.output.tokens_BLD.float(), reference.output.float()
        )
        row.note = "cos video = cosine of the Qwen token features"
        rows.append(BenchRow(stage="text", name="ours expand_prompts", config=f"<= {EXPAND_TOKENS} new tokens"))
        rewrite = measure(
            lambda: expanded_token_ids(PROMPT, tokenizer=parts.tokenizer, text_encoder=parts.text_encoder,
                                       device=options.device, seed=0, max_new_tokens=EXPAND_TOKENS),
            device=options.device,
            repeats=options.repeats,
            warmup=options.warmup,
        )
        row = rows[2]
        row.record(rewrite)
        # The ids generate wrote, not the decoded text re-tokenized: random weights write mostly special and
        # unprintable tokens, so the text of 256 tokens was 4 tokens long (0.6 tokens/s, first H100 run).
        tokens = int(rewrite.output.shape[1])
        seconds = rewrite.median_s  # the row's seconds, as row.record took them
        row.note = (f"{tokens} tokens written, {seconds / tokens * 1000:.1f} ms a token "
                    f"({tokens / seconds:.1f} tokens/s); no diffusers row (its rewrite is the same transformers "
                    "generate)")
        rows.append(_static_cache_row(parts, options, rewrite))
    except Exception as error:  # noqa: BLE001 (a stage failure is a table row)
        rows[-1].error = f"{error_type_name(error)}: {error}"
    return rows


def _static_cache_row(parts: TextComponents, options: TextOptions, eager) -> BenchRow:
    """The same rewrite as requests run it with --compile-prompt-rewrite true: through one `StaticRewriteCache`,
    whose decoding step transformers compiles on CUDA. The eager generate spent 21-30 ms a token on an H100 (if it
    wrote all 256), where reading the 15 GB of weights takes about 5: the rest is the host launching kernels one by
    one. The row says whether the ids it writes are the eager ones (a compiled step rounds differently, and one
    flipped token changes the rewrite from there on); its first call, which compiles, is reported apart."""
    row = BenchRow(stage="text", name="ours expand_prompts, static cache", config=f"<= {EXPAND_TOKENS} new tokens")
    try:
        apply_rewrite_compile_config(parts.text_encoder, options.device)  # as the worker compiles it
        cache = StaticRewriteCache(parts.text_encoder.config)

        def run() -> torch.Tensor:
            return expanded_token_ids(PROMPT, tokenizer=parts.tokenizer, text_encoder=parts.text_encoder,
                                      device=options.device, seed=0, max_new_tokens=EXPAND_TOKENS,
                                      static_cache=cache)

        first = measure(run, device=options.device, repeats=1, warmup=0)
        static = measure(run, device=options.device, repeats=options.repeats, warmup=0)
        row.record(static)
        row.reference_seconds = eager.median_s  # the "x diffusers" column reads as x the eager rewrite here
        ids, eager_ids = static.output, eager.output
        if torch.equal(ids.cpu(), eager_ids.cpu()):
            same = "the same ids as the eager rewrite"
        else:
            length = min(ids.shape[1], eager_ids.shape[1])
            differ = (ids[0, :length].cpu() != eager_ids[0, :length].cpu()).nonzero()
            where = int(differ[0]) if len(differ) else length
            same = (f"ids differ from the eager rewrite's from token {where} (of {ids.shape[1]} and "
                    f"{eager_ids.shape[1]})")
        tokens = int(ids.shape[1])
        seconds = static.median_s  # the row's seconds, as row.record took them
        row.note = (f"{tokens} tokens, {seconds / tokens * 1000:.1f} ms a token; first call {first.median_s:.1f} s "
                    f"(compiles on CUDA); {same}; x column: against the eager rewrite")
    except Exception as error:  # noqa: BLE001 (a stage failure is a table row)
        row.error = f"{error_type_name(error)}: {error}"
    finally:
        # transformers keeps the compiled step on the model (`_compiled_call`, a reference cycle through it): the
        # 16 GB encoder outlived the stage until a collection, beside the next stage's model.
        vars(parts.text_encoder).pop("_compiled_call", None)
        gc.collect()
    return row
