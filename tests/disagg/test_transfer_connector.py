"""The Mooncake transfer connector between two engines in this process (each with its own transfer engine, over TCP
on 127.0.0.1): a prefill engine's KV read by a decode engine gives the tokens one engine alone gives, computing only
the last prompt token; the prefill side frees its blocks on the decode side's notification, on a release, or after
its timeout (counted); expired or foreign-layout params are computed locally, never read."""
from __future__ import annotations

import time

import pytest
import torch
from tiny_models import make_tiny_model

from surge import LLM, SamplingParams
from surge.kv_transfer.transfer_agent import find_agent

ENGINE = {"block_size": 4, "max_model_len": 256, "kv_cache_memory": 1 << 22, "device": "cpu"}
GREEDY = {"temperature": 0, "max_tokens": 8, "ignore_eos": True}
LENGTHS = (13, 29, 8, 4)


def _connector(role: str, **extra) -> dict:
    return {"kv_connector": "MooncakeTransferConnector", "kv_role": role, "kv_connector_extra_config": extra}


@pytest.fixture(scope="module", params=["llama", "qwen3-hybrid"])
def model_dir(request, tmp_path_factory):
    return make_tiny_model(request.param, tmp_path_factory.mktemp(request.param))


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(0)
    return [torch.randint(3, 256, (n,), generator=g).tolist() for n in LENGTHS]


