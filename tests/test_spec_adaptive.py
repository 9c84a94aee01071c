"""The adaptive speculation policy (pure Python): k from measured forward costs and acceptance."""
from __future__ import annotations

import pytest

from tokenmill.spec_decode.adaptive import AdaptivePolicy, ForwardCost, expected_tokens


def test_expected_tokens():
    assert expected_tokens(0.0, 4) == 1.0
    assert expected_tokens(1.0, 4) == 5.0
    assert expected_tokens(0.5, 2) == pytest.approx(1.75)


def test_forward_cost_interpolates_and_extrapolates():
    f = ForwardCost()
    assert f(10) is None
    f.observe(1, 0.010)
    f.observe(64, 0.020)
    assert f(1) == pytest.approx(0.010)
    assert 0.010 < f(16) < 0.020
    assert f(128) == pytest.approx(0.040)  # proportional beyond the largest seen
    assert f(0.5) == pytest.approx(0.010)  # flat below the smallest


def _policy(costs: dict[int, float], accepted: int, drafted: int, **kw) -> AdaptivePolicy:
    p = AdaptivePolicy(4, **kw)
    for tokens, s in costs.items():
        p.forward.observe(tokens, s)
    for _ in range(200):
        p.observe_verification(drafted, accepted)
    return p


def test_bandwidth_bound_batch_speculates_compute_bound_does_not():
    # Weight-bound: 1..5 tokens cost the same. Compute-bound at 64+: time grows with tokens.
    costs = {1: 0.010, 4: 0.0105, 8: 0.011, 64: 0.040, 128: 0.080, 256: 0.160, 512: 0.320}
    p = _policy(costs, accepted=3, drafted=4)
    assert p.choose(1) >= 3
    assert p.choose(64) == 0


def test_k_follows_acceptance():
    costs = {1: 0.010, 2: 0.0102, 4: 0.0106, 8: 0.013, 16: 0.02}
    high = _policy(costs, accepted=4, drafted=4)
    low = _policy(costs, accepted=0, drafted=4)
    assert high.choose(1) == 4
    assert low.choose(1) == 0


def test_draft_cost_counts():
    costs = {1: 0.010, 4: 0.0105, 8: 0.011}
    p = _policy(costs, accepted=3, drafted=4)
    assert p.choose(1) > 0
    p.observe_draft(1, 4, 4 * 0.010)  # each drafted position costs a whole target forward
    assert p.choose(1) == 0


def test_switches():
    costs = {1: 0.01, 64: 0.64, 256: 2.56}
    assert _policy(costs, 0, 4, adaptive=False).choose(64) == 4
    assert _policy({1: 0.01, 8: 0.01}, 4, 4, disable_by_batch_size=8).choose(8) == 0
    assert _policy({1: 0.01, 8: 0.01}, 4, 4, disable_by_batch_size=8).choose(4) > 0
