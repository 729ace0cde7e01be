"""Triton paged attention and KV write against TorchAttentionBackend and a dense float64 reference: mixed batches of
decode rows and prefill chunks with cached context, GQA, sliding windows, logit soft-capping and sinks, NaN in every
slot nobody wrote."""
from __future__ import annotations

import math

import pytest
import torch

from surge.attention.backend import AttentionMetadata, AttentionParams
from surge.attention.torch_backend import TorchAttentionBackend

# (context tokens already cached, new tokens this step) per request
MIXED = [(0, 1), (16, 1), (38, 1), (0, 7), (21, 12), (5, 33)]
DECODE = [(0, 1), (16, 1), (38, 1), (70, 1)]


def params(q, cache, window, scale, softcap=None, sinks=None):
    """The layer parameters of q [T, Hq, D] over cache [2, N, B, Hkv, D]."""
    return AttentionParams(q.shape[1], cache.shape[3], q.shape[2], scale, window, logit_softcap=softcap,
                           has_sinks=sinks is not None)


def _batch(requests, block_size, num_q_heads, num_kv_heads, head_dim, dtype, device, seed):
    """Random q/k/v for the new tokens, a cache holding every request's context (blocks scattered, null block 0
    never used) with NaN everywhere else, and the step's metadata."""
    gen = torch.Generator().manual_seed(seed)
    max_blocks = max(math.ceil((c + n) / block_size) for c, n in requests)
    num_blocks = 1 + len(requests) * max_blocks
    order = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    tables = torch.zeros(len(requests), max_blocks, dtype=torch.int32)
    cache = torch.full((2, num_blocks, block_size, num_kv_heads, head_dim), float("nan"), dtype=dtype)
    full_k, full_v, slots, qsl = [], [], [], [0]
    for r, (ctx, new) in enumerate(requests):
        blocks = [order.pop() for _ in range(math.ceil((ctx + new) / block_size))]
        tables[r, :len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
        kv = torch.randn(2, ctx + new, num_kv_heads, head_dim, generator=gen).to(dtype)
        full_k.append(kv[0])
        full_v.append(kv[1])
        for p in range(ctx + new):
            slot = blocks[p // block_size] * block_size + p % block_size
            if p < ctx:
                cache.view(2, -1, num_kv_heads, head_dim)[:, slot] = kv[:, p]
            else:
                slots.append(slot)
        qsl.append(qsl[-1] + new)
    num_tokens = qsl[-1]
    q = torch.randn(num_tokens, num_q_heads, head_dim, generator=gen).to(dtype)
    k_new = torch.cat([fk[c:] for fk, (c, _) in zip(full_k, requests)])
    v_new = torch.cat([fv[c:] for fv, (c, _) in zip(full_v, requests)])
    seq_lens = [c + n for c, n in requests]
    meta = AttentionMetadata(
        num_reqs=len(requests), num_tokens=num_tokens, query_start_loc=qsl, seq_lens=seq_lens,
        max_query_len=max(n for _, n in requests), max_seq_len=max(seq_lens),
        query_start_loc_t=torch.tensor(qsl, dtype=torch.int32, device=device),
        seq_lens_t=torch.tensor(seq_lens, dtype=torch.int64, device=device),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device), block_table=tables.to(device))
    return (q.to(device), k_new.to(device), v_new.to(device), cache.to(device), meta, full_k, full_v)


def _dense_reference(q, full_k, full_v, requests, window, scale, softcap=None, sinks=None, causal_end=None):
    """Per request, per query: explicit softmax over visible positions, in float64; soft-capped scores
    cap * tanh(s / cap); a sink: one more logit per head in the denominator, weighting no value; causal_end: per
    token, the last position it sees when past its own (an image's end)."""
    out = torch.empty(q.shape, dtype=torch.float64)
    group = q.shape[1] // full_k[0].shape[1]
    t = 0
    for (ctx, new), keys, values in zip(requests, full_k, full_v):
        keys = keys.double().repeat_interleave(group, dim=1)
        values = values.double().repeat_interleave(group, dim=1)
        for i in range(new):
            pos = ctx + i
            lo = 0 if window is None else max(0, pos - window + 1)
            hi = pos if causal_end is None else max(pos, int(causal_end[t]))
            scores = torch.einsum("hd,khd->hk", q[t].double().cpu(), keys[lo:hi + 1]) * scale
            if softcap is not None:
                scores = softcap * torch.tanh(scores / softcap)
            if sinks is not None:
                probs = torch.cat((scores, sinks.double().cpu()[:, None]), dim=-1).softmax(-1)[:, :-1]
            else:
                probs = scores.softmax(-1)
            out[t] = torch.einsum("hk,khd->hd", probs, values[lo:hi + 1])
            t += 1
    return out


def _run_triton(q, k, v, cache, meta, window, scale, num_sms=None, softcap=None, sinks=None):
    from surge.attention.triton_backend import TritonAttentionBackend

    backend = TritonAttentionBackend()
    if num_sms is not None:
        from surge.kernels.attention import PagedAttention
        backend._kernels[q.device] = PagedAttention(q.device, num_sms)
    return backend.forward(q, k, v, cache, meta, params(q, cache, window, scale, softcap, sinks), sinks=sinks)


TOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}

