"""The CPU offload tier: prefixes evicted from the KV cache come back from host memory, token-identical to a run
without any connector (an MLA model's latent cache too); loads may run in the background while other requests decode;
a model with a KV group the store cannot keep starts, serves, and takes no hits."""
from __future__ import annotations

import time

import pytest
import torch

from surge import LLM, SamplingParams
from surge.core.request import RequestStatus
from surge.kv_transfer.factory import register_connector
from surge.kv_transfer.offload import OffloadingConnector
from tiny_dsv import make_tiny_model as make_tiny_deepseek
from tiny_models import make_tiny_model

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
ENGINE = dict(block_size=4, max_model_len=256, kv_cache_memory=1 << 22, device="cpu")
PREFIX_LEN = 64


@pytest.fixture(scope="module", params=["llama", "qwen3-hybrid"])
def model_dir(request, tmp_path_factory):
    return make_tiny_model(request.param, tmp_path_factory.mktemp(request.param))


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    prefix = torch.randint(3, 256, (PREFIX_LEN,), generator=g).tolist()
    return [prefix + torch.randint(3, 256, (n,), generator=g).tolist() for n in (3, 7, 11, 5)]


def _tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def _offload(asynchronous: bool = False, **extra) -> dict:
    return {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
            "kv_connector_extra_config": {"cpu_gib": 0.01, "async_load": asynchronous, **extra}}


@pytest.mark.parametrize("asynchronous,kv_cache_dtype", [(False, "auto"), (True, "auto"), (False, "fp8")],
                         ids=["sync", "async", "sync-fp8"])
def test_evicted_prefix_comes_back_from_host_memory(model_dir, asynchronous, kv_cache_dtype):
    prompts = _prompts()
    engine = {**ENGINE, "kv_cache_dtype": kv_cache_dtype}
    ref = _tokens(LLM(model_dir, **engine).generate(prompts, GREEDY, use_tqdm=False))
    llm = LLM(model_dir, kv_transfer_config=_offload(asynchronous), **engine)
    assert _tokens(llm.generate(prompts[:1], GREEDY, use_tqdm=False)) == ref[:1]
    assert llm.engine.kv_cache_manager.usage == 0.0  # the save is done: the held blocks went back
    assert llm.reset_prefix_cache()  # the KV cache forgets every prefix: only the offload tier has it
    outs = llm.generate(prompts[1:], GREEDY, use_tqdm=False)
    assert _tokens(outs) == ref[1:]
    stats = llm.engine.kv_connector.stats
    assert stats.saved_bytes > 0 and stats.failures == 0
    if "hybrid" not in str(model_dir):
        # The prefix's complete blocks (all but the last prompt token's) were loaded, not computed.
        assert all(o.num_cached_tokens >= 0.9 * PREFIX_LEN for o in outs), [o.num_cached_tokens for o in outs]
        assert stats.external_hit_tokens >= 0.9 * PREFIX_LEN and stats.loaded_bytes > 0
    # A sliding-window group keeps only the blocks its window held when the request finished, so the hybrid
    # model's hit at the shared prefix's end is not served (the window there was gone): it recomputes, identically.
    assert llm.engine.kv_cache_manager.usage == 0.0 and not llm.engine.has_unfinished_requests()


def test_mla_latent_blocks_come_back_from_host_memory(tmp_path):
    """DeepSeek V3's one-plane latent cache (MLAAttentionSpec) through the same pool: the prefix loaded, not
    computed, and the tokens those of a run without the tier."""
    model_dir = make_tiny_deepseek("deepseek-v3", tmp_path / "deepseek-v3")
    prompts = _prompts()
    ref = _tokens(LLM(model_dir, **ENGINE).generate(prompts, GREEDY, use_tqdm=False))
    llm = LLM(model_dir, kv_transfer_config=_offload(), **ENGINE)
    assert _tokens(llm.generate(prompts[:1], GREEDY, use_tqdm=False)) == ref[:1]
    assert llm.reset_prefix_cache()
    outs = llm.generate(prompts[1:], GREEDY, use_tqdm=False)
    assert _tokens(outs) == ref[1:]
    stats = llm.engine.kv_connector.stats
    assert stats.failures == 0 and stats.loaded_bytes > 0
    assert all(o.num_cached_tokens >= 0.9 * PREFIX_LEN for o in outs), [o.num_cached_tokens for o in outs]


