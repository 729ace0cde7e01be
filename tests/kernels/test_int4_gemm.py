"""Weight-only int GEMM and its packed layouts: the canonical layout unpacked against compressed-tensors' own packing
and dequantization; AutoAWQ and GPTQ (act-order too) tensors packed here by hand, converted, unpacked back; the
Triton GEMM against F.linear on the dequantized weight for 4 and 8 bits, groups 32/64/128 and channel-wise,
symmetric and asymmetric, bf16/fp16/fp32, at the launch policy's boundaries (split-K or not, M = 1)."""
from __future__ import annotations

import pytest
import torch

from surge.kernels import quant_reference as ref


def _random_int_weight(n, k, bits, group, dtype, seed=0, asymmetric=True):
    """(unsigned values uint8 [N, K], scales [N, K / group] in dtype, unsigned zeros uint8 [N, K / group] or None)."""
    g = torch.Generator().manual_seed(seed)
    u = torch.randint(0, 1 << bits, (n, k), generator=g).to(torch.uint8)
    scale = (torch.rand(n, k // group, generator=g) * 0.02 + 0.001).to(dtype)
    zero = torch.randint(0, 1 << bits, (n, k // group), generator=g).to(torch.uint8) if asymmetric else None
    return u, scale, zero


def _expected_weight(u, scale, zero, bits, group):
    """The meaning of the layout, elementwise: (u - z) * s, one rounding in s's dtype."""
    z = (1 << (bits - 1)) if zero is None else zero.long().repeat_interleave(group, 1)
    return (u.long() - z).to(scale.dtype) * scale.repeat_interleave(group, 1)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("asymmetric", [False, True])
def test_canonical_layout_is_compressed_tensors_pack_quantized(bits, asymmetric):
    """compressed-tensors packs signed q (with its offset) into weight_packed and the zero points along N; our
    unpacking and dequantize_packed equal its own unpack_from_int32 and dequantize."""
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32, unpack_from_int32
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.forward import dequantize

    from surge.kernels.int_packing import unpack_ct_zero_point

    n, k, group = 24, 256, 64
    u, scale, zero = _random_int_weight(n, k, bits, group, torch.bfloat16, asymmetric=asymmetric)
    offset = 1 << (bits - 1)
    q = (u.to(torch.int16) - offset).to(torch.int8)
    packed = pack_to_int32(q, bits)
    assert packed.shape == (n, k * bits // 32)
    assert torch.equal(ref.unpack_int32(packed, bits, k), u)
    assert torch.equal(ref.pack_int32(u, bits), packed)
    assert torch.equal(unpack_from_int32(ref.pack_int32(u, bits), bits, q.shape), q)
    zp_signed = None
    if asymmetric:
        zp_signed = (zero.to(torch.int16) - offset).to(torch.int8)
        packed_zero = pack_to_int32(zp_signed, bits, packed_dim=0)
        assert packed_zero.shape == (-(-n * bits // 32), k // group)
        assert torch.equal(unpack_ct_zero_point(packed_zero, bits, n), zero)
    args = QuantizationArgs(num_bits=bits, type="int", strategy="group", group_size=group, symmetric=not asymmetric)
    expected = dequantize(q, scale, zp_signed, args, dtype=torch.bfloat16)
    got = ref.dequantize_packed(packed, scale, bits, group, zero)
    assert torch.equal(got, expected)
    assert torch.equal(got, _expected_weight(u, scale, zero, bits, group))


def _pack_awq(u_kn):
    """AutoAWQ's packing, written out: [K, N] 4-bit -> int32 [K, N / 8], column 8c + order[i] at nibble i."""
    order = [0, 2, 4, 6, 1, 3, 5, 7]
    rows, cols = u_kn.shape
    words = torch.zeros(rows, cols // 8, dtype=torch.int64)
    for c in range(cols // 8):
        for i in range(8):
            words[:, c] |= u_kn[:, 8 * c + order[i]].long() << (4 * i)
    return torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32)


def _pack_sequential(u, dim, bits=4):
    """GPTQ's packing along dim: value j of the packed dim at bits (j % p) * bits of word j // p."""
    p = 32 // bits
    u = u.long().movedim(dim, 0)
    words = torch.zeros(u.shape[0] // p, *u.shape[1:], dtype=torch.int64)
    for j in range(u.shape[0]):
        words[j // p] |= u[j] << ((j % p) * bits)
    words = torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32)
    return words.movedim(0, dim)


def test_awq_converts_to_the_canonical_layout():
    from surge.kernels.int_packing import awq_to_canonical

    n, k, group = 32, 256, 128
    u, scale, zero = _random_int_weight(n, k, 4, group, torch.float16, seed=1)
    qweight, qzeros = _pack_awq(u.t()), _pack_awq(zero.t())
    assert qweight.shape == (k, n // 8) and qzeros.shape == (k // group, n // 8)
    w = awq_to_canonical(qweight, qzeros, scale.t().contiguous(), group)
    assert (w.bits, w.group_size, w.input_perm) == (4, group, None)
    assert torch.equal(ref.dequantize_packed(w.weight_packed, w.weight_scale, 4, group, w.zero_point),
                       _expected_weight(u, scale, zero, 4, group))


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("act_order", [False, True])
def test_gptq_converts_to_the_canonical_layout(act_order, bits):
    """v1 zeros (stored zero - 1); act-order: g_idx a random assignment of K channels to groups, so the canonical
    weight is column-permuted and the GEMM reads x[:, perm]: x @ W.T is unchanged."""
    from surge.kernels.int_packing import gptq_to_canonical

    n, k, group = 16, 256, 64
    g = torch.Generator().manual_seed(2)
    u, scale, zero = _random_int_weight(n, k, bits, group, torch.float16, seed=2)
    zero = zero.clamp(1, (1 << bits) - 1)  # v1 stores zero - 1 in the field
    g_idx = torch.arange(k) // group
    if act_order:
        g_idx = g_idx[torch.randperm(k, generator=g)]
    # Meaning of the checkpoint: column k of W belongs to group g_idx[k].
    w_expected = (u.long() - zero.long()[:, g_idx]).to(torch.float16) * scale[:, g_idx]
    qweight = _pack_sequential(u.t(), 0, bits)  # [K * bits / 32, N]
    qzeros = _pack_sequential((zero.t().long() - 1), 1, bits)  # [K / group, N * bits / 32]
    w = gptq_to_canonical(qweight, qzeros, scale.t().contiguous(), g_idx.int(), bits, group)
    assert (w.input_perm is not None) == act_order
    canonical = ref.dequantize_packed(w.weight_packed, w.weight_scale, bits, group, w.zero_point)
    if act_order:
        assert torch.equal(canonical, w_expected[:, w.input_perm.long()])
    else:
        assert torch.equal(canonical, w_expected)
    x = torch.randn(3, k, generator=g)  # float32: the product (u - z) * s is rounded to float32 on both sides
    w_float = (u.long() - zero.long()[:, g_idx]).float() * scale[:, g_idx].float()
    torch.testing.assert_close(ref.int_gemm(x, w.weight_packed, w.weight_scale, bits, group, w.zero_point,
                                            w.input_perm), x @ w_float.t(), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="g_idx"):
        gptq_to_canonical(qweight, qzeros, scale.t().contiguous(), torch.zeros(k, dtype=torch.int32), bits, group)


def _gemm_case(m, n, k, bits, group, dtype, asymmetric, seed=0):
    u, scale, zero = _random_int_weight(n, k, bits, group, dtype, seed=seed, asymmetric=asymmetric)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(seed + 1)).to(dtype)
    return x, ref.pack_int32(u, bits), scale, zero


def _check(got, expected, dtype):
    # Same dequantized weight; float32 sums in another order, one rounding (bf16: 2^-8 relative).
    tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}[dtype]
    torch.testing.assert_close(got.float(), expected.float(), rtol=tol, atol=tol)


# (M, N, K, bits, group, asymmetric): decode M = 1 with group 128 (K split in 2, then not split), the split-K path at
# its last row (32) and the tiled path at the first past it (33); channel-wise with K not a multiple of the tile;
# groups of 32 and 64; 8 bits.
CASES = [(1, 32, 1024, 4, 128, True), (1, 64, 256, 4, 128, False), (32, 40, 512, 4, 128, True),
         (33, 40, 512, 4, 128, True),
         (5, 72, 200, 4, 200, False), (70, 48, 128, 4, 32, True), (3, 64, 256, 8, 64, True), (2, 16, 96, 8, 96, False)]


@pytest.mark.parametrize("case", CASES, ids=[f"M{c[0]}-N{c[1]}-K{c[2]}-b{c[3]}-g{c[4]}-z{int(c[5])}" for c in CASES])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_int_gemm_equals_dequantized_linear(case, dtype, device, request):
    from surge.kernels.int4_gemm import int_gemm

    if dtype == torch.bfloat16:
        request.getfixturevalue("require_bf16_dot")
    m, n, k, bits, group, asymmetric = case
    x, packed, scale, zero = _gemm_case(m, n, k, bits, group, dtype, asymmetric)
    weight = ref.dequantize_packed(packed, scale, bits, group, zero)  # rounded to x's dtype, as the kernel's tiles
    expected = x.float() @ weight.float().t()
    got = int_gemm(x.to(device), packed.to(device), scale.to(device), bits=bits, group_size=group,
                   zero_point=None if zero is None else zero.to(device))
    assert got.dtype == dtype and got.shape == (m, n)
    if case == CASES[0]:
        from surge.kernels.int4_gemm import launch_policy
        assert launch_policy(m, n, k, group).split_k == 2
    _check(got.cpu(), expected, dtype)


def test_forced_geometries_bias_perm_and_leading_dims(device):
    """Every split count (1, 2, 4, and one leaving the last split short), a bias through either path, act-order's
    column gather, and x with leading dimensions."""
    from surge.kernels.int4_gemm import IntGemmLaunch, int_gemm

    m, n, k, group = 3, 40, 384, 64
    x, packed, scale, zero = _gemm_case(m, n, k, 4, group, torch.float32, True, seed=5)
    bias = torch.randn(n)
    perm = torch.randperm(k, generator=torch.Generator().manual_seed(6)).int()
    expected = ref.int_gemm(x, packed, scale, 4, group, zero, perm, bias)
    args = [t.to(device) for t in (x, packed, scale)]
    options = dict(bits=4, group_size=group, zero_point=zero.to(device), input_perm=perm.to(device),
                   bias=bias.to(device))
    for split in (1, 2, 4, 5):  # 6 K tiles of 64: 5 splits of 2 tiles make 3 splits (no empty split)
        launch = IntGemmLaunch(16, 16, 64, split, 4, 2)
        _check(int_gemm(*args, **options, launch=launch).cpu(), expected, torch.float32)
    got = int_gemm(args[0].view(1, m, k), *args[1:], **options)
    assert got.shape == (1, m, n)
    _check(got.view(m, n).cpu(), expected, torch.float32)


def test_bad_arguments_name_themselves(device):
    from surge.kernels.int4_gemm import int_gemm

    x, packed, scale, _ = _gemm_case(2, 16, 128, 4, 64, torch.float32, False)
    with pytest.raises(ValueError, match="bits=3"):
        int_gemm(x, packed, scale, bits=3, group_size=64)
    with pytest.raises(ValueError, match="weight_scale"):
        int_gemm(x, packed, scale, bits=4, group_size=32)
    with pytest.raises(ValueError, match="weight_packed"):
        int_gemm(x[:, :64], packed, scale, bits=4, group_size=64)


def test_launch_policy_boundaries():
    from surge.kernels.int4_gemm import MAX_SPLIT_K, SPLIT_K_MAX_M, launch_policy

    # Qwen3-8B's o_proj at decode: 64 tiles of 64 columns, 32 K tiles of 128: split 8 (4 x 64 < 2 * 132 programs).
    decode = launch_policy(1, 4096, 4096, 128)
    assert (decode.block_m, decode.block_n, decode.block_k, decode.split_k) == (16, 64, 128, 8)
    assert launch_policy(SPLIT_K_MAX_M, 4096, 4096, 128).split_k == 8
    assert launch_policy(16, 4096, 4096, 128).block_m == 16 and launch_policy(17, 4096, 4096, 128).block_m == 32
    prefill = launch_policy(SPLIT_K_MAX_M + 1, 4096, 4096, 128)
    assert (prefill.block_m, prefill.block_n, prefill.block_k, prefill.split_k) == (64, 128, 64, 1)
    assert launch_policy(128, 4096, 4096, 128).block_m == 64 and launch_policy(129, 4096, 4096, 128).block_m == 128
    # Split stops at ~2 waves, at 4 K tiles per split and at MAX_SPLIT_K.
    assert launch_policy(1, 24576, 4096, 128).split_k == 1  # 384 column tiles already
    assert launch_policy(1, 64, 512, 128).split_k == 1 and launch_policy(1, 64, 1024, 128).split_k == 2
    assert launch_policy(1, 64, 1920, 1920).split_k == 2 and launch_policy(1, 64, 2048, 128).split_k == 4
    assert launch_policy(1, 64, 1 << 20, 128).split_k == MAX_SPLIT_K
    # The K tile divides the group: 32 -> 32; channel-wise (group = K) any K; a group no multiple of 16 is refused.
    assert launch_policy(1, 64, 4096, 32).block_k == 32 and launch_policy(1, 64, 200, 200).block_k == 128
    assert launch_policy(64, 64, 4096, 128).block_k == 64 and launch_policy(1, 64, 4096, 96).block_k == 32
    with pytest.raises(ValueError, match="group_size=40"):
        launch_policy(1, 64, 4096, 40)


@pytest.mark.parametrize("fmt", ["awq", "gptq-act-order"])
def test_awq_gptq_layers_feed_the_int_gemm(fmt, device):
    """The AWQ / GPTQ linear methods convert checkpoint tensors as they load into what the kernels read: on a loaded
    layer's parameters (qweight, scales, qzeros, g_idx's permutation) int_gemm and the decode GEMV compute x @ W.T, as
    the layer's CPU path does. The GPTQ qweight arrives before its g_idx, and waits for it. The layer lives on the
    kernels' device (CUDA when there is one) and the checkpoint's tensors arrive on the CPU, as the loader reads
    them: the conversion mixes the two (act-order's permutation, derived from the layer's g_idx)."""
    from surge.kernels.int4_gemm import int_gemm
    from surge.kernels.int_gemv import int_gemv
    from surge.model.layers.linear import Linear, deferred_weights
    from surge.model.quant.awq import AWQLinearMethod
    from surge.model.quant.gptq import GPTQLinearMethod

    n, k, group = 32, 128, 32
    g = torch.Generator().manual_seed(3)
    u, scale, zero = _random_int_weight(n, k, 4, group, torch.float32, seed=3)
    g_idx = torch.arange(k) // group
    if fmt == "awq":
        method = AWQLinearMethod(bits=4, group_size=group, symmetric=False)
        tensors = {"qweight": _pack_awq(u.t()), "qzeros": _pack_awq(zero.t()), "scales": scale.t().contiguous()}
    else:
        zero = zero.clamp(1, 15)  # v1 stores zero - 1
        g_idx = g_idx[torch.randperm(k, generator=g)]
        method = GPTQLinearMethod(bits=4, group_size=group, symmetric=False, act_order=True)
        tensors = {"qweight": _pack_sequential(u.t(), 0, 4), "qzeros": _pack_sequential(zero.t().long() - 1, 1, 4),
                   "scales": scale.t().contiguous(), "g_idx": g_idx.int()}
    with deferred_weights():
        layer = Linear(k, n)
    layer.set_method(method, device)
    for name, t in tensors.items():
        getattr(layer, name).weight_loader(getattr(layer, name), t)
    assert all(p.device.type == device.type for p in layer.parameters())
    w = (u.long() - zero.long()[:, g_idx]).float() * scale[:, g_idx]
    x = torch.randn(5, k, generator=g)
    want = x @ w.t()
    # the dequantized path (what the CPU runs), on the layer's own parameters
    torch.testing.assert_close(method.dense_weight(layer).cpu().float(), w, rtol=0, atol=0)
    x = x.to(device)
    torch.testing.assert_close(layer(x).cpu(), want, rtol=1e-5, atol=1e-5)
    got = int_gemm(x, layer.qweight, layer.scales, bits=4, group_size=group, zero_point=layer.qzeros,
                   input_perm=method._input_perm(layer))
    torch.testing.assert_close(got.cpu(), want, rtol=1e-5, atol=1e-5)
    for rows in (1, 4):  # the decode GEMV (surge/kernels/int_gemv.py) reads the same parameters
        got = int_gemv(x[:rows], layer.qweight, layer.scales, bits=4, group_size=group, zero_point=layer.qzeros,
                       input_perm=method._input_perm(layer))
        torch.testing.assert_close(got.cpu(), want[:rows], rtol=1e-5, atol=1e-5)
