"""One request's output failing to process never costs the others their tokens (issue 24, item 3).

Processing a step's outputs (detokenizing, logprobs, stop strings, deltas) once ran in one loop whose exception
the output thread logged and swallowed: the requests after the failing one lost that step's tokens, and those
that finished in it never got their final delta. Now each request is processed alone: the failing one ends with
a 500 (its KV blocks freed in the core), and every other request's output equals its output alone.
Faults are made here by wrapping OutputProcessor methods for requests whose id contains "poison".
"""
from __future__ import annotations

import asyncio

import pytest

from tiny import make_tiny_model
from tokenmill import LLM, SamplingParams
from tokenmill.engine.async_engine import AsyncLLMEngine, RequestDelta
from tokenmill.engine.output import OutputProcessor

pytestmark = [pytest.mark.usefixtures("one_torch_thread"), pytest.mark.timeout(120)]

DEADLINE_S = 30.0  # the whole concurrent run: far more than it takes, far less than a hang
PROMPTS = ["The quick brown fox", "Once upon a time", "SELECT * FROM users", "Paged attention stores keys"]
POISONED = 1  # the index of the prompt whose request is poisoned
# Greedy, so a request's output does not depend on its neighbours; logprobs and prompt logprobs so every
# stage of output processing runs; n = 2 so a failure must end both sequences.
PARAMS = SamplingParams(n=2, temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=2, prompt_logprobs=2)
STAGES = ["detokenize", "logprobs", "prompt_logprobs", "delta"]


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    path = make_tiny_model(tmp_path_factory.mktemp("isolation") / "llama", "llama")
    return LLM(str(path), max_model_len=256, num_gpu_blocks_override=64)


@pytest.fixture(scope="module")
def solo(llm) -> list[dict]:
    """Each prompt's output alone (offline, before any engine thread drives the core)."""
    return [summary(llm.generate([p], PARAMS, use_tqdm=False)[0]) for p in PROMPTS]


def summary(out) -> dict:
    """What must not change: each sequence's text, tokens, logprobs and finish reason, and the prompt logprobs."""
    return {"seqs": [(o.text, o.token_ids, rounded(o.logprobs), o.finish_reason) for o in out.outputs],
            "prompt_logprobs": rounded(out.prompt_logprobs)}


def rounded(positions: list | None) -> list | None:
    """Logprobs to 3 decimals: batched and solo steps round their sums differently in the last bits."""
    if positions is None:
        return None
    return [None if p is None else {t: (round(lp.logprob, 3), lp.rank, lp.decoded_token) for t, lp in p.items()}
            for p in positions]


def poison(monkeypatch, stage: str, at_token: int) -> None:
    """Make processing of the poisoned request raise at `stage` once a sequence of it has `at_token` tokens
    (prompt logprobs come with the first step, whatever at_token says)."""
    def hit(request_id: str, num_tokens: int) -> bool:
        return "poison" in request_id and num_tokens >= at_token

    def boom() -> None:
        raise RuntimeError(f"poisoned at {stage}")

    if stage == "detokenize":
        real_append = OutputProcessor._append

        def _append(self, state, seq, o):
            if hit(state.request_id, len(seq.token_ids) + len(o.new_token_ids)):
                boom()
            return real_append(self, state, seq, o)

        monkeypatch.setattr(OutputProcessor, "_append", _append)
    elif stage == "logprobs":
        real_record = OutputProcessor._record_logprobs

        def _record_logprobs(self, seq, tok, lp, k):
            if hit(seq.child_id, len(seq.token_ids)):
                boom()
            return real_record(self, seq, tok, lp, k)

        monkeypatch.setattr(OutputProcessor, "_record_logprobs", _record_logprobs)
    elif stage == "prompt_logprobs":
        real_rows = OutputProcessor.prompt_rows
        real_record = OutputProcessor._record_prompt_logprobs

        def prompt_rows(self, state, pairs):
            if hit(state.request_id, at_token):
                boom()
            return real_rows(self, state, pairs)

        def _record_prompt_logprobs(self, state, p, entries=None):  # the offline engine builds rows here
            if hit(state.request_id, at_token):
                boom()
            return real_record(self, state, p, entries)

        monkeypatch.setattr(OutputProcessor, "prompt_rows", prompt_rows)
        monkeypatch.setattr(OutputProcessor, "_record_prompt_logprobs", _record_prompt_logprobs)
    elif stage == "delta":
        real_delta = OutputProcessor.make_delta

        def make_delta(self, state, tag, itl, error=None, force_final=False):
            if state.error is None and hit(state.request_id, max(len(s.token_ids) for s in state.seqs)):
                boom()
            return real_delta(self, state, tag, itl, error, force_final)

        monkeypatch.setattr(OutputProcessor, "make_delta", make_delta)
    else:
        raise ValueError(stage)


def request_id(i: int) -> str:
    return f"poison-{i}" if i == POISONED else f"ok-{i}"


