"""The MLA decode kernel on the GPU (`python -m surge.bench.kernels --only mla`): DeepSeek-V2-Lite's (16 heads) and
V3's (128 heads) attention over the latent cache, GB/s against the bytes it must read (the latent cache rows of
every position, kv_lora_rank + qk_rope_head_dim values each, plus the queries), checked against the torch path."""
from __future__ import annotations

from collections.abc import Callable

import torch

from surge.bench.paged_blocks import scattered_blocks

LORA, ROPE, NOPE, V_DIM, BLOCK = 512, 64, 128, 128, 16  # BLOCK: the engine's default cache block
DTYPE = torch.bfloat16


def _mla_batch(requests: list[tuple[int, int]], heads: int):
    """requests: (cached context, new tokens). A random latent cache with scattered blocks, this step's rows, the
    queries, kv_b_proj's weight and the metadata."""
    from surge.attention.torch_backend import TorchAttentionMetadata

    num_blocks, table, slots, qsl = scattered_blocks(requests, BLOCK)
    cache = torch.randn(1, num_blocks, BLOCK, 1, LORA + ROPE, device="cuda", dtype=DTYPE)
    t = qsl[-1]
    q = torch.randn(t, heads, NOPE + ROPE, device="cuda", dtype=DTYPE)
    rows = torch.randn(t, LORA + ROPE, device="cuda", dtype=DTYPE)
    w = torch.randn(heads * (NOPE + V_DIM), LORA, device="cuda", dtype=DTYPE) / LORA ** 0.5
    seq_lens = [c + n for c, n in requests]
    meta = TorchAttentionMetadata(
        num_reqs=len(requests), num_tokens=t, query_start_loc=qsl, seq_lens=seq_lens,
        max_query_len=max(n for _, n in requests), max_seq_len=max(seq_lens),
        query_start_loc_t=torch.tensor(qsl, dtype=torch.int32, device="cuda"),
        seq_lens_t=torch.tensor(seq_lens, dtype=torch.int32, device="cuda"),
        slot_mapping=torch.cat(slots).cuda(), block_table=table.cuda())
    return q, rows, cache, w, meta


def check_mla(quick: bool, bench: Callable, report: Callable, max_err: Callable) -> None:
    """bench, report, max_err: surge.bench.kernels' (as run, that module is __main__: its failures list is the one
    its main reads)."""
    from surge.attention.backend import AttentionParams
    from surge.attention.mla import mla_forward
    from surge.attention.triton_backend import TritonAttentionBackend, mla_warm_up_keys

    backend = TritonAttentionBackend()
    kernel = backend.mla_kernel(torch.device("cuda"))
    batches = (1, 64) if quick else (1, 8, 64, 128, 256)
    for name, heads in (("v2-lite", 16), ("v3", 128)):
        params = AttentionParams(heads, 1, NOPE + ROPE, (NOPE + ROPE) ** -0.5, head_dim_v=V_DIM, kv_lora_rank=LORA,
                                 qk_rope_head_dim=ROPE)
        kernel.compile_many(mla_warm_up_keys(kernel, (params,), BLOCK, DTYPE, list(batches), max(batches)))
        for b in batches:
            for ctx in (1024, 4096):
                q, rows, cache, w, meta = _mla_batch([(ctx - 1, 1)] * b, heads)
                got = backend.forward_mla(q, rows[:, :LORA], rows[:, LORA:], cache, meta, params, w)
                expected = mla_forward(q, rows[:, :LORA], rows[:, LORA:], cache, meta, params, w)
                # The kernel alone, over the latent queries the layer computes first: what the cache costs.
                q_lat = torch.randn(heads, b, LORA, device="cuda", dtype=DTYPE).transpose(0, 1)
                q_pe, out = q[..., NOPE:], torch.empty_like(q_lat)

                def attend():
                    kernel(q_lat, q_pe, cache[0], meta.block_table, meta.seq_lens_t, meta.query_start_loc_t,
                           num_seqs=b, decode_only=True, scale=params.scale, out=out)

                launch = kernel.dispatch(decode_only=True, num_seqs=b, num_heads=heads, kv_lora_rank=LORA,
                                         qk_rope_head_dim=ROPE, block_size=BLOCK, dtype=DTYPE).launch
                layer = bench(lambda: backend.forward_mla(q, rows[:, :LORA], rows[:, LORA:], cache, meta, params,
                                                          w))
                report(f"mla {name} decode b={b} ctx={ctx}", bench(attend),
                       nbytes=b * ctx * (LORA + ROPE) * 2 + q_lat.numel() * 2 * 2 + q_pe.numel() * 2,
                       err=max_err(got, expected), tol=0.02,
                       extra=f"splits={launch.num_splits} layer (W_UK, write, W_UV) {layer * 1e6:.1f} us")
