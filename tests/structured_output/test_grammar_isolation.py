"""Grammar checks stay isolated and cheap (issue 44).

- A grammar-check worker that cannot start is retried with backoff (reported by `checker_status`, /health and
  /metrics); grammar requests get 503 + Retry-After meanwhile, never a check in the server's process. Before, one
  failed start set `_no_worker` for good and llguidance ran in the server from then on.
- A hanging check is killed at its timeout: two of them cannot hold the checkers for good.
- No free checker is a 503, not a cached "did not compile" 400 (before: a valid grammar refused until evicted).
- A grammar is converted and checked once per distinct text, off the event loop: the per-prompt call is a
  lookup (before: the GBNF text was rebuilt for every prompt, 0.13 s each for 164 KB, on the event loop).
- The verdict cache is shared by threads and the event loop under one lock.

Worker faults are injected with a stand-in worker program (the same line protocol as checker_worker.py).
"""
from __future__ import annotations

import asyncio
import sys
import threading

import pytest

from tokenmill import StructuredOutputsParams
from tokenmill.serve.errors import APIError
from tokenmill.structured_output import checker, grammar, isolation
from tokenmill.structured_output.checker import CheckerPool, CheckerUnavailable

SO = StructuredOutputsParams
pytestmark = pytest.mark.timeout(120)
DEADLINE_S = 30.0  # generous for a loaded host; a failure is a hang, not slowness

# Answers like the real worker; a grammar containing HANG never gets an answer (the worker sleeps).
FAKE_WORKER = r"""
import json, sys, time
sys.stdout.write('{"ready": true}\n'); sys.stdout.flush()
for line in sys.stdin:
    if "HANG" in json.loads(line)["grammar"]:
        time.sleep(3600)
    sys.stdout.write('{"error": ""}\n'); sys.stdout.flush()
"""
FAKE = [sys.executable, "-c", FAKE_WORKER]
MISSING = ["/nonexistent/python-for-the-grammar-checker"]


@pytest.fixture
def pool(monkeypatch):
    """The module's pool replaced by one that retries fast; no check may ever run in this process."""
    p = CheckerPool(command=list(FAKE), backoff=(0.05, 0.2))
    monkeypatch.setattr(isolation, "_pool", p)
    monkeypatch.setattr(isolation, "_check_here", lambda *a: pytest.fail("a grammar was checked in process"))
    yield p
    p.close()


@pytest.fixture
def fresh_verdicts(monkeypatch):
    monkeypatch.setattr(grammar, "_verdicts", grammar._Verdicts(grammar.VERDICT_CACHE_SIZE))
    monkeypatch.setattr(grammar, "_memo", grammar._ObjectMemo())


def wait_failures(p: CheckerPool, n: int) -> None:
    with p._cond:
        assert p._cond.wait_for(lambda: p.start_failures >= n, DEADLINE_S)


# ---- a worker that cannot start ---------------------------------------------------------------------------
def test_a_worker_that_cannot_start_is_retried_with_backoff_and_never_checks_in_process(pool):
    pool.command = MISSING  # no interpreter: every start fails (as with no file descriptors, or a start timeout)
    with pytest.raises(CheckerUnavailable) as e:
        checker.check_isolated('start: "x"', 10)
    assert e.value.retry_after_s >= 1
    status = checker.checker_status()
    assert status.state == "restarting" and status.start_failures >= 1 and status.last_error
    with pytest.raises(CheckerUnavailable):  # meanwhile refused at once, no start attempt of its own
        checker.check_isolated('start: "y"', 10)
    wait_failures(pool, 3)  # the restarter keeps trying, by itself
    assert checker.checker_status().state == "restarting"
    pool.command = list(FAKE)  # the host recovers
    assert pool.wait_ready(DEADLINE_S)
    assert checker.checker_status().state == "ok"
    assert checker.check_isolated('start: "x"', 10) == ""


