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


def _verify(p: AdaptivePolicy, batch: int, accepted_at, steps: int = 300) -> list[int]:
    """Run the choose/observe loop: accepted_at(k) accepted drafts per verification at k. The ks chosen."""
    chosen = []
    for _ in range(steps):
        k = p.choose(batch)
        chosen.append(k)
        if k:
            p.observe_verification(k, accepted_at(k))
    return chosen


def test_tree_size_is_learned_per_k():
    """A tree whose accepted path stops at 2 whatever its size, on a target whose cost grows with every row:
    the geometric model (acceptance 2/3 per draft) would want the biggest tree; the learned figures settle on a
    small one. With the path growing with the tree, the biggest pays."""
    costs = {1: 0.010, 2: 0.0110, 4: 0.0130, 8: 0.017, 16: 0.025, 32: 0.04}
    flat = AdaptivePolicy(12, shape="tree", drafter="lookup")
    for t, s in costs.items():
        flat.forward.observe(t, s)
    chosen = _verify(flat, 1, lambda k: min(k, 2))
    assert all(2 <= k <= 4 for k in chosen[-50:] if k), chosen[-50:]
    grows = AdaptivePolicy(12, shape="tree", drafter="lookup")
    for t, s in costs.items():
        grows.forward.observe(t, s)
    chosen = _verify(grows, 1, lambda k: k)
    assert max(chosen[-50:]) == 12


def test_block_rows_are_what_the_drafter_sent():
    """Blocks cut by the drafter's estimate: the policy prices the rows it actually verified (here 1 of any k)."""
    p = AdaptivePolicy(8, shape="block", drafter="lookup")
    p.forward.observe(1, 0.010)
    p.forward.observe(2, 0.010)
    p.forward.observe(9, 0.050)
    p.last_k = 8
    for _ in range(50):
        p.observe_verification(1, 1)
    emitted, rows = p.per_request(8, p.acceptance)
    assert rows < 1.5 and emitted > 1.9  # (the prior of 2 verifications at 8 rows fades)
    assert p.rate(1, 8) > 1.5 * p.rate(1, 0)


def test_eagle_tree_drafting_costs_a_forward_per_level():
    p = AdaptivePolicy(12, drafter="head", shape="tree", tree_width=3, tree_depth=4)
    p.draft_forward.observe(1, 0.001)
    p.draft_forward.observe(3, 0.002)
    p.draft_forward.observe(6, 0.003)
    p.draft_forward.observe(9, 0.004)
    t = p.draft_forward
    # k = 10: levels min(4, 1 + 9 // 3) = 4, fed 3, 6, 9 rows after the catch-up; k = 3: a chain of 2 passes
    assert p.draft_cost(1, 10, 0.5) == pytest.approx(t(p.per_request(10, 0.5)[0]) + t(3) + t(6) + t(9))
    assert p.draft_cost(1, 3, 0.5) == pytest.approx(t(p.per_request(3, 0.5)[0]) + 2 * t(1))
    assert t(9) > t(6) > t(3) > t(1)
