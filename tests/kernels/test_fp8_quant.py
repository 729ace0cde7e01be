"""fp8 activation quantization kernels: bit for bit the torch definitions of surge/kernels/quant_reference.py (q's
bytes and the float32 scales), per token, per tensor and per 1 x group, at the launch policies' step boundaries;
and the reference itself against the plain meaning (x ~= q * scale within e4m3's half ulp, 2^-4 relative)."""
from __future__ import annotations

import pytest
import torch

from surge.kernels import quant_reference as ref

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _x(m, k, dtype, device, seed=0, spread=True):
    """Rows of very different magnitudes (spread), so per-row and per-group scales differ."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g)
    if spread:
        x = x * torch.logspace(-3, 3, m)[:, None] * torch.logspace(-1, 1, k)[None, :]
    return x.to(device=device, dtype=dtype)


def _assert_same_fp8(got, expected):
    assert got.dtype == torch.float8_e4m3fn and got.shape == expected.shape
    assert torch.equal(got.cpu().view(torch.uint8), expected.cpu().view(torch.uint8))


def test_reference_round_trips_within_half_an_ulp():
    x = _x(6, 300, torch.float32, "cpu")
    for q, scale in (ref.fp8_quant_per_token(x), ref.fp8_quant_per_tensor(x)):
        back = q.float() * scale
        assert ((back - x).abs() <= 2 ** -4 * x.abs() + scale * 2 ** -9 + 1e-30).all()  # incl. e4m3 subnormals
    q, scale = ref.fp8_quant_per_token_group(x, 128)
    assert scale.shape == (6, 3) and scale.stride() == (1, 6)
    back = ref.dequantize_fp8(q, scale, block=(1, 128))
    assert ((back - x).abs() <= 2 ** -4 * x.abs() + scale.repeat_interleave(128, 1)[:, :300] * 2 ** -9).all()
    assert (q.float().abs().amax(1) == 448).all()  # each row's amax lands on the largest e4m3 value


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mk", [(1, 64), (5, 100), (3, 4097)], ids=["M1-K64", "M5-K100", "M3-K4097"])
def test_per_token_equals_reference(mk, dtype, device):
    from surge.kernels.fp8_quant import scaled_fp8_quant_per_token

    x = _x(*mk, dtype, device)
    q, scale = scaled_fp8_quant_per_token(x)
    expected_q, expected_scale = ref.fp8_quant_per_token(x.cpu())
    assert scale.shape == (mk[0], 1) and scale.dtype == torch.float32
    assert torch.equal(scale.cpu(), expected_scale)
    _assert_same_fp8(q, expected_q)


def test_per_token_multi_step_rows_zero_rows_and_strided_rows(device):
    """A row longer than the step (forced 16 columns: 7 steps, the last partial), a row of zeros (the scale floor),
    rows of a wider tensor (a stride past K)."""
    from surge.kernels.fp8_quant import QuantLaunch, scaled_fp8_quant_per_token

    wide = _x(4, 160, torch.bfloat16, device, seed=1)
    x = wide[:, :100]
    x[2] = 0
    expected_q, expected_scale = ref.fp8_quant_per_token(x.cpu())
    assert expected_scale[2].item() == torch.tensor(ref.FP8_MIN_SCALE).item()  # as float32
    for launch in (None, QuantLaunch(16, 1)):
        q, scale = scaled_fp8_quant_per_token(x, launch)
        assert torch.equal(scale.cpu(), expected_scale)
        _assert_same_fp8(q, expected_q)


def test_per_tensor_static_saturates_and_dynamic_equals_reference(device):
    from surge.kernels.fp8_quant import scaled_fp8_quant_per_tensor

    x = _x(7, 150, torch.bfloat16, device, seed=2)
    static = torch.tensor([0.05])  # far below amax / 448: a fifth of the values saturate to +-448
    q, scale = scaled_fp8_quant_per_tensor(x, static.to(device))
    expected_q, _ = ref.fp8_quant_per_tensor(x.cpu(), static)
    _assert_same_fp8(q, expected_q)
    assert scale.item() == static.item() and (q.float().abs() == 448).float().mean() > 0.2
    q, scale = scaled_fp8_quant_per_tensor(x)
    expected_q, expected_scale = ref.fp8_quant_per_tensor(x.cpu())
    assert torch.equal(scale.cpu(), expected_scale)
    _assert_same_fp8(q, expected_q)
    with pytest.raises(ValueError, match="one element"):
        scaled_fp8_quant_per_tensor(x, torch.ones(2, device=device))


# (M, K, group): one group; a partial last group; 16 groups of 128 (one program), 17 (two, the second partial);
# groups of 64.
GROUPS = [(1, 128, 128), (5, 200, 128), (2, 2048, 128), (3, 2176, 128), (4, 192, 64)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", GROUPS, ids=[f"M{m}-K{k}-g{g}" for m, k, g in GROUPS])
def test_per_token_group_equals_reference(case, dtype, device):
    from surge.kernels.fp8_quant import per_token_group_quant_fp8

    m, k, group = case
    x = _x(m, k, dtype, device, seed=k)
    q, scale = per_token_group_quant_fp8(x, group)
    expected_q, expected_scale = ref.fp8_quant_per_token_group(x.cpu(), group)
    assert scale.shape == (m, -(-k // group)) and scale.stride() == (1, m)  # M-major, as _scaled_mm wants
    assert torch.equal(scale.cpu(), expected_scale)
    _assert_same_fp8(q, expected_q)


def test_per_token_group_forced_geometry(device):
    """One group per program (many programs), and more groups per program than the row has."""
    from surge.kernels.fp8_quant import QuantLaunch, per_token_group_quant_fp8

    x = _x(3, 300, torch.bfloat16, device, seed=4)
    expected_q, expected_scale = ref.fp8_quant_per_token_group(x.cpu(), 64)
    for launch in (QuantLaunch(1, 1), QuantLaunch(8, 2)):
        q, scale = per_token_group_quant_fp8(x, 64, launch)
        assert torch.equal(scale.cpu(), expected_scale)
        _assert_same_fp8(q, expected_q)
    with pytest.raises(ValueError, match="group_size=96"):
        per_token_group_quant_fp8(x, 96)


def test_launch_policies():
    from surge.kernels.fp8_quant import MAX_ROW_BLOCK, per_group_launch, per_token_launch

    assert per_token_launch(1).block == 16 and per_token_launch(100).block == 128
    assert per_token_launch(MAX_ROW_BLOCK) == per_token_launch(MAX_ROW_BLOCK + 1)  # then two steps per row
    assert per_token_launch(4096).num_warps == 8 and per_token_launch(512).num_warps == 1
    assert per_group_launch(2048, 128).block == 16 and per_group_launch(2176, 128).block == 16  # 2 programs
    assert per_group_launch(200, 128).block == 2 and per_group_launch(128, 128).block == 1
    assert per_group_launch(4096, 64).block == 32


# (hidden, group_size): per token on a padded row; groups of 64 with a partial last group; two groups of 128.
NORMS = [(100, None), (200, 64), (256, 128)]


def _x_exact_squares(m, k, dtype, device, seed):
    """Rows whose sum of squares float32 adds exactly in any order, spread as _x's: integers in [-16, 16] / 8 times
    a power of two per row (2^-6 .. 2^6) and per third of the columns (2^-1, 1, 2). The sum of two such tensors
    (x + residual) is one with integers in [-32, 32]: every partial sum of squares is a multiple of one power of two
    below 2^22 times it, within float32's 24 bits."""
    g = torch.Generator().manual_seed(seed)
    ints = torch.randint(-16, 17, (m, k), generator=g).float()
    rows = 2.0 ** torch.linspace(-6, 6, m).round()
    cols = 2.0 ** (torch.arange(k) * 3 // k - 1).float()
    return (ints / 8 * rows[:, None] * cols[None, :]).to(device=device, dtype=dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden,group", NORMS, ids=[f"H{h}-g{g}" for h, g in NORMS])
def test_rms_norm_fp8_equals_norm_then_quant(hidden, group, dtype, device):
    """The fused norm + quantization is bit for bit the norm kernel followed by the quantization kernel (each tested
    against torch on its own); with the residual add too (its sum as fused_add_rms_norm's).

    On rows whose sum of squares is exact in any order. The compiler lays the row out after its stores: the fused
    kernel's fp8 store gives each thread 8 contiguous values, rms_norm's float32 store 4 (Triton 3.7's sm_90 TTGIR;
    the H200 run under 3.6 differed for float32 at H256-g128), so their row sums add in different orders and rstd
    may differ in its last bit (either is a correct float32 sum): bit equality holds only where the order cannot
    matter. Under the interpreter both sum alike, any rows."""
    from surge.kernels.fp8_quant import per_token_group_quant_fp8, scaled_fp8_quant_per_token
    from surge.kernels.norm import fused_add_rms_norm, fused_add_rms_norm_fp8, rms_norm, rms_norm_fp8

    x = _x_exact_squares(5, hidden, dtype, device, seed=hidden)
    residual = _x_exact_squares(5, hidden, dtype, device, seed=hidden + 1)
    weight = torch.randn(hidden, generator=torch.Generator().manual_seed(3)).to(device, dtype)

    def quant(t):
        return scaled_fp8_quant_per_token(t) if group is None else per_token_group_quant_fp8(t, group)

    expected_q, expected_scale = quant(rms_norm(x, weight, 1e-6))
    q, scale = rms_norm_fp8(x, weight, 1e-6, group)
    assert scale.stride() == expected_scale.stride() and torch.equal(scale, expected_scale)
    _assert_same_fp8(q, expected_q)
    normed, summed = fused_add_rms_norm(x, residual, weight, 1e-6)
    expected_q, expected_scale = quant(normed)
    q, scale, residual_out = fused_add_rms_norm_fp8(x, residual, weight, 1e-6, group)
    assert torch.equal(residual_out, summed) and torch.equal(scale, expected_scale)
    _assert_same_fp8(q, expected_q)


def test_rms_norm_fp8_with_float32_weight_quantizes_the_float32_output(device):
    from surge.kernels.fp8_quant import scaled_fp8_quant_per_token
    from surge.kernels.norm import rms_norm, rms_norm_fp8

    x = _x(3, 64, torch.bfloat16, device, seed=9)
    weight = torch.randn(64, generator=torch.Generator().manual_seed(4)).to(device)
    out = rms_norm(x, weight, 1e-6)
    assert out.dtype == torch.float32
    expected_q, expected_scale = scaled_fp8_quant_per_token(out)
    q, scale = rms_norm_fp8(x, weight, 1e-6)
    assert torch.equal(scale, expected_scale)
    _assert_same_fp8(q, expected_q)
    with pytest.raises(ValueError, match="group_size=256"):
        rms_norm_fp8(x, weight, 1e-6, 256)


def test_silu_and_mul_fp8_per_token_keeps_a_row_in_registers_up_to_the_tile_limit():
    from surge.kernels.activation import MAX_ROW_TILE, launch_policy, per_token_fp8_launch

    assert per_token_fp8_launch(12288) == per_token_fp8_launch(MAX_ROW_TILE) and \
        per_token_fp8_launch(MAX_ROW_TILE).block == MAX_ROW_TILE
    assert per_token_fp8_launch(MAX_ROW_TILE).num_warps == 16 and per_token_fp8_launch(100).num_warps == 1
    assert per_token_fp8_launch(MAX_ROW_TILE + 1) == launch_policy(MAX_ROW_TILE + 1)  # two passes of 1024


# (d, group_size, forced tile): per token in one tile (the row in registers) and in 7 steps of 16; groups of 64 over
# 5 tiles of 64 (the last partial), 4 groups of 64 per 256-column tile; groups of 128.
SILUS = [(100, None, None), (100, None, 16), (300, 64, 64), (300, 64, 256), (256, 128, None)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d,group,tile", SILUS, ids=[f"d{d}-g{g}-t{t}" for d, g, t in SILUS])
def test_silu_and_mul_fp8_equals_silu_then_quant(d, group, tile, dtype, device):
    from surge.kernels.activation import ActivationLaunch, silu_and_mul, silu_and_mul_fp8
    from surge.kernels.fp8_quant import per_token_group_quant_fp8, scaled_fp8_quant_per_token

    x = _x(4, 2 * d, dtype, device, seed=d, spread=False) * torch.tensor([[0.01], [1.0], [4.0], [30.0]], device=device,
                                                                      dtype=dtype)  # rows of other magnitudes
    x[3, :d], x[3, d:] = x[3, :d].abs(), -x[3, d:].abs()  # a row of products <= 0: its amax is a negative value's
    product = silu_and_mul(x)
    assert product.isfinite().all()
    expected_q, expected_scale = (scaled_fp8_quant_per_token(product) if group is None
                                  else per_token_group_quant_fp8(product, group))
    q, scale = silu_and_mul_fp8(x, group, None if tile is None else ActivationLaunch(tile, 1))
    assert scale.stride() == expected_scale.stride() and torch.equal(scale, expected_scale)
    _assert_same_fp8(q, expected_q)