def test_pool_evicts_least_recently_used(tmp_path):
    """A pool of a few blocks: the oldest prefix is overwritten by newer ones, and outputs stay identical."""
    model_dir = make_tiny_model("llama", tmp_path / "llama")
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 256, (40,), generator=g).tolist() for _ in range(6)]
    ref = _tokens(LLM(model_dir, **ENGINE).generate(prompts, GREEDY, use_tqdm=False))
    llm = LLM(model_dir, kv_transfer_config=_offload(), **ENGINE)
    connector = llm.engine.kv_connector
    connector._free_slots = connector._free_slots[-12:]  # 12 slots: about one prompt's blocks
    connector.num_slots = 12
    for p in prompts:
        llm.generate([p], GREEDY, use_tqdm=False)
        llm.reset_prefix_cache()
    assert len(connector._index) <= 12
    again = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert _tokens(again) == ref
    assert again[-1].num_cached_tokens > 0 and again[0].num_cached_tokens == 0  # newest kept, oldest evicted


class SlowOffloadingConnector(OffloadingConnector):
    """A slowed store: each background load takes a while."""

    def _copy_in(self, job):
        time.sleep(0.5)
        super()._copy_in(job)


def test_async_load_waits_while_others_decode(tmp_path):
    from surge.core.request import Request

    model_dir = make_tiny_model("llama", tmp_path / "llama")

    register_connector("SlowOffloadingConnector", SlowOffloadingConnector)
    prompts = _prompts()
    other = torch.randint(3, 256, (9,), generator=torch.Generator().manual_seed(5)).tolist()  # shares nothing
    long = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    ref = LLM(model_dir, **ENGINE)
    ref_loader = _tokens(ref.generate([prompts[1]], GREEDY, use_tqdm=False))[0]
    ref_decoder = _tokens(ref.generate([other], long, use_tqdm=False))[0]
    config = {**_offload(True), "kv_connector": "SlowOffloadingConnector"}
    llm = LLM(model_dir, kv_transfer_config=config, **ENGINE)
    llm.generate(prompts[:1], GREEDY, use_tqdm=False)
    llm.reset_prefix_cache()
    engine = llm.engine
    engine.add_request(Request("decoder", other, long, 4))
    engine.add_request(Request("loader", prompts[1], GREEDY, 4))
    seen_waiting, decoded_meanwhile, got = False, 0, {"decoder": [], "loader": []}
    deadline = time.monotonic() + 60
    while engine.has_unfinished_requests() and time.monotonic() < deadline:
        outs = engine.step()
        loader = engine.scheduler.requests.get("loader")
        waiting = loader is not None and loader.status == RequestStatus.WAITING_FOR_REMOTE_KVS
        seen_waiting |= waiting
        for o in outs:
            got[o.request_id] += o.new_token_ids
            if waiting and o.request_id == "decoder" and o.new_token_ids:
                decoded_meanwhile += 1
    assert seen_waiting and decoded_meanwhile > 0  # the decoder kept going while the loader's KV came in
    assert got["loader"] == ref_loader and got["decoder"] == ref_decoder
    assert engine.kv_connector.stats.external_hit_tokens >= 0.9 * PREFIX_LEN


def test_a_group_the_store_cannot_keep_is_skipped(scratch_group_model):
    model_dir = scratch_group_model
    prompts = _prompts()
    ref = _tokens(LLM(model_dir, **ENGINE).generate(prompts, GREEDY, use_tqdm=False))
    llm = LLM(model_dir, kv_transfer_config=_offload(), **ENGINE)
    kvc = llm.engine.executor.kv_cache_config
    assert kvc.transferable_group_ids != kvc.prefix_cacheable_group_ids  # the scratch group is in the model
    assert llm.engine.kv_connector.store_group_ids == kvc.prefix_cacheable_group_ids
    llm.generate(prompts[:1], GREEDY, use_tqdm=False)
    llm.reset_prefix_cache()
    outs = llm.generate(prompts[1:], GREEDY, use_tqdm=False)
    assert _tokens(outs) == ref[1:]
    assert llm.engine.kv_connector.stats.external_hit_tokens == 0  # a hit would need the scratch group's KV
    assert all(o.num_cached_tokens == 0 for o in outs)


