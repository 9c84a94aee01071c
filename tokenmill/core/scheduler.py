"""Token-budget scheduler: each step gives each chosen request a number of new tokens to compute.

There are no prefill and decode phases. Running requests that need one token (decodes) go first,
then running requests in the middle of a prompt, then waiting requests, until the budget
(`max_num_batched_tokens`) or the running cap (`max_num_seqs`) is reached. The budget counts work: a token
each, and a prompt-logprob row each (an LM-head row over the vocabulary), so no step carries more.

Prompts share what the decodes leave (issue 44): each running prompt, and the newcomers together, first get an
equal share; a prompt that does not finish within its share is long, and while `max_long_partial_prefills`
are in progress further long ones wait, so a short request behind long prompts starts at once; then what the
shares left goes to the prompts cut short and the long ones that waited (nothing is left unused). A request
whose prompt a running one is computing (the n sequences of one prompt) waits and reads it from the prefix
cache. Prompts are chunked by their share (and `long_prefill_token_threshold`, when set). When the block pool
runs dry the lowest-priority running request is preempted by recompute: its blocks are freed, its tokens kept,
and it waits at the front.
The waiting queue (waiting_queue.py), admission of waiting requests (admission.py), the speculative-decoding
counters (spec_stats.py), the worker-diff protocol (worker_diffs.py: what the workers hold, the batches that
update them) and advancing requests by a step's result (step_update.py) are their own modules.
No torch here.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

from tokenmill.config import SchedulerConfig
from tokenmill.core.admission import Admission, StepFill
from tokenmill.core.kv_cache import RELEASED, KVCacheManager
from tokenmill.core.outputs import EngineCoreOutput
from tokenmill.core.policies import make_policy
from tokenmill.core.request import Request, RequestStatus
from tokenmill.core.spec_stats import SpecDecodingStats
from tokenmill.core.step_update import StepUpdate
from tokenmill.core.waiting_queue import WaitingQueue
from tokenmill.core.worker_diffs import WorkerDiffs
from tokenmill.testing import faults


@dataclass
class SchedulerOutput:
    scheduled: list[tuple[Request, int]] = field(default_factory=list)  # (request, new tokens), in batch order
    preempted: list[Request] = field(default_factory=list)
    recorded: list[Request] = field(default_factory=list)  # first admissions: their prefix query was counted
    reloaded: list[Request] = field(default_factory=list)  # taken back because a KV load failed: wait again
    spec: dict[str, list[int]] = field(default_factory=dict)  # drafts scheduled for verification, by request id

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)

    def __bool__(self) -> bool:
        return bool(self.scheduled)


class Scheduler(Admission, StepUpdate, WorkerDiffs):
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager, max_model_len: int, structured=None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__()  # the worker-diff state
        # Monotonic seconds, system-wide (request timestamps are compared across processes); tests step a fake one.
        self.clock = clock
        self.config = config
        self.structured = structured  # structured_output.StructuredOutputManager: matchers of constrained requests
        self.kv = kv
        self.max_model_len = max_model_len
        self.policy = make_policy(config)
        self.waiting = WaitingQueue(self.policy.queue_key, clock)
        self.running: list[Request] = []
        self.num_preemptions = 0
        self.num_lookahead_tokens = config.num_lookahead_tokens
        self.prompt_tokens = 0  # prompt tokens computed (cache hits excluded)
        self.generation_tokens = 0
        self.requests: dict[str, Request] = {}  # unfinished, by id
        self.spec_stats = SpecDecodingStats(config.num_lookahead_tokens)
        self.current: Request | None = None  # the request schedule()/update_from_output() is handling (blame)
        # The last step's (tokens, start time), for the policy's step-time model; _continuing: work was left when
        # it ended, so the next schedule() follows it at once and the gap between the two is its time.
        self._last_step: tuple[int, float] | None = None
        self._continuing = False
        self.ended: list[EngineCoreOutput] = []  # requests schedule() ended (shed by the policy): see take_ended

    def take_ended(self) -> list[EngineCoreOutput]:
        """The outputs of requests schedule() ended, for the engine to send (once)."""
        ended, self.ended = self.ended, []
        return ended

    # ---- request lifecycle ---------------------------------------------------------------
    @property
    def capacity_tokens(self) -> int:
        """Tokens one request can hold in the whole pool, its speculative lookahead slots included."""
        # (a windowed group holds a chunk and the lookahead slots reserved past it beyond its window)
        chunk = self.config.max_num_batched_tokens + self.num_lookahead_tokens
        return self.kv.capacity_tokens(chunk) - self.num_lookahead_tokens

    def add_request(self, req: Request) -> None:
        """Queue a request. ValueError if even the whole pool could not hold its prompt (it could never run);
        its max_tokens is cut to what the pool can hold, so it finishes with "length" instead of preempting
        itself forever once it outgrows the pool."""
        if req.lora is not None and self.config.max_loras < 1:  # it would wait for a slot for ever
            raise ValueError(f"LoRA adapter {req.lora.lora_name!r} requested, but this engine runs without adapters "
                             "(start it with --enable-lora).")
        room = self.capacity_tokens - req.num_prompt_tokens
        if room < (0 if req.pooling else 1):  # an embedding request needs its prompt only, no generated token
            raise ValueError(f"the prompt ({req.num_prompt_tokens} tokens) does not fit the KV cache "
                             f"({self.capacity_tokens} tokens for one request).")
        req.max_tokens = min(req.max_tokens, room)
        req.status = RequestStatus.WAITING
        self.requests[req.request_id] = req
        self.waiting.add(req)

    def finish_request(self, req: Request, status: RequestStatus) -> None:
        """Stop a request wherever it is (finish or abort) and free its blocks at once."""
        assert status.finished
        if req.status == RequestStatus.RUNNING:
            self.running.remove(req)
        elif req.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED):
            self.waiting.remove(req)
        if req.block_ids:
            self.kv.free(req)
        self.unsend(req)
        if req.grammar is not None:
            self.structured.free(req)
        if self.kv.connector is not None:
            self.kv.connector.admitted(req.request_id)  # forget a pending handed-over KV read
        self.requests.pop(req.request_id, None)
        req.status = status
        req.finished_time = self.clock()

    def has_unfinished(self) -> bool:
        return bool(self.running) or bool(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    # ---- one step ------------------------------------------------------------------------
    def preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.kv.free(req)
        self.unsend(req)
        req.spec_token_ids, req.spec_parents = [], None
        req.status = RequestStatus.PREEMPTED
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.add(req)

    def recompute_failed_loads(self, out: SchedulerOutput, bad_blocks: set[int]) -> None:
        """Some loaded blocks (kv.loads_failed) hold no valid KV. Requests admitted this step with such a
        block in their cached prefix leave the batch and wait at the front; the lookup at their next
        admission stops before the bad block, so those tokens are recomputed. The blocks such a request was to
        write this step will not be written either: a request whose prefix hit shares one leaves too (with a
        sliding window it may hold no bad block itself, only a block computed after one), until none is left."""
        bad, bs = set(bad_blocks), self.kv.block_size
        while True:
            keep, taken = [], False
            for req, n in out.scheduled:
                first_bad = min((i for table in req.tables for i, b in enumerate(table[: req.num_computed_tokens // bs])
                                 if b in bad), default=None)
                if first_bad is None:
                    keep.append((req, n))
                    continue
                # Blocks from the bad one on were loaded, or named for tokens this step will not compute now; those
                # from its first uncomputed token on (its own, fresh) will hold no KV: a hit sharing one is bad too.
                bad.update(b for table in req.tables for b in table[req.num_computed_tokens // bs:] if b != RELEASED)
                self.kv.unname_from(req, first_bad)
                self._take_back(out, req)
                out.reloaded.append(req)
                taken = True
            out.scheduled = keep
            if not taken:
                return

    def _take_back(self, out: SchedulerOutput, req: Request) -> None:
        """Undo this step's admission of `req`: it waits again, holding nothing, and its prefix lookup (not
        counted yet) runs again at its next admission."""
        self.running.remove(req)
        self.kv.free(req)
        self.unsend(req)
        out.spec.pop(req.request_id, None)
        if req in out.recorded:
            out.recorded.remove(req)
            self.kv.unrecord_query(req.num_prompt_tokens, req.num_cached_tokens)
            req.num_cached_tokens = -1
        req.status = RequestStatus.PREEMPTED if req.num_preemptions else RequestStatus.WAITING
        self.waiting.add(req)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        now = self.clock()
        self._observe_last_step(now)
        scheduled: dict[int, int] = {}  # id(req) -> tokens
        policy = self.policy
        policy.reorder(self.waiting, now)
        plan = policy.plan(self.running, self.waiting, now, self.kv.num_free_blocks, self.kv.block_size)
        for req in plan.shed:  # their outputs wait in self.ended, so an exception below cannot lose them
            self.ended.append(self.fail_request(
                req, "the request can no longer meet its time-to-first-token target under the current load; "
                     "retry later.", 503, "slo_unattainable"))
        for req in plan.preempt:  # room for urgent waiting requests, before anything is scheduled
            self.preempt(req)
            out.preempted.append(req)
        fill = StepFill(self.config.max_num_batched_tokens, plan.deferrable_tokens)
        prompts = fill.partial = sum(1 for r in self.running if r.is_prefill)
        pool_ran_dry = False

        # Decodes first, then running prompts (the policy's order).
        for req in policy.running_order(self.running, now):
            if fill.budget <= 0:
                break
            if req.status != RequestStatus.RUNNING:
                continue  # preempted earlier in this loop
            self.current = req
            faults.maybe_raise("schedule", [req.request_id])
            if req.is_prefill and fill.share is None:
                # What the decodes left is shared: each running prompt, and the newcomers together, first get an
                # equal part; what a part leaves unused goes to the others in _top_up. At least a token and its
                # logprob row, so that every prompt moves while the budget lasts.
                fill.share = max(fill.budget // (prompts + (1 if len(self.waiting) else 0)), 2)
            capped = fill.deferrable is not None and req.is_prefill and policy.deferrable(req)
            start = req.num_computed_tokens
            n = self._chunk(req, start, req.num_uncomputed_tokens, self._allowance(req, fill, req.is_prefill))
            if n <= 0:
                continue  # its prompt waits for a step with room
            spec = self._drafts(req, fill.budget - n) if n == 1 else []
            n += len(spec)
            while not self.kv.allocate_slots(req, n, num_lookahead_tokens=self.num_lookahead_tokens):
                candidates = [r for r in self.running if id(r) not in scheduled]
                victim = max(candidates, key=policy.victim_key)
                self.preempt(victim)
                out.preempted.append(victim)
                pool_ran_dry = True
                if victim is req:
                    break
            else:
                scheduled[id(req)] = n
                out.scheduled.append((req, n))
                if spec:
                    out.spec[req.request_id] = spec
                self._spend(req, start, n, fill, capped)

        # Admit waiting requests, unless this step already had to preempt for blocks. A request whose grammar is
        # still compiling, whose handed-over KV is still being read (KV connector), whose prompt a running request
        # is computing (it reads it from the prefix cache later), or that does not fit the pool now stays in the
        # queue without holding up the ones behind it (a large one only for MAX_ADMISSION_SKIPS steps: then it
        # holds the queue until it fits); so does a long prompt while max_long_partial_prefills are in progress,
        # for shorter ones behind it, until the budget they leave is handed out (_top_up).
        passed: list[Request] = []  # popped and put back below, also when an exception ends this loop
        admitted = len(out.scheduled)
        try:
            if not pool_ran_dry:
                made_room = set(map(id, plan.preempt))
                self._admit(out, fill, passed, made_room)
                self._top_up(out, fill, passed, made_room)
        except BaseException:
            # Requests admitted by this call may read blocks another one admitted with them was to write in
            # this step; that step will not run. Back to the queue, holding nothing.
            self._unadmit(out, out.scheduled[admitted:])
            raise
        finally:
            for req in passed:
                if req.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED):
                    self.waiting.add(req)
        self.current = None
        self._last_step = (out.num_tokens, now) if out.scheduled else None
        return out

    def _observe_last_step(self, now: float) -> None:
        if self._last_step is not None and self._continuing:
            tokens, start = self._last_step
            self.policy.observe_step(tokens, now - start)
        self._last_step = None

    def _unadmit(self, out: SchedulerOutput, admitted: list[tuple[Request, int]]) -> None:
        for req, _ in admitted:
            if req.status == RequestStatus.RUNNING:
                self._take_back(out, req)

    def _allowance(self, req: Request, fill: StepFill, prompt: bool) -> int:
        """The most work `req` may take now: the budget left and, for a prompt, its share and the policy's cap."""
        most = fill.budget
        if prompt and fill.share is not None:
            most = min(most, fill.share)
        if prompt and fill.deferrable is not None and self.policy.deferrable(req):
            most = min(most, fill.deferrable)
        return most

    def _spend(self, req: Request, start: int, n: int, fill: StepFill, capped: bool) -> None:
        work = self.cost(req, start, n)
        fill.budget -= work
        if capped:
            fill.deferrable -= work

    @staticmethod
    def cost(req: Request, start: int, n: int) -> int:
        """The work of computing tokens start .. start + n - 1 of `req` in a step: one per token, and one more
        per prompt-logprob row among them (a row of the LM head over the whole vocabulary, its log-softmax and
        top-k: as dear as a token of a small model). Sampled rows are at most one per token, within it."""
        if req.params.prompt_logprobs is None:
            return n
        return n + max(0, min(start + n, req.num_prompt_tokens - 1) - start)

    def _chunk(self, req: Request, start: int, uncomputed: int, allowance: int, taken: int = 0) -> int:
        """Tokens to compute for a request this step from token `start` on (`uncomputed` left): all it has,
        within `allowance` of work (cost) and, for a prompt, within long_prefill_token_threshold (`taken`: tokens
        it already has in this step). A preempted request's recompute is not capped: in small chunks,
        several recomputing requests on a tight pool can preempt each other before any gets back to
        decoding, for ever (found by the property test)."""
        n = min(uncomputed, allowance)
        rows = self.cost(req, start, n) - n  # prompt-logprob rows among them
        if rows:
            rows_left = req.num_prompt_tokens - 1 - start
            n = min(uncomputed, allowance - rows_left if allowance >= 2 * rows_left else allowance // 2)
            if n == 0 and allowance >= 1 and self.config.max_num_batched_tokens < 2:
                n = 1  # a budget of one cannot hold a token and its row: that step carries both
        cap = self.config.long_prefill_token_threshold
        if cap > 0 and req.num_preemptions == 0:
            return max(min(n, cap - taken), 0)
        return n

    def _drafts(self, req: Request, budget: int) -> list[int]:
        """The drafts worth verifying: within the token budget, max_tokens and max_model_len."""
        if not req.spec_token_ids:
            return []
        room = min(budget, req.max_tokens - req.num_output_tokens - 1, self.max_model_len - req.num_tokens - 1)
        return req.spec_token_ids[: max(room, 0)]

    # ---- the step contract ---------------------------------------------------------------
    # (build_batch, unbuild: worker_diffs.WorkerDiffs; update_from_output: step_update.StepUpdate)
    def fail_request(self, req: Request, message: str, status: int = 500, code: str | None = None) -> EngineCoreOutput:
        """End one request with an error (its caller gets `message`); its blocks are freed."""
        if not req.finished:
            self.finish_request(req, RequestStatus.FINISHED_ABORTED)
        req.stop_reason = message
        return EngineCoreOutput(req.request_id, [], finish_reason="abort", stop_reason=message, error=message,
                                error_status=status, finished_time=req.finished_time, error_code=code)

    def finish_requests(self, request_ids: list[str], status: RequestStatus, stop_reason=None) -> None:
        """Finish requests by id wherever they are (aborts, and stop strings found by the output processor)."""
        for rid in request_ids:
            req = self.requests.get(rid)
            if req is None:
                continue
            if stop_reason is not None:
                req.stop_reason = stop_reason
            self.finish_request(req, status)
