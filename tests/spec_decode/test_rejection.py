"""Rejection sampling preserves the target distribution: on a small vocabulary, many draws with a fixed seed land on
the target's distribution and not on the draft's (Pearson's chi-square against p, and total variation), for a
point-mass draft (n-gram) and a full draft distribution; and through the runner's verification, with temperature
and top-k, p is the distribution the request would have sampled from at each position."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from surge.sampling_params import SamplingParams
from surge.spec_decode.rejection import rejection_sample
from surge.worker.spec_verify import num_accepted, verify

N = 200_000
# chi-square with 7 degrees of freedom (V = 8): P(X > 24.32) = 0.001, so a correct sampler fails this with
# probability 1e-3 for a random seed (never for the fixed one). A wrong one (drawing from q, or accepting without
# the residual) sits at chi-square in the thousands for these p and q.
CHI2_CRIT_DF7 = 24.32
TV_MARGIN = 0.01  # total variation from p; the draft sits >= 0.3 away


def _chi2(counts: torch.Tensor, p: torch.Tensor) -> float:
    expected = p * counts.sum()
    keep = expected > 0
    assert counts[~keep].sum() == 0, "a token of probability 0 was drawn"
    return float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())


def _tv(counts: torch.Tensor, p: torch.Tensor) -> float:
    return 0.5 * float((counts / counts.sum() - p).abs().sum())


P = torch.tensor([0.30, 0.05, 0.20, 0.0, 0.15, 0.10, 0.12, 0.08])
Q = torch.tensor([0.02, 0.50, 0.03, 0.20, 0.05, 0.10, 0.05, 0.05])


def _draw(p: torch.Tensor, q: torch.Tensor | None, draft: torch.Tensor, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    m = draft.numel()
    uniform = torch.rand(m, generator=g)
    noise = torch.empty(m, p.numel()).exponential_(generator=g)
    accepted, tokens = rejection_sample(p.expand(m, -1), draft, uniform, noise,
                                        None if q is None else q.expand(m, -1))
    assert torch.equal(tokens[accepted], draft[accepted])
    return tokens


def test_draft_distribution_is_corrected_to_the_target():
    g = torch.Generator().manual_seed(1)
    draft = torch.multinomial(Q, N, replacement=True, generator=g)  # proposals drawn from q
    counts = torch.bincount(_draw(P, Q, draft, seed=2), minlength=8).float()
    assert _chi2(counts, P) < CHI2_CRIT_DF7
    assert _tv(counts, P) < TV_MARGIN
    assert _tv(counts, Q) > 0.3 and _tv(torch.bincount(draft, minlength=8).float(), P) > 0.3  # q is far from p


def test_point_mass_draft_gives_the_target():
    """n-gram drafts: always the same token (even one of probability 0 under p); acceptance is p(x)."""
    for token in (1, 3, 0):
        draft = torch.full((N,), token)
        tokens = _draw(P, None, draft, seed=token)
        counts = torch.bincount(tokens, minlength=8).float()
        assert _chi2(counts, P) < CHI2_CRIT_DF7, token
        assert _tv(counts, P) < TV_MARGIN
        rate = float((tokens == token).float().mean())
        assert abs(rate - float(P[token])) < 0.01  # accepted as often as p(x) says


def test_num_accepted_counts_the_leading_run():
    accepted = torch.tensor([True, False, True, True, True, False, True])
    assert num_accepted(accepted, [3, 2, 0, 2]).tolist() == [1, 2, 0, 0]
    assert num_accepted(torch.tensor([True, True]), [2]).tolist() == [2]  # all accepted: k itself
    assert num_accepted(torch.zeros(0, dtype=torch.bool), [0, 0]).tolist() == [0, 0]


@dataclass
class _State:
    """What verification reads of a runner's request state."""
    params: SamplingParams
    prompt_token_ids: list[int] = field(default_factory=lambda: [5, 6])
    output_token_ids: list[int] = field(default_factory=list)
    generator: torch.Generator | None = None

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)


def test_verification_samples_what_the_request_would_have():
    """Two drafts per request, fixed logits per position; temperature 0.7 and top-k 5. The first token follows
    p0 = softmax(top5(l0) / 0.7) whatever the draft; given the first draft accepted, the second follows p1; given
    both, the bonus follows p2. Drafts are chosen so acceptance and rejection both happen often."""
    torch.manual_seed(0)
    V, n = 8, 30_000
    logits = torch.randn(3, V) * 1.5
    params = SamplingParams(temperature=0.7, top_k=5)

    def target(l: torch.Tensor) -> torch.Tensor:
        kth = l.topk(5).values[-1]
        return torch.where(l >= kth, l / 0.7, torch.tensor(float("-inf"))).softmax(-1)

    p = [target(l) for l in logits]
    d0, d1 = int(p[0].argsort()[-2]), int(p[1].argsort()[-1])  # a likely first draft, the likeliest second
    requests = [(_State(params), [d0, d1]) for _ in range(n)]
    out = verify(logits.repeat(n, 1), requests)
    tokens = out.token_ids.view(n, 3)
    a = out.num_accepted
    first = torch.bincount(tokens[:, 0], minlength=V).float()
    assert _chi2(first, p[0]) < CHI2_CRIT_DF7
    second = torch.bincount(tokens[a >= 1, 1], minlength=V).float()
    assert _chi2(second, p[1]) < CHI2_CRIT_DF7
    bonus = torch.bincount(tokens[a == 2, 2], minlength=V).float()
    assert bonus.sum() > 2000 and _chi2(bonus, p[2]) < CHI2_CRIT_DF7
    assert abs(float((a >= 1).float().mean()) - float(p[0][d0])) < 0.015