async def collect(engine: AsyncLLMEngine, rid: str, prompt: list[int]) -> tuple[dict, RequestDelta]:
    """The request's output as `summary` has it, from its deltas, and its last delta."""
    texts, tokens, lps, reasons, prompt_lps, last = {}, {}, {}, {}, None, None
    async for d in engine.generate(rid, prompt, PARAMS):
        for s in d.sequences:
            texts[s.index] = texts.get(s.index, "") + s.text
            tokens.setdefault(s.index, []).extend(s.token_ids)
            lps.setdefault(s.index, []).extend(s.logprobs or [])
            reasons[s.index] = s.finish_reason
        prompt_lps = d.prompt_logprobs if d.prompt_logprobs is not None else prompt_lps
        last = d
    seqs = [(texts.get(i, ""), tokens.get(i, []), rounded(lps.get(i, [])), reasons.get(i)) for i in range(PARAMS.n)]
    return {"seqs": seqs, "prompt_logprobs": rounded(prompt_lps)}, last


async def run_all(engine: AsyncLLMEngine, prompts: list[list[int]]):
    runs = (collect(engine, request_id(i), p) for i, p in enumerate(prompts))
    results = await asyncio.wait_for(asyncio.gather(*runs), DEADLINE_S)
    stats = await asyncio.wait_for(engine.call("scheduler_stats"), DEADLINE_S)  # after every abort (FIFO)
    return results, stats


def check(results, stats, solo: list[dict]) -> None:
    for i, ((got, last), alone) in enumerate(zip(results, solo)):
        assert last.finished
        if i == POISONED:
            assert last.error is not None and last.error.status == 500 and last.error.code == "engine_error"
            assert "poisoned" in last.error.message
            assert {s.index for s in last.sequences} <= {0, 1}
        else:
            assert last.error is None, last.error
            assert got == alone, f"request {i} differs from its solo run"
    assert stats.kv_usage == 0 and stats.num_running == 0 and stats.num_waiting == 0


@pytest.mark.parametrize("at_token", [2, PARAMS.max_tokens])  # mid-stream, and in the step all finish in
@pytest.mark.parametrize("stage", STAGES)
def test_a_poisoned_request_fails_alone_in_the_async_engine(llm, solo, monkeypatch, stage, at_token):
    prompts = [llm.engine.tokenize(p) for p in PROMPTS]
    poison(monkeypatch, stage, at_token)
    engine = AsyncLLMEngine(llm.engine)
    engine.start()
    try:
        results, stats = asyncio.run(run_all(engine, prompts))
        assert engine.is_alive and engine.num_in_flight == 0
        assert engine.num_engine_errors == 1
    finally:
        engine.shutdown()
    check(results, stats, solo)
    assert llm.engine.kv.num_free_blocks == llm.engine.kv.num_blocks


@pytest.mark.parametrize("stage", ["detokenize", "prompt_logprobs"])
def test_a_poisoned_request_fails_alone_offline(llm, solo, monkeypatch, stage):
    poison(monkeypatch, stage, 2)
    engine = llm.engine
    for i, p in enumerate(PROMPTS):
        engine.add_request(request_id(i), p, PARAMS)
    finals = {}
    for _ in range(10 * PARAMS.max_tokens):  # a bound on steps instead of a hang
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
        if len(finals) == len(PROMPTS):
            break
    assert len(finals) == len(PROMPTS), sorted(finals)
    for i, alone in enumerate(solo):
        out = finals[request_id(i)]
        if i == POISONED:
            err = out.extra["error"]
            assert err["code"] == "engine_error" and "poisoned" in err["message"] and set(err) == {
                "message", "type", "param", "code"}
            assert all(o.finish_reason == "abort" for o in out.outputs)
        else:
            assert summary(out) == alone and "error" not in out.extra
    assert not engine.has_unfinished_requests() and not engine.groups
    assert engine.kv.usage == 0


def test_the_fault_hook_reaches_the_output_stage(llm, solo, monkeypatch):
    """TOKENMILL_FAULTS=output=<request id> fails that request's output processing (tokenmill/testing/faults.py,
    when it is there)."""
    faults = pytest.importorskip("tokenmill.testing.faults")
    monkeypatch.setenv(faults.ENV, f"output={request_id(POISONED)}")
    prompts = [llm.engine.tokenize(p) for p in PROMPTS]
    engine = AsyncLLMEngine(llm.engine)
    engine.start()
    try:
        results, stats = asyncio.run(run_all(engine, prompts))
    finally:
        engine.shutdown()
    poisoned = results[POISONED][1]
    assert poisoned.error is not None and "injected fault at output" in poisoned.error.message
    for i, ((got, last), alone) in enumerate(zip(results, solo)):
        if i != POISONED:
            assert last.error is None and got == alone
    assert stats.kv_usage == 0 and stats.num_running == 0
