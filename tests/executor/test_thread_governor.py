"""executor/thread_governor.py: each step size's thread count chosen by measuring steps.

- Quiet (all threads faster): probes with one thread never switch, and back off to MAX_PROBE_EVERY.
- A busy neighbour (one thread faster): the first probe switches; when the neighbour goes, a probe switches back.
- Steps whose results may follow the count (float models; prompt-sized steps) probe only while the run-queue
  signal says a neighbour is likely, or while their size already runs on fewer threads.
- One-thread machines are left alone; each size keeps its own choice.
- Switching the count on every step changes no token or logprob of a GGUF model.
- executor/run_queue.py: the waiting share from /proc/thread-self/schedstat, read at most every interval.
"""
from __future__ import annotations

from pathlib import Path
import pytest
import torch

from tokenmill import native
from tokenmill.executor import run_queue as rq
from tokenmill.executor import thread_governor as tg


def run(gov: tg.ThreadGovernor, steps: int, cost: dict[int, float], tokens: int = 1) -> list[int]:
    """`steps` steps of `tokens` tokens; cost: seconds a step takes with n threads. Returns the counts used."""
    used = []
    for _ in range(steps):
        gov.begin(tokens)
        n = gov._step[2] if gov._step is not None else gov.max_threads
        used.append(n)
        gov.end(cost[n])
    return used


def test_quiet_machine_keeps_all_threads_and_probes_less_and_less():
    applied = []
    gov = tg.ThreadGovernor(2, applied.append)
    used = run(gov, 2000, {2: 0.010, 1: 0.018})
    s = gov.state(1)
    assert s.threads == 2 and gov.switches == 0
    assert s.every == tg.MAX_PROBE_EVERY
    probes = used.count(1)
    assert 3 <= probes <= 2000 // tg.PROBE_EVERY // 2  # backing off: far fewer than one per PROBE_EVERY
    assert applied[0] == 2 and all(a != b for a, b in zip(applied, applied[1:]))  # only changes are applied
    assert applied[-1] == 2  # a probe gives the threads back as soon as it ends


def test_a_busy_neighbour_switches_to_one_thread_and_back_when_it_goes():
    applied = []
    gov = tg.ThreadGovernor(2, applied.append)
    run(gov, 40, {2: 0.030, 1: 0.018})
    assert gov.state(1).threads == 1 and gov.switches == 1 and applied[-1] == 1
    gov.close()  # an engine that stops now gives the process its threads back
    assert applied[-1] == 2
    gov._applied = 1  # (as it was: the engine ran on)
    run(gov, 600, {2: 0.010, 1: 0.018})  # the neighbour stopped: a probe with 2 threads wins
    assert gov.state(1).threads == 2 and gov.switches == 2 and applied[-1] == 2


def test_noise_within_the_margin_does_not_switch():
    gov = tg.ThreadGovernor(2, lambda n: None)
    run(gov, 500, {2: 0.010, 1: 0.0095})  # one thread 5 % faster: under the margin
    assert gov.state(1).threads == 2 and gov.switches == 0


def test_steps_whose_results_may_change_probe_only_under_the_run_queue_signal():
    """A float model (not invariant), and prompt-sized steps of any model: on a quiet machine never a probe, so
    results stay bit for bit those of all threads; with the signal on, a neighbour is found and the size switches;
    once switched, it probes (back to all threads) without the signal, and returns when the neighbour goes."""
    for invariant, tokens in ((False, 1), (False, 64), (True, tg.MAX_TOKENS + 1)):
        applied, signal = [], [False]
        gov = tg.ThreadGovernor(2, applied.append, invariant=invariant, contended=lambda: signal[0])
        used = run(gov, 300, {2: 0.1, 1: 0.01}, tokens=tokens)  # one thread would win, but nothing says so
        assert set(used) == {2} and set(applied) == {2} and gov.switches == 0
        signal[0] = True
        run(gov, tg.PROBE_EVERY + 1, {2: 0.1, 1: 0.01}, tokens=tokens)
        assert gov.state(tokens).threads == 1 and gov.switches == 1
        signal[0] = False  # one thread on the free core: the stepping thread no longer waits
        run(gov, 2 * tg.MAX_PROBE_EVERY, {2: 0.01, 1: 0.018}, tokens=tokens)  # the neighbour went
        assert gov.state(tokens).threads == 2 and gov.switches == 2 and applied[-1] == 2


def test_each_size_keeps_its_own_choice_and_large_sizes_are_grouped():
    gov = tg.ThreadGovernor(2, lambda n: None, invariant=False, contended=lambda: True)
    run(gov, 40, {2: 0.03, 1: 0.01}, tokens=1)  # decode: one thread wins
    run(gov, 40, {2: 0.2, 1: 0.35}, tokens=600)  # a prompt chunk: two threads win
    assert gov.state(1).threads == 1 and gov.state(600).threads == 2
    assert gov.hint == 2 and gov.switches == 2  # the chunk started on one thread (the hint), then switched
    hinted = tg.ThreadGovernor(2, lambda n: None, invariant=False, contended=lambda: True)
    run(hinted, 3, {2: 0.03, 1: 0.01}, tokens=1)  # the first probe, at the second step, switches
    assert hinted.switches == 1 and hinted.hint == 1
    assert hinted.state(40).threads == 1  # a size never seen starts where the last switch went
    assert tg.size_key(5) == 5 and tg.size_key(9) == tg.size_key(16) == 16 and tg.size_key(600) == 1024
    assert gov.state(513) is gov.state(1024)


