"""The benchmarks run end to end on CPU with random-weight presets, and the HF peer really runs the same model."""
from __future__ import annotations

import re

import pytest

from surge.entrypoints.cli.main import main


def test_throughput_matches_hf_on_preset(capsys):
    assert main(["bench", "throughput", "--preset", "tiny-qwen3-hybrid", "--num-prompts", "6", "--input-len", "40",
                 "--output-len", "12", "--range-ratio", "0.5", "--compare-hf", "--block-size", "8"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"surge: .* output tok/s", out)
    assert "greedy outputs identical to HF: 6/6" in out


def test_throughput_prints_a_ratio_per_batch_size(capsys):
    assert main(["bench", "throughput", "--preset", "tiny-llama", "--num-prompts", "3", "--input-len", "12",
                 "--output-len", "5", "--compare-hf", "--batch-sizes", "3,1", "--repeats", "2"]) == 0
    out = capsys.readouterr().out
    for size in (3, 1):
        assert re.search(rf"surge \(batch {size}\): .* output tok/s", out)
        assert re.search(rf"hf generate \(batch {size}\): .* output tok/s", out)
        assert re.search(rf"ratio surge / hf \(batch {size}\): [0-9.]+x output tok/s, best of 2 runs each; greedy "
                         r"outputs identical to HF: 3/3", out)


def test_throughput_refuses_bad_batch_sizes(capsys):
    from surge.bench.throughput import parse_batch_sizes

    assert parse_batch_sizes(None) == [None] and parse_batch_sizes("16,1") == [16, 1]
    for bad in ("16,x", "0", ""):
        with pytest.raises(ValueError, match="--batch-sizes"):
            parse_batch_sizes(bad)


class _FakeCB:
    """HF's continuous batching manager as the bench uses it: requests stream one token per result, 1 s apart on a
    fake clock; request "1" wants more tokens than the others get time for."""

    def __init__(self, clock):
        self.clock, self.queue, self.stopped, self.cancelled = clock, [], False, []

    def continuous_batching_context_manager(self, generation_config, block, timeout):
        import contextlib

        @contextlib.contextmanager
        def manager():
            yield self
            self.stopped = True
        return manager()

    def add_request(self, prompt, request_id, max_new_tokens, streaming):
        assert streaming
        self.queue.append([request_id, max_new_tokens, []])

    def cancel_request(self, request_id):
        self.cancelled.append(request_id)

    def get_result(self, timeout):
        import types

        self.clock[0] += 1.0
        live = [q for q in self.queue if len(q[2]) < q[1]]
        rid, want, toks = live[0]
        toks.append(7)
        if len(toks) == want:
            self.queue.remove(live[0])
        return types.SimpleNamespace(request_id=rid, generated_tokens=list(toks),
                                     is_finished=lambda: len(toks) == want)


def test_hf_time_limit_counts_streamed_tokens_of_unfinished_requests(monkeypatch):
    from surge.bench import throughput

    clock = [0.0]
    monkeypatch.setattr(throughput.time, "perf_counter", lambda: clock[0])
    fake = _FakeCB(clock)
    run = throughput._run_hf_continuous(fake, [([1, 2], 2), ([3], 50), ([4], 1)], time_limit=6.5)
    # Results at fake seconds 0..6: request 0's two tokens, then request 1 streams five of its 50.
    assert run.cut_off and fake.stopped and fake.cancelled == ["1", "2"]  # the unfinished ones
    assert run.tokens == [[7, 7], None, None]
    assert run.out_tokens == 7 and run.seconds == pytest.approx(7.0)
    fake = _FakeCB(clock)
    whole = throughput._run_hf_continuous(fake, [([1], 3), ([2], 1)], time_limit=100)
    assert not whole.cut_off and whole.tokens == [[7, 7, 7], [7]] and whole.out_tokens == 4 and not fake.cancelled


def test_hf_time_limit_refuses_nonsense(capsys):
    assert main(["bench", "throughput", "--preset", "tiny-llama", "--num-prompts", "2", "--hf-time-limit", "0"]) != 0
    assert "--hf-time-limit=0 must be > 0 seconds" in capsys.readouterr().err
    assert main(["bench", "throughput", "--preset", "tiny-llama", "--num-prompts", "2", "--input-len", "8",
                 "--output-len", "2", "--compare-hf", "--hf-time-limit", "5"]) != 0
    assert "--hf-time-limit applies to HF generate_batch on CUDA" in capsys.readouterr().err


def test_latency_reports_hardware_rates(capsys):
    assert main(["bench", "latency", "--preset", "tiny-llama", "--batch-sizes", "1,3", "--input-len", "16",
                 "--output-len", "6", "--repeats", "1", "--compare-hf"]) == 0
    out = capsys.readouterr().out
    assert "measured copy bandwidth" in out and "GEMM peak" in out
    assert len(re.findall(r"TFLOP/s \(MFU .*GB/s \(MBU", out)) == 2
    assert "greedy identical: True" in out
    assert re.search(r"KV cache: \d+ bytes per token \(\d+ layers\), [\d,]+ tokens per GB\n", out)  # no MLA


def test_latency_kv_line_sets_the_latent_beside_a_plain_cache(tmp_path):
    """DeepSeek's KV bytes per token come from its MLA cache spec (latent 32 + rope key 8, float32, 3 layers), beside
    a plain multi-head cache of the same model: 4 heads x (keys 16 + 8, values 12) per layer."""
    from surge import LLM
    from surge.bench.latency import _kv_cache_per_token
    from tiny_dsv import make_tiny_model

    llm = LLM(str(make_tiny_model("deepseek-v2", tmp_path)), dtype="float32", block_size=4, kv_cache_memory=1 << 20,
              max_model_len=64)
    per_token, line = _kv_cache_per_token(llm.engine)
    assert per_token == 3 * 40 * 4
    assert line == ("KV cache: 480 bytes per token (3 layers), 2,083,333 tokens per GB; a plain MHA cache of this "
                    "model: 1728 bytes per token, 578,704 tokens per GB (the latent cache holds 3.6x the tokens)")


def test_unknown_preset_is_refused(capsys):
    assert main(["bench", "latency", "--preset", "gpt-5"]) == 2
    assert "preset='gpt-5' is unknown" in capsys.readouterr().err


def test_parity_reports_identity_and_where_outputs_part(capsys):
    assert main(["bench", "parity", "--preset", "tiny-llama", "--num-prompts", "3", "--input-len", "8",
                 "--input-len-max", "20", "--output-len", "10", "--hf-self-check"]) == 0
    out = capsys.readouterr().out
    assert "greedy outputs identical to HF generate (torch.float32): 3/3" in out
    assert out.count("identical for 10 tokens") == 3 and "noise floor" in out


def test_first_divergence():
    from surge.bench.parity import first_divergence

    assert first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert first_divergence([1, 2, 3], [1, 5, 3]) == 1
    assert first_divergence([1, 2], [1, 2, 3]) == 2


def test_moe_preset_against_hf_and_its_active_weights(capsys):
    """tiny-qwen3-moe: the HF peer (its experts stacked in memory) loads into Surge and decodes the same tokens; the
    bytes a decode step reads count the experts it reaches: top-k per layer for one token, all of them for many."""
    import torch

    from surge.bench.common import ActiveWeights
    from surge.model.loader.base import build_model
    from surge.model.presets import preset_model_config

    assert main(["bench", "latency", "--preset", "tiny-qwen3-moe", "--batch-sizes", "1", "--input-len", "16",
                 "--output-len", "6", "--repeats", "1", "--compare-hf"]) == 0
    out = capsys.readouterr().out
    assert "active per token" in out and "greedy identical: True" in out
    model = build_model(preset_model_config("tiny-qwen3-moe", "float32", torch.device("cpu")), torch.device("meta"))
    w = ActiveWeights.of(model)
    per_expert = 3 * 256 * 128 * 4  # gate, up and down of hidden 256 x intermediate 128, float32
    assert (w.num_experts, w.top_k, w.expert_bytes) == (16, 4, 3 * 16 * per_expert)  # 3 sparse layers of 4
    assert w.experts_touched(1) == 4 and w.step_bytes(1) == w.nbytes - w.expert_bytes + 3 * 4 * per_expert
    assert w.experts_touched(10_000) == 16 and w.step_bytes(10_000) == w.nbytes
    assert w.params_per_token == w.params - w.expert_params * 3 / 4
