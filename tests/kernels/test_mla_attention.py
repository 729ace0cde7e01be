"""The Triton MLA kernel (surge/kernels/mla_attention.py), through TritonAttentionBackend.forward_mla, against a dense
float64 MLA reference: keys and values expanded per head from every position's latent (kv_b_proj's weight), a plain
softmax per query. Decode and mixed batches over several blocks with a partial last one, split-KV on and off, float32
and bfloat16, head counts that fill, pad and span head tiles; NaN in every slot no request wrote; CUDA-graph padding
rows; the launch policy at its N/N+1 boundaries."""
from __future__ import annotations

import math

import pytest
import torch

from surge.attention.backend import AttentionMetadata, AttentionParams
from surge.core.kv_cache.spec import MLAAttentionSpec

BLOCK = 4
NOPE, V = 16, 8
SCALE = 0.21

DECODE = [(5, 1), (17, 1), (0, 1), (9, 1)]  # 5 blocks for the longest; last blocks partial
MIXED = [(6, 1), (0, 7), (9, 5), (3, 1)]  # decode rows, a fresh prompt, a chunk after cached context
# More than FEW_TOKENS tokens: one launch, no split; its fresh prompt of 70 tokens is expanded, not absorbed.
LONG_MIXED = [(6, 1), (0, 70), (9, 27), (3, 1)]
# shape -> (requests, num_sms, whether the launch splits the KV sequence)
SHAPES = {"decode": (DECODE, 1, False), "decode-split": (DECODE, 132, True),
          "few-token-split": (MIXED, 132, True), "mixed": (LONG_MIXED, 132, False)}


def _batch(requests, heads, lora, rope, dtype, device, seed):
    """Random queries, this step's [latent | rope key] rows, a cache holding every request's context (blocks
    scattered, null block 0 never used) with NaN everywhere else, kv_b_proj's weight, and the step's metadata."""
    gen = torch.Generator().manual_seed(seed)
    max_blocks = max(math.ceil((c + n) / BLOCK) for c, n in requests)
    num_blocks = 1 + len(requests) * max_blocks
    order = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    spec = MLAAttentionSpec(BLOCK, 1, lora + rope, dtype, kv_lora_rank=lora)
    cache = torch.full(spec.cache_shape(num_blocks), float("nan"), dtype=dtype)
    rows = cache.view(-1, lora + rope)
    tables = torch.zeros(len(requests), max_blocks + 1, dtype=torch.int32)
    latents, slots, qsl = [], [], [0]
    for r, (ctx, new) in enumerate(requests):
        lat = torch.randn(ctx + new, lora + rope, generator=gen).to(dtype)
        latents.append(lat)
        for b in range(math.ceil((ctx + new) / BLOCK)):
            tables[r, b] = block = order.pop()
            for p in range(b * BLOCK, min((b + 1) * BLOCK, ctx + new)):
                if p < ctx:
                    rows[block * BLOCK + p % BLOCK] = lat[p]
                else:
                    slots.append(block * BLOCK + p % BLOCK)
        qsl.append(qsl[-1] + new)
    q = torch.randn(qsl[-1], heads, NOPE + rope, generator=gen).to(dtype)
    new_rows = torch.cat([lat[c:] for lat, (c, _) in zip(latents, requests)])
    w = (torch.randn(heads * (NOPE + V), lora, generator=gen) / lora ** 0.5).to(dtype)
    seq_lens = [c + n for c, n in requests]
    meta = AttentionMetadata(
        num_reqs=len(requests), num_tokens=qsl[-1], query_start_loc=qsl, seq_lens=seq_lens,
        max_query_len=max(n for _, n in requests), max_seq_len=max(seq_lens),
        query_start_loc_t=torch.tensor(qsl, dtype=torch.int32, device=device),
        seq_lens_t=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        slot_mapping=torch.tensor(slots, device=device), block_table=tables.to(device))
    return q.to(device), new_rows.to(device), cache.to(device), meta, w.to(device), latents


