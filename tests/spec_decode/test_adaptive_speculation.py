"""Adaptive speculation decides from what it measures: these tests run the engine on simulated hardware (a
clock that advances only when the target or the draft runs a forward, by a fixed cost of its token count), so
the decisions are the same on an idle machine and a loaded one, and assert what the policy does, never how
fast anything ran."""
from __future__ import annotations

import time

import pytest

from compare import assert_same_outputs
from tiny import make_tiny_model
from tokenmill import LLM, SamplingParams
from tokenmill.spec_decode.adaptive import PLAIN_FIRST, PLAIN_MAX, PROBE_MAX, AdaptivePolicy

PROMPT = "Once upon a time there was a small language model that could count to ten. " * 2
KV = dict(kv_cache_memory_bytes=8 << 20)
MS = 1e-3


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return str(make_tiny_model(tmp_path_factory.mktemp("target"), "llama", seed=1))


class SimulatedClock:
    """time.perf_counter for the test: advances by cost(T) seconds when a model runs a forward over T tokens
    (target: the engine's model; draft: the speculative decoder's draft module), plus `warmup` on each
    model's first forward (one-time setup, as the real int4 draft's first call: ~3 s). Nothing else
    advances it, so every duration the engine measures is a function of the work done."""

    def __init__(self, monkeypatch, llm: LLM, target_cost, draft_cost, warmup: float = 0.0) -> None:
        self.now = 0.0
        self.forwards = {"target": 0, "draft": 0}
        runner = llm.engine.core.executor.worker.runner
        self._hook(runner.model, "target", target_cost, warmup)
        if runner.spec is not None and runner.spec.runner is not None:
            self._hook(runner.spec.runner.module, "draft", draft_cost, warmup)
        monkeypatch.setattr(time, "perf_counter", lambda: self.now)

    def _hook(self, module, name: str, cost, warmup: float) -> None:
        def pre(_module, args):
            self.now += cost(args[0].numel()) + (warmup if self.forwards[name] == 0 else 0.0)
            self.forwards[name] += 1

        module.register_forward_pre_hook(pre)


def linear(base_ms: float, per_token_ms: float):
    return lambda tokens: (base_ms + per_token_ms * tokens) * MS


def generate(target: str, monkeypatch, spec: dict, target_cost, draft_cost, max_tokens: int, warmup: float = 0.0):
    llm = LLM(target, speculative_config=spec, **KV)
    clock = SimulatedClock(monkeypatch, llm, target_cost, draft_cost, warmup)
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, logprobs=1)
    out = [o.outputs[0] for o in llm.generate([PROMPT], params, use_tqdm=False)]
    monkeypatch.undo()
    return llm, out, clock


def test_adaptive_drafts_as_much_as_fixed_k_at_full_acceptance(target, monkeypatch):
    """Issue 25: with an int4 self-draft the adaptive policy drafted 3 times in 128 tokens at 96-100 %
    acceptance, because the draft's first step (its catch-up over the whole prompt, and a ~3 s first call)
    was charged to the 4 drafts as their per-token cost, speculation switched off, and every probe's
    catch-up over the 64 skipped tokens confirmed it. Here the draft is the target's own weights (every draft
    accepted), costing a fifth of a target forward per token plus a first-call warm-up, with a target
    that is bandwidth-bound at batch 1: adaptive must draft every step, as `adaptive: false` does (the one
    plain step that measures t(1) comes only after PLAIN_FIRST drafting steps, beyond these 96 tokens)."""
    spec = {"method": "draft_model", "model": target, "num_speculative_tokens": 4}
    target_cost, draft_cost = linear(20.0, 0.5), linear(4.0, 0.5)  # ms; a prompt of ~40 tokens: 40 / 24 ms
    runs = {}
    for adaptive in (False, True):
        llm, out, clock = generate(target, monkeypatch, dict(spec, adaptive=adaptive), target_cost, draft_cost,
                                   max_tokens=96, warmup=3.0)
        runs[adaptive] = (llm.engine.core.scheduler.spec_stats, out, clock)
    (fixed, fixed_out, fixed_clock), (adapt, adapt_out, adapt_clock) = runs[False], runs[True]
    assert_same_outputs(fixed_out, adapt_out, "adaptive vs fixed")
    assert len(adapt_out[0].token_ids) == 96
    assert fixed.num_accepted_tokens == fixed.num_draft_tokens and adapt.num_accepted_tokens == adapt.num_draft_tokens
    assert adapt.num_draft_tokens >= fixed.num_draft_tokens, (adapt.as_dict(), fixed.as_dict())
    assert adapt_clock.forwards["target"] <= fixed_clock.forwards["target"]  # no more target steps than fixed
    assert llm.engine.core.executor.worker.runner.spec.last_k == 4


