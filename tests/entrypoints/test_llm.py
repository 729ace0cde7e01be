"""surge.LLM end to end on tiny random models: scheduling choices never change greedy output, seeded sampling
ignores batch company, stop conditions and n > 1 behave as vLLM users expect, bad input is refused by name."""
from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from surge import LLM, SamplingParams
from tiny_models import make_tiny_model

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module", params=["llama", "qwen3-hybrid"])
def model_dir(request, tmp_path_factory):
    return make_tiny_model(request.param, tmp_path_factory.mktemp(request.param))


def _prompts(n: int = 6, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    shared = torch.randint(3, 256, (20,), generator=g).tolist()  # a shared prefix, for prefix-cache hits
    out = []
    for i in range(n):
        tail = torch.randint(3, 256, (int(torch.randint(1, 30, (1,), generator=g)),), generator=g).tolist()
        out.append((shared if i % 2 == 0 else []) + tail)
    return out


def _tokens(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def test_scheduling_choices_do_not_change_greedy_output(model_dir):
    prompts = _prompts()
    base = LLM(model_dir, block_size=4, enable_prefix_caching=False, kv_cache_memory=1 << 22, max_model_len=128)
    expected = _tokens(base.generate(prompts, GREEDY, use_tqdm=False))

    cached = LLM(model_dir, block_size=4, enable_prefix_caching=True, kv_cache_memory=1 << 22, max_model_len=128)
    assert _tokens(cached.generate(prompts, GREEDY, use_tqdm=False)) == expected
    second = cached.generate(prompts, GREEDY, use_tqdm=False)  # now the prompts are in the cache
    assert _tokens(second) == expected
    assert any(o.num_cached_tokens > 0 for o in second)
    assert cached.engine.kv_cache_manager.prefix_hits > 0

    for budget in (1, 5, 16):
        chunked = LLM(model_dir, block_size=4, max_num_batched_tokens=budget, kv_cache_memory=1 << 22,
                      max_model_len=128)
        assert _tokens(chunked.generate(prompts, GREEDY, use_tqdm=False)) == expected, f"budget {budget}"

    # 40 blocks of 4 tokens: the batch needs far more, so requests get preempted and recomputed.
    tight = LLM(model_dir, block_size=4, num_gpu_blocks_override=41, max_model_len=128)
    assert _tokens(tight.generate(prompts, GREEDY, use_tqdm=False)) == expected
    assert tight.engine.scheduler.num_preemptions > 0
    assert tight.engine.kv_cache_manager.usage == 0.0  # everything freed at the end


def test_seeded_sampling_ignores_batch(model_dir):
    llm = LLM(model_dir, block_size=4, kv_cache_memory=1 << 22, max_model_len=128)
    prompts = _prompts(5, seed=1)
    seeded = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=1234, max_tokens=16, ignore_eos=True)
    alone = llm.generate([prompts[0]], seeded, use_tqdm=False)[0].outputs[0].token_ids
    others = SamplingParams(temperature=1.2, max_tokens=20, ignore_eos=True)
    mixed = llm.generate(prompts[1:3] + [prompts[0]] + prompts[3:], [others, others, seeded, others, others],
                         use_tqdm=False)
    assert mixed[2].outputs[0].token_ids == alone
    unseeded = llm.generate([prompts[0]] * 3, others.clone(max_tokens=16), use_tqdm=False)
    assert len({tuple(t) for t in _tokens(unseeded)}) > 1  # sanity: sampling is random without a seed


def test_n_samples(model_dir):
    llm = LLM(model_dir, block_size=4, kv_cache_memory=1 << 22, max_model_len=128)
    out = llm.generate([[5, 6, 7, 8, 9]], SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=8,
                                                          ignore_eos=True), use_tqdm=False)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert all(len(c.token_ids) == 8 and c.finish_reason == "length" for c in out.outputs)
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    greedy = llm.generate([[5, 6, 7, 8, 9]], SamplingParams(n=2, temperature=0, max_tokens=8), use_tqdm=False)[0]
    assert greedy.outputs[0].token_ids == greedy.outputs[1].token_ids


