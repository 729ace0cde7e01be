"""StepInputs: a mixed step whose graph padding comes with fill's own copies holds exactly what fill followed by
pad_mixed's fills leaves, pad_mixed writes again only when the buffers may hold something else, and rows scheduled
ahead of their verdict end up where an exact host schedule would have put them."""
from __future__ import annotations

from types import SimpleNamespace

import torch

from surge.core.scheduler_output import ScheduledRequest
from surge.worker.step_inputs import DeviceDrafts, StepInputs

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


def test_rows_scheduled_ahead_take_the_device_tokens_and_start_where_the_verdict_ended():
    """Request a: its verdict accepted 1 of 3 drafts (2 rejected), so the host's count (every draft accepted) is 2
    positions too far; c accepted everything. Each takes its newest token and k = 2 drafts from DeviceDrafts, and
    the buffers equal a fill of the same rows scheduled exactly, tokens known (b, a prefill chunk, between them).
    The host's lengths come back exact when asked, as upper bounds otherwise."""
    k = 2
    a_known, c_known = [11, 12, 13, 14, 15, 16], [31, 32, 33]  # the device's history, the newest token last
    ahead = DeviceDrafts({"c": 0, "a": 1}, torch.tensor([[33, 40, 41], [16, 50, 51]]), torch.tensor([0, 2]))
    states = [SimpleNamespace(request_id="a", token_ids=a_known[:4], block_ids=[[5, 2, 7]]),
              SimpleNamespace(request_id="b", token_ids=[21, 22, 23, 24], block_ids=[[9]]),
              SimpleNamespace(request_id="c", token_ids=c_known[:2], block_ids=[[3]])]
    scheduled = [ScheduledRequest("a", 7, 1 + k, True, device_drafts=k), ScheduledRequest("b", 0, 3, False),
                 ScheduledRequest("c", 2, 1 + k, True, device_drafts=k)]
    exact_states = [SimpleNamespace(request_id="a", token_ids=a_known, block_ids=[[5, 2, 7]]), states[1],
                    SimpleNamespace(request_id="c", token_ids=c_known, block_ids=[[3]])]
    exact = [ScheduledRequest("a", 5, 1 + k, True, spec_token_ids=[50, 51]), scheduled[1],
             ScheduledRequest("c", 2, 1 + k, True, spec_token_ids=[40, 41])]
    got, want, bound = (StepInputs(32, 8, 4, 1, BLOCK, torch.device("cpu")) for _ in range(3))
    assert got.fill(scheduled, states, ahead=ahead) == want.fill(exact, exact_states)
    for g, w in zip(_buffers(got), _buffers(want)):
        assert torch.equal(g, w)
    assert got.input_ids[:9].tolist() == [16, 50, 51, 21, 22, 23, 33, 40, 41]
    assert got.positions[:3].tolist() == [5, 6, 7] and got.slot_mapping[0][:3].tolist() == [9, 10, 11]
    assert bound.fill(scheduled, states, ahead=ahead, exact_host_lengths=False)[3] == [10, 3, 5]
    for g, w in zip(_buffers(bound), _buffers(want)):  # the device's copies are exact either way
        assert torch.equal(g, w)
