"""Fault injection at every stage of the engine step (tokenmill/testing/faults.py), under concurrent load.

For each stage a chosen request (the victim) raises there while other requests run beside it, some of them
sharing its prompt prefix. Asserted: only the victim fails (with an error naming the fault), every other
request's output equals its solo run, no KV block leaks and no block keeps a name whose KV was never
written, nothing hangs (every loop has a deadline), and a later request with the victim's prompt gets the
same output as a solo run (the prefix cache was not poisoned).
"""
from __future__ import annotations

import time

import pytest

from tiny import make_tiny_model
from tokenmill import LLM, SamplingParams
from tokenmill.testing import faults

pytestmark = pytest.mark.usefixtures("one_torch_thread")

MAX_LEN = 96
DEADLINE_S = 60.0

SHARED = list(range(3, 3 + 24))  # a 24-token prefix the victim shares with two neighbours
PROMPTS = {
    "n-shared-a": SHARED + [40, 41, 42],
    "n-shared-b": SHARED + [50, 51],
    "n-other-a": [60 + i for i in range(10)],
    "n-other-b": [80 + i for i in range(30)],
    "n-seeded": [90 + i for i in range(7)],
    "victim": SHARED + [70, 71, 72, 73, 74, 75, 76, 77, 78],
}


def params_for(rid: str) -> SamplingParams:
    if rid == "n-seeded":  # sampled, n > 1: its seed makes it independent of the batch
        return SamplingParams(max_tokens=10, temperature=1.0, seed=7, n=2)
    return SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("faults") / "llama", "llama")


@pytest.fixture(scope="module")
def llm(path):
    # A small token budget, so prompts are chunked and the victim's prefill spans several steps.
    return LLM(str(path), max_model_len=MAX_LEN, num_gpu_blocks_override=64, block_size=4,
               max_num_batched_tokens=32, enable_prefix_caching=True)


def run(llm: LLM, order: list[str], late: list[str] = (), rid_suffix: str = "",
        slo=lambda rid: None) -> dict[str, list]:
    """Add `order` at once, step twice, add `late`, step until done. Returns {id: [(tokens, finish, stop)]}.
    `slo(rid)`: the request's latency targets (the slo policy)."""
    engine = llm.engine
    outs: dict[str, list] = {}
    for rid in order:
        engine.add_request(rid + rid_suffix, None, params_for(rid), prompt_token_ids=PROMPTS[rid], slo=slo(rid))
    deadline = time.monotonic() + DEADLINE_S
    steps = 0
    while engine.has_unfinished_requests() or late:
        assert time.monotonic() < deadline, "the engine did not finish in time"
        if steps == 2:
            for rid in late:
                engine.add_request(rid + rid_suffix, None, params_for(rid), prompt_token_ids=PROMPTS[rid],
                                   slo=slo(rid))
            late = []
        for o in engine.step():
            if o.finished:
                outs[o.request_id.removesuffix(rid_suffix)] = [
                    (c.token_ids, c.finish_reason, c.stop_reason) for c in o.outputs]
        steps += 1
    return outs


def assert_idle(llm: LLM) -> None:
    engine = llm.engine
    kv = engine.kv
    assert not engine.has_unfinished_requests()
    assert kv.num_free_blocks == kv.num_blocks, "KV blocks leaked"
    assert not kv.unwritten, "blocks named for KV that was never written"
    kv.check_invariants()


@pytest.fixture(scope="module")
def solo(llm) -> dict[str, list]:
    """Every prompt alone, on an empty prefix cache."""
    out = {}
    for rid in PROMPTS:
        llm.engine.kv.reset_prefix_cache()
        out.update(run(llm, [rid], rid_suffix="-solo"))
    llm.engine.kv.reset_prefix_cache()
    return out


