"""Triton LoRA shrink/expand against the torch path of the same layer (surge/model/layers/lora.py) and a plain
per-token reference: merged slices of unequal sizes, tokens of several adapters and of none, ranks up to 64, at the
launch policy's boundaries (fused 16 / split 17 tokens, decode tiles 64 / prefill tiles 65, column runs, split-K),
float32 and bfloat16; y a window of a wider output."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from surge.model.layers.lora import LinearLoRA, LoRAMapping


def _layer(in_features, slices, max_loras, rank, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    layer = LinearLoRA(in_features, slices, max_loras, rank, LoRAMapping(256, max_loras, device), dtype, device)
    for slot in range(max_loras):
        r = rank - slot * (rank // 4)  # each slot a different rank, zero-padded to max_rank
        parts = {j: (torch.randn(r, in_features, generator=g) * 0.2, torch.randn(size, r, generator=g) * 0.2)
                 for j, (_, size) in enumerate(slices)}
        layer.set_slot(slot, parts)
    return layer


def _reference(layer, x, token_slot):
    y = torch.zeros(x.shape[0], layer.b.shape[1], dtype=torch.float64)
    r = layer.max_rank
    for t, slot in enumerate(token_slot.tolist()):
        if slot < 0:
            continue
        for j, (offset, size) in enumerate(layer.slices):
            a = layer.a[slot, j * r:(j + 1) * r].double().cpu()
            b = layer.b[slot, offset:offset + size].double().cpu()
            y[t, offset:offset + size] = b @ (a @ x[t].double().cpu())
    return y


def _run_kernels(layer, x, base, token_slot, launch=None):
    """The kernels' y: base plus the deltas, y a column window of a wider output (strided rows)."""
    from surge.kernels.lora import lora_add

    m = LoRAMapping(256, layer.a.shape[0], x.device, use_kernels=True)
    m.set_tokens(token_slot)
    wide = torch.full((base.shape[0], base.shape[1] + 5), 7.0, dtype=base.dtype, device=base.device)
    y = wide[:, 2:2 + base.shape[1]]
    y.copy_(base)
    lora_add(x, layer.a, layer.b, y, layer.slice_offsets, layer.slice_key, m.sorted_tokens, m.slot_ids,
             m.group_start, m.group_len, launch)
    assert (wide[:, :2] == 7).all() and (wide[:, 2 + base.shape[1]:] == 7).all()  # nothing written outside y
    return y


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_tokens,in_features,slices,rank", [
    (1, 64, [(0, 64), (64, 32), (96, 32)], 8),  # batch-1 decode, q/k/v-like slices: fused
    (5, 64, [(0, 64), (64, 32), (96, 32)], 16),
    (16, 96, [(0, 40), (40, 40)], 16),  # the largest fused step; in and slices not tile multiples
    (17, 96, [(0, 40), (40, 40)], 16),  # the smallest split decode-tile step
    (4, 64, [(0, 32), (32, 32)], 64),  # rank 64 fused
    (9, 64, [(0, 20), (20, 12)], 8),  # a slice starting off a multiple of 8 columns
    (64, 48, [(0, 40), (40, 40)], 16),  # the largest decode-tile step
    (65, 64, [(0, 80)], 64),  # the smallest prefill-tile step; rank 64
    (130, 96, [(0, 24), (24, 136)], 32),  # several 64-row tiles; a slice wider than its tile
    (30, 512, [(0, 32), (32, 16)], 16),  # decode-tile split-K: 2 splits of 256 columns
    (64, 700, [(0, 48)], 8),  # 3 splits, the last one short and not a multiple of the k tile
    (65, 700, [(0, 48)], 8),  # prefill-tile split-K (2 or 3 splits)
])
@pytest.mark.parametrize("variant", ["policy", "other_path", "narrow_runs"])
def test_kernels_match_torch(num_tokens, in_features, slices, rank, dtype, variant, device, request):
    """The policy's launch, the other path (fused <-> split) at the same tiles, and 16-column tiles in runs of 3 per
    program, each against the torch path and a per-token float64 reference."""
    import dataclasses

    from surge.kernels.lora import lora_policy

    if dtype == torch.bfloat16:
        request.getfixturevalue("require_bf16_dot")
    max_loras = 3
    layer = _layer(in_features, slices, max_loras, rank, dtype, device)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(num_tokens, in_features, generator=g).to(device, dtype)
    base = torch.randn(num_tokens, layer.b.shape[1], generator=g).to(device, dtype)
    token_slot = torch.randint(-1, max_loras, (num_tokens,), generator=g).numpy()
    token_slot[:3] = [2, -1, 0][:num_tokens]

    sizes = tuple(size for _, size in slices)
    launch = lora_policy(num_tokens, max_loras, in_features, sizes, rank, x.element_size())
    if variant == "other_path":
        launch = lora_policy(num_tokens, max_loras, in_features, sizes, rank, x.element_size(), not launch.fused)
    elif variant == "narrow_runs":
        launch = dataclasses.replace(launch, block_n=16, tiles_per_program=3)
    y_kernel = _run_kernels(layer, x, base, token_slot, launch)

    torch_mapping = LoRAMapping(256, max_loras, device, use_kernels=False)
    torch_mapping.set_tokens(token_slot)
    layer.mapping = torch_mapping
    y_torch = base.clone()
    layer.add_(y_torch, x)

    want = base.double().cpu() + _reference(layer, x, torch.from_numpy(token_slot))
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(y_kernel.double().cpu(), want, atol=tol, rtol=tol)
    torch.testing.assert_close(y_torch.double().cpu(), want, atol=tol, rtol=tol)
    base_rows = torch.from_numpy(token_slot < 0).to(device)
    assert torch.equal(y_kernel[base_rows], base[base_rows])  # slot -1: untouched


