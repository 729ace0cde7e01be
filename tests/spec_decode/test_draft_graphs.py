"""The draft model's GPU path, on the CPU: stand-in graph runners replay from the persistent input buffers alone
(all a captured graph reads), so a buffer the draft forgot to fill shows as a wrong output; and every draft forward
of a step is a replay, none eager (the H200 ran each step's draft forward over the verified tokens eagerly: ~20 ms
of host launches per step, 0.23x), with the host waiting for the device at most once per step."""
from __future__ import annotations

import warnings
from collections import Counter

import numpy as np
import pytest
import torch
from test_draft_model import BASE, _generate, _spec
from test_ngram import _prompts
from tiny_models import make_tiny_model

from surge import LLM, SamplingParams


class BufferReplay:
    """A CUDA graph runner's contract without CUDA: replay reads only StepInputs' buffers (the live metadata the
    caller built is never seen), over the real rows; the padding rows are the graph runner's own test."""

    def __init__(self, model, inputs, backend, sizes=(1, 2, 4, 8), mixed_sizes=(512,)) -> None:
        self.model, self.inputs, self.backend = model, inputs, backend
        self.sizes, self.mixed_sizes = sizes, mixed_sizes

    def padded_size(self, num_reqs: int) -> int | None:
        return next((s for s in self.sizes if s >= num_reqs), None)

    def mixed_size(self, num_tokens: int, num_reqs: int) -> int | None:
        return next((t for t in self.mixed_sizes if t >= num_tokens), None)

    def _run(self, num_tokens: int, num_reqs: int):
        inp = self.inputs
        qsl = inp.query_start_loc[:num_reqs + 1].tolist()
        seq_lens = inp.seq_lens[:num_reqs].tolist()
        meta = inp.metadata(self.backend, num_tokens, num_reqs, qsl, seq_lens, int(max(np.diff(qsl))),
                            max(seq_lens))
        return self.model(inp.input_ids[:num_tokens], inp.positions[:num_tokens], meta)

    def replay(self, num_reqs: int):
        return self._run(num_reqs, num_reqs)

    def replay_mixed(self, num_tokens: int, num_reqs: int):
        return self._run(num_tokens, num_reqs)


def test_every_draft_forward_replays_a_graph(tmp_path):
    model_dir = make_tiny_model("llama", tmp_path / "llama")
    k = 4
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    engine = dict(kv_cache_memory=1 << 22, max_num_seqs=8, **BASE)
    ref = LLM(model_dir, **engine).generate(_prompts(), params, use_tqdm=False)
    llm = LLM(model_dir, speculative_config=_spec(model_dir, k), **engine)
    runner = llm.engine.executor.runner
    draft = runner.draft
    draft.graph_runner = BufferReplay(draft.model, draft.inputs, draft.backend)
    draft.step_graphs = BufferReplay(draft.model, runner.inputs, draft.backend)
    steps = [0]
    inner = runner.execute_async

    def count(out):
        steps[0] += not out.is_empty
        return inner(out)

    runner.execute_async = count
    outs, (proposed, accepted) = _generate(llm, _prompts(), params)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in ref]
    assert proposed > 0 and accepted == proposed  # the target as its own draft: the buffers held the right inputs
    c = draft.counts
    assert c["step eager"] == 0 and c["pass eager"] == 0, dict(c)
    assert c["step graph"] == steps[0] and c["pass graph"] == k * c["steps"], dict(c)
    assert 0 < c["host waits"] <= c["steps"] <= steps[0], dict(c)


def test_without_graphs_every_forward_is_eager(tmp_path):
    """The counters tell the two paths apart: on the CPU (no graphs) every forward is counted eager."""
    model_dir = make_tiny_model("llama", tmp_path / "llama")
    llm = LLM(model_dir, speculative_config=_spec(model_dir, 2), kv_cache_memory=1 << 22, **BASE)
    llm.generate(_prompts()[:1], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    c = llm.engine.executor.runner.draft.counts
    assert c["step graph"] == c["pass graph"] == 0 and c["step eager"] > 0 and c["pass eager"] == 2 * c["steps"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_every_draft_forward_replays_and_the_host_never_waits(tmp_path):
    """The real graph runners (tiny Llama as its own draft): output equal to decoding without speculation, no
    eager draft forward, and inside the draft's work no synchronizing call (torch's sync debug mode counts them:
    each is a wait for the device's whole queue): where the proposals start is corrected on the device."""
    model_dir = make_tiny_model("llama", tmp_path / "llama")
    engine = {"block_size": 16, "max_model_len": 256, "device": "cuda", "kv_cache_memory": 1 << 26,
              "max_num_seqs": 8}
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    ref = LLM(model_dir, **engine).generate(_prompts(), params, use_tqdm=False)
    llm = LLM(model_dir, speculative_config=_spec(model_dir, 4), **engine)
    draft = llm.engine.executor.runner.draft
    assert draft.graph_runner is not None and draft.step_graphs is not None
    syncs: Counter[str] = Counter()
    others: list[str] = []

    def counted(name: str):
        inner = getattr(draft, name)

        def run(*args, **kwargs):
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                torch.cuda.set_sync_debug_mode("warn")
                try:
                    return inner(*args, **kwargs)
                finally:
                    torch.cuda.set_sync_debug_mode("default")
                    for w in caught:  # torch's own words for a synchronizing call; other warnings are shown
                        if "called a synchronizing CUDA operation" in str(w.message):
                            syncs[name] += 1
                        else:
                            others.append(f"{name}: {w.category.__name__}: {w.message}")
        return run

    for name in ("forward_step", "propose_after"):
        setattr(draft, name, counted(name))
    outs, (proposed, accepted) = _generate(llm, _prompts(), params)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in ref]
    assert proposed > 0 and accepted > 0.9 * proposed  # near-ties may round apart between graph shapes
    c = draft.counts
    assert c["step eager"] == 0 and c["pass eager"] == 0 and c["pass graph"] == 4 * c["steps"], dict(c)
    assert syncs["forward_step"] == syncs["propose_after"] == c["host waits"] == 0, (dict(syncs), dict(c), others)
