"""AsyncLLMEngine: the server's side of the engine core (which runs in its own process, or a thread).

Callers on an event loop add and abort requests; the processor tokenizes and validates them here and
the core client carries them to the core. Nothing here blocks the event loop on the core: the client only
queues messages (its threads move them, see core_client.py), and a full queue refuses the request with a
503 rather than waiting. One output thread takes the core's step outputs, runs the OutputProcessor
(detokenizing, stop strings, logprobs) one request at a time, so a failure there ends that request alone,
and hands each event loop its `RequestDelta`s with one `call_soon_threadsafe`. The lock it shares with the
event loop is held per request, never across a step (and not while building prompt logprobs). If the core
dies, every open request ends with an error and `is_alive` turns False (the server's /health answers 503):
nothing waits forever. No torch here.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import threading
import time
from collections import defaultdict
from typing import TYPE_CHECKING, AsyncIterator, Protocol

from tokenmill.core.outputs import EngineCoreOutputs, SchedulerStats
from tokenmill.core.request import RequestSLO
from tokenmill.engine.core_client import CoreBusyError, CoreClient, CoreDeadError, ThreadCoreClient, make_core_client
from tokenmill.engine.output import (EngineError, FinishedRequest, OutputProcessor, RequestDelta,  # noqa: F401
                                     RequestState, SequenceDelta)
from tokenmill.engine.processor import ModelFacts, Processor, RequestOptions, child_ids
from tokenmill.lora.request import LoRARequest
from tokenmill.sampling_params import SamplingParams
from tokenmill.structured_output.checker import CheckerUnavailable

if TYPE_CHECKING:
    from tokenmill.engine.stats import StepStats

log = logging.getLogger(__name__)

POLL_S = 0.1  # the output thread's wait for the core, between checks that it is still alive
# Utility calls (diagnostics, kv_events, ...) waiting for the core's answer; more are refused with a 503: each
# holds a future, and a core busy with a long step answers none of them until it ends.
MAX_PENDING_CALLS = 64


class EngineObserver(Protocol):
    """Called from the output thread; must be quick and thread-safe (Prometheus metrics are)."""

    def on_iteration(self, stats: SchedulerStats, step: StepStats | None, inter_token_s: list[float]) -> None: ...

    def on_request_finished(self, record: FinishedRequest) -> None: ...


class AsyncLLMEngine:
    def __init__(self, client, observer: EngineObserver | None = None, tokenizer=None,
                 facts: ModelFacts | None = None) -> None:
        from tokenmill.engine.engine import LLMEngine

        if isinstance(client, LLMEngine):  # an offline engine's core, driven from a thread (tests, tools)
            tokenizer, facts, client = client.tokenizer, client.facts, ThreadCoreClient(client.core)
        self.client: CoreClient = client
        self.observer = observer
        self.facts = facts
        self.processor = Processor(tokenizer, facts)
        self.output = OutputProcessor(tokenizer)
        self._lock = threading.Lock()  # guards self.output between the event loops and the output thread
        self._in_flight: set[str] = set()  # added, final delta not yet delivered
        self._stats = SchedulerStats()
        self._adds_sent = 0
        self._adds_seen = 0
        self._utility: dict[int, concurrent.futures.Future] = {}
        self._call_ids = itertools.count()
        self._draining = False
        self._stopped = False
        self._dead: str | None = None
        self._calls_lock = threading.Lock()  # _utility and _dead, between callers and the output thread
        self._thread: threading.Thread | None = None
        self.num_engine_errors = 0

    @classmethod
    def from_config(cls, config, own_process: bool = True, observer: EngineObserver | None = None) -> AsyncLLMEngine:
        """Start the core (in its own process by default), load the tokenizer here meanwhile."""
        from tokenmill.engine.engine import model_facts
        from tokenmill.model.default import resolve_model_config
        from tokenmill.model.loader import load_tokenizer

        resolve_model_config(config.model)  # Hub ids -> the Hugging Face cache
        t0 = time.monotonic()
        client = make_core_client(config, own_process)
        try:
            tokenizer = load_tokenizer(config.model.model, config.model.tokenizer)
        except BaseException:
            client.shutdown()
            raise
        facts = model_facts(config, client.info, tokenizer, time.monotonic() - t0)
        return cls(client, observer, tokenizer, facts)

    # ---- facts about the model, safe to read from any thread -----------------------------
    @property
    def tokenizer(self):
        return self.processor.tokenizer

    max_model_len = property(lambda self: self.facts.max_model_len)
    vocab_size = property(lambda self: self.facts.vocab_size)

    @property
    def num_waiting(self) -> int:
        """Sequences waiting for their first step, counting adds the core has not reported yet."""
        return self._stats.num_waiting + max(self._adds_sent - self._adds_seen, 0)

    @property
    def num_in_flight(self) -> int:
        return len(self._in_flight)

    @property
    def draining(self) -> bool:
        return self._draining

    @property
    def is_alive(self) -> bool:
        return (self._thread is not None and self._thread.is_alive() and not self._stopped
                and self._dead is None and self.client.is_alive)

    # ---- lifecycle ------------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is None:
            self.client.start()
            self._thread = threading.Thread(target=self._run, name="tokenmill-outputs", daemon=True)
            self._thread.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        """Answer whatever is left with an error, stop the core and the output thread."""
        if self._stopped:
            return
        self._stopped = True
        self._fail_all(EngineError("the server is shutting down; the request was aborted.", 503, "shutting_down"))
        self.client.shutdown(timeout)
        if self._thread is not None:
            self._thread.join(timeout)

    def begin_drain(self) -> None:
        """Refuse new requests from now on (callers check `draining`); in-flight ones carry on."""
        self._draining = True

    async def wait_idle(self, timeout: float) -> bool:
        """Wait until every added request has delivered its final delta; False on timeout."""
        deadline = time.monotonic() + timeout
        while self._in_flight:
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(0.02)
        return True

    def abort_all(self, error: EngineError) -> None:
        self._fail_all(error)

    # ---- requests (call these from an event loop) ----------------------------------------
    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    queue: asyncio.Queue, *, tag: int = 0, priority: int = 0, arrival_time: float | None = None,
                    prompt: str | None = None, lora_request: LoRARequest | None = None,
                    slo: RequestSLO | None = None, cache_salt: str | None = None) -> None:
        """Queue a request; its deltas arrive on `queue`, the last one with finished=True."""
        loop = asyncio.get_running_loop()
        refuse = None
        if self._stopped:
            refuse = EngineError("the server is shutting down.", 503, "shutting_down")
        elif self._dead is not None:
            refuse = EngineError(f"the engine is not running: {self._dead}", 503, "engine_dead")
        elif request_id in self._in_flight:
            refuse = EngineError(f"request_id {request_id!r} is already in use.", 400)
        if refuse is None:
            try:
                options = RequestOptions(priority, arrival_time, lora_request, slo, cache_salt)
                _, ids, params, reqs = self.processor.process(request_id, prompt_token_ids, params, None, options)
            except ValueError as e:
                refuse = EngineError(str(e), 400)
            except CheckerUnavailable as e:  # a grammar nobody checked before (the server always does first)
                refuse = EngineError(f"the grammar cannot be checked right now: {e}", 503, "overloaded")
        if refuse is not None:
            queue.put_nowait(RequestDelta(request_id, tag, [], True, len(prompt_token_ids), error=refuse))
            return
        self._in_flight.add(request_id)
        with self._lock:
            state = self.output.add_request(request_id, prompt, ids, params, reqs[0].arrival_time,
                                            child_ids(request_id, params.n), sink=(queue, loop, tag))
            state.adapter = lora_request.lora_name if lora_request is not None else None
        try:
            self.client.send_requests(reqs)  # queued, never a wait on the core
            self._adds_sent += len(reqs)
        except CoreBusyError as e:  # back-pressure: refused now, the caller retries later (503 + Retry-After)
            log.warning("refusing request %s: %s", request_id, e)
            with self._lock:
                self.output.remove(request_id)
            self._in_flight.discard(request_id)
            queue.put_nowait(RequestDelta(request_id, tag, [], True, len(ids), error=EngineError(
                "the server is busy receiving other large requests; please retry shortly.", 503, "overloaded")))
        except CoreDeadError as e:
            self._on_dead(str(e))

    def check_lora(self, lora: LoRARequest) -> None:
        """Read and check an adapter against the model (blocking: call it off the event loop); ValueError says why.
        Requests with it are then admitted without reading it again."""
        self.processor.check_lora(lora)

    def forget_lora(self, lora: LoRARequest) -> None:
        self.processor.forget_lora(lora)

    def abort(self, request_id: str, error: EngineError | None = None) -> None:
        """Stop a request and free its KV blocks; a no-op once it has finished."""
        with self._lock:
            state = self.output.abort(request_id)
            if state is None:
                return
            try:
                delta = self.output.make_delta(state, state.sink[2], [], error, force_final=True)
            except Exception as e:  # its detokenizer is broken: it ends with that error instead
                self.output.fail(state, e)
                delta = self.output.make_delta(state, state.sink[2], [], error)
            self.output.remove(request_id)
        self._deliver({state.sink[1]: [(state.sink[0], delta)]})
        self._record_finished([state])
        try:
            self.client.send(("abort", (state.child_ids, "abort", None)))
        except CoreDeadError as e:
            self._on_dead(str(e))

    def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 **kw) -> AsyncIterator[RequestDelta]:
        """Deltas of one request until it finishes; leaving early aborts it."""
        return stream_deltas(self, request_id, prompt_token_ids, params, **kw)

    async def call(self, method: str, *args):
        """Run an EngineCore method in the core (diagnostics, reset_prefix_cache) and return its result.
        EngineError 503 engine_dead at once when the core is gone, or as soon as it goes while this waits:
        nothing else would ever answer the call (the output thread has stopped)."""
        call_id = next(self._call_ids)
        fut: concurrent.futures.Future = concurrent.futures.Future()
        with self._calls_lock:  # against _on_dead: a call is either failed by it or refused here
            if self._dead is not None or self._stopped:
                raise EngineError(f"the engine is not running: {self._dead or 'the server is shutting down'}",
                                  503, "engine_dead")
            if len(self._utility) >= MAX_PENDING_CALLS:
                raise EngineError(f"{len(self._utility)} calls are already waiting for the engine core; please "
                                  "retry shortly.", 503, "overloaded")
            self._utility[call_id] = fut
        try:
            self.client.send(("utility", (call_id, method, args)))
        except CoreDeadError as e:
            self._on_dead(str(e))  # fails this call's future too
        return await asyncio.wrap_future(fut)

    # ---- the output thread ----------------------------------------------------------------
    def _run(self) -> None:
        try:
            self._loop()
        except BaseException as e:  # a bug here: without this thread nothing would answer anyone again
            log.exception("the engine's output thread failed")
            self._on_dead(f"the output thread failed: {type(e).__name__}: {e}")
        finally:  # a call made after this thread stopped, with the core gone or shut down, fails at once
            if self._dead is None:
                self._on_dead("the server is shutting down." if self._stopped or self.client.closed
                              else "the engine's output thread stopped.")

    def _loop(self) -> None:
        while not self._stopped:
            try:
                msgs = self.client.get(POLL_S)
            except CoreDeadError as e:
                if not (self._stopped or self.client.closed):  # at shutdown the pipe closes on purpose
                    self._on_dead(str(e))
                return
            for kind, payload in msgs:
                try:
                    self._handle(kind, payload)
                except Exception:  # a bug here must not silence every stream
                    log.exception("output processing failed for a %s message", kind)

    def _handle(self, kind: str, payload) -> None:
        if kind == "outputs":
            self._handle_outputs(payload)
        elif kind == "stats":
            self._stats, self._adds_seen = payload
        elif kind == "utility":
            call_id, ok, result = payload
            with self._calls_lock:
                fut = self._utility.pop(call_id, None)
            if fut is not None:
                fut.set_result(result) if ok else fut.set_exception(EngineError(result, 500, "engine_error"))
        elif kind == "step_failed":
            message, ids = payload
            self.num_engine_errors += 1
            self._fail_children(set(ids), EngineError(message, 400 if "already in use" in message else 500,
                                                      None if "already in use" in message else "engine_error"))
        elif kind == "dead":
            self._on_dead(payload[0])

    def _handle_outputs(self, out: EngineCoreOutputs) -> None:
        t0 = time.perf_counter()
        failed = [o for o in out.outputs if o.error is not None]
        if failed:  # requests the core refused (a grammar that did not compile): 400 to their callers
            out.outputs = [o for o in out.outputs if o.error is None]
            for o in failed:
                self._fail_children({o.request_id}, EngineError(
                    o.error, o.error_status, o.error_code or (None if o.error_status < 500 else "engine_error")))
        batches: dict = defaultdict(list)
        itl: list[float] = []
        done: list[RequestState] = []
        to_core: list[tuple] = []
        with self._lock:
            groups = self.output.group(out.outputs)
        for state, pairs in groups:
            delta = self._process_request(state, pairs, itl, to_core)
            if delta is None:
                continue
            queue, loop, _ = state.sink
            if delta.sequences or delta.finished or delta.prompt_logprobs:
                batches[loop].append((queue, delta))
            if delta.finished:
                done.append(state)
        for msg in to_core:  # stop strings and failures finish sequences in the core (queued, never a wait)
            try:
                self.client.send(msg)
            except CoreDeadError:
                break
        if out.stats is not None:
            self._stats = out.stats
            self._adds_seen = out.num_added
        if out.step is not None:
            out.step.detokenize_s = time.perf_counter() - t0
        self._notify(out, itl)
        self._deliver(batches)
        self._record_finished(done)

    def _process_request(self, state: RequestState, pairs: list, itl: list[float],
                         to_core: list[tuple]) -> RequestDelta | None:
        """One request's outputs of a step, isolated: if anything in it raises, this request alone ends with a
        500 and its sequences are aborted in the core (their KV blocks freed); the step's others go on.
        Returns its delta (None: the event loop aborted it meanwhile)."""
        try:
            rows, cause = self.output.prompt_rows(state, pairs), None  # the slow part, outside the lock
        except Exception as e:
            rows, cause = None, e
        with self._lock:
            if self.output.requests.get(state.request_id) is not state:
                return None
            try:
                if cause is not None:
                    raise cause
                stops = self.output.process_request(state, pairs, rows)
                delta = self.output.make_delta(state, state.sink[2], itl)
                to_core += [("abort", ([child_id], "stop", stop)) for child_id, stop in stops]
            except Exception as e:
                self.output.fail(state, e)
                self.num_engine_errors += 1
                delta = self.output.make_delta(state, state.sink[2], itl)
                to_core.append(("abort", (state.child_ids, "abort", state.error.message)))
            if delta.finished:
                self.output.remove(state.request_id)
        return delta

    def _fail_children(self, child_set: set[str], error: EngineError) -> None:
        with self._lock:
            states = [s for s in self.output.requests.values() if child_set & set(s.child_ids)]
        for s in states:
            self.abort(s.request_id, error)

    def _fail_all(self, error: EngineError) -> None:
        with self._lock:
            ids = list(self.output.requests)
        for rid in ids:
            self.abort(rid, error)

    def _on_dead(self, message: str) -> None:
        with self._calls_lock:
            if self._dead is not None:
                return
            self._dead = message
            calls, self._utility = list(self._utility.values()), {}
        if not (self._stopped or self.client.closed):  # a shutdown (or the program's exit) is no death
            log.error("engine core is gone: %s; failing %d request(s)", message, len(self.output.requests))
        self._fail_all(EngineError(f"the engine is not running: {message}", 500, "engine_dead"))
        for fut in calls:
            if not fut.done():
                fut.set_exception(EngineError(f"the engine is not running: {message}", 503, "engine_dead"))

    def _notify(self, out: EngineCoreOutputs, itl: list[float]) -> None:
        if self.observer is None:
            return
        try:
            self.observer.on_iteration(self._stats, out.step, itl)
        except Exception:
            log.exception("metrics observer failed")

    def _record_finished(self, states: list[RequestState]) -> None:
        if self.observer is None or not states:
            return
        now = time.monotonic()
        for state in states:
            try:
                self.observer.on_request_finished(OutputProcessor.finished_record(state, now))
            except Exception:
                log.exception("metrics observer failed")

    def _deliver(self, batches: dict) -> None:
        for loop, items in batches.items():
            if not items:
                continue
            try:
                loop.call_soon_threadsafe(self._put_all, items)
            except RuntimeError:  # the loop is closed: nobody is listening any more
                for _, delta in items:
                    if delta.finished:
                        self._in_flight.discard(delta.request_id)

    def _put_all(self, items: list) -> None:
        for queue, delta in items:
            queue.put_nowait(delta)
            if delta.finished:
                self._in_flight.discard(delta.request_id)


async def stream_deltas(engine, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                        **kw) -> AsyncIterator[RequestDelta]:
    """`engine.generate` for any engine with add_request/abort (one core, or data-parallel replicas)."""
    queue: asyncio.Queue[RequestDelta] = asyncio.Queue()
    engine.add_request(request_id, prompt_token_ids, params, queue, **kw)
    finished = False
    try:
        while not finished:
            delta = await queue.get()
            finished = delta.finished
            yield delta
    finally:
        if not finished:
            engine.abort(request_id)
