"""Triton rotary embedding, in place on strided q/k views, against surge.model.layers.rotary.RotaryEmbedding; partial
rotary and GPT-J's interleaved layout against the prologue's unfused reference (surge.kernels.reference)."""
from __future__ import annotations

import pytest
import torch

from surge.model.layers.rotary import RotaryEmbedding


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("heads,head_dim", [((4, 2), 16), ((3, 1), 12)])  # GQA; non-power-of-two heads and dim
def test_rotary_matches_layer(heads, head_dim, dtype, device):
    from surge.kernels.rotary import apply_rotary

    num_q, num_k = heads
    rope = RotaryEmbedding(head_dim, 64, {"rope_theta": 10000.0, "rope_type": "default"}).to(device)
    gen = torch.Generator().manual_seed(0)
    qkv = torch.randn(6, (num_q + 2 * num_k) * head_dim, generator=gen).to(device, dtype)
    q = qkv[:, :num_q * head_dim].view(6, num_q, head_dim)
    k = qkv[:, num_q * head_dim:(num_q + num_k) * head_dim].view(6, num_k, head_dim)
    v_before = qkv[:, (num_q + num_k) * head_dim:].clone()
    positions = torch.tensor([0, 1, 2, 17, 40, 63], device=device)
    expected_q, expected_k = rope(positions, q.clone(), k.clone())
    apply_rotary(positions, q, k, rope.cos_cache, rope.sin_cache)
    tol = {torch.float32: 1e-6, torch.float16: 1e-3, torch.bfloat16: 1e-2}[dtype]
    torch.testing.assert_close(q, expected_q, atol=tol, rtol=tol)
    torch.testing.assert_close(k, expected_k, atol=tol, rtol=tol)
    assert torch.equal(qkv[:, (num_q + num_k) * head_dim:], v_before)  # v untouched


def test_launch_policy():
    from surge.kernels.rotary import launch_policy

    p = launch_policy(32, 8, 128)  # Qwen3-8B
    assert (p.q_heads_pad, p.k_heads_pad, p.half_pad, p.num_warps) == (32, 8, 64, 4)  # 5120 elements
    assert launch_policy(8, 8, 64).num_warps == 1 and launch_policy(8, 8, 128).num_warps == 2  # 1024 / 2048
    assert launch_policy(8, 9, 128).num_warps == 2 and launch_policy(16, 16, 128).num_warps == 4  # 3072 / 4096
    with pytest.raises(ValueError, match="head_dim"):
        launch_policy(4, 4, 63)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("qk_norm", [False, True])
