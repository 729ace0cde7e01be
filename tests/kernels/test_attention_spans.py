"""Bidirectional image spans (Gemma 3): a query inside an image sees the image's later tokens too. The Triton kernel
and the torch backend against a dense float64 reference, over spans that cross query tiles and KV tiles, spans whose
first tokens are cached (a prefix hit inside an image), two images in one request, sliding windows shorter than a
span, decode and text rows beside them, in one launch and split-KV; NaN in every slot nobody wrote."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from surge.attention.backend import AttentionParams
from surge.attention.torch_backend import TorchAttentionBackend
from test_attention import TOL, _batch, _dense_reference, _run_triton, params

# (context tokens cached, new tokens) per request, and each request's image spans [start, end) in positions.
MANY = ([(0, 45), (10, 22), (16, 1), (0, 7), (5, 30)],  # 105 tokens: one launch
        [[(3, 38)], [(6, 20)], [], [], [(8, 12), (14, 31)]])
FEW = ([(0, 20), (30, 1), (12, 10)],  # 31 tokens: split-KV on 132 SMs
       [[(2, 18)], [], [(12, 21)]])


def causal_end(requests, spans, device) -> torch.Tensor:
    """What the runner builds: each new token's last visible position if in an image (its end - 1), else 0."""
    ends = []
    for (ctx, new), request_spans in zip(requests, spans):
        for pos in range(ctx, ctx + new):
            ends.append(next((e - 1 for s, e in request_spans if s <= pos < e), 0))
    return torch.tensor(ends, dtype=torch.int32, device=device)


@pytest.mark.parametrize("window", [None, 9])
@pytest.mark.parametrize("batch,num_sms", [(MANY, None), (FEW, 132), (FEW, 1)], ids=["one-launch", "split", "few"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_bidirectional_spans_match_references(batch, num_sms, window, dtype, device):
    requests, spans = batch
    q, k, v, cache, meta, full_k, full_v = _batch(requests, 4, 8, 2, 32, dtype, device, seed=11)
    meta.causal_end = causal_end(requests, spans, device)
    layer = dataclasses.replace(params(q, cache, window, 32 ** -0.5), bidirectional_spans=True)
    zeroed = torch.nan_to_num(cache, nan=0.0)  # the torch backend reads masked slots: it needs a zeroed cache
    expected = TorchAttentionBackend().forward(q, k, v, zeroed, meta, layer)
    from surge.attention.triton_backend import TritonAttentionBackend
    backend = TritonAttentionBackend()
    if num_sms is not None:
        from surge.kernels.attention import PagedAttention
        backend._kernels[q.device] = PagedAttention(q.device, num_sms)
    got = backend.forward(q, k, v, cache, meta, layer)
    assert not got.isnan().any(), "NaN from unwritten slots leaked into the output"
    dense = _dense_reference(q, full_k, full_v, requests, window, 32 ** -0.5, causal_end=meta.causal_end.cpu())
    tol = TOL[dtype]
    torch.testing.assert_close(got.double().cpu(), dense, atol=tol, rtol=tol)
    torch.testing.assert_close(expected.double().cpu(), dense, atol=tol, rtol=tol)
    # Not vacuous: the image rows (and only they) differ from causal attention.
    causal = _dense_reference(q, full_k, full_v, requests, window, 32 ** -0.5)
    ahead = meta.causal_end.cpu() > torch.cat([torch.arange(c, c + n) for c, n in requests])
    diff = (dense - causal).abs().amax(dim=(1, 2))
    assert diff[~ahead].max() == 0 and diff[ahead].min() > 1e-3


def test_without_causal_end_a_spans_layer_is_causal(device):
    """A step with no image tokens carries no causal_end: the layer attends causally (and the kernel variant is the
    plain one)."""
    requests = MANY[0]
    q, k, v, cache, meta, full_k, full_v = _batch(requests, 4, 8, 2, 32, torch.float32, device, seed=12)
    layer = dataclasses.replace(params(q, cache, None, 32 ** -0.5), bidirectional_spans=True)
    got = _run_triton(q, k, v, cache, meta, None, 32 ** -0.5)
    from surge.attention.triton_backend import TritonAttentionBackend
    torch.testing.assert_close(TritonAttentionBackend().forward(q, k, v, cache, meta, layer), got, atol=0, rtol=0)
    dense = _dense_reference(q, full_k, full_v, requests, None, 32 ** -0.5)
    torch.testing.assert_close(got.double().cpu(), dense, atol=TOL[torch.float32], rtol=TOL[torch.float32])


def test_causal_end_is_refused_on_decode_launches(device):
    from surge.kernels.attention import PagedAttention
    q, _, _, cache, meta, _, _ = _batch([(4, 1), (9, 1)], 4, 8, 2, 32, torch.float32, device, seed=1)
    with pytest.raises(ValueError, match="causal_end"):
        PagedAttention(device, 132)(q, cache[0], cache[1], meta.block_table, meta.seq_lens_t, meta.query_start_loc_t,
                                    num_seqs=2, decode_only=True, sliding_window=None, scale=0.1,
                                    causal_end=torch.zeros(2, dtype=torch.int32, device=device))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="compiles for the GPU")
@pytest.mark.parametrize("batch", [MANY, FEW], ids=["mixed", "few-token"])
def test_warm_up_compiles_the_spans_variants(batch):
    """A layer with bidirectional spans warms up the mixed launches with causal_end too: a step computing images
    then compiles nothing."""
    from surge.attention.triton_backend import TritonAttentionBackend, warm_up_keys
    from surge.kernels.attention import PagedAttention, _merge_splits_kernel, _paged_attention_kernel
    from test_attention import _num_compiled

    device = torch.device("cuda")
    requests, spans = batch
    q, k, v, cache, meta, _, _ = _batch(requests, 16, 8, 2, 32, torch.bfloat16, device, seed=9)
    meta.causal_end = causal_end(requests, spans, device)
    layer = dataclasses.replace(params(q, cache, 9, 32 ** -0.5), bidirectional_spans=True)
    backend = TritonAttentionBackend()
    kernel = backend._kernels[q.device] = PagedAttention(q.device, 132)
    kernel.compile_many(warm_up_keys(kernel, (layer,), 16, torch.bfloat16, [], len(requests)))
    before = _num_compiled(_paged_attention_kernel), _num_compiled(_merge_splits_kernel)
    backend.forward(q, k, v, cache, meta, layer)
    torch.cuda.synchronize()
    assert (_num_compiled(_paged_attention_kernel), _num_compiled(_merge_splits_kernel)) == before


def test_warm_up_keys_add_spans_variants_of_the_mixed_launches_only():
    from surge.attention.triton_backend import warm_up_keys
    from surge.kernels.attention import PagedAttention

    kernel = PagedAttention(torch.device("cpu"), 132)
    plain = AttentionParams(8, 2, 32, 0.1, 9)
    plain_keys = set(warm_up_keys(kernel, (plain,), 16, torch.bfloat16, [1, 64], 64))
    keys = set(warm_up_keys(kernel, (dataclasses.replace(plain, bidirectional_spans=True),), 16, torch.bfloat16,
                            [1, 64], 64))
    spans = keys - plain_keys
    assert len(spans) == 2 and all(k.spans and not k.launch.decode for k in spans)  # few-token and general
    assert {dataclasses.replace(k, spans=False) for k in spans} <= plain_keys
