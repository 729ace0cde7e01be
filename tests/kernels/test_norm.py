"""Triton RMSNorm (plain and fused with the residual add) against surge.model.layers.norm.RMSNorm."""
from __future__ import annotations

import pytest
import torch

from surge.model.layers.norm import RMSNorm

TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.float16: dict(atol=1e-3, rtol=1e-3),
       torch.bfloat16: dict(atol=1e-2, rtol=1e-2)}


def _layer(hidden, dtype, device):
    layer = RMSNorm(hidden, eps=1e-5).to(device=device, dtype=dtype)
    layer.weight.data = torch.randn(hidden, generator=torch.Generator().manual_seed(1)).to(device, dtype)
    return layer


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("hidden", [64, 100])  # a power of two and a padded row
def test_rms_norm_matches_layer(hidden, dtype, device):
    from surge.kernels.norm import fused_add_rms_norm, rms_norm

    layer = _layer(hidden, dtype, device)
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(5, hidden, generator=gen) * 3).to(device, dtype)
    residual = torch.randn(5, hidden, generator=gen).to(device, dtype)
    torch.testing.assert_close(rms_norm(x, layer.weight, layer.eps), layer(x), **TOL[dtype])
    out, new_residual = fused_add_rms_norm(x, residual, layer.weight, layer.eps)
    expected, expected_residual = layer(x, residual)
    assert torch.equal(new_residual, expected_residual)  # one rounding of an fp32 sum: exact
    torch.testing.assert_close(out, expected, **TOL[dtype])


def test_rms_norm_per_head_on_a_strided_view(device):
    """Qwen3's q_norm: q is [T, H, D], a view of the fused qkv projection with a token stride wider than H * D."""
    from surge.kernels.norm import rms_norm

    layer = _layer(16, torch.float32, device)
    qkv = torch.randn(3, (4 + 2 * 2) * 16, device=device)
    q = qkv[:, :4 * 16].view(3, 4, 16)
    out = rms_norm(q, layer.weight, layer.eps)
    assert out.shape == q.shape and out.is_contiguous()
    torch.testing.assert_close(out, layer(q), **TOL[torch.float32])


def test_weight_dtype_promotes_like_torch(device):
    from surge.kernels.norm import rms_norm

    layer = RMSNorm(32).to(device)  # fp32 weight, bf16 activations: torch returns fp32
    x = torch.randn(2, 32, device=device).to(torch.bfloat16)
    out = rms_norm(x, layer.weight, layer.eps)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, layer(x), **TOL[torch.bfloat16])


def test_launch_policy_boundaries():
    from surge.kernels.norm import MAX_HIDDEN, launch_policy

    assert launch_policy(512).num_warps == 1 and launch_policy(513).block == 1024
    assert launch_policy(1024).num_warps == 2 and launch_policy(4096).num_warps == 8
    assert launch_policy(8192).num_warps == 16 and launch_policy(MAX_HIDDEN).num_warps == 16
    with pytest.raises(ValueError, match="hidden_size"):
        launch_policy(MAX_HIDDEN + 1)
