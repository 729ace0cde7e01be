"""The decode int GEMV (surge/kernels/int_gemv.py) against torch: x @ W.T on the dequantized weight in float32 for 4
and 8 bits, groups 16/32/64/128 and channel-wise, symmetric and asymmetric, bf16/fp16/fp32, at the launch policy's
switches (BLOCK_N at N / N + 1, split K at the SM count, chunks at the group); split K's in-kernel sum leaves its
counters zero; act-order's gather; the W4A16 method's choice between it and int_gemm."""
from __future__ import annotations

import pytest
import torch

from surge.kernels import quant_reference as ref
from surge.kernels.int_gemv import (MAX_M, MAX_ROWS, IntGemvLaunch, _arrival_counters, chunk_words_for, int_gemv,
                                    launch_policy)


def _case(m, n, k, bits, group, dtype, asymmetric, seed=0):
    """(x [M, K] in dtype, packed int32 [N, K * bits / 32], scales [N, K / group] in dtype, zeros uint8 or None)."""
    g = torch.Generator().manual_seed(seed)
    groups = -(-k // group)
    u = torch.randint(0, 1 << bits, (n, k), generator=g).to(torch.uint8)
    scale = (torch.rand(n, groups, generator=g) * 0.02 + 0.001).to(dtype)
    zero = torch.randint(0, 1 << bits, (n, groups), generator=g).to(torch.uint8) if asymmetric else None
    x = torch.randn(m, k, generator=g).to(dtype)
    return x, ref.pack_int32(u, bits), scale, zero


def _expected(x, packed, scale, bits, group, zero=None, perm=None, bias=None):
    """The definition in float32 (the kernel never rounds the weight to x's dtype; its output is rounded once)."""
    return ref.int_gemm(x.float(), packed, scale.float(), bits, group, zero, perm,
                        None if bias is None else bias.float())


def _check(got, expected, dtype):
    # float32 sums in another order, then one rounding to x's dtype (bf16: 2^-8 relative).
    tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}[dtype]
    torch.testing.assert_close(got.float(), expected, rtol=tol, atol=tol)


def _on(device, *tensors):
    return [None if t is None else t.to(device) for t in tensors]


# (M, N, K, bits, group, asymmetric): group 128 at M = 1 (one chunk of 16 words a group); N one past a BLOCK_N of 16;
# group 32 (4-word chunks) at MAX_ROWS rows; channel-wise with K no multiple of the step; 8 bits; group 16 (2-word
# chunks); 3 rows (M padded to 4).
CASES = [(1, 32, 1024, 4, 128, True), (1, 17, 256, 4, 128, False), (MAX_ROWS, 40, 512, 4, 32, True),
         (2, 24, 200, 4, 200, False), (2, 16, 256, 8, 64, True), (1, 8, 128, 4, 16, True),
         (3, 9, 384, 4, 128, True)]


@pytest.mark.parametrize("case", CASES, ids=[f"M{c[0]}-N{c[1]}-K{c[2]}-b{c[3]}-g{c[4]}-z{int(c[5])}" for c in CASES])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_int_gemv_equals_dequantized_linear(case, dtype, device):
    m, n, k, bits, group, asymmetric = case
    x, packed, scale, zero = _case(m, n, k, bits, group, dtype, asymmetric)
    bias = torch.randn(n).to(dtype)
    got = int_gemv(*_on(device, x, packed, scale), bits=bits, group_size=group,
                   zero_point=None if zero is None else zero.to(device), bias=bias.to(device))
    assert got.dtype == dtype and got.shape == (m, n)
    _check(got.cpu(), _expected(x, packed, scale, bits, group, zero, bias=bias), dtype)


