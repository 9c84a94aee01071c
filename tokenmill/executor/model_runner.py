"""Runs one ScheduledBatch: tensors -> one forward pass over the packed batch -> logits -> sampled tokens.

The runner never sees the scheduler's objects: it keeps its own request states (input_batch.py),
updated from the batch's diffs, and returns a picklable ModelRunnerOutput.

This module is the runner's core (KV pool set-up, forward dispatch, step timings); each further stage of a step
is a module of its own, mixed into ModelRunner: CUDA graphs (graph_capture.py), pipeline micro-batches
(pipeline_stage.py), sampling (step_sampling.py), tree verification with its KV moves (tree_verify.py), prompt
logprobs (prompt_logprobs.py), draft proposal (draft_proposal.py) and the embedding requests' pooled hidden states
(pooling.py).
"""
from __future__ import annotations

import logging
import time

import torch

from tokenmill.core.batch import ModelRunnerOutput, ScheduledBatch, StepTimings
from tokenmill.executor.attention_timing import _attention_timer  # (also re-exported: tests import it from here)
from tokenmill.executor.cuda_graphs import DecodeGraphs
from tokenmill.executor.draft_proposal import DraftProposal
from tokenmill.executor.forward_clock import ForwardClock
from tokenmill.executor.graph_capture import GraphCapture
from tokenmill.executor.input_batch import InputBatch, StepInputs
from tokenmill.executor.kv_groups import KVGroup, OffReasons, describe, plan_kv_groups, share_kv_cache
from tokenmill.executor.pipeline_stage import PipelineStage, micro_batches  # noqa: F401  (micro_batches re-exported)
from tokenmill.executor.pooling import Pooling
from tokenmill.executor.prompt_logprobs import PromptLogprobRows
from tokenmill.executor.step_sampling import StepSampling
from tokenmill.executor.thread_governor import make_governor
from tokenmill.executor.tree_verify import TreeVerification
from tokenmill.layers import collectives
from tokenmill.layers.attention import Attention
from tokenmill.layers.attention_backends import kv_quant
from tokenmill.layers.attention_backends.base import AttentionBackend, GroupedMetadata
from tokenmill.sample.sampler import Sampler

log = logging.getLogger(__name__)


