"""Tests for the token-budget scheduler (tokenmill/engine/scheduler.py). Pure Python, no torch.

A small driver stands in for the engine: it runs schedule(), advances num_computed_tokens by the
scheduled counts, "samples" a deterministic token for every request whose tokens are all computed,
and finishes requests at max_tokens. Unit tests pin the scheduling policy; a hypothesis test runs
random workloads (pool sizes, budgets, caps, priorities, aborts) and checks the invariants after
every step, liveness, and that every request ends with exactly its expected tokens. Some workloads
run with host/disk KV tiers (ops applied to shadow contents, tests/kv_shadow.py), some with every
disk file corrupt: failed loads take the request back and it recomputes.
"""
from __future__ import annotations

import itertools

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kv_shadow import ShadowTransfer
from tokenmill.config import SchedulerConfig
from tokenmill.core.kv_cache import RELEASED, KVCacheManager, blocks_for_tokens, group_key
from tokenmill.core.kv_offload import OffloadTiers
from tokenmill.core.policies.fcfs import PriorityPolicy
from tokenmill.core.request import Request, RequestSLO, RequestStatus
from tokenmill.core.scheduler import Scheduler
from tokenmill.core.waiting_queue import WaitingQueue
from tokenmill.sampling_params import SamplingParams

_ids = itertools.count()


def fake_token(tokens: list[int]) -> int:
    """The 'model': a deterministic function of the sequence so far (equal prompts decode equally)."""
    return (sum(tokens[-3:]) + len(tokens)) % 5


def expected_output(prompt: list[int], max_tokens: int) -> list[int]:
    toks = list(prompt)
    for _ in range(max_tokens):
        toks.append(fake_token(toks))
    return toks[len(prompt) :]


def make_sched(num_blocks=64, block_size=4, budget=64, max_seqs=8, policy="fcfs", caching=True, max_model_len=64,
               offload: OffloadTiers | None = None, clock=None, slo_shed=False, windows=(None,)):
    kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching=caching, offload=offload, group_windows=windows)
    cfg = SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=budget, policy=policy, slo_shed=slo_shed)
    if clock is None:
        return Scheduler(cfg, kv, max_model_len), kv
    return Scheduler(cfg, kv, max_model_len, clock=clock), kv


