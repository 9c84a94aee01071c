"""`tokenmill serve --data-parallel-size N`: N engine cores (each its own process, its own KV pool) behind one
OpenAI endpoint. Same interface as AsyncLLMEngine, so the server does not know there are several; each new
request goes to the replica with the fewest requests in flight (ties: round robin), and stays there.
Aborts go to the request's replica. A replica that dies fails its own requests; the others keep serving.
"""
from __future__ import annotations

import asyncio
import itertools
import threading

from tokenmill.engine.async_engine import AsyncLLMEngine, EngineError, stream_deltas


class ReplicaObserver:
    """One replica's view of the shared ServerMetrics: its counters are cumulative per replica, so the
    metrics keep a separate 'last seen' per replica, and gauges are summed over replicas."""

    def __init__(self, metrics, index: int) -> None:
        self.metrics, self.index = metrics, index

    def on_iteration(self, stats, step, inter_token_s) -> None:
        self.metrics.on_iteration(stats, step, inter_token_s, replica=self.index)

    def on_request_finished(self, record) -> None:
        self.metrics.on_request_finished(record)


class DataParallelEngine:
    def __init__(self, engines: list[AsyncLLMEngine]) -> None:
        self.engines = engines
        self.owner: dict[str, int] = {}
        self._rr = itertools.count()
        self._lock = threading.Lock()

    @classmethod
    def from_config(cls, config, size: int, observer=None) -> "DataParallelEngine":
        import copy

        engines = []
        try:
            for i in range(size):
                c = copy.deepcopy(config)
                c.model.seed = config.model.seed + i  # replicas draw different unseeded samples
                engines.append(AsyncLLMEngine.from_config(c, own_process=True,
                                                          observer=ReplicaObserver(observer, i) if observer else None))
        except BaseException:
            for e in engines:
                e.shutdown()
            raise
        return cls(engines)

    # ---- what the server reads -------------------------------------------------------------
    first = property(lambda self: self.engines[0])
    tokenizer = property(lambda self: self.first.tokenizer)
    facts = property(lambda self: self.first.facts)
    max_model_len = property(lambda self: self.first.max_model_len)
    vocab_size = property(lambda self: self.first.vocab_size)
    num_waiting = property(lambda self: sum(e.num_waiting for e in self.live))
    num_in_flight = property(lambda self: sum(e.num_in_flight for e in self.engines))
    draining = property(lambda self: self.first.draining)

    @property
    def live(self) -> list[AsyncLLMEngine]:
        return [e for e in self.engines if e.is_alive]

    @property
    def is_alive(self) -> bool:
        return bool(self.live)

    # ---- lifecycle ---------------------------------------------------------------------------
    def start(self) -> None:
        for e in self.engines:
            e.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        for e in self.engines:
            e.shutdown(timeout)

    def begin_drain(self) -> None:
        for e in self.engines:
            e.begin_drain()

    async def wait_idle(self, timeout: float) -> bool:
        results = await asyncio.gather(*(e.wait_idle(timeout) for e in self.engines))
        return all(results)

    def abort_all(self, error: EngineError) -> None:
        for e in self.engines:
            e.abort_all(error)

    # ---- requests ------------------------------------------------------------------------------
    def pick(self) -> int:
        """The live replica with the fewest requests in flight; ties in round-robin order."""
        live = [i for i, e in enumerate(self.engines) if e.is_alive] or list(range(len(self.engines)))
        turn = next(self._rr)
        return min(live, key=lambda i: (self.engines[i].num_in_flight, (i - turn) % len(self.engines)))

    def add_request(self, request_id: str, prompt_token_ids: list[int], params, queue: asyncio.Queue, **kw) -> None:
        i = self.pick()
        with self._lock:
            if len(self.owner) > 4 * max(self.num_in_flight, 1024):  # forget finished requests now and then
                self.owner = {r: j for r, j in self.owner.items() if r in self.engines[j]._in_flight}
            self.owner[request_id] = i
        self.engines[i].add_request(request_id, prompt_token_ids, params, queue, **kw)

    def check_lora(self, lora) -> None:
        for e in self.engines:
            e.check_lora(lora)

    def forget_lora(self, lora) -> None:
        for e in self.engines:
            e.forget_lora(lora)

    def abort(self, request_id: str, error: EngineError | None = None) -> None:
        with self._lock:
            i = self.owner.pop(request_id, None)
        if i is not None:
            self.engines[i].abort(request_id, error)

    def generate(self, request_id: str, prompt_token_ids: list[int], params, **kw):
        return stream_deltas(self, request_id, prompt_token_ids, params, **kw)

    async def call(self, method: str, *args):
        """Run a core method on every live replica: dicts come back as replica 0's with a `replicas` list of
        all of them; booleans are and-ed."""
        results = await asyncio.gather(*(e.call(method, *args) for e in self.live))
        if not results:
            raise EngineError("no engine replica is running.", 503, "engine_dead")
        if all(isinstance(r, bool) for r in results):
            return all(results)
        if all(isinstance(r, dict) for r in results):
            return {**results[0], "replicas": results}
        return results[0]
