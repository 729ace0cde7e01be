"""The torch attention backend (the CPU path) against a float64 per-query softmax: decode-only, mixed and prefill
batches, GQA, sliding windows whose old blocks were handed back (the null block in their table entries), and NaN in
every slot nobody wrote, the null block included: an uninitialized cache must not leak into any output."""
from __future__ import annotations

import math

import pytest
import torch

from surge.attention.backend import AttentionParams, CommonAttentionMetadata, Prologue
from surge.attention.torch_backend import TorchAttentionBackend, TorchAttentionMetadata, _rotate
from surge.model.layers.rotary import RotaryEmbedding

BLOCK = 4


def params(q, cache, window, scale):
    """The layer parameters of q [T, Hq, D] over cache [2, N, B, Hkv, D]."""
    return AttentionParams(q.shape[1], cache.shape[3], q.shape[2], scale, window)


def _batch(requests, num_q_heads, num_kv_heads, head_dim, window, seed):
    """requests: (cached context, new tokens). Blocks scattered; with a window, the blocks wholly before every
    query's window are the null block (0) in the table, as the KV manager leaves them. Unwritten slots: NaN."""
    gen = torch.Generator().manual_seed(seed)
    max_blocks = max(math.ceil((c + n) / BLOCK) for c, n in requests)
    num_blocks = 1 + len(requests) * max_blocks
    order = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    tables = torch.zeros(len(requests), max_blocks + 2, dtype=torch.int32)  # wider than needed: padded with 0
    cache = torch.full((2, num_blocks, BLOCK, num_kv_heads, head_dim), float("nan"))
    flat = cache.view(2, -1, num_kv_heads, head_dim)
    keys, values, slots, qsl = [], [], [], [0]
    for r, (ctx, new) in enumerate(requests):
        kv = torch.randn(2, ctx + new, num_kv_heads, head_dim, generator=gen)
        keys.append(kv[0])
        values.append(kv[1])
        first_visible = 0 if window is None else max(0, ctx - window + 1)
        for b in range(math.ceil((ctx + new) / BLOCK)):
            if (b + 1) * BLOCK <= first_visible:
                continue  # handed back: the table keeps the null block here
            block = order.pop()
            tables[r, b] = block
            for p in range(b * BLOCK, min((b + 1) * BLOCK, ctx + new)):
                if p < ctx:
                    flat[:, block * BLOCK + p % BLOCK] = kv[:, p]
                else:
                    slots.append(block * BLOCK + p % BLOCK)
        qsl.append(qsl[-1] + new)
    q = torch.randn(qsl[-1], num_q_heads, head_dim, generator=gen)
    k_new = torch.cat([kk[c:] for kk, (c, _) in zip(keys, requests)])
    v_new = torch.cat([vv[c:] for vv, (c, _) in zip(values, requests)])
    seq_lens = [c + n for c, n in requests]
    common = CommonAttentionMetadata(
        num_reqs=len(requests), num_tokens=qsl[-1], query_start_loc=qsl, seq_lens=seq_lens,
        max_query_len=max(n for _, n in requests), max_seq_len=max(seq_lens),
        query_start_loc_t=torch.tensor(qsl, dtype=torch.int32), seq_lens_t=torch.tensor(seq_lens, dtype=torch.int32))
    return q, k_new, v_new, cache, common, torch.tensor(slots), tables, keys, values


def _reference(q, keys, values, requests, window, scale, softcap=None, sinks=None):
    out = torch.empty(q.shape, dtype=torch.float64)
    group = q.shape[1] // keys[0].shape[1]
    t = 0
    for (ctx, new), k, v in zip(requests, keys, values):
        k, v = k.double().repeat_interleave(group, 1), v.double().repeat_interleave(group, 1)
        for i in range(new):
            pos = ctx + i
            lo = 0 if window is None else max(0, pos - window + 1)
            scores = torch.einsum("hd,khd->hk", q[t].double(), k[lo:pos + 1]) * scale
            if softcap is not None:
                scores = softcap * torch.tanh(scores / softcap)
            if sinks is None:
                probs = scores.softmax(-1)
            else:  # exp(s) / (sum exp(s) + exp(sink)): the sink takes probability and gives no value
                probs = scores.exp() / (scores.exp().sum(-1, keepdim=True) + sinks.double().exp()[:, None])
            out[t] = torch.einsum("hk,khd->hd", probs, v[lo:pos + 1])
            t += 1
    return out


