"""Triton LoRA shrink/expand against the torch path of the same layer (surge/model/layers/lora.py) and a plain
per-token reference: merged slices of unequal sizes, tokens of several adapters and of none, ranks up to 64, at the
launch policy's boundaries (decode-sized 64 / 65 tokens, n and slice tiles, split-K), float32 and bfloat16."""
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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_tokens,in_features,slices,rank", [
    (5, 64, [(0, 64), (64, 32), (96, 32)], 8),  # q/k/v-like slices, decode-sized tiles
    (64, 48, [(0, 40), (40, 40)], 16),  # the largest decode-sized step; in and slices not tile multiples
    (65, 64, [(0, 80)], 64),  # the smallest prefill-sized step; rank 64
    (130, 96, [(0, 24), (24, 136)], 32),  # several 64-row tiles; a slice wider than its tile
    (3, 512, [(0, 32), (32, 16)], 16),  # decode-sized split-K: 2 splits of 256 columns
    (64, 700, [(0, 48)], 8),  # 3 splits, the last one short and not a multiple of the k tile
    (65, 700, [(0, 48)], 8),  # prefill-sized: no split
])
def test_kernels_match_torch(num_tokens, in_features, slices, rank, dtype, device, request):
    if dtype == torch.bfloat16:
        request.getfixturevalue("require_bf16_dot")
    max_loras = 3
    layer = _layer(in_features, slices, max_loras, rank, dtype, device)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(num_tokens, in_features, generator=g).to(device, dtype)
    base = torch.randn(num_tokens, layer.b.shape[1], generator=g).to(device, dtype)
    token_slot = torch.randint(-1, max_loras, (num_tokens,), generator=g).numpy()
    token_slot[:3] = [2, -1, 0]

    kernel_mapping = LoRAMapping(256, max_loras, device, use_kernels=True)
    kernel_mapping.set_tokens(token_slot)
    layer.mapping = kernel_mapping
    y_kernel = base.clone()
    layer.add_(y_kernel, x)

    torch_mapping = LoRAMapping(256, max_loras, device, use_kernels=False)
    torch_mapping.set_tokens(token_slot)
    layer.mapping = torch_mapping
    y_torch = base.clone()
    layer.add_(y_torch, x)

    want = base.double().cpu() + _reference(layer, x, torch.from_numpy(token_slot))
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(y_kernel.double().cpu(), want, atol=tol, rtol=tol)
    torch.testing.assert_close(y_torch.double().cpu(), want, atol=tol, rtol=tol)
    base_rows = torch.from_numpy(token_slot < 0)
    assert torch.equal(y_kernel[base_rows.to(device)], base[base_rows.to(device)])  # slot -1: untouched


def test_unused_groups_and_padding_tokens_are_skipped(device, monkeypatch):
    """A graph captured with the kernels replays them in a step with no adapter: the same grid changes nothing.
    Eagerly, such a step launches nothing."""
    from surge.kernels import lora as kernels

    layer = _layer(32, [(0, 16)], 2, 16, torch.float32, device)
    m = layer.mapping = LoRAMapping(64, 2, device, use_kernels=True)
    m.set_tokens(np.full(20, -1))
    x, y = torch.randn(20, 32, device=device), torch.randn(20, 16, device=device)
    out = y.clone()
    s = kernels.shrink_buffer(20, 16, 32, device)
    kernels.lora_shrink(x, layer.a, s, m.sorted_tokens, m.slot_ids, m.group_start, m.group_len)
    kernels.lora_expand(s, layer.b, out, layer.slice_offsets, layer.max_slice, m.sorted_tokens, m.slot_ids,
                        m.group_start, m.group_len)
    assert torch.equal(out, y)
    monkeypatch.setattr(kernels, "lora_shrink", lambda *a: pytest.fail("launched for a step with no adapter"))
    layer.add_(out, x)
    assert torch.equal(out, y)


def test_launch_policy_boundaries():
    from surge.kernels.lora import DECODE_MAX_TOKENS, expand_policy, shrink_policy

    assert shrink_policy(DECODE_MAX_TOKENS, 64, 4096).block_m == 16
    assert shrink_policy(DECODE_MAX_TOKENS + 1, 64, 4096).block_m == 64
    assert shrink_policy(1, 16, 4096).block_n == 16 and shrink_policy(1, 17, 4096).block_n == 32
    assert shrink_policy(1, 64, 4096).block_n == 64 and shrink_policy(1, 192, 4096).block_n == 64
    assert shrink_policy(1, 64, 16).block_k == 16 and shrink_policy(1, 64, 17).block_k == 32
    assert shrink_policy(1, 64, 4096).block_k == 128 and shrink_policy(100, 64, 4096).block_k == 64
    assert expand_policy(1, 4096, 16).block_k == 16 and expand_policy(1, 4096, 17).block_k == 32
    assert expand_policy(1, 4096, 64).block_k == 64
    assert expand_policy(DECODE_MAX_TOKENS, 4096, 16).block_n == 128
    assert expand_policy(DECODE_MAX_TOKENS + 1, 4096, 16).block_n == 64
    assert expand_policy(1, 8, 16).block_n == 16
    # split-K for decode-sized shrinks: one program per 256 columns of `in`, up to 32
    assert shrink_policy(1, 48, 4096).split_k == 16 and shrink_policy(DECODE_MAX_TOKENS, 48, 4097).split_k == 17
    assert shrink_policy(1, 48, 8192).split_k == 32 and shrink_policy(1, 48, 12288).split_k == 32
    assert shrink_policy(1, 48, 256).split_k == 1 and shrink_policy(DECODE_MAX_TOKENS + 1, 48, 4096).split_k == 1


def test_warm_up_compiles_without_touching_the_step_mapping(device):
    from surge.kernels.lora import DECODE_MAX_TOKENS

    layer = _layer(32, [(0, 16), (16, 8)], 2, 16, torch.float32, device)
    layer.mapping = LoRAMapping(64, 2, device, use_kernels=True)
    layer.mapping.set_tokens(np.array([0, 1, 1, 0, -1]))  # a live step's mapping: left as it is
    before = layer.mapping.groups_t.clone()
    for num_tokens in (1, DECODE_MAX_TOKENS + 1):
        layer.warm_up(num_tokens, torch.float32)
    assert torch.equal(layer.mapping.groups_t, before)
