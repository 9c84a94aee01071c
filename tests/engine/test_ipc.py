"""The pipe between the API process and the engine-core process never blocks either side (issue 24, item 1).

Large messages both ways (prompts of thousands of ids with n copies, prompt logprobs) beside streams that stop
strings end (each an abort the output thread sends) once froze the event loop for good: it blocked sending an
add to a core that was blocked sending outputs to an output thread that waited for the event loop's send lock.
Now sends go through queues and threads on both sides. Here an AsyncLLMEngine drives a core process from this
test's event loop, and a watchdog thread checks the loop answers within a deadline all along.
"""
from __future__ import annotations

import asyncio
import os
import random
import statistics
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path

import pytest

from tiny import make_tiny_model
from tokenmill import LLM, SamplingParams
from tokenmill.core.outputs import EngineCoreOutputs
from tokenmill.engine.async_engine import AsyncLLMEngine
from tokenmill.engine.core_proc import JOIN_TIMEOUT_S, QueueInbox, dump_frame, run_core_loop

pytestmark = pytest.mark.timeout(300)

MAX_LEN = 8192
LOOP_DEADLINE_S = 5.0  # one probe of the event loop: far more than an answer takes, far less than a hang
HANG_S = 25.0  # after a miss, how much longer the loop gets before it counts as hung
LOAD_S = 20.0  # how long the deadlock test keeps its load up
LOAD_DEADLINE_S = 60.0  # ... and the longest the load may take to finish
START_DEADLINE_S = 180.0  # a program that starts a core (imports torch twice on a loaded machine) and exits
COPIES_EVERY_S = 0.4  # the deadlock test's arrivals of 16 x 7,000 ids
MEGABYTE_REQUESTS = 45
STOPS = ["e", "a", "o", "i", "t", "n", " "]  # common enough to end a stream within a few tokens


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("ipc") / "llama", "llama", max_position_embeddings=MAX_LEN)


@pytest.fixture(scope="module")
def engine(model_path):
    """An AsyncLLMEngine with its core in a process of its own; at the end, shut down cleanly: the core
    exits by itself and every thread that moved messages is joined."""
    from tokenmill.engine_args import EngineArgs

    config = EngineArgs.from_kwargs(model=str(model_path), max_model_len=MAX_LEN, kv_cache_memory_bytes=128 << 20,
                                    max_num_batched_tokens=4096).create_engine_config()
    e = AsyncLLMEngine.from_config(config, own_process=True)
    e.start()
    yield e
    t0 = time.monotonic()
    e.shutdown()
    assert time.monotonic() - t0 < 10
    assert e.client.proc.exitcode == 0
    assert not [t.name for t in threading.enumerate() if t.name.startswith(("tokenmill-core", "tokenmill-outputs"))]


def prompt_ids(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(300, 380) for _ in range(length)]  # three bytes each when pickled


VICTIM_PROMPT = prompt_ids(3, 16)
VICTIM = SamplingParams(max_tokens=128, temperature=0.0, ignore_eos=True)


async def run(engine: AsyncLLMEngine, rid: str, prompt: list[int], params: SamplingParams) -> list:
    """The request's deltas, the last one finished; raises the delta's EngineError."""
    deltas = []
    async for d in engine.generate(rid, prompt, params):
        if d.error is not None:
            raise d.error
        deltas.append(d)
    return deltas


# ---- the parts, without a model ------------------------------------------------------------------------
def test_queues_are_bounded_by_bytes_never_block_and_close():
    q = QueueInbox(limit=100)
    assert q.put_all(["a", "a2"], 150)  # under the limit, any one batch goes in, even a large one
    assert not q.put_all(["b"], 10) and q.nbytes == 150  # full: refused at once, all or nothing
    q.put(("abort", None), 10)  # always taken
    assert q.get(0, max_bytes=1) == ["a", "a2"]  # a batch's copies come with its first message
    assert q.nbytes == 10 and q.wait_room(0) and q.put_all(["c"], 10)
    assert q.get(0) == [("abort", None), "c"] and q.get(0) == []
    q.close()
    q.put("late")
    assert q.get(None) == ["late"]  # what is left, then EOF
    with pytest.raises(EOFError):
        q.get(None)


