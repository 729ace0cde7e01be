"""DeepSeek V4's kernels compile through compile_many (in parallel: each opts in) from their own dispatch keys, at
V4-Flash's shapes, and a launch after the warm-up finds its variant compiled. CUDA only: Triton's interpreter
compiles nothing (scripts/h200 v4-kernel-tests)."""
from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="compiles for the GPU")


def test_compile_many_then_launch_without_a_new_variant():
    from surge.kernels.compressor import CompressorPool
    from surge.kernels.indexer_score import IndexerScores
    from surge.kernels.indexer_topk import IndexerTopK
    from surge.kernels.mhc import MhcPre

    device, bf16 = torch.device("cuda"), torch.bfloat16
    topk, scores, pool, mhc = IndexerTopK(device), IndexerScores(device), CompressorPool(device), MhcPre(device)
    plan = [
        (topk, [topk.dispatch(max_len=n, k=512) for n in (1024, 16384)]),  # short and split
        (scores, [scores.dispatch(num_heads=64, head_dim=128, cache_block=64, max_len=16384, dtype=bf16)]),
        (pool, [pool.dispatch(rate=4, head_dim=512, rope_dim=64, overlap=True, state_block=64, dtype=bf16),
                pool.dispatch(rate=128, head_dim=512, rope_dim=64, overlap=False, state_block=128, dtype=bf16),
                pool.dispatch(rate=4, head_dim=128, rope_dim=64, overlap=True, state_block=64, dtype=bf16)]),
        (mhc, [mhc.dispatch(hc_mult=4, hidden_size=4096, sinkhorn_iters=20, dtype=bf16)]),
    ]
    for kernel, keys in plan:
        assert kernel.compile_many(keys, max_workers=4) == len(keys)
        assert all(kernel.is_compiled(k) for k in keys)
    lengths = torch.full((2,), 700, dtype=torch.int32, device=device)
    topk(torch.randn(2, 1024, device=device), lengths, 512)
    assert len(topk._compiled) == 2  # the warm-up's two variants, nothing new
