"""The stream fp8 GEMV (surge/kernels/gemv.py's default at 1-4 rows) against torch: x @ dequantized(W).T in
float32 at tiny shapes (odd N, K not a multiple of the step, M = 1..4, a K split, block scales), and its launch
policy's switches (stages 3 / 4 and the split at the N where in-flight bytes cross IN_FLIGHT_BYTES)."""
from __future__ import annotations

import pytest
import torch

from surge.kernels.gemv import (H200_SMS, IN_FLIGHT_BYTES, MAX_ROWS, GemvLaunch, StreamLaunch, fp8_gemv,
                                stream_policy)
from surge.kernels.quant_reference import dequantize_fp8
from test_gemv import _weight  # fp8 weights and scales, per row or in 128 x 128 blocks


def _reference(x, q, scale, bias, block):
    w = dequantize_fp8(q.cpu(), scale.cpu(), (128, 128) if block else None)
    return torch.nn.functional.linear(x.cpu().float(), w, None if bias is None else bias.cpu().float())


@pytest.mark.parametrize("block", [False, True], ids=["per-row", "block"])
@pytest.mark.parametrize("m, n, k, launch", [
    (1, 17, 200, StreamLaunch(16, 4, 2)),  # odd N (two programs, the second one row), K not a multiple of 64
    (2, 33, 96, StreamLaunch(16, 2, 3)),
    (3, 130, 300, StreamLaunch(16, 8, 3, split_k=2)),  # a K split over 3 steps (2 + 1), rows straddle a scale block
    (MAX_ROWS, 40, 384, StreamLaunch(16, 8, 4, split_k=3)),
    (MAX_ROWS, 9, 16, None),  # the policy's choice at the smallest K
], ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_stream_gemv_matches_dequantized_linear(block, m, n, k, launch, dtype, device):
    q, scale = _weight(n, k, block, device)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(device, dtype)
    bias = torch.randn(n).to(device, dtype)
    got = fp8_gemv(x, q, scale, bias, block_scales=block, launch=launch or stream_policy(m, n, k))
    assert got.dtype == dtype and got.shape == (m, n)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.cpu().float(), _reference(x, q, scale, bias, block), atol=tol, rtol=tol)


def test_stream_is_the_default_and_tiles_stays_selectable(monkeypatch, device):
    """SURGE_FP8_GEMV picks the kernel; both compute the same product."""
    q, scale = _weight(24, 256, False, device)
    x = torch.randn(2, 256, generator=torch.Generator().manual_seed(7)).to(device)
    expected = _reference(x, q, scale, None, False)
    for kernel in ("stream", "tiles"):
        monkeypatch.setenv("SURGE_FP8_GEMV", kernel)
        torch.testing.assert_close(fp8_gemv(x, q, scale).cpu(), expected, atol=1e-5, rtol=1e-5)
    monkeypatch.setenv("SURGE_FP8_GEMV", "fast")
    with pytest.raises(ValueError, match="SURGE_FP8_GEMV='fast'"):
        fp8_gemv(x, q, scale)
    monkeypatch.delenv("SURGE_FP8_GEMV")
    got = fp8_gemv(x, q, scale, launch=GemvLaunch(8, 128, 4))  # an explicit launch names its kernel
    torch.testing.assert_close(got.cpu(), expected, atol=1e-5, rtol=1e-5)


def test_policy_on_qwen3_8b_layers():
    """Steps of 512 columns, 16 rows a program; 3 stages for qkv and gate_up, 4 for o and down, none split."""
    for m in range(1, MAX_ROWS + 1):
        assert stream_policy(m, 6144, 4096) == StreamLaunch(16, 32, 3)
        assert stream_policy(m, 4096, 4096) == StreamLaunch(16, 32, 4)
        assert stream_policy(m, 24576, 4096) == StreamLaunch(16, 32, 3)
        assert stream_policy(m, 4096, 12288) == StreamLaunch(16, 32, 4)
    assert stream_policy(1, 4096, 100).chunks == 8 and stream_policy(1, 4096, 16).chunks == 1


def test_policy_switches_where_the_bytes_in_flight_cross_the_target():
    """N * BLOCK_K * (stages - 1) against IN_FLIGHT_BYTES * SMs: stages 3 down to the boundary N, 4 below it, and
    a K split (powers of two, at least 4 steps a split) below what 4 stages cover."""
    wanted = IN_FLIGHT_BYTES * H200_SMS
    n3 = -(-wanted // (512 * 2))  # the smallest N with 3 stages
    assert stream_policy(1, n3, 4096).num_stages == 3 and stream_policy(1, n3 - 1, 4096).num_stages == 4
    n4 = -(-wanted // (512 * 3))  # the smallest N with 4 stages unsplit
    assert stream_policy(1, n4, 4096).split_k == 1 and stream_policy(1, n4 - 1, 4096).split_k == 2
    assert stream_policy(1, 64, 4096).split_k == 2  # 8 steps: at most 2 splits of 4
    assert stream_policy(1, 64, 65536).split_k == 8
    with pytest.raises(ValueError, match="m=5"):
        stream_policy(5, 64, 64)
    with pytest.raises(ValueError, match="n=0"):
        stream_policy(1, 0, 64)
