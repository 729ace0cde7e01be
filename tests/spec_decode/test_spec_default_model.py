"""The default model (SmolLM2-135M, real weights) with both proposers: greedy output identical to decoding without
speculation on prompts that quote a passage (the benchmark's workload), drafts accepted; the draft model being the
target itself, every proposal accepted."""
from __future__ import annotations

import pytest

from surge import LLM, SamplingParams
from surge.bench.speculative import INSTRUCTIONS, PASSAGES

ENGINE = {"dtype": "float32", "max_model_len": 512, "kv_cache_memory": 64 << 20}


@pytest.fixture(scope="module")
def prompts(default_model_dir):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(default_model_dir)
    texts = [tok.apply_chat_template([{"role": "user", "content": f"{p}\n\n{INSTRUCTIONS[i]}"}], tokenize=False,
                                     add_generation_prompt=True) for i, p in enumerate(PASSAGES[:2])]
    return [tok(t, add_special_tokens=False)["input_ids"] for t in texts]


@pytest.fixture(scope="module")
def reference(default_model_dir, prompts):
    params = SamplingParams(temperature=0, max_tokens=24)
    return [o.outputs[0].token_ids for o in LLM(default_model_dir, **ENGINE).generate(prompts, params,
                                                                                       use_tqdm=False)]


@pytest.mark.parametrize("k", [1, 3, 5])
@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_greedy_identical_on_the_default_model(default_model_dir, prompts, reference, method, k):
    spec = {"method": method, "num_speculative_tokens": k}
    if method == "draft_model":
        spec["model"] = str(default_model_dir)
    llm = LLM(default_model_dir, speculative_config=spec, **ENGINE)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == reference
    stats = llm.engine.scheduler.spec_stats
    assert stats.num_accepted_tokens > 0
    if method == "draft_model":
        assert stats.num_accepted_tokens == stats.num_draft_tokens