class FakeCore:
    """Just enough of an EngineCore for run_core_loop: always has work, counts its steps."""

    def __init__(self) -> None:
        self.stats = type("Stats", (), {"idle_s": 0.0})()
        self.stepped, self.aborted = threading.Event(), threading.Event()

    def has_unfinished_requests(self) -> bool:
        return True

    def abort_requests(self, ids, status=None, stop_reason=None) -> None:
        self.aborted.set()

    def step(self, on_scheduled=None) -> EngineCoreOutputs:
        self.stepped.set()
        return EngineCoreOutputs()


def test_the_core_loop_takes_commands_but_holds_its_steps_while_its_reader_is_behind():
    core, inbox, sent = FakeCore(), QueueInbox(), []
    behind = threading.Event()
    behind.set()
    loop = threading.Thread(target=run_core_loop, args=(core, inbox, sent.append, lambda: not behind.is_set()),
                            daemon=True)
    loop.start()
    inbox.put(("abort", (["x"], "abort", None)))
    assert core.aborted.wait(LOOP_DEADLINE_S)  # commands still go in...
    assert not core.stepped.is_set()  # ...but no step adds to the backlog
    behind.clear()
    assert core.stepped.wait(LOOP_DEADLINE_S)
    inbox.put(("shutdown", None))
    loop.join(LOOP_DEADLINE_S)
    assert not loop.is_alive()


# ---- back-pressure: a full queue refuses, never waits ---------------------------------------------------
def test_a_full_send_queue_refuses_new_requests_with_a_503(model_path):
    """Back-pressure, not a wait: while what is queued for the core fills its queue, a new request is refused at
    once with a 503 the server sends with Retry-After; what was queued runs once the core takes it."""
    from tokenmill.serve.generation import error_from_delta

    llm = LLM(str(model_path), max_model_len=MAX_LEN, num_gpu_blocks_override=1024)
    engine = AsyncLLMEngine(llm.engine)  # not started: nothing takes what is queued for the core yet
    engine.client.inbox.limit = 16_000  # bytes: one request of 8,000 ids fills it
    big, params = prompt_ids(11, 8000), SamplingParams(max_tokens=2, ignore_eos=True)

    async def main():
        first, second = asyncio.Queue(), asyncio.Queue()
        engine.add_request("first", big, params, first)
        engine.add_request("second", big, params, second)
        refused = await asyncio.wait_for(second.get(), LOOP_DEADLINE_S)
        engine.start()
        deltas = [await asyncio.wait_for(first.get(), LOAD_DEADLINE_S)]
        while not deltas[-1].finished:
            deltas.append(await asyncio.wait_for(first.get(), LOAD_DEADLINE_S))
        again = await asyncio.wait_for(run(engine, "again", big, params), LOAD_DEADLINE_S)  # room again
        return refused, deltas, again

    try:
        refused, deltas, again = asyncio.run(main())
        assert engine.num_in_flight == 0
    finally:
        engine.shutdown()
    assert refused.finished and refused.error.status == 503 and refused.error.code == "overloaded"
    assert error_from_delta(refused).headers["Retry-After"] == "1"
    assert deltas[-1].error is None and sum(len(s.token_ids) for d in deltas for s in d.sequences) == 2
    assert again[-1].finished
    assert llm.engine.kv.num_free_blocks == llm.engine.kv.num_blocks


