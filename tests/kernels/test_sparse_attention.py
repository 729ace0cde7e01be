"""DeepSeek V4's sparse attention kernel (sliding window of token rows + compressed entries, sinks): its torch
reference against the host path's math (surge/attention/deepseek_v4.py: sink_attention over the visible keys), the
kernel against the reference over shuffled paged caches at the N/N+1 boundaries of its tiles (window, top-k list,
complete entries, heads), with entries several to a block and one per several blocks, and its launch policy."""
from __future__ import annotations

import pytest
import torch

from surge.attention.deepseek_v4 import sink_attention
from surge.kernels.deepseek_v4_reference import sparse_attention as reference
from surge.kernels.sparse_attention import SparseAttention, SparseLaunch, launch_policy

_SMALL = SparseLaunch(block_h=16, block_n=16, head_dim_pad=32, num_warps=4)  # tiles the tests can cross cheaply


def _paged(num_blocks: int, block_size: int, dim: int, tables: list[int], g: torch.Generator, dtype):
    """A cache of random rows and block tables of `tables[i]` distinct shuffled blocks each (block 0 unused)."""
    cache = torch.randn(num_blocks, block_size, dim, generator=g).to(dtype)
    order = torch.randperm(num_blocks - 1, generator=g) + 1
    table = torch.zeros(len(tables), max(tables), dtype=torch.int32)
    used = 0
    for i, n in enumerate(tables):
        table[i, :n] = order[used:used + n].int()
        used += n
    return cache, table


def _case(positions: list[int], reqs: list[int], heads: int, window: int, rate: int, block_size: int, k: int | None,
          dtype=torch.float32, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    dim = 32
    seq_len = max(positions) + 1
    blocks = -(-seq_len // block_size)
    nreq = max(reqs) + 1
    rows, row_table = _paged(nreq * blocks + 3, block_size, dim, [blocks] * nreq, g, dtype)
    entries = entry_table = topk = None
    if rate:
        rows_per_block = max(1, block_size // rate)
        entries, entry_table = _paged(nreq * blocks + 3, rows_per_block, dim, [blocks] * nreq, g, dtype)
        if k is not None:  # each token's choice among its complete entries, unordered, -1 padded
            topk = torch.full((len(positions), k), -1, dtype=torch.int32)
            for t, p in enumerate(positions):
                chosen = torch.randperm((p + 1) // rate, generator=g)[:k]
                topk[t, :chosen.numel()] = chosen.int()
    q = torch.randn(len(positions), heads, dim, generator=g).to(dtype)
    sinks = torch.randn(heads, generator=g)
    args = (q, rows, row_table, torch.tensor(reqs, dtype=torch.int32), torch.tensor(positions), sinks)
    return args, dict(scale=dim ** -0.5, window=window, entries=entries, entry_table=entry_table, rate=rate,
                      topk=topk)


def _on(device, value):
    return value.to(device) if isinstance(value, torch.Tensor) else value


def _check(args, kw, device, launch=_SMALL, rtol=1e-5, atol=1e-5):
    """The kernel on `device` (CUDA when there is one, else the interpreter on the CPU) against the reference."""
    out = SparseAttention(device)(*(_on(device, a) for a in args), **{n: _on(device, v) for n, v in kw.items()},
                                  launch=launch)
    torch.testing.assert_close(out.cpu(), reference(*args, **kw), rtol=rtol, atol=atol)


@pytest.mark.parametrize("window", [16, 17])
def test_window_tile_boundary(window, device):
    """Sliding only: positions before, at and past the window's tile of 16, across requests; 17 heads (two tiles)."""
    _check(*_case([0, 5, 15, 16, 17, 40], [0, 1, 0, 1, 0, 1], heads=17, window=window, rate=0, block_size=4,
                  k=None), device)


@pytest.mark.parametrize("count", [16, 17])
def test_all_entries_tile_boundary(count, device):
    """HCA: every complete entry, at 16 and 17 of them (one tile, two), rate 8 over blocks of 4 (an entry every
    second block) and a query just before its window completes."""
    rate = 8
    _check(*_case([count * rate - 1, count * rate + rate - 2, 3], [0, 1, 1], heads=4, window=6, rate=rate,
                  block_size=4, k=None), device)


@pytest.mark.parametrize("k", [16, 17])
def test_topk_tile_boundary(k, device):
    """CSA: the listed entries (unordered, -1 padded: fewer complete than k for the short rows), rate 4 over blocks
    of 8 (two entries a block)."""
    _check(*_case([80, 67, 20, 2], [0, 1, 0, 1], heads=16, window=6, rate=4, block_size=8, k=k), device)


def test_default_policy_and_bfloat16(device, require_bf16_dot):
    """The launch policy's tiles (64 keys at head_dim 32), in bfloat16 against the float32-math reference."""
    _check(*_case([70, 9], [0, 0], heads=4, window=65, rate=4, block_size=4, k=3, dtype=torch.bfloat16),
           device, launch=None, rtol=2e-2, atol=2e-2)


def test_reference_matches_host_path_math():
    """The reference's keys and mask are the host path's: sink_attention over the window and the chosen entries."""
    (q, rows, table, reqs, positions, sinks), kw = _case([9, 12], [0, 0], heads=4, window=6, rate=4, block_size=4,
                                                          k=2)
    keys, visible = [], []
    flat, entries = rows.view(-1, rows.shape[-1]), kw["entries"].view(-1, rows.shape[-1])
    k_pos = torch.arange(13)
    keys = torch.cat((flat[table[0, k_pos // 4].long() * 4 + k_pos % 4], entries[kw["entry_table"][0, :3].long()]))
    window = (k_pos[None, :] <= positions[:, None]) & (k_pos[None, :] > positions[:, None] - 6)
    picked = torch.zeros(2, 3, dtype=torch.bool)
    for t in range(2):
        picked[t, kw["topk"][t][kw["topk"][t] >= 0].long()] = True
    visible = torch.cat((window, picked), dim=1)
    expected = sink_attention(q, keys, visible, sinks, kw["scale"])
    torch.testing.assert_close(reference(q, rows, table, reqs, positions, sinks, **kw), expected)


def test_policy_boundaries():
    assert launch_policy(1, 1) == SparseLaunch(16, 64, 16, 4)  # tl.dot's minimum tile
    assert launch_policy(17, 128) == SparseLaunch(32, 64, 128, 4)
    assert launch_policy(64, 512) == SparseLaunch(16, 16, 512, 8)  # V4-Flash: 8192-element tiles
    assert launch_policy(64, 129).head_dim_pad == 256 and launch_policy(64, 129).num_warps == 8
    for bad in ((0, 32), (4, 0), (4, 1025)):
        with pytest.raises(ValueError):
            launch_policy(*bad)
    with pytest.raises(ValueError, match="block_size=16 and rate=6"):
        SparseAttention(torch.device("cpu")).dispatch(num_heads=4, head_dim=32, window=8, block_size=16, rate=6,
                                                      topk=0, dtype=torch.float32)
