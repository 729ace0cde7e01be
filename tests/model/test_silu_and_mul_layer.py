"""SiluAndMul on the CPU against HF's MLP formulation, act_fn(gate) * up: bitwise (greedy parity with HF rests on it),
and the merged input left untouched (the product is written in place into the SiLU's own buffer)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from surge.model.layers.activation import SiluAndMul


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 16, 1024])
def test_silu_and_mul_matches_hf_formulation(rows, dtype):
    x = (torch.randn(rows, 2 * 96, generator=torch.Generator().manual_seed(rows)) * 4).to(dtype)
    before = x.clone()
    with torch.inference_mode():
        got = SiluAndMul()(x)
    gate, up = before[:, :96], before[:, 96:]
    assert torch.equal(got, F.silu(gate) * up)
    assert torch.equal(x, before)