def test_the_process_client_refuses_only_adds_when_its_queue_is_full(engine):
    """Aborts and utility calls always get through (they free resources and are small); adds wait for room."""
    queue = engine.client._to_core
    limit, queue.limit = queue.limit, 0  # as if the pipe were full

    async def main():
        refused: asyncio.Queue = asyncio.Queue()
        engine.add_request("refused", prompt_ids(12, 100), SamplingParams(max_tokens=1), refused)
        delta = await asyncio.wait_for(refused.get(), LOOP_DEADLINE_S)
        stats = await asyncio.wait_for(engine.call("scheduler_stats"), LOAD_DEADLINE_S)
        queue.limit = limit
        ok = await asyncio.wait_for(run(engine, "ok", prompt_ids(12, 100), SamplingParams(max_tokens=1)),
                                    LOAD_DEADLINE_S)
        return delta, stats, ok

    try:
        delta, stats, ok = asyncio.run(main())
    finally:
        queue.limit = limit
    assert delta.error.status == 503 and delta.error.code == "overloaded"
    assert stats.num_running == 0 and ok[-1].finished
    assert engine.is_alive and engine.num_in_flight == 0


# ---- shutdown -------------------------------------------------------------------------------------------
LEAVE = """
import asyncio, sys, time
from tokenmill import SamplingParams
from tokenmill.engine.async_engine import AsyncLLMEngine
from tokenmill.engine_args import EngineArgs

async def one(engine):
    async for _ in engine.generate("a", [300, 301, 302], SamplingParams(max_tokens=4)):
        pass

if __name__ == "__main__":
    config = EngineArgs.from_kwargs(model=sys.argv[1], max_model_len=512,
                                    kv_cache_memory_bytes=16 << 20).create_engine_config()
    engine = AsyncLLMEngine.from_config(config, own_process=True)
    engine.start()
    asyncio.run(one(engine))
    print(time.monotonic(), flush=True)  # and leave without engine.shutdown()
"""


def test_a_program_that_exits_without_shutting_down_does_not_hang(model_path, tmp_path):
    """multiprocessing's exit handler joins the core process, which waited for this end of its pipe to close:
    the program hung at exit. The client now shuts the core down first."""
    script = tmp_path / "leave.py"
    script.write_text(LEAVE)
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]), OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, str(script), str(model_path)], capture_output=True, text=True,
                          timeout=START_DEADLINE_S, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    exit_s = time.monotonic() - float(done.stdout.split()[-1])  # CLOCK_MONOTONIC is system-wide
    assert exit_s < 2 * JOIN_TIMEOUT_S, f"it took {exit_s:.1f} s to exit"
    assert "engine core is gone" not in done.stderr  # a shutdown, not a death


# ---- 1 MB of requests beside a victim -----------------------------------------------------------------
async def victim(engine: AsyncLLMEngine, rid: str) -> tuple[list[int], float]:
    """The victim's tokens and its latency, from add to final delta."""
    t0 = time.perf_counter()
    deltas = await run(engine, rid, VICTIM_PROMPT, VICTIM)
    return [t for d in deltas for s in d.sequences for t in s.token_ids], time.perf_counter() - t0


async def megabyte(engine: AsyncLLMEngine, rid: str) -> None:
    """MEGABYTE_REQUESTS requests of 8,000 prompt ids each, over 1 MB on the pipe together. One prompt, in the
    prefix cache after the first round."""
    prompt = prompt_ids(7, 8000)
    params = SamplingParams(max_tokens=1, ignore_eos=True)
    await asyncio.gather(*(run(engine, f"{rid}-{j}", prompt, params) for j in range(MEGABYTE_REQUESTS)))