def test_single_thread_machines_are_left_alone():
    never = []
    one = tg.ThreadGovernor(1, never.append, contended=lambda: True)
    run(one, 100, {1: 0.01})
    assert never == []


def test_run_queue_share_from_schedstat_readings():
    t, waited = [0.0], [0]
    w = rq.RunQueueWait(read=lambda: waited[0], clock=lambda: t[0], interval_s=0.1, threshold=0.15)
    assert not w.contended()  # first reading: nothing to compare with
    t[0], waited[0] = 0.05, 40_000_000
    assert not w.contended() and w.share == 0.0  # within the interval: not read again
    t[0], waited[0] = 0.2, 100_000_000  # waited 0.1 s of 0.2 s
    assert w.contended() and w.share == pytest.approx(0.5)
    t[0], waited[0] = 0.4, 101_000_000  # 1 ms of 0.2 s
    assert not w.contended() and w.share == pytest.approx(0.005)
    assert not rq.RunQueueWait(read=lambda: None).contended() and not rq.RunQueueWait(read=lambda: None).available()


def test_run_queue_reads_this_thread_where_linux_keeps_it():
    if rq.run_delay_ns() is None:
        pytest.skip("no /proc/thread-self/schedstat here")
    a = rq.run_delay_ns()
    sum(range(100_000))
    assert rq.run_delay_ns() >= a >= 0


@pytest.mark.skipif(not native.has_op("set_attention_plan_threads"), reason="tokenmill._C not built")
def test_switching_threads_every_step_changes_no_result(tmp_path, monkeypatch):
    """A GGUF model with the governor switching between 1 and 2 threads on every decode step (every step a
    probe that wins) gives the tokens and logprobs, bit for bit, of the same model with the governor off: the
    GGUF rows do not depend on the count, and attention plans its partitions for 2 threads (the prompt, 1100
    tokens, is long enough that 1 and 2 threads would plan different partitions)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    import model_shapes as ms

    from tokenmill import LLM, SamplingParams

    path = ms.ensure_gguf("tiny-test", "Q4_0", tmp_path)
    ids = [{"prompt_token_ids": [(37 * i) % 1000 + 5 for i in range(1100)]}]
    greedy = SamplingParams(max_tokens=12, temperature=0.0, logprobs=2)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)

    def run() -> tuple[list[int], list, object]:
        llm = LLM(str(path), max_model_len=1400, kv_cache_memory_bytes=32 << 20, enable_prefix_caching=False)
        out = llm.generate(ids, greedy, use_tqdm=False)[0].outputs[0]
        gov = llm.engine.runner.governor
        llm.close()
        return list(out.token_ids), [sorted(d.items()) for d in out.logprobs], gov

    try:
        monkeypatch.setenv("TOKENMILL_THREAD_GOVERNOR", "0")
        base_tokens, base_lps, off = run()
        assert off is None
        monkeypatch.delenv("TOKENMILL_THREAD_GOVERNOR")
        monkeypatch.setattr(tg, "PROBE_EVERY", 1)
        monkeypatch.setattr(tg, "MARGIN", 1e9)  # every probe wins: the count flips every step
        tokens, lps, gov = run()
        assert gov is not None and gov.switches >= 8
        assert torch.get_num_threads() == 2  # closing the engine gave the threads back
        assert tokens == base_tokens and lps == base_lps
    finally:
        torch.set_num_threads(threads)


def test_made_only_where_it_can_act(monkeypatch):
    dense = torch.nn.Linear(4, 4)
    assert tg.make_governor("cuda", 8, dense) is None
    assert tg.make_governor("cpu", 1, dense) is None
    if native.has_op("set_attention_plan_threads") and rq.run_delay_ns() is not None:
        prev = torch.ops.tokenmill.set_attention_plan_threads(0)
        try:
            gov = tg.make_governor("cpu", 2, dense)  # a float model: governed, probing only under the signal
        finally:
            torch.ops.tokenmill.set_attention_plan_threads(prev)
        assert gov is not None and not gov.invariant
    monkeypatch.setattr(rq, "SCHEDSTAT", "/nonexistent/schedstat")  # a kernel that keeps no run-queue times
    assert tg.make_governor("cpu", 2, dense) is None  # no signal: a float model is left alone
    monkeypatch.setenv("TOKENMILL_THREAD_GOVERNOR", "0")
    assert tg.make_governor("cpu", 2, dense) is None
