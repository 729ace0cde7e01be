"""The decode fp8 GEMV (surge.kernels.gemv.py) against torch: x @ dequantized(W).T in float32, per-row and
128 x 128 block scales, at the launch policy's switches (BLOCK_N 8 / 16, partial tiles along N and K)."""
from __future__ import annotations

import pytest
import torch

from surge.kernels.gemv import MAX_ROWS, GemvLaunch, fp8_gemv, launch_policy
from surge.kernels.quant_reference import dequantize_fp8


def _weight(n, k, block, device):
    g = torch.Generator().manual_seed(n * 1000 + k)
    w = (torch.randn(n, k, generator=g) * 0.05).clamp(-0.4, 0.4)
    if block:
        scale = torch.rand(-(-n // 128), -(-k // 128), generator=g) * 0.01 + 0.001
        expanded = scale.repeat_interleave(128, 0).repeat_interleave(128, 1)[:n, :k]
    else:
        scale = torch.rand(n, 1, generator=g) * 0.01 + 0.001
        expanded = scale
    q = (w / expanded).clamp(-448, 448).to(torch.float8_e4m3fn)
    return q.to(device), scale.to(device)


@pytest.mark.parametrize("block", [False, True], ids=["per-row", "block"])
@pytest.mark.parametrize("m, n, k", [(1, 8, 64), (1, 24, 200), (3, 130, 256), (MAX_ROWS, 40, 384), (2, 17, 16)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_gemv_matches_dequantized_linear(block, m, n, k, dtype, device):
    q, scale = _weight(n, k, block, device)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(device, dtype)
    bias = torch.randn(n).to(device, dtype)
    got = fp8_gemv(x, q, scale, bias, block_scales=block)
    w = dequantize_fp8(q.cpu(), scale.cpu(), (128, 128) if block else None)
    expected = torch.nn.functional.linear(x.cpu().float(), w, bias.cpu().float())
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.cpu().float(), expected, atol=tol, rtol=tol)


def test_launch_policy_steps_1024_columns_a_row_until_128():
    assert [launch_policy(m, 4096, 4096).block_k for m in (1, 2, 3, 4)] == [1024, 512, 256, 256]
    assert launch_policy(1, 4096, 100).block_k == 128 and launch_policy(1, 4096, 48).block_k == 64


@pytest.mark.parametrize("block_k", [128, 256, 512])
def test_block_scales_across_a_wide_tile(block_k, device):
    """A K step wider than a scale block reads each column's own block scale."""
    q, scale = _weight(24, 700, True, device)
    x = torch.randn(1, 700, generator=torch.Generator().manual_seed(3)).to(device)
    got = fp8_gemv(x, q, scale, block_scales=True, launch=GemvLaunch(8, block_k, 4))
    expected = torch.nn.functional.linear(x.cpu(), dequantize_fp8(q.cpu(), scale.cpu(), (128, 128)))
    torch.testing.assert_close(got.cpu(), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("launch", [GemvLaunch(8, 128, 4, split_k=2), GemvLaunch(8, 128, 4, split_k=3, num_stages=2),
                                    GemvLaunch(16, 256, 4, reduce_once=True),
                                    GemvLaunch(8, 128, 4, split_k=2, reduce_once=True)], ids=str)
@pytest.mark.parametrize("block", [False, True], ids=["per-row", "block"])
def test_split_k_stages_and_one_reduction_compute_the_same(launch, block, device):
    """Split K (3 splits over 5 K steps: 2 + 2 + 1), pipelined loads and the single final reduction: the same
    product, bias added once."""
    q, scale = _weight(40, 640, block, device)
    x = torch.randn(3, 640, generator=torch.Generator().manual_seed(5)).to(device, torch.bfloat16)
    bias = torch.randn(40).to(device, torch.bfloat16)
    got = fp8_gemv(x, q, scale, bias, block_scales=block, launch=launch)
    w = dequantize_fp8(q.cpu(), scale.cpu(), (128, 128) if block else None)
    expected = torch.nn.functional.linear(x.cpu().float(), w, bias.cpu().float())
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.cpu().float(), expected, atol=2e-2, rtol=2e-2)


def test_fp8_gemv_refuses_what_it_does_not_take(device):
    q, scale = _weight(8, 64, False, device)
    with pytest.raises(ValueError, match="up to 4 rows"):
        fp8_gemv(torch.zeros(5, 64, device=device), q, scale)
    with pytest.raises(ValueError, match=r"weight_scale must be float32 \(1, 1\)"):
        fp8_gemv(torch.zeros(1, 64, device=device), q, scale, block_scales=True)


def test_the_fp8_method_switches_at_the_kernels_row_limit():
    from surge.model.quant.fp8 import GEMV_ROWS
    assert GEMV_ROWS == MAX_ROWS

