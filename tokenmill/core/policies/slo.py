"""`--scheduling-policy slo`: serve as many requests within their TTFT and TPOT targets as possible.

Requests carry an SLO (core/request.RequestSLO, from their tenant or the request). Those without one are batch
work: they get what the SLO requests leave, and never the other way round.

- Admission by slack: an SLO request must start its prompt by its latest start time (arrival + TTFT target -
  the predicted time of its prompt, step_time.StepTimeModel); the waiting queue is ordered by it (earliest
  first), then requests that can no longer meet their TTFT (they still run before batch work), then batch work
  in (priority, arrival) order. A preempted SLO request that already streams goes first: its TPOT counts.
- Protecting TPOT and TTFT: while SLO requests run, wait or were lately admitted, each step is sized to what
  the tightest of them can afford (step_limit: the time a TPOT mean has saved, a TTFT's remaining slack, a
  quarter of a recent TTFT target, counting only requests admitted within their target: a shed or hopeless
  request leaves no trace): batch prompt chunks get the tokens that fit in that time after the decodes and the
  SLO prompts (step_time.StepTimeModel), and at least MIN_DEFERRABLE_TOKENS so batch work never stops.
- Making room: an SLO request that has used half its TTFT waiting for a seat (max_num_seqs) or for blocks
  preempts running batch requests (latest first) until it fits; when the pool runs dry mid-step the victim is
  batch work first.
- Shedding (`--slo-shed`): a waiting SLO request whose TTFT can no longer be met even if it started now ends
  with 503 + Retry-After, instead of taking time from requests that can still make theirs.
"""
from __future__ import annotations

import math

from tokenmill.core.policies.base import SchedulingPolicy, StepPlan, register
from tokenmill.core.policies.step_time import StepTimeModel
from tokenmill.core.request import Request

MARGIN = 0.9  # steps aim at this fraction of the tightest TPOT target (steps vary; the mean must stay under it)
MIN_DEFERRABLE_TOKENS = 32  # batch prompt tokens every step may compute, whatever the SLO requests need
MAKE_ROOM_AFTER = 0.5  # an SLO request preempts batch work once this fraction of its TTFT is spent waiting
MAX_ROOM_MAKERS = 4  # waiting SLO requests considered for preemptions per step (bounds the step's work)
RESNAPSHOT_S = 1.0  # how often the queue order follows the step-time model's latest fit
RECENT_S = 10.0  # SLO requests seen this recently keep steps short (step_limit), for the next one to arrive

FEASIBLE, LATE, BATCH = 0, 1, 2  # admission classes, in order


def is_batch(req: Request) -> bool:
    return req.slo is None or req.slo.empty


