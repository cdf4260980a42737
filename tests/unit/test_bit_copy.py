"""`copy_bits_`: the sequence-parallel layout copies moved as int64 words must give the bits of `copy_`."""

import pytest
import torch

from k6serve.parallel import bit_copy
from k6serve.parallel.bit_copy import copy_bits_


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous().view({2: torch.int16, 4: torch.int32}[x.element_size()])


def _word_copies(monkeypatch) -> list[torch.Tensor]:
    """Record the int64 word views `copy_bits_` copies from (empty when it fell back to `copy_`)."""
    seen, original = [], bit_copy._word_view

    def recording(x):
        words = original(x)
        if words is not None:
            seen.append(words)
        return words

    monkeypatch.setattr(bit_copy, "_word_view", recording)
    return seen


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_permuted_copy_moves_words_and_keeps_every_bit(monkeypatch, dtype):
    words = _word_copies(monkeypatch)
    source = torch.randn(2, 7, 3, 4, 16).to(dtype)  # (B, L, N, h, D): a Ulysses send copy
    source.view(torch.int8)[0, 0, 0, 0, :4] = -1  # NaN payloads travel unchanged (no float arithmetic)
    destination = torch.empty(3, 2, 7, 4, 16, dtype=dtype)
    copy_bits_(destination, source.permute(2, 0, 1, 3, 4))
    assert torch.equal(_bits(destination), _bits(source.permute(2, 0, 1, 3, 4)))
    assert len(words) == 2  # both sides went as words


def test_layouts_without_whole_words_fall_back_to_copy(monkeypatch):
    words = _word_copies(monkeypatch)
    source = torch.randn(5, 8).to(torch.bfloat16)
    for odd_view in (source[:, 1:7], source[:, :6], source.t()):  # offset, width, non-unit last stride
        destination = torch.empty(odd_view.shape, dtype=torch.bfloat16)
        copy_bits_(destination, odd_view)
        assert torch.equal(_bits(destination), _bits(odd_view))
    assert len(words) <= 3  # only destinations were viewable; never both sides of one copy
    float64 = torch.randn(3, 4, dtype=torch.float64)
    assert torch.equal(copy_bits_(torch.empty(3, 4, dtype=torch.float64), float64), float64)


def test_mismatched_tensors_are_refused():
    with pytest.raises(AssertionError):
        copy_bits_(torch.empty(2, 4, dtype=torch.bfloat16), torch.empty(2, 4, dtype=torch.float16))