def test_the_hook_matches_requests_and_their_children(monkeypatch):
    monkeypatch.setenv(faults.ENV, "forward=abc,update=*")
    with pytest.raises(faults.InjectedFault, match="forward for request abc-1"):
        faults.maybe_raise("forward", ["x", "abc-1"])
    faults.maybe_raise("forward", ["abcd", "abc-x", "ab"])  # neither the id nor one of its children
    faults.maybe_raise("schedule", ["abc"])  # another stage
    with pytest.raises(faults.InjectedFault):
        faults.maybe_raise("update", ["anything"])
    monkeypatch.setenv(faults.ENV, "nowhere=abc")
    with pytest.raises(ValueError, match="unknown stage"):
        faults.maybe_raise("forward", ["abc"])
    monkeypatch.delenv(faults.ENV)
    faults.maybe_raise("forward", ["abc"])


def fail_the_victim(llm: LLM, solo: dict, monkeypatch, stage: str, compare=lambda rid: True) -> None:
    """The victim raises at `stage` while its neighbours run: it ends with the fault's error, the neighbours
    (those `compare` names) with their solo output, and nothing leaks."""
    neighbours = [rid for rid in PROMPTS if rid != "victim"]
    monkeypatch.setenv(faults.ENV, f"{stage}=victim")
    outs = run(llm, neighbours, late=["victim"])
    monkeypatch.delenv(faults.ENV)
    (tokens, finish, stop), = outs["victim"]
    assert finish == "abort" and f"injected fault at {stage}" in str(stop), outs["victim"]
    for rid in filter(compare, neighbours):
        assert outs[rid] == solo[rid], f"{rid} changed when {stage} failed for the victim"
    assert_idle(llm)


@pytest.mark.parametrize("stage", ["schedule", "build_batch", "bitmask", "forward", "sample", "update"])
def test_a_fault_at_one_stage_fails_only_its_request(llm, solo, monkeypatch, stage):
    fail_the_victim(llm, solo, monkeypatch, stage)
    # The victim's blocks were named when they were allocated: a later request with the same prompt must
    # not read KV that was never written.
    again = run(llm, ["victim", "n-shared-a"], rid_suffix="-again")
    assert again["victim"] == solo["victim"] and again["n-shared-a"] == solo["n-shared-a"]
    assert_idle(llm)


def test_a_fault_in_every_request_fails_them_all_and_the_engine_runs_on(llm, solo, monkeypatch):
    monkeypatch.setenv(faults.ENV, "forward=*")
    outs = run(llm, list(PROMPTS))
    monkeypatch.delenv(faults.ENV)
    assert {rid: [c[1] for c in o] for rid, o in outs.items()} == {
        rid: ["abort"] * params_for(rid).n for rid in PROMPTS}
    assert_idle(llm)
    assert run(llm, list(PROMPTS), rid_suffix="-after") == solo
    assert_idle(llm)


def test_random_faults_at_every_stage_never_leak_or_change_survivors(llm, solo, monkeypatch):
    """The soak's mode: every stage fails now and then for any request. Each request either fails with an
    injected fault or finishes with exactly its solo output."""
    spec = ",".join(f"{s}=*@0.03" for s in ("schedule", "build_batch", "bitmask", "forward", "sample", "update"))
    monkeypatch.setenv(faults.ENV, spec)
    failed = 0
    for round_ in range(4):
        outs = run(llm, list(PROMPTS)[:3], late=list(PROMPTS)[3:], rid_suffix=f"-r{round_}")
        for rid, seqs in outs.items():
            if any(f == "abort" for _, f, _ in seqs):
                failed += 1
                assert any("injected fault" in str(s) for _, _, s in seqs), seqs
            else:
                assert seqs == solo[rid], rid
    monkeypatch.delenv(faults.ENV)
    assert_idle(llm)
    assert run(llm, list(PROMPTS), rid_suffix="-calm") == solo