DECODE = [(0, 1), (5, 1), (16, 1), (38, 1)]
EQUAL = [(20, 1)] * 4  # decode rows of one length: no mask at all
MIXED = [(0, 1), (16, 1), (38, 1), (0, 7), (21, 12), (5, 33)]
PREFILL = [(0, 9), (13, 6)]
FRESH = [(0, 5), (0, 5), (0, 5), (0, 8), (0, 8), (3, 5), (0, 5), (0, 1)]  # runs of equal fresh prompts, batched


@pytest.mark.parametrize("requests", [DECODE, MIXED, PREFILL], ids=["decode", "mixed", "prefill"])
@pytest.mark.parametrize("window", [None, 7])
@pytest.mark.parametrize("softcap, with_sinks", [(2.0, False), (None, True), (1.5, True)])
def test_softcap_and_sinks_match_reference(requests, window, softcap, with_sinks):
    q, k, v, cache, common, slots, tables, keys, values = _batch(requests, 6, 2, 16, window, seed=5)
    q = q * 3  # scores large enough for the cap to bite
    sinks = torch.randn(6, generator=torch.Generator().manual_seed(3)) if with_sinks else None
    backend = TorchAttentionBackend()
    meta = backend.build_metadata(common, slots, tables)
    layer = AttentionParams(6, 2, 16, 0.25, window, logit_softcap=softcap, has_sinks=with_sinks)
    got = backend.forward(q, k, v, cache, meta, layer, None, sinks)
    assert not got.isnan().any()
    torch.testing.assert_close(got.double(), _reference(q, keys, values, requests, window, 0.25, softcap, sinks),
                               atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("requests", [DECODE, EQUAL, MIXED, PREFILL, FRESH],
                         ids=["decode", "equal", "mixed", "prefill", "fresh"])
@pytest.mark.parametrize("heads,window", [((4, 2), None), ((6, 2), 7), ((2, 2), 3), ((3, 1), 16), ((6, 2), 21)])
def test_matches_reference_with_nan_in_unwritten_slots(requests, heads, window):
    q, k, v, cache, common, slots, tables, keys, values = _batch(requests, *heads, 16, window, seed=11)
    backend = TorchAttentionBackend()
    meta = backend.build_metadata(common, slots, tables)
    before = cache.clone()
    got = backend.forward(q, k, v, cache, meta, params(q, cache, window, 16 ** -0.5))
    assert not got.isnan().any()
    torch.testing.assert_close(got.double(), _reference(q, keys, values, requests, window, 16 ** -0.5),
                               atol=1e-5, rtol=1e-5)
    if requests is EQUAL:  # a window of 21 still sees all 21 positions; one of 16 or fewer cuts in
        assert (meta.plans[window].mask is None) == (window is None or window >= 21)
    # Only the new tokens' slots were written.
    changed = (cache.isnan() != before.isnan()).any(-1).any(-1).view(2, -1)
    assert torch.equal(changed[0].nonzero().flatten(), slots.sort().values)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_decode_matches_reference(dtype):
    """Half precision decodes through SDPA's flash kernel (float32 accumulation), float32 through bmm."""
    q, k, v, cache, common, slots, tables, keys, values = _batch(DECODE, 4, 2, 16, None, seed=5)
    backend = TorchAttentionBackend()
    meta = backend.build_metadata(common, slots, tables)
    got = backend.forward(q.to(dtype), k.to(dtype), v.to(dtype), cache.to(dtype), meta, params(q, cache, None, 0.25))
    ref = _reference(q.to(dtype).double(), [t.to(dtype).double() for t in keys],
                     [t.to(dtype).double() for t in values], DECODE, None, 0.25)
    torch.testing.assert_close(got.double(), ref, atol=2e-2, rtol=2e-2)


def test_layers_of_a_group_share_one_decode_plan():
    q, k, v, cache, common, slots, tables, _, _ = _batch(DECODE, 4, 2, 16, None, seed=2)
    backend = TorchAttentionBackend()
    meta = backend.build_metadata(common, slots, tables)
    first = backend.forward(q, k, v, cache, meta, params(q, cache, None, 0.25))
    plan = meta.plans[None]
    second = backend.forward(q, k, v, cache.clone(), meta, params(q, cache, None, 0.25))
    assert meta.plans[None] is plan and torch.equal(first, second)
    # A sliding window is another plan (another mask) over the same metadata.
    backend.forward(q, k, v, cache.clone(), meta, params(q, cache, 5, 0.25))
    assert set(meta.plans) == {None, 5}


@pytest.mark.parametrize("num_tokens", [1, 16, 300])
@pytest.mark.parametrize("merged", [True, False], ids=["qkv-views", "separate"])
def test_rotary_bitwise_equal_to_the_prologue_reference(num_tokens, merged):
    """The backend's float32 rotary (factors once per step, q and k as one view of the merged projection) against
    Prologue.apply, which HF's rotate-half rounding is tested against: bitwise, q and k."""
    g = torch.Generator().manual_seed(num_tokens)
    rotary = RotaryEmbedding(64, 4096, {"rope_theta": 100000.0, "rope_type": "default"})
    qkv = torch.randn(num_tokens, (9 + 3 + 3) * 64, generator=g) * 4
    q, k, _ = qkv.split([9 * 64, 3 * 64, 3 * 64], dim=-1)
    q, k = q.view(-1, 9, 64), k.view(-1, 3, 64)
    if not merged:
        q, k = q.clone(), k.clone()
    prologue = Prologue(torch.randint(0, 4096, (num_tokens,), generator=g), rotary.cos_cache, rotary.sin_cache)
    meta = TorchAttentionMetadata(1, num_tokens, [0, num_tokens], [num_tokens], num_tokens, num_tokens,
                                  torch.tensor([0, num_tokens]), torch.tensor([num_tokens]),
                                  slot_mapping=torch.arange(num_tokens), block_table=torch.zeros(1, 1))
    want_q, want_k = prologue.apply(q, k)
    for _ in range(2):  # the second layer reads the step's factors
        got_q, got_k = _rotate(prologue, q, k, meta)
        assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)
    assert len(meta.rotary) == 1


