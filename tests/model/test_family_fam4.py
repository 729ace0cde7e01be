"""OLMo, OLMo 2, OLMo 3, OLMoE, Cohere, GLM, GLM-4 and ERNIE 4.5: tiny random checkpoints match HF transformers
through every parity check (tests/hf_parity.py); config values Surge does not implement are refused by name."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from transformers import AutoModelForCausalLM

from hf_parity import check_all, check_two_ranks_decode_as_one
from surge.distributed import parallel_state
from surge.distributed.parallel_state import TPGroup
from surge.engine.args import read_model_config
from surge.model.models.registry import get_model_class
from surge.model.models.olmo import OlmoAttention
from tiny_fam4 import TINY_CONFIGS, make_tiny_model

KINDS = list(TINY_CONFIGS)


@pytest.fixture(scope="module", params=KINDS)
def tiny(request, tmp_path_factory):
    path = make_tiny_model(request.param, tmp_path_factory.mktemp(request.param))
    return request.param, path, AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def test_matches_hf(tiny):
    check_all(*tiny)


# ---- tensor parallelism of the whole-projection QK-norm (OLMo 2, OLMo 3, OLMoE) ----

@pytest.mark.parametrize("tp, num_kv_heads", [(2, 2), (4, 2), (2, 1), (4, 1), (2, 3)])
def test_projection_norm_split_over_ranks_equals_the_whole(monkeypatch, tp, num_kv_heads):
    """Each simulated rank loads its slice of the norm weights and normalizes its heads with the sum of squares of
    the whole projection (the all-reduce stands in: every rank's share, summed); the slices equal the one-rank norm
    of the whole q and k projections, including KV heads replicated over ranks and KV heads split unevenly."""
    torch.manual_seed(0)
    heads, d = 6 if num_kv_heads == 3 else 4, 8
    tc = SimpleNamespace(hidden_size=32, num_attention_heads=heads, num_key_value_heads=num_kv_heads, head_dim=d,
                         rms_norm_eps=1e-6)
    q, k = torch.randn(5, heads * d), torch.randn(5, num_kv_heads * d)
    wq, wk = torch.rand(heads * d) + 0.5, torch.rand(num_kv_heads * d) + 0.5

    def reference(x, w):
        return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))

    def rank_norms(rank):
        monkeypatch.setattr(parallel_state, "_TP", TPGroup(rank=rank, world_size=tp))
        attn = OlmoAttention(tc, None, None, bias=False, projection_norm=True, clip_qkv=None)
        for norm, w in ((attn.q_norm, wq), (attn.k_norm, wk)):
            norm.weight.weight_loader(norm.weight, w)
        sh = attn.qkv_proj.shard
        q_slice = q[:, sh.q_start * d:(sh.q_start + sh.q_count) * d]
        return attn, q_slice, k[:, sh.kv_start * d:(sh.kv_start + sh.kv_count) * d]

    ranks = [rank_norms(r) for r in range(tp)]
    totals = [sum(attn.q_norm.sum_of_squares(qs) for attn, qs, _ in ranks),
              sum(attn.k_norm.sum_of_squares(ks) for attn, _, ks in ranks)]
    for attn, qs, ks in ranks:
        sh = attn.qkv_proj.shard
        for norm, x, total, ref, start in ((attn.q_norm, qs, totals[0], reference(q, wq), sh.q_start),
                                           (attn.k_norm, ks, totals[1], reference(k, wk), sh.kv_start)):
            monkeypatch.setattr(TPGroup, "all_reduce", lambda self, t, total=total: total.clone())
            torch.testing.assert_close(norm(x), ref[:, start * d:start * d + x.shape[1]])


@pytest.mark.parametrize("kind", ["olmo2", "cohere-qk-norm"])
def test_qk_norms_over_two_ranks_match_one_rank(kind, tmp_path):
    """OLMo 2's whole-projection norms (an all-reduce of the sums of squares) and Cohere's per-head norms (split by
    heads) over two ranks (gloo): the same greedy tokens and logprobs as one rank."""
    check_two_ranks_decode_as_one(make_tiny_model(kind, tmp_path / kind))


@pytest.mark.parametrize("field, value", [("hidden_act", "gelu"), ("sliding_window", 12)])
def test_olmoe_refuses_what_it_does_not_implement(tmp_path, field, value):
    path = make_tiny_model("olmoe", tmp_path / "olmoe", **{field: value})
    mc = read_model_config(path, "float32", torch.device("cpu"))
    with pytest.raises(ValueError, match=f"{field}={value!r}"):
        get_model_class(mc.architecture)(mc)
