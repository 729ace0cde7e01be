"""The Mooncake store connector against a real Mooncake store (its master, metadata server and memory holder
started for each test on free loopback ports): a prefix outlives the engine that computed it, engines of another
layout never read it, a store that dies costs hits but no request, and a slow load lets other requests decode.
Every output is checked token for token against an engine without any connector."""
from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from surge import LLM, SamplingParams
from surge.core.request import Request, RequestStatus
from surge.kv_transfer.factory import register_connector
from surge.kv_transfer.mooncake_server import MooncakeStoreServer, free_port
from surge.kv_transfer.mooncake_store import MooncakeStoreConnector, MooncakeStoreSettings
from tiny_models import make_tiny_model

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
ENGINE = dict(block_size=4, max_model_len=256, kv_cache_memory=1 << 22, device="cpu")
PREFIX_LEN = 64
DRIVER = Path(__file__).with_name("mooncake_driver.py")


@pytest.fixture
def store(tmp_path):
    with MooncakeStoreServer(segment_size=128 << 20, log_dir=tmp_path / "mooncake") as server:
        yield server


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> Path:
    return make_tiny_model("llama", tmp_path_factory.mktemp("llama"))


def _prompts(seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    prefix = torch.randint(3, 256, (PREFIX_LEN,), generator=g).tolist()
    return [prefix + torch.randint(3, 256, (n,), generator=g).tolist() for n in (3, 7, 11, 5)]


def _tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def _reference(model_dir, prompts, params=GREEDY, **engine) -> list[list[int]]:
    return _tokens(LLM(model_dir, **{**ENGINE, **engine}).generate(prompts, params, use_tqdm=False))


class SlowMooncakeStoreConnector(MooncakeStoreConnector):
    """A slowed store: each get waits before it goes to Mooncake (on the connector's background thread)."""
    delay_s = 0.5

    def _get_into(self, keys, ptrs, sizes):
        time.sleep(self.delay_s)
        return super()._get_into(keys, ptrs, sizes)


register_connector("SlowMooncakeStoreConnector", SlowMooncakeStoreConnector)


def _slow(store: MooncakeStoreServer, **extra) -> dict:
    return {**store.connector_config(**extra), "kv_connector": "SlowMooncakeStoreConnector"}


def test_new_engine_process_loads_the_prefix_from_the_store(default_model_dir, store):
    """The issue's acceptance: engine A (the default model) serves a prompt with a 1,000-token prefix and is shut
    down; engine B, a new process, takes >= 90% of its prompts from the store, token-identical to no connector."""
    g = torch.Generator().manual_seed(3)
    prefix = torch.randint(100, 40000, (1000,), generator=g).tolist()
    prompts = [prefix + torch.randint(100, 40000, (5,), generator=g).tolist() for _ in range(3)]
    params = dict(temperature=0, max_tokens=6, ignore_eos=True)
    engine = dict(max_model_len=1100, num_gpu_blocks_override=160, block_size=16, device="cpu",
                  max_num_batched_tokens=1100)
    config = store.connector_config()
    a = LLM(default_model_dir, kv_transfer_config=config, **engine)
    a.generate(prompts[:1], SamplingParams(**params), use_tqdm=False)
    stats = a.engine.kv_connector.stats
    assert stats.saved_bytes > 0 and stats.failures == 0 and stats.external_hit_tokens == 0
    assert not a.engine.has_unfinished_requests() and a.engine.kv_cache_manager.usage == 0.0  # the put is done
    a.engine.shutdown()
    del a

    spec = {"model": str(default_model_dir), "engine": {**engine, "kv_transfer_config": config},
            "prompts": prompts[1:], "params": params}
    proc = subprocess.run([sys.executable, str(DRIVER)], input=json.dumps(spec), capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-4000:]
    b = json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("RESULT "))[7:])
    ref = _tokens(LLM(default_model_dir, **engine).generate(prompts[1:], SamplingParams(**params), use_tqdm=False))
    assert b["tokens"] == ref
    # Computed prefill dropped by >= 90%: B computed only what follows the prefix's last complete block.
    assert all(n >= 0.9 * len(prompts[1]) for n in b["num_cached_tokens"]), b["num_cached_tokens"]
    assert b["stats"]["external_hit_tokens"] >= 0.9 * len(prefix) and b["stats"]["loaded_bytes"] > 0
    assert b["stats"]["failures"] == 0 and b["failed_loads"] == 0


