"""AsyncLLMEngine: LLMEngine.step() in one background thread, results streamed to asyncio queues.

The engine is not thread-safe, so only the engine thread touches it: callers on an event loop post
commands (add, abort) under a lock and the thread applies them between steps. After each step the
thread turns every request's progress into a `RequestDelta` (new text, token ids, logprobs) and hands
the batch to the request's event loop with one `call_soon_threadsafe`. Forward passes run in torch,
which releases the GIL, so the HTTP event loop stays responsive while the model computes.
No torch here.
"""
from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, AsyncIterator, Protocol

from tokenmill.outputs import PositionLogprobs, RequestOutput
from tokenmill.sampling_params import SamplingParams

if TYPE_CHECKING:
    from tokenmill.engine.engine import LLMEngine, RequestGroup, StepStats

log = logging.getLogger(__name__)

# While requests are unfinished but nothing could be scheduled, poll at this interval instead of spinning.
STALL_WAIT_S = 0.005


class EngineError(Exception):
    """A request failed inside the engine thread; `status` is the HTTP status it maps to."""

    def __init__(self, message: str, status: int = 500, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.code = code


@dataclass
class SequenceDelta:
    """What one of a request's n sequences produced since the previous delta."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[PositionLogprobs] | None
    finish_reason: str | None = None  # "stop" | "length" | "abort" once the sequence is done
    stop_reason: int | str | None = None


@dataclass
class RequestDelta:
    request_id: str
    tag: int  # the caller's label, e.g. which prompt of a batch this request serves
    sequences: list[SequenceDelta]
    finished: bool
    num_prompt_tokens: int
    num_cached_tokens: int = 0
    prompt_logprobs: list[PositionLogprobs | None] | None = None  # once, with the first generated token
    error: EngineError | None = None


@dataclass
class FinishedRequest:
    """Timings of a finished request, for metrics (monotonic seconds)."""

    num_prompt_tokens: int
    num_generation_tokens: int
    finish_reason: str
    arrival_time: float
    first_scheduled_time: float | None
    first_token_time: float | None
    finished_time: float


class EngineObserver(Protocol):
    """Called from the engine thread; must be quick and thread-safe (Prometheus metrics are)."""

    def on_iteration(self, engine: LLMEngine, step: StepStats | None, inter_token_s: list[float]) -> None: ...

    def on_request_finished(self, record: FinishedRequest) -> None: ...


# ---- commands posted to the engine thread -----------------------------------------------------
@dataclass
class _Add:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    queue: asyncio.Queue
    loop: asyncio.AbstractEventLoop
    tag: int
    priority: int
    arrival_time: float
    prompt: str | None


@dataclass
class _Abort:
    request_id: str
    error: EngineError | None = None


@dataclass
class _AbortAll:
    error: EngineError


@dataclass
class _Stop:
    error: EngineError


@dataclass(eq=False)
class _Tracked:
    """The engine thread's view of one request it streams."""

    group: RequestGroup
    queue: asyncio.Queue
    loop: asyncio.AbstractEventLoop
    tag: int
    sent: list[int]  # generated tokens already delivered, per sequence
    done: list[bool]  # final delta delivered, per sequence
    last_token_time: list[float | None]
    prompt_logprobs_sent: bool = False


@dataclass
class _Batch:
    """Deltas bound for one event loop, delivered with a single call_soon_threadsafe."""

    items: list[tuple[asyncio.Queue, RequestDelta]] = field(default_factory=list)


class AsyncLLMEngine:
    def __init__(self, engine: LLMEngine, observer: EngineObserver | None = None) -> None:
        self.engine = engine
        self.observer = observer
        self._cond = threading.Condition()
        self._commands: list = []
        self._pending_adds = 0
        self._tracked: dict[str, _Tracked] = {}  # engine thread only
        self._in_flight: set[str] = set()  # event loop side: added, final delta not yet delivered
        self._draining = False
        self._stopped = False
        self._thread: threading.Thread | None = None
        self.num_engine_errors = 0

    # ---- facts about the model, safe to read from any thread -----------------------------
    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def vocab_size(self) -> int:
        return self.engine.vocab_size

    @property
    def num_waiting(self) -> int:
        """Sequences waiting for their first step, counting adds not yet taken by the engine thread.
        May briefly count a request twice; never misses one."""
        return self.engine.scheduler.num_waiting + self._pending_adds

    @property
    def num_in_flight(self) -> int:
        return len(self._in_flight)

    @property
    def draining(self) -> bool:
        return self._draining

    @property
    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stopped

    # ---- lifecycle ------------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="tokenmill-engine", daemon=True)
            self._thread.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        """Abort whatever is left (its callers get an error) and stop the engine thread."""
        if self._thread is None or self._stopped:
            return
        self._post(_Stop(EngineError("the server is shutting down; the request was aborted.", 503, "shutting_down")))
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
        self._post(_AbortAll(error))

    # ---- requests (call these from an event loop) ----------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        queue: asyncio.Queue,
        *,
        tag: int = 0,
        priority: int = 0,
        arrival_time: float | None = None,
        prompt: str | None = None,
    ) -> None:
        """Queue a request; its deltas arrive on `queue`, the last one with finished=True."""
        loop = asyncio.get_running_loop()
        arrival = arrival_time if arrival_time is not None else time.monotonic()
        self._in_flight.add(request_id)
        self._post(_Add(request_id, prompt_token_ids, params, queue, loop, tag, priority, arrival, prompt), add=True)

    def abort(self, request_id: str, error: EngineError | None = None) -> None:
        """Stop a request and free its KV blocks; a no-op once it has finished."""
        if request_id in self._in_flight:
            self._post(_Abort(request_id, error))

    async def generate(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, **kw
    ) -> AsyncIterator[RequestDelta]:
        """Deltas of one request until it finishes; leaving early aborts it."""
        queue: asyncio.Queue[RequestDelta] = asyncio.Queue()
        self.add_request(request_id, prompt_token_ids, params, queue, **kw)
        finished = False
        try:
            while not finished:
                delta = await queue.get()
                finished = delta.finished
                yield delta
        finally:
            if not finished:
                self.abort(request_id)

    def _post(self, command, add: bool = False) -> None:
        with self._cond:
            if self._stopped:
                if isinstance(command, _Add):
                    self._reject_late(command)
                return
            self._commands.append(command)
            if add:
                self._pending_adds += 1
            self._cond.notify()

    def _reject_late(self, cmd: _Add) -> None:
        err = EngineError("the server is shutting down.", 503, "shutting_down")
        delta = RequestDelta(cmd.request_id, cmd.tag, [], True, len(cmd.prompt_token_ids), error=err)
        self._in_flight.discard(cmd.request_id)
        cmd.queue.put_nowait(delta)

    # ---- the engine thread ----------------------------------------------------------------
    def _run(self) -> None:
        engine = self.engine
        stop: _Stop | None = None
        while stop is None:
            with self._cond:
                while not self._commands and not engine.has_unfinished_requests():
                    idle_from = time.perf_counter()
                    self._cond.wait()
                    engine.stats.idle_s += time.perf_counter() - idle_from  # for "where the time goes"
                commands, self._commands = self._commands, []
            batches: dict[asyncio.AbstractEventLoop, _Batch] = defaultdict(_Batch)
            for cmd in commands:
                if stop is not None:
                    if isinstance(cmd, _Add):
                        self._refuse(cmd, stop.error, batches)
                elif isinstance(cmd, _Stop):
                    stop = cmd
                else:
                    self._apply(cmd, batches)
            step = None
            itl: list[float] = []
            if stop is None and engine.has_unfinished_requests():
                try:
                    outputs = engine.step()
                    step = engine.stats.last
                    self._collect(outputs, batches, itl)
                except Exception as e:  # a bug in one step must not take the server down
                    self.num_engine_errors += 1
                    log.exception("engine step failed; aborting %d request(s)", len(self._tracked))
                    self._abort_everything(EngineError(f"internal engine error: {e}", 500, "engine_error"), batches)
            if stop is not None:
                self._abort_everything(stop.error, batches)
            self._notify(step, itl)
            self._deliver(batches)
            if step is not None and step.num_tokens == 0 and not self._commands:
                with self._cond:
                    self._cond.wait(STALL_WAIT_S)
        with self._cond:
            self._stopped = True
            late, self._commands = self._commands, []
        for cmd in late:
            if isinstance(cmd, _Add):
                cmd.loop.call_soon_threadsafe(self._reject_late, cmd)

    def _refuse(self, cmd: _Add, error: EngineError, batches: dict) -> None:
        delta = RequestDelta(cmd.request_id, cmd.tag, [], True, len(cmd.prompt_token_ids), error=error)
        batches[cmd.loop].items.append((cmd.queue, delta))
        with self._cond:
            self._pending_adds -= 1

    def _apply(self, cmd, batches: dict) -> None:
        if isinstance(cmd, _Add):
            try:
                group = self.engine.add_request(
                    cmd.request_id, cmd.prompt, cmd.params, prompt_token_ids=cmd.prompt_token_ids,
                    priority=cmd.priority, arrival_time=cmd.arrival_time,
                )
            except Exception as e:
                self._refuse(cmd, EngineError(str(e), 400 if isinstance(e, ValueError) else 500), batches)
                return
            n = len(group.children)
            self._tracked[cmd.request_id] = _Tracked(group, cmd.queue, cmd.loop, cmd.tag, [0] * n, [False] * n,
                                                     [None] * n)
            with self._cond:
                self._pending_adds -= 1
        elif isinstance(cmd, _Abort):
            self._abort_one(cmd.request_id, cmd.error, batches)
        elif isinstance(cmd, _AbortAll):
            self._abort_everything(cmd.error, batches)

    def _abort_one(self, request_id: str, error: EngineError | None, batches: dict) -> None:
        tracked = self._tracked.get(request_id)
        if tracked is None:
            return
        try:
            out = self.engine.abort_request(request_id)
            self._emit(tracked, out, batches, [], error=error, force_final=True)
        except Exception:  # still tell the caller, or it would wait forever
            log.exception("abort of %s failed", request_id)
            self._tracked.pop(request_id, None)
            failed = RequestDelta(request_id, tracked.tag, [], True, len(tracked.group.prompt_token_ids),
                                  error=error or EngineError("the request failed in the engine.", 500, "engine_error"))
            batches[tracked.loop].items.append((tracked.queue, failed))

    def _abort_everything(self, error: EngineError, batches: dict) -> None:
        for request_id in list(self._tracked):
            self._abort_one(request_id, error, batches)

    def _collect(self, outputs: list[RequestOutput], batches: dict, itl: list[float]) -> None:
        for out in outputs:
            tracked = self._tracked.get(out.request_id)
            if tracked is not None:
                self._emit(tracked, out, batches, itl)

    def _emit(self, t: _Tracked, out: RequestOutput | None, batches: dict, itl: list[float],
              error: EngineError | None = None, force_final: bool = False) -> None:
        group = t.group
        now = time.monotonic()
        seqs: list[SequenceDelta] = []
        for i, (child, detok) in enumerate(zip(group.children, group.detoks)):
            if t.done[i]:
                continue
            finished = child.finished or force_final
            start, end = t.sent[i], child.num_output_tokens
            ids = child.token_ids[child.num_prompt_tokens + start:]
            text = detok.get_delta(finished=finished)
            if not ids and not text and not finished:
                continue
            if ids:
                if t.last_token_time[i] is not None:
                    itl.append(now - t.last_token_time[i])
                t.last_token_time[i] = now
            lps = group.logprobs[i][start:end] if group.logprobs is not None else None
            reason = child.status.value if child.finished else ("abort" if finished else None)
            seqs.append(SequenceDelta(i, text, ids, lps, reason, child.stop_reason if finished else None))
            t.sent[i] = end
            t.done[i] = finished
        finished = all(t.done)
        prompt_lps = None
        if group.prompt_logprobs is not None and not t.prompt_logprobs_sent and any(t.sent):
            prompt_lps = list(group.prompt_logprobs)
            t.prompt_logprobs_sent = True
        first = group.children[0]
        delta = RequestDelta(
            request_id=group.request_id,
            tag=t.tag,
            sequences=seqs,
            finished=finished,
            num_prompt_tokens=len(group.prompt_token_ids),
            num_cached_tokens=max(first.num_cached_tokens, 0),
            prompt_logprobs=prompt_lps,
            error=error,
        )
        batches[t.loop].items.append((t.queue, delta))
        if finished:
            del self._tracked[group.request_id]
            if self.observer is not None:
                self._record_finished(group, now)

    def _record_finished(self, group: RequestGroup, now: float) -> None:
        first = group.children[0]
        ends = [c.finished_time for c in group.children if c.finished_time is not None]
        record = FinishedRequest(
            num_prompt_tokens=len(group.prompt_token_ids),
            num_generation_tokens=sum(c.num_output_tokens for c in group.children),
            finish_reason=first.status.value if first.finished else "abort",
            arrival_time=group.arrival_time,
            first_scheduled_time=first.first_scheduled_time,
            first_token_time=first.first_token_time,
            finished_time=max(ends) if ends else now,
        )
        try:
            self.observer.on_request_finished(record)
        except Exception:
            log.exception("metrics observer failed")

    def _notify(self, step: StepStats | None, itl: list[float]) -> None:
        if self.observer is None:
            return
        try:
            self.observer.on_iteration(self.engine, step, itl)
        except Exception:
            log.exception("metrics observer failed")

    def _deliver(self, batches: dict) -> None:
        for loop, batch in batches.items():
            if not batch.items:
                continue
            try:
                loop.call_soon_threadsafe(self._put_all, batch.items)
            except RuntimeError:  # the loop is closed: nobody is listening any more
                for _, delta in batch.items:
                    if delta.finished:
                        self._in_flight.discard(delta.request_id)

    def _put_all(self, items: list[tuple[asyncio.Queue, RequestDelta]]) -> None:
        for queue, delta in items:
            queue.put_nowait(delta)
            if delta.finished:
                self._in_flight.discard(delta.request_id)