def test_layer_add_uses_the_kernels(device):
    """LinearLoRA.add_ with a kernel mapping equals the torch path (the layer wiring: slices, offsets, rank)."""
    layer = _layer(64, [(0, 32), (32, 16), (48, 16)], 2, 8, torch.float32, device)
    x = torch.randn(9, 64, device=device)
    token_slot = np.array([0, 1, -1, 1, 0, 0, -1, 1, 1])
    outs = []
    for use_kernels in (True, False):
        layer.mapping = LoRAMapping(16, 2, device, use_kernels=use_kernels)
        layer.mapping.set_tokens(token_slot)
        y = torch.zeros(9, 64, device=device)
        layer.add_(y, x)
        outs.append(y)
    torch.testing.assert_close(outs[0], outs[1], atol=1e-5, rtol=1e-5)
    assert outs[0].abs().sum() > 0


@pytest.mark.parametrize("num_tokens", [1, 17, 70])
def test_unused_groups_and_padding_tokens_are_skipped(num_tokens, device, monkeypatch):
    """A graph captured with the kernels replays them in a step with no adapter: the same grid changes nothing.
    Eagerly, such a step launches nothing."""
    from surge.kernels import lora as kernels

    layer = _layer(32, [(0, 16)], 2, 16, torch.float32, device)
    m = layer.mapping = LoRAMapping(128, 2, device, use_kernels=True)
    m.set_tokens(np.full(num_tokens, -1))
    x, y = torch.randn(num_tokens, 32, device=device), torch.randn(num_tokens, 16, device=device)
    out = y.clone()
    kernels.lora_add(x, layer.a, layer.b, out, layer.slice_offsets, layer.slice_key, m.sorted_tokens, m.slot_ids,
                     m.group_start, m.group_len)
    assert torch.equal(out, y)
    monkeypatch.setattr(kernels, "lora_add", lambda *a: pytest.fail("launched for a step with no adapter"))
    layer.add_(out, x)
    assert torch.equal(out, y)


QKV, GATE_UP = (4096, 1024, 1024), (12288, 12288)  # Qwen3-8B's merged projections


