"""RMSNorm on the CPU against HF transformers' LlamaRMSNorm: bitwise in float32 (greedy parity with HF rests on
it), within rounding in bfloat16; with the residual add, the sum is returned too."""
from __future__ import annotations

import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from surge.model.layers.norm import RMSNorm


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 16, 300])
def test_rms_norm_matches_hf(rows, dtype):
    g = torch.Generator().manual_seed(rows)
    x = (torch.randn(rows, 576, generator=g) * 3).to(dtype)
    residual = torch.randn(rows, 576, generator=g).to(dtype)
    ours, hf = RMSNorm(576, 1e-5), LlamaRMSNorm(576, eps=1e-5)
    with torch.no_grad():
        ours.weight.copy_(torch.rand(576, generator=g) + 0.5)
        hf.weight.copy_(ours.weight)
    ours, hf = ours.to(dtype), hf.to(dtype)
    with torch.inference_mode():
        assert torch.equal(ours(x), hf(x))
        normed, summed = ours(x, residual)
        assert torch.equal(summed, x + residual) and torch.equal(normed, hf(x + residual))
