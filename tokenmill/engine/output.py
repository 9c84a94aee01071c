"""OutputProcessor: the one place that turns the core's token ids into what callers see.

It owns each request's detokenizers, logprobs, stop strings, `RequestOutput`s and streaming deltas. The
offline engine, the async engine (server) and the CLI consume only what it returns. Stop strings are
found here, on the caller's side; the request is then finished in the core with an abort that carries
the stop reason (tokens the core made meanwhile are dropped). No torch.

A step's outputs are processed one request at a time, each isolated from the others: an exception while
processing one request (detokenizing, logprobs, stop strings, its delta) ends that request with an
EngineError (500) and leaves every other request of the step untouched (issue 24).
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

import numpy as np

from tokenmill.core.batch import PromptLogprobs, TokenLogprobs
from tokenmill.core.outputs import EngineCoreOutput
from tokenmill.engine.detokenizer import IncrementalDetokenizer
from tokenmill.outputs import (CompletionOutput, EmbeddingOutput, EmbeddingRequestOutput, Logprob, PositionLogprobs,
                               RequestMetrics, RequestOutput)
from tokenmill.sampling_params import PoolingParams, SamplingParams
from tokenmill.testing import faults

log = logging.getLogger(__name__)


class EngineError(Exception):
    """A request failed in the engine; `status` is the HTTP status it maps to."""

    def __init__(self, message: str, status: int = 500, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.code = code

    def openai(self) -> dict:
        """The error in OpenAI's shape, as the server sends it (serve/errors.py), for offline callers."""
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        return {"message": self.message, "type": kind, "param": None, "code": self.code}


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
    embedding: list[float] | None = None  # an embedding request's vector, with its final delta


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
    adapter: str | None = None


@dataclass(eq=False)
class SequenceState:
    index: int
    child_id: str
    detok: IncrementalDetokenizer
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[PositionLogprobs] | None = None
    cumulative_logprob: float = 0.0
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    sent: int = 0  # tokens already streamed
    done: bool = False  # final delta streamed
    last_token_time: float | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(eq=False)
