"""DeepSeek V4's batched Triton path in CUDA graphs (CUDA only; scripts/h200 v4-graph-tests): decode and mixed
steps replayed from graphs give the eager engine's tokens and logprobs, with padded decode rows (5 requests in the
graph of 8) and padded mixed steps (padding tokens of no request, slot -1), prompts past several HCA windows; the
warm-up compiled every V4 kernel variant the steps dispatch (no key is first seen after it)."""
from __future__ import annotations

import pytest
import torch

from surge import LLM, SamplingParams
from tiny_dsv4 import make_tiny_model

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need CUDA")


def _generate(path, enforce_eager: bool, dtype: str):
    llm = LLM(str(path), dtype=dtype, device="cuda", block_size=4, kv_cache_memory=1 << 26, max_model_len=128,
              max_num_seqs=8, max_num_batched_tokens=64, enforce_eager=enforce_eager)
    runner = llm.engine.executor.runner
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 256, (n,), generator=g).tolist() for n in (3, 13, 29, 40, 57)]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logprobs=2),
                        use_tqdm=False)
    kernels = runner.backend.deepseek_v4_kernels(torch.device("cuda"))  # the warm-up's and the launches' set
    assert kernels is runner.backend.deepseek_v4_kernels(torch.device("cuda", torch.cuda.current_device()))
    for kernel, keys in runner.model.kernel_keys(kernels, 4).items():  # launched: the warm-up's keys, no other
        assert set(kernel._compiled) == set(keys) and kernel._warmed_up, kernel.name
    return runner, outs


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_deepseek_v4_graph_replay_matches_eager(tmp_path, dtype):
    """The same tokens and logprobs; a replay's GEMMs run at the padded batch (other cuBLAS tiles than the eager
    step's), so the tokens may part only where the eager step's best two were a near-tie, and nothing is compared
    after that."""
    path = make_tiny_model("deepseek-v4", tmp_path)
    eager_runner, eager = _generate(path, True, dtype)
    runner, graphed = _generate(path, False, dtype)
    assert eager_runner.graph_runner is None
    graphs = runner.graph_runner
    assert graphs is not None and sorted(graphs.graphs) == graphs.sizes and graphs.mixed_graphs
    tol = 3e-2 if dtype == "bfloat16" else 1e-4
    for e, g in zip(eager, graphed):
        for tok_e, tok_g, de, dg in zip(e.outputs[0].token_ids, g.outputs[0].token_ids, e.outputs[0].logprobs,
                                        g.outputs[0].logprobs):
            assert dg[tok_g].logprob == pytest.approx(de[tok_e].logprob, abs=tol)
            if tok_g != tok_e:  # a near-tie in the eager step: the replay picked its runner-up
                assert tok_g in de and abs(de[tok_e].logprob - de[tok_g].logprob) < tol
                break
            for tok in set(de) & set(dg):
                assert dg[tok].logprob == pytest.approx(de[tok].logprob, abs=tol)
