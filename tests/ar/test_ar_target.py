"""The AR target (:class:`dloom.ar.target.ARTarget`): its KV cache over left-padded rows of
different lengths, cropped and fed again, gives the logits of an uncached forward."""

from __future__ import annotations

import pytest
import torch

from dloom.ar.target import ARTarget
from dloom.check.tiny import tiny_ar


@pytest.fixture(scope="module")
def target():
    return tiny_ar(0, vocab=16, hidden=32, layers=2, init=0.8, context=128)


def test_cropped_cache_gives_the_uncached_logits_for_padded_rows_of_different_lengths(target):
    prompts = [[0, 0, 5, 6, 7], [3, 4, 9, 10, 11]]
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    ids = torch.tensor(prompts)
    ar = ARTarget(target)
    ar.reset(ids, mask, 10)
    assert ar.length == 4 and ar.forwards == 1
    first = torch.tensor([[7, 3, 4, 5], [11, 6, 0, 0]])  # row 0: 4 new columns, row 1: 2
    out = ar.forward(first, torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]]))
    assert ar.length == 8
    ar.crop(6)  # both rows keep columns 0..5; row 0 feeds its columns 6, 7 again
    second = torch.tensor([[4, 5, 8], [9, 0, 0]])
    out2 = ar.forward(second, torch.tensor([[1, 1, 1], [1, 0, 0]]))

    def uncached(row, tokens):
        full = torch.tensor([prompts[row] + tokens])
        full_mask = torch.cat([mask[row : row + 1], torch.ones(1, len(tokens), dtype=torch.long)], 1)
        positions = (full_mask.cumsum(-1) - 1).clamp(min=0)
        return target.model(input_ids=full, attention_mask=full_mask, position_ids=positions).logits[0]

    torch.testing.assert_close(out[0], uncached(0, [3, 4, 5])[4:], rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(out[1, :2], uncached(1, [6])[4:], rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(out2[0], uncached(0, [3, 4, 5, 8])[6:], rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(out2[1, :1], uncached(1, [6, 9])[6:], rtol=1e-10, atol=1e-10)
    with pytest.raises(ValueError, match="crop to 12 columns; allowed: 0 .. 9"):
        ar.crop(12)
