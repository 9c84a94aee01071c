"""A worker owns one device: it joins torch.distributed, loads its model shard, sizes and allocates its KV
pool, and runs the batches the executor hands it.

This module is the worker's core (start-up in order, steps, shutdown); each start-up stage is a module of its
own: device set-up (device_setup.py), the model and its quantization (model_setup.py), KV pool sizing and
profiling (kv_sizing.py, mixed in), CUDA graph planning (graph_planning.py, mixed in) and the resident-memory
line (memory_report.py); the KV transfer calls are transfer_rpcs.py (mixed in).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from tokenmill.config import EngineConfig
from tokenmill.core.batch import ModelRunnerOutput, ScheduledBatch
from tokenmill.executor.device_setup import init_device
from tokenmill.executor.graph_planning import GraphPlanning
from tokenmill.executor.kv_groups import off_reasons
from tokenmill.executor.kv_sizing import KVSizing, kv_dtype_for, min_blocks  # noqa: F401  (min_blocks re-exported)
from tokenmill.executor.memory_report import log_resident_memory
from tokenmill.executor.model_runner import ModelRunner
from tokenmill.executor.model_setup import load_worker_model
from tokenmill.executor.transfer_rpcs import TransferRPCs

log = logging.getLogger(__name__)


@dataclass
class WorkerInfo:
    """What the core needs to know about the workers (picklable)."""

    num_blocks: int
    block_size: int
    bytes_per_block: int
    max_model_len: int
    vocab_size: int
    device: str
    kv_dtype: str
    compute_dtype: str
    model_cost: Any  # diagnostics.ModelCost
    offload: Any = None  # kv_transfer.OffloadSpec when lower KV tiers are on
    attention_backend: str = ""
    lora_shapes: dict | None = None  # --enable-lora: checkpoint module (q_proj, ...) -> (in, out), to check adapters
    num_layers: int = 0
    # The KV cache groups' attention windows (executor/kv_groups.py; None: full attention), in group order.
    kv_group_windows: tuple[int | None, ...] = (None,)
    weights: dict | None = None  # --weights-resident-gb: model/weight_store.WeightStore.describe()
    hidden_size: int = 0  # the model's final hidden state: an embedding's length


class Worker(KVSizing, GraphPlanning, TransferRPCs):
    """One device's model shard, KV pool and steps; the stages it mixes in share its state."""

    def __init__(self, config: EngineConfig, rank: int = 0, world_size: int = 1,
                 distributed_init_method: str | None = None) -> None:
        self.config = config
        self.rank = rank
        self.world_size = world_size
        self.distributed_init_method = distributed_init_method
        self.cpu_group = None  # torch.distributed group for control messages (None: the default group, gloo)
        self.device = torch.device(config.device)
        self.runner: ModelRunner | None = None
        self._cuda_used_by_others = 0  # bytes of the device held outside this engine, as the KV sizing saw them
        self.kv_group_windows: tuple[int | None, ...] = (None,)  # executor/kv_groups.py, set by init()
        self.cp_size = 1  # decode context parallelism's ranks, set by init()
        self.transfer = None
        self.connector = None  # executor/kv_connector.ConnectorWorker with --kv-transfer-config

    # ---- start-up ------------------------------------------------------------------------
    def init_device(self) -> None:
        self.device, self.cpu_group = init_device(self.config, self.device, self.rank, self.world_size,
                                                  self.distributed_init_method)

    def init(self) -> WorkerInfo:
        """Device, model, KV pool and lower KV tiers; returns what the core needs to know."""
        from tokenmill.layers.attention_backends.registry import get_attention_backend

        self.init_device()
        cache = self.config.cache
        cp = self.cp_size = self.config.parallel.context_parallel_size
        model, self.hf_config, self.max_model_len, quant = load_worker_model(self.config, self.device, self.rank)
        backend_cls = get_attention_backend(self.config.attention_backend, self.device)
        vocab = int(self.hf_config.vocab_size)
        from tokenmill.spec_decode.decoder import build_spec_decoder

        spec = build_spec_decoder(self.config, model, backend_cls, cache.block_size, self.device, vocab,
                                  self.max_model_len)
        if cp > 1:  # this rank's share of every sequence's K/V (layers/attention_backends/context_parallel.py)
            from tokenmill.layers.attention_backends.context_parallel import ContextParallelBackend

            backend = ContextParallelBackend(cache.block_size, self.device, self.rank % cp, cp,
                                             split_tokens=self.config.parallel.prefill_context_parallel_size > 1)
        else:
            backend = backend_cls(cache.block_size, self.device)
        self.runner = ModelRunner(model, vocab, cache.block_size, self.device, backend, spec)
        if cp > 1:
            self.runner.token_split = backend.token_split
        lora = self.config.lora
        if lora is not None:  # before the KV pool is sized: the slots take memory
            from tokenmill.lora.manager import LoRAManager

            self.runner.lora = LoRAManager(model, lora.max_loras, lora.max_lora_rank,
                                           lora.max_cpu_loras or lora.max_loras, self.device)
            log.info("LoRA: %d slot(s) of rank up to %d in %d layers, %.1f MiB", lora.max_loras, lora.max_lora_rank,
                     len(self.runner.lora.targets.layers), self.runner.lora.nbytes / 2**20)
        kv_dtype = kv_dtype_for(cache.kv_cache_dtype, model)
        self.kv_group_windows = self.runner.configure_kv_groups(off_reasons(self.config, spec))
        self.plan_graphs()
        num_blocks = self.determine_num_blocks(kv_dtype)
        self.runner.allocate_kv_cache(num_blocks, kv_dtype)
        if self.runner.graph_mode is not None:
            self.runner.capture_graphs(*self._graph_shapes())
        log.info("KV cache: %d blocks x %d tokens, %.1f MiB (kv_cache_dtype %s: %s); attention backend %s", num_blocks,
                 cache.block_size, num_blocks * self.runner.bytes_per_block / 2**20,
                 cache.kv_cache_dtype, str(kv_dtype).removeprefix("torch."), type(self.runner.backend).describe())
        log_resident_memory(self.config, self.hf_config, model, quant, self.runner.kv_caches(), self.device)
        offload = None
        from tokenmill.executor.kv_transfer import build_transfer

        built = build_transfer(cache, self.runner)
        if built is not None:
            self.transfer, offload = built
        kv_transfer = self.config.kv_transfer
        if kv_transfer is not None:
            from tokenmill.core.kv_connector import store_path
            from tokenmill.executor.kv_connector import ConnectorWorker

            self.connector = ConnectorWorker(self.runner.kv_caches(), store_path(kv_transfer))
        torch.manual_seed(self.config.model.seed)  # after loading, so sampling draws the same in any process
        targets = self.runner.lora.targets if self.runner.lora is not None else None
        store = model.weight_store  # set by WeightStore / HostOffload.attach only
        # The core's pool: every rank's local blocks (context parallelism: global block b is rank b % cp's b // cp).
        return WorkerInfo(num_blocks * cp, cache.block_size, self.runner.bytes_per_block, self.max_model_len, vocab,
                          str(self.device), str(kv_dtype).removeprefix("torch."),
                          str(model.compute_dtype).removeprefix("torch."), self.model_cost(), offload,
                          self.runner.backend.name, targets.shapes if targets else None, targets.num_layers if targets else 0,
                          self.kv_group_windows, store.describe() if store is not None else None,
                          model.spec.hidden_size if model.spec is not None else 0)

    def model_cost(self):
        from tokenmill.diagnostics import ModelCost

        return ModelCost.from_model(self.runner.model, self.hf_config, self.runner.kv_dtype)

    # ---- steps ---------------------------------------------------------------------------
    def execute_model(self, batch: ScheduledBatch) -> ModelRunnerOutput:
        return self.runner.execute_model(batch)

    def ping(self) -> str:
        return "pong"

    def release_memory(self) -> None:
        """Hand the KV pools (a draft's too) and the decode graphs back now, on LLM.close() or an engine's
        shutdown, even while something still references the model (a caller's handle on the runner kept a
        90 % pool alive and the next engine in the process found 0 blocks, docs/gpu.md): each pool's storage
        shrinks to nothing, so the runner cannot step afterwards."""
        if self.runner is None or any(a.k_cache is None for a in self.runner.attn_layers):
            return  # (init failed before the pool was allocated)
        for t in self.runner.kv_caches():
            if t.untyped_storage().resizable():  # (not a pool mapped from a file or shared memory)
                t.untyped_storage().resize_(0)
        self.runner.graphs = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def shutdown(self) -> None:
        if self.runner is not None and self.runner.governor is not None:
            self.runner.governor.close()  # the process gets its threads back (an in-process engine shares them)
        if self.transfer is not None:
            self.transfer.close()
        self.release_memory()
        if self.distributed_init_method is not None:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()