CASES = [  # block_size, (Hq, Hkv), head_dim, window, dtype
    (16, (4, 2), 32, None, torch.float32),
    (4, (8, 2), 32, 9, torch.float32),
    (16, (8, 2), 32, 20, torch.float16),
    (4, (4, 2), 24, None, torch.float16),  # head_dim padded to a power of two
    (16, (8, 2), 32, None, torch.bfloat16),
    (4, (2, 2), 16, 5, torch.bfloat16),  # no GQA, window shorter than a block
]


@pytest.mark.parametrize("requests", [MIXED, DECODE], ids=["mixed", "decode"])
@pytest.mark.parametrize("block_size,heads,head_dim,window,dtype", CASES)
def test_attention_matches_references(requests, block_size, heads, head_dim, window, dtype, device, request):
    if dtype == torch.bfloat16:
        request.getfixturevalue("require_bf16_dot")
    q, k, v, cache, meta, full_k, full_v = _batch(requests, block_size, *heads, head_dim, dtype, device, seed=7)
    scale = head_dim ** -0.5
    zeroed = torch.nan_to_num(cache, nan=0.0)  # the torch backend reads masked slots: it needs a zeroed cache
    expected = TorchAttentionBackend().forward(q, k, v, zeroed, meta, params(q, cache, window, scale))
    got = _run_triton(q, k, v, cache, meta, window, scale)
    assert not got.isnan().any(), "NaN from unwritten slots leaked into the output"
    # The KV write put the new tokens exactly where the torch backend did; untouched slots kept their NaN.
    assert torch.equal(torch.nan_to_num(cache, nan=0.0), zeroed)
    dense = _dense_reference(q, full_k, full_v, requests, window, scale)
    tol = TOL[dtype]
    torch.testing.assert_close(got.double().cpu(), dense, atol=tol, rtol=tol)
    torch.testing.assert_close(got.float(), expected.float(), atol=2 * tol, rtol=2 * tol)


