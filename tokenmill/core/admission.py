"""Admission: which waiting requests join a step, within what the running ones left of its budget (the
scheduler's step, scheduler.py). Mixed into Scheduler. No torch here."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tokenmill.core.request import Request, RequestStatus
from tokenmill.testing import faults

if TYPE_CHECKING:
    from tokenmill.config import SchedulerConfig
    from tokenmill.core.kv_cache import KVCacheManager
    from tokenmill.core.scheduler import SchedulerOutput
    from tokenmill.core.waiting_queue import WaitingQueue

# A waiting request that does not fit the pool now is passed over so smaller ones behind it can run, for
# at most this many steps; then nothing behind it is admitted until it fits (running requests finish and
# free their blocks), so a large request is delayed, never starved. Preempted requests are never passed over.
MAX_ADMISSION_SKIPS = 64
# Waiting requests that did not fit, tried per step before admission stops: bounds a step's scheduling work
# when the queue is long and the pool full.
MAX_MISFITS_PER_STEP = 16
# Waiting requests passed over per step without trying the pool (a running prompt computes their prefix, or they
# are long prompts waiting for max_long_partial_prefills): bounds a step's scheduling work behind a long queue.
MAX_PASSED_PER_STEP = 512


@dataclass
class StepFill:
    """How one step's budget is being handed out (Scheduler.schedule)."""

    budget: int  # work left: a token each, and a prompt-logprob row each (Scheduler.cost)
    deferrable: int | None  # work left for the policy's deferrable prompts (StepPlan.deferrable_tokens); None: no cap
    share: int | None = None  # the most one prompt takes before the top-up; None: all that is left
    partial: int = 0  # long prompts in progress: those running at the start, and those admitted in this step
    passed_long: list[Request] = field(default_factory=list)  # long prompts passed over for max_long_partial_prefills
    passed: int = 0  # waiting requests passed over without trying the pool
    misfits: int = 0  # waiting requests the pool could not hold
    adapters: set = field(default_factory=set)  # LoRA adapters that hold the step's slots
    lora_blocked: bool = False  # a request waits for an adapter slot: no later adapter request is admitted
    inflight: set[bytes] | None = None  # hashes of the running prompts' blocks (built when first needed)