def test_verification_is_seeded_per_request():
    V = 16
    logits = torch.randn(4, V)
    params = SamplingParams(temperature=1.0, seed=7)

    def run(seed: int) -> list[int]:
        state = _State(params.clone(seed=seed), generator=torch.Generator().manual_seed(seed))
        return verify(logits, [(state, [1, 2, 3])]).token_ids.tolist()

    runs = [run(s) for s in (7, 7, 8, 9, 10)]
    assert runs[0] == runs[1]
    assert len({tuple(r) for r in runs[1:]}) > 1


def test_greedy_rows_take_the_argmax_after_penalties():
    """A repetition penalty turns the argmax away from a token seen before: the verdict follows the penalised
    logits at each position, counting the drafts before it."""
    logits = torch.zeros(3, 8)
    logits[:, 4] = 2.0
    logits[:, 5] = 1.5
    params = SamplingParams(temperature=0, repetition_penalty=2.0)
    out = verify(logits, [(_State(params, prompt_token_ids=[0, 1]), [4, 5])])
    # position 0: 4 (unseen). position 1: 4 seen (2.0 / 2 = 1.0 < 1.5): 5, the draft. position 2: both seen: 4
    # (1.0) vs 5 (0.75), so 4.
    assert out.token_ids.tolist() == [4, 5, 4] and out.num_accepted.tolist() == [2]


def test_greedy_verdicts_counted_on_the_host_equal_the_device_ones():
    """Without a draft model the greedy verdicts are counted on the host from the argmax (no device ops): the same
    tokens and accepted counts as the device path, on random logits and drafts that match some leading positions."""
    from surge.worker.spec_verify import VerifiedDrafts

    g = torch.Generator().manual_seed(0)
    params = SamplingParams(temperature=0)
    for trial in range(20):
        ks = torch.randint(0, 5, (4,), generator=g).tolist()
        logits = torch.randn(sum(k + 1 for k in ks), 16, generator=g)
        best, requests, o = logits.argmax(-1).tolist(), [], 0
        for k in ks:  # a random-length prefix of each request's drafts agrees with the argmax
            run = int(torch.randint(0, k + 1, (1,), generator=g))
            drafts = best[o:o + run] + [(t + 1) % 16 for t in best[o + run:o + k]]
            requests.append((_State(params, prompt_token_ids=[1]), drafts))
            o += k + 1
        device, host = verify(logits, requests), verify(logits, requests, device_verdicts=False)
        assert host.num_accepted is None and torch.equal(host.token_ids, device.token_ids)
        results = []
        for out in (device, host):
            result = type("Result", (), {"sampled": {}, "logprobs": {}})()
            VerifiedDrafts([str(i) for i in range(len(ks))], [d for _, d in requests], [None] * len(ks),
                           out.token_ids, out.num_accepted, None).into(result)
            results.append(result.sampled)
        assert results[0] == results[1], trial
        assert [len(t) - 1 for t in results[1].values()] == device.num_accepted.tolist()


def test_drafts_given_on_the_device_verify_as_the_host_lists_do():
    """A request scheduled ahead of its verdict has its drafts on the device only: given as a count with the tokens
    in draft_ids, its verdict (greedy or seeded sampling) is the one the host lists give."""
    g = torch.Generator().manual_seed(3)
    drafts = [[3, 4], [5], [6, 7, 8, 9]]
    logits = torch.randn(sum(len(d) + 1 for d in drafts), 16, generator=g)
    for params in (SamplingParams(temperature=0), SamplingParams(temperature=0.9, seed=5)):
        def run(device_side: bool):
            requests = [(_State(params, generator=torch.Generator().manual_seed(5) if params.seed else None),
                         len(d) if device_side else d) for d in drafts]
            ids = torch.tensor([t for d in drafts for t in d]) if device_side else None
            return verify(logits, requests, draft_ids=ids)
        lists, counts = run(False), run(True)
        assert torch.equal(lists.token_ids, counts.token_ids) and torch.equal(lists.num_accepted, counts.num_accepted)
