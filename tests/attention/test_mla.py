"""Multi-head latent attention over the latent cache (surge/attention/mla.py) against a float64 dense reference: keys
and values expanded per head from every position's latent, a per-query softmax. Decode-only, mixed and prefill
batches (fresh, and after cached context); decode rows absorbed and the others expanded by default, and every row
each way; NaN in every slot no request wrote, the null block included."""
from __future__ import annotations

import math

import pytest
import torch

from surge.attention.backend import AttentionParams, CommonAttentionMetadata
from surge.attention.mla import mla_forward
from surge.attention.torch_backend import TorchAttentionMetadata
from surge.core.kv_cache.spec import MLAAttentionSpec

BLOCK = 4
HEADS, NOPE, ROPE, V, LORA = 4, 8, 4, 6, 16
SCALE = 0.37


def _batch(requests, seed):
    """requests: (cached context, new tokens). Blocks scattered; cached context written into the cache as the
    [latent | rope key] rows an earlier step left; unwritten slots NaN."""
    gen = torch.Generator().manual_seed(seed)
    max_blocks = max(math.ceil((c + n) / BLOCK) for c, n in requests)
    num_blocks = 1 + len(requests) * max_blocks
    order = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    spec = MLAAttentionSpec(BLOCK, 1, LORA + ROPE, torch.float32, kv_lora_rank=LORA)
    cache = torch.full(spec.cache_shape(num_blocks), float("nan"))
    rows = cache.view(-1, LORA + ROPE)
    tables = torch.zeros(len(requests), max_blocks + 2, dtype=torch.int32)
    latents, slots, qsl = [], [], [0]
    for r, (ctx, new) in enumerate(requests):
        lat = torch.randn(ctx + new, LORA + ROPE, generator=gen)
        latents.append(lat)
        for b in range(math.ceil((ctx + new) / BLOCK)):
            block = order.pop()
            tables[r, b] = block
            for p in range(b * BLOCK, min((b + 1) * BLOCK, ctx + new)):
                if p < ctx:
                    rows[block * BLOCK + p % BLOCK] = lat[p]
                else:
                    slots.append(block * BLOCK + p % BLOCK)
        qsl.append(qsl[-1] + new)
    q = torch.randn(qsl[-1], HEADS, NOPE + ROPE, generator=gen)
    new_rows = torch.cat([lat[c:] for lat, (c, _) in zip(latents, requests)])
    seq_lens = [c + n for c, n in requests]
    meta = TorchAttentionMetadata(
        num_reqs=len(requests), num_tokens=qsl[-1], query_start_loc=qsl, seq_lens=seq_lens,
        max_query_len=max(n for _, n in requests), max_seq_len=max(seq_lens),
        query_start_loc_t=torch.tensor(qsl, dtype=torch.int32), seq_lens_t=torch.tensor(seq_lens, dtype=torch.int32),
        slot_mapping=torch.tensor(slots), block_table=tables)
    w = torch.randn(HEADS * (NOPE + V), LORA, generator=gen) / LORA ** 0.5
    return q, new_rows, cache, meta, w, latents


def _reference(q, latents, requests, w):
    w = w.double().view(HEADS, NOPE + V, LORA)
    out, t = torch.empty(q.shape[0], HEADS, V, dtype=torch.float64), 0
    for (ctx, new), lat in zip(requests, latents):
        lat = lat.double()
        kv = torch.einsum("hdl,sl->shd", w, lat[:, :LORA])
        keys = torch.cat((kv[..., :NOPE], lat[:, None, LORA:].expand(-1, HEADS, -1)), dim=-1)
        values = kv[..., NOPE:]
        for i in range(new):
            pos = ctx + i
            probs = (torch.einsum("hd,shd->hs", q[t].double(), keys[:pos + 1]) * SCALE).softmax(-1)
            out[t] = torch.einsum("hs,shd->hd", probs, values[:pos + 1])
            t += 1
    return out


BATCHES = {
    "decode": [(5, 1), (12, 1), (1, 1)],
    "decode-equal-lengths": [(7, 1), (7, 1)],
    "prefill": [(0, 9), (0, 3)],
    "mixed": [(6, 1), (0, 7), (9, 5), (3, 1)],
    "chunk-after-context": [(13, 6)],
}


@pytest.mark.parametrize("absorb", [None, True, False], ids=["auto", "absorbed", "expanded"])
@pytest.mark.parametrize("kind", list(BATCHES))
def test_mla_matches_dense_reference(kind, absorb):
    requests = BATCHES[kind]
    q, new_rows, cache, meta, w, latents = _batch(requests, seed=len(kind))
    params = AttentionParams(HEADS, 1, NOPE + ROPE, SCALE, head_dim_v=V, kv_lora_rank=LORA, qk_rope_head_dim=ROPE)
    out = mla_forward(q, new_rows[:, :LORA], new_rows[:, LORA:], cache, meta, params, w, absorb=absorb)
    assert out.shape == (q.shape[0], HEADS, V)
    torch.testing.assert_close(out.double(), _reference(q, latents, requests, w), atol=1e-5, rtol=1e-5)
    written = cache.view(-1, LORA + ROPE)[meta.slot_mapping]
    assert torch.equal(written, new_rows)  # this step's rows, as given


def test_mla_params_and_refusals():
    with pytest.raises(ValueError, match="only MLA layers"):
        AttentionParams(4, 4, 16, 0.25, head_dim_v=8)
    with pytest.raises(ValueError, match="one latent KV head"):
        AttentionParams(4, 2, 12, 0.25, head_dim_v=8, kv_lora_rank=16, qk_rope_head_dim=4)
    with pytest.raises(ValueError, match="sliding window"):
        AttentionParams(4, 1, 12, 0.25, sliding_window=8, head_dim_v=8, kv_lora_rank=16, qk_rope_head_dim=4)
