"""Triton SiLU-and-mul against surge.model.layers.activation.SiluAndMul."""
from __future__ import annotations

import pytest
import torch

from surge.model.layers.activation import SiluAndMul


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", [(3, 2 * 40), (2, 2, 2 * 1100)])  # padded tile; several tiles per row, 3-D
def test_silu_and_mul_matches_layer(shape, dtype, device):
    from surge.kernels.activation import silu_and_mul

    x = (torch.randn(*shape, generator=torch.Generator().manual_seed(0)) * 4).to(device, dtype)
    tol = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 1e-2}[dtype]
    torch.testing.assert_close(silu_and_mul(x), SiluAndMul()(x), atol=tol, rtol=tol)


def test_launch_policy_boundaries():
    from surge.kernels.activation import launch_policy

    assert launch_policy(1024).block == 1024 and launch_policy(1025).block == 1024
    assert launch_policy(256).num_warps == 1 and launch_policy(257).num_warps == 2
    with pytest.raises(ValueError, match="even"):
        from surge.kernels.activation import silu_and_mul
        silu_and_mul(torch.zeros(2, 3))
