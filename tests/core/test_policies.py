"""Scheduling policies (core/policies): the registry, the step-time model and the slo policy's decisions.

The scheduler's invariants under every policy (no leaked block, progress, order) are the property test in
test_scheduler.py; here each decision of the slo policy is pinned on a fake clock.
"""
from __future__ import annotations

import pytest

from test_scheduler import FakeClock, advance, check_step, expected_output, make_req, make_sched, run_to_completion
from tokenmill.config import SCHEDULING_POLICIES, SchedulerConfig
from tokenmill.core.policies import POLICIES, make_policy
from tokenmill.core.policies.slo import MARGIN, MIN_DEFERRABLE_TOKENS
from tokenmill.core.policies.step_time import StepTimeModel
from tokenmill.core.request import RequestSLO, RequestStatus


def test_every_policy_name_is_registered():
    assert set(POLICIES) == set(SCHEDULING_POLICIES)
    with pytest.raises(ValueError, match="unknown scheduling policy 'lifo'"):
        make_policy(SchedulerConfig(policy="lifo"))


def test_request_slo_rejects_non_positive_targets():
    with pytest.raises(ValueError, match="ttft_ms must be a positive"):
        RequestSLO(ttft_ms=0)
    with pytest.raises(ValueError, match="tpot_ms must be a positive"):
        RequestSLO(tpot_ms=-5)
    assert RequestSLO().empty and not RequestSLO(tpot_ms=5).empty


def test_step_time_model_fits_a_line_and_inverts_it():
    m = StepTimeModel(decay=0.99)
    for i in range(400):
        x = 1 + (i * 37) % 512
        m.observe(x, 0.01 + 0.0002 * x)
    level, slope = m.coefficients()
    assert level == pytest.approx(0.01, rel=0.05) and slope == pytest.approx(0.0002, rel=0.05)
    assert m.tokens_within(0.05) == pytest.approx(200, abs=8)
    assert m.tokens_within(0.001) == 0  # shorter than an empty step


def test_step_time_model_keeps_the_prior_slope_when_every_step_had_one_size():
    m = StepTimeModel()
    for _ in range(100):
        m.observe(8, 0.03)
    level, slope = m.coefficients()
    assert slope == pytest.approx(m.per_token, rel=0.2)
    assert m.predict(8) == pytest.approx(0.03, rel=0.05)  # the level follows the data


def slo_sched(clock, **kw):
    kw.setdefault("budget", 2048)
    kw.setdefault("num_blocks", 1024)
    kw.setdefault("max_model_len", 4096)
    sched, kv = make_sched(policy="slo", clock=clock, **kw)
    for _ in range(50):  # 10 ms per step + 0.1 ms per token
        for tokens in (1, 64, 512):
            sched.policy.observe_step(tokens, 0.01 + 0.0001 * tokens)
    return sched, kv


def timed_step(sched, clock, dt: float = 0.04):
    """One step that takes dt on the fake clock; first tokens are stamped when it ends (as update_from_output)."""
    out = sched.schedule()
    check_step(sched, out)
    clock.now += dt
    advance(sched, out)
    for r, _ in out.scheduled:
        if r.num_output_tokens and r.first_token_time is None:
            r.first_token_time = clock.now
    return out


def test_slo_queue_order_feasible_by_latest_start_then_late_then_batch():
    clock = FakeClock(10.0)
    sched, _ = slo_sched(clock, max_seqs=1)
    tight = make_req([1] * 8, arrival=9.9, rid="tight")  # 100 ms left of 200: starts first
    loose = make_req([1] * 8, arrival=9.95, rid="loose")
    loose.slo, tight.slo = RequestSLO(ttft_ms=1000), RequestSLO(ttft_ms=200)
    late = make_req([1] * 8, arrival=9.0, rid="late")
    late.slo = RequestSLO(ttft_ms=100)  # its TTFT passed long ago
    batch_urgent = make_req([1] * 8, arrival=9.5, priority=0, rid="batch0")
    batch_later = make_req([1] * 8, arrival=1.0, priority=3, rid="batch3")
    for r in (batch_later, batch_urgent, late, loose, tight):
        sched.add_request(r)
    sched.policy.reorder(sched.waiting, clock())
    assert [r.request_id for r in sched.waiting] == ["tight", "loose", "late", "batch0", "batch3"]


