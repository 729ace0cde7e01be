"""Triton rotary embedding, in place on strided q/k views, against surge.model.layers.rotary.RotaryEmbedding."""
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
