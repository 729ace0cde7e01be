"""HF parity for a tiny random checkpoint: Surge's logits equal HF transformers' at prefill and at every decode step
(greedy tokens are HF's argmax), with prompts longer than a block and than a 12-token sliding window, batched, with
prefill in 7-token chunks, through prefix-cache hits and preemption, and prompt logprobs; float32 throughout.

One function per check, so a family's test module is its configs and one parametrized test."""
from __future__ import annotations

import pytest
import torch

from surge import LLM, SamplingParams

ATOL = RTOL = 2e-4


def record_logits(llm: LLM) -> list[tuple[str, int, torch.Tensor]]:
    """Wrap the runner so every sampled row's logits are recorded with (request id, position of the row)."""
    runner = llm.engine.executor.runner
    records: list[tuple[str, int, torch.Tensor]] = []
    execute, compute_logits = runner.execute_async, runner.model.compute_logits  # execute() goes through it too
    pending: list[tuple[str, int]] = []

    def wrapped_execute(out):
        pending[:] = [(s.request_id, s.num_computed_tokens + s.num_new_tokens - 1)
                      for s in out.scheduled if s.samples]
        return execute(out)

    def wrapped_logits(hidden):
        logits = compute_logits(hidden)
        if pending and logits.shape[0] == len(pending):
            records.extend((rid, pos, row.float().cpu()) for (rid, pos), row in zip(pending, logits))
            pending.clear()
        return logits

    runner.execute_async, runner.model.compute_logits = wrapped_execute, wrapped_logits
    return records


def _check(name, records, prompts, outs, hf, vocab, atol=ATOL):
    ids_by_rid = {o.request_id: p + o.outputs[0].token_ids for p, o in zip(prompts, outs)}
    with torch.no_grad():
        ref = {rid: hf(torch.tensor([ids])).logits[0] for rid, ids in ids_by_rid.items()}
    assert {rid for rid, _, _ in records} == set(ref)
    for rid, pos, row in records:
        torch.testing.assert_close(row, ref[rid][pos], atol=atol, rtol=RTOL if atol == ATOL else 0,
                                   msg=lambda m, rid=rid, pos=pos: f"{name} request {rid} pos {pos}: {m}")
    for p, o in zip(prompts, outs):  # greedy tokens are the argmax of HF's logits (within atol of it, where wider)
        steps = ref[o.request_id][len(p) - 1:-1]
        if atol == ATOL:
            assert o.outputs[0].token_ids == steps.argmax(-1).tolist(), name
        else:
            picked = steps.gather(1, torch.tensor(o.outputs[0].token_ids)[:, None]).squeeze(1)
            assert bool((picked >= steps.max(-1).values - 2 * atol).all()), name


def check_every_step(name: str, path, hf, budget: int = 4096, vocab: int = 256, max_tokens: int = 24,
                     atol: float = ATOL, **engine_args) -> None:
    """Four prompts (3 to 40 tokens) in one batch, prefill in chunks of `budget` tokens. atol: wider for schemes
    that quantize activations (a rounding that float32 noise flips), the greedy tokens then within 2 * atol of HF's
    largest logit."""
    llm = LLM(path, dtype="float32", block_size=4, kv_cache_memory=1 << 22, max_num_batched_tokens=budget,
              max_model_len=256, **engine_args)
    records = record_logits(llm)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (3, 13, 29, 40)]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True),
                        use_tqdm=False)
    assert len(records) == max_tokens * len(prompts)
    _check(name, records, prompts, outs, hf, vocab, atol)


def check_prefix_hits_and_preemption(name: str, path, hf, vocab: int = 256, num_blocks: int = 40,
                                     max_model_len: int = 128, atol: float = ATOL, **engine_args) -> None:
    """A warm-up request leaves a shared prefix in the cache; then a batch larger than the KV cache is preempted and
    recomputed. The KV cache starts as NaN, as uninitialized memory may: no step may read a slot no request wrote.
    A model whose every layer slides holds only a window per request: it needs a smaller cache (num_blocks, and
    max_model_len, which the cache must hold) to be preempted. engine, tol: as check_every_step's."""
    llm = LLM(path, dtype="float32", block_size=4, num_gpu_blocks_override=num_blocks, max_num_batched_tokens=32,
              max_model_len=max_model_len, **engine_args)
    for cache in llm.engine.executor.runner.kv_caches:
        cache.fill_(float("nan"))
    g = torch.Generator().manual_seed(1)
    shared = torch.randint(3, vocab, (20,), generator=g).tolist()
    prompts = [shared + torch.randint(3, vocab, (n,), generator=g).tolist() for n in (1, 7, 12, 3, 9, 5)]
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    llm.generate([shared + [5]], greedy, use_tqdm=False)
    records = record_logits(llm)
    outs = llm.generate(prompts, greedy, use_tqdm=False)
    assert llm.engine.kv_cache_manager.prefix_hits > 0 and llm.engine.scheduler.num_preemptions > 0
    _check(name, records, prompts, outs, hf, vocab, atol)


def check_two_ranks_decode_as_one(path, abs_logprob: float = 1e-4, expert_parallel: bool = False) -> None:
    """Tensor parallelism over two CPU ranks (gloo) against one rank: the same greedy tokens, the same top-2
    logprob tokens, their logprobs within abs_logprob. expert_parallel: the two ranks hold whole experts."""
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 256, (n,), generator=g).tolist() for n in (5, 19, 33)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=2)
    outs = []
    for tp in (1, 2):
        llm = LLM(path, tensor_parallel_size=tp, enable_expert_parallel=expert_parallel and tp > 1, block_size=4,
                  max_model_len=128, device="cpu", kv_cache_memory=1 << 22, max_num_batched_tokens=24)
        try:
            outs.append(llm.generate(prompts, params, use_tqdm=False))
        finally:
            llm.engine.shutdown()
    for one, two in zip(*outs):
        assert two.outputs[0].token_ids == one.outputs[0].token_ids
        for d1, d2 in zip(one.outputs[0].logprobs, two.outputs[0].logprobs):
            assert list(d2) == list(d1)
            for tok in d1:
                assert d2[tok].logprob == pytest.approx(d1[tok].logprob, abs=abs_logprob)


def check_prompt_logprobs(name: str, path, hf) -> None:
    llm = LLM(path, dtype="float32", block_size=4, kv_cache_memory=1 << 22, max_num_batched_tokens=8,
              max_model_len=256)
    prompt = list(range(40, 70))
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=3, logprobs=2),
                       use_tqdm=False)[0]
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([prompt + out.outputs[0].token_ids])).logits[0].float(), -1)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
    for i in range(1, len(prompt)):
        entry = out.prompt_logprobs[i]
        assert entry[prompt[i]].logprob == pytest.approx(ref[i - 1, prompt[i]].item(), abs=1e-4), name
        assert set(ref[i - 1].topk(3).indices.tolist()) <= set(entry)
    for j, entry in enumerate(out.outputs[0].logprobs):
        tok = out.outputs[0].token_ids[j]
        assert entry[tok].logprob == pytest.approx(ref[len(prompt) - 1 + j, tok].item(), abs=1e-4), name
        assert entry[tok].rank == 1  # greedy picks the top token


def check_all(name: str, path, hf, preemption_blocks: int = 40, preemption_max_model_len: int = 128) -> None:
    """Every check, one engine after another (a family's one test)."""
    check_every_step(name, path, hf)
    check_every_step(name, path, hf, budget=7)
    check_prefix_hits_and_preemption(name, path, hf, num_blocks=preemption_blocks,
                                     max_model_len=preemption_max_model_len)
    check_prompt_logprobs(name, path, hf)