def _dense_reference(q, latents, requests, w, heads, lora):
    """Per request: keys [W_UK kv_c | k_pe] and values W_UV kv_c for every head, then per query a softmax over the
    positions up to its own, all in float64."""
    w = w.double().cpu().view(heads, NOPE + V, lora)
    out, t = torch.empty(q.shape[0], heads, V, dtype=torch.float64), 0
    for (ctx, new), lat in zip(requests, latents):
        lat = lat.double()
        kv = torch.einsum("hdl,sl->shd", w, lat[:, :lora])
        keys = torch.cat((kv[..., :NOPE], lat[:, None, lora:].expand(-1, heads, -1)), dim=-1)
        for i in range(new):
            probs = (torch.einsum("hd,shd->hs", q[t].double().cpu(), keys[:ctx + i + 1]) * SCALE).softmax(-1)
            out[t] = torch.einsum("hs,shd->hd", probs, kv[:ctx + i + 1, :, NOPE:])
            t += 1
    return out


def _params(heads, lora, rope):
    return AttentionParams(heads, 1, NOPE + rope, SCALE, head_dim_v=V, kv_lora_rank=lora, qk_rope_head_dim=rope)


def _run(q, new_rows, cache, meta, w, lora, num_sms):
    from surge.attention.triton_backend import TritonAttentionBackend
    from surge.kernels.mla_attention import MLAPagedAttention

    backend = TritonAttentionBackend()
    backend._mla_kernels[q.device] = MLAPagedAttention(q.device, num_sms)
    rope = new_rows.shape[1] - lora
    return backend.forward_mla(q, new_rows[:, :lora], new_rows[:, lora:], cache, meta,
                               _params(q.shape[1], lora, rope), w)


TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2}

# heads, kv_lora_rank, qk_rope_head_dim, dtype: 16 heads (V2-Lite's, one tile), 20 (padded; bf16: 32-row tiles),
# 40 (bf16: two head tiles, the second part padding), a latent and rope key that are not powers of two.
CASES = [
    (16, 32, 16, torch.float32),
    (20, 24, 8, torch.float32),
    (16, 32, 16, torch.bfloat16),
    (40, 32, 16, torch.bfloat16),
]


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("heads,lora,rope,dtype", CASES)
def test_mla_kernel_matches_dense_reference(shape, heads, lora, rope, dtype, device, request):
    from surge.kernels.mla_attention import mla_launch_policy

    if dtype == torch.bfloat16:
        request.getfixturevalue("require_bf16_dot")
    requests, num_sms, splits = SHAPES[shape]
    q, new_rows, cache, meta, w, latents = _batch(requests, heads, lora, rope, dtype, device, seed=heads + lora)
    launch = mla_launch_policy(decode_only=meta.decode_only, num_seqs=meta.num_reqs, num_heads=heads, dtype=dtype,
                               num_sms=num_sms, num_tokens=meta.num_tokens)
    assert (launch.num_splits > 1) == splits  # the case tests what its name says
    before = cache.clone()
    got = _run(q, new_rows, cache, meta, w, lora, num_sms)
    assert got.shape == (q.shape[0], heads, V) and not got.isnan().any(), "NaN from unwritten slots leaked"
    # This step's rows went exactly to their slots; every other slot kept its NaN.
    flat = cache.view(-1, lora + rope)
    assert torch.equal(flat[meta.slot_mapping], new_rows)
    changed = (cache.isnan() != before.isnan()).view(-1, lora + rope).any(-1).nonzero().flatten()
    assert changed.tolist() == sorted(meta.slot_mapping.tolist())
    tol = TOL[dtype]
    expected = _dense_reference(q, latents, requests, w, heads, lora)
    torch.testing.assert_close(got.double().cpu(), expected, atol=tol, rtol=tol)


