"""The scheduler's encoder budget: a chunk that touches an image the runner has not encoded spends the image's tokens
of max_num_encoder_input_tokens; one that does not fit is cut before the image and waits (never starves: an image
larger than the budget runs alone in a step); images the encoder cache holds, and prefix-cache hits over an image,
cost nothing. Randomized workloads run the runner's real
EncoderCache beside the scheduler: what it encodes per step stays within the budget, the scheduler's mirror of it
stays equal to it, and every request produces what a plain sequential model produces."""
from __future__ import annotations

import random

import pytest
import torch

from surge.config import SchedulerConfig
from surge.core.kv_cache.manager import KVCacheManager
from surge.core.kv_cache.spec import FullAttentionSpec, KVCacheConfig, build_kv_cache_groups
from surge.core.request import Request
from surge.core.scheduler import Scheduler, SchedulerOutput
from surge.multimodal import MultiModalFeature
from surge.sampling_params import SamplingParams
from surge.worker.encoder_cache import EncoderCache

BS = 4
V = 50


def next_token(history: list[int]) -> int:
    """The fake model: deterministic in the whole history."""
    return (sum(history) * 31 + len(history)) % V


def reference_output(prompt: list[int], max_tokens: int) -> list[int]:
    history, out = list(prompt), []
    for _ in range(max_tokens):
        out.append(next_token(history))
        history.append(out[-1])
    return out


def image(name: str, offset: int, length: int) -> MultiModalFeature:
    """A feature whose "pixels" are `length` floats, so the fake encoder below yields `length` rows."""
    pixels = torch.full((length,), float(sum(map(ord, name))))
    return MultiModalFeature(name, offset, length, pixels.numpy().tobytes(), [length])


def make_request(rid: str, prompt_len: int, images: list[MultiModalFeature], max_tokens: int = 4,
                 seed: int = 0, text: str | None = None) -> Request:
    """A random prompt, the same for the same text (default: the request id)."""
    rng = random.Random(f"{text or rid}{seed}")
    prompt = [rng.randrange(V) for _ in range(prompt_len)]
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return Request(rid, prompt, params, BS, mm_features=images)


def make_scheduler(encoder_budget: int, batch: int = 64, caching: bool = False, chunked: bool = True,
                   num_blocks: int = 128) -> Scheduler:
    groups = build_kv_cache_groups([FullAttentionSpec(BS, 2, 8, torch.float32)])
    config = SchedulerConfig(max_num_batched_tokens=batch, max_num_seqs=8, max_model_len=128,
                             enable_chunked_prefill=chunked, max_num_encoder_input_tokens=encoder_budget)
    return Scheduler(config, KVCacheManager(KVCacheConfig(groups, num_blocks), caching))


class FakeEncoder:
    """The vision tower's stand-in: counts the image tokens it produces."""

    def __init__(self) -> None:
        self.num_tokens = 0

    def embed_images(self, features: list[MultiModalFeature], device: torch.device) -> list[torch.Tensor]:
        rows = [f.pixel_values(device).unsqueeze(-1) for f in features]
        self.num_tokens += sum(r.shape[0] for r in rows)
        return rows


class Runner:
    """The runner's encoder side, fed only by step messages: the real EncoderCache, encoding and releasing as
    model_runner._merged_image_embeds does."""

    def __init__(self) -> None:
        self.cache = EncoderCache(torch.device("cpu"))
        self.encoder = FakeEncoder()
        self.features: dict[str, list[MultiModalFeature]] = {}

    def execute(self, out: SchedulerOutput) -> list[int]:
        """The lengths of the images encoded this step."""
        if out.finished_ids:
            self.cache.drop_requests(out.finished_ids)
        for new in out.new_requests:
            self.features[new.request_id] = new.mm_features
        spans = []
        for s in out.scheduled:
            start, end = s.num_computed_tokens, s.num_computed_tokens + s.num_new_tokens
            spans += [(s.request_id, f) for f in self.features[s.request_id] if f.offset < end and f.end > start]
            for f in self.features[s.request_id]:
                if f.offset < start < f.end:  # a chunk inside a span reads rows encoded before
                    assert f.identifier in self.cache.embeds or (s.request_id, f) in spans
        encoded = {f.identifier: f.length for _, f in spans if f.identifier not in self.cache.embeds}
        self.cache.encode(self.encoder, spans)
        for s in out.scheduled:
            end = s.num_computed_tokens + s.num_new_tokens
            for f in self.features[s.request_id]:
                if f.offset < end and f.end > s.num_computed_tokens:
                    assert f.identifier in self.cache.embeds  # every span's rows are there to merge
        for rid, f in spans:
            s = next(s for s in out.scheduled if s.request_id == rid)
            if s.num_computed_tokens + s.num_new_tokens >= f.end:
                self.cache.release(f.identifier, rid)
        return list(encoded.values())