def test_random_faults_under_the_slo_policy_never_leak_or_change_survivors(path, solo, monkeypatch):
    """The same under --scheduling-policy slo, half the requests with targets (their steps capped, batch work
    deferred): failures stay with their requests, the survivors' outputs are their solo ones."""
    from tokenmill.core.request import RequestSLO

    slo_llm = LLM(str(path), max_model_len=MAX_LEN, num_gpu_blocks_override=64, block_size=4,
                  max_num_batched_tokens=32, enable_prefix_caching=True, scheduling_policy="slo")
    targets = {rid: RequestSLO(ttft_ms=60_000, tpot_ms=1) if i % 2 else None for i, rid in enumerate(PROMPTS)}
    spec = ",".join(f"{s}=*@0.03" for s in ("schedule", "build_batch", "bitmask", "forward", "sample", "update"))
    monkeypatch.setenv(faults.ENV, spec)
    for round_ in range(3):
        outs = run(slo_llm, list(PROMPTS)[:3], late=list(PROMPTS)[3:], rid_suffix=f"-s{round_}", slo=targets.get)
        for rid, seqs in outs.items():
            if any(f == "abort" for _, f, _ in seqs):
                assert any("injected fault" in str(s) for _, _, s in seqs), seqs
            else:
                assert seqs == solo[rid], rid
    monkeypatch.delenv(faults.ENV)
    assert_idle(slo_llm)
    assert run(slo_llm, list(PROMPTS), rid_suffix="-calm", slo=targets.get) == solo


def test_names_given_in_a_failed_schedule_are_dropped(llm, solo, monkeypatch):
    """schedule() names the blocks of the requests it admits before it reaches the one that fails; those
    blocks are not written this step. If such a request is then aborted, its freed blocks must not keep
    names a later request would hit."""
    engine = llm.engine
    engine.add_request("victim-x", None, params_for("victim"), prompt_token_ids=PROMPTS["victim"][:20])
    engine.add_request("poison", None, params_for("n-other-a"), prompt_token_ids=PROMPTS["n-other-a"])
    monkeypatch.setenv(faults.ENV, "schedule=poison")
    outs = engine.step()
    monkeypatch.delenv(faults.ENV)
    assert [(o.request_id, o.outputs[0].finish_reason) for o in outs] == [("poison", "abort")]
    engine.abort_request("victim-x")
    assert_idle(llm)
    assert run(llm, ["victim"], rid_suffix="-later")["victim"] == solo["victim"]
    assert_idle(llm)


@pytest.fixture(scope="module")
def offload_llm(path):
    # 14 blocks of 8 tokens: a few prompts evict each other's prefixes to the host tier, and loading any
    # chain is worth it (min_blocks=1).
    return LLM(str(path), max_model_len=MAX_LEN, num_gpu_blocks_override=14, block_size=8,
               kv_offload_bytes=1 << 20, kv_offload_min_blocks=1)


def test_a_failed_kv_transfer_recomputes_instead_of_reading_bad_kv(offload_llm, monkeypatch):
    """KV tier transfers fail for the requests that load blocks: every load counts as failed and those
    requests recompute (their output is unchanged); saves of that step are forgotten, never loaded later."""
    llm = offload_llm
    long_prompt = list(range(3, 3 + 40))  # 5 blocks
    fillers = [[100 + 7 * i + j for j in range(40)] for i in range(3)]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)

    def gen(prompt, rid):
        llm.engine.add_request(rid, None, params, prompt_token_ids=prompt)
        deadline = time.monotonic() + DEADLINE_S
        while llm.engine.has_unfinished_requests():
            assert time.monotonic() < deadline
            for o in llm.engine.step():
                if o.finished:
                    return o.outputs[0].token_ids, o.outputs[0].finish_reason

    solo = gen(long_prompt, "solo")
    stats = llm.engine.kv.offload.stats
    filled = [gen(f, f"fill-{i}") for i, f in enumerate(fillers)]  # push the prompt's blocks to the host tier
    assert stats.saves > 0
    loads_before = stats.host_loads
    monkeypatch.setenv(faults.ENV, "transfer=victim")
    assert gen(long_prompt, "victim") == solo  # recomputed: same output
    monkeypatch.delenv(faults.ENV)
    assert stats.host_loads > loads_before and stats.load_failures > 0
    assert_idle(llm)
    monkeypatch.setenv(faults.ENV, "transfer=*")  # every transfer fails, saves included
    for i, f in enumerate(fillers):
        gen(f, f"fill-again-{i}")
    monkeypatch.delenv(faults.ENV)
    for i, f in enumerate(fillers):  # whatever the tiers still hold is valid
        assert gen(f, f"check-{i}") == filled[i]
    assert gen(long_prompt, "after") == solo
    assert_idle(llm)
    llm.engine.kv.offload.check_invariants()