async def same_work(engine: AsyncLLMEngine, rid: str) -> None:
    """The control: the same sequences as `megabyte` (so the same scheduling, attention and sampling), as n
    copies of 3 requests, whose prompt ids cross the pipe once per request: ~70 KB."""
    prompt = prompt_ids(7, 8000)
    params = SamplingParams(n=MEGABYTE_REQUESTS // 3, max_tokens=1, ignore_eos=True)
    await asyncio.gather(*(run(engine, f"{rid}-{j}", prompt, params) for j in range(3)))


async def victim_rounds(engine: AsyncLLMEngine, rounds: int) -> tuple[set, dict[str, float]]:
    """The victim alone, beside the control and beside 1 MB of requests, interleaved `rounds` times (all see
    the same machine load): (its distinct outputs, {kind: median seconds})."""
    await victim(engine, "victim-warm")
    await megabyte(engine, "mb-warm")
    outputs, seconds = set(), {"alone": [], "control": [], "megabyte": []}
    for r in range(rounds):
        for kind, others in (("alone", None), ("control", same_work), ("megabyte", megabyte)):
            attack = asyncio.ensure_future(others(engine, f"{kind}-{r}")) if others else None
            tokens, s = await victim(engine, f"victim-{kind}-{r}")
            outputs.add(tuple(tokens))
            seconds[kind].append(s)
            if attack is not None:
                await asyncio.wait_for(attack, LOAD_DEADLINE_S)
    return outputs, {k: statistics.median(v) for k, v in seconds.items()}


def test_a_victim_keeps_its_latency_while_megabyte_requests_arrive(engine):
    """The victim's baseline is its latency beside the same work in few bytes: running 45 sequences over 8,000
    cached ids (prefix hashes, attention over each context) slows it down by itself, whatever the pipe does;
    what is measured here is the cost of moving the megabyte, and it stays within 2x."""
    assert MEGABYTE_REQUESTS * len(dump_frame([prompt_ids(7, 8000)])) > 1 << 20
    outputs, t = asyncio.run(victim_rounds(engine, 5))
    assert len(outputs) == 1 and len(next(iter(outputs))) == VICTIM.max_tokens  # the same output every time
    assert t["megabyte"] <= 2 * t["control"], (
        f"the victim took {t['megabyte']:.3f} s beside 1 MB of requests, {t['control']:.3f} s beside the same "
        f"work in few bytes ({t['alone']:.3f} s alone)")
    assert engine.num_in_flight == 0


# ---- the deadlock of issue 24 --------------------------------------------------------------------------
def thread_stacks() -> str:
    """The innermost frames of this process's other threads: where each one waits."""
    names = {t.ident: t.name for t in threading.enumerate()}
    out = []
    for ident, frame in sys._current_frames().items():
        if ident != threading.get_ident():
            stack = "".join(traceback.format_stack(frame)[-4:])
            out.append(f"--- {names.get(ident, ident)}\n{stack}")
    return "\n".join(out)


class LoopWatchdog:
    """Probes an event loop from a thread, 20 times a second: each probe must run on the loop within
    LOOP_DEADLINE_S. On a miss it notes where the threads of this process wait, gives the loop HANG_S more,
    then kills the core process, which unblocks whatever waits on the pipe: the test fails with a message
    instead of hanging."""

    def __init__(self, loop: asyncio.AbstractEventLoop, engine: AsyncLLMEngine) -> None:
        self.loop, self.engine = loop, engine
        self.seconds: list[float] = []
        self.miss: str | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="loop-watchdog", daemon=True)

    async def _noop(self) -> None:
        pass

    def _run(self) -> None:
        while not self._stop.wait(0.05):
            t0 = time.perf_counter()
            fut = asyncio.run_coroutine_threadsafe(self._noop(), self.loop)
            try:
                fut.result(LOOP_DEADLINE_S)
            except TimeoutError:
                stacks = thread_stacks()
                try:
                    fut.result(HANG_S)
                    self.miss = f"stalled for {time.perf_counter() - t0:.1f} s"
                except TimeoutError:
                    self.miss = f"hung for {HANG_S + LOOP_DEADLINE_S:.0f} s (until the core was killed)"
                    self.engine.client.proc.kill()
                self.miss += f"; the threads waited in:\n{stacks}"
                return
            self.seconds.append(time.perf_counter() - t0)

    def __enter__(self) -> LoopWatchdog:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(LOOP_DEADLINE_S + 1)


