"""Fused MoE kernel: equals the torch reference (surge/kernels/reference.py, HF's experts loop) on random shapes, for
every launch geometry, with experts that receive no tokens, a single token, and experts held by another rank; the
router kernel against torch's softmax and topk (ties against a stable sort); the block alignment kernels against a
plain Python model and exactly against the torch alignment, the fused output bitwise alike with either; the launch
policies at their N/N+1 boundaries; CUDA graph replay of router and experts. The variants gpt-oss needs (expert
biases, the clamped SwiGLU, softmax after top-k) against the same references."""
from __future__ import annotations

import pytest
import torch

from surge.kernels.reference import align_to_blocks as torch_align
from surge.kernels.reference import fused_moe as reference


def _case(num_tokens, num_experts, top_k, hidden, inter, dtype, device, seed=0, remote=0):
    """Random experts and routing; `remote` experts (the highest ids) are another rank's, so their ids become -1."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, hidden, generator=g)
    gate_up = torch.randn(num_experts, 2 * inter, hidden, generator=g) / hidden ** 0.5
    down = torch.randn(num_experts, hidden, inter, generator=g) / inter ** 0.5
    scores = torch.rand(num_tokens, num_experts + remote, generator=g)
    weights, ids = scores.softmax(-1).topk(top_k, dim=-1)
    ids = torch.where(ids < num_experts, ids, -1)
    return [t.to(device=device, dtype=dtype) for t in (x, gate_up, down, weights)] + [ids.to(device)]


def _check(got, expected, dtype):
    tol = {"atol": 2e-5, "rtol": 2e-5} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
    torch.testing.assert_close(got.float(), expected.float(), **tol)


def _launches(num_tokens, num_experts, top_k, hidden, inter):
    from surge.kernels.fused_moe import GemmTiles, MoeLaunch, launch_policy

    chosen = launch_policy(num_tokens, top_k, num_experts, hidden, inter)
    return [chosen, MoeLaunch(16, GemmTiles(16, 16, 4, 2), GemmTiles(32, 16, 4, 2), combine_block=16),
            MoeLaunch(32, GemmTiles(32, 64, 4, 2), GemmTiles(16, 32, 4, 2)),
            MoeLaunch(64, GemmTiles(64, 32, 4, 2), GemmTiles(64, 64, 4, 2))]


# (tokens, experts, top_k, hidden, intermediate): one token; more experts than pairs (most get none); shapes that
# are not multiples of any tile; many tokens per expert.
SHAPES = [(1, 8, 2, 64, 32), (3, 16, 2, 48, 40), (37, 8, 3, 96, 56), (130, 4, 2, 32, 24)]


@pytest.mark.parametrize("shape", SHAPES, ids=[f"T{s[0]}-E{s[1]}-k{s[2]}-H{s[3]}-I{s[4]}" for s in SHAPES])
def test_equals_reference_for_every_geometry(shape, device):
    from surge.kernels.fused_moe import fused_moe

    x, gate_up, down, weights, ids = _case(*shape, torch.float32, device)
    expected = reference(x.cpu(), gate_up.cpu(), down.cpu(), weights.cpu(), ids.cpu())
    if shape[0] * shape[2] < shape[1]:
        assert len(ids.unique()) < shape[1]  # some experts receive no token
    for launch in _launches(*shape):
        _check(fused_moe(x, gate_up, down, weights, ids, launch=launch).cpu(), expected, torch.float32)


# (bias, activation): each flag alone, then both (gpt-oss's experts); DeepSeek V4's clamped SiLU.
VARIANTS = [(True, "silu"), (False, "swiglu_oai"), (True, "swiglu_oai"), (False, "silu_clamped")]


@pytest.mark.parametrize("bias,activation", VARIANTS, ids=[f"bias{int(b)}-{a}" for b, a in VARIANTS])
def test_bias_and_activation_equal_reference(bias, activation, device):
    """Expert biases (gate|up [E, 2I], down [E, H]) and the clamped SwiGLU against the torch reference, with a limit
    the gate and up values cross (both sides of up), and an expert held elsewhere (-1)."""
    from surge.kernels.fused_moe import fused_moe

    x, gate_up, down, weights, ids = _case(9, 4, 2, 32, 24, torch.float32, device, seed=13, remote=1)
    g = torch.Generator().manual_seed(14)
    options = dict(activation=activation, swiglu_alpha=1.5, swiglu_limit=0.6)
    if bias:
        options.update(gate_up_bias=torch.randn(4, 48, generator=g).to(device),
                       down_bias=torch.randn(4, 32, generator=g).to(device))
    cpu = {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in options.items()}
    expected = reference(x.cpu(), gate_up.cpu(), down.cpu(), weights.cpu(), ids.cpu(), **cpu)
    if activation != "silu":  # the clamps act: gate above the limit, up beyond it on both sides
        up = x.cpu() @ gate_up.cpu()[:, 24:].transpose(1, 2)
        assert (x.cpu() @ gate_up.cpu()[:, :24].transpose(1, 2) > 0.6).any() and (up > 0.6).any() and (up < -0.6).any()
    for launch in _launches(9, 4, 2, 32, 24)[:2]:
        _check(fused_moe(x, gate_up, down, weights, ids, launch=launch, **options).cpu(), expected, torch.float32)


@pytest.fixture
def garbage_memory(monkeypatch):
    """torch.empty and empty_like return NaN (floats) or -7777 (integers): a kernel output left partly unwritten,
    or a row read that no kernel wrote, shows."""
    empty, empty_like = torch.empty, torch.empty_like

    def fill(t):
        return t.fill_(float("nan") if t.is_floating_point() else -7777)

    monkeypatch.setattr(torch, "empty", lambda *a, **k: fill(empty(*a, **k)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **k: fill(empty_like(*a, **k)))


def test_experts_held_elsewhere_contribute_nothing(device, garbage_memory):
    """Expert parallelism: ids of -1 (local ids), or global ids with this rank's expert_offset; a token whose
    experts are all remote gets zeros, though no kernel writes its rows."""
    from surge.kernels.fused_moe import fused_moe

    x, gate_up, down, weights, ids = _case(29, 4, 3, 64, 32, torch.float32, device, seed=3, remote=4)
    ids[0] = -1
    assert (ids == -1).any(dim=1).sum() > 5
    expected = reference(x.cpu(), gate_up.cpu(), down.cpu(), weights.cpu(), ids.cpu())
    got = fused_moe(x, gate_up, down, weights, ids).cpu()
    assert torch.equal(got[0], torch.zeros_like(got[0]))
    _check(got, expected, torch.float32)
    # Rank 1 of 2 holds experts 4..7 of 8: ids 0..3 are rank 0's, ids 4..7 its own experts 0..3.
    global_ids = torch.where(ids >= 0, ids + 4, torch.randint(0, 4, ids.shape, device=device))
    assert torch.equal(fused_moe(x, gate_up, down, weights, global_ids, expert_offset=4).cpu(), got)


def test_bf16_equals_reference(device, require_bf16_dot):
    from surge.kernels.fused_moe import fused_moe

    x, gate_up, down, weights, ids = _case(21, 8, 2, 64, 48, torch.bfloat16, device, seed=5)
    # The reference in float32 from the same bf16 inputs: the kernel accumulates in float32 and rounds once.
    expected = reference(x.cpu().float(), gate_up.cpu().float(), down.cpu().float(), weights.cpu().float(),
                         ids.cpu())
    got = fused_moe(x, gate_up, down, weights, ids)
    assert got.dtype == torch.bfloat16
    _check(got.cpu(), expected, torch.bfloat16)


@pytest.mark.parametrize("block_m", [16, 32])
def test_alignment_against_a_plain_model(block_m, device):
    from surge.kernels.moe_routing import align_to_blocks, max_padded_pairs

    g = torch.Generator().manual_seed(block_m)
    num_experts, ids = 6, torch.randint(-1, 5, (23, 3), generator=g)  # expert 5 gets nothing, -1 is remote
    sorted_ids, block_expert = align_to_blocks(ids.to(device), num_experts, block_m)
    sorted_ids, block_expert = sorted_ids.cpu().tolist(), block_expert.cpu().tolist()
    flat, num_pairs = ids.flatten().tolist(), ids.numel()
    expected_ids, expected_blocks = [], []
    for e in range(num_experts):  # each expert's pairs in order, padded to whole blocks
        pairs = [p for p, pe in enumerate(flat) if pe == e]
        blocks = -(-len(pairs) // block_m)
        expected_ids += pairs + [num_pairs] * (blocks * block_m - len(pairs))
        expected_blocks += [e] * blocks
    rows = max_padded_pairs(num_pairs, num_experts, block_m)
    expected_ids += [num_pairs] * (rows - len(expected_ids))
    expected_blocks += [-1] * (rows // block_m - len(expected_blocks))
    assert sorted_ids == expected_ids and block_expert == expected_blocks


def _torch_route(logits, top_k, renormalize):
    """HF's routing: softmax in float32, torch.topk, renormalized."""
    probs = torch.softmax(logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    return (weights / weights.sum(-1, keepdim=True) if renormalize else weights), ids


# (tokens, experts, top_k): decode of Qwen3-30B-A3B; experts not a power of two; one program per row up to 16
# tokens, several rows per program beyond (and a last program partly past the rows); every expert chosen.
ROUTES = [(1, 128, 8), (16, 10, 3), (17, 60, 4), (45, 6, 6)]


@pytest.mark.parametrize("route", ROUTES, ids=[f"T{r[0]}-E{r[1]}-k{r[2]}" for r in ROUTES])
@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_router_equals_torch_topk(route, renormalize, dtype, device):
    """The experts of torch.topk on the float32 softmax, in its order, on every row where no tie reaches the k-th
    place (bf16 logits tie often); on every row, the order of a stable descending sort (ties to the lowest id) and
    torch's weights."""
    from surge.model.layers.moe import select_experts

    num_tokens, num_experts, top_k = route
    g = torch.Generator().manual_seed(num_tokens)
    logits = (torch.randn(num_tokens, num_experts, generator=g) * 2).to(dtype)
    expected_weights, expected_ids = _torch_route(logits, top_k, renormalize)
    weights, ids = select_experts(logits.to(device), top_k, renormalize, dtype, use_kernel=True)
    assert weights.dtype == dtype and ids.dtype == torch.int32 and ids.shape == (num_tokens, top_k)
    ids = ids.cpu().long()
    ranked = torch.sort(logits.float(), dim=-1, descending=True, stable=True).values[:, :top_k + 1]
    untied = (ranked[:, 1:] != ranked[:, :-1]).all(dim=1)
    assert untied.sum() >= num_tokens // 2
    assert ids[untied].tolist() == expected_ids[untied].tolist()
    assert ids.tolist() == torch.sort(logits.float(), dim=-1, descending=True, stable=True).indices[:, :top_k].tolist()
    # float32: within the rounding of exp and two divisions; bf16: the same float32 value rounded (one ulp apart
    # at most, where the float32 values straddle a rounding boundary).
    tol = {"rtol": 1e-5, "atol": 1e-7} if dtype == torch.float32 else {"rtol": 2 ** -7, "atol": 0}
    torch.testing.assert_close(weights.cpu().float(), expected_weights.to(dtype).float(), **tol)


@pytest.mark.parametrize("route", [(1, 8, 2), (17, 10, 3)], ids=["T1-E8-k2", "T17-E10-k3"])
def test_router_softmax_after_topk_equals_torch(route, device):
    """gpt-oss's routing: torch.topk of the logits, then the softmax of those k (HF's GptOssTopKRouter order)."""
    from surge.model.layers.moe import select_experts

    num_tokens, num_experts, top_k = route
    logits = torch.randn(num_tokens, num_experts, generator=torch.Generator().manual_seed(num_tokens)) * 2
    top, expected_ids = torch.topk(logits, top_k, dim=-1)
    expected = torch.softmax(top, dim=-1)
    for use_kernel in (True, False):
        weights, ids = select_experts(logits.to(device), top_k, False, torch.float32, use_kernel=use_kernel,
                                      softmax_after_topk=True)
        assert ids.cpu().long().tolist() == expected_ids.tolist()
        torch.testing.assert_close(weights.cpu(), expected, rtol=1e-6, atol=1e-7)


def test_router_ties_go_to_the_lowest_expert(device):
    """Logits from a few values, so most rows tie, some across the k-th place; a row of -inf but for one expert.
    The reference ranks by a stable descending sort of the logits: equal logits in ascending expert order."""
    from surge.model.layers.moe import select_experts

    g = torch.Generator().manual_seed(7)
    logits = torch.randint(0, 3, (33, 12), generator=g).float()
    logits[5] = float("-inf")
    logits[5, 9] = 1.0
    top_k = 4
    expected_ids = torch.sort(logits, dim=-1, descending=True, stable=True).indices[:, :top_k]
    probs = torch.softmax(logits, dim=-1)
    expected = probs.gather(1, expected_ids)
    expected = expected / expected.sum(-1, keepdim=True)
    weights, ids = select_experts(logits.to(device), top_k, True, torch.float32, use_kernel=True)
    assert ids.cpu().long().tolist() == expected_ids.tolist()
    assert ids[5, 0] == 9 and ids[5, 1:].tolist() == [0, 1, 2]  # then the lowest of the -inf experts
    torch.testing.assert_close(weights.cpu(), expected, rtol=1e-5, atol=1e-7)


def test_router_launch_boundaries():
    from surge.kernels.moe_routing import router_launch

    assert router_launch(16, 128, 8).rows == 1 and router_launch(17, 128, 8).rows == 16
    assert router_launch(17, 8, 2).rows == 32 and router_launch(4096, 8, 2).rows == 256
    assert router_launch(1, 128, 8) == router_launch(16, 128, 8)
    launch = router_launch(1, 60, 5)
    assert (launch.experts_pad, launch.top_k_pad) == (64, 8)
    for bad in [{"num_tokens": 0}, {"top_k": 9}, {"num_experts": 0}]:
        with pytest.raises(ValueError, match=next(iter(bad))):
            router_launch(**{"num_tokens": 4, "num_experts": 8, "top_k": 2, **bad})


def _routing(num_tokens, top_k, num_experts, seed, remote=0.0):
    """Ids of experts [0, num_experts - 2] (the last gets nothing), a `remote` share of them -1."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, num_experts - 1, (num_tokens, top_k), generator=g)
    return torch.where(torch.rand(num_tokens, top_k, generator=g) < remote, -1, ids)


def _align_launches(num_pairs, num_experts, block_m):
    """The chosen geometry, then forced ones: several steps in one program, and several programs of several steps
    (pairs counted and placed across step and program boundaries)."""
    import triton

    from surge.kernels.moe_routing import AlignLaunch, align_launch

    pad = triton.next_power_of_2(num_experts)
    return [align_launch(num_pairs, num_experts, block_m), AlignLaunch(pad, 16, 64 * -(-num_pairs // 64), 1, 16),
            AlignLaunch(pad, 16, 32, -(-num_pairs // 32), 16)]


# (tokens, top_k, experts, block_m, remote share): one token; Qwen3-30B-A3B decode; remote experts; two steps of
# one program; the two-launch path (600 pairs of 64 experts: five programs, test_align_launch_boundaries).
ALIGNS = [(1, 2, 6, 16, 0.0), (1, 8, 128, 16, 0.0), (23, 3, 6, 32, 0.3), (70, 3, 64, 16, 0.1), (300, 4, 8, 64, 0.0),
          (150, 4, 64, 64, 0.1)]


@pytest.mark.parametrize("case", ALIGNS, ids=[f"T{c[0]}-k{c[1]}-E{c[2]}-m{c[3]}" for c in ALIGNS])
def test_alignment_equals_torch(case, device, garbage_memory):
    """Exactly the torch alignment (a stable sort): sorted ids, blocks' experts, every padding row; and the same
    from global ids of which this rank holds [offset, offset + E) (the others, like -1, take no row)."""
    from surge.kernels.moe_routing import align_to_blocks

    num_tokens, top_k, num_experts, block_m, remote = case
    ids = _routing(num_tokens, top_k, num_experts, seed=num_tokens, remote=remote)
    expected = torch_align(ids, num_experts, block_m)
    offset = 2 * num_experts  # rank 2 of 3: the ids of ranks 0 and 1 and -1 are not here
    other_ranks = torch.randint(0, 2 * num_experts, ids.shape, generator=torch.Generator().manual_seed(1))
    global_ids = torch.where(ids >= 0, ids + offset, other_ranks)
    for launch in _align_launches(num_tokens * top_k, num_experts, block_m):
        for dtype in (torch.int32, torch.int64):
            got = align_to_blocks(ids.to(device=device, dtype=dtype), num_experts, block_m, launch=launch)
            assert torch.equal(got[0].cpu(), expected[0]) and torch.equal(got[1].cpu(), expected[1]), launch
        got = align_to_blocks(global_ids.to(device), num_experts, block_m, expert_offset=offset, launch=launch)
        assert torch.equal(got[0].cpu(), expected[0]) and torch.equal(got[1].cpu(), expected[1]), launch


def test_fused_output_bitwise_alike_with_either_alignment(device, monkeypatch):
    """Each pair writes its own row, so the output does not depend on where in its group a pair is placed: fed by
    the torch alignment, or by one that reverses each block's pairs (which no alignment makes), the kernels give the
    very same bits as with the Triton alignment."""
    import surge.kernels.fused_moe as fm

    x, gate_up, down, weights, _ = _case(70, 6, 3, 48, 40, torch.bfloat16, device, seed=11)
    ids = _routing(70, 3, 6, seed=11, remote=0.2).to(device)
    ours = fm.fused_moe(x, gate_up, down, weights, ids)

    def unshuffled(topk_ids, num_experts, block_m, expert_offset):
        return torch_align(topk_ids, num_experts, block_m)

    def shuffled(topk_ids, num_experts, block_m, expert_offset):
        sorted_ids, block_expert = torch_align(topk_ids, num_experts, block_m)
        num_pairs, order = topk_ids.numel(), sorted_ids.clone()
        for block in range(block_expert.numel()):  # reverse each block's live pairs
            rows = sorted_ids[block * block_m:(block + 1) * block_m]
            live = rows[rows < num_pairs]
            order[block * block_m:block * block_m + live.numel()] = live.flip(0)
        return order, block_expert

    for align in (unshuffled, shuffled):
        monkeypatch.setattr(fm, "align_to_blocks", align)
        assert torch.equal(fm.fused_moe(x, gate_up, down, weights, ids), ours), align.__name__


def test_align_launch_boundaries():
    from surge.kernels.moe_routing import MAX_ALIGN_PROGRAMS, align_launch

    # 128 experts: one-hot steps of 64 pairs; one program of up to 4 steps, then programs of one step each up to
    # MAX_ALIGN_PROGRAMS, then longer chunks.
    assert align_launch(8, 128, 16).num_programs == 1 and align_launch(8, 128, 16).pairs_per_step == 16
    assert align_launch(256, 128, 16).num_programs == 1 and align_launch(256, 128, 16).chunk == 256
    assert align_launch(257, 128, 16).num_programs == 5 and align_launch(257, 128, 16).chunk == 64
    assert align_launch(64 * 64, 128, 16).num_programs == 64 and align_launch(64 * 64, 128, 16).chunk == 64
    big = align_launch(64 * 64 + 1, 128, 64)
    assert big.chunk == 128 and big.num_programs == 33 <= MAX_ALIGN_PROGRAMS
    assert align_launch(1 << 20, 128, 64).num_programs == MAX_ALIGN_PROGRAMS
    assert align_launch(4096, 8, 16).num_programs == 1 and align_launch(4097, 8, 16).num_programs == 5
    assert align_launch(1200, 8, 64).num_programs == 1 and align_launch(600, 64, 64).num_programs == 5
    assert align_launch(8, 128, 16).blocks_per_step == 64 and align_launch(8, 4, 64).blocks_per_step == 64
    with pytest.raises(ValueError, match="block_m"):
        align_launch(8, 128, 0)


def test_launch_policy_boundaries():
    from surge.kernels.fused_moe import MAX_BLOCK_M, launch_policy

    def block_m(tokens):  # 8 experts, top 2: tokens / 4 pairs per expert
        return launch_policy(tokens, 2, 8, 2048, 768).block_m

    assert block_m(1) == 16 and block_m(64) == 16 and block_m(65) == 32
    assert block_m(128) == 32 and block_m(129) == 64
    assert block_m(256) == 64 and block_m(257) == MAX_BLOCK_M == 64 and block_m(1 << 16) == 64
    decode, prefill = launch_policy(128, 2, 8, 2048, 768), launch_policy(129, 2, 8, 2048, 768)
    assert (decode.gate_up.block_n, decode.gate_up.block_k, decode.gate_up.num_stages) == (64, 128, 4)
    assert (prefill.gate_up.block_n, prefill.gate_up.block_k, prefill.gate_up.num_stages) == (128, 64, 3)
    # Qwen3-30B-A3B (128 experts, 8 per token): batch 1 decode and a 2048-token prefill.
    assert launch_policy(1, 8, 128, 2048, 768).block_m == 16 and launch_policy(2048, 8, 128, 2048, 768).block_m == 64
    tiny = launch_policy(1, 1, 1, 24, 8)  # tiles never exceed the (padded) dimension, nor go below 16
    assert (tiny.gate_up.block_n, tiny.gate_up.block_k, tiny.down.block_n, tiny.down.block_k) == (16, 32, 32, 16)
    assert (tiny.combine_block, launch_policy(1, 1, 1, 8, 8).combine_block) == (32, 16)
    combine = [launch_policy(1, 8, 128, hidden, 768).combine_block for hidden in (512, 513, 1024, 1025, 2048)]
    assert combine == [512, 1024, 1024, 1024, 1024]
    for bad in [{"num_tokens": 0}, {"top_k": 9}, {"hidden": 0}]:
        with pytest.raises(ValueError, match=next(iter(bad))):
            shapes = {"num_tokens": 4, "top_k": 2, "num_experts": 8, "hidden": 64, "intermediate": 32}
            launch_policy(**{**shapes, **bad})


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need CUDA")
@pytest.mark.parametrize("num_tokens", [1, 16, 130])  # one alignment launch, then two (130 x 4 pairs of 64 experts)
def test_cuda_graph_replays_any_routing(num_tokens):
    """Router, alignment and experts captured once, replayed on new logits: the eager result, bit for bit."""
    from surge.kernels.fused_moe import fused_moe
    from surge.kernels.moe_routing import align_launch
    from surge.model.layers.moe import select_experts

    cuda = torch.device("cuda")
    x, gate_up, down, _, _ = _case(num_tokens, 64, 4, 64, 32, torch.bfloat16, cuda)
    logits = torch.randn(num_tokens, 64, device=cuda, dtype=torch.bfloat16)

    def step():
        weights, ids = select_experts(logits, 4, True, torch.bfloat16)
        return fused_moe(x, gate_up, down, weights, ids)

    assert (align_launch(num_tokens * 4, 64, 16).num_programs > 1) == (num_tokens == 130)
    step()  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    for seed in (1, 2):
        g = torch.Generator(device=cuda).manual_seed(seed)
        logits.copy_(torch.randn(logits.shape, generator=g, device=cuda))
        x.copy_(torch.randn(x.shape, generator=g, device=cuda))
        graph.replay()
        torch.testing.assert_close(out, step(), atol=0, rtol=0)