# ---- through the server: the engine core in its own process ----------------------------------------
def test_random_faults_behind_the_server_fail_requests_cleanly(path, tmp_path, monkeypatch):
    """Faults at random stages in the engine-core process (and the output processing in the API
    process): each request either succeeds with its solo output or gets a 500 in OpenAI's error shape
    naming the fault; nothing hangs, /health stays 200 and the KV cache drains to 0."""
    import asyncio

    import httpx

    from server_harness import start_server

    prompts = [[5 + 3 * i + j for j in range(6 + i)] for i in range(12)]
    body = dict(model="tiny", max_tokens=8, temperature=0.0, ignore_eos=True)
    stages = ("schedule", "build_batch", "bitmask", "forward", "sample", "update", "output")
    monkeypatch.setenv(faults.ENV, ",".join(f"{s}=*@0.02" for s in stages))
    srv = start_server(path, tmp_path / "server.log", "--served-model-name", "tiny", "--max-model-len", "96")
    try:
        def alone(prompt: list[int]) -> str:  # one request at a time; a fault hits one in ten or so: ask again
            for _ in range(8):
                r = httpx.post(srv.url("/v1/completions"), json=dict(body, prompt=prompt), timeout=60)
                if r.status_code == 200:
                    return r.json()["choices"][0]["text"]
                assert "injected fault" in r.json()["error"]["message"], r.text
            raise AssertionError("eight faults in a row")

        solo = [alone(p) for p in prompts]

        async def go():
            async with httpx.AsyncClient(timeout=60) as client:
                async def one(i):
                    return i, await client.post(srv.url("/v1/completions"), json=dict(body, prompt=prompts[i]))
                return await asyncio.gather(*(one(i % len(prompts)) for i in range(36)))

        results = asyncio.run(go())
        failed = 0
        for i, r in results:
            if r.status_code == 200:
                assert r.json()["choices"][0]["text"] == solo[i]
            else:
                failed += 1
                err = r.json()["error"]
                assert r.status_code == 500 and {"message", "type", "param", "code"} <= err.keys(), r.text
                assert "injected fault" in err["message"], err
        assert httpx.get(srv.url("/health"), timeout=10).status_code == 200
        assert srv.wait_metric("tokenmill:kv_cache_usage_perc", 0.0, timeout=10) == 0.0
        assert srv.metric("tokenmill:num_requests_running") == 0
    finally:
        srv.stop()


def test_requests_admitted_with_a_failed_schedule_do_not_read_unwritten_blocks(llm, solo, monkeypatch):
    """Two requests with one prompt are admitted in one schedule() (the second shares the blocks the first
    is to write), then the schedule fails on a third and the first is aborted: the second must not run
    reading those blocks unwritten."""
    engine = llm.engine
    twin = [200 + i for i in range(14)]  # 3 full blocks and a bit: all three requests fit one step's budget
    expected = None
    for name in ("twin-solo", "twin-a", "twin-b"):
        engine.add_request(name, None, params_for("victim"), prompt_token_ids=twin)
        if name == "twin-solo":
            deadline = time.monotonic() + DEADLINE_S
            while engine.has_unfinished_requests():
                assert time.monotonic() < deadline
                expected = [[(c.token_ids, c.finish_reason, c.stop_reason) for c in o.outputs]
                            for o in engine.step() if o.finished] or expected
            engine.kv.reset_prefix_cache()
    engine.add_request("poison", None, params_for("n-other-a"), prompt_token_ids=PROMPTS["n-other-a"])
    monkeypatch.setenv(faults.ENV, "schedule=poison")
    outs = {o.request_id: o for o in engine.step()}
    monkeypatch.delenv(faults.ENV)
    assert outs["poison"].outputs[0].finish_reason == "abort"
    assert all(r.status.name == "WAITING" and not r.block_ids for r in engine.scheduler.waiting)
    engine.abort_request("twin-a")  # the one that was to write the shared blocks goes away
    done = {}
    deadline = time.monotonic() + DEADLINE_S
    while engine.has_unfinished_requests():
        assert time.monotonic() < deadline
        for o in engine.step():
            if o.finished:
                done[o.request_id] = [(c.token_ids, c.finish_reason, c.stop_reason) for c in o.outputs]
    assert done == {"twin-b": expected[0]}
    assert_idle(llm)


