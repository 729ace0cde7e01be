"""The fused MoE's pair path (decode-sized batches: no alignment, down and combine fused) against the torch
reference and the grouped path, its launch policy's boundaries, and the router's uniform-weights variant (the
routing simulation)."""
from __future__ import annotations

import pytest
import torch

from surge.kernels.reference import fused_moe as reference


def _case(num_tokens, num_experts, top_k, hidden, inter, dtype, device, seed=0, remote=0):
    """Random experts and routing; `remote` experts (the highest ids) are another rank's: their ids become -1."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, hidden, generator=g)
    gate_up = torch.randn(num_experts, 2 * inter, hidden, generator=g) / hidden ** 0.5
    down = torch.randn(num_experts, hidden, inter, generator=g) / inter ** 0.5
    weights, ids = torch.rand(num_tokens, num_experts + remote, generator=g).softmax(-1).topk(top_k, dim=-1)
    ids = torch.where(ids < num_experts, ids, -1)
    return [t.to(device=device, dtype=dtype) for t in (x, gate_up, down, weights)] + [ids.to(device)]


def _check(got, expected, dtype):
    tol = {"atol": 2e-5, "rtol": 2e-5} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
    torch.testing.assert_close(got.float(), expected.float(), **tol)


@pytest.fixture
def no_alignment(monkeypatch):
    """The pair path must not align: an alignment (or a grouped GEMM) would fail the test."""
    import surge.kernels.fused_moe as fm

    def forbidden(*args, **kwargs):
        raise AssertionError("the pair path aligned the pairs")

    monkeypatch.setattr(fm, "align_to_blocks", forbidden)


def _pair_launches(num_tokens, top_k, hidden, inter):
    from surge.kernels.fused_moe import PairLaunch, PairTiles, pair_launch

    # The policy's tiles; tiles smaller than the dimensions (several K steps, partial row blocks), pipelined; one
    # warp.
    return [pair_launch(num_tokens, top_k, hidden, inter),
            PairLaunch(PairTiles(4, 16, num_stages=2), PairTiles(8, 16, num_stages=3)),
            PairLaunch(PairTiles(16, 32, num_warps=1), PairTiles(4, 64, num_warps=2))]


# (tokens, experts, top_k, hidden, intermediate): one token; K and N not multiples of any tile; top 1; top 3 (k
# padded to 4 slots); as many pairs as experts (some experts chosen twice).
SHAPES = [(1, 8, 2, 64, 32), (3, 16, 2, 48, 40), (5, 8, 1, 40, 24), (2, 8, 3, 40, 24), (4, 8, 2, 32, 56)]


@pytest.mark.parametrize("shape", SHAPES, ids=[f"T{s[0]}-E{s[1]}-k{s[2]}-H{s[3]}-I{s[4]}" for s in SHAPES])
def test_pair_path_equals_reference(shape, device, no_alignment):
    from surge.kernels.fused_moe import launch_policy, pair_experts

    num_tokens, num_experts, top_k, hidden, inter = shape
    x, gate_up, down, weights, ids = _case(*shape, torch.float32, device)
    expected = reference(x.cpu(), gate_up.cpu(), down.cpu(), weights.cpu(), ids.cpu())
    assert launch_policy(num_tokens, top_k, num_experts, hidden, inter).pairs is not None
    for launch in _pair_launches(num_tokens, top_k, hidden, inter):
        _check(pair_experts(x, gate_up, down, weights, ids, launch).cpu(), expected, torch.float32)


# (bias, activation): each alone, then both (gpt-oss's experts); DeepSeek V4's clamped SiLU.
VARIANTS = [(True, "silu"), (False, "swiglu_oai"), (True, "swiglu_oai"), (False, "silu_clamped")]


@pytest.mark.parametrize("bias,activation", VARIANTS, ids=[f"bias{int(b)}-{a}" for b, a in VARIANTS])
def test_pair_path_bias_and_activation(bias, activation, device, no_alignment):
    from surge.kernels.fused_moe import fused_moe

    x, gate_up, down, weights, ids = _case(3, 6, 2, 32, 24, torch.float32, device, seed=13, remote=1)
    g = torch.Generator().manual_seed(14)
    options = dict(activation=activation, swiglu_alpha=1.5, swiglu_limit=0.6)
    if bias:
        options.update(gate_up_bias=torch.randn(6, 48, generator=g).to(device),
                       down_bias=torch.randn(6, 32, generator=g).to(device))
    cpu = {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in options.items()}
    expected = reference(x.cpu(), gate_up.cpu(), down.cpu(), weights.cpu(), ids.cpu(), **cpu)
    _check(fused_moe(x, gate_up, down, weights, ids, **options).cpu(), expected, torch.float32)


@pytest.fixture
def garbage_memory(monkeypatch):
    """torch.empty and empty_like return NaN or -7777: a row read that no kernel wrote shows."""
    empty, empty_like = torch.empty, torch.empty_like

    def fill(t):
        return t.fill_(float("nan") if t.is_floating_point() else -7777)

    monkeypatch.setattr(torch, "empty", lambda *a, **k: fill(empty(*a, **k)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **k: fill(empty_like(*a, **k)))


def test_pair_path_skips_experts_held_elsewhere(device, garbage_memory, no_alignment):
    """Local ids of -1, or global ids with expert_offset: a token whose experts are all remote gets zeros though
    its activation rows are never written (NaN here), and NaN weights of remote slots do not leak."""
    from surge.kernels.fused_moe import fused_moe

    x, gate_up, down, weights, ids = _case(4, 8, 2, 48, 32, torch.float32, device, seed=3, remote=8)
    ids[0] = -1
    weights[0] = float("nan")
    assert (ids == -1).sum() >= 3
    expected = reference(x.cpu(), gate_up.cpu(), down.cpu(), torch.nan_to_num(weights.cpu()), ids.cpu())
    got = fused_moe(x, gate_up, down, weights, ids).cpu()
    assert torch.equal(got[0], torch.zeros_like(got[0]))
    _check(got, expected, torch.float32)
    # Rank 1 of 2 holds experts 8..15 of 16: ids 0..7 are rank 0's.
    global_ids = torch.where(ids >= 0, ids + 8, torch.randint(0, 8, ids.shape, device=device))
    assert torch.equal(fused_moe(x, gate_up, down, weights, global_ids, expert_offset=8).cpu(), got)


def test_pair_path_bf16_equals_reference(device, no_alignment):
    from surge.kernels.fused_moe import fused_moe

    x, gate_up, down, weights, ids = _case(4, 16, 4, 64, 48, torch.bfloat16, device, seed=5)
    # The reference in float32 from the same bf16 inputs: the kernels accumulate in float32 and round the
    # activation and the output once each.
    expected = reference(x.cpu().float(), gate_up.cpu().float(), down.cpu().float(), weights.cpu().float(),
                         ids.cpu())
    got = fused_moe(x, gate_up, down, weights, ids)
    assert got.dtype == torch.bfloat16
    _check(got.cpu(), expected, torch.bfloat16)


def test_pair_path_bf16_equals_grouped_path(device, require_bf16_dot):
    from surge.kernels.fused_moe import GemmTiles, MoeLaunch, fused_moe

    x, gate_up, down, weights, ids = _case(4, 16, 4, 64, 48, torch.bfloat16, device, seed=5)
    grouped = MoeLaunch(16, GemmTiles(16, 32, 4, 2), GemmTiles(32, 16, 4, 2))
    _check(fused_moe(x, gate_up, down, weights, ids).cpu(),
           fused_moe(x, gate_up, down, weights, ids, launch=grouped).cpu(), torch.bfloat16)


def test_pair_policy_boundaries():
    from surge.kernels.fused_moe import (MAX_PAIR_BLOCK_K, MAX_PAIR_BLOCK_N, MIN_PAIR_BLOCK_N, PAIR_PROGRAMS,
                                         PairTiles, launch_policy, pair_launch)

    def pairs(tokens, top_k=8, experts=128, quant="none"):
        return launch_policy(tokens, top_k, experts, 2048, 768, quant).pairs

    # Qwen3-30B-A3B: the pair path up to 16 tokens (128 pairs of 128 experts), the grouped GEMMs from 17.
    assert pairs(16) is not None and pairs(17) is None
    assert pairs(4, top_k=2, experts=8) is not None and pairs(5, top_k=2, experts=8) is None  # Mixtral
    assert pairs(1, quant="fp8_block") is None and pairs(1, quant="mxfp4") is None
    # Batch 1: gate|up's 8 pairs x 768 rows in blocks of 8 (768 programs; 16 would give 384 < PAIR_PROGRAMS),
    # down's 2048 columns in blocks of 4 (512 programs), the 8 experts' [4, 256] tiles a step; K steps of one
    # warp's width (MAX_PAIR_BLOCK_K).
    one = pairs(1)
    assert one.gate_up == PairTiles(8, MAX_PAIR_BLOCK_K) and one.down == PairTiles(4, MAX_PAIR_BLOCK_K)
    assert 8 * 768 // 8 >= PAIR_PROGRAMS > 8 * 768 // 16 and 2048 // 4 == PAIR_PROGRAMS
    assert pairs(4).gate_up == PairTiles(32, 128) and pairs(4).down == PairTiles(16, 64)
    # Down's block of rows stops where 8 experts' tiles of MIN_PAIR_BLOCK_K fill a step; gate|up's at the maximum.
    assert pairs(16).gate_up == PairTiles(MAX_PAIR_BLOCK_N, 64) and pairs(16).down == PairTiles(16, 64)
    assert pairs(16, top_k=2, experts=32).down == PairTiles(64, 64)
    # The row block doubles only while twice as wide still gives PAIR_PROGRAMS programs: N, N + 1 rows.
    assert pair_launch(1, 1, 64, 8 * 511 + 1).gate_up.block_n == 8
    assert pair_launch(1, 1, 64, 8 * 511).gate_up.block_n == 4
    # Tiny shapes: the row block never below MIN_PAIR_BLOCK_N, the K tile never past K padded (nor below 16).
    tiny = pair_launch(1, 1, 8, 3)
    assert tiny.gate_up == PairTiles(MIN_PAIR_BLOCK_N, 16) and tiny.down == PairTiles(MIN_PAIR_BLOCK_N, 16)


def test_uniform_weights_router(device):
    """The routing simulation's router: the top k of the scores (as torch.topk chooses them), weights 1 / k."""
    from surge.kernels.moe_routing import route

    g = torch.Generator().manual_seed(2)
    scores = torch.rand(5, 24, generator=g).to(device)
    weights, ids = route(scores, 6, False, torch.bfloat16, uniform_weights=True)
    expected = torch.topk(scores.cpu(), 6, dim=-1).indices
    assert torch.equal(ids.cpu().long(), expected)
    assert torch.equal(weights.cpu(), torch.full((5, 6), 1 / 6, dtype=torch.bfloat16))