@pytest.mark.parametrize("heads,head_dim", [((4, 2), 16), ((3, 1), 12)])
def test_rotary_write_kv_matches_prologue(heads, head_dim, qk_norm, dtype, device):
    """The fused prologue (per-head norm, rotary, cache write) against the unfused layers and a plain write."""
    from surge.attention.backend import Prologue
    from surge.kernels.rotary import rotary_write_kv
    from surge.model.layers.norm import RMSNorm

    num_q, num_k = heads
    gen = torch.Generator().manual_seed(1)
    rope = RotaryEmbedding(head_dim, 64, {"rope_theta": 10000.0, "rope_type": "default"})
    q_norm = k_norm = None
    if qk_norm:
        q_norm, k_norm = RMSNorm(head_dim, 1e-6), RMSNorm(head_dim, 1e-6)
        q_norm.weight.data = torch.rand(head_dim, generator=gen) + 0.5
        k_norm.weight.data = torch.rand(head_dim, generator=gen) + 0.5
        q_norm, k_norm = q_norm.to(dtype), k_norm.to(dtype)  # as the model builds them: weights in its dtype
    T, num_blocks, block_size = 6, 5, 4
    qkv = (3 * torch.randn(T, (num_q + 2 * num_k) * head_dim, generator=gen)).to(dtype)
    split = lambda t: (t[:, :num_q * head_dim].view(T, num_q, head_dim),  # noqa: E731
                       t[:, num_q * head_dim:(num_q + num_k) * head_dim].view(T, num_k, head_dim),
                       t[:, (num_q + num_k) * head_dim:].view(T, num_k, head_dim))
    positions = torch.tensor([0, 1, 2, 17, 40, 63])
    slots = torch.tensor([0, 5, 6, -1, 19, 13])  # -1: a padding row, written nowhere

    # Reference: the layers in torch (CPU), then a plain scatter into the cache.
    q_ref, k_ref, v_ref = (t.clone() for t in split(qkv.clone()))
    q_in, k_in = q_ref.clone(), k_ref.clone()
    if q_norm is not None:
        q_ref, k_ref = q_norm(q_ref), k_norm(k_ref)
    q_ref, k_ref = rope(positions, q_ref, k_ref)
    # The prologue's own unfused reference (plain tensors) is the layers' math too.
    q_pro, k_pro = Prologue(positions, rope.cos_cache, rope.sin_cache,
                            q_norm.weight if q_norm is not None else None,
                            k_norm.weight if k_norm is not None else None,
                            q_norm.eps if q_norm is not None else 0.0).apply(q_in, k_in)
    torch.testing.assert_close(q_pro, q_ref, atol=0, rtol=0)
    torch.testing.assert_close(k_pro, k_ref, atol=0, rtol=0)
    cache_ref = torch.zeros(2, num_blocks, block_size, num_k, head_dim, dtype=dtype)
    keep = slots >= 0
    cache_ref[0].view(-1, num_k, head_dim)[slots[keep]] = k_ref[keep]
    cache_ref[1].view(-1, num_k, head_dim)[slots[keep]] = v_ref[keep]

    qkv_dev = qkv.to(device)
    q, k, v = split(qkv_dev)
    k_before = k.clone()
    cache = torch.zeros(2, num_blocks, block_size, num_k, head_dim, dtype=dtype, device=device)
    rope = rope.to(device)
    rotary_write_kv(positions.to(device), q, k, v, rope.cos_cache, rope.sin_cache, cache[0], cache[1],
                    slots.to(device), q_norm.weight.to(device) if qk_norm else None,
                    k_norm.weight.to(device) if qk_norm else None, 1e-6)
    tol = {torch.float32: 1e-5, torch.bfloat16: 2e-2}[dtype]
    torch.testing.assert_close(q.cpu(), q_ref, atol=tol, rtol=tol)
    torch.testing.assert_close(cache.cpu(), cache_ref, atol=tol, rtol=tol)
    assert torch.equal(k, k_before)  # k itself is left alone: attention reads the cache


def test_rotary_write_kv_refuses_half_norm():
    from surge.kernels.rotary import rotary_write_kv

    q, k = torch.zeros(1, 2, 8), torch.zeros(1, 1, 8)
    cache = torch.zeros(2, 1, 4, 1, 8)
    with pytest.raises(ValueError, match="q_norm_weight and k_norm_weight"):
        rotary_write_kv(torch.zeros(1, dtype=torch.long), q, k, k, torch.zeros(4, 4), torch.zeros(4, 4), cache[0],
                        cache[1], torch.zeros(1, dtype=torch.long), q_norm_weight=torch.ones(8))


# (heads, head_dim, rotary_dim, interleaved): GPT-J pairs over the whole head; NeoX halves of the first 8 of 16
# channels; pairs of the first 6 of 12 (3 pairs, a 6-channel rest: neither a power of two); a quarter of the head.
LAYOUTS = [((4, 2), 16, 16, True), ((4, 2), 16, 8, False), ((3, 1), 12, 6, True), ((3, 1), 12, 6, False),
           ((4, 2), 16, 4, True)]
LAYOUT_IDS = ["interleaved", "partial", "partial-interleaved-odd", "partial-odd", "quarter-interleaved"]