def test_launch_policy_boundaries():
    from surge.kernels.lora import DECODE_MAX_TOKENS, FUSED_MAX_TOKENS, lora_policy

    def policy(num_tokens, k=4096, slices=QKV, rank=16, itemsize=2, groups=8):
        return lora_policy(num_tokens, groups, k, slices, rank, itemsize)

    # fused up to FUSED_MAX_TOKENS tokens, where one slice's A (padded rank x in) is at most 512 KB and the grid's
    # re-reads of it at most 20 MB
    assert policy(FUSED_MAX_TOKENS).fused and not policy(FUSED_MAX_TOKENS + 1).fused
    assert policy(1, k=16384, slices=(128,)).fused and not policy(1, k=16385, slices=(128,)).fused  # r 16, bf16
    assert policy(1, k=8192, slices=(128,), itemsize=4).fused
    assert not policy(1, k=8193, slices=(128,), itemsize=4).fused
    assert policy(1, rank=33, slices=(128,)).fused and not policy(1, rank=33, k=4097, slices=(128,)).fused  # r 64
    # Qwen3-8B's down (384 KB, 32 column tiles): one token fused, two of two adapters (24 MB of re-reads) split
    assert policy(1, k=12288, slices=(4096,)).fused and not policy(2, k=12288, slices=(4096,)).fused
    assert policy(FUSED_MAX_TOKENS, slices=GATE_UP).fused  # 128 programs of 128 KB: 16 MB
    # tiles: 16 rows up to DECODE_MAX_TOKENS, then 64
    assert policy(DECODE_MAX_TOKENS).block_m == 16 and policy(DECODE_MAX_TOKENS + 1).block_m == 64
    assert policy(1, rank=8).block_r == 16 and policy(1, rank=16).block_r == 16 and policy(1, rank=17).block_r == 32
    assert policy(1, slices=(8,)).block_n == 16 and policy(1).block_n == 128
    # B and y tiles within 16 KB
    assert policy(2048, itemsize=4).block_n == 64 and policy(1, rank=64, itemsize=4).block_n == 64
    # the expand's column runs: about FUSED_PROGRAMS programs fused, EXPAND_PROGRAMS split
    assert policy(1).tiles_per_program == 1  # 48 tiles (q 32, k 8, v 8): 48 programs
    assert policy(1, slices=GATE_UP).tiles_per_program == 2  # 192 tiles: 96 programs
    assert policy(16, slices=GATE_UP).tiles_per_program == 12  # 8 groups x 192 tiles: 128 programs
    assert policy(2048, slices=GATE_UP).tiles_per_program == 8  # 39 tiles of 64 rows x 192: 936 programs
    # the shrink's split-K: decode tiles one program per 256 columns of `in`, up to 32
    assert policy(17).split_k == 16 and policy(DECODE_MAX_TOKENS, k=4097).split_k == 17
    assert policy(17, k=8192).split_k == 32 and policy(17, k=12288).split_k == 32 and policy(17, k=256).split_k == 1
    assert policy(1).split_k == 1  # fused: no shrink launch
    # prefill tiles: up to 4 splits of at least 4 k steps, whatever the step's size (one compiled kernel)
    assert policy(2048).split_k == 4 and policy(2048, k=1024).split_k == 2 and policy(2048, k=512).split_k == 1
    assert policy(65).split_k == policy(65536).split_k == 4
    assert policy(1).block_k == 512 and policy(1, itemsize=4).block_k == 256 and policy(1, k=100).block_k == 128
    assert policy(1, rank=64, slices=(128,)).block_k == 128  # the fused A tile within 16 KB
    assert policy(17).block_k == 128 and policy(2048).block_k == 128 and policy(2048, itemsize=4).block_k == 64


def test_warm_up_compiles_without_touching_the_step_mapping(device):
    from surge.kernels.lora import WARM_UP_TOKEN_COUNTS

    layer = _layer(32, [(0, 16), (16, 8)], 2, 16, torch.float32, device)
    layer.mapping = LoRAMapping(64, 2, device, use_kernels=True)
    layer.mapping.set_tokens(np.array([0, 1, 1, 0, -1]))  # a live step's mapping: left as it is
    before = layer.mapping.groups_t.clone()
    for num_tokens in WARM_UP_TOKEN_COUNTS:
        layer.warm_up(num_tokens, torch.float32)
    assert torch.equal(layer.mapping.groups_t, before)