def test_router_warps_boundary():
    """One warp while a program's tile is at most ROUTER_ONE_WARP_ELEMENTS (a decode row of up to 256 experts)."""
    from surge.kernels.moe_routing import ROUTER_ONE_WARP_ELEMENTS, router_launch

    assert ROUTER_ONE_WARP_ELEMENTS == 256
    assert router_launch(1, 128, 8).num_warps == 1 and router_launch(16, 256, 8).num_warps == 1
    assert router_launch(1, 257, 8).num_warps == 4  # 512 lanes
    assert router_launch(17, 128, 8).num_warps == 4  # 16 rows a program from 17 tokens: 2048 elements


def test_pair_launch_refuses_quantized_experts():
    """The pair path has no quantized variant: the policy never picks it for them, and an explicit launch says so."""
    from surge.kernels.fused_moe import MoeQuant, fused_moe, launch_policy

    x = torch.randn(1, 32)
    gate_up = torch.zeros(4, 32, 32, dtype=torch.float8_e4m3fn)
    down = torch.zeros(4, 32, 16, dtype=torch.float8_e4m3fn)
    quant = MoeQuant("fp8_channel", torch.ones(4, 32), torch.ones(4, 32))
    ids, weights = torch.tensor([[0, 1]]), torch.full((1, 2), 0.5)
    assert launch_policy(1, 2, 4, 32, 16, "fp8_channel").pairs is None
    with pytest.raises(ValueError, match="pair path"):
        fused_moe(x, gate_up, down, weights, ids, launch=launch_policy(1, 2, 4, 32, 16), quant=quant)