def test_while_restarting_a_grammar_request_is_a_503_with_retry_after_and_no_cached_verdict(pool, fresh_verdicts):
    from tokenmill.serve.structured import check_constraint

    pool.command = MISSING
    so = SO(grammar='start: "a" | "b"')
    with pytest.raises(APIError) as e:
        asyncio.run(check_constraint(None, so, "structured_outputs"))
    assert e.value.status == 503 and e.value.code == "grammar_checker_unavailable"
    assert int(e.value.headers["Retry-After"]) >= 1
    pool.command = list(FAKE)
    assert pool.wait_ready(DEADLINE_S)
    asyncio.run(check_constraint(None, so, "structured_outputs"))  # the same grammar, checked now: fine
    grammar.validate(so)


def test_health_and_metrics_report_the_restarting_worker(pool):
    from tokenmill.serve.metrics import ServerMetrics

    metrics = ServerMetrics("m")

    def sample(name: str) -> float:
        line = next(x for x in metrics.render().decode().splitlines() if x.startswith(f"tokenmill:{name}{{"))
        return float(line.rsplit(" ", 1)[1])

    assert sample("grammar_worker_up") == 1.0
    pool.command = MISSING
    with pytest.raises(CheckerUnavailable):
        checker.check_isolated('start: "x"', 10)
    assert sample("grammar_worker_up") == 0.0 and sample("grammar_worker_start_failures_total") >= 1
    assert _health_body() == {"status": "ok", "grammar_worker": "restarting"}  # still 200: only grammars wait
    pool.command = list(FAKE)
    assert pool.wait_ready(DEADLINE_S)
    assert sample("grammar_worker_up") == 1.0
    assert _health_body() == {"status": "ok", "grammar_worker": "ok"}


def _health_body() -> dict:
    import httpx

    from tokenmill.serve.app import build_app
    from tokenmill.serve.metrics import ServerMetrics
    from tokenmill.serve.state import ServerSettings, ServerState

    class Engine:  # alive, not draining: all /health reads
        is_alive, draining = True, False

    state = ServerState(Engine(), ServerSettings(served_model_names=["m"]), ServerMetrics("m"))

    async def get():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(build_app(state)), base_url="http://t") as c:
            return await c.get("/health")

    try:
        r = asyncio.run(get())
    finally:
        state.shutdown()
    assert r.status_code == 200, r.text
    return r.json()


