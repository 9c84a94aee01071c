"""executor/thread_governor.py: the thread count of the GGUF row loops chosen by measuring steps.

- Quiet (all threads faster): probes with one thread never switch, and back off to MAX_PROBE_EVERY.
- A busy neighbour (one thread faster): the first probe switches; when the neighbour goes, a probe switches back.
- Prompt-sized steps and one-thread machines are left alone.
- Switching the count on every step changes no token or logprob of a GGUF model; float models get no governor.
"""
from __future__ import annotations

from pathlib import Path
import pytest
import torch

from tokenmill import native
from tokenmill.executor import thread_governor as tg


def run(gov: tg.ThreadGovernor, steps: int, cost: dict[int, float], tokens: int = 1) -> list[int]:
    """`steps` steps of `tokens` tokens; cost: seconds a step takes with n threads. Returns the counts used."""
    used = []
    for _ in range(steps):
        gov.begin(tokens)
        n = gov._step[1] if gov._step is not None else gov.max_threads
        used.append(n)
        gov.end(cost[n])
    return used


def test_quiet_machine_keeps_all_threads_and_probes_less_and_less():
    applied = []
    gov = tg.ThreadGovernor(2, applied.append)
    used = run(gov, 2000, {2: 0.010, 1: 0.018})
    assert gov.threads == 2 and gov.switches == 0
    assert gov.every == tg.MAX_PROBE_EVERY
    probes = used.count(1)
    assert 3 <= probes <= 2000 // tg.PROBE_EVERY // 2  # backing off: far fewer than one per PROBE_EVERY
    assert applied[0] == 2 and all(a != b for a, b in zip(applied, applied[1:]))  # only changes are applied
    assert applied[-1] == 2  # a probe gives the threads back as soon as it ends


def test_a_busy_neighbour_switches_to_one_thread_and_back_when_it_goes():
    applied = []
    gov = tg.ThreadGovernor(2, applied.append)
    run(gov, 40, {2: 0.030, 1: 0.018})
    assert gov.threads == 1 and gov.switches == 1 and applied[-1] == 1
    gov.close()  # an engine that stops now gives the process its threads back
    assert applied[-1] == 2
    gov._applied = 1  # (as it was: the engine ran on)
    run(gov, 600, {2: 0.010, 1: 0.018})  # the neighbour stopped: a probe with 2 threads wins
    assert gov.threads == 2 and gov.switches == 2 and applied[-1] == 2


def test_noise_within_the_margin_does_not_switch():
    gov = tg.ThreadGovernor(2, lambda n: None)
    run(gov, 500, {2: 0.010, 1: 0.0095})  # one thread 5 % faster: under the margin
    assert gov.threads == 2 and gov.switches == 0


def test_prompt_steps_and_single_thread_machines_are_left_alone():
    applied = []
    gov = tg.ThreadGovernor(2, applied.append)
    run(gov, 100, {2: 0.1, 1: 0.01}, tokens=tg.MAX_TOKENS + 1)
    assert set(applied) <= {2} and gov.threads == 2  # prompt steps: all threads, never a probe
    never = []
    one = tg.ThreadGovernor(1, never.append)
    run(one, 100, {1: 0.01})
    assert never == []


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
    assert tg.make_governor("cpu", 2, dense) is None  # no GGUF kernels: oneDNN's GEMVs are left alone
    monkeypatch.setenv("TOKENMILL_THREAD_GOVERNOR", "0")
    assert tg.make_governor("cpu", 2, dense) is None
