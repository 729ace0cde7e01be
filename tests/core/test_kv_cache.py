"""KV cache tests: block pool, prefix hashing and the multi-group KVCacheManager, each against a plain reference
(hashlib, hand-computed block counts and window arithmetic), never against the code's own output."""
from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from surge.core.kv_cache import hashing
from surge.core.kv_cache.block_pool import BlockPool
from surge.core.kv_cache.hashing import hash_block_tokens
from surge.core.kv_cache.manager import KVCacheManager
from surge.core.kv_cache.spec import (FullAttentionSpec, KVCacheConfig, KVCacheGroup, KVCacheSpec, MLAAttentionSpec,
                                      SlidingWindowSpec, build_kv_cache_groups, live_block_caps,
                                      num_blocks_for_budget)
from surge.core.request import Request
from surge.sampling_params import SamplingParams

BS = 4
WINDOW = 8
SLIDING, FULL = 0, 1  # group ids of hybrid_groups()


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def full_groups() -> tuple[KVCacheGroup, ...]:
    return build_kv_cache_groups([FullAttentionSpec(BS, 2, 8, torch.float32)])


def hybrid_groups(window: int = WINDOW) -> tuple[KVCacheGroup, ...]:
    return build_kv_cache_groups([SlidingWindowSpec(BS, 2, 8, torch.float32, sliding_window=window),
                                  FullAttentionSpec(BS, 2, 8, torch.float32)])


def make_request(rid: str, tokens: list[int], **params) -> Request:
    params = {"temperature": 0, "max_tokens": 16, "ignore_eos": True, **params}
    return Request(rid, tokens, SamplingParams(**params), BS)


def admit(kv: KVCacheManager, req: Request) -> int:
    """What the scheduler does for a waiting request whose whole prompt fits: hit, allocate, mark computed."""
    hit, num_hit = kv.get_computed_blocks(req)
    assert kv.allocate_slots(req, req.num_tokens - num_hit, hit, num_hit)
    req.num_computed_tokens = req.num_tokens
    return num_hit


def assert_all_free(kv: KVCacheManager) -> None:
    for m in kv.managers:
        assert m.pool.num_free_blocks == m.pool.num_blocks - 1
        assert all(b.ref_cnt == 0 for b in m.pool.blocks[1:])
        assert m.pool.null_block.ref_cnt >= 1


# ---------------------------------------------------------------------------------------------------------------
# BlockPool


def test_null_block_is_never_handed_out() -> None:
    pool = BlockPool(6, enable_caching=True)
    got = pool.get_new_blocks(5)
    assert sorted(b.block_id for b in got) == [1, 2, 3, 4, 5]
    assert pool.num_free_blocks == 0
    with pytest.raises(RuntimeError):
        pool.get_new_blocks(1)
    pool.free_blocks([pool.null_block])  # freeing the null block is a no-op
    assert pool.num_free_blocks == 0 and pool.null_block.ref_cnt == 1


def test_ref_counts() -> None:
    pool = BlockPool(4, enable_caching=True)
    (b,) = pool.get_new_blocks(1)
    assert b.ref_cnt == 1 and pool.num_free_blocks == 2
    pool.touch([b])  # a second request shares it
    assert b.ref_cnt == 2
    pool.free_blocks([b])
    assert b.ref_cnt == 1 and pool.num_free_blocks == 2  # still held by one request
    pool.free_blocks([b])
    assert b.ref_cnt == 0 and pool.num_free_blocks == 3


def test_free_queue_is_lru() -> None:
    pool = BlockPool(5, enable_caching=True)
    blocks = pool.get_new_blocks(4)
    order = [blocks[2], blocks[0], blocks[3], blocks[1]]
    for b in order:
        pool.free_blocks([b])
    assert [b.block_id for b in pool.get_new_blocks(4)] == [b.block_id for b in order]


