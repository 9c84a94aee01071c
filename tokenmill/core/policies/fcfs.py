"""First come, first served; and vLLM's priority policy (lower `priority` first, then arrival)."""
from __future__ import annotations

from tokenmill.core.policies.base import SchedulingPolicy, register
from tokenmill.core.request import Request


@register
class FCFSPolicy(SchedulingPolicy):
    """Arrival order. The latest arrival is preempted first (it has waited least and usually computed least)."""

    name = "fcfs"


@register
class PriorityPolicy(SchedulingPolicy):
    """Each request's `priority` (lower first), then arrival. The least urgent, latest request is preempted."""

    name = "priority"

    def queue_key(self, req: Request, now: float) -> tuple:
        return (req.priority, req.arrival_time)