def test_stop_conditions(model_dir):
    llm = LLM(model_dir, block_size=4, kv_cache_memory=1 << 22, max_model_len=64)
    prompt = [10, 11, 12, 13, 14, 15]
    free = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0]
    # A stop token id: generation ends right at its first occurrence (the token is kept, as in vLLM).
    stop_tok = free.token_ids[5]
    first = free.token_ids.index(stop_tok)
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[stop_tok]),
                       use_tqdm=False)[0].outputs[0]
    assert out.token_ids == free.token_ids[:first + 1] and out.finish_reason == "stop"
    assert out.stop_reason == stop_tok
    # min_tokens keeps the stop token from ending generation early.
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[stop_tok],
                                                min_tokens=first + 1), use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) > first + 1
    # A stop string spanning tokens: text ends before it.
    text = free.text
    stop = text[4:7]
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=30, stop=[stop], ignore_eos=True),
                       use_tqdm=False)[0].outputs[0]
    assert out.text == text[:text.index(stop)] and out.finish_reason == "stop" and out.stop_reason == stop
    # max_model_len ends generation with "length".
    out = llm.generate([list(range(3, 60))], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True),
                       use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 64 - 57 and out.finish_reason == "length"


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_max_tokens_zero_scores_the_prompt_only(model_dir, async_scheduling):
    """max_tokens=0: the prompt's logprobs (HF's), nothing generated; prompts longer than a step's budget take
    several chunks, beside requests that do generate."""
    # float32 on every device: the logprobs are compared with HF's float32 ones to 1e-4 (bf16 on a GPU would round
    # differently with every GEMM shape, e.g. a CUDA graph's padded one).
    llm = LLM(model_dir, dtype="float32", block_size=4, kv_cache_memory=1 << 22, max_model_len=128,
              max_num_batched_tokens=16, async_scheduling=async_scheduling)
    prompts = _prompts()
    scoring = SamplingParams(max_tokens=0, prompt_logprobs=1)
    outs = llm.generate(prompts, [scoring if i % 3 else GREEDY for i in range(len(prompts))], use_tqdm=False)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    for i, (prompt, out) in enumerate(zip(prompts, outs)):
        if i % 3 == 0:
            assert len(out.outputs[0].token_ids) == GREEDY.max_tokens
            continue
        assert (out.outputs[0].token_ids, out.outputs[0].text, out.outputs[0].finish_reason) == ([], "", "length")
        with torch.inference_mode():
            ref = torch.log_softmax(hf(torch.tensor([prompt])).logits[0].double(), dim=-1)
        assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
        for j in range(1, len(prompt)):
            assert out.prompt_logprobs[j][prompt[j]].logprob == pytest.approx(ref[j - 1, prompt[j]].item(), abs=1e-4)
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.kv_cache_manager.usage == 0.0


def test_abort_frees_blocks(model_dir):
    llm = LLM(model_dir, block_size=4, kv_cache_memory=1 << 22, max_model_len=128)
    rid = llm._add_request([5, 6, 7, 8, 9, 10], SamplingParams(max_tokens=50, ignore_eos=True))
    llm._add_request([5, 6, 7], SamplingParams(max_tokens=50, ignore_eos=True))
    llm.engine.step()
    assert llm.engine.kv_cache_manager.usage > 0
    llm.abort(rid)
    llm.abort("1")
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.kv_cache_manager.usage == 0.0


@pytest.mark.parametrize("kwargs, name", [
    (dict(temperature=-1), "temperature"), (dict(top_p=0), "top_p"), (dict(top_k=-5), "top_k"),
    (dict(min_p=2), "min_p"), (dict(max_tokens=-1), "max_tokens"), (dict(n=0), "n"),
    (dict(temperature=float("inf")), "temperature"), (dict(temperature=float("nan")), "temperature"),
    (dict(top_p=float("nan")), "top_p"), (dict(repetition_penalty=float("inf")), "repetition_penalty"),
    (dict(presence_penalty=3), "presence_penalty"), (dict(repetition_penalty=0), "repetition_penalty"),
    (dict(logprobs=99), "logprobs"), (dict(min_tokens=5, max_tokens=2), "min_tokens"), (dict(stop=[""]), "stop"),
])
def test_invalid_sampling_params_name_the_parameter(kwargs, name):
    with pytest.raises(ValueError, match=name):
        SamplingParams(**kwargs)


def test_invalid_engine_arguments(model_dir, tmp_path):
    with pytest.raises(ValueError, match="dtype"):
        LLM(model_dir, dtype="int3")
    with pytest.raises(ValueError, match="not a directory"):
        LLM(tmp_path / "nope")
    with pytest.raises(ValueError, match="block_size"):
        LLM(model_dir, block_size=3)
    llm = LLM(model_dir, block_size=4, kv_cache_memory=1 << 22, max_model_len=32)
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate([list(range(3, 40))], GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="vocabulary"):
        llm.generate([[1, 2, 100000]], GREEDY, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