class FakeClock:
    """Seconds that pass only when a test says so."""

    def __init__(self, now: float = 0.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def make_req(prompt, max_tokens=4, priority=0, arrival=None, params=None, rid=None) -> Request:
    i = next(_ids)
    return Request(
        rid or f"r{i}",
        list(prompt),
        params or SamplingParams(),
        max_tokens=max_tokens,
        priority=priority,
        arrival_time=float(i) if arrival is None else float(arrival),
    )


def advance(sched: Scheduler, out) -> list[Request]:
    """The engine's half of a step. Returns the requests that finished."""
    done = []
    for req, n in out.scheduled:
        req.num_computed_tokens += n
        assert req.num_computed_tokens <= req.num_tokens
        if req.num_computed_tokens == req.num_tokens:
            req.append_token(fake_token(req.token_ids))
            if req.num_output_tokens >= req.max_tokens:
                sched.finish_request(req, RequestStatus.FINISHED_LENGTH)
                done.append(req)
    return done


def step(sched: Scheduler):
    out = sched.schedule()
    check_step(sched, out)
    advance(sched, out)
    return out


def check_state(sched: Scheduler) -> None:
    """Ref counts equal the running requests referencing each block; waiting requests hold nothing."""
    kv = sched.kv
    kv.check_invariants()
    assert len(sched.running) <= sched.config.max_num_seqs
    owners = [0] * kv.num_blocks
    for r in sched.running:
        assert r.status == RequestStatus.RUNNING
        live = list(r.held_block_ids())
        assert len(set(live)) == len(live) and RELEASED not in live
        assert len(r.tables) == kv.num_groups and len({len(t) for t in r.tables}) == 1  # one entry per block each
        for table, released in zip(r.tables, r.num_released):
            assert table[:released] == [RELEASED] * released
        for b in live:
            owners[b] += 1
    assert [b.ref_count for b in kv.blocks] == owners
    assert kv.num_free_blocks + sum(1 for o in owners if o) == kv.num_blocks
    for r in sched.waiting:
        assert r.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
        assert r.block_ids == [] and r.num_computed_tokens == 0


def check_step(sched: Scheduler, out) -> None:
    check_state(sched)
    assert out.num_tokens <= sched.config.max_num_batched_tokens
    for r, n in out.scheduled:
        assert n >= 1 and r in sched.running
        assert len(r.block_ids) * sched.kv.block_size >= r.num_computed_tokens + n


def run_to_completion(sched: Scheduler, max_steps=1000) -> list:
    outs = []
    while sched.has_unfinished():
        outs.append(step(sched))
        assert len(outs) < max_steps, "scheduler made no progress"
    return outs


def ids(out) -> list[tuple[str, int]]:
    return [(r.request_id, n) for r, n in out.scheduled]


# ---- budget and chunking -------------------------------------------------------------------


def test_token_budget_respected_and_filled():
    sched, kv = make_sched(budget=10)
    reqs = [make_req(range(i, i + 7), max_tokens=3) for i in range(0, 40, 10)]
    for r in reqs:
        sched.add_request(r)
    outs = run_to_completion(sched)
    assert all(o.num_tokens <= 10 for o in outs)
    # First step: a 7-token prompt, then a 3-token chunk of the next.
    assert ids(outs[0]) == [(reqs[0].request_id, 7), (reqs[1].request_id, 3)]
    assert all(r.output_token_ids == expected_output(r.prompt_token_ids, 3) for r in reqs)
    assert all(r.status == RequestStatus.FINISHED_LENGTH for r in reqs)
    assert kv.num_free_blocks == kv.num_blocks


def test_long_prompt_chunked_across_steps():
    sched, kv = make_sched(budget=8, block_size=4)
    r = make_req(range(25), max_tokens=2)
    sched.add_request(r)
    counts = []
    while sched.has_unfinished():
        out = step(sched)
        counts.append(ids(out))
        if len(counts) <= 4:
            assert len(r.block_ids) == kv.blocks_needed(r.num_computed_tokens)
    rid = r.request_id
    assert counts == [[(rid, 8)], [(rid, 8)], [(rid, 8)], [(rid, 1)], [(rid, 1)]]
    assert r.output_token_ids == expected_output(list(range(25)), 2)


def test_long_prefill_token_threshold_caps_each_prompt_chunk():
    """vLLM's long_prefill_token_threshold: a long prompt computes at most that many tokens a step, so a
    second prompt shares the step instead of waiting behind it, and a running decode's step stays short."""
    sched, kv = make_sched(budget=32, block_size=4)
    sched.config.long_prefill_token_threshold = 8
    d = make_req([1, 2], max_tokens=12)
    sched.add_request(d)
    step(sched)  # d's prompt, then it decodes
    long, short = make_req(range(10, 40), max_tokens=2), make_req(range(50, 56), max_tokens=2)
    sched.add_request(long)
    sched.add_request(short)
    out = step(sched)
    assert ids(out) == [(d.request_id, 1), (long.request_id, 8), (short.request_id, 6)]
    out = step(sched)
    assert ids(out) == [(d.request_id, 1), (short.request_id, 1), (long.request_id, 8)]
    run_to_completion(sched)
    assert long.output_token_ids == expected_output(list(range(10, 40)), 2)
    assert d.output_token_ids == expected_output([1, 2], 12)
    sched.config.long_prefill_token_threshold = 0  # off: the budget alone chunks
    late = make_req(range(100, 140), max_tokens=1)
    sched.add_request(late)
    assert ids(step(sched)) == [(late.request_id, 32)]


def test_long_prefill_cap_does_not_thrash_recomputes():
    """Found by the property test: five requests on a pool that holds one at full length, prompts chunked by
    3. Capped recomputes of preempted requests kept preempting each other for ever; recompute is uncapped."""
    sched, kv = make_sched(num_blocks=10, block_size=3, budget=18, max_seqs=6, max_model_len=29)
    sched.config.long_prefill_token_threshold = 3
    reqs = [make_req([0], max_tokens=28, arrival=0.0, params=SamplingParams(prompt_logprobs=1)) for _ in range(5)]
    for r in reqs:
        sched.add_request(r)
    run_to_completion(sched, max_steps=1000)
    assert all(r.output_token_ids == expected_output([0], 28) for r in reqs)


def test_decodes_scheduled_before_prompt_chunks():
    sched, kv = make_sched(budget=4)
    d = make_req([1, 2], max_tokens=8)
    p = make_req(range(10, 30), max_tokens=2)
    sched.add_request(d)
    sched.add_request(p)
    out = step(sched)
    assert ids(out) == [(d.request_id, 2), (p.request_id, 2)]
    assert not d.is_prefill and p.is_prefill
    # Put the prompt in front of the decode in the running list: the decode must still go first and
    # get its token, even though the prompt alone could use the whole budget.
    sched.running[:] = [p, d]
    out = step(sched)
    assert ids(out) == [(d.request_id, 1), (p.request_id, 3)]
    w = make_req([7, 7, 7], max_tokens=1)
    sched.add_request(w)
    # Decode, then the prompt chunk, then (only with budget left) waiting requests.
    sched.running[:] = [p, d]
    out = step(sched)
    assert ids(out) == [(d.request_id, 1), (p.request_id, 3)]
    assert w.status == RequestStatus.WAITING
    run_to_completion(sched)
    assert w.output_token_ids == expected_output([7, 7, 7], 1)


def test_max_num_seqs_cap():
    sched, kv = make_sched(budget=100, max_seqs=2)
    reqs = [make_req([i] * 3, max_tokens=2 + i) for i in range(5)]
    for r in reqs:
        sched.add_request(r)
    out = step(sched)
    assert [r for r, _ in out.scheduled] == reqs[:2]
    assert sched.num_running == 2 and sched.num_waiting == 3
    out = step(sched)  # reqs[0] finished after this step's sample (2 outputs)
    assert [r for r, _ in out.scheduled] == reqs[:2]
    assert reqs[0].finished
    out = step(sched)
    assert [r for r, _ in out.scheduled] == [reqs[1], reqs[2]]
    run_to_completion(sched)
    assert all(r.output_token_ids == expected_output(r.prompt_token_ids, r.max_tokens) for r in reqs)


def test_fcfs_order_ignores_priority():
    sched, kv = make_sched(budget=100, max_seqs=1, policy="fcfs")
    reqs = [make_req([i], max_tokens=1, priority=p, arrival=a) for i, (p, a) in enumerate([(5, 3), (0, 1), (9, 2), (1, 0)])]
    for r in reqs:
        sched.add_request(r)
    order = []
    for o in run_to_completion(sched):
        order += [r for r, _ in o.scheduled]
    assert order == sorted(reqs, key=lambda r: r.arrival_time)


def test_priority_order_lower_value_first_then_arrival():
    sched, kv = make_sched(budget=100, max_seqs=1, policy="priority")
    spec = [(5, 0), (0, 3), (1, 1), (0, 2), (5, 4)]
    reqs = [make_req([i], max_tokens=1, priority=p, arrival=a) for i, (p, a) in enumerate(spec)]
    for r in reqs:
        sched.add_request(r)
    order = []
    for o in run_to_completion(sched):
        order += [(r.priority, r.arrival_time) for r, _ in o.scheduled]
    assert order == sorted((p, float(a)) for p, a in spec)


def test_waiting_queue_ties_keep_insertion_order():
    q = WaitingQueue(PriorityPolicy(SchedulerConfig()).queue_key)
    a, b, c = (make_req([1], priority=1, arrival=0) for _ in range(3))
    d = make_req([1], priority=0, arrival=5)
    for r in (a, b, c, d):
        q.add(r)
    assert list(q) == [d, a, b, c]
    assert q.remove(b) and not q.remove(b)
    assert [q.pop(), q.pop(), q.pop()] == [d, a, c] and len(q) == 0


def _fill_then_overflow(policy, spec):
    """Three running requests that fill the pool exactly; the next decode of the first needs a block."""
    sched, kv = make_sched(num_blocks=6, block_size=2, budget=100, policy=policy, caching=False)
    reqs = [make_req([10 * i + 1, 10 * i + 2, 10 * i + 3], max_tokens=10, priority=p, arrival=a)
            for i, (p, a) in enumerate(spec)]
    for r in reqs:
        sched.add_request(r)
    step(sched)  # 3 tokens each: 2 blocks each, pool full
    step(sched)  # 4th token fits in the second block
    assert kv.num_free_blocks == 0
    out = sched.schedule()  # 5th token: a third block for everyone
    check_step(sched, out)
    return sched, kv, reqs, out


def test_fcfs_preempts_latest_arrival():
    sched, kv, reqs, out = _fill_then_overflow("fcfs", [(0, 0), (9, 1), (1, 2)])
    # Under fcfs the priority is ignored: the latest arrival goes.
    assert out.preempted[0] is reqs[2]


def test_priority_preempts_lowest_priority_then_latest():
    sched, kv, reqs, out = _fill_then_overflow("priority", [(0, 0), (9, 1), (1, 2)])
    assert out.preempted[0] is reqs[1]  # priority 9, although reqs[2] arrived later
    sched, kv, reqs, out = _fill_then_overflow("priority", [(3, 0), (3, 1), (3, 2)])
    assert out.preempted[0] is reqs[2]  # equal priority: latest arrival


def test_preemption_frees_blocks_keeps_tokens_and_readmits():
    sched, kv = make_sched(num_blocks=4, block_size=2, budget=100, caching=False)
    a = make_req([1, 2, 3], max_tokens=4, arrival=0)
    b = make_req([4, 5, 6], max_tokens=4, arrival=1)
    sched.add_request(a)
    sched.add_request(b)
    step(sched)  # 3 + 3 tokens: all 4 blocks
    step(sched)  # 4th token of each fits
    assert kv.num_free_blocks == 0
    c = make_req([9], max_tokens=1, arrival=2)
    sched.add_request(c)
    b_tokens = list(b.token_ids)
    assert len(b_tokens) == 5
    out = sched.schedule()
    check_step(sched, out)
    assert out.preempted == [b]
    assert b.status == RequestStatus.PREEMPTED and b.num_preemptions == 1 and sched.num_preemptions == 1
    assert b.block_ids == [] and b.num_computed_tokens == 0
    assert b.token_ids == b_tokens  # prompt and outputs so far are kept
    assert b in list(sched.waiting) and b not in sched.running
    # A step that preempted admits nobody, though c would fit in the free block.
    assert ids(out) == [(a.request_id, 1)]
    assert kv.num_free_blocks == 1 and c.status == RequestStatus.WAITING
    advance(sched, out)
    outs = run_to_completion(sched)
    # b is re-admitted with its whole sequence (5 tokens) to recompute, before the later c.
    readmit = next(o for o in outs if any(r is b for r, _ in o.scheduled))
    assert (b, 5) in readmit.scheduled
    first_c = next(i for i, o in enumerate(outs) if any(r is c for r, _ in o.scheduled))
    assert outs.index(readmit) <= first_c
    for r in (a, b, c):
        assert r.status == RequestStatus.FINISHED_LENGTH
        assert r.output_token_ids == expected_output(r.prompt_token_ids, r.max_tokens)
    assert kv.num_free_blocks == kv.num_blocks


def test_preempted_request_readmitted_through_prefix_cache():
    sched, kv = make_sched(num_blocks=4, block_size=2, budget=100, caching=True)
    a = make_req([1, 2, 3], max_tokens=4, arrival=0)
    b = make_req([4, 5, 6], max_tokens=4, arrival=1)
    sched.add_request(a)
    sched.add_request(b)
    step(sched)
    step(sched)
    out = step(sched)
    assert out.preempted == [b]
    # b's named blocks sit in the free pool; a takes one of them (b's tail goes first), so b comes
    # back with a one-block hit and recomputes 3 of its 5 tokens.
    outs = run_to_completion(sched)
    readmit = next(o for o in outs if any(r is b for r, _ in o.scheduled))
    assert (b, 3) in readmit.scheduled
    assert b.num_cached_tokens == 0  # the first admission's figure is kept
    assert b.num_preemptions == 1
    assert b.output_token_ids == expected_output([4, 5, 6], 4)
    assert all(r.finished for r in (a, b))
    assert kv.num_free_blocks == kv.num_blocks


def test_prefix_hit_skips_cached_tokens_and_records_stats():
    sched, kv = make_sched(num_blocks=16, block_size=4, budget=100)
    a = make_req(range(10), max_tokens=3)
    sched.add_request(a)
    step(sched)
    b = make_req(range(10), max_tokens=3)
    sched.add_request(b)
    out = step(sched)
    assert (b, 2) in out.scheduled  # 8 of 10 prompt tokens hit
    assert b.num_cached_tokens == 8 and a.num_cached_tokens == 0
    assert b.block_ids[:2] == a.block_ids[:2]
    assert (kv.stats.queries, kv.stats.hits) == (20, 8)
    run_to_completion(sched)
    assert b.output_token_ids == a.output_token_ids == expected_output(list(range(10)), 3)
    p = make_req(range(10), max_tokens=1, params=SamplingParams(prompt_logprobs=1))
    sched.add_request(p)
    out = step(sched)
    assert (p, 10) in out.scheduled and p.num_cached_tokens == 0


def test_lower_tier_hits_cost_no_budget_and_priority_keeps_its_meaning():
    from tokenmill.core.kv_offload import LoadOp

    tiers = OffloadTiers(host_slots=8, min_chain_blocks=1)
    sched, kv = make_sched(num_blocks=6, block_size=4, budget=6, policy="priority", offload=tiers)
    a = make_req(range(13), max_tokens=1)
    sched.add_request(a)
    run_to_completion(sched)
    b = make_req([50] * 23, max_tokens=1)  # the whole pool: a's three named blocks are evicted (saved)
    sched.add_request(b)
    run_to_completion(sched)
    assert set(a.block_hashes[:3]) <= set(tiers.host) and not any(h in kv.cached for h in a.block_hashes[:3])
    kv.take_transfer_ops()
    # Two waiting: an uncached one of priority 0 and a fully host-cached one of priority 1.
    hi = make_req([60] * 5, max_tokens=1, priority=0, arrival=100)
    lo = make_req(range(13), max_tokens=1, priority=1, arrival=50)
    sched.add_request(lo)
    sched.add_request(hi)
    out = sched.schedule()
    # Priority first (5 of the 6 tokens), then the cached one costs only its last token.
    assert ids(out) == [(hi.request_id, 5), (lo.request_id, 1)]
    assert lo.num_cached_tokens == 12 and lo.num_computed_tokens == 12
    loads = [op for op in kv.take_transfer_ops() if isinstance(op, LoadOp)]
    assert [op.hash for op in loads] == a.block_hashes[:3] and [op.block_id for op in loads] == lo.block_ids[:3]
    assert tiers.stats.host_loads == 3
    advance(sched, out)
    run_to_completion(sched)
    assert lo.output_token_ids == expected_output(list(range(13)), 1)


# ---- finish / abort ------------------------------------------------------------------------


def test_finish_and_abort_free_blocks_from_running_and_waiting():
    sched, kv = make_sched(num_blocks=8, block_size=4, budget=100, max_seqs=1)
    a = make_req(range(9), max_tokens=5)
    w = make_req(range(20, 29), max_tokens=5)
    sched.add_request(a)
    sched.add_request(w)
    step(sched)
    assert a.status == RequestStatus.RUNNING and len(a.block_ids) == 3
    assert w.status == RequestStatus.WAITING and w.block_ids == []
    sched.finish_request(a, RequestStatus.FINISHED_ABORTED)
    assert a.status == RequestStatus.FINISHED_ABORTED and a.finished and a.finished_time is not None
    assert a.block_ids == [] and a not in sched.running
    assert kv.num_free_blocks == 8
    check_state(sched)
    sched.finish_request(w, RequestStatus.FINISHED_ABORTED)  # from waiting
    assert w.status == RequestStatus.FINISHED_ABORTED and len(sched.waiting) == 0
    assert not sched.has_unfinished()
    assert not sched.schedule()
    # A preempted request (waiting, no blocks) can be finished too; a running one frees at once.
    x = make_req(range(5), max_tokens=3)
    sched.add_request(x)
    step(sched)
    held = len(x.block_ids)
    assert held and kv.num_free_blocks == 8 - held
    sched.finish_request(x, RequestStatus.FINISHED_STOPPED)
    assert kv.num_free_blocks == 8 and not sched.has_unfinished()
    with pytest.raises(AssertionError):
        sched.finish_request(make_req([1]), RequestStatus.RUNNING)


def test_abort_preempted_request():
    sched, kv = make_sched(num_blocks=4, block_size=2, budget=100, caching=False)
    a = make_req([1, 2, 3], max_tokens=4, arrival=0)
    b = make_req([4, 5, 6], max_tokens=4, arrival=1)
    sched.add_request(a)
    sched.add_request(b)
    step(sched)
    step(sched)
    out = step(sched)
    assert out.preempted == [b] and b.status == RequestStatus.PREEMPTED
    sched.finish_request(b, RequestStatus.FINISHED_ABORTED)
    assert b not in list(sched.waiting) and b.finished
    run_to_completion(sched)
    assert b.num_output_tokens == 2  # nothing more after the abort
    assert kv.num_free_blocks == kv.num_blocks


# ---- property test -------------------------------------------------------------------------

STEMS = [[0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3], [0, 1, 2, 3, 3, 2, 1, 0, 0, 0], [4, 4, 4, 4, 4, 4, 4, 4]]


def prefix_keys(tokens) -> list[int]:
    out, h = [], 0
    for t in tokens:
        h = hash((h, t))
        out.append(h)
    return out


@st.composite
def workloads(draw):
    bs = draw(st.integers(1, 4))
    mml = draw(st.integers(2, 32))
    budget = draw(st.integers(1, 24))
    # KV cache groups' windows: one full table; one table of a shared window (Mistral); a full group and windowed
    # ones (Gemma 3); two windows.
    w1, w2 = draw(st.sampled_from([1, 2, 3, 5, 8])), draw(st.sampled_from([1, 2, 3, 5, 8]))
    windows = draw(st.sampled_from([(None,), (None,), (None,), (w1,), (None, w1), (None, w1, w1), (w1, w2)]))
    min_blocks = blocks_for_tokens(mml, windows, bs, budget)
    num_blocks = min_blocks + draw(st.sampled_from([0, 0, 1, 2, 4, 8, 32]))  # mostly tight: preemptions
    max_seqs = draw(st.integers(1, 6))
    policy = draw(st.sampled_from(["fcfs", "priority", "slo"]))
    slo_shed = policy == "slo" and draw(st.booleans())
    caching = draw(st.sampled_from([True, True, False]))
    offload = None
    if caching and draw(st.booleans()):
        offload = dict(host_slots=draw(st.integers(1, 4)), disk=draw(st.booleans()),
                       group_blocks=draw(st.integers(1, 3)), min_chain_blocks=draw(st.integers(1, 2)))
    corrupt = draw(st.sampled_from([False, False, True]))
    long_prefill = draw(st.sampled_from([0, 0, 1, 3, 8]))
    n = draw(st.integers(1, 8))
    reqs = []
    for _ in range(n):
        stem = draw(st.sampled_from(STEMS))
        cut = draw(st.integers(0, len(stem)))
        tail = draw(st.lists(st.integers(0, 4), max_size=10))
        prompt = (stem[:cut] + tail)[: mml - 1] or [0]
        room = mml - len(prompt)
        max_tokens = draw(st.one_of(st.just(room), st.integers(1, room)))
        reqs.append(
            dict(
                prompt=prompt,
                max_tokens=max_tokens,
                priority=draw(st.integers(0, 2)),
                arrival_step=draw(st.one_of(st.integers(0, 4), st.integers(0, 40))),  # late: after evictions
                arrival=float(draw(st.integers(0, 8))),  # ties on purpose
                prompt_logprobs=draw(st.integers(0, 9)) == 0,
                abort_step=draw(st.one_of(st.none(), st.none(), st.integers(0, 30))),
                # slo policy: batch work, or targets of a few fake steps (10 ms each) so some turn late
                slo=draw(st.sampled_from([None, None, (50, 20), (200, None), (None, 20), (20, 100), (400, 50),
                                          (150, 30)])),
            )
        )
    return dict(bs=bs, mml=mml, num_blocks=num_blocks, budget=budget, max_seqs=max_seqs,
                policy=policy, caching=caching, offload=offload, corrupt=corrupt, reqs=reqs,
                long_prefill=long_prefill, slo_shed=slo_shed, windows=windows)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads())
