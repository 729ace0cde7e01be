"""The scheduler under disable_chunked_mm_input (Gemma 3's images): a chunk never ends inside an image's tokens. It
stops before the image, which a later step takes whole; a running request whose image does not fit what is left of
the budget waits a step without holding up the others (or being preempted); a waiting one stays first in line; a chunk
that starts inside an image (after a prefix-cache hit) takes the rest of the image or nothing."""
from __future__ import annotations

import torch

from surge.config import SchedulerConfig
from surge.core.kv_cache.manager import KVCacheManager
from surge.core.kv_cache.spec import FullAttentionSpec, KVCacheConfig, build_kv_cache_groups
from surge.core.request import Request
from surge.core.scheduler import Scheduler
from surge.multimodal import MultiModalFeature
from surge.sampling_params import SamplingParams

BS = 4


def _request(rid: str, prompt_len: int, images: list[tuple[int, int]], max_tokens: int = 2, start: int = 0,
             tail: list[int] = ()) -> Request:
    """A prompt of distinct tokens (then tail) with an image at each (offset, length), each image its own."""
    features = [MultiModalFeature.of(torch.full((1,), float(i)), offset, length)
                for i, (offset, length) in enumerate(images)]
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return Request(rid, list(range(start, start + prompt_len)) + list(tail), params, BS, mm_features=features)


def _scheduler(budget: int, whole_images: bool = True, enable_caching: bool = False) -> Scheduler:
    groups = build_kv_cache_groups([FullAttentionSpec(BS, 2, 8, torch.float32)])
    return Scheduler(SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=8, max_model_len=64,
                                     disable_chunked_mm_input=whole_images),
                     KVCacheManager(KVCacheConfig(groups, 64), enable_caching))


def _step(sched: Scheduler) -> list[tuple[str, int, int]]:
    out = sched.schedule()
    sched.update_from_output(out, {s.request_id: [1] for s in out.scheduled if s.samples})
    return [(s.request_id, s.num_computed_tokens, s.num_new_tokens) for s in out.scheduled]


def test_a_chunk_stops_before_an_image_it_would_end_inside():
    sched = _scheduler(budget=10)
    sched.add_request(_request("r", 24, [(6, 8), (15, 3)]))
    # [6, 16) would end inside the second image: it stops before it too
    assert [_step(sched) for _ in range(4)] == [[("r", 0, 6)], [("r", 6, 9)], [("r", 15, 9)], [("r", 24, 1)]]
    chunked = _scheduler(budget=10, whole_images=False)  # causal image tokens: any split will do
    chunked.add_request(_request("r", 24, [(6, 8), (15, 3)]))
    assert _step(chunked) == [("r", 0, 10)]


def test_a_request_whose_image_does_not_fit_waits_a_step():
    sched = _scheduler(budget=10)
    sched.add_request(_request("a", 4, []))
    sched.add_request(_request("b", 14, [(2, 9)]))
    assert _step(sched) == [("a", 0, 4), ("b", 0, 2)]  # b's image (9 tokens) does not fit the 6 left
    sched.add_request(_request("c", 12, [(1, 9)]))
    # b (running) takes its image; c's (waiting) does not fit the 1 token left: c waits, first in line.
    assert _step(sched) == [("a", 4, 1), ("b", 2, 9)]
    assert _step(sched) == [("b", 11, 3), ("c", 0, 1)]  # a finished; c's image again too long for what is left
    assert _step(sched) == [("b", 14, 1), ("c", 1, 9)]
    assert sched.num_preemptions == 0


def test_a_chunk_starting_inside_an_image_takes_the_rest_of_it_or_nothing():
    """A prefix-cache hit that ends inside an image (its blocks computed by a step that held the whole image): the
    rest of the image comes in one chunk, in a step with room for it."""
    sched = _scheduler(budget=20, enable_caching=True)
    sched.add_request(_request("first", 24, [(2, 16)]))
    assert _step(sched) == [("first", 0, 20)]
    sched.add_request(_request("filler", 15, [], start=100))
    # The first 18 tokens and the image as "first": 4 blocks cached, the fifth differs (its tokens 18, 19).
    sched.add_request(_request("second", 18, [(2, 16)], tail=[50, 51, 52, 53]))
    assert _step(sched) == [("first", 20, 4), ("filler", 0, 15)]  # 1 token left: not the image's last 2
    assert _step(sched) == [("first", 24, 1), ("filler", 15, 1), ("second", 16, 6)]
    assert sched.requests["second"].num_cached_tokens == 16