def test_slo_caps_batch_prompts_while_an_slo_request_decodes():
    clock = FakeClock(0.0)
    sched, kv = slo_sched(clock)
    chat = make_req([5] * 4, max_tokens=6, arrival=0.0, rid="chat")
    chat.slo = RequestSLO(ttft_ms=1000, tpot_ms=50)
    sched.add_request(chat)
    step = MARGIN * 0.05  # steps exactly as long as the policy aims for: no time is saved
    timed_step(sched, clock, step)
    batch = make_req([7] * 3500, max_tokens=2, arrival=0.01, rid="batch")
    sched.add_request(batch)
    out = timed_step(sched, clock, step)
    got = dict((r.request_id, n) for r, n in out.scheduled)
    # Its next token is due MARGIN x 50 ms after the first: (step - 0.01) / 0.0001 tokens in the step (10 ms
    # fixed, 0.1 ms a token), one of them the decode.
    fits = round((step - 0.01) / 0.0001)
    assert got["chat"] == 1 and got["batch"] == pytest.approx(fits - 1, abs=12)
    while not chat.finished:
        out = timed_step(sched, clock, step)
        assert sum(n for r, n in out.scheduled if r is batch) <= fits
    # The SLO request is gone: the batch prompt takes the whole budget again (a recent TTFT of 1 s allows
    # 250 ms steps: more than the budget's 2048 tokens take).
    left = batch.num_uncomputed_tokens
    out = timed_step(sched, clock)
    assert out.scheduled == [(batch, min(left, 2048))] and left > 1000
    run_to_completion(sched)
    assert batch.output_token_ids == expected_output(batch.prompt_token_ids, 2)
    assert kv.num_free_blocks == kv.num_blocks


def test_a_tpot_mean_that_saved_time_affords_a_longer_step():
    """Steps shorter than the TPOT target bank time; the policy spends it on one larger batch chunk."""
    clock = FakeClock(0.0)
    sched, kv = slo_sched(clock)
    chat = make_req([5] * 4, max_tokens=30, arrival=0.0, rid="chat")
    chat.slo = RequestSLO(tpot_ms=30)
    sched.add_request(chat)
    for _ in range(5):
        timed_step(sched, clock, dt=0.01)  # 10 ms steps against a budget of MARGIN x 30 ms: time saved each
    batch = make_req([7] * 3500, max_tokens=2, arrival=clock.now, rid="batch")
    sched.add_request(batch)
    out = timed_step(sched, clock)
    # 5 tokens, the first at 10 ms: the 6th is due by 0.01 + 5 x MARGIN x 0.03 s; now 0.05. A step without
    # savings would get (MARGIN x 0.03 - 0.01) / 0.0001 tokens.
    limit = 0.01 + 5 * MARGIN * 0.03 - 0.05
    got = dict((r.request_id, n) for r, n in out.scheduled)["batch"]
    assert got == pytest.approx((limit - 0.01) / 0.0001 - 1, abs=20)
    assert got > 3 * (MARGIN * 0.03 - 0.01) / 0.0001
    run_to_completion(sched)
    assert kv.num_free_blocks == kv.num_blocks


def test_batch_prompts_always_progress_under_slo_pressure():
    clock = FakeClock(0.0)
    sched, kv = slo_sched(clock)
    chat = make_req([5] * 4, max_tokens=50, arrival=0.0, rid="chat")
    chat.slo = RequestSLO(tpot_ms=5)  # shorter than any step: no room at all for batch work
    batch = make_req([7] * 200, max_tokens=1, arrival=0.01, rid="batch")
    sched.add_request(chat)
    sched.add_request(batch)
    steps = 0
    while not batch.finished:
        out = sched.schedule()
        check_step(sched, out)
        assert sum(n for r, n in out.scheduled if r is batch) <= MIN_DEFERRABLE_TOKENS
        advance(sched, out)
        steps += 1
    assert steps <= 200 // MIN_DEFERRABLE_TOKENS + 2


def test_an_urgent_slo_request_preempts_batch_work_for_a_seat():
    clock = FakeClock(0.0)
    sched, kv = slo_sched(clock, max_seqs=2)
    a = make_req([1, 2, 3], max_tokens=40, arrival=0.0, rid="a")
    b = make_req([4, 5, 6], max_tokens=40, arrival=0.001, rid="b")
    for r in (a, b):
        sched.add_request(r)
    advance(sched, sched.schedule())
    chat = make_req([9] * 5, max_tokens=3, arrival=0.0, rid="chat")
    chat.slo = RequestSLO(ttft_ms=1000)
    sched.add_request(chat)
    clock.now = 0.3  # 30 % of its TTFT spent: it waits for a seat
    out = sched.schedule()
    assert not out.preempted and chat.status == RequestStatus.WAITING
    advance(sched, out)
    clock.now = 0.6  # past half: the latest batch request makes room
    out = sched.schedule()
    check_step(sched, out)
    assert out.preempted == [b] and b.status == RequestStatus.PREEMPTED
    assert chat in [r for r, _ in out.scheduled] and b not in [r for r, _ in out.scheduled]
    advance(sched, out)
    run_to_completion(sched)
    for r in (a, b, chat):
        assert r.output_token_ids == expected_output(r.prompt_token_ids, r.max_tokens)
    assert kv.num_free_blocks == kv.num_blocks
    assert sched.policy.describe()["preempted_for_room"] == 1


