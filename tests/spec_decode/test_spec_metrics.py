"""Speculative decoding's counters with vLLM's meaning (drafts, draft tokens, accepted tokens, accepted per
position), counted independently from the step messages and the runner's verdicts, through SchedulerStats to
/metrics' Prometheus text; the benchmark's quoting workload through the CLI's latency command."""
from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families
from test_ngram import _prompts
from tiny_models import make_tiny_model

from surge import LLM, SamplingParams
from surge.engine.output_processor import IterationStats
from surge.entrypoints.openai.metrics import PrometheusMetrics


def _samples(text: bytes) -> dict[tuple[str, str | None], float]:
    out = {}
    for family in text_string_to_metric_families(text.decode()):
        for s in family.samples:
            out[(s.name, s.labels.get("position"))] = s.value
    return out


def test_counters_match_an_independent_count(tmp_path):
    model_dir = make_tiny_model("llama", tmp_path / "llama")
    k = 3
    llm = LLM(model_dir, speculative_config={"method": "ngram", "num_speculative_tokens": k}, block_size=4,
              max_model_len=128, device="cpu", kv_cache_memory=1 << 22)
    drafts, draft_tokens, accepted, per_pos = 0, 0, 0, [0] * k
    sched = llm.engine.scheduler
    inner = sched.update_from_output

    def record(out, sampled, kv_output=None):
        nonlocal drafts, draft_tokens, accepted
        for s in out.scheduled:
            if s.spec_token_ids and s.request_id in sampled:
                drafts += 1
                draft_tokens += len(s.spec_token_ids)
                # The leading drafts the output repeats are the accepted ones.
                run = 0
                while run < len(s.spec_token_ids) and sampled[s.request_id][run] == s.spec_token_ids[run]:
                    run += 1
                assert run == len(sampled[s.request_id]) - 1  # greedy: accepted exactly while they agree
                accepted += run
                for j in range(run):
                    per_pos[j] += 1
        return inner(out, sampled, kv_output)

    sched.update_from_output = record
    metrics = PrometheusMetrics("tiny", llm.engine.config, prefix="vllm")
    llm.generate(_prompts()[:2], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True), use_tqdm=False)
    metrics(llm.engine.get_stats(), IterationStats())
    llm.generate(_prompts()[2:], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True), use_tqdm=False)
    metrics(llm.engine.get_stats(), IterationStats())  # a second report adds only the growth
    got = _samples(metrics.render())
    assert drafts > 0 and accepted > 0
    assert got[("vllm:spec_decode_num_drafts_total", None)] == drafts
    assert got[("vllm:spec_decode_num_draft_tokens_total", None)] == draft_tokens
    assert got[("vllm:spec_decode_num_accepted_tokens_total", None)] == accepted
    assert [got[("vllm:spec_decode_num_accepted_tokens_per_pos_total", str(j))] for j in range(k)] == per_pos
    plain = PrometheusMetrics("tiny", LLM(model_dir, block_size=4, max_model_len=128, device="cpu",
                                          kv_cache_memory=1 << 22).engine.config, prefix="vllm")
    assert not any("spec_decode" in name for name, _ in _samples(plain.render()))  # vLLM's names without it
