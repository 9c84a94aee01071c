"""The contract between the scheduler and a scheduling policy, and the registry of policies."""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from tokenmill.config import SchedulerConfig
from tokenmill.core.request import Request


@dataclass
class StepPlan:
    """What a policy decides for one step before the scheduler fills it."""

    # Prompt tokens the deferrable requests (policy.deferrable) may compute this step; decodes and the other
    # requests' prompts are bounded by the step budget only. None: no cap.
    deferrable_tokens: int | None = None
    # Running requests to preempt before the step is filled, to make room for urgent waiting ones.
    preempt: tuple[Request, ...] = ()
    # Waiting requests to end now (HTTP 503) because they can no longer meet their SLO.
    shed: tuple[Request, ...] = ()


class SchedulingPolicy:
    """The questions the scheduler asks. The defaults are first come, first served."""

    name: ClassVar[str] = ""

    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config

    def queue_key(self, req: Request, now: float) -> tuple:
        """Admission order: the waiting request with the smallest key is admitted first."""
        return (req.arrival_time,)

    def reorder(self, queue, now: float) -> None:
        """Called at the start of every step: a policy whose queue keys change with time brings the waiting
        queue (waiting_queue.WaitingQueue) back in order here."""

    def victim_key(self, req: Request) -> tuple:
        """When the pool runs dry, the running request with the largest key is preempted first."""
        return self.queue_key(req, 0.0)

    def running_order(self, running: list[Request], now: float) -> list[Request]:
        """The order in which running requests get the step's budget: decodes first, then prompt chunks."""
        return sorted(running, key=lambda r: r.is_prefill)

    def deferrable(self, req: Request) -> bool:
        """Whether StepPlan.deferrable_tokens bounds this request's prompt chunks. A policy that defers queues
        deferrable requests after all others (admission stops at the first one that finds no tokens left)."""
        return False

    def plan(self, running: list[Request], waiting, now: float, num_free_blocks: int, block_size: int) -> StepPlan:
        return StepPlan()

    def observe_step(self, num_tokens: int, seconds: float) -> None:
        """The wall time of a step that computed num_tokens tokens."""

    def describe(self) -> dict:
        """State for /v1/diagnostics."""
        return {"name": self.name}


POLICIES: dict[str, type[SchedulingPolicy]] = {}


def register(cls: type[SchedulingPolicy]) -> type[SchedulingPolicy]:
    POLICIES[cls.name] = cls
    return cls


def make_policy(config: SchedulerConfig) -> SchedulingPolicy:
    try:
        return POLICIES[config.policy](config)
    except KeyError:
        raise ValueError(f"unknown scheduling policy {config.policy!r}; choose from {', '.join(POLICIES)}.") from None