def test_cached_free_block_is_revived_until_evicted() -> None:
    pool = BlockPool(4, enable_caching=True)
    a, b, c = pool.get_new_blocks(3)
    h = hash_block_tokens(None, [1, 2, 3, 4])
    pool.cache_block(a, h)
    pool.free_blocks([a, b, c])  # a is the oldest free block
    assert pool.get_cached_block(h) is a
    pool.touch([a])  # a prefix hit revives it: out of the free queue
    assert a.ref_cnt == 1 and pool.num_free_blocks == 2 and pool.get_cached_block(h) is a
    assert a not in pool.get_new_blocks(2)
    pool.free_blocks([a])
    pool.free_blocks([b, c])
    new = pool.get_new_blocks(1)  # a is oldest again: evicted first, its hash forgotten
    assert new == [a] and a.block_hash is None and pool.get_cached_block(h) is None


def test_without_caching_nothing_is_kept() -> None:
    pool = BlockPool(4, enable_caching=False)
    (a,) = pool.get_new_blocks(1)
    h = hash_block_tokens(None, [1, 2, 3, 4])
    pool.cache_block(a, h)
    assert pool.get_cached_block(h) is None
    pool.free_blocks([a])
    assert pool.get_cached_block(h) is None and a.block_hash is None


def test_reset_prefix_cache_only_when_nothing_is_held() -> None:
    pool = BlockPool(4, enable_caching=True)
    (a,) = pool.get_new_blocks(1)
    h = hash_block_tokens(None, [5] * BS)
    pool.cache_block(a, h)
    assert pool.reset_prefix_cache() is False and pool.get_cached_block(h) is a
    pool.free_blocks([a])
    assert pool.reset_prefix_cache() is True and pool.get_cached_block(h) is None


# ---------------------------------------------------------------------------------------------------------------
# Prefix hashing


def ref_hash(parent: bytes | None, tokens: list[int]) -> bytes:
    """The documented layout: sha256(parent or root, int64 token ids)."""
    payload = b"".join(t.to_bytes(8, sys.byteorder, signed=True) for t in tokens)
    return hashlib.sha256((parent if parent is not None else b"surge-prefix-v1") + payload).digest()


def test_block_hash_matches_plain_sha256_and_chains() -> None:
    h0 = hash_block_tokens(None, [1, 2, 3, 4])
    h1 = hash_block_tokens(h0, [5, 6, 7, 8])
    assert h0 == ref_hash(None, [1, 2, 3, 4])
    assert h1 == ref_hash(h0, [5, 6, 7, 8])
    # The same tokens after a different prefix hash differently: a block's hash depends on every earlier token.
    assert hash_block_tokens(hash_block_tokens(None, [1, 2, 3, 9]), [5, 6, 7, 8]) != h1
    assert hash_block_tokens(None, [1, 2, 3, 4], extra_keys=("lora-1",)) != h0


