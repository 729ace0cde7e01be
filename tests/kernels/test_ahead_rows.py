"""The kernel that corrects rows scheduled ahead of their verdict (surge/kernels/ahead_rows.py) against the torch ops
it replaces in StepInputs.fill: random steps mixing ahead rows with known decode and prefill rows, one or two KV
cache groups, with and without a mixed graph's padding; every buffer equal, host lengths exact or bounds alike."""
from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch

from surge.core.scheduler_output import ScheduledRequest

BLOCK = 4


@pytest.mark.parametrize("num_groups", [1, 2])
@pytest.mark.parametrize("padded", [False, True])
def test_kernel_corrections_equal_the_torch_path(device, num_groups, padded):
    from surge.worker.step_inputs import DeviceDrafts, StepInputs

    rng = random.Random(num_groups * 10 + padded)
    for trial in range(8):
        k = rng.randint(1, 4)
        scheduled, states, ahead_ids = [], [], []
        for i in range(rng.randint(1, 6)):
            rid = f"r{i}"
            known = [rng.randrange(100) for _ in range(rng.randint(3, 30))]
            blocks = [[rng.randrange(1, 64) for _ in range(len(known) // BLOCK + 3)] for _ in range(num_groups)]
            states.append(SimpleNamespace(request_id=rid, token_ids=known, block_ids=blocks))
            kind = rng.choice(["ahead", "ahead", "decode", "prefill"])
            if kind == "ahead":  # the host counts every draft of the step in flight accepted: past what it knows
                scheduled.append(ScheduledRequest(rid, len(known) + rng.randint(0, k), 1 + k, True, device_drafts=k))
                ahead_ids.append(rid)
            elif kind == "decode":
                scheduled.append(ScheduledRequest(rid, len(known) - 1, 1, True))
            else:
                start = rng.randint(0, len(known) - 2)
                scheduled.append(ScheduledRequest(rid, start, rng.randint(1, len(known) - start), False))
        order = list(range(len(ahead_ids) + 2))  # rows of the device's tokens, spare rows between
        rng.shuffle(order)
        rows = dict(zip(ahead_ids, order))
        ahead = DeviceDrafts(rows, torch.randint(0, 100, (len(order), 1 + k), device=device),
                             torch.randint(0, k + 1, (len(order),), device=device))
        padding = (lambda t, r: (t + 5, r + 2)) if padded else None
        results = []
        for use_kernel in (True, False):
            inp = StepInputs(256, 16, 16, num_groups, BLOCK, device)
            inp.use_ahead_kernel = use_kernel
            for exact in (True, False):
                out = inp.fill(scheduled, states, ahead=ahead, mixed_padding=padding, exact_host_lengths=exact)
                results.append((out, [t.cpu().clone() for t in (inp.input_ids, inp.positions, inp.seq_lens,
                                                                inp.query_start_loc, *inp.slot_mapping)]))
        for (out_k, bufs_k), (out_t, bufs_t) in zip(results[:2], results[2:]):
            assert out_k == out_t, trial
            for a, b in zip(bufs_k, bufs_t):
                assert torch.equal(a, b), trial
        if ahead_ids:  # the exact and bound host lengths differ by what was rejected
            exact_lens, bound_lens = results[0][0][3], results[1][0][3]
            rejected = ahead.rejected.cpu()
            for i, s in enumerate(scheduled):
                extra = int(rejected[rows[s.request_id]]) if s.device_drafts else 0
                assert bound_lens[i] - exact_lens[i] == extra