class ModelRunner(GraphCapture, PipelineStage, StepSampling, TreeVerification, PromptLogprobRows,
                  DraftProposal, Pooling):
    """One device's model and KV pool; `execute_model` runs a step. The stages it mixes in share its state."""

    def __init__(self, model: torch.nn.Module, vocab_size: int, block_size: int, device: torch.device,
                 backend: AttentionBackend, spec=None) -> None:
        self.model = model
        self.vocab_size = vocab_size
        self.block_size = block_size
        self.device = device
        self.backend = backend
        self.attn_layers = [m for m in model.modules() if isinstance(m, Attention)]
        # Every layer's window in the whole model (a pipeline stage holds only some of the layers).
        decoder = model.spec  # (every model is a DecoderForCausalLM)
        self.model_windows = ({layer.sliding_window for layer in decoder.layers} if decoder is not None
                              else {a.sliding_window for a in self.attn_layers})
        self.input_batch = InputBatch(block_size, device, vocab_size)
        self.kv_groups = [KVGroup(None, list(self.attn_layers))]  # configure_kv_groups
        self.sampler = Sampler()
        self.spec = spec  # spec_decode.decoder.SpecDecoder: proposes each request's next drafts
        self.lora = None  # lora.manager.LoRAManager with --enable-lora: adapter slots, set per step
        self._path_rows = None  # this step's accepted tree paths moved into chain order (packed rows: src, dst)
        # Prefill context parallelism (layers/attention_backends/context_parallel.py): this rank runs the model on
        # its share of the step's tokens; the final hidden states are gathered back. None: every token here.
        self.token_split = None
        self.num_blocks = 0
        self.kv_dtype: torch.dtype | None = None
        self.attn_timer = _attention_timer(torch.device(device))
        # Each step size's thread count, chosen by timing steps (a busy neighbour core: thread_governor.py).
        self.governor = make_governor(torch.device(device).type, torch.get_num_threads(), model)
        for a in self.attn_layers:
            a.timer = self.attn_timer
        # For the K/V bytes attention reads per step: (sliding window or None, K+V bytes per token summed
        # over the layers with that window), set once the cache dtype is known.
        self._attn_read_groups: list[tuple[int | None, int]] = []
        # CUDA graphs for decode steps (executor/cuda_graphs.py): the mode the worker planned before the pool was
        # allocated ("cuda", "emulate" or None), and the captured graphs once it is.
        self.graph_mode: str | None = None
        self.graphs: DecodeGraphs | None = None

    def block_bytes(self, kv_dtype: torch.dtype) -> int:
        """K and V of one block over all layers (with int8's scales), a speculative draft's layers included."""
        draft = self.spec.block_bytes(kv_dtype) if self.spec is not None else 0
        return draft + sum(kv_quant.layer_block_bytes(a, self.block_size, kv_dtype)
                           for a in self.kv_groups[0].layers)

    @property
    def bytes_per_block(self) -> int:
        return self.block_bytes(self.kv_dtype)

    def configure_kv_groups(self, off: OffReasons) -> tuple[int | None, ...]:
        """Group the attention layers by window (executor/kv_groups.py) before the pool is sized; returns each
        group's window, for the core's block tables."""
        self.kv_groups = plan_kv_groups(self.attn_layers, self.model_windows, off)
        hybrid = len(self.kv_groups) > 1
        for g, group in enumerate(self.kv_groups):
            for a in group.layers:
                a.kv_group = g if hybrid else None
        self.input_batch = InputBatch(self.block_size, self.device, self.vocab_size, len(self.kv_groups))
        log.info("KV cache: %s", describe(self.kv_groups))
        return tuple(group.window for group in self.kv_groups)

    def allocate_kv_cache(self, num_blocks: int, kv_dtype: torch.dtype) -> None:
        # With CUDA graphs, one block more than the scheduler's pool: the pad block of padded decode batches.
        self.backend.allocate_kv_cache(self.kv_groups[0].layers, num_blocks + (self.graph_mode is not None), kv_dtype)
        share_kv_cache(self.kv_groups)
        if self.spec is not None:
            self.spec.allocate_kv_cache(num_blocks, kv_dtype)
        self.num_blocks = num_blocks
        self.kv_dtype = kv_dtype
        groups: dict[int | None, int] = {}
        for a in self.attn_layers:
            per_token = kv_quant.layer_block_bytes(a, 1, kv_dtype)
            groups[a.sliding_window] = groups.get(a.sliding_window, 0) + per_token
        self._attn_read_groups = list(groups.items())

    def attn_read_bytes(self, query_len: torch.Tensor, kv_len: torch.Tensor) -> int:
        """K/V bytes this step's attention must read: per layer, every request's attended cache tokens x
        num_kv_heads x head_dim x 2 (K and V) x itemsize. With a sliding window W a query at position p
        sees keys p-W+1..p, so a request's chunk of n new queries ending at kv_len reads
        min(kv_len, n + W - 1) tokens (min(kv_len, W) when decoding)."""
        total = 0
        for window, per_token in self._attn_read_groups:
            read = kv_len if window is None else torch.minimum(kv_len, query_len + (window - 1))
            total += int(read.sum()) * per_token
        return total

    def kv_caches(self) -> list[torch.Tensor]:
        """Every layer's K and V pool (and int8's scales), each indexed by block on its first dimension; a
        draft's too, so prefix blocks moved between tiers keep the draft's KV."""
        caches = [t for a in self.kv_groups[0].layers for t in kv_quant.layer_caches(a)]
        return caches + self.spec.kv_caches() if self.spec is not None else caches

    def mark_initialized(self, block_ids: torch.Tensor) -> None:
        self.backend.mark_initialized(block_ids)
        if self.spec is not None:
            self.spec.mark_initialized(block_ids)

    # ---- one step ------------------------------------------------------------------------
    @torch.inference_mode()
    def execute_model(self, batch: ScheduledBatch) -> ModelRunnerOutput:
        t0 = time.perf_counter()
        if self.spec is not None:
            for rid in batch.finished_req_ids:
                self.spec.forget(rid)
        self.input_batch.update(batch)
        self._path_rows = None
        if not batch:
            return ModelRunnerOutput()
        if self.model.pp_size > 1:
            return self._execute_stage(batch, t0)
        inp = self.input_batch.prepare(batch)
        if self.lora is not None:
            self.lora.prepare(inp.requests, batch.num_scheduled_tokens)
        graph = self.graphs.key_for(inp) if self.graphs is not None else None  # a uniform batch a graph takes
        meta = self._metadata(inp) if graph is None else None
        timer = self.attn_timer
        if timer is not None:
            timer.total = 0.0
        clock = ForwardClock(self.device)
        governor = self.governor
        if governor is not None:
            governor.begin(inp.input_ids.shape[0])
        clock.start()
        split = self.token_split
        if graph is not None:
            hidden = self.graphs.run(inp, graph)
        elif split is None:
            self.model.begin_step(inp.layout)  # the whole batch on this rank: the layout describes its tokens
            try:
                hidden = self.model(inp.input_ids, inp.positions, meta)
            finally:
                self.model.begin_step(None)
        else:
            T = inp.input_ids.shape[0]
            hidden = split.gather(self.model(split.local(inp.input_ids), split.local(inp.positions), meta), T)
        logits = self.model.compute_logits(hidden[inp.sample_rows]) if inp.sample_rows.numel() else None
        clock.stop()  # (no device sync: CUDA events, read after the results' copy to the host)
        collective_s = collectives.take_time()
        out = self._sample(logits, inp, batch) if logits is not None else ModelRunnerOutput()
        out.pooled = self._pool(hidden, inp)  # embedding requests whose prompt ended (none: nothing done)
        prompt_lps = self._prompt_logprobs(hidden, inp)
        out.prompt_logprobs = prompt_lps
        forward_s = clock.seconds()
        if governor is not None:
            governor.end(forward_s)
        if self.spec is not None:
            self._propose(inp, batch, hidden, out, forward_s)
        layout = inp.layout
        out.timings = StepTimings(
            prepare_s=clock.t0 - t0, forward_s=forward_s,
            sample_s=max(time.perf_counter() - clock.t0 - forward_s, 0.0),  # the step's wall time after its forward
            kv_tokens=inp.kv_tokens,
            attn_pairs=inp.attn_pairs, attn_s=timer.total if timer is not None else 0.0,
            attn_bytes=self.attn_read_bytes(layout.query_len, layout.kv_len), collective_s=collective_s,
            weight_wait_s=self._weight_wait())
        return out

    def _weight_wait(self) -> float:
        store = self.model.weight_store  # set by WeightStore / HostOffload only
        return store.take_wait() if store is not None else 0.0

    def _metadata(self, inp: StepInputs):
        """The backend's metadata for the step: one, or one per KV cache group (each layer picks its group's)."""
        meta = self.backend.build_metadata(inp.layout)
        if not inp.group_layouts:
            return meta
        return GroupedMetadata([meta, *(self.backend.build_metadata(lay) for lay in inp.group_layouts)])