@pytest.mark.parametrize("num_sms", [1, 64])
@pytest.mark.parametrize("requests", [MIXED, DECODE], ids=["mixed", "decode"])
def test_sliding_window_reads_nothing_before_the_window(requests, num_sms, device):
    """A sliding group frees the blocks that left every window, and a prefix hit maps them to the null block: their
    slots may hold anything. NaN before the step's first window start (in a tile the window starts inside, and in
    whole blocks pointing at the null block) must not reach the output (0 * NaN is NaN)."""
    block_size, window = 4, 9
    q, k, v, cache, meta, full_k, full_v = _batch(requests, block_size, 8, 2, 32, torch.float32, device, seed=5)
    flat = cache.view(2, -1, 2, 32)
    for r, (ctx, _) in enumerate(requests):
        first = max(0, ctx - window + 1)  # the earliest position any of the request's queries sees
        for p in range(first):
            flat[:, int(meta.block_table[r, p // block_size]) * block_size + p % block_size] = float("nan")
        meta.block_table[r, :first // block_size] = 0
    got = _run_triton(q, k, v, cache, meta, window, 32 ** -0.5, num_sms=num_sms)
    assert not got.isnan().any(), "NaN from slots before the window leaked into the output"
    dense = _dense_reference(q, full_k, full_v, requests, window, 32 ** -0.5)
    torch.testing.assert_close(got.double().cpu(), dense, atol=TOL[torch.float32], rtol=TOL[torch.float32])


@pytest.mark.parametrize("num_sms", [1, 8, 64])  # 1 split, a few, the maximum
def test_split_kv_decode_matches_reference(num_sms, device):
    requests = [(0, 1), (150, 1), (37, 1)]
    q, k, v, cache, meta, full_k, full_v = _batch(requests, 16, 8, 2, 32, torch.float32, device, seed=3)
    from surge.kernels.attention import launch_policy
    splits = launch_policy(decode_only=True, num_seqs=3, num_q_heads=8, num_kv_heads=2, head_dim=32,
                           dtype=torch.float32, num_sms=num_sms).num_splits
    assert splits == {1: 1, 8: 8, 64: 16}[num_sms]
    got = _run_triton(q, k, v, cache, meta, None, 32 ** -0.5, num_sms=num_sms)
    dense = _dense_reference(q, full_k, full_v, requests, None, 32 ** -0.5)
    torch.testing.assert_close(got.double().cpu(), dense, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("window", [None, 9])
@pytest.mark.parametrize("num_sms", [1, 8, 132])  # 2 splits (2 KV heads), the maximum, the H200
def test_split_kv_few_token_mixed_step_matches_reference(num_sms, window, device):
    """A verification-shaped step (a few tokens per request over long contexts, a decode row, a short prefill):
    split like decode, merged, equal to the dense reference."""
    from surge.kernels.attention import launch_policy

    requests = [(150, 5), (37, 3), (0, 4), (90, 1)]
    q, k, v, cache, meta, full_k, full_v = _batch(requests, 16, 8, 2, 32, torch.float32, device, seed=4)
    splits = launch_policy(decode_only=False, num_seqs=4, num_q_heads=8, num_kv_heads=2, head_dim=32,
                           dtype=torch.float32, num_sms=num_sms, num_tokens=meta.num_tokens).num_splits
    assert splits == {1: 2, 8: 16, 132: 16}[num_sms]
    got = _run_triton(q, k, v, cache, meta, window, 32 ** -0.5, num_sms=num_sms)
    dense = _dense_reference(q, full_k, full_v, requests, window, 32 ** -0.5)
    torch.testing.assert_close(got.double().cpu(), dense, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("num_sms", [1, 132])  # without and with split-KV
def test_padding_rows_of_a_graph_batch_are_harmless(num_sms, device):
    """A CUDA-graph batch padded to its capture size: padding rows have seq_len 0 and slot -1. They write nothing,
    read nothing, come out as zeros, and leave the real rows unchanged."""
    requests = [(9, 1), (30, 1)]
    q, k, v, cache, meta, full_k, full_v = _batch(requests, 16, 8, 2, 32, torch.float32, device, seed=5)
    pad = 2
    qp = torch.cat([q, torch.randn(pad, *q.shape[1:], device=device)])
    kp, vp = (torch.cat([t, torch.randn(pad, *t.shape[1:], device=device)]) for t in (k, v))
    meta.num_reqs, meta.num_tokens = 2 + pad, 2 + pad
    meta.query_start_loc = [0, 1, 2, 3, 4]
    meta.query_start_loc_t = torch.arange(5, dtype=torch.int32, device=device)
    meta.seq_lens_t = torch.cat([meta.seq_lens_t, torch.zeros(pad, dtype=torch.int64, device=device)])
    meta.slot_mapping = torch.cat([meta.slot_mapping, torch.full((pad,), -1, device=device)])
    meta.block_table = torch.cat([meta.block_table, torch.zeros_like(meta.block_table[:pad])])
    before = cache.clone()
    got = _run_triton(qp, kp, vp, cache, meta, None, 32 ** -0.5, num_sms=num_sms)
    assert torch.equal(got[2:], torch.zeros_like(got[2:]))
    # Only the real rows' k and v were written (2 tokens x {k, v} x 2 heads x 32 dims): the NaN fill elsewhere stays.
    assert int((cache.isnan() != before.isnan()).sum()) == 2 * 2 * 2 * 32
    dense = _dense_reference(q, full_k, full_v, requests, None, 32 ** -0.5)
    torch.testing.assert_close(got[:2].double().cpu(), dense, atol=2e-5, rtol=2e-5)


def test_kv_write_skips_negative_slots(device):
    from surge.kernels.kv_cache import write_kv_cache

    cache = torch.zeros(2, 3, 4, 2, 8, device=device)
    kv = torch.randn(2, 3, 2, 8, device=device)
    write_kv_cache(kv[0], kv[1], cache[0], cache[1], torch.tensor([5, -1, 11], device=device))
    expected = torch.zeros(2, 12, 2, 8, device=device)
    expected[:, 5], expected[:, 11] = kv[:, 0], kv[:, 2]
    assert torch.equal(cache.view(2, 12, 2, 8), expected)


def test_launch_policy_boundaries():
    from surge.kernels.attention import FEW_TOKENS, MAX_SPLITS, PROGRAMS_PER_SM, launch_policy

    def policy(**kw):
        args = dict(decode_only=True, num_seqs=1, num_q_heads=32, num_kv_heads=8, head_dim=128,
                    dtype=torch.bfloat16, num_sms=132)
        return launch_policy(**{**args, **kw})

    # Splits stop once num_seqs * Hkv programs reach PROGRAMS_PER_SM * num_sms: 528 = 66 * 8.
    assert PROGRAMS_PER_SM * 132 == 66 * 8
    assert policy(num_seqs=65).num_splits == 2 and policy(num_seqs=66).num_splits == 1
    assert policy(num_seqs=33).num_splits == 2 and policy(num_seqs=32).num_splits == 4  # 33*8*2 >= 528 > 32*8*2
    assert policy(num_seqs=1).num_splits == MAX_SPLITS
    assert policy(num_seqs=1, num_sms=1).num_splits == 1
    # Head size 128 keeps 64-wide KV tiles, 129 halves them; fp32 halves them too.
    assert policy(head_dim=128).block_n == 64 and policy(head_dim=129).block_n == 32
    assert policy(dtype=torch.float32).block_n == 32 and policy(dtype=torch.float32).num_warps == 8
    assert policy(decode_only=False, dtype=torch.float32).block_m == 16 and policy().num_warps == 4
    # Decode tiles hold one token's group, padded to the MMA minimum of 16 rows: group 16 -> 16, group 17 -> 32.
    assert policy(num_q_heads=16 * 8).block_m == 16 and policy(num_q_heads=17 * 8).block_m == 32
    assert policy().block_q == 1
    # Mixed batches: 64-row tiles, block_q tokens of the padded group; split only up to FEW_TOKENS tokens, as one
    # request's decode (8 KV heads: 16 splits on 132 SMs).
    mixed = policy(decode_only=False, num_seqs=1)
    assert (mixed.block_m, mixed.block_q, mixed.num_splits) == (64, 16, 1)
    assert policy(decode_only=False, num_seqs=256, num_tokens=FEW_TOKENS).num_splits == MAX_SPLITS
    assert policy(decode_only=False, num_seqs=256, num_tokens=FEW_TOKENS + 1).num_splits == 1
    assert policy(decode_only=False, num_seqs=256, num_tokens=5, num_sms=1).num_splits == 1
    # Few-token launches find a tile's request in one load covering every row that can own a tile, plus one (its
    # end): 64 // 16 + 64 tiles at most; one width for all of them (one variant); larger launches bisect.
    few = [policy(decode_only=False, num_seqs=s, num_tokens=t) for s, t in ((256, 5), (1, 16), (256, FEW_TOKENS))]
    assert {p.search for p in few} == {128} and 128 >= FEW_TOKENS // 16 + FEW_TOKENS + 1
    assert policy(decode_only=False, num_seqs=256, num_tokens=FEW_TOKENS + 1).search == 0
    assert policy(decode_only=False, num_q_heads=64 * 8, num_tokens=FEW_TOKENS).search == 256  # block_q 1
    assert policy(decode_only=True, num_seqs=256, num_tokens=5) == policy(decode_only=True, num_seqs=256)
    assert policy(decode_only=False, num_q_heads=64 * 8).block_q == 1
    assert policy(decode_only=False, num_q_heads=65 * 8).block_m == 128
    # Capacities only: the policy has no argument for sequence lengths.
    with pytest.raises(ValueError, match="num_kv_heads"):
        policy(num_q_heads=30)


# Spare rows; rows exactly full; more rows than tokens (the grid then counts tokens, not rows); more rows than a
# few-token launch's one-load request search covers (it need not: rows past the grid own no tile).
@pytest.mark.parametrize("padded_tokens,padded_reqs", [(64, 9), (600, 6), (64, 80), (64, 300)])
@pytest.mark.parametrize("num_sms", [None, 132])  # with 132, split-KV: the merge skips the padding tokens
def test_mixed_graph_padding_leaves_real_rows_alone(padded_tokens, padded_reqs, num_sms, device):
    """A mixed step laid out as its CUDA graph replays it (StepInputs.pad_mixed): padding tokens belong to no request,
    padding rows have none. Real rows equal the unpadded launch's, the padding writes no KV, and no tile reads past
    a block table (600 padding tokens would need 38 blocks of a 4-block table if a request owned them)."""
    from surge.attention.triton_backend import TritonAttentionBackend
    from surge.worker.step_inputs import StepInputs

    requests = MIXED
    q, k, v, cache, meta, full_k, full_v = _batch(requests, 16, 8, 2, 32, torch.float32, device, seed=11)
    n, r = meta.num_tokens, meta.num_reqs
    inputs = StepInputs(padded_tokens, padded_reqs, meta.block_table.shape[1], 1, 16, device)
    inputs.query_start_loc[:r + 1].copy_(meta.query_start_loc_t)
    inputs.seq_lens[:r].copy_(meta.seq_lens_t)
    inputs.slot_mapping[0][:n].copy_(meta.slot_mapping)
    inputs.block_tables[0][:r].copy_(meta.block_table)
    inputs.pad_mixed(n, r, padded_tokens, padded_reqs)
    assert inputs.query_start_loc[padded_reqs] == n and not inputs.seq_lens[r:padded_reqs].any()
    padded = inputs.metadata(TritonAttentionBackend(), padded_tokens, padded_reqs, [], [], padded_tokens, 64,
                             for_capture=True)[0]
    extra = padded_tokens - n
    gen = torch.Generator().manual_seed(1)
    qp, kp, vp = (torch.cat([t, torch.randn(extra, *t.shape[1:], generator=gen).to(device)]) for t in (q, k, v))
    before = cache.clone()
    got = _run_triton(qp, kp, vp, cache, padded, None, 32 ** -0.5, num_sms=num_sms)
    written = cache.isnan() != before.isnan()
    assert int(written.sum()) == n * 2 * 2 * 32  # the real tokens' k and v only
    dense = _dense_reference(q, full_k, full_v, requests, None, 32 ** -0.5)
    torch.testing.assert_close(got[:n].double().cpu(), dense, atol=2e-5, rtol=2e-5)


# Soft-capping and sinks through every launch shape: (requests, num_sms, the splits the policy must pick). Decode
# without and with split-KV, a few-token mixed step (split, merged), a general mixed batch (over FEW_TOKENS tokens:
# one launch, requests found by bisection).
SHAPES = {
    "decode": ([(0, 1), (150, 1), (37, 1)], 1, 1),
    "decode-split": ([(0, 1), (150, 1), (37, 1)], 64, 16),
    "few-token-split": ([(150, 5), (37, 3), (0, 4), (90, 1)], 132, 16),
    "mixed": (MIXED + [(10, 30)], 132, 1),
}
SOFTCAP = 4.0  # with q scaled by 3 the scores reach well past it: tanh bends them


def _sinks(num_heads):
    """A logit per query head: small, large negative (the sink weighs nothing), large positive (it takes most)."""
    sinks = torch.randn(num_heads, generator=torch.Generator().manual_seed(2))
    sinks[0], sinks[-1] = -30.0, 6.0
    return sinks


@pytest.mark.parametrize("window", [None, 9])
@pytest.mark.parametrize("softcap,with_sinks", [(SOFTCAP, False), (None, True), (SOFTCAP, True)],
                         ids=["softcap", "sinks", "both"])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_softcap_and_sinks_match_references(shape, softcap, with_sinks, window, device):
    from surge.kernels.attention import launch_policy

    requests, num_sms, expected_splits = SHAPES[shape]
    q, k, v, cache, meta, full_k, full_v = _batch(requests, 16, 8, 2, 32, torch.float32, device, seed=6)
    q = q * 3
    sinks = _sinks(8).to(device) if with_sinks else None
    decode = all(n == 1 for _, n in requests)
    splits = launch_policy(decode_only=decode, num_seqs=len(requests), num_q_heads=8, num_kv_heads=2, head_dim=32,
                           dtype=torch.float32, num_sms=num_sms, num_tokens=meta.num_tokens).num_splits
    assert splits == expected_splits
    zeroed = torch.nan_to_num(cache, nan=0.0)
    expected = TorchAttentionBackend().forward(q, k, v, zeroed, meta, params(q, cache, window, 32 ** -0.5, softcap,
                                                                             sinks), sinks=sinks)
    got = _run_triton(q, k, v, cache, meta, window, 32 ** -0.5, num_sms=num_sms, softcap=softcap, sinks=sinks)
    assert not got.isnan().any()
    dense = _dense_reference(q, full_k, full_v, requests, window, 32 ** -0.5, softcap, sinks)
    torch.testing.assert_close(got.double().cpu(), dense, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(got, expected, atol=4e-5, rtol=4e-5)
    if with_sinks:  # the sink took its share: rows are no longer convex combinations of the values alone
        plain = _dense_reference(q, full_k, full_v, requests, window, 32 ** -0.5, softcap)
        assert (dense - plain).abs().amax() > 0.1


@pytest.mark.parametrize("shape", ["decode-split", "mixed"])
def test_softcap_and_sinks_bf16(shape, device, request):
    request.getfixturevalue("require_bf16_dot")
    requests, num_sms, _ = SHAPES[shape]
    q, k, v, cache, meta, full_k, full_v = _batch(requests, 16, 8, 2, 32, torch.bfloat16, device, seed=8)
    q = q * 3
    sinks = _sinks(8).to(device)
    got = _run_triton(q, k, v, cache, meta, 9, 32 ** -0.5, num_sms=num_sms, softcap=SOFTCAP, sinks=sinks)
    dense = _dense_reference(q, full_k, full_v, requests, 9, 32 ** -0.5, SOFTCAP, sinks)
    torch.testing.assert_close(got.double().cpu(), dense, atol=2e-2, rtol=2e-2)


def test_padding_rows_with_sinks_are_zero(device):
    """A graph's padding rows (seq_len 0) see only the sink: nothing to weigh, they come out as zeros, split or not."""
    for num_sms in (1, 132):
        requests = [(9, 1), (30, 1)]
        q, k, v, cache, meta, full_k, full_v = _batch(requests, 16, 8, 2, 32, torch.float32, device, seed=5)
        qp = torch.cat([q, torch.randn(2, *q.shape[1:], device=device)])
        kp, vp = (torch.cat([t, torch.randn(2, *t.shape[1:], device=device)]) for t in (k, v))
        meta.num_reqs, meta.num_tokens = 4, 4
        meta.query_start_loc = [0, 1, 2, 3, 4]
        meta.query_start_loc_t = torch.arange(5, dtype=torch.int32, device=device)
        meta.seq_lens_t = torch.cat([meta.seq_lens_t, torch.zeros(2, dtype=torch.int64, device=device)])
        meta.slot_mapping = torch.cat([meta.slot_mapping, torch.full((2,), -1, device=device)])
        meta.block_table = torch.cat([meta.block_table, torch.zeros_like(meta.block_table[:2])])
        sinks = _sinks(8).to(device)
        got = _run_triton(qp, kp, vp, cache, meta, None, 32 ** -0.5, num_sms=num_sms, softcap=SOFTCAP, sinks=sinks)
        assert torch.equal(got[2:], torch.zeros_like(got[2:]))
        dense = _dense_reference(q, full_k, full_v, requests, None, 32 ** -0.5, SOFTCAP, sinks)
        torch.testing.assert_close(got[:2].double().cpu(), dense, atol=2e-5, rtol=2e-5)


def test_sinks_must_be_one_float32_logit_per_query_head(device):
    from surge.kernels.attention import PagedAttention

    q, k, v, cache, meta, _, _ = _batch(DECODE, 16, 8, 2, 32, torch.float32, device, seed=1)
    kernel = PagedAttention(device, 132)
    for bad in (torch.zeros(2, device=device), torch.zeros(8, dtype=torch.bfloat16, device=device)):
        with pytest.raises(ValueError, match="sinks"):
            kernel(q, cache[0], cache[1], meta.block_table, meta.seq_lens_t, meta.query_start_loc_t,
                   num_seqs=meta.num_reqs, decode_only=True, sliding_window=None, scale=0.1, sinks=bad)


def _num_compiled(kernel) -> int:
    """Variants of a Triton kernel compiled in this process (its per-device caches)."""
    return sum(len(cache[0]) for cache in kernel.device_caches.values())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="compiles for the GPU")
@pytest.mark.parametrize("softcap,with_sinks", [(None, False), (SOFTCAP, False), (None, True), (SOFTCAP, True)])
@pytest.mark.parametrize("shape", ["decode-split", "few-token-split", "mixed"])
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16-cache", "fp8-cache"])
def test_warm_up_compiles_what_the_launch_runs(shape, softcap, with_sinks, fp8):
    """compile() on tiny tensors builds the very variants (both kernels under split-KV) a real launch then uses,
    over a cache of the model's dtype or an FP8 one."""
    from surge.attention.triton_backend import TritonAttentionBackend, warm_up_keys
    from surge.kernels.attention import PagedAttention, _merge_splits_kernel, _paged_attention_kernel

    device = torch.device("cuda")
    requests, num_sms, _ = SHAPES[shape]
    q, k, v, cache, meta, _, _ = _batch(requests, 16, 8, 2, 32, torch.bfloat16, device, seed=9)
    scales = {}
    if fp8:
        cache = torch.nan_to_num(cache, nan=0.0).to(torch.float8_e4m3fn)
        scales = {"k_scale": torch.tensor(0.5, device=device), "v_scale": torch.tensor(0.25, device=device)}
    sinks = _sinks(8).to(device) if with_sinks else None
    layer = params(q, cache, 9, 32 ** -0.5, softcap, sinks)
    backend = TritonAttentionBackend()
    kernel = backend._kernels[q.device] = PagedAttention(q.device, num_sms)  # cuda:0, as forward looks it up
    decode = all(n == 1 for _, n in requests)
    keys = warm_up_keys(kernel, (layer,), 16, torch.bfloat16, [len(requests)] if decode else [], len(requests),
                        cache.dtype)
    kernel.compile_many(keys)
    before = _num_compiled(_paged_attention_kernel), _num_compiled(_merge_splits_kernel)
    backend.forward(q, k, v, cache, meta, layer, sinks=sinks, **scales)
    torch.cuda.synchronize()
    assert (_num_compiled(_paged_attention_kernel), _num_compiled(_merge_splits_kernel)) == before


# ---- FP8 KV cache: float8_e4m3fn keys and values with per-tensor scales ----
K_SCALE, V_SCALE = 0.043, 0.37  # not powers of two: the scale's own rounding counts


def _fp8_batch(requests, dtype, device, seed, heads=(8, 2)):
    """_batch with an FP8 cache (the context quantized as the write kernels store it, NaN elsewhere), the same cache
    with zeros for NaN (the torch backend reads masked slots), and the reference's keys and values as an FP8 cache
    holds them: quantized, then dequantized."""
    from surge.kernels.reference import dequantize_fp8, quantize_fp8

    q, k, v, cache, meta, full_k, full_v = _batch(requests, 16, *heads, 32, dtype, device, seed)
    scales = torch.tensor(K_SCALE, device=device), torch.tensor(V_SCALE, device=device)
    cache8 = torch.stack([quantize_fp8(cache[i], scales[i]) for i in (0, 1)])
    zeroed8 = torch.stack([quantize_fp8(torch.nan_to_num(cache[i], nan=0.0), scales[i]) for i in (0, 1)])
    stored_k = [dequantize_fp8(quantize_fp8(t, scales[0].cpu()), scales[0].cpu(), torch.float64) for t in full_k]
    stored_v = [dequantize_fp8(quantize_fp8(t, scales[1].cpu()), scales[1].cpu(), torch.float64) for t in full_v]
    return q, k, v, cache8, zeroed8, meta, stored_k, stored_v, scales


FP8_SHAPES = {**SHAPES, "few-token-edge": ([(20, 30), (0, 33), (7, 1)], 132, 16),  # FEW_TOKENS: split
              "few-token-edge+1": ([(20, 30), (0, 34), (7, 1)], 132, 1)}  # one more token: one launch


@pytest.mark.parametrize("window", [None, 9])
@pytest.mark.parametrize("shape", list(FP8_SHAPES))
def test_fp8_kv_attention_matches_reference(shape, window, device, require_fp8):
    """Every launch shape (decode with and without split-KV, few-token split at FEW_TOKENS and one past it, a general
    mixed batch) over an FP8 cache, GQA 8:2: equal to the dense reference over the stored (quantize-dequantized)
    keys and values, to the float32 tolerance (the scales folded into the softmax scale and the output are the only
    other change), and to the torch backend's FP8 path; this step's keys and values are stored exactly as
    quantize_fp8 gives them."""
    from surge.kernels.attention import launch_policy
    from surge.kernels.reference import quantize_fp8

    requests, num_sms, expected_splits = FP8_SHAPES[shape]
    q, k, v, cache, zeroed, meta, stored_k, stored_v, (ks, vs) = _fp8_batch(requests, torch.float32, device, 12)
    decode = all(n == 1 for _, n in requests)
    assert launch_policy(decode_only=decode, num_seqs=len(requests), num_q_heads=8, num_kv_heads=2, head_dim=32,
                         dtype=torch.float32, num_sms=num_sms, num_tokens=meta.num_tokens).num_splits == expected_splits
    layer = params(q, cache, window, 32 ** -0.5)
    before = cache.clone()
    expected = TorchAttentionBackend().forward(q, k, v, zeroed, meta, layer, k_scale=ks, v_scale=vs)
    from surge.attention.triton_backend import TritonAttentionBackend
    from surge.kernels.attention import PagedAttention
    backend = TritonAttentionBackend()
    backend._kernels[q.device] = PagedAttention(q.device, num_sms)
    got = backend.forward(q, k, v, cache, meta, layer, k_scale=ks, v_scale=vs)
    assert not got.isnan().any()
    written = (cache.view(torch.uint8) != before.view(torch.uint8)).any(-1).any(-1).view(2, -1)  # [K/V, slot]
    slots = meta.slot_mapping.cpu()
    assert written[:, slots].all() and int(written.sum()) == 2 * len(slots)
    for i, (new, scale) in enumerate(((k, ks), (v, vs))):
        stored = cache[i].view(-1, 2, 32)[meta.slot_mapping]
        assert torch.equal(stored.view(torch.uint8).cpu(), quantize_fp8(new, scale).view(torch.uint8).cpu())
    dense = _dense_reference(q, stored_k, stored_v, requests, window, 32 ** -0.5)
    torch.testing.assert_close(got.double().cpu(), dense, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(got.cpu(), expected, atol=4e-5, rtol=4e-5)


@pytest.mark.parametrize("shape", ["decode-split", "mixed"])
def test_fp8_kv_attention_bf16(shape, device, request, require_fp8):
    """bfloat16 queries over an FP8 cache (its values widened to bf16 exactly, the dot as plain bf16 attention's):
    within the bf16 tolerance of the reference, with a sliding window and no GQA."""
    request.getfixturevalue("require_bf16_dot")
    requests, num_sms, _ = FP8_SHAPES[shape]
    q, k, v, cache, _, meta, stored_k, stored_v, (ks, vs) = _fp8_batch(requests, torch.bfloat16, device, 13,
                                                                        heads=(2, 2))
    from surge.attention.triton_backend import TritonAttentionBackend
    from surge.kernels.attention import PagedAttention
    backend = TritonAttentionBackend()
    backend._kernels[q.device] = PagedAttention(q.device, num_sms)
    got = backend.forward(q, k, v, cache, meta, params(q, cache, 9, 32 ** -0.5), k_scale=ks, v_scale=vs)
    dense = _dense_reference(q, stored_k, stored_v, requests, 9, 32 ** -0.5)
    torch.testing.assert_close(got.double().cpu(), dense, atol=2e-2, rtol=2e-2)


def test_fp8_kv_write_quantizes_and_saturates(device, require_fp8):
    """write_kv_cache into an FP8 cache stores quantize_fp8's very bytes: x / scale, past +-448 saturated (never
    inf or NaN), negative slots skipped."""
    from surge.kernels.kv_cache import write_kv_cache
    from surge.kernels.reference import FP8_MAX, quantize_fp8

    gen = torch.Generator().manual_seed(3)
    kv = torch.randn(2, 4, 2, 16, generator=gen) * 8
    kv[0, 0, 0, :3] = torch.tensor([1e4, -1e4, 448 * K_SCALE])  # saturated both ways, and exactly the largest
    scales = torch.tensor(K_SCALE), torch.tensor(V_SCALE)
    cache = torch.zeros(2, 3, 4, 2, 16, dtype=torch.float8_e4m3fn, device=device)
    slots = torch.tensor([5, -1, 11, 0])
    write_kv_cache(kv[0].to(device), kv[1].to(device), cache[0], cache[1], slots.to(device),
                   scales[0].to(device), scales[1].to(device))
    expected = torch.zeros(2, 12, 2, 16, dtype=torch.float8_e4m3fn)
    for i in (0, 1):
        expected[i, slots[slots >= 0]] = quantize_fp8(kv[i, slots >= 0], scales[i])
    assert torch.equal(cache.view(2, 12, 2, 16).view(torch.uint8).cpu(), expected.view(torch.uint8))
    assert cache.float().abs().max() == FP8_MAX and cache[0, 1, 1, 0, :2].float().tolist() == [FP8_MAX, -FP8_MAX]