# ---- hanging checks ----------------------------------------------------------------------------------------
def test_hanging_checks_are_killed_at_their_timeout_and_do_not_hold_the_checkers(pool):
    results: list[str] = []
    threads = [threading.Thread(target=lambda: results.append(checker.check_isolated('start: "HANG"', 0.5)))
               for _ in range(checker.CHECK_WORKERS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(DEADLINE_S)
    assert not any(t.is_alive() for t in threads)
    assert results == ["it did not compile within 0.5 s."] * checker.CHECK_WORKERS
    assert not pool._idle  # both hanging workers were killed, not kept
    assert checker.check_isolated('start: "x"', 10) == ""  # a fresh worker answers


def test_no_free_checker_is_a_503_and_never_a_cached_verdict(pool, fresh_verdicts, monkeypatch):
    """Before: a check that waited its whole timeout for a busy checker returned "did not compile", which was
    cached: a valid grammar stayed refused with a 400."""
    so = SO(regex="[a-z]{4}")
    for _ in range(checker.CHECK_WORKERS):
        assert pool._slots.acquire(timeout=1)  # every checker busy
    try:
        with pytest.raises(CheckerUnavailable):
            pool.check("x", 0.05)
        with monkeypatch.context() as m:
            m.setattr(grammar, "VALIDATE_TIMEOUT_S", 0.05)
            with pytest.raises(CheckerUnavailable):
                grammar.validate(so)
    finally:
        for _ in range(checker.CHECK_WORKERS):
            pool._slots.release()
    grammar.validate(so)  # checked now that a checker is free: valid


def test_the_check_lane_is_bounded():
    from tokenmill.serve.structured import CheckLane

    lane, release = CheckLane(threads=1, max_queued=2), threading.Event()

    async def main():
        held = [asyncio.ensure_future(lane.run(release.wait, DEADLINE_S)) for _ in range(2)]
        await asyncio.sleep(0)
        with pytest.raises(CheckerUnavailable):
            await lane.run(release.wait, DEADLINE_S)
        release.set()
        assert await asyncio.wait_for(asyncio.gather(*held), DEADLINE_S) == [True, True]
        return await asyncio.wait_for(lane.run(lambda: "room again"), DEADLINE_S)

    assert asyncio.run(main()) == "room again"
    assert lane.queued == 0


# ---- once per distinct grammar, off the event loop -----------------------------------------------------------
def big_gbnf(rules: int = 1500) -> str:
    """A flat GBNF grammar of ~100 KB: its conversion to Lark is Python, and costs ~0.1 s."""
    lines = ["root ::= " + " | ".join(f"r{i}" for i in range(rules))]
    lines += [f'r{i} ::= "word{i}-' + "x" * 40 + '" [a-z]?' for i in range(rules)]
    return "\n".join(lines)


def test_a_grammar_is_converted_and_hashed_once_for_all_the_prompts_and_never_on_the_event_loop(
        pool, fresh_verdicts, monkeypatch):
    """A completions request with 1,024 prompts: the server checks its constraint once (off the event loop),
    then the processor's per-prompt call is a lookup."""
    from tokenmill.serve.structured import check_constraint

    conversions: list[str] = []
    hashes: list[int] = []
    to_grammar, sha256 = grammar.to_grammar, grammar.hashlib.sha256

    def counted_to_grammar(so):
        conversions.append(threading.current_thread().name)
        return to_grammar(so)

    def counted_sha256(data=b""):
        hashes.append(len(data))
        return sha256(data)

    monkeypatch.setattr(grammar, "to_grammar", counted_to_grammar)
    monkeypatch.setattr(grammar.hashlib, "sha256", counted_sha256)
    so = SO(grammar=big_gbnf())
    loop_thread: list[str] = []

    async def request():
        loop_thread.append(threading.current_thread().name)
        await check_constraint(None, so, "structured_outputs")
        for _ in range(1024):  # AsyncLLMEngine.add_request -> Processor.process, on the event loop
            grammar.validate(so)

    asyncio.run(request())
    assert len(conversions) == 1 and conversions[0] != loop_thread[0]
    assert len(hashes) == 1
    # A second request with the same text (a new params object): hashed once more, never converted again.
    asyncio.run(check_constraint(None, SO(grammar=big_gbnf()), "structured_outputs"))
    assert len(conversions) == 1 and len(hashes) == 2


def test_concurrent_requests_with_one_new_grammar_convert_it_once(pool, fresh_verdicts, monkeypatch):
    conversions: list[int] = []
    to_grammar = grammar.to_grammar

    def counted(so):
        conversions.append(1)
        return to_grammar(so)

    monkeypatch.setattr(grammar, "to_grammar", counted)
    text, errors = big_gbnf(300), []

    def one():
        try:
            grammar.validate(SO(grammar=text))
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=one) for _ in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(DEADLINE_S)
    assert not errors and not any(t.is_alive() for t in threads)
    assert len(conversions) == 1


def test_an_invalid_grammar_is_refused_from_the_cache_without_converting_again(pool, fresh_verdicts, monkeypatch):
    conversions: list[int] = []
    to_grammar = grammar.to_grammar
    monkeypatch.setattr(grammar, "to_grammar", lambda so: conversions.append(1) or to_grammar(so))
    deep = "\n".join(["start: r0"] + [f'r{i}: "x" r{i + 1} | "y"' for i in range(400)] + ['r400: "z"'])
    for _ in range(3):
        with pytest.raises(ValueError, match="the limit is 300"):
            grammar.validate(SO(grammar=deep))
    assert len(conversions) == 1


def test_the_verdict_cache_is_shared_by_threads_under_a_lock():
    """Before: one thread's eviction (`pop(next(iter(...)))`) while another inserted raised `dictionary changed
    size during iteration`, a 500. Eight threads, a small cache, evictions all the time."""
    cache, errors = grammar._Verdicts(8), []

    def work(t: int) -> None:
        try:
            for i in range(2000):
                key = f"{t}-{i % 50}"
                assert cache.get_or_compute(key, lambda: "" if i % 2 else "bad", DEADLINE_S) in ("", "bad")
                cache.get(f"{(t + 1) % 8}-{i % 50}")
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(DEADLINE_S)
    assert not errors and not any(t.is_alive() for t in threads)
    assert len(cache._done) <= 8 and not cache._running
