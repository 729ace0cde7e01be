"""Sampler tests against plain-Python / NumPy references of each step (penalties, filters, logprobs)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from surge.model.layers.sampler import Sampler, SamplingRow, _apply_penalties, compute_token_logprobs, greedy_argmax
from surge.sampling_params import SamplingParams

V = 12


def row(prompt=(), output=(), seed=None, **kw) -> SamplingRow:
    gen = torch.Generator().manual_seed(seed) if seed is not None else None
    return SamplingRow(SamplingParams(**kw), list(prompt), list(output), gen)


def ref_penalize(logits: list[float], prompt, output, rep, freq, pres) -> list[float]:
    out = list(logits)
    for t in range(len(out)):
        if t in prompt or t in output:
            out[t] = out[t] / rep if out[t] > 0 else out[t] * rep
        count = sum(1 for o in output if o == t)
        out[t] -= freq * count + pres * (1.0 if count else 0.0)
    return out


def ref_probs(logits: np.ndarray, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0) -> np.ndarray:
    x = logits.astype(np.float64) / temperature
    p = np.exp(x - x.max())
    p /= p.sum()
    if top_k:
        p[x < np.sort(x)[::-1][top_k - 1]] = 0
        p /= p.sum()
    order = np.argsort(-p, kind="stable")
    total = 0.0
    for rank, t in enumerate(order):  # keep the smallest prefix whose mass reaches top_p
        if total >= top_p:
            p[order[rank:]] = 0
            break
        total += p[t]
    p /= p.sum()
    p[p < min_p * p.max()] = 0
    return p / p.sum()


def test_greedy_is_argmax_first_on_ties():
    torch.manual_seed(0)
    logits = torch.randint(0, 4, (64, V)).float()  # many ties
    out = Sampler()(logits, [row(temperature=0.0) for _ in range(64)])
    assert out.sampled_token_ids.tolist() == [int(np.argmax(r)) for r in logits.numpy()]
    assert out.logprobs is None and out.logprob_token_ids is None and out.sampled_token_ranks is None


def test_penalties_match_reference():
    torch.manual_seed(1)
    rng = np.random.default_rng(1)
    logits = torch.randn(16, V) * 3
    rows, expected = [], []
    for i in range(16):
        prompt, output = rng.integers(0, V, 6).tolist(), rng.integers(0, V, 5 + i % 4).tolist()
        rep, freq, pres = [1.0, 1.3, 0.7][i % 3], [0.0, 0.5, -1.2][i % 3], [0.0, 1.5, 0.4][(i // 3) % 3]
        rows.append(row(prompt, output, temperature=0.0, repetition_penalty=rep, frequency_penalty=freq,
                        presence_penalty=pres))
        expected.append(ref_penalize(logits[i].tolist(), prompt, output, rep, freq, pres))
    penalized = logits.clone()
    _apply_penalties(penalized, rows)
    np.testing.assert_allclose(penalized.numpy(), np.array(expected), rtol=1e-6, atol=1e-6)
    original = logits.clone()
    out = Sampler()(logits, rows)
    assert torch.equal(logits, original), "the caller's logits must not change"
    assert out.sampled_token_ids.tolist() == [int(np.argmax(e)) for e in expected]


def test_min_tokens_masks_eos_and_stop_ids():
    logits = torch.arange(V, dtype=torch.float32).repeat(5, 1)  # V-1 best, then V-2, V-3
    eos = (V - 1,)
    rows = [
        row(output=[1], temperature=0.0, min_tokens=3, stop_token_ids=[V - 2], _eos_token_ids=eos),
        row(output=[1, 2, 3], temperature=0.0, min_tokens=3, stop_token_ids=[V - 2], _eos_token_ids=eos),
        row(output=[], temperature=0.0, min_tokens=2, ignore_eos=True, _eos_token_ids=eos),
        row(output=[], temperature=0.0, min_tokens=2, stop_token_ids=[V - 2, V - 1]),
        row(output=[], temperature=0.7, seed=3, min_tokens=1, stop_token_ids=[V - 3], top_k=1, _eos_token_ids=eos),
    ]
    assert Sampler()(logits, rows).sampled_token_ids.tolist() == [V - 3, V - 1, V - 1, V - 3, V - 2]


@pytest.mark.parametrize("kw", [
    dict(temperature=1.0), dict(temperature=0.6, top_k=4), dict(top_p=0.7), dict(temperature=1.5, top_p=0.9),
    dict(min_p=0.2), dict(temperature=0.8, top_k=6, top_p=0.8, min_p=0.1), dict(top_k=1),
])
def test_filters_match_reference_distribution(kw):
    n = 40_000
    logits = torch.tensor([1.0, 2.5, 0.3, 2.0, -1.0, 1.7, 0.9, 2.2, -0.5, 1.2, 0.1, 1.9])
    torch.manual_seed(123)
    tokens = Sampler()(logits.repeat(n, 1), [row(**kw)] * n).sampled_token_ids.numpy()
    expected = ref_probs(logits.numpy(), **kw)
    empirical = np.bincount(tokens, minlength=V) / n
    assert empirical[expected == 0].sum() == 0, "a filtered-out token was sampled"
    assert np.abs(empirical - expected).max() < 0.015, (empirical, expected)


def test_top_p_boundaries():
    torch.manual_seed(0)
    logits = torch.randn(200, V)
    tiny = Sampler()(logits, [row(top_p=1e-6) for _ in range(200)]).sampled_token_ids
    assert tiny.tolist() == logits.argmax(-1).tolist()
    # The kept set is the smallest prefix reaching top_p: just under a token's cumulative mass keeps it and stops.
    probs = torch.log(torch.tensor([0.5, 0.25, 0.15, 0.1])).repeat(4000, 1)
    torch.manual_seed(1)
    for top_p, kept in [(0.49, {0}), (0.51, {0, 1}), (0.74, {0, 1}), (0.76, {0, 1, 2}), (0.91, {0, 1, 2, 3})]:
        assert set(Sampler()(probs, [row(top_p=top_p)] * 4000).sampled_token_ids.tolist()) == kept


def test_seeded_row_is_independent_of_batch():
    torch.manual_seed(5)
    logits = torch.randn(6, 8, V)  # 8 steps
    kw = dict(temperature=1.3, top_p=0.95)
    torch.manual_seed(100)
    gen = torch.Generator().manual_seed(42)
    alone = [Sampler()(logits[0, s:s + 1], [SamplingRow(SamplingParams(**kw), [], [], gen)]).sampled_token_ids.item()
             for s in range(8)]
    for position in (0, 3, 5):
        torch.manual_seed(200 + position)  # a different global RNG state must not matter
        gen = torch.Generator().manual_seed(42)
        got = []
        for s in range(8):
            rows = [row(temperature=0.9, seed=7 + i if i % 2 else None) for i in range(6)]
            rows[position] = SamplingRow(SamplingParams(**kw), [], [], gen)
            batch = logits[:, s].clone()
            batch[position] = logits[0, s]
            got.append(Sampler()(batch, rows).sampled_token_ids[position].item())
        assert got == alone
    other = torch.Generator().manual_seed(43)
    assert [Sampler()(logits[0, s:s + 1], [SamplingRow(SamplingParams(**kw), [], [], other)])
            .sampled_token_ids.item() for s in range(8)] != alone


def ref_logprobs(logits: np.ndarray) -> np.ndarray:
    x = logits.astype(np.float64)
    return x - x.max(-1, keepdims=True) - np.log(np.exp(x - x.max(-1, keepdims=True)).sum(-1, keepdims=True))


def test_compute_token_logprobs_with_ties():
    logits = torch.tensor([[3.0, 1.0, 3.0, 2.0, 1.0, 0.0], [0.0, 0.0, 0.0, 5.0, -1.0, 4.0]])
    targets = torch.tensor([4, 1])
    ids, lps, ranks = compute_token_logprobs(logits, targets, 3)
    ref = ref_logprobs(logits.numpy())
    assert ranks.tolist() == [1 + sum(v > r[t] for v in r) for r, t in zip(ref, targets.tolist())] == [4, 3]
    assert ids[:, 0].tolist() == [4, 1]
    np.testing.assert_allclose(lps.numpy(), np.take_along_axis(ref, ids.numpy(), 1), atol=1e-6)
    assert sorted(ids[0, 1:3].tolist()) == [0, 2] and ids[0, 3].item() == 3
    assert ids[1, 1:].tolist()[:2] == [3, 5]
    assert (np.diff(lps[:, 1:].numpy(), axis=1) <= 0).all()
    assert compute_token_logprobs(logits, targets, 0)[0].shape == (2, 1)


def test_logprobs_are_raw_and_ranked():
    torch.manual_seed(3)
    logits = torch.randn(4, V, dtype=torch.bfloat16)
    # Penalties and temperature change what is sampled but never the reported logprobs.
    rows = [row(temperature=0.0, min_tokens=1, stop_token_ids=[int(logits[0].float().argmax())],
                repetition_penalty=2.0, prompt=[1, 2], logprobs=3),
            row(seed=1, temperature=0.5, logprobs=5), row(temperature=0.0), row(seed=2, top_k=3, logprobs=0)]
    out = Sampler()(logits, rows)
    ref = ref_logprobs(logits.float().numpy())
    sampled = out.sampled_token_ids.tolist()
    assert out.logprob_token_ids.shape == out.logprobs.shape == (4, 6) and out.logprobs.dtype == torch.float32
    assert out.logprob_token_ids[:, 0].tolist() == sampled
    np.testing.assert_allclose(out.logprobs.numpy(), np.take_along_axis(ref, out.logprob_token_ids.numpy(), 1),
                               atol=1e-5)
    for i in range(4):
        assert out.logprob_token_ids[i, 1:].tolist() == np.argsort(-ref[i], kind="stable")[:5].tolist()
        assert out.sampled_token_ranks[i].item() == 1 + int((ref[i] > ref[i, sampled[i]]).sum())
    assert out.sampled_token_ranks[0].item() > 1


def test_mixed_batch_equals_rows_alone():
    torch.manual_seed(9)
    logits = torch.randn(6, V) * 2
    specs = [dict(temperature=0.0, logprobs=2), dict(temperature=0.8, top_k=3, seed=1),
             dict(temperature=1.2, top_p=0.6, seed=2, logprobs=4), dict(temperature=0.0, repetition_penalty=1.5),
             dict(min_p=0.3, seed=3, frequency_penalty=0.8, logprobs=0), dict(temperature=0.7, seed=4, top_k=5,
                                                                              top_p=0.9, presence_penalty=1.0)]
    def make(i: int, step: int) -> SamplingRow:
        spec = dict(specs[i], seed=specs[i]["seed"] + 10 * step) if "seed" in specs[i] else specs[i]
        return row(prompt=[1, 2, 3], output=[i, 4, 4], **spec)

    for step in range(5):  # several seeds so random rows are exercised, not just lucky once
        batch = Sampler()(logits, [make(i, step) for i in range(6)])
        for i in range(6):
            alone = Sampler()(logits[i:i + 1], [make(i, step)])
            assert batch.sampled_token_ids[i] == alone.sampled_token_ids[0]
            if specs[i].get("logprobs") is not None:
                k = 1 + specs[i]["logprobs"]
                assert torch.equal(batch.logprob_token_ids[i, :k], alone.logprob_token_ids[0])
                torch.testing.assert_close(batch.logprobs[i, :k], alone.logprobs[0])
                assert batch.sampled_token_ranks[i] == alone.sampled_token_ranks[0]


def test_greedy_batch_on_bf16_logits_is_argmax_without_a_float_copy():
    torch.manual_seed(4)
    logits = (torch.randn(16, V) * 3).to(torch.bfloat16)  # bf16 rounding: ties, resolved to the lowest id
    logits[0, 5] = float("nan")  # NaN is the maximum, as torch.argmax has it
    out = Sampler()(logits, [row(temperature=0.0) for _ in range(16)]).sampled_token_ids
    assert out.tolist() == logits.float().argmax(dim=-1).tolist() and out[0] == 5


def testexponential_noise_keeps_seeded_rows_on_their_generators():
    from surge.model.layers.sampler import exponential_noise

    rows = [row(seed=7), row(), row(temperature=0.0), row(seed=8)]
    torch.manual_seed(0)
    noise = exponential_noise(rows, V, torch.device("cpu"), clamp=False)
    assert noise[0].tolist() == torch.empty(V).exponential_(generator=torch.Generator().manual_seed(7)).tolist()
    assert noise[3].tolist() == torch.empty(V).exponential_(generator=torch.Generator().manual_seed(8)).tolist()
    assert noise[2].tolist() == [1.0] * V and (noise[1] > 0).all()
    tiny = torch.finfo(torch.float32).tiny
    assert (exponential_noise([row()], V, torch.device("cpu")) >= tiny).all()


@pytest.mark.parametrize("temperature", [1e-38, 1e-30, 1e-6])
def test_tiny_temperature_is_greedy(temperature):
    """logits / 1e-38 overflows to inf and the softmax to NaN; below 1e-5 a temperature means greedy (as vLLM)."""
    torch.manual_seed(3)
    logits = torch.randn(8, V) * 5
    logits[:, 0] = -10.0  # a NaN softmax would pick id 0
    argmax = [int(np.argmax(r)) for r in logits.numpy()]
    assert Sampler()(logits, [row(temperature=temperature) for _ in range(8)]).sampled_token_ids.tolist() == argmax
    # Beside rows that sample, with filters on: still the argmax.
    rows = [row(temperature=temperature, top_k=3, top_p=0.9) if i % 2 == 0 else row(temperature=1.0, seed=i)
            for i in range(8)]
    assert Sampler()(logits, rows).sampled_token_ids.tolist()[::2] == argmax[::2]


@pytest.mark.parametrize("value", [float("inf"), float("nan"), -1.0])
def test_temperature_must_be_finite_and_non_negative(value):
    with pytest.raises(ValueError, match=r"temperature=.* finite number >= 0"):
        SamplingParams(temperature=value)


@pytest.mark.parametrize("vocab_size", [49152, 151936, 128256, 1000, 50257])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_argmax_is_torch_argmax(vocab_size, dtype):
    """Ties (inside a block, across blocks, at block edges), rows all -inf, a NaN, and random rows: torch's argmax."""
    g = torch.Generator().manual_seed(vocab_size)
    x = torch.randn(9, vocab_size, generator=g).to(dtype)
    top = torch.tensor(1e4, dtype=dtype)
    x[0, [5, 7]] = top  # one block
    x[1, [vocab_size - 1, 3]] = top  # first and last block
    x[2, [1023, 1024, 2047] if vocab_size > 2048 else [63, 64]] = top  # both sides of a block edge
    x[3] = float("-inf")
    x[4, [100, vocab_size - 7]] = float("nan")
    x[5, -1] = top
    x[6, 0] = top
    assert torch.equal(greedy_argmax(x), x.argmax(dim=-1))
    assert torch.equal(greedy_argmax(x[:, :-1]), x[:, :-1].argmax(dim=-1))  # not contiguous
