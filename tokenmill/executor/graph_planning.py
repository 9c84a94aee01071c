"""The worker's CUDA graph planning: whether decode steps replay graphs (decided before the KV pool is sized),
the shapes they are captured for, and what they hold of the device. Mixed into Worker."""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from tokenmill.config import EngineConfig

if TYPE_CHECKING:
    from tokenmill.executor.model_runner import ModelRunner

# The worker's log: its start-up lines keep one name whichever stage writes them.
log = logging.getLogger("tokenmill.executor.worker")


class GraphPlanning:
    """Mixed into Worker; sets its runner's graph_mode."""

    runner: ModelRunner
    config: EngineConfig
    device: torch.device
    max_model_len: int

    def plan_graphs(self) -> None:
        """Whether decode steps will replay CUDA graphs (executor/cuda_graphs.py), decided before the pool is
        sized (the graphs' pad block is one past it); the reason is logged when the device has graphs but this
        configuration cannot use them."""
        from tokenmill.executor.cuda_graphs import graph_mode

        mode = graph_mode(self.device, self.config.enforce_eager)
        why = self.runner.graph_blockers() if mode is not None else None
        if why is None and mode is not None and self.config.parallel.world_size > 1:
            why = "more than one rank (capturing collectives is not yet proven on a GPU)"
        if why is not None:
            log.info("CUDA graphs off: %s; decode steps run eagerly", why)
            mode = None
        self.runner.graph_mode = mode

    def _graph_shapes(self) -> tuple[int, int, tuple[int, ...]]:
        """What the graphs are captured for: up to max_num_seqs requests, block tables as wide as the longest
        request's (drafts' slots included), 1 token per request, and k + 1 with k drafts per step."""
        cache, sched, spec = self.config.cache, self.config.scheduler, self.config.speculative
        max_blocks = -(-(self.max_model_len + sched.num_lookahead_tokens) // cache.block_size)
        k = spec.num_speculative_tokens if spec is not None else 0
        return sched.max_num_seqs, max_blocks, (1, k + 1) if k else (1,)

    def _graph_bytes(self) -> int:
        """What the decode graphs hold for good (their private memory pool, which eager steps cannot reuse, and
        their fixed buffers), measured by capturing them once on the profiling pool and releasing them."""
        before = torch.cuda.memory_reserved(self.device)
        self.runner.capture_graphs(*self._graph_shapes())
        held = torch.cuda.memory_reserved(self.device) - before
        self.runner.graphs = None
        return max(held, 0)