def check_budget(sched: Scheduler, encoded: list[int]) -> None:
    """Within the budget, or one image (without chunked prefill: one prompt's images) alone over it."""
    budget = sched.config.max_num_encoder_input_tokens
    assert sum(encoded) <= budget or len(encoded) == 1 or not sched.config.enable_chunked_prefill, (encoded, budget)


def run(sched: Scheduler, runner: Runner, max_steps: int = 500) -> list[dict[str, int]]:
    """Steps until every request finished; per step, {request id: tokens scheduled}. Checks the budget, and that
    the scheduler's mirror equals the runner's cache after every step."""
    plans = []
    for _ in range(max_steps):
        if not sched.has_unfinished_requests():
            return plans
        out = sched.schedule()
        check_budget(sched, runner.execute(out))
        assert sched.encoder.users == runner.cache.users
        plans.append({s.request_id: s.num_new_tokens for s in out.scheduled})
        sched.update_from_output(out, {s.request_id: [next_token(sched.requests[s.request_id].token_ids)]
                                       for s in out.scheduled if s.samples})
    raise AssertionError(f"requests left unfinished after {max_steps} steps: {list(sched.requests)}")


def test_a_chunk_is_cut_before_an_image_that_does_not_fit_and_waits_for_budget():
    sched, runner = make_scheduler(encoder_budget=16), Runner()
    reqs = [make_request(f"r{i}", 20, [image(f"img{i}", 4, 12)]) for i in range(3)]
    for req in reqs:
        sched.add_request(req)
    plans = run(sched, runner)
    # Step 1: r0 whole (its image: 12 of 16); r1 and r2 only up to their images. Then one image a step.
    assert plans[0] == {"r0": 20, "r1": 4, "r2": 4}
    assert plans[1] == {"r0": 1, "r1": 16}
    assert plans[2] == {"r0": 1, "r1": 1, "r2": 16}
    assert runner.encoder.num_tokens == 36
    for req in reqs:
        assert req.output_token_ids == reference_output(req.prompt_token_ids, 4)
    assert not sched.encoder.users and not runner.cache.embeds


def test_cached_images_cost_nothing():
    sched, runner = make_scheduler(encoder_budget=24, batch=128), Runner()
    # One image in three prompts: encoded once, in the first step, for all of them; of two distinct ones, the
    # second waits.
    for rid in ("a", "b", "c"):
        sched.add_request(make_request(rid, 20, [image("shared", 2, 12)]))
    sched.add_request(make_request("d", 20, [image("other", 2, 12)]))
    sched.add_request(make_request("e", 20, [image("third", 2, 12)]))
    plans = run(sched, runner)
    assert plans[0] == {"a": 20, "b": 20, "c": 20, "d": 20, "e": 2}
    assert plans[1] == {"a": 1, "b": 1, "c": 1, "d": 1, "e": 18}
    assert runner.encoder.num_tokens == 36


def test_a_held_image_is_free_for_a_chunk_inside_its_span():
    # The image spans 3 chunks of 8: encoded at the first, held (free) for the next two.
    sched, runner = make_scheduler(encoder_budget=16, batch=8), Runner()
    sched.add_request(make_request("a", 24, [image("big", 2, 16)]))
    plans = run(sched, runner)
    assert [p["a"] for p in plans[:4]] == [8, 8, 8, 1]
    assert runner.encoder.num_tokens == 16


