"""The n-gram step kernel (append + lookup in one launch) against the plain scan and the torch path it replaces:
rows of different lengths, sampled and verified rows in one batch, verdicts in a flat buffer or a broadcast matrix
(strided accepted counts), through many steps of growth."""
from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from surge.config import SpeculativeConfig
from ngram_reference import reference_propose


def _verdicts(rng: random.Random, k: int, n: int, matrix: bool, device: torch.device):
    """n random verdicts: (Verdicts, each one's kept tokens). matrix: laid out as the TP broadcast lays them out."""
    from surge.worker.ngram_lookup import Verdicts

    num_drafts = [rng.randint(0, k) for _ in range(n)]
    accepted = [rng.randint(0, d) for d in num_drafts]
    tokens = [[rng.randrange(3) for _ in range(d + 1)] for d in num_drafts]
    kept = [t[:a + 1] for t, a in zip(tokens, accepted)]
    if matrix:
        buf = torch.zeros(n, k + 2, dtype=torch.int64)
        for j, t in enumerate(tokens):
            buf[j, :len(t)] = torch.tensor(t)
            buf[j, k + 1] = accepted[j]
        buf = buf.to(device)
        return Verdicts(buf.view(-1), [j * (k + 2) for j in range(n)], num_drafts, buf[:, k + 1]), kept
    flat = torch.tensor([x for t in tokens for x in t], dtype=torch.int64, device=device)
    starts = np.cumsum([0] + [d + 1 for d in num_drafts[:-1]]).tolist()
    return Verdicts(flat, starts, num_drafts, torch.tensor(accepted, dtype=torch.int32, device=device)), kept


@pytest.mark.parametrize("lo,hi,k", [(1, 4, 4), (2, 3, 1), (1, 1, 5), (3, 5, 3), (2, 8, 2)])
@pytest.mark.parametrize("matrix", [False, True])
def test_kernel_step_matches_the_torch_path_and_a_plain_scan(device, lo, hi, k, matrix):
    from surge.worker.ngram_lookup import DeviceNgram

    rng = random.Random(lo * 100 + hi * 10 + k + matrix)
    config = SpeculativeConfig("ngram", k, prompt_lookup_min=lo, prompt_lookup_max=hi)
    # Rows far longer than a block of the kernel's scan (512) for some; two tables kept in step.
    kernel = DeviceNgram(config, 1400, device, use_kernel=True)
    torch_path = DeviceNgram(config, 1400, device, use_kernel=False)
    seqs = {f"r{i}": [rng.randrange(3) for _ in range(rng.choice([1, 2, 5, 12, 600, 1100]))] for i in range(11)}
    for table in (kernel, torch_path):
        for rid, tokens in seqs.items():
            table.add(rid, torch.tensor(tokens, device=device))
        table.remove(["r3"])
    del seqs["r3"]
    for step in range(6):
        rids = list(seqs)
        rng.shuffle(rids)
        num_sampled = rng.randint(0, len(rids))
        sampled = torch.tensor([rng.randrange(3) for _ in range(num_sampled)], dtype=torch.int64, device=device)
        verdicts, kept = _verdicts(rng, k, len(rids) - num_sampled, matrix, device)
        new = [[t] for t in sampled.tolist()] + kept
        args = (sampled if num_sampled else None, verdicts if len(rids) > num_sampled else None)
        got = kernel.step([kernel.row_of[r] for r in rids], *args)
        want = torch_path.step([torch_path.row_of[r] for r in rids], *args)
        for g, w, what in zip(got, want, ("tokens", "rejected", "valid")):
            assert torch.equal(g.cpu(), w.cpu()), (what, step)
        tokens, rejected, valid = (t.cpu() for t in got)
        for i, rid in enumerate(rids):
            seqs[rid] += new[i]
            assert tokens[i, 0] == seqs[rid][-1]
            assert tokens[i, 1:1 + valid[i]].tolist() == reference_propose(seqs[rid], k, lo, hi), (rid, step)
            assert tokens[i, 1 + valid[i]:].tolist() == [seqs[rid][-1]] * (k - int(valid[i]))
            if i >= num_sampled:
                j = i - num_sampled
                assert rejected[i] == verdicts.num_drafts[j] - (len(kept[j]) - 1)
            else:
                assert rejected[i] == 0
        for table in (kernel, torch_path):
            lengths = table.lengths.cpu()
            assert [int(lengths[table.row_of[r]]) for r in rids] == [len(seqs[r]) for r in rids]
