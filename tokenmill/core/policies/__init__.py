"""Scheduling policies: who is admitted first, how a step's tokens are split, who is preempted.

The scheduler (core/scheduler.py) keeps the mechanics (blocks, chunks, the token budget, preemption by
recompute); a policy answers its questions (base.SchedulingPolicy). `--scheduling-policy NAME` picks one from
POLICIES. No torch.
"""
from __future__ import annotations

from tokenmill.core.policies.base import POLICIES, SchedulingPolicy, make_policy
from tokenmill.core.policies import fcfs, slo  # noqa: F401  (they register themselves)

__all__ = ["POLICIES", "SchedulingPolicy", "make_policy"]
