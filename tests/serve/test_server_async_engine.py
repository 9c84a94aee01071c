"""AsyncLLMEngine on its own (no HTTP): same output as the offline engine, aborts free blocks at once,
a failing step fails only its requests, shutdown answers everyone, and an idle engine thread sleeps."""
from __future__ import annotations

import asyncio
import time

import pytest
import torch

from tiny import make_tiny_model
from tokenmill import LLM, SamplingParams
from tokenmill.engine.async_engine import AsyncLLMEngine, EngineError

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    path = make_tiny_model(tmp_path_factory.mktemp("async") / "llama", "llama")
    return LLM(str(path), max_model_len=256, num_gpu_blocks_override=64)


@pytest.fixture
def engine(llm):
    e = AsyncLLMEngine(llm.engine)
    e.start()
    yield e
    e.shutdown()
    assert not llm.engine.groups and llm.engine.kv.num_free_blocks == llm.engine.kv.num_blocks


def ids(llm, text: str) -> list[int]:
    return llm.engine.tokenize(text)


async def collect(engine: AsyncLLMEngine, rid: str, prompt: list[int], params: SamplingParams):
    texts, tokens, last = {}, {}, None
    async for d in engine.generate(rid, prompt, params):
        for s in d.sequences:
            texts[s.index] = texts.get(s.index, "") + s.text
            tokens.setdefault(s.index, []).extend(s.token_ids)
        last = d
    return texts, tokens, last


def test_streamed_deltas_equal_offline_generation(llm):
    params = SamplingParams(temperature=0.0, max_tokens=24, n=1, stop=["e"])
    prompts = [ids(llm, t) for t in ("The quick brown fox", "Once upon a time", "SELECT * FROM")]
    # The reference first: only one thread may drive the engine, and once started that is the engine thread.
    offline = llm.generate(prompts, params, use_tqdm=False)
    engine = AsyncLLMEngine(llm.engine)
    engine.start()

    async def main():
        return await asyncio.gather(*(collect(engine, f"r{i}", p, params) for i, p in enumerate(prompts)))

    try:
        results = asyncio.run(main())
    finally:
        engine.shutdown()
    for (texts, tokens, last), ref in zip(results, offline):
        assert texts[0] == ref.outputs[0].text
        assert tokens[0] == ref.outputs[0].token_ids
        assert last.finished and last.sequences[-1].finish_reason == ref.outputs[0].finish_reason


def test_n_sequences_and_seed(llm, engine):
    params = SamplingParams(temperature=1.0, max_tokens=8, n=3, seed=5, ignore_eos=True)
    prompt = ids(llm, "Paged attention")
    a = asyncio.run(collect(engine, "a", prompt, params))
    b = asyncio.run(collect(engine, "b", prompt, params))
    assert sorted(a[1]) == [0, 1, 2] and all(len(t) == 8 for t in a[1].values())
    assert a[1] == b[1]


def test_abort_frees_blocks_at_once(llm, engine):
    kv = llm.engine.kv

    async def main():
        gen = engine.generate("long", ids(llm, "The quick brown fox"), SamplingParams(max_tokens=200, ignore_eos=True))
        await gen.__anext__()
        assert kv.num_free_blocks < kv.num_blocks
        await gen.aclose()  # leaving early aborts
        t0 = time.monotonic()
        while kv.num_free_blocks < kv.num_blocks and time.monotonic() - t0 < 1:
            await asyncio.sleep(0.001)
        return time.monotonic() - t0

    assert asyncio.run(main()) < 0.5
    assert kv.num_free_blocks == kv.num_blocks


def test_failing_step_fails_its_requests_only(llm, engine, monkeypatch):
    real_step = llm.engine.core.step
    calls = {"n": 0}

    def flaky_step(*args):
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("boom")
        return real_step(*args)

    monkeypatch.setattr(llm.engine.core, "step", flaky_step)
    prompt = ids(llm, "Once upon a time")

    async def main():
        _, _, last = await collect(engine, "x", prompt, SamplingParams(max_tokens=20, ignore_eos=True))
        return last

    last = asyncio.run(main())
    assert isinstance(last.error, EngineError) and last.error.status == 500 and "boom" in last.error.message
    monkeypatch.setattr(llm.engine.core, "step", real_step)
    texts, tokens, last = asyncio.run(collect(engine, "y", prompt, SamplingParams(max_tokens=4, ignore_eos=True)))
    assert last.error is None and len(tokens[0]) == 4
    assert engine.is_alive and engine.num_engine_errors == 1


def test_bad_request_in_engine_becomes_error_delta(llm, engine):
    async def main():
        return await collect(engine, "bad", [10**6], SamplingParams())

    _, _, last = asyncio.run(main())
    assert last.finished and last.error.status == 400 and "vocabulary" in last.error.message


def test_shutdown_answers_in_flight_and_later_requests(llm):
    engine = AsyncLLMEngine(llm.engine)
    engine.start()
    prompt = ids(llm, "The quick brown fox")

    async def main():
        queue: asyncio.Queue = asyncio.Queue()
        engine.add_request("s", prompt, SamplingParams(max_tokens=200, ignore_eos=True), queue)
        await queue.get()
        await asyncio.get_running_loop().run_in_executor(None, engine.shutdown)
        while True:
            d = await asyncio.wait_for(queue.get(), 5)
            if d.finished:
                break
        late: asyncio.Queue = asyncio.Queue()
        engine.add_request("late", prompt, SamplingParams(), late)
        return d, await asyncio.wait_for(late.get(), 5)

    final, late = asyncio.run(main())
    assert final.error.status == 503 and late.error.status == 503 and late.finished
    assert not engine.is_alive and engine.num_in_flight == 0
    assert llm.engine.kv.num_free_blocks == llm.engine.kv.num_blocks


def test_idle_engine_thread_sleeps(engine):
    time.sleep(0.05)
    cpu0, wall0 = time.process_time(), time.monotonic()
    time.sleep(0.5)
    assert time.process_time() - cpu0 < 0.05 * (time.monotonic() - wall0) + 0.02