def test_random_workloads(w):
    bs, mml = w["bs"], w["mml"]
    offload = OffloadTiers(**w["offload"]) if w["offload"] else None
    clock = FakeClock()
    windows = w["windows"]
    sched, kv = make_sched(w["num_blocks"], bs, w["budget"], w["max_seqs"], w["policy"], w["caching"], mml, offload,
                           clock, w["slo_shed"], windows)
    sched.config.long_prefill_token_threshold = w["long_prefill"]
    defers = w["policy"] == "slo"  # batch prompts may get fewer tokens than the budget; urgent ones make room
    transfer = ShadowTransfer()
    budget = w["budget"]
    reqs = []
    for i, spec in enumerate(w["reqs"]):
        params = SamplingParams(prompt_logprobs=1) if spec["prompt_logprobs"] else SamplingParams()
        reqs.append(make_req(spec["prompt"], spec["max_tokens"], spec["priority"], spec["arrival"] / 100, params,
                             f"q{i}"))
        if spec["slo"] is not None:
            reqs[-1].slo = RequestSLO(*spec["slo"])
    shed: set[str] = set()
    added: set[int] = set()
    aborted: set[int] = set()
    content: dict[int, dict[int, int]] = {}  # block -> slot -> prefix key of the KV written there
    total = sum(len(s["prompt"]) + s["max_tokens"] for s in w["reqs"])
    max_steps = 8 + 7 + 40 * total  # generous; a livelock runs into it
    key, victim_key = sched.waiting.key, sched.policy.victim_key

    for t in range(max_steps):
        clock.now = t / 100
        for i, spec in enumerate(w["reqs"]):
            if spec["arrival_step"] == t:
                sched.add_request(reqs[i])
                added.add(i)
            if spec["abort_step"] == t and i in added and not reqs[i].finished:
                sched.finish_request(reqs[i], RequestStatus.FINISHED_ABORTED)
                aborted.add(i)
                assert reqs[i].block_ids == []
        if len(added) == len(reqs) and not sched.has_unfinished():
            break

        prev_running = list(sched.running)
        uncomputed = {id(r): r.num_uncomputed_tokens for r in prev_running}
        had_work = sched.has_unfinished()
        out = sched.schedule()
        for o in sched.take_ended():  # shed: never started, ended with 503
            r = next(r for r in reqs if r.request_id == o.request_id)
            assert w["slo_shed"] and o.error_status == 503 and o.error_code == "slo_unattainable"
            assert r.status == RequestStatus.FINISHED_ABORTED and r.block_ids == [] and r.slo is not None
            assert r.first_scheduled_time is None
            shed.add(r.request_id)
        check_step(sched, out)
        # Progress every step: the last unscheduled candidate always fits once the others are preempted.
        assert bool(out.scheduled) == (had_work and sched.has_unfinished())

        # Budget use: each entry gets at most what it has left and (when set) the long-prefill cap; the step's work
        # (a token each, a prompt-logprob row each) stays within the budget (a budget of one token carries a token
        # and its row). How prompts share the budget: tests/serve/test_fair_share.py.
        cap = w["long_prefill"] or budget
        seen = set()
        work = 0
        for r, n in out.scheduled:
            assert id(r) not in seen
            seen.add(id(r))
            assert n <= min(r.num_tokens - r.num_computed_tokens, budget if r.num_preemptions else cap)
            work += Scheduler.cost(r, r.num_computed_tokens, n)
        assert work <= max(budget, 2)
        # Previously running requests first, decodes before prompt chunks; then admissions.
        was_running = [id(r) in uncomputed for r, _ in out.scheduled]
        assert was_running == sorted(was_running, reverse=True)
        kinds = [uncomputed[id(r)] > 1 for r, _ in out.scheduled if id(r) in uncomputed]
        assert kinds == sorted(kinds)
        # Preemption: victims hold nothing, wait again with their tokens; no admissions in that step.
        if out.preempted:
            assert defers or all(was_running)
            unscheduled = [r for r in sched.running if id(r) not in seen]
            for v in out.preempted:
                assert v.status == RequestStatus.PREEMPTED and v.block_ids == [] and v.num_computed_tokens == 0
                assert v in list(sched.waiting) and v not in sched.running
                assert all(victim_key(v) >= victim_key(u) for u in unscheduled)  # the victim ranks last
                assert not defers or v.slo is None or not any(u.slo is None for u in unscheduled)
        for r, n in out.scheduled:
            if id(r) not in uncomputed:  # admitted this step: only a prefix hit may be precomputed
                assert r.num_computed_tokens % bs == 0 and r.num_computed_tokens < r.num_tokens
                if r.num_preemptions == 0:
                    assert r.num_computed_tokens == r.num_cached_tokens
                if not kv.enable_prefix_caching or r.params.prompt_logprobs is not None:
                    assert r.num_computed_tokens == 0
        assert list(sched.waiting) == sorted(sched.waiting, key=key)

        # The tier ops run before the forward pass; a failed load takes its requests back out.
        if w["corrupt"] and offload is not None:
            transfer.corrupt.update(offload.files)
        failed = transfer.run(kv.take_transfer_ops(), content)
        if failed:
            before = list(out.scheduled)
            sched.recompute_failed_loads(out, kv.loads_failed(failed))
            assert out.reloaded and len(out.scheduled) + len(out.reloaded) == len(before)
            for r in out.reloaded:
                assert r.block_ids == [] and r.num_computed_tokens == 0 and r in list(sched.waiting)
                assert r.num_cached_tokens == -1 or r.num_preemptions > 0  # first admission: asked again
            check_state(sched)
        else:
            assert not out.reloaded

        # The "forward pass": write the KV of the scheduled positions, then every running request
        # must read back its own tokens' KV (catches a prefix hit on the wrong block, or a write
        # into a block someone else shares).
        # Each group writes its own blocks (a group's layers keep their K/V in the group's blocks).
        for r, n in out.scheduled:
            keys = prefix_keys(r.token_ids[: r.num_computed_tokens + n])
            for table, gw in zip(r.tables, windows):
                # every key this step's queries read (from the first query's window start on) is held
                assert RELEASED not in table[max(r.num_computed_tokens - (gw or mml) + 1, 0) // bs:]
                for p in range(r.num_computed_tokens, r.num_computed_tokens + n):
                    content.setdefault(table[p // bs], {})[p % bs] = keys[p]
        for r, n in out.scheduled:
            r.num_computed_tokens += n
            if kv.has_windows:  # the engine's update_from_output releases what slid out of the windows
                kv.release_out_of_window(r)
        for r in sched.running:
            assert len(r.block_ids) == kv.blocks_needed(r.num_computed_tokens)
            assert len(r.block_ids) <= -(-mml // bs)
            assert r.num_held_blocks <= blocks_for_tokens(r.num_computed_tokens, windows, bs, budget)
            for table, released, gw in zip(r.tables, r.num_released, windows):
                # released: exactly the blocks no later query reads
                assert released == (0 if gw is None else max(r.num_computed_tokens - gw + 1, 0) // bs)
                for p, k in enumerate(prefix_keys(r.token_ids[: r.num_computed_tokens])):
                    if table[p // bs] != RELEASED:
                        assert content[table[p // bs]][p % bs] == k
        # Every named block, held or free, holds the KV of the token chain its name stands for.
        chain_of = {group_key(g, h): r.token_ids[: (i + 1) * bs] for r in reqs for i, h in enumerate(r.block_hashes)
                    for g in range(kv.num_groups)}
        for h, b in kv.cached.items():
            keys = prefix_keys(chain_of[h])
            assert [content.get(b, {}).get(s) for s in range(bs)] == keys[-bs:], "named block with other KV"
        # Sample.
        for r, n in out.scheduled:
            if r.num_computed_tokens == r.num_tokens:
                r.append_token(fake_token(r.token_ids))
                assert r.num_tokens <= mml
                if r.num_output_tokens >= r.max_tokens:
                    sched.finish_request(r, RequestStatus.FINISHED_LENGTH)
                    assert r.block_ids == []
        kv.check_invariants()
        assert len(sched.running) <= w["max_seqs"]
    else:
        pytest.fail(f"not finished after {max_steps} steps")

    for i, r in enumerate(reqs):
        assert r.finished
        exp = expected_output(r.prompt_token_ids, r.max_tokens)
        if r.request_id in shed:
            assert r.status == RequestStatus.FINISHED_ABORTED and r.num_output_tokens == 0
        elif i in aborted:
            assert r.status == RequestStatus.FINISHED_ABORTED
            assert r.output_token_ids == exp[: r.num_output_tokens]
        else:
            assert r.status == RequestStatus.FINISHED_LENGTH
            assert r.output_token_ids == exp
        assert r.block_ids == []
    assert not sched.running and len(sched.waiting) == 0
    assert kv.num_free_blocks == kv.num_blocks
    assert all(b.ref_count == 0 for b in kv.blocks)
    kv.check_invariants()


# ---- admission when the pool is short ----------------------------------------------------------
def test_a_request_that_does_not_fit_now_does_not_hold_up_smaller_ones():
    """issue 24: with a small pool, a waiting request that cannot fit blocked everything behind it."""
    sched, kv = make_sched(num_blocks=8, block_size=4, budget=64, max_seqs=8, caching=False, max_model_len=32)
    long_running = make_req(list(range(1, 17)), max_tokens=8, arrival=0)  # 16 tokens: 4 blocks + growth
    sched.add_request(long_running)
    step(sched)
    big = make_req(list(range(1, 21)), max_tokens=2, arrival=1)  # 20 tokens: 5 blocks, only 3-4 free
    small = make_req([7, 8, 9], max_tokens=2, arrival=2)
    sched.add_request(big)
    sched.add_request(small)
    out = step(sched)
    assert small in [r for r, _ in out.scheduled] and big.status == RequestStatus.WAITING
    run_to_completion(sched)
    for r in (long_running, big, small):
        assert r.output_token_ids == expected_output(r.prompt_token_ids, r.max_tokens)
    assert kv.num_free_blocks == kv.num_blocks


def test_a_passed_over_request_gets_its_turn():
    """Small requests keep arriving and keep the pool busy; the big one is passed over at most
    MAX_ADMISSION_SKIPS steps, then the queue waits for it."""
    sched, kv = make_sched(num_blocks=8, block_size=4, budget=64, max_seqs=8, caching=False, max_model_len=32)
    for _ in range(3):
        sched.add_request(make_req([9, 9, 9], max_tokens=3))
    step(sched)
    big = make_req(list(range(1, 29)), max_tokens=1)  # 7 of 8 blocks
    sched.add_request(big)
    steps = 0
    while big.status == RequestStatus.WAITING:
        sched.add_request(make_req([9, 9, 9], max_tokens=3))  # a steady stream of small requests
        step(sched)
        steps += 1
        assert steps <= 250, "the big request starved"  # a literal: a few times the skip limit
    assert steps > 10  # it was passed over for a while
    run_to_completion(sched)
    assert big.output_token_ids == expected_output(big.prompt_token_ids, 1)
    assert kv.num_free_blocks == kv.num_blocks


def test_a_prompt_the_whole_pool_cannot_hold_is_refused_and_max_tokens_is_capped():
    sched, kv = make_sched(num_blocks=4, block_size=4, max_model_len=64)
    with pytest.raises(ValueError, match="does not fit the KV cache"):
        sched.add_request(make_req(list(range(1, 17)), max_tokens=4))  # 16 tokens: no room for one more
    assert not sched.has_unfinished()
    r = make_req(list(range(1, 11)), max_tokens=50)  # 10 + 50 > 16: finishes with "length" at 16
    sched.add_request(r)
    assert r.max_tokens == 6
    run_to_completion(sched)
    assert r.status == RequestStatus.FINISHED_LENGTH and r.num_tokens == 16
    assert kv.num_free_blocks == kv.num_blocks
