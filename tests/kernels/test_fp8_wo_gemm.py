"""The fp8 weight-only tensor-core GEMM (surge/kernels/fp8_wo_gemm.py) against torch: x @ dequantized(W).T in float32,
per-row and 128 x 128 block scales, split-K on and off, rows / output columns / K at tile boundaries (N and N+1)."""
from __future__ import annotations

import pytest
import torch

from surge.kernels.fp8_wo_gemm import WoLaunch, fp8_wo_gemm, launch_policy
from surge.kernels.quant_reference import dequantize_fp8
from test_gemv import _weight  # fp8 weights and scales, per row or in 128 x 128 blocks


@pytest.mark.parametrize("block", [False, True], ids=["per-row", "block"])
@pytest.mark.parametrize("m, n, k, launch", [
    (5, 64, 128, WoLaunch(16, 64, 128, 1)),  # one tile
    (16, 65, 200, WoLaunch(16, 64, 128, 1)),  # a second, one-row output tile; a partial K tile
    (17, 130, 384, WoLaunch(32, 64, 128, 2)),  # rows past one 16-row tile; split K over 3 K tiles (2 + 1)
    (33, 128, 640, WoLaunch(32, 64, 128, 4)),  # two row tiles; split K 4 over 5 K tiles (2 + 2 + 1 + 0)
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_wo_gemm_matches_dequantized_linear(block, m, n, k, launch, dtype, device):
    q, scale = _weight(n, k, block, device)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(device, dtype)
    bias = torch.randn(n).to(device, dtype)
    got = fp8_wo_gemm(x, q, scale, bias, block_scales=block, launch=launch)
    w = dequantize_fp8(q.cpu(), scale.cpu(), (128, 128) if block else None)
    expected = torch.nn.functional.linear(x.cpu().float(), w, bias.cpu().float())
    assert got.dtype == dtype and got.shape == (m, n)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.cpu().float(), expected, atol=tol, rtol=tol)


def test_launch_policy_rows_tile_and_split_k():
    assert [launch_policy(m, 4096, 4096).block_t for m in (1, 16, 17, 32, 33, 64, 65)] == [16, 16, 32, 32, 64, 64, 128]
    # split K in two while the programs are fewer than two per SM and each split keeps >= 8 K steps of 128
    assert launch_policy(16, 264 * 64, 4096, num_sms=132).split_k == 1  # 264 tiles: enough programs
    assert launch_policy(16, 263 * 64, 4096, num_sms=132).split_k == 2  # 263: one split more
    assert launch_policy(16, 64, 16 * 128, num_sms=132).split_k == 2  # 16 K steps: two splits of 8
    assert launch_policy(16, 64, 16 * 128 - 1, num_sms=132).split_k == 2  # 16 steps, the last partial: still 2 x 8
    assert launch_policy(16, 64, 15 * 128, num_sms=132).split_k == 1  # 15: no split of >= 8 each
    assert launch_policy(64, 4096, 12288).split_k == 8  # down_proj at batch 64: 64 tiles x 8 = 512 programs


@pytest.mark.parametrize("m, n, k, launch", [(5, 65, 200, WoLaunch(16, 64, 128, 1)),
                                             (33, 130, 640, WoLaunch(64, 64, 128, 2))])
def test_fp8_activations_take_the_fp8_mma(m, n, k, launch, device):
    """W8A8: x quantized per row, both MMA operands fp8: x_q * x_scale @ dequantized(W).T."""
    from surge.kernels.quant_reference import fp8_quant_per_token
    q, scale = _weight(n, k, False, device)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(device, torch.bfloat16)
    xq, xs = fp8_quant_per_token(x)
    got = fp8_wo_gemm(xq, q, scale, launch=launch, x_scale=xs, out_dtype=torch.bfloat16)
    expected = dequantize_fp8(xq.cpu(), xs.cpu()) @ dequantize_fp8(q.cpu(), scale.cpu()).t()
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.cpu().float(), expected, atol=2e-2, rtol=2e-2)
