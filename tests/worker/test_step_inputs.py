"""StepInputs: a mixed step whose graph padding comes with fill's own copies holds exactly what fill followed by
pad_mixed's fills leaves, and pad_mixed writes again only when the buffers may hold something else."""
from __future__ import annotations

from types import SimpleNamespace

import torch

from surge.core.scheduler_output import ScheduledRequest
from surge.worker.step_inputs import StepInputs

BLOCK = 4


def _step():
    """A verification row (3 known tokens + 2 drafts computed from position 1) and a 3-token prefill chunk."""
    scheduled = [ScheduledRequest("a", 1, 4, True, spec_token_ids=[7, 8]),
                 ScheduledRequest("b", 0, 3, False)]
    states = [SimpleNamespace(request_id="a", token_ids=[11, 12, 13], block_ids=[[5, 2]]),
              SimpleNamespace(request_id="b", token_ids=[21, 22, 23, 24], block_ids=[[9]])]
    return scheduled, states


def _buffers(inp: StepInputs) -> list[torch.Tensor]:
    return [inp.input_ids, inp.positions, inp.seq_lens, inp.query_start_loc, *inp.slot_mapping, *inp.block_tables]


def test_fill_with_mixed_padding_equals_fill_then_pad_mixed():
    asked = []

    def padding(num_tokens, num_reqs):
        asked.append((num_tokens, num_reqs))
        return 16, 6

    fused, plain = (StepInputs(32, 8, 4, 1, BLOCK, torch.device("cpu")) for _ in range(2))
    for inp in (fused, plain):  # stale values from an earlier, larger step, where the padding goes
        for buf in _buffers(inp):
            buf.fill_(3)
    scheduled, states = _step()
    assert fused.fill(scheduled, states, mixed_padding=padding)[:2] == (7, 2)
    assert asked == [(7, 2)]
    plain.fill(scheduled, states)
    plain.pad_mixed(7, 2, 16, 6)
    for got, want in zip(_buffers(fused), _buffers(plain)):
        assert torch.equal(got, want)
    assert fused.query_start_loc[:8].tolist() == [0, 4, 7, 7, 7, 7, 7, 3]
    assert fused.slot_mapping[0][:16].tolist() == [21, 22, 23, 8, 36, 37, 38] + [-1] * 9
    assert fused.positions[7:16].eq(0).all() and fused.seq_lens[:7].tolist() == [5, 3, 0, 0, 0, 0, 3]


def test_pad_mixed_writes_only_when_the_layout_may_have_changed():
    inp = StepInputs(32, 8, 4, 1, BLOCK, torch.device("cpu"))
    scheduled, states = _step()
    inp.fill(scheduled, states, mixed_padding=lambda t, r: (16, 6))
    inp.slot_mapping[0][10] = 99  # a marker in the padding: only a real write would clear it
    inp.pad_mixed(7, 2, 16, 6)  # fill laid this very padding out: nothing to do
    assert inp.slot_mapping[0][10] == 99
    inp.pad_mixed(7, 2, 32, 6)  # another graph's padding: written
    assert inp.slot_mapping[0][10] == -1
    inp.slot_mapping[0][10] = 99
    inp.pad_decode(1, 4)  # a decode replay in between: the mixed layout is gone
    inp.pad_mixed(7, 2, 32, 6)
    assert inp.slot_mapping[0][10] == -1
    inp.slot_mapping[0][10] = 99
    inp.fill(scheduled, states)  # a fill without padding: neither
    inp.pad_mixed(7, 2, 32, 6)
    assert inp.slot_mapping[0][10] == -1


def test_decode_steps_are_never_padded_as_mixed():
    inp = StepInputs(32, 8, 4, 1, BLOCK, torch.device("cpu"))
    scheduled = [ScheduledRequest("a", 2, 1, True)]
    states = [SimpleNamespace(request_id="a", token_ids=[11, 12, 13], block_ids=[[5]])]

    def padding(num_tokens, num_reqs):
        raise AssertionError("a decode step asked for mixed padding")
    assert inp.fill(scheduled, states, mixed_padding=padding)[:2] == (1, 1)
    assert inp.slot_mapping[0][0] == 22