async def many_copies(engine: AsyncLLMEngine, i: int) -> None:
    """16 copies of 7,000 ids: ~336 KB of add messages, more than a socket buffer holds. Three distinct
    prompts, so after their first time the prefix cache makes them cheap to run."""
    params = SamplingParams(n=16, max_tokens=1, temperature=1.0, ignore_eos=True)
    deltas = await run(engine, f"copies-{i}-{random.random()}", prompt_ids(i % 3, 7000), params)
    assert sum(len(s.token_ids) for d in deltas for s in d.sequences) == 16


async def prompt_logprobs(engine: AsyncLLMEngine, i: int) -> None:
    """700 prompt positions x 20 logprobs: a step of 4,096 such positions is ~1 MB from the core, and slower to
    process than to compute for prompts this short: the output thread is the slow reader."""
    params = SamplingParams(max_tokens=1, prompt_logprobs=20, ignore_eos=True)
    deltas = await run(engine, f"echo-{i}-{random.random()}", prompt_ids(100 + i, 700), params)
    lps = next(d.prompt_logprobs for d in deltas if d.prompt_logprobs is not None)
    assert len(lps) == 700 and lps[0] is None and len(lps[1]) >= 20


async def stopped_stream(engine: AsyncLLMEngine, i: int) -> None:
    """A stream that a stop string ends after a few tokens: an abort sent from the output thread."""
    params = SamplingParams(max_tokens=64, temperature=1.0, seed=i, stop=STOPS, ignore_eos=True)
    deltas = await run(engine, f"stop-{i}-{random.random()}", engine.tokenizer("Once upon a time").input_ids, params)
    assert deltas[-1].finished


async def repeat(make, engine: AsyncLLMEngine, until: float) -> int:
    """Closed loop: `make(engine, i)` again and again until the monotonic time `until`; how many completed."""
    i = 0
    while time.monotonic() < until:
        await make(engine, i)
        i += 1
    return i


async def arrivals(make, engine: AsyncLLMEngine, every: float, seconds: float) -> int:
    """Open loop: a new `make(engine, i)` every `every` seconds for `seconds`, each started on time whatever the
    others do, as from independent clients; how many completed."""
    loop = asyncio.get_running_loop()
    count = int(seconds / every)
    tasks: list[asyncio.Future] = []
    all_started = asyncio.Event()

    def launch(i: int) -> None:
        tasks.append(asyncio.ensure_future(make(engine, i)))
        if len(tasks) == count:
            all_started.set()

    for i in range(count):
        loop.call_later(i * every, launch, i)
    await all_started.wait()
    await asyncio.gather(*tasks)
    return len(tasks)


async def deadlock_load(engine: AsyncLLMEngine, seconds: float) -> tuple[LoopWatchdog, list[int]]:
    """Adds of n copies arriving at their own pace (so some land while the output thread is busy), prompt
    logprobs keeping the output thread busy, and streams that stop strings end (aborts from that thread)."""
    with LoopWatchdog(asyncio.get_running_loop(), engine) as dog:
        until = time.monotonic() + seconds
        workers = [arrivals(many_copies, engine, COPIES_EVERY_S, seconds)]
        workers += [repeat(prompt_logprobs, engine, until) for _ in range(6)]
        workers += [repeat(stopped_stream, engine, until) for _ in range(16)]
        done = await asyncio.wait_for(asyncio.gather(*workers, return_exceptions=True), LOAD_DEADLINE_S)
    return dog, done


def test_large_messages_both_ways_and_stop_aborts_never_freeze_the_loop(engine):
    dog, done = asyncio.run(deadlock_load(engine, LOAD_S))
    assert dog.miss is None, f"the event loop did not answer in {LOOP_DEADLINE_S} s: it {dog.miss}"
    assert all(isinstance(n, int) and n >= 1 for n in done), done  # every kind completed, again and again
    assert max(dog.seconds) < LOOP_DEADLINE_S
    assert engine.is_alive and engine.num_in_flight == 0
