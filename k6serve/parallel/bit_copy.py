"""Layout copies of bf16/fp16 tensors moved as 8-byte words: the same bits, a quarter of the elements.

The sequence-parallel exchanges permute tensors into send buffers and back (Ulysses' per-rank head groups, the
packed K/V of a gather). Both sides are strided, so PyTorch runs its generic, non-vectorised copy kernel, whose
cost is per element: on the H200 profile of a Pro-distill Ulysses2 step (docs/benchmarks.md, fourth session) 365
such copies took 78.5 ms, about twice what their bytes need. Reinterpreting the last dim as int64 words (4 bf16
values each) keeps every byte where it was and cuts the elements, and so the index arithmetic, by 4. It is a
bit copy by construction: int64 loads and stores do no floating-point work.
"""

from __future__ import annotations

import torch
from torch import Tensor

_WORD = torch.int64
_WORD_BYTES = 8


def _word_view(x: Tensor) -> Tensor | None:
    """`x` viewed as int64 words along its last dim, or None where its layout does not allow it."""
    if x.element_size() >= _WORD_BYTES or x.dim() == 0 or x.untyped_storage().data_ptr() % _WORD_BYTES:
        return None
    try:  # Tensor.view(dtype) itself refuses layouts that are not whole words (last stride, size, offset, strides)
        return x.view(_WORD)
    except RuntimeError:
        return None


def copy_bits_(destination: Tensor, source: Tensor) -> Tensor:
    """`destination.copy_(source)` for tensors of the same shape and dtype, moved as int64 words when both
    layouts allow it (last dim contiguous, sizes and offsets in whole words); else a plain copy."""
    assert destination.shape == source.shape and destination.dtype == source.dtype, (
        destination.shape, source.shape, destination.dtype, source.dtype)
    destination_words, source_words = _word_view(destination), _word_view(source)
    if destination_words is None or source_words is None:
        return destination.copy_(source)
    destination_words.copy_(source_words)
    return destination
