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
