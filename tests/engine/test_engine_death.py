"""When the engine core dies, every pending and every later call fails at once (issue 44), and the queues around
the core have bounds that a test fills: the in-process core's outputs (as bounded as the core process's) and the
utility calls waiting for the core.

Before: the first /v1/diagnostics or /v1/kv_events after the core died on an idle server waited forever (the
output thread had stopped, and the message went to a dead pipe); the core in a thread queued its outputs
without bound. No model here: the core is a fake behind the real AsyncLLMEngine, ThreadCoreClient and
run_core_loop; tests/serve/test_server_core_process.py kills a real core process.
"""
from __future__ import annotations

import asyncio
import threading
from types import SimpleNamespace

import httpx
import pytest

from tokenmill.core.outputs import EngineCoreOutput, EngineCoreOutputs, SchedulerStats
from tokenmill.engine import async_engine
from tokenmill.engine.async_engine import AsyncLLMEngine, EngineError
from tokenmill.engine.core_client import CoreClient, CoreDeadError, ThreadCoreClient
from tokenmill.engine.core_proc import QueueInbox, output_size

pytestmark = pytest.mark.timeout(60)

DEADLINE_S = 10.0  # far longer than failing takes, far shorter than a hang (the router waits 600 s)


class DyingClient(CoreClient):
    """A core client whose core never answers and can be killed: like the process client, a message sent to a
    dead core is queued without complaint (the pipe's writer notices later, if ever)."""

    def __init__(self) -> None:
        self.incoming = QueueInbox()
        self.sent: list[tuple] = []
        self.alive = True

    def send(self, msg: tuple) -> None:
        self.sent.append(msg)

    def send_requests(self, reqs: list) -> None:
        self.sent += [("add", r) for r in reqs]

    def get(self, timeout: float | None = None) -> list[tuple]:
        try:
            return self.incoming.get(timeout)
        except EOFError:
            raise CoreDeadError("the engine core process died (exit code -9).") from None

    def kill(self) -> None:
        self.alive = False
        self.incoming.close()

    @property
    def is_alive(self) -> bool:
        return self.alive

    def shutdown(self, timeout: float = 10.0) -> None:
        self.closed = True
        self.incoming.close()


@pytest.fixture
def engine():
    e = AsyncLLMEngine(DyingClient())
    e.start()
    yield e
    e.shutdown()


async def _call(engine: AsyncLLMEngine, method: str = "diagnostics"):
    return await asyncio.wait_for(engine.call(method, None), DEADLINE_S)


def test_a_call_waiting_when_the_core_dies_fails_at_once(engine):
    async def main():
        pending = asyncio.ensure_future(engine.call("diagnostics", None))
        await asyncio.sleep(0)  # sent; the core will never answer
        assert engine.client.sent[-1][0] == "utility" and not pending.done()
        engine.client.kill()
        return await asyncio.wait_for(pending, DEADLINE_S)

    with pytest.raises(EngineError) as e:
        asyncio.run(main())
    assert e.value.status == 503 and e.value.code == "engine_dead"


def test_every_call_after_the_core_died_on_an_idle_engine_fails_at_once(engine):
    """The issue's hang: nothing was pending when the core died; the next diagnostics call waited forever."""
    engine.client.kill()
    engine._thread.join(DEADLINE_S)  # the output thread has seen the death and stopped
    assert not engine._thread.is_alive() and not engine.is_alive
    for method in ("diagnostics", "kv_events"):
        with pytest.raises(EngineError) as e:
            asyncio.run(_call(engine, method))
        assert e.value.status == 503 and e.value.code == "engine_dead"


def test_an_output_thread_that_fails_fails_the_calls_too(engine, monkeypatch):
    """A bug in the output thread (here: the client raising something unexpected) must not leave calls
    waiting for an answer nobody will deliver."""
    def broken(timeout=None):
        raise RuntimeError("boom")

    async def main():
        pending = asyncio.ensure_future(engine.call("diagnostics", None))
        await asyncio.sleep(0)
        monkeypatch.setattr(engine.client, "get", broken)
        engine.client.incoming.put(("stats", (SchedulerStats(), 0)))  # wake the thread up: its next get raises
        return await asyncio.wait_for(pending, DEADLINE_S)

    with pytest.raises(EngineError) as e:
        asyncio.run(main())
    assert e.value.code == "engine_dead" and "output thread failed" in e.value.message