def test_a_prefix_cache_hit_over_the_image_needs_no_encoder():
    sched, runner = make_scheduler(encoder_budget=16, caching=True), Runner()
    first = make_request("first", 24, [image("img", 4, 12)], text="t")
    sched.add_request(first)
    run(sched, runner)
    assert runner.encoder.num_tokens == 12
    again = make_request("again", 24, [image("img", 4, 12)], text="t")  # same prompt, same image
    other = make_request("other", 24, [image("img2", 4, 12)], text="t")  # another image: only the first block
    sched.add_request(again)
    sched.add_request(other)
    run(sched, runner)
    assert again.num_cached_tokens == 20 and other.num_cached_tokens == 4
    assert runner.encoder.num_tokens == 24  # img2 only
    assert again.output_token_ids == first.output_token_ids


def test_without_chunked_prefill_the_whole_prompt_waits_for_budget():
    sched, runner = make_scheduler(encoder_budget=20, batch=128, chunked=False), Runner()
    sched.add_request(make_request("a", 30, [image("x", 2, 10), image("y", 16, 10)]))
    sched.add_request(make_request("b", 30, [image("z", 2, 10)]))
    sched.add_request(make_request("c", 30, [image("x", 2, 10)]))
    plans = run(sched, runner)
    # a's images spend the step's budget; b and c wait for the next (x again: a released it, so it is encoded again).
    assert plans[0] == {"a": 30} and plans[1] == {"a": 1, "b": 30, "c": 30}
    # A prompt whose images exceed the budget runs alone in a step.
    sched.add_request(make_request("d", 40, [image("x", 2, 10), image("u", 12, 10), image("v", 22, 10)]))
    sched.add_request(make_request("e", 30, [image("w", 2, 10)]))
    assert run(sched, runner)[:2] == [{"d": 40}, {"d": 1, "e": 30}]


def test_an_image_larger_than_the_budget_runs_alone_in_its_step():
    sched, runner = make_scheduler(encoder_budget=16), Runner()
    sched.add_request(make_request("a", 20, [image("a1", 1, 4)]))
    sched.add_request(make_request("b", 40, [image("huge", 1, 30), image("b2", 32, 4)]))
    plans = run(sched, runner)
    # a's image spends 4 of 16: b's 30-token image waits for a step of its own, then b2 for the next.
    assert plans[0] == {"a": 20, "b": 1} and plans[1] == {"a": 1, "b": 31} and plans[2] == {"a": 1, "b": 8}
    assert SchedulerConfig(max_num_batched_tokens=99).max_num_encoder_input_tokens == 99
    with pytest.raises(ValueError, match="max_num_encoder_input_tokens=0"):
        SchedulerConfig(max_num_encoder_input_tokens=0)


@pytest.mark.parametrize("seed", range(6))
def test_random_image_workloads_stay_in_budget_and_match_the_sequential_model(seed):
    rng = random.Random(seed)
    budget = rng.choice([8, 12, 24, 64])
    sched = make_scheduler(encoder_budget=budget, batch=rng.choice([8, 16, 64]), caching=rng.random() < 0.5,
                           num_blocks=rng.choice([24, 64]))
    runner = Runner()
    names = [f"img{i}" for i in range(4)]
    reqs = []
    for i in range(12):
        prompt_len = rng.randrange(8, 48)
        images, pos = [], rng.randrange(0, 4)
        while pos + 8 <= prompt_len and len(images) < 3 and rng.random() < 0.7:
            length = rng.randrange(2, min(budget + 8, prompt_len - pos) + 1)  # some over the budget
            images.append(image(f"{rng.choice(names)}-{length}", pos, length))  # names repeat: shared images
            pos += length + rng.randrange(0, 4)
        reqs.append(make_request(f"r{i}", prompt_len, images, max_tokens=rng.randrange(1, 6), seed=seed))
    pending = list(reqs)
    for _ in range(400):  # arrivals over the first steps, then run to the end
        for _ in range(rng.randrange(0, 3)):
            if pending:
                sched.add_request(pending.pop(0))
        if not pending:
            break
        out = sched.schedule()
        check_budget(sched, runner.execute(out))
        assert sched.encoder.users == runner.cache.users
        sched.update_from_output(out, {s.request_id: [next_token(sched.requests[s.request_id].token_ids)]
                                       for s in out.scheduled if s.samples})
    run(sched, runner)
    for req in reqs:
        assert req.output_token_ids == reference_output(req.prompt_token_ids, req.params.max_tokens), req.request_id
    assert not sched.encoder.users and not runner.cache.embeds