def test_adaptive_turns_off_when_drafting_costs_as_much_as_the_target(target, monkeypatch):
    """A self-draft costs the target's time per token (bandwidth-bound: a forward costs about the same for 1
    to 5 tokens): verifying k drafts saves k target forwards but drafting them costs k. The engine measures
    this, stops drafting, and output is unchanged."""
    cost = linear(20.0, 0.02)
    llm, out, _ = generate(target, monkeypatch, {"method": "draft_model", "model": target,
                                                  "num_speculative_tokens": 4}, cost, cost, max_tokens=40)
    spec = llm.engine.core.executor.worker.runner.spec
    assert spec.last_k == 0
    assert llm.engine.core.scheduler.spec_stats.num_drafts < 10
    assert len(out[0].token_ids) == 40


def test_adaptive_measures_the_plain_step_and_stops_where_verifying_is_compute_bound(target, monkeypatch):
    """A compute-bound target (GGUF blocks on a CPU: 5 tokens cost ~2x one) with a draft that is cheap but
    not cheap enough: every draft accepted, yet 5 tokens per 20 + 54 ms lose to 1 per 12 ms. Drafting never
    observes the plain step, so after PLAIN_FIRST drafting steps one step runs without drafts, measures
    t(1), and speculation switches off: less (simulated) time than `adaptive: false`, same output."""
    spec = {"method": "draft_model", "model": target, "num_speculative_tokens": 4}
    target_cost, draft_cost = linear(10.0, 2.0), linear(11.0, 2.0)
    runs = {}
    for adaptive in (False, True):
        llm, out, clock = generate(target, monkeypatch, dict(spec, adaptive=adaptive), target_cost, draft_cost,
                                   max_tokens=400)
        runs[adaptive] = (llm, out, clock)
    (_, fixed_out, fixed_clock), (llm, adapt_out, adapt_clock) = runs[False], runs[True]
    assert_same_outputs(fixed_out, adapt_out, "adaptive vs fixed")
    assert llm.engine.core.executor.worker.runner.spec.last_k == 0
    # Drafting until the plain step was measured (PLAIN_FIRST + the first, unmeasured step), then probes only.
    assert llm.engine.core.scheduler.spec_stats.num_drafts <= PLAIN_FIRST + 1 + 5
    assert adapt_clock.now < fixed_clock.now, (adapt_clock.now, fixed_clock.now)


# ---- the policy alone, fed the observations the engine would make -------------------------------------
def _drafting_step(p: AdaptivePolicy, batch: int, k: int, t_ms: float, d_ms: float, accepted: int,
                   catch_up: int | None = None) -> None:
    """One step the engine ran with k drafts for `batch` requests: the target forward over batch (k+1) tokens
    (t_ms), then the draft's catch-up and k-1 passes (d_ms each)."""
    p.forward.observe(batch * (k + 1), t_ms * MS)
    for _ in range(batch):
        p.observe_verification(k, accepted)
    p.observe_draft_forward(catch_up if catch_up is not None else 2 * batch, d_ms * MS)
    for _ in range(k - 1):
        p.observe_draft_forward(batch, d_ms * MS)


def test_slow_measurements_do_not_switch_speculation_off():
    """Every cost is a low quantile of recent observations, because timing noise only adds time: draft
    forwards that take 100x as long on every other step (another process on the CPU, an OpenMP barrier
    waiting for a descheduled thread) do not make drafting look expensive."""
    p = AdaptivePolicy(4)
    for step in range(12):
        assert p.choose(1) == 4, step
        _drafting_step(p, 1, 4, t_ms=21, d_ms=400 if step % 2 else 4, accepted=4)
    assert p.choose(1) == 4
    assert p.draft_cost(1, 4, 1.0) == pytest.approx(4 * 4 * MS)