@register
class SLOPolicy(SchedulingPolicy):
    name = "slo"

    def __init__(self, config) -> None:
        super().__init__(config)
        self.step_time = StepTimeModel()
        # The fit latest_start uses, refreshed every RESNAPSHOT_S (then the queue is re-sorted): between refreshes
        # a key changes only when its request turns LATE, which reorder() handles at the queue's head.
        self._fit = self.step_time.coefficients()
        self._fit_time: float | None = None
        # TTFT target (s) -> when a request with it was last admitted within it (_remember_ttft): as many entries
        # as distinct targets
        self._recent_ttft: dict[float, float] = {}
        self.num_shed = 0
        self.num_room_preemptions = 0

    # ---- order ---------------------------------------------------------------------------
    def latest_start(self, req: Request) -> float:
        """When its prompt must start for its first token to come within its TTFT target."""
        level, slope = self._fit
        return req.arrival_time + req.slo.ttft_ms / 1000 - (level + slope * req.num_prompt_tokens)

    def reorder(self, queue, now: float) -> None:
        if self._fit_time is None or now - self._fit_time >= RESNAPSHOT_S:
            self._fit, self._fit_time = self.step_time.coefficients(), now
            queue.resort(now)
            return
        # FEASIBLE keys are times: those now in the past are at the head. Requests whose latest start passed
        # turn LATE (a preempted stream and a TPOT-only request, also keyed by a past time, stay).
        expired = []
        for key, req in queue.items():
            if key[0] != FEASIBLE or key[1] >= now:
                break
            if req.first_token_time is None and req.slo is not None and req.slo.ttft_ms is not None:
                expired.append(req)
        for req in expired:
            queue.remove(req)
            queue.add(req)

    def queue_key(self, req: Request, now: float) -> tuple:
        if is_batch(req):
            return (BATCH, req.priority, req.arrival_time)
        if req.first_token_time is not None:  # preempted while streaming: back to decoding first
            return (FEASIBLE, req.first_token_time)
        if req.slo.ttft_ms is None:
            return (FEASIBLE, req.arrival_time)
        start = self.latest_start(req)
        return (FEASIBLE, start) if start >= now else (LATE, req.arrival_time)

    def victim_key(self, req: Request) -> tuple:
        return (is_batch(req), req.priority, req.arrival_time)

    def running_order(self, running: list[Request], now: float) -> list[Request]:
        return sorted(running, key=lambda r: (r.is_prefill, r.is_prefill and is_batch(r)))

    def deferrable(self, req: Request) -> bool:
        return is_batch(req)

    # ---- the step ------------------------------------------------------------------------
    def plan(self, running: list[Request], waiting, now: float, num_free_blocks: int, block_size: int) -> StepPlan:
        slo_waiting = []
        for key, r in waiting.items():  # in order: the SLO requests, then batch work
            if key[0] == BATCH:
                break
            slo_waiting.append(r)
        slo_running = [r for r in running if not is_batch(r)]
        self._remember_ttft(slo_running)
        shed = self._shed(slo_waiting, now) if self.config.slo_shed and slo_waiting else []
        if shed:
            slo_waiting = [r for r in slo_waiting if r not in shed]
        limit = self.step_limit(slo_running, slo_waiting, now)
        if limit is None:
            return StepPlan(shed=tuple(shed))  # no SLO work now or lately: the whole budget, as fcfs
        return StepPlan(self._deferrable_tokens(running, slo_running, slo_waiting, limit),
                        tuple(self._make_room(running, slo_waiting, now, num_free_blocks, block_size)), tuple(shed))

    def _remember_ttft(self, slo_running: list[Request]) -> None:
        """The TTFT targets of requests admitted while their target could still be met, by when they were
        admitted (step_limit keeps steps short for RECENT_S after). Only those: a request that waits, is shed or
        asked for a target no step can meet says nothing about the next one, and must not cost all batch work
        its step size for RECENT_S (one `ttft_ms: 0.001` request used to hold it at MIN_DEFERRABLE_TOKENS)."""
        for r in slo_running:
            ttft, admitted = r.slo.ttft_ms, r.first_scheduled_time
            if ttft is None or admitted is None or admitted > r.arrival_time + ttft / 1000:
                continue
            target = ttft / 1000
            if self._recent_ttft.get(target, -math.inf) < admitted:
                self._recent_ttft[target] = admitted

    def _shed(self, slo_waiting: list[Request], now: float) -> list[Request]:
        shed = [r for r in slo_waiting if r.slo.ttft_ms is not None and r.first_scheduled_time is None
                and self.latest_start(r) < now]
        self.num_shed += len(shed)
        return shed

    def step_limit(self, slo_running: list[Request], slo_waiting: list[Request], now: float) -> float | None:
        """The longest this step may take (seconds) without costing an SLO request its targets; None: no limit.

        - A decoding request with a TPOT target must have its next token by first_token_time + tpot * n (n: its
          tokens so far, MARGIN of the target): its TPOT is a mean, so the time short steps saved pays for a
          longer one now and then (big prompt chunks, which run efficiently), but never more.
        - A running request still in its prompt must see its first token by its TTFT; one waiting must start by
          its latest start time.
        - While SLO requests arrive (one admitted within its target in the last RECENT_S), a step takes at most
          a quarter of the tightest recent TTFT, so one arriving now does not wait out a long batch step.
        Requests that can no longer make a target do not limit the step (nothing can save them).
        """
        limits = []
        for r in slo_running:
            tpot, ttft = r.slo.tpot_ms, r.slo.ttft_ms
            if r.first_token_time is not None:
                if tpot is not None:
                    limits.append(r.first_token_time + MARGIN * tpot / 1000 * r.num_output_tokens - now)
            elif ttft is not None:
                limits.append(r.arrival_time + ttft / 1000 - now)
            elif tpot is not None:
                limits.append(MARGIN * tpot / 1000)
        for r in slo_waiting:
            if r.slo.ttft_ms is not None:
                limits.append(self.latest_start(r) - now)
            else:
                limits.append(MARGIN * r.slo.tpot_ms / 1000)
        for target in [t for t, seen in self._recent_ttft.items() if seen < now - RECENT_S]:
            del self._recent_ttft[target]
        if self._recent_ttft:
            limits.append(min(self._recent_ttft) / 4)
        limits = [x for x in limits if x > 0]
        if not limits:
            return None if not slo_running and not slo_waiting else 0.0
        return min(limits)

    def _deferrable_tokens(self, running: list[Request], slo_running: list[Request], slo_waiting: list[Request],
                           limit: float) -> int:
        """Batch prompt tokens that fit in the step limit after the decodes and the SLO prompts."""
        budget = self.config.max_num_batched_tokens
        decodes = sum(1 + len(r.spec_token_ids) for r in running if not r.is_prefill)
        slo_prompts = sum(r.num_uncomputed_tokens for r in slo_running if r.is_prefill)
        slo_prompts += sum(r.num_tokens - r.num_computed_tokens for r in slo_waiting)
        room = self.step_time.tokens_within(limit) - decodes - min(slo_prompts, budget)
        return max(room, MIN_DEFERRABLE_TOKENS)

    def _make_room(self, running: list[Request], slo_waiting: list[Request], now: float, num_free_blocks: int,
                   block_size: int) -> list[Request]:
        """Batch requests to preempt so the SLO requests that have waited long enough can be admitted."""
        seats = self.config.max_num_seqs - len(running)
        free = num_free_blocks
        victims = sorted((r for r in running if is_batch(r)), key=self.victim_key, reverse=True)
        chosen: list[Request] = []
        urgent = [r for r in slo_waiting if r.slo.ttft_ms is not None and r.first_scheduled_time is None
                  and now - r.arrival_time >= MAKE_ROOM_AFTER * r.slo.ttft_ms / 1000 and self.latest_start(r) >= now]
        for req in urgent[:MAX_ROOM_MAKERS]:
            need = math.ceil((req.num_tokens + 1) / block_size)
            picked, s, f = [], seats, free
            while (s < 1 or f < need) and victims:
                v = victims.pop(0)
                picked.append(v)
                s += 1
                f += v.num_held_blocks  # at most: shared blocks stay held
            if s < 1 or f < need:
                break  # not enough batch work to preempt: it waits like everyone else
            chosen += picked
            seats, free = s - 1, f - need
        self.num_room_preemptions += len(chosen)
        return chosen

    def observe_step(self, num_tokens: int, seconds: float) -> None:
        self.step_time.observe(num_tokens, seconds)

    def describe(self) -> dict:
        level, slope = self.step_time.coefficients()
        return {"name": self.name, "step_seconds_fixed": level, "step_seconds_per_token": slope,
                "steps_observed": self.step_time.steps, "shed": self.num_shed,
                "preempted_for_room": self.num_room_preemptions}