def test_diagnostics_after_the_core_died_is_a_503_engine_dead_over_http(engine):
    from tokenmill.serve.app import build_app
    from tokenmill.serve.metrics import ServerMetrics
    from tokenmill.serve.state import ServerSettings, ServerState

    state = ServerState(engine, ServerSettings(served_model_names=["m"]), ServerMetrics("m"))
    app = build_app(state)
    engine.client.kill()
    engine._thread.join(DEADLINE_S)

    async def main():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://t") as c:
            diag = await asyncio.wait_for(c.get("/v1/diagnostics"), DEADLINE_S)
            events = await asyncio.wait_for(c.get("/v1/kv_events"), DEADLINE_S)
            health = await c.get("/health")
        return diag, events, health

    try:
        diag, events, health = asyncio.run(main())
    finally:
        state.shutdown()
    for r in (diag, events):
        assert r.status_code == 503, r.text
        assert r.json()["error"]["code"] == "engine_dead" and r.headers["Retry-After"] == "1"
    assert health.status_code == 503 and health.json()["error"]["code"] == "engine_dead"


# ---- the queues' bounds ------------------------------------------------------------------------------------
def test_calls_waiting_for_the_core_are_bounded(engine, monkeypatch):
    monkeypatch.setattr(async_engine, "MAX_PENDING_CALLS", 3)

    async def main():
        waiting = [asyncio.ensure_future(engine.call("diagnostics", None)) for _ in range(3)]
        await asyncio.sleep(0)
        with pytest.raises(EngineError) as e:
            await _call(engine)
        assert e.value.status == 503 and e.value.code == "overloaded"
        answer_all()  # the core answers: room again
        assert len(await asyncio.wait_for(asyncio.gather(*waiting), DEADLINE_S)) == 3
        again = asyncio.ensure_future(engine.call("diagnostics", None))
        await asyncio.sleep(0)
        answer_all("again")
        return await asyncio.wait_for(again, DEADLINE_S)

    def answer_all(result=None) -> None:
        for call_id in list(engine._utility):
            engine.client.incoming.put(("utility", (call_id, True, result or {"id": call_id})))

    assert asyncio.run(main()) == "again"


class StepCore:
    """Just enough of an EngineCore for ThreadCoreClient: always has work; each step outputs 100 token ids."""

    info = None

    def __init__(self) -> None:
        self.stats = SimpleNamespace(idle_s=0.0)
        self.scheduler = SimpleNamespace(requests={})
        self.steps = 0
        self.stepped = threading.Event()
        self.pings: list[int] = []
        self.pinged = threading.Condition()

    def has_unfinished_requests(self) -> bool:
        return True

    def step(self, on_scheduled=None) -> EngineCoreOutputs:
        self.steps += 1
        self.stepped.set()
        return EngineCoreOutputs([EngineCoreOutput("r", list(range(100)))])

    def scheduler_stats(self) -> SchedulerStats:
        return SchedulerStats()

    def ping(self, n: int) -> int:
        with self.pinged:
            self.pings.append(n)
            self.pinged.notify_all()
        return n

    def shutdown(self) -> None:
        pass


def _ping(client: ThreadCoreClient, core: StepCore, n: int) -> None:
    """A command through the loop; returns once the loop has run it (so every step it could take before, it took)."""
    client.send(("utility", (n, "ping", (n,))))
    with core.pinged:
        assert core.pinged.wait_for(lambda: n in core.pings, DEADLINE_S)


def test_the_in_process_core_holds_its_steps_while_its_outputs_wait_unread():
    """The core in a thread had no output back-pressure: a reader that fell behind let its outputs grow without
    bound. Now the loop stops stepping once OUTBOX_BYTES (here ~10 steps' worth) wait, keeps taking commands,
    and steps again once the reader catches up, as the core process does."""
    core = StepCore()
    one_step = output_size(("outputs", core.step()))
    core.steps = 0
    client = ThreadCoreClient(core, outbox_bytes=10 * one_step)
    client.start()
    try:
        with client.outbox._cond:  # notified on every put
            assert client.outbox._cond.wait_for(lambda: client.outbox.full, DEADLINE_S)
        held = core.steps
        _ping(client, core, 1)
        _ping(client, core, 2)  # the loop went round after the first: had it room, it stepped meanwhile
        assert core.steps == held == 10  # commands still go in; no step adds to the backlog
        msgs = client.get(0)  # the reader catches up
        assert sum(kind == "outputs" for kind, _ in msgs) == held
        core.stepped.clear()
        assert core.stepped.wait(DEADLINE_S) and core.steps > held
    finally:
        client.shutdown(DEADLINE_S)
    assert not client._thread.is_alive()