class RequestState:
    """A user request: n sequences sharing one prompt."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    seqs: list[SequenceState]
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    num_cached_tokens: int = 0
    sink: Any = None  # the async engine's delivery target (queue, loop, tag)
    prompt_logprobs_sent: bool = False
    error: EngineError | None = None  # processing its output failed: it ended with this error
    adapter: str | None = None  # the LoRA adapter it ran with, by name (metrics)
    embedding: list[float] | None = None  # an embedding request's vector, once its prompt ran

    @property
    def finished(self) -> bool:
        return all(s.finished for s in self.seqs)

    @property
    def child_ids(self) -> list[str]:
        return [s.child_id for s in self.seqs]


# One request's outputs of a step, each with the sequence it belongs to.
Pairs = list[tuple[SequenceState, EngineCoreOutput]]


class OutputProcessor:
    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.requests: dict[str, RequestState] = {}
        self._children: dict[str, tuple[RequestState, SequenceState]] = {}
        self.decode_token = lru_cache(maxsize=1 << 16)(lambda t: tokenizer.decode([t]))

    def add_request(self, request_id: str, prompt: str | None, prompt_token_ids: list[int], params: SamplingParams,
                    arrival_time: float, child_ids: list[str], sink: Any = None) -> RequestState:
        seqs = [SequenceState(i, cid, IncrementalDetokenizer(self.tokenizer, prompt_token_ids, params),
                              logprobs=[] if params.logprobs is not None else None)
                for i, cid in enumerate(child_ids)]
        state = RequestState(request_id, prompt, prompt_token_ids, params, arrival_time, seqs,
                             [None] if params.prompt_logprobs is not None else None, sink=sink)
        self.requests[request_id] = state
        for s in seqs:
            self._children[s.child_id] = (state, s)
        return state

    def failed(self, child_id: str) -> bool:
        """Whether the request of this sequence failed in output processing (`state.error`)."""
        entry = self._children.get(child_id)
        return entry is not None and entry[0].error is not None

    def remove(self, request_id: str) -> RequestState | None:
        state = self.requests.pop(request_id, None)
        if state is not None:
            for cid in state.child_ids:
                self._children.pop(cid, None)
        return state

    def abort(self, request_id: str) -> RequestState | None:
        """Finish every unfinished sequence with "abort"; returns the state (still registered)."""
        state = self.requests.get(request_id)
        if state is not None:
            now = time.monotonic()
            for s in state.seqs:
                if not s.finished:
                    s.finish_reason, s.finished_time = "abort", now
        return state

    # ---- one step's outputs --------------------------------------------------------------
    def process_outputs(self, outputs: list[EngineCoreOutput]) -> tuple[list[RequestState], list[tuple[str, str]]]:
        """Apply the core's outputs. Returns the requests that changed (in order) and the sequences to finish in
        the core, as (child id, reason): those a stop string finished, and those of a request whose output
        failed to process (then finished here with "abort" and `state.error` set; the reason is the error), so
        that every caller frees their KV blocks the same way."""
        touched: list[RequestState] = []
        stops: list[tuple[str, str]] = []
        for state, pairs in self.group(outputs):
            touched.append(state)
            try:
                stops += self.process_request(state, pairs)
            except Exception as e:
                error = self.fail(state, e)
                stops += [(cid, error.message) for cid in state.child_ids]
        return touched, stops

    def group(self, outputs: list[EngineCoreOutput]) -> list[tuple[RequestState, Pairs]]:
        """A step's outputs by request, in order of first appearance. Outputs of requests no longer here
        (aborted) and of sequences a stop string finished (the core had not heard yet) are dropped."""
        groups: dict[str, tuple[RequestState, list]] = {}
        for o in outputs:
            entry = self._children.get(o.request_id)
            if entry is None or entry[1].finished:
                continue
            state, seq = entry
            groups.setdefault(state.request_id, (state, []))[1].append((seq, o))
        return list(groups.values())

    def prompt_rows(self, state: RequestState, pairs: Pairs) -> dict[int, list]:
        """The prompt logprobs among one request's outputs as entries, by id(output). They read no request
        state, so the async engine builds them outside its lock: this is the slow part of a long echo."""
        if state.prompt_logprobs is None:
            return {}
        return {id(o): self.prompt_logprob_entries(o.prompt_logprobs) for seq, o in pairs
                if o.prompt_logprobs is not None and seq.index == 0}

    def process_request(self, state: RequestState, pairs: Pairs,
                        rows: dict[int, list] | None = None) -> list[tuple[str, str]]:
        """Apply one request's outputs of a step (from `group`); `rows`: its `prompt_rows`, if already built.
        Returns the (child id, stop string) of sequences a stop string finished. Raises whatever goes wrong:
        the caller then fails this request alone (`fail`)."""
        faults.maybe_raise("output", (state.request_id,))
        stops = []
        for seq, o in pairs:
            if seq.finished:
                continue
            if seq.index == 0:
                state.num_cached_tokens = o.num_cached_tokens
            seq.first_scheduled_time = o.first_scheduled_time
            seq.first_token_time = o.first_token_time
            if o.prompt_logprobs is not None and seq.index == 0 and state.prompt_logprobs is not None:
                entries = rows.get(id(o)) if rows is not None else None
                self._record_prompt_logprobs(state, o.prompt_logprobs, entries)
            if o.pooled is not None:
                state.embedding = embedding_of(o.pooled, state.params.pooling)
            stop = self._append(state, seq, o)
            if stop is not None:
                seq.finish_reason, seq.stop_reason, seq.finished_time = "stop", stop, time.monotonic()
                stops.append((seq.child_id, stop))
            elif o.finished:
                seq.finish_reason, seq.stop_reason, seq.finished_time = o.finish_reason, o.stop_reason, o.finished_time
        return stops

    def fail(self, state: RequestState, cause: BaseException) -> EngineError:
        """End a request whose output could not be processed: every unfinished sequence finishes with "abort"
        and the error is kept for its final delta (or output). The caller aborts all its children in the
        core (finishing one there twice is harmless)."""
        log.error("processing the output of request %s failed; ending it", state.request_id,
                  exc_info=(type(cause), cause, cause.__traceback__))
        error = EngineError(f"the request failed while its output was processed: {type(cause).__name__}: {cause}",
                            500, "engine_error")
        state.error = error
        now = time.monotonic()
        for s in state.seqs:
            if not s.finished:
                s.finish_reason, s.stop_reason, s.finished_time = "abort", error.message, now
        return error

    def _append(self, state: RequestState, seq: SequenceState, o: EngineCoreOutput) -> str | None:
        p = state.params
        last = len(o.new_token_ids) - 1
        for i, tok in enumerate(o.new_token_ids):
            seq.token_ids.append(tok)
            if seq.logprobs is not None and o.new_logprobs is not None:
                self._record_logprobs(seq, tok, o.new_logprobs[i], p.logprobs)
            if i == last and o.finish_reason == "stop" and not o.grammar_done:
                return None  # EOS or a stop token: not part of the text
            # As in vLLM, stop strings count only once min_tokens tokens have been generated.
            stop = seq.detok.update([tok], check_stop=len(seq.token_ids) > p.min_tokens)
            if stop is not None:
                return stop
        return None

    def _record_logprobs(self, seq: SequenceState, tok: int, lp: TokenLogprobs, k: int) -> None:
        logprob, rank, top_ids, top_lps = lp
        entry = {tok: Logprob(logprob, rank, self.decode_token(tok))}
        for j, (tid, tlp) in enumerate(zip(top_ids[:k], top_lps[:k])):
            if tid not in entry:
                entry[tid] = Logprob(tlp, j + 1, self.decode_token(tid))
        seq.logprobs.append(entry)
        seq.cumulative_logprob += logprob

    def prompt_logprob_entries(self, p: PromptLogprobs) -> list[PositionLogprobs]:
        entries = []
        for r, tok in enumerate(p.token_ids):
            entry = {tok: Logprob(p.logprobs[r], p.ranks[r], self.decode_token(tok))}
            for j, (tid, tlp) in enumerate(zip(p.top_ids[r], p.top_logprobs[r])):
                if tid not in entry:
                    entry[tid] = Logprob(tlp, j + 1, self.decode_token(tid))
            entries.append(entry)
        return entries

    def _record_prompt_logprobs(self, state: RequestState, p: PromptLogprobs,
                                entries: list[PositionLogprobs] | None = None) -> None:
        if entries is None:
            entries = self.prompt_logprob_entries(p)
        done = len(state.prompt_logprobs)  # entries recorded so far (position 0 has none)
        skip = max(0, done - (p.first_pos + 1))  # recomputed after a preemption
        state.prompt_logprobs.extend(entries[skip:])

    # ---- what callers see ----------------------------------------------------------------
    def make_output(self, state: RequestState) -> RequestOutput | EmbeddingRequestOutput:
        if state.params.pooling is not None:
            return self._embedding_output(state)
        outs = [
            CompletionOutput(
                index=s.index,
                text=s.detok.output_text,
                token_ids=list(s.token_ids),
                cumulative_logprob=s.cumulative_logprob if s.logprobs is not None else None,
                logprobs=s.logprobs,
                finish_reason=s.finish_reason,
                stop_reason=s.stop_reason,
            )
            for s in state.seqs
        ]
        first = state.seqs[0]
        return RequestOutput(
            request_id=state.request_id,
            prompt=state.prompt,
            prompt_token_ids=state.prompt_token_ids,
            prompt_logprobs=state.prompt_logprobs,
            outputs=outs,
            finished=state.finished,
            num_cached_tokens=state.num_cached_tokens,
            metrics=RequestMetrics(state.arrival_time, first.first_scheduled_time, first.first_token_time,
                                   first.finished_time),
            extra={"error": state.error.openai()} if state.error is not None else {},
        )

    @staticmethod
    def _embedding_output(state: RequestState) -> EmbeddingRequestOutput:
        first = state.seqs[0]
        error = state.error
        if error is None and state.embedding is None and first.finished:  # ended in the core without its vector
            error = EngineError(str(first.stop_reason or "the request was aborted"), 500, "engine_error")
        return EmbeddingRequestOutput(
            request_id=state.request_id, prompt=state.prompt, prompt_token_ids=state.prompt_token_ids,
            outputs=EmbeddingOutput(state.embedding if state.embedding is not None else []),
            finished=state.finished, num_cached_tokens=state.num_cached_tokens,
            metrics=RequestMetrics(state.arrival_time, first.first_scheduled_time, first.first_token_time,
                                   first.finished_time),
            extra={"error": error.openai()} if error is not None else {})

    def make_delta(self, state: RequestState, tag: int, itl: list[float], error: EngineError | None = None,
                   force_final: bool = False) -> RequestDelta:
        """What changed since the last delta; with force_final every sequence ends (an abort). A request that
        failed (`state.error`) gets its final delta with that error, and nothing of its detokenizers (they
        may be what failed)."""
        if state.error is not None:
            return self._error_delta(state, tag, error or state.error)
        now = time.monotonic()
        seqs: list[SequenceDelta] = []
        for s in state.seqs:
            if s.done:
                continue
            finished = s.finished or force_final
            start, end = s.sent, len(s.token_ids)
            ids = s.token_ids[start:]
            text = s.detok.get_delta(finished=finished)
            if not ids and not text and not finished:
                continue
            if ids:
                if s.last_token_time is not None:
                    itl.append(now - s.last_token_time)
                s.last_token_time = now
            lps = s.logprobs[start:end] if s.logprobs is not None else None
            reason = s.finish_reason if s.finished else ("abort" if finished else None)
            seqs.append(SequenceDelta(s.index, text, ids, lps, reason, s.stop_reason if finished else None))
            s.sent, s.done = end, finished
        prompt_lps = None
        # Only the first sequence computes them (processor): with n > 1 another may stream before they are whole.
        ready = state.prompt_logprobs is not None and (len(state.prompt_logprobs) >= len(state.prompt_token_ids)
                                                       or all(s.done for s in state.seqs))
        if ready and not state.prompt_logprobs_sent and any(s.sent for s in state.seqs):
            prompt_lps = list(state.prompt_logprobs)
            state.prompt_logprobs_sent = True
        finished = all(s.done for s in state.seqs)
        return RequestDelta(state.request_id, tag, seqs, finished, len(state.prompt_token_ids),
                            state.num_cached_tokens, prompt_lps, error, state.embedding if finished else None)

    @staticmethod
    def _error_delta(state: RequestState, tag: int, error: EngineError) -> RequestDelta:
        seqs = []
        for s in state.seqs:
            if not s.done:
                seqs.append(SequenceDelta(s.index, "", [], None, s.finish_reason or "abort", s.stop_reason))
                s.sent, s.done = len(s.token_ids), True
        return RequestDelta(state.request_id, tag, seqs, True, len(state.prompt_token_ids), state.num_cached_tokens,
                            None, error)

    @staticmethod
    def finished_record(state: RequestState, now: float) -> FinishedRequest:
        first = state.seqs[0]
        ends = [s.finished_time for s in state.seqs if s.finished_time is not None]
        return FinishedRequest(
            num_prompt_tokens=len(state.prompt_token_ids),
            num_generation_tokens=sum(len(s.token_ids) for s in state.seqs),
            finish_reason=first.finish_reason or "abort",
            arrival_time=state.arrival_time,
            first_scheduled_time=first.first_scheduled_time,
            first_token_time=first.first_token_time,
            finished_time=max(ends) if ends else now,
            adapter=state.adapter,
        )


def embedding_of(pooled: list[float], p: PoolingParams) -> list[float]:
    """An embedding request's vector as its caller sees it: the pooled hidden state's first `dimensions` values
    (Matryoshka truncation), then L2-normalised (`normalize`; as torch's F.normalize, eps 1e-12), in float32."""
    v = np.asarray(pooled, dtype=np.float32)
    if p.dimensions is not None:
        v = v[: p.dimensions]
    if p.normalize:
        v = v / np.float32(max(float(np.linalg.norm(v.astype(np.float64))), 1e-12))
    return v.tolist()
