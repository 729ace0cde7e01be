"""LayerNorm (with bias, without, non-parametric) against torch's nn.LayerNorm, which HF's LayerNorm models use:
bitwise in float32 and bfloat16; with the residual add, the sum is returned too."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from surge.model.layers.norm import LayerNorm


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias,affine", [(True, True), (False, True), (False, False)])
def test_layer_norm_matches_torch(bias, affine, dtype):
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(9, 96, generator=g) * 3 + 1).to(dtype)
    residual = torch.randn(9, 96, generator=g).to(dtype)
    ours, ref = LayerNorm(96, 1e-5, bias=bias, affine=affine), nn.LayerNorm(96, 1e-5, affine, bias)
    assert {n for n, _ in ours.named_parameters()} == {n for n, _ in ref.named_parameters()}
    with torch.no_grad():
        for (_, p), (_, r) in zip(ours.named_parameters(), ref.named_parameters()):
            p.copy_(torch.rand(96, generator=g) + 0.5)
            r.copy_(p)
    ours, ref = ours.to(dtype), ref.to(dtype)
    with torch.inference_mode():
        assert torch.equal(ours(x), ref(x))
        normed, summed = ours(x, residual)
        assert torch.equal(summed, x + residual) and torch.equal(normed, ref(x + residual))
