"""The collectives of tensor parallelism and the point-to-point hand-over of pipeline parallelism, timed:
each step reports how long it spent in them (`StepTimings.collective_s`), so /v1/diagnostics can say what
share of a step communication is (for a pipeline stage, waiting for the previous stage counts too)."""
from __future__ import annotations

import time

import torch
import torch.distributed as dist

_spent = 0.0
_group = None  # this rank's tensor-parallel group (None: all ranks; set when pipeline stages split them)
_cp_group = None  # this rank's context-parallel group (None: all ranks; set when tensor parallelism splits them)


def set_group(group) -> None:
    global _group
    _group = group


def set_cp_group(group) -> None:
    global _cp_group
    _cp_group = group


def all_reduce(t: torch.Tensor) -> torch.Tensor:
    global _spent
    t0 = time.perf_counter()
    dist.all_reduce(t, group=_group)
    _spent += time.perf_counter() - t0
    return t


def all_gather_last(y: torch.Tensor, world: int) -> torch.Tensor:
    """Concatenate every rank's y along the last dimension."""
    global _spent
    t0 = time.perf_counter()
    parts = [torch.empty_like(y) for _ in range(world)]
    dist.all_gather(parts, y.contiguous(), group=_group)
    _spent += time.perf_counter() - t0
    return torch.cat(parts, dim=-1)


def all_gather_stack(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Every context-parallel rank's copy of each tensor, stacked on a new first dimension (context parallelism's
    partial attention and its log-sum-exp)."""
    global _spent
    t0 = time.perf_counter()
    world = dist.get_world_size(_cp_group)
    out = []
    for t in tensors:
        parts = [torch.empty_like(t) for _ in range(world)]
        dist.all_gather(parts, t.contiguous(), group=_cp_group)
        out.append(torch.stack(parts))
    _spent += time.perf_counter() - t0
    return out


def all_gather_rows(t: torch.Tensor) -> torch.Tensor:
    """Every context-parallel rank's rows, concatenated along the first dimension in rank order (prefill context
    parallelism: the ranks' shares of the step's tokens, each padded to the same count)."""
    global _spent
    t0 = time.perf_counter()
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size(_cp_group))]
    dist.all_gather(parts, t.contiguous(), group=_cp_group)
    _spent += time.perf_counter() - t0
    return torch.cat(parts)


def send_stage(tensors: list[torch.Tensor], dst: int) -> list:
    """Pipeline parallelism: hand a stage's activations to the next stage (non-blocking: the sender goes on
    with its next micro-batch). Returns the pending sends."""
    return [dist.isend(t.contiguous(), dst) for t in tensors]


def recv_stage(shapes: list[tuple[int, ...]], dtype: torch.dtype, src: int, device: torch.device) -> list[torch.Tensor]:
    """Pipeline parallelism: the previous stage's activations, received into buffers on this stage's device
    (NCCL moves device tensors only)."""
    global _spent
    t0 = time.perf_counter()
    out = [torch.empty(s, dtype=dtype, device=device) for s in shapes]
    for t in out:
        dist.recv(t, src)
    _spent += time.perf_counter() - t0
    return out


def take_time() -> float:
    """Seconds spent in collectives since the last call."""
    global _spent
    spent, _spent = _spent, 0.0
    return spent