def test_default_model_prefix_evicted_from_the_kv_cache(default_model_dir):
    """The default model, prompts sharing a 1,000-token prefix; other traffic then evicts the prefix from the KV
    cache (its blocks are reused, not reset): the offload tier supplies >= 90% of the later prompts' tokens."""
    g = torch.Generator().manual_seed(2)
    prefix = torch.randint(100, 40000, (1000,), generator=g).tolist()
    prompts = [prefix + torch.randint(100, 40000, (5,), generator=g).tolist() for _ in range(3)]
    flood = [torch.randint(100, 40000, (300,), generator=g).tolist() for _ in range(4)]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    engine = dict(max_model_len=1100, num_gpu_blocks_override=80, block_size=16, device="cpu",
                  max_num_batched_tokens=1100)  # 79 blocks: the prefix (63) cannot stay beside the flood
    ref = _tokens(LLM(default_model_dir, **engine).generate(prompts, params, use_tqdm=False))
    llm = LLM(default_model_dir, kv_offload_gib=0.25, **engine)
    assert _tokens(llm.generate(prompts[:1], params, use_tqdm=False)) == ref[:1]
    llm.generate(flood, params, use_tqdm=False)
    outs = llm.generate(prompts[1:], params, use_tqdm=False)
    assert _tokens(outs) == ref[1:]
    for o in outs:
        assert o.num_cached_tokens >= 0.9 * len(prompts[1]), o.num_cached_tokens  # computed prefill dropped >= 90%
    stats = llm.engine.kv_connector.stats
    assert stats.external_hit_tokens >= 0.9 * 1000 and stats.failures == 0


def test_tensor_parallel_ranks_load_their_shards(tmp_path):
    model_dir = make_tiny_model("llama", tmp_path / "llama")
    prompts = _prompts()
    ref = _tokens(LLM(model_dir, **ENGINE).generate(prompts, GREEDY, use_tqdm=False))
    llm = LLM(model_dir, tensor_parallel_size=2, kv_transfer_config=_offload(), **ENGINE)
    try:
        assert _tokens(llm.generate(prompts[:1], GREEDY, use_tqdm=False)) == ref[:1]
        assert llm.reset_prefix_cache()
        outs = llm.generate(prompts[1:], GREEDY, use_tqdm=False)
        assert _tokens(outs) == ref[1:]
        assert all(o.num_cached_tokens >= 0.9 * PREFIX_LEN for o in outs)
        assert llm.engine.kv_cache_manager.usage == 0.0
    finally:
        llm.engine.shutdown()


def test_server_metrics_show_the_connector(tiny_model_dir):
    """/metrics with a connector: vLLM's external prefix cache counters and what the connector moved."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families
    from remote_server import RemoteServer

    with RemoteServer(tiny_model_dir, "--served-model-name", "tiny", "--max-model-len", "256", "--kv-cache-memory",
                      str(8 << 20), "--block-size", "4", "--kv-offload-gib", "0.01") as server:
        body = {"model": "tiny", "prompt": list(range(3, 60)), "max_tokens": 4, "temperature": 0}
        for _ in range(2):
            assert httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).status_code == 200
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # the save of the finished request lands within a step or two
            fams = {f.name: f for f in text_string_to_metric_families(httpx.get(f"{server.url}/metrics").text)}
            saved = sum(s.value for s in fams["surge:kv_connector_saved_bytes"].samples)
            if saved > 0:
                break
            time.sleep(0.2)
        assert saved > 0
        assert {"surge:external_prefix_cache_queries", "surge:external_prefix_cache_hits",
                "surge:kv_connector_loaded_bytes", "surge:kv_connector_failures",
                "surge:kv_connector_storage_usage_perc"} <= set(fams)
        usage = [s.value for s in fams["surge:kv_connector_storage_usage_perc"].samples]
        assert usage and 0 < usage[0] <= 1