@pytest.fixture(scope="module")
def reference(model_dir, prompts):
    outs = LLM(model_dir, **ENGINE).generate(prompts, SamplingParams(**GREEDY), use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def prefill(llm: LLM, prompts, **params) -> list[dict]:
    """The prefill leg: max_tokens=1 with do_remote_decode; returns each request's kv_transfer_params as soon as it
    finishes (LLM.generate would wait for the held blocks too)."""
    sp = SamplingParams(temperature=0, max_tokens=1, kv_transfer_params={"do_remote_decode": True, **params})
    ids = [llm._add_request(p, sp) for p in prompts]
    final = {}
    for _ in range(1000):
        outputs, _ = llm.output_processor.process(llm.engine.step())
        final.update({o.request_id: o for o in outputs if o.finished})
        if len(final) == len(ids):
            return [final[i].kv_transfer_params for i in ids]
    raise AssertionError("the prefill leg did not finish in 1000 steps")


def step_until(llm: LLM, condition, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        llm.engine.step()
        time.sleep(0.002)


def _decode(llm: LLM, prompts, params: list[dict]) -> list:
    return llm.generate(prompts, [SamplingParams(**GREEDY, kv_transfer_params=p) for p in params], use_tqdm=False)


@pytest.mark.parametrize("staging", [False, True], ids=["direct", "staged"])
def test_decode_reads_the_prefill_kv_and_computes_only_the_last_prompt_token(model_dir, prompts, reference,
                                                                               staging):
    """Staged: through host staging caches, as a KV cache in device memory goes (the same copies on the CPU)."""
    extra = {"staging": staging, "staging_gib": 0.002}
    p = LLM(model_dir, kv_transfer_config=_connector("kv_producer", timeout_s=30, **extra), **ENGINE)
    d = LLM(model_dir, kv_transfer_config=_connector("kv_consumer", **extra), **ENGINE)
    params = prefill(p, prompts[:1], transfer_id="t-0") + prefill(p, prompts[1:2], transfer_id="t-0")
    params += prefill(p, prompts[2:])
    assert params[0]["transfer_id"] == "t-0" and all(x["do_remote_prefill"] for x in params)
    assert len({x["transfer_id"] for x in params}) == 4  # the caller's, else (none, or one in use) fresh ones
    assert p.engine.kv_cache_manager.usage > 0  # held for the decode side
    outs = _decode(d, prompts, params)
    assert [o.outputs[0].token_ids for o in outs] == reference
    stats = d.engine.kv_connector.stats
    hybrid = "hybrid" in str(model_dir)
    if not hybrid:  # every prompt token but the last came from the prefill engine
        assert [o.num_cached_tokens for o in outs] == [n - 1 for n in LENGTHS]
        assert stats.external_hit_tokens == sum(n - 1 for n in LENGTHS) and stats.loaded_bytes > 0
    assert stats.failures == 0
    # The reads' notifications free the prefill side's blocks long before its timeout.
    step_until(p, lambda: p.engine.kv_cache_manager.usage == 0.0)
    assert p.engine.kv_connector.stats.failures == 0 and not p.engine.has_unfinished_requests()
    for llm in (p, d):  # every staging slot is back
        agent = find_agent(id(llm.config.kv_transfer_config))
        assert (agent.staging is not None) == staging
        if staging:
            assert agent._free_runs == [(1, agent.staging[0].shape[1] - 1)]


def test_unread_blocks_are_freed_after_the_timeout_and_counted(model_dir, prompts):
    p = LLM(model_dir, kv_transfer_config=_connector("kv_producer", timeout_s=0.3), **ENGINE)
    prefill(p, prompts[:2])
    assert p.engine.kv_cache_manager.usage > 0
    start = time.monotonic()
    step_until(p, lambda: not p.engine.has_unfinished_requests())
    assert 0.2 < time.monotonic() - start < 5
    assert p.engine.kv_cache_manager.usage == 0.0 and p.engine.kv_connector.stats.failures == 2


def test_expired_or_foreign_params_are_computed_not_read(model_dir, prompts, reference):
    p = LLM(model_dir, kv_transfer_config=_connector("kv_producer", timeout_s=30), **ENGINE)
    other_layout = LLM(model_dir, kv_transfer_config=_connector("kv_consumer"), **{**ENGINE, "block_size": 8})
    d = LLM(model_dir, kv_transfer_config=_connector("kv_consumer"), **ENGINE)
    params = prefill(p, prompts[:2])
    outs = _decode(other_layout, prompts[:2], params)  # another block size: the bytes would not mean the same
    assert [o.outputs[0].token_ids for o in outs] == reference[:2]
    assert other_layout.engine.kv_connector.stats.external_hit_tokens == 0
    # It never read them, so it released them: the prefill side frees at once, without a timeout.
    step_until(p, lambda: p.engine.kv_cache_manager.usage == 0.0)
    assert p.engine.kv_connector.stats.failures == 0
    expired = [{**x, "expires_at": time.time() - 1} for x in prefill(p, prompts[:1])]
    assert [o.outputs[0].token_ids for o in _decode(d, prompts[:1], expired)] == reference[:1]
    # Another prompt's params (a client's mistake): its KV would be garbage here.
    [other] = prefill(p, prompts[1:2])
    assert [o.outputs[0].token_ids for o in _decode(d, prompts[:1], [other])] == reference[:1]
    assert d.engine.kv_connector.stats.external_hit_tokens == 0


def test_a_decode_engine_of_another_kv_cache_dtype_says_so_and_computes(model_dir, prompts, caplog):
    """float32 blocks are no FP8 cache's: the decode side never reads them, names both dtypes, and releases them."""
    p = LLM(model_dir, kv_transfer_config=_connector("kv_producer", timeout_s=30), **ENGINE)
    fp8 = {**ENGINE, "kv_cache_dtype": "fp8"}
    d = LLM(model_dir, kv_transfer_config=_connector("kv_consumer"), **fp8)
    params = prefill(p, prompts[:2])
    with caplog.at_level("WARNING", logger="surge.kv_transfer.transfer_connector"):
        outs = _decode(d, prompts[:2], params)
    assert "its KV cache dtype 'float32' differs from this engine's 'float8_e4m3fn'" in caplog.text
    expected = LLM(model_dir, **fp8).generate(prompts[:2], SamplingParams(**GREEDY), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in expected]
    assert d.engine.kv_connector.stats.external_hit_tokens == 0
    step_until(p, lambda: p.engine.kv_cache_manager.usage == 0.0)
    assert p.engine.kv_connector.stats.failures == 0


def test_a_decode_request_aborted_before_its_read_releases_the_blocks(model_dir, prompts):
    p = LLM(model_dir, kv_transfer_config=_connector("kv_producer", timeout_s=30), **ENGINE)
    d = LLM(model_dir, kv_transfer_config=_connector("kv_consumer"), **ENGINE)
    [params] = prefill(p, prompts[:1])
    rid = d._add_request(prompts[0], SamplingParams(**GREEDY, kv_transfer_params=params))
    d.abort(rid)  # before any step: its read was never asked for, and no step runs after it
    step_until(p, lambda: p.engine.kv_cache_manager.usage == 0.0)
    assert p.engine.kv_connector.stats.failures == 0


def test_settings_are_checked():
    from surge.kv_transfer.transfer_connector import TransferSettings
    with pytest.raises(ValueError, match="timeout_s"):
        TransferSettings.from_extra_config({"timeout_s": 0})
    with pytest.raises(ValueError, match="unknown kv_connector_extra_config keys \\['port'\\]"):
        TransferSettings.from_extra_config({"port": 1})