def test_a_seeded_request_resent_after_a_failed_step_continues_its_random_stream(llm, monkeypatch):
    """A fault inside the worker (sampling) makes the engine re-send the step's requests to the worker; a
    seeded sampled request then draws what it would have drawn running uninterrupted (its generator is a
    function of seed and output position, not restarted from the seed)."""
    engine = llm.engine
    params = SamplingParams(max_tokens=12, temperature=1.0, seed=7)

    def gen(victim_at: int | None) -> list[int]:
        engine.add_request("seeded", None, params, prompt_token_ids=[90 + i for i in range(7)])
        out, steps, deadline = None, 0, time.monotonic() + DEADLINE_S
        while engine.has_unfinished_requests():
            assert time.monotonic() < deadline
            if steps == victim_at:
                engine.add_request("victim", None, SamplingParams(max_tokens=3), prompt_token_ids=[5, 6, 7])
            for o in engine.step():
                if o.finished and o.request_id == "seeded":
                    out = o.outputs[0].token_ids
                elif o.finished:
                    assert o.outputs[0].finish_reason == "abort"
            steps += 1
        return out

    solo = gen(None)
    monkeypatch.setenv(faults.ENV, "sample=victim")
    assert gen(victim_at=4) == solo
    monkeypatch.delenv(faults.ENV)
    assert_idle(llm)


@pytest.fixture(scope="module")
def tree_llm(path, tmp_path_factory):
    """The same engine verifying Medusa draft trees (random heads: paths off the first nodes get moved)."""
    from medusa_tiny import write_medusa

    heads = write_medusa(tmp_path_factory.mktemp("medusa"), path, heads=4)
    return LLM(str(path), max_model_len=MAX_LEN, num_gpu_blocks_override=64, block_size=4,
               max_num_batched_tokens=32, enable_prefix_caching=True,
               speculative_config={"method": "medusa", "model": str(heads), "num_speculative_tokens": 8,
                                   "adaptive": False})


@pytest.mark.parametrize("stage", ["forward", "sample"])
def test_a_fault_while_verifying_trees_fails_only_its_request(tree_llm, solo, monkeypatch, stage):
    """Issue 30: a step verifying draft trees fails for one request; the others (trees verified, paths moved)
    keep their solo output, nothing leaks."""
    # the sampled neighbour: trees draw other uniforms than plain decoding (the same distribution)
    fail_the_victim(tree_llm, solo, monkeypatch, stage, compare=lambda rid: rid != "n-seeded")
    assert tree_llm.engine.core.scheduler.spec_stats.num_draft_tokens > 0


@pytest.fixture(scope="module", params=["eagle tree", "dflash"])
def drafting_llm(request, path, tmp_path_factory):
    """The same engine drafting EAGLE-2 trees from a random head, or blocks from a random block drafter."""
    from draft_heads_tiny import write_eagle_head
    from test_dflash import write_drafter

    folder = tmp_path_factory.mktemp("drafter")
    if request.param == "eagle tree":
        spec = {"method": "eagle", "model": str(write_eagle_head(folder, path, copy=False)), "tree_topk": 2,
                "num_speculative_tokens": 6}
    else:
        spec = {"method": "dflash", "model": str(write_drafter(folder, path)), "block_threshold": 0.0}
    return LLM(str(path), max_model_len=MAX_LEN, num_gpu_blocks_override=64, block_size=4,
               max_num_batched_tokens=32, enable_prefix_caching=True,
               speculative_config={**spec, "adaptive": False})


@pytest.mark.parametrize("stage", ["forward", "sample", "propose"])
def test_a_fault_while_drafting_trees_or_blocks_fails_only_its_request(drafting_llm, solo, monkeypatch, stage):
    """Issue 30: EAGLE-2 trees and block drafts; a step fails for one request while drafting, verifying or
    proposing; the others keep their solo output (the sampled one: another uniform stream, so not compared)."""
    fail_the_victim(drafting_llm, solo, monkeypatch, stage, compare=lambda rid: rid != "n-seeded")
    assert drafting_llm.engine.core.scheduler.spec_stats.num_draft_tokens > 0
