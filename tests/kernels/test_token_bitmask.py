"""The structured-output mask on the logits against a plain Python reading of the bit layout (bit t % 32 of word
t // 32 allows token t), and against llguidance's own numpy implementation of the same layout."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from surge.kernels.token_bitmask import _unpack, apply_token_bitmask_, bitmask_to_device, unpack_bitmask


def _reference(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> torch.Tensor:
    out = logits.clone()
    words = bitmask.tolist()
    for i, r in enumerate(rows):
        for t in range(logits.shape[1]):
            w = t // 32
            if w >= len(words[i]) or not (words[i][w] >> (t % 32)) & 1:  # Python ints: >> on a negative is fine
                out[r, t] = float("-inf")
    return out


def _random_mask(n: int, words: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-2 ** 31, 2 ** 31, (n, words), generator=g, dtype=torch.int64).to(torch.int32)


@pytest.mark.parametrize("vocab, words", [(64, 2), (70, 3), (100, 3), (31, 1)],
                         ids=["exact", "padded-row", "mask-shorter-than-row", "one-word"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_row_matches_reference(vocab, words, dtype, device):
    logits = torch.randn(4, vocab, generator=torch.Generator().manual_seed(0)).to(dtype)
    mask = _random_mask(4, words, 1)
    mask[0] = -1  # all allowed
    mask[1] = 0  # none allowed: the row is all -inf
    expected = _reference(logits, mask, [0, 1, 2, 3])
    got = logits.to(device)
    apply_token_bitmask_(got, mask.to(device))
    assert torch.equal(got.cpu(), expected)


def test_a_subset_of_rows(device):
    logits = torch.randn(6, 96, generator=torch.Generator().manual_seed(2))
    mask = _random_mask(3, 3, 3)
    rows = [4, 0, 2]
    expected = _reference(logits, mask, rows)
    got = logits.to(device)
    apply_token_bitmask_(got, mask.to(device), torch.tensor(rows, device=device))
    assert torch.equal(got.cpu(), expected)
    assert torch.equal(got[[1, 3, 5]].cpu(), logits[[1, 3, 5]])  # rows without a mask are untouched


def test_same_layout_as_llguidance():
    from llguidance.numpy import apply_token_bitmask_inplace

    logits = torch.randn(3, 150, generator=torch.Generator().manual_seed(4))
    mask = _random_mask(3, 5, 5)
    theirs = logits.numpy().copy()
    apply_token_bitmask_inplace(theirs, mask.numpy().astype(np.int32))
    apply_token_bitmask_(logits, mask)
    assert np.array_equal(logits.numpy(), theirs)


@pytest.mark.parametrize("use_numpy", [True, False], ids=["numpy", "torch"])
def test_both_unpackings_match_reference(use_numpy):
    mask = _random_mask(3, 4, 6)
    expected = [[bool((row[t // 32] >> (t % 32)) & 1) for t in range(128)] for row in mask.tolist()]
    assert unpack_bitmask(mask, 128, use_numpy).tolist() == expected
    assert unpack_bitmask(mask, 140, use_numpy)[:, 128:].sum() == 0  # past the mask: not allowed
    # What apply_token_bitmask_ masks: the negation, past the mask included.
    disallowed = _unpack(mask, 140, use_numpy, allowed=False)
    assert disallowed[:, :128].tolist() == [[not b for b in row] for row in expected]
    assert disallowed[:, 128:].all()


def test_unpack_and_bad_input():
    mask = torch.tensor([[0b101, 0]], dtype=torch.int32)
    assert unpack_bitmask(mask, 4).tolist() == [[True, False, True, False]]
    with pytest.raises(ValueError, match="bitmask must be a 2-D int32"):
        apply_token_bitmask_(torch.zeros(1, 4), torch.zeros(1, 1, dtype=torch.int64))


@pytest.mark.parametrize("writable", [True, False], ids=["engine-buffer", "step-message-bytes"])
def test_bitmask_to_device_keeps_every_word(writable, device):
    mask = _random_mask(3, 5, 7)
    raw = mask.numpy().astype("<i4").tobytes()
    buffer = memoryview(bytearray(raw)) if writable else raw
    words = bitmask_to_device(buffer, 3, 5, torch.device(device))
    assert words.dtype == torch.int32 and words.device.type == torch.device(device).type
    assert words.cpu().tolist() == mask.tolist()
    if writable and words.device.type == "cpu":  # the engine's buffer is read in place, not copied
        assert words.data_ptr() == np.frombuffer(buffer, dtype=np.int32).ctypes.data
