"""The compressor's pooling: the torch reference bit for bit against HF's HCA and CSA compressors, the kernel
against the reference from a shuffled paged state cache into shuffled cache slots (window 0 without its overlap
half, windows straddling state blocks, skipped entries leaving the cache untouched), and its launch policy."""
from __future__ import annotations

import pytest
import torch

from surge.kernels.compressor import CompressorPool, launch_policy
from surge.kernels.deepseek_v4_reference import compress_windows


def _hf_config(partial_rotary_factor: float = 0.25):
    from transformers import DeepseekV4Config

    return DeepseekV4Config(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, head_dim=32,
                            q_lora_rank=16, index_n_heads=3, index_head_dim=16, index_topk=4, n_routed_experts=4,
                            num_experts_per_tok=2, moe_intermediate_size=16, o_groups=1, o_lora_rank=8,
                            partial_rotary_factor=partial_rotary_factor)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", ["hca", "csa"])
def test_reference_matches_hf_compressors(kind, dtype):
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4CSACompressor, DeepseekV4HCACompressor

    config = _hf_config()
    torch.manual_seed(0)
    module = (DeepseekV4HCACompressor if kind == "hca" else DeepseekV4CSACompressor)(config)
    with torch.no_grad():
        for p in module.parameters():
            p.normal_()
    module = module.to(dtype)
    module.position_bias.data, module.kv_norm.weight.data = module.position_bias.float(), module.kv_norm.weight.float()
    n = 300  # 2 HCA windows, 75 CSA windows; the rest stays partial
    hidden = torch.randn(1, n, 32).to(dtype)
    with torch.no_grad():
        expected = module(hidden, torch.randn(1, n, 16).to(dtype), torch.arange(n)[None], None, 0)[0][0, 0]
        kv, gate = module.kv_proj(hidden)[0], module.gate_proj(hidden)[0]
        rate = module.compress_rate
        cos, sin = module.rotary_emb(kv, position_ids=(torch.arange(n // rate) * rate)[None], layer_type="compress")
        got = compress_windows(kv, gate, module.position_bias, module.kv_norm.weight, config.rms_norm_eps, cos[0],
                               sin[0], rate, overlap=kind == "csa")
    assert torch.equal(got, expected)


def test_policy_boundaries():
    assert launch_policy(4, 512, 64, overlap=True) == launch_policy(4, 512, 64, overlap=True)
    csa = launch_policy(4, 512, 64, overlap=True)
    assert (csa.slots_pad, csa.block_d, csa.head_dim_pad, csa.half_rope_pad, csa.num_warps) == (8, 512, 512, 32, 4)
    assert launch_policy(4, 513, 64, overlap=True).head_dim_pad == 1024
    assert launch_policy(4, 513, 64, overlap=True).num_warps == 8
    hca = launch_policy(128, 512, 64, overlap=False)
    assert (hca.slots_pad, hca.block_d) == (128, 32)
    assert launch_policy(129, 512, 64, overlap=False).slots_pad == 256
    assert launch_policy(256, 512, 64, overlap=True).block_d == 16  # never below 16 channels
    for bad in ((0, 16, 4, False), (4, 0, 4, False), (4, 1025, 4, False), (4, 16, 3, False), (4, 16, 18, False)):
        with pytest.raises(ValueError):
            launch_policy(*bad)


def _rope_caches(max_pos: int, rope_dim: int, dtype: torch.dtype):
    inv_freq = 1.0 / (160000.0 ** (torch.arange(0, rope_dim, 2, dtype=torch.float) / rope_dim))
    freqs = torch.arange(max_pos, dtype=torch.float)[:, None] * inv_freq
    return freqs.cos().to(dtype), freqs.sin().to(dtype)


def _check(device, dtype, rate, head_dim, rope_dim, overlap, seq_lens, state_block, cache_block=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    width = head_dim * (2 if overlap else 1)
    kvs = [torch.randn(n, width, generator=g).to(dtype) for n in seq_lens]
    gates = [(2 * torch.randn(n, width, generator=g)).to(dtype) for n in seq_lens]
    bias = torch.randn(rate, width, generator=g)
    norm = torch.randn(head_dim, generator=g)
    cos, sin = _rope_caches(max(seq_lens) + 1, rope_dim, dtype)
    # The state: each sequence's token rows in shuffled blocks, garbage elsewhere.
    blocks = [-(-n // state_block) for n in seq_lens]
    order = torch.randperm(sum(blocks) + 1, generator=g)
    state_kv = torch.randn(sum(blocks) + 1, state_block, width, generator=g).to(dtype)
    state_gate = torch.randn(sum(blocks) + 1, state_block, width, generator=g).to(dtype)
    table = torch.zeros(len(seq_lens), max(blocks), dtype=torch.int32)
    used = 0
    for s, n in enumerate(seq_lens):
        for b in range(blocks[s]):
            rows = slice(b * state_block, min((b + 1) * state_block, n))
            state_kv[order[used], :rows.stop - rows.start] = kvs[s][rows]
            state_gate[order[used], :rows.stop - rows.start] = gates[s][rows]
            table[s, b] = order[used]
            used += 1
    # Every closed window of every sequence, to shuffled slots, with skipped entries between.
    entries = [(s, w) for s, n in enumerate(seq_lens) for w in range(n // rate)]
    num_slots = (len(entries) // cache_block + 2) * cache_block
    slots = torch.randperm(num_slots, generator=g)[:len(entries)]
    entry_seq = torch.tensor([s for s, _ in entries] + [0, 0], dtype=torch.int32)
    entry_window = torch.tensor([w for _, w in entries] + [0, 0], dtype=torch.int32)
    entry_slot = torch.cat([slots, torch.tensor([-1, -1])]).to(torch.int64)
    sentinel = torch.full((num_slots // cache_block, cache_block, head_dim), 7.0, dtype=dtype)
    cache = sentinel.to(device)
    CompressorPool(device)(state_kv.to(device), state_gate.to(device), table.to(device), bias.to(device),
                           norm.to(device), 1e-6, cos.to(device), sin.to(device), entry_seq.to(device),
                           entry_window.to(device), entry_slot.to(device), cache, rate=rate, overlap=overlap)
    flat = cache.cpu().view(-1, head_dim)
    for s, n in enumerate(seq_lens):
        windows = n // rate
        positions = torch.arange(windows) * rate
        expected = compress_windows(kvs[s], gates[s], bias, norm, 1e-6, cos[positions], sin[positions], rate, overlap)
        got = torch.stack([flat[slots[i]] for i, (es, _) in enumerate(entries) if es == s]) if windows else expected
        if dtype == torch.float32:
            torch.testing.assert_close(got, expected, rtol=2e-6, atol=2e-6)
        elif device.type == "cpu":  # the interpreter rounds each step as the reference does
            assert torch.equal(got, expected)
        else:  # the GPU's exp and fused multiply-adds may tip a rounding step one bf16 ulp (not 40% of them, as
            # dropping a rounding step does)
            torch.testing.assert_close(got.float(), expected.float(), rtol=8e-3, atol=8e-3)
            assert (got == expected).float().mean() >= 0.95
    untouched = torch.ones(num_slots, dtype=torch.bool)
    untouched[slots] = False
    assert torch.all(flat[untouched] == 7.0)


@pytest.mark.parametrize("state_block", [4, 6])  # windows within a state block; windows straddling two
def test_csa_overlap_windows(state_block, device):
    """Rate 4 with the Ca/Cb overlap: sequences of 3 (no window), 4 (window 0 alone: no Ca half), 5, 8/9 and 23."""
    _check(device, torch.float32, 4, 32, 8, True, [3, 4, 5, 8, 9, 23], state_block)


def test_indexer_shape(device):
    """The indexer's compressor: rate 4, overlap, a head of 16 with 8 rotary channels."""
    _check(device, torch.float32, 4, 16, 8, True, [12, 17], 8, seed=1)


def test_hca_rate_128(device):
    """Rate 128 without overlap: 127 tokens close nothing, 128 one window, 257 two."""
    _check(device, torch.float32, 128, 16, 8, False, [127, 128, 257], 64, seed=2)


def test_bf16(device):
    _check(device, torch.bfloat16, 4, 32, 8, True, [9, 16], 4, seed=3)


def test_rejects_bad_arguments(device):
    pool = CompressorPool(device)
    state = torch.zeros(2, 4, 32)
    i32 = torch.zeros(1, dtype=torch.int32)
    args = (state, state, torch.zeros(1, 2, dtype=torch.int32), torch.zeros(4, 32), torch.zeros(16), 1e-6,
            torch.zeros(8, 4), torch.zeros(8, 4), i32, i32, torch.zeros(1, dtype=torch.int64))
    with pytest.raises(ValueError, match="cache must be"):
        pool(*args, torch.zeros(2, 4, 32), rate=4, overlap=True)
    with pytest.raises(ValueError, match="position_bias must be"):
        pool(*args, torch.zeros(2, 4, 16), rate=2, overlap=True)
    with pytest.raises(ValueError, match="entry_slot must be"):
        pool(*args[:-1], i32, torch.zeros(2, 4, 16), rate=4, overlap=True)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need CUDA")
def test_cuda_graph_replays_any_closing_windows():
    """Captured once for a capacity of 8 entries; each replay with other windows closing (the rest slot -1) writes
    exactly what an eager launch writes, and nothing else."""
    device, rate, head_dim, capacity = torch.device("cuda"), 4, 64, 8
    g = torch.Generator().manual_seed(0)
    state_kv = torch.randn(16, 8, 2 * head_dim, generator=g).to(device)
    state_gate = torch.randn(16, 8, 2 * head_dim, generator=g).to(device)
    table = torch.randperm(16, generator=g).to(torch.int32).view(2, 8).to(device)
    bias, norm = torch.randn(rate, 2 * head_dim, generator=g).to(device), torch.randn(head_dim, generator=g).to(device)
    cos, sin = (t.to(device) for t in _rope_caches(64, 16, torch.float32))
    entry_seq = torch.zeros(capacity, dtype=torch.int32, device=device)
    entry_window = torch.zeros(capacity, dtype=torch.int32, device=device)
    entry_slot = torch.full((capacity,), -1, dtype=torch.int64, device=device)
    cache = torch.zeros(8, 4, head_dim, device=device)
    pool = CompressorPool(device)

    def step(c):
        pool(state_kv, state_gate, table, bias, norm, 1e-6, cos, sin, entry_seq, entry_window, entry_slot, c,
             rate=rate, overlap=True)

    step(cache)  # compiled outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step(cache)
    for live in (1, 8, 3):
        entry_seq.copy_(torch.randint(0, 2, (capacity,), generator=g).to(torch.int32))
        entry_window.copy_(torch.randint(0, 16, (capacity,), generator=g).to(torch.int32))
        slots = torch.randperm(32, generator=g)[:capacity]
        slots[live:] = -1
        entry_slot.copy_(slots)
        cache.zero_()
        graph.replay()
        eager = torch.zeros_like(cache)
        step(eager)
        torch.cuda.synchronize()
        assert torch.equal(cache, eager), live
        assert int((cache.view(-1, head_dim).abs().sum(-1) > 0).sum()) == live
