"""Tensor parallelism's collectives, timed: each step reports how long its all-reduces and all-gathers
took (`StepTimings.collective_s`), so /v1/diagnostics can say what share of a step communication is."""
from __future__ import annotations

import time

import torch
import torch.distributed as dist

_spent = 0.0


def all_reduce(t: torch.Tensor) -> torch.Tensor:
    global _spent
    t0 = time.perf_counter()
    dist.all_reduce(t)
    _spent += time.perf_counter() - t0
    return t


def all_gather_last(y: torch.Tensor, world: int) -> torch.Tensor:
    """Concatenate every rank's y along the last dimension."""
    global _spent
    t0 = time.perf_counter()
    parts = [torch.empty_like(y) for _ in range(world)]
    dist.all_gather(parts, y.contiguous())
    _spent += time.perf_counter() - t0
    return torch.cat(parts, dim=-1)


def take_time() -> float:
    """Seconds spent in collectives since the last call."""
    global _spent
    spent, _spent = _spent, 0.0
    return spent