def test_extreme_values_unpack_exactly(device):
    """Every value 0 and 15 against zeros 0, 15 and (GPTQ v1's) 16, in every nibble position, float32: the exponent
    trick's subtraction is exact at the ends of its range."""
    n, k, group = 6, 256, 32
    u = torch.zeros(n, k, dtype=torch.uint8)
    u[1::2] = 15
    u[4, ::3] = 15
    zero = torch.tensor([0, 0, 15, 15, 16, 7], dtype=torch.uint8)[:, None].expand(n, k // group).contiguous()
    scale = torch.full((n, k // group), 0.5)
    x = torch.arange(k, dtype=torch.float32)[None, :] / k
    packed = ref.pack_int32(u, 4)
    got = int_gemv(*_on(device, x, packed, scale), bits=4, group_size=group, zero_point=zero.to(device))
    w = (u.double() - zero.double().repeat_interleave(group, 1)) * 0.5
    torch.testing.assert_close(got.cpu().double(), x.double() @ w.t(), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("launch", [IntGemvLaunch(8, 2, 4, split_k=2), IntGemvLaunch(4, 4, 4, split_k=3),
                                    IntGemvLaunch(16, 1, 4, split_k=5, num_stages=2),
                                    IntGemvLaunch(2, 8, 1, num_warps=8, num_stages=3)], ids=str)
def test_forced_geometries_bias_perm_and_counters(launch, device):
    """Split K into 2, 3 (6 steps: 2 + 2 + 2) and 5 (24 steps: 5 + 5 + 5 + 5 + 4), pipelined steps, a bias added
    once, act-order's column gather, x with leading dimensions; a second call computes the same (the last split of
    each column block reset its counter)."""
    m, n, k, group = 3, 40, 768, 64
    x, packed, scale, zero = _case(m, n, k, 4, group, torch.float32, True, seed=5)
    bias = torch.randn(n)
    perm = torch.randperm(k, generator=torch.Generator().manual_seed(6)).int()
    expected = _expected(x, packed, scale, 4, group, zero, perm, bias)
    args = _on(device, x, packed, scale)
    options = dict(bits=4, group_size=group, zero_point=zero.to(device), input_perm=perm.to(device),
                   bias=bias.to(device), launch=launch)
    for _ in range(2):
        _check(int_gemv(*args, **options).cpu(), expected, torch.float32)
    if launch.split_k > 1:
        assert not _arrival_counters(args[0].device).any()
    got = int_gemv(args[0].view(1, m, k), *args[1:], **options)
    assert got.shape == (1, m, n)
    _check(got.view(m, n).cpu(), expected, torch.float32)


def test_bad_arguments_name_themselves():
    x, packed, scale, _ = _case(2, 16, 128, 4, 64, torch.float32, False)
    with pytest.raises(ValueError, match="bits=3"):
        int_gemv(x, packed, scale, bits=3, group_size=64)
    with pytest.raises(ValueError, match="weight_scale"):
        int_gemv(x, packed, scale, bits=4, group_size=32)
    with pytest.raises(ValueError, match="weight_packed"):
        int_gemv(x[:, :64], packed, scale, bits=4, group_size=64)
    with pytest.raises(ValueError, match="17 rows"):
        int_gemv(torch.zeros(MAX_M + 1, 128), packed, scale, bits=4, group_size=64)
    with pytest.raises(ValueError, match="straddle groups of 64"):
        int_gemv(x, packed, scale, bits=4, group_size=64, launch=IntGemvLaunch(4, 1, 16))


def test_chunks_lie_in_one_group():
    assert [chunk_words_for(4096, g, 4) for g in (16, 32, 64, 128, 256, 40)] == [2, 4, 8, 16, 16, 1]
    assert chunk_words_for(4096, 64, 8) == 16 and chunk_words_for(4096, 32, 8) == 8
    assert chunk_words_for(200, 200, 4) == 16 and chunk_words_for(200, 1024, 4) == 16  # channel-wise
    with pytest.raises(ValueError, match="group_size=12 must be a multiple of 8"):
        chunk_words_for(4096, 12, 4)


def test_launch_policy_boundaries():
    # Qwen3-8B's o_proj at batch 1: 64 words (256 bytes) of 32 rows a step, 16 words a thread; 128 column blocks,
    # fewer than the SMs: K split in 2.
    policy = launch_policy(1, 4096, 4096, 128)
    assert policy == IntGemvLaunch(32, 4, 16, 2, 4, 1) and policy.block_words == 64
    assert launch_policy(1, 4096, 4096, 32) == IntGemvLaunch(32, 16, 4, 2, 4, 1)
    assert launch_policy(1, 24576, 4096, 128).split_k == 1  # gate_up: 768 column blocks
    # Steps of 64 / M words (at least 16): M x words stays 64; BLOCK_N 32 until M = 4, then halving.
    assert [launch_policy(m, 4096, 4096, 128).block_words for m in (1, 2, 3, MAX_ROWS, MAX_ROWS + 1)] == \
        [64, 32, 16, 16, 16]
    assert [launch_policy(m, 4096, 4096, 128).block_n for m in (1, 2, MAX_ROWS, MAX_ROWS + 1, MAX_M)] == \
        [32, 32, 32, 16, 8]
    with pytest.raises(ValueError, match="m=17"):
        launch_policy(MAX_M + 1, 4096, 4096, 128)
    # BLOCK_N: a power of two covering N, up to 32 rows (N / N + 1).
    assert launch_policy(1, 16, 4096, 128).block_n == 16 and launch_policy(1, 17, 4096, 128).block_n == 32
    # A short K takes a narrower step: 256 values are 32 words, two chunks of 16.
    assert launch_policy(1, 64, 256, 128).block_words == 32 and launch_policy(1, 64, 256, 128).chunks == 2
    # Split K while the column blocks are fewer than the SMs (131 * 32 = 4192 rows: 131 blocks; 4193: 132), each
    # split keeping 4 steps of 512 values (4096 = 8 steps: 2 splits; 3584: 7 steps, none).
    assert launch_policy(1, 4192, 8192, 128, num_sms=132).split_k == 2
    assert launch_policy(1, 4193, 8192, 128, num_sms=132).split_k == 1
    assert launch_policy(1, 4192, 3584, 128, num_sms=132).split_k == 1
    assert launch_policy(1, 64, 1 << 20, 128).split_k == 8  # MAX_SPLIT_K
    with pytest.raises(ValueError, match="bits=2"):
        launch_policy(1, 64, 4096, 128, bits=2)


@pytest.mark.parametrize("rows, kernel", [(1, "int_gemv"), (MAX_ROWS, "int_gemv"), (MAX_ROWS + 1, "int_gemm")])
def test_w4a16_method_takes_the_gemv_for_few_rows(rows, kernel, monkeypatch, device):
    """The W4A16 method's CUDA path (without CUDA called on CPU tensors: the kernels run in the interpreter): the
    GEMV up to MAX_ROWS rows, int_gemm's tiles beyond; both give the dequantized path's result (the layer's CPU
    one, on the same parameters)."""
    import surge.kernels.int4_gemm as int4_gemm
    import surge.kernels.int_gemv as int_gemv_module
    from surge.model.layers.linear import Linear, deferred_weights
    from surge.model.quant.wna16 import WNA16LinearMethod

    method = WNA16LinearMethod(bits=4, group_size=32, symmetric=False)
    with deferred_weights():
        layer = Linear(64, 24)
    layer.set_method(method, torch.device("cpu"))
    method.init_dummy(layer, torch.Generator().manual_seed(0))
    x = torch.randn(rows, 64, generator=torch.Generator().manual_seed(1))
    want = layer(x)  # on the CPU: the dequantized weight's GEMM
    layer.to(device)
    used = []
    for module, name in ((int4_gemm, "int_gemm"), (int_gemv_module, "int_gemv")):
        original = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, _f=original, _n=name, **kw: used.append(_n) or _f(*a, **kw))
    got = method.cuda_gemm(layer, x.to(device), None)
    assert used == [kernel]
    torch.testing.assert_close(got.cpu(), want, rtol=1e-5, atol=1e-5)
