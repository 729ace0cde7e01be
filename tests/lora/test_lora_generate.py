"""LoRA end to end on a tiny Llama: each prompt's greedy output in a batch that mixes the base model and several
PEFT adapters (different ranks, alpha != r, rsLoRA, attention-only) equals HF's with that adapter merged, float32;
through chunked prefill, preemption, adapter swapping past max_loras, and a prefix cache never shared across
adapters; bad adapters are refused by name."""
from __future__ import annotations

import json
import shutil

import pytest
import torch

from surge import LLM, LoRARequest, SamplingParams
from tiny_lora import ATTENTION, hf_greedy, make_adapter, merged_hf_model
from tiny_models import make_tiny_model

MAX_TOKENS = 12
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
    return make_tiny_model("llama", tmp_path_factory.mktemp("llama"))


@pytest.fixture(scope="module")
def adapters(base_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    return {
        "r8": make_adapter(root / "r8", base_dir, rank=8, alpha=16, seed=1),
        "r4-rslora": make_adapter(root / "r4", base_dir, rank=4, alpha=6, use_rslora=True, seed=2),
        "r16-attn": make_adapter(root / "r16", base_dir, rank=16, alpha=8, targets=ATTENTION, seed=3),
    }


def _requests(adapters) -> dict[str, LoRARequest]:
    return {name: LoRARequest(name, i + 1, str(path)) for i, (name, path) in enumerate(adapters.items())}


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 256, (int(torch.randint(3, 30, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


@pytest.fixture(scope="module")
def expected(base_dir, adapters):
    """HF's greedy tokens of each prompt under each adapter (None: the base model)."""
    prompts = _prompts(4)
    out = {}
    for name in [None, *adapters]:
        model = merged_hf_model(base_dir, None if name is None else adapters[name])
        out[name] = [hf_greedy(model, p, MAX_TOKENS) for p in prompts]
    assert all(out[name] != out[None] for name in adapters)  # each adapter changes the output
    return prompts, out


def _mixed_batch(prompts, names, requests):
    """Every prompt under every adapter and the base, interleaved."""
    rows = [(i, name) for i in range(len(prompts)) for name in names]
    return rows, [prompts[i] for i, _ in rows], [None if n is None else requests[n] for _, n in rows]


@pytest.mark.parametrize("engine", [
    dict(max_loras=3),  # every adapter in one step
    dict(max_loras=1, max_cpu_loras=1),  # one adapter per step, swapped in and out of slot and host memory
    dict(max_loras=2, max_num_batched_tokens=7),  # chunked prefill
    dict(max_loras=3, num_gpu_blocks_override=17, max_num_seqs=16),  # preemption
    dict(max_loras=3, speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                          "prompt_lookup_min": 1}),  # drafts verified under each adapter
    # drafts of the base model itself (no adapter: a draft only proposes), verified under each request's adapter
    dict(max_loras=3, speculative_config={"method": "draft_model", "model": "BASE", "num_speculative_tokens": 3}),
    dict(max_loras=2, tensor_parallel_size=2),  # A and B sharded as the base layers
], ids=["all", "swap", "chunked", "preempt", "ngram", "draft", "tp2"])
def test_mixed_batch_matches_hf_merged(base_dir, adapters, expected, engine):
    prompts, reference = expected
    requests = _requests(adapters)
    if engine.get("speculative_config", {}).get("model") == "BASE":
        engine = {**engine, "speculative_config": {**engine["speculative_config"], "model": str(base_dir)}}
    llm = LLM(base_dir, dtype="float32", enable_lora=True, max_lora_rank=16, block_size=4, max_model_len=64,
              kv_cache_memory=1 << 22, **engine)
    rows, batch, loras = _mixed_batch(prompts, [None, *adapters], requests)
    outs = llm.generate(batch, GREEDY, use_tqdm=False, lora_request=loras)
    for (i, name), out in zip(rows, outs):
        assert out.outputs[0].token_ids == reference[name][i], (i, name)
    if "num_gpu_blocks_override" in engine:
        assert llm.engine.scheduler.num_preemptions > 0
    if "speculative_config" in engine:
        stats = llm.engine.scheduler.spec_stats
        assert stats.num_draft_tokens > 0 and stats.num_accepted_tokens > 0


def test_unloaded_adapter_frees_its_slot_and_reloads_afresh(base_dir, adapters, expected, tmp_path):
    """EngineCore.remove_lora (the server's unload): the runner drops the adapter's slot and host copy at the next
    step no request of it is in, so the same name and id then read new files."""
    from surge.core.request import Request

    prompts, reference = expected
    llm = LLM(base_dir, dtype="float32",
              enable_lora=True, max_loras=2, max_lora_rank=16, block_size=4, max_model_len=64,
              kv_cache_memory=1 << 22)
    engine, manager = llm.engine, llm.engine.executor.runner.lora
    path = tmp_path / "a"
    shutil.copytree(adapters["r8"], path)
    lora = LoRARequest("a", 7, str(path))
    engine.add_request(Request("x", prompts[0], GREEDY, 4, lora_request=lora))
    stats = engine.get_stats()  # vLLM's lora_requests_info labels
    assert (stats.waiting_lora_adapters, stats.running_lora_adapters) == (["a"], [])
    assert engine.remove_lora(7)
    tokens = [t for o in engine.step() for t in o.new_token_ids]
    stats = engine.get_stats()
    assert (stats.waiting_lora_adapters, stats.running_lora_adapters) == ([], ["a"])
    while engine.has_unfinished_requests():  # its request keeps the adapter until it ends
        tokens += [t for o in engine.step() for t in o.new_token_ids]
        assert 7 in manager.slot_of or not engine.has_unfinished_requests()
    assert tokens == reference["r8"][0]
    assert 7 in manager.slot_of and 7 in manager.loaded
    llm.generate(prompts[:1], GREEDY, use_tqdm=False)  # the next step frees it
    assert 7 not in manager.slot_of and 7 not in manager.loaded and len(manager.free_slots) == 2
    shutil.rmtree(path)
    shutil.copytree(adapters["r4-rslora"], path)  # new weights under the same name and id
    # The prefix cache keys blocks by (name, id): the server gives a reloaded adapter a new id; here the cache goes.
    llm.reset_prefix_cache()
    out = llm.generate(prompts[:1], GREEDY, use_tqdm=False, lora_request=lora)[0]
    assert out.outputs[0].token_ids == reference["r4-rslora"][0]


def test_one_adapter_for_every_prompt_and_chat(base_dir, adapters, expected):
    prompts, reference = expected
    lora = _requests(adapters)["r8"]
    llm = LLM(base_dir, dtype="float32",
              enable_lora=True, max_lora_rank=8, block_size=4, max_model_len=64, kv_cache_memory=1 << 22)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=lora)
    assert [o.outputs[0].token_ids for o in outs] == reference["r8"]


def test_prefix_cache_is_never_shared_across_adapters(base_dir, adapters, expected):
    prompts, reference = expected
    requests = _requests(adapters)
    llm = LLM(base_dir, dtype="float32",
              enable_lora=True, max_loras=2, max_lora_rank=16, block_size=4, max_model_len=64,
              kv_cache_memory=1 << 22)
    prompt = prompts[1]  # 4+ full blocks
    first = llm.generate([prompt], GREEDY, use_tqdm=False, lora_request=requests["r8"])[0]
    assert first.outputs[0].token_ids == reference["r8"][1]
    other = llm.generate([prompt], GREEDY, use_tqdm=False, lora_request=requests["r4-rslora"])[0]
    assert other.num_cached_tokens == 0
    assert other.outputs[0].token_ids == reference["r4-rslora"][1]
    base = llm.generate([prompt, prompt], GREEDY, use_tqdm=False)
    assert base[0].num_cached_tokens == 0 and base[1].num_cached_tokens > 0  # base requests still share
    assert [o.outputs[0].token_ids for o in base] == [reference[None][1]] * 2
    again = llm.generate([prompt], GREEDY, use_tqdm=False, lora_request=requests["r8"])[0]
    assert again.num_cached_tokens > 0 and again.outputs[0].token_ids == reference["r8"][1]


def test_bad_adapters_are_refused_by_name(base_dir, adapters, tmp_path):
    llm = LLM(base_dir, dtype="float32",
              enable_lora=True, max_lora_rank=8, block_size=4, max_model_len=64, kv_cache_memory=1 << 22)
    with pytest.raises(ValueError, match=r"rank r=16, greater than max_lora_rank=8"):
        llm.generate([[5, 6, 7]], GREEDY, use_tqdm=False, lora_request=LoRARequest("big", 1, str(adapters["r16-attn"])))
    bad = make_adapter(tmp_path / "bad", base_dir, rank=4, alpha=4, targets=("q_proj",))
    cfg = json.loads((bad / "adapter_config.json").read_text())
    for change, message in [({"target_modules": ["q_proj", "foo_proj"]}, "target module 'foo_proj' is not a linear"),
                            ({"use_dora": True}, "use_dora=true"),
                            ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
                            ({"target_modules": ["q_proj", "embed_tokens"]}, "embeddings")]:
        (bad / "adapter_config.json").write_text(json.dumps({**cfg, **change}))
        with pytest.raises(ValueError, match=message):
            llm.generate([[5, 6, 7]], GREEDY, use_tqdm=False, lora_request=LoRARequest(message, 2, str(bad)))
    with pytest.raises(ValueError, match="not a directory"):
        llm.generate([[5, 6, 7]], GREEDY, use_tqdm=False, lora_request=LoRARequest("x", 3, str(tmp_path / "none")))
    base_only = LLM(base_dir, dtype="float32", block_size=4, max_model_len=64, kv_cache_memory=1 << 22)
    with pytest.raises(ValueError, match="enable_lora=True"):
        base_only.generate([[5, 6, 7]], GREEDY, use_tqdm=False, lora_request=LoRARequest("r8", 1, str(adapters["r8"])))
    assert not llm.engine.has_unfinished_requests()