@pytest.mark.parametrize("requests", [DECODE, EQUAL, MIXED, PREFILL, FRESH],
                         ids=["decode", "equal", "mixed", "prefill", "fresh"])
@pytest.mark.parametrize("window,softcap,with_sinks,dtype", [
    (None, None, False, torch.float32), (7, None, False, torch.float32), (7, 1.5, True, torch.float32),
    (None, None, False, torch.bfloat16)], ids=["full", "window", "softcap-sinks", "bf16"])
def test_fp8_cache_matches_reference_over_the_stored_values(requests, window, softcap, with_sinks, dtype):
    """An FP8 cache (float8_e4m3fn, per-tensor scales, NaN where nobody wrote) on every path (decode plans, fresh
    runs, per-request prefill, the explicit soft-cap/sink path, half precision): the reference attends to what the
    cache holds, keys and values quantized then dequantized, this step's own as well; the new tokens are stored as
    quantize_fp8 gives them."""
    from surge.kernels.reference import dequantize_fp8, quantize_fp8

    q, k, v, cache, common, slots, tables, keys, values = _batch(requests, 6, 2, 16, window, seed=7)
    ks, vs = torch.tensor(0.031), torch.tensor(0.29)
    cache = torch.stack([quantize_fp8(cache[0].to(dtype), ks), quantize_fp8(cache[1].to(dtype), vs)])
    stored_k = [dequantize_fp8(quantize_fp8(t.to(dtype), ks), ks, torch.float64) for t in keys]
    stored_v = [dequantize_fp8(quantize_fp8(t.to(dtype), vs), vs, torch.float64) for t in values]
    sinks = torch.randn(6, generator=torch.Generator().manual_seed(3)) if with_sinks else None
    backend = TorchAttentionBackend()
    meta = backend.build_metadata(common, slots, tables)
    layer = AttentionParams(6, 2, 16, 0.25, window, logit_softcap=softcap, has_sinks=with_sinks)
    got = backend.forward(q.to(dtype), k.to(dtype), v.to(dtype), cache, meta, layer, None, sinks, ks, vs)
    assert not got.isnan().any()
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    ref = _reference(q.to(dtype).double(), stored_k, stored_v, requests, window, 0.25, softcap, sinks)
    torch.testing.assert_close(got.double(), ref, atol=tol, rtol=tol)
    for i, (new, scale) in enumerate(((k, ks), (v, vs))):
        stored = cache[i].view(-1, 2, 16)[slots]
        assert torch.equal(stored.view(torch.uint8), quantize_fp8(new.to(dtype), scale).view(torch.uint8))
