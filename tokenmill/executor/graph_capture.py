"""The model runner's CUDA graphs stage: whether this model's decode steps can replay from graphs, and capturing
them once the KV pool is allocated (the graphs themselves: cuda_graphs.py). Mixed into ModelRunner."""
from __future__ import annotations

import logging
import time

import torch

from tokenmill.executor.attention_timing import TIME_ATTENTION_ENV
from tokenmill.executor.cuda_graphs import DecodeGraphs, capture_sizes
from tokenmill.executor.kv_groups import KVGroup
from tokenmill.layers.attention import AttentionTimer
from tokenmill.layers.attention_backends.base import AttentionBackend

# The runner's log: its start-up lines keep one name whichever stage writes them.
log = logging.getLogger("tokenmill.executor.model_runner")


class GraphCapture:
    """Mixed into ModelRunner; reads the runner's model, backend, KV groups and pool size."""

    model: torch.nn.Module
    device: torch.device
    backend: AttentionBackend
    kv_groups: list[KVGroup]
    num_blocks: int
    lora: object | None
    token_split: object | None
    attn_timer: AttentionTimer | None
    graph_mode: str | None
    graphs: DecodeGraphs | None

    def graph_blockers(self) -> str | None:
        """Why this model's decode steps cannot replay from CUDA graphs (None: they can). Each reason is state a
        replay would not see change: per-step host work inside the forward, or Python attributes set by it."""
        from tokenmill.layers.moe import FusedMoE

        if self.backend.graph_buffers(1, 1, 0) is None:
            return f"attention backend {self.backend.name} has no fixed-address metadata"
        reasons = [
            (self.lora is not None, "LoRA adapters (slots chosen per step on the host)"),
            (self.token_split is not None, "context parallelism"),
            # getattr: DecoderForCausalLM sets pp_size, WeightStore / HostOffload weight_store; other models not
            (self.model.pp_size > 1, "pipeline parallelism"),
            (self.model.weight_store is not None, "streamed or host-offloaded weights"),
            (self.attn_timer is not None and self.attn_timer.sync,
             f"attention timing ({TIME_ATTENTION_ENV}=1: it synchronises the device per layer)"),
            (any(isinstance(m, FusedMoE) and not m.graph_safe() for m in self.model.modules()),
             "MoE layers whose routing copies counts to the host"),
        ]
        return next((why for bad, why in reasons if bad), None)

    def capture_graphs(self, max_num_seqs: int, max_blocks: int, query_lens: tuple[int, ...] = (1,)) -> None:
        """Capture the graphs (worker, after allocate_kv_cache; the pad block is the one past the pool): decodes,
        and with speculative decoding chain verifications (query_lens 1 and k + 1) where the backend takes them."""
        def buffers(q: int) -> list:
            return [self.backend.graph_buffers(max_num_seqs, max_blocks, self.num_blocks, q) for _ in self.kv_groups]

        per_group = buffers(max(query_lens))
        if any(b is None for b in per_group):  # more tokens per request than the backend's graphs take
            query_lens, per_group = (1,), buffers(1)
        graphs = DecodeGraphs(self.model, per_group, capture_sizes(max_num_seqs), self.device, self.graph_mode,
                              query_lens)
        t0 = time.perf_counter()
        try:
            graphs.capture()
        except RuntimeError as e:  # a kernel that cannot be captured: say so and stay eager
            log.warning("CUDA graphs off: capturing the decode forward failed (%s); every step runs eagerly", e)
            return
        self.graphs = graphs
        log.info("CUDA graphs: batches of %s requests x %s tokens captured in %.1f s (--enforce-eager turns them off)",
                 ", ".join(map(str, graphs.sizes)), " or ".join(map(str, query_lens)), time.perf_counter() - t0)