def test_long_catch_ups_count_as_forwards_over_many_tokens():
    """The draft's catch-up over a whole prompt or over the tokens skipped while off is one forward over
    many tokens: it is recorded as such, not divided among the step's drafts as their cost."""
    p = AdaptivePolicy(4)
    p.choose(1)
    _drafting_step(p, 1, 4, t_ms=21, d_ms=4, accepted=4, catch_up=64)
    p.observe_draft_forward(64, 300 * MS)  # a slow (compute-bound) catch-up over 64 tokens
    assert p.choose(1) == 4
    assert p.draft_cost(1, 4, 1.0) < 20 * MS


def test_off_when_speculation_loses_and_back_on_when_it_pays_again():
    """Drafts the target rejects: off. While off it probes after 8 steps, then 16, 32, 64; a probe that finds
    the drafts accepted again turns it back on."""
    p = AdaptivePolicy(4)
    for _ in range(20):
        k = p.choose(1)
        if k == 0:
            break
        _drafting_step(p, 1, k, t_ms=21, d_ms=4, accepted=0)
    assert k == 0, "drafting kept on although no draft is ever accepted"
    gaps, off = [], 1
    while len(gaps) < 5:
        k = p.choose(1)
        if k == 0:
            off += 1
            p.forward.observe(1, 20 * MS)
        else:
            assert k == 4
            gaps.append(off)
            off = 0
            _drafting_step(p, 1, k, t_ms=21, d_ms=4, accepted=0)
    assert gaps == [8, 16, 32, 64, PROBE_MAX]
    # The text changes: the next probe's drafts are all accepted, and speculation stays on.
    while p.choose(1) == 0:
        p.forward.observe(1, 20 * MS)
    for _ in range(5):
        _drafting_step(p, 1, 4, t_ms=21, d_ms=4, accepted=4)
        assert p.choose(1) > 0


def test_a_draft_head_pays_its_catch_up_whether_drafting_or_not():
    """An EAGLE/MTP head catches up on every step, so speculation off still costs its catch-up; a model
    draft skips it while off (and catches up on its first drafting step)."""
    model, head = AdaptivePolicy(4, drafter="model"), AdaptivePolicy(4, drafter="head")
    for p in (model, head):
        p.forward.observe(1, 20 * MS)
        p.observe_draft_forward(1, 5 * MS)
        p.observe_draft_forward(2, 5 * MS)
    assert model.draft_cost(1, 0, 1.0) == 0.0 and head.draft_cost(1, 0, 1.0) == pytest.approx(5 * MS)
    assert model.draft_cost(1, 1, 0.0) == head.draft_cost(1, 1, 0.0) == pytest.approx(5 * MS)


def test_plain_steps_while_drafting_are_rare_and_catch_a_compute_bound_target():
    """While drafting wins, one step in PLAIN_FIRST, 2 PLAIN_FIRST, ... PLAIN_MAX goes without drafts to
    measure t(B); where that measurement shows the plain step is cheap enough, speculation stops."""
    def run(t1_ms: float, steps: int) -> list[int]:
        p, ks = AdaptivePolicy(4), []
        for _ in range(steps):
            k = p.choose(1)
            ks.append(k)
            if k:
                _drafting_step(p, 1, k, t_ms=20, d_ms=10, accepted=4)
            else:
                p.forward.observe(1, t1_ms * MS)
        return ks

    # Bandwidth-bound (t(1) = t(5)): the plain steps come after 32, 64, 128, 256, 256 drafting steps.
    ks = run(20.0, 1 + 32 + 1 + 64 + 1 + 128 + 1 + 256 + 1 + 256 + 1)
    plain = [i for i, k in enumerate(ks) if k == 0]
    gaps = [b - a - 1 for a, b in zip([-1] + plain, plain)]
    assert gaps == [PLAIN_FIRST, 2 * PLAIN_FIRST, 4 * PLAIN_FIRST, PLAIN_MAX, PLAIN_MAX]
    # Compute-bound (t(1) = 12 ms against t(5) = 20 ms, drafting 40 ms): off from the first measurement on,
    # but for the probes that keep checking.
    ks = run(12.0, 200)
    assert all(k == 4 for k in ks[:PLAIN_FIRST]) and ks[PLAIN_FIRST] == 0
    assert sum(k > 0 for k in ks[PLAIN_FIRST:]) <= 5