@pytest.mark.parametrize("shape", ["few-token-split", "mixed"])
@pytest.mark.parametrize("host_lengths", [True, False], ids=["eager", "captured"])
def test_fresh_prompts_expand_only_with_host_lengths(shape, host_lengths, device, monkeypatch):
    """An eager step's fresh prompts of EXPAND_MIN_TOKENS or more are attended to expanded (the kernel skips them);
    a captured step's metadata has no host lengths, so every row goes through the kernel. Both equal the reference."""
    import surge.attention.mla as mla

    requests, num_sms, _ = SHAPES[shape]
    heads, lora, rope = 16, 32, 16
    q, new_rows, cache, meta, w, latents = _batch(requests, heads, lora, rope, torch.float32, device, seed=6)
    expanded = []
    monkeypatch.setattr(mla, "_expanded_fresh",
                        lambda q, *a, inner=mla._expanded_fresh: expanded.append(q.shape[0]) or inner(q, *a))
    if not host_lengths:
        meta.seq_lens = []
    got = _run(q, new_rows, cache, meta, w, lora, num_sms)
    fresh = [n for c, n in requests if c == 0 and n >= mla.EXPAND_MIN_TOKENS]
    assert expanded == (fresh if host_lengths else [])
    assert fresh == ([70] if shape == "mixed" else [])  # the case tests what it says
    expected = _dense_reference(q, latents, requests, w, heads, lora)
    torch.testing.assert_close(got.double().cpu(), expected, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("num_sms", [1, 132], ids=["one-split", "split-kv"])
def test_decode_graph_padding_rows_are_harmless(num_sms, device):
    """A decode graph's padding rows: one token each, length 1, slot 0 of the null block (StepInputs.pad_decode).
    The real rows equal the reference, and the padding writes only the null block's first slot."""
    heads, lora, rope = 16, 32, 16
    q, new_rows, cache, meta, w, latents = _batch(DECODE, heads, lora, rope, torch.float32, device, seed=3)
    pad = 3
    q = torch.cat([q, torch.randn(pad, *q.shape[1:], device=device)])
    new_rows = torch.cat([new_rows, torch.randn(pad, lora + rope, device=device)])
    n = meta.num_reqs + pad
    meta.num_reqs = meta.num_tokens = n
    meta.query_start_loc = list(range(n + 1))
    meta.query_start_loc_t = torch.arange(n + 1, dtype=torch.int32, device=device)
    meta.seq_lens_t = torch.cat([meta.seq_lens_t, torch.ones(pad, dtype=torch.int32, device=device)])
    meta.slot_mapping = torch.cat([meta.slot_mapping, torch.zeros(pad, dtype=torch.int64, device=device)])
    meta.block_table = torch.cat([meta.block_table, torch.zeros_like(meta.block_table[:pad])])
    before = cache.clone()
    got = _run(q, new_rows, cache, meta, w, lora, num_sms)
    expected = _dense_reference(q[:len(DECODE)], latents, DECODE, w, heads, lora)
    torch.testing.assert_close(got[:len(DECODE)].double().cpu(), expected, atol=2e-5, rtol=2e-5)
    changed = (cache.isnan() != before.isnan()).view(-1, lora + rope).any(-1).nonzero().flatten()
    assert changed.tolist() == sorted(meta.slot_mapping[:len(DECODE)].tolist() + [0])


@pytest.mark.parametrize("num_sms", [1, 132], ids=["few-splits", "max-splits"])
def test_mixed_graph_padding_leaves_real_rows_alone(num_sms, device):
    """A mixed step laid out as its graph replays it (StepInputs.pad_mixed): padding tokens belong to no request and
    write nothing (slot -1), padding rows have no tokens and length 0. Real rows equal the reference."""
    heads, lora, rope = 16, 32, 16
    q, new_rows, cache, meta, w, latents = _batch(MIXED, heads, lora, rope, torch.float32, device, seed=4)
    tokens, reqs = meta.num_tokens, meta.num_reqs
    padded_tokens, padded_reqs = 32, 9
    q = torch.cat([q, torch.randn(padded_tokens - tokens, *q.shape[1:], device=device)])
    new_rows = torch.cat([new_rows, torch.randn(padded_tokens - tokens, lora + rope, device=device)])
    qsl = meta.query_start_loc + [tokens] * (padded_reqs - reqs)
    meta.num_reqs, meta.num_tokens, meta.query_start_loc, meta.max_query_len = padded_reqs, padded_tokens, qsl, 32
    meta.query_start_loc_t = torch.tensor(qsl, dtype=torch.int32, device=device)
    meta.seq_lens_t = torch.cat([meta.seq_lens_t, torch.zeros(padded_reqs - reqs, dtype=torch.int32, device=device)])
    meta.slot_mapping = torch.cat([meta.slot_mapping, torch.full((padded_tokens - tokens,), -1, device=device)])
    meta.block_table = torch.cat([meta.block_table, torch.zeros_like(meta.block_table[:padded_reqs - reqs])])
    before = cache.clone()
    got = _run(q, new_rows, cache, meta, w, lora, num_sms)
    expected = _dense_reference(q[:tokens], latents, MIXED, w, heads, lora)
    torch.testing.assert_close(got[:tokens].double().cpu(), expected, atol=2e-5, rtol=2e-5)
    changed = (cache.isnan() != before.isnan()).view(-1, lora + rope).any(-1).nonzero().flatten()
    assert changed.tolist() == sorted(meta.slot_mapping[:tokens].tolist())


def test_mla_launch_policy_boundaries():
    from surge.kernels.attention import FEW_TOKENS, MAX_SPLITS, PROGRAMS_PER_SM
    from surge.kernels.mla_attention import mla_launch_policy

    def policy(**kw):
        args = dict(decode_only=True, num_seqs=1, num_heads=16, dtype=torch.bfloat16, num_sms=132)
        return mla_launch_policy(**{**args, **kw})

    # Head tiles: 16 heads one 16-row tile (V2-Lite), 17 one padded 32-row tile in bf16, 128 four (V3); float32
    # tiles stay at 16 rows: 17 heads take two.
    assert (policy().block_h, policy().num_warps) == (16, 4)
    assert (policy(num_heads=17).block_h, policy(num_heads=17).num_warps) == (32, 8)
    assert policy(num_heads=8).block_h == 16  # a TP rank's 8 heads: padded to the MMA minimum
    assert policy(num_heads=17, dtype=torch.float32).block_h == 16
    # Splits stop once num_seqs * head tiles programs reach PROGRAMS_PER_SM * num_sms = 528.
    assert PROGRAMS_PER_SM * 132 == 528
    assert policy(num_seqs=528).num_splits == 1 and policy(num_seqs=527).num_splits == 2
    assert policy(num_seqs=264).num_splits == 2 and policy(num_seqs=263).num_splits == 4
    assert policy(num_heads=128, num_seqs=132).num_splits == 1  # 4 head tiles
    assert policy(num_heads=128, num_seqs=131).num_splits == 2
    assert policy(num_heads=129, num_seqs=131).num_splits == 1  # 5 tiles: 655 programs
    assert policy(num_seqs=1).num_splits == MAX_SPLITS and policy(num_seqs=4, num_sms=1).num_splits == 1
    assert policy(num_seqs=3, num_sms=1).num_splits == 2
    # Mixed tiles: 32 rows of block_q tokens x block_h heads (16 in float32); split only up to FEW_TOKENS tokens.
    mixed = policy(decode_only=False, num_seqs=256)
    assert (mixed.block_h, mixed.block_q, mixed.num_splits, mixed.decode) == (16, 2, 1, False)
    assert policy(decode_only=False, num_heads=32).block_q == 1
    assert policy(decode_only=False, dtype=torch.float32).block_q == 1
    assert policy(decode_only=False, num_seqs=256, num_tokens=FEW_TOKENS).num_splits == MAX_SPLITS
    assert policy(decode_only=False, num_seqs=256, num_tokens=FEW_TOKENS + 1).num_splits == 1
    # Capacities only: a decode launch does not depend on the token count.
    assert policy(num_seqs=64, num_tokens=5) == policy(num_seqs=64)
    with pytest.raises(ValueError, match="num_heads"):
        policy(num_heads=0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="compiles for the GPU")
@pytest.mark.parametrize("decode", [True, False], ids=["decode", "mixed"])
def test_mla_warm_up_compiles_what_the_launch_runs(decode):
    """compile() on tiny tensors builds the very variants (both kernels under split-KV) a real launch then uses."""
    from surge.attention.triton_backend import TritonAttentionBackend, mla_warm_up_keys
    from surge.kernels.attention import _merge_splits_kernel
    from surge.kernels.mla_attention import MLAPagedAttention, _mla_attention_kernel

    device = torch.device("cuda")
    heads, lora, rope = 16, 512, 64
    requests = DECODE if decode else [(40, 3), (0, 5), (7, 1)]  # few tokens: split
    q, new_rows, cache, meta, w, _ = _batch(requests, heads, lora, rope, torch.bfloat16, device, seed=9)
    backend = TritonAttentionBackend()
    kernel = backend._mla_kernels[q.device] = MLAPagedAttention(q.device, 132)
    layer = _params(heads, lora, rope)
    keys = mla_warm_up_keys(kernel, (layer,), BLOCK, torch.bfloat16, [len(requests)] if decode else [],
                            len(requests))
    kernel.compile_many(keys)

    def compiled(fn):
        return sum(len(c[0]) for c in fn.device_caches.values())

    before = compiled(_mla_attention_kernel), compiled(_merge_splits_kernel)
    backend.forward_mla(q, new_rows[:, :lora], new_rows[:, lora:], cache, meta, layer, w)
    torch.cuda.synchronize()
    assert (compiled(_mla_attention_kernel), compiled(_merge_splits_kernel)) == before


@pytest.mark.parametrize("shape", ["decode-split", "few-token-split", "mixed"])
def test_runtime_launches_are_among_the_warm_up_keys(shape, device):
    """The keys a step dispatches (decode at a capture size, a few-token and a larger mixed step) are among those
    start-up compiles: no compile lands inside a request or a graph capture."""
    from surge.attention.triton_backend import TritonAttentionBackend, mla_warm_up_keys
    from surge.kernels.mla_attention import MLAPagedAttention

    requests, num_sms, _ = SHAPES[shape]
    heads, lora, rope = 16, 32, 16
    q, new_rows, cache, meta, w, _ = _batch(requests, heads, lora, rope, torch.float32, device, seed=2)
    backend = TritonAttentionBackend()
    kernel = backend._mla_kernels[q.device] = MLAPagedAttention(q.device, num_sms)
    layer = _params(heads, lora, rope)
    warm = set(mla_warm_up_keys(kernel, (layer,), BLOCK, torch.float32, [1, 2, 4, 8], 8))
    dispatched = []
    kernel.ensure = dispatched.append
    backend.forward_mla(q, new_rows[:, :lora], new_rows[:, lora:], cache, meta, layer, w)
    assert len(dispatched) == 1 and dispatched[0] in warm


def test_triton_backend_captures_mla_layers_and_torch_does_not():
    """The Triton MLA path reads lengths on the device: a DeepSeek model's steps may be captured in CUDA graphs.
    The torch path reads host lengths: not."""
    from surge.attention.torch_backend import TorchAttentionBackend
    from surge.attention.triton_backend import TritonAttentionBackend

    layers = (_params(16, 512, 64),)
    assert TritonAttentionBackend().supports_cuda_graphs_for(layers)
    assert not TorchAttentionBackend().supports_cuda_graphs_for(layers)