def _tables(head_dim, rotary_dim, interleaved):
    rope = RotaryEmbedding(head_dim, 64, {"rope_theta": 10000.0, "rope_type": "default"}, interleaved, rotary_dim)
    assert rope.cos_cache.shape == (64, rotary_dim // 2)
    return rope.cos_cache, rope.sin_cache


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,head_dim,rotary_dim,interleaved", LAYOUTS, ids=LAYOUT_IDS)
def test_rotary_partial_and_interleaved_match_reference(heads, head_dim, rotary_dim, interleaved, dtype, device):
    from surge.attention.backend import Prologue
    from surge.kernels.rotary import apply_rotary

    num_q, num_k = heads
    cos, sin = _tables(head_dim, rotary_dim, interleaved)
    gen = torch.Generator().manual_seed(3)
    qkv = torch.randn(6, (num_q + 2 * num_k) * head_dim, generator=gen).to(dtype)
    positions = torch.tensor([0, 1, 2, 17, 40, 63])
    q_in = qkv[:, :num_q * head_dim].view(6, num_q, head_dim)
    k_in = qkv[:, num_q * head_dim:(num_q + num_k) * head_dim].view(6, num_k, head_dim)
    expected_q, expected_k = Prologue(positions, cos, sin, interleaved=interleaved).apply(q_in, k_in)
    qkv_dev = qkv.to(device)
    q = qkv_dev[:, :num_q * head_dim].view(6, num_q, head_dim)
    k = qkv_dev[:, num_q * head_dim:(num_q + num_k) * head_dim].view(6, num_k, head_dim)
    apply_rotary(positions.to(device), q, k, cos.to(device), sin.to(device), interleaved)
    tol = {torch.float32: 1e-6, torch.bfloat16: 1e-2}[dtype]
    torch.testing.assert_close(q.cpu(), expected_q, atol=tol, rtol=tol)
    torch.testing.assert_close(k.cpu(), expected_k, atol=tol, rtol=tol)
    # The channels past rotary_dim are untouched (bitwise), and so is v.
    assert torch.equal(q.cpu()[..., rotary_dim:], q_in[..., rotary_dim:])
    assert torch.equal(qkv_dev[:, (num_q + num_k) * head_dim:].cpu(), qkv[:, (num_q + num_k) * head_dim:])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("qk_norm", [False, True])
@pytest.mark.parametrize("heads,head_dim,rotary_dim,interleaved", LAYOUTS, ids=LAYOUT_IDS)
def test_rotary_write_kv_partial_and_interleaved_match_prologue(heads, head_dim, rotary_dim, interleaved, qk_norm,
                                                                dtype, device):
    """The fused prologue against Prologue.apply (RMSNorm over the whole head, then the first rotary_dim channels
    rotated) and a plain scatter of k and v into the cache."""
    from surge.attention.backend import Prologue
    from surge.kernels.rotary import rotary_write_kv

    num_q, num_k = heads
    cos, sin = _tables(head_dim, rotary_dim, interleaved)
    gen = torch.Generator().manual_seed(4)
    q_w = k_w = None
    if qk_norm:
        q_w = (torch.rand(head_dim, generator=gen) + 0.5).to(dtype)
        k_w = (torch.rand(head_dim, generator=gen) + 0.5).to(dtype)
    T, num_blocks, block_size = 6, 5, 4
    qkv = (3 * torch.randn(T, (num_q + 2 * num_k) * head_dim, generator=gen)).to(dtype)
    split = lambda t: (t[:, :num_q * head_dim].view(T, num_q, head_dim),  # noqa: E731
                       t[:, num_q * head_dim:(num_q + num_k) * head_dim].view(T, num_k, head_dim),
                       t[:, (num_q + num_k) * head_dim:].view(T, num_k, head_dim))
    positions = torch.tensor([0, 1, 2, 17, 40, 63])
    slots = torch.tensor([0, 5, 6, -1, 19, 13])  # -1: a padding row, written nowhere

    q_in, k_in, v_in = split(qkv)
    q_ref, k_ref = Prologue(positions, cos, sin, q_w, k_w, 1e-6 if qk_norm else 0.0, interleaved).apply(q_in, k_in)
    cache_ref = torch.zeros(2, num_blocks, block_size, num_k, head_dim, dtype=dtype)
    keep = slots >= 0
    cache_ref[0].view(-1, num_k, head_dim)[slots[keep]] = k_ref[keep]
    cache_ref[1].view(-1, num_k, head_dim)[slots[keep]] = v_in[keep]

    qkv_dev = qkv.to(device)
    q, k, v = split(qkv_dev)
    cache = torch.zeros(2, num_blocks, block_size, num_k, head_dim, dtype=dtype, device=device)
    rotary_write_kv(positions.to(device), q, k, v, cos.to(device), sin.to(device), cache[0], cache[1],
                    slots.to(device), q_w.to(device) if qk_norm else None, k_w.to(device) if qk_norm else None,
                    1e-6, interleaved)
    tol = {torch.float32: 1e-5, torch.bfloat16: 2e-2}[dtype]
    torch.testing.assert_close(q.cpu(), q_ref, atol=tol, rtol=tol)
    torch.testing.assert_close(cache.cpu(), cache_ref, atol=tol, rtol=tol)
    assert torch.equal(cache[1].cpu(), cache_ref[1])  # v copied bit for bit, every channel
    assert torch.equal(k.cpu(), k_in)  # k itself is left alone: attention reads the cache


def test_rotary_dim_must_fit_the_head():
    from surge.kernels.rotary import apply_rotary, launch_policy

    q, k = torch.zeros(1, 2, 8), torch.zeros(1, 1, 8)
    with pytest.raises(ValueError, match="rotary_dim // 2"):
        apply_rotary(torch.zeros(1, dtype=torch.long), q, k, torch.zeros(4, 5), torch.zeros(4, 5))
    with pytest.raises(ValueError, match="rotary_dim=6"):
        launch_policy(4, 4, 4, 6)
    assert launch_policy(8, 8, 128, 64).rest_pad == 64 and launch_policy(8, 8, 128).rest_pad == 0
    assert launch_policy(8, 8, 80, 40).rest_pad == 64  # 20 pairs and 40 channels passed through, padded


@pytest.mark.parametrize("heads,head_dim,rotary_dim,interleaved", [LAYOUTS[2], LAYOUTS[4]], ids=LAYOUT_IDS[2:5:2])
def test_triton_backend_fuses_partial_and_interleaved_prologues(heads, head_dim, rotary_dim, interleaved, device,
                                                                monkeypatch):
    """The Triton backend runs these prologues through the fused kernel (no unfused fallback): its attention output
    and cache equal the torch backend's, which applies Prologue.apply."""
    from surge.attention.backend import AttentionMetadata, AttentionParams, Prologue
    from surge.attention.torch_backend import TorchAttentionBackend
    from surge.attention.triton_backend import TritonAttentionBackend

    num_q, num_k = heads
    requests = [(0, 5), (7, 1), (3, 4)]  # (cached, new) per request; cached positions hold earlier keys
    gen = torch.Generator().manual_seed(5)
    cos, sin = _tables(head_dim, rotary_dim, interleaved)
    q_w, k_w = torch.rand(head_dim, generator=gen) + 0.5, torch.rand(head_dim, generator=gen) + 0.5
    num_tokens = sum(n for _, n in requests)
    positions = torch.cat([torch.arange(c, c + n) for c, n in requests])
    qsl = [0]
    for _, n in requests:
        qsl.append(qsl[-1] + n)
    seq_lens = [c + n for c, n in requests]
    tables = torch.tensor([[1, 2, 0], [3, 4, 0], [5, 6, 0]], dtype=torch.int32)
    slots = torch.tensor([int(tables[r, p // 4]) * 4 + p % 4 for r, (c, n) in enumerate(requests)
                          for p in range(c, c + n)])
    cache = torch.randn(2, 7, 4, num_k, head_dim, generator=gen)  # cached context: already rotated keys
    q, k, v = (torch.randn(num_tokens, h, head_dim, generator=gen) for h in (num_q, num_k, num_k))
    layer = AttentionParams(num_q, num_k, head_dim, head_dim ** -0.5)

    def run(backend, dev):
        meta = AttentionMetadata(
            num_reqs=3, num_tokens=num_tokens, query_start_loc=qsl, seq_lens=seq_lens,
            max_query_len=max(n for _, n in requests), max_seq_len=max(seq_lens),
            query_start_loc_t=torch.tensor(qsl, dtype=torch.int32, device=dev),
            seq_lens_t=torch.tensor(seq_lens, dtype=torch.int64, device=dev), slot_mapping=slots.to(dev),
            block_table=tables.to(dev))
        prologue = Prologue(positions.to(dev), cos.to(dev), sin.to(dev), q_w.to(dev), k_w.to(dev), 1e-6, interleaved)
        kv = cache.clone().to(dev)
        out = backend.forward(q.clone().to(dev), k.clone().to(dev), v.to(dev), kv, meta, layer, prologue)
        return out.cpu(), kv.cpu()

    expected_out, expected_cache = run(TorchAttentionBackend(), torch.device("cpu"))

    def unfused(*args):
        raise AssertionError("the Triton backend fell back to Prologue.apply")
    monkeypatch.setattr(Prologue, "apply", unfused)
    got_out, got_cache = run(TritonAttentionBackend(), device)
    torch.testing.assert_close(got_cache, expected_cache, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_out, expected_out, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("qk_norm", [False, True])
@pytest.mark.parametrize("heads,head_dim,rotary_dim,interleaved", [((4, 2), 16, 16, False), LAYOUTS[1]],
                         ids=["full", "partial"])
def test_rotary_write_kv_into_fp8_cache_quantizes_what_it_would_store(heads, head_dim, rotary_dim, interleaved,
                                                                       qk_norm, dtype, device, require_fp8):
    """Into an FP8 cache the fused prologue stores quantize_fp8 of exactly what it writes into a cache of the model's
    dtype (tested above against the unfused layers), bit for bit: k normed, rotated and rounded to the dtype, then
    x / k_scale saturated; v / v_scale. q is rotated in place as before."""
    from surge.kernels.reference import quantize_fp8
    from surge.kernels.rotary import rotary_write_kv

    num_q, num_k = heads
    cos, sin = (t.to(device) for t in _tables(head_dim, rotary_dim, interleaved))
    gen = torch.Generator().manual_seed(5)
    norms = ((torch.rand(head_dim, generator=gen) + 0.5).to(dtype).to(device) for _ in range(2)) if qk_norm else None
    q_w, k_w = norms if qk_norm else (None, None)
    T = 6
    qkv = (3 * torch.randn(T, (num_q + 2 * num_k) * head_dim, generator=gen)).to(dtype).to(device)
    qkv[0, num_q * head_dim] = 1e4  # a value far past 448 * k_scale (position 0: not rotated): saturated, unless normed
    positions = torch.tensor([0, 1, 2, 17, 40, 63], device=device)
    slots = torch.tensor([0, 5, 6, -1, 19, 13], device=device)
    scales = torch.tensor(0.029, device=device), torch.tensor(0.41, device=device)
    caches = []
    for cache_dtype in (dtype, torch.float8_e4m3fn):
        x = qkv.clone()
        q = x[:, :num_q * head_dim].view(T, num_q, head_dim)
        k = x[:, num_q * head_dim:(num_q + num_k) * head_dim].view(T, num_k, head_dim)
        v = x[:, (num_q + num_k) * head_dim:].view(T, num_k, head_dim)
        cache = torch.zeros(2, 5, 4, num_k, head_dim, dtype=cache_dtype, device=device)
        rotary_write_kv(positions, q, k, v, cos, sin, cache[0], cache[1], slots, q_w, k_w, 1e-6, interleaved,
                        *scales)
        caches.append((cache, q))
    (plain, q_plain), (fp8, q_fp8) = caches
    assert torch.equal(q_fp8, q_plain)
    for i in (0, 1):
        assert torch.equal(fp8[i].view(torch.uint8).cpu(), quantize_fp8(plain[i], scales[i]).view(torch.uint8).cpu())
    assert (fp8[0].float().abs().max() == 448.0) != qk_norm