def test_another_layout_gets_no_hits(tiny_llama, store):
    """dtype, KV cache dtype and block size are part of every key: an engine of another layout finds nothing of A's,
    while an engine of A's layout finds it all (through a staging buffer of 5 blocks: a transfer in several
    chunks)."""
    prompts = _prompts()
    config = store.connector_config()
    small_staging = store.connector_config(staging_buffer_size=5 * 4096)  # a tiny-llama block: 4 KiB, 4 layers
    a = LLM(tiny_llama, kv_transfer_config=small_staging, **ENGINE)
    a.generate(prompts[:1], GREEDY, use_tqdm=False)
    assert a.engine.kv_connector.stats.saved_bytes == (PREFIX_LEN + 3 + 7) // 4 * 4096  # every complete block
    for layout in ({"dtype": "bfloat16"}, {"block_size": 8}, {"kv_cache_dtype": "fp8"}):
        llm = LLM(tiny_llama, kv_transfer_config=config, **{**ENGINE, **layout})
        outs = llm.generate(prompts[1:2], GREEDY, use_tqdm=False)
        assert llm.engine.kv_connector.stats.external_hit_tokens == 0, layout
        assert outs[0].num_cached_tokens == 0, layout
        assert _tokens(outs) == _reference(tiny_llama, prompts[1:2], **layout), layout
    same = LLM(tiny_llama, kv_transfer_config=small_staging, **ENGINE)
    outs = same.generate(prompts[1:2], GREEDY, use_tqdm=False)
    assert outs[0].num_cached_tokens >= 0.9 * PREFIX_LEN
    assert same.engine.kv_connector.stats.loaded_bytes == PREFIX_LEN // 4 * 4096
    assert _tokens(outs) == _reference(tiny_llama, prompts[1:2])


def test_fp8_kv_blocks_outlive_their_engine(tiny_llama, store):
    """An FP8 KV cache's blocks (float8 bytes) saved by one engine serve another of its layout, token for token."""
    prompts, fp8 = _prompts(), {"kv_cache_dtype": "fp8"}
    a = LLM(tiny_llama, kv_transfer_config=store.connector_config(), **ENGINE, **fp8)
    a.generate(prompts[:1], GREEDY, use_tqdm=False)
    assert a.engine.kv_connector.stats.saved_bytes == (PREFIX_LEN + 3 + 7) // 4 * 1024  # a quarter of float32's
    b = LLM(tiny_llama, kv_transfer_config=store.connector_config(), **ENGINE, **fp8)
    outs = b.generate(prompts[1:2], GREEDY, use_tqdm=False)
    assert outs[0].num_cached_tokens >= 0.9 * PREFIX_LEN and b.engine.kv_connector.stats.failures == 0
    assert _tokens(outs) == _reference(tiny_llama, prompts[1:2], **fp8)


def _drive(engine, requests: dict[str, list[int]], params: dict[str, SamplingParams], on_step,
           timeout: float = 60.0) -> dict[str, list[int]]:
    """Add the requests to the engine core and step it until they are done; on_step(engine, outputs) after each
    step. Returns each request's tokens."""
    for rid, prompt in requests.items():
        engine.add_request(Request(rid, prompt, params[rid], ENGINE["block_size"]))
    got = {rid: [] for rid in requests}
    deadline = time.monotonic() + timeout
    while engine.has_unfinished_requests():
        assert time.monotonic() < deadline, "the engine did not finish in time"
        outs = engine.step()
        for o in outs:
            got[o.request_id] += o.new_token_ids
        on_step(engine, outs)
    return got


