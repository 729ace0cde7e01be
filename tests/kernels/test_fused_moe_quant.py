"""Quantized fused MoE variants against the torch reference of the fused MoE run on the dequantized weights, its
activations quantized and dequantized as the kernels quantize them: fp8 with 128 x 128 (and smaller) weight blocks
and 1 x bk dynamic activation groups (partial blocks included), fp8 with per-channel or per-tensor weight scales and per-token or
static activation scales, and MXFP4 experts (gpt-oss: biases, clamped SwiGLU) whose dequantization is checked against
transformers' own."""
from __future__ import annotations

import pytest
import torch

from surge.kernels import quant_reference as qref
from surge.kernels.reference import fused_moe as reference

BF16 = torch.bfloat16


def _routing(num_tokens, num_experts, top_k, seed, remote=1):
    g = torch.Generator().manual_seed(seed)
    scores = torch.rand(num_tokens, num_experts + remote, generator=g)
    weights, ids = scores.softmax(-1).topk(top_k, dim=-1)
    return weights, torch.where(ids < num_experts, ids, -1)


def _quantize_blocks(w, block=(128, 128)):
    """w [E, R, C] -> (fp8, float32 scales [E, ceil(R / bn), ceil(C / bk)]): block amax / 448, as the
    checkpoints' weight_scale_inv (and HF's Fp8Quantize) are made."""
    e, r, c = w.shape
    bn, bk = block
    rb, cb = -(-r // bn), -(-c // bk)
    padded = torch.nn.functional.pad(w, (0, cb * bk - c, 0, rb * bn - r)).view(e, rb, bn, cb, bk)
    scale = padded.abs().amax(dim=(2, 4)) / qref.FP8_MAX
    scale = torch.where(scale > 0, scale, 1.0)
    expanded = scale.repeat_interleave(bn, 1).repeat_interleave(bk, 2)[:, :r, :c]
    return (w / expanded).clamp(-qref.FP8_MAX, qref.FP8_MAX).to(torch.float8_e4m3fn), scale


def _check(got, expected):
    """bf16 tolerance: each pair's weighted row is rounded to bf16 before the combine (the reference keeps float32),
    and fp8 codes flip where float32 sums in another order cross a rounding boundary. Measured: the worst element
    uses at most 30% of it (MXFP4), about 10% (fp8)."""
    assert got.dtype == BF16
    torch.testing.assert_close(got.float().cpu(), expected.float(), atol=2e-2, rtol=2e-2)


def _launches(shape):
    from surge.kernels.fused_moe import GemmTiles, MoeLaunch, launch_policy

    num_tokens, num_experts, top_k, hidden, inter = shape
    return [launch_policy(num_tokens, top_k, num_experts, hidden, inter),
            MoeLaunch(16, GemmTiles(32, 64, 4, 2), GemmTiles(64, 32, 4, 2), combine_block=64)]


@pytest.mark.parametrize("inter, block", [(128, (128, 128)), (192, (128, 128)), (96, (32, 32)), (96, (48, 32))],
                         ids=["I128", "I192-partial-block", "I96-block32", "I96-block48x32"])
def test_fp8_block_equals_dequantized_reference(inter, block, device):
    """gate and up quantized apart (their block rows stacked, as two checkpoint tensors), I = 192 leaves a half
    block in each and a partial K group in down; H = 256 two K groups in gate|up. Smaller blocks (a tiny checkpoint's
    32 x 32, rows and columns apart) narrow the K tiles to the block's columns; 48-row blocks end mid-tile in N."""
    from surge.kernels.fused_moe import MoeQuant, fused_moe

    shape = (9, 4, 2, 256, inter)
    num_tokens, num_experts, top_k, hidden, _ = shape
    g = torch.Generator().manual_seed(inter)
    x = torch.randn(num_tokens, hidden, generator=g).to(BF16)
    gate = torch.randn(num_experts, inter, hidden, generator=g) / hidden ** 0.5
    up = torch.randn(num_experts, inter, hidden, generator=g) / hidden ** 0.5
    down = torch.randn(num_experts, hidden, inter, generator=g) / inter ** 0.5
    (gate_q, gate_s), (up_q, up_s), (down_q, down_s) = (_quantize_blocks(w, block) for w in (gate, up, down))
    gate_up_q, gate_up_s = torch.cat((gate_q, up_q), 1), torch.cat((gate_s, up_s), 1)
    gate_up_deq = torch.cat((qref.dequantize_fp8(gate_q, gate_s, block), qref.dequantize_fp8(up_q, up_s, block)), 1)
    down_deq = qref.dequantize_fp8(down_q, down_s, block)
    weights, ids = _routing(num_tokens, num_experts, top_k, seed=inter)

    def act_quant(rows, _):  # the kernel stores the activation in bf16, then quantizes it (1 x bk groups)
        return qref.fp8_fake_quant(rows.to(BF16), "group", None, block[1])

    expected = reference(x.float(), gate_up_deq, down_deq, weights, ids, activation_quant=act_quant)
    quant = MoeQuant("fp8_block", gate_up_s.to(device), down_s.to(device), block=block)
    for launch in _launches(shape):
        got = fused_moe(x.to(device), gate_up_q.to(device), down_q.to(device), weights.to(BF16).to(device),
                        ids.to(device), launch=launch, quant=quant)
        _check(got, expected)
    # Without the activation quantization the reference differs by far more than the tolerance: the test sees it.
    plain = reference(x.float(), gate_up_deq, down_deq, weights, ids)
    assert (plain - expected).abs().max() > 4 * (got.float().cpu() - expected).abs().max()


@pytest.mark.parametrize("static", [False, True], ids=["dynamic-per-token", "static-per-tensor"])
def test_fp8_channel_equals_dequantized_reference(static, device):
    """Per-channel gate|up scales [E, 2I], a per-tensor down scale [E, 1]; activations per token, or static scales
    (one per GEMM) that saturate some values."""
    from surge.kernels.fused_moe import MoeQuant, fused_moe

    shape = (13, 4, 2, 64, 48)
    num_tokens, num_experts, top_k, hidden, inter = shape
    g = torch.Generator().manual_seed(7)
    x = torch.randn(num_tokens, hidden, generator=g).to(BF16)
    gate_up = torch.randn(num_experts, 2 * inter, hidden, generator=g) / hidden ** 0.5
    down = torch.randn(num_experts, hidden, inter, generator=g) / inter ** 0.5
    gate_up_s = gate_up.abs().amax(-1) / qref.FP8_MAX  # [E, 2I]
    down_s = down.abs().amax(dim=(1, 2))[:, None] / qref.FP8_MAX  # [E, 1]
    gate_up_q = (gate_up / gate_up_s[..., None]).to(torch.float8_e4m3fn)
    down_q = (down / down_s[..., None]).clamp(-448, 448).to(torch.float8_e4m3fn)
    weights, ids = _routing(num_tokens, num_experts, top_k, seed=8)
    input_scales = {"gate_up": torch.tensor([2.5 / 448]), "down": torch.tensor([0.3 / 448])} if static else {}

    def act_quant(rows, which):
        return qref.fp8_fake_quant(rows.to(BF16), "token", input_scales.get(which))

    expected = reference(x.float(), gate_up_q.float() * gate_up_s[..., None], down_q.float() * down_s[..., None],
                         weights, ids, activation_quant=act_quant)
    quant = MoeQuant("fp8_channel", gate_up_s.to(device), down_s.to(device),
                     *(input_scales[w].to(device) for w in ("gate_up", "down") if static))
    for launch in _launches(shape):
        got = fused_moe(x.to(device), gate_up_q.to(device), down_q.to(device), weights.to(BF16).to(device),
                        ids.to(device), launch=launch, quant=quant)
        _check(got, expected)
    if static:  # the static scales clip: some inputs of each GEMM saturate
        assert (x.float().abs() > 2.5).any()


def _random_mxfp4(num_experts, rows, cols, g):
    """Random codes; scales 2^-8 .. 2^-3, so that |w| <= 0.75 and the projections stay O(1)."""
    blocks = torch.randint(0, 256, (num_experts, rows, cols // 32, 16), generator=g, dtype=torch.uint8)
    scales = torch.randint(119, 125, (num_experts, rows, cols // 32), generator=g, dtype=torch.uint8)
    return blocks, scales


def test_mxfp4_dequantization_equals_transformers():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    blocks, scales = _random_mxfp4(3, 8, 64, torch.Generator().manual_seed(0))
    scales[1] = torch.randint(100, 160, scales[1].shape, generator=torch.Generator().manual_seed(1))  # wide range
    blocks[0, 0, 0, 0], scales[0, 0, 0] = 0x8F, 127  # codes 15 (-6) then 8 (-0)
    theirs = convert_moe_packed_tensors(blocks, scales, dtype=BF16).transpose(1, 2)  # HF keeps [E, K, N]
    ours = qref.dequantize_mxfp4(blocks, scales, BF16)
    assert ours.shape == (3, 8, 64) and torch.equal(ours, theirs)
    assert ours[0, 0, :2].tolist() == [-6.0, -0.0]


def test_mxfp4_experts_equal_dequantized_reference(device, require_bf16_dot):
    """gpt-oss's experts: MXFP4 weights, biases, the clamped SwiGLU, an expert held elsewhere; gate and up rows
    interleaved in the checkpoint, deinterleaved once."""
    from surge.kernels.fused_moe import MoeQuant, deinterleave_gate_up, fused_moe

    shape = (11, 4, 2, 64, 96)
    num_tokens, num_experts, top_k, hidden, inter = shape
    g = torch.Generator().manual_seed(3)
    x = torch.randn(num_tokens, hidden, generator=g).to(BF16)
    gate_up_blocks, gate_up_scales = _random_mxfp4(num_experts, 2 * inter, hidden, g)  # interleaved rows
    down_blocks, down_scales = _random_mxfp4(num_experts, hidden, inter, g)
    gate_up_bias = torch.randn(num_experts, 2 * inter, generator=g)
    down_bias = torch.randn(num_experts, hidden, generator=g)
    weights, ids = _routing(num_tokens, num_experts, top_k, seed=4)
    options = dict(activation="swiglu_oai", swiglu_alpha=1.702, swiglu_limit=7.0)

    interleaved = qref.dequantize_mxfp4(gate_up_blocks, gate_up_scales, BF16)
    gate_up = torch.cat((interleaved[:, 0::2], interleaved[:, 1::2]), 1)  # HF: gate = [..., ::2], up = [..., 1::2]
    bias = torch.cat((gate_up_bias[:, 0::2], gate_up_bias[:, 1::2]), 1)
    def bf16_activation(rows, which):  # the kernel stores the activation in bf16
        return rows.to(BF16).float() if which == "down" else rows

    expected = reference(x.float(), gate_up.float(), qref.dequantize_mxfp4(down_blocks, down_scales).float(),
                         weights, ids, gate_up_bias=bias.to(BF16).float(), down_bias=down_bias.to(BF16).float(),
                         activation_quant=bf16_activation, **options)
    assert expected.abs().mean() > 0.3  # outputs of a size the tolerance means something for
    quant = MoeQuant("mxfp4", deinterleave_gate_up(gate_up_scales).to(device), down_scales.to(device))
    for launch in _launches(shape):
        got = fused_moe(x.to(device), deinterleave_gate_up(gate_up_blocks).to(device), down_blocks.to(device),
                        weights.to(BF16).to(device), ids.to(device), launch=launch, quant=quant,
                        gate_up_bias=deinterleave_gate_up(gate_up_bias).to(BF16).to(device),
                        down_bias=down_bias.to(BF16).to(device), **options)
        _check(got, expected)


def test_quantized_arguments_are_checked(device):
    from surge.kernels.fused_moe import MoeQuant, fused_moe

    x = torch.randn(2, 256, dtype=BF16, device=device)
    weights, ids = _routing(2, 2, 1, seed=0, remote=0)
    gate_up = torch.zeros(2, 256, 256, device=device).to(torch.float8_e4m3fn)
    down = torch.zeros(2, 256, 128, device=device).to(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="'int3'"):
        MoeQuant("int3", x, x)
    bad = MoeQuant("fp8_block", torch.ones(2, 1, 2, device=device), torch.ones(2, 2, 1, device=device))
    with pytest.raises(ValueError, match="gate_up_scale of shape"):
        fused_moe(x, gate_up, down, weights.to(device), ids.to(device), quant=bad)
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        fused_moe(x, gate_up.to(BF16), down.to(BF16), weights.to(device), ids.to(device), quant=bad)


@pytest.mark.parametrize("method", ["fp8-block32", "mxfp4"])
def test_moe_methods_kernel_path_equals_cpu_path_in_float32(method, device):
    """The MoE methods' CUDA path (apply_kernels; without CUDA on CPU tensors, the kernels interpreted) in float32,
    as the parity tests run on the H200, against their CPU path on the same layer: fp8 experts in a tiny
    checkpoint's 32 x 32 blocks take the kernels' fp8_block variant (K tiles narrowed to 32); mxfp4 experts, whose
    variant takes bf16 only, the unquantized kernels on the dequantized experts."""
    from surge.model.layers.linear import deferred_weights
    from surge.model.layers.moe import FusedMoE
    from surge.model.quant.fp8_moe import Fp8MoEMethod
    from surge.model.quant.mxfp4 import Mxfp4MoEMethod

    num_tokens, num_experts, top_k, hidden, inter = 7, 4, 2, 64, 64
    if method == "mxfp4":
        moe = Mxfp4MoEMethod()
    else:
        moe = Fp8MoEMethod(weights="block", block=(32, 32), scale_name="weight_scale_inv")
    with deferred_weights():
        layer = FusedMoE(num_experts, hidden, inter)
    layer.set_method(moe, torch.device("cpu"))
    moe.init_dummy(layer, torch.Generator().manual_seed(0))
    g = torch.Generator().manual_seed(1)
    x = torch.randn(num_tokens, hidden, generator=g)
    weights, ids = _routing(num_tokens, num_experts, top_k, seed=2, remote=0)
    want = moe.apply(layer, x, weights, ids)  # the CPU path: the reference loop on the dequantized experts
    scale = want.abs().max().item()  # small: the dummy experts are normal(0, 0.02)
    assert scale > 0
    layer.to(device)
    got = moe.apply_kernels(layer, x.to(device), weights.to(device), ids.to(device)).cpu()
    assert got.dtype == torch.float32
    # float32 sums in another order; fp8: the activations quantized alike on both paths (a code flips only where
    # such a sum crosses a rounding boundary: none at this size, measured)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * scale)
