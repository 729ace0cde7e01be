"""Structured output under async scheduling and tensor parallelism, on a tiny random model with a byte tokenizer:
the synchronous single-rank engine is the reference (every token identical), and every output matches its grammar."""
from __future__ import annotations

import re

import pytest
import torch
from tiny_models import make_tiny_model

from surge import LLM, SamplingParams, StructuredOutputsParams

WORDS = r"[a-z]{2,6}( [a-z]{2,6}){1,3}\."
ENGINE = {"block_size": 4, "max_model_len": 96, "kv_cache_memory": 1 << 22}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model("llama", tmp_path_factory.mktemp("llama"))


def _params() -> list[SamplingParams]:
    so = StructuredOutputsParams
    return [
        SamplingParams(temperature=0, max_tokens=40, structured_outputs=so(regex=WORDS)),
        SamplingParams(temperature=0.8, top_k=40, seed=5, max_tokens=40, structured_outputs=so(regex=WORDS)),
        SamplingParams(temperature=1.0, seed=9, max_tokens=10, structured_outputs=so(choice=["north", "south"])),
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),  # unconstrained, beside them
        SamplingParams(n=3, temperature=1.0, seed=1, max_tokens=40, logprobs=2, structured_outputs=so(regex=WORDS)),
    ]


def _run(model_dir, **kwargs):
    llm = LLM(model_dir, **{**ENGINE, **kwargs})
    prompts = [[5 + i, 40 + i, 77] for i in range(5)]
    outs = llm.generate(prompts, _params(), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests() and not llm.engine.structured_output.grammars
    assert llm.engine.kv_cache_manager.usage == 0.0
    results = [(c.token_ids, c.finish_reason, None if c.logprobs is None else
                [{t: round(lp.logprob, 4) for t, lp in d.items()} for d in c.logprobs])
               for o in outs for c in o.outputs]
    texts = [c.text for o in outs for c in o.outputs]
    for text in texts[:2] + texts[4:]:
        assert re.fullmatch(WORDS, text), text
    assert texts[2] in ("north", "south")
    # Logprobs come from the masked logits: every token they rank above -inf is one the grammar allowed there.
    allowed = {ord(c) for c in "abcdefghijklmnopqrstuvwxyz ."} | {2}
    for c in outs[4].outputs:
        assert all(t in allowed for d in c.logprobs for t, lp in d.items() if lp.logprob > float("-inf"))
    return results


@pytest.fixture(scope="module")
def reference(model_dir):
    return _run(model_dir, async_scheduling=False)


@pytest.mark.parametrize("engine_kwargs", [{}, {"num_gpu_blocks_override": 30, "kv_cache_memory": None}],
                         ids=["plain", "preempted"])
def test_async_scheduling_matches_sync(model_dir, reference, engine_kwargs):
    assert _run(model_dir, async_scheduling=True, **engine_kwargs) == reference


def test_tensor_parallel_matches_one_rank(model_dir, reference):
    """Two CPU ranks (gloo); rank 0 applies the mask, which reaches it in the step message."""
    expected = _run(model_dir, device="cpu", async_scheduling=False) if torch.cuda.is_available() else reference
    assert _run(model_dir, device="cpu", tensor_parallel_size=2, async_scheduling=True) == expected