def test_master_killed_mid_run(tiny_llama, store):
    """The master dies while a load is in flight: the load fails and is recomputed, lookups fail after it, every
    request completes with the same tokens, and the failures are counted."""
    prompts = _prompts(seed=1)
    ref = _reference(tiny_llama, prompts)
    llm = LLM(tiny_llama, kv_transfer_config=_slow(store), **ENGINE)
    assert _tokens(llm.generate(prompts[:1], GREEDY, use_tqdm=False)) == ref[:1]
    llm.reset_prefix_cache()
    engine = llm.engine
    killed = []

    def kill_while_loading(engine, outs):
        if not killed and engine.scheduler.waiting_for_kv:
            store.kill("master")
            killed.append(time.monotonic())

    got = _drive(engine, {"1": prompts[1]}, {"1": GREEDY}, kill_while_loading)
    assert killed and got["1"] == ref[1]
    assert engine.scheduler.num_failed_kv_loads == 1  # the load failed; the request was recomputed
    llm.reset_prefix_cache()
    outs = llm.generate(prompts[2:], GREEDY, use_tqdm=False)  # the store is gone: no hits, same tokens
    assert _tokens(outs) == ref[2:] and outs[0].num_cached_tokens == 0
    assert engine.kv_connector.stats.failures >= 2  # the failed load, then a lookup
    assert not engine.has_unfinished_requests() and engine.kv_cache_manager.usage == 0.0


def test_a_store_that_hangs_is_waited_for_a_bounded_time(tiny_llama, store):
    """A load slower than transfer_timeout_s fails and is recomputed; a master that stops answering (SIGSTOP)
    costs one lookup_timeout_s, then the store is left alone: same tokens, failures counted."""
    import signal

    prompts = _prompts(seed=3)
    ref = _reference(tiny_llama, prompts)
    llm = LLM(tiny_llama, kv_transfer_config=_slow(store, transfer_timeout_s=0.2, lookup_timeout_s=0.3), **ENGINE)
    llm.generate(prompts[:1], GREEDY, use_tqdm=False)
    llm.reset_prefix_cache()
    assert _tokens(llm.generate(prompts[1:2], GREEDY, use_tqdm=False)) == ref[1:2]
    assert llm.engine.scheduler.num_failed_kv_loads == 1  # over 0.2 s: failed, recomputed
    llm.reset_prefix_cache()
    master = store.procs["master"]
    master.send_signal(signal.SIGSTOP)
    try:
        start = time.monotonic()
        outs = llm.generate(prompts[2:], GREEDY, use_tqdm=False)
        assert time.monotonic() - start < 5  # one lookup waited 0.3 s; the rest skip the store
    finally:
        master.send_signal(signal.SIGCONT)
    # Mooncake's client may still answer a lookup from its own cache; a load then fails (the worker's client is
    # paused) and is recomputed. Either way: the same tokens.
    assert _tokens(outs) == ref[2:]
    assert llm.engine.kv_connector.stats.failures >= 2


def test_async_load_waits_while_others_decode(tiny_llama, store):
    """A slowed store: the loader waits for its KV (WAITING_FOR_REMOTE_KVS) while the decoder keeps decoding."""
    prompts = _prompts(seed=2)
    other = torch.randint(3, 256, (9,), generator=torch.Generator().manual_seed(5)).tolist()  # shares nothing
    long = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    ref_loader = _reference(tiny_llama, prompts[1:2])[0]
    ref_decoder = _reference(tiny_llama, [other], long)[0]
    llm = LLM(tiny_llama, kv_transfer_config=_slow(store), **ENGINE)
    llm.generate(prompts[:1], GREEDY, use_tqdm=False)
    llm.reset_prefix_cache()
    seen = {"waiting": False, "decoded_meanwhile": 0}

    def watch(engine, outs):
        loader = engine.scheduler.requests.get("loader")
        waiting = loader is not None and loader.status == RequestStatus.WAITING_FOR_REMOTE_KVS
        seen["waiting"] |= waiting
        seen["decoded_meanwhile"] += waiting and any(o.request_id == "decoder" and o.new_token_ids for o in outs)

    got = _drive(llm.engine, {"decoder": other, "loader": prompts[1]}, {"decoder": long, "loader": GREEDY}, watch)
    assert seen["waiting"] and seen["decoded_meanwhile"] > 0  # the decoder kept going while the loader's KV came in
    assert got["loader"] == ref_loader and got["decoder"] == ref_decoder
    stats = llm.engine.kv_connector.stats
    assert stats.external_hit_tokens >= 0.9 * PREFIX_LEN and stats.failures == 0
    assert llm.engine.scheduler.num_failed_kv_loads == 0


