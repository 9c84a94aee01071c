"""The scheduler with LoRA adapters (pure Python): never more distinct adapters running than slots, a request for a
cold adapter is not starved by a stream of requests for the hot one, base-model requests need no slot, and the
prefix cache never shares blocks across adapters."""
from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from test_scheduler import check_state, make_req, make_sched, step
from tokenmill.core.request import RequestStatus
from tokenmill.lora.request import LoRARequest

A, B, C = (LoRARequest(n, i + 1, f"/adapters/{n}") for i, n in enumerate("abc"))


def lora_req(prompt, lora, max_tokens=4):
    r = make_req(prompt, max_tokens=max_tokens)
    r.lora = lora
    r.extra_keys = lora.cache_key if lora is not None else ()
    return r


def adapters_running(sched) -> set:
    return {r.lora.cache_key for r in sched.running if r.lora is not None}


def test_cold_adapter_is_not_starved_by_a_stream_for_the_hot_one():
    sched, kv = make_sched(num_blocks=256, budget=64, max_seqs=16)
    sched.config.max_loras = 1
    sched.add_request(lora_req(range(8), A, max_tokens=6))
    cold = lora_req(range(100, 108), B, max_tokens=2)
    sched.add_request(cold)
    base = lora_req(range(200, 208), None, max_tokens=2)
    sched.add_request(base)
    for i in range(40):  # a new request for the hot adapter every step
        sched.add_request(lora_req(range(300 + 10 * i, 308 + 10 * i), A, max_tokens=6))
        step(sched)
        assert len(adapters_running(sched)) <= 1
        if cold.status != RequestStatus.WAITING:
            break
    assert cold.status != RequestStatus.WAITING, "the request for the cold adapter never got a slot"
    assert base.first_scheduled_time is not None and base.first_scheduled_time <= cold.first_scheduled_time


def test_adapter_requests_need_slots():
    """On an engine without slots an adapter request is refused, not queued to wait for one for ever."""
    sched, _ = make_sched()
    with pytest.raises(ValueError, match="--enable-lora"):
        sched.add_request(lora_req(range(8), A))


def test_prefix_cache_is_keyed_by_adapter():
    sched, kv = make_sched(num_blocks=64, block_size=4, budget=64)
    sched.config.max_loras = 2
    prompt = list(range(16))
    first = lora_req(prompt, A, max_tokens=1)
    sched.add_request(first)
    while sched.has_unfinished():
        step(sched)
    for lora, hit in ((A, True), (B, False), (None, False)):
        r = lora_req(prompt, lora, max_tokens=1)
        assert bool(kv.get_computed_blocks(r)) == hit, lora


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(slots=st.integers(1, 3), blocks=st.integers(8, 40),
       reqs=st.lists(st.tuples(st.integers(0, 3), st.integers(1, 12), st.integers(1, 5)), min_size=1, max_size=20))
def test_random_workloads_hold_the_slot_limit_and_finish(slots, blocks, reqs):
    sched, kv = make_sched(num_blocks=blocks, block_size=4, budget=16, max_seqs=6, max_model_len=32)
    sched.config.max_loras = slots
    made = []
    for i, (which, plen, out) in enumerate(reqs):
        r = lora_req(range(i * 3, i * 3 + plen), (None, A, B, C)[which], max_tokens=out)
        sched.add_request(r)
        made.append(r)
    steps = 0
    while sched.has_unfinished():
        step(sched)
        check_state(sched)
        assert len(adapters_running(sched)) <= slots
        steps += 1
        assert steps < 500, "no progress"
    assert all(r.status == RequestStatus.FINISHED_LENGTH for r in made)
    assert kv.num_free_blocks == kv.num_blocks
