"""Checks shared by the MTP draft tests (DeepSeek V3's layer, test_mtp.py; V4's, test_mtp_v4.py): generation with
and without the draft, its proposals as scheduled against a plain reference's, one rank against two, and the draft
built as rank 1 of two."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from test_draft_model import _generate
from test_ngram import _prompts

from surge import LLM, SamplingParams
from surge.config import ParallelConfig
from surge.distributed.parallel_state import layout_of_rank
from surge.engine.args import EngineArgs
from surge.model.loader.base import build_model

Proposals = list[tuple[list[int], list[int]]]  # (the request's tokens, its drafts) for each step that verifies drafts


def mtp_spec(k: int) -> dict:
    return {"method": "deepseek_mtp", "num_speculative_tokens": k}


def record_proposals(llm: LLM) -> Proposals:
    """(the request's tokens, its drafts) for every step that verifies drafts, as scheduled."""
    sched, seen = llm.engine.scheduler, []
    inner = sched.schedule

    def schedule():
        out = inner()
        for s in out.scheduled:
            if s.spec_token_ids:
                seen.append((list(sched.requests[s.request_id].token_ids), list(s.spec_token_ids)))
        return out

    sched.schedule = schedule
    return seen


@dataclass
class SpeculativeRun:
    llm: LLM
    proposals: Proposals
    proposed: int  # drafts proposed over the run
    accepted: int  # of them accepted
    ahead: int  # drafts verified in steps scheduled ahead of their verdict (async scheduling)


def speculate_as_without(path: Path, k: int, params: SamplingParams, engine: dict) -> SpeculativeRun:
    """The test prompts greedy on `path` without speculation, then with k MTP drafts (proposals recorded): the
    outputs must be identical."""
    ref = LLM(str(path), **engine).generate(_prompts(), params, use_tqdm=False)
    llm = LLM(str(path), speculative_config=mtp_spec(k), **engine)
    proposals = record_proposals(llm)
    ahead: list[int] = []
    outs, (proposed, accepted) = _generate(llm, _prompts(), params, ahead)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in ref]
    return SpeculativeRun(llm, proposals, proposed, accepted, ahead[0])


def assert_drafts_equal_the_reference(proposals: Proposals, reference) -> None:
    """Each step's drafts are the reference's (`reference.drafts(tokens, k)` -> drafts, top-2 logit margins) up to
    the first that differs, where the margin is wide enough for float32 to decide."""
    for tokens, drafts in proposals:
        expect, margins = reference.drafts(tokens, len(drafts))
        for got, want, margin in zip(drafts, expect, margins):
            if margin > 1e-4:  # a near tie may go either way in float32
                assert got == want, (tokens, drafts, expect)
            if got != want:
                break  # later drafts follow from this one


def one_rank_and_two(path: Path, k: int, params: SamplingParams, expert_parallel: bool, engine: dict) -> list:
    """[(outputs, (proposed, accepted))] with k drafts at tensor parallelism 1, then 2 (gloo; with expert
    parallelism if asked)."""
    runs = []
    for tp in (1, 2):
        llm = LLM(str(path), speculative_config=mtp_spec(k), tensor_parallel_size=tp,
                  enable_expert_parallel=expert_parallel and tp > 1, **engine)
        try:
            runs.append(_generate(llm, _prompts(), params))
        finally:
            llm.engine.shutdown()
    return runs


def draft_as_rank_1_of_2(path: Path, expert_parallel: bool, model_class: type) -> torch.nn.Module:
    """The draft model built on the meta device as rank 1 of two under the draft's ParallelConfig (derived by
    DRAFT_PARALLEL_POLICY, which must inherit expert parallelism)."""
    spec = EngineArgs(model=str(path), dtype="float32", device="cpu",
                      speculative_config=mtp_spec(1)).create_engine_config().speculative_config
    draft = spec.draft_parallel_config(ParallelConfig(tensor_parallel_size=2, enable_expert_parallel=expert_parallel))
    assert draft.enable_expert_parallel == expert_parallel
    with layout_of_rank(draft, 1):
        return build_model(spec.draft, torch.device("meta"), model_class)