class Admission:
    """Mixed into Scheduler; uses its queue, pool, policy and budget helpers (_chunk, _allowance, _spend)."""

    config: SchedulerConfig
    kv: KVCacheManager
    waiting: WaitingQueue
    running: list[Request]
    num_lookahead_tokens: int

    def _admit(self, out: SchedulerOutput, fill: StepFill, passed: list[Request], made_room: set[int]) -> None:
        """Waiting requests in the queue's order. made_room: ids of requests preempted this step to make room for
        others (they wait at least a step)."""
        # LoRA: the adapters of the running requests hold the step's slots (at most max_loras). A request for
        # another adapter waits for one to free up; while it waits, no later adapter request is admitted, so the
        # running adapters drain and it cannot be starved by a stream of requests for the hot ones. Base-model
        # requests need no slot and pass.
        fill.adapters = {r.lora.cache_key for r in self.running if r.lora is not None}
        while (fill.budget > 0 and len(self.waiting) and len(self.running) < self.config.max_num_seqs
               and fill.passed < MAX_PASSED_PER_STEP):
            req = self.waiting.pop()
            passed.append(req)  # until it runs
            if self._try_admit(out, req, fill, passed, made_room, top_up=False):
                break

    def _try_admit(self, out: SchedulerOutput, req: Request, fill: StepFill, passed: list[Request], made_room: set[int],
                   top_up: bool) -> bool:
        """Admit `req` (taken from the queue, in `passed`) if it may run now. Returns True when nobody behind it
        may be admitted in this step."""
        self.current = req
        faults.maybe_raise("schedule", [req.request_id])
        if (req.grammar is not None and req.grammar.matcher is None) or id(req) in made_room:
            return False
        if req.lora is not None and (fill.lora_blocked or (req.lora.cache_key not in fill.adapters
                                                           and len(fill.adapters) >= self.config.max_loras)):
            fill.lora_blocked = True
            return False
        computed, offloaded, remote = [], [], []
        if req.num_computed_tokens == 0:
            computed = self.kv.get_computed_blocks(req)
            offloaded = self.kv.get_offloaded_chain(req, len(computed))
            remote = self.kv.get_remote_chain(req, len(computed) + len(offloaded))
            connector = self.kv.connector
            if remote and not connector.admissible(req.request_id, remote):
                return False  # its KV is being read: waits without holding others up
        # Cached tokens, shared on the device, loaded from a lower tier or from a prefill instance, cost
        # no budget.
        hit = len(computed) + len(offloaded) + len(remote)
        if self._behind_inflight(req, hit, fill):
            fill.passed += 1
            return False
        start = req.num_computed_tokens + hit * self.kv.block_size
        left = req.num_tokens - start
        capped = fill.deferrable is not None and self.policy.deferrable(req)
        n = self._chunk(req, start, left, self._allowance(req, fill, True))
        if n <= 0 and capped:
            return True  # no room left this step for deferred prompts (a policy queues them after the others)
        long = n < left  # its prompt stays in progress after this step
        if n <= 0 or (long and not top_up and fill.partial >= self.config.max_long_partial_prefills):
            if not top_up:
                fill.passed_long.append(req)
                fill.passed += 1
            return False
        if not self.kv.allocate_slots(req, n, computed, offloaded, self.num_lookahead_tokens, remote):
            # A preempted request keeps its place (it ran before, and recomputing it only gets dearer);
            # one that never ran is passed over for a while.
            req.admission_skips += 1
            fill.misfits += 1
            # its turn (admit nobody behind it until it fits), or enough tried for one step
            return bool(req.num_preemptions or req.admission_skips > MAX_ADMISSION_SKIPS
                        or fill.misfits >= MAX_MISFITS_PER_STEP)
        passed.remove(req)  # it holds blocks now: running from here, so no exception below can lose it
        req.status = RequestStatus.RUNNING
        self.running.append(req)
        if req.lora is not None:
            fill.adapters.add(req.lora.cache_key)
        out.scheduled.append((req, n))
        self._spend(req, start, n, fill, capped)
        if long:
            fill.partial += 1
        if fill.inflight is not None:
            self._add_inflight(fill, req)
        req.admission_skips = 0
        if self.kv.connector is not None:
            self.kv.connector.admitted(req.request_id)
        if req.num_cached_tokens < 0:
            req.num_cached_tokens = hit * self.kv.block_size
            self.kv.record_query(req.num_prompt_tokens, req.num_cached_tokens)
            out.recorded.append(req)
        if req.first_scheduled_time is None:
            req.first_scheduled_time = self.clock()
        return False

    def _top_up(self, out: SchedulerOutput, fill: StepFill, passed: list[Request], made_room: set[int]) -> None:
        """Hand out the budget the shares left unused: first to the prompts this step cut short (in batch order),
        then to the long prompts passed over for max_long_partial_prefills. No step leaves budget unused while a
        prompt could take it, and none carries more than the budget."""
        fill.share = None
        for i, (req, n) in enumerate(out.scheduled):
            if fill.budget <= 0:
                return
            left = req.num_uncomputed_tokens - n
            if left <= 0 or req.request_id in out.spec:
                continue
            start = req.num_computed_tokens + n
            capped = fill.deferrable is not None and self.policy.deferrable(req)
            more = self._chunk(req, start, left, self._allowance(req, fill, True), taken=n)
            if more > 0 and self.kv.allocate_slots(req, n + more, num_lookahead_tokens=self.num_lookahead_tokens):
                out.scheduled[i] = (req, n + more)
                self._spend(req, start, more, fill, capped)
        for req in fill.passed_long:
            if fill.budget <= 0 or len(self.running) >= self.config.max_num_seqs:
                return
            if self._try_admit(out, req, fill, passed, made_room, top_up=True):
                return

    def _behind_inflight(self, req: Request, hit: int, fill: StepFill) -> bool:
        """Whether a running prompt computes the next block of req's prompt after its prefix hit in a later step:
        then req waits and reads that block from the prefix cache, instead of computing it again beside the
        other (the n sequences of one prompt; equal prompts). The running one progresses every step, so the wait
        ends; the last block that is not full is each one's own."""
        kv = self.kv
        if not kv.enable_prefix_caching or not req.reads_prefix_cache or req.num_computed_tokens:
            return False
        if hit >= (req.num_tokens - 1) // kv.block_size:
            return False
        if fill.inflight is None:
            fill.inflight = set()
            for r in self.running:
                if r.is_prefill:
                    self._add_inflight(fill, r)
        return req.block_hashes[hit] in fill.inflight

    def _add_inflight(self, fill: StepFill, req: Request) -> None:
        # (a request that reads no hits, prompt logprobs or mean pooling, has hashes only for the blocks it named)
        self.kv.update_hashes(req, req.num_tokens - 1)
        fill.inflight.update(req.block_hashes)
