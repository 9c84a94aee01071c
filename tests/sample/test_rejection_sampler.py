"""Tests for speculative-decoding rejection sampling (tokenmill/sample/rejection_sampler.py).

The statistical tests put N requests with the same per-position target p_j and draft q_j in one
call and check, by a chi-square test, that the token emitted at position t (among requests that
reach it) is distributed as p_t. scipy is not installed, so chi2_sf uses the closed forms of the
chi-square upper tail (checked against table values below). Seeds are fixed: the tests are
deterministic, and each p-value threshold was met with a wide margin.
"""
from __future__ import annotations

import math

import pytest
import torch

from tokenmill.sample import rejection_sampler as rs
from tokenmill.sample.draws import UNSEEDED, position_seed
from tokenmill.sample.rejection_sampler import rejection_sample as _rejection_sample
from tokenmill.sample.sampler import SamplingMetadata, apply_top_k_top_p_min_p
from tokenmill.sampling_params import SamplingParams


def rejection_sample(*args):
    """The sampler's rejection_sample with the accepted counts as a list (the runner copies them to the host with
    the step's other results)."""
    tokens, num_accepted = _rejection_sample(*args)
    return tokens, num_accepted.tolist()


N = 20000


def chi2_sf(x: float, df: int) -> float:
    """P(X > x) for X ~ chi-square(df), df >= 1 (exact closed forms for even and odd df)."""
    h = x / 2
    if df % 2 == 0:
        term = total = math.exp(-h)
        for i in range(1, df // 2):
            term *= h / i
            total += term
        return total
    total = math.erfc(math.sqrt(h))
    term = math.sqrt(2 / math.pi) * math.exp(-h) * math.sqrt(x)
    for r in range(1, (df - 1) // 2 + 1):
        total += term
        term *= x / (2 * r + 1)
    return total


CRITICAL_AT_001 = [(1, 6.635), (2, 9.210), (3, 11.345), (4, 13.277), (5, 15.086), (7, 18.475)]


@pytest.mark.parametrize("df,critical", CRITICAL_AT_001)
def test_chi2_sf_matches_table(df, critical):
    assert chi2_sf(critical, df) == pytest.approx(0.01, rel=1e-3)


def chi2_pvalue(tokens: torch.Tensor, p: torch.Tensor) -> float:
    """Goodness of fit of `tokens` to p; zero-probability tokens must never occur."""
    observed = torch.bincount(tokens, minlength=p.numel()).double()
    support = p > 0
    assert observed[~support].sum() == 0
    if support.sum() == 1:
        return 1.0
    expected = p[support].double() * len(tokens)
    assert expected.min() >= 5, "too few samples for a chi-square test"
    stat = ((observed[support] - expected) ** 2 / expected).sum().item()
    return chi2_sf(stat, int(support.sum()) - 1)


def emitted_pvalues(p: torch.Tensor, q: torch.Tensor | None, drafts: torch.Tensor, seed: int = 0) -> list[float]:
    """p [k+1, V] target per position, q [k, V] draft distribution (None: point mass), drafts [N, k].
    One call for N requests; the p-value of the emitted token at each position t against p_t."""
    n, k = drafts.shape
    torch.manual_seed(seed)
    tokens, num_accepted = rejection_sample(
        p.repeat(n, 1),
        p.argmax(dim=-1).repeat(n),
        [k + 1] * n,
        drafts.tolist(),
        [q] * n,
        [False] * n,
        None,
    )
    tokens = tokens.view(n, k + 1)
    num_accepted = torch.tensor(num_accepted)
    assert ((num_accepted >= 0) & (num_accepted <= k)).all()
    assert (tokens[:, :k] == drafts).logical_or(torch.arange(k) >= num_accepted[:, None]).all()
    # Position t is emitted by the requests that accepted at least t drafts; the target does not
    # depend on the prefix, so it is distributed as p_t there.
    return [chi2_pvalue(tokens[num_accepted >= t, t], p[t]) for t in range(k + 1)]


def random_dist(rows: int, V: int, g: torch.Generator, sharpness: float = 1.5) -> torch.Tensor:
    return (torch.randn(rows, V, generator=g) * sharpness).softmax(dim=-1)


def draft_samples(q: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    """[N, k] drafts, column j ~ q_j."""
    return torch.stack([torch.multinomial(qj, N, replacement=True, generator=g) for qj in q], dim=1)


@pytest.mark.parametrize("k", [1, 2, 3])
def test_emitted_tokens_follow_target_with_draft_distribution(k):
    g = torch.Generator().manual_seed(100 + k)
    V = 6
    p, q = random_dist(k + 1, V, g), random_dist(k, V, g)
    pvalues = emitted_pvalues(p, q, draft_samples(q, g), seed=k)
    assert min(pvalues) > 0.01, pvalues


def top_p_target(rows: int, V: int, g: torch.Generator) -> torch.Tensor:
    logits = torch.randn(rows, V, generator=g) * 1.5
    params = [SamplingParams(temperature=1.0, top_p=0.9)] * rows
    meta = SamplingMetadata.build(params, [[]] * rows, [[]] * rows, [None] * rows, [[]] * rows, V)
    return apply_top_k_top_p_min_p(logits, meta).softmax(dim=-1)


@pytest.mark.parametrize("k", [1, 3])
def test_emitted_tokens_follow_top_p_target_with_point_mass_drafts(k):
    g = torch.Generator().manual_seed(200 + k)
    V = 8
    p = top_p_target(k + 1, V, g)
    assert (p == 0).any(dim=-1).all()  # top-p removed something in every row
    # n-gram-style proposals: fixed tokens, independent of the sampler's randomness, some outside
    # the top-p set (always rejected).
    drafts = torch.stack([p[j].argmax().expand(N) if j % 2 else torch.arange(N) % V for j in range(k)], dim=1)
    pvalues = emitted_pvalues(p, None, drafts, seed=k)
    assert min(pvalues) > 0.01, pvalues


def broken_always_accept(u, p_d, q_d):
    return torch.ones_like(u, dtype=torch.bool)


def broken_resample_from_p(probs, q):
    return probs


@pytest.mark.parametrize("helper,broken", [
    ("_accept", broken_always_accept),
    ("_residual", broken_resample_from_p),
])
def test_broken_rule_fails_the_same_check(monkeypatch, helper, broken):
    monkeypatch.setattr(rs, helper, broken)
    g = torch.Generator().manual_seed(102)
    V, k = 6, 2
    p, q = random_dist(k + 1, V, g), random_dist(k, V, g)
    assert emitted_pvalues(p, q, draft_samples(q, g))[0] < 1e-6


def one_hot(tokens: list[int], V: int) -> torch.Tensor:
    return torch.nn.functional.one_hot(torch.tensor(tokens), V).float()


def test_greedy_prefix_correction_and_bonus():
    V = 10
    greedy = [3, 4, 5, 6] + [7, 8, 9, 1] + [2]
    probs = torch.full((len(greedy), V), 1.0 / V)
    tokens, num_accepted = rejection_sample(
        probs, torch.tensor(greedy), [4, 4, 1], [[3, 4, 0], [7, 8, 9], []], [None] * 3, [True] * 3, None
    )
    assert num_accepted == [2, 3, 0]
    assert tokens[:3].tolist() == [3, 4, 5]  # two accepted, then the target's argmax at the mismatch
    assert tokens[4:8].tolist() == [7, 8, 9, 1]  # all accepted, then the bonus
    assert tokens[8].item() == 2


def test_mixed_batch_gives_per_request_results():
    V = 10
    # Random requests with one-hot targets are deterministic: draft j is accepted iff it is t_j.
    requests = [  # (greedy, target argmax per row, drafts, expected accepted, expected tokens)
        (True, [1, 2, 3], [1, 5], 1, [1, 2]),
        (False, [4, 5, 6, 7], [4, 5, 6], 3, [4, 5, 6, 7]),
        (False, [8], [], 0, [8]),
        (True, [9], [], 0, [9]),
        (False, [2, 3], [0], 0, [2]),
        (True, [6, 7, 8], [6, 7], 2, [6, 7, 8]),
    ]
    targets = [t for r in requests for t in r[1]]
    tokens, num_accepted = rejection_sample(
        one_hot(targets, V),
        torch.tensor(targets),
        [len(r[1]) for r in requests],
        [r[2] for r in requests],
        [None] * len(requests),
        [r[0] for r in requests],
        None,
    )
    assert num_accepted == [r[3] for r in requests]
    start = 0
    for r, n in zip(requests, num_accepted):
        assert tokens[start : start + n + 1].tolist() == r[4]
        start += len(r[1])


def test_seeded_requests_do_not_depend_on_the_batch():
    g = torch.Generator().manual_seed(7)
    V = 50
    p = random_dist(8, V, g, sharpness=0.5)  # flat: many rejections, so the noise matters
    q = random_dist(3, V, g, sharpness=0.5)
    seeded = dict(rows=4, drafts=[0, 1, 2], q=q)

    def run(batch: list[dict], seed_of: list[int | None]):
        rows = [b["rows"] for b in batch]
        probs = torch.cat([p[: b["rows"]] for b in batch])
        # Each row keyed by its request's seed and the output position it samples (as the sampling state does).
        keys = torch.tensor([UNSEEDED if s is None else position_seed(s, j)
                             for b, s in zip(batch, seed_of) for j in range(b["rows"])])
        tokens, acc = rejection_sample(
            probs, probs.argmax(dim=-1), rows, [b["drafts"] for b in batch], [b["q"] for b in batch],
            [b.get("greedy", False) for b in batch], keys,
        )
        return tokens.split(rows), acc

    alone_tokens, alone_acc = zip(*[run([seeded], [s]) for s in range(20)])
    other = dict(rows=2, drafts=[5], q=None)
    greedy = dict(rows=3, drafts=[1, 2], q=None, greedy=True)
    no_drafts = dict(rows=1, drafts=[], q=None)
    for s in range(20):
        tokens, acc = run([other, seeded, greedy, no_drafts, seeded], [None, s, 123, 456, s])
        for i in (1, 4):
            n = acc[i]
            assert n == alone_acc[s][0]
            assert torch.equal(tokens[i][: n + 1], alone_tokens[s][0][: n + 1])
    emitted = {tuple(t[0][: n[0] + 1].tolist()) for t, n in zip(alone_tokens, alone_acc)}
    assert len(emitted) > 5  # the seed does change the outcome


def test_draft_with_zero_q_and_target_with_zero_p():
    V = 4
    p = torch.tensor([[0.5, 0.3, 0.2, 0.0], [0.25, 0.25, 0.25, 0.25]]).repeat(N // 10, 1)
    n = N // 10
    # d = 2: q(d) = 0 < p(d) -> always accepted.
    q = torch.tensor([[0.6, 0.4, 0.0, 0.0]])
    tokens, acc = rejection_sample(p, p.argmax(-1), [2] * n, [[2]] * n, [q] * n, [False] * n, None)
    assert acc == [1] * n and (tokens.view(n, 2)[:, 0] == 2).all()
    # d = 3: p(d) = 0 -> always rejected; the correction is never d.
    q = torch.tensor([[0.1, 0.1, 0.1, 0.7]])
    for draft_q in (q, None):
        tokens, acc = rejection_sample(p, p.argmax(-1), [2] * n, [[3]] * n, [draft_q] * n, [False] * n, None)
        assert acc == [0] * n and (tokens.view(n, 2)[:, 0] != 3).all()


def test_zero_residual_samples_from_target():
    # p == q and the draft has p(d) = q(d) = 0: rejected, max(0, p - q) is all zero -> sample from p.
    p = torch.tensor([[0.5, 0.5, 0.0, 0.0], [0.0, 0.0, 1.0, 0.0]])
    n = 200
    tokens, acc = rejection_sample(
        p.repeat(n, 1), p.argmax(-1).repeat(n), [2] * n, [[3]] * n, [p[:1]] * n, [False] * n, None
    )
    first = tokens.view(n, 2)[:, 0]
    assert acc == [0] * n
    assert set(first.tolist()) == {0, 1}
    assert torch.equal(rs._residual(p, p), p)
    # p == q with a draft from q is always accepted (ratio 1), and the bonus comes from p_k.
    tokens, acc = rejection_sample(
        p.repeat(n, 1), p.argmax(-1).repeat(n), [2] * n, [[0]] * n, [p[:1]] * n, [False] * n, None
    )
    assert acc == [1] * n and (tokens.view(n, 2)[:, 1] == 2).all()


def test_empty_batch():
    tokens, acc = rejection_sample(torch.zeros(0, 5), torch.zeros(0, dtype=torch.int64), [], [], [], [], None)
    assert tokens.shape == (0,) and acc == []