def test_no_master_at_start(tiny_llama):
    """Nothing listens at the master's address: the engine starts at once, serves, and counts the failure."""
    prompts = _prompts()
    config = {"kv_connector": "MooncakeStoreConnector",
              "kv_connector_extra_config": {"master": f"127.0.0.1:{free_port()}",
                                            "metadata_server": f"http://127.0.0.1:{free_port()}/metadata"}}
    start = time.monotonic()
    llm = LLM(tiny_llama, kv_transfer_config=config, **ENGINE)
    assert time.monotonic() - start < 10
    assert _tokens(llm.generate(prompts, GREEDY, use_tqdm=False)) == _reference(tiny_llama, prompts)
    assert llm.engine.kv_connector.stats.failures >= 1  # the connect; lookups are skipped while it is down


def test_a_group_the_store_cannot_keep_is_skipped(scratch_group_model, store):
    model_dir = scratch_group_model
    prompts = _prompts()
    ref = _reference(model_dir, prompts)
    config = store.connector_config()
    LLM(model_dir, kv_transfer_config=config, **ENGINE).generate(prompts[:1], GREEDY, use_tqdm=False)
    llm = LLM(model_dir, kv_transfer_config=config, **ENGINE)
    kvc = llm.engine.executor.kv_cache_config
    assert llm.engine.kv_connector.store_group_ids == kvc.prefix_cacheable_group_ids != kvc.transferable_group_ids
    outs = llm.generate(prompts[1:], GREEDY, use_tqdm=False)
    assert _tokens(outs) == ref[1:]
    stats = llm.engine.kv_connector.stats
    assert stats.external_hit_tokens == 0 and stats.saved_bytes == 0  # a hit would need the scratch group's KV


@pytest.mark.parametrize("extra, message", [
    ({"mastr": "127.0.0.1:1"}, "unknown kv_connector_extra_config keys \\['mastr'\\]"),
    ({"master": "127.0.0.1"}, "'master'\\]='127.0.0.1' must be host:port"),
    ({"global_segment_size": -1}, "'global_segment_size'\\]=-1 must be a whole number of bytes"),
    ({"lookup_timeout_s": 0}, "'lookup_timeout_s'\\]=0 must be a positive number of seconds"),
    ({"staging_buffer_size": 0}, "staging_buffer_size'\\]=0 must hold at least one block"),
])
def test_bad_settings_name_the_key(extra, message):
    with pytest.raises(ValueError, match=message):
        MooncakeStoreSettings.from_extra_config(extra)


def test_kv_store_serve_command(tmp_path):
    """`surge kv-store serve` prints a config engines can use and stops cleanly on SIGTERM."""
    import signal

    proc = subprocess.Popen([sys.executable, "-m", "surge.entrypoints.cli.main", "kv-store", "serve", "--rpc-port",
                             str(free_port()), "--metadata-port", str(free_port()), "--segment-gib", "0.05",
                             "--log-dir", str(tmp_path)], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                            text=True)
    try:
        line = proc.stdout.readline()
        assert line.startswith("Mooncake store ready."), line
        config = json.loads(line.split("--kv-transfer-config ", 1)[1].strip().strip("'"))
        assert config["kv_connector"] == "MooncakeStoreConnector"
        assert config["kv_connector_extra_config"]["master"].startswith("127.0.0.1:")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(15) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(5)
