"""The scheduler under LoRA: at most max_loras distinct adapters among the running requests (so in any step), a
request whose adapter does not fit waiting without holding up those behind it, in arrival order once it fits; the
adapter in every block hash, so two adapters never share a cached prefix while base requests still do."""
from __future__ import annotations

import torch

from surge.config import SchedulerConfig
from surge.core.kv_cache.manager import KVCacheManager
from surge.core.kv_cache.spec import FullAttentionSpec, KVCacheConfig, build_kv_cache_groups
from surge.core.request import Request, RequestStatus
from surge.core.scheduler import Scheduler
from surge.lora_request import LoRARequest
from surge.sampling_params import SamplingParams

BS = 4
A, B, C = (LoRARequest(name, i + 1, f"/adapters/{name}") for i, name in enumerate("abc"))


def _request(rid: str, lora: LoRARequest | None, prompt=(5, 6, 7, 8, 9), max_tokens: int = 3) -> Request:
    return Request(rid, list(prompt), SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True), BS,
                   lora_request=lora)


def _scheduler(max_loras: int, enable_caching: bool = False) -> Scheduler:
    groups = build_kv_cache_groups([FullAttentionSpec(BS, 2, 8, torch.float32)])
    return Scheduler(SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=8, max_model_len=64),
                     KVCacheManager(KVCacheConfig(groups, 64), enable_caching), max_loras=max_loras)


def _run_step(sched: Scheduler) -> list[str]:
    out = sched.schedule()
    sched.update_from_output(out, {s.request_id: [1] for s in out.scheduled if s.samples})
    return [s.request_id for s in out.scheduled]


def test_at_most_max_loras_adapters_run_and_the_queue_is_not_blocked():
    sched = _scheduler(max_loras=2)
    for rid, lora in [("a1", A), ("b1", B), ("c1", C), ("base", None), ("a2", A), ("c2", C)]:
        sched.add_request(_request(rid, lora))
    seen_adapters = []
    first = _run_step(sched)
    assert first == ["a1", "b1", "base", "a2"]  # c1 waits; base and a2 behind it are admitted
    assert [r.request_id for r in sched.waiting] == ["c1", "c2"]  # in arrival order
    while sched.has_unfinished_requests():
        ids = _run_step(sched)
        seen_adapters.append({sched_lora(sched, rid) for rid in ids} - {None})
        assert len(seen_adapters[-1]) <= 2
    assert any("c" in s for s in seen_adapters)  # c's requests ran once a slot freed


def sched_lora(sched: Scheduler, rid: str) -> str | None:
    req = sched.requests.get(rid)
    return None if req is None or req.lora_request is None else req.lora_request.lora_name


def test_adapter_keys_the_prefix_cache():
    prompt = list(range(10, 30))  # 5 full blocks
    base1, base2, a, a2, b = (_request(rid, lora, prompt) for rid, lora in
                              [("base1", None), ("base2", None), ("a", A), ("a2", A), ("b", B)])
    assert base1.block_hashes == base2.block_hashes
    assert a.block_hashes == a2.block_hashes
    assert not set(a.block_hashes) & set(base1.block_hashes)
    assert not set(a.block_hashes) & set(b.block_hashes)
    renamed = _request("r", LoRARequest("a", 7, "/adapters/a"), prompt)  # the same name reloaded under a new id
    assert not set(renamed.block_hashes) & set(a.block_hashes)

    sched = _scheduler(max_loras=2, enable_caching=True)
    for req in (base1, a):
        sched.add_request(req)
    while sched.has_unfinished_requests():
        _run_step(sched)
    for req in (base2, b, a2):
        sched.add_request(req)
    _run_step(sched)
    assert base2.num_cached_tokens > 0 and a2.num_cached_tokens > 0
    assert b.num_cached_tokens == 0
    assert all(r.status in (RequestStatus.RUNNING, RequestStatus.FINISHED_LENGTH) for r in (base2, b, a2))