def test_request_block_hashes_cover_full_blocks_only() -> None:
    tokens = list(range(10, 20))  # 2 full blocks + 2 tokens
    req = make_request("r", tokens)
    expected, parent = [], None
    for i in range(len(tokens) // BS):
        parent = ref_hash(parent, tokens[i * BS:(i + 1) * BS])
        expected.append(parent)
    assert req.block_hashes == expected
    req.append_token(20)
    assert req.block_hashes == expected
    req.append_token(21)  # completes the third block
    assert req.block_hashes == expected + [ref_hash(expected[-1], [18, 19, 20, 21])]


def test_block_hash_is_stable_across_processes() -> None:
    # Load hashing.py alone (importing surge pulls in torch): two fresh interpreters with different str-hash seeds.
    code = ("import importlib.util, sys\n"
            "spec = importlib.util.spec_from_file_location('h', sys.argv[1])\n"
            "m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m)\n"
            "print(m.hash_block_tokens(m.hash_block_tokens(None, [1, 2, 3]), [4, 5, 6], ('k', 7)).hex())\n")
    expected = hash_block_tokens(hash_block_tokens(None, [1, 2, 3]), [4, 5, 6], ("k", 7)).hex()
    for seed in ("1", "12345"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        got = subprocess.run([sys.executable, "-c", code, str(Path(hashing.__file__))], env=env,
                             capture_output=True, text=True, check=True).stdout.strip()
        assert got == expected


# ---------------------------------------------------------------------------------------------------------------
# KVCacheManager: prefix hits


@pytest.mark.parametrize("num_prompt_tokens, expected_hit", [
    (BS - 1, 0), (BS, 0), (BS + 1, BS), (2 * BS, BS), (2 * BS + 1, 2 * BS), (3 * BS, 2 * BS)])
def test_hit_is_capped_so_the_last_prompt_token_is_computed(num_prompt_tokens: int, expected_hit: int) -> None:
    kv = KVCacheManager(KVCacheConfig(full_groups(), 16), enable_caching=True)
    prompt = list(range(100, 100 + num_prompt_tokens))
    first = make_request("a", prompt)
    assert admit(kv, first) == 0
    first_ids = kv.get_block_ids("a")[0]
    kv.free(first)
    second = make_request("b", prompt)
    assert admit(kv, second) == expected_hit
    # The hit blocks are the first request's blocks, in order.
    assert kv.get_block_ids("b")[0][:expected_hit // BS] == first_ids[:expected_hit // BS]


def test_shared_prefix_shares_blocks_while_both_run() -> None:
    kv = KVCacheManager(KVCacheConfig(full_groups(), 16), enable_caching=True)
    a = make_request("a", list(range(9)))
    b = make_request("b", list(range(8)) + [42, 43])  # the same two full blocks, then different tokens
    admit(kv, a)
    assert admit(kv, b) == 2 * BS
    ids_a, ids_b = kv.get_block_ids("a")[0], kv.get_block_ids("b")[0]
    assert ids_a[:2] == ids_b[:2] and ids_a[2] != ids_b[2]
    pool = kv.managers[0].pool
    assert [pool.blocks[i].ref_cnt for i in ids_a[:2]] == [2, 2]
    kv.free(a)
    kv.free(b)
    assert_all_free(kv)


def test_no_hit_with_prompt_logprobs_or_without_caching() -> None:
    prompt = list(range(3 * BS + 1))
    for enable_caching, params in ((True, {"prompt_logprobs": 1}), (False, {})):
        kv = KVCacheManager(KVCacheConfig(full_groups(), 16), enable_caching=enable_caching)
        first = make_request("a", prompt)
        admit(kv, first)
        kv.free(first)
        hit, num_hit = kv.get_computed_blocks(make_request("b", prompt, **params))
        assert num_hit == 0 and all(h == [] for h in hit), (enable_caching, params)


def test_hybrid_hit_agreed_by_all_groups_with_nulls_before_the_window() -> None:
    kv = KVCacheManager(KVCacheConfig(hybrid_groups(), 32), enable_caching=True)
    prompt = list(range(6 * BS + 1))
    first = make_request("a", prompt)
    admit(kv, first)
    sliding_ids = kv.get_block_ids("a")[SLIDING]
    full_ids = kv.get_block_ids("a")[FULL]
    kv.free(first)

    # Every block is still cached: a 6-block hit. The sliding group needs only the blocks covering the window
    # before position 24 (positions 17..23 -> blocks 4, 5); earlier entries are the null block.
    hit, num_hit = kv.get_computed_blocks(make_request("b", prompt))
    assert num_hit == 6 * BS
    need = cdiv(WINDOW - 1, BS)
    assert [b.block_id for b in hit[SLIDING]] == [0] * (6 - need) + sliding_ids[6 - need:6]
    assert [b.block_id for b in hit[FULL]] == full_ids[:6]

    # Evict block 5 from the sliding pool only (by drawing every free block older than it). The full group alone
    # could still serve 6 blocks; the sliding group can serve 5 (blocks 3, 4 cover the window before 20).
    pool = kv.managers[SLIDING].pool
    drawn = []
    while pool.get_cached_block(first.block_hashes[5]) is not None:
        drawn += pool.get_new_blocks(1)
    assert pool.get_cached_block(first.block_hashes[4]) is not None
    pool.free_blocks(drawn)
    hit, num_hit = kv.get_computed_blocks(make_request("c", prompt))
    assert num_hit == 5 * BS
    assert [b.block_id for b in hit[SLIDING]] == [0] * (5 - need) + sliding_ids[5 - need:5]
    assert [b.block_id for b in hit[FULL]] == full_ids[:5]

    # The full group is the short one now: with its block 2 evicted, both agree on 2 blocks.
    pool = kv.managers[FULL].pool
    drawn = []
    while pool.get_cached_block(first.block_hashes[2]) is not None:
        drawn += pool.get_new_blocks(1)
    pool.free_blocks(drawn)
    req = make_request("d", prompt)
    hit, num_hit = kv.get_computed_blocks(req)
    assert num_hit == 2 * BS and [len(h) for h in hit] == [2, 2]
    assert kv.allocate_slots(req, req.num_tokens - num_hit, hit, num_hit)
    assert kv.get_block_ids("d")[FULL][:2] == full_ids[:2]


def test_hybrid_hit_shorter_than_the_window() -> None:
    # Window 13 reads 12 earlier tokens (3 blocks); a 2-block hit needs only blocks 0 and 1, which are cached.
    kv = KVCacheManager(KVCacheConfig(hybrid_groups(13), 16), enable_caching=True)
    prompt = list(range(2 * BS + 1))
    first = make_request("a", prompt)
    admit(kv, first)
    sliding_ids = kv.get_block_ids("a")[SLIDING]
    kv.free(first)
    hit, num_hit = kv.get_computed_blocks(make_request("b", prompt))
    assert num_hit == 2 * BS
    assert [b.block_id for b in hit[SLIDING]] == sliding_ids[:2]


# ---------------------------------------------------------------------------------------------------------------
# KVCacheManager: sliding windows, all-or-nothing allocation, free, capability projections


@pytest.mark.parametrize("window", [2, 5, 8, 13])
def test_sliding_group_returns_blocks_that_left_the_window(window: int) -> None:
    num_blocks = 40
    kv = KVCacheManager(KVCacheConfig(hybrid_groups(window), num_blocks), enable_caching=False)
    req = make_request("r", [1, 2, 3])
    admit(kv, req)
    while req.num_tokens < 120:  # decode one token per step
        req.append_token(req.num_tokens % 50)
        c = req.num_computed_tokens
        assert kv.allocate_slots(req, 1)
        sliding, full = kv.get_block_ids("r")
        # Reference: the token at position c reads positions (c - window, c]; blocks wholly before are returned.
        first_needed_block = max(0, c - window + 1) // BS
        held = [i for i, b in enumerate(sliding) if b != 0]
        assert held == list(range(first_needed_block, cdiv(c + 1, BS)))
        assert len(held) <= window // BS + 2
        assert kv.managers[SLIDING].pool.num_free_blocks == num_blocks - 1 - len(held)
        assert len(full) == cdiv(c + 1, BS) and 0 not in full
        req.num_computed_tokens = c + 1
    kv.free(req)
    assert_all_free(kv)


def test_allocate_slots_is_all_or_nothing_across_groups() -> None:
    num_blocks = 12  # 11 real blocks per group
    kv = KVCacheManager(KVCacheConfig(hybrid_groups(), num_blocks), enable_caching=False)
    long = make_request("long", [1] * 4)
    admit(kv, long)
    while long.num_tokens < 40:  # the full group ends up holding 10 blocks, the sliding group about 3
        long.append_token(2)
        assert kv.allocate_slots(long, 1)
        long.num_computed_tokens += 1
    free_before = [m.pool.num_free_blocks for m in kv.managers]
    assert free_before[FULL] == 1 and free_before[SLIDING] >= 2

    other = make_request("other", [3] * 8)  # 2 blocks per group: the sliding group has them, the full does not
    hit, num_hit = kv.get_computed_blocks(other)
    assert kv.allocate_slots(other, 8, hit, num_hit) is False
    assert [m.pool.num_free_blocks for m in kv.managers] == free_before
    assert kv.get_block_ids("other") == ([], [])

    kv.free(long)
    assert kv.allocate_slots(other, 8)
    assert [len(ids) for ids in kv.get_block_ids("other")] == [2, 2]
    kv.free(other)
    assert_all_free(kv)


@pytest.mark.parametrize("enable_caching", [True, False])
def test_free_returns_every_block(enable_caching: bool) -> None:
    kv = KVCacheManager(KVCacheConfig(hybrid_groups(), 40), enable_caching=enable_caching)
    reqs = [make_request(f"r{i}", [7] * 9 + [i] * (3 + 4 * i)) for i in range(4)]  # shared 2-block prefix
    for req in reqs:
        admit(kv, req)
        for _ in range(5):
            req.append_token(req.num_tokens % 11)
            assert kv.allocate_slots(req, 1)
            req.num_computed_tokens += 1
    assert all(m.pool.num_free_blocks < m.pool.num_blocks - 1 for m in kv.managers)
    for req in reqs:
        kv.free(req)
    assert_all_free(kv)
    assert all(ids == [] for req in reqs for ids in kv.get_block_ids(req.request_id))


def test_trim_frees_every_group_tail_and_the_block_changes_say_where_tables_changed() -> None:
    num_blocks = 20
    kv = KVCacheManager(KVCacheConfig(hybrid_groups(), num_blocks), enable_caching=False)
    req = make_request("r", list(range(6)))
    admit(kv, req)  # 6 tokens: 2 blocks per group
    first = [list(ids) for ids in kv.get_block_ids("r")]
    assert kv.take_block_changes("r") == ([0, 0], first)  # a new table: all of it
    assert kv.take_block_changes("r") == ([2, 2], [[], []])  # nothing changed since
    assert kv.allocate_slots(req, 5)  # the last token and 4 drafts: positions 6..10, a third block per group
    grown = kv.get_block_ids("r")
    assert [ids[:2] for ids in grown] == first and all(len(ids) == 3 for ids in grown)
    assert kv.take_block_changes("r") == ([2, 2], [[grown[SLIDING][2]], [grown[FULL][2]]])

    kv.trim(req, 7)  # one draft accepted: positions 0..6 stay, in cdiv(7, BS) = 2 blocks
    assert kv.get_block_ids("r") == tuple(first)
    assert [m.pool.num_free_blocks for m in kv.managers] == [num_blocks - 1 - 2] * 2
    assert all(m.pool.blocks[ids[2]].ref_cnt == 0 for m, ids in zip(kv.managers, grown))
    assert kv.take_block_changes("r") == ([2, 2], [[], []])  # the runner cuts its tables after two blocks
    kv.trim(req, 8)  # nothing past the end: a no-op
    assert kv.get_block_ids("r") == tuple(first)
    kv.free(req)
    assert_all_free(kv)


@dataclass(frozen=True)
class StateSpec(KVCacheSpec):
    """A stand-in for a group whose blocks cannot be reused by another request (a recurrent state)."""

    @property
    def prefix_cacheable(self) -> bool:
        return False

    @property
    def transferable(self) -> bool:
        return False


def test_get_block_ids_selects_groups_by_capability() -> None:
    full = FullAttentionSpec(BS, 2, 8, torch.float32)
    state = StateSpec(BS, 2, 8, torch.float32)
    config = KVCacheConfig((KVCacheGroup(0, state, (0, 2)), KVCacheGroup(1, full, (1, 3))), 10)
    assert config.prefix_cacheable_group_ids == (1,) and config.transferable_group_ids == (1,)
    kv = KVCacheManager(config, enable_caching=True)
    req = make_request("r", list(range(9)))
    admit(kv, req)
    all_ids = kv.get_block_ids("r")
    assert len(all_ids) == 2 and all(len(ids) == 3 for ids in all_ids)
    assert kv.get_block_ids("r", group_ids=config.prefix_cacheable_group_ids) == (all_ids[1],)
    assert kv.get_block_ids("r", group_ids=()) == ()
    # Only the prefix-cacheable group caches its blocks.
    assert all(kv.managers[1].pool.blocks[i].block_hash is not None for i in all_ids[1][:2])
    assert all(kv.managers[0].pool.blocks[i].block_hash is None for i in all_ids[0])


def test_mla_spec_one_latent_plane_per_token() -> None:
    """An MLA layer caches kv_lora_rank + qk_rope_head_dim values per token (DeepSeek V3: 512 + 64 = 576), one plane:
    no factor 2 and no head count, 1/(2 * heads * head_dim / 576) of the standard cache of the same model; its own
    group beside a standard spec of the same bytes, and a layout id naming the split, so no connector exchanges its
    blocks with a K/V layout's."""
    mla = MLAAttentionSpec(16, 1, 576, torch.bfloat16, kv_lora_rank=512)
    assert mla.cache_shape(10) == (1, 10, 16, 1, 576)
    assert mla.page_size_bytes == 16 * 576 * 2
    assert FullAttentionSpec(16, 128, 192, torch.bfloat16).page_size_bytes == 2 * 16 * 128 * 192 * 2
    assert FullAttentionSpec(16, 2, 8, torch.float32).cache_shape(10) == (2, 10, 16, 2, 8)
    assert mla.prefix_cacheable and mla.transferable and mla.qk_rope_head_dim == 64
    lookalike = FullAttentionSpec(16, 1, 288, torch.bfloat16)  # the same bytes a block
    assert lookalike.page_size_bytes == mla.page_size_bytes
    groups = build_kv_cache_groups([mla, lookalike, mla])
    assert [(g.spec, g.layer_ids) for g in groups] == [(mla, (0, 2)), (lookalike, (1,))]
    assert mla.layout_id == "MLAAttentionSpec:latent512+rope64" and lookalike.layout_id != mla.layout_id
    assert FullAttentionSpec(4, 2, 8, torch.float32).layout_id == "FullAttentionSpec:2x8:w0"  # unchanged keys
    with pytest.raises(ValueError, match="kv_lora_rank=0"):
        MLAAttentionSpec(16, 1, 576, torch.bfloat16)


@pytest.mark.parametrize("seed", range(4))
def test_sliding_pool_capped_at_its_live_blocks_never_runs_out(seed: int) -> None:
    """A sliding group's pool of max_live_blocks (not num_blocks) holds every block the running requests can hold
    at once: random requests, each step at most max_num_seqs of them and max_num_batched_tokens new tokens (chunked
    prefill, decode), never fail to allocate while the full group has room, and the cap binds (a smaller pool)."""
    import random

    rng = random.Random(seed)
    max_seqs, max_tokens = 3, 10
    groups = hybrid_groups()
    caps = live_block_caps(groups, max_seqs, max_tokens, lookback=0)
    config = KVCacheConfig(groups, num_blocks=400, live_block_caps=caps)
    assert config.num_blocks_of(SLIDING) == caps[SLIDING] == max_seqs * (cdiv(WINDOW - 1, BS) + 2) + 3 + 1 < 400
    assert config.num_blocks_of(FULL) == 400
    kv = KVCacheManager(config, enable_caching=True)
    running = [make_request(f"r{i}", [rng.randrange(50) for _ in range(rng.randrange(1, 40))]) for i in range(max_seqs)]
    for step in range(200):
        budget = max_tokens
        for req in running:
            num_new = min(req.num_tokens - req.num_computed_tokens, rng.randrange(1, budget + 1)) if budget else 0
            if num_new <= 0:
                continue
            assert kv.allocate_slots(req, num_new), (step, req.request_id)
            budget -= num_new
            req.num_computed_tokens += num_new
            if req.num_computed_tokens == req.num_tokens:
                req.append_token(rng.randrange(50))
        for i, req in enumerate(running):
            if req.num_tokens > rng.randrange(40, 90):
                kv.free(req)
                running[i] = make_request(f"r{step}.{i}", [rng.randrange(50) for _ in range(rng.randrange(1, 40))])


def test_num_blocks_for_budget_pays_capped_pools_once() -> None:
    """The sliding group's capped pool is a fixed cost; the rest of the budget buys blocks of the full group. A cap
    above what the budget buys does not bind: that group is then paid per block like the full one. (As before
    caps, the full groups' null block comes on top of the budget.)"""
    groups = hybrid_groups()
    page = groups[0].spec.page_size_bytes  # both groups: 2 planes x 4 slots x 2 heads x 8 values x 4 bytes
    caps = (11, None)
    n = num_blocks_for_budget(groups, caps, budget=100 * page)
    assert n == 100 - 11 + 1
    assert KVCacheConfig(groups, n, caps).total_bytes == 100 * page + page  # the full group's null block on top
    assert num_blocks_for_budget(groups, (60, None), budget=100 * page) == 50 + 1  # 60 > 51: not binding
    assert num_blocks_for_budget(groups, caps, budget=100 * page, extra_bytes_per_block=page) == (100 - 11) // 2 + 1
