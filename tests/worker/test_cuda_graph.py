"""Capture sizes cover every batch up to max_num_seqs with bounded padding; the replay test needs CUDA."""
from __future__ import annotations

import pytest
import torch

from surge.worker.cuda_graph import capture_sizes


@pytest.mark.parametrize("max_num_seqs", [1, 2, 3, 7, 8, 9, 128, 255, 256, 257, 300, 512])
def test_capture_sizes_cover_every_batch(max_num_seqs):
    sizes = capture_sizes(max_num_seqs)
    assert sizes == sorted(set(sizes)) and sizes[-1] == max_num_seqs and sizes[0] == 1
    for n in range(1, max_num_seqs + 1):
        padded = min(s for s in sizes if s >= n)
        assert padded - n < 16  # at most one step of padding


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_graph_replay_matches_eager():
    from surge import LLM, SamplingParams
    prompts = [[5 + i, 6, 7, 8, 9] * (i + 1) for i in range(5)]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    eager = LLM(preset="tiny-llama", load_format="dummy", enforce_eager=True, skip_tokenizer_init=True)
    graphs = LLM(preset="tiny-llama", load_format="dummy", skip_tokenizer_init=True)
    assert graphs.engine.runner.graph_runner is not None
    a = [o.outputs[0].token_ids for o in eager.generate(prompts, params, use_tqdm=False)]
    b = [o.outputs[0].token_ids for o in graphs.generate(prompts, params, use_tqdm=False)]
    assert a == b