@pytest.mark.parametrize("shed", [True, False])
def test_a_request_that_cannot_meet_its_ttft_is_shed_or_runs_late(shed):
    clock = FakeClock(0.0)
    sched, kv = slo_sched(clock, max_seqs=1, slo_shed=shed)
    batch = make_req([1, 2, 3], max_tokens=4, arrival=0.0, rid="batch")
    sched.add_request(batch)
    advance(sched, sched.schedule())
    late = make_req([4] * 6, max_tokens=2, arrival=0.0, rid="late")
    late.slo = RequestSLO(ttft_ms=100)
    waiting_batch = make_req([5] * 6, max_tokens=2, arrival=0.0, rid="waiting-batch")
    sched.add_request(waiting_batch)
    sched.add_request(late)
    clock.now = 0.5
    out = sched.schedule()
    ended = sched.take_ended()
    if shed:
        assert [o.request_id for o in ended] == ["late"]
        assert ended[0].error_status == 503 and ended[0].error_code == "slo_unattainable"
        assert late.status == RequestStatus.FINISHED_ABORTED and late.block_ids == []
    else:
        assert not ended
        assert [r.request_id for r in sched.waiting][0] == "late"  # late, but still before batch work
    advance(sched, out)
    run_to_completion(sched)
    for r in (batch, waiting_batch) + (() if shed else (late,)):
        assert r.output_token_ids == expected_output(r.prompt_token_ids, r.max_tokens)
    assert kv.num_free_blocks == kv.num_blocks


def test_slo_shed_needs_the_slo_policy():
    from tokenmill.engine_args import EngineArgs

    with pytest.raises(ValueError, match="slo_shed needs the slo scheduling policy"):
        EngineArgs(slo_shed=True).create_engine_config()


@pytest.mark.parametrize("shed", [True, False])
def test_a_hopeless_slo_request_leaves_no_trace_in_the_step_size(shed):
    """One request with a TTFT no step can meet (ttft_ms 0.001: the server's floor refuses it, an engine caller
    may not) is shed or runs late; either way batch prompts get the whole budget right after, not
    MIN_DEFERRABLE_TOKENS for RECENT_S as when every waiting request's target was remembered."""
    clock = FakeClock(0.0)
    sched, kv = slo_sched(clock, slo_shed=shed, budget=512)
    batch = make_req([7] * 4000, max_tokens=2, arrival=0.0, rid="batch")
    sched.add_request(batch)
    assert timed_step(sched, clock).scheduled == [(batch, 512)]
    greedy = make_req([5] * 4, max_tokens=2, arrival=clock.now, rid="greedy")
    greedy.slo = RequestSLO(ttft_ms=0.001)
    sched.add_request(greedy)
    clock.now += 0.001  # its target passed before any step could start it
    for _ in range(5):  # shed at once, or served first (late, still before batch work)
        timed_step(sched, clock)
        if greedy.finished:
            break
    assert greedy.finished
    if shed:
        assert [o.request_id for o in sched.take_ended()] == ["greedy"] and greedy.block_ids == []
    else:
        assert greedy.output_token_ids == expected_output(greedy.prompt_token_ids, 2)
    assert sched.policy.step_limit([], [], clock.now) is None
    assert batch.num_uncomputed_tokens > 512 and timed_step(sched, clock).scheduled == [(batch, 512)]
    run_to_completion(sched)
    assert batch.output_token_ids == expected_output(batch.prompt_token_ids, 2)
    assert kv.num_free_blocks == kv.num_blocks


def test_a_served_slo_request_still_keeps_steps_short_for_the_next():
    """The memory the floor fix narrows still works: a request admitted within its 200 ms TTFT keeps batch
    chunks to a quarter of it for RECENT_S after it is gone, then the budget is whole again."""
    from tokenmill.core.policies.slo import RECENT_S

    clock = FakeClock(0.0)
    sched, kv = slo_sched(clock)
    chat = make_req([5] * 4, max_tokens=2, arrival=0.0, rid="chat")
    chat.slo = RequestSLO(ttft_ms=200)
    sched.add_request(chat)
    while not chat.finished:
        timed_step(sched, clock, 0.02)
    batch = make_req([7] * 4000, max_tokens=2, arrival=clock.now, rid="batch")
    sched.add_request(batch)
    got = timed_step(sched, clock).scheduled
    fits = round((0.2 / 4 - 0.01) / 0.0001)  # a 50 ms step: 10 ms fixed, 0.1 ms a token
    assert got[0][0] is batch and got[0][1] == pytest.approx(fits, abs=12)
    clock.now += RECENT_S
    assert timed_step(sched, clock).scheduled == [(batch, 2048)]
    run_to_completion(sched)
    assert kv.num_free_blocks == kv.num_blocks
